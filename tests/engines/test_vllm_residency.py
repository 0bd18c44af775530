"""VLLMEngine's adapters on a stand-in AsyncLLM that logs add_lora and remove_lora as they are sent.

vLLM's client sends a call to the engine core in the first step of the task that awaits it, so
the order of this log is the order the engine core sees (tests/engines/test_vllm_gpu.py and
tests/engines/test_engine_contract.py check the same engine on vLLM itself, with -m gpu).
"""

from __future__ import annotations

import asyncio
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Awaitable, Callable

import pytest
from conftest import word_level_tokenizer

from pipeline.config.schema import SamplingConfig, VLLMEngineConfig
from pipeline.engines.vllm import VLLMEngine
from pipeline.errors import AdapterError
from pipeline.types import AdapterRef, Generation, GroupRequest, Prompt


class RecordingAsyncLLM:
    """Just enough of vLLM's AsyncLLM for VLLMEngine: a log of LoRA calls, loads that fail, requests held open."""

    instances: list[RecordingAsyncLLM] = []

    def __init__(self, args: Any = None) -> None:
        self.args = args  # what the engine built vLLM with
        self.model_config = SimpleNamespace(max_model_len=64, get_vocab_size=lambda: 100)
        self.vllm_config = SimpleNamespace(compilation_config=SimpleNamespace(max_cudagraph_capture_size=0))
        self.errored = False
        self.calls: list[tuple[str, str, int]] = []  # ("add" | "remove", lora_name, lora_int_id), as sent
        self.fail: set[str] = set()  # add_lora raises for these names, as vLLM does for a bad adapter
        self.gates: dict[str, asyncio.Event] = {}  # generate on this adapter waits until its gate is set
        self._names: dict[int, str] = {}

    @classmethod
    def from_engine_args(cls, args: object) -> RecordingAsyncLLM:
        cls.instances.append(cls(args))
        return cls.instances[-1]

    async def add_lora(self, lora: SimpleNamespace) -> bool:
        self.calls.append(("add", lora.lora_name, lora.lora_int_id))
        self._names[lora.lora_int_id] = lora.lora_name
        await asyncio.sleep(0)  # the engine core answers later
        if lora.lora_name in self.fail:
            raise RuntimeError(f"worker could not load {lora.lora_name}")
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.calls.append(("remove", self._names[lora_id], lora_id))
        await asyncio.sleep(0)
        return True

    async def generate(self, prompt: dict, params: SimpleNamespace, request_id: str, lora_request=None):  # type: ignore[no-untyped-def]
        if lora_request is not None and lora_request.lora_name in self.gates:
            await self.gates[lora_request.lora_name].wait()
        lp = [{t: SimpleNamespace(logprob=-0.5)} for t in (1, 2)]
        outputs = [SimpleNamespace(index=i, token_ids=[1, 2], finish_reason="length", logprobs=lp)
                   for i in range(params.n)]
        yield SimpleNamespace(finished=True, outputs=outputs, lora_request=lora_request)

    async def abort(self, request_ids: object) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def ops(self) -> list[tuple[str, str]]:
        return [(op, name) for op, name, _ in self.calls]


def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The names VLLMEngine.start() imports from vLLM, in stand-in modules."""
    def new(**kw: Any) -> SimpleNamespace:
        return SimpleNamespace(**kw)

    error = type("FakeVLLMError", (Exception,), {})
    names = {"vllm.engine.arg_utils": {"AsyncEngineArgs": new}, "vllm.inputs": {"TokensPrompt": dict},
             "vllm.lora.request": {"LoRARequest": new},
             "vllm.sampling_params": {"SamplingParams": new, "RequestOutputKind": SimpleNamespace(FINAL_ONLY=2)},
             "vllm.v1.engine.async_llm": {"AsyncLLM": RecordingAsyncLLM},
             "vllm.v1.engine.exceptions": {"EngineDeadError": error, "EngineGenerateError": error}}
    for dotted, attrs in names.items():
        parts = dotted.split(".")
        for package in (".".join(parts[:i]) for i in range(1, len(parts))):  # the packages above it
            if package not in sys.modules:
                monkeypatch.setitem(sys.modules, package, types.ModuleType(package))
        module = types.ModuleType(dotted)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, dotted, module)
    monkeypatch.setattr(RecordingAsyncLLM, "instances", [])


def adapter(tmp_path: Path, version: int, run: str = "a") -> AdapterRef:
    directory = tmp_path / "adapters" / run / str(version)
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text('{"r": 8}')
    (directory / "adapter_model.safetensors").write_bytes(b"")
    return AdapterRef(version, f"v{version:06d}-{run}", str(directory))


def request(i: int) -> GroupRequest:
    return GroupRequest(i, Prompt(f"p{i}", "", (4, 5, 6)), n=2, max_new_tokens=8)


async def settle() -> None:
    """Let the tasks already scheduled (background removals, the stand-in's answers) run."""
    for _ in range(5):
        await asyncio.sleep(0)


def run_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_loras: int,
               body: Callable[[VLLMEngine, Any], Awaitable[Any]], *, llm: type = RecordingAsyncLLM,
               **engine_kwargs: Any) -> None:
    """Start a VLLMEngine (max_staleness 1, `engine_kwargs`) on `llm` (a RecordingAsyncLLM), run `body`, close it."""
    fake_vllm(monkeypatch)
    monkeypatch.setattr(sys.modules["vllm.v1.engine.async_llm"], "AsyncLLM", llm)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    (tmp_path / "model").mkdir(parents=True, exist_ok=True)
    engine = VLLMEngine(tmp_path / "model", sampling=SamplingConfig(), cfg=VLLMEngineConfig(max_loras=max_loras),
                        device="cuda:0", max_staleness=1, name="vllm-residency", **engine_kwargs)

    async def main() -> None:
        await engine.start()
        try:
            await body(engine, RecordingAsyncLLM.instances[-1])
        finally:
            await engine.close()

    asyncio.run(main())


