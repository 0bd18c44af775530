"""The Generator on its own: retries with backoff, a group that fails for good settled once, a dead
engine's calls costing no retry, and every group sampled with the version it was admitted with.

Simulated engines that fail on cue, a real EngineRotation, and fakes for what lies downstream
(scoring's `accept`, `Outcomes.settle_failed`) and for the adapters by version.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any, Sequence

from test_rotation import InUse, Tasks

from pipeline.config.schema import EngineConfig, SimulatedEngineConfig
from pipeline.engines.simulated import SimulatedEngine
from pipeline.errors import EngineDeadError, GenerationError
from pipeline.loop.buffer import Admission
from pipeline.loop.generation import Generator
from pipeline.loop.rotation import EngineRotation
from pipeline.types import AdapterRef, Generation, GroupRequest, Prompt

PROMPT = Prompt(id="p", text="p", token_ids=(1, 2))
V1 = AdapterRef(version=1, name="v000001-test", path="/nowhere/v1")
V2 = AdapterRef(version=2, name="v000002-test", path="/nowhere/v2")


class Flaky(SimulatedEngine):
    """A simulated engine whose first `fail_first` calls raise `error`; it records each call's version."""

    def __init__(self, fail_first: int = 0, error: type[Exception] = GenerationError, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail_first, self.error = fail_first, error
        self.calls: list[int] = []  # the version each call asked for

    def _maybe_fail(self, adapter: AdapterRef) -> None:
        self.calls.append(adapter.version)
        if len(self.calls) <= self.fail_first:
            raise self.error(f"engine {self.name}: call {len(self.calls)} fails (injected)")

    async def generate(self, request: GroupRequest, adapter: AdapterRef) -> Generation:
        self._maybe_fail(adapter)
        return await super().generate(request, adapter)


class FailsOneOfTheWave(Flaky):
    """A simulated engine whose first generate_many call fails one group (`victim`) and returns the rest."""

    def __init__(self, victim: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.victim = victim

    async def generate_many(self, requests: Sequence[GroupRequest], adapter: AdapterRef) -> list[Any]:
        self.calls.append(adapter.version)
        out = await super().generate_many(requests, adapter)
        if len(self.calls) == 1:
            out = [GenerationError("injected") if r.group_id == self.victim else g for r, g in zip(requests, out)]
        return out


class FakeOutcomes:
    """Records the groups settled as failed (Outcomes.settle_failed's arguments)."""

    def __init__(self) -> None:
        self.failed: list[dict[str, Any]] = []

    async def settle_failed(self, group_id: int, reason: str, gen: Any, rewards: Any,
                            error: BaseException | None = None, **fields: Any) -> None:
        self.failed.append({"group_id": group_id, "reason": reason, "error": error, **fields})


class Harness:
    def __init__(self, engines: list[SimulatedEngine], **cfg: Any) -> None:
        self.cfg = EngineConfig(kind="simulated", **{"retries": 3, "retry_backoff_s": 0.01,
                                                     "max_consecutive_errors": 10, "request_timeout_s": 5.0, **cfg})
        self.tasks = Tasks()
        self.rotation = EngineRotation(engines, built=False, cfg=self.cfg, close_timeout_s=5.0,
                                       spawn=self.tasks.spawn, in_use=InUse([]))
        self.versions = SimpleNamespace(adapters={0: AdapterRef.base(), 1: V1})  # Versions.adapters
        self.outcomes = FakeOutcomes()
        self.accepted: list[tuple[Admission, Generation]] = []
        self.generator = Generator(rotation=self.rotation, versions=self.versions, outcomes=self.outcomes,
                                   cfg=self.cfg, spawn=self.tasks.spawn, accept=self.accept)

    async def accept(self, items: list[tuple[Admission, Generation]]) -> None:
        self.accepted.extend(items)

    async def all_done(self) -> None:
        while pending := [t for t in self.tasks.tasks if not t.done()]:
            await asyncio.gather(*pending)


def group(group_id: int, version: int = 1) -> tuple[Admission, GroupRequest]:
    return (Admission(group_id, version, time.monotonic()),
            GroupRequest(group_id=group_id, prompt=PROMPT, n=2, max_new_tokens=4))


def test_a_failed_call_is_retried_after_its_backoff_and_counted():
    async def main() -> None:
        engine = Flaky(fail_first=2, name="sim")
        h = Harness([engine], retries=3, retry_backoff_s=0.02)
        t0 = time.monotonic()
        await h.generator.group_task(*group(7))
        assert time.monotonic() - t0 >= 0.02 + 0.04 - 0.003  # backoff 0.02 * 2**r before retry r + 1
        assert [adm.group_id for adm, _ in h.accepted] == [7] and h.outcomes.failed == []
        assert h.generator.retries.value == 2 and len(engine.calls) == 3
        assert h.rotation.slot(engine).errors == 0  # the success reset its count

    asyncio.run(main())


def test_a_group_whose_retries_are_spent_fails_once_with_its_attempts():
    async def main() -> None:
        engine = Flaky(fail_first=100, name="sim")
        h = Harness([engine], retries=2)
        await h.generator.group_task(*group(3))
        assert h.accepted == [] and len(engine.calls) == 3  # the first attempt and two retries
        assert [(f["group_id"], f["reason"], f["attempts"], f["engine"]) for f in h.outcomes.failed] \
            == [(3, "generation_error", 3, "sim")]
        assert h.generator.retries.value == 2

    asyncio.run(main())


def test_a_call_past_the_request_timeout_is_a_failed_attempt():
    async def main() -> None:
        engine = SimulatedEngine(SimulatedEngineConfig(hang_rate=1.0), name="sim")  # every call hangs
        h = Harness([engine], retries=1, request_timeout_s=0.05)
        await h.generator.group_task(*group(4))
        assert [(f["reason"], f["attempts"]) for f in h.outcomes.failed] == [("generation_timeout", 2)]
        assert h.generator.retries.value == 1 and engine.stats["injected_hangs"] == 2  # each attempt hung

    asyncio.run(main())


def test_a_dead_engines_call_uses_no_retry_while_another_engine_can_take_the_group():
    async def main() -> None:
        dead, alive = Flaky(fail_first=100, error=EngineDeadError, name="dead"), SimulatedEngine(name="alive")
        h = Harness([dead, alive], retries=0)  # no retries at all: the group still goes through
        await h.generator.group_task(*group(5))
        assert [gen.engine for _, gen in h.accepted] == ["alive"] and h.outcomes.failed == []
        assert h.generator.retries.value == 0 and h.rotation.healthy == [alive]

    asyncio.run(main())


def _tokens(gen: Generation) -> list[list[int]]:
    return [c.token_ids.tolist() for c in gen.completions]


async def _reference(request: GroupRequest, ref: AdapterRef) -> list[list[int]]:
    """The completions a fresh engine of the same seed samples for `request` with `ref`."""
    return _tokens(await SimulatedEngine(name="reference").generate(request, ref))


def test_a_groups_completions_all_come_from_the_version_it_was_admitted_with():
    async def main() -> None:
        engine = Flaky(fail_first=1, name="sim")
        h = Harness([engine])
        adm, request = group(11, version=1)
        task = asyncio.create_task(h.generator.group_task(adm, request))
        await asyncio.sleep(0)  # the first attempt failed; the retry waits its backoff
        h.versions.adapters[2] = V2  # meanwhile version 2 was published and serves
        await task
        [(got_adm, gen)] = h.accepted
        assert got_adm is adm and gen.version == 1 and engine.calls == [1, 1]
        assert _tokens(gen) == await _reference(request, V1) != await _reference(request, V2)

    asyncio.run(main())


def test_a_wave_and_the_retry_of_a_group_it_failed_sample_with_the_waves_version():
    async def main() -> None:
        engine = FailsOneOfTheWave(victim=21, name="sim")
        h = Harness([engine])
        wave = [group(i, version=1) for i in (20, 21, 22)]  # admitted at version 1 ...
        h.versions.adapters[2] = V2  # ... and version 2 was published since
        await h.generator.wave_task(wave)
        await h.all_done()  # the failed group's retry, alone
        assert sorted(adm.group_id for adm, _ in h.accepted) == [20, 21, 22] and h.outcomes.failed == []
        assert engine.calls == [1, 1] and h.generator.retries.value == 1
        requests = {r.group_id: r for _, r in wave}
        for adm, gen in h.accepted:
            assert gen.version == adm.version == 1
            assert _tokens(gen) == await _reference(requests[adm.group_id], V1)

    asyncio.run(main())
