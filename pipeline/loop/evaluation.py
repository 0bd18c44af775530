"""Held-out evaluation: which steps are evaluated, the pass@k estimate, and the versions an
evaluation holds loaded.

An evaluation round samples `eval.n` completions of each eval prompt on the engines that
generate for training, at the version they serve once the round's step is published, scores
them with the run's rewards and logs them in rollouts.zarr with fate "eval". Nothing of a round
reaches the buffer, the ledger or the training accounting.

Invariants:
- Rounds run before the first step (step 0), after every `eval.every`-th step and after the last
  one; a round's groups have ids of their own, below zero (`eval_group_id`), so they can never
  meet a training group's id (a stream position, >= 0) in the rollout log.
- A version that a round samples with stays loaded until the round's last engine call has
  returned (`pipeline.loop.versions.VersionPins`); in full-weight mode no engine swaps weights while
  a round samples.
- A round's rows reach the RolloutLog and its metrics row reaches metrics.jsonl in one moment on
  the loop; `done` names the rounds whose rows a checkpoint covers, so a resumed run redoes only
  the round it cut.
- `pass_at_k` is the unbiased estimator of Chen et al. (2021): 1 - C(n - c, k) / C(n, k).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import structlog

from pipeline.config.schema import EvalConfig, SamplingConfig
from pipeline.errors import ConfigError, PromptError
from pipeline.types import Generation, GroupOutcome, GroupRequest, Prompt

if TYPE_CHECKING:  # the components a round uses; none of them imports this module back
    from pipeline.loop.generation import Generator
    from pipeline.loop.outcomes import Outcomes
    from pipeline.data.prompts import PromptBuilder
    from pipeline.loop.scoring import Scoring
    from pipeline.loop.versions import VersionPins, Versions

log = structlog.get_logger(__name__)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k samples drawn without replacement from n, of which c
    pass, passes (Chen et al. 2021, the numerically stable product form)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


# eval prompts a round may hold: ids stay unique per (step, index) whatever the eval set's size,
# also when a resumed run evaluates another set than its first session did
MAX_EVAL_PROMPTS = 1 << 24


def eval_group_id(step: int, index: int) -> int:
    """The rollout-log id of eval prompt `index` in the round of `step`: negative, unique per (step, index)."""
    if not 0 <= index < MAX_EVAL_PROMPTS:
        raise ValueError(f"eval prompt index {index} is outside [0, {MAX_EVAL_PROMPTS})")
    return -(1 + step * MAX_EVAL_PROMPTS + index)


def is_due(step: int, every: int, last_step: int) -> bool:
    """Whether a round runs after `step` (step 0: before training)."""
    return every > 0 and (step == 0 or step % every == 0 or step == last_step)


def round_metrics(rewards: Sequence[np.ndarray], parts: Sequence[np.ndarray], names: Sequence[str], n: int,
                  threshold: float) -> dict[str, float]:
    """`eval/*` metrics of one round from each scored group's rewards [n] and per-function values [F, n]."""
    if not rewards:
        return {}
    all_rewards = np.concatenate(rewards)
    passes = [int((r >= threshold).sum()) for r in rewards]
    out = {"eval/reward_mean": float(all_rewards.mean()),
           "eval/pass@1": float(np.mean([pass_at_k(n, c, 1) for c in passes]))}
    if n > 1:
        out[f"eval/pass@{n}"] = float(np.mean([pass_at_k(n, c, n) for c in passes]))
    stacked = np.concatenate(parts, axis=1)  # [F, groups * n]
    if len(names) > 1:
        out.update({f"eval/reward/{name}": float(stacked[i].mean()) for i, name in enumerate(names)})
    return out


def eval_row(step: int, version: int, metrics: dict[str, Any], groups: int, failed: int, refused: int,
             seconds: float) -> dict[str, Any]:
    """The metrics.jsonl row of one round (keys under eval/, beside the step and the version used)."""
    return {"step": step, "version": version, **metrics, "eval/groups": groups, "eval/failed": failed,
            "eval/prompts_refused": refused, "eval/seconds": seconds}