async def held(engine: VLLMEngine, llm: RecordingAsyncLLM, i: int, on: AdapterRef) -> asyncio.Task[Generation]:
    """A generate call on `on` that stays inside vLLM until `llm.gates[on.name]` is set."""
    llm.gates[on.name] = asyncio.Event()
    task = asyncio.get_running_loop().create_task(engine.generate(request(i), on), name=f"held-{i}")
    await settle()
    assert not task.done()
    return task


def test_a_loaded_adapter_is_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a1 = adapter(tmp_path, 1)

    async def body(engine: VLLMEngine, llm: RecordingAsyncLLM) -> None:
        await engine.load_adapter(a1)
        gens = await asyncio.gather(*(engine.generate(request(i), a1) for i in range(3)))
        await engine.load_adapter(a1)
        assert [g.version for g in gens] == [1, 1, 1]
        assert llm.ops() == [("add", a1.name)] and engine.loaded_adapters == (a1.name,)

    run_engine(tmp_path, monkeypatch, 0, body)


def test_over_max_loras_the_oldest_idle_adapter_is_removed_before_the_new_one_is_added(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Three runs' version 1 and 2: versions never fall behind by more than max_staleness, so only the bound acts.
    a1, a2, b1, c1 = adapter(tmp_path, 1, "a"), adapter(tmp_path, 2, "a"), adapter(tmp_path, 1, "b"), \
        adapter(tmp_path, 1, "c")

    async def body(engine: VLLMEngine, llm: RecordingAsyncLLM) -> None:
        await engine.load_adapter(a1)
        await engine.load_adapter(a2)
        await engine.load_adapter(b1)
        assert llm.ops() == [("add", a1.name), ("add", a2.name), ("remove", a1.name), ("add", b1.name)]
        assert engine.loaded_adapters == (a2.name, b1.name)
        running = await held(engine, llm, 1, a2)  # the oldest is busy: the next oldest goes instead
        await engine.load_adapter(c1)
        assert llm.ops()[4:] == [("remove", b1.name), ("add", c1.name)]
        assert engine.loaded_adapters == (a2.name, c1.name)
        llm.gates[a2.name].set()
        assert (await running).version == 2

    run_engine(tmp_path, monkeypatch, 2, body)


def test_loading_v_removes_versions_older_than_v_minus_k_once_no_request_uses_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    v = {i: adapter(tmp_path, i) for i in (1, 2, 3, 4)}

    async def body(engine: VLLMEngine, llm: RecordingAsyncLLM) -> None:
        running = await held(engine, llm, 1, v[1])
        await engine.load_adapter(v[2])
        await engine.load_adapter(v[3])  # version 1 is stale now, but a group still runs on it
        assert llm.ops() == [("add", v[1].name), ("add", v[2].name), ("add", v[3].name)]
        llm.gates[v[1].name].set()
        assert (await running).version == 1
        await settle()
        assert llm.ops()[3:] == [("remove", v[1].name)] and engine.loaded_versions == (2, 3)
        await engine.load_adapter(v[4])  # version 2 is stale and idle: it goes at once, before 4 is added
        assert llm.ops()[4:] == [("remove", v[2].name), ("add", v[4].name)]
        assert engine.loaded_versions == (3, 4)

    run_engine(tmp_path, monkeypatch, 0, body)


def test_an_adapter_is_removed_only_after_its_last_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a1 = adapter(tmp_path, 1)

    async def body(engine: VLLMEngine, llm: RecordingAsyncLLM) -> None:
        running = await held(engine, llm, 1, a1)
        await engine.unload_adapter(a1)
        await settle()
        assert llm.ops() == [("add", a1.name)] and engine.loaded_versions == (1,)
        llm.gates[a1.name].set()
        assert (await running).version == 1
        await settle()
        assert llm.ops() == [("add", a1.name), ("remove", a1.name)] and engine.loaded_versions == ()

    run_engine(tmp_path, monkeypatch, 0, body)


def test_a_failed_add_lora_leaves_nothing_resident(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a1 = adapter(tmp_path, 1)

    async def body(engine: VLLMEngine, llm: RecordingAsyncLLM) -> None:
        llm.fail.add(a1.name)
        with pytest.raises(AdapterError, match="could not load adapter version 1"):
            await engine.load_adapter(a1)
        assert engine.loaded_versions == () and engine.stats.adapters_loaded == 0
        llm.fail.clear()
        assert (await engine.generate(request(1), a1)).version == 1  # loaded again, not the failure replayed
        (add1, _, id1), (add2, _, id2) = llm.calls  # and nothing removed: vLLM never held the first
        assert (add1, add2) == ("add", "add") and id2 > id1
        assert engine.loaded_adapters == (a1.name,)

    run_engine(tmp_path, monkeypatch, 0, body)


@pytest.mark.parametrize("full_weights", [False, True], ids=["lora", "full"])
def test_graphs_are_captured_once_per_size_with_lora_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          full_weights: bool) -> None:
    """With LoRA, vLLM is told not to capture every size a second time without LoRA (a run samples on
    no adapter only before its first version); full weights have no LoRA and say nothing of it."""
    fake_vllm(monkeypatch)
    model = tmp_path / "model"
    model.mkdir()
    engine = VLLMEngine(model, sampling=SamplingConfig(), cfg=VLLMEngineConfig(max_cudagraph_capture_size=48),
                        full_weights=full_weights)
    asyncio.run(engine.start())
    args = RecordingAsyncLLM.instances[-1].args
    assert args.max_cudagraph_capture_size == 48
    if full_weights:
        assert not hasattr(args, "enable_lora") and args.compilation_config == {}
    else:
        assert args.enable_lora and args.compilation_config == {"cudagraph_specialize_lora": False}


@pytest.mark.parametrize("layout", ["builtin", "added", "vocabulary", "in_map", "none"])
def test_the_eos_read_from_the_files_is_the_one_the_tokenizer_loads_with(tmp_path: Path, layout: str) -> None:
    """vLLM skips its tokenizer only with the eos id the loaded tokenizer would have given it."""
    from transformers import AutoTokenizer

    from pipeline.engines.vllm import tokenizer_eos
    from pipeline.models.builtin import build_tokenizer

    if layout == "builtin":
        build_tokenizer(300).save_pretrained(tmp_path)
    else:
        word_level_tokenizer(tmp_path, eos=None if layout == "none" else "</s>" if layout == "vocabulary" else "<|end|>",
                             eos_added=layout in ("added", "in_map"), in_map=layout == "in_map")
    loaded = AutoTokenizer.from_pretrained(tmp_path).eos_token_id
    assert tokenizer_eos(tmp_path) == (True, loaded)
    assert (loaded is None) == (layout == "none")


def test_vllm_starts_without_a_tokenizer_only_where_its_files_give_the_eos_id(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the files give the eos id, vLLM starts without a tokenizer and every request stops on
    that id; where they name an eos but not its id, vLLM loads the tokenizer and knows it itself."""
    seen = []

    async def body(engine: VLLMEngine, llm: Any) -> None:
        seen.append((llm.args.skip_tokenizer_init, engine._sampling_params(request(0)).stop_token_ids))

    for where, with_json in ((tmp_path / "a", True), (tmp_path / "b", False)):
        word_level_tokenizer(where / "model", eos="<|end|>", eos_added=True, with_json=with_json)
        run_engine(where, monkeypatch, 2, body)
    assert seen == [(True, [5]), (False, None)]  # "<|end|>" was added after the 5 words


@pytest.mark.parametrize("asked, initialised, used", [
    ("auto", False, "fork"), ("auto", True, "spawn"), ("fork", False, "fork"), ("fork", True, "spawn"),
    ("spawn", False, "spawn")])
def test_the_engine_core_is_forked_only_from_a_process_without_cuda(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asked: str, initialised: bool, used: str) -> None:
    """engine.vllm.start_method reaches vLLM as the core starts (VLLM_WORKER_MULTIPROC_METHOD, read
    then, whatever the environment held before); a fork only where this process has not initialised
    the CUDA driver, and "fork" asked for in vain is said."""
    import os

    from structlog.testing import capture_logs

    import pipeline.engines.vllm as engine_module

    seen: list[str | None] = []

    class Recording(RecordingAsyncLLM):
        @classmethod
        def from_engine_args(cls, args: object) -> RecordingAsyncLLM:
            seen.append(os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"))
            return super().from_engine_args(args)

    fake_vllm(monkeypatch)
    monkeypatch.setattr(sys.modules["vllm.v1.engine.async_llm"], "AsyncLLM", Recording)
    monkeypatch.setattr(engine_module, "cuda_driver_initialized", lambda: initialised)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn" if used == "fork" else "fork")  # the config wins
    (tmp_path / "model").mkdir()
    engine = VLLMEngine(tmp_path / "model", sampling=SamplingConfig(), device="cuda:0", max_staleness=1, name="start",
                        cfg=VLLMEngineConfig(start_method=asked))

    async def main() -> None:
        await engine.start()
        await engine.close()

    with capture_logs() as logs:
        asyncio.run(main())
    assert seen == [used]
    [started] = [e for e in logs if e["event"] == "engine_started"]
    assert started["start_method"] == used
    assert any(e["event"] == "engine_core_spawned" for e in logs) is (asked == "fork" and used == "spawn")


def test_the_engine_logs_vllms_import_apart_from_its_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A first start's import of vLLM (seconds cold) is timed apart from the AsyncLLM's construction."""
    import importlib.abc
    import importlib.util
    import time

    from structlog.testing import capture_logs

    fake_vllm(monkeypatch)
    slow_name = "vllm.v1.engine.exceptions"
    module = sys.modules[slow_name]
    monkeypatch.delitem(sys.modules, slow_name)
    monkeypatch.setattr(sys.modules["vllm.v1.engine"], "__path__", [], raising=False)  # a package, to import from

    class SlowImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name: str, path: object, target: object = None) -> Any:
            return importlib.util.spec_from_loader(name, self) if name == slow_name else None

        def create_module(self, spec: Any) -> Any:
            time.sleep(0.3)  # an import that takes a while
            return module

        def exec_module(self, m: Any) -> None:
            pass

    monkeypatch.setattr(sys, "meta_path", [SlowImport(), *sys.meta_path])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    (tmp_path / "model").mkdir()
    engine = VLLMEngine(tmp_path / "model", sampling=SamplingConfig(), cfg=VLLMEngineConfig(), device="cuda:0",
                        max_staleness=1, name="import")
    with capture_logs() as logs:
        asyncio.run(engine.start())
    [started] = [e for e in logs if e["event"] == "engine_started"]
    assert started["import_s"] >= 0.3 and started["seconds"] < 0.3


@pytest.mark.parametrize("compiled", [True, False])
def test_without_torch_compile_the_engine_asks_for_whole_batch_graphs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      compiled: bool) -> None:
    fake_vllm(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    (tmp_path / "model").mkdir()
    engine = VLLMEngine(tmp_path / "model", sampling=SamplingConfig(), device="cuda:0", max_staleness=1, name="start",
                        cfg=VLLMEngineConfig(torch_compile=compiled))
    asyncio.run(engine.start())
    config = RecordingAsyncLLM.instances[-1].args.compilation_config
    assert config["cudagraph_specialize_lora"] is False
    assert (config.get("mode"), config.get("cudagraph_mode")) == ((None, None) if compiled else ("NONE", "FULL"))


def test_the_driver_is_asked_whether_it_was_initialised_not_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDeviceGetCount answers CUDA_ERROR_NOT_INITIALIZED (3) before cuInit and 0 after it."""
    import ctypes

    from pipeline import devices

    for answer, initialised in ((3, False), (0, True)):
        calls: list[str] = []

        class Driver:
            def cuDeviceGetCount(self, count: object, answer: int = answer) -> int:
                calls.append("cuDeviceGetCount")
                return answer

            def __getattr__(self, name: str) -> object:  # cuInit or anything else would initialise it
                raise AssertionError(f"the check called {name}")

        monkeypatch.setattr(ctypes, "CDLL", lambda name: Driver())
        assert devices.cuda_driver_initialized() is initialised and calls == ["cuDeviceGetCount"]

    def no_driver(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    assert devices.cuda_driver_initialized() is False
