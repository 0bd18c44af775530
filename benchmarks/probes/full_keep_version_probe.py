"""Full-weight mode: what keeping a version's weights for a later log-prob check costs a step.

    python benchmarks/probes/full_keep_version_probe.py --device cuda:0 --out runs/probe

A full-mode trainer step copies the whole model to the CPU when `Batch.keep_version` is set
(so a check within max_staleness steps can recompute log-probs under it); the orchestrator
sets it only for the steps that need it. This times training steps of the same batch with
keep_version on and off, alternating (pairs in the same process, same weights' size), and the
copy alone. The model is built offline (shape --shape); the batch is random tokens, so only
the times mean anything. Prints a table and writes <out>/full_keep_version_<hardware>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

from pipeline.models import builtin as models  # noqa: E402
from pipeline.config.schema import LossConfig, TrainerConfig  # noqa: E402
from pipeline.trainer.policy import PolicyTrainer  # noqa: E402
from pipeline.types import Batch, Completion, Generation, GroupRequest, Prompt, RolloutGroup  # noqa: E402


def batch(step: int, groups: int, n: int, tokens: int, vocab: int, seed: int) -> Batch:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = Prompt(id=f"p{g}", text="", token_ids=tuple(int(x) for x in rng.integers(10, vocab, size=16)))
        req = GroupRequest(group_id=step * groups + g, prompt=prompt, n=n, max_new_tokens=tokens)
        comps = tuple(Completion(rng.integers(10, vocab, size=tokens).astype(np.int64),
                                 np.full(tokens, -5.0, dtype=np.float32), "length") for _ in range(n))
        gen = Generation(req, comps, version=step - 1, engine="probe", t_start=0.0, t_end=0.0)
        out.append(RolloutGroup(gen, rng.permutation(n).astype(np.float64), 0.0))
    return Batch(step=step, version=step - 1, groups=tuple(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--pairs", type=int, default=5, help="steps with and without keeping, alternating")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--model-cache", default="runs/models")
    p.add_argument("--out", default=str(common.RESULTS_DIR))
    a = p.parse_args()

    model_dir = models.build_model(a.shape, a.model_cache)
    cfg = TrainerConfig(update="full", device=a.device, dtype=a.dtype, lr=1e-6)
    trainer = PolicyTrainer(model_dir, cfg, LossConfig(), keep_versions=3)
    trainer.setup()
    vocab = trainer.model.config.vocab_size
    params = sum(q.numel() for _, q in trainer._trainable())
    nbytes = sum(q.numel() * q.element_size() for _, q in trainer._trainable())

    def sync() -> None:
        if a.device.startswith("cuda"):
            import torch
            torch.cuda.synchronize(a.device)

    times: dict[bool, list[float]] = {True: [], False: []}
    step = 0
    for i in range(a.pairs + 1):  # the first pair warms up and is not counted
        for keep in (i % 2 == 0, i % 2 == 1):  # alternate which goes first
            step += 1
            b = batch(step, a.groups, a.n, a.tokens, vocab, seed=step)
            b.keep_version = keep
            sync()
            t = time.perf_counter()
            trainer.step(b)
            sync()
            if i:
                times[keep].append(time.perf_counter() - t)
    copies = []
    for _ in range(3):
        sync()
        t = time.perf_counter()
        trainer._keep_current_version()
        sync()
        copies.append(time.perf_counter() - t)

    med = {k: statistics.median(v) for k, v in times.items()}
    res = {
        "shape": a.shape, "dtype": a.dtype, "device": a.device, "trainable_params": params, "weights_bytes": nbytes,
        "batch": {"groups": a.groups, "n": a.n, "tokens": a.tokens},
        "step_s_keep": times[True], "step_s_no_keep": times[False],
        "median_step_s_keep": med[True], "median_step_s_no_keep": med[False],
        "saved_s_per_step": med[True] - med[False], "copy_alone_s": copies,
    }
    tbl = common.table(["keep_version", "median step s", "steps"],
                       [[k, med[k], len(times[k])] for k in (True, False)])
    hw = common.hardware()
    text = (f"full mode, {a.shape} ({params / 1e6:.0f}M parameters, {nbytes / 2**30:.2f} GiB in {a.dtype}), "
            f"{a.groups} groups x {a.n} x {a.tokens} tokens | {common.hardware_tag(hw)}\n{tbl}\n"
            f"a step that keeps its version costs {med[True] - med[False]:+.3f} s; the copy alone "
            f"{statistics.median(copies):.3f} s (median of 3)")
    print(text, flush=True)
    out = Path(a.out)
    path = common.write_json(out / f"full_keep_version_{common.hardware_tag(hw)}.json",
                             {**common.header("full_keep_version", sys.argv[1:]), "hardware": hw, **res, "printed": text})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
