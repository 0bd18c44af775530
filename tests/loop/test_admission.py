"""pipeline/loop/admission.py: what the Admitter admits, driven through `admission_loop` alone.

Checked, over random batch sizes, bounds, waves, resumed versions and prompt sets: it admits
exactly up to the staleness bound at the serving version (never more, never less), each group
sampled at the serving version with the item at its stream position; an id it handed out but
could not start goes back to the ledger; a malformed item is refused on its own, counted, logged
a few times per reason, never generated, and converted once however often the stream draws it;
refusing every item ends the run; a run of refusals yields the loop; a group's seed depends on
its id only. The generator is a recorder: the tests see what admission hands on, nothing after.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from pipeline.config.schema import SamplingConfig
from pipeline.data.refusals import LOGGED_PER_REASON
from pipeline.data.tasks import PromptSource
from pipeline.errors import ConfigError, PromptError
from pipeline.loop.admission import Admitter
from pipeline.loop.buffer import Admission, RolloutBuffer
from pipeline.loop.outcomes import Outcomes
from pipeline.store.ledger import Ledger
from pipeline.store.rollout_log import RolloutLog
from pipeline.types import GroupRequest, Prompt

SAMPLING = SamplingConfig(n=3, max_new_tokens=5)
QUIET_TICKS = 50  # loop turns after which a blocked admission loop has surely done all it can


class Recorder:
    """The generator as admission sees it: each spawned task records the groups it was handed."""

    def __init__(self) -> None:
        self.calls: list[list[tuple[Admission, GroupRequest]]] = []

    async def group_task(self, adm: Admission, request: GroupRequest) -> None:
        self.calls.append([(adm, request)])

    async def wave_task(self, wave: list[tuple[Admission, GroupRequest]]) -> None:
        self.calls.append(list(wave))

    @property
    def started(self) -> list[tuple[Admission, GroupRequest]]:
        return [pair for call in self.calls for pair in call]


class Builder:
    """Items {"id": "i7", "bad": reason or None} to Prompts; counts the conversions of each item."""

    def __init__(self) -> None:
        self.built: Counter[str] = Counter()

    def build(self, item: dict[str, Any]) -> Prompt:
        self.built[item["id"]] += 1
        if item["bad"]:
            raise PromptError(f"item {item['id']} is {item['bad']}", reason=item["bad"])
        return prompt_of(item)


def prompt_of(item: dict[str, Any]) -> Prompt:
    return Prompt(item["id"], f"text of {item['id']}", (1 + int(item["id"][1:]),))


def items_of(bad: list[str | None]) -> list[dict[str, Any]]:
    return [{"id": f"i{i}", "bad": reason} for i, reason in enumerate(bad)]


@dataclass
class Harness:
    admitter: Admitter
    ledger: Ledger
    buffer: RolloutBuffer
    source: PromptSource
    builder: Builder
    generator: Recorder
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)


@asynccontextmanager
async def harness(items: list[dict[str, Any]], *, B: int, K: int, wave: bool = False, epochs: int | None = 1,
                  shuffle: bool = True, start_version: int = 0, seed: int = 0,
                  sampling: SamplingConfig = SAMPLING) -> AsyncIterator[Harness]:
    """An Admitter over `items` (a stream of `epochs` epochs) with a real ledger, buffer and outcomes."""
    with tempfile.TemporaryDirectory() as tmp:
        source = PromptSource(items, seed=seed, epochs=epochs, shuffle=shuffle)
        ledger = Ledger(source.total)
        buffer = RolloutBuffer(B, K, start_version=start_version)
        log = RolloutLog(Path(tmp) / "rollouts.zarr")
        builder, generator = Builder(), Recorder()
        tasks: list[asyncio.Task[Any]] = []

        def spawn(coro: Any, name: str) -> asyncio.Task[Any]:
            tasks.append(asyncio.get_running_loop().create_task(coro, name=name))
            return tasks[-1]

        admitter = Admitter(ledger=ledger, source=source, builder=builder, buffer=buffer,  # type: ignore[arg-type]
                            outcomes=Outcomes(ledger, log, buffer), generator=generator,  # type: ignore[arg-type]
                            sampling=sampling, seed=seed, max_wave=B if wave else 1, spawn=spawn)
        h = Harness(admitter, ledger, buffer, source, builder, generator, tasks)
        try:
            yield h
        finally:
            await asyncio.gather(*tasks)
            log.close()


async def quiet(h: Harness) -> None:
    """Let the admission loop run until it waits (it awaits nothing while it can admit)."""
    for _ in range(QUIET_TICKS):
        await asyncio.sleep(0)
    await asyncio.gather(*h.tasks)  # the spawned recorders have recorded


def check_requests(h: Harness, sampling: SamplingConfig = SAMPLING) -> None:
    """Every group handed on samples the item at its stream position, with the run's sampling."""
    for adm, request in h.generator.started:
        assert request.group_id == adm.group_id
        assert request.prompt == prompt_of(h.source.item_at(adm.group_id))
        assert (request.n, request.max_new_tokens) == (sampling.n, sampling.max_new_tokens)


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 4), K=st.integers(0, 3), wave=st.booleans(), start_version=st.integers(0, 3),
       items=st.integers(1, 30), bumps=st.lists(st.integers(1, 2), max_size=4))
