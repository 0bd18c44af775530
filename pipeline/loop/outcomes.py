"""Outcomes: the one writer of what became of each group, in the ledger and in the RolloutLog.

Invariants:
- Every admitted group is live here from its admission (`start`) until it leaves, once, through
  `record`/`record_many`: trained, dropped (reason) or failed (reason). Leaving settles it in the
  ledger and appends its row to the RolloutLog in the same moment on the event loop, so a
  checkpoint taken between two steps sees the two agree.
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
from typing import Any, Sequence

import numpy as np
import structlog

from pipeline.loop.buffer import Admission, BufferClosed, RolloutBuffer
from pipeline.errors import FatalError
from pipeline.store.ledger import Ledger
from pipeline.store.rollout_log import RolloutLog
from pipeline.types import Generation, GroupOutcome, Prompt, RolloutGroup

MAX_CONSECUTIVE_FAILURES = 64  # this many groups failing in a row means the cause is not one group
TRACEBACKS_PER_SOURCE = 3  # full tracebacks logged per failing function (then its one-line error only)
# pending RolloutLog groups, or completion tokens, that make the flush loop write before its
# second is up. A flush costs ~20 ms whatever its size plus ~5 us a group (n=8, 16 tokens each,
# on one core), so at ten thousand groups a second flushing every 4,096 groups spent 5 us a group
# on the fixed part alone; the token bound keeps what is pending to about 16 MB of arrays.
FLUSH_GROUPS = 16384
FLUSH_TOKENS = 1 << 21

Exit = tuple[int, str, str, int, "Generation | None", "np.ndarray | None"]  # group, fate, reason, step, gen, rewards

log = structlog.get_logger(__name__)


class Outcomes:
    """Live groups, and their one exit each into the ledger and the RolloutLog."""

    def __init__(self, ledger: Ledger, rollout_log: RolloutLog, buffer: RolloutBuffer) -> None:
        self.ledger = ledger
        self.rollout_log = rollout_log
        self.buffer = buffer
        self.live: dict[int, tuple[Prompt, int, float]] = {}  # group id -> (prompt, version, t_admitted)
        self._consecutive_failures = 0
        self._tracebacks: Counter[str] = Counter()  # full tracebacks logged, per failing function

    def start(self, admissions: Sequence[Admission], prompts: Sequence[Prompt]) -> None:
        """Admitted groups are in flight."""
        for adm, prompt in zip(admissions, prompts):
            self.live[adm.group_id] = (prompt, adm.version, adm.t_admitted)
        self.ledger.set_state_many([adm.group_id for adm in admissions], "in_flight")

    def record(self, group_id: int, fate: str, reason: str, step: int, gen: Generation | None,
               rewards: np.ndarray | None) -> None:
        """The one exit of a group from the system: settled in the ledger, its RolloutLog entry appended."""
        self.record_many([(group_id, fate, reason, step, gen, rewards)])

    def record_many(self, items: Sequence[Exit]) -> None:
        """`record` for several groups, appended to the RolloutLog in one call."""
        now = time.monotonic()
        outcomes = []
        for group_id, fate, reason, step, gen, rewards in items:
            prompt, version, t_adm = self.live.pop(group_id)
            if gen is not None:  # an episode group's prompt is its first observation, known once generated
                prompt = gen.request.prompt
            self.ledger.settle(group_id, fate, reason)
            outcomes.append(GroupOutcome(group_id, prompt, version, fate, reason, step, gen, rewards, t_adm, now))
        self.rollout_log.append_many(outcomes)

    def record_eval(self, outcomes: Sequence[GroupOutcome]) -> None:
        """An evaluation round's groups (fate "eval"): logged, never settled, never live."""
        self.rollout_log.append_many(outcomes)

    def scored(self) -> None:
        """A group was generated and scored: the run of failures in a row is broken."""
        self._consecutive_failures = 0

    async def settle_failed(self, group_id: int, reason: str, gen: Generation | None, rewards: np.ndarray | None,
                            error: BaseException | None = None, **fields: Any) -> None:
        """A live group failed for good (or is dropped, if the buffer has closed for shutdown):
        logged with `error` and `fields`, then settled."""
        log.warning("group_failed", group_id=group_id, reason=reason, error=(str(error) or repr(error)) if error else None,
                    **fields, **self._traceback(reason, error))
        self._consecutive_failures += 1
        try:
            await self.buffer.fail(group_id, reason)
        except BufferClosed:
            pass  # shutdown accounts for it below through settle_in_flight
        if self.buffer.closed:
            self.buffer.settle_in_flight(group_id, "shutdown")
            self.record(group_id, "dropped", "shutdown", -1, gen, rewards)
            return
        self.record(group_id, "failed", reason, -1, gen, rewards)
        if self._consecutive_failures >= MAX_CONSECUTIVE_FAILURES:
            raise FatalError(f"{self._consecutive_failures} groups failed in a row, so the cause is not one group; "
                             f"the last: {reason}" + (f": {error}" if error else "") +
                             " (tracebacks in events.jsonl, event group_failed)")

    def _traceback(self, reason: str, error: BaseException | None) -> dict[str, Any]:
        """{"exc_info": error} while the function that raised `error` has had fewer than
        TRACEBACKS_PER_SOURCE tracebacks logged; {} for errors that are not a user function's."""
        if error is None or error.__cause__ is None:
            return {}
        source = f"{reason}:{getattr(error, 'function', '') or type(error.__cause__).__name__}"
        self._tracebacks[source] += 1
        return {"exc_info": error} if self._tracebacks[source] <= TRACEBACKS_PER_SOURCE else {}

    def drop_groups(self, groups: Sequence[RolloutGroup], reason: str) -> None:
        """Scored groups no step will train (the buffer's, a cut batch's) leave as dropped (`reason`)."""
        for g in groups:
            self.record(g.group_id, "dropped", reason, -1, g.generation, g.rewards)

    def drop_live(self, reason: str) -> None:
        """Every group still live leaves as dropped (`reason`): what shutdown finds in flight."""
        for gid in list(self.live):
            self.buffer.settle_in_flight(gid, reason)
            self.record(gid, "dropped", reason, -1, None, None)

    async def flush_loop(self) -> None:
        """Consumes the RolloutLog's pending rows; writes them to zarr in a thread about once a
        second, or sooner once FLUSH_GROUPS groups or FLUSH_TOKENS tokens are pending.

        Off the train loop: a flush costs tens of milliseconds whatever its size, and a trainer
        that waited for it would idle that long every time. Sooner when many are pending, so the
        log's own backstop (a flush on the appending thread, the event loop) stays unused.
        """
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.1)
            pending = self.rollout_log.pending
            if (pending >= FLUSH_GROUPS or self.rollout_log.pending_tokens >= FLUSH_TOKENS
                    or (pending and time.monotonic() - last >= 1.0)):
                await asyncio.to_thread(self.rollout_log.flush)
                last = time.monotonic()
