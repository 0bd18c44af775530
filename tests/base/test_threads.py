"""Daemon threads for a user's code: a call given up at its timeout is counted until it returns, and
past MAX_ABANDONED at once a new call is refused with UserCodeStuckError, naming what hangs.

Through the runner and the reward scorer too: an environment step and a reward function that time
out are the calls counted, and the refusal ends their caller as a FatalError, not one group's failure.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from pipeline import threads
from pipeline.data.rewards import RewardScorer
from pipeline.envs.protocol import EnvStep, EnvTimeoutError
from pipeline.envs.runner import EnvRunner
from pipeline.errors import FatalError, RewardError
from pipeline.threads import DaemonThreads, UserCodeStuckError
from pipeline.types import Prompt


def test_calls_given_up_are_counted_until_they_return_and_past_the_bound_none_starts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "MAX_ABANDONED", 3)
    pool = DaemonThreads("test")
    release = threading.Event()

    def hang() -> str:
        release.wait(10)
        return "late"

    async def main() -> None:
        assert await pool.run(lambda: 7) == 7  # a call that returns in time counts for nothing
        for i in range(3):
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.05):
                    await pool.run(hang, what=f"step {i}")
            assert pool.abandoned == i + 1
        with pytest.raises(UserCodeStuckError, match=r"^3 calls of your code outlived their timeouts .*"
                                                     r"\(step 0, step 1, step 2; the first given up \d+ s ago\)"):
            await pool.run(lambda: 7)
        release.set()  # they return at last: no longer counted, calls start again
        for _ in range(200):
            if pool.abandoned == 0:
                break
            await asyncio.sleep(0.01)
        assert pool.abandoned == 0 and await pool.run(lambda: 8) == 8

    asyncio.run(main())


class Hangs:
    """An environment whose step waits for `release`."""

    release = threading.Event()

    def reset(self, row: dict) -> str:
        return "go"

    def step(self, action: str) -> EnvStep:
        self.release.wait(10)
        return EnvStep(None, reward=0.0, done=True)


def test_an_environment_step_that_times_out_is_counted_and_too_many_end_the_run_not_a_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "MAX_ABANDONED", 2)
    monkeypatch.setattr("pipeline.envs.runner.USER_CODE", pool := DaemonThreads("user-code-test"))
    Hangs.release.clear()

    async def main() -> None:
        for _ in range(2):
            runner = await EnvRunner.open(Hangs, step_timeout_s=0.05)
            await runner.reset({})
            with pytest.raises(EnvTimeoutError):  # one group's failure
                await runner.step("a")
        assert pool.abandoned == 2
        with pytest.raises(UserCodeStuckError, match=r"environment Hangs\.step") as e:
            await EnvRunner.open(Hangs, step_timeout_s=0.05)
        assert isinstance(e.value, FatalError)
        Hangs.release.set()

    asyncio.run(main())


def test_a_reward_function_that_times_out_is_counted_and_too_many_end_the_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "MAX_ABANDONED", 1)
    monkeypatch.setattr("pipeline.data.rewards.USER_CODE", pool := DaemonThreads("user-code-test"))
    release = threading.Event()

    def slow(prompts: list[str], completions: list[str], **kw: Any) -> list[float]:
        release.wait(10)
        return [0.0] * len(completions)

    scorer = RewardScorer(slow, timeout_s=0.05)
    prompt = Prompt(id="p", text="p", token_ids=(1,))

    async def main() -> None:
        [first] = await scorer.score_many([prompt], [["a", "b"]], [[[1], [2]]])
        assert isinstance(first, RewardError) and pool.abandoned == 1  # its groups failed, the run goes on
        with pytest.raises(UserCodeStuckError, match="reward function 'slow'"):
            await scorer.score_many([prompt], [["a", "b"]], [[[1], [2]]])
        release.set()

    asyncio.run(main())
