"""The trainer: one policy update per batch on its own device, published as a LoRA adapter or full weights.

Two update modes (`trainer.update`), one step:
- "lora": a peft LoRA adapter on the frozen base model; only the adapter trains (in float32
  whatever the base dtype) and each version is published as an adapter directory.
- "full": every weight of the model trains, in `trainer.dtype` (float32 by default; bfloat16
  halves the memory but AdamW on bf16 weights and moments loses small updates to rounding), and
  each version is published as a whole model directory (what `save_pretrained` writes).

Invariants:
- Version t of the policy is the policy after t steps; version 0 is exactly the base model
  (LoRA B starts at zero; full mode starts from the loaded weights), so engines at version 0
  sample the same policy the trainer starts from.
- `step` is synchronous and blocking: the orchestrator runs it in a worker thread, never on
  the event loop. A step is trainer.epochs passes over the batch in trainer.minibatches parts,
  one optimizer step each, and publishes one version. The proximal policy of the loss is the
  weights at the start of the step: with one optimizer step, the detached current log-probs;
  with more, log-probs computed once without grad before the first (timed: train/proximal_s),
  so decoupled PPO's clip acts from the second optimizer step on. The KL reference (loss.kl_coef)
  is the base model with the LoRA adapter disabled, or in full mode a frozen copy loaded once.
- An optimizer step whose loss or gradient norm is not finite changes no weight and ends its
  step, which counts as skipped (the earlier optimizer steps of that step stand).
- train/ess is the effective sample size of the whole batch's importance weights, not a mean
  over micro-batches; train/entropy is the mean entropy of the policy's next-token distribution
  at the sampled tokens, at the start of the step.
- Only tokens the policy sampled (`Completion.sampled`) are weighed: the loss, its gradient, the
  train/* ratio and weight statistics, the token counts and the micro-batch weights. Environment
  tokens of a multi-turn episode are context of the forward pass and nothing else: their
  behaviour log-probs are never read and the logits that predict them get no gradient. A
  completion with no sampled token is left out. Single turns (mask None) weigh every token.
- Published versions are safetensors + JSON only: adapter_config.json + adapter_model.safetensors
  (peft's save_pretrained) for LoRA; config.json (+ generation_config.json) + model.safetensors,
  or model-*-of-*.safetensors with model.safetensors.index.json, for full weights. Full-weight
  tensors carry the base model's Hugging Face names (what `from_pretrained` and vLLM's weight
  loader read); tied embeddings stay tied and are written once, as the base model writes them.
- Log-probs can be recomputed under the last `keep_versions` versions (the current weights plus
  CPU copies of older ones); in full mode a copy is the whole model, so at most the current and
  the previous version are kept. A step copies the version it trains from only when its batch
  says so (`Batch.keep_version`: the orchestrator asks when a log-prob check may look back at
  it). An older version, or one not kept, raises KeyError.
- `recompute_logprobs` gives one [T] array per completion (empty for an empty one), over every
  completion token, environment ones too, aligned with `Completion.logprobs`; comparing it with
  the engine's is the caller's, over `Completion.sampled` positions.
- Trainer state (`save_state`/`load_state`) is trainable weights, AdamW moments keyed by
  parameter name, RNG state, counters and the update mode, as pipeline.trainer.state writes and
  checks it (safetensors + JSON, never pickle). A restored trainer's next step gives
  bit-identical weights to the original's; a state that does not fit (missing or corrupt file,
  the other update mode, other parameters, shapes or dtypes, other LoRA rank) is refused whole,
  nothing changed.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import structlog
import torch

from pipeline.config.schema import LossConfig, TrainerConfig
from pipeline.errors import ConfigError, TrainerError
from pipeline.trainer.loss import effective_sample_size, group_advantages, policy_loss
from pipeline.models.builtin import (building_modules, load_causal_lm, pack_sequences, quiet_progress,
                             token_logprobs_and_entropy)
from pipeline.trainer.state import (UPDATE_MODES, Counters, read_simulated_state, read_state, write_simulated_state,
                                    write_state)
from pipeline.types import Batch, RolloutGroup, TrainStats

log = structlog.get_logger(__name__)

FULL_KEEP_VERSIONS = 2  # full mode: the current version and the previous one (a CPU copy of the whole model)


@dataclass(slots=True)
class _Rows:
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


class LoRATrainer:
    """The policy (a peft LoRA adapter, or with `cfg.update == "full"` every weight), its optimizer,
    and the corrected GRPO step. The name predates full-weight updates; both modes live here
    because they share everything but which parameters train and what a version directory holds.
    """

    def __init__(self, model_path: str | Path, cfg: TrainerConfig, loss_cfg: LossConfig, *, seed: int = 0,
                 trust_remote_code: bool = False, keep_versions: int = 3, deterministic: bool = False) -> None:
        """keep_versions: log-probs can be recomputed under this many recent versions (>= 1);
        full mode keeps at most FULL_KEEP_VERSIONS, since each older one is a whole-model copy.
        deterministic: torch's deterministic algorithms (same batches, same seed: same weights)."""
        if keep_versions < 1:
            raise ConfigError(f"keep_versions must be >= 1 (the current version), got {keep_versions}")
        self.model_path = str(model_path)
        self.full = cfg.update == "full"
        self.keep_versions = min(keep_versions, FULL_KEEP_VERSIONS) if self.full else keep_versions
        self._snapshots: dict[int, dict[str, torch.Tensor]] = {}  # older versions' trainable weights, on the CPU
        self.cfg = cfg
        self.loss_cfg = loss_cfg
        self.seed = seed
        self.trust_remote_code = trust_remote_code
        self.deterministic = deterministic
        self.version = 0
        self.skipped_steps = 0
        self.consecutive_skips = 0  # non-finite steps in a row; the orchestrator stops the run at a limit
        self.model: torch.nn.Module | None = None
        self.reference: torch.nn.Module | None = None  # full mode with loss.kl_coef > 0: the frozen base
        self._layout: tuple[dict[str, str], bytes] | None = None  # LoRA: saved tensor -> parameter name, config
        self.optimizer: torch.optim.Optimizer | None = None
        self.pad_id = 0

    def setup(self) -> None:
        """Load the base model; wrap it with a fresh LoRA adapter, or make every weight trainable (blocking)."""
        from transformers import AutoTokenizer

        if self.deterministic:
            # warn_only: an op without a deterministic kernel warns (in the log) rather than stop the run
            torch.use_deterministic_algorithms(True, warn_only=True)
        torch.manual_seed(self.seed)
        device = self._load_device()
        base = load_causal_lm(self.model_path, device, self.cfg.dtype, self.trust_remote_code)
        tok = AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=self.trust_remote_code)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        model = self._full_model(base) if self.full else self._lora_model(base)
        if self.full and self.loss_cfg.kl_coef > 0:  # LoRA's reference is the base with the adapter off: free
            self.reference = load_causal_lm(self.model_path, device, self.cfg.dtype, self.trust_remote_code)
            self.reference.eval().requires_grad_(False)
        model.train()
        self.model = model
        self._snapshots = {}
        self._layout = None
        self._place()
        # parameters() yields a tied weight (lm_head = embed_tokens) once, so AdamW steps it once
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=self.cfg.lr, betas=tuple(self.cfg.betas),
                                           weight_decay=self.cfg.weight_decay)
        log.info("trainer_ready", device=self.cfg.device, update=self.cfg.update,
                 trainable_params=sum(p.numel() for p in params),
                 lora_rank=None if self.full else self.cfg.lora_rank)

    # a sharded trainer's ranks load on the CPU and then shard onto their devices (pipeline.trainer.fsdp)
    def _load_device(self) -> str:
        """Where setup loads the model: the trainer's device."""
        return self.cfg.device

    def _place(self) -> None:
        """The model (and the KL reference) as built, before the optimizer takes its parameters:
        already in place here."""

    @staticmethod
    def _full_model(base: torch.nn.Module) -> torch.nn.Module:
        """Every weight trains, in the dtype it was loaded in (trainer.dtype)."""
        for p in base.parameters():
            p.requires_grad_(True)
        return base

    def _lora_model(self, base: torch.nn.Module) -> torch.nn.Module:
        """A fresh peft LoRA adapter on the frozen base; the adapter trains in float32."""
        from peft import LoraConfig, get_peft_model

        targets = self.cfg.target_modules
        lcfg = LoraConfig(
            r=self.cfg.lora_rank, lora_alpha=self.cfg.lora_alpha, lora_dropout=self.cfg.lora_dropout,
            target_modules="all-linear" if targets == ("all-linear",) else list(targets),
            bias="none", task_type="CAUSAL_LM",
        )
        with building_modules():
            model = get_peft_model(base, lcfg)
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.data = p.data.float()  # LoRA weights train in float32 whatever the base dtype
        return model

    # ------------------------------------------------------------------ data

    def _rows(self, groups: Sequence[RolloutGroup], *, all_tokens: bool = False) -> _Rows:
        """Flatten groups into rows, one per completion with a token to weigh.

        A completion without a sampled token (empty, or environment tokens only) is left out, as
        nothing in it may carry gradient; with `all_tokens` (recomputing log-probs) only empty
        ones are.
        """
        rewards = [torch.as_tensor(g.rewards, dtype=torch.float32) for g in groups]
        rows = _Rows()
        for gi, (g, r) in enumerate(zip(groups, rewards)):
            a = group_advantages(r[None, :], scale=self.loss_cfg.scale_rewards, std=self.loss_cfg.std)[0]
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

    def _micro_batches(self, rows: Sequence[int]) -> list[list[int]]:
        """`rows` (indices into a _Rows) in forward/backward passes of micro_batch_sequences each."""
        m = self.cfg.micro_batch_sequences
        return [list(rows[i:i + m]) for i in range(0, len(rows), m)]

    def _passes(self, part: list[int]) -> list[list[int]]:
        """The forward/backward passes of one optimizer step's rows that this trainer computes: all
        of them here; a rank of a sharded trainer takes its share (pipeline.trainer.fsdp)."""
        return self._micro_batches(part)

    def _before_pass(self, last: bool) -> None:
        """Before each forward/backward of an optimizer step (a sharded trainer reduces gradients
        over its ranks after the last only)."""

    def _empty_pass(self, rows: _Rows, part: list[int]) -> None:
        raise AssertionError("only a sharded trainer has passes without rows")

    def _forward(self, rows: _Rows, idx: Sequence[int], *, entropy: bool = False,
                 model: torch.nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Log-probs of the rows `idx` under the current weights (or `model`), over every token
        (environment tokens are context): ([n, L] log-probs, [n, L] mask of the sampled
        completion tokens, [n, L] entropy of each next-token distribution or None)."""
        ids, attn, cmask = pack_sequences([rows.prompts[i] for i in idx], [rows.comps[i] for i in idx], self.pad_id,
                                          [rows.sampled[i] for i in idx])
        dev = self.cfg.device
        lp, ent = token_logprobs_and_entropy(model or self.model, ids.to(dev), attn.to(dev), entropy=entropy)
        return lp, cmask.to(dev), ent

    @torch.no_grad()
    def _fixed_logprobs(self, rows: _Rows, reference: bool) -> list[torch.Tensor]:
        """Per row, the log-probs [prompt + completion] under the weights at the start of the step
        (the proximal policy) or, with `reference`, under the reference policy: computed once, no grad."""
        out: list[torch.Tensor] = []
        with contextlib.ExitStack() as stack:
            model = self.model
            if reference and self.reference is not None:
                model = self.reference
            elif reference:
                stack.enter_context(self.model.disable_adapter())  # peft: the base model, adapter off
            for idx in self._micro_batches(range(len(rows.comps))):
                lp, _, _ = self._forward(rows, idx, model=model)
                out.extend(lp[i, :len(rows.prompts[r]) + len(rows.comps[r])].detach() for i, r in enumerate(idx))
        return out

    @staticmethod
    def _padded(values: list[torch.Tensor], idx: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        """values[r] for r in idx, right-padded with 0 into the [n, L] layout of `like`."""
        out = torch.zeros_like(like)
        for i, r in enumerate(idx):
            out[i, :len(values[r])] = values[r].to(out.device)
        return out

    def _behaviour(self, rows: _Rows, idx: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        """The engine's log-probs of rows `idx` where it sampled, in the [n, L] layout of `like`;
        its 0 on environment tokens lies outside the completion mask."""
        beh = torch.zeros_like(like)
        for i, r in enumerate(idx):
            start = len(rows.prompts[r])
            beh[i, start:start + len(rows.behaviour[r])] = torch.as_tensor(rows.behaviour[r], device=like.device)
        return beh

    def _minibatches(self, n: int, step: int, epoch: int) -> list[list[int]]:
        """The rows of one epoch in trainer.minibatches parts; shuffled per (seed, step, epoch) when
        there is more than one part, so every epoch splits the batch differently but repeatably."""
        parts = min(self.cfg.minibatches, n) or 1
        order = list(range(n))
        if parts > 1:
            order = np.random.default_rng([self.seed, step, epoch]).permutation(n).tolist()
        return [order[i * n // parts:(i + 1) * n // parts] for i in range(parts)]

    # ------------------------------------------------------------------ step

    def step(self, batch: Batch) -> TrainStats:
        """One corrected GRPO step on a batch: trainer.epochs x trainer.minibatches optimizer steps,
        then the version counts up by one. Returns the stats of the step (blocking).

        With more than one optimizer step the proximal log-probs (the weights at the start of the
        step) are computed once, without grad, before the first; with one they are the detached
        current log-probs, the same values. The reference log-probs (loss.kl_coef > 0) likewise.
        An optimizer step whose loss or gradient norm is not finite changes no weight and ends the
        step (its later optimizer steps are not taken); the step then counts as skipped.
        """
        assert self.model is not None and self.optimizer is not None, "call setup() first"
        t0 = time.monotonic()
        rows = self._rows(batch.groups)
        n = len(rows.comps)
        if batch.keep_version:  # before any optimizer step changes the weights
            self._keep_current_version()
        updates = self.cfg.epochs * self.cfg.minibatches
        metrics: dict[str, float] = {}
        prox = ref = None
        if updates > 1 and self.loss_cfg.correction != "none":
            t = time.monotonic()
            prox = self._fixed_logprobs(rows, reference=False)
            metrics["train/proximal_s"] = time.monotonic() - t
        if self.loss_cfg.kl_coef > 0:
            t = time.monotonic()
            ref = self._fixed_logprobs(rows, reference=True)
            metrics["train/reference_s"] = time.monotonic() - t
        advs = torch.tensor(rows.advantages, dtype=torch.float32)
        acc: dict[str, float] = {}
        weights = [0.0, 0.0, 0.0]  # the importance weights of the batch, once: sum, sum of squares, tokens
        losses: list[float] = []
        norms: list[float] = []
        skipped = False
        for epoch in range(self.cfg.epochs):
            for part in self._minibatches(n, batch.step, epoch):
                loss = self._backward(rows, part, advs, prox, ref, acc, weights if epoch == 0 else None,
                                      entropy=epoch == 0, share=1 / updates)
                grad_norm = self._clip_gradients()
                losses.append(loss)
                norms.append(grad_norm)
                if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                    skipped = True
                    break
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            if skipped:
                break
        self.optimizer.zero_grad(set_to_none=True)
        self._pool_stats(acc, weights)
        if skipped:
            self.skipped_steps += 1
            self.consecutive_skips += 1
            log.warning("train_step_skipped", step=batch.step, loss=losses[-1], grad_norm=norms[-1],
                        optimizer_steps_taken=len(losses) - 1, consecutive_skips=self.consecutive_skips)
        else:
            self.consecutive_skips = 0
        self.version += 1
        for v in [v for v in self._snapshots if v <= self.version - self.keep_versions]:
            del self._snapshots[v]
        rewards = np.concatenate([g.rewards for g in batch.groups]) if batch.groups else np.zeros(0)
        ratio_max = acc.pop("ratio_max", 0.0)
        metrics.update({f"train/{k}": v for k, v in acc.items()})
        metrics.update({
            "train/loss": float(np.mean(losses)) if losses else 0.0,
            "train/grad_norm": float(np.mean(norms)) if norms else 0.0, "train/ratio_max": ratio_max,
            "train/ess": effective_sample_size(weights[0], weights[1], weights[2]),
            "train/optimizer_steps": float(len(losses) - skipped), "train/skipped": float(skipped),
            "train/sequences": float(n), "train/lr": self.cfg.lr,
            "train/reward_mean": float(rewards.mean()) if rewards.size else float("nan"),
        })
        return TrainStats(step=batch.step, version=self.version, metrics=metrics, t_start=t0, t_end=time.monotonic())

    def loss_gradients(self, batch: Batch) -> tuple[float, dict[str, torch.Tensor]]:
        """The loss of `batch` and its gradient for every trainable parameter, as the step's first
        optimizer step sees them (before clipping), without changing any weight (blocking)."""
        assert self.model is not None and self.optimizer is not None, "call setup() first"
        rows = self._rows(batch.groups)
        ref = self._fixed_logprobs(rows, reference=True) if self.loss_cfg.kl_coef > 0 else None
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._backward(rows, list(range(len(rows.comps))), torch.tensor(rows.advantages, dtype=torch.float32),
                              None, ref, {}, None, entropy=False, share=1.0)
        grads = {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                 for n, p in self._trainable()}
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grads

    def _pool_stats(self, acc: dict[str, float], weights: list[float]) -> None:
        """The step's statistics and importance-weight sums over every row: here they already are;
        the ranks of a sharded trainer add theirs up (in place)."""

    def _clip_gradients(self) -> float:
        """The gradient norm, before clipping it to trainer.grad_clip (when on)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.cfg.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        # sharded parameters (FSDP2) give a DTensor norm, already reduced over the ranks
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def _backward(self, rows: _Rows, part: list[int], advs: torch.Tensor, prox: list[torch.Tensor] | None,
                  ref: list[torch.Tensor] | None, acc: dict[str, float], weights: list[float] | None, *,
                  entropy: bool, share: float) -> float:
        """Forward and backward over the rows `part` (one optimizer step's), in micro-batches whose
        losses are weighed so their sum is the loss of the whole part; returns that loss, the
        gradients left in place. Statistics go into `acc` (each optimizer step's weighed by `share`
        of the step), the importance-weight sums into `weights` when given."""
        part_tokens = rows.sampled_tokens(part)  # what token_mean averages over: sampled tokens only
        all_tokens = rows.sampled_tokens() if entropy else 0  # the entropy's mean is over the whole batch
        loss_total = 0.0
        passes = self._passes(part)
        for i, idx in enumerate(passes):
            self._before_pass(last=i == len(passes) - 1)
            if not idx:  # a sharded trainer's rank with no rows left: a pass that weighs nothing
                self._empty_pass(rows, part)
                continue
            lp, cmask, ent = self._forward(rows, idx, entropy=entropy)
            beh = self._behaviour(rows, idx, lp)
            loss, stats = policy_loss(
                lp, beh, advs[idx].to(lp.device), cmask, self.loss_cfg,
                proximal_logprobs=None if prox is None else self._padded(prox, idx, lp),
                reference_logprobs=None if ref is None else self._padded(ref, idx, lp),
                norm_tokens=self.loss_cfg.norm_tokens)
            tokens = float(cmask.sum())
            # token_mean: this micro-batch's share of the part's tokens; per sequence: of its sequences
            weight = tokens / max(1, part_tokens) if self.loss_cfg.aggregation == "token_mean" else len(idx) / len(part)
            (loss * weight).backward()
            loss_total += float(loss.detach()) * weight
            if weights is not None:
                weights[0] += stats["is_weight_sum"]
                weights[1] += stats["is_weight_sq_sum"]
                weights[2] += stats["tokens"]
            if entropy and tokens:
                acc["entropy"] = acc.get("entropy", 0.0) + float(ent[cmask].double().sum()) / max(1, all_tokens)
            for k, v in stats.items():
                if k in ("ess", "is_weight_sum", "is_weight_sq_sum"):
                    continue
                if k == "ratio_max":
                    acc[k] = max(acc.get(k, 0.0), v)
                elif k in ("tokens", "masked_nonfinite"):
                    if entropy:  # counted over one pass of the batch
                        acc[k] = acc.get(k, 0.0) + v
                else:
                    acc[k] = acc.get(k, 0.0) + v * share * tokens / max(1, part_tokens)
        return loss_total

    # ------------------------------------------------------------------ other services

    def _trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def _keep_current_version(self) -> None:
        """Copy the current version's trainable weights to the CPU before a step changes them, so
        log-probs can be recomputed under it later (skipped when only the current version is kept)."""
        if self.keep_versions > 1:
            self._snapshots[self.version] = {n: self._state_view(p).detach().to("cpu", copy=True)
                                             for n, p in self._trainable()}

    def kept_versions(self) -> list[int]:
        """The versions `recompute_logprobs` can use: the older ones kept, and the current one."""
        return sorted({*self._snapshots, self.version})

    @contextlib.contextmanager
    def _weights_of(self, version: int) -> Iterator[None]:
        """Run the model with an older version's weights, then put the current ones back exactly.

        Swaps each parameter's storage rather than copying into it: the current weights stay
        where they are (no copy out and back), and a tied weight is one Parameter, swapped once.
        On a GPU the older version takes one more copy of the trainable weights while it runs
        (in full mode, one more model; the gradients, already freed, took that much in the step).
        """
        if version == self.version:
            yield
            return
        current: dict[str, torch.Tensor] = {}
        trainable = self._trainable()
        try:
            for n, p in trainable:
                current[n] = p.data
                p.data = self._snapshots[version][n].to(p.device)
            yield
        finally:
            for n, p in trainable:
                if n in current:
                    p.data = current[n]

    @torch.no_grad()
    def recompute_logprobs(self, groups: Sequence[RolloutGroup]) -> list[list[np.ndarray]]:
        """Per group and per completion, the log-probs [T] of every completion token under the
        weights of the version that sampled the group, aligned with `Completion.token_ids`.

        Environment tokens of a multi-turn episode are included (the model's log-prob of them,
        given what came before), so the arrays line up with `Completion.logprobs`; only the
        positions where `Completion.sampled` is True are comparable with the engine's (its
        log-probs elsewhere are 0), and the caller selects them. An empty completion gets an
        empty array. Used by the log-prob contract check: engine and trainer must agree on the
        same policy. Raises KeyError if a group's version is not one of `kept_versions()`.
        """
        assert self.model is not None, "call setup() first"
        kept = self.kept_versions()
        missing = {g.version for g in groups} - set(kept)
        if missing:
            raise KeyError(f"trainer keeps versions {kept}, not {sorted(missing)}")
        out: list[list[np.ndarray]] = [[np.zeros(0, dtype=np.float32)] * len(g.completions) for g in groups]
        was_training = self.model.training
        self.model.eval()
        try:
            for version in sorted({g.version for g in groups}):
                idx = [i for i, g in enumerate(groups) if g.version == version]
                rows = self._rows([groups[i] for i in idx], all_tokens=True)
                with self._weights_of(version):
                    for part in self._micro_batches(range(len(rows.comps))):
                        lp, _, _ = self._forward(rows, part)
                        for i, r in enumerate(part):
                            (gi, ci), start = rows.owner[r], len(rows.prompts[r])
                            out[idx[gi]][ci] = lp[i, start:start + len(rows.comps[r])].float().cpu().numpy()
        finally:
            self.model.train(was_training)
        return out

    def save_adapter(self, directory: Path) -> None:
        """Write the current version into the existing `directory` (blocking).

        LoRA: adapter_config.json + adapter_model.safetensors. Full: the whole model as
        `from_pretrained` and vLLM read it: config.json, generation_config.json (when the base has
        one) and model.safetensors (or shards plus model.safetensors.index.json), weights in the
        trainer's dtype under the base model's tensor names, a tied lm_head left out as HF does.
        No tokenizer: engines keep the base model's.
        """
        assert self.model is not None, "call setup() first"
        if self.full:
            # transformers >= 5 writes only safetensors (it has no safe_serialization switch left);
            # no "Writing model shards" bar in the run's log for every version
            with quiet_progress():
                self.model.save_pretrained(str(directory))
            return
        # peft's save_pretrained writes these two files and a README model card, which alone cost
        # ~16 ms of its ~23 on the tiny model: at 50-100 ms a step, a fifth of it. The same bytes
        # here: the adapter's tensors under peft's saved names, the config peft would write.
        from safetensors.torch import save_file

        names, config = self._lora_layout()
        params = dict(self._trainable())
        tensors = {key: self._whole(params[name]) for key, name in names.items()}
        if self._writes_versions:
            save_file(tensors, str(Path(directory) / "adapter_model.safetensors"), metadata={"format": "pt"})
            (Path(directory) / "adapter_config.json").write_bytes(config)

    _writes_versions = True  # a sharded trainer's ranks other than 0 gather the version and write nothing

    def _whole(self, p: torch.nn.Parameter) -> torch.Tensor:
        """A parameter's whole value (a sharded trainer gathers it from every rank)."""
        return p.detach().contiguous()

    def _lora_layout(self) -> tuple[dict[str, str], bytes]:
        """Once per setup: each saved tensor name with the name of the parameter it holds, and the
        bytes of adapter_config.json, both as peft's save_pretrained makes them (the config never changes)."""
        if self._layout is None:
            import tempfile

            from peft import get_peft_model_state_dict

            by_storage = {p.data_ptr(): n for n, p in self._trainable()}
            saved = get_peft_model_state_dict(self.model, adapter_name="default")
            missing = [k for k, t in saved.items() if t.data_ptr() not in by_storage]
            if missing:  # a tensor peft saves that is no trainable parameter: not a layout this code knows
                raise TrainerError(f"the LoRA adapter saves tensors that are not its parameters: {missing[:3]}")
            cfg = self.model.peft_config["default"]
            inference_mode, cfg.inference_mode = cfg.inference_mode, True  # as save_pretrained writes it
            if cfg.base_model_name_or_path is None:
                cfg.base_model_name_or_path = self.model.base_model.model.__dict__.get("name_or_path") or None
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    cfg.save_pretrained(tmp)
                    config = (Path(tmp) / "adapter_config.json").read_bytes()
            finally:
                cfg.inference_mode = inference_mode
            self._layout = ({k: by_storage[t.data_ptr()] for k, t in saved.items()}, config)
        return self._layout

    # ------------------------------------------------------------------ state (checkpoint and resume)

    def save_state(self, directory: Path) -> None:
        """Write everything the next step depends on into the existing `directory` (blocking, fsynced):
        the files pipeline.trainer.state describes."""
        assert self.model is not None and self.optimizer is not None, "call setup() first"
        trainable = self._trainable()
        moments = {n: {k: self._state_view(v) for k, v in self.optimizer.state.get(p, {}).items()}
                   for n, p in trainable}
        write_state(Path(directory), self.cfg, [(n, self._state_view(p)) for n, p in trainable], moments,
                    Counters(self.version, self.skipped_steps, self.consecutive_skips), extra=self._state_extra())
        log.debug("trainer_state_saved", path=str(directory), version=self.version, update=self.cfg.update)

    def load_state(self, directory: Path) -> None:
        """Restore a state written by `save_state` (after `setup()`; blocking).

        Everything is checked before anything changes (pipeline.trainer.state.read_state): a state
        that does not fit this trainer raises TrainerError naming the file or parameter.
        Afterwards only the restored version can be recomputed (the older copies are gone).
        """
        self._apply_state(self._read_state(Path(directory)), Path(directory))

    # a sharded trainer's ranks save, load and keep their own shards of each tensor (pipeline.trainer.fsdp)
    def _state_view(self, t: torch.Tensor) -> torch.Tensor:
        """What the state (and a kept older version) holds of a parameter or moment: here all of it."""
        return t

    def _as_moment(self, p: torch.nn.Parameter, t: torch.Tensor) -> torch.Tensor:
        """A saved AdamW moment as the optimizer keeps it for `p`."""
        return t

    def _state_extra(self) -> dict[str, Any]:
        """Fields of trainer.json beyond pipeline.trainer.state's own."""
        return {}

    def _read_state(self, directory: Path) -> Any:
        """The state in `directory`, checked against this trainer (TrainerError when it does not fit)."""
        assert self.model is not None and self.optimizer is not None, "call setup() first"
        ranks = directory / "ranks.json"  # pipeline.trainer.fsdp's: one directory per rank
        if ranks.is_file() and not (directory / "trainer.json").exists():
            try:
                n = json.loads(ranks.read_bytes()).get("world_size")
            except (OSError, ValueError, AttributeError):
                n = "several"
            raise TrainerError(f"{directory} was written by {n} trainer ranks (trainer.devices); this trainer is one "
                               "process: a sharded state resumes onto the same number of ranks")
        return read_state(directory, self.cfg, {n: self._state_view(p) for n, p in self._trainable()})

    def _apply_state(self, saved: Any, directory: Path) -> None:
        """Put a state read by `_read_state` in place: weights, AdamW moments, RNG, counters."""
        trainable = dict(self._trainable())
        with torch.no_grad():
            for n, p in trainable.items():
                view = self._state_view(p)
                view.copy_(saved.weights[n].to(view.device))
        index = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        sd = self.optimizer.state_dict()
        sd["state"] = {index[id(trainable[n])]: {k: v if k == "step" else self._as_moment(trainable[n], v)
                                                 for k, v in st.items()}
                       for n, st in saved.optimizer.items()}
        self.optimizer.load_state_dict(sd)  # places each moment on its parameter's device
        torch.set_rng_state(saved.rng["cpu"])
        if self.cfg.device.startswith("cuda"):
            if "cuda" in saved.rng:
                torch.cuda.set_rng_state(saved.rng["cuda"], self.cfg.device)
            else:
                log.warning("trainer_state_no_cuda_rng", path=str(directory), device=self.cfg.device)
        if saved.lr != self.cfg.lr:
            log.info("trainer_lr_changed", saved=saved.lr, now=self.cfg.lr)
        self.version = saved.counters.version
        self.skipped_steps = saved.counters.skipped_steps
        self.consecutive_skips = saved.counters.consecutive_skips
        self._snapshots = {}
        log.info("trainer_state_loaded", path=str(directory), version=self.version, update=self.cfg.update)

    def close(self) -> None:
        """Nothing to release beyond memory (the process-based trainer stops its child here)."""


class SimulatedTrainer:
    """A trainer that only waits `step_s` per step: for benchmarks of the orchestration itself.

    update: "lora" writes a minimal adapter directory, "full" a minimal model directory, so the
    adapter store and engines of either kind exercise their real publish and load paths.
    """

    def __init__(self, step_s: float = 0.0, update: str = "lora") -> None:
        if update not in UPDATE_MODES:
            raise ConfigError(f"trainer.update must be one of {', '.join(UPDATE_MODES)}, got {update!r}")
        self.step_s = step_s
        self.update = update
        self.version = 0
        self.skipped_steps = 0
        self.consecutive_skips = 0

    def setup(self) -> None:
        return None

    def step(self, batch: Batch) -> TrainStats:
        t0 = time.monotonic()
        if self.step_s > 0:
            time.sleep(self.step_s)
        self.version += 1
        rewards = np.concatenate([g.rewards for g in batch.groups]) if batch.groups else np.zeros(0)
        return TrainStats(step=batch.step, version=self.version,
                          metrics={"train/reward_mean": float(rewards.mean()) if rewards.size else float("nan")},
                          t_start=t0, t_end=time.monotonic())

    def recompute_logprobs(self, groups: Sequence[RolloutGroup]) -> list[list[np.ndarray]]:
        return [[c.logprobs for c in g.completions] for g in groups]

    def close(self) -> None:
        return None

    def save_adapter(self, directory: Path) -> None:
        """A minimal valid version directory (adapter_config.json + adapter_model.safetensors, or
        config.json + model.safetensors), so the store and engines exercise the real path."""
        from safetensors.numpy import save_file

        weights, config = ("model.safetensors", "config.json") if self.update == "full" else \
            ("adapter_model.safetensors", "adapter_config.json")
        save_file({"version": np.array([self.version], dtype=np.int64)}, str(Path(directory) / weights))
        (Path(directory) / config).write_text(json.dumps({"simulated": True, "version": self.version}))

    def save_state(self, directory: Path) -> None:
        """trainer.json with the version (and step_s), fsynced: all the state this trainer has."""
        write_simulated_state(Path(directory), self.update, self.version, self.step_s)

    def load_state(self, directory: Path) -> None:
        self.version = read_simulated_state(Path(directory), self.update)
