"""Policy versions on their way to the engines: published -> verified -> loaded -> serving.

The trainer publishes each version into the adapter store; the adapter loop verifies the newest
against its manifest, has every engine in rotation load it, and only then makes it the serving
version that admission samples with. How a version replaces the last on an engine is a swap
strategy: LoRA adapters load beside the ones in use (`LoraSwap`); full weights replace them, so
the groups in flight and any evaluation round finish first (`FullWeightSwap`), or, in flight
(pipeline.full_weight_swap = "in_flight"), only the evaluation rounds do and the groups go on with
the new weights.

Built in data-flow order, each given what it uses: `VersionSet` (the versions published and not
pruned, the serving one, those in use) first, then the `EngineRotation` (which reads from it what
a restarted engine loads), then `Versions` (the loop that moves the serving version) with both.

Invariants:
- A version serves only after every engine in rotation loaded it; a version whose directory
  does not verify or load is skipped while an older one may still serve within max_staleness,
  and past that the run stops with an AdapterError naming the directory.
- A version stays loaded (and on disk) while a group in flight, an evaluation round, or the
  staleness bound may still ask for it; older ones are unloaded and pruned.
- In full-weight mode every engine holds the same one version: a load that fails is undone by
  loading the served version again. A group is never sampled across two versions, except with
  in-flight swaps, where it is labelled with the version it started with and its Generation's
  `last_version` names the newest one that may have sampled its tokens. An evaluation round is
  always one version's.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from typing import Callable, Protocol, Sequence

import structlog

from pipeline.store.weights import AdapterStore
from pipeline.loop.buffer import RolloutBuffer
from pipeline.engines.base import Engine
from pipeline.errors import AdapterError
from pipeline.loop.rotation import EngineRotation
from pipeline.types import AdapterRef

log = structlog.get_logger(__name__)


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


class VersionSet:
    """The adapter versions engines may be asked for: each one published and not yet pruned, the serving
    one, and those in use (the serving one, a group in flight's, an evaluation round's)."""

    def __init__(self, *, buffer: RolloutBuffer, pins: VersionPins, start_version: int) -> None:
        self.buffer = buffer  # the versions of the groups in flight
        self.pins = pins  # the versions evaluation rounds sample with
        self.adapters: dict[int, AdapterRef] = {0: AdapterRef.base()}
        self.served = start_version  # the version engines serve; Versions.adapter_loop moves it

    def refs_in_use(self) -> list[AdapterRef]:
        """The adapters a group in flight, an eval round, or the next group admitted may ask an engine
        for (not the base)."""
        versions = {self.served, *self.buffer.in_flight_versions(), *self.pins.versions()}
        return [self.adapters[v] for v in sorted(versions) if v > 0 and v in self.adapters]

    def keep_from(self, max_staleness: int) -> int:
        """The oldest version still needed: by a group in flight, an eval round, or the staleness bound."""
        return min(self.buffer.in_flight_versions() + self.pins.versions() + [self.served - max_staleness])


class SwapStrategy(Protocol):
    """How a new version replaces the last on the engines; the adapter loop calls these in order."""

    drain_s: dict[int, float]  # version -> seconds admission paused before its load (empty: none pause)

    async def before_load(self, version: int) -> None: ...

    async def after_failed_load(self, served: AdapterRef) -> None: ...

    async def after_serving(self) -> None: ...


class LoraSwap:
    """LoRA adapters: a new version loads beside those in use; nothing waits."""

    def __init__(self) -> None:
        self.drain_s: dict[int, float] = {}  # nothing pauses

    async def before_load(self, version: int) -> None:
        pass

    async def after_failed_load(self, served: AdapterRef) -> None:
        pass

    async def after_serving(self) -> None:
        pass


class FullWeightSwap:
    """Whole weights: an engine holds one version. Drained (`drain`), admission pauses and what is in
    flight (groups and evaluation rounds) finishes on the old weights before the engines load the new
    ones; in flight (pipeline.full_weight_swap = "in_flight"), the groups go on with the new weights
    (the engine recomputes their context with them) and only evaluation rounds, which score one
    version, finish first."""

    def __init__(self, *, buffer: RolloutBuffer, pins: VersionPins, rotation: EngineRotation,
                 drain: bool = True) -> None:
        self.buffer = buffer  # admission pauses, and the groups in flight drain, before a load (drain)
        self.pins = pins  # evaluation rounds finish before a load, and none starts during it
        self.rotation = rotation  # after a failed load, the engines load the served weights again
        self.drain = drain
        self.drain_s: dict[int, float] = {}  # version -> seconds the load waited (groups and eval rounds; eval only in flight)

    async def before_load(self, version: int) -> None:
        t_drain = time.monotonic()
        if self.drain:
            self.buffer.pause_admission()
            await self.buffer.wait_drained()
        await self.pins.hold_swaps()
        self.drain_s[version] = time.monotonic() - t_drain

    async def after_failed_load(self, served: AdapterRef) -> None:
        # engines that did load it go back to the served weights, so every engine serves one version
        await self.rotation.load_on_engines(served)
        await self.after_serving()

    async def after_serving(self) -> None:
        if self.drain:
            await self.buffer.resume_admission()
        await self.pins.release_swaps()


class Versions:
    """The published versions, the one engines serve, and the loop that moves it."""

    def __init__(self, *, rotation: EngineRotation, version_set: VersionSet, store: AdapterStore, buffer: RolloutBuffer,
                 pins: VersionPins, max_staleness: int, full_weights: bool, in_flight: bool = False) -> None:
        self.rotation = rotation  # the engines that load each version
        self.set = version_set  # what is published, served and in use
        self.store = store
        self.buffer = buffer  # told each new serving version
        self.max_staleness = max_staleness
        self.swap: SwapStrategy = (FullWeightSwap(buffer=buffer, pins=pins, rotation=rotation, drain=not in_flight)
                                   if full_weights else LoraSwap())
        self.publish_t: dict[int, float] = {}
        self.publish_to_loaded: dict[int, float] = {}
        # where a version's publish-to-loaded went: version -> seconds the adapter loop took to get to
        # it (busy with the last version's unloads and pruning), verifying it, and the engines' loads
        self.parts: dict[int, dict[str, float]] = {}
        self.load_failures: dict[int, str] = {}
        self._published = asyncio.Event()
        self._serving = asyncio.Event()  # set (then replaced) when engines serve a new version

    @property
    def adapters(self) -> dict[int, AdapterRef]:
        """Version -> its adapter, for every version published and not yet pruned (0: the base)."""
        return self.set.adapters

    @property
    def served(self) -> int:
        """The version engines serve."""
        return self.set.served

    @property
    def drain_s(self) -> dict[int, float]:
        """Version -> seconds admission paused before its load (full weights; empty with LoRA)."""
        return self.swap.drain_s

    def metrics(self, version: int) -> dict[str, float]:
        """The step row's figures of `version`'s way to the engines (NaN where it has not served):
        publish to serving, and its parts (the loop getting to it, verifying it, the engines' loads)."""
        parts = self.parts.get(version, {})
        return {"adapter/publish_to_loaded_s": self.publish_to_loaded.get(version, math.nan),
                **{f"adapter/{k}": parts.get(k, math.nan) for k in ("wait_s", "verify_s", "load_s")}}

    def published(self, ref: AdapterRef) -> None:
        """The trainer published `ref`: the adapter loop takes it from here."""
        self.adapters[ref.version] = ref
        self.publish_t[ref.version] = time.monotonic()
        self._published.set()

    async def wait_serving(self, version: int) -> None:
        """Until engines serve `version` or newer, or a load of such a version failed."""
        while self.served < version and not any(v >= version for v in self.load_failures):
            await self._serving.wait()

    # ------------------------------------------------------------------ loading

    async def load_on_engines(self, ref: AdapterRef) -> None:
        """Every engine in rotation loads `ref` (`EngineRotation.load_on_engines`)."""
        await self.rotation.load_on_engines(ref)

    async def unload_on_engines(self, ref: AdapterRef, engines: Sequence[Engine]) -> None:
        """Free `ref` on each engine; a failure costs memory, not the run (`EngineRotation.unload_on_engines`)."""
        await self.rotation.unload_on_engines(ref, engines)

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
            t_woke = time.monotonic()
            try:
                # a directory is checked against its manifest before any engine reads it (a version in
                # memory is checked against its checksum by each engine that opens it)
                if ref.path is not None:
                    await asyncio.to_thread(self.store.verify_dir, ref.path)
                t_verified = time.monotonic()
                await self.swap.before_load(newest)
                t_loading = time.monotonic()
                await self.load_on_engines(ref)
            except (AdapterError, OSError) as e:
                await self.swap.after_failed_load(self.adapters[served])
                # keep serving the last good version while the staleness bound allows; then stop clearly
                self.load_failures[newest] = repr(e)
                self._serving_changed()  # an eval round waiting for this version takes the served one
                log.error("adapter_load_failed", version=newest, path=ref.path, error=str(e), serving=served)
                if newest - served > K:
                    raise AdapterError(f"engines could not load adapter versions {served + 1}..{newest} "
                                       f"(last: {ref.path}: {e}); version {served} is the newest they serve and "
                                       f"max_staleness = {K} allows no older data") from e
                continue
            t_loaded = time.monotonic()
            self.publish_to_loaded[newest] = t_loaded - self.publish_t[newest]
            self.parts[newest] = {"wait_s": t_woke - self.publish_t[newest], "verify_s": t_verified - t_woke,
                                  "load_s": t_loaded - t_loading}
            served = self.set.served = newest  # an engine restarted from now on loads it before it serves
            self._serving_changed()
            structlog.contextvars.bind_contextvars(policy_version=served)
            await self.buffer.set_serving_version(served)
            await self.swap.after_serving()
            log.debug("adapter_serving", version=served, publish_to_loaded_s=round(self.publish_to_loaded[newest], 4))
            keep_from = self.set.keep_from(K)
            for v in [v for v in self.adapters if 0 < v < keep_from]:
                old = self.adapters.pop(v)
                await self.unload_on_engines(old, self.rotation.healthy)
            await asyncio.to_thread(self.store.prune, keep_from)

    def _serving_changed(self) -> None:
        """Wake whatever waits for a new serving version (each waits on the event it found; a new one follows)."""
        self._serving.set()
        self._serving = asyncio.Event()
