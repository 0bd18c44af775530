"""The engine rotation on its own: one slot per engine, the least loaded takes the call, an engine
leaves on errors and (if the pipeline built it) comes back restarted, with the versions in use loaded
before it takes a call.

The engines are simulated; what a restarted engine must load comes from a fixed list (`InUse`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pipeline.config.schema import EngineConfig, SimulatedEngineConfig
from pipeline.engines.simulated import SimulatedEngine
from pipeline.errors import EngineDeadError, GenerationError
from pipeline.loop.rotation import EngineRotation
from pipeline.types import AdapterRef

V1 = AdapterRef(version=1, name="v000001-test", path="/nowhere/v1")


class InUse:
    """The versions in use, as the rotation reads them (a VersionSet in a run)."""

    def __init__(self, refs: list[AdapterRef]) -> None:
        self.refs = refs

    def refs_in_use(self) -> list[AdapterRef]:
        return list(self.refs)


class Tasks:
    """A spawn function that names and keeps each task (the Supervisor's part in a run)."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[Any]] = []

    def spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.append(task)
        return task


def rotation(engines: list[SimulatedEngine], *, built: bool = True, in_use: list[AdapterRef] | None = None,
             tasks: Tasks | None = None, **cfg: Any) -> EngineRotation:
    config = EngineConfig(kind="simulated", **{"restart_backoff_s": 0.0, "max_consecutive_errors": 2, **cfg})
    return EngineRotation(engines, built=built, cfg=config, close_timeout_s=5.0,
                          spawn=(tasks or Tasks()).spawn, in_use=InUse(in_use or []))


def engines(k: int) -> list[SimulatedEngine]:
    return [SimulatedEngine(seed=i, name=f"sim-{i}") for i in range(k)]


def test_each_engine_has_one_slot_and_a_call_goes_to_the_least_loaded():
    async def main() -> None:
        es = engines(3)
        rot = rotation(es)
        assert [s.engine for s in rot.slots] == es and rot.healthy == es
        assert all(rot.slot(e).engine is e for e in es)
        held: list[Any] = []  # the calls still running, as (context manager, engine)

        async def take() -> SimulatedEngine:
            cm = rot.call()
            engine, _ = await cm.__aenter__()
            held.append((cm, engine))
            return engine

        async def finish(engine: SimulatedEngine) -> None:
            cm = next(cm for cm, e in held if e is engine)
            held.remove((cm, engine))
            await cm.__aexit__(None, None, None)

        assert [await take() for _ in range(3)] == es  # each took an idle engine, in rotation order
        assert [rot.slot(e).load for e in es] == [1, 1, 1]
        await finish(es[1])
        assert await take() is es[1]  # the only idle one, though not the first
        assert [await take() for _ in range(3)] == es  # all equal again: in order
        await finish(es[0])
        await finish(es[0])
        await finish(es[2])
        assert [rot.slot(e).load for e in es] == [0, 2, 1]
        assert [await take() for _ in range(3)] == [es[0], es[0], es[2]]
        for cm, _ in list(held):
            await cm.__aexit__(None, None, None)
        assert [rot.slot(e).load for e in es] == [0, 0, 0]  # every call's load is given back

    asyncio.run(main())


def test_an_engine_leaves_the_rotation_after_max_consecutive_errors_and_a_success_resets_the_count():
    async def main() -> None:
        es = engines(2)
        rot = rotation(es, built=False)  # the caller's engines: never restarted
        bad = es[0]
        rot.failed(bad, GenerationError("one"), 0)
        rot.succeeded(bad)  # a success in between: the count starts again
        rot.failed(bad, GenerationError("two"), 0)
        assert rot.healthy == es and rot.slot(bad).errors == 1
        rot.failed(bad, GenerationError("three"), 0)  # two in a row (max_consecutive_errors = 2)
        assert rot.healthy == [es[1]] and not rot.slot(bad).healthy and rot.slot(bad).epoch == 1
        for _ in range(3):  # it takes no call, however loaded the other is
            async with rot.call() as (e, epoch):
                assert e is es[1] and epoch == 0
        assert rot.restarting is False and rot.can_generate
        rot.failed(es[1], EngineDeadError("dead"), 0)  # dead: out at once, whatever the count
        assert rot.healthy == [] and not rot.can_generate
        with pytest.raises(EngineDeadError, match="caller's and are not restarted"):
            rot.pick()
        assert rot.summary()["engines_out_of_rotation"] == ["sim-0", "sim-1"]

    asyncio.run(main())


def test_a_failure_of_a_call_sent_before_the_engine_left_says_nothing_about_it_since():
    async def main() -> None:
        es = engines(2)
        rot = rotation(es, built=False, max_consecutive_errors=1)
        rot.failed(es[0], GenerationError("x"), 0)
        assert rot.slot(es[0]).epoch == 1
        errors = rot.slot(es[0]).errors
        rot.failed(es[0], GenerationError("late"), 0)  # a call from epoch 0 that failed afterwards
        assert rot.slot(es[0]).errors == errors

    asyncio.run(main())


class GatedEngine(SimulatedEngine):
    """A simulated engine whose adapter loads wait for `gate` (so a test can look while one runs)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = asyncio.Event()
        self.loading = asyncio.Event()

    async def load_adapter(self, adapter: AdapterRef) -> None:
        self.loading.set()
        await self.gate.wait()
        await super().load_adapter(adapter)


def test_a_dead_engine_is_restarted_and_loads_the_versions_in_use_before_it_takes_a_call():
    async def main() -> None:
        engine = GatedEngine(name="sim-0")
        await engine.start()
        tasks = Tasks()
        rot = rotation([engine], in_use=[V1], tasks=tasks, restarts=2)
        rot.failed(engine, EngineDeadError("died"), 0)
        assert rot.healthy == [] and rot.restarting and rot.can_generate  # a restart is under way

        async def one_call() -> tuple[str, int]:
            async with rot.call() as (e, epoch):
                return e.name, epoch

        waiting = asyncio.create_task(one_call())  # no engine in rotation: the call waits for the restart
        await asyncio.wait_for(engine.loading.wait(), 5)
        await asyncio.sleep(0.01)
        assert not waiting.done() and rot.healthy == []  # started again, but not in rotation before its load
        assert 1 not in engine.loaded_versions
        engine.gate.set()
        assert await asyncio.wait_for(waiting, 5) == ("sim-0", 1)  # the new epoch
        assert 1 in engine.loaded_versions and rot.healthy == [engine]
        slot = rot.slot(engine)
        assert (slot.restarts_done, slot.restart_failures, slot.errors, slot.restarting) == (1, 0, 0, None)
        assert rot.summary()["engine_restarts"] == {"sim-0": 1}
        await asyncio.gather(*tasks.tasks)

    asyncio.run(main())


def test_an_engine_whose_restarts_are_spent_stays_out_and_the_run_fails():
    async def main() -> None:
        engine = SimulatedEngine(SimulatedEngineConfig(failed_restarts=5), name="sim-0")  # it never comes back
        await engine.start()
        tasks = Tasks()
        rot = rotation([engine], tasks=tasks, restarts=2)
        rot.failed(engine, EngineDeadError("died"), 0)
        with pytest.raises(EngineDeadError, match=r"restarts are spent \(engine\.restarts = 2; "
                                                  r"sim-0: 0 restarted, 2 failed\)"):
            await asyncio.gather(*tasks.tasks)
        assert not rot.can_generate and rot.slot(engine).restart_failures == 2

    asyncio.run(main())
