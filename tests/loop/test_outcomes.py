"""The owner of a group's life: each exit is one call that the buffer, the ledger and the RolloutLog
all see once and alike; a group cannot leave twice; shutdown leaves nothing live; a run of
failures stops the run.

Every test drives a real buffer, ledger and RolloutLog through `Outcomes` only, and compares
the three views of what became of the groups: the buffer's counts, the ledger's fates and the
log's rows.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

import numpy as np
import pytest

from pipeline.errors import FatalError
from pipeline.loop import outcomes as outcomes_module
from pipeline.loop.buffer import Admission, RolloutBuffer
from pipeline.loop.outcomes import Outcomes
from pipeline.store.ledger import Ledger
from pipeline.store.rollout_log import RolloutLog, read_rollouts
from pipeline.types import Completion, Generation, GroupRequest, Prompt, RolloutGroup

PROMPT = Prompt(id="p", text="p", token_ids=(1, 2))


class World:
    """A buffer, a ledger and a RolloutLog, with the Outcomes that owns their groups."""

    def __init__(self, path: Path, batch_groups: int = 1, max_staleness: int = 0) -> None:
        self.ledger = Ledger()
        self.log = RolloutLog(path)
        self.buffer = RolloutBuffer(batch_groups, max_staleness)
        self.outcomes = Outcomes(self.ledger, self.log, self.buffer)

    async def admit(self) -> Admission:
        adm = await self.outcomes.admit(self.ledger.next_id(), PROMPT)
        assert adm is not None
        return adm

    def views(self) -> tuple[Counter[str], Counter[str], Counter[str]]:
        """What became of the groups, per fate ("trained", "dropped:<reason>", "failed:<reason>"),
        as the buffer counts it, as the ledger settled it and as the log's rows say."""
        c = self.buffer.counts
        buffer = Counter({"trained": c.trained, **{f"dropped:{r}": n for r, n in c.dropped.items()},
                          **{f"failed:{r}": n for r, n in c.failed.items()}})
        log = Counter({"trained" if k == "trained:" else k: n for k, n in self.log.reasons().items()})
        return +buffer, +self.ledger.fates, +log

    def rows(self) -> list[dict[str, Any]]:
        self.log.flush()
        r = read_rollouts(self.log.path)
        return [r.group(i) for i in range(r.num_groups)]


def scored(adm: Admission) -> RolloutGroup:
    """The group of `adm`, generated at its version and scored (two completions of two tokens)."""
    req = GroupRequest(group_id=adm.group_id, prompt=PROMPT, n=2, max_new_tokens=2)
    comp = Completion(np.array([3, 4]), np.array([-0.5, -0.25], dtype=np.float32), "length")
    gen = Generation(req, (comp, comp), version=adm.version, engine="test", t_start=0.0, t_end=0.0)
    return RolloutGroup(gen, np.array([0.0, 1.0]), 0.0)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path / "rollouts.zarr")
    yield w
    w.log.close()


# ---------------------------------------------------------------------- each exit path, once

async def trained(w: World) -> RolloutGroup:
    g = scored(await w.admit())
    await w.outcomes.buffered([g])
    sel = await w.outcomes.select(0)
    assert sel.groups == [g]
    w.outcomes.trained(sel.groups, 1)
    return g


async def zero_advantage(w: World) -> RolloutGroup:
    g = scored(await w.admit())
    await w.outcomes.drop(g.group_id, "zero_advantage", g.generation, g.rewards)
    return g


async def failed(w: World) -> RolloutGroup:
    g = scored(await w.admit())
    await w.outcomes.settle_failed(g.group_id, "reward_error", g.generation, None, RuntimeError("boom"))
    return g


async def stale_at_selection(w: World) -> RolloutGroup:
    g = scored(await w.admit())
    await w.outcomes.buffered([g])
    await w.buffer.finish_admission()  # the batch may then be empty
    sel = await w.outcomes.select(1)  # a trainer a version past the bound (K = 0)
    assert sel.groups == [] and sel.dropped == [(g, "stale")]
    return g


async def shutdown_buffered(w: World) -> RolloutGroup:
    g = scored(await w.admit())
    await w.outcomes.buffered([g])
    await w.outcomes.close()
    return g


async def shutdown_training(w: World) -> RolloutGroup:
    g = scored(await w.admit())
    await w.outcomes.buffered([g])
    await w.outcomes.select(0)
    await w.outcomes.close()
    w.outcomes.drop_live("shutdown")
    return g


async def shutdown_in_flight(w: World) -> RolloutGroup:
    g = scored(await w.admit())
    await w.outcomes.close()
    w.outcomes.drop_live("shutdown")
    return g


async def put_after_close(w: World) -> RolloutGroup:
    g = scored(await w.admit())
    await w.outcomes.close()
    await w.outcomes.buffered([g])  # the buffer refuses it: it leaves with its rows kept
    return g


async def failed_after_close(w: World) -> RolloutGroup:
    g = scored(await w.admit())
    await w.outcomes.close()
    await w.outcomes.settle_failed(g.group_id, "generation_error", None, None, RuntimeError("cancelled"))
    return g


# exit path -> (fate as the three views count it, step of the row, whether the row has the generation)
EXITS: dict[Callable[[World], Awaitable[RolloutGroup]], tuple[str, int, bool]] = {
    trained: ("trained", 1, True),
    zero_advantage: ("dropped:zero_advantage", -1, True),
    failed: ("failed:reward_error", -1, True),
    stale_at_selection: ("dropped:stale", -1, True),
    shutdown_buffered: ("dropped:shutdown", -1, True),
    shutdown_training: ("dropped:shutdown", -1, True),
    shutdown_in_flight: ("dropped:shutdown", -1, False),
    put_after_close: ("dropped:shutdown", -1, True),
    failed_after_close: ("dropped:shutdown", -1, False),
}


