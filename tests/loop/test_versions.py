"""Versions on their own: the adapter loop between a store and simulated engines.

A version serves only once every engine in rotation loaded it; a version whose directory does not
verify is skipped (and, past max_staleness, ends the run); versions a group in flight or an
evaluation round uses stay loaded while older ones are unloaded and pruned; in full-weight mode the
engines swap only once admission drained and no evaluation round runs, and a failed swap puts the
served weights back. The buffer is a fake that records what it is told.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import numpy as np
import pytest
from safetensors.numpy import save_file
from test_rotation import GatedEngine, Tasks

from pipeline.config.schema import EngineConfig
from pipeline.engines.simulated import SimulatedEngine
from pipeline.errors import AdapterError
from pipeline.loop.rotation import EngineRotation
from pipeline.loop.versions import VersionPins, Versions, VersionSet
from pipeline.store.weights import AdapterStore
from pipeline.types import AdapterRef


class FakeBuffer:
    """What Versions uses of the RolloutBuffer: the versions in flight, the serving version, admission's pause."""

    def __init__(self) -> None:
        self.in_flight: list[int] = []  # versions of the groups in flight
        self.events: list[Any] = []  # what it was told, in order
        self.drained = asyncio.Event()  # set: nothing in flight holds the drain up
        self.drained.set()

    def in_flight_versions(self) -> list[int]:
        return list(self.in_flight)

    async def set_serving_version(self, version: int) -> None:
        self.events.append(("serving", version))

    def pause_admission(self) -> None:
        self.events.append("pause")

    async def wait_drained(self) -> None:
        self.events.append("draining")
        await self.drained.wait()
        self.events.append("drained")

    async def resume_admission(self) -> None:
        self.events.append("resume")


class Run:
    """A store, engines, their rotation, and Versions wired as the orchestrator wires them."""

    def __init__(self, tmp_path: Path, engines: list[SimulatedEngine], *, K: int = 1, full: bool = False) -> None:
        self.store = AdapterStore(tmp_path / "adapters", keep_last=0)  # keep_last 0: pruning shows at once
        self.engines = engines
        self.buffer = FakeBuffer()
        self.pins = VersionPins()
        self.set = VersionSet(buffer=self.buffer, pins=self.pins, start_version=0)
        self.rotation = EngineRotation(engines, built=False, cfg=EngineConfig(kind="simulated"), close_timeout_s=5.0,
                                       spawn=Tasks().spawn, in_use=self.set)
        self.versions = Versions(rotation=self.rotation, version_set=self.set, store=self.store, buffer=self.buffer,
                                 pins=self.pins, max_staleness=K, full_weights=full)

    def publish(self, version: int) -> AdapterRef:
        ref = self.store.publish(version, write_adapter)
        self.versions.published(ref)
        return ref

    async def serve(self, version: int) -> None:
        """Publish `version` and wait until it serves and the loop has pruned after it."""
        self.publish(version)
        await asyncio.wait_for(self.versions.wait_serving(version), 5)
        assert self.versions.served == version
        keep_from = self.set.keep_from(self.versions.max_staleness)
        await eventually(lambda: all(v >= keep_from for v in self.store.versions()))  # unloaded, then pruned

    @contextlib.asynccontextmanager
    async def loop(self) -> AsyncIterator[asyncio.Task[None]]:
        """The adapter loop running; its error, if it failed, is raised at the end."""
        task = asyncio.create_task(self.versions.adapter_loop(), name="adapter-loop")
        try:
            yield task
        finally:
            if task.done():
                task.result()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def write_adapter(d: Path) -> None:
    """Adapter files as peft's save_pretrained writes them (the simulated engines never read them)."""
    save_file({"lora_A": np.zeros((2, 3), dtype=np.float32)}, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({"r": 2, "peft_type": "LORA"}))


async def eventually(cond: Callable[[], bool], limit_s: float = 5.0) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def test_a_version_serves_only_after_every_engine_in_rotation_loaded_it(tmp_path: Path) -> None:
    async def main() -> None:
        fast, slow = SimulatedEngine(name="fast"), GatedEngine(name="slow")
        run = Run(tmp_path, [fast, slow])
        async with run.loop():
            run.publish(1)
            await asyncio.wait_for(slow.loading.wait(), 5)
            await eventually(lambda: 1 in fast.loaded_versions)
            waiting = asyncio.create_task(run.versions.wait_serving(1))
            await asyncio.sleep(0.02)
            # one engine has it, the other is still loading: admission still samples with version 0
            assert run.versions.served == 0 and not waiting.done() and run.buffer.events == []
            assert [r.version for r in run.set.refs_in_use()] == []
            slow.gate.set()
            await asyncio.wait_for(waiting, 5)
            assert run.versions.served == 1 and run.buffer.events == [("serving", 1)]
            assert 1 in fast.loaded_versions and 1 in slow.loaded_versions
            assert [r.version for r in run.set.refs_in_use()] == [1]  # what an engine restarted now loads

    asyncio.run(main())


