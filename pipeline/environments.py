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

`EnvRunner` adapts any environment uniformly. Invariants:
- Sync methods run in a worker thread, never on the event loop; async ones are awaited. The
  threads are daemons of their own (`pipeline.threads.DaemonThreads`), one per call: a step
  that never returns holds neither a worker another call needs nor the process at exit.
- Every reset and step runs under `step_timeout_s`; one that takes longer raises
  `EnvTimeoutError` (reason "env_timeout"). One that raises, or returns something that is not a
  valid observation / EnvStep, raises `EnvError` (reason "env_error") naming the environment and
  keeping the original exception as `__cause__`. Both are RecoverableErrors: the group fails, the
  run goes on. Nothing else escapes, except cancellation.
- `step` returns an EnvStep whose reward is a finite float, whose done is a bool and whose
  observation is a string or a list of messages (None only with done). After an error, a
  timeout or `done`, the runner takes no further step.
- `close()` is safe to call twice and never raises: the episode's result is complete by then.
- A sync call that times out goes on in its thread until it returns (a thread cannot be stopped);
  its runner has finished, its result is dropped, and the run ends on time whatever it does.

`ToolEnvironment` is a base class for tool use: its public methods (or the `tools` given) are the
tools; an action holding a call runs it and observes the result, an action without one ends the
episode and is scored. `from_trl` wraps a TRL `environment_factory` class the same way.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import json
import math
import re
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np
import structlog

from pipeline.errors import ConfigError, RecoverableError
from pipeline.rewards import load_reward_function
from pipeline.threads import USER_CODE

