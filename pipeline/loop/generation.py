"""Generation: admitted groups to Generations from the engines, retried until they succeed or fail for good.

Invariants:
- A group's call goes to the least loaded engine in rotation; a call that raises one of
  ENGINE_ERRORS or exceeds engine.request_timeout_s fails that attempt, not the run: it counts
  against the engine (`EngineRotation.failed`) and is retried after retry_backoff_s * 2**r,
  up to engine.retries, then the group is settled as failed. A dead engine's calls use no retry
  while another engine, or this one restarted, can take the group.
- Groups admitted together (one version) go as one `generate_many` call where the engines have
  it; a group that call failed goes on alone through the per-group retries.
- Every generated group goes on to scoring (`accept`); every failed one is settled through
  `Outcomes`. Nothing here touches the buffer or the ledger itself.
- With an environment (`episodes`), an attempt is the group's n episodes from their start on one
  engine (`Episodes.run`): an engine failure in any turn fails the attempt, retried from the
  first turn; an environment's failure (EnvError) fails the group with its reason, no retry.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

import structlog

from pipeline.loop.buffer import Admission
from pipeline.config.schema import EngineConfig
from pipeline.engines.base import Engine
from pipeline.envs.protocol import EnvError
from pipeline.loop.episodes import Episodes
from pipeline.errors import EngineDeadError, GenerationError, RecoverableError
from pipeline.loop.outcomes import Outcomes
from pipeline.loop.rotation import EngineRotation
from pipeline.observe.metrics import Count
from pipeline.types import AdapterRef, Generation, GroupRequest
from pipeline.loop.versions import Versions

log = structlog.get_logger(__name__)

# what an engine call may raise and still be only that attempt's failure: the engines' own errors,
# timeouts, and what vLLM and aiohttp raise when a request or the engine behind it breaks
ENGINE_ERRORS = (RecoverableError, TimeoutError, EngineDeadError, RuntimeError, ValueError, OSError)

Accept = Callable[[list[tuple[Admission, Generation]]], Awaitable[None]]


class Generator:
    """Engine calls for admitted groups and for evaluation rounds, with their retries."""

    def __init__(self, *, rotation: EngineRotation, versions: Versions, outcomes: Outcomes, cfg: EngineConfig,
                 spawn: Callable[[Any, str], asyncio.Task[Any]], accept: Accept, episodes: Episodes | None = None) -> None:
        self.rotation = rotation
        self.episodes = episodes  # an environment task: each group's n episodes in place of one call
        self.versions = versions
        self.outcomes = outcomes
        self.cfg = cfg
        self._spawn = spawn
        self._accept = accept  # generated groups go on to scoring
        self.retries = Count()  # attempts retried, over the session (Reporting reads it)

    async def group_task(self, adm: Admission, request: GroupRequest, attempt: int = 0) -> None:
        """Generates one group and hands it to scoring; a group that fails for good is settled."""
        gen = await self._generate(adm, request, attempt)
        if gen is not None:
            await self._accept([(adm, gen)])

    async def wave_task(self, wave: list[tuple[Admission, GroupRequest]]) -> None:
        """Groups admitted together (one version), sampled by one `generate_many` call; a group
        the call failed goes on alone, through the per-group retries."""
        async with self.rotation.call() as (engine, epoch):
            try:
                async with asyncio.timeout(self.cfg.request_timeout_s):
                    results = await engine.generate_many([r for _, r in wave],
                                                         self.versions.adapters[wave[0][0].version])
                if len(results) != len(wave):
                    raise GenerationError(f"engine {engine.name} returned {len(results)} results for {len(wave)} groups")
            except ENGINE_ERRORS as e:  # this call failed: each group goes on alone through its retries
                results = [e] * len(wave)
        done: list[tuple[Admission, Generation]] = []
        failed = False
        for (adm, request), r in zip(wave, results):
            if isinstance(r, Generation):
                done.append((adm, r))
                continue
            if not failed:  # one failed call counts once against the engine
                self.rotation.failed(engine, r, epoch)
                failed = True
            attempt = await self._after_failed_attempt(adm, engine, r, 0)
            if attempt >= 0:
                self._spawn(self.group_task(adm, request, attempt), f"group-{adm.group_id}")
        if not failed:
            self.rotation.succeeded(engine)
        if done:
            await self._accept(done)

    async def _generate(self, adm: Admission, request: GroupRequest, attempt: int = 0) -> Generation | None:
        """One group from the engines: retried (with backoff, on the least loaded engine) until it
        succeeds or engine.retries are spent; None means it failed for good (already settled).
        `attempt` > 0 continues the retries of a group whose batch call failed it."""
        while True:
            if attempt:
                await asyncio.sleep(self.cfg.retry_backoff_s * 2 ** (attempt - 1))
            async with self.rotation.call() as (engine, epoch):
                try:
                    gen = await self._sample(engine, request, self.versions.adapters[adm.version])
                    self.rotation.succeeded(engine)
                    return gen
                except (EnvError, *ENGINE_ERRORS) as e:
                    error = e
            if isinstance(error, EnvError):  # the environment's failure: the group's, not the engine's
                await self.outcomes.settle_failed(adm.group_id, error.reason, None, None, error, engine=engine.name)
                return None
            self.rotation.failed(engine, error, epoch)
            attempt = await self._after_failed_attempt(adm, engine, error, attempt)
            if attempt < 0:
                return None

    async def _sample(self, engine: Engine, request: GroupRequest, adapter: AdapterRef) -> Generation:
        """One attempt at a group: one engine call, or the group's episodes (each turn under the timeout)."""
        if self.episodes is not None:
            return await self.episodes.run(engine, request, adapter)
        async with asyncio.timeout(self.cfg.request_timeout_s):
            return await engine.generate(request, adapter)

    async def _after_failed_attempt(self, adm: Admission, engine: Engine, error: BaseException, attempt: int) -> int:
        """The attempt to retry next, or -1: the group failed for good (settled here).

        An engine call failing is this attempt's failure, counted and logged, not the run's; a
        dead engine's calls do not use up retries (another engine, or this one restarted, takes the
        group)."""
        reason = "generation_timeout" if isinstance(error, TimeoutError) else "generation_error"
        can_generate = self.rotation.can_generate
        if isinstance(error, EngineDeadError) and can_generate:
            return attempt
        if attempt >= self.cfg.retries or not can_generate:
            await self.outcomes.settle_failed(adm.group_id, reason, None, None, error, engine=engine.name,
                                              attempts=attempt + 1)
            if not can_generate:
                raise self.rotation.no_engine_error()  # nothing can generate any more
            return -1
        self.retries += 1
        log.info("generation_retry", group_id=adm.group_id, engine=engine.name, attempt=attempt + 1,
                 reason=reason, error=repr(error))
        return attempt + 1

    async def generate_eval(self, requests: list[GroupRequest], ref: AdapterRef,
                            batch: int) -> list[Generation | BaseException]:
        """Each eval group's Generation or its last error: in calls of up to `batch` groups (one a call
        for batch 1), all at once; a call that fails is retried (engine.retries, with backoff) for
        the groups it failed. Nothing is settled: eval groups are not the ledger's."""
        cfg = self.cfg

        async def chunk(part: list[GroupRequest]) -> list[Generation | BaseException]:
            out: list[Generation | BaseException] = [GenerationError("not generated")] * len(part)
            todo = list(range(len(part)))
            for attempt in range(cfg.retries + 1):
                if attempt:
                    await asyncio.sleep(cfg.retry_backoff_s * 2 ** (attempt - 1))
                async with self.rotation.call() as (engine, epoch):
                    try:
                        if self.episodes is not None:  # each group its episodes, all at once
                            got: list[Any] = list(await asyncio.gather(
                                *(self._sample(engine, part[i], ref) for i in todo), return_exceptions=True))
                            if failed := [g for g in got if isinstance(g, BaseException)
                                          and not isinstance(g, (EnvError, *ENGINE_ERRORS))]:
                                raise failed[0]
                        else:
                            async with asyncio.timeout(cfg.request_timeout_s):
                                if len(todo) == 1:
                                    got = [await engine.generate(part[todo[0]], ref)]
                                else:
                                    got = list(await engine.generate_many([part[i] for i in todo], ref))
                        if len(got) != len(todo):
                            raise GenerationError(f"engine {engine.name} returned {len(got)} results for "
                                                  f"{len(todo)} groups")
                    except ENGINE_ERRORS as e:  # this call failed: counted against the engine, retried
                        got = [e] * len(todo)
                for i, r in zip(todo, got):
                    out[i] = r
                todo = [i for i in todo if not isinstance(out[i], (Generation, EnvError))]  # an env's failure is final
                if not todo:
                    self.rotation.succeeded(engine)
                    break
                self.rotation.failed(engine, out[todo[0]], epoch)
            return out

        parts = await asyncio.gather(*(chunk(requests[i:i + batch]) for i in range(0, len(requests), batch)))
        return [r for part in parts for r in part]
