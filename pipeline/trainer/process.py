"""The trainer in its own process: the same interface as PolicyTrainer, none of its GIL time.

A training step in a thread of the orchestrator's process holds the GIL for much of its
Python work (module calls, kernel launches), which delays the event loop and, with it, the
vLLM engine's output handling that runs there. In a child process the step competes for no
lock; the orchestrator's worker thread only waits on a pipe.

Invariants:
- One request at a time, answered in order; an exception in the child is raised in the caller
  as TrainerError with its type name, message and the child's traceback (KeyError, a version
  the trainer no longer holds, as KeyError).
- The child is started with "spawn" (never fork: the parent may hold CUDA) and is stopped by
  `close()`; if it dies, every later call raises TrainerError saying it is not running.
- The child never imports the parent's main script or module: a research script without an
  `if __name__ == "__main__"` guard would otherwise run again in it and build a second pipeline.
  So `trainer_cls` and whatever the call arguments hold must come from importable modules.
- No call waits forever: setup has `start_timeout_s`, every other call `trainer.step_timeout_s`.
  A call that runs past it kills the child (so it lets go of its device) and raises TrainerError
  naming the call and the setting. `close()` during a call kills the child too.
- The child's events (and its libraries' logs) are the run's events, shipped to the parent's
  handlers as pipeline.trainer.log_shipping says. The child logs at the level the parent's `pipeline`
  loggers had at setup (info, or debug), warnings and up when logging was never configured.
  The parent reads every event that reached the pipe before it reports the child's death; on a
  stop or a failed start the child waits (up to FLUSH_S) for its buffer to drain first.
- The child ignores SIGINT: a Ctrl-C reaches the whole process group, and the orchestrator,
  not the signal, decides when the trainer stops (it finishes the step and checkpoints first).
  It exits at once when its parent dies, whatever it was doing.
- Adapters and trainer state still go through the filesystem: `save_adapter(dir)`,
  `save_state(dir)` and `load_state(dir)` make the child write or read them. `step_and_save`
  is a step and the save of the version it made in one round trip (the pipeline's publish);
  `step_and_share` is a step and its version handed over in memory (trainer.publish = "memory":
  full weights in the child's GPU memory, whose buffer the child keeps; LoRA tensors in the reply).
- `version`, `skipped_steps` and `consecutive_skips` mirror the child's after every call that
  changes them (setup, step, step_and_save, load_state).
- With a `channel`, the child reads and answers its requests through `channel(pipe, trainer)`
  instead of the pipe itself (rank 0 of trainer ranks relays each to the others: pipeline.trainer.ranks).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
import types
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import structlog

from pipeline.config.schema import LossConfig, TrainerConfig
from pipeline.devices import ENV_LOCK, lower_process_priority
from pipeline.errors import TrainerError
from pipeline.trainer.log_shipping import forward_events, log_to_parent
from pipeline.types import Batch, RolloutGroup, TrainStats


# calls that answer with the trainer's counters too
_MIRRORED = ("setup", "step", "step_and_save", "step_and_share", "load_state")
FLUSH_S = 5.0  # how long a stopping or failing child waits for its events to drain


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """While a child is spawned, `__main__` is a bare module, so spawn's preparation data names no
    main script or module and the child does not import (that is, run) the parent's again.

    Spawn reads `__main__.__spec__` and `__file__` and pickles the process object inside `start()`,
    so the stand-in is needed only for that call. Callers hold ENV_LOCK, which every child start of
    the pipeline holds, so two starts never swap it at once."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _exit_with(parent_sentinel: int) -> None:
    """End this process when its parent has gone without stopping it (SIGKILL, os._exit on a second Ctrl-C):
    a step that nobody awaits must not keep the device."""
    wait([parent_sentinel])
    os._exit(1)


def child_start(events: Connection, floor: int, priority: tuple[int, bool]) -> Any:
    """What every trainer process does first; returns the shipper of its events to the parent."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this process stops
    # Lower priority than the orchestrator: on a machine short of cores (2 on a laptop or CI),
    # a step that competed as an equal delayed the event loop by a scheduler slice.
    # Every thread has it: those imports started and those started later (torch's included).
    lower_process_priority(priority[0], idle=priority[1])
    threading.Thread(target=_exit_with, args=(mp.parent_process().sentinel,), name="trainer-parent-watch",
                     daemon=True).start()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return log_to_parent(events, floor)


def set_threads(cfg: TrainerConfig) -> None:
    """The child's torch thread count, when a CPU trainer was given one."""
    if cfg.device == "cpu" and cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)  # build_trainer chose it (devices.trainer_threads)
        structlog.get_logger(__name__).info("trainer_threads", threads=cfg.threads)


