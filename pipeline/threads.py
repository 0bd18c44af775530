"""Worker threads for a user's code that may never return (environment steps, reward functions).

A thread cannot be stopped. A call that outlives its timeout goes on in its thread, and the
process must still be able to end: `DaemonThreads` runs calls in daemon threads of its own,
which neither the event loop's shutdown nor the interpreter's exit waits for (both join the
workers of a `ThreadPoolExecutor`, and asyncio's default executor is one). A call never waits
for a worker: an idle one takes it, or a new one starts, so a call stuck for good holds only
its own thread and a timeout counts only the call's own time.

Invariants: `submit` starts the call at once; its future gets the result or the exception;
nothing here ever blocks waiting for a call; a worker idle for IDLE_S seconds ends.
"""

from __future__ import annotations

import itertools
import queue
import threading
from concurrent.futures import Executor, Future
from typing import Any, Callable

IDLE_S = 60.0  # an idle worker ends after this long; a later call starts another


class DaemonThreads(Executor):
    """An executor of daemon worker threads (`name-N`), as many as there are calls running."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._count = itertools.count(1)
        self._work: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple, dict]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # workers waiting for a call and not yet promised one
        self._shutdown = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        if self._shutdown:
            raise RuntimeError(f"{self.name}: cannot start a call after shutdown")
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
