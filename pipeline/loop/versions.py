"""Policy versions on their way to the engines: published -> verified -> loaded -> serving.

The trainer publishes each version into the adapter store; the adapter loop verifies the newest
against its manifest, has every engine in rotation load it, and only then makes it the serving
version that admission samples with. How a version replaces the last on an engine is a swap
strategy: LoRA adapters load beside the ones in use (`LoraSwap`); full weights replace them, so
the groups in flight and any evaluation round finish first (`FullWeightSwap`).

Invariants:
- A version serves only after every engine in rotation loaded it; a version whose directory
  does not verify or load is skipped while an older one may still serve within max_staleness,
  and past that the run stops with an AdapterError naming the directory.
- A version stays loaded (and on disk) while a group in flight, an evaluation round, or the
  staleness bound may still ask for it; older ones are unloaded and pruned.
- In full-weight mode every engine holds the same one version: a load that fails is undone by
  loading the served version again, and a group is never sampled across two versions.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any, Callable, Sequence

import structlog

from pipeline.store.weights import AdapterStore
from pipeline.loop.buffer import RolloutBuffer
from pipeline.engines.base import Engine
from pipeline.errors import AdapterError, EngineDeadError
from pipeline.loop.rotation import EngineRotation
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


class VersionPins:
    """Versions that evaluation rounds are sampling with, and a gate for full-weight swaps.

    `pin` takes the serving version (waiting while a swap is under way); `unpin` releases it.
    `hold_swaps` waits until no version is pinned and keeps new pins out until `release_swaps`.
    """

    def __init__(self) -> None:
        self._count: Counter[int] = Counter()
        self._cond = asyncio.Condition()
        self._swapping = False

    async def pin(self, current: Callable[[], int]) -> int:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._swapping)
            version = current()
            self._count[version] += 1
            return version

    async def unpin(self, version: int) -> None:
        async with self._cond:
            self._count[version] -= 1
            if self._count[version] <= 0:
                del self._count[version]
            self._cond.notify_all()

    def versions(self) -> list[int]:
        return sorted(self._count)

    async def hold_swaps(self) -> None:
        async with self._cond:
            self._swapping = True
            await self._cond.wait_for(lambda: not self._count)

    async def release_swaps(self) -> None:
        async with self._cond:
            self._swapping = False
            self._cond.notify_all()


class LoraSwap:
    """LoRA adapters: a new version loads beside those in use; nothing waits."""

    async def before_load(self, version: int) -> None:
        pass

    async def after_failed_load(self) -> None:
        pass

    async def after_serving(self) -> None:
        pass


class FullWeightSwap:
    """Whole weights: an engine holds one version, so admission pauses and what is in flight (groups
    and evaluation rounds) finishes on the old weights before the engines load the new ones."""

    def __init__(self, versions: Versions) -> None:
        self.versions = versions
        self.drain_s: dict[int, float] = {}  # version -> seconds admission paused for the drain

    async def before_load(self, version: int) -> None:
        v = self.versions
        t_drain = time.monotonic()
        v.buffer.pause_admission()
        await v.buffer.wait_drained()
        await v.pins.hold_swaps()
        self.drain_s[version] = time.monotonic() - t_drain

    async def after_failed_load(self) -> None:
        v = self.versions
        # engines that did load it go back to the served weights, so every engine serves one version
        await v.load_on_engines(v.adapters[v.served])
        await v.buffer.resume_admission()
        await v.pins.release_swaps()

    async def after_serving(self) -> None:
        await self.versions.buffer.resume_admission()
        await self.versions.pins.release_swaps()


class Versions:
    """The published versions, the one engines serve, and the loop that moves it."""

    def __init__(self, *, rotation: EngineRotation, store: AdapterStore, buffer: RolloutBuffer, pins: VersionPins,
                 max_staleness: int, load_timeout_s: float, full_weights: bool, start_version: int) -> None:
        self.rotation = rotation
        self.store = store
        self.buffer = buffer
        self.pins = pins  # versions evaluation rounds sample with
        self.max_staleness = max_staleness
        self.load_timeout_s = load_timeout_s
        self.swap: LoraSwap | FullWeightSwap = FullWeightSwap(self) if full_weights else LoraSwap()
        self.adapters: dict[int, AdapterRef] = {0: AdapterRef.base()}
        self.served = start_version  # the version engines serve; the adapter loop moves it
        self.publish_t: dict[int, float] = {}
        self.publish_to_loaded: dict[int, float] = {}
        self.load_failures: dict[int, str] = {}
        self._published = asyncio.Event()
        self._serving = asyncio.Event()  # set (then replaced) when engines serve a new version

    @property
    def drain_s(self) -> dict[int, float]:
        return self.swap.drain_s if isinstance(self.swap, FullWeightSwap) else {}

    def published(self, ref: AdapterRef) -> None:
        """The trainer published `ref`: the adapter loop takes it from here."""
        self.adapters[ref.version] = ref
        self.publish_t[ref.version] = time.monotonic()
        self._published.set()

    def refs_in_use(self) -> list[AdapterRef]:
        """The adapters a group in flight, an eval round, or the next group admitted may ask an engine
        for (not the base)."""
        versions = {self.served, *self.buffer.in_flight_versions(), *self.pins.versions()}
        return [self.adapters[v] for v in sorted(versions) if v > 0 and v in self.adapters]

    async def wait_serving(self, version: int) -> None:
        """Until engines serve `version` or newer, or a load of such a version failed."""
        while self.served < version and not any(v >= version for v in self.load_failures):
            await self._serving.wait()

    # ------------------------------------------------------------------ loading

    async def load_on_engines(self, ref: AdapterRef) -> None:
        """Every engine in rotation loads `ref`, each under engine.load_timeout_s; so does an engine
        that comes back into rotation (restarted) while the others load."""
        done: set[tuple[str, int]] = set()  # (engine, epoch): a restarted engine is a new one to load
        rotation = self.rotation
        while engines := [e for e in rotation.healthy if (e.name, rotation.slot(e).epoch) not in done]:
            epochs = [rotation.slot(e).epoch for e in engines]
            done.update((e.name, ep) for e, ep in zip(engines, epochs))
            results = await settled([self.load_one(e, ref) for e in engines])
            for e, epoch, r in zip(engines, epochs, results):
                if isinstance(r, EngineDeadError):
                    rotation.failed(e, r, epoch)  # a dead engine leaves the rotation; the others serve on
                elif isinstance(r, BaseException):
                    raise r
        if not rotation.can_generate:
            raise rotation.no_engine_error()

    async def load_one(self, engine: Engine, ref: AdapterRef) -> None:
        """`engine` loads `ref` under engine.load_timeout_s."""
        try:
            async with asyncio.timeout(self.load_timeout_s):
                await engine.load_adapter(ref)
        except TimeoutError:
            raise AdapterError(f"engine {engine.name} did not load adapter {ref.path} within "
                               f"engine.load_timeout_s = {self.load_timeout_s} s") from None

    async def unload_on_engines(self, ref: AdapterRef, engines: Sequence[Engine]) -> None:
        """Free `ref` on each engine, each under engine.load_timeout_s; a failure costs memory, not the run."""
        async def one(e: Engine) -> None:
            async with asyncio.timeout(self.load_timeout_s):
                await e.unload_adapter(ref)

        results = await settled([one(e) for e in engines])
        for e, r in zip(engines, results):
            if isinstance(r, Exception):
                log.warning("adapter_unload_failed", engine=e.name, adapter=ref.name, error=repr(r))

    # ------------------------------------------------------------------ the loop

    async def adapter_loop(self) -> None:
        """Consumes published versions; produces the serving version; waits on publishes and engine loads."""
        K = self.max_staleness
        while True:
            await self._published.wait()
            self._published.clear()
            newest, served = max(self.adapters), self.served
            if newest <= served:
                continue
            ref = self.adapters[newest]
            try:
                # the directory is checked against its manifest before any engine reads it
                await asyncio.to_thread(self.store.verify_dir, ref.path)
                await self.swap.before_load(newest)
                await self.load_on_engines(ref)
            except (AdapterError, OSError) as e:
                await self.swap.after_failed_load()
                # keep serving the last good version while the staleness bound allows; then stop clearly
                self.load_failures[newest] = repr(e)
                self._serving_changed()  # an eval round waiting for this version takes the served one
                log.error("adapter_load_failed", version=newest, path=ref.path, error=str(e), serving=served)
                if newest - served > K:
                    raise AdapterError(f"engines could not load adapter versions {served + 1}..{newest} "
                                       f"(last: {ref.path}: {e}); version {served} is the newest they serve and "
                                       f"max_staleness = {K} allows no older data") from e
                continue
            self.publish_to_loaded[newest] = time.monotonic() - self.publish_t[newest]
            served = self.served = newest  # an engine restarted from now on loads it before it serves
            self._serving_changed()
            structlog.contextvars.bind_contextvars(policy_version=served)
            await self.buffer.set_serving_version(served)
            await self.swap.after_serving()
            log.debug("adapter_serving", version=served, publish_to_loaded_s=round(self.publish_to_loaded[newest], 4))
            keep_from = min(self.buffer.in_flight_versions() + self.pins.versions() + [served - K])
            for v in [v for v in self.adapters if 0 < v < keep_from]:
                old = self.adapters.pop(v)
                await self.unload_on_engines(old, self.rotation.healthy)
            await asyncio.to_thread(self.store.prune, keep_from)

    def _serving_changed(self) -> None:
        """Wake whatever waits for a new serving version (each waits on the event it found; a new one follows)."""
        self._serving.set()
        self._serving = asyncio.Event()