class Evaluator:
    """The eval loop: rounds requested by the training loop, sampled, scored and logged."""

    def __init__(self, items: Sequence[Any], *, cfg: EvalConfig, sampling: SamplingConfig, seed: int,
                 builder: PromptBuilder, generator: Generator, versions: Versions, pins: VersionPins,
                 scoring: Scoring, outcomes: Outcomes, write_row: Callable[[dict[str, Any]], None],
                 batch: int, done: set[int], rows: list[dict[str, Any]]) -> None:
        self.items = list(items)
        self.cfg = cfg
        self.sampling = sampling
        self.seed = seed
        self.builder = builder
        self.generator = generator
        self.versions = versions
        self.pins = pins
        self.scoring = scoring  # the training groups' rewards: reward functions and/or an environment's
        self.outcomes = outcomes
        self._write_row = write_row  # metrics.jsonl and the trackers
        self.batch = batch  # groups per engine call: batch_groups where engines have generate_many, else 1
        self.done = done  # rounds whose rows are in the RolloutLog
        self.rows = rows  # one per round: the earlier sessions' kept ones, then this session's
        self._due: asyncio.Queue[int] = asyncio.Queue()  # steps whose policy is to be evaluated
        self._queued: set[int] = set()
        self._prompts: list[Prompt | None] | None = None  # the items as Prompts, converted once

    def request(self, step: int) -> None:
        """Queue a round of the policy of `step` (once per step)."""
        if step not in self._queued and step not in self.done:
            self._queued.add(step)
            self._due.put_nowait(step)

    async def join(self) -> None:
        """Until every requested round is done."""
        await self._due.join()

    async def eval_loop(self) -> None:
        """Consumes steps to evaluate; produces eval rows (metrics.jsonl, trackers) and eval groups
        (rollouts.zarr, fate "eval"); waits on the step's version being served, then on the engines.

        A round samples at the serving version once it is the step's (or, if engines could not load
        that one, at the one they serve); it shares the engines with training groups, never the buffer.
        """
        while True:
            step = await self._due.get()
            try:
                await self.versions.wait_serving(step)
                await self._round(step)
            finally:
                self._due.task_done()

    def _prompt_list(self) -> list[Prompt | None]:
        """The eval prompts (None where one is refused), converted once; ConfigError if all are refused."""
        if self._prompts is None:
            prompts: list[Prompt | None] = []
            reasons: Counter[str] = Counter()
            for item in self.items:
                try:
                    prompts.append(self.builder.build(item))
                except PromptError as e:
                    prompts.append(None)
                    if not reasons[e.reason]:
                        log.warning("eval_prompt_refused", reason=e.reason, error=str(e))
                    reasons[e.reason] += 1
            if not any(p is not None for p in prompts):
                raise ConfigError(f"every one of the {len(prompts)} eval prompts was refused "
                                  f"({', '.join(f'{r}: {n}' for r, n in reasons.items())}); see events.jsonl")
            self._prompts = prompts
        return self._prompts

    async def _round(self, step: int) -> None:
        """One evaluation of the serving policy: every eval prompt sampled eval.n times, scored, logged."""
        cfg, sampling = self.cfg, self.sampling
        t0 = time.monotonic()
        prompts = self._prompt_list()
        base = self.seed * 1_000_003
        requests = [GroupRequest(eval_group_id(step, i), p, cfg.n, sampling.max_new_tokens,
                                 (base + eval_group_id(step, i)) % 2**31 if sampling.per_request_seed else None)
                    for i, p in enumerate(prompts) if p is not None]
        version = await self.pins.pin(lambda: self.versions.served)
        try:
            results = await self.generator.generate_eval(requests, self.versions.adapters[version], self.batch)
        finally:
            await self.pins.unpin(version)
        gens = [r for r in results if isinstance(r, Generation)]
        scores = await self.scoring.score(gens)
        by_id = {g.request.group_id: s for g, s in zip(gens, scores)}
        now = time.monotonic()
        outcomes, rewards, parts = [], [], []
        for request, r in zip(requests, results):
            scored = by_id.get(request.group_id)
            if not isinstance(r, Generation):
                log.warning("eval_group_failed", step=step, group_id=request.group_id, error=repr(r))
                outcomes.append(GroupOutcome(request.group_id, request.prompt, version, "eval", "generation_error",
                                             step, None, None, t0, now))
            elif not isinstance(scored, tuple):  # a RewardError
                log.warning("eval_group_failed", step=step, group_id=request.group_id, error=str(scored))
                outcomes.append(GroupOutcome(request.group_id, r.request.prompt, version, "eval", "reward_error",
                                             step, r, None, t0, now))
            else:  # r.request.prompt: an episode group's prompt is its first observation, known once generated
                rewards.append(scored[0])
                parts.append(scored[1])
                outcomes.append(GroupOutcome(request.group_id, r.request.prompt, version, "eval", "", step, r,
                                             scored[0], t0, now))
        # one moment on the loop: the round's rows and its metrics row appear together, or neither does
        self.outcomes.record_eval(outcomes)
        metrics = round_metrics(rewards, parts, self.scoring.names, cfg.n, cfg.pass_threshold)
        row = eval_row(step, version, metrics, len(rewards), len(requests) - len(rewards),
                       len(prompts) - len(requests), time.monotonic() - t0)
        self._write_row(row)
        self.rows.append(row)
        self.done.add(step)
        log.info("eval_done", step=step, version=version, groups=len(rewards), seconds=round(row["eval/seconds"], 3),
                 **{k.split("/", 1)[1]: round(v, 4) for k, v in metrics.items()})
