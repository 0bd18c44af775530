"""pipeline.engines.residency: when an engine's adapters load and go, on a fake engine that records it.

The engines' own tests (test_engine_transformers.py, test_vllm_server_engine.py) check the same
through real loads; these check the invariants one at a time, with loads the test releases.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Awaitable, Callable

import pytest

from pipeline.engines.base import check_adapter_dir
from pipeline.engines.residency import Residency, Resident
from pipeline.errors import AdapterCorruptError, AdapterError, AdapterNotFoundError, EngineDeadError
from pipeline.types import AdapterRef


def ref(version: int, run: str = "a") -> AdapterRef:
    return AdapterRef(version, f"v{version:06d}-{run}", f"/adapters/{run}/{version}")


class FakeEngine:
    """Loads that wait for the test's go-ahead (when `hold`), and a log of loads and unloads in call order."""

    def __init__(self, bound: int, hold: bool = False) -> None:
        self.log: list[tuple[str, str]] = []
        self.gates: dict[str, asyncio.Event] = {}
        self.hold = hold
        self.fail: set[str] = set()
        self.residency: Residency[str] = Residency("fake", bound, prepare=self.prepare, load=self.load,
                                                   unload=self.unload)

    def prepare(self, adapter: AdapterRef) -> str:
        if adapter.path is None:
            raise AdapterNotFoundError("no path")
        return adapter.path

    async def load(self, r: Resident[str]) -> None:
        self.log.append(("load", r.ref.name))
        if self.hold:
            await self.gates.setdefault(r.ref.name, asyncio.Event()).wait()
        if r.ref.name in self.fail:
            raise AdapterError(f"cannot load {r.ref.name}")

    def unload(self, r: Resident[str]) -> Awaitable[None]:
        self.log.append(("unload", r.ref.name))  # at the call, as an engine submitting to its worker
        return asyncio.sleep(0)

    def open(self, adapter: AdapterRef) -> None:
        self.gates.setdefault(adapter.name, asyncio.Event()).set()

    def resident(self) -> list[int]:
        return [r.ref.version for r in self.residency]

    def unloaded(self) -> list[str]:
        return [name for what, name in self.log if what == "unload"]


