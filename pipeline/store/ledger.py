"""The ledger: what became of every group of the data stream, across crashes and resumes.

A group's id is its position in the prompt stream (group g samples item g of the stream that
`PromptSource.item_at` defines), so an id means the same prompt in every attempt: a group
generated again after a crash keeps its id, and the RolloutLog (which refuses a repeated id)
can hold it only once.

An id is handed out (`next_id`), then settled once: trained, dropped or failed (with a reason)
when its group leaves the system, or refused (a malformed prompt; it never becomes a group). An
id handed out and not started is given back. Between the two its group is live; where it is in
its life (in flight, buffered, training) is the loop's to know (`Outcomes`), not part of what a
checkpoint must remember.

Invariants:
- Every id below `cursor` is settled, handed out in this attempt (its group live, or about to
  start) or queued for another attempt; ids are handed out once per attempt.
- `snapshot()` is taken on the event loop between two steps, so it is one consistent moment;
  what it calls settled is exactly what the RolloutLog holds in its first `log_rows` rows.
- `from_snapshot` queues every id below the cursor that was not settled at the snapshot: the
  groups that were live then, and the ones settled after it (their outcome died with the
  process, or is cut from the RolloutLog on resume). They go first, in id order.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any

FORMAT_VERSION = 1
SETTLED_FATES = ("trained", "dropped", "failed", "refused")


class Ledger:
    """Group ids (stream positions), their fates, and what a checkpoint must remember of them."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit  # ids >= limit do not exist (a finite data stream); None = endless
        self.cursor = 0  # next id never handed out
        self._queue: deque[int] = deque()  # ids to attempt again, before the cursor's
        # settled ids, compactly: every id < _settled_below is settled, and so are those in _settled_above
        self._settled_below = 0
        self._settled_above: set[int] = set()
        self.fates: Counter[str] = Counter()  # "trained", "dropped:<reason>", "failed:<reason>", "refused"

    # ------------------------------------------------------------------ handing out ids

    def next_id(self) -> int | None:
        """The next id to attempt: a queued one first, then a new one (None: the stream is over)."""
        if self._queue:
            return self._queue.popleft()
        if self.limit is not None and self.cursor >= self.limit:
            return None
        gid = self.cursor
        self.cursor += 1
        return gid

    def give_back(self, gid: int) -> None:
        """An id handed out but not started (admission closed): it is the next one handed out again."""
        if gid >= self.cursor or self.is_settled(gid) or gid in self._queue:
            raise ValueError(f"group {gid} is not handed out (cursor {self.cursor}), or settled, or queued "
                             "already; only an id handed out and not started can be given back")
        self._queue.appendleft(gid)

    @property
    def queued(self) -> int:
        return len(self._queue)

    # ------------------------------------------------------------------ settling

    def settle(self, gid: int, fate: str, reason: str = "") -> None:
        """The group left the system: trained, dropped or failed (with reason), or refused."""
        if fate not in SETTLED_FATES:
            raise ValueError(f"fate must be one of {SETTLED_FATES}, got {fate!r}")
        if gid >= self.cursor:
            raise ValueError(f"group {gid} was never handed out (cursor {self.cursor})")
        if self.is_settled(gid):
            raise ValueError(f"group {gid} is already settled; a group leaves the system once")
        self._settled_above.add(gid)
        while self._settled_below in self._settled_above:  # keep the explicit set small
            self._settled_above.discard(self._settled_below)
            self._settled_below += 1
        self.fates[fate if fate in ("trained", "refused") else f"{fate}:{reason}"] += 1

    def is_settled(self, gid: int) -> bool:
        return gid < self._settled_below or gid in self._settled_above

    def states(self) -> Counter[str]:
        """How many ids wait here unsettled and not handed out: {"queued": n} (live groups' states
        are `Outcomes`')."""
        return Counter({"queued": len(self._queue)})

    # ------------------------------------------------------------------ persistence

    def snapshot(self, **extra: Any) -> dict[str, Any]:
        """A JSON-able picture of this moment (with the caller's fields: step, log_rows, ...)."""
        return {
            "format": FORMAT_VERSION,
            "cursor": self.cursor,
            "limit": self.limit,
            "settled_below": self._settled_below,
            "settled_above": sorted(self._settled_above),
            "fates": dict(self.fates),
            **extra,
        }

    @classmethod
    def from_snapshot(cls, snap: dict[str, Any], limit: int | None = None) -> Ledger:
        """The ledger at a snapshot, with every unsettled id below its cursor queued again."""
        if snap.get("format") != FORMAT_VERSION:
            raise ValueError(f"ledger format {snap.get('format')!r}, this code reads {FORMAT_VERSION}")
        led = cls(limit)
        led.cursor = int(snap["cursor"])
        led._settled_below = int(snap["settled_below"])
        led._settled_above = {int(x) for x in snap["settled_above"]}
        led.fates = Counter({k: int(v) for k, v in snap["fates"].items()})
        led._queue = deque(g for g in range(led._settled_below, led.cursor) if g not in led._settled_above)
        return led
