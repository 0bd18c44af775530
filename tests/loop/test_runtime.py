"""pipeline/loop/runtime.py: what a run changes in its process is put back, and the Supervisor's first failure.

Checked, from random starting settings (so that "put back" cannot pass by setting a default):
`restore()` gives back the switch interval, the collector's thresholds and frozen objects and
torch's threads that `enter()` and `share_cpu()` changed, leaves alone what the config told it not
to touch (even when something else changed it during the run), and is safe before, after a
partial enter, and twice; the signal handlers call back on SIGINT and SIGTERM while the run is on
and are gone after `remove_signal_handlers()`. The Supervisor's failure is the first task to
raise, whatever raises later, never a BufferClosed or a cancelled task; `cancel_all` cancels every
task and, for one that will not end, gives up after its timeout and names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import sys
from typing import Any, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from pipeline.config.io import load_config
from pipeline.devices import cpu_cores
from pipeline.loop.buffer import BufferClosed
from pipeline.loop.runtime import Runtime, Supervisor


def config(switch_ms: float, gc_threshold: int, share: bool) -> Any:
    """A run's config; `share`: engine and trainer computing on the CPU, which share_cpu acts on."""
    kinds = {"engine.kind": "transformers", "trainer.kind": "peft"} if share else {
        "engine.kind": "simulated", "trainer.kind": "simulated"}
    return load_config(None, {**kinds, "pipeline.switch_interval_ms": switch_ms, "pipeline.gc_threshold": gc_threshold})


def process_settings() -> tuple[float, tuple[int, ...], int, int]:
    """What a run may change: (switch interval, gc thresholds, frozen objects, torch threads)."""
    import torch

    return sys.getswitchinterval(), gc.get_threshold(), gc.get_freeze_count(), torch.get_num_threads()


@contextlib.contextmanager
def kept_process_settings() -> Iterator[None]:
    """The test process's settings, put back whatever an example (or a broken Runtime) left."""
    import torch

    interval, threshold, threads = sys.getswitchinterval(), gc.get_threshold(), torch.get_num_threads()
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
        gc.set_threshold(*threshold)
        gc.unfreeze()
        torch.set_num_threads(threads)


MS = st.integers(1, 50).map(lambda ms: ms / 1000)  # whole milliseconds: Python keeps the interval in microseconds


@settings(max_examples=60, deadline=None)
@given(switch_ms=st.sampled_from([0, 0.25, 1.0, 7.5]), gc_threshold=st.sampled_from([0, 500, 100_000]),
       share=st.booleans(), entered=st.booleans(), interval=MS,
       threshold=st.tuples(st.integers(100, 5000), st.integers(2, 20), st.integers(2, 20)),
       threads=st.integers(cpu_cores() + 1, cpu_cores() + 4), meddle=MS.map(lambda s: s + 0.06))
def test_restore_puts_back_exactly_what_the_run_changed(switch_ms: float, gc_threshold: int, share: bool,
                                                        entered: bool, interval: float,
                                                        threshold: tuple[int, int, int], threads: int,
                                                        meddle: float) -> None:
    with kept_process_settings():
        restore_after_a_run(switch_ms, gc_threshold, share, entered, interval, threshold, threads, meddle)