def run(body: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(body())


def test_an_adapter_in_use_is_unloaded_only_after_its_last_release() -> None:
    async def body() -> None:
        e = FakeEngine(bound=4)
        first = await e.residency.acquire(ref(1))
        second = await e.residency.acquire(ref(1))
        assert first is second and e.log == [("load", ref(1).name)]  # loaded once for both calls
        await e.residency.unload(ref(1))
        assert e.resident() == [1] and e.unloaded() == []  # deferred: two calls use it
        e.residency.release(first)
        assert e.unloaded() == []
        e.residency.release(second)
        assert e.resident() == [] and e.unloaded() == [ref(1).name]

    run(body)


def test_a_new_call_cancels_a_deferred_unload() -> None:
    async def body() -> None:
        e = FakeEngine(bound=4)
        held = await e.residency.acquire(ref(1))
        await e.residency.unload(ref(1))
        again = await e.residency.acquire(ref(1))  # still needed after all
        e.residency.release(held)
        e.residency.release(again)
        assert e.resident() == [1] and e.unloaded() == []

    run(body)


def test_the_oldest_idle_adapter_goes_before_a_load_and_busy_ones_never() -> None:
    async def body() -> None:
        e = FakeEngine(bound=2)
        busy = await e.residency.acquire(ref(1))
        await e.residency.load(ref(2))
        await e.residency.load(ref(3))  # 1 is busy: 2 goes, though newer
        assert e.resident() == [1, 3]
        # the victim's unload is called before the new load begins (a worker runs them in that order)
        assert e.log[-2:] == [("unload", ref(2).name), ("load", ref(3).name)]
        e.residency.release(busy)
        assert e.resident() == [1, 3]  # within the bound: nothing to do
        await e.residency.load(ref(4))
        assert e.resident() == [3, 4] and e.unloaded() == [ref(2).name, ref(1).name]

    run(body)


def test_the_bound_is_exceeded_while_every_adapter_is_in_use_and_restored_after() -> None:
    async def body() -> None:
        e = FakeEngine(bound=2)
        held = [await e.residency.acquire(ref(v)) for v in (1, 2, 3)]
        assert e.resident() == [1, 2, 3]  # no running group loses its adapter
        e.residency.release(held[1])
        assert e.resident() == [1, 3]  # back under the bound as soon as one is idle
        e.residency.release(held[0])
        e.residency.release(held[2])
        assert e.resident() == [1, 3]

    run(body)


def test_an_unload_asked_while_loading_waits_for_the_load() -> None:
    async def body() -> None:
        e = FakeEngine(bound=4, hold=True)
        loading = asyncio.create_task(e.residency.load(ref(1)))
        await asyncio.sleep(0)
        unloading = asyncio.create_task(e.residency.unload(ref(1)))
        await asyncio.sleep(0.01)
        assert not unloading.done() and e.resident() == [1]
        e.open(ref(1))
        await asyncio.gather(loading, unloading)
        assert e.resident() == [] and e.unloaded() == [ref(1).name]

    run(body)


def test_a_failed_load_leaves_nothing_and_the_next_call_loads_again() -> None:
    async def body() -> None:
        e = FakeEngine(bound=2)
        e.fail.add(ref(1).name)
        with pytest.raises(AdapterError, match="cannot load"):
            await e.residency.acquire(ref(1))
        assert e.resident() == []
        e.fail.clear()
        r = await e.residency.acquire(ref(1))
        assert r is not None and r.loaded and e.log == [("load", ref(1).name)] * 2
        with pytest.raises(AdapterNotFoundError):  # refused before anything is evicted
            await e.residency.load(AdapterRef(2, "v000002-a", None))
        assert e.resident() == [1] and e.unloaded() == []

    run(body)


def test_adapters_are_told_apart_by_name_and_a_name_means_one_directory() -> None:
    async def body() -> None:
        e = FakeEngine(bound=4)
        await e.residency.load(ref(1, "a"))
        await e.residency.load(ref(1, "b"))  # version 1 of another run: another adapter
        assert e.resident() == [1, 1]
        await e.residency.unload(AdapterRef(1, "v000001-c", "/elsewhere"))  # not held: ignored
        assert e.resident() == [1, 1]
        with pytest.raises(AdapterError, match="adapter names must be unique"):
            await e.residency.acquire(AdapterRef(2, ref(1, "a").name, "/adapters/a/1"))
        assert await e.residency.acquire(AdapterRef.base()) is None  # the base model is never resident
        e.residency.release(None)

    run(body)


def test_close_fails_waiting_calls_and_stops_every_load_and_unload() -> None:
    async def body() -> None:
        e = FakeEngine(bound=1, hold=True)
        e.open(ref(1))
        held = await e.residency.acquire(ref(1))
        waiting = asyncio.create_task(e.residency.acquire(ref(2)))
        await asyncio.sleep(0)
        loaded = await e.residency.close()
        assert loaded == [held]  # what was loaded, for the engine to free
        with pytest.raises(EngineDeadError, match="closed while loading adapter version 2"):
            await waiting
        e.residency.release(held)  # a call that unwinds after the close
        await e.residency.unload(ref(1))
        assert e.unloaded() == [] and e.resident() == []

    run(body)


def test_adapter_directories_are_checked_before_any_load(tmp_path: Path) -> None:
    good = tmp_path / "good"
    good.mkdir()
    (good / "adapter_config.json").write_text('{"r": 8, "rank_pattern": {"q_proj": 32}}')
    (good / "adapter_model.safetensors").write_bytes(b"")
    assert check_adapter_dir(AdapterRef(1, "good", str(good))) == good.resolve()
    assert check_adapter_dir(AdapterRef(1, "good", str(good)), (32, "engine.vllm.max_lora_rank")) == good.resolve()
    with pytest.raises(AdapterError, match="LoRA rank 32 but engine.vllm.max_lora_rank = 16; raise engine.vllm"):
        check_adapter_dir(AdapterRef(1, "good", str(good)), (16, "engine.vllm.max_lora_rank"))
    not_json = tmp_path / "not_json"
    not_json.mkdir()
    (not_json / "adapter_config.json").write_text("[1, 2]")
    (not_json / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(AdapterCorruptError, match="holds no JSON object"):
        check_adapter_dir(AdapterRef(2, "nj", str(not_json)))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_text("{}")
    with pytest.raises(AdapterCorruptError, match=f"{no_weights}.* has no safetensors weights"):
        check_adapter_dir(AdapterRef(3, "nw", str(no_weights)))
    with pytest.raises(AdapterNotFoundError, match="does not exist"):
        check_adapter_dir(AdapterRef(4, "missing", str(tmp_path / "missing")))
