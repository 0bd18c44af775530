"""The Engine contract (pipeline.engines.base), checked on every engine: simulated, transformers, vLLM.

Each engine starts once per module and lives on one event loop owned by its fixture (vLLM's
AsyncLLM must stay on the loop that created it); tests run coroutines on it with `h.run(...)`.
The vLLM param is marked `gpu` and skipped without CUDA or vLLM. Real engines are checked
against a recomputation by transformers (+ peft) in float32 on the same weights; the simulated
engine has no weights, so those tests skip it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

import numpy as np
import pytest

from pipeline.config.schema import SamplingConfig, SimulatedEngineConfig, TransformersEngineConfig, VLLMEngineConfig
from pipeline.engines.base import Engine
from pipeline.types import AdapterRef, Generation, GroupRequest, Prompt

# CPU transformers engine vs recomputation: both float32 on the same weights, so only summation
# order differs (KV cache and left padding against one full pass): differences are ~1e-6.
TRANSFORMERS_MAX_ABS_DLOGPROB = 1e-3
# vLLM runs bfloat16, the recomputation float32: see docs/architecture.md#measurements-behind-the-code for the
# agreement measured on a 0.5B model; the "small" test model has far smaller logits, so 0.1 is loose.
VLLM_MEAN_ABS_DLOGPROB = 0.1
# The version an engine was asked for must explain its log-probs far better than any other
# candidate: mean |d| under it below this fraction of the best wrong candidate's.
VERSION_SEPARATION = 0.25

MAX_STALENESS = 1
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT_VOCAB = 256  # the built-in byte tokenizer's bytes: ids below its special tokens

# Third-party warnings raised inside vLLM's import and start-up are not ours to fail on;
# RuntimeWarning (a coroutine never awaited) still fails the test.
VLLM_WARNING_FILTERS = [pytest.mark.filterwarnings(f"ignore::{w}") for w in
                        ("DeprecationWarning", "PendingDeprecationWarning", "FutureWarning", "UserWarning")]


def close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel and await what a module's engine left running on `loop`, then close it."""
    leftover = asyncio.all_tasks(loop)
    for task in leftover:
        task.cancel()
    if leftover:
        loop.run_until_complete(asyncio.gather(*leftover, return_exceptions=True))
    loop.close()


def vllm_unavailable() -> str | None:
    """Why the vLLM engine cannot run here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (pip install 'pipeline[vllm]')"
    import torch

    if not torch.cuda.is_available():
        return "vLLM needs a CUDA GPU and none is available"
    return None


@dataclass
class VLLMEnv:
    """A GPU module's one started vLLM engine (the "small" model on cuda:0) and the loop it lives on."""

    loop: asyncio.AbstractEventLoop
    engine: Any  # pipeline.engines.vllm.VLLMEngine
    model_path: Path

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)


E = TypeVar("E", bound=VLLMEnv)


def vllm_env(tmp_path_factory: pytest.TempPathFactory, basename: str, cfg: VLLMEngineConfig, name: str,
             make: Callable[[asyncio.AbstractEventLoop, Any, Path, Path], E], **engine_kw: Any) -> Iterator[E]:
    """Body of a vLLM GPU module's `env` fixture: skip without CUDA or vLLM; else build the "small"
    model in a fresh temporary directory `basename`, start a VLLMEngine on it (cuda:0, max_staleness 1)
    on a new event loop, yield make(loop, engine, model_path, tmp), then close the engine and the loop.

    `make` publishes the module's versions and builds its recomputer; it runs once the engine has
    started (the GPU already holds the engine's share) and inside the try, so a failure in it still
    closes the engine."""
    if reason := vllm_unavailable():
        pytest.skip(reason)
    from pipeline.engines.vllm import VLLMEngine
    from pipeline.models.builtin import build_model

    tmp = tmp_path_factory.mktemp(basename)
    loop = asyncio.new_event_loop()
    engine = None
    try:
        model_path = build_model("small", tmp / "models")
        engine = VLLMEngine(model_path, sampling=SamplingConfig(), cfg=cfg, device="cuda:0",
                            max_staleness=1, name=name, **engine_kw)
        loop.run_until_complete(engine.start())
        yield make(loop, engine, model_path, tmp)
    finally:
        if engine is not None:
            loop.run_until_complete(engine.close())
        close_loop(loop)