def restore_after_a_run(switch_ms: float, gc_threshold: int, share: bool, entered: bool, interval: float,
                        threshold: tuple[int, int, int], threads: int, meddle: float) -> None:
    import torch

    sys.setswitchinterval(interval)
    gc.set_threshold(*threshold)
    torch.set_num_threads(threads)  # more than share_cpu ever sets: a change shows
    before = process_settings()
    assert before[2] == 0, "nothing frozen before the run"
    rt = Runtime(config(switch_ms, gc_threshold, share))
    rt.restore()  # before anything: nothing to put back
    assert process_settings() == before

    rt.share_cpu()
    if entered:  # else only share_cpu ran: a set-up that failed before the loops started
        rt.enter(None)
    now = process_settings()
    assert now[3] == (max(1, cpu_cores() // 2) if share else threads)
    if entered:
        assert now[0] == pytest.approx(switch_ms / 1000 if switch_ms else interval, abs=1e-5)
        assert now[1] == ((gc_threshold, *threshold[1:]) if gc_threshold else threshold)
        assert (now[2] > 0) == bool(gc_threshold), "set-up's objects are frozen out of the collector"
    else:
        assert now[:3] == before[:3]
    if not switch_ms:
        sys.setswitchinterval(meddle)  # the run was told to leave it: whatever set it since stays

    rt.restore()
    after = process_settings()
    want = (meddle if not switch_ms else interval, *before[1:])
    assert after[0] == pytest.approx(want[0], abs=1e-5), "the switch interval"
    assert after[1:] == want[1:], "(gc thresholds, frozen objects, torch threads)"
    sys.setswitchinterval(meddle)
    gc.set_threshold(*threshold[::-1])
    rt.restore()  # a second restore puts back nothing more
    assert sys.getswitchinterval() == pytest.approx(meddle, abs=1e-5) and gc.get_threshold() == threshold[::-1]


SIGNALS = (signal.SIGINT, signal.SIGTERM)


def test_signal_handlers_call_back_during_the_run_and_are_gone_after() -> None:
    async def main() -> list[signal.Signals]:
        # what the process had when the run began: asyncio.run's own SIGINT handler, SIGTERM's default
        before = {sig: signal.getsignal(sig) for sig in SIGNALS}
        assert before[signal.SIGTERM] == signal.SIG_DFL
        seen: list[signal.Signals] = []
        arrived = asyncio.Event()

        def on_signal(sig: signal.Signals) -> None:
            seen.append(sig)
            arrived.set()

        rt = Runtime(config(0, 0, False))
        rt.enter(on_signal)
        for sig in SIGNALS:
            # a handler that is not the run's would end this test process: send only to the run's
            assert signal.getsignal(sig) is not before[sig], f"{sig.name} has no handler of the run's"
            arrived.clear()
            os.kill(os.getpid(), sig)
            await asyncio.wait_for(arrived.wait(), 5)
        rt.remove_signal_handlers()
        assert {sig: signal.getsignal(sig) for sig in SIGNALS} == before, "the handlers are the process's again"
        rt.remove_signal_handlers()  # twice: nothing more to remove
        rt.restore()

        quiet = Runtime(config(0, 0, False))
        quiet.enter(None)  # a caller that handles signals itself: none installed
        assert {sig: signal.getsignal(sig) for sig in SIGNALS} == before
        quiet.remove_signal_handlers()
        return seen

    assert asyncio.run(main()) == list(SIGNALS)


def test_a_callers_own_signal_handler_is_put_back() -> None:
    """A researcher's program with its own SIGTERM handler has it back once the run has ended."""
    def mine(signum: int, frame: Any) -> None:
        pass

    old = signal.signal(signal.SIGTERM, mine)
    try:
        async def main() -> None:
            rt = Runtime(config(0, 0, False))
            rt.enter(lambda sig: None)
            rt.remove_signal_handlers()

        asyncio.run(main())
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, old)


OUTCOMES = ("ok", "raise", "buffer_closed", "cancelled")


@settings(max_examples=100, deadline=None)
@given(outcomes=st.lists(st.sampled_from(OUTCOMES), max_size=8), data=st.data())
def test_the_supervisors_failure_is_the_first_task_to_raise(outcomes: list[str], data: st.DataObject) -> None:
    """Tasks end in a random order, the main one (the train loop) among them; the run fails with
    the first error raised before the main task ends, never a BufferClosed or a cancellation."""
    order = data.draw(st.permutations(range(len(outcomes) + 1)))  # when each ends; the last index is main's
    ends = {i: 3 * rank for rank, i in enumerate(order)}  # loop turns before it ends, apart enough to order them

    async def task(i: int, outcome: str) -> str:
        for _ in range(ends[i]):
            await asyncio.sleep(0)
        if outcome == "raise":
            raise ValueError(f"task {i}")
        if outcome == "buffer_closed":
            raise BufferClosed("buffer closed")
        if outcome == "cancelled":
            raise asyncio.CancelledError
        return f"task {i}"

    async def main() -> tuple[str | BaseException, Supervisor]:
        sup = Supervisor()
        for i, outcome in enumerate(outcomes):
            t = sup.spawn(task(i, outcome), f"loop-{i}")
            assert t.get_name() == f"loop-{i}" and t in sup.tasks
        main_task = sup.spawn(task(len(outcomes), "ok"), "train-loop")
        try:
            got: str | BaseException = await asyncio.wait_for(sup.until_done_or_failed(main_task), 5)
        except ValueError as e:
            got = e
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if rest:
            await asyncio.wait(rest)  # the rest end too; a later error changes nothing
        await asyncio.sleep(0)  # their done callbacks
        assert not sup.tasks, "ended tasks leave the supervisor"
        return got, sup

    got, sup = asyncio.run(main())
    raised = sorted((ends[i], i) for i, o in enumerate(outcomes) if o == "raise")
    first = next((i for end, i in raised if end < ends[len(outcomes)]), None)
    if first is None:
        assert got == f"task {len(outcomes)}", "no failure before the main task ended: its result"
    else:
        assert isinstance(got, ValueError) and str(got) == f"task {first}"
    if raised:
        assert str(sup.failure.result()) == f"task {raised[0][1]}", "the first failure stays the failure"
    else:
        assert not sup.failure.done()


def test_cancel_all_cancels_every_task_and_names_one_that_will_not_end() -> None:
    async def main() -> None:
        sup = Supervisor()
        release = asyncio.Event()

        async def stuck() -> None:  # a loop that ignores its cancellation, as a blocking call would
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                await release.wait()
                raise

        tasks = [sup.spawn(asyncio.sleep(3600), f"loop-{i}") for i in range(3)]
        hung = sup.spawn(stuck(), "stuck-loop")
        await asyncio.sleep(0)
        with capture_logs() as logs:
            await asyncio.wait_for(sup.cancel_all(timeout=0.2), 5)
        assert all(t.cancelled() for t in tasks) and not hung.done()
        assert [(e["event"], e["tasks"]) for e in logs] == [("shutdown_tasks_stuck", ["stuck-loop"])]
        assert sup.tasks == {hung}, "ended tasks leave the supervisor"
        release.set()
        await asyncio.gather(hung, return_exceptions=True)
        assert not sup.tasks and not sup.failure.done(), "cancellations are not failures"

    asyncio.run(main())
