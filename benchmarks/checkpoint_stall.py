"""How long the train loop stands still for a checkpoint: the trainer's state written with the loop
waiting (`save_state`, pipeline.checkpoint_behind = false) against copied and written behind the
steps (`begin_save_state`, the default).

    python benchmarks/checkpoint_stall.py                                   # small shape, full weights, CPU
    python benchmarks/checkpoint_stall.py --shape qwen2.5-0.5b --device cuda:0 --dtype bfloat16

For each of --repeats rounds, on one PolicyTrainer after a warm-up step:
  waited       save_state: the whole write (tensors to host, serialise, hash, fsync)
  copied       begin_save_state: the copy the loop waits for now
  behind       from begin_save_state until the files are in place (the marker), the next step running
  step         a training step alone, and the step right after begin_save_state (the write beside it)
Writes checkpoint_stall_<shape>_<update>_<hardware>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (the benchmarks' shared helpers sit next to this script)


def batch(step: int, groups: int, n: int, prompt_len: int, completion_len: int, vocab: int):
    """`groups` groups of n random completions with distinct rewards (every advantage nonzero)."""
    from pipeline.types import Batch, Completion, Generation, GroupRequest, Prompt, RolloutGroup

    rng = np.random.default_rng(step)
    out = []
    for g in range(groups):
        ids = tuple(int(t) for t in rng.integers(1, vocab - 1, size=prompt_len))
        request = GroupRequest(group_id=step * groups + g, prompt=Prompt(id=f"p{g}", text="", token_ids=ids), n=n,
                               max_new_tokens=completion_len)
        completions = tuple(Completion(token_ids=rng.integers(1, vocab - 1, size=completion_len).astype(np.int64),
                                       logprobs=np.full(completion_len, -10.0, dtype=np.float32),
                                       finish_reason="length") for _ in range(n))
        generation = Generation(request=request, completions=completions, version=step - 1, engine="bench",
                                t_start=0.0, t_end=0.0)
        out.append(RolloutGroup(generation=generation, rewards=rng.permutation(n).astype(np.float64), t_scored=0.0))
    return Batch(step=step, version=step - 1, groups=tuple(out))


def wait_marker(directory: Path, timeout: float = 600.0) -> float:
    from pipeline.store.checkpoint import STATE_WRITTEN

    t0 = time.monotonic()
    while not (directory / STATE_WRITTEN).exists():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"no {STATE_WRITTEN} in {directory} after {timeout} s")
        time.sleep(0.005)
    return time.monotonic()


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="small", help="a built-in model shape (tiny, small, qwen2.5-0.5b)")
    ap.add_argument("--update", choices=["full", "lora"], default="full")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32, help="completion length")
    ap.add_argument("--scratch", type=Path, default=None, help="where the model and states go (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)

    from pipeline.config.schema import LossConfig, TrainerConfig
    from pipeline.models import builtin as models
    from pipeline.trainer.policy import PolicyTrainer

    with tempfile.TemporaryDirectory(prefix="checkpoint_stall-", dir=args.scratch) as scratch:
        root = Path(scratch)
        model = models.build_model(args.shape, root / "models")
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        cfg = TrainerConfig(device=args.device, update=args.update, dtype=args.dtype, lora_rank=16)
        trainer = PolicyTrainer(model, cfg, LossConfig(), seed=0, keep_versions=1)
        trainer.setup()
        step = 1
        trainer.step(batch(step, args.groups, args.n, 16, args.tokens, vocab))  # moments exist from here
        rounds = []
        for r in range(args.repeats):
            step += 1
            t = time.monotonic()
            trainer.step(batch(step, args.groups, args.n, 16, args.tokens, vocab))
            step_alone = time.monotonic() - t
            waited_dir, behind_dir = root / f"waited-{r}", root / f"behind-{r}"
            waited_dir.mkdir()
            behind_dir.mkdir()
            t = time.monotonic()
            trainer.save_state(waited_dir)
            waited = time.monotonic() - t
            t0 = time.monotonic()
            trainer.begin_save_state(behind_dir)
            copied = time.monotonic() - t0
            step += 1
            t = time.monotonic()
            trainer.step(batch(step, args.groups, args.n, 16, args.tokens, vocab))
            step_beside = time.monotonic() - t
            behind = wait_marker(behind_dir) - t0
            size = sum(p.stat().st_size for p in waited_dir.iterdir())
            rounds.append({"waited_s": waited, "copied_s": copied, "behind_s": behind, "step_alone_s": step_alone,
                           "step_beside_write_s": step_beside, "state_bytes": size})
            print(f"round {r}: waited {waited:.3f} s, copied {copied:.3f} s, written behind in {behind:.3f} s; "
                  f"step {step_alone:.3f} s alone, {step_beside:.3f} s beside the write ({size / 1e6:.1f} MB)",
                  flush=True)
        trainer.close()

    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    hw = common.hardware(gpus=args.device.startswith("cuda"))
    printed = common.table(["shape", "update", "device", "state MB", "waited s", "copied s", "behind s",
                            "step alone s", "step beside s"],
                           [[args.shape, args.update, args.device, med["state_bytes"] / 1e6, med["waited_s"],
                             med["copied_s"], med["behind_s"], med["step_alone_s"], med["step_beside_write_s"]]])
    print(printed)
    result = {**common.header("checkpoint_stall", argv),
              "hardware": hw, "settings": {k: str(v) for k, v in vars(args).items()},
              "rounds": rounds, "median": med, "stall_ratio": med["copied_s"] / med["waited_s"], "printed": printed}
    path = args.out / f"checkpoint_stall_{args.shape}_{args.update}_{common.hardware_tag(hw)}{args.tag}.json"
    print(f"wrote {common.write_json(path, result)}")
    return path


if __name__ == "__main__":
    main()