# --------------------------------------------------------------------------- adapters and recomputation


def publish_adapters(model_path: Path, root: Path, versions: Sequence[int], *, rank: int, b_std: float,
                     device: str = "cpu") -> dict[int, AdapterRef]:
    """Publish one random LoRA per version (distinct seeds) through an AdapterStore; 0 is the base."""
    import torch
    from peft import LoraConfig, get_peft_model

    from pipeline.store.weights import AdapterStore
    from pipeline.models.builtin import load_causal_lm

    model = get_peft_model(load_causal_lm(model_path, device, "float32"),
                           LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=LORA_TARGETS))
    store = AdapterStore(root)
    refs = {0: AdapterRef.base()}
    for v in versions:
        gen = torch.Generator(device=device).manual_seed(1000 + v)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_A" in name:
                    bound = 1.0 / math.sqrt(p.shape[1])
                    p.copy_((torch.rand(p.shape, generator=gen, device=device) * 2 - 1) * bound)
                elif "lora_B" in name:  # peft starts B at 0 (no change); a random B makes each version distinct
                    p.copy_(torch.randn(p.shape, generator=gen, device=device) * b_std)
        refs[v] = store.publish(v, write=lambda d: model.save_pretrained(str(d)))
    return refs


class Recomputer:
    """Log-probs of given completions under the base model or one adapter: transformers + peft, float32."""

    def __init__(self, model_path: Path, adapters: Mapping[int, AdapterRef], device: str) -> None:
        from peft import PeftModel

        from pipeline.models.builtin import load_causal_lm

        self.device = device
        self.names = {v: ref.name for v, ref in adapters.items() if v != 0}
        base = load_causal_lm(model_path, device, "float32")
        model = None
        for v, ref in adapters.items():
            if v == 0:
                continue
            if model is None:
                model = PeftModel.from_pretrained(base, ref.path, adapter_name=ref.name)
            else:
                model.load_adapter(ref.path, adapter_name=ref.name)
        assert model is not None, "recomputation needs at least one adapter"
        self.model = model.eval()

    def __call__(self, version: int, gen: Generation) -> list[np.ndarray]:
        from pipeline.models.builtin import completion_logprobs

        prompts = [list(gen.request.prompt.token_ids)] * len(gen.completions)
        completions = [c.token_ids.tolist() for c in gen.completions]
        if version == 0:
            with self.model.disable_adapter():
                return completion_logprobs(self.model, prompts, completions, self.device)
        self.model.set_adapter(self.names[version])
        return completion_logprobs(self.model, prompts, completions, self.device)


def abs_dlogprob(gen: Generation, recomputed: list[np.ndarray]) -> np.ndarray:
    """|engine log-prob - recomputed log-prob| over every token of the group: [sum of T]."""
    return np.abs(np.concatenate([c.logprobs for c in gen.completions]) - np.concatenate(recomputed))


def version_distances(recompute: Recomputer, gen: Generation, candidates: Sequence[int]) -> dict[int, float]:
    """Mean |d| of the group's log-probs under each candidate version."""
    return {v: float(abs_dlogprob(gen, recompute(v, gen)).mean()) for v in candidates}


# --------------------------------------------------------------------------- harness


