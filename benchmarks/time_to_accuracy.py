"""Time to accuracy: how soon each staleness bound and correction reaches a held-out accuracy.

    python benchmarks/time_to_accuracy.py                                    # the CPU grid below
    python benchmarks/time_to_accuracy.py --ks 0 1 --arms tis --seeds 2 --steps 100   # a quick look
    python benchmarks/time_to_accuracy.py --engine vllm --ks 0 1 2 --arms tis --seeds 2   # one GPU
    python benchmarks/time_to_accuracy.py --plot-only benchmarks/results/time_to_accuracy_<...>.json

Every run is a real Pipeline on the warm-started built-in model (pipeline.models.warm_start: the
shape fine-tuned on 2-digit addition until ~30% of held-out problems come out exactly right,
built once and shared by every run) learning the built-in `addition` task with LoRA: exact-match
reward, B groups of n completions a step. Eval rounds (`eval.every`) sample each of the task's
held-out problems `eval.n` times with the version just published; their `eval/pass@1` is the
accuracy, taken against the step and against the wall time at which that version was
published (training's wall clock from the first step: set-up apart, eval rounds' load on the
engines included, as a user's run pays it).

Arms: max_staleness K in --ks x correction in --arms (none, tis, ppo as in staleness_learning.py:
ppo takes trainer.minibatches = 4), and `lr0`, K = 0 with a learning rate of 0: the control
that tells learning from noise. A seed fixes the prompts' order and the adapter's first weights,
so runs of one seed are paired. With --deterministic (transformers engine only) it fixes every
sampling draw too, and a K-stale run trains on samples exactly K versions old; it is not the
default because deterministic decoding takes each group alone (~3x slower on 2 cores), which
is not the wall time a user's run has and hides most of what K > 0 overlaps.

Reported, per arm, over seeds: the first and final accuracy and the best, each a mean with its
95% t-interval; the time (and the steps) to first reach the target, by default halfway from
the warm start to the best accuracy of K = 0's mean curve (`--target` sets it), "not reached"
where a seed never did (its time is never made up); paired by seed against K = 0 of the same
correction, the final accuracy's difference and the time's ratio, each with its interval.
Writes time_to_accuracy_<engine>_<shape>_<hardware>.json and a plot of accuracy against wall
time and against steps, one line per arm (mean over seeds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as run.py: idle OpenMP threads sleep (engine and trainer share cores)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (the benchmarks' shared helpers sit next to this script)
from common import mean_ci  # noqa: E402
from staleness_learning import ARMS as CORRECTIONS  # noqa: E402

BENCHMARK = "time_to_accuracy"
ARMS = {**{k: CORRECTIONS[k] for k in ("none", "tis", "ppo")}, "lr0": {"loss.correction": "tis", "trainer.lr": 0.0}}
MIN_EVAL_PROMPTS = 500  # one round's standard error at most ~2.2 points (binomial, p = 0.5)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="transformers", choices=["transformers", "vllm"])
    p.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    p.add_argument("--arms", nargs="+", default=["none", "tis", "ppo"], choices=[a for a in ARMS if a != "lr0"])
    p.add_argument("--no-control", action="store_true", help="leave out the lr-0 control")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-n", type=int, default=4, help="samples per held-out problem")
    p.add_argument("--eval-prompts", type=int, default=512, help=f"held-out problems per round (>= {MIN_EVAL_PROMPTS})")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-groups", type=int, default=8)
    p.add_argument("--n", type=int, default=8, help="completions per prompt (the group)")
    p.add_argument("--digits", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=6000, help="training problems (the task's train split)")
    p.add_argument("--warm-start-accuracy", type=float, default=0.3)
    p.add_argument("--model-shape", default=None, help="default: tiny on the CPU, small with vLLM")
    p.add_argument("--model-cache", default=".cache/models")
    p.add_argument("--target", type=float, default=None,
                   help="accuracy to time (default: halfway from the warm start to K = 0's best)")
    p.add_argument("--deterministic", action="store_true",
                   help="transformers engine: deterministic runs (paired by seed; ~3x slower decoding, see above)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vLLM's share of the GPU")
    p.add_argument("--out", default=str(common.DEFAULT_OUT))
    p.add_argument("--tag", default="", help="appended to the result's file name")
    p.add_argument("--plot-only", default="", help="a result JSON to analyse and plot again (its runs as recorded)")
    args = p.parse_args(argv)
    if args.plot_only:
        return args
    if args.model_shape is None:
        args.model_shape = "small" if args.engine == "vllm" else "tiny"
    if args.eval_prompts < MIN_EVAL_PROMPTS:
        p.error(f"--eval-prompts must be >= {MIN_EVAL_PROMPTS} (one round's standard error <= ~2.2 points), "
                f"got {args.eval_prompts}")
    if not 1 <= args.eval_every <= args.steps:
        p.error(f"--eval-every must be in [1, --steps], got {args.eval_every}")
    if args.seeds < 1:
        p.error("--seeds must be >= 1")
    if 0 not in args.ks:
        p.error("--ks must include 0: every arm is compared with K = 0")
    return args


def base_overrides(args: argparse.Namespace, model_path: str) -> dict[str, Any]:
    if args.engine == "vllm":
        engine = {"engine.kind": "vllm", "engine.devices": ["cuda:0"], "trainer.device": "cuda:0",
                  "engine.vllm.gpu_memory_utilization": args.gpu_memory_utilization, "engine.vllm.max_model_len": 256}
    else:
        engine = {"engine.kind": "transformers", "engine.devices": ["cpu"], "trainer.device": "cpu",
                  "deterministic": args.deterministic}
    return {**engine, "model.path": model_path, "log.progress": False, "log.level": "warning",
            "task.name": "addition", "task.digits": args.digits, "task.num_prompts": args.num_prompts,
            "task.num_eval_prompts": args.eval_prompts, "sampling.n": args.n,
            "sampling.max_new_tokens": args.digits + 2,  # the longest sum and its end
            "pipeline.steps": args.steps, "pipeline.batch_groups": args.batch_groups, "trainer.lr": args.lr,
            "eval.every": args.eval_every, "eval.n": args.eval_n, "eval.max_prompts": args.eval_prompts,
            "pipeline.checkpoint_every": 0, "pipeline.shutdown_timeout_s": 120}


def jobs(args: argparse.Namespace, model_path: str) -> list[dict[str, Any]]:
    base = base_overrides(args, model_path)
    arms = [(k, arm) for k in args.ks for arm in args.arms] + ([] if args.no_control else [(0, "lr0")])
    return [{"name": f"K{k}-{arm}-s{seed}", "k": k, "arm": arm, "seed": seed,
             "overrides": {**base, **ARMS[arm], "seed": seed, "data.seed": seed, "pipeline.max_staleness": k}}
            for seed in range(args.seeds) for k, arm in arms]


def collect(job: dict[str, Any], p: Any, summary: dict[str, Any], seconds: float) -> dict[str, Any]:
    """A finished run's accuracy curve: (step, wall s at that version's publish, pass@1) per eval round."""
    if summary.get("error") or not summary.get("accounting_ok"):
        raise RuntimeError(f"run {job['name']} did not finish cleanly: {summary.get('error')}")
    wall = {0: 0.0, **{r["step"]: r["wall_s"] for r in p.metrics_rows}}
    curve = [(r["step"], wall[r["step"]], r["eval/pass@1"]) for r in p.eval_rows]
    return {**{k: job[k] for k in ("name", "k", "arm", "seed")}, "seconds": seconds, "setup_s": summary["setup_s"],
            "wall_s": summary["wall_s"], "groups_per_s": summary["groups_trained"] / summary["wall_s"],
            "curve": curve, "first": curve[0][2], "final": curve[-1][2], "best": max(c[2] for c in curve),
            f"pass@{p.config.eval.n}_final": p.eval_rows[-1].get(f"eval/pass@{p.config.eval.n}"),
            "staleness_max": summary["staleness_max"]}


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    """One run with engines and trainer of its own (the transformers engine)."""
    from pipeline.config.io import load_config
    from pipeline.loop.orchestrator import Pipeline

    with tempfile.TemporaryDirectory(prefix=f"{BENCHMARK}-") as out:
        t0 = time.monotonic()
        p = Pipeline(load_config(None, {**job["overrides"], "out": out}), console=False)
        summary = common.run_async(p.run())
        return collect(job, p, summary, time.monotonic() - t0)


def report(r: dict[str, Any]) -> None:
    print(f"{r['name']:>12}: accuracy {r['first']:.3f} -> {r['final']:.3f} (best {r['best']:.3f}), "
          f"{r['wall_s']:.0f} s training, {r['groups_per_s']:.1f} groups/s", flush=True)


# ====================================================================== analysis


def first_reach(curve: Sequence[Sequence[float]], target: float) -> tuple[float, int] | None:
    """(wall s, step) of the first eval round at or above `target`; None if none was."""
    return next(((wall, step) for step, wall, acc in curve if acc >= target), None)


def crossing(curve: Sequence[Sequence[float]], target: float, axis: int) -> float | None:
    """Where a (step, wall s, accuracy) curve first reaches `target`, interpolated linearly between
    eval rounds, on `axis` (0 steps, 1 wall s); None if it never does."""
    for before, after in zip([None, *curve[:-1]], curve):
        if after[2] >= target:
            if before is None or after[2] == before[2]:
                return float(after[axis])
            f = (target - before[2]) / (after[2] - before[2])
            return before[axis] + f * (after[axis] - before[axis])
    return None


def mean_curve(runs: list[dict[str, Any]]) -> list[tuple[int, float, float]]:
    """(step, mean wall s, mean accuracy) over the runs, at the steps every one of them evaluated."""
    steps = sorted(set.intersection(*({c[0] for c in r["curve"]} for r in runs)))
    by = [{c[0]: c for c in r["curve"]} for r in runs]
    return [(s, sum(b[s][1] for b in by) / len(by), sum(b[s][2] for b in by) / len(by)) for s in steps]


def analyse(runs: list[dict[str, Any]], target: float | None) -> dict[str, Any]:
    """Per arm: accuracies, time and steps to the target, paired comparisons with K = 0."""
    arms = list(dict.fromkeys((r["k"], r["arm"]) for r in runs))
    of = {(r["k"], r["arm"], r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    start = sum(r["first"] for r in runs) / len(runs)  # one warm-start model: every run's first round samples it
    base_arm = "tis" if any(a == (0, "tis") for a in arms) else next(a for k, a in arms if k == 0 and a != "lr0")
    k0_best = max(c[2] for c in mean_curve([r for r in runs if r["k"] == 0 and r["arm"] == base_arm]))
    if target is None:
        target = start + 0.5 * (k0_best - start)
    table: dict[str, Any] = {}
    for k, arm in arms:
        mine = [of[(k, arm, s)] for s in seeds if (k, arm, s) in of]
        reached = {r["seed"]: first_reach(r["curve"], target) for r in mine}
        row: dict[str, Any] = {
            "k": k, "arm": arm, "seeds": len(mine),
            **{key: mean_ci([r[key] for r in mine]) for key in ("first", "final", "best", "wall_s", "groups_per_s")},
            "reached": sum(v is not None for v in reached.values()),
            "time_to_target_s": mean_ci([v[0] for v in reached.values() if v]) if any(reached.values()) else None,
            "steps_to_target": mean_ci([v[1] for v in reached.values() if v]) if any(reached.values()) else None,
            "curve_mean": mean_curve(mine),
        }
        # the mean curve's crossing: less at the mercy of one noisy eval round than each seed's first reach
        row["mean_curve_time_to_target_s"] = crossing(row["curve_mean"], target, 1)
        row["mean_curve_steps_to_target"] = crossing(row["curve_mean"], target, 0)
        zero = "tis" if arm == "lr0" else arm
        if (k, arm) != (0, zero) and any((0, zero, s) in of for s in seeds):
            pairs = [(of[(k, arm, s)], of[(0, zero, s)]) for s in seeds if (k, arm, s) in of and (0, zero, s) in of]
            row["final_minus_K0"] = mean_ci([a["final"] - b["final"] for a, b in pairs])
            times = [(first_reach(a["curve"], target), first_reach(b["curve"], target)) for a, b in pairs]
            ratios = [a[0] / b[0] for a, b in times if a and b and b[0] > 0]
            row["time_ratio_to_K0"] = mean_ci(ratios) if ratios else None
            row["time_ratio_pairs"] = len(ratios)
        if arm not in ("none", "lr0") and any((k, "none", s) in of for s in seeds):  # what the correction buys at this K
            pairs = [(of[(k, arm, s)], of[(k, "none", s)]) for s in seeds if (k, arm, s) in of and (k, "none", s) in of]
            row["final_minus_none"] = mean_ci([a["final"] - b["final"] for a, b in pairs])
        table[f"K{k}-{arm}"] = row
    zero_time = {a: table.get(f"K0-{a}", {}).get("mean_curve_time_to_target_s") for _, a in arms}
    for row in table.values():
        base = zero_time.get("tis" if row["arm"] == "lr0" else row["arm"])
        mine = row["mean_curve_time_to_target_s"]
        row["mean_curve_time_ratio_to_K0"] = mine / base if mine is not None and base else None
    return {"start": start, "k0_best": k0_best, "base_arm": base_arm, "target": target, "table": table}


def _ci(c: dict[str, Any] | None, digits: int = 3) -> str:
    if not c:
        return "not reached"
    half = c["ci95"]
    return f"{c['mean']:.{digits}f}" + ("" if half != half else f" ± {half:.{digits}f}")  # nan: one seed


def markdown(analysis: dict[str, Any], seeds: int) -> str:
    lines = [f"target accuracy {analysis['target']:.3f} (warm start {analysis['start']:.3f}, best K=0 "
             f"{analysis['base_arm']} {analysis['k0_best']:.3f})", "",
             "| arm | final | best | time to target s (reached) | steps to target | final − K=0 | final − none "
             "| time ÷ K=0 | mean curve: s to target (÷ K=0) | groups/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in analysis["table"].items():
        lines.append(" | ".join([
            f"| {name}", _ci(row["final"]), _ci(row["best"]),
            f"{_ci(row['time_to_target_s'], 1)} ({row['reached']}/{seeds})", _ci(row["steps_to_target"], 0),
            _ci(row.get("final_minus_K0")) if "final_minus_K0" in row else "",
            _ci(row.get("final_minus_none")) if "final_minus_none" in row else "",
            (_ci(row.get("time_ratio_to_K0"), 2) + f" ({row['time_ratio_pairs']} pairs)")
            if row.get("time_ratio_to_K0") else ("" if "final_minus_K0" not in row else "not reached"),
            "not reached" if row.get("mean_curve_time_to_target_s") is None else
            f"{row['mean_curve_time_to_target_s']:.1f}" + (f" ({row['mean_curve_time_ratio_to_K0']:.2f})"
                                                          if row.get("mean_curve_time_ratio_to_K0") else ""),
            f"{row['groups_per_s']['mean']:.1f} |"]))
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5))
    FigureCanvasAgg(fig)
    by_wall, by_step = fig.subplots(1, 2)
    a = result["analysis"]
    ks = sorted({row["k"] for row in a["table"].values() if row["k"] is not None})
    colours = {k: f"C{i}" for i, k in enumerate(ks)}  # a colour per K, a line style per correction
    dashes = {"tis": "-", "none": ":", "ppo": "--"}
    for name, row in a["table"].items():
        curve = row["curve_mean"]
        style = {"linestyle": "--", "color": "gray"} if row["arm"] in ("lr0", "trl") else \
            {"linestyle": dashes.get(row["arm"], "-."), "color": colours[row["k"]]}
        if row["arm"] == "trl":
            style = {"linestyle": "-", "color": "black", "linewidth": 2}
        by_wall.plot([c[1] for c in curve], [c[2] for c in curve], label=name, **style)
        by_step.plot([c[0] for c in curve], [c[2] for c in curve], label=name, **style)
    for ax, x in ((by_wall, "training wall time (s)"), (by_step, "step")):
        ax.axhline(a["target"], color="black", linewidth=0.7, linestyle=":")
        ax.set(xlabel=x, ylabel="held-out exact match (pass@1, mean over seeds)")
    by_wall.legend(fontsize=7, ncol=2)
    s = result["settings"]
    fig.suptitle(f"{s['engine']}, {s['model_shape']} warm start, {s['digits']}-digit addition, lr {s['lr']:g}, "
                 f"B={s['batch_groups']} x n={s['n']}, {result['seeds']} seeds | {result['hardware_tag']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.plot_only:  # the recorded runs analysed again (a newer analysis), the table printed, the plot redrawn
        path = Path(args.plot_only)
        result = json.loads(path.read_text())
        target = result["settings"].get("target")
        result["analysis"] = analyse(result["runs"], target)
        result["table_markdown"] = result["printed"] = markdown(result["analysis"], result["seeds"])
        print(result["table_markdown"])
        common.write_json(path, result)
        plot(result, path.with_suffix(".png"))
        return result
    from pipeline.config.schema import TaskConfig
    from pipeline.observe.log import configure_logging
    from pipeline.data.tasks import build_task
    from pipeline.models.warm_start import warm_start

    configure_logging(None, "warning", console=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    load = common.MachineLoad()
    task = build_task(TaskConfig(name="addition", digits=args.digits, num_prompts=args.num_prompts,
                                 num_eval_prompts=args.eval_prompts), args.digits + 2)  # a split too small says so here
    t = time.monotonic()
    model_path = str(warm_start(args.model_shape, task, args.model_cache, target=args.warm_start_accuracy))
    print(f"warm start {model_path} ready in {time.monotonic() - t:.1f} s", flush=True)
    todo = jobs(args, model_path)
    t0 = time.monotonic()
    print(f"{len(todo)} runs", flush=True)
    if args.engine == "vllm":
        runs = common.run_async(common.runs_on_one_vllm_engine(todo, model_path, max(args.ks), collect, report,
                                                               BENCHMARK))
    else:
        runs = []
        for job in todo:
            runs.append(r := run_one(job))
            report(r)
    analysis = analyse(runs, args.target)
    hw = common.hardware()
    tag = common.hardware_tag(hw)
    text = markdown(analysis, args.seeds)
    print(text, flush=True)
    machine_load = load.record()
    result = {**common.header(BENCHMARK, argv), "hardware": hw, "hardware_tag": tag, "machine_load": machine_load,
              "load_note": common.load_note(machine_load, hw["cpu_affinity"]), "wall_s": time.monotonic() - t0,
              "seeds": args.seeds, "settings": {k: v for k, v in vars(args).items() if k not in ("out", "plot_only")},
              "model_path": model_path, "warm_start": json.loads((Path(model_path) / "warm_start.json").read_text()),
              "analysis": analysis, "table_markdown": text, "printed": text, "runs": runs}
    name = f"{BENCHMARK}_{args.engine}_{args.model_shape}_{tag}{args.tag}"
    out = Path(args.out)
    common.write_json(out / f"{name}.json", result)
    plot(result, out / f"{name}.png")
    print(f"wrote {out / name}.json and .png", flush=True)
    return result


if __name__ == "__main__":
    main()
