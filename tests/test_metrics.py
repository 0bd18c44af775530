"""The loop-lag monitor sees a blocked loop, with sub-millisecond precision under uvloop."""

from __future__ import annotations

import asyncio
import time

import pytest

from pipeline.metrics import LoopLagMonitor


async def _monitored(block_s: float) -> LoopLagMonitor:
    mon = LoopLagMonitor(interval_s=0.005)
    mon.start()
    await asyncio.sleep(0.1)
    time.sleep(block_s)  # the loop is blocked: the monitor's timer fires this much late
    await asyncio.sleep(0.1)
    await mon.stop()
    return mon


def test_a_blocked_loop_shows_as_lag() -> None:
    mon = asyncio.run(_monitored(0.05))
    assert max(mon.lags) >= 0.04
    assert mon.percentile_ms(100) >= 40.0


def test_lag_samples_are_not_rounded_to_milliseconds_under_uvloop() -> None:
    uvloop = pytest.importorskip("uvloop")
    mon = uvloop.run(_monitored(0.0123))
    assert max(mon.lags) >= 0.007  # blocked 12.3 ms, less what was left of the 5 ms interval
    # uvloop's loop.time() ticks in whole milliseconds; perf_counter samples have fractions
    fractions = [abs(x * 1000 - round(x * 1000)) for x in mon.lags if x > 0]
    assert any(f > 0.01 for f in fractions), mon.lags
