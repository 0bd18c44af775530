"""Episodes: a group of n multi-turn episodes of an environment, generated as one group.

A group's n episodes share their first observation, so one engine call with n samples the
first turn of all of them. Each later turn is one request (n = 1) per live episode, all of a
turn sent together (`generate_many` where the engine has it). Between turns each episode's
environment takes the policy's action and answers; its answer is rendered (the chat template's
tool or user turn and the next assistant header) and appended as tokens.

    reset(row) x n ─► prompt ─► engine (n) ─► step(action) x live ─► reply tokens ─► engine (1 per live) ─► ...

Invariants:
- Token in, token out: the policy's sampled tokens are never decoded and encoded again. An
  episode's completion is its sampled tokens and the environment's reply tokens in order, and
  each turn's prompt is the group's prompt followed by exactly those tokens.
- An environment with tools (`ToolUser`) has their JSON schemas shown by the chat template in
  the prompt (its `tools`), and in every reply rendered after it; such an episode is a chat.
- `Completion.mask` is True on the sampled tokens only; `logprobs` holds the engine's value
  there and 0 on reply tokens. `turns` counts the policy's turns; `env_reward` sums the
  environment's rewards over its steps.
- An episode ends when its environment says done (finish reason "stop"), after `env.max_turns`
  policy turns ("max_turns"), or when the next turn would not fit the episode's token budget
  ("length"): prompt + completion never exceed `env.max_episode_tokens` (or the engines' context).
- Every turn of a group runs on one engine (its prefix cache holds the history) with the adapter
  version the group was admitted with; a turn sampled with any other version fails the attempt.
- An environment's failure (it raised, timed out, or answered something malformed) is an
  EnvError: the group fails with its reason; it is not an engine failure and is not retried.
  Every environment of an attempt is closed when the attempt ends, however it ends.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import structlog

from pipeline.config.schema import EnvConfig
from pipeline.envs.protocol import EnvError, ToolUser
from pipeline.envs.runner import EnvRunner
from pipeline.envs.tools import tool_schemas
from pipeline.errors import GenerationError
from pipeline.faults import crash_point
from pipeline.data.prompts import PromptBuilder, PromptError, render_observation
from pipeline.protocols import BatchEngine, Engine
from pipeline.types import AdapterRef, Completion, Generation, GroupRequest, Prompt

log = structlog.get_logger(__name__)


class EpisodeRows:
    """Admission's prompt builder for environment tasks: the row itself, kept for `reset(row)`; the
    prompt is the first observation, known once the episodes have started."""

    def build(self, item: Any) -> Prompt:
        row = dict(item) if isinstance(item, Mapping) else {"prompt": item}
        return Prompt(id=str(row.get("id", "")), text="", token_ids=(), meta=row)


@dataclass(frozen=True)
class _Framing:
    """How a group's conversation is rendered after its prompt."""

    chat: bool  # replies are chat turns of the template (else their text as it is)
    tools: list[dict[str, Any]] | None  # the tool schemas the template shows, as in the prompt


@dataclass
class _Episode:
    """One episode's tokens so far and what its environment said."""

    env: EnvRunner
    index: int  # its place among the group's n episodes
    last: Completion | None = None  # the policy's latest turn, for the environment to take
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    turns: int = 0
    reward: float = 0.0
    finish: str = ""  # "" while live; then "stop" (the environment ended it), "max_turns" or "length"

    def add(self, c: Completion) -> None:
        """The policy's turn: its sampled tokens with the engine's log-probs."""
        self.tokens += c.token_ids.tolist()
        self.logprobs += c.logprobs.tolist()
        self.mask += [True] * len(c.token_ids)
        self.turns += 1
        self.last = c

    def completion(self) -> Completion:
        return Completion(np.asarray(self.tokens, dtype=np.int64), np.asarray(self.logprobs, dtype=np.float32),
                          self.finish or "length", mask=np.asarray(self.mask, dtype=bool), turns=self.turns,
                          env_reward=self.reward)