@dataclass
class Harness:
    """One started engine, the loop it lives on, its adapter versions and (real engines) a recomputer."""

    kind: str
    loop: asyncio.AbstractEventLoop
    engine: Any
    adapters: dict[int, AdapterRef]  # 0 (base) .. 3
    long_tokens: int  # max_new_tokens of a group that runs long enough to cancel or overlap
    recompute: Recomputer | None = None
    prompt_rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    next_group: int = 0
    closers: list[Callable[[], Any]] = field(default_factory=list)  # run after the engine closes (servers)
    server: Any = None  # vllm_server kinds: the stand-in (CPU) or the `vllm serve` process (GPU)

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def request(self, n: int = 4, max_new_tokens: int = 16, seed: int | None = None) -> GroupRequest:
        self.next_group += 1
        ids = tuple(int(x) for x in self.prompt_rng.integers(0, PROMPT_VOCAB, size=12))
        return GroupRequest(group_id=self.next_group, prompt=Prompt(f"contract-{self.next_group}", "", ids),
                            n=n, max_new_tokens=max_new_tokens, seed=seed)

    def generate(self, version: int, **kw: Any) -> Generation:
        return self.run(self.engine.generate(self.request(**kw), self.adapters[version]))

    def dlogprob_ok(self, gen: Generation, version: int) -> tuple[bool, str]:
        assert self.recompute is not None
        d = abs_dlogprob(gen, self.recompute(version, gen))
        if self.kind in ("vllm", "vllm_server_gpu"):
            return bool(d.mean() < VLLM_MEAN_ABS_DLOGPROB), f"mean |d| {d.mean():.4f} (max {d.max():.4f})"
        return bool(d.max() < TRANSFORMERS_MAX_ABS_DLOGPROB), f"max |d| {d.max():.2e}"


def _simulated(loop: asyncio.AbstractEventLoop, tmp: Path) -> Harness:
    from pipeline.engines.simulated import SimulatedEngine

    engine = SimulatedEngine(SimulatedEngineConfig(latency_s=0.2, completion_tokens=64, vocab_size=128))
    loop.run_until_complete(engine.start())
    adapters = {0: AdapterRef.base(), **{v: AdapterRef(v, f"v{v:06d}-simulated", None) for v in (1, 2, 3)}}
    return Harness("simulated", loop, engine, adapters, long_tokens=64)


def _transformers(loop: asyncio.AbstractEventLoop, tmp: Path) -> Harness:
    from pipeline.engines.transformers import TransformersEngine
    from pipeline.models.builtin import build_model

    model_path = build_model("tiny", tmp / "models")
    engine = TransformersEngine(model_path, sampling=SamplingConfig(), cfg=TransformersEngineConfig(),
                                device="cpu", dtype="float32", max_loaded_adapters=MAX_STALENESS + 1, seed=0,
                                name="transformers-contract")
    # Started before this thread runs any torch: on two CPU cores the engine's worker thread ran the
    # tiny model ~100x slower when this thread had run torch first (two OpenMP thread teams spinning
    # on the same cores); in this order it did not.
    loop.run_until_complete(engine.start())
    adapters = publish_adapters(model_path, tmp / "adapters", (1, 2, 3), rank=8, b_std=0.05)
    # "tiny" has 512 positions: 12 prompt tokens + 400 leaves room
    return Harness("transformers", loop, engine, adapters, long_tokens=400,
                   recompute=Recomputer(model_path, adapters, "cpu"))


def _vllm(loop: asyncio.AbstractEventLoop, tmp: Path) -> Harness:
    from pipeline.engines.vllm import VLLMEngine
    from pipeline.models.builtin import build_model

    model_path = build_model("small", tmp / "models")
    engine = VLLMEngine(model_path, sampling=SamplingConfig(), max_staleness=MAX_STALENESS, name="vllm-contract",
                        cfg=VLLMEngineConfig(gpu_memory_utilization=0.3, enforce_eager=True, max_model_len=2048,
                                             max_num_seqs=256, max_lora_rank=16), device="cuda:0")
    loop.run_until_complete(engine.start())
    adapters = publish_adapters(model_path, tmp / "adapters", (1, 2, 3), rank=16, b_std=0.05, device="cuda:0")
    # Random weights end a completion by end-of-sequence with chance ~1/320 per token, so 16
    # completions of up to 1500 tokens keep vLLM busy for a few hundred steps.
    return Harness("vllm", loop, engine, adapters, long_tokens=1500,
                   recompute=Recomputer(model_path, adapters, "cuda:0"))