def _corrupt(ref: AdapterRef) -> None:
    (Path(ref.path) / "adapter_model.safetensors").write_bytes(b"not the published bytes")


def test_a_version_whose_directory_does_not_verify_is_skipped(tmp_path: Path) -> None:
    async def main() -> None:
        engine = SimulatedEngine(name="sim")
        run = Run(tmp_path, [engine], K=1)
        bad = run.store.publish(1, write_adapter)
        _corrupt(bad)
        async with run.loop():
            run.versions.published(bad)
            await asyncio.wait_for(run.versions.wait_serving(1), 5)  # returns: version 1 failed
            assert run.versions.served == 0 and list(run.versions.load_failures) == [1]
            assert 1 not in engine.loaded_versions and run.buffer.events == []  # no engine read it
            await run.serve(2)  # the next good one serves
            assert 2 in engine.loaded_versions and 1 not in engine.loaded_versions

    asyncio.run(main())


def test_an_unverified_version_past_max_staleness_stops_the_run_naming_its_directory(tmp_path: Path) -> None:
    async def main() -> None:
        run = Run(tmp_path, [SimulatedEngine(name="sim")], K=0)
        bad = run.store.publish(1, write_adapter)
        _corrupt(bad)
        with pytest.raises(AdapterError, match=rf"could not load adapter versions 1..1 \(last: {bad.path}.*"
                                               r"max_staleness = 0"):
            async with run.loop() as task:
                run.versions.published(bad)
                await asyncio.wait_for(asyncio.shield(task), 5)

    asyncio.run(main())


def test_versions_in_flight_or_pinned_stay_loaded_and_older_ones_are_pruned(tmp_path: Path) -> None:
    async def main() -> None:
        engine = SimulatedEngine(name="sim")
        run = Run(tmp_path, [engine], K=0)
        async with run.loop():
            await run.serve(1)
            run.buffer.in_flight = [1]  # a group sampled with version 1 is still running
            await run.serve(2)
            assert {1, 2} <= engine.loaded_versions and run.store.versions() == [1, 2] and 1 in run.versions.adapters
            assert [r.version for r in run.set.refs_in_use()] == [1, 2]

            pinned = await run.pins.pin(lambda: run.versions.served)  # an eval round samples with version 2
            assert pinned == 2
            run.buffer.in_flight = []  # the group of version 1 ended
            await run.serve(3)
            assert 1 not in engine.loaded_versions and 1 not in run.versions.adapters
            assert run.store.versions() == [2, 3] and {2, 3} <= engine.loaded_versions
            assert [r.version for r in run.set.refs_in_use()] == [2, 3]

            await run.pins.unpin(2)
            await run.serve(4)
            assert engine.loaded_versions == {0, 4} and run.store.versions() == [4]
            assert sorted(run.versions.adapters) == [0, 4]

    asyncio.run(main())


def test_full_weight_mode_drains_admission_before_the_engines_swap(tmp_path: Path) -> None:
    async def main() -> None:
        engines = [SimulatedEngine(name=f"sim-{i}", full_weights=True) for i in range(2)]
        run = Run(tmp_path, engines, full=True)
        run.buffer.drained.clear()  # groups are in flight
        async with run.loop():
            run.publish(1)
            await eventually(lambda: run.buffer.events or any(e.loaded_versions != {0} for e in engines))
            await asyncio.sleep(0.02)
            # admission paused, and the engines keep the weights the groups in flight sample with
            assert run.buffer.events == ["pause", "draining"] and run.versions.served == 0
            assert all(e.loaded_versions == {0} for e in engines)
            run.buffer.drained.set()  # the groups in flight finished
            await asyncio.wait_for(run.versions.wait_serving(1), 5)
            assert all(e.loaded_versions == {1} for e in engines)
            await eventually(lambda: "resume" in run.buffer.events)
            assert run.buffer.events == ["pause", "draining", "drained", ("serving", 1), "resume"]
            assert run.versions.drain_s[1] >= 0.02

    asyncio.run(main())


