"""Environments for multi-turn episodes: the protocol an environment meets, the runner that makes
any of them safe to await, and the tool-use base classes.

    from pipeline.envs import EnvStep, ToolEnvironment, from_trl

- `protocol.py`: `Environment` (reset, step, optional close and tools), `EnvStep`, `EnvError`,
  loading `env.factory`.
- `runner.py`: `EnvRunner`, one environment instance off the event loop, under its timeout,
  its answers checked.
- `tools.py`: tool calls in the Hermes/Qwen format, tool schemas for chat templates,
  `ToolEnvironment`, and `from_trl` for TRL's `environment_factory` classes.
"""

from pipeline.envs.protocol import (ClosableEnvironment, EnvError, Environment, EnvironmentFactory, EnvStep,
                                    EnvTimeoutError, Observation, ToolUser, load_environment_factory)
from pipeline.envs.runner import EnvRunner
from pipeline.envs.tools import ToolCallError, ToolEnvironment, TRLEnvironment, from_trl, parse_hermes_call, tool_schemas

__all__ = ["ClosableEnvironment", "EnvError", "EnvRunner", "EnvStep", "EnvTimeoutError", "Environment",
           "EnvironmentFactory", "Observation", "TRLEnvironment", "ToolCallError", "ToolEnvironment", "ToolUser",
           "from_trl", "load_environment_factory", "parse_hermes_call", "tool_schemas"]
