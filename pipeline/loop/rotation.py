"""The engine rotation: which engines take calls and loads, how loaded each is, and restarting those that fail.

One record per engine (`EngineSlot`) holds its state: in rotation or not, calls in flight,
consecutive failed calls, its epoch (times it left the rotation) and its restart counts.
What a restarted engine must load comes from a `VersionsInUse`, given at construction: the
rotation knows adapter references, not who publishes or serves them.

Invariants:
- A call goes to the least loaded engine in rotation (`call()`); while none is in rotation and
  one is being restarted, the call waits for it instead of failing.
- A failed call counts against its engine only if it was sent in the engine's current epoch: a
  call sent before the engine last left the rotation says nothing about the engine since.
- An engine that is dead, or fails engine.max_consecutive_errors calls in a row, leaves the
  rotation; an engine the pipeline built is then restarted in the background (closed,
  engine.restart_backoff_s, started, the adapter versions in use loaded) up to engine.restarts
  attempts, each counted whether it worked or not. An engine the caller passed in is never
  restarted.
- A load on every engine (`load_on_engines`) covers an engine that comes back into rotation while
  the others load; an engine that dies meanwhile leaves the rotation and the others load on.
- With no engine in rotation and none being restarted, `no_engine_error()` is the run's error.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Protocol, Sequence

import structlog

from pipeline.config.schema import EngineConfig
from pipeline.engines.base import Engine
from pipeline.errors import AdapterError, EngineDeadError
from pipeline.types import AdapterRef

log = structlog.get_logger(__name__)


async def settled(coros: list[Any]) -> list[Any]:
    """Each coroutine's result or exception, in order, run concurrently: `gather(...,
    return_exceptions=True)`, except that one coroutine is awaited in place (a task per engine
    costs more than a simulated engine's load, twice a step)."""
    if len(coros) != 1:
        return await asyncio.gather(*coros, return_exceptions=True)
    try:
        return [await coros[0]]
    except asyncio.CancelledError as e:
        if asyncio.current_task().cancelling():  # we are being cancelled: gather would be too
            raise
        return [e]  # the coroutine's own cancellation: gather returns it as its result
    except Exception as e:  # returned, as gather(return_exceptions=True) does
        return [e]


class VersionsInUse(Protocol):
    """The adapter versions an engine must hold before it takes calls (`pipeline.loop.versions.VersionSet`)."""

    def refs_in_use(self) -> list[AdapterRef]: ...


@dataclass
class EngineSlot:
    """One engine and its place in the rotation."""

    engine: Engine
    built: bool  # the pipeline built it (and so may restart and must close it)
    healthy: bool = True  # in rotation: takes calls
    errors: int = 0  # consecutive failed calls
    load: int = 0  # calls in flight
    epoch: int = 0  # times it left the rotation
    restarting: asyncio.Task[None] | None = None
    restarts_done: int = 0  # restarts that put it back in rotation
    restart_failures: int = 0  # restart attempts that failed

    @property
    def attempts(self) -> int:
        return self.restarts_done + self.restart_failures


class EngineRotation:
    """The engines of a run, their records, the calls they take and their restarts."""

    def __init__(self, engines: Sequence[Engine], *, built: bool, cfg: EngineConfig, close_timeout_s: float,
                 spawn: Callable[[Any, str], asyncio.Task[Any]], in_use: VersionsInUse) -> None:
        self.cfg = cfg
        self.slots = [EngineSlot(e, built) for e in engines]
        self._by_name = {s.engine.name: s for s in self.slots}
        self._order: list[EngineSlot] = list(self.slots)  # engines in rotation, in the order they (re)joined
        self._close_timeout_s = close_timeout_s
        self._spawn = spawn
        self._in_use = in_use  # the versions a restarted engine must load before it serves
        self._grew = asyncio.Event()  # set (then replaced) when an engine returns or a restart gives up

    # ------------------------------------------------------------------ who is in rotation

    @property
    def engines(self) -> list[Engine]:
        return [s.engine for s in self.slots]

    @property
    def healthy(self) -> list[Engine]:
        """The engines in rotation."""
        return [s.engine for s in self._order]

    def slot(self, engine: Engine) -> EngineSlot:
        return self._by_name[engine.name]

    @property
    def restarting(self) -> bool:
        return any(s.restarting is not None for s in self.slots)

    @property
    def can_generate(self) -> bool:
        """An engine is in rotation, or one is being restarted."""
        return bool(self._order) or self.restarting

    def _changed(self) -> None:
        """Wake every call waiting for an engine (each waits on the event it found; a new one follows)."""
        self._grew.set()
        self._grew = asyncio.Event()

    # ------------------------------------------------------------------ calls

    def pick(self) -> EngineSlot:
        """The least loaded engine in rotation (EngineDeadError if there is none)."""
        if not self._order:
            raise self.no_engine_error()
        return min(self._order, key=lambda s: s.load)

    @contextlib.asynccontextmanager
    async def call(self) -> AsyncIterator[tuple[Engine, int]]:
        """An engine for one call and its epoch when the call was sent, counted as loaded while it runs.

        While none is in rotation and one is being restarted, wait for it: a restart ends either
        with the engine back or, when its restarts are spent and nothing else can generate, with
        the run's error."""
        while not self._order and self.restarting:
            await self._grew.wait()
        slot = self.pick()
        slot.load += 1
        try:
            yield slot.engine, slot.epoch
        finally:
            slot.load -= 1

    def succeeded(self, engine: Engine) -> None:
        self.slot(engine).errors = 0

    def failed(self, engine: Engine, error: BaseException, epoch: int) -> None:
        """Count a failed call sent in `epoch`; an engine dead, or failing too often in a row, leaves the
        rotation (and is restarted in the background where it may be)."""
        slot = self.slot(engine)
        if epoch != slot.epoch:
            return
        slot.errors += 1
        dead = isinstance(error, EngineDeadError)
        if (dead or slot.errors >= self.cfg.max_consecutive_errors) and slot.healthy:
            slot.healthy = False
            self._order.remove(slot)
            slot.epoch += 1
            log.error("engine_out_of_rotation", engine=engine.name, consecutive_errors=slot.errors,
                      error=repr(error), engines_left=[e.name for e in self.healthy])
            self._restart_later(slot)

    def no_engine_error(self) -> EngineDeadError:
        cfg = self.cfg
        if not any(s.built for s in self.slots):
            why = "engines passed to Pipeline(engines=...) are the caller's and are not restarted"
        elif cfg.restarts == 0:
            why = "engine.restarts = 0, so engines are not restarted"
        else:
            tried = ", ".join(f"{s.engine.name}: {s.restarts_done} restarted, {s.restart_failures} failed"
                              for s in self.slots)
            why = f"every engine's restarts are spent (engine.restarts = {cfg.restarts}; {tried})"
        return EngineDeadError(f"no engine is left in rotation ({', '.join(e.name for e in self.engines)} died or "
                               f"failed engine.max_consecutive_errors = {cfg.max_consecutive_errors} calls in a row; "
                               f"{why}); see events.jsonl for their errors")

    # ------------------------------------------------------------------ adapter loads

    async def load_on_engines(self, ref: AdapterRef) -> None:
        """Every engine in rotation loads `ref`, each under engine.load_timeout_s; so does an engine
        that comes back into rotation (restarted) while the others load."""
        done: set[tuple[str, int]] = set()  # (engine, epoch): a restarted engine is a new one to load
        while slots := [s for s in self._order if (s.engine.name, s.epoch) not in done]:
            epochs = [s.epoch for s in slots]
            done.update((s.engine.name, ep) for s, ep in zip(slots, epochs))
            results = await settled([self.load_one(s.engine, ref) for s in slots])
            for s, epoch, r in zip(slots, epochs, results):
                if isinstance(r, EngineDeadError):
                    self.failed(s.engine, r, epoch)  # a dead engine leaves the rotation; the others serve on
                elif isinstance(r, BaseException):
                    raise r
        if not self.can_generate:
            raise self.no_engine_error()

    async def load_one(self, engine: Engine, ref: AdapterRef) -> None:
        """`engine` loads `ref` under engine.load_timeout_s."""
        try:
            async with asyncio.timeout(self.cfg.load_timeout_s):
                await engine.load_adapter(ref)
        except TimeoutError:
            raise AdapterError(f"engine {engine.name} did not load adapter {ref.path} within "
                               f"engine.load_timeout_s = {self.cfg.load_timeout_s} s") from None

    async def unload_on_engines(self, ref: AdapterRef, engines: Sequence[Engine]) -> None:
        """Free `ref` on each engine, each under engine.load_timeout_s; a failure costs memory, not the run."""
        async def one(e: Engine) -> None:
            async with asyncio.timeout(self.cfg.load_timeout_s):
                await e.unload_adapter(ref)

        results = await settled([one(e) for e in engines])
        for e, r in zip(engines, results):
            if isinstance(r, Exception):
                log.warning("adapter_unload_failed", engine=e.name, adapter=ref.name, error=repr(r))

    # ------------------------------------------------------------------ restarts

    def _restart_later(self, slot: EngineSlot) -> None:
        """Restart the engine in the background if the pipeline built it and it has restarts left."""
        name = slot.engine.name
        if not slot.built:
            log.warning("engine_not_restarted", engine=name, reason="caller_owned",
                        hint="the pipeline restarts only engines it built from engine.kind; "
                             "an engine passed to Pipeline(engines=...) is the caller's to restart")
        elif self.cfg.restarts == 0:
            log.warning("engine_not_restarted", engine=name, reason="restarts_off", restarts=0)
        elif slot.attempts >= self.cfg.restarts:
            log.error("engine_not_restarted", engine=name, reason="restarts_spent", restarts=self.cfg.restarts,
                      restarted=slot.restarts_done, failed=slot.restart_failures)
        else:
            slot.restarting = self._spawn(self._restart_loop(slot), f"restart-{name}")

    async def _restart_loop(self, slot: EngineSlot) -> None:
        """Consumes an engine the pipeline built that left the rotation; produces it back in rotation,
        started afresh with the adapter versions in use; waits on its close, engine.restart_backoff_s,
        its start and its adapter loads.

        Every attempt, failed or not, counts against engine.restarts. When they are spent the engine
        stays out; if then no engine is in rotation or being restarted, the run fails.
        """
        cfg, name = self.cfg, slot.engine.name
        error: Exception | None = None
        try:
            while (attempt := slot.attempts + 1) <= cfg.restarts:
                log.warning("engine_restarting", engine=name, attempt=attempt, restarts=cfg.restarts,
                            backoff_s=cfg.restart_backoff_s)
                t0 = time.monotonic()
                try:
                    versions = await self._restart_once(slot)
                except Exception as e:  # this attempt failed, whatever raised: counted, and the next one tries
                    error = e
                    slot.restart_failures += 1
                    log.error("engine_restart_failed", engine=name, attempt=attempt, restarts=cfg.restarts,
                              error=repr(e))
                    continue
                slot.restarts_done += 1
                log.info("engine_restarted", engine=name, attempt=attempt, seconds=round(time.monotonic() - t0, 3),
                         versions=versions, engines_in_rotation=[e.name for e in self.healthy])
                return
            log.error("engine_not_restarted", engine=name, reason="restarts_spent", restarts=cfg.restarts,
                      restarted=slot.restarts_done, failed=slot.restart_failures, error=repr(error))
        finally:
            slot.restarting = None
            self._changed()
        if not self.can_generate:
            raise self.no_engine_error() from error

    async def _restart_once(self, slot: EngineSlot) -> list[int]:
        """Close the engine, wait engine.restart_backoff_s, start it (under engine.start_timeout_s), load
        the adapter versions in use (each under engine.load_timeout_s) and put it back in rotation.

        Closing first fails what the engine still holds (so those groups go elsewhere or wait) and
        frees its resources during the backoff. Returns the versions loaded."""
        cfg, engine = self.cfg, slot.engine
        async with asyncio.timeout(self._close_timeout_s):
            await engine.close()
        await asyncio.sleep(cfg.restart_backoff_s)
        try:
            async with asyncio.timeout(cfg.start_timeout_s):
                await engine.start()
        except TimeoutError:
            raise EngineDeadError(f"engine {engine.name} did not start again within engine.start_timeout_s = "
                                  f"{cfg.start_timeout_s} s") from None
        loaded: dict[str, int] = {}
        tried: set[str] = set()
        while refs := [r for r in self._in_use.refs_in_use() if r.name not in tried]:
            for ref in refs:
                tried.add(ref.name)
                try:
                    await self.load_one(engine, ref)
                except AdapterError:
                    if ref in self._in_use.refs_in_use():
                        raise
                    continue  # its last group ended while it loaded and retention removed it: not needed
                loaded[ref.name] = ref.version
        # nothing awaited since the versions in use were last read: none can be missing
        slot.errors = 0
        slot.healthy = True
        self._order.append(slot)
        return sorted(loaded.values())

    # ------------------------------------------------------------------ what the run reports

    def summary(self) -> dict[str, Any]:
        return {"engines_out_of_rotation": [s.engine.name for s in self.slots if not s.healthy],
                "engine_restarts": {s.engine.name: s.restarts_done for s in self.slots if s.restarts_done},
                "engine_restart_failures": {s.engine.name: s.restart_failures for s in self.slots
                                            if s.restart_failures}}
