"""Full weights on one GPU: a version through the filesystem against one through CUDA IPC.

    python benchmarks/probes/full_weight_sync_probe.py --shapes qwen2.5-0.5b,qwen2.5-1.5b --out DIR

For each built-in shape, a full-weight PolicyTrainer (bf16) and vLLM (an AsyncLLM whose engine
core is a second process) share one GPU. Each repeat trains a step, then brings that version to
vLLM both ways, the order alternating:
- files, as the pipeline does today: the store publishes the version (save_pretrained, the
  sha256 of every file, fsync, rename), the adapter loop's verify reads it back, and vLLM pauses
  and reloads its weights from the directory (`reload_weights`, as pipeline.engines.vllm does);
- memory: the trainer packs its weights into one buffer (pipeline.engines.shared_weights.pack),
  vLLM pauses and its worker opens the buffer's IPC handle, checks it and reloads from it.
After each load vLLM samples completions of one prompt and the trainer recomputes their
log-probs: a small mean |Δ| means vLLM holds the version just trained. The control is the same
figure before the load, with vLLM still on the version before.

Prints each part's median seconds (the first repeat warms up and is left out) and each way's
share of a train step; writes <out>/full_weight_sync_<hardware>.json after every shape.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from full_keep_version_probe import batch  # noqa: E402

from pipeline.config.schema import LossConfig, TrainerConfig  # noqa: E402
from pipeline.engines import shared_weights  # noqa: E402
from pipeline.engines.vllm import ENV_DEFAULTS, sampled_logprobs  # noqa: E402
from pipeline.models import builtin as models  # noqa: E402
from pipeline.store.weights import AdapterStore  # noqa: E402
from pipeline.trainer.policy import PolicyTrainer  # noqa: E402

WORKER = "pipeline.engines.shared_weights.SharedWeightsWorker"
PROMPT = list(range(40, 72))  # 32 byte ids


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


async def identity(llm: Any, trainer: PolicyTrainer, device: str, seed: int) -> float:
    """Mean |vLLM - trainer| log-prob over 4 completions vLLM samples now (small: same weights)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(n=4, max_tokens=32, temperature=1.0, top_p=1.0, logprobs=0, flat_logprobs=True,
                            detokenize=False, seed=seed, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    final = None
    async for out in llm.generate(TokensPrompt(prompt_token_ids=PROMPT), params, request_id=f"id-{seed}"):
        final = out
    tokens = [list(c.token_ids) for c in final.outputs]
    engine = [sampled_logprobs(c.token_ids, c.logprobs) for c in final.outputs]
    trainer.model.eval()
    mine = models.completion_logprobs(trainer.model, [PROMPT] * len(tokens), tokens, device)
    trainer.model.train()
    return float(np.mean([np.abs(a - b).mean() for a, b in zip(engine, mine)]))


async def by_files(llm: Any, trainer: PolicyTrainer, store: AdapterStore, version: int) -> dict[str, float]:
    t0 = time.perf_counter()
    ref = store.publish(version, trainer.save_adapter)
    t1 = time.perf_counter()
    store.verify_dir(ref.path)
    t2 = time.perf_counter()
    await llm.pause_generation(mode="wait")
    try:
        await llm.collective_rpc("reload_weights", kwargs={"weights_path": str(ref.path)})
    finally:
        await llm.resume_generation()
    t3 = time.perf_counter()
    return {"publish_s": t1 - t0, "verify_s": t2 - t1, "load_s": t3 - t2, "total_s": t3 - t0}


async def by_memory(llm: Any, trainer: PolicyTrainer, version: int) -> dict[str, float]:
    import torch

    t0 = time.perf_counter()
    packed = shared_weights.pack(version, trainer.model.named_parameters())
    payload = shared_weights.share(packed)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    await llm.pause_generation(mode="wait")
    try:
        [reply] = await llm.collective_rpc("load_shared_weights", args=(payload,))
    finally:
        await llm.resume_generation()
    t2 = time.perf_counter()
    assert reply["checksum"] == packed.checksum and reply["version"] == version, reply
    del packed  # the worker's load has returned: the buffer may go
    torch.cuda.ipc_collect()  # and its memory with it, now that the worker let go of the handle
    return {"pack_s": t1 - t0, "load_s": t2 - t1, "worker_check_s": reply["open_check_s"],
            "worker_reload_s": reply["reload_s"], "total_s": t2 - t0}


async def probe_shape(shape: str, a: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    import torch
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    model_dir = models.build_model(shape, a.model_cache)
    trainer = PolicyTrainer(model_dir, TrainerConfig(update="full", device=a.device, dtype="bfloat16", lr=a.lr,
                                                     micro_batch_sequences=a.micro_batch),
                            LossConfig(), keep_versions=1)
    trainer.setup()
    vocab = trainer.model.config.vocab_size
    nbytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=str(model_dir), dtype="bfloat16", seed=0, gpu_memory_utilization=a.gpu_memory_utilization,
        enforce_eager=True, max_model_len=1024, worker_extension_cls=WORKER))
    store = AdapterStore(scratch / f"store-{shape}", base_model=str(model_dir), keep_last=2, kind="full")
    rows: list[dict[str, Any]] = []
    try:
        for r in range(a.repeats + 1):
            order = ("files", "memory") if r % 2 == 0 else ("memory", "files")
            row: dict[str, Any] = {"repeat": r, "order": list(order)}
            for way in order:
                version = 2 * r + (1 if way == order[0] else 2)
                b = batch(version, a.groups, a.n, a.tokens, vocab, seed=version)
                torch.cuda.synchronize()
                t = time.perf_counter()
                trainer.step(b)
                torch.cuda.synchronize()
                row.setdefault("step_s", []).append(time.perf_counter() - t)
                before = await identity(llm, trainer, a.device, seed=1000 + version)
                parts = (await by_files(llm, trainer, store, version) if way == "files"
                         else await by_memory(llm, trainer, version))
                after = await identity(llm, trainer, a.device, seed=2000 + version)
                row[way] = {**parts, "mean_abs_dlogp_before_load": before, "mean_abs_dlogp_after_load": after}
            rows.append(row)
            print(f"[{shape}] repeat {r}: step {statistics.mean(row['step_s']):.3f} s; files "
                  f"{row['files']['total_s']:.3f} s (|dlogp| {row['files']['mean_abs_dlogp_before_load']:.4f} -> "
                  f"{row['files']['mean_abs_dlogp_after_load']:.4f}); memory {row['memory']['total_s']:.3f} s "
                  f"(|dlogp| {row['memory']['mean_abs_dlogp_before_load']:.4f} -> "
                  f"{row['memory']['mean_abs_dlogp_after_load']:.4f})", flush=True)
    finally:
        llm.shutdown()
        del trainer
        torch.cuda.empty_cache()
    timed = rows[1:]  # the first repeat warms both ways up
    step = median([s for r in timed for s in r["step_s"]])
    summary: dict[str, Any] = {"step_s": step}
    for way in ("files", "memory"):
        keys = [k for k in timed[0][way] if k.endswith("_s")]
        summary[way] = {k: median([r[way][k] for r in timed]) for k in keys}
        summary[way]["share_of_step"] = summary[way]["total_s"] / step if step else None
        summary[way]["mean_abs_dlogp_after_load_max"] = max(r[way]["mean_abs_dlogp_after_load"] for r in timed)
        summary[way]["mean_abs_dlogp_before_load_min"] = min(r[way]["mean_abs_dlogp_before_load"] for r in timed)
    summary["memory_over_files"] = summary["memory"]["total_s"] / summary["files"]["total_s"]
    return {"shape": shape, "weights_bytes": nbytes, "summary": summary, "repeats": rows}


