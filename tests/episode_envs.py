"""Environments the episode tests load (by import path too: env.factory = "tests/episode_envs.py:Name")."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any, Mapping

from pipeline.envs import EnvStep


class Echo:
    """Replies " r<turn> " each turn, reward 1 a step, done after `turns` steps (the row's, else 3).
    Records what it saw and said, for the token-equality test."""

    log: list[tuple[str, str, str]] = []  # (row id, action, reply), over every instance

    def reset(self, row: Mapping[str, Any]) -> str:
        self.row = dict(row)
        self.t = 0
        return f"q{row['id']}:"

    def step(self, action: str) -> EnvStep:
        self.t += 1
        reply = f" r{self.t} "
        Echo.log.append((str(self.row["id"]), action, reply))
        return EnvStep(observation=reply, reward=1.0, done=self.t >= int(self.row.get("turns", 3)))


class Random:
    """Async; each step sleeps up to `latency` s and ends the episode with probability 1/3: episodes
    of random lengths and latencies, drawn from the row's id so that every group's run differs."""

    def __init__(self, latency: float = 0.02) -> None:
        self.latency = latency

    async def reset(self, row: Mapping[str, Any]) -> str:
        self.rng = random.Random(f"{row['id']}-{id(self)}")
        return f"q{row['id']}:"

    async def step(self, action: str) -> tuple[str, float, bool, dict]:
        await asyncio.sleep(self.rng.uniform(0, self.latency))
        return " ok ", float(len(action) % 3), self.rng.random() < 1 / 3, {}


class Slow(Echo):
    """Echo whose steps take `SLOW_S` seconds (kill -9 lands mid-episode)."""

    SLOW_S = 0.05

    def step(self, action: str) -> EnvStep:
        time.sleep(self.SLOW_S)
        return super().step(action)


class Flaky(Echo):
    """Echo whose step raises on rows with an id ending in 3, and hangs on those ending in 7."""

    def step(self, action: str) -> EnvStep:
        rid = str(self.row["id"])
        if rid.endswith("3"):
            raise KeyError("the tool crashed")
        if rid.endswith("7"):
            time.sleep(5)
        return super().step(action)


class Stuck(Echo):
    """Echo whose step never returns on rows with an id ending in 7: a user's thread stuck for good."""

    def step(self, action: str) -> EnvStep:
        while str(self.row["id"]).endswith("7"):
            time.sleep(0.05)
        return super().step(action)


class StuckAlways(Echo):
    """Echo whose every step never returns."""

    def step(self, action: str) -> EnvStep:
        while True:
            time.sleep(0.05)


class Endless(Echo):
    """Never done."""

    def step(self, action: str) -> EnvStep:
        out = super().step(action)
        return EnvStep(observation=out.observation, reward=out.reward, done=False)


class ChatTool:
    """A chat episode: the user asks for a sum, every policy turn gets a tool message back, the
    third ends it; reward 1 when the last turn holds the sum's digits."""

    def reset(self, row: Mapping[str, Any]) -> list[dict[str, str]]:
        self.a, self.b = 3 + int(row["id"]) % 50, 7 + int(row["id"]) % 31
        self.t = 0
        return [{"role": "user", "content": f"Use the calculator: what is {self.a} + {self.b}?"}]

    def step(self, action: str) -> EnvStep:
        self.t += 1
        if self.t >= 3:
            return EnvStep(observation=None, reward=float(str(self.a + self.b) in action), done=True)
        return EnvStep(observation={"role": "tool", "content": f"calculator: {self.a} + {self.b} = {self.a + self.b}"})