def _serve(conn: Connection, events: Connection, floor: int, trainer_cls: type | None, channel: Any,
           start: tuple[tuple, dict] | None, priority: tuple[int, bool]) -> None:
    """The child's loop: build the trainer, then answer (method, args) requests until told to stop.

    start: the trainer's (args, kwargs); None for a process started early (`TrainerProcess`),
    which imports the trainer's libraries first and then waits for them in an "init" message.
    channel: None, or what the requests are read and answered through, made of the pipe and the trainer."""
    shipper = child_start(events, floor, priority)
    try:
        if trainer_cls is None:
            from pipeline.trainer.policy import PolicyTrainer as trainer_cls  # torch, transformers, peft: seconds
        if start is None:
            try:
                _, start = conn.recv()  # ("init", (args, kwargs)), once the model exists
            except EOFError:  # never used: the run ended before its trainer was built
                return
        args, kwargs = start
        set_threads(args[1])
        trainer = trainer_cls(*args, **kwargs)
        if channel is not None:
            conn = channel(conn, trainer)
    except BaseException:
        structlog.get_logger(__name__).exception("trainer_process_failed", stage="start")
        shipper.flush(FLUSH_S)
        raise
    while True:
        try:
            method, margs = conn.recv()
        except EOFError:  # the parent is gone: nothing left to serve
            return
        if method == "stop":
            shipper.flush(FLUSH_S)
            conn.send(("ok", None))
            conn.close()
            # its events are flushed and its files written: nothing is left that the interpreter's
            # teardown would keep, and with torch loaded that teardown is slow, at every run's end
            os._exit(0)
        try:
            result = run_call(trainer, method, margs)
            if method in _MIRRORED:
                result = (result, trainer.version, trainer.skipped_steps, trainer.consecutive_skips)
            reply: tuple[str, Any] = ("ok", result)
        except Exception as e:  # report to the parent, which raises it; keep serving
            reply = ("error", (type(e).__name__, str(e), traceback.format_exc()))
        conn.send(reply)


def run_call(trainer: Any, method: str, margs: Sequence[Any]) -> Any:
    """One request: the process's own calls (`_CHILD_CALLS`), else the trainer's method."""
    own = _CHILD_CALLS.get(method)
    return own(trainer, *margs) if own is not None else getattr(trainer, method)(*margs)


def _step_and_save(trainer: Any, batch: Batch, directory: Path) -> tuple[TrainStats, float]:
    """A step, then its version written into `directory`; the stats and the save's seconds."""
    stats = trainer.step(batch)
    t0 = time.monotonic()
    trainer.save_adapter(directory)
    return stats, time.monotonic() - t0


def _step_and_share(trainer: Any, batch: Batch, keep_from: int) -> tuple[TrainStats, dict[str, Any], float]:
    """A step, then the version it made handed over in memory (`PolicyTrainer.share_weights`): the
    stats, the payload and the share's seconds."""
    stats = trainer.step(batch)
    t0 = time.monotonic()
    payload = trainer.share_weights(keep_from)
    return stats, payload, time.monotonic() - t0


def _torch_threads(trainer: Any) -> int:
    import torch

    return torch.get_num_threads()


# the process's calls, not the trainer's
_CHILD_CALLS = {"step_and_save": _step_and_save, "step_and_share": _step_and_share, "torch_threads": _torch_threads}


def priority_of(cfg: TrainerConfig) -> tuple[int, bool]:
    """A trainer process's (nice value, SCHED_IDLE): idle scheduling only for a CPU trainer."""
    return cfg.nice, cfg.sched_idle and cfg.device == "cpu"


def _spawn(trainer_cls: type | None, channel: Any, start: tuple[tuple, dict] | None,
           priority: tuple[int, bool]) -> tuple[Any, Connection, threading.Thread]:
    """Start a trainer process: (process, its request pipe, the thread forwarding its events)."""
    if trainer_cls is not None and trainer_cls.__module__ == "__main__":
        raise TrainerError(f"trainer_cls {trainer_cls.__qualname__} is defined in the script being run "
                           "(__main__), which the trainer's process does not import; define it in a module")
    conn, child = mp.get_context("spawn").Pipe()
    proc, reader = start_child(_serve, lambda events, floor: (child, events, floor, trainer_cls, channel, start,
                                                              priority), "pipeline-trainer")
    child.close()
    return proc, conn, reader


