"""CUDA_VISIBLE_DEVICES, one per process, shared by the threads that start child processes.

A child process takes a copy of the environment when it starts. A vLLM engine narrows
CUDA_VISIBLE_DEVICES to its own GPU while its engine core starts (in a worker thread, so the
event loop runs on), and the trainer process is spawned at the same moment of set-up: started
inside that window, the trainer would see only the engine's GPU ("invalid device ordinal" on
cuda:1, seen on 2x H200).

Invariant: the environment is narrowed only inside `visible_devices`, and every start of a child
process that may use a GPU holds `ENV_LOCK`, which `visible_devices` holds too, so a child never
starts with another's narrowed view.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def visible_devices(value: str) -> Iterator[None]:
    """Set CUDA_VISIBLE_DEVICES inside the block (holding ENV_LOCK); restore it (or its absence) after."""
    with ENV_LOCK:
        old = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = value
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = old
