"""Admission: ledger ids to admitted groups under the staleness bound, and on to generation.

Invariants:
- An id is admitted only when the buffer admits it (the staleness bound and capacity), through
  `Outcomes`, which makes its group live in the same call; an id handed out but not admitted is
  given back to the ledger, to be handed out again first.
- Each item of the prompt source becomes a Prompt once, however often the stream draws it; an item
  that cannot be one is refused on its own (settled "refused" in the ledger with its reason),
  logged for the first few of each reason, and if every item of the source is refused with none
  accepted the run ends with a ConfigError: it could only refuse them again.
- The loop awaits between refusals, so a run of them never holds the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import structlog

from pipeline.loop.buffer import Admission, RolloutBuffer
from pipeline.config.schema import SamplingConfig
from pipeline.errors import ConfigError, PromptError
from pipeline.faults import crash_point
from pipeline.loop.generation import Generator
from pipeline.store.ledger import Ledger
from pipeline.loop.outcomes import Outcomes
from pipeline.data.prompts import PromptBuilder
from pipeline.data.refusals import LOGGED_PER_REASON, Refusals
from pipeline.data.tasks import PromptSource
from pipeline.types import GroupRequest, Prompt

log = structlog.get_logger(__name__)


class Admitter:
    """The admission loop and the prompts it admits."""

    def __init__(self, *, ledger: Ledger, source: PromptSource, builder: PromptBuilder, buffer: RolloutBuffer,
                 outcomes: Outcomes, generator: Generator, sampling: SamplingConfig, seed: int, max_wave: int,
                 spawn: Callable[[Any, str], asyncio.Task[Any]]) -> None:
        self.ledger = ledger
        self.source = source
        self.builder = builder
        self.buffer = buffer
        self.outcomes = outcomes
        self.generator = generator
        self.sampling = sampling
        self.seed = seed
        self.max_wave = max_wave  # groups per engine call: batch_groups where engines have generate_many, else 1
        self._spawn = spawn
        self.refusals = Refusals(len(source.items))
        # id(item) -> (item, its Prompt or the PromptError refusing it): each item is converted (and
        # tokenized) once, not every time the stream draws it; the item is kept so a reused id cannot match
        self._prompts: dict[int, tuple[Any, Prompt | PromptError]] = {}

    async def admission_loop(self) -> None:
        """Consumes ledger ids (stream positions); produces generation tasks; waits on admission.

        Groups admitted together share a version: with an engine that samples many groups per
        call (`generate_many`) they go as one call, up to batch_groups at a time; otherwise each
        gets its own task. One task per group costs more than the group itself once the engine
        is fast, so batching is what keeps the loop's cost per group small.
        """
        max_wave = self.max_wave
        while (gid := self.ledger.next_id()) is not None:
            prompt = self.prompt_or_refuse(gid)
            if prompt is None:
                await asyncio.sleep(0)  # a run of refusals must not hold the loop: signal handlers run on it
                continue
            adm = await self.outcomes.admit(gid, prompt)
            if adm is None:
                self.ledger.give_back(gid)
                return
            # more groups that may start now, without waiting: the same version, so one call
            room = self.buffer.admission_room()
            ids, prompts = [gid], [prompt]
            while len(ids) <= room and (gid := self.ledger.next_id()) is not None:
                prompt = self.prompt_or_refuse(gid)
                if prompt is None:
                    break  # refusals end the wave: the outer loop yields between them
                ids.append(gid)
                prompts.append(prompt)
            adms = [adm, *self.outcomes.admit_now(ids[1:], prompts[1:])]
            for gid in reversed(ids[len(adms):]):  # not started (nothing awaited since `room`, so none)
                self.ledger.give_back(gid)
            wave = self._requests(adms, prompts)
            for i in range(0, len(wave), max_wave):
                part = wave[i:i + max_wave]
                if max_wave == 1:
                    self._spawn(self.generator.group_task(*part[0]), f"group-{part[0][0].group_id}")
                else:
                    self._spawn(self.generator.wave_task(part), f"groups-{part[0][0].group_id}+{len(part)}")
        await self.buffer.finish_admission()
        log.info("prompts_exhausted", cursor=self.ledger.cursor)

    def prompt_or_refuse(self, gid: int) -> Prompt | None:
        """Item `gid` of the stream as a Prompt; a malformed one is refused (settled), not the run,
        unless every item of the source is (ConfigError: the run could only refuse them again)."""
        index = self.source.index_at(gid)
        item = self.source.items[index]
        hit = self._prompts.get(id(item))
        if hit is None or hit[0] is not item:
            try:
                hit = (item, self.builder.build(item))
                self.refusals.accept()
            except PromptError as e:  # this item is refused, now and whenever the stream draws it again
                hit = (item, e)
            self._prompts[id(item)] = hit
        if not isinstance(hit[1], PromptError):
            return hit[1]
        error = hit[1]
        self.ledger.settle(gid, "refused", error.reason)
        n = self.refusals.refuse(index, error.reason, str(error))
        if n <= LOGGED_PER_REASON:
            more = {"hint": "further refusals of this kind are counted, not logged"} if n == LOGGED_PER_REASON else {}
            log.warning("prompt_refused", group_id=gid, reason=str(error), kind=error.reason, **more)
        if self.refusals.everything_refused:
            raise ConfigError(f"every prompt of the data set was refused: {self.refusals.items} of "
                              f"{self.refusals.items} distinct prompts, none usable ({self.refusals.describe()})")
        return None

    def _requests(self, adms: list[Admission], prompts: list[Prompt]) -> list[tuple[Admission, GroupRequest]]:
        """Each admitted group's request to the engines."""
        sampling = self.sampling
        base = self.seed * 1_000_003
        wave = []
        for adm, prompt in zip(adms, prompts):
            crash_point("admission")
            gid = adm.group_id
            seed = (base + gid) % 2**31 if sampling.per_request_seed else None
            wave.append((adm, GroupRequest(gid, prompt, sampling.n, sampling.max_new_tokens, seed)))
        return wave
