"""vLLM full-weight updates on a GPU: the version written once as a model directory is the one sampled.

Every test is marked `gpu` and skips without CUDA and vLLM. One engine in full-weight mode (the
"small" built-in model, eager mode, 30% of the GPU) serves the module. Versions are the base
model with every linear weight perturbed (a different seed per version), published through an
AdapterStore of kind "full" exactly as the trainer publishes them. Set OUT to a directory to keep
the version-identity matrix and reload times (`vllm_full_weights_identity.json`).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pytest
from test_engine_contract import (
    PROMPT_VOCAB,
    VERSION_SEPARATION,
    VLLM_MEAN_ABS_DLOGPROB,
    VLLM_WARNING_FILTERS,
    VLLMEnv,
    abs_dlogprob,
    vllm_env,
)

from pipeline.store.weights import AdapterStore
from pipeline.config.schema import VLLMEngineConfig
from pipeline.errors import AdapterCorruptError, GenerationError
from pipeline.types import AdapterRef, Generation, GroupRequest, Prompt

pytestmark = [pytest.mark.gpu, *VLLM_WARNING_FILTERS]

VERSIONS = (1, 2)
# Each 2-d weight W gets W.std() * REL_STD * N(0, 1) added. On the CPU (float32, 128 sampled
# tokens) relative noise 0.05 / 0.1 / 0.15 moved the "small" model's sampled-token log-probs by
# 0.09 / 0.17 / 0.25 nats on average; 0.3 keeps every wrong version well above vLLM's bf16 error.
REL_STD = 0.3
ENGINE_CFG = VLLMEngineConfig(gpu_memory_utilization=0.3, enforce_eager=True, max_model_len=2048, max_num_seqs=256)


def perturbed_model(model_path: Path, seed: int) -> Any:
    """The base model with every 2-d (linear / embedding) weight perturbed: float32, on the CPU."""
    import torch

    from pipeline.models.builtin import load_causal_lm

    model = load_causal_lm(model_path, "cpu", "float32")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * REL_STD)
    return model


def publish_full_versions(model_path: Path, root: Path, versions: Sequence[int]) -> dict[int, AdapterRef]:
    """Publish each version as a whole model (save_pretrained) through a full-weight AdapterStore."""
    store = AdapterStore(root, base_model=str(model_path), kind="full")
    refs = {0: AdapterRef.base()}
    for v in versions:
        model = perturbed_model(model_path, seed=1000 + v)
        refs[v] = store.publish(v, lambda d, m=model: m.save_pretrained(str(d), safe_serialization=True))
    return refs


class FullRecomputer:
    """Log-probs of given completions under each version's full weights: transformers, float32."""

    def __init__(self, model_path: Path, refs: dict[int, AdapterRef], device: str) -> None:
        from pipeline.models.builtin import load_causal_lm

        self.device = device
        self.models = {v: load_causal_lm(model_path if v == 0 else Path(ref.path), device, "float32").eval()
                       for v, ref in refs.items()}

    def __call__(self, version: int, gen: Generation) -> list[np.ndarray]:
        from pipeline.models.builtin import completion_logprobs

        prompts = [list(gen.request.prompt.token_ids)] * len(gen.completions)
        completions = [c.token_ids.tolist() for c in gen.completions]
        return completion_logprobs(self.models[version], prompts, completions, self.device)


@dataclass
class Env(VLLMEnv):  # its engine is in full-weight mode
    refs: dict[int, AdapterRef]
    recompute: FullRecomputer
    root: Path


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Any:
    def make(loop: asyncio.AbstractEventLoop, engine: Any, model_path: Path, tmp: Path) -> Env:
        refs = publish_full_versions(model_path, tmp / "versions", VERSIONS)
        return Env(loop, engine, model_path, refs, FullRecomputer(model_path, refs, "cuda:0"), tmp / "versions")

    yield from vllm_env(tmp_path_factory, "vllm-full", ENGINE_CFG, "vllm-full-0", make, full_weights=True)


