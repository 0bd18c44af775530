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
  returned (`VersionPins`); in full-weight mode no engine swaps weights while a round samples.
- `pass_at_k` is the unbiased estimator of Chen et al. (2021): 1 - C(n - c, k) / C(n, k).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any, Callable, Sequence

import numpy as np


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


class VersionPins:
    """Versions that evaluation rounds are sampling with, and a gate for full-weight swaps.

    `pin` takes the serving version (waiting while a swap is under way); `unpin` releases it.
    `hold_swaps` waits until no version is pinned and keeps new pins out until `release_swaps`.
    """

    def __init__(self) -> None:
        self._count: Counter[int] = Counter()
        self._cond = asyncio.Condition()
        self._swapping = False

    async def pin(self, current: Callable[[], int]) -> int:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._swapping)
            version = current()
            self._count[version] += 1
            return version

    async def unpin(self, version: int) -> None:
        async with self._cond:
            self._count[version] -= 1
            if self._count[version] <= 0:
                del self._count[version]
            self._cond.notify_all()

    def versions(self) -> list[int]:
        return sorted(self._count)

    async def hold_swaps(self) -> None:
        async with self._cond:
            self._swapping = True
            await self._cond.wait_for(lambda: not self._count)

    async def release_swaps(self) -> None:
        async with self._cond:
            self._swapping = False
            self._cond.notify_all()


def eval_row(step: int, version: int, metrics: dict[str, Any], groups: int, failed: int, refused: int,
             seconds: float) -> dict[str, Any]:
    """The metrics.jsonl row of one round (keys under eval/, beside the step and the version used)."""
    return {"step": step, "version": version, **metrics, "eval/groups": groups, "eval/failed": failed,
            "eval/prompts_refused": refused, "eval/seconds": seconds}
