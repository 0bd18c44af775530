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
    led.settle(gid, "trained")
    with pytest.raises(ValueError, match="already settled"):
        led.settle(gid, "dropped", "stale")
    with pytest.raises(ValueError, match="never handed out"):
        led.settle(5, "failed", "generation_error")
    with pytest.raises(ValueError, match="fate must be one of"):
        led.settle(led.next_id(), "buffered")
    assert led.fates == {"trained": 1}


def test_given_back_ids_come_first() -> None:
    led = Ledger()
    a, b = led.next_id(), led.next_id()
    led.give_back(b)
    assert led.states() == {"queued": 1}
    with pytest.raises(ValueError, match="queued already"):
        led.give_back(b)  # twice would hand it out twice
    assert led.next_id() == b and led.next_id() == 2
    led.settle(a, "trained")
    with pytest.raises(ValueError, match="can be given back"):
        led.give_back(a)
    with pytest.raises(ValueError, match="not handed out"):
        led.give_back(7)
    assert led.states() == {"queued": 0} and led.next_id() == 3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["take", "settle", "give_back"]), min_size=1, max_size=80), st.randoms())
def test_a_snapshot_queues_exactly_the_unsettled_ids_below_its_cursor(ops, rnd) -> None:
    led = Ledger()
    handed: list[int] = []  # handed out and not given back
    settled: set[int] = set()
    for op in ops:
        if op == "take" or not handed:
            gid = led.next_id()
            assert gid not in handed and gid not in settled, "an id is handed out once per attempt"
            handed.append(gid)
            continue
        gid = rnd.choice(handed)
        if gid in settled:
            continue
        if op == "settle":
            led.settle(gid, rnd.choice(["trained", "dropped", "failed", "refused"]), "why")
            settled.add(gid)
        else:
            led.give_back(gid)
            handed.remove(gid)
    snap = json.loads(json.dumps(led.snapshot(step=3)))  # it is what a checkpoint writes
    assert snap["step"] == 3
    again = Ledger.from_snapshot(snap)
    requeued = [again.next_id() for _ in range(again.queued)]
    assert requeued == sorted(set(range(led.cursor)) - settled)
    assert again.next_id() == led.cursor  # then new ids continue from the cursor
    assert sum(again.fates.values()) == len(settled)
    for gid in settled:
        assert again.is_settled(gid)