def group(group_id: int, n: int = 4, max_new_tokens: int = 64, prompt_seed: int = 0) -> GroupRequest:
    ids = tuple(int(x) for x in np.random.default_rng(prompt_seed).integers(0, PROMPT_VOCAB, size=16))
    return GroupRequest(group_id=group_id, prompt=Prompt(f"full-{prompt_seed}", "", ids), n=n,
                        max_new_tokens=max_new_tokens)


def test_each_loaded_version_is_the_one_sampled(env: Env) -> None:
    """Load 1, 2, back to 0, then 2 again: every group is explained by its own version's weights only."""
    order = (1, 2, 0, 2)
    prompts_per_load = 4

    async def sample() -> tuple[list[tuple[int, list[Generation]]], list[float]]:
        out, reloads = [], []
        for k, v in enumerate(order):
            t = time.monotonic()
            await env.engine.load_adapter(env.refs[v])
            reloads.append(time.monotonic() - t)
            assert env.engine.loaded_versions == (() if v == 0 else (v,))
            gens = await asyncio.gather(*(env.engine.generate(group(1000 * k + i, prompt_seed=i), env.refs[v])
                                          for i in range(prompts_per_load)))
            out.append((v, list(gens)))
        return out, reloads

    loads, reloads = env.run(sample())
    candidates = (0, *VERSIONS)
    matrix: dict[str, dict[str, float]] = {}
    for k, (asked, gens) in enumerate(loads):
        assert all(g.version == asked for g in gens)
        matrix[f"load{k}:v{asked}"] = {
            f"v{c}": round(float(np.concatenate([abs_dlogprob(g, env.recompute(c, g)) for g in gens]).mean()), 5)
            for c in candidates}

    out = os.environ.get("OUT")
    if out:
        import torch
        import vllm

        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "vllm_full_weights_identity.json").write_text(json.dumps({
            "what": "full-weight versions: mean |vLLM log-prob - transformers float32 log-prob| per sampled token; "
                    "rows: load order and the version loaded, columns: version recomputed under (v0 = base)",
            "mean_abs_dlogprob": matrix, "reload_s": [round(x, 3) for x in reloads], "vllm": vllm.__version__,
            "gpu": torch.cuda.get_device_name(0), "model": "small (pipeline.models.builtin, random weights)",
            "engine_dtype": ENGINE_CFG.dtype, "rel_std": REL_STD, "enforce_eager": ENGINE_CFG.enforce_eager,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }, indent=1) + "\n")

    for key, row in matrix.items():
        asked = key.split(":")[1]
        best_wrong = min(x for c, x in row.items() if c != asked)
        assert row[asked] < VLLM_MEAN_ABS_DLOGPROB, f"{key}: {row}"
        assert row[asked] < VERSION_SEPARATION * best_wrong, f"{key}: {row} (all: {matrix})"


def test_a_group_for_another_version_is_refused(env: Env) -> None:
    env.run(env.engine.load_adapter(env.refs[1]))
    with pytest.raises(GenerationError, match="asked for version 2"):
        env.run(env.engine.generate(group(5000), env.refs[2]))
    gen = env.run(env.engine.generate(group(5001), env.refs[1]))
    assert gen.version == 1


def test_a_directory_without_weights_is_refused_and_the_old_weights_serve_on(env: Env) -> None:
    env.run(env.engine.load_adapter(env.refs[1]))
    bad_dir = env.root / "v000009-deadbeef"
    bad_dir.mkdir()
    (bad_dir / "config.json").write_text(Path(env.refs[1].path, "config.json").read_text())
    bad = AdapterRef(version=9, name=bad_dir.name, path=str(bad_dir))
    with pytest.raises(AdapterCorruptError, match="no safetensors"):
        env.run(env.engine.load_adapter(bad))
    assert env.engine.loaded_versions == (1,)
    gen = env.run(env.engine.generate(group(6000), env.refs[1]))
    d = {c: float(abs_dlogprob(gen, env.recompute(c, gen)).mean()) for c in (0, *VERSIONS)}
    assert d[1] < VLLM_MEAN_ABS_DLOGPROB and d[1] < VERSION_SEPARATION * min(d[0], d[2]), d


