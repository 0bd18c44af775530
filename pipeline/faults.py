"""Crash points: named places where a test can kill the process with SIGKILL.

`PIPELINE_CRASH_AT="name:n"` (read once, at import) makes the n-th call of
`crash_point("name")` kill the process on the spot, as `kill -9` would: no `finally`, no
flush, no atexit. Crash tests place a kill in the middle of a publish, a zarr append or a
checkpoint write and check that `run.py --resume` repairs it. Without the variable a crash
point costs one comparison.

Invariants:
- Only a process started with the variable can be killed this way; a resumed run is started
  without it.
- Names are fixed strings at call sites (listed in CRASH_POINTS) so tests can name them all.
"""

from __future__ import annotations

import os
import signal

CRASH_POINTS = (
    "admission",              # a group was admitted, its task not yet started
    "group.after_generate",   # an engine returned a group, not yet scored or buffered
    "episode.after_step",     # an episode's environment answered a turn, the next turn not yet asked for
    "step.after_train",       # the trainer stepped, nothing published yet
    "publish.before_rename",  # adapter files written and fsynced into the temporary directory
    "publish.after_rename",   # the version directory exists, the pipeline has not seen it
    "step.after_record",      # a step's groups were recorded as trained, metrics not written
    "log.mid_flush",          # zarr arrays written, the commit attribute not yet
    "log.after_commit",       # a flush committed
    "checkpoint.mid_write",   # trainer state written into the temporary checkpoint directory
    "checkpoint.before_rename",  # the whole checkpoint written and fsynced, not yet renamed
    "checkpoint.after_rename",   # the checkpoint is in place, older ones not yet pruned
)

_SPEC = os.environ.get("PIPELINE_CRASH_AT", "")
_NAME, _, _COUNT = _SPEC.partition(":")
_AT = int(_COUNT) if _COUNT.isdigit() else 1
_hits = 0


def crash_point(name: str) -> None:
    """Kill this process with SIGKILL if PIPELINE_CRASH_AT names this point and hit."""
    global _hits
    if name != _NAME:
        return
    _hits += 1
    if _hits >= _AT:
        os.kill(os.getpid(), signal.SIGKILL)
