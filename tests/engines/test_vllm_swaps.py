"""VLLMEngine's full-weight swaps on a stand-in AsyncLLM: drained (a load waits for the requests
running) and in flight (a load pauses them with mode "keep" and they go on with the new weights).

What vLLM does with a paused request (preempted, its KV cache recomputed with the new weights) is
checked on a GPU by tests/engines/test_vllm_full_weights_gpu.py; here, what the engine asks of vLLM
and what it tells the pipeline.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Awaitable, Callable

import pytest
import test_vllm_residency as residency
from test_vllm_residency import RecordingAsyncLLM, request, settle

from pipeline.engines.vllm import VLLMEngine
from pipeline.errors import AdapterCorruptError, GenerationError
from pipeline.types import AdapterRef


class SwappingAsyncLLM(RecordingAsyncLLM):
    """Requests held open until released or aborted; pauses, reloads and resumes logged in order."""

    def __init__(self, args: Any = None) -> None:
        super().__init__(args)
        self.log: list[tuple] = []  # ("pause", mode, clear_cache) | ("rpc", method) | ("resume",) | ("abort", ids)
        self.release = asyncio.Event()
        self.fail_rpc = False
        self._aborted: set[str] = set()

    async def generate(self, prompt: dict, params: SimpleNamespace, request_id: str, lora_request=None):  # type: ignore[no-untyped-def]
        while not self.release.is_set() and request_id not in self._aborted:
            await asyncio.sleep(0.001)
        reason = "abort" if request_id in self._aborted else "length"
        lp = [{t: SimpleNamespace(logprob=-0.5)} for t in (1, 2)]
        outputs = [SimpleNamespace(index=i, token_ids=[1, 2], finish_reason=reason, logprobs=lp)
                   for i in range(params.n)]
        yield SimpleNamespace(finished=True, outputs=outputs, lora_request=lora_request)

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.log.append(("pause", mode, clear_cache))

    async def resume_generation(self) -> None:
        self.log.append(("resume",))

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        self.log.append(("rpc", method))
        await asyncio.sleep(0)
        if self.fail_rpc:
            raise RuntimeError("a shard could not be read")
        return [None]

    async def abort(self, request_ids: Any) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.log.append(("abort", len(ids)))
        self._aborted.update(ids)


def version(tmp_path: Path, v: int) -> AdapterRef:
    d = tmp_path / "versions" / f"v{v:06d}"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"")
    return AdapterRef(v, d.name, str(d))


def run_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_flight: bool,
               body: Callable[[VLLMEngine, SwappingAsyncLLM], Awaitable[Any]]) -> None:
    residency.run_engine(tmp_path, monkeypatch, 0, body, llm=SwappingAsyncLLM, full_weights=True, in_flight=in_flight)


async def running_on(engine: VLLMEngine, llm: SwappingAsyncLLM, ref: AdapterRef) -> asyncio.Task:
    """`ref` loaded, then a request on it held open inside vLLM."""
    llm.release.set()
    await engine.load_adapter(ref)
    llm.release.clear()
    running = asyncio.create_task(engine.generate(request(0), ref))
    await settle()
    return running


def test_an_in_flight_load_pauses_the_running_requests_and_they_end_on_the_new_version(tmp_path, monkeypatch):
    v1, v2, v3 = (version(tmp_path, v) for v in (1, 2, 3))

    async def body(engine: VLLMEngine, llm: SwappingAsyncLLM) -> None:
        running = await running_on(engine, llm, v1)
        await asyncio.wait_for(engine.load_adapter(v2), 1.0)  # does not wait for the request
        assert not running.done() and engine.loaded_versions == (2,)
        assert llm.log[-3:] == [("pause", "keep", True), ("rpc", "reload_weights"), ("resume",)]
        older = asyncio.create_task(engine.generate(request(1), v1))  # the serving version may lag the engine's
        llm.release.set()
        gen, late = await running, await older
        assert (gen.version, gen.last_version, gen.spans_versions) == (1, 2, True)
        assert (late.version, late.last_version) == (1, 2)
        same = await engine.generate(request(2), v2)
        assert (same.version, same.last_version, same.spans_versions) == (2, 2, False)
        with pytest.raises(GenerationError, match="asked for version 3"):
            await engine.generate(request(3), v3)

    run_engine(tmp_path, monkeypatch, True, body)


def test_a_drained_load_waits_for_the_requests_running(tmp_path, monkeypatch):
    v1, v2 = version(tmp_path, 1), version(tmp_path, 2)

    async def body(engine: VLLMEngine, llm: SwappingAsyncLLM) -> None:
        running = await running_on(engine, llm, v1)
        loading = asyncio.create_task(engine.load_adapter(v2))
        await asyncio.sleep(0.05)
        assert not loading.done() and ("rpc", "reload_weights") not in llm.log[-1:]
        with pytest.raises(GenerationError, match="loading version 2"):  # nothing starts during a swap
            await engine.generate(request(1), v1)
        llm.release.set()
        gen = await running
        await loading
        assert (gen.version, gen.last_version, gen.spans_versions) == (1, None, False)
        assert llm.log[-3:] == [("pause", "wait", True), ("rpc", "reload_weights"), ("resume",)]

    run_engine(tmp_path, monkeypatch, False, body)


def test_an_in_flight_load_that_fails_aborts_the_requests_it_paused(tmp_path, monkeypatch):
    """Their next tokens would come from half-replaced weights: they fail, and nothing samples until a
    load succeeds."""
    v1, v2 = version(tmp_path, 1), version(tmp_path, 2)

    async def body(engine: VLLMEngine, llm: SwappingAsyncLLM) -> None:
        running = await running_on(engine, llm, v1)
        llm.fail_rpc = True
        with pytest.raises(AdapterCorruptError, match="could not load the weights of version 2"):
            await engine.load_adapter(v2)
        assert llm.log[-3:] == [("rpc", "reload_weights"), ("abort", 1), ("resume",)]
        with pytest.raises(GenerationError, match="finish_reason 'abort'"):
            await running
        assert engine.loaded_versions == ()
        with pytest.raises(GenerationError, match="no version"):
            await engine.generate(request(1), v1)
        llm.fail_rpc = False
        llm.release.set()
        await engine.load_adapter(v1)  # the served version again
        assert (await engine.generate(request(2), v1)).version == 1

    run_engine(tmp_path, monkeypatch, True, body)