def shared_version(version: int, model: Any) -> tuple[Any, AdapterRef]:
    """`model`'s weights packed on cuda:0 by this process and shared as trainer.publish = "memory"
    shares them: (the packed buffer, which must outlive the load; the ref)."""
    from pipeline.engines import shared_weights

    packed = shared_weights.pack(version, model.to("cuda:0").named_parameters())
    return packed, AdapterRef.in_memory(version, shared_weights.share(packed))


def test_a_version_shared_in_gpu_memory_is_the_one_sampled(env: Env) -> None:
    """Version 1's weights through CUDA IPC (not its directory): the engine samples version 1 after
    the load, not version 2 it held before, and a buffer whose checksum is not the producer's is refused."""
    packed, ref = shared_version(1, perturbed_model(env.model_path, seed=1001))  # version 1's weights
    env.run(env.engine.load_adapter(env.refs[2]))
    env.run(env.engine.load_adapter(ref))
    assert env.engine.loaded_versions == (1,)
    gens = [env.run(env.engine.generate(group(7000 + i, prompt_seed=i), ref)) for i in range(4)]
    d = {c: float(np.concatenate([abs_dlogprob(g, env.recompute(c, g)) for g in gens]).mean()) for c in (0, *VERSIONS)}
    assert d[1] < VLLM_MEAN_ABS_DLOGPROB and d[1] < VERSION_SEPARATION * min(d[0], d[2]), d

    bad = AdapterRef.in_memory(3, {**ref.shared, "version": 3, "checksum": "0" * 32})
    with pytest.raises(AdapterCorruptError, match="checksum"):
        env.run(env.engine.load_adapter(bad))
    env.run(env.engine.load_adapter(env.refs[2]))  # and the engine loads on
    assert env.engine.loaded_versions == (2,)
    del packed


def test_an_in_flight_swap_samples_each_token_with_the_weights_held_when_it_was_sampled(env: Env) -> None:
    """in_flight: version 2 loads while a long group of version 1 runs. The group keeps label 1 and
    names 2 as its last version; in each completion the tokens before one point are version 1's
    samples and those after it version 2's, with version 2's log-probs over a context version 2
    recomputed (the recomputation runs each version over the whole sequence)."""
    env.run(env.engine.load_adapter(env.refs[1]))

    async def swap_mid_group() -> Generation:
        running = asyncio.ensure_future(env.engine.generate(group(8000, n=8, max_new_tokens=1024), env.refs[1]))
        await asyncio.sleep(0.2)
        assert not running.done(), "the group ended before the swap: make it longer"
        await env.engine.load_adapter(env.refs[2])
        return await running

    env.engine.in_flight = True
    try:
        gen = env.run(swap_mid_group())
    finally:
        env.engine.in_flight = False
    assert (gen.version, gen.last_version, gen.spans_versions) == (1, 2, True)
    assert env.engine.loaded_versions == (2,)
    before, after = env.recompute(1, gen), env.recompute(2, gen)
    splits, spans = [], []
    for c, lp1, lp2 in zip(gen.completions, before, after):
        d1, d2 = np.abs(c.logprobs - lp1), np.abs(c.logprobs - lp2)
        # the split that explains the completion best: version 1 before it, version 2 from it on
        cost = np.concatenate([[0.0], np.cumsum(d1)]) + np.concatenate([np.cumsum(d2[::-1])[::-1], [0.0]])
        s = int(np.argmin(cost))
        if s >= 16 and len(c.logprobs) - s >= 16:  # long enough on both sides to tell the versions apart
            splits.append(s)
            spans.append((float(d1[:s].mean()), float(d2[:s].mean()), float(d2[s:].mean()), float(d1[s:].mean())))
    assert len(splits) >= 2, f"too few completions ran across the swap: {[len(c.logprobs) for c in gen.completions]}"
    assert max(splits) - min(splits) <= 2, splits  # the group's completions decode in step: one swap point
    for own_before, other_before, own_after, other_after in spans:
        assert own_before < VLLM_MEAN_ABS_DLOGPROB and own_before < VERSION_SEPARATION * other_before, spans
        assert own_after < VLLM_MEAN_ABS_DLOGPROB and own_after < VERSION_SEPARATION * other_after, spans