def _vllm_server(loop: asyncio.AbstractEventLoop, tmp: Path) -> Harness:
    """The HTTP engine against a stand-in for `vllm serve` that samples with the transformers engine."""
    from vllm_stand_in import VLLMStandIn

    from pipeline.config.schema import VLLMServerEngineConfig
    from pipeline.engines.vllm_server import VLLMServerEngine

    inner = _transformers(loop, tmp)
    stub = VLLMStandIn(inner.engine, model_name="tiny")
    url = loop.run_until_complete(stub.start())
    engine = VLLMServerEngine(url, sampling=SamplingConfig(), cfg=VLLMServerEngineConfig(urls=(url,)),
                              max_staleness=MAX_STALENESS, name="vllm-server-contract")
    loop.run_until_complete(engine.start())
    return Harness("vllm_server", loop, engine, inner.adapters, long_tokens=inner.long_tokens,
                   recompute=inner.recompute, server=stub,
                   closers=[stub.close, inner.engine.close])


def _vllm_server_gpu(loop: asyncio.AbstractEventLoop, tmp: Path) -> Harness:
    """The HTTP engine against a real `vllm serve` of the "small" model on cuda:0 (eager, LoRA at run time)."""
    from pipeline.config.schema import VLLMServerEngineConfig
    from pipeline.engines.vllm_server import VLLMServerEngine
    from pipeline.engines.vllm_launch import VLLMServeProcess
    from pipeline.models.builtin import build_model

    model_path = build_model("small", tmp / "models")
    server = VLLMServeProcess(model_path, tmp / "vllm-serve.log", gpu_memory_utilization=0.3, enforce_eager=True,
                              max_num_seqs=256, max_loras=4)
    try:
        url = loop.run_until_complete(server.start())
        engine = VLLMServerEngine(url, sampling=SamplingConfig(), cfg=VLLMServerEngineConfig(urls=(url,)),
                                  max_staleness=MAX_STALENESS, name="vllm-server-gpu-contract")
        loop.run_until_complete(engine.start())
        adapters = publish_adapters(model_path, tmp / "adapters", (1, 2, 3), rank=16, b_std=0.05, device="cuda:0")
    except BaseException:
        loop.run_until_complete(server.stop())
        raise
    return Harness("vllm_server_gpu", loop, engine, adapters, long_tokens=1500,
                   recompute=Recomputer(model_path, adapters, "cuda:0"), server=server, closers=[server.stop])


BUILDERS: dict[str, Callable[[asyncio.AbstractEventLoop, Path], Harness]] = {
    "simulated": _simulated, "transformers": _transformers, "vllm": _vllm, "vllm_server": _vllm_server,
    "vllm_server_gpu": _vllm_server_gpu}
ENGINES = [
    pytest.param("simulated", id="simulated"),
    pytest.param("transformers", id="transformers"),
    pytest.param("vllm_server", id="vllm_server"),
    pytest.param("vllm", id="vllm", marks=[pytest.mark.gpu, *VLLM_WARNING_FILTERS]),
    pytest.param("vllm_server_gpu", id="vllm_server_gpu", marks=[pytest.mark.gpu, *VLLM_WARNING_FILTERS]),
]


