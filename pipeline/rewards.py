"""Scoring a group: reward functions with TRL's signature, sync or async, checked.

A reward function is `reward(prompts: list[str], completions: list[str], **kwargs) -> list[float]`
(TRL's convention). For one group, `prompts` repeats the prompt n times; `kwargs` holds
`completion_ids` (list of token-id lists) and every extra column of the prompt, repeated n
times. Several functions are combined as a weighted sum.

Invariant: `score_group` returns n finite floats or raises `RewardError` naming the function
and what was wrong; it never lets a reward function's exception escape as anything else.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from typing import Any, Callable, Sequence

import numpy as np

from pipeline.errors import RewardError
from pipeline.types import Prompt

RewardFn = Callable[..., Any]


def _name(fn: RewardFn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


class RewardScorer:
    """A weighted sum of reward functions, applied to one group at a time."""

    def __init__(self, fns: RewardFn | Sequence[RewardFn], weights: Sequence[float] | None = None,
                 sync_in_thread: bool = True) -> None:
        self.fns = [fns] if callable(fns) else list(fns)
        if not self.fns:
            raise ValueError("at least one reward function is needed")
        self.weights = list(weights) if weights is not None else [1.0] * len(self.fns)
        if len(self.weights) != len(self.fns):
            raise ValueError(f"{len(self.fns)} reward functions but {len(self.weights)} weights")
        self.sync_in_thread = sync_in_thread  # a blocking reward must not stall the event loop

    async def _call(self, fn: RewardFn, prompts: list[str], completions: list[str], kwargs: dict) -> Any:
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
            return await fn(prompts, completions, **kwargs)
        if self.sync_in_thread:
            out = await asyncio.to_thread(fn, prompts, completions, **kwargs)
        else:
            out = fn(prompts, completions, **kwargs)
        if inspect.isawaitable(out):
            out = await out
        return out

    async def score(self, prompt: Prompt, completions: list[str], completion_ids: list[list[int]]) -> np.ndarray:
        """Rewards [n] for one group; RewardError if any function fails or returns a bad value."""
        n = len(completions)
        prompts = [prompt.text] * n
        kwargs: dict[str, Any] = {k: [v] * n for k, v in prompt.meta.items()}
        kwargs["completion_ids"] = completion_ids
        total = np.zeros(n, dtype=np.float64)
        for fn, w in zip(self.fns, self.weights):
            name = _name(fn)
            try:
                out = await self._call(fn, prompts, completions, kwargs)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a user's reward bug fails this group, not the run
                raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
            try:
                values = [float(x) for x in out]
            except (TypeError, ValueError):
                raise RewardError(f"reward function {name!r} must return a list of {n} numbers, "
                                  f"got {str(out)[:80]!r}") from None
            if len(values) != n:
                raise RewardError(f"reward function {name!r} returned {len(values)} values for {n} completions")
            bad = [v for v in values if not math.isfinite(v)]
            if bad:
                raise RewardError(f"reward function {name!r} returned a non-finite value ({bad[0]})")
            total += w * np.asarray(values, dtype=np.float64)
        return total
