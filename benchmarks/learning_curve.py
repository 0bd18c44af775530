"""Does the policy learn? The same run twice, with the configured learning rate and with lr = 0.

    python benchmarks/learning_curve.py                       # CPU: tiny model, transformers engine
    python benchmarks/learning_curve.py --config examples/own_task/config.toml   # your own task's files
    python benchmarks/learning_curve.py --task calculator     # the built-in multi-turn tool-use task
    python benchmarks/learning_curve.py --engine vllm --model-shape small \
        --engine-device cuda:0 --trainer-device cuda:1 --steps 100

Both runs use the same seed, prompts, engine and settings; the only difference is the learning
rate, so the gap between the reward curves is what training bought. With vLLM, one engine is
started once and serves both runs (the Pipeline does not close engines it did not build). Where
the config evaluates ([eval] every > 0), each run's eval rounds (held-out prompts) are kept too.
Writes learning_curve_<engine>_<shape>_<hardware>.json (learning_curve_<task>_... for another task:
a data.train task named after its folder, an env.factory after its file, a built-in one by its
name) and a PNG of both curves.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dataclasses import replace  # noqa: E402

from pipeline.config.schema import WARM_START_TASKS  # noqa: E402
from pipeline.config.io import load_config  # noqa: E402
from pipeline.loop.orchestrator import Pipeline  # noqa: E402


def hardware() -> dict:
    import platform

    import torch

    info = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except ImportError:  # vLLM is optional
        pass
    return info


def window_mean(xs: list[float], frac: float = 0.2, last: bool = True) -> float:
    k = max(1, int(len(xs) * frac))
    w = xs[-k:] if last else xs[:k]
    return sum(w) / len(w)


async def main(args: argparse.Namespace) -> dict:
    overrides = {
        "seed": args.seed, "model.shape": args.model_shape, "engine.kind": args.engine,
        "engine.devices": [args.engine_device], "trainer.device": args.trainer_device,
        "pipeline.steps": args.steps, "pipeline.max_staleness": args.max_staleness,
        "pipeline.batch_groups": args.batch_groups, "log.progress": False,
        **({"task.name": args.task, "model.warm_start": args.task in WARM_START_TASKS} if args.task else {}),
    }
    if args.engine == "vllm":
        overrides.update({"engine.vllm.enforce_eager": True, "engine.vllm.gpu_memory_utilization": 0.5,
                          "engine.vllm.dtype": "bfloat16",
                          "engine.vllm.max_model_len": 512})
    cfg = load_config(args.config, overrides)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engines = None
    if args.engine == "vllm":
        from pipeline.engines.vllm import VLLMEngine
        from pipeline.loop.build import vllm_config
        from pipeline.models.builtin import build_model

        model_path = cfg.model.path or str(build_model(cfg.model.shape, cfg.model.cache_dir, seed=cfg.seed))
        cfg = load_config(args.config, {**overrides, "model.path": model_path})
        engine = VLLMEngine(model_path, sampling=cfg.sampling, cfg=vllm_config(cfg), device=args.engine_device,
                            max_staleness=cfg.pipeline.max_staleness, name="vllm-0")
        t = time.monotonic()
        await engine.start()
        print(f"vLLM engine started in {time.monotonic() - t:.1f} s", flush=True)
        engines = [engine]
    runs = {}
    runs_root = Path("runs") / f"learning_curve-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        for label, lr in (("trained", cfg.trainer.lr if args.lr is None else args.lr), ("lr0", 0.0)):
            # the run directories (zarr, adapters, checkpoints) go under runs/, not beside the results
            run_cfg = replace(cfg, trainer=replace(cfg.trainer, lr=lr), out=str(runs_root / f"run_{label}"))
            p = Pipeline(run_cfg, engines=engines, console=args.verbose)
            t = time.monotonic()
            summary = await p.run()
            rewards = [r["reward_mean"] for r in p.metrics_rows]
            runs[label] = {
                "lr": lr, "wall_s": time.monotonic() - t, "reward_per_step": rewards,
                "reward_first_window": window_mean(rewards, last=False), "reward_final_window": window_mean(rewards),
                "staleness_max": summary["staleness_max"], "accounting_ok": summary["accounting_ok"],
                "groups_trained": summary["groups_trained"], "tokens_per_s": summary["tokens_per_s"],
                "logprob_check": {k: v for k, v in p.metrics_rows[0].items() if k.startswith("check/")},
                "busy_generator": summary["busy_generator"], "busy_trainer": summary["busy_trainer"],
                "eval": [{k: v for k, v in r.items() if k in ("step", "version") or k.startswith("eval/")}
                         for r in p.eval_rows],
            }
            print(f"{label}: lr={lr} reward first/final window {runs[label]['reward_first_window']:.3f} -> "
                  f"{runs[label]['reward_final_window']:.3f} in {runs[label]['wall_s']:.1f} s", flush=True)
            for r in runs[label]["eval"]:
                print(f"  eval at step {r['step']}: reward {r['eval/reward_mean']:.3f}, pass@1 {r['eval/pass@1']:.3f}",
                      flush=True)
    finally:
        if engines:
            await engines[0].close()
    gap = runs["trained"]["reward_final_window"] - runs["lr0"]["reward_final_window"]
    hw = hardware()
    task = Path(cfg.data.train).resolve().parent.name if cfg.data.train else \
        Path(cfg.env.factory.partition(":")[0]).stem if cfg.env.factory else cfg.task.name
    result = {"settings": {**overrides, "lr": runs["trained"]["lr"], "group_size": cfg.sampling.n,
                           "max_new_tokens": cfg.sampling.max_new_tokens, "task": task, "config": args.config},
              "hardware": hw, "runs": runs, "final_window_gap": gap}
    tag = "_".join(x.replace(" ", "-") for x in hw.get("gpus", [hw["cpu"]])[:1])
    named = cfg.data.train or cfg.env.factory or task != "char_class"  # the default task's files keep their names
    name = f"learning_curve_{task + '_' if named else ''}{args.engine}_{args.model_shape}_{tag}"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for label, r in runs.items():
            line, = ax.plot(r["reward_per_step"], label=f"{label} (lr={r['lr']})", lw=1)
            if r["eval"]:  # held-out prompts, at the steps they were evaluated
                ax.plot([e["step"] for e in r["eval"]], [e["eval/reward_mean"] for e in r["eval"]], "o--",
                        color=line.get_color(), ms=4, lw=0.8, label=f"{label}: eval reward")
        ax.set_xlabel("step")
        ax.set_ylabel("batch mean reward")
        ax.set_title(f"{task}: {args.engine}, {args.model_shape}, staleness <= {cfg.pipeline.max_staleness}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=90)
    except ImportError:  # the plot is optional; the JSON has the numbers
        pass
    print(f"final-window gap (trained - lr0): {gap:+.3f}; wrote {out / name}.json", flush=True)
    return result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="examples/cpu_default.toml", help="base TOML config (default: run.py's)")
    p.add_argument("--engine", default="transformers", choices=["transformers", "vllm", "simulated"])
    p.add_argument("--model-shape", default="tiny", choices=["tiny", "small", "qwen2.5-0.5b", "qwen2.5-1.5b"])
    p.add_argument("--engine-device", default="cpu")
    p.add_argument("--trainer-device", default="cpu")
    p.add_argument("--task", help="a built-in task (addition, char_class, copy, calculator); default: the config's")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-groups", type=int, default=8)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--lr", type=float, default=None, help="learning rate of the trained run (default: config's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/benchmarks")
    p.add_argument("--verbose", action="store_true", help="log to the console too")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    try:
        import uvloop
    except ImportError:  # uvloop is optional
        uvloop = None
    (uvloop.run if uvloop is not None else asyncio.run)(main(args))