def test_admission_fills_the_staleness_bound_at_the_serving_version_and_no_further(
        B: int, K: int, wave: bool, start_version: int, items: int, bumps: list[int]) -> None:
    async def main() -> None:
        async with harness(items_of([None] * items), B=B, K=K, wave=wave, start_version=start_version) as h:
            loop_task = asyncio.create_task(h.admitter.admission_loop())
            serving, seen = start_version, 0
            for bump in [0, *bumps]:
                if bump:
                    serving += bump
                    await h.buffer.set_serving_version(serving)
                await quiet(h)
                started = h.generator.started
                bound = (K + serving - start_version + 1) * B  # live groups allowed (a resume starts at its version)
                assert len(started) == min(items, bound), "admission stopped short of the bound or passed it"
                assert all(adm.version == serving for adm, _ in started[seen:]), "sampled at the serving version"
                seen = len(started)
            ids = [adm.group_id for adm, _ in h.generator.started]
            assert sorted(ids) == list(range(len(ids))), "each stream position once, none skipped"
            assert all(len(call) <= (B if wave else 1) for call in h.generator.calls)
            check_requests(h)
            assert loop_task.done() == (len(ids) == items), "the loop ends once the stream is exhausted"
            await h.buffer.finish_admission()
            await asyncio.wait_for(loop_task, 5)

    asyncio.run(main())


@settings(max_examples=30, deadline=None)
@given(B=st.integers(1, 3), K=st.integers(0, 2), wave=st.booleans(), extra=st.integers(1, 10))
def test_an_id_handed_out_but_not_started_is_handed_out_again_first(B: int, K: int, wave: bool, extra: int) -> None:
    """Admission ending while the loop waits at the bound: the id it held goes back to the ledger."""
    async def main() -> None:
        bound = (K + 1) * B
        async with harness(items_of([None] * (bound + extra)), B=B, K=K, wave=wave) as h:
            loop_task = asyncio.create_task(h.admitter.admission_loop())
            await quiet(h)
            assert len(h.generator.started) == bound and not loop_task.done()  # waiting to admit one more
            await h.buffer.finish_admission()
            await asyncio.wait_for(loop_task, 5)
            started = {adm.group_id for adm, _ in h.generator.started}
            rest = []
            while (gid := h.ledger.next_id()) is not None:
                rest.append(gid)
            assert rest[0] == bound, "the id the loop held is the next one handed out"
            assert sorted(started) + rest == list(range(bound + extra)), "no id lost, none handed out twice"

    asyncio.run(main())


@settings(max_examples=40, deadline=None)
@given(bad=st.lists(st.sampled_from([None, None, "malformed", "too_long"]), min_size=1, max_size=12).filter(
    lambda b: any(r is None for r in b)), epochs=st.integers(1, 3), seed=st.integers(0, 5), wave=st.booleans())
