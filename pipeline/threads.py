"""Worker threads for a user's code that may never return (environment steps, reward functions).

A thread cannot be stopped. A call that outlives its timeout goes on in its thread, and the
process must still be able to end: `DaemonThreads` runs calls in daemon threads of its own,
which neither the event loop's shutdown nor the interpreter's exit waits for (both join the
workers of a `ThreadPoolExecutor`, and asyncio's default executor is one). A call never waits
for a worker: an idle one takes it, or a new one starts, so a call stuck for good holds only
its own thread and a timeout counts only the call's own time.

A call its caller stopped waiting for (`run` cancelled: a timeout) is abandoned: it goes on in
its thread, counted until it returns. Threads stuck for good add up, and each one that wakes
competes for the GIL with the run (thousands of them, from an environment that hangs on some
rows across an eval round, slowed a 2-core run tenfold): past MAX_ABANDONED at once, a new call
is refused with UserCodeStuckError, a FatalError that ends the run naming the calls.

Invariants: `submit` starts the call at once (or refuses it, past MAX_ABANDONED); its future gets
the result or the exception; nothing here ever blocks waiting for a call; a worker idle for
IDLE_S seconds ends.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import queue
import threading
import time
from concurrent.futures import Executor, Future
from typing import Any, Callable

from pipeline.errors import FatalError

IDLE_S = 60.0  # an idle worker ends after this long; a later call starts another
# abandoned calls still running at once past which new calls are refused: a few slow calls that
# return late stay under it; a hang that repeats across rows or episodes reaches it
MAX_ABANDONED = 64


class UserCodeStuckError(FatalError):
    """Too many calls of a user's code outlived their timeouts and have not returned."""


class DaemonThreads(Executor):
    """An executor of daemon worker threads (`name-N`), as many as there are calls running."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._count = itertools.count(1)
        self._work: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple, dict]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # workers waiting for a call and not yet promised one
        self._shutdown = False
        # calls whose caller stopped waiting, until they return -> (what was called, when it was given up)
        self._abandoned: dict[Future, tuple[str, float]] = {}

    @property
    def abandoned(self) -> int:
        """Calls given up by their callers and still running."""
        return len(self._abandoned)

    async def run(self, fn: Callable[..., Any], *args: Any, what: str = "") -> Any:
        """fn(*args) in a daemon thread, awaited, with the caller's contextvars (as asyncio.to_thread).
        A wait that is cancelled (the caller's timeout) abandons the call: it runs on, counted, and
        `what` (default: fn's name) names it if the count passes MAX_ABANDONED."""
        future = self.submit(contextvars.copy_context().run, fn, *args)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._abandon(future, what or getattr(fn, "__qualname__", None) or type(fn).__name__)
            raise

    def _abandon(self, future: Future, what: str) -> None:
        with self._lock:
            if future.done():
                return
            self._abandoned[future] = (what, time.monotonic())
        future.add_done_callback(self._returned)

    def _returned(self, future: Future) -> None:
        with self._lock:
            self._abandoned.pop(future, None)

    def _refuse_if_stuck(self) -> None:
        with self._lock:
            if len(self._abandoned) < MAX_ABANDONED:
                return
            stuck = sorted(self._abandoned.values(), key=lambda x: x[1])
        names = sorted({what for what, _ in stuck})
        raise UserCodeStuckError(
            f"{len(stuck)} calls of your code outlived their timeouts and have not returned ({', '.join(names)}; "
            f"the first given up {time.monotonic() - stuck[0][1]:.0f} s ago). Each holds a thread that competes "
            "with the run for the CPU, so the run stops here: find what hangs (an environment's reset or step, "
            "a reward function), or make it return")

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        if self._shutdown:
            raise RuntimeError(f"{self.name}: cannot start a call after shutdown")
        self._refuse_if_stuck()
        future: Future = Future()
        with self._lock:
            self._work.put((future, fn, args, kwargs))
            start = self._idle == 0
            if not start:
                self._idle -= 1  # an idle worker is promised this call
        if start:
            threading.Thread(target=self._worker, name=f"{self.name}-{next(self._count)}", daemon=True).start()
        return future

    def _worker(self) -> None:
        while True:
            try:
                future, fn, args, kwargs = self._work.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:  # nobody was promised this worker: it ends
                        self._idle -= 1
                        return
                continue  # a call was promised to it and is on its way
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as e:  # the caller's future carries it, as a ThreadPoolExecutor's does
                    future.set_exception(e)
                else:
                    future.set_result(result)
            del future, fn, args, kwargs  # nothing of a finished call is kept alive by an idle worker
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new calls. Never waits: a call still running may never return."""
        self._shutdown = True


USER_CODE = DaemonThreads("user-code")  # where environments' and rewards' sync code runs
