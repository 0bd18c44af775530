"""Scoring a group: reward functions with TRL's signature, sync or async, checked.

A reward function is `reward(prompts: list[str], completions: list[str], **kwargs) -> list[float]`
(TRL's convention): one value per completion. `prompts[i]` is the prompt of `completions[i]`;
`kwargs` holds `completion_ids` (list of token-id lists) and every extra column of the prompts,
one entry per completion. Several functions are combined as a weighted sum.

One call scores one group or, through `score_many`, every group of an engine call at once (as
TRL calls a reward with a whole batch): a group's completions are consecutive, in order. A
call over several groups that raises or returns the wrong number of values is made again one
group at a time, so only the groups it fails on fail.

Invariants: `score` returns n finite floats or raises `RewardError` naming the function and
what was wrong; `score_many` gives each group its rewards or its own RewardError. Neither lets
a reward function's exception escape as anything else.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from bisect import bisect_right
from itertools import chain
from typing import Any, Callable, Sequence

import numpy as np
import structlog

from pipeline.errors import ConfigError, FatalError, RewardError
from pipeline.threads import USER_CODE
from pipeline.types import Prompt

log = structlog.get_logger(__name__)

RewardFn = Callable[..., Any]


def _name(fn: RewardFn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _unique(names: list[str]) -> list[str]:
    """Names made distinct (`acc`, `acc_2`, ...), so each function has its own reward/<name> metric."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return out


