"""RewardScorer's invariants: n finite floats or RewardError; sync rewards off the loop, under a timeout."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest

from pipeline.errors import RewardError
from pipeline.data.rewards import RewardScorer
from pipeline.types import Prompt

PROMPT = Prompt(id="p0", text="2+2=", token_ids=(1, 2, 3, 4), meta={"answer": "4", "level": 1})
COMPLETIONS = ["4", "5", "four", ""]
COMPLETION_IDS = [[10], [11], [12, 13, 14, 15], []]
SLOW_S = 0.05


def _scorer(fns: Any, weights: list[float] | None = None, timeout_s: float = 300.0) -> RewardScorer:
    return RewardScorer(fns, weights, timeout_s=timeout_s)


def _score(scorer: RewardScorer) -> np.ndarray:
    return asyncio.run(scorer.score(PROMPT, COMPLETIONS, COMPLETION_IDS))


class Recorder:
    """A sync reward (length of each completion) that records the thread of each call; `delay_s` slows it."""

    def __init__(self) -> None:
        self.threads: list[int] = []
        self.delay_s = 0.0
        self.__name__ = "length_reward"

    def __call__(self, prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        self.threads.append(threading.get_ident())
        if self.delay_s:
            time.sleep(self.delay_s)
        return [float(len(c)) for c in completions]


def _calls_on_loop(scorer: RewardScorer, fn: Recorder, calls: int) -> list[bool]:
    """Score `calls` groups in one event loop; for each, whether the function ran on the loop's thread."""

    async def main() -> list[bool]:
        loop_thread = threading.get_ident()
        start = len(fn.threads)
        for _ in range(calls):
            out = await scorer.score(PROMPT, COMPLETIONS, COMPLETION_IDS)
            np.testing.assert_array_equal(out, [1.0, 1.0, 4.0, 0.0])
        return [t == loop_thread for t in fn.threads[start:]]

    return asyncio.run(main())


def test_a_sync_reward_never_runs_on_the_event_loop():
    """A sync reward that hangs on the loop's thread would stop everything: timers, signals, the rest."""
    fn = Recorder()
    scorer = _scorer(fn)
    assert _calls_on_loop(scorer, fn, 20) == [False] * 20
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("user-code"))


def test_a_slow_sync_reward_leaves_the_loop_running_meanwhile():
    fn = Recorder()
    fn.delay_s = SLOW_S
    scorer = _scorer(fn)

    async def main() -> tuple[np.ndarray, int]:
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.002)

        task = asyncio.create_task(ticker())
        try:
            out = await scorer.score(PROMPT, COMPLETIONS, COMPLETION_IDS)
        finally:
            done.set()
            await task
        return out, ticks

    out, ticks = asyncio.run(main())
    np.testing.assert_array_equal(out, [1.0, 1.0, 4.0, 0.0])
    assert ticks >= 3  # the loop kept running while the reward slept in its thread