def test_full_weight_mode_waits_for_eval_rounds_and_starts_none_during_the_swap(tmp_path: Path) -> None:
    async def main() -> None:
        engines = [SimulatedEngine(name=f"sim-{i}", full_weights=True) for i in range(2)]
        run = Run(tmp_path, engines, full=True)
        eval_version = await run.pins.pin(lambda: run.versions.served)  # an eval round samples with version 0
        async with run.loop():
            run.publish(1)
            await eventually(lambda: "drained" in run.buffer.events or any(e.loaded_versions != {0} for e in engines))
            late_round = asyncio.create_task(run.pins.pin(lambda: run.versions.served))
            await asyncio.sleep(0.02)
            # the round keeps its weights, and no new round starts while the swap waits for it
            assert all(e.loaded_versions == {0} for e in engines) and run.versions.served == 0
            assert not late_round.done()
            await run.pins.unpin(eval_version)
            await asyncio.wait_for(run.versions.wait_serving(1), 5)
            assert await asyncio.wait_for(late_round, 5) == 1  # the round waiting started on the new weights
            assert all(e.loaded_versions == {1} for e in engines)

    asyncio.run(main())


class RefusesVersion(SimulatedEngine):
    """A full-weight simulated engine whose load of one version fails."""

    def __init__(self, refused: int, **kwargs: Any) -> None:
        super().__init__(full_weights=True, **kwargs)
        self.refused = refused

    async def load_adapter(self, adapter: AdapterRef) -> None:
        if adapter.version == self.refused:
            raise AdapterError(f"engine {self.name}: injected failure to load version {adapter.version}")
        await super().load_adapter(adapter)


def test_full_weight_mode_puts_the_served_weights_back_when_one_engine_fails_to_load(tmp_path: Path) -> None:
    async def main() -> None:
        good, bad = SimulatedEngine(name="good", full_weights=True), RefusesVersion(1, name="bad")
        run = Run(tmp_path, [good, bad], full=True)
        async with run.loop():
            run.publish(1)
            await asyncio.wait_for(run.versions.wait_serving(1), 5)
            await eventually(lambda: "resume" in run.buffer.events)
            assert run.versions.served == 0 and list(run.versions.load_failures) == [1]
            assert good.loaded_versions == {0} and bad.loaded_versions == {0}  # every engine holds one version
            assert run.buffer.events == ["pause", "draining", "drained", "resume"]
            await run.serve(2)  # the pins and admission were released: the next version swaps in
            assert good.loaded_versions == bad.loaded_versions == {2}

    asyncio.run(main())


class SlowLoad(SimulatedEngine):
    """A simulated engine whose adapter loads take `load_s`."""

    def __init__(self, load_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.load_s = load_s

    async def load_adapter(self, adapter: AdapterRef) -> None:
        await asyncio.sleep(self.load_s)
        await super().load_adapter(adapter)


def test_a_versions_way_to_the_engines_is_told_in_its_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Verifying takes 0.15 s and the engines' load 0.25 s: the step row says so, part by part, and
    publish-to-serving holds both; a version not yet served has NaN figures."""
    verify = AdapterStore.verify_dir

    def slow_verify(self: AdapterStore, path: str) -> Any:
        time.sleep(0.15)
        return verify(self, path)

    monkeypatch.setattr(AdapterStore, "verify_dir", slow_verify)

    async def main() -> dict[str, float]:
        run = Run(tmp_path, [SlowLoad(0.25, name="slow-load")])
        async with run.loop():
            await run.serve(1)
        return run.versions.metrics(1)

    m = asyncio.run(main())
    # (asyncio's loop clock may end the 0.25 s sleep up to its resolution early)
    assert 0.15 <= m["adapter/verify_s"] < 0.25 and 0.249 <= m["adapter/load_s"] < 0.35
    assert 0 <= m["adapter/wait_s"] < 0.1
    parts = m["adapter/wait_s"] + m["adapter/verify_s"] + m["adapter/load_s"]
    assert parts <= m["adapter/publish_to_loaded_s"] < parts + 0.05
    later = Run(tmp_path / "other", [SimulatedEngine(name="idle")]).versions.metrics(1)
    assert all(np.isnan(v) for v in later.values()) and set(later) == set(m)