log = structlog.get_logger(__name__)

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
    reward functions are (`pipeline.rewards.load_reward_function`). ConfigError naming `key` if it fails."""
    return load_reward_function(entry, key)


# --------------------------------------------------------------------------- the runner


def _name(env: Any) -> str:
    return type(env).__name__


class EnvRunner:
    """One environment instance, made safe to await: off the loop, under a timeout, its output checked.

    `executor`: where sync methods run (None: a daemon thread per call, `pipeline.threads.USER_CODE`).
    The timeout counts from the call, so an executor with fewer workers than live episodes makes
    steps wait for a worker inside their timeout.
    """

    def __init__(self, env: Environment, *, step_timeout_s: float, executor: Executor | None = None) -> None:
        if not isinstance(env, Environment):
            raise TypeError(f"{_name(env)} is not an environment: it needs reset(row) and step(action)")
        self.env = env
        self.name = _name(env)
        self.step_timeout_s = step_timeout_s
        self.executor = executor
        self.steps = 0  # steps taken
        self.finished = False  # done, failed or closed: no further step
        self._closed = False

    @classmethod
    async def open(cls, factory: EnvironmentFactory, *, step_timeout_s: float,
                   executor: Executor | None = None) -> EnvRunner:
        """A runner over a new instance from `factory`, built off the loop under the timeout
        (a factory may start a process); EnvError/EnvTimeoutError as a step's."""
        where = getattr(factory, "__qualname__", None) or _name(factory)  # a class or function has one; a partial not
        env = await cls._timed(None, f"{where}()", step_timeout_s, executor, factory)
        return cls(env, step_timeout_s=step_timeout_s, executor=executor)

    @staticmethod
    async def _timed(runner: EnvRunner | None, what: str, timeout_s: float, executor: Executor | None,
                     fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), awaited if async, else in a worker thread; EnvTimeoutError / EnvError if it fails."""
        deadline = asyncio.timeout(timeout_s)
        try:
            async with deadline:
                if inspect.iscoroutinefunction(fn):
                    out = await fn(*args)
                else:
                    loop = asyncio.get_running_loop()
                    # contextvars travel with the call (as asyncio.to_thread does): log fields stay bound
                    out = await loop.run_in_executor(executor or USER_CODE, contextvars.copy_context().run,
                                                     fn, *args)
                if inspect.isawaitable(out):  # a sync method returning a coroutine: awaited here, on the loop
                    out = await out
                return out
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the environment's bug or slowness fails its group, not the run
            if runner is not None:
                runner.finished = True
            if isinstance(e, TimeoutError) and deadline.expired():  # ours, not a timeout the environment raised
                raise EnvTimeoutError(f"environment {what} took longer than env.step_timeout_s = {timeout_s:g} s") \
                    from None
            raise EnvError(f"environment {what} raised {type(e).__name__}: {e}") from e

    async def reset(self, row: Mapping[str, Any]) -> Observation:
        """The episode's first observation (its prompt), checked."""
        if self.steps or self.finished:
            raise RuntimeError(f"environment {self.name} was reset after its episode started")
        obs = await self._timed(self, f"{self.name}.reset", self.step_timeout_s, self.executor, self.env.reset, row)
        checked = self._observation(obs, "reset")
        if checked is None:
            self.finished = True
            raise EnvError(f"environment {self.name}.reset returned None; it must return the first observation "
                           "(a string or a list of {role, content} messages)")
        return checked

    async def step(self, action: str) -> EnvStep:
        """The environment's reaction to the policy's turn, as a checked EnvStep."""
        if self.finished:
            raise RuntimeError(f"environment {self.name} stepped after its episode ended")
        out = await self._timed(self, f"{self.name}.step", self.step_timeout_s, self.executor, self.env.step, action)
        self.steps += 1
        step = self._env_step(out)
        self.finished = step.done
        return step

    async def close(self) -> None:
        """Close the environment if it can be closed; a failure is logged, never raised."""
        if self._closed:
            return
        self._closed = self.finished = True
        if not isinstance(self.env, ClosableEnvironment):
            return
        try:
            await self._timed(None, f"{self.name}.close", self.step_timeout_s, self.executor, self.env.close)
        except EnvError as e:  # the episode is complete; a close that fails loses nothing of it
            log.warning("env_close_failed", environment=self.name, error=str(e))

    def _fail(self, message: str) -> EnvError:
        self.finished = True
        return EnvError(f"environment {self.name}.{message}")

    def _observation(self, obs: Any, where: str) -> Observation | None:
        """obs as an Observation (a message dict becomes a list of one); EnvError if it is none."""
        if obs is None or isinstance(obs, str):
            return obs
        messages = [obs] if isinstance(obs, Mapping) else obs
        if isinstance(messages, (list, tuple)) and messages and all(
                isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            return [dict(m) for m in messages]
        raise self._fail(f"{where} returned an observation of {type(obs).__name__} {str(obs)[:80]!r}; it must be "
                         "a string, a {role, content} message or a non-empty list of them (content a string)")

    def _env_step(self, out: Any) -> EnvStep:
        if isinstance(out, EnvStep):
            obs, reward, done, info = out.observation, out.reward, out.done, out.info
        elif isinstance(out, (tuple, list)) and len(out) == 4:
            obs, reward, done, info = out
        else:
            raise self._fail(f"step returned {type(out).__name__} {str(out)[:80]!r}; it must return an EnvStep or "
                             "a tuple (observation, reward, done, info)")
        # bool is an int, and numpy scalars are not python floats: accept numbers, refuse flags and text
        if isinstance(reward, (bool, np.bool_)) or not isinstance(reward, (int, float, np.integer, np.floating)):
            raise self._fail(f"step returned a reward of {type(reward).__name__} {str(reward)[:40]!r}; "
                             "it must be a finite number")
        reward = float(reward)
        if not math.isfinite(reward):
            raise self._fail(f"step returned a non-finite reward ({reward})")
        if not isinstance(done, (bool, np.bool_)):
            raise self._fail(f"step returned done = {str(done)[:40]} ({type(done).__name__}); it must be a bool")
        done = bool(done)
        if info is None:
            info = {}
        if not isinstance(info, Mapping):
            raise self._fail(f"step returned info of {type(info).__name__}; it must be a dict (or None)")
        obs = self._observation(obs, "step")
        if obs is None and not done:
            raise self._fail("step returned no observation (None) for an episode that goes on; return '' "
                             "to add nothing, or done = True")
        return EnvStep(observation=obs, reward=reward, done=done, info=dict(info))


# --------------------------------------------------------------------------- tool use


class ToolCallError(ValueError):
    """A tool call the policy wrote that cannot be run (malformed JSON, not a name and arguments)."""


_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_hermes_call(action: str) -> tuple[str, dict[str, Any]] | None:
    """The first Hermes/Qwen-style call in `action`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

    None when the action holds no `<tool_call>`; ToolCallError when it holds one that is not a
    JSON object with a string "name" and an object "arguments" (a string holding JSON is accepted,
    as OpenAI's format writes it)."""
    match = _HERMES_CALL.search(action)
    if match is None:
        return None
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError as e:
        raise ToolCallError(f"the tool call is not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolCallError('a tool call must be a JSON object {"name": ..., "arguments": {...}}')
    args = call.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise ToolCallError("the tool call's arguments are not valid JSON") from None
    if not isinstance(args, dict):
        raise ToolCallError(f"the tool call's arguments must be an object, got {type(args).__name__}")
    return call["name"], args


def _run_sync(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn's result; an async fn (or one returning an awaitable) runs to its end on a loop of its own.
    For methods that run in a worker thread (the runner puts sync steps there), never on the main loop."""
    out = fn(*args, **kwargs)
    if inspect.isawaitable(out):
        async def wait() -> Any:
            return await out
        out = asyncio.run(wait())
    return out


def tool_schemas(tools: Mapping[str, Callable[..., Any]]) -> list[dict[str, Any]]:
    """A JSON schema per tool, as chat templates take them (`apply_chat_template(..., tools=...)`):
    transformers' `get_json_schema` of its signature and Google-style docstring, under its tool name.
    ConfigError naming the tool when its docstring or type hints cannot make one."""
    from transformers.utils import (
        get_json_schema,  # here: importing transformers costs seconds
    )

    out = []
    for name, fn in tools.items():
        try:
            schema = get_json_schema(fn)
        except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException: a bad tool
            raise ConfigError(f"tool {name!r} has no schema: {type(e).__name__}: {e}. A tool needs type hints and "
                              "a docstring with an Args: section describing every argument") from None
        schema["function"]["name"] = name
        out.append(schema)
    return out


class ToolEnvironment:
    """An environment where the policy calls tools, then answers.

    Subclass it and define public methods (each one a tool, as TRL's environment_factory does),
    or pass `tools={name: callable}`. Each step parses one call out of the action (`parse_call`,
    Hermes/Qwen `<tool_call>` JSON by default), runs it and observes the result as a tool
    message; an action without a call is the answer: the episode ends and `score(action)` is its
    reward. A call to an unknown tool, with bad arguments or whose tool raises is answered with a
    message saying what was wrong, and the episode goes on.

    Methods run synchronously: the runner puts `step` in a worker thread, and an async tool runs
    to its end there on a loop of its own.
    """

    _given_tools: dict[str, Callable[..., Any]] | None = None  # tools=...; None: the public methods

    def __init__(self, tools: Mapping[str, Callable[..., Any]] | Sequence[Callable[..., Any]] | None = None) -> None:
        if tools is not None:
            self._given_tools = dict(tools) if isinstance(tools, Mapping) else {fn.__name__: fn for fn in tools}
        self.prompt: Observation | None = None

    @property
    def tools(self) -> dict[str, Callable[..., Any]]:
        """Name -> callable: the tools given, or the public methods a subclass defines."""
        if self._given_tools is not None:
            return dict(self._given_tools)
        own = set(dir(ToolEnvironment))
        return {name: getattr(self, name) for name, member in inspect.getmembers(type(self), inspect.isfunction)
                if not name.startswith("_") and name not in own}

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools' JSON schemas, for a chat template's `tools=`."""
        return tool_schemas(self.tools)

    def reset(self, row: Mapping[str, Any]) -> Observation:
        """The row's prompt. Override to set up per-episode state (and return the prompt)."""
        self.prompt = row["prompt"]
        return self.prompt

    def parse_call(self, action: str) -> tuple[str, dict[str, Any]] | None:
        """(tool name, arguments) of the call in `action`, None if it holds none; raise ToolCallError
        for a call that cannot be read (its message goes back to the policy)."""
        return parse_hermes_call(action)

    def score(self, action: str) -> float:
        """The reward of the final answer `action` (0 by default)."""
        return 0.0

    def step(self, action: str) -> EnvStep:
        try:
            call = self.parse_call(action)
        except ToolCallError as e:  # the policy's malformed call: it is told, and may try again
            return EnvStep(self._tool_message("error", f"error: {e}"), info={"tool_error": "malformed"})
        if call is None:
            return EnvStep(None, reward=float(_run_sync(self.score, action)), done=True)
        name, args = call
        tools = self.tools
        fn = tools.get(name)
        if fn is None:
            known = ", ".join(sorted(tools)) or "none"
            return EnvStep(self._tool_message(name, f"error: no tool named {name!r} (tools: {known})"),
                           info={"tool": name, "tool_error": "unknown_tool"})
        try:
            inspect.signature(fn).bind(**args)
        except TypeError as e:
            return EnvStep(self._tool_message(name, f"error: bad arguments for {name}: {e}"),
                           info={"tool": name, "tool_error": "bad_arguments"})
        try:
            result = _run_sync(fn, **args)
        except Exception as e:  # the tool's own failure is its answer to this call, as TRL reports it
            return EnvStep(self._tool_message(name, f"error: {type(e).__name__}: {e}"),
                           info={"tool": name, "tool_error": "raised"})
        return EnvStep(self._tool_message(name, str(result)), info={"tool": name})

    @staticmethod
    def _tool_message(name: str, content: str) -> list[dict[str, Any]]:
        return [{"role": "tool", "name": name, "content": content}]


# --------------------------------------------------------------------------- interop: TRL


@runtime_checkable
class _OwnsReward(Protocol):
    """A TRL environment that scores its rollout itself."""

    def get_reward(self) -> float | Awaitable[float]:
        ...


class TRLEnvironment(ToolEnvironment):
    """A TRL `environment_factory` instance as a ToolEnvironment (TRL 1.x GRPOTrainer's contract).

    TRL's contract: `reset(**row)` returns None or a string appended to the prompt's last user
    message; every public method but `reset` and `get_reward` is a tool; an optional
    `get_reward()` (sync or async) scores the finished rollout. Here the tools, the `<tool_call>`
    parsing and the error messages are ToolEnvironment's; `get_reward` is called when the policy
    answers without a call (TRL calls it also for a rollout cut at its tool-call limit: an episode
    cut at env.max_turns gets 0 here).
    """

    def __init__(self, env: Any) -> None:
        inner = {name: getattr(env, name) for name, _ in inspect.getmembers(type(env), inspect.isfunction)
                 if name not in ("reset", "get_reward") and not name.startswith("_")}
        super().__init__(tools=inner)
        self.env = env

    def reset(self, row: Mapping[str, Any]) -> Observation:
        extra = _run_sync(self.env.reset, **row)
        prompt = row["prompt"]
        if extra is None:
            pass
        elif not isinstance(extra, str):
            raise TypeError(f"{type(self.env).__name__}.reset returned {type(extra).__name__}; TRL's contract is "
                            "None or a string to append to the prompt")
        elif isinstance(prompt, str):
            prompt = prompt + extra
        else:
            prompt = [dict(m) for m in prompt]
            last = max((i for i, m in enumerate(prompt) if m["role"] == "user"), default=None)
            if last is None:
                prompt.append({"role": "user", "content": extra})
            else:
                prompt[last]["content"] = prompt[last]["content"] + extra
        self.prompt = prompt
        return prompt

    def score(self, action: str) -> float:
        return float(_run_sync(self.env.get_reward)) if isinstance(self.env, _OwnsReward) else 0.0


def from_trl(factory: Callable[[], Any]) -> EnvironmentFactory:
    """An environment factory over a TRL `environment_factory`: each instance wrapped in TRLEnvironment.

    For env.factory, in a file of yours: `make = from_trl(MyTRLEnv)`, then factory = "file.py:make"."""
    def make() -> TRLEnvironment:
        return TRLEnvironment(factory())

    make.__qualname__ = f"from_trl({getattr(factory, '__qualname__', _name(factory))})"
    return make
