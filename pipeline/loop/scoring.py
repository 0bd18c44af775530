"""Scoring: generated groups checked against the engine contract, decoded, rewarded, filtered, buffered.

Invariants:
- A generation whose version is not the one its group was admitted with, or that has another
  number of completions than asked, fails its group (counted as a version mismatch or a wrong
  completion count); it is never scored or trained.
- A reward that raises or returns a bad value fails only the groups it fails on (RewardScorer).
- With an environment, a group's reward is env.reward's choice: the environment's rewards summed
  over each episode ("env"), the reward functions on each episode's transcript ("functions"), or
  their sum ("sum"), each part reported under its name (the environment's as "env").
- Every group goes on through one call of `Outcomes`: into the buffer (`buffered`; dropped there
  if shutdown closed it), or out as failed or dropped as zero-advantage (pipeline.filter_zero_advantage).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import numpy as np
import structlog

from pipeline.loop.buffer import Admission
from pipeline.faults import crash_point
from pipeline.loop.outcomes import Outcomes
from pipeline.observe.metrics import Count
from pipeline.data.rewards import RewardScorer
from pipeline.types import Generation, RolloutGroup

log = structlog.get_logger(__name__)

# completion tokens from which a wave is decoded in a worker thread: about a millisecond of
# decoding, ten times a thread hop; below, it is cheaper on the loop
DECODE_OFF_LOOP_TOKENS = 16384


class Texts:
    """Token ids to completion texts, on the loop for small waves and in a thread for large ones."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer  # None: no text (prompts carry token ids), every completion is ""
        if tokenizer is not None:
            from pipeline.models.builtin import batch_decoder

            self._decode: Callable[[list[list[int]]], list[str]] = batch_decoder(tokenizer)  # on the loop's thread
            self._decode_parallel = batch_decoder(tokenizer, parallel=True)  # in a worker thread

    async def __call__(self, ids: list[list[list[int]]]) -> list[list[str]]:
        """Each group's completions [groups][n] of token ids decoded."""
        if self.tokenizer is None:
            return [[""] * len(per) for per in ids]
        every = [x for per in ids for x in per]
        if sum(map(len, every)) >= DECODE_OFF_LOOP_TOKENS:  # off the loop: vLLM's output handling runs there
            flat = await asyncio.to_thread(self._decode_parallel, every)
        else:
            flat = self._decode(every)
        texts, i = [], 0
        for per in ids:
            texts.append(flat[i:i + len(per)])
            i += len(per)
        return texts


def reward_names(scorer: RewardScorer, env_reward: str | None) -> list[str]:
    """The parts of a group's reward: the reward functions', the environment's ("env"), or both."""
    if env_reward == "env":
        return ["env"]
    return ["env", *scorer.names] if env_reward == "sum" else list(scorer.names)


class Scoring:
    """From an engine's Generations to RolloutGroups in the buffer."""

    def __init__(self, *, texts: Texts, scorer: RewardScorer, outcomes: Outcomes, filter_zero_advantage: bool,
                 spans: list[tuple[float, float]], env_reward: str | None = None) -> None:
        self.texts = texts
        self.scorer = scorer
        self.env_reward = env_reward  # None: no environment; else env.reward ("env", "functions" or "sum")
        self.names = reward_names(scorer, env_reward)  # the reward parts, in order
        self.outcomes = outcomes
        self.filter_zero_advantage = filter_zero_advantage
        self.spans = spans  # (start, end) of each engine call whose groups came back, for the report
        self.version_mismatches = Count()  # generations of another version than their group's (Reporting reads it)

    async def accept(self, items: list[tuple[Admission, Generation]]) -> None:
        """Check, decode, score and buffer generated groups; each one that cannot be kept is settled."""
        keep: list[tuple[Admission, Generation]] = []
        spans = self.spans
        for adm, gen in items:
            crash_point("group.after_generate")
            if not spans or spans[-1] != (gen.t_start, gen.t_end):  # the groups of one call share theirs
                spans.append((gen.t_start, gen.t_end))
            if gen.version != adm.version or len(gen.completions) != gen.request.n:
                self.version_mismatches += gen.version != adm.version
                log.error("generation_contract_broken", group_id=adm.group_id, engine=gen.engine,
                          asked_version=adm.version, got_version=gen.version, completions=len(gen.completions))
                await self.outcomes.settle_failed(adm.group_id, "version_mismatch" if gen.version != adm.version
                                                  else "wrong_completion_count", gen, None, engine=gen.engine)
                continue
            keep.append((adm, gen))
        scores = await self.score([gen for _, gen in keep])
        groups: list[RolloutGroup] = []
        now = time.monotonic()
        for (adm, gen), scored in zip(keep, scores):
            if not isinstance(scored, tuple):  # a RewardError: a reward bug fails this group; the run goes on
                await self.outcomes.settle_failed(adm.group_id, "reward_error", gen, None, scored,
                                                  function=scored.function)
                continue
            rewards, parts = scored
            self.outcomes.scored()
            if self.filter_zero_advantage and rewards.min() == rewards.max():
                await self.outcomes.drop(adm.group_id, "zero_advantage", gen, rewards)
                continue
            groups.append(RolloutGroup(gen, rewards, now, parts))
        await self.outcomes.buffered(groups)

    async def score(self, gens: list[Generation]) -> list[Any]:
        """Each group's (rewards [n], parts [F, n]) or the RewardError that failed it: the reward functions
        on the decoded completions (an episode's whole transcript), the environment's summed rewards
        (nothing decoded then), or both."""
        mode = self.env_reward
        if mode == "env":
            return [(env, env[None]) for env in map(_env_rewards, gens)]
        ids = [[c.token_ids.tolist() for c in gen.completions] for gen in gens]
        scores = await self.scorer.score_many_parts([gen.request.prompt for gen in gens], await self.texts(ids), ids)
        if mode != "sum":
            return scores
        out = []
        for gen, scored in zip(gens, scores):
            if isinstance(scored, tuple):
                env = _env_rewards(gen)
                scored = (scored[0] + env, np.vstack([env[None], scored[1]]))
            out.append(scored)
        return out


def _env_rewards(gen: Generation) -> np.ndarray:
    """An episode group's environment rewards, each summed over the episode's steps."""
    return np.array([c.env_reward or 0.0 for c in gen.completions], dtype=np.float64)
