"""The process settings a run changes while it runs: torch threads, the GIL switch interval, the
garbage collector and the signal handlers; every one of them is restored when the run ends (a
caller's own SIGINT or SIGTERM handler too). And the Supervisor of the run's tasks.

Invariants:
- Every task of a run is spawned through its Supervisor; the first one to raise (BufferClosed,
  what loops raise once shutdown has closed the buffer, aside) is the run's failure.
- `restore()` puts back exactly what `enter()` (and `share_cpu()`) changed, and only that; it is
  safe to call after a partial enter, and more than once.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import sys
from typing import Any, Callable

import structlog

from pipeline.loop.buffer import BufferClosed
from pipeline.config.schema import RunConfig
from pipeline.devices import cpu_cores

log = structlog.get_logger(__name__)


def quiet_gc(threshold: int) -> tuple[int, ...]:
    """The collector as a run sets it: what exists now is frozen out of it, and a young pass comes
    every `threshold` allocations. Returns the thresholds before, for `restore_gc`.

    Each group allocates thousands of small acyclic objects (token lists, completions); a
    young-generation pass every 700 allocations, and full passes over everything set-up built
    (the model, the tokenizer), are a cost per group the overhead benchmark sees (docs/architecture.md#measurements-behind-the-code)."""
    before = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(threshold, *before[1:])
    return before


def restore_gc(before: tuple[int, ...]) -> None:
    """Undo `quiet_gc`: its thresholds back, and the frozen objects collectable again."""
    gc.set_threshold(*before)
    gc.unfreeze()


class Runtime:
    """What one run changed in its process, to be put back."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self._threads_before: int | None = None  # torch threads
        self._switch_before: float | None = None  # the GIL switch interval
        self._gc_before: tuple[int, ...] | None = None  # the collector's thresholds
        self._signals: dict[signal.Signals, Any] = {}  # signal -> the handler it had before the run

    def share_cpu(self) -> None:
        """Engine and trainer both computing on the CPU: this process (the engine's generation, and
        an in-process trainer) takes half the cores; a trainer process takes its own count
        (trainer.threads, `devices.trainer_threads`).

        Two torch threads that each run a full-width OpenMP team oversubscribe the cores, and
        the spinning teams slowed the tiny model's decoding many times over on a 2-core machine.
        Also at max_staleness 0, where they take turns: decoding's ops are too small for a second
        thread to pay (docs/architecture.md#measurements-behind-the-code).
        """
        cfg = self.cfg
        if "cpu" in cfg.trainer.rank_devices and cfg.trainer.kind == "peft" and cfg.engine.kind == "transformers" \
                and "cpu" in cfg.engine.devices:
            import torch

            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(max(1, cpu_cores() // 2))  # trainer_threads gives a trainer process the rest

    def enter(self, on_signal: Callable[[signal.Signals], None] | None) -> None:
        """The run's settings: signal handlers (if `on_signal`), switch interval and collector."""
        pc = self.cfg.pipeline
        if on_signal is not None:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                before = signal.getsignal(sig)
                loop.add_signal_handler(sig, on_signal, sig)
                self._signals[sig] = before
        if pc.switch_interval_ms:
            # a worker thread holding the GIL (the engine's Python glue, a zarr flush) keeps the
            # loop waiting up to this long; Python's default was the loop's lag on 2 cores
            self._switch_before = sys.getswitchinterval()
            sys.setswitchinterval(pc.switch_interval_ms / 1000)
        if pc.gc_threshold:
            self._gc_before = quiet_gc(pc.gc_threshold)

    def remove_signal_handlers(self) -> None:
        """Signals act as they did before the run (shutdown is under way: a second Ctrl-C interrupts
        it, or reaches the caller's own handler)."""
        if self._signals:
            loop = asyncio.get_running_loop()
            for sig, before in self._signals.items():
                # asyncio puts back SIG_DFL (or Python's SIGINT handler), not the one it replaced
                loop.remove_signal_handler(sig)
                if before is not None:  # None: a handler not set from Python, which asyncio cannot have replaced either
                    signal.signal(sig, before)
            self._signals = {}

    def restore(self) -> None:
        """Threads, switch interval and collector as they were before the run."""
        if self._threads_before is not None:
            import torch

            torch.set_num_threads(self._threads_before)
            self._threads_before = None
        if self._switch_before is not None:
            sys.setswitchinterval(self._switch_before)
            self._switch_before = None
        if self._gc_before is not None:
            restore_gc(self._gc_before)
            self._gc_before = None


class Supervisor:
    """The run's tasks: all spawned here, and the first one to fail (BufferClosed aside) is the run's failure."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()
        self.failure: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

    def spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and not isinstance(exc, BufferClosed) and not self.failure.done():
            self.failure.set_result(exc)

    async def until_done_or_failed(self, task: asyncio.Task[Any]) -> Any:
        """`task`'s result, or the first failure of any task spawned here, whichever comes first."""
        await asyncio.wait({task, self.failure}, return_when=asyncio.FIRST_COMPLETED)
        if self.failure.done():
            raise self.failure.result()
        return task.result()

    async def cancel_all(self, timeout: float) -> None:
        """Cancel every task and wait up to `timeout` for them to end (those that do not are logged)."""
        tasks = list(self.tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            if pending:
                log.error("shutdown_tasks_stuck", tasks=[t.get_name() for t in pending])
