"""The ledger: ids handed out once per attempt, settled once, and queued again after a snapshot."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.store.ledger import Ledger


def test_ids_are_stream_positions_and_a_finite_stream_ends() -> None:
    led = Ledger(limit=3)
    assert [led.next_id() for _ in range(4)] == [0, 1, 2, None]


def test_a_group_settles_once_and_only_after_it_was_handed_out() -> None:
    led = Ledger()
    gid = led.next_id()
    led.set_state(gid, "in_flight")
    led.settle(gid, "trained")
    with pytest.raises(ValueError, match="already settled"):
        led.settle(gid, "dropped", "stale")
    with pytest.raises(ValueError, match="never handed out"):
        led.settle(5, "failed", "generation_error")
    with pytest.raises(ValueError, match="live state"):
        led.set_state(led.next_id(), "trained")


def test_given_back_ids_come_first() -> None:
    led = Ledger()
    a, b = led.next_id(), led.next_id()
    led.give_back(b)
    assert led.next_id() == b and led.next_id() == 2
    led.set_state(a, "in_flight")
    with pytest.raises(ValueError, match="cannot be given back"):
        led.give_back(a)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["take", "settle", "live"]), min_size=1, max_size=80), st.randoms())
def test_a_snapshot_queues_exactly_the_unsettled_ids_below_its_cursor(ops, rnd) -> None:
    led = Ledger()
    handed: list[int] = []
    settled: set[int] = set()
    for op in ops:
        if op == "take" or not handed:
            handed.append(led.next_id())
            continue
        gid = rnd.choice(handed)
        if gid in settled:
            continue
        if op == "settle":
            led.settle(gid, rnd.choice(["trained", "dropped", "failed", "refused"]), "why")
            settled.add(gid)
        else:
            led.set_state(gid, rnd.choice(["in_flight", "buffered", "training"]))
    snap = json.loads(json.dumps(led.snapshot(step=3)))  # it is what a checkpoint writes
    assert snap["step"] == 3
    again = Ledger.from_snapshot(snap)
    requeued = [again.next_id() for _ in range(again.queued)]
    assert requeued == sorted(set(handed) - settled)
    assert again.next_id() == led.cursor  # then new ids continue from the cursor
    assert sum(again.fates.values()) == len(settled)
    for gid in settled:
        assert again.is_settled(gid)


def test_set_state_many_is_set_state_for_each_and_refuses_as_it_does() -> None:
    led = Ledger()
    ids = [led.next_id() for _ in range(4)]
    led.set_state_many(ids[:3], "in_flight")
    led.set_state_many(ids[1:3], "buffered")
    assert led.states() == {"in_flight": 1, "buffered": 2, "queued": 0}
    led.settle(ids[2], "trained")
    with pytest.raises(ValueError, match=r"groups \[2\] are already settled"):
        led.set_state_many(ids, "training")
    with pytest.raises(ValueError, match="live state"):
        led.set_state_many(ids[:2], "trained")
    assert led.states() == {"in_flight": 1, "buffered": 1, "queued": 0}  # nothing changed by a refusal