def load_reward_function(entry: str, key: str = "reward.functions") -> RewardFn:
    """The function an entry names: "package.module:fn" (imported) or "path/to/file.py:fn" (run
    from that file, relative to the working directory). ConfigError naming the entry if it fails."""
    target, _, attr = entry.rpartition(":")
    where = f"{key} entry {entry!r}"
    is_file = target.endswith(".py") or "/" in target or os.sep in target
    try:
        if is_file:
            path = os.path.abspath(target)
            if not os.path.isfile(path):
                raise ConfigError(f"{where}: file {target!r} does not exist")
            # a name of its own per file, registered, so the module can import siblings and pickle
            name = f"_pipeline_reward_{os.path.splitext(os.path.basename(path))[0]}_" \
                   f"{hashlib.sha256(path.encode()).hexdigest()[:8]}"
            module = sys.modules.get(name)
            if module is None:
                spec = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(spec)
                folder = os.path.dirname(path)
                if folder not in sys.path:
                    sys.path.append(folder)  # after everything else: a sibling never shadows a library
                sys.modules[name] = module
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[name]
                    raise
        else:
            module = importlib.import_module(target)
    except ConfigError:
        raise
    except Exception as e:  # the user's module failed to import (missing, syntax error, its own raise): bad input
        raise ConfigError(f"{where}: importing {target!r} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"{where}: {target!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ConfigError(f"{where}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


class RewardScorer:
    """A weighted sum of reward functions, applied to one group at a time.

    Async functions are awaited on the loop; sync ones run in a daemon worker thread
    (`pipeline.threads.USER_CODE`), never on the loop itself, so one that never returns holds its
    thread only. Every call runs under `timeout_s`: one that takes longer is a RewardError for
    the groups it scores (its thread goes on, and is never waited for).
    """

    def __init__(self, fns: RewardFn | Sequence[RewardFn], weights: Sequence[float] | None = None,
                 timeout_s: float = 300.0) -> None:
        self.fns = [fns] if callable(fns) else list(fns)
        if not self.fns:
            raise ValueError("at least one reward function is needed")
        self.weights = list(weights) if weights is not None else [1.0] * len(self.fns)
        if len(self.weights) != len(self.fns):
            raise ValueError(f"{len(self.fns)} reward functions but {len(self.weights)} weights")
        self._weights = np.asarray(self.weights, dtype=np.float64)  # [F]: total = weights @ parts
        self.names = _unique([_name(fn) for fn in self.fns])
        # classified once: inspect.iscoroutinefunction is slow enough to matter per group
        self.is_async = [inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
                         for fn in self.fns]
        self.timeout_s = timeout_s
        self.batched = [True] * len(self.fns)  # False once a function proved it takes one group per call

    async def _call(self, i: int, prompts: list[str], completions: list[str], kwargs: dict) -> Any:
        if self.is_async[i]:
            return await self.fns[i](prompts, completions, **kwargs)
        call = functools.partial(self.fns[i], prompts, completions, **kwargs)
        # contextvars travel with the call (as asyncio.to_thread does): log fields stay bound; one
        # given up at the timeout is counted until it returns (pipeline.threads.MAX_ABANDONED)
        out = await USER_CODE.run(call, what=f"reward function {self.names[i]!r}")
        if inspect.isawaitable(out):
            out = await out
        return out

    async def score_many(self, prompts: Sequence[Prompt], completions: Sequence[list[str]],
                         completion_ids: Sequence[list[list[int]]]) -> list[np.ndarray | RewardError]:
        """`score` for several groups: each one's rewards [n] or its RewardError, in order."""
        out = await self.score_many_parts(prompts, completions, completion_ids)
        return [r if isinstance(r, RewardError) else r[0] for r in out]

    async def score_many_parts(self, prompts: Sequence[Prompt], completions: Sequence[list[str]],
                               completion_ids: Sequence[list[list[int]]]
                               ) -> list[tuple[np.ndarray, np.ndarray] | RewardError]:
        """Each group's (weighted rewards [n], each function's own values [F, n]) or its RewardError.

        Each function is called once for all the groups together when their prompts have the
        same extra columns (otherwise, or for one group, once per group). A batched call that
        raises or returns a wrong count is made again per group, to find the groups it fails
        on; a non-finite value fails only the group holding it.
        """
        G = len(prompts)
        keys = set(prompts[0].meta) if G else set()
        if G < 2 or not all(self.batched) or any(set(p.meta) != keys for p in prompts):
            return await self._score_each(prompts, completions, completion_ids)
        sizes = list(map(len, completions))
        texts = [p.text for p, n in zip(prompts, sizes) for _ in range(n)]
        kwargs: dict[str, Any] = {k: [p.meta[k] for p, n in zip(prompts, sizes) for _ in range(n)] for k in keys}
        kwargs["completion_ids"] = list(chain.from_iterable(completion_ids))
        flat = list(chain.from_iterable(completions))
        N = len(flat)
        ends = np.cumsum(sizes).tolist()
        bounds = list(zip([0, *ends[:-1]], ends))  # [start, stop) of each group's completions
        parts = np.zeros((len(self.fns), N), dtype=np.float64)
        errors: dict[int, RewardError] = {}
        for i in range(len(self.fns)):
            try:
                values = self._check(i, await self._invoke(i, texts, flat, kwargs), N)
            except RewardError as e:  # which groups? each alone, as `score` would have called it
                values = np.zeros(N, dtype=np.float64)
                for g, (a, b) in enumerate(bounds):
                    if g in errors:
                        continue
                    one = {k: v[a:b] for k, v in kwargs.items()}
                    try:
                        values[a:b] = self._check(i, await self._invoke(i, texts[a:b], flat[a:b], one), b - a)
                    except RewardError as ge:
                        errors[g] = ge
                if not errors:  # no group failed, alone or earlier: it takes one group at a time
                    self.batched[i] = False
                    log.warning("reward_unbatched", function=self.names[i], error=str(e),
                                hint="it failed on several groups at once but not on any one of them; "
                                     "from now on it is called once per group")
            for j in np.flatnonzero(~np.isfinite(values)).tolist():
                g = bisect_right(ends, j)
                if g not in errors:
                    errors[g] = RewardError(f"reward function {self.names[i]!r} returned a non-finite value ({values[j]})",
                                            self.names[i])
            parts[i] = values
        total = self._weights @ parts
        return [errors.get(g) or (total[a:b], parts[:, a:b]) for g, (a, b) in enumerate(bounds)]

    async def _score_each(self, prompts: Sequence[Prompt], completions: Sequence[list[str]],
                          completion_ids: Sequence[list[list[int]]]) -> list[tuple[np.ndarray, np.ndarray] | RewardError]:
        """`score_parts` per group, concurrently, as separate groups would be."""
        async def one(i: int) -> tuple[np.ndarray, np.ndarray] | RewardError:
            try:
                return await self.score_parts(prompts[i], completions[i], completion_ids[i])
            except RewardError as e:
                return e

        if len(prompts) == 1:
            return [await one(0)]
        return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))

    async def score(self, prompt: Prompt, completions: list[str], completion_ids: list[list[int]]) -> np.ndarray:
        """Rewards [n] for one group; RewardError if any function fails or returns a bad value."""
        return (await self.score_parts(prompt, completions, completion_ids))[0]

    async def score_parts(self, prompt: Prompt, completions: list[str],
                          completion_ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """(rewards [n], each function's values [F, n]) for one group; RewardError as `score`."""
        n = len(completions)
        prompts = [prompt.text] * n
        kwargs: dict[str, Any] = {k: [v] * n for k, v in prompt.meta.items()}
        kwargs["completion_ids"] = completion_ids
        parts = np.zeros((len(self.fns), n), dtype=np.float64)
        for i in range(len(self.fns)):
            values = self._check(i, await self._invoke(i, prompts, completions, kwargs), n)
            bad = values[~np.isfinite(values)]
            if bad.size:
                raise RewardError(f"reward function {self.names[i]!r} returned a non-finite value ({bad[0]})",
                                  self.names[i])
            parts[i] = values
        return self._weights @ parts, parts

    async def _invoke(self, i: int, prompts: list[str], completions: list[str], kwargs: dict) -> Any:
        """Function i's raw output; RewardError if it raised or took longer than timeout_s."""
        deadline = asyncio.timeout(self.timeout_s)
        try:
            async with deadline:
                return await self._call(i, prompts, completions, kwargs)
        except asyncio.CancelledError:
            raise
        except TimeoutError as e:
            if not deadline.expired():  # the function's own TimeoutError: its bug, like any other raise
                raise RewardError(f"reward function {self.names[i]!r} raised TimeoutError: {e}", self.names[i]) from e
            raise RewardError(f"reward function {self.names[i]!r} took longer than reward.timeout_s = "
                              f"{self.timeout_s:g} s (it runs on in its thread; its groups failed)",
                              self.names[i]) from None
        except FatalError:  # too many calls stuck for good: the run's problem, not these groups'
            raise
        except Exception as e:  # a user's reward bug fails the groups it scored, not the run
            raise RewardError(f"reward function {self.names[i]!r} raised {type(e).__name__}: {e}",
                              self.names[i]) from e

    def _check(self, i: int, out: Any, n: int) -> np.ndarray:
        """Function i's output as [n] float64 (finite or not); RewardError if it is not n numbers."""
        name = self.names[i]
        try:
            values = [float(x) for x in out]
        except (TypeError, ValueError):
            raise RewardError(f"reward function {name!r} must return a list of {n} numbers, "
                              f"got {str(out)[:80]!r}", name) from None
        if len(values) != n:
            raise RewardError(f"reward function {name!r} returned {len(values)} values for {n} completions", name)
        return np.asarray(values, dtype=np.float64)

