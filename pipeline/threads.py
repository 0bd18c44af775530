"""Worker threads for a user's code that may never return (environment steps, reward functions).

A thread cannot be stopped. A call that outlives its timeout goes on in its thread, and the
process must still be able to end: `DaemonThreads` runs each call in a daemon thread of its
own, which neither the event loop's shutdown nor the interpreter's exit waits for (both join
the workers of a `ThreadPoolExecutor`, and asyncio's default executor is one). One thread per
call also means a call never waits for a worker that a hung call holds, so a timeout counts
only the call's own time.

Invariants: `submit` starts the call at once; its future gets the result or the exception;
nothing here ever blocks waiting for a thread.
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Executor, Future
from typing import Any, Callable


class DaemonThreads(Executor):
    """An executor that runs each call in a new daemon thread (`name-N`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._count = itertools.count(1)
        self._shutdown = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        if self._shutdown:
            raise RuntimeError(f"{self.name}: cannot start a call after shutdown")
        future: Future = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # the caller's future carries it, as a ThreadPoolExecutor's does
                future.set_exception(e)
            else:
                future.set_result(result)

        threading.Thread(target=run, name=f"{self.name}-{next(self._count)}", daemon=True).start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new calls. Never waits: a call still running may never return."""
        self._shutdown = True


USER_CODE = DaemonThreads("user-code")  # where environments' sync methods run unless a runner is given another