@pytest.fixture(scope="module", params=ENGINES)
def h(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    kind = request.param
    if kind in ("vllm", "vllm_server_gpu") and (reason := vllm_unavailable()):
        pytest.skip(reason)
    loop = asyncio.new_event_loop()
    harness = None
    try:
        harness = BUILDERS[kind](loop, tmp_path_factory.mktemp(f"contract-{kind}"))  # starts the engine
        yield harness
    finally:
        if harness is not None:
            harness.run(harness.engine.close())
            for close in harness.closers:
                harness.run(close())
        close_loop(loop)


def needs_weights(h: Harness) -> None:
    if h.recompute is None:
        pytest.skip("the simulated engine has no weights to recompute log-probs with")


async def until_busy(engine: Any, timeout_s: float = 30.0) -> None:
    """Return once the engine's busy meter runs (a request is being sampled)."""
    before = engine.busy.busy_total()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while engine.busy.busy_total() <= before:
        if loop.time() > deadline:
            raise AssertionError(f"engine did not start the request within {timeout_s} s")
        await asyncio.sleep(0.002)


def requests_running(url: str) -> float:
    """vLLM's `vllm:num_requests_running` gauge, summed over its label sets, from the server's /metrics."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith("vllm:num_requests_running")]
    assert lines, "the server's /metrics has no vllm:num_requests_running"
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)


def cancelled_count(engine: Any) -> int:
    stats = engine.stats  # the simulated engine keeps a dict, the others a dataclass
    return int(stats["cancelled"] if isinstance(stats, Mapping) else stats.cancelled)


# --------------------------------------------------------------------------- the contract


def test_group_has_n_completions_with_a_logprob_per_token(h: Harness) -> None:
    assert isinstance(h.engine, Engine)
    h.run(h.engine.start())  # started already: a second start() is a no-op
    for version in (0, 1):
        req = h.request(n=4, max_new_tokens=16)
        gen = h.run(h.engine.generate(req, h.adapters[version]))
        assert gen.request is req and gen.engine == h.engine.name
        assert gen.version == version
        assert len(gen.completions) == 4
        assert gen.t_start <= gen.t_end
        for c in gen.completions:
            assert c.token_ids.dtype == np.int64 and c.logprobs.dtype == np.float32
            assert 1 <= len(c.token_ids) == len(c.logprobs) <= 16
            assert np.all(np.isfinite(c.logprobs)) and np.all(c.logprobs <= 0), c.logprobs
            assert c.finish_reason in ("stop", "length")
            if c.finish_reason == "length":
                assert len(c.token_ids) == 16


def test_logprobs_agree_with_recomputation(h: Harness) -> None:
    needs_weights(h)
    for version in (0, 1):
        gen = h.generate(version, n=4, max_new_tokens=32)
        ok, what = h.dlogprob_ok(gen, version)
        assert ok, f"{h.kind} log-probs on version {version} disagree with transformers: {what}"


def test_logprobs_identify_the_version_asked_for(h: Harness) -> None:
    needs_weights(h)
    assert h.recompute is not None
    candidates = (0, 1, 2)
    for version in (1, 2):
        gen = h.generate(version, n=4, max_new_tokens=32)
        d = version_distances(h.recompute, gen, candidates)
        best_wrong = min(x for v, x in d.items() if v != version)
        assert d[version] < VERSION_SEPARATION * best_wrong, \
            f"group sampled on version {version}: mean |d| per candidate version {d}"


def test_old_version_serves_a_group_in_flight(h: Harness) -> None:
    async def load_newer() -> None:
        # With max_staleness 1, version 3 makes version 1 stale while its group still runs.
        await h.engine.load_adapter(h.adapters[2])
        await h.engine.load_adapter(h.adapters[3])

    async def scenario() -> Generation:
        loop = asyncio.get_running_loop()
        await h.engine.load_adapter(h.adapters[1])
        task = loop.create_task(h.engine.generate(h.request(n=16, max_new_tokens=h.long_tokens), h.adapters[1]))
        await until_busy(h.engine)
        assert not task.done(), "the version-1 group ended before versions 2 and 3 were asked for; make it longer"
        await loop.create_task(load_newer())
        if h.kind == "vllm":
            # vLLM loads beside running requests (the transformers engine queues loads behind its
            # running decode on its one worker thread, so there the group has ended by now).
            assert not task.done(), "the version-1 group ended before versions 2 and 3 were loaded; make it longer"
        return await task

    gen = h.run(scenario())
    assert gen.version == 1
    if h.kind == "vllm":
        h.run(asyncio.sleep(0.1))  # the stale version is removed in the background once its group ends
        assert 1 not in h.engine.loaded_versions and {2, 3} <= set(h.engine.loaded_versions)
    if h.recompute is not None:
        ok, what = h.dlogprob_ok(gen, 1)
        assert ok, f"the version-1 group that overlapped loads of 2 and 3 does not match version 1: {what}"
        d = version_distances(h.recompute, gen, (0, 1, 2, 3))
        assert d[1] < VERSION_SEPARATION * min(d[0], d[2], d[3]), d


def test_cancel_aborts_the_request(h: Harness) -> None:
    async def scenario() -> None:
        before = cancelled_count(h.engine)
        aborted_before = h.server.aborted if h.kind == "vllm_server" else 0
        task = asyncio.get_running_loop().create_task(
            h.engine.generate(h.request(n=16, max_new_tokens=h.long_tokens), h.adapters[1]))
        await until_busy(h.engine)
        assert not task.done(), "the group ended before it could be cancelled; make it longer"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert cancelled_count(h.engine) == before + 1
        # Aborted means no more work on it: the busy meter stops (nothing else is running).
        await asyncio.sleep(0.3)
        idle = h.engine.busy.busy_total()
        await asyncio.sleep(0.2)
        assert h.engine.busy.busy_total() == idle, "the engine kept working after the cancel"
        if h.kind == "vllm":
            assert h.engine.unfinished_requests == 0
        if h.kind == "vllm_server":  # the server saw its client go and stopped sampling
            assert h.server.aborted == aborted_before + 1
        if h.kind == "vllm_server_gpu":  # vLLM's own gauge: nothing left running on the server
            assert await asyncio.to_thread(requests_running, h.engine.url) == 0
        gen = await h.engine.generate(h.request(n=2, max_new_tokens=8), h.adapters[1])
        assert gen.version == 1 and len(gen.completions) == 2

    h.run(scenario())


# Last: it restarts the module's engine (a test after it would run on the restarted one).
def test_close_then_start_serves_afresh(h: Harness) -> None:
    """A restart (what the Pipeline does to an engine it built that died): close() fails the call
    it was running, start() on the same object brings it back with no adapter loaded, and each
    version asked for is loaded again and sampled with its own weights."""
    from pipeline.errors import EngineDeadError

    async def scenario() -> tuple[Generation, Generation]:
        await h.engine.load_adapter(h.adapters[1])
        running = asyncio.get_running_loop().create_task(
            h.engine.generate(h.request(n=4, max_new_tokens=h.long_tokens), h.adapters[1]))
        await until_busy(h.engine)
        await h.engine.close()
        with pytest.raises(EngineDeadError):
            await running
        await h.engine.start()
        assert 1 not in h.engine.loaded_versions, "a restarted engine must not claim the old adapters"
        base = await h.engine.generate(h.request(n=4, max_new_tokens=16), h.adapters[0])
        await h.engine.load_adapter(h.adapters[2])
        return base, await h.engine.generate(h.request(n=4, max_new_tokens=32), h.adapters[2])

    base, gen = h.run(scenario())
    assert (base.version, gen.version) == (0, 2) and len(base.completions) == len(gen.completions) == 4
    assert 2 in h.engine.loaded_versions
    if h.recompute is not None:
        for g, v in ((base, 0), (gen, 2)):
            ok, what = h.dlogprob_ok(g, v)
            assert ok, f"{h.kind} after a restart: log-probs on version {v} disagree with transformers: {what}"
        d = version_distances(h.recompute, gen, (0, 1, 2))
        assert d[2] < VERSION_SEPARATION * min(d[0], d[1]), d