def start_child(target: Any, args: Any, name: str) -> tuple[Any, threading.Thread]:
    """Start `target(*args(events, floor))` in a spawned daemon process named `name`, its events
    forwarded to this process's logging: (process, the thread forwarding them)."""
    ctx = mp.get_context("spawn")
    events, child_events = ctx.Pipe(duplex=False)
    floor = max(logging.getLogger("pipeline").getEffectiveLevel(), logging.DEBUG)
    proc = ctx.Process(target=target, args=args(child_events, floor), name=name, daemon=True)
    # not while a vLLM engine's start has narrowed CUDA_VISIBLE_DEVICES to its GPU
    with ENV_LOCK, _main_module_hidden():
        proc.start()
    child_events.close()  # the child's copy is the only writer left, so its end is the pipe's end
    reader = threading.Thread(target=forward_events, args=(events, proc), name=f"{name}-events", daemon=True)
    reader.start()
    return proc, reader


class TrainerProcess:
    """A trainer process started before the model it will train exists: it imports torch,
    transformers and peft, which takes seconds, while the pipeline builds or loads the model.
    A ProcessTrainer given it (`process=`) takes it over at setup; `close()` ends one never used."""

    def __init__(self, cfg: TrainerConfig, trainer_cls: type | None = None, channel: Any = None) -> None:
        self.trainer_cls = trainer_cls
        self.channel = channel
        self.priority = priority_of(cfg)
        self.parts: tuple[Any, Connection, threading.Thread] | None = _spawn(trainer_cls, channel, None,
                                                                             self.priority)

    def take(self) -> tuple[Any, Connection, threading.Thread]:
        """The process, its pipe and its event reader, now the caller's (once)."""
        if self.parts is None:
            raise TrainerError("this trainer process was already taken or closed")
        parts, self.parts = self.parts, None
        return parts

    def close(self) -> None:
        """End the process if nobody took it (idempotent): its pipe closes, it exits; killed after 10 s."""
        if self.parts is None:
            return
        (proc, conn, reader), self.parts = self.parts, None
        conn.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        reader.join(FLUSH_S)


