"""A batch as the trainer's rows: one per completion with a token to weigh, and how a step splits them.

Invariants:
- Rows are in group order, then completion order; `Rows.owner` names the completion each came from.
- A completion without a sampled token (empty, or environment tokens only) is no row, as nothing
  in it may carry gradient; with `all_tokens` (recomputing log-probs) only an empty one is left out.
- An epoch's minibatches partition its rows; with more than one they are drawn in an order
  seeded by (seed, step, epoch), so each epoch splits the batch differently but repeatably.
- `rank_passes` gives every rank the same number of passes (those past a rank's share are
  empty), because each pass of a sharded model is a collective; for one rank it is
  `micro_batches` of the whole part.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from pipeline.config.schema import LossConfig
from pipeline.trainer.loss import group_advantages
from pipeline.types import RolloutGroup


@dataclass(slots=True)
class Rows:
    """A batch flattened to rows, one per completion, in group order; each list is [N]."""

    prompts: list[list[int]] = field(default_factory=list)
    comps: list[list[int]] = field(default_factory=list)  # completion token ids (sampled and environment)
    behaviour: list[np.ndarray] = field(default_factory=list)  # [T] the engine's log-probs (0 off the mask)
    sampled: list[np.ndarray | None] = field(default_factory=list)  # Completion.mask: [T] bool, None = all sampled
    advantages: list[float] = field(default_factory=list)
    owner: list[tuple[int, int]] = field(default_factory=list)  # (group index, completion index)

    def sampled_tokens(self, rows: Sequence[int] | None = None) -> int:
        """How many tokens the policy sampled over `rows` (default: every row): the tokens a loss weighs."""
        idx = range(len(self.comps)) if rows is None else rows
        return sum(len(self.comps[r]) if self.sampled[r] is None else int(np.count_nonzero(self.sampled[r]))
                   for r in idx)


def rows_of(groups: Sequence[RolloutGroup], loss_cfg: LossConfig, *, all_tokens: bool = False) -> Rows:
    """Flatten groups into rows, with each completion's group advantage (loss.scale_rewards, loss.std)."""
    rewards = [torch.as_tensor(g.rewards, dtype=torch.float32) for g in groups]
    rows = Rows()
    for gi, (g, r) in enumerate(zip(groups, rewards)):
        a = group_advantages(r[None, :], scale=loss_cfg.scale_rewards, std=loss_cfg.std)[0]
        for ci, (c, adv) in enumerate(zip(g.completions, a.tolist())):
            if len(c.token_ids) == 0 or not (all_tokens or c.mask is None or c.mask.any()):
                continue  # nothing was sampled: no token to weigh
            rows.prompts.append(list(g.prompt.token_ids))
            rows.comps.append(c.token_ids.tolist())
            rows.behaviour.append(c.logprobs)
            rows.sampled.append(c.mask)
            rows.advantages.append(adv)
            rows.owner.append((gi, ci))
    return rows


def micro_batches(rows: Sequence[int], size: int) -> list[list[int]]:
    """`rows` (indices into a Rows) in forward/backward passes of `size` rows each."""
    return [list(rows[i:i + size]) for i in range(0, len(rows), size)]


def rank_passes(part: list[int], size: int, rank: int, world_size: int) -> list[list[int]]:
    """The passes of one optimizer step's rows `part` that `rank` computes: its contiguous share of
    them in micro-batches of `size`, then empty passes up to the most any rank makes."""
    def share(r: int) -> list[int]:
        return part[r * len(part) // world_size:(r + 1) * len(part) // world_size]

    most = max(-(-len(share(r)) // size) for r in range(world_size))
    mine = micro_batches(share(rank), size)
    return mine + [[] for _ in range(most - len(mine))]


def minibatches(n: int, parts: int, seed: int, step: int, epoch: int) -> list[list[int]]:
    """The rows of one epoch in `parts` parts (at most one per row); shuffled per (seed, step, epoch)
    when there is more than one part."""
    parts = min(parts, n) or 1
    order = list(range(n))
    if parts > 1:
        order = np.random.default_rng([seed, step, epoch]).permutation(n).tolist()
    return [order[i * n // parts:(i + 1) * n // parts] for i in range(parts)]


def padded_rows(values: list[torch.Tensor], idx: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """values[r] for r in idx, right-padded with 0 into the [n, L] layout of `like`."""
    out = torch.zeros_like(like)
    for i, r in enumerate(idx):
        out[i, :len(values[r])] = values[r].to(out.device)
    return out


def behaviour_logprobs(rows: Rows, idx: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """The engine's log-probs of rows `idx` where it sampled, in the [n, L] layout of `like`;
    its 0 on environment tokens lies outside the completion mask."""
    beh = torch.zeros_like(like)
    for i, r in enumerate(idx):
        start = len(rows.prompts[r])
        beh[i, start:start + len(rows.behaviour[r])] = torch.as_tensor(rows.behaviour[r], device=like.device)
    return beh


def pooled(every: list[tuple[dict[str, float], list[float]]]) -> tuple[dict[str, float], list[float]]:
    """The step's statistics and importance-weight sums over every rank's rows, from each rank's
    (`every`, rank order): sums, but ratio_max a maximum. One rank's are returned as they are."""
    (acc, weights), rest = every[0], every[1:]
    acc, weights = dict(acc), list(weights)
    for rank_acc, rank_weights in rest:
        for k, v in rank_acc.items():
            acc[k] = max(acc.get(k, v), v) if k == "ratio_max" else acc.get(k, 0.0) + v
        weights = [w + rw for w, rw in zip(weights, rank_weights)]
    return acc, weights
