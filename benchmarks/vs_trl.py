"""TRL's GRPOTrainer and this pipeline side by side on the CPU: same model, task, settings and samples.

    python benchmarks/vs_trl.py               # one seed
    python benchmarks/vs_trl.py --seeds 3     # mean and spread over seeds 0, 1, 2
    python benchmarks/vs_trl.py --workload micro --update full --seeds 3 --staleness 0,1
    python benchmarks/vs_trl.py --task addition --seeds 2     # time to accuracy on a warm-started model
    python benchmarks/vs_trl.py --task addition --engine vllm # ... on one GPU, TRL in vLLM colocate mode

Workloads: `default` is B = 8 prompts x n = 8 completions of 16 tokens, 30 steps; `micro` is the
smallest a user's first toy run is likely to be, where a step's fixed cost decides the race:
the same 64 samples a step of 8 tokens (~50 ms a step on 2 cores), 60 steps, LoRA r16. `--update full`
trains every weight on both sides (TRL without a peft config, our trainer.update = "full").

Needs the `bench` extra (pip install -e '.[bench]': trl, datasets).

Both sides train the same built-in model (pipeline.models.builtin.build_model) on the char_class task
with the same reward function, LoRA (rank, alpha, target modules, no dropout), learning rate
(constant), AdamW betas, gradient clipping, group size, completion length and number of steps
and samples; sampling at temperature 1, top_p 1, top_k off; no KL term. TRL generates with
transformers (no vLLM), one generation batch of B prompts x n per optimizer step, on the CPU in
float32, gradient checkpointing off (our trainer does not checkpoint). Our pipeline runs at
each --staleness value (default 0 and 2) with the transformers engine and the LoRA trainer.
Threads: TRL uses torch's default thread count; the Pipeline itself narrows it for its run when
engine and trainer share the CPU (each run records the count it had in `torch_threads`).

Figures: wall time of training (model loading and set-up reported apart), samples/s over that
wall time and in steady state (after --warmup-steps steps), and the reward at equal samples:
the mean over the last fifth of the steps (every system trains the same number of samples).
With --seeds N each figure is given as mean and standard deviation over the seeds.

Writes <out>/vs_trl_<model>_<hardware>.json and .png (reward against samples; samples/s).

`--task addition` races to an accuracy instead: both sides train the warm-started built-in
model (pipeline.models.warm_start) on the built-in addition task with the exact-match reward, the
same B x n, learning rate and LoRA, and evaluate every --eval-every steps on the task's
held-out problems (--eval-n samples each at temperature 1, pass@1). Ours is
benchmarks/time_to_accuracy.py's run at each --staleness K (correction tis); TRL evaluates in
a callback whose time is left out of its clock (ours pays its eval rounds' load on the engines,
so the comparison leans to TRL). The target is time_to_accuracy's (halfway from the warm start
to our K = 0's best, or --target); reported: each system's time and steps to it ("not reached"
where it never did), final accuracy, and our time over TRL's. With --engine vllm TRL generates
in vLLM colocate mode on the same GPU (vllm_gpu_memory_utilization as ours) and ours runs the
vLLM engine beside the trainer. Writes vs_trl_addition_<engine>_<shape>_<hardware>.json and .png.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

# As run.py does: idle OpenMP threads sleep instead of spinning, since engine and trainer share the
# CPU cores (set before torch is imported, for TRL and our pipeline alike).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (the benchmarks' shared helpers sit next to this script)

from pipeline.config.schema import LossConfig, TrainerConfig  # noqa: E402
from pipeline.config.io import load_config  # noqa: E402

BENCHMARK = "vs_trl"
REWARD_WINDOW = 5  # reward at equal samples: the mean over the last 1/REWARD_WINDOW of the steps
TRL_REQUIRED_FIELDS = ("num_generations", "max_completion_length", "temperature", "top_p", "top_k", "beta",
                       "num_iterations", "loss_type", "scale_rewards", "steps_per_generation", "use_vllm",
                       "gradient_checkpointing", "use_cpu")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=1, help="run seeds 0..N-1 and report mean and spread")
    p.add_argument("--workload", default="default", choices=["default", "micro"])
    p.add_argument("--update", default="lora", choices=["lora", "full"], help="LoRA adapters or every weight")
    p.add_argument("--staleness", default="0,2", help="max_staleness values of our pipeline")
    p.add_argument("--steps", type=int, help="optimizer steps (default 30)")
    p.add_argument("--batch-groups", type=int, help="B, prompts per step (default 8)")
    p.add_argument("--group-size", type=int, help="n, completions per prompt (default 8)")
    p.add_argument("--max-new-tokens", type=int, help="completion length (default 16)")
    p.add_argument("--warmup-steps", type=int, help="steps left out of the steady-state samples/s (default 2)")
    p.add_argument("--lr", type=float, default=TrainerConfig.lr)
    p.add_argument("--lora-rank", type=int, help=f"LoRA rank (default {TrainerConfig.lora_rank}; micro 16)")
    p.add_argument("--lora-alpha", type=float, default=TrainerConfig.lora_alpha)
    p.add_argument("--num-prompts", type=int, default=512, help="size of the char_class prompt set")
    p.add_argument("--model-shape", default="tiny")
    p.add_argument("--model-cache", default=".cache/models")
    p.add_argument("--skip-trl", action="store_true", help="run only our pipeline (no TRL needed)")
    p.add_argument("--out", default=str(common.DEFAULT_OUT))
    p.add_argument("--quick", action="store_true", help="a short smoke test (under a minute on 2 CPU cores)")
    p.add_argument("--task", default="char_class", choices=["char_class", "addition"],
                   help="addition: time to a held-out accuracy on the warm-started model (see above)")
    p.add_argument("--engine", default="transformers", choices=["transformers", "vllm"], help="with --task addition")
    p.add_argument("--eval-every", type=int, default=25, help="with --task addition")
    p.add_argument("--eval-n", type=int, default=4, help="with --task addition: samples per held-out problem")
    p.add_argument("--eval-prompts", type=int, default=512, help="with --task addition: held-out problems")
    p.add_argument("--target", type=float, default=None, help="with --task addition: the accuracy to time")
    p.add_argument("--reanalyse", metavar="JSON", help="with --task addition: a recorded race, analysed again "
                   "(its runs as recorded), its table printed, its JSON and plot rewritten")
    args = p.parse_args(argv)
    if args.task == "addition":
        return args
    r = TrainerConfig.lora_rank
    quick = {"steps": 3, "batch_groups": 2, "group_size": 4, "max_new_tokens": 8, "warmup_steps": 1, "lora_rank": r}
    full = {"steps": 30, "batch_groups": 8, "group_size": 8, "max_new_tokens": 16, "warmup_steps": 2, "lora_rank": r}
    micro = {"steps": 60, "batch_groups": 8, "group_size": 8, "max_new_tokens": 8, "warmup_steps": 5, "lora_rank": 16}
    for key, value in (quick if args.quick else micro if args.workload == "micro" else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.staleness_list = common.parse_list(args.staleness, int)
    if args.seeds < 1:
        p.error("--seeds must be >= 1")
    if not 1 <= args.warmup_steps < args.steps:
        p.error(f"--warmup-steps must be in [1, --steps), got {args.warmup_steps} with --steps {args.steps}")
    return args


def steady_rate(step_ends: Sequence[float], samples_per_step: int, warmup: int) -> float:
    """Samples per second from the end of step `warmup` to the end of the last step."""
    span = step_ends[-1] - step_ends[warmup - 1]
    return (len(step_ends) - warmup) * samples_per_step / span if span > 0 else float("nan")


def tail_mean(values: Sequence[float]) -> float:
    return float(np.mean(values[-max(1, len(values) // REWARD_WINDOW):]))


# ====================================================================== our pipeline


def run_pipeline(args: argparse.Namespace, model_path: Path, seed: int, K: int, run_dir: Path) -> dict[str, Any]:
    from pipeline.loop.orchestrator import Pipeline

    cfg = load_config(None, {
        "out": str(run_dir), "seed": seed, "model.path": str(model_path),
        "task.name": "char_class", "task.num_prompts": args.num_prompts,
        "engine.kind": "transformers", "engine.devices": ["cpu"], "trainer.kind": "peft", "trainer.device": "cpu",
        "trainer.lr": args.lr, "trainer.update": args.update,
        "trainer.lora_rank": args.lora_rank, "trainer.lora_alpha": args.lora_alpha,
        "trainer.lora_dropout": 0.0, "trainer.target_modules": ["all-linear"],
        "sampling.n": args.group_size, "sampling.max_new_tokens": args.max_new_tokens,
        "pipeline.steps": args.steps, "pipeline.batch_groups": args.batch_groups, "pipeline.max_staleness": K,
        "log.progress": False, "log.level": "warning"})
    import torch

    p = Pipeline(cfg, console=False)
    threads = torch.get_num_threads()
    t0 = time.perf_counter()
    try:
        s = common.run_async(p.run())
        run_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)  # the Pipeline may narrow them for its run; TRL gets them all back
    total = time.perf_counter() - t0
    if s["error"] or not s["accounting_ok"] or s["steps"] != args.steps:
        raise RuntimeError(f"our pipeline at max_staleness={K}, seed {seed} did not finish cleanly: {s}")
    rows = p.metrics_rows
    samples = s["groups_trained"] * args.group_size
    ends = [end for _, end in p.timeline["training"]]
    rewards = [r["reward_mean"] for r in rows]
    return {
        "system": f"pipeline K={K}", "seed": seed, "max_staleness": K, "update": p.config.trainer.update,
        "samples": samples,
        "wall_s": s["wall_s"], "setup_s": s["setup_s"], "total_s": total,
        "samples_per_s": samples / s["wall_s"],
        "samples_per_s_steady": steady_rate(ends, args.batch_groups * args.group_size, args.warmup_steps),
        "reward_final": tail_mean(rewards), "reward_mean": float(np.mean(rewards)), "reward_curve": rewards,
        "staleness_max": s["staleness_max"], "loop_lag_p99_ms": s["loop_lag_p99_ms"],
        "busy_generator": s["busy_generator"], "busy_trainer": s["busy_trainer"], "torch_threads": run_threads,
    }


def pipeline_settings() -> dict[str, Any]:
    loss = LossConfig()
    return {"loss_correction": loss.correction, "is_cap": loss.is_cap, "aggregation": loss.aggregation,
            "scale_rewards": loss.scale_rewards, "betas": list(TrainerConfig.betas),
            "grad_clip": TrainerConfig.grad_clip, "weight_decay": TrainerConfig.weight_decay,
            "optimizer": "AdamW (torch)", "lr_schedule": "constant",
            "logprob_check": "engine vs trainer log-probs of 2 groups at step 1 (the pipeline's default)"}


# ====================================================================== TRL


def trl_config(args: argparse.Namespace, seed: int, out_dir: Path, **extra: Any) -> Any:
    """GRPOConfig for the race: our settings in TRL's names; `extra` replaces or adds fields."""
    from trl import GRPOConfig

    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    missing = [f for f in TRL_REQUIRED_FIELDS if f not in fields]
    if missing:
        import trl

        raise SystemExit(f"error: trl {trl.__version__}'s GRPOConfig lacks {', '.join(missing)}; this benchmark "
                         "needs a TRL with those settings (it was written against trl 1.16)")
    B, n = args.batch_groups, args.group_size
    return GRPOConfig(**dict(
        output_dir=str(out_dir), seed=seed, data_seed=seed,
        per_device_train_batch_size=B * n,  # completions per optimizer step: B prompts x n
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,  # one step per generation batch
        num_generations=n, max_completion_length=args.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
        beta=0.0, loss_type="dapo",  # token-level mean over the batch, like our token_mean aggregation
        scale_rewards="group",  # divide by the group's std, like our scale_rewards = true
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=TrainerConfig.betas[0], adam_beta2=TrainerConfig.betas[1],
        weight_decay=TrainerConfig.weight_decay, max_grad_norm=TrainerConfig.grad_clip,
        max_steps=args.steps, use_cpu=True, bf16=False, fp16=False, use_vllm=False,
        gradient_checkpointing=False, report_to="none", logging_steps=1, save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
    ) | extra)


