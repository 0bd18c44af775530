"""The rollout buffer: admission of new groups, versioned completed groups, batch selection.

Vocabulary. B = groups per training step, K = max_staleness. The trainer at version t (it has
done t steps) trains a batch and publishes t + 1; a group sampled at version u and trained by
that step has staleness t - u. Engines sample new groups at the *serving* version s <= t (the
newest version every engine has loaded). A group is *live* from admission until it is trained,
dropped or failed; live groups are in flight (being generated or scored) or buffered.

Invariants:
- Admission: a group may start only while `live_started < (K + s + 1) * B` (live_started =
  trained + buffered + in flight), and never beyond `max_groups`. Failed and dropped groups give
  their slot back, so a failure never starves the trainer.
- Staleness <= K at consumption, without discarding work. Completed groups arrive out of order,
  so picking the first B to finish is not enough (a slow group of an old version could be left
  behind until it is too stale). A group of version u must be trained by step u + K (its
  deadline). The admission bound guarantees the live groups with deadline <= d never exceed the
  B-slots of steps up to d; the selection keeps that true after every step: for each deadline d
  in [t, s + K - 1], the batch takes at least `need(d) = live(deadline <= d) - (d - t) * B` groups
  of deadline <= d, preferring completed groups of the oldest versions and waiting for in-flight
  ones only when a deadline forces it (earliest-deadline-first). Groups admitted later are
  sampled at version >= s, so they cannot tighten deadlines before s + K. With K = 0 this is the
  fully synchronous loop: the batch is exactly the B groups of the current version.
- Admission can be paused (a full-weight swap: engines hold one version, so the groups in
  flight finish before the weights change); `wait_drained` returns once none is in flight.
- A consumption-time check drops (and counts, reason "stale") anything older than K anyway.
- Bounded: at most `capacity` completed groups are held; `put` waits for room (backpressure).
  Capacity >= (K + 1) * B, the most that can ever be live, so a blocked producer can never hold
  a group the trainer is waiting for.
- Deterministic mode (`deterministic=True`): what a group is sampled with and which step trains
  it depend only on its place in the start order, never on timing. The i-th group started (i
  from 0 since the start or resume) is sampled at version start_version + max(0, i // B - K),
  the oldest the bound allows (the serving version if that is older, which only a failed or
  dropped group can cause), and each step takes the B lowest-id live groups, waiting for any
  of them still in flight. Without failures or drops that is exactly the B groups i // B = t.
- Accounting at every moment: started = trained + training + buffered + in_flight + dropped
  + failed ("training": selected for a step that has not finished; `commit` or `abandon` it).
- The buffer knows a group only as far as the bound and the selection need (its version while
  in flight, the scored group while stored). Its calls that start, store, select or end a group
  are made by `pipeline.loop.outcomes.Outcomes`, the owner of a group's life, each beside the
  group's own record there and its exit into the ledger and the RolloutLog.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

from pipeline.errors import PipelineError
from pipeline.types import RolloutGroup


class BufferClosed(PipelineError):
    """The buffer was closed; no more groups are admitted, put or consumed."""


class Admission(NamedTuple):
    """A started group: its id and the version it must be sampled with (a tuple: one per group,
    built in waves of hundreds, where a frozen dataclass costs several times more)."""

    group_id: int
    version: int
    t_admitted: float


@dataclass
class BufferCounts:
    started: int = 0
    trained: int = 0
    training: int = 0  # selected for a step that has not finished
    buffered: int = 0
    in_flight: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)

    @property
    def live(self) -> int:
        return self.trained + self.training + self.buffered + self.in_flight

    def balanced(self) -> bool:
        return self.started == (self.live + sum(self.dropped.values()) + sum(self.failed.values()))


@dataclass(frozen=True)
class Selection:
    """What one step takes from the buffer: groups to train and groups dropped at consumption."""

    groups: list[RolloutGroup]
    dropped: list[tuple[RolloutGroup, str]]
    waited_s: float  # time spent waiting for groups


class RolloutBuffer:
    """Admission control, the store of completed groups, and EDF batch selection."""

    def __init__(self, batch_groups: int, max_staleness: int, capacity: int = 0, max_groups: int | None = None,
                 first_group_id: int = 0, start_version: int = 0, deterministic: bool = False) -> None:
        if batch_groups < 1 or max_staleness < 0:
            raise ValueError(f"batch_groups must be >= 1 and max_staleness >= 0, got {batch_groups}, {max_staleness}")
        self.B = batch_groups
        self.K = max_staleness
        self.capacity = capacity or (max_staleness + 1) * batch_groups
        if self.capacity < (max_staleness + 1) * batch_groups:
            raise ValueError(f"capacity must be >= (max_staleness + 1) * batch_groups = "
                             f"{(max_staleness + 1) * batch_groups}, got {capacity}")
        self.max_groups = max_groups  # stop admitting once this many live groups were started
        # A resumed run starts at the checkpoint's version with nothing live: admission counts as
        # if exactly start_version * B groups were trained, so it does not burst ahead.
        self.start_version = start_version
        self.serving_version = start_version
        self.deterministic = deterministic
        self.counts = BufferCounts()
        self._next_id = first_group_id
        self._in_flight: dict[int, int] = {}  # group id -> version
        self._completed: dict[int, RolloutGroup] = {}  # insertion order = completion order
        self._admission_open = True
        self._paused = False
        self._closed = False
        self._cond = asyncio.Condition()

    # ------------------------------------------------------------------ admission

    def admission_room(self) -> int:
        """How many more groups may start now."""
        if self._paused:
            return 0
        limit = (self.K + self.serving_version - self.start_version + 1) * self.B
        if self.max_groups is not None:
            limit = min(limit, self.max_groups)
        return max(0, limit - self.counts.live)

    def try_admit(self, group_id: int | None = None) -> Admission | None:
        """Start one group if admission allows it now (synchronous core of `admit`).

        group_id: the caller's id for it (the ledger's stream position); default: the next of a counter.
        """
        if self._closed:
            raise BufferClosed("buffer closed")
        if not self._admission_open or self.admission_room() <= 0:
            return None
        if group_id is None:
            group_id = self._next_id
            self._next_id += 1
        elif group_id in self._in_flight or group_id in self._completed:
            raise ValueError(f"group {group_id} is already live")
        return self._start([group_id], time.monotonic())[0]

    def try_admit_many(self, group_ids: list[int]) -> list[Admission]:
        """Start the groups `group_ids` that admission allows now, in order (a prefix of them):
        `try_admit` for a wave of groups, with one time and one version for all of them."""
        if self._closed:
            raise BufferClosed("buffer closed")
        if not self._admission_open:
            return []
        live = [g for g in group_ids if g in self._in_flight or g in self._completed]
        if live or len(set(group_ids)) != len(group_ids):
            raise ValueError(f"groups {live or sorted(group_ids)} are already live or repeated")
        return self._start(group_ids[:self.admission_room()], time.monotonic())

    def _start(self, group_ids: list[int], now: float) -> list[Admission]:
        if self.deterministic:  # by place in the start order: the oldest version the bound allows
            first = self.counts.started
            versions = [min(self.serving_version, self.start_version + max(0, (first + i) // self.B - self.K))
                        for i in range(len(group_ids))]
        else:
            versions = [self.serving_version] * len(group_ids)
        self._in_flight.update(zip(group_ids, versions))
        self.counts.started += len(group_ids)
        self.counts.in_flight += len(group_ids)
        return [Admission(g, v, now) for g, v in zip(group_ids, versions)]

    async def admit(self, group_id: int | None = None) -> Admission | None:
        """Wait for room, then start one group. None once admission is finished for good."""
        async with self._cond:
            while True:
                if not self._admission_open and not self._closed:
                    return None
                adm = self.try_admit(group_id)
                if adm is not None:
                    return adm
                if self.max_groups is not None and self.counts.live >= self.max_groups and not self._in_flight \
                        and not self._completed:
                    return None
                await self._cond.wait()

    async def set_serving_version(self, version: int) -> None:
        """Every engine now serves `version`: new groups are sampled with it."""
        async with self._cond:
            if version < self.serving_version:
                raise ValueError(f"serving version cannot go back from {self.serving_version} to {version}")
            self.serving_version = version
            self._cond.notify_all()

    def pause_admission(self) -> None:
        """No group starts until `resume_admission` (groups already in flight go on)."""
        self._paused = True

    async def resume_admission(self) -> None:
        async with self._cond:
            self._paused = False
            self._cond.notify_all()

    async def wait_drained(self) -> None:
        """Wait until no group is in flight (or the buffer is closed)."""
        async with self._cond:
            while self._in_flight and not self._closed:
                await self._cond.wait()

    async def finish_admission(self) -> None:
        """No more groups will start (the prompt source is exhausted); partial batches may follow."""
        async with self._cond:
            self._admission_open = False
            self._cond.notify_all()

    # ------------------------------------------------------------------ producers

    def _leave_flight(self, group_id: int) -> int:
        try:
            version = self._in_flight.pop(group_id)
        except KeyError:
            raise ValueError(f"group {group_id} is not in flight") from None
        self.counts.in_flight -= 1
        return version

    def put_nowait(self, group: RolloutGroup) -> None:
        """Store a completed group now (the caller has checked there is room)."""
        if self._closed:
            raise BufferClosed("buffer closed")
        if len(self._completed) >= self.capacity:
            raise RuntimeError(f"buffer full ({self.capacity} groups)")
        expected = self._in_flight.get(group.group_id)
        if expected is not None and expected != group.version:
            raise ValueError(f"group {group.group_id} was admitted for version {expected} "
                             f"but was sampled with version {group.version}")
        self._leave_flight(group.group_id)
        self._completed[group.group_id] = group
        self.counts.buffered += 1

    def fail_nowait(self, group_id: int, reason: str) -> None:
        self._leave_flight(group_id)
        self.counts.failed[reason] += 1

    def drop_nowait(self, group_id: int, reason: str) -> None:
        self._leave_flight(group_id)
        self.counts.dropped[reason] += 1

    async def put(self, group: RolloutGroup) -> None:
        """A group finished generation and scoring; waits while the buffer is full."""
        await self.put_many([group])

    async def put_many(self, groups: list[RolloutGroup]) -> None:
        """Completed groups, in order; each waits while the buffer is full. One wake-up for all."""
        async with self._cond:
            for group in groups:
                while len(self._completed) >= self.capacity and not self._closed:
                    self._cond.notify_all()  # what is stored so far may be what the consumer waits for
                    await self._cond.wait()
                self.put_nowait(group)
            # A batch can be selected only once B groups are complete, or the last in flight is
            # in: waking the consumer for each put re-ran its selection per group for nothing.
            if len(self._completed) >= self.B or not self._in_flight:
                self._cond.notify_all()

    async def fail(self, group_id: int, reason: str) -> tuple[str, str]:
        """An in-flight group failed (generation or reward); its slot is given back. Once the
        buffer is closed it counts as dropped ("shutdown"): shutdown, not the group, ended it.
        Returns the fate and reason counted."""
        async with self._cond:
            if self._closed:
                self.drop_nowait(group_id, "shutdown")
                return "dropped", "shutdown"
            self.fail_nowait(group_id, reason)
            self._cond.notify_all()
            return "failed", reason

    async def drop(self, group_id: int, reason: str) -> None:
        """An in-flight group is dropped before buffering (e.g. filtered); its slot is given back."""
        async with self._cond:
            self.drop_nowait(group_id, reason)
            self._cond.notify_all()

    # ------------------------------------------------------------------ consumer

    def try_select(self, trainer_version: int) -> Selection | None:
        """Pick the batch for the step that starts at `trainer_version`, if it can be picked now."""
        t = trainer_version
        dropped: list[tuple[RolloutGroup, str]] = []
        for gid, g in list(self._completed.items()):
            if t - g.version > self.K:  # second line of defence; the selection below prevents it
                del self._completed[gid]
                self.counts.buffered -= 1
                self.counts.dropped["stale"] += 1
                dropped.append((g, "stale"))
        exhausted = not self._admission_open or (self.max_groups is not None and self.counts.live >= self.max_groups)
        if self.deterministic:
            return self._select_by_id(exhausted, dropped)
        # Oldest version first; completion order within a version.
        candidates = sorted(self._completed.values(), key=lambda g: g.version)[: self.B]
        if len(candidates) < self.B and not (exhausted and not self._in_flight):
            return Selection([], dropped, 0.0) if dropped else None
        live_versions = list(self._in_flight.values()) + [g.version for g in self._completed.values()]
        for d in range(t, self.serving_version + self.K):
            need = sum(1 for u in live_versions if u + self.K <= d) - (d - t) * self.B
            if need > 0 and sum(1 for g in candidates if g.version + self.K <= d) < need:
                return Selection([], dropped, 0.0) if dropped else None
        for g in candidates:
            del self._completed[g.group_id]
        self.counts.buffered -= len(candidates)
        self.counts.training += len(candidates)
        return Selection(candidates, dropped, 0.0)

    def _select_by_id(self, exhausted: bool, dropped: list[tuple[RolloutGroup, str]]) -> Selection | None:
        """Deterministic mode: the B lowest-id live groups, once none of them is in flight."""
        lowest = sorted([*self._in_flight, *self._completed])[: self.B]
        if any(g in self._in_flight for g in lowest) or (len(lowest) < self.B and not exhausted):
            return Selection([], dropped, 0.0) if dropped else None
        candidates = [self._completed.pop(g) for g in lowest]
        self.counts.buffered -= len(candidates)
        self.counts.training += len(candidates)
        return Selection(candidates, dropped, 0.0)

    def commit(self, groups: list[RolloutGroup]) -> None:
        """The step that took these groups finished: they are trained."""
        self.counts.training -= len(groups)
        self.counts.trained += len(groups)

    def abandon(self, groups: list[RolloutGroup], reason: str) -> None:
        """The step that took these groups will not finish (shutdown): they are dropped."""
        if groups:
            self.counts.training -= len(groups)
            self.counts.dropped[reason] += len(groups)

    async def get_batch(self, trainer_version: int) -> Selection:
        """Wait until a batch can be selected under the staleness rule, then take it.

        Returns fewer than B groups only when admission is finished and nothing is in flight
        (then possibly none: the run is out of data). Groups dropped at consumption are
        returned beside the batch so the caller can log them.
        """
        t0 = time.monotonic()
        dropped: list[tuple[RolloutGroup, str]] = []
        async with self._cond:
            while True:
                if self._closed:
                    raise BufferClosed("buffer closed")
                sel = self.try_select(trainer_version)
                if sel is not None:
                    dropped.extend(sel.dropped)
                    if sel.groups or not self._can_still_fill():
                        self._cond.notify_all()
                        return Selection(sel.groups, dropped, time.monotonic() - t0)
                await self._cond.wait()

    def _can_still_fill(self) -> bool:
        exhausted = not self._admission_open or (self.max_groups is not None and self.counts.live >= self.max_groups)
        return not exhausted or bool(self._in_flight) or bool(self._completed)

    # ------------------------------------------------------------------ shutdown

    async def close(self) -> tuple[list[RolloutGroup], list[int]]:
        """Refuse all further work and wake every waiter.

        Returns the completed groups that were never trained and the ids still in flight; the
        caller records them as dropped (reason "shutdown") so every group is accounted for.
        """
        async with self._cond:
            self._closed = True
            self._admission_open = False
            left = list(self._completed.values())
            self._completed.clear()
            self.counts.buffered = 0
            for g in left:
                self.counts.dropped["shutdown"] += 1
            self._cond.notify_all()
            return left, list(self._in_flight)

    def settle_in_flight(self, group_id: int, reason: str) -> None:
        """After close: account an in-flight group that will never finish as dropped."""
        if group_id in self._in_flight:
            self.drop_nowait(group_id, reason)

    def is_in_flight(self, group_id: int) -> bool:
        return group_id in self._in_flight

    def in_flight_versions(self) -> list[int]:
        return list(self._in_flight.values())

    def oldest_live_version(self) -> int:
        """The oldest version a live group uses (serving version if none): retention keeps it."""
        vs = list(self._in_flight.values()) + [g.version for g in self._completed.values()]
        return min(vs, default=self.serving_version)

    def __len__(self) -> int:
        return len(self._completed)
