"""Batched group decoding with a transformers model: the sampling loop, with no engine lifecycle.

`GroupDecoder.decode` samples every row of several groups (one set of weights) in one loop:
left padding, explicit position ids, a KV cache, float32 logits. It runs on the calling thread
and knows nothing of queues, adapters or event loops: the engine hands it requests and callbacks.

Invariants:
- Rows are group-contiguous and stay so as rows leave, so each group is one slice of the batch,
  sampled with that group's generator (seeded from `GroupRequest.seed`, else the shared one).
- Each sampled token's log-prob is taken under the processed distribution it was sampled from
  (temperature, top-k, top-p, min-p applied in that order); with the default sampling settings
  this is the log-softmax of the raw logits, i.e. the policy's own log-prob.
- A row ends at an end-of-sequence token (kept, with its log-prob; "stop") or after
  `max_new_tokens` tokens ("length"). Finished rows, and the rows of groups whose `cancelled`
  says so (asked between steps), leave the batch; a group is reported once, when its last row ends.
"""

from __future__ import annotations

import inspect
from typing import Callable, Sequence

import numpy as np
import torch
from transformers import DynamicCache

from pipeline.config.schema import SamplingConfig
from pipeline.types import Completion, GroupRequest


def process_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Log-probs of the distribution tokens are sampled from: logits [R, V] float32 -> [R, V].

    Tokens removed by top-k, top-p or min-p get -inf. The defaults leave log_softmax(logits).
    """
    if sampling.temperature != 1.0:
        logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens more likely than it already reach top_p (the first always stays).
        drop_sorted = (probs.cumsum(-1) - probs) > sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if sampling.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < sampling.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return logits.log_softmax(-1)


class GroupDecoder:
    """Samples groups with one loaded model (whatever weights it holds when `decode` runs)."""

    def __init__(self, model: torch.nn.Module, *, sampling: SamplingConfig, eos_ids: frozenset[int],
                 device: torch.device) -> None:
        self.model = model
        self.sampling = sampling
        self.eos_ids = eos_ids  # empty: rows always run to max_new_tokens
        self.device = device
        params = inspect.signature(type(model).forward).parameters
        # transformers >= 5.2x names the cache argument `cache` (and warns on `past_key_values`).
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._has_logits_to_keep = "logits_to_keep" in params

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 cache: DynamicCache) -> torch.Tensor:
        """Next-token logits [R, V] float32 for input_ids, attention_mask (past + new), position_ids [R, T]."""
        kwargs = {self._cache_kwarg: cache}
        if self._has_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, **kwargs)
        return out.logits[:, -1, :].float()

    def decode(self, requests: Sequence[GroupRequest], *, generator: torch.Generator,
               cancelled: Callable[[int], bool], finished: Callable[[int, tuple[Completion, ...]], None],
               sampled: Callable[[int], None], between: Callable[[], None] | None = None) -> None:
        """Sample every row of `requests` to its end (call under torch.inference_mode()).

        `cancelled(i)`: whether group i is no longer wanted; `finished(i, completions)`: group i's
        `n` completions, called as soon as its last row ends; `sampled(k)`: k more tokens sampled
        (rows of groups later cancelled included). `generator` serves groups without a seed.
        `between()`: called between two forward passes (work that must not wait for the batch's end).
        """
        dev = self.device
        pad = 0  # padding is masked everywhere: any id in the vocabulary serves
        width = max(len(r.prompt.token_ids) for r in requests)
        row_group: list[int] = []
        prompt_ids = torch.full((len(requests), width), pad, dtype=torch.long)
        prompt_mask = torch.zeros((len(requests), width), dtype=torch.long)
        for gi, r in enumerate(requests):
            ids = r.prompt.token_ids
            prompt_ids[gi, width - len(ids):] = torch.as_tensor(ids, dtype=torch.long)
            prompt_mask[gi, width - len(ids):] = 1
            row_group.extend([gi] * r.n)
        expand = torch.as_tensor(row_group, dtype=torch.long)
        input_ids = prompt_ids[expand].to(dev)  # [R, P]
        mask = prompt_mask[expand].to(dev)  # [R, P]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [R, P]; left padding shifts every row to start at 0
        generators = [torch.Generator(device=dev).manual_seed(r.seed) if r.seed is not None else generator
                      for r in requests]

        tokens: list[list[int]] = [[] for _ in row_group]
        logprobs: list[list[float]] = [[] for _ in row_group]
        reasons: list[str] = ["" for _ in row_group]
        rows_left = [r.n for r in requests]
        active = list(range(len(row_group)))  # original row index of each batch row

        cache = DynamicCache(config=self.model.config)
        logits = self._forward(input_ids, mask, positions, cache)  # [R, V]
        next_pos = positions[:, -1] + 1  # [R]
        while True:
            lp = process_logits(logits, self.sampling)  # [R, V]
            tok_ids = torch.empty(len(active), dtype=torch.long, device=dev)
            start = 0
            while start < len(active):  # one slice per group, sampled with that group's generator
                gi = row_group[active[start]]
                stop = start + 1
                while stop < len(active) and row_group[active[stop]] == gi:
                    stop += 1
                tok_ids[start:stop] = torch.multinomial(lp[start:stop].exp(), 1, generator=generators[gi]).squeeze(1)
                start = stop
            tok_lps = lp.gather(1, tok_ids.unsqueeze(1)).squeeze(1)
            sampled(len(active))

            keep: list[int] = []
            for i, (tok, tok_lp) in enumerate(zip(tok_ids.tolist(), tok_lps.tolist())):
                row = active[i]
                gi = row_group[row]
                if cancelled(gi):
                    continue
                tokens[row].append(tok)
                logprobs[row].append(tok_lp)
                if tok in self.eos_ids:
                    reasons[row] = "stop"
                elif len(tokens[row]) >= requests[gi].max_new_tokens:
                    reasons[row] = "length"
                else:
                    keep.append(i)
                    continue
                rows_left[gi] -= 1
                if rows_left[gi] == 0:
                    finished(gi, tuple(
                        Completion(token_ids=np.asarray(tokens[j], dtype=np.int64),
                                   logprobs=np.asarray(logprobs[j], dtype=np.float32), finish_reason=reasons[j])
                        for j in range(len(row_group)) if row_group[j] == gi))
            if not keep:
                return
            if len(keep) < len(active):
                sel = torch.as_tensor(keep, dtype=torch.long, device=dev)
                cache.batch_select_indices(sel)
                mask, next_pos, tok_ids = mask[sel], next_pos[sel], tok_ids[sel]
                active = [active[i] for i in keep]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            if between is not None:
                between()
            logits = self._forward(tok_ids.unsqueeze(1), mask, next_pos.unsqueeze(1), cache)
            next_pos = next_pos + 1