def test_a_reward_that_never_returns_fails_only_its_groups_after_the_timeout():
    stuck = threading.Event()

    def sometimes_stuck(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        if any("stuck" in p for p in prompts):
            stuck.wait()  # never set: this call never returns
        return [1.0] * len(completions)

    scorer = _scorer(sometimes_stuck, timeout_s=0.3)
    prompts = [Prompt(id=f"p{i}", text="stuck" if i == 1 else "fine", token_ids=(1,), meta={}) for i in range(3)]

    async def main() -> list[Any]:
        t = time.monotonic()
        out = await scorer.score_many(prompts, [["a", "b"]] * 3, [[[1], [2]]] * 3)
        return [out, time.monotonic() - t]

    out, seconds = asyncio.run(main())
    assert isinstance(out[1], RewardError) and "took longer than reward.timeout_s = 0.3 s" in str(out[1])
    assert out[1].function == "sometimes_stuck"
    np.testing.assert_array_equal(out[0], [1.0, 1.0])
    np.testing.assert_array_equal(out[2], [1.0, 1.0])
    assert seconds < 3  # the batched call's timeout, then the stuck group's own: not a wait for the thread
    stuck.set()


def test_a_timeout_the_reward_raises_itself_is_its_error_not_ours():
    def raises(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        raise TimeoutError("the grader's server did not answer")

    with pytest.raises(RewardError, match="raised TimeoutError: the grader's server did not answer"):
        _score(_scorer(raises))


def test_async_reward_functions_are_awaited_on_the_loop():
    seen: list[int] = []

    async def async_reward(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        seen.append(threading.get_ident())
        await asyncio.sleep(0)
        return [1.0 if c == kwargs["answer"][i] else 0.0 for i, c in enumerate(completions)]

    class AsyncCallable:
        async def __call__(self, prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
            seen.append(threading.get_ident())
            return [float(len(ids)) for ids in kwargs["completion_ids"]]

    async def later(values: list[float]) -> list[float]:
        return values

    def returns_awaitable(prompts: list[str], completions: list[str], **kwargs: Any) -> Any:
        return later([0.5] * len(completions))

    scorer = _scorer([async_reward, AsyncCallable(), returns_awaitable])
    assert scorer.is_async == [True, True, False]

    async def main() -> tuple[np.ndarray, int]:
        return await scorer.score(PROMPT, COMPLETIONS, COMPLETION_IDS), threading.get_ident()

    out, loop_thread = asyncio.run(main())
    np.testing.assert_array_equal(out, np.array([1, 0, 0, 0]) + np.array([1, 1, 4, 0]) + 0.5)
    assert seen == [loop_thread, loop_thread]


def test_weights_combine_and_every_function_gets_the_group():
    calls: list[dict[str, Any]] = []

    def correct(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        calls.append({"prompts": prompts, **kwargs})
        return [1.0 if c == a else 0.0 for c, a in zip(completions, kwargs["answer"])]

    def length(prompts: list[str], completions: list[str], **kwargs: Any) -> list[int]:
        return [len(c) for c in completions]  # ints are numbers too

    out = _score(_scorer([correct, length], weights=[2.0, -0.5]))
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, [2.0 - 0.5, -0.5, -2.0, 0.0])
    assert calls == [{"prompts": [PROMPT.text] * 4, "answer": ["4"] * 4, "level": [1] * 4,
                      "completion_ids": COMPLETION_IDS}]


def test_a_raising_reward_is_a_reward_error_naming_it():
    def broken_reward(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        raise ZeroDivisionError("no answer")

    async def broken_async(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        raise KeyError("solution")

    fine = Recorder()
    with pytest.raises(RewardError, match="'broken_reward' raised ZeroDivisionError: no answer"):
        _score(_scorer([fine, broken_reward]))
    with pytest.raises(RewardError, match="'broken_async' raised KeyError"):
        _score(_scorer(broken_async))


@pytest.mark.parametrize("values, message", [
    ([1.0, float("nan"), 0.0, 0.0], r"'bad' returned a non-finite value \(nan\)"),
    ([1.0, float("inf"), 0.0, 0.0], r"'bad' returned a non-finite value \(inf\)"),
    ([1.0, 0.0, 0.0], "'bad' returned 3 values for 4 completions"),
    ([1.0, 0.0, 0.0, 0.0, 1.0], "'bad' returned 5 values for 4 completions"),
    (["good", 0.0, 0.0, 0.0], "'bad' must return a list of 4 numbers"),
    (None, "'bad' must return a list of 4 numbers"),
    (1.0, "'bad' must return a list of 4 numbers"),
])
def test_bad_reward_values_are_reward_errors(values: Any, message: str):
    def bad(prompts: list[str], completions: list[str], **kwargs: Any) -> Any:
        return values

    with pytest.raises(RewardError, match=message):
        _score(_scorer(bad))


def test_cancellation_is_not_a_reward_error():
    async def hangs(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        await asyncio.Event().wait()
        return []

    async def main() -> None:
        task = asyncio.create_task(_scorer(hangs).score(PROMPT, COMPLETIONS, COMPLETION_IDS))
        await asyncio.sleep(0.01)
        task.cancel()
        await task

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())


def test_scorer_refuses_no_functions_or_mismatched_weights():
    with pytest.raises(ValueError, match="at least one reward function"):
        RewardScorer([])
    with pytest.raises(ValueError, match="2 reward functions but 1 weights"):
        RewardScorer([Recorder(), Recorder()], weights=[1.0])


# --- several groups at once (score_many: every group of an engine call) ---------------------

P2 = Prompt(id="p1", text="3+3=", token_ids=(5, 6), meta={"answer": "6", "level": 2})
GROUPS = ([PROMPT, P2, PROMPT], [COMPLETIONS, ["6", "bad"], ["4"]], [COMPLETION_IDS, [[16], [17, 18]], [[10]]])


def _score_many(scorer: RewardScorer, groups: Any = GROUPS) -> list[Any]:
    return asyncio.run(scorer.score_many(*groups))


def test_one_call_scores_every_group_with_per_completion_columns():
    calls: list[dict[str, Any]] = []

    def correct(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        calls.append({"prompts": prompts, "completions": completions, **kwargs})
        return [1.0 if c == a else 0.0 for c, a in zip(completions, kwargs["answer"])]

    scorer = _scorer([correct, Recorder()], weights=[2.0, 1.0])
    out = _score_many(scorer)
    assert len(calls) == 1  # one call for the three groups (the recorder too: it saw 7 completions once)
    assert calls[0] == {"prompts": ["2+2="] * 4 + ["3+3="] * 2 + ["2+2="],
                        "completions": COMPLETIONS + ["6", "bad", "4"],
                        "answer": ["4"] * 4 + ["6"] * 2 + ["4"], "level": [1] * 4 + [2] * 2 + [1],
                        "completion_ids": COMPLETION_IDS + [[16], [17, 18], [10]]}
    # the same rewards as scoring each group alone
    alone = [asyncio.run(_scorer([correct, Recorder()], weights=[2.0, 1.0]).score(p, c, i)) for p, c, i in zip(*GROUPS)]
    assert len(out) == 3
    for got, want in zip(out, alone):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(out[1], [3.0, 3.0])


def test_a_reward_that_raises_on_one_group_fails_only_that_group():
    calls: list[int] = []

    def picky(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        calls.append(len(completions))
        if "bad" in completions:
            raise ValueError("cannot parse 'bad'")
        return [1.0] * len(completions)

    scorer = _scorer(picky)
    out = _score_many(scorer)
    assert calls == [7, 4, 2, 1]  # the batched call, then each group alone to find the bad one
    assert isinstance(out[1], RewardError) and "'picky' raised ValueError: cannot parse 'bad'" in str(out[1])
    np.testing.assert_array_equal(out[0], [1.0] * 4)
    np.testing.assert_array_equal(out[2], [1.0])
    assert scorer.batched == [True]  # the failure was the group's own: later calls stay batched


def test_a_non_finite_value_fails_only_its_group():
    def nan_for_bad(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        return [float("nan") if c == "bad" else 0.5 for c in completions]

    out = _score_many(_scorer([nan_for_bad, Recorder()]))
    assert isinstance(out[1], RewardError) and "'nan_for_bad' returned a non-finite value (nan)" in str(out[1])
    np.testing.assert_array_equal(out[0], [1.5, 1.5, 4.5, 0.5])
    np.testing.assert_array_equal(out[2], [1.5])


def test_a_reward_that_takes_only_one_group_is_called_per_group_from_then_on():
    calls: list[int] = []

    def one_prompt_only(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        calls.append(len(completions))
        assert len(set(prompts)) == 1, "expects one prompt per call"
        return [float(len(c)) for c in completions]

    scorer = _scorer(one_prompt_only)
    first = _score_many(scorer)
    assert calls == [7, 4, 2, 1] and scorer.batched == [False]
    assert [r.tolist() for r in first] == [[1.0, 1.0, 4.0, 0.0], [1.0, 3.0], [1.0]]
    second = _score_many(scorer)
    assert calls[4:] == [4, 2, 1]  # no batched attempt any more
    assert [r.tolist() for r in second] == [r.tolist() for r in first]


def test_groups_with_different_prompt_columns_are_scored_one_by_one():
    calls: list[list[str]] = []

    def rec(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        calls.append(sorted(kwargs))
        return [0.0] * len(completions)

    other = Prompt(id="p9", text="x", token_ids=(1,), meta={"answer": "y"})  # no "level"
    out = _score_many(_scorer(rec), ([PROMPT, other], [["a"], ["b", "c"]], [[[1]], [[2], [3]]]))
    assert [len(r) for r in out] == [1, 2]
    assert calls == [["answer", "completion_ids", "level"], ["answer", "completion_ids"]]


def test_a_batched_failure_on_a_group_already_failed_keeps_the_function_batched():
    def nan_for_bad(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        return [float("nan") if c == "bad" else 0.5 for c in completions]

    def chokes_on_bad(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        if "bad" in completions:
            raise ValueError("bad")
        return [1.0] * len(completions)

    # the first function already failed group 1, so the second's retries skip it and find nothing
    # new: that proves nothing about batching, and the second function stays batched
    scorer = _scorer([nan_for_bad, chokes_on_bad])
    out = _score_many(scorer)
    assert isinstance(out[1], RewardError) and "non-finite" in str(out[1])
    np.testing.assert_array_equal(out[0], [1.5] * 4)
    assert scorer.batched == [True, True]


# --- reward functions by import path (reward.functions), and each function's own values -----------

def test_a_reward_loads_from_a_file_and_from_a_module(tmp_path, monkeypatch) -> None:
    from pipeline.data.rewards import load_reward_function

    (tmp_path / "helpers_mod.py").write_text("TARGET = 'a'\n")
    (tmp_path / "my_reward.py").write_text(
        "import helpers_mod\n\n"
        "def hits(prompts, completions, **kw):\n"
        "    return [float(c.count(helpers_mod.TARGET)) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    fn = load_reward_function("my_reward.py:hits")  # relative to the working directory
    assert fn(["p"], ["aab"]) == [2.0]
    assert load_reward_function("pipeline.data.tasks:char_class_task").__name__ == "char_class_task"


@pytest.mark.parametrize("source, entry, match", [
    (None, "nowhere.py:f", "file 'nowhere.py' does not exist"),
    ("def f(:\n", "bad.py:f", "importing 'bad.py' failed: SyntaxError"),
    ("raise RuntimeError('boom at import')\n", "bad.py:f", "RuntimeError: boom at import"),
    ("x = 1\n", "bad.py:f", "has no attribute 'f'"),
    ("f = 1\n", "bad.py:f", "'f' is a int, not a function"),
    (None, "no_such_package_xyz.mod:f", "ModuleNotFoundError"),
])
def test_an_entry_that_cannot_be_imported_is_a_config_error_naming_it(tmp_path, monkeypatch, source, entry,
                                                                      match) -> None:
    from pipeline.errors import ConfigError
    from pipeline.data.rewards import load_reward_function

    if source is not None:
        (tmp_path / "bad.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=match) as e:
        load_reward_function(entry, "reward.functions[1]")
    assert f"reward.functions[1] entry {entry!r}" in str(e.value)


def test_each_functions_own_values_come_with_the_weighted_sum() -> None:
    def a(prompts, completions, **kw):
        return [1.0] * len(completions)

    def b(prompts, completions, **kw):
        return [float(len(c)) for c in completions]

    out = asyncio.run(_scorer([a, b], weights=[2.0, 0.5]).score_many_parts(*GROUPS))
    for (total, parts), texts in zip(out, GROUPS[1]):
        assert parts.shape == (2, len(texts))
        assert parts[1].tolist() == [float(len(t)) for t in texts]
        assert np.allclose(total, 2.0 * parts[0] + 0.5 * parts[1])


def test_two_functions_of_one_name_get_distinct_metric_names() -> None:
    def acc(prompts, completions, **kw):
        return [0.0] * len(completions)

    other = acc
    assert _scorer([acc, other]).names == ["acc", "acc_2"]