class ProcessTrainer:
    """A PolicyTrainer running in a child process (`trainer.separate_process = true`).

    `trainer_cls` is the class built in the child (PolicyTrainer when None); it is sent by name, so it
    must be importable, and it is built as `trainer_cls(model_path, cfg, loss_cfg, **kwargs)`.
    `channel`, when given, is sent by name too (see the module's invariants).
    """

    def __init__(self, model_path: str | Path, cfg: TrainerConfig, loss_cfg: LossConfig, *, seed: int = 0,
                 trust_remote_code: bool = False, keep_versions: int = 3, deterministic: bool = False,
                 start_timeout_s: float = 600.0, trainer_cls: type | None = None, channel: Any = None,
                 process: TrainerProcess | None = None) -> None:
        if process is not None and (process.trainer_cls is not trainer_cls or process.channel is not channel
                                    or process.priority != priority_of(cfg)):
            raise TrainerError("the trainer process given was started for another trainer class or priority")
        self._process = process  # started early (TrainerProcess): taken over at setup
        self._args = (str(model_path), cfg, loss_cfg)
        self._kwargs = {"seed": seed, "trust_remote_code": trust_remote_code, "keep_versions": keep_versions,
                        "deterministic": deterministic}
        self._trainer_cls = trainer_cls
        self._channel = channel
        self.start_timeout_s = start_timeout_s
        self.step_timeout_s = cfg.step_timeout_s
        self.version = 0
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self._conn: Connection | None = None
        self._reader: threading.Thread | None = None
        self._proc: Any = None
        self._lock = threading.Lock()  # held by the call in progress

    @property
    def pid(self) -> int | None:
        """The child's process id (None before setup and after close)."""
        return None if self._proc is None else self._proc.pid

    def _reap(self, wait_s: float) -> None:
        """Wait for the child to end, then for its last events to be logged."""
        if self._proc is not None:
            self._proc.join(wait_s)
            if self._proc.is_alive():
                return
        if self._reader is not None:
            self._reader.join(FLUSH_S)  # the child is gone: the reader only drains what is left

    def _kill(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
        self._reap(5)

    def _dead(self, method: str) -> TrainerError:
        code = None
        if self._proc is not None:
            self._reap(1)  # reap it, so the exit code is known and its last events are logged first
            code = self._proc.exitcode
        return TrainerError(f"the trainer process is not running (exit code {code}); {method} failed")

    def _answered(self, conn: Connection, timeout: float, method: str) -> bool:
        """Wait for the answer to `method` (False when `timeout` passes first)."""
        return conn.poll(timeout)

    def _no_answer(self, method: str, limit: str) -> str:
        return f"the trainer process did not answer {method} within {limit}"

    def _call(self, method: str, *args: Any) -> Any:
        timeout, setting = ((self.start_timeout_s, "start_timeout_s") if method == "setup"
                            else (self.step_timeout_s, "trainer.step_timeout_s"))
        with self._lock:
            conn, proc = self._conn, self._proc
            if conn is None or proc is None or not proc.is_alive():
                raise self._dead(method)
            try:
                conn.send((method, args))
                if not self._answered(conn, timeout, method):
                    why = self._no_answer(method, f"{setting} = {timeout} s")
                    self._kill()
                    raise TrainerError(f"{why}; it was killed (exit code {proc.exitcode})")
                status, value = conn.recv()
            except (EOFError, OSError):  # the child died before or while answering (OSError: broken pipe)
                raise self._dead(method) from None
        if status == "error":
            name, msg, tb = value
            if name == "KeyError":  # a version the trainer no longer holds: callers handle it
                raise KeyError(msg)
            raise TrainerError(f"trainer {method} failed in its process: {name}: {msg}\n{tb}")
        return value

    def setup(self) -> None:
        if self._process is not None:  # started early: it has imported its libraries, now it builds the trainer
            self._proc, self._conn, self._reader = self._process.take()
            try:
                self._conn.send(("init", (self._args, self._kwargs)))
            except OSError:  # it died while importing: the setup call below says so
                pass
        else:
            self._proc, self._conn, self._reader = _spawn(self._trainer_cls, self._channel, (self._args, self._kwargs),
                                                          priority_of(self._args[1]))
        _, self.version, self.skipped_steps, self.consecutive_skips = self._call("setup")

    def step(self, batch: Batch) -> TrainStats:
        stats, self.version, self.skipped_steps, self.consecutive_skips = self._call("step", batch)
        return stats

    def step_and_save(self, batch: Batch, directory: Path) -> tuple[TrainStats, float]:
        """`step(batch)`, then `save_adapter(directory)`, in one round trip to the child: the stats
        and the seconds the save took there."""
        (stats, save_s), self.version, self.skipped_steps, self.consecutive_skips = self._call(
            "step_and_save", batch, Path(directory))
        return stats, save_s

    def step_and_share(self, batch: Batch, keep_from: int) -> tuple[TrainStats, dict[str, Any], float]:
        """`step(batch)`, then `share_weights(keep_from)`, in one round trip to the child: the stats, the
        payload (plain data; the buffer stays the child's) and the seconds the share took there."""
        (stats, payload, share_s), self.version, self.skipped_steps, self.consecutive_skips = self._call(
            "step_and_share", batch, keep_from)
        return stats, payload, share_s

    def share_weights(self, keep_from: int) -> dict[str, Any]:
        return self._call("share_weights", keep_from)

    def recompute_logprobs(self, groups: Sequence[RolloutGroup]) -> list[list[np.ndarray]]:
        return self._call("recompute_logprobs", list(groups))

    def torch_threads(self) -> int:
        """The child's torch intra-op thread count."""
        return self._call("torch_threads")

    def save_adapter(self, directory: Path) -> None:
        self._call("save_adapter", Path(directory))

    def save_state(self, directory: Path) -> dict[str, str]:
        return self._call("save_state", Path(directory))

    def begin_save_state(self, directory: Path) -> None:
        """The child copies its state and writes it behind its later calls (`PolicyTrainer.begin_save_state`)."""
        self._call("begin_save_state", Path(directory))

    def load_state(self, directory: Path) -> None:
        _, self.version, self.skipped_steps, self.consecutive_skips = self._call("load_state", Path(directory))

    def close(self) -> None:
        """Stop the child (idempotent): on request when idle, killed when a call is still in progress."""
        if self._proc is None:
            return
        idle = locked = self._lock.acquire(blocking=False)
        if not idle:
            # a call in progress is abandoned (its caller stopped waiting: shutdown, a cancelled step):
            # killing the child ends that call at once (the calling thread reaps it: two threads
            # waiting on one pid can leave the loser believing it alive), then its pipe is ours to close
            self._proc.kill()
            locked = self._lock.acquire(timeout=FLUSH_S)
        try:
            if idle and self._proc.is_alive() and self._conn is not None:
                try:
                    self._conn.send(("stop", ()))
                    self._conn.poll(10)
                except OSError:  # already gone (OSError covers a broken pipe)
                    pass
                self._proc.join(10)
            self._kill()  # when it did not stop on request
            if self._conn is not None:
                self._conn.close()  # the events pipe is the reader's to close, once it has read all
            self._proc = None
            self._conn = None
            self._reader = None
        finally:
            if locked:
                self._lock.release()
