"""Environments: what a multi-turn episode talks to, and the runner that makes any of them safe to await.

An environment is anything with `reset(row)` and `step(action)` (the `Environment` protocol),
sync or async; it comes from a built-in task (`Task.environment`) or from `env.factory`, an
import path loaded like a reward function's ("package.module:Class" or "path/to/file.py:Class":
any callable taking no argument and returning one environment). One instance plays one episode.

    reset(row)     -> the first observation: the episode's prompt (a string or chat messages)
    step(action)   -> EnvStep(observation, reward, done, info), or the tuple of those four
    close()        -> optional (`ClosableEnvironment`): free what the episode held
    tools          -> optional (`ToolUser`): name -> callable the policy may call; their results
                      come back as observations, their schemas go to chat templates (`tool_schemas`)

`action` is the text of the policy's turn. An observation is text, or chat messages
(`{"role", "content"}` dicts); a tool's result is a `{"role": "tool", ...}` message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Protocol, runtime_checkable


from pipeline.errors import RecoverableError
from pipeline.data.rewards import load_reward_function


Observation = str | list[dict[str, Any]]  # text, or chat messages {"role": str, "content": str, ...}

REASONS = ("env_error", "env_timeout")  # EnvError.reason: the group-failure reasons counted per run


class EnvError(RecoverableError):
    """An environment's reset or step raised or returned something invalid: its group fails.

    `reason` is "env_error" (see REASONS); the environment's own exception is `__cause__`."""

    def __init__(self, message: str, reason: str = "env_error") -> None:
        super().__init__(message)
        self.reason = reason


class EnvTimeoutError(EnvError):
    """An environment's reset or step took longer than env.step_timeout_s."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="env_timeout")


@dataclass
class EnvStep:
    """What one step of an environment returns."""

    observation: Observation | None  # appended after the policy's turn; None: nothing (only with done)
    reward: float = 0.0  # this step's reward; an episode's environment reward is the sum over its steps
    done: bool = False  # the episode is over: no further turn
    info: dict[str, Any] = field(default_factory=dict)  # anything the environment reports (logged, not trained on)


@runtime_checkable
class Environment(Protocol):
    """One episode's environment. Either method may be sync or async (`async def`)."""

    def reset(self, row: Mapping[str, Any]) -> Observation | Awaitable[Observation]:
        """Start an episode from a data row ({"id", "prompt", ...}); the first observation is its prompt."""
        ...

    def step(self, action: str) -> EnvStep | tuple[Any, Any, Any, Any] | Awaitable[Any]:
        """React to the policy's turn: EnvStep, or (observation, reward, done, info)."""
        ...


@runtime_checkable
class ClosableEnvironment(Environment, Protocol):
    """An environment that holds something to free when its episode ends (a process, a sandbox)."""

    def close(self) -> None | Awaitable[None]:
        ...


@runtime_checkable
class ToolUser(Protocol):
    """An environment with tools the policy may call: their schemas are shown to it (`tool_schemas`)."""

    tools: Mapping[str, Callable[..., Any]]


EnvironmentFactory = Callable[[], Environment]


def load_environment_factory(entry: str, key: str = "env.factory") -> EnvironmentFactory:
    """The callable an entry names ("package.module:Class" or "path/to/file.py:Class"), imported as
    reward functions are (`pipeline.data.rewards.load_reward_function`). ConfigError naming `key` if it fails."""
    return load_reward_function(entry, key)