@pytest.mark.parametrize("publish,swap", [("files", "drain"), ("memory", "drain"), ("memory", "in_flight")])
def test_a_full_weight_run_trains_and_every_version_reaches_the_engine(env: Env, tmp_path: Path, publish: str,
                                                                       swap: str) -> None:
    """A whole run with trainer.update = "full": vLLM and the trainer share GPU 0, K = 1, each version
    through files or through the trainer's GPU memory (trainer.publish), the groups in flight drained
    before each load or carried across it (pipeline.full_weight_swap).

    Every check (each second step) recomputes the trainer's log-probs of groups under the version
    that sampled them (with in-flight swaps, only groups no swap reached); if the engine had kept
    older weights, they would disagree more and more.
    """
    from pipeline.config.io import load_config
    from pipeline.loop.orchestrator import Pipeline

    steps = 8
    cfg = load_config(None, {
        "out": str(tmp_path / "run"), "model.path": str(env.model_path), "engine.kind": "vllm",
        "engine.devices": ["cuda:0"], "trainer.device": "cuda:0", "trainer.update": "full", "trainer.lr": 1e-4,
        "engine.vllm.enforce_eager": True, "engine.vllm.gpu_memory_utilization": 0.3,
        "engine.vllm.max_model_len": 512, "pipeline.steps": steps, "pipeline.batch_groups": 8,
        # in flight, whole batches may span a swap (no group to check): check every step then
        "pipeline.max_staleness": 1, "pipeline.logprob_check_every": 1 if swap == "in_flight" else 2,
        "sampling.n": 4, "log.progress": False,
        "trainer.publish": publish, "pipeline.full_weight_swap": swap})
    p = Pipeline(cfg, console=False)
    summary = env.run(p.run())
    checks = [r["check/mean_abs_diff"] for r in p.metrics_rows if "check/mean_abs_diff" in r]
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        name = publish if swap == "drain" else f"{publish}_{swap}"
        (Path(out) / f"vllm_full_weights_run_{name}.json").write_text(json.dumps({
            "summary": summary, "checks_mean_abs_diff": checks, "publish_s": [r.get("time/publish_s") for r in p.metrics_rows],
            "drain_s": [r.get("adapter/drain_s") for r in p.metrics_rows],
            "publish_to_loaded_s": [r.get("adapter/publish_to_loaded_s") for r in p.metrics_rows],
            "spanning_versions": [r.get("rollout/spanning_versions") for r in p.metrics_rows],
        }, indent=1, default=str) + "\n")
    assert summary["error"] is None and summary["accounting_ok"] and summary["steps"] == steps, summary
    assert summary["staleness_max"] <= 1
    assert summary["drain_s_mean"] is not None
    assert len(checks) >= 3, p.metrics_rows
    assert max(checks) < VLLM_MEAN_ABS_DLOGPROB, checks
    if swap == "in_flight":  # groups ran across swaps, and none of them failed for it
        assert summary["groups_spanning_versions"] > 0 and summary["groups_failed"] == {}, summary
    else:
        assert summary["groups_spanning_versions"] == 0, summary
    published = sorted(Path(tmp_path / "run" / "adapters").glob("v*/model*.safetensors"))
    assert published, "full-weight versions are model directories"
    if publish == "memory":  # no version went through the disk but the last, written at the end
        assert [d.parent.name[:7] for d in published] == [f"v{steps:06d}"], published
