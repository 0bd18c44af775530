"""The trainer in its own process: the same interface as LoRATrainer, none of its GIL time.

A training step in a thread of the orchestrator's process holds the GIL for much of its
Python work (module calls, kernel launches), which delays the event loop and, with it, the
vLLM engine's output handling that runs there. In a child process the step competes for no
lock; the orchestrator's worker thread only waits on a pipe.

Invariants:
- One request at a time, answered in order; an exception in the child is raised in the caller
  with its type name and message (the child's traceback goes to its log).
- The child is started with "spawn" (never fork: the parent may hold CUDA) and is stopped by
  `close()`; if it dies, every later call raises TrainerError saying it is not running.
- Adapters and trainer state still go through the filesystem: `save_adapter(dir)`,
  `save_state(dir)` and `load_state(dir)` make the child write or read them.
- `version`, `skipped_steps` and `consecutive_skips` mirror the child's after every call that
  changes them (setup, step, load_state).
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from pipeline.config import LossConfig, TrainerConfig
from pipeline.errors import TrainerError
from pipeline.types import Batch, RolloutGroup, TrainStats


_MIRRORED = ("setup", "step", "load_state")  # calls that answer with the trainer's counters too


def _serve(conn: Connection, args: tuple, kwargs: dict) -> None:
    """The child's loop: build the trainer, then answer (method, args) requests until told to stop."""
    import os

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # Lower priority than the orchestrator: on a machine short of cores (2 on a laptop or CI),
    # a step that competed as an equal delayed the event loop by a scheduler slice (5-6 ms).
    os.nice(args[1].nice)
    import logging

    import structlog

    # the child has no run-directory handlers: its own console lines stay at warnings and errors
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    from pipeline.trainer import LoRATrainer

    trainer = LoRATrainer(*args, **kwargs)
    while True:
        try:
            method, margs = conn.recv()
        except EOFError:  # the parent is gone: nothing left to serve
            return
        if method == "stop":
            conn.send(("ok", None))
            return
        try:
            result = getattr(trainer, method)(*margs)
            if method in _MIRRORED:
                result = (result, trainer.version, trainer.skipped_steps, trainer.consecutive_skips)
            conn.send(("ok", result))
        except Exception as e:  # report to the parent, which raises it; keep serving
            conn.send(("error", (type(e).__name__, str(e), traceback.format_exc())))


class ProcessTrainer:
    """A LoRATrainer running in a child process (`trainer.separate_process = true`)."""

    def __init__(self, model_path: str | Path, cfg: TrainerConfig, loss_cfg: LossConfig, *, seed: int = 0,
                 trust_remote_code: bool = False, keep_versions: int = 3, start_timeout_s: float = 600.0) -> None:
        self._args = (str(model_path), cfg, loss_cfg)
        self._kwargs = {"seed": seed, "trust_remote_code": trust_remote_code, "keep_versions": keep_versions}
        self.start_timeout_s = start_timeout_s
        self.version = 0
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self._conn: Connection | None = None
        self._proc: Any = None

    @property
    def pid(self) -> int | None:
        """The child's process id (None before setup and after close)."""
        return None if self._proc is None else self._proc.pid

    def _dead(self, method: str) -> TrainerError:
        code = None
        if self._proc is not None:
            self._proc.join(1)  # reap it, so the exit code is known
            code = self._proc.exitcode
        return TrainerError(f"the trainer process is not running (exit code {code}); {method} failed")

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        if self._conn is None or self._proc is None or not self._proc.is_alive():
            raise self._dead(method)
        try:
            self._conn.send((method, args))
            if not self._conn.poll(timeout):
                raise TrainerError(f"the trainer process did not answer {method} within {timeout} s")
            status, value = self._conn.recv()
        except (EOFError, OSError):  # the child died before or while answering (OSError: broken pipe)
            raise self._dead(method) from None
        if status == "error":
            name, msg, tb = value
            if name == "KeyError":  # a version the trainer no longer holds: callers handle it
                raise KeyError(msg)
            raise TrainerError(f"trainer {method} failed in its process: {name}: {msg}\n{tb}")
        return value

    def setup(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, self._args, self._kwargs), name="pipeline-trainer",
                                 daemon=True)
        self._proc.start()
        child.close()
        _, self.version, self.skipped_steps, self.consecutive_skips = self._call("setup", timeout=self.start_timeout_s)

    def step(self, batch: Batch) -> TrainStats:
        stats, self.version, self.skipped_steps, self.consecutive_skips = self._call("step", batch)
        return stats

    def recompute_logprobs(self, groups: Sequence[RolloutGroup]) -> list[list[np.ndarray]]:
        return self._call("recompute_logprobs", list(groups))

    def save_adapter(self, directory: Path) -> None:
        self._call("save_adapter", Path(directory))

    def save_state(self, directory: Path) -> None:
        self._call("save_state", Path(directory))

    def load_state(self, directory: Path) -> None:
        _, self.version, self.skipped_steps, self.consecutive_skips = self._call("load_state", Path(directory))

    def close(self) -> None:
        """Stop the child (idempotent)."""
        if self._proc is None:
            return
        try:
            if self._proc.is_alive() and self._conn is not None:
                self._conn.send(("stop", ()))
                self._conn.poll(10)
        except (BrokenPipeError, OSError):
            pass  # already gone
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        if self._conn is not None:
            self._conn.close()
        self._proc = None
        self._conn = None
