"""A training step's time against the trainer's world size (FSDP2 ranks, `trainer.devices`).

    python benchmarks/trainer_scaling.py --devices cuda:1,cuda:2,cuda:3     # vLLM may hold cuda:0
    python benchmarks/trainer_scaling.py --devices cuda:0 --updates lora full  # one GPU: FSDP2's cost at 1 rank
    python benchmarks/trainer_scaling.py --devices cpu,cpu --shape tiny --groups 4 --n 4 --tokens 16  # CPU smoke

For each update mode it times the one-process trainer on the first device (the baseline), then
trainer ranks on the first 1, 2, ... devices: `--steps` steps after one warm-up step, each on a
fresh batch of --groups x --n completions of --tokens tokens after a --prompt-tokens prompt (issue
22's B = 32 x n = 8 x 128 by default), LoRA rank --lora-rank. A step is the pipeline's publish
too: the step and the version's save (`step_and_save`, rank 0 writing it).

Reported per (update, ranks): the median step seconds as the pipeline sees it, the slowest rank's
own step time (train/rank_step_max_s), the save, samples per second, and the speed-up over the
baseline measured in the same run. Writes trainer_scaling_<shape>_<hardware><tag>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import hardware, hardware_tag, header, parse_list, table, write_json  # noqa: E402


def _batch(seed: int, args: argparse.Namespace, vocab: int):
    """Groups of random completions (rewards distinct within a group, behaviour log-probs -5)."""
    import numpy as np

    from pipeline.types import Batch, Completion, Generation, GroupRequest, Prompt, RolloutGroup

    rng = np.random.default_rng(seed)
    groups = []
    for g in range(args.groups):
        ids = tuple(int(x) for x in rng.integers(0, vocab, size=args.prompt_tokens))
        request = GroupRequest(group_id=seed * 10_000 + g, prompt=Prompt(id=f"p{g}", text="", token_ids=ids),
                               n=args.n, max_new_tokens=args.tokens)
        comps = tuple(Completion(token_ids=rng.integers(0, vocab, size=args.tokens).astype(np.int64),
                                 logprobs=np.full(args.tokens, -5.0, dtype=np.float32), finish_reason="length")
                      for _ in range(args.n))
        gen = Generation(request=request, completions=comps, version=0, engine="bench", t_start=0.0, t_end=0.0)
        groups.append(RolloutGroup(generation=gen, rewards=rng.permutation(args.n).astype(np.float64), t_scored=0.0))
    return Batch(step=seed, version=0, groups=tuple(groups))


def time_trainer(trainer, args: argparse.Namespace, vocab: int) -> dict:
    """Setup, one warm-up step, then --steps timed steps with their saves."""
    t0 = time.monotonic()
    trainer.setup()
    setup_s = time.monotonic() - t0
    steps, ranks, saves = [], [], []
    try:
        with tempfile.TemporaryDirectory(prefix="trainer_scaling-") as tmp:
            for i in range(args.steps + 1):
                d = Path(tmp) / f"v{i}"
                d.mkdir()
                batch = _batch(i + 1, args, vocab)
                t = time.monotonic()
                stats, save_s = trainer.step_and_save(batch, d)
                if i:  # the first step warms up (allocator, kernels, NCCL's first collectives)
                    steps.append(time.monotonic() - t)
                    saves.append(save_s)
                    ranks.append(stats.metrics.get("train/rank_step_max_s", stats.t_end - stats.t_start))
    finally:
        trainer.close()
    samples = args.groups * args.n
    med = statistics.median(steps)
    return {"setup_s": setup_s, "step_s": med, "step_s_all": steps, "rank_step_max_s": statistics.median(ranks),
            "save_s": statistics.median(saves), "samples_per_s": samples / med}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="cuda:0", help="comma-separated; ranks take the first 1, 2, ... of them")
    ap.add_argument("--shape", default="qwen2.5-0.5b", help="a built-in model shape (pipeline.models.builtin.SHAPES)")
    ap.add_argument("--model", default="", help="a model directory instead of a built-in shape")
    ap.add_argument("--updates", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=32, help="trainer.micro_batch_sequences")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", help="trainer.dtype (full weights; LoRA trains in float32)")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "pipeline-models"))
    ap.add_argument("--out", default="runs/benchmarks")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    devices = parse_list(args.devices, str)

    from pipeline.models import builtin as models
    from pipeline.loop.build import model_config_value
    from pipeline.config.schema import LossConfig, TrainerConfig
    from pipeline.trainer.process import ProcessTrainer
    from pipeline.trainer.ranks import RankedTrainer

    model = args.model or str(models.build_model(args.shape, args.cache))
    vocab = int(model_config_value(model, "vocab_size") or 256) - 1
    dtype = "float32" if devices[0] == "cpu" else args.dtype
    loss = LossConfig(norm_tokens=args.tokens)
    results = []
    for update in args.updates:
        base = dict(update=update, lora_rank=args.lora_rank, micro_batch_sequences=args.micro_batch, dtype=dtype,
                    lr=1e-5, threads=1 if devices[0] == "cpu" else 0)
        runs = [("one process", 1, ProcessTrainer(model, TrainerConfig(device=devices[0], **base), loss, seed=0))]
        runs += [("ranks", w, RankedTrainer(model, TrainerConfig(devices=tuple(devices[:w]), **base), loss, seed=0))
                 for w in range(1, len(devices) + 1)]
        baseline = None
        for kind, world, trainer in runs:
            r = {"update": update, "trainer": kind, "world_size": world, "devices": devices[:world],
                 **time_trainer(trainer, args, vocab)}
            baseline = baseline or r["step_s"]
            r["speedup_vs_one_process"] = baseline / r["step_s"]
            results.append(r)
            print(f"{update} {kind} x{world}: step {r['step_s']:.3f} s, {r['samples_per_s']:.1f} samples/s", flush=True)

    hw = hardware(gpus=devices[0] != "cpu")
    print(table(["update", "trainer", "ranks", "step s", "slowest rank s", "save s", "samples/s", "x one process"],
                [[r["update"], r["trainer"], r["world_size"], r["step_s"], r["rank_step_max_s"], r["save_s"],
                  r["samples_per_s"], r["speedup_vs_one_process"]] for r in results]))
    name = f"trainer_scaling_{Path(model).name if args.model else args.shape}_{hardware_tag(hw)}{args.tag}.json"
    path = write_json(Path(args.out) / name, {
        **header("trainer_scaling", argv), "hardware": hw, "model": model, "shape": args.shape,
        "workload": {"groups": args.groups, "n": args.n, "tokens": args.tokens, "prompt_tokens": args.prompt_tokens,
                     "lora_rank": args.lora_rank, "micro_batch_sequences": args.micro_batch, "dtype": dtype,
                     "steps": args.steps, "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE", "0 (ours)")},
        "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