def test_a_malformed_item_is_refused_alone_counted_and_converted_once(bad: list[str | None], epochs: int, seed: int,
                                                                      wave: bool) -> None:
    items = items_of(bad)
    total = epochs * len(items)

    async def main() -> tuple[Harness, list[dict[str, Any]]]:
        with capture_logs() as logs:
            async with harness(items, B=2, K=total, wave=wave, epochs=epochs, seed=seed) as h:  # no bound binds
                await asyncio.wait_for(h.admitter.admission_loop(), 10)
        return h, logs

    h, logs = asyncio.run(main())
    refused = [p for p in range(total) if h.source.item_at(p)["bad"]]
    good = [p for p in range(total) if not h.source.item_at(p)["bad"]]
    assert sorted(adm.group_id for adm, _ in h.generator.started) == good, "every good position generated once"
    check_requests(h)
    assert all(h.ledger.is_settled(p) for p in refused) and h.ledger.fates["refused"] == len(refused)
    by_reason = Counter(h.source.item_at(p)["bad"] for p in refused)
    assert h.admitter.refusals.by_reason == by_reason
    assert h.builder.built == Counter(item["id"] for item in items), "each item converted once, every epoch"
    logged = Counter(e["kind"] for e in logs if e["event"] == "prompt_refused")
    assert logged == {reason: min(n, LOGGED_PER_REASON) for reason, n in by_reason.items()}


@pytest.mark.parametrize("items", [1, 5])
def test_refusing_every_item_ends_the_run_once_each_was_refused(items: int) -> None:
    async def main() -> Harness:
        async with harness(items_of(["malformed"] * items), B=2, K=0, epochs=None) as h:  # an endless stream
            with pytest.raises(ConfigError, match=f"every prompt of the data set was refused: {items} of {items}"):
                await asyncio.wait_for(h.admitter.admission_loop(), 10)
        return h

    h = asyncio.run(main())
    assert h.ledger.cursor == items and h.ledger.fates["refused"] == items, "not before each item had its turn"
    assert h.generator.started == []


def test_a_run_of_refusals_yields_the_loop_between_them() -> None:
    """Signal handlers run on the loop: other tasks run between any two refusals."""
    refused = 40

    async def main() -> tuple[Harness, int]:
        async with harness(items_of(["malformed"] * refused + [None]), B=1, K=0, shuffle=False) as h:
            turns = 0

            async def other_task() -> None:
                nonlocal turns
                while True:
                    turns += 1
                    await asyncio.sleep(0)

            ticker = asyncio.create_task(other_task())
            await asyncio.sleep(0)  # the other task is running
            await asyncio.wait_for(h.admitter.admission_loop(), 10)
            ticker.cancel()
            await asyncio.gather(ticker, return_exceptions=True)
        return h, turns

    h, turns = asyncio.run(main())
    assert [adm.group_id for adm, _ in h.generator.started] == [refused]
    assert turns >= refused, f"the other task ran {turns} times during {refused} refusals"


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), first=st.tuples(st.integers(1, 4), st.booleans()),
       second=st.tuples(st.integers(1, 4), st.booleans()))
def test_a_groups_seed_depends_on_the_run_seed_and_its_id_only(seed: int, first: tuple[int, bool],
                                                                second: tuple[int, bool]) -> None:
    """With per-request seeds, how groups were batched into waves does not change what each samples."""
    sampling = SamplingConfig(n=3, max_new_tokens=5, per_request_seed=True)
    items = items_of([None] * 8)

    async def seeds(B: int, wave: bool, run_seed: int, per_request: SamplingConfig) -> dict[int, int | None]:
        """Seeds by group id, admitted B at a time (K = 0): the waves differ with B."""
        async with harness(items, B=B, K=0, wave=wave, seed=run_seed, sampling=per_request) as h:
            loop_task = asyncio.create_task(h.admitter.admission_loop())
            for version in range(1, len(items) + 1):
                await quiet(h)
                await h.buffer.set_serving_version(version)
            await asyncio.wait_for(loop_task, 10)
        assert len(h.generator.started) == len(items)
        return {adm.group_id: request.seed for adm, request in h.generator.started}

    async def main() -> None:
        a = await seeds(*first, seed, sampling)
        b = await seeds(*second, seed, sampling)
        assert a == b
        assert len(set(a.values())) == len(a) and all(isinstance(s, int) for s in a.values()), "distinct seeds"
        other = await seeds(*first, seed + 1, sampling)
        assert all(other[g] != a[g] for g in a), "another run seed, other seeds"
        unseeded = await seeds(*first, seed, SAMPLING)
        assert set(unseeded.values()) == {None}, "without per_request_seed the engine's own seed samples"

    asyncio.run(main())
