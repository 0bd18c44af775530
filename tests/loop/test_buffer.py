"""The buffer's invariants: staleness <= K at consumption without drops, accounting, backpressure."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.loop.buffer import BufferClosed, RolloutBuffer
from pipeline.types import Completion, Generation, GroupRequest, Prompt, RolloutGroup

PROMPT = Prompt(id="p", text="p", token_ids=(1,))


def make_group(group_id: int, version: int) -> RolloutGroup:
    req = GroupRequest(group_id=group_id, prompt=PROMPT, n=1, max_new_tokens=1)
    comp = Completion(np.array([1]), np.array([-0.5], dtype=np.float32), "length")
    gen = Generation(req, (comp,), version=version, engine="test", t_start=0.0, t_end=0.0)
    return RolloutGroup(gen, np.array([1.0]), 0.0)


def simulate(K: int, B: int, steps: int, rng: random.Random, fail_p: float, serve_lag_p: float,
             deterministic: bool = False) -> dict:
    """Drive the buffer's synchronous core through a random interleaving of events.

    Events: admit a group, complete a random in-flight group (any order), fail one, let the
    trainer try a step, let the engines catch up to the newest version. Returns what happened;
    raises if the system can make no progress (a deadlock).
    """
    buf = RolloutBuffer(batch_groups=B, max_staleness=K, max_groups=steps * B, deterministic=deterministic)
    trainer_version = 0
    staleness: list[int] = []
    batches: list[list[tuple[int, int]]] = []  # per step, (group id, version) of the groups it trained
    in_flight: dict[int, int] = {}
    for _ in range(100_000):
        if trainer_version == steps:
            break
        moves = []
        if buf.admission_room() > 0:
            moves.append("admit")
        if in_flight and len(buf) < buf.capacity:
            moves += ["complete", "complete"]
            if fail_p > 0:
                moves.append("fail")
        moves.append("train")
        if buf.serving_version < trainer_version:
            moves.append("serve")
        forced = moves == ["train"]  # only the trainer can move: it must be able to
        move = rng.choice(moves)
        if move == "admit":
            adm = buf.try_admit()
            assert adm is not None
            in_flight[adm.group_id] = adm.version
        elif move == "complete":
            gid = rng.choice(list(in_flight))
            if rng.random() < fail_p:
                buf.fail_nowait(gid, "reward_error")
            else:
                buf.put_nowait(make_group(gid, in_flight[gid]))
            del in_flight[gid]
        elif move == "fail":
            gid = rng.choice(list(in_flight))
            buf.fail_nowait(gid, "generation_error")
            del in_flight[gid]
        elif move == "serve":
            if rng.random() >= serve_lag_p:
                buf.serving_version = trainer_version
        else:
            sel = buf.try_select(trainer_version)
            assert sel is not None or not forced, f"deadlock at version {trainer_version}: {buf.counts}"
            if sel is not None and sel.groups:
                buf.commit(sel.groups)
                assert len(sel.groups) == B or not buf._can_still_fill()
                staleness += [trainer_version - g.version for g in sel.groups]
                batches.append([(g.group_id, g.version) for g in sel.groups])
                assert not sel.dropped, "the selection rule must make the consumption check redundant"
                trainer_version += 1
        assert buf.counts.balanced()
        assert len(buf) <= buf.capacity
    return {"steps": trainer_version, "staleness": staleness, "counts": buf.counts, "batches": batches}


@settings(max_examples=300, deadline=None)
@given(K=st.integers(0, 4), B=st.integers(1, 4), seed=st.integers(0, 10**6),
       fail_p=st.sampled_from([0.0, 0.1, 0.3]), serve_lag_p=st.sampled_from([0.0, 0.5, 0.9]))
def test_staleness_bound_holds_for_any_completion_order(K, B, seed, fail_p, serve_lag_p):
    out = simulate(K, B, steps=12, rng=random.Random(seed), fail_p=fail_p, serve_lag_p=serve_lag_p)
    assert out["steps"] == 12
    assert out["staleness"] and max(out["staleness"]) <= K
    assert out["counts"].dropped.get("stale", 0) == 0


def test_staleness_reaches_k_when_the_generator_runs_ahead():
    # Without a bound the trainer would see arbitrarily old groups; with one it sees up to K.
    seen = set()
    for seed in range(50):
        out = simulate(2, 2, steps=12, rng=random.Random(seed), fail_p=0.0, serve_lag_p=0.0)
        seen |= set(out["staleness"])
    assert max(seen) == 2


def test_fifo_completion_would_break_the_bound_but_edf_does_not():
    # K=2, B=1: groups a, b, c start at version 0; d at 1 finishes first. Taking completed
    # groups in completion order would train b and c at versions 2 and 3 (staleness 3).
    buf = RolloutBuffer(batch_groups=1, max_staleness=2)
    a, b, c = (buf.try_admit() for _ in range(3))
    assert buf.try_admit() is None  # (K + 0 + 1) * B = 3 live groups at version 0
    buf.put_nowait(make_group(a.group_id, 0))
    assert [g.group_id for g in buf.try_select(0).groups] == [a.group_id]
    buf.serving_version = 1
    d = buf.try_admit()
    assert d.version == 1
    buf.put_nowait(make_group(d.group_id, 1))
    # b and c (deadline 2) are in flight; step at version 1 must take one of them, not d.
    assert buf.try_select(1) is None
    buf.put_nowait(make_group(c.group_id, 0))
    assert [g.group_id for g in buf.try_select(1).groups] == [c.group_id]
    buf.serving_version = 2
    buf.put_nowait(make_group(b.group_id, 0))
    assert [g.group_id for g in buf.try_select(2).groups] == [b.group_id]  # staleness 2 = K


def test_max_staleness_zero_is_synchronous():
    buf = RolloutBuffer(batch_groups=2, max_staleness=0)
    a, b = buf.try_admit(), buf.try_admit()
    assert buf.try_admit() is None
    buf.put_nowait(make_group(a.group_id, 0))
    assert buf.try_select(0) is None  # waits for the whole batch
    buf.put_nowait(make_group(b.group_id, 0))
    assert len(buf.try_select(0).groups) == 2
    assert buf.try_admit() is None  # nothing new until the engines serve version 1
    buf.serving_version = 1
    assert buf.try_admit().version == 1


def test_failures_give_their_slot_back():
    buf = RolloutBuffer(batch_groups=2, max_staleness=0)
    a, b = buf.try_admit(), buf.try_admit()
    assert b is not None and buf.try_admit() is None  # both slots taken
    buf.fail_nowait(a.group_id, "reward_error")
    c = buf.try_admit()
    assert c is not None
    assert buf.counts.failed["reward_error"] == 1 and buf.counts.balanced()


def test_consumption_check_drops_stale_groups_with_reason():
    buf = RolloutBuffer(batch_groups=1, max_staleness=1)
    a = buf.try_admit()
    buf.put_nowait(make_group(a.group_id, 0))
    sel = buf.try_select(5)  # a trainer far ahead (only possible if a caller bypassed admission)
    assert [(g.group_id, r) for g, r in sel.dropped] == [(a.group_id, "stale")]
    assert buf.counts.dropped["stale"] == 1 and buf.counts.balanced()


def test_put_waits_when_full():
    async def main():
        buf = RolloutBuffer(batch_groups=1, max_staleness=0, capacity=1)
        a = buf.try_admit()
        buf.serving_version = 1  # let a second group in without training
        b = buf.try_admit()
        await buf.put(make_group(a.group_id, 0))
        blocked = asyncio.create_task(buf.put(make_group(b.group_id, 1)))
        await asyncio.sleep(0.05)
        assert not blocked.done(), "put must wait while the buffer is full"
        sel = await buf.get_batch(0)
        assert [g.group_id for g in sel.groups] == [a.group_id]
        await asyncio.wait_for(blocked, 1.0)
        assert len(buf) == 1

    asyncio.run(main())


def test_close_wakes_every_waiter_and_accounts_for_what_is_left():
    async def main():
        buf = RolloutBuffer(batch_groups=2, max_staleness=0)
        a, b = buf.try_admit(), buf.try_admit()
        await buf.put(make_group(a.group_id, 0))
        trainer = asyncio.create_task(buf.get_batch(0))  # waits for b
        admitter = asyncio.create_task(buf.admit())  # waits for version 1
        await asyncio.sleep(0.02)
        assert not trainer.done() and not admitter.done()
        left, in_flight = await buf.close()
        with pytest.raises(BufferClosed):
            await trainer
        with pytest.raises(BufferClosed):
            await admitter
        assert [g.group_id for g in left] == [a.group_id] and in_flight == [b.group_id]
        buf.settle_in_flight(b.group_id, "shutdown")
        assert buf.counts.dropped["shutdown"] == 2 and buf.counts.balanced()
        with pytest.raises(BufferClosed):
            buf.put_nowait(make_group(b.group_id, 0))

    asyncio.run(main())


def test_a_failure_once_closed_counts_as_dropped_by_shutdown():
    """Shutdown, not the group, ended it: the buffer counts what the ledger and the log will say."""

    async def main():
        buf = RolloutBuffer(batch_groups=2, max_staleness=0)
        a, b = buf.try_admit(), buf.try_admit()
        assert await buf.fail(a.group_id, "reward_error") == ("failed", "reward_error")
        await buf.close()
        assert await buf.fail(b.group_id, "reward_error") == ("dropped", "shutdown")
        assert buf.counts.failed == {"reward_error": 1} and buf.counts.dropped == {"shutdown": 1}
        assert buf.counts.in_flight == 0 and buf.counts.balanced()

    asyncio.run(main())


def test_finite_source_ends_with_a_partial_batch():
    async def main():
        buf = RolloutBuffer(batch_groups=4, max_staleness=1)
        ids = [buf.try_admit() for _ in range(3)]
        await buf.finish_admission()
        assert await buf.admit() is None
        for adm in ids:
            await buf.put(make_group(adm.group_id, 0))
        sel = await buf.get_batch(0)
        assert len(sel.groups) == 3
        sel = await buf.get_batch(1)
        assert sel.groups == []

    asyncio.run(main())


def test_paused_admission_starts_nothing_and_drains_what_is_in_flight():
    """A full-weight swap: no group starts while paused; wait_drained returns once the last one is in."""

    async def scenario() -> None:
        buf = RolloutBuffer(batch_groups=2, max_staleness=1)
        a, b = buf.try_admit(), buf.try_admit()
        buf.pause_admission()
        assert buf.admission_room() == 0 and buf.try_admit() is None
        drained = asyncio.ensure_future(buf.wait_drained())
        await asyncio.sleep(0)
        await buf.put(make_group(a.group_id, 0))
        await asyncio.sleep(0)
        assert not drained.done()  # b is still in flight
        await buf.fail(b.group_id, "reward_error")
        await asyncio.wait_for(drained, 1)
        assert buf.try_admit() is None  # still paused after the drain
        await buf.set_serving_version(1)
        await buf.resume_admission()
        c = buf.try_admit()
        assert c is not None and c.version == 1 and buf.counts.balanced()

    asyncio.run(scenario())


def test_wait_drained_returns_at_once_when_nothing_is_in_flight_and_on_close():
    async def scenario() -> None:
        buf = RolloutBuffer(batch_groups=2, max_staleness=0)
        await asyncio.wait_for(buf.wait_drained(), 1)
        buf.try_admit()
        drained = asyncio.ensure_future(buf.wait_drained())
        await asyncio.sleep(0)
        assert not drained.done()
        await buf.close()
        await asyncio.wait_for(drained, 1)

    asyncio.run(scenario())


def test_try_admit_many_starts_the_prefix_admission_allows_at_one_version():
    buf = RolloutBuffer(batch_groups=2, max_staleness=1)  # (K + 0 + 1) * B = 4 live at version 0
    first = buf.try_admit(10)
    wave = buf.try_admit_many([11, 12, 13, 14, 15])
    assert [a.group_id for a in wave] == [11, 12, 13]  # room for three more
    assert {a.version for a in wave} == {0} and len({a.t_admitted for a in wave}) == 1
    assert buf.counts.in_flight == buf.counts.started == 4 and buf.try_admit_many([14]) == []
    buf.fail_nowait(first.group_id, "reward_error")  # its slot is given back
    with pytest.raises(ValueError, match="already live"):
        buf.try_admit_many([wave[0].group_id])
    with pytest.raises(ValueError, match="repeated"):
        buf.try_admit_many([14, 14])
    assert buf.counts.in_flight == 3 and buf.counts.balanced()  # a refused call starts nothing
    buf.serving_version = 1
    assert [(a.group_id, a.version) for a in buf.try_admit_many([14, 15, 16])] == [(14, 1), (15, 1), (16, 1)]
    asyncio.run(buf.finish_admission())
    assert buf.try_admit_many([17]) == []
    asyncio.run(buf.close())
    with pytest.raises(BufferClosed):
        buf.try_admit_many([17])


@settings(max_examples=200, deadline=None)
@given(K=st.integers(0, 4), B=st.integers(1, 4), seed=st.integers(0, 10**6),
       serve_lag_p=st.sampled_from([0.0, 0.5, 0.9]))
def test_deterministic_batches_and_versions_do_not_depend_on_completion_order(K, B, seed, serve_lag_p):
    """deterministic=True: step t trains exactly groups t*B .. t*B + B - 1, sampled at version
    max(0, t - K), whatever the order in which groups complete or engines catch up."""
    out = simulate(K, B, steps=8, rng=random.Random(seed), fail_p=0.0, serve_lag_p=serve_lag_p, deterministic=True)
    assert out["batches"] == [[(t * B + i, max(0, t - K)) for i in range(B)] for t in range(8)]


@settings(max_examples=200, deadline=None)
@given(K=st.integers(0, 4), B=st.integers(1, 4), seed=st.integers(0, 10**6),
       fail_p=st.sampled_from([0.1, 0.3]), serve_lag_p=st.sampled_from([0.0, 0.5, 0.9]))
def test_deterministic_mode_keeps_the_staleness_bound_when_groups_fail(K, B, seed, fail_p, serve_lag_p):
    out = simulate(K, B, steps=8, rng=random.Random(seed), fail_p=fail_p, serve_lag_p=serve_lag_p, deterministic=True)
    assert all(0 <= s <= K for s in out["staleness"])
    for batch in out["batches"]:
        assert [g for g, _ in batch] == sorted(g for g, _ in batch)
