"""Adapter residency: which adapters an engine holds, and when one may go.

An engine says how to check, load and unload one adapter; a Residency decides when, for every
engine the same way. One Residency serves one start of an engine: a restart builds a new one.

Invariants:
- Adapters are keyed by `AdapterRef.name`; a name asked for as another version or directory is
  refused (check_same_adapter). The base model (version 0) is never resident.
- An adapter is resident from the moment its load begins until its unload begins. A resident
  adapter is never unloaded while a call uses it (`acquire` .. `release`): an unload asked for
  meanwhile is deferred to its last release, or, while it still loads, to the end of the load.
- At most `bound` adapters are resident: before a load begins, those the engine's `stale` rule
  says the new one replaces go (busy or loading ones at their last release or the end of their
  load), then the oldest idle loaded ones until the new one fits. When every one is in use the
  bound is exceeded (a warning) rather than break a running group, and it is restored as they
  are released.
- `unload` is called at the moment an adapter stops being resident, in that order, so an engine
  that submits the work at once (to a single worker thread) frees a victim before any later load.
  What it returns is awaited by `unload()` and run in the background for evictions and
  deferred unloads.
- A failed load leaves nothing resident: the next call for the adapter loads it again.
- After `close()` nothing is loaded or unloaded; calls that unwind later release into nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Generic, Iterator, TypeVar

import structlog

from pipeline.engines.base import check_same_adapter
from pipeline.errors import AdapterError, EngineDeadError
from pipeline.types import AdapterRef

log = structlog.get_logger(__name__)

H = TypeVar("H")  # what the engine keeps per adapter: its server-side name, its LoRA request, its path


@dataclass(eq=False)
class Resident(Generic[H]):
    """One adapter an engine holds or is loading."""

    ref: AdapterRef
    handle: H  # from the engine's `prepare`
    order: int  # load order: smaller began loading earlier
    ready: asyncio.Task[None] = field(init=False)  # the load; done without error once the engine holds it
    in_use: int = 0  # calls between acquire and release
    unload_requested: bool = False  # unload at the last release (or when the load ends)

    @property
    def loaded(self) -> bool:
        return self.ready.done() and not self.ready.cancelled() and self.ready.exception() is None


class Residency(Generic[H]):
    """The adapters one engine holds: loaded on first use, kept while used, at most `bound` at once.

    `prepare(ref)` checks an adapter and returns its handle (raising refuses it before anything
    is evicted); `load(resident)` and `unload(resident)` return what does the work;
    `stale(resident_ref, incoming_ref)`, if given, says which adapters a new load makes useless.
    """

    def __init__(self, engine: str, bound: int, *, prepare: Callable[[AdapterRef], H],
                 load: Callable[[Resident[H]], Awaitable[Any]], unload: Callable[[Resident[H]], Awaitable[Any]],
                 held_as: str = "loaded", stale: Callable[[AdapterRef, AdapterRef], bool] | None = None) -> None:
        self.engine = engine
        self.bound = bound
        self.closed = False
        self._prepare = prepare
        self._load = load
        self._unload = unload
        self._held_as = held_as  # how error messages say the engine holds an adapter
        self._stale = stale  # None: only the bound makes adapters go
        self._entries: dict[str, Resident[H]] = {}  # AdapterRef.name -> resident adapter
        self._order = 0
        self._background: set[asyncio.Future[Any]] = set()  # unloads nobody awaits

    def __iter__(self) -> Iterator[Resident[H]]:
        """The resident adapters, loading ones included, oldest first."""
        return iter(sorted(self._entries.values(), key=lambda r: r.order))

    async def acquire(self, adapter: AdapterRef) -> Resident[H] | None:
        """The resident `adapter` (loading it if needed), in use until `release`; None for the base model."""
        if adapter.version == 0:
            return None
        entry = self._entry(adapter)
        entry.in_use += 1
        entry.unload_requested = False  # a new call is evidence that it is still needed
        try:
            await self._wait(entry)
        except BaseException:
            self.release(entry)
            raise
        return entry

    def release(self, entry: Resident[H] | None) -> None:
        """A call on `entry` ended: unload it if that was asked and no call uses it; back under the bound."""
        if entry is None:
            return
        entry.in_use -= 1
        if entry.in_use or self.closed or self._entries.get(entry.ref.name) is not entry or not entry.loaded:
            return
        if entry.unload_requested:
            self._drop_soon(entry)
        self._evict(incoming=0)

    async def load(self, adapter: AdapterRef) -> None:
        """Make `adapter` resident ahead of use (the base model needs nothing)."""
        if adapter.version == 0:
            return
        entry = self._entry(adapter)
        entry.unload_requested = False
        await self._wait(entry)

    async def unload(self, adapter: AdapterRef) -> None:
        """Unload `adapter` now, or at its last release while calls use it; an unknown one is ignored."""
        entry = self._entries.get(adapter.name)
        if self.closed or entry is None or adapter.version == 0:
            return
        if not entry.ready.done():
            # a failed load leaves nothing to unload; its error went to whoever asked for it
            with contextlib.suppress(AdapterError, EngineDeadError):
                await self._wait(entry)
        if self._entries.get(adapter.name) is not entry:
            return
        if entry.in_use:
            entry.unload_requested = True
            return
        del self._entries[adapter.name]
        await self._unload(entry)

    async def close(self) -> list[Resident[H]]:
        """Stop loading and unloading; return the adapters that were loaded (the engine frees them if it must)."""
        self.closed = True
        entries, self._entries = list(self._entries.values()), {}
        tasks = [*self._background, *(e.ready for e in entries)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return [e for e in entries if e.loaded]

    # ------------------------------------------------------------------ internals

    def _entry(self, adapter: AdapterRef) -> Resident[H]:
        entry = self._entries.get(adapter.name)
        if entry is None:
            entry = self._begin(adapter)
        check_same_adapter(entry.ref, adapter, self._held_as)
        return entry

    def _begin(self, adapter: AdapterRef) -> Resident[H]:
        handle = self._prepare(adapter)
        self._retire_stale(adapter)
        self._evict(incoming=1)
        self._order += 1
        entry = Resident(ref=adapter, handle=handle, order=self._order)
        entry.ready = asyncio.get_running_loop().create_task(self._load_job(entry),
                                                             name=f"{self.engine}-load-{adapter.name}")
        # Retrieve the outcome even when every waiter was cancelled (no "never retrieved" noise).
        entry.ready.add_done_callback(lambda t: t.cancelled() or t.exception())
        self._entries[adapter.name] = entry
        return entry

    async def _load_job(self, entry: Resident[H]) -> None:
        try:
            await self._load(entry)
        except BaseException:
            if self._entries.get(entry.ref.name) is entry:
                del self._entries[entry.ref.name]  # a later call loads it again
            raise
        if entry.unload_requested and not entry.in_use:
            # asked to go while it loaded; unloaded once the waiters of this load have resumed
            asyncio.get_running_loop().call_soon(self._drop_if_idle, entry)

    async def _wait(self, entry: Resident[H]) -> None:
        try:
            await asyncio.shield(entry.ready)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            # closed under us, even if the engine started again since: the load was cancelled, not this call
            if entry.ready.cancelled() and self.closed and not (current is not None and current.cancelling()):
                raise EngineDeadError(f"engine {self.engine} closed while loading adapter version "
                                      f"{entry.ref.version} ({entry.ref.name})") from None
            raise

    def _retire_stale(self, incoming: AdapterRef) -> None:
        """Before `incoming` loads: unload the idle loaded adapters it makes stale; mark busy or loading ones."""
        if self._stale is None:
            return
        for entry in [e for e in self if self._stale(e.ref, incoming)]:
            if entry.loaded and not entry.in_use:
                self._drop_soon(entry)
            else:
                entry.unload_requested = True

    def _evict(self, incoming: int) -> None:
        """Unload the oldest idle loaded adapters until `incoming` more fit under the bound."""
        excess = len(self._entries) + incoming - self.bound
        if excess <= 0:
            return
        idle = [e for e in self if e.loaded and not e.in_use]
        for entry in idle[:excess]:
            self._drop_soon(entry)
        if len(idle) < excess and incoming:
            log.warning("adapter_bound_exceeded", engine=self.engine, bound=self.bound,
                        loaded=[e.ref.name for e in self], in_use=[e.ref.name for e in self if e.in_use])

    def _drop_if_idle(self, entry: Resident[H]) -> None:
        if entry.unload_requested and not entry.in_use and self._entries.get(entry.ref.name) is entry:
            self._drop_soon(entry)

    def _drop_soon(self, entry: Resident[H]) -> None:
        """Forget `entry` now and unload it in the background."""
        del self._entries[entry.ref.name]
        # called now: an engine's worker sees unloads in the order decided here
        work = asyncio.ensure_future(self._unload(entry))
        if isinstance(work, asyncio.Task):
            work.set_name(f"{self.engine}-unload-{entry.ref.name}")
        self._background.add(work)
        work.add_done_callback(lambda done: self._unloaded(done, entry))

    def _unloaded(self, done: asyncio.Future[Any], entry: Resident[H]) -> None:
        self._background.discard(done)
        if not done.cancelled() and done.exception() is not None:
            # nobody awaits a background unload: say it failed; the engine keeps serving
            log.warning("adapter_unload_failed", engine=self.engine, adapter=entry.ref.name,
                        error=repr(done.exception()))