def run_trl(args: argparse.Namespace, model_path: Path, seed: int, out_dir: Path) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOTrainer

    from pipeline.config.schema import TaskConfig
    from pipeline.data.tasks import build_task

    task = build_task(TaskConfig(name="char_class", num_prompts=args.num_prompts), args.max_new_tokens)
    data = Dataset.from_list([{"prompt": p["prompt"], "target_class": p["target_class"]} for p in task.prompts])
    batch_rewards: list[float] = []

    def char_class_reward(prompts: list[str], completions: list[str], **kw: Any) -> list[float]:
        out = task.reward(prompts, completions, **kw)
        batch_rewards.append(float(np.mean(out)))  # one call per generation batch = per step
        return out

    step_ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, *a: Any, **kw: Any) -> None:
            step_ends.append(time.monotonic())

    cfg = trl_config(args, seed, out_dir)
    t0 = time.perf_counter()
    trainer = GRPOTrainer(
        model=str(model_path), reward_funcs=char_class_reward, args=cfg, train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(str(model_path)),
        peft_config=None if args.update == "full" else LoraConfig(
            r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0, target_modules="all-linear",
            bias="none", task_type="CAUSAL_LM"),
        callbacks=[StepClock()])
    trainer.remove_callback(PrinterCallback)  # its per-step dicts would drown the benchmark's own output
    setup = time.perf_counter() - t0
    dtypes = sorted({str(p.dtype) for p in trainer.model.parameters()})
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    steps = len(step_ends)
    if steps != args.steps or len(batch_rewards) != args.steps:
        raise RuntimeError(f"TRL ran {steps} steps with {len(batch_rewards)} reward calls, expected {args.steps}")
    samples = steps * args.batch_groups * args.group_size
    result = {
        "system": "trl", "seed": seed, "samples": samples, "wall_s": wall, "setup_s": setup, "total_s": setup + wall,
        "samples_per_s": samples / wall,
        "samples_per_s_steady": steady_rate(step_ends, args.batch_groups * args.group_size, args.warmup_steps),
        "reward_final": tail_mean(batch_rewards), "reward_mean": float(np.mean(batch_rewards)),
        "reward_curve": batch_rewards, "model_dtypes": dtypes, "torch_threads": torch.get_num_threads(),
    }
    del trainer
    return result


