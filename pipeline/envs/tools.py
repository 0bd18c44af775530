"""`ToolEnvironment` is a base class for tool use: its public methods (or the `tools` given) are the
tools; an action holding a call runs it and observes the result, an action without one ends the
episode and is scored. `from_trl` wraps a TRL `environment_factory` class the same way.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from typing import Any, Awaitable, Callable, Mapping, Protocol, Sequence, runtime_checkable


from pipeline.errors import ConfigError
from pipeline.envs.protocol import EnvironmentFactory, EnvStep, Observation



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

    make.__qualname__ = f"from_trl({getattr(factory, '__qualname__', type(factory).__name__)})"
    return make
