"""Outcomes: the one owner of a group's life, from its admission to its one exit.

    admit ─► in_flight ─► buffered ─► training ─► trained (step s)
                 │            │           │
                 └────────────┴───────────┴─────► dropped (reason) | failed (reason)

Each change of a group's state is one call here, which does the buffer's side (its slot, the
staleness bound, EDF selection) and the group's side (its record here; at its exit the ledger
and the RolloutLog) together; no other component pairs a buffer call with a ledger or log write.

Invariants:
- A group is live here from `admit`/`admit_now` until it leaves, once: `trained`, `drop`,
  `settle_failed`, or shutdown (`close`, then `drop_live`). A second exit, or a change from a
  state the group is not in, raises ValueError and changes nothing.
- Leaving appends the group's row to the RolloutLog and then settles it in the ledger in the same
  moment on the event loop (nothing awaited between), so a checkpoint taken between two steps
  sees the two agree; the buffer counts the same fate and reason.
- A group that fails once shutdown has closed the buffer is dropped ("shutdown"), in the buffer,
  the ledger and the log alike.
- Evaluation groups are never live and never in the ledger: `record_eval` only appends their rows.
- MAX_CONSECUTIVE_FAILURES groups failing in a row end the run (the cause is not one group),
  with an error that says the last failure's reason and error.
- A failure is logged here ("group_failed"); a user's function that raised (a reward function,
  an environment) has its own traceback in the event for its first TRACEBACKS_PER_SOURCE
  failures, so events.jsonl shows where it broke without a traceback per group.
- `flush_loop` writes pending rows to zarr in a worker thread about once a second, or sooner
  once FLUSH_GROUPS groups or FLUSH_TOKENS tokens are pending.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import structlog

from pipeline.errors import FatalError
from pipeline.loop.buffer import Admission, BufferClosed, RolloutBuffer, Selection
from pipeline.store.ledger import Ledger
from pipeline.store.rollout_log import RolloutLog
from pipeline.types import Generation, GroupOutcome, Prompt, RolloutGroup

MAX_CONSECUTIVE_FAILURES = 64  # this many groups failing in a row means the cause is not one group
TRACEBACKS_PER_SOURCE = 3  # full tracebacks logged per failing function (then its one-line error only)
# pending RolloutLog groups, or completion tokens, that make the flush loop write before its
# second is up. A flush has a fixed cost whatever its size beside a small one per group, so at
# high rates flushing every few thousand groups spent as much on the fixed part as on the groups
# (docs/results.md); the token bound keeps the arrays pending in memory bounded when groups are long.
FLUSH_GROUPS = 16384
FLUSH_TOKENS = 1 << 21

Exit = tuple[int, str, str, int, "Generation | None", "np.ndarray | None"]  # group, fate, reason, step, gen, rewards

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Live:
    """A live group: where it is in its life, and what its RolloutLog row will need."""

    prompt: Prompt
    version: int  # the version it is sampled with
    t_admitted: float  # time.monotonic() at admission
    state: str = "in_flight"  # then "buffered" (handed to the buffer), then "training" (in a step's batch)
    group: RolloutGroup | None = None  # the scored group, from "buffered" on


class Outcomes:
    """Live groups, each state change of theirs in the buffer and here, and their one exit each
    into the ledger and the RolloutLog."""

    def __init__(self, ledger: Ledger, rollout_log: RolloutLog, buffer: RolloutBuffer) -> None:
        self.ledger = ledger
        self.rollout_log = rollout_log
        self.buffer = buffer
        # group id -> its record, in the order of each one's last change (so shutdown drops a
        # step's batch in the order it was selected, and what is in flight in admission order)
        self.live: dict[int, Live] = {}
        self._consecutive_failures = 0
        self._tracebacks: Counter[str] = Counter()  # full tracebacks logged, per failing function

    # ------------------------------------------------------------------ start

    async def admit(self, group_id: int, prompt: Prompt) -> Admission | None:
        """Wait for room under the staleness bound, then start the group (in flight). None once
        admission is finished for good: the group did not start."""
        adm = await self.buffer.admit(group_id)
        if adm is not None:
            self._start([adm], [prompt])
        return adm

    def admit_now(self, group_ids: Sequence[int], prompts: Sequence[Prompt]) -> list[Admission]:
        """Start the groups that admission allows now, without waiting (a prefix of `group_ids`,
        at one version); the others did not start."""
        adms = self.buffer.try_admit_many(list(group_ids))
        self._start(adms, prompts)
        return adms

    def _start(self, admissions: Sequence[Admission], prompts: Sequence[Prompt]) -> None:
        for adm, prompt in zip(admissions, prompts):
            self.live[adm.group_id] = Live(prompt, adm.version, adm.t_admitted)

    # ------------------------------------------------------------------ on the way

    async def buffered(self, groups: list[RolloutGroup]) -> None:
        """Scored groups into the buffer (waiting for room). If shutdown closed it, those it never
        stored leave as dropped ("shutdown"), their rows kept; the close dropped the others."""
        for g in groups:
            self._expect(g.group_id, "in_flight")
        for g in groups:
            self._move(g.group_id, "in_flight", "buffered").group = g
        try:
            await self.buffer.put_many(groups)
        except BufferClosed:  # shutting down: the run is ending, not failing
            left = [g for g in groups if self.buffer.is_in_flight(g.group_id)]
            for g in left:
                self.buffer.settle_in_flight(g.group_id, "shutdown")
            self._leave_many([(g.group_id, "dropped", "shutdown", -1, g.generation, g.rewards) for g in left])

    async def select(self, trainer_version: int) -> Selection:
        """Wait for the batch of the step that starts at `trainer_version` (the buffer's EDF
        selection); its groups are training from here. What the buffer dropped at consumption
        leaves as dropped, with the buffer's reason."""
        sel = await self.buffer.get_batch(trainer_version)
        # nothing awaited from here on: a cancelled select has either taken the batch or not
        self._leave_many([(g.group_id, "dropped", reason, -1, g.generation, g.rewards) for g, reason in sel.dropped])
        for g in sel.groups:
            self._move(g.group_id, "buffered", "training")
        return sel

    def _move(self, group_id: int, was: str, state: str) -> Live:
        """The live group `group_id`, from state `was` to `state` (and to the end of `live`)."""
        rec = self._expect(group_id, was)
        del self.live[group_id]
        rec.state = state
        self.live[group_id] = rec
        return rec

    def _expect(self, group_id: int, state: str) -> Live:
        rec = self.live.get(group_id)
        if rec is None or rec.state != state:
            raise ValueError(f"group {group_id} is {rec.state if rec else 'not live'}, not {state}: "
                             "a group goes through its states in order and leaves once")
        return rec

    # ------------------------------------------------------------------ exits

    def trained(self, groups: Sequence[RolloutGroup], step: int) -> None:
        """The step `step` trained these groups (its version is published): they leave as trained."""
        for g in groups:
            self._expect(g.group_id, "training")
        self.buffer.commit(list(groups))
        self._leave_many([(g.group_id, "trained", "", step, g.generation, g.rewards) for g in groups])

    async def drop(self, group_id: int, reason: str, gen: Generation | None, rewards: np.ndarray | None) -> None:
        """A group in flight that no step will train (`reason`, e.g. zero_advantage) leaves as dropped."""
        self._expect(group_id, "in_flight")
        await self.buffer.drop(group_id, reason)
        self._leave_many([(group_id, "dropped", reason, -1, gen, rewards)])

    def scored(self) -> None:
        """A group was generated and scored: the run of failures in a row is broken."""
        self._consecutive_failures = 0

    async def settle_failed(self, group_id: int, reason: str, gen: Generation | None, rewards: np.ndarray | None,
                            error: BaseException | None = None, **fields: Any) -> None:
        """A group in flight failed for good: logged with `error` and `fields`, then it leaves as
        failed (`reason`), or as dropped ("shutdown") if shutdown has closed the buffer."""
        self._expect(group_id, "in_flight")
        log.warning("group_failed", group_id=group_id, reason=reason, error=(str(error) or repr(error)) if error else None,
                    **fields, **self._traceback(reason, error))
        self._consecutive_failures += 1
        fate, counted = await self.buffer.fail(group_id, reason)
        self._leave_many([(group_id, fate, counted, -1, gen, rewards)])
        if fate == "failed" and self._consecutive_failures >= MAX_CONSECUTIVE_FAILURES:
            raise FatalError(f"{self._consecutive_failures} groups failed in a row, so the cause is not one group; "
                             f"the last: {reason}" + (f": {error}" if error else "") +
                             " (tracebacks in events.jsonl, event group_failed)")

    async def close(self) -> None:
        """Shutdown's first move: the buffer closes (no group is admitted, stored or selected any
        more, every waiter wakes) and the groups it held leave as dropped ("shutdown")."""
        left, _ = await self.buffer.close()
        self._leave_many([(g.group_id, "dropped", "shutdown", -1, g.generation, g.rewards) for g in left])

    def drop_live(self, reason: str) -> None:
        """After `close` and the loops' end, every group still live leaves as dropped (`reason`):
        the batch whose step shutdown cut, then what was in flight."""
        training = [(gid, rec) for gid, rec in self.live.items() if rec.state == "training"]
        rest = [(gid, rec) for gid, rec in self.live.items() if rec.state != "training"]
        self.buffer.abandon([rec.group for _, rec in training], reason)
        for gid, _ in rest:
            self.buffer.settle_in_flight(gid, reason)
        self._leave_many([(gid, "dropped", reason, -1, rec.group.generation if rec.group else None,
                           rec.group.rewards if rec.group else None) for gid, rec in training + rest])

    def _leave_many(self, items: Sequence[Exit]) -> None:
        """The one exit of these live groups: their RolloutLog rows appended in one call, then each
        settled in the ledger. A group that is not live (it left already) raises before anything."""
        if not items:
            return
        now = time.monotonic()
        live = self.live
        outcomes = []
        for group_id, fate, reason, step, gen, rewards in items:
            rec = live.get(group_id)
            if rec is None:
                raise ValueError(f"group {group_id} is not live: a group leaves the system once")
            # an episode group's prompt is its first observation, known once generated
            prompt = gen.request.prompt if gen is not None else rec.prompt
            outcomes.append(GroupOutcome(group_id, prompt, rec.version, fate, reason, step, gen, rewards,
                                         rec.t_admitted, now))
        self.rollout_log.append_many(outcomes)  # all or none: a repeated group raises before anything settles
        for o in outcomes:
            del live[o.group_id]
            self.ledger.settle(o.group_id, o.fate, o.reason)

    def _traceback(self, reason: str, error: BaseException | None) -> dict[str, Any]:
        """{"exc_info": error} while the function that raised `error` has had fewer than
        TRACEBACKS_PER_SOURCE tracebacks logged; {} for errors that are not a user function's."""
        if error is None or error.__cause__ is None:
            return {}
        source = f"{reason}:{getattr(error, 'function', '') or type(error.__cause__).__name__}"
        self._tracebacks[source] += 1
        return {"exc_info": error} if self._tracebacks[source] <= TRACEBACKS_PER_SOURCE else {}

    # ------------------------------------------------------------------ the log

    def record_eval(self, outcomes: Sequence[GroupOutcome]) -> None:
        """An evaluation round's groups (fate "eval"): logged, never settled, never live."""
        self.rollout_log.append_many(outcomes)

    async def flush_loop(self) -> None:
        """Consumes the RolloutLog's pending rows; writes them to zarr in a thread about once a
        second, or sooner once FLUSH_GROUPS groups or FLUSH_TOKENS tokens are pending.

        Off the train loop: a flush has a fixed cost whatever its size, and a trainer that waited
        for it would idle that long every time. Sooner when many are pending, so the log's own
        backstop (a flush on the appending thread, the event loop) stays unused.
        """
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.1)
            pending = self.rollout_log.pending
            if (pending >= FLUSH_GROUPS or self.rollout_log.pending_tokens >= FLUSH_TOKENS
                    or (pending and time.monotonic() - last >= 1.0)):
                await asyncio.to_thread(self.rollout_log.flush)
                last = time.monotonic()
