"""Measurements: busy time of a stage, event-loop lag, and per-step metrics as JSON lines.

Metric keys are `area/name` (`rollout/staleness_max`, `train/ratio_mean`, `engine/tokens_per_s`),
reduced once per step. Metrics are not logs: they go to `metrics.jsonl`, one object per step.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from collections import deque
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np


class Count:
    """A number one component counts up (`count += 1`, in place) and Reporting reads (`count.value`)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def __iadd__(self, n: int) -> Count:
        self.value += int(n)
        return self

    def __repr__(self) -> str:
        return f"Count({self.value})"


class BusyMeter:
    """Time during which a stage had at least one unit of work running.

    `enter()`/`exit()` bracket each unit (they may overlap); the meter records the union of
    the intervals, so four concurrent groups over one second count as one busy second.
    """

    def __init__(self, keep_intervals: int = 100_000) -> None:
        self._active = 0
        self._since = 0.0
        self.busy_s = 0.0
        self.intervals: deque[tuple[float, float]] = deque(maxlen=keep_intervals)

    def enter(self) -> None:
        if self._active == 0:
            self._since = time.monotonic()
        self._active += 1

    def exit(self) -> None:
        self._active -= 1
        if self._active == 0:
            now = time.monotonic()
            self.busy_s += now - self._since
            self.intervals.append((self._since, now))

    def busy_total(self) -> float:
        """Busy seconds so far, counting an interval still open."""
        extra = time.monotonic() - self._since if self._active else 0.0
        return self.busy_s + extra

    def __enter__(self) -> BusyMeter:
        self.enter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.exit()


class LoopLagMonitor:
    """Event-loop lag: how late a timer set for `interval_s` actually fires.

    Timed with time.perf_counter, not loop.time(): uvloop's clock is libuv's millisecond one,
    cached per loop iteration, which rounded every sample to whole milliseconds.
    """

    def __init__(self, interval_s: float = 0.01, keep: int = 100_000) -> None:
        self.interval_s = interval_s
        self.lags: deque[float] = deque(maxlen=keep)
        self._task: asyncio.Task[None] | None = None

    async def _monitor_loop(self) -> None:
        """Consumes nothing, produces lag samples; waits on its own timer."""
        clock = time.perf_counter
        while True:
            t = clock()
            await asyncio.sleep(self.interval_s)
            self.lags.append(max(0.0, clock() - t - self.interval_s))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._monitor_loop(), name="loop-lag-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def percentile_ms(self, q: float, last: int | None = None) -> float:
        """The q-th percentile of the lag in milliseconds, over all samples or the `last` ones."""
        if not self.lags:
            return 0.0
        n = len(self.lags)
        k = n if last is None else min(n, last)
        # from the right end: islice(lags, n - k, n) walks the n - k older samples first, every
        # step, once the deque holds its 100,000
        it = itertools.islice(reversed(self.lags), k)
        return 1000.0 * percentile(np.fromiter(it, dtype=np.float64, count=k), q)


def percentile(a: np.ndarray, q: float) -> float:
    """np.percentile(a, q) (linear interpolation) for a non-empty 1-d array, by partial sort.

    The same value, cheaper for the few thousand samples a step reads: np.percentile's own
    machinery is a cost paid every step, on the event loop.
    """
    pos = (len(a) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(a) - 1)
    part = np.partition(a, (lo, hi))
    return float(part[lo] + (part[hi] - part[lo]) * (pos - lo))


def summarize(values: Iterable[float], prefix: str) -> dict[str, float]:
    """mean / max / min of a list of numbers under `prefix_mean` etc. (empty -> nothing)."""
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        return {}
    return {f"{prefix}_mean": float(arr.mean()), f"{prefix}_max": float(arr.max()), f"{prefix}_min": float(arr.min())}


def _jsonable(v: Any) -> Any:
    if isinstance(v, (np.floating, float)):
        f = float(v)
        return f if math.isfinite(f) else None
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


class MetricsWriter:
    """Appends one JSON object per step to `metrics.jsonl` (flushed every line)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, row: Mapping[str, Any]) -> None:
        # plain ints, strings and finite floats as they are; the rest (NaN, numpy scalars, nests) converted
        out = {k: v if type(v) in (int, str, bool) or (type(v) is float and math.isfinite(v)) else _jsonable(v)
               for k, v in row.items()}
        self._f.write(json.dumps(out) + "\n")
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