class Episodes:
    """Runs groups of episodes on an engine: `run(engine, request, adapter)` in place of `engine.generate`."""

    def __init__(self, factory: Callable[[], Any], *, cfg: EnvConfig, builder: PromptBuilder, tokenizer: Any,
                 max_new_tokens: int, request_timeout_s: float) -> None:
        self.factory = factory
        self.cfg = cfg
        self.builder = builder
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.request_timeout_s = request_timeout_s
        self.budget = cfg.max_episode_tokens or builder.max_context  # prompt + completion tokens an episode may hold; None: no limit known
        self.turns = 0  # policy turns sampled, over the session
        self.env_steps = 0

    async def run(self, engine: Engine, request: GroupRequest, adapter: AdapterRef) -> Generation:
        """The group's n episodes to their ends; a Generation of one completion per episode."""
        t_start = time.monotonic()
        episodes: list[_Episode] = []
        last: int | None = None  # in-flight swaps: the newest version any turn may have sampled with
        try:
            runners = await asyncio.gather(*(EnvRunner.open(self.factory, step_timeout_s=self.cfg.step_timeout_s)
                                             for _ in range(request.n)), return_exceptions=True)
            episodes = [_Episode(r, i) for i, r in enumerate(runners) if isinstance(r, EnvRunner)]
            for r in runners:
                if isinstance(r, BaseException):
                    raise r
            prompt, framing = await self._start(request.prompt, episodes)
            if self._room(prompt, 0) < 1:
                raise EnvError(f"prompt {prompt.id!r} has {len(prompt.token_ids)} tokens: no room for a turn within "
                               f"the episode's budget of {self.budget}", reason="env_prompt_too_long")
            first = GroupRequest(request.group_id, prompt, request.n, self._room(prompt, 0), request.seed, turn=0)
            gen = await self._call(engine, [first], adapter)
            last = _newest(last, gen)
            for ep, c in zip(episodes, gen[0].completions):
                ep.add(c)
            while True:
                await self._step(prompt, framing, [ep for ep in episodes if not ep.finish])
                live = [ep for ep in episodes if not ep.finish]
                if not live:
                    break
                turn = live[0].turns
                requests = [GroupRequest(request.group_id, Prompt(prompt.id, "", prompt.token_ids + tuple(ep.tokens)),
                                         1, self._room(prompt, len(ep.tokens)),
                                         None if request.seed is None else
                                         (request.seed * 31 + turn * 1009 + ep.index) % 2**31, turn=turn)
                            for ep in live]
                answers = await self._call(engine, requests, adapter)
                last = _newest(last, answers)
                for ep, g in zip(live, answers):
                    ep.add(g.completions[0])
        finally:
            await asyncio.gather(*(ep.env.close() for ep in episodes))
        return Generation(GroupRequest(request.group_id, prompt, request.n, request.max_new_tokens, request.seed),
                          tuple(ep.completion() for ep in episodes), version=adapter.version, engine=engine.name,
                          t_start=t_start, t_end=time.monotonic(),
                          last_version=last)

    async def _start(self, row_prompt: Prompt, episodes: list[_Episode]) -> tuple[Prompt, _Framing]:
        """Reset every episode's environment on the row: their common first observation as the prompt
        (with the environment's tool schemas), and how the replies after it are rendered."""
        row = dict(row_prompt.meta)
        first = await asyncio.gather(*(ep.env.reset(row) for ep in episodes))
        if any(obs != first[0] for obs in first[1:]):
            raise EnvError(f"prompt {row_prompt.id!r}: the environments of one group gave different first "
                           "observations; reset(row) must depend on the row only (the group shares one prompt)")
        field_name = self.builder.prompt_field
        item = {**{k: v for k, v in row.items() if k != field_name}, "id": row_prompt.id, field_name: first[0]}
        env = episodes[0].env.env
        tools = (tool_schemas(env.tools) or None) if isinstance(env, ToolUser) else None
        chat = bool(tools) or self.builder.apply_chat_template or not isinstance(first[0], str)
        try:
            return self.builder.build(item, tools=tools), _Framing(chat, tools)
        except PromptError as e:
            raise EnvError(f"the first observation of prompt {row_prompt.id!r} cannot be a prompt: {e}",
                           reason=f"env_prompt_{e.reason}") from e

    def _room(self, prompt: Prompt, used: int) -> int:
        """Tokens the next turn may sample: max_new_tokens, within the episode's budget."""
        if self.budget is None:
            return self.max_new_tokens
        return max(0, min(self.max_new_tokens, self.budget - len(prompt.token_ids) - used))

    async def _call(self, engine: Engine, requests: list[GroupRequest], adapter: AdapterRef) -> list[Generation]:
        """One turn of the live episodes, on `engine`, under engine.request_timeout_s."""
        async with asyncio.timeout(self.request_timeout_s):
            if len(requests) > 1 and isinstance(engine, BatchEngine):
                results: list[Any] = await engine.generate_many(requests, adapter)
                if len(results) != len(requests):
                    raise GenerationError(f"engine {engine.name} returned {len(results)} results for "
                                          f"{len(requests)} turns")
            else:
                results = await asyncio.gather(*(engine.generate(r, adapter) for r in requests),
                                               return_exceptions=True)
        for r, g in zip(requests, results):
            if isinstance(g, BaseException):
                raise g
            if g.version != adapter.version or len(g.completions) != r.n:
                raise GenerationError(f"engine {engine.name} answered turn {r.turn} of group {r.group_id} with "
                                      f"version {g.version} and {len(g.completions)} completions; asked for "
                                      f"version {adapter.version} and {r.n}")
        self.turns += sum(r.n for r in requests)
        return results

    async def _step(self, prompt: Prompt, framing: _Framing, live: list[_Episode]) -> None:
        """Each live episode's environment takes the turn just sampled; its reply is appended, or it ends."""
        actions = [self.tokenizer.decode(ep.last.token_ids.tolist(), skip_special_tokens=True) for ep in live]
        results = await asyncio.gather(*(ep.env.step(a) for ep, a in zip(live, actions)), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        self.env_steps += len(live)
        crash_point("episode.after_step")
        for ep, step in zip(live, results):
            ep.reward += step.reward
            if step.done or step.observation is None:
                ep.finish = "stop"
                continue
            if ep.turns >= self.cfg.max_turns:
                ep.finish = "max_turns"  # the turns are spent before the environment was done
                continue
            try:
                reply = render_observation(self.tokenizer, step.observation, chat=framing.chat,
                                           chat_template=self.builder.chat_template,
                                           turn_ended=ep.last.finish_reason == "stop", tools=framing.tools)
            except PromptError as e:
                raise EnvError(f"environment {ep.env.name}: its observation cannot be rendered: {e}") from e
            if self.budget is not None and len(prompt.token_ids) + len(ep.tokens) + len(reply) >= self.budget:
                ep.finish = "length"  # no room for the reply and a turn after it
                continue
            ep.tokens += reply
            ep.logprobs += [0.0] * len(reply)
            ep.mask += [False] * len(reply)


def _newest(last: int | None, turns: list[Generation]) -> int | None:
    """The newest of `last` and the turns' last_version (None: no turn was carried across a swap)."""
    return max((v for v in (last, *(g.last_version for g in turns)) if v is not None), default=None)