@pytest.mark.parametrize("path", list(EXITS), ids=lambda f: f.__name__)
def test_each_exit_is_seen_once_and_alike_by_the_buffer_the_ledger_and_the_log(world: World, path) -> None:
    fate, step, with_generation = EXITS[path]

    async def scenario() -> RolloutGroup:
        g = await path(world)
        await world.outcomes.close()  # a shutdown afterwards must find nothing more of it
        world.outcomes.drop_live("shutdown")
        return g

    g = asyncio.run(scenario())
    assert world.views() == (Counter({fate: 1}),) * 3
    assert world.outcomes.live == {} and world.buffer.counts.balanced() and world.ledger.is_settled(g.group_id)
    [row] = world.rows()
    assert (row["group_id"], row["fate"], row["step"], row["version"]) == (g.group_id, fate.split(":")[0], step, 0)
    assert row["reason"] == fate.partition(":")[2]
    assert len(row["completions"]) == (2 if with_generation else 0)


@pytest.mark.parametrize("path", list(EXITS), ids=lambda f: f.__name__)
def test_a_group_cannot_leave_twice(world: World, path) -> None:
    async def scenario() -> None:
        g = await path(world)
        before = world.views()
        again: list[Callable[[], Any]] = [
            lambda: world.outcomes.trained([g], 2),
            lambda: world.outcomes.drop(g.group_id, "zero_advantage", g.generation, g.rewards),
            lambda: world.outcomes.settle_failed(g.group_id, "reward_error", g.generation, None),
            lambda: world.outcomes.buffered([g]),
        ]
        for exit_again in again:
            with pytest.raises(ValueError, match="not live"):
                result = exit_again()
                if asyncio.iscoroutine(result):
                    await result
        assert world.views() == before and len(world.log) == 1

    asyncio.run(scenario())


def test_a_group_goes_through_its_states_in_order(world: World) -> None:
    """A step cannot train a group it did not select, nor the buffer take one twice."""

    async def scenario() -> None:
        g = scored(await world.admit())
        with pytest.raises(ValueError, match="is in_flight, not training"):
            world.outcomes.trained([g], 1)
        await world.outcomes.buffered([g])
        with pytest.raises(ValueError, match="is buffered, not in_flight"):
            await world.outcomes.buffered([g])
        with pytest.raises(ValueError, match="is buffered, not in_flight"):
            await world.outcomes.drop(g.group_id, "zero_advantage", g.generation, g.rewards)
        assert len(world.log) == 0 and world.ledger.fates == {} and world.buffer.counts.balanced()

    asyncio.run(scenario())


# ---------------------------------------------------------------------- shutdown

def test_shutdown_drops_every_live_group_once_in_the_order_of_their_states(tmp_path: Path) -> None:
    """What the buffer held first, then the batch in training in its selected order, then what was in
    flight in admission order; scored groups keep their generation in the log."""
    w = World(tmp_path / "rollouts.zarr", batch_groups=2, max_staleness=1)  # room for 4 at version 0

    async def scenario() -> list[int]:
        a, b, c, d = [scored(await w.admit()) for _ in range(4)]
        for g in (c, a, b):  # completion order: the batch is c then a
            await w.outcomes.buffered([g])
        sel = await w.outcomes.select(0)
        assert sel.groups == [c, a]
        await w.outcomes.close()
        w.outcomes.drop_live("shutdown")
        return [g.group_id for g in (b, c, a, d)]

    order = asyncio.run(scenario())
    assert w.outcomes.live == {} and w.buffer.counts.live == 0 and w.buffer.counts.balanced()
    assert w.views() == (Counter({"dropped:shutdown": 4}),) * 3
    rows = w.rows()
    assert [r["group_id"] for r in rows] == order
    assert [len(r["completions"]) for r in rows] == [2, 2, 2, 0]  # d was never generated
    w.log.close()


# ---------------------------------------------------------------------- failures in a row

def test_a_run_of_failures_stops_the_run_and_a_scored_group_breaks_the_run(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(outcomes_module, "MAX_CONSECUTIVE_FAILURES", 3)
    w = World(tmp_path / "rollouts.zarr", batch_groups=16)

    async def fail(reason: str = "reward_error") -> None:
        adm = await w.admit()
        await w.outcomes.settle_failed(adm.group_id, reason, None, None, RuntimeError("boom"))

    async def scenario() -> None:
        await fail()
        await fail()
        w.outcomes.scored()  # a group that scored: the run of failures is broken
        await fail()
        await fail()
        with pytest.raises(FatalError, match="3 groups failed in a row.*the last: generation_error: boom"):
            await fail("generation_error")
        # the group that ended the run has left like any other
        assert w.views() == (Counter({"failed:reward_error": 4, "failed:generation_error": 1}),) * 3
        last = await w.admit()
        await w.outcomes.close()
        # once shut down, a failure is shutdown's and stops nothing
        await w.outcomes.settle_failed(last.group_id, "reward_error", None, None, RuntimeError("boom"))

    asyncio.run(scenario())
    assert w.views()[1] == Counter({"failed:reward_error": 4, "failed:generation_error": 1, "dropped:shutdown": 1})
    assert w.outcomes.live == {} and len(w.log) == 6
    w.log.close()