def trl_settings(args: argparse.Namespace) -> dict[str, Any]:
    import trl

    cfg = trl_config(args, 0, Path(tempfile.gettempdir()) / "unused")
    keys = ("loss_type", "scale_rewards", "beta", "epsilon", "epsilon_high", "importance_sampling_level",
            "num_iterations", "steps_per_generation", "generation_batch_size", "per_device_train_batch_size",
            "num_generations", "max_completion_length", "temperature", "top_p", "top_k", "min_p",
            "mask_truncated_completions", "top_entropy_quantile", "gradient_checkpointing", "bf16", "fp16",
            "use_vllm", "learning_rate", "lr_scheduler_type", "adam_beta1", "adam_beta2", "weight_decay",
            "max_grad_norm", "optim", "shuffle_dataset")
    return {"version": trl.__version__, **{k: getattr(cfg, k, None) for k in keys}}


# ====================================================================== report


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def stats(key: str) -> dict[str, float | None]:
        vals = [r[key] for r in runs if r.get(key) is not None]
        if not vals:
            return {"mean": None, "std": None, "min": None, "max": None}
        return {"mean": float(np.mean(vals)), "std": float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0,
                "min": float(min(vals)), "max": float(max(vals))}

    curves = np.array([r["reward_curve"] for r in runs], dtype=np.float64)
    return {"system": runs[0]["system"], "seeds": [r["seed"] for r in runs], "samples": runs[0]["samples"],
            **{k: stats(k) for k in ("wall_s", "setup_s", "samples_per_s", "samples_per_s_steady", "reward_final",
                                     "reward_mean")},
            "reward_curve_mean": curves.mean(axis=0).tolist()}