async def main_async(a: argparse.Namespace) -> None:
    hw = common.hardware()
    out = Path(a.out) / f"full_weight_sync_{common.hardware_tag(hw)}.json"
    record: dict[str, Any] = {**common.header("full_weight_sync_probe", sys.argv[1:]), "hardware": hw,
                              "settings": vars(a), "shapes": []}
    with tempfile.TemporaryDirectory(prefix="fws-") as tmp:
        for shape in a.shapes.split(","):
            res = await probe_shape(shape, a, Path(tmp))
            record["shapes"].append(res)
            common.write_json(out, record)  # kept after each shape: a cut-off call keeps what it measured
            s = res["summary"]
            print(f"[{shape}] {res['weights_bytes'] / 1e9:.2f} GB of weights; step {s['step_s']:.3f} s")
            for way in ("files", "memory"):
                parts = ", ".join(f"{k.removesuffix('_s')} {v:.3f}" for k, v in s[way].items() if k.endswith("_s"))
                print(f"  {way:6s} {parts} s; {100 * s[way]['share_of_step']:.0f}% of a step; "
                      f"|dlogp| after load <= {s[way]['mean_abs_dlogp_after_load_max']:.4f}, "
                      f"before >= {s[way]['mean_abs_dlogp_before_load_min']:.4f}")
            print(f"  memory / files: {s['memory_over_files']:.2f}", flush=True)
    print(f"wrote {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b", help="built-in shapes, comma-separated")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vLLM's share of the GPU")
    p.add_argument("--repeats", type=int, default=4, help="timed repeats per shape (one more warms up)")
    p.add_argument("--lr", type=float, default=1e-4, help="large enough that a step moves the log-probs")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8, help="trainer.micro_batch_sequences")
    p.add_argument("--model-cache", default="runs/models")
    p.add_argument("--out", default=str(common.RESULTS_DIR))
    a = p.parse_args()
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    asyncio.run(main_async(a))


if __name__ == "__main__":
    main()
