"""Does staleness hurt learning, and does the importance correction undo it?

    python benchmarks/staleness_learning.py                      # the grid below, CPU, one worker per core
    python benchmarks/staleness_learning.py --ks 0 4 --arms none tis --seeds 4 --steps 40   # a quick look
    python benchmarks/staleness_learning.py --plot-only benchmarks/results/staleness_learning_<hw>.json

Every run is a real Pipeline (transformers engine, LoRA trainer, the built-in task on the tiny
model) with `deterministic = true`, so a seed fixes everything but the arm: the prompts, their
order, the initial adapter and every sampling draw's seed. Runs of one seed are paired across
arms, and the differences between arms are taken seed by seed.

Arms: max_staleness K in --ks x correction in --arms:
  none  loss.correction = "none" (stale samples used as if on-policy)
  tis   truncated importance sampling (the default)
  ppo   decoupled PPO, trainer.minibatches = 4 (the clip acts from the second optimizer step)
  mask  truncated IS with loss.is_mode = "mask" (tokens above the cap dropped, AReaL's filter)
  tis4  truncated IS with trainer.minibatches = 4: ppo's optimizer steps without its clip
In deterministic mode a K-stale run's groups of step t are sampled at version max(0, t - K):
every batch is exactly K versions old, the most the bound allows.

The score of a run is its final evaluation (eval.every = steps: held-out prompts sampled with
the last version, `eval/reward_mean`), so it measures the policy the run ended with, not the
stale policies that sampled its last batches. Reported per arm: mean over seeds with a 95%
t-interval, and for each arm the paired difference to K = 0 with the same correction (and to
"none" at the same K) with its 95% t-interval. Writes staleness_learning_<hardware>.json and a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (the benchmarks' shared helpers sit next to this script)
from common import mean_ci  # noqa: E402

ARMS = {
    "none": {"loss.correction": "none"},
    "tis": {"loss.correction": "tis"},
    "ppo": {"loss.correction": "ppo", "trainer.minibatches": 4},
    "mask": {"loss.correction": "tis", "loss.is_mode": "mask"},
    # ppo's control: as many optimizer steps per batch, no clip (tells the clip from the extra steps)
    "tis4": {"loss.correction": "tis", "trainer.minibatches": 4},
}
def one_run(job: dict) -> dict:
    """One Pipeline run in this worker process (one torch thread: the workers share the cores)."""
    import torch

    torch.set_num_threads(1)
    from pipeline.config.io import load_config
    from pipeline.loop.orchestrator import Pipeline

    with tempfile.TemporaryDirectory(prefix="staleness_learning-") as out:
        t0 = time.monotonic()
        p = Pipeline(load_config(None, {**job["overrides"], "out": out}), console=False)
        summary = p.run_sync()
    return collect(job, p, summary, time.monotonic() - t0)


def collect(job: dict, p: object, summary: dict, seconds: float) -> dict:
    """What a finished run scored: its final and first eval, its training curve and loss statistics."""
    if summary.get("error"):
        raise RuntimeError(f"run {job['name']} failed: {summary['error']}")
    steps, evals = p.metrics_rows, p.eval_rows
    mean = lambda key, empty: sum(r.get(key, empty) for r in steps) / len(steps)
    return {**{k: job[k] for k in ("name", "k", "arm", "seed")}, "seconds": seconds,
            "final_eval": evals[-1]["eval/reward_mean"], "first_eval": evals[0]["eval/reward_mean"],
            "eval_curve": [(r["step"], r["eval/reward_mean"]) for r in evals],
            "train_reward": [r["reward_mean"] for r in steps],
            "staleness_max": max(r["staleness_max"] for r in steps),
            "clipped_frac": mean("train/clipped_frac", 0.0), "truncated_frac": mean("train/truncated_frac", 0.0),
            "ess": mean("train/ess", 1.0), "entropy": mean("train/entropy", float("nan"))}


def jobs(args: argparse.Namespace) -> list[dict]:
    if args.engine == "vllm":  # vLLM cannot be deterministic: seeds fix prompts and initial weights only
        setting = {"engine.kind": "vllm", "engine.devices": ["cuda:0"], "trainer.device": "cuda:0",
                   "model.shape": args.model_shape, "engine.vllm.enforce_eager": True,
                   "engine.vllm.gpu_memory_utilization": 0.5, "engine.vllm.max_model_len": 512}
    else:
        setting = {"deterministic": True, "trainer.separate_process": False, "model.shape": args.model_shape}
    base = {
        **setting, "log.progress": False, "log.level": "warning",
        "pipeline.steps": args.steps, "pipeline.batch_groups": args.batch_groups, "sampling.n": args.n,
        "sampling.max_new_tokens": args.max_new_tokens, "trainer.lr": args.lr, "task.name": args.task,
        "pipeline.checkpoint_every": 0, "pipeline.logprob_check_every": 0, "eval.every": args.eval_every or args.steps,
        "eval.max_prompts": args.eval_prompts, "eval.n": 4, "pipeline.shutdown_timeout_s": 120,
    }
    out = []
    for seed in range(args.seeds):
        for k in args.ks:
            for arm in args.arms:
                overrides = {**base, **ARMS[arm], "seed": seed, "pipeline.max_staleness": k, "task.seed": seed}
                out.append({"name": f"K{k}-{arm}-s{seed}", "k": k, "arm": arm, "seed": seed, "overrides": overrides})
    return out


def analyse(runs: list[dict], ks: list[int], arms: list[str], baselines: tuple[str, ...] = ("none",)) -> dict:
    """Per arm mean +- CI of the final eval reward; paired differences by seed, to K = ks[0] of the
    same arm and to each baseline arm at the same K."""
    score = {(r["k"], r["arm"], r["seed"]): r["final_eval"] for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    table = {}
    for k in ks:
        for arm in arms:
            xs = [score[(k, arm, s)] for s in seeds if (k, arm, s) in score]
            mine = [r for r in runs if r["k"] == k and r["arm"] == arm]
            row = {"final_eval": mean_ci(xs),  # and the loss's weight statistics, means over steps and seeds
                   **{key: sum(r[key] for r in mine) / len(mine) for key in ("ess", "truncated_frac", "clipped_frac")}}
            if k != ks[0]:
                d = [score[(k, arm, s)] - score[(ks[0], arm, s)] for s in seeds
                     if (k, arm, s) in score and (ks[0], arm, s) in score]
                row[f"minus_K{ks[0]}"] = mean_ci(d)
            for base in baselines:
                if arm != base and base in arms:
                    d = [score[(k, arm, s)] - score[(k, base, s)] for s in seeds
                         if (k, arm, s) in score and (k, base, s) in score]
                    row[f"minus_{base}"] = mean_ci(d)
            table[f"K{k}-{arm}"] = row
    return table


def markdown(table: dict, ks: list[int], arms: list[str]) -> str:
    lines = ["| K | " + " | ".join(arms) + " |", "| --- | " + " | ".join("---" for _ in arms) + " |"]
    for k in ks:
        cells = []
        for arm in arms:
            row = table[f"K{k}-{arm}"]
            f = row["final_eval"]
            cell = f"{f['mean']:.3f} ± {f['ci95']:.3f}"
            if f"minus_K{ks[0]}" in row:
                d = row[f"minus_K{ks[0]}"]
                cell += f" (Δ {d['mean']:+.3f} ± {d['ci95']:.3f})"
            cells.append(cell)
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines += ["", "ESS / truncated_frac / clipped_frac (means over steps and seeds):",
              "| K | " + " | ".join(arms) + " |", "| --- | " + " | ".join("---" for _ in arms) + " |"]
    for k in ks:
        rows = [table[f"K{k}-{arm}"] for arm in arms]
        lines.append(f"| {k} | " + " | ".join(f"{r['ess']:.3f} / {r['truncated_frac']:.3f} / {r['clipped_frac']:.3f}"
                                             for r in rows) + " |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    ks, arms, table = result["ks"], result["arms"], result["table"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, arm in enumerate(arms):
        xs = [k + (i - (len(arms) - 1) / 2) * 0.12 for k in ks]
        ms = [table[f"K{k}-{arm}"]["final_eval"]["mean"] for k in ks]
        es = [table[f"K{k}-{arm}"]["final_eval"]["ci95"] for k in ks]
        ax.errorbar(xs, ms, yerr=es, marker="o", capsize=3, label=arm)
    ax.set_xlabel("max_staleness K")
    ax.set_ylabel("final eval reward (95% CI)")
    s = result["settings"]
    ax.set_title(f"{s['task']}, lr {s['lr']}, {s['steps']} steps, {result['seeds']} seeds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def merge(paths: list[Path], out: Path, tag: str, baselines: tuple[str, ...]) -> None:
    """One table from several results of the same settings (seeds pair runs across files)."""
    parts = [json.loads(p.read_text()) for p in paths]
    keys = ("steps", "lr", "task", "batch_groups", "n", "max_new_tokens")
    if len({tuple(part["settings"].get(k) for k in keys) for part in parts}) > 1:
        raise SystemExit(f"the results differ in their settings ({', '.join(keys)}): not one experiment")
    runs = [r for part in parts for r in part["runs"]]
    ks = sorted({r["k"] for r in runs})
    arms = list(dict.fromkeys(a for part in parts for a in part["arms"]))
    complete = [k for k in ks if all(any(r["k"] == k and r["arm"] == a for r in runs) for a in arms)]
    table = analyse(runs, complete, arms, baselines)
    result = {**parts[0], "ks": complete, "arms": arms, "table": table, "runs": runs, "merged_from": [p.name for p in paths]}
    print(markdown(table, complete, arms))
    for name, row in table.items():
        for base in baselines:
            if f"minus_{base}" in row:
                d = row[f"minus_{base}"]
                print(f"{name} minus {base}: {d['mean']:+.3f} ± {d['ci95']:.3f}")
    path = out / f"{paths[0].stem}{tag or '_merged'}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    plot(result, path.with_suffix(".png"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    ap.add_argument("--arms", nargs="+", default=["none", "tis", "ppo", "mask"], choices=list(ARMS))
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=5e-2)
    ap.add_argument("--task", default="char_class")
    ap.add_argument("--batch-groups", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=0, help="0 = only before the first step and after the last")
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="parallel runs (transformers engine)")
    ap.add_argument("--engine", default="transformers", choices=["transformers", "vllm"],
                    help="vllm: one engine on cuda:0 serves every run in turn, the trainer beside it")
    ap.add_argument("--model-shape", default="tiny", choices=["tiny", "small", "qwen2.5-0.5b", "qwen2.5-1.5b"])
    ap.add_argument("--out", default="runs/benchmarks")
    ap.add_argument("--tag", default="", help="appended to the result's file name")
    ap.add_argument("--plot-only", default="", help="a result JSON to plot again")
    ap.add_argument("--baselines", nargs="+", default=["none"], help="with --merge: arms to take paired differences to")
    ap.add_argument("--merge", nargs="+", default=[], metavar="JSON",
                    help="results of one setting (arms run apart, paired by seed) to analyse and plot as one")
    args = ap.parse_args()
    if args.plot_only:
        path = Path(args.plot_only)
        plot(json.loads(path.read_text()), path.with_suffix(".png"))
        return
    if args.merge:
        merge([Path(m) for m in args.merge], Path(args.out), args.tag, tuple(args.baselines))
        return
    from benchmarks.learning_curve import hardware

    todo = jobs(args)
    t0 = time.monotonic()
    runs = []
    if args.engine == "vllm":
        import asyncio

        print(f"{len(todo)} runs on one vLLM engine")
        from pipeline.config.io import load_config
        from pipeline.models.builtin import build_model

        cfg = load_config(None, todo[0]["overrides"])
        model_path = str(build_model(cfg.model.shape, cfg.model.cache_dir, seed=0))

        def report(r: dict) -> None:
            print(f"{r['name']:>14}: final eval {r['final_eval']:.3f} (first {r['first_eval']:.3f}), "
                  f"{r['seconds']:.0f} s", flush=True)

        runs = asyncio.run(common.runs_on_one_vllm_engine(todo, model_path, max(args.ks), collect, report,
                                                          "staleness_learning"))
    else:
        from pipeline.models.builtin import build_model

        build_model(args.model_shape, ".cache/models", seed=0)  # once, before the workers look for it
        print(f"{len(todo)} runs on {args.workers} workers")
        with ProcessPoolExecutor(max_workers=args.workers) as pool:
            for r in pool.map(one_run, todo):
                runs.append(r)
                print(f"{r['name']:>14}: final eval {r['final_eval']:.3f} (first {r['first_eval']:.3f}), "
                      f"{r['seconds']:.0f} s", flush=True)
    table = analyse(runs, args.ks, args.arms)
    hw = hardware()
    result = {"benchmark": "staleness_learning", "hardware": hw, "wall_s": time.monotonic() - t0,
              "ks": args.ks, "arms": args.arms, "seeds": args.seeds,
              "settings": {k: v for k, v in vars(args).items() if k not in ("out", "plot_only", "workers")},
              "table": table, "runs": runs}
    print(markdown(table, args.ks, args.arms))
    where = hw["gpus"][0].replace(" ", "-") if args.engine == "vllm" else f"{hw['cpu'].replace(' ', '-')}-{hw['cores']}c"
    name = f"staleness_learning_{args.engine}_{args.model_shape}_{where}{args.tag}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / (name + '.json')}")
    plot(result, out / f"{name}.png")


if __name__ == "__main__":
    main()