def pm(s: dict[str, Any]) -> str:
    if s["mean"] is None:
        return "-"
    return f"{common.fmt(s['mean'])} ± {common.fmt(s['std'])}" if s["std"] else common.fmt(s["mean"])


def plot(summary: list[dict[str, Any]], samples_per_step: int, title: str, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    for s in summary:
        curve = s["reward_curve_mean"]
        ax1.plot(np.arange(1, len(curve) + 1) * samples_per_step, curve, label=s["system"])
    ax1.set(xlabel="samples trained", ylabel="reward (mean over seeds)", title="reward at equal samples")
    ax1.legend(fontsize=8)
    names = [s["system"] for s in summary]
    means = [s["samples_per_s"]["mean"] for s in summary]
    errs = [s["samples_per_s"]["std"] or 0.0 for s in summary]
    ax2.bar(names, means, yerr=errs, capsize=4)
    ax2.set(ylabel="samples/s (training wall time)", title="throughput")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ====================================================================== the addition race


def addition_args(args: argparse.Namespace) -> argparse.Namespace:
    """time_to_accuracy's settings for our side of the race, from this script's flags."""
    import time_to_accuracy as tta

    flags = ["--engine", args.engine, "--ks", *map(str, common.parse_list(args.staleness, int)), "--arms", "tis",
             "--no-control", "--seeds", str(args.seeds), "--eval-every", str(args.eval_every),
             "--eval-n", str(args.eval_n), "--eval-prompts", str(args.eval_prompts),
             "--model-cache", args.model_cache]
    for flag, value in (("--steps", args.steps), ("--batch-groups", args.batch_groups), ("--n", args.group_size),
                        ("--lr", None if args.lr == TrainerConfig.lr else args.lr),
                        ("--model-shape", None if args.model_shape == "tiny" and args.engine == "vllm"
                         else args.model_shape)):
        if value is not None:
            flags += [flag, str(value)]
    return tta.parse_args(flags)


def trl_namespace(ours: argparse.Namespace, args: argparse.Namespace) -> argparse.Namespace:
    """This script's flags with the race's settings (time_to_accuracy's) where trl_config reads them."""
    return argparse.Namespace(**{**vars(args), "max_new_tokens": ours.digits + 2, "steps": ours.steps,
                                 "batch_groups": ours.batch_groups, "group_size": ours.n, "lr": ours.lr})


def run_trl_addition(ours: argparse.Namespace, args: argparse.Namespace, model_path: str, seed: int,
                     rows: list[dict[str, Any]], held_out: list[dict[str, Any]], out_dir: Path) -> dict[str, Any]:
    """TRL's GRPOTrainer on the addition task: its accuracy curve, eval time left out of its clock.
    Run in a process of its own (`trl_in_child`): TRL's colocated vLLM and its torch.distributed
    set-up leave the process they ran in, and ours starts clean beside none of it."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOTrainer

    from pipeline.data.tasks import exact_match
    from pipeline.models.warm_start import sampled_accuracy

    data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    held = [(r["prompt"], r["answer"]) for r in held_out] * ours.eval_n
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    curve: list[tuple[int, float, float]] = []
    clock = {"t0": 0.0, "eval_s": 0.0}

    def evaluate(model: Any, step: int) -> None:
        t = time.monotonic()
        device = next(model.parameters()).device
        acc = sampled_accuracy(model, tokenizer, held, str(device))
        wall = t - clock["t0"] - clock["eval_s"]
        clock["eval_s"] += time.monotonic() - t
        curve.append((step, wall, acc))

    class Eval(TrainerCallback):
        def on_train_begin(self, a: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            clock["t0"] = time.monotonic()
            evaluate(model, 0)

        def on_step_end(self, a: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            if state.global_step % ours.eval_every == 0 or state.global_step == ours.steps:
                evaluate(model, state.global_step)

    targs = trl_config(trl_namespace(ours, args), seed, out_dir, use_cpu=ours.engine != "vllm", use_vllm=ours.engine == "vllm",
                       vllm_mode="colocate", vllm_gpu_memory_utilization=ours.gpu_memory_utilization,
                       vllm_max_model_length=256)
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=model_path, reward_funcs=exact_match, args=targs, train_dataset=data,
                          processing_class=tokenizer,
                          peft_config=LoraConfig(r=TrainerConfig.lora_rank, lora_alpha=TrainerConfig.lora_alpha,
                                                 lora_dropout=0.0, target_modules="all-linear", bias="none",
                                                 task_type="CAUSAL_LM"),
                          callbacks=[Eval()])
    trainer.remove_callback(PrinterCallback)
    setup = time.perf_counter() - t0
    trainer.train()
    wall = time.monotonic() - clock["t0"] - clock["eval_s"]
    result = {"system": "trl", "seed": seed, "setup_s": setup, "wall_s": wall, "eval_s": clock["eval_s"],
              "curve": curve, "first": curve[0][2], "final": curve[-1][2], "best": max(c[2] for c in curve),
              "samples_per_s": ours.steps * ours.batch_groups * ours.n / wall, "torch_threads": torch.get_num_threads()}
    return result


def trl_in_child(ours: argparse.Namespace, args: argparse.Namespace, model_path: str, seed: int,
                 rows: list[dict[str, Any]], held_out: list[dict[str, Any]], out_dir: Path) -> dict[str, Any]:
    """run_trl_addition in a fresh process of this script (`--trl-child FILE`), its call and its result
    passed as JSON files: nothing of TRL's is left in this process afterwards."""
    out_dir.mkdir(parents=True, exist_ok=True)
    call = out_dir / "trl_call.json"
    call.write_text(json.dumps({"ours": vars(ours), "args": vars(args), "model_path": model_path, "seed": seed,
                                "rows": rows, "held_out": held_out, "out_dir": str(out_dir)}))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--trl-child", str(call)])
    result = out_dir / "trl_result.json"
    if proc.returncode != 0 or not result.is_file():
        raise RuntimeError(f"TRL's run (seed {seed}) failed in its process, exit code {proc.returncode}")
    return json.loads(result.read_text())


def _trl_child(path: str) -> None:
    """The child's side of trl_in_child: run, then write the result beside the call."""
    call = json.loads(Path(path).read_text())
    out_dir = Path(call["out_dir"])
    result = run_trl_addition(argparse.Namespace(**call["ours"]), argparse.Namespace(**call["args"]),
                              call["model_path"], call["seed"], call["rows"], call["held_out"], out_dir)
    (out_dir / "trl_result.json").write_text(json.dumps(common.jsonable(result)))


def race_analysis(runs: list[dict[str, Any]], trl_runs: list[dict[str, Any]], target: float | None, seeds: int,
                  n: int) -> tuple[dict[str, Any], str]:
    """time_to_accuracy's analysis of our runs, with TRL's runs beside them: its accuracies, its time
    to the same target (per seed and where its mean curve crosses it) and ours over its, by seed."""
    import time_to_accuracy as tta

    analysis = tta.analyse(runs, target)
    target = analysis["target"]
    text = tta.markdown(analysis, seeds)
    if not trl_runs:
        return analysis, text
    reached = [tta.first_reach(r["curve"], target) for r in trl_runs]
    curve = tta.mean_curve(trl_runs)
    trl_row = {"k": None, "arm": "trl", "seeds": len(trl_runs),
               "final": tta.mean_ci([r["final"] for r in trl_runs]), "best": tta.mean_ci([r["best"] for r in trl_runs]),
               "reached": sum(x is not None for x in reached),
               "time_to_target_s": tta.mean_ci([x[0] for x in reached if x]) if any(reached) else None,
               "steps_to_target": tta.mean_ci([x[1] for x in reached if x]) if any(reached) else None,
               "samples_per_s": tta.mean_ci([r["samples_per_s"] for r in trl_runs]),
               "curve_mean": curve, "mean_curve_time_to_target_s": tta.crossing(curve, target, 1)}
    trl_time = trl_row["mean_curve_time_to_target_s"]
    for name, row in analysis["table"].items():
        mine = sorted((o for o in runs if (o["k"], o["arm"]) == (row["k"], row["arm"])), key=lambda o: o["seed"])
        pairs = [(tta.first_reach(o["curve"], target), x) for o, x in zip(mine, reached)]
        ratios = [a[0] / b[0] for a, b in pairs if a and b and b[0] > 0]
        row["time_ratio_to_trl"] = tta.mean_ci(ratios) if ratios else None
        ours_time = row["mean_curve_time_to_target_s"]
        row["mean_curve_time_ratio_to_trl"] = ours_time / trl_time if ours_time is not None and trl_time else None
        row["final_minus_trl"] = row["final"]["mean"] - trl_row["final"]["mean"]
        text += (f"\n{name}: time to target ÷ TRL's = "
                 + (tta._ci(row["time_ratio_to_trl"], 2) if ratios else "- (not reached by both in any seed)")
                 + (f" by seed; {row['mean_curve_time_ratio_to_trl']:.2f} by the mean curves"
                    if row["mean_curve_time_ratio_to_trl"] else ""))
    text += (f"\n| trl | {tta._ci(trl_row['final'])} | {tta._ci(trl_row['best'])} | "
             f"{tta._ci(trl_row['time_to_target_s'], 1)} ({trl_row['reached']}/{len(trl_runs)}) | "
             f"{tta._ci(trl_row['steps_to_target'], 0)} | | | | "
             + ("not reached" if trl_time is None else f"{trl_time:.1f}")
             + f" | {trl_row['samples_per_s']['mean'] / n:.1f} |")
    analysis["table"]["trl"] = {**trl_row, "groups_per_s": {"mean": trl_row["samples_per_s"]["mean"] / n}}
    return analysis, text


def addition_race(args: argparse.Namespace, argv: Sequence[str] | None) -> dict[str, Any]:
    import time_to_accuracy as tta

    from pipeline.config.schema import TaskConfig
    from pipeline.observe.log import configure_logging
    from pipeline.data.tasks import build_task
    from pipeline.models.warm_start import warm_start

    ours = addition_args(args)
    configure_logging(None, "warning", console=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    load = common.MachineLoad()
    task = build_task(TaskConfig(name="addition", digits=ours.digits, num_prompts=ours.num_prompts,
                                 num_eval_prompts=ours.eval_prompts), ours.digits + 2)
    model_path = str(warm_start(ours.model_shape, task, ours.model_cache, target=ours.warm_start_accuracy))
    trl_runs = []
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp:
        for seed in range(args.seeds) if not args.skip_trl else ():  # TRL first: its vLLM is gone before ours starts
            trl_runs.append(r := trl_in_child(ours, args, model_path, seed, task.prompts,
                                              task.eval_prompts[:ours.eval_prompts], Path(tmp) / f"trl-{seed}"))
            print(f"seed {seed} trl: accuracy {r['first']:.3f} -> {r['final']:.3f}, {r['wall_s']:.1f} s "
                  f"(+{r['eval_s']:.1f} s eval, not counted)", flush=True)
    out = Path(args.out)
    if trl_runs:  # kept even if our side fails after them
        common.write_json(out / f"{BENCHMARK}_addition_{ours.engine}_{ours.model_shape}_trl_runs.json",
                          {"settings": vars(ours), "trl_runs": trl_runs})
    todo = tta.jobs(ours, model_path)
    if ours.engine == "vllm":
        runs = common.run_async(common.runs_on_one_vllm_engine(todo, model_path, max(ours.ks), tta.collect,
                                                               tta.report, tta.BENCHMARK))
    else:
        runs = []
        for job in todo:
            runs.append(r := tta.run_one(job))
            tta.report(r)
    analysis, text = race_analysis(runs, trl_runs, args.target, args.seeds, ours.n)
    hw = common.hardware()
    tag = common.hardware_tag(hw)
    print(text, flush=True)
    machine_load = load.record()
    record = {**common.header(f"{BENCHMARK}_addition", argv), "hardware": hw, "hardware_tag": tag,
              "machine_load": machine_load, "load_note": common.load_note(machine_load, hw["cpu_affinity"]),
              "seeds": args.seeds, "settings": vars(ours), "model_path": model_path,
              "trl": trl_settings(trl_namespace(ours, args)) if trl_runs else None, "analysis": analysis, "table_markdown": text,
              "printed": text,
              "runs": runs, "trl_runs": trl_runs}
    name = f"{BENCHMARK}_addition_{ours.engine}_{ours.model_shape}_{tag}"
    common.write_json(out / f"{name}.json", record)
    tta.plot({**record, "seeds": args.seeds}, out / f"{name}.png")
    print(f"wrote {out / name}.json and .png", flush=True)
    return record


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--trl-child"]:  # trl_in_child's process
        _trl_child(argv[1])
        return {}
    args = parse_args(argv)
    if args.task == "addition" and args.reanalyse:
        import time_to_accuracy as tta

        path = Path(args.reanalyse)
        record = json.loads(path.read_text())
        record["analysis"], record["table_markdown"] = race_analysis(
            record["runs"], record["trl_runs"], record["settings"].get("target"), record["seeds"], record["settings"]["n"])
        record["printed"] = record["table_markdown"]
        print(record["table_markdown"])
        common.write_json(path, record)
        tta.plot(record, path.with_suffix(".png"))
        return record
    if args.task == "addition":
        if not args.skip_trl and importlib.util.find_spec("trl") is None:
            raise SystemExit("error: this benchmark needs TRL: pip install -e '.[bench]' (or pass --skip-trl)")
        return addition_race(args, argv)
    if not args.skip_trl and (importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None):
        raise SystemExit("error: this benchmark needs TRL: pip install -e '.[bench]' (or pass --skip-trl)")
    from pipeline.observe.log import configure_logging
    from pipeline.models.builtin import build_model

    configure_logging(None, "warning", console=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no fork warnings from the tokenizers library
    load = common.MachineLoad()
    model_path = build_model(args.model_shape, args.model_cache, seed=0)
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp:
        for seed in range(args.seeds):
            if not args.skip_trl:
                r = run_trl(args, model_path, seed, Path(tmp) / f"trl-{seed}")
                runs.setdefault(r["system"], []).append(r)
                print(f"seed {seed} trl: {r['wall_s']:.1f} s, {r['samples_per_s']:.1f} samples/s, "
                      f"reward {r['reward_final']:.4f}", flush=True)
            for K in args.staleness_list:
                r = run_pipeline(args, model_path, seed, K, Path(tmp) / f"ours-K{K}-{seed}")
                runs.setdefault(r["system"], []).append(r)
                print(f"seed {seed} {r['system']}: {r['wall_s']:.1f} s, {r['samples_per_s']:.1f} samples/s, "
                      f"reward {r['reward_final']:.4f}", flush=True)
    summary = [aggregate(rs) for rs in runs.values()]
    hw = common.hardware()
    machine_load = load.record()
    note = common.load_note(machine_load, hw["cpu_affinity"])
    trl_row = next((s for s in summary if s["system"] == "trl"), None)
    ratios = {}
    if trl_row is not None:
        for s in summary:
            if s["system"] != "trl":
                ratios[s["system"]] = {
                    "samples_per_s_vs_trl": s["samples_per_s"]["mean"] / trl_row["samples_per_s"]["mean"],
                    "samples_per_s_steady_vs_trl": s["samples_per_s_steady"]["mean"]
                    / trl_row["samples_per_s_steady"]["mean"],
                    "reward_final_minus_trl": s["reward_final"]["mean"] - trl_row["reward_final"]["mean"],
                }
    tbl = common.table(
        ["system", "seeds", "samples", "wall s", "setup s", "samples/s", "steady samples/s", "reward (final)",
         "reward (all steps)", "x TRL samples/s"],
        [[s["system"], len(s["seeds"]), s["samples"], pm(s["wall_s"]), pm(s["setup_s"]), pm(s["samples_per_s"]),
          pm(s["samples_per_s_steady"]), pm(s["reward_final"]), pm(s["reward_mean"]),
          ratios.get(s["system"], {}).get("samples_per_s_vs_trl")] for s in summary])
    update = "full weights" if args.update == "full" else f"LoRA r{args.lora_rank}"
    title = (f"{args.workload} workload: {args.model_shape} model, char_class, B={args.batch_groups} x "
             f"n={args.group_size}, {args.max_new_tokens} tokens, {args.steps} steps, lr {args.lr:g}, {update} | "
             f"{common.hardware_tag(hw)}")
    lines = [f"TRL GRPOTrainer vs pipeline -- {title}", tbl]
    if note:
        lines.append(f"note: {note}")
    text = "\n".join(lines)
    print(text, flush=True)
    workload = "" if args.workload == "default" and args.update == "lora" else f"_{args.workload}_{args.update}"
    name = f"{BENCHMARK}{workload}_{args.model_shape}_{common.hardware_tag(hw)}{'_quick' if args.quick else ''}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(summary, args.batch_groups * args.group_size, title, out / f"{name}.png")
    record = {
        **common.header(BENCHMARK, argv), "hardware": hw, "machine_load": machine_load, "load_note": note,
        "settings": {k: getattr(args, k) for k in (
            "seeds", "workload", "update", "staleness_list", "steps", "batch_groups", "group_size", "max_new_tokens",
            "warmup_steps", "lr", "lora_rank", "lora_alpha", "num_prompts", "model_shape", "quick")},
        "model_path": str(model_path), "target_modules": "all-linear", "task": "char_class",
        "trl": trl_settings(args) if not args.skip_trl else None, "pipeline": pipeline_settings(),
        "summary": summary, "ratios": ratios, "runs": [r for rs in runs.values() for r in rs],
        "table": tbl, "printed": text,
        "files": {"json": str(out / f"{name}.json"), "png": str(out / f"{name}.png")},
    }
    common.write_json(out / f"{name}.json", record)
    print(f"wrote {out / name}.json and .png", flush=True)
    return record


if __name__ == "__main__":
    main()
