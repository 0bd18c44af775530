"""An adapter for `verifiers` MultiTurnEnv environments (prime-intellect's package), as env.factory.

Not part of the pipeline: it needs `pip install verifiers` (checked with verifiers 0.1.14, whose
MultiTurnEnv is `verifiers.legacy.envs.multiturn_env` in later releases; verifiers 0.1.14 pins
datasets < 4.7, so keep it in an environment of its own). In a file of yours:

    from examples.multi_turn.verifiers_adapter import verifiers_factory
    make = verifiers_factory("my-env-id", max_turns=5)  # vf.load_environment(env_id, **args)

then `env.factory = "my_file.py:make"`, with data.train holding the environment's rows
(`vf_env.get_dataset()`: "prompt" messages, "answer", "info").

How: verifiers owns the episode loop (`MultiTurnEnv.rollout(input, client, model, ...)` is
final) and asks a `vf.Client` for every policy turn. Here the client is a queue: `reset` starts
the rollout as a task and returns the first prompt it asks for; `step(action)` answers that
request with the action's text and waits for the next request (its new messages are the
observation) or for the rollout's end (the environment's rubric then scores it: the reward).
Tool calls reach a verifiers ToolEnv as text only: a `ResponseMessage` without `tool_calls`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Callable, Mapping

import verifiers as vf
from verifiers.types import Response, ResponseMessage


def _dicts(messages: Any) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_none=True) if isinstance(m, vf.types.CustomBaseModel) else dict(m)
            for m in messages]


class _TurnClient(vf.Client):
    """A verifiers Client answered by the pipeline's policy, one request at a time."""

    def __init__(self) -> None:
        super().__init__(object())  # no provider behind it: get_response is answered here
        self.requests: asyncio.Queue[tuple[list[dict[str, Any]], asyncio.Future[str]]] = asyncio.Queue()

    def setup_client(self, config: Any) -> Any:
        return None

    async def to_native_tool(self, tool: Any) -> Any:
        return tool

    async def to_native_prompt(self, messages: Any) -> tuple[Any, dict]:
        return messages, {}

    async def get_native_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("answered in get_response")

    async def raise_from_native_response(self, response: Any) -> None:
        return None

    async def from_native_response(self, response: Any) -> Response:
        raise NotImplementedError("answered in get_response")

    async def close(self) -> None:
        return None

    async def get_response(self, prompt: Any, model: str, sampling_args: Any, tools: Any = None,
                           **kwargs: Any) -> Response:
        answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        await self.requests.put((_dicts(prompt), answer))
        message = ResponseMessage(role="assistant", content=await answer, finish_reason="stop", is_truncated=False)
        return Response(id=uuid.uuid4().hex, created=int(time.time()), model=model, message=message)


class VerifiersEnvironment:
    """One episode of a verifiers MultiTurnEnv, as an async pipeline Environment."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.client = _TurnClient()
        self.rollout: asyncio.Task | None = None
        self.pending: asyncio.Future[str] | None = None
        self.seen = 0  # messages of the conversation the policy has seen, its own turns included

    async def _next(self) -> tuple[list[dict[str, Any]] | None, Any]:
        """The rollout's next request (its prompt messages, None) or its end (None, the final state)."""
        get = asyncio.ensure_future(self.client.requests.get())
        done, _ = await asyncio.wait({get, self.rollout}, return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            prompt, self.pending = get.result()
            return prompt, None
        get.cancel()
        return None, self.rollout.result()

    async def reset(self, row: Mapping[str, Any]) -> list[dict[str, Any]]:
        rollout_input = {"example_id": row.get("example_id", row["id"]), **row}
        self.rollout = asyncio.create_task(self.env.rollout(rollout_input, self.client, "pipeline", {}))
        prompt, state = await self._next()
        if prompt is None:
            raise RuntimeError(f"the verifiers rollout ended before its first turn: {state.get('error')!r}")
        self.seen = len(prompt)
        return prompt

    async def step(self, action: str) -> tuple[Any, float, bool, dict[str, Any]]:
        self.pending.set_result(action)
        prompt, state = await self._next()
        if prompt is not None:
            observation = prompt[self.seen + 1:]  # what follows the policy's own turn
            self.seen = len(prompt)
            return observation, 0.0, False, {}
        if state.get("error") is not None:
            raise RuntimeError(f"the verifiers rollout failed: {state['error']!r}")
        await self.env.rubric.score_rollout(state)
        return None, float(state["reward"]), True, {"stop_condition": state.get("stop_condition")}

    async def close(self) -> None:
        if self.rollout is not None and not self.rollout.done():
            self.rollout.cancel()


def verifiers_factory(env_id: str, **env_args: Any) -> Callable[[], VerifiersEnvironment]:
    """An env.factory over `vf.load_environment(env_id, **env_args)`, loaded once; each episode
    gets its own VerifiersEnvironment (verifiers keeps per-rollout state in its State, not the env)."""
    env = vf.load_environment(env_id, **env_args)
    return lambda: VerifiersEnvironment(env)
