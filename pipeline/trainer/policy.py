"""The policy trainer: one corrected GRPO update per batch, LoRA or full weights, alone or as one of FSDP2 ranks.

`PolicyTrainer` is the one trainer. What `trainer.update` changes (which parameters train, the KL
reference, what a version publishes) is its update strategy (pipeline.trainer.update). As one of
trainer ranks it is given their collectives (pipeline.trainer.collectives; pipeline.trainer.ranks
makes them) and shards its model with pipeline.trainer.fsdp.apply_fsdp; alone, its collectives
are the no-op `Local` and the same code runs.

Invariants:
- Version t of the policy is the policy after t steps; version 0 is exactly the base model, so
  engines at version 0 sample the same policy the trainer starts from.
- `step` is synchronous and blocking: the orchestrator runs it in a worker thread, never on
  the event loop. A step is trainer.epochs passes over the batch in trainer.minibatches parts,
  one optimizer step each, and publishes one version. The proximal policy of the loss is the
  weights at the start of the step: with one optimizer step, the detached current log-probs;
  with more, log-probs computed once without grad before the first (timed: train/proximal_s),
  so decoupled PPO's clip acts from the second optimizer step on.
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
- Log-probs can be recomputed under the last `keep_versions` versions (pipeline.trainer.snapshots;
  full mode keeps at most two). A step copies the version it trains from only when its batch
  says so (`Batch.keep_version`). An older version, or one not kept, raises KeyError.
- `recompute_logprobs` gives one [T] array per completion (empty for an empty one), over every
  completion token, environment ones too, aligned with `Completion.logprobs`; comparing it with
  the engine's is the caller's, over `Completion.sampled` positions.
- Trainer state (`save_state`/`load_state`) is trainable weights, AdamW moments keyed by
  parameter name, RNG state, counters and the update mode, as pipeline.trainer.state writes and
  checks it (safetensors + JSON, never pickle). A restored trainer's next step gives
  bit-identical weights to the original's; a state that does not fit (missing or corrupt file,
  the other update mode, other parameters, shapes or dtypes, other LoRA rank) is refused whole,
  nothing changed.
- As one of trainer ranks: every rank holds the whole batch. The rows of each optimizer step are
  split into contiguous shares, one per rank; each micro-batch's loss is weighed by its share of
  the whole step's tokens (or sequences), so the summed gradient, the loss and every train/*
  statistic equal the one-process trainer's up to float rounding. Every rank makes the same
  number of forward and backward passes (a rank whose share is used up runs one that weighs
  nothing). Log-probs computed without grad (proximal, reference, `recompute_logprobs`) are
  computed for every row on every rank. A state holds one directory per rank, each rank's own
  shards; a state that any rank refuses changes no rank.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import structlog
import torch

from pipeline.config.schema import LossConfig, TrainerConfig
from pipeline.errors import ConfigError, TrainerError
from pipeline.models.builtin import load_causal_lm, pack_sequences, token_logprobs_and_entropy
from pipeline.trainer.collectives import Collectives, Local
from pipeline.trainer.fsdp import apply_fsdp, device_mesh, like_parameter, local, value
from pipeline.trainer.loss import effective_sample_size, policy_loss
from pipeline.trainer.rows import (Rows, behaviour_logprobs, micro_batches, minibatches, padded_rows, pooled,
                                   rank_passes, rows_of)
from pipeline.trainer.snapshots import Snapshots
from pipeline.trainer.state import (Counters, SavedState, StateWriter, check_ranks_file, mark_written, rank_dir,
                                    read_state, refuse_ranks_state, write_ranks_file, write_state)
from pipeline.trainer.update import strategy_of, trainable_parameters
from pipeline.types import Batch, RolloutGroup, TrainStats

log = structlog.get_logger(__name__)


class PolicyTrainer:
    """The policy (its update strategy's trainable parameters), its optimizer, and the corrected GRPO step."""

    def __init__(self, model_path: str | Path, cfg: TrainerConfig, loss_cfg: LossConfig, *, seed: int = 0,
                 trust_remote_code: bool = False, keep_versions: int = 3, deterministic: bool = False,
                 collectives: Collectives | None = None) -> None:
        """keep_versions: log-probs can be recomputed under this many recent versions (>= 1; full
        mode keeps at most two). deterministic: torch's deterministic algorithms (same batches,
        same seed: same weights). collectives: the trainer ranks this is one of (one process when None)."""
        if keep_versions < 1:
            raise ConfigError(f"keep_versions must be >= 1 (the current version), got {keep_versions}")
        self.model_path = str(model_path)
        self.strategy = strategy_of(cfg)
        self.collectives = collectives or Local(cfg.device)
        self.keep_versions = self.strategy.versions_kept(keep_versions)
        self.snapshots = Snapshots(self.keep_versions, sharded=self.collectives.sharded)
        self.cfg = cfg
        self.loss_cfg = loss_cfg
        self.seed = seed
        self.trust_remote_code = trust_remote_code
        self.deterministic = deterministic
        self.version = 0
        self.skipped_steps = 0
        self.consecutive_skips = 0  # non-finite steps in a row; the orchestrator stops the run at a limit
        self.model: torch.nn.Module | None = None
        self.reference: torch.nn.Module | None = None  # a separate KL reference (full mode, loss.kl_coef > 0)
        self.optimizer: torch.optim.Optimizer | None = None
        self.pad_id = 0
        self.writer = StateWriter()  # a checkpoint's state written behind the steps (begin_save_state)

    def setup(self) -> None:
        """Load the base model and build the policy on it, as the update strategy says (blocking)."""
        from transformers import AutoTokenizer

        if self.deterministic:
            # warn_only: an op without a deterministic kernel warns (in the log) rather than stop the run
            torch.use_deterministic_algorithms(True, warn_only=True)
        torch.manual_seed(self.seed)
        # a sharded trainer's ranks load on the CPU: apply_fsdp moves each rank's shards to its device
        device = "cpu" if self.collectives.sharded else self.cfg.device
        base = load_causal_lm(self.model_path, device, self.cfg.dtype, self.trust_remote_code)
        tok = AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=self.trust_remote_code)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        model = self.strategy.trainable(base)
        if self.strategy.separate_reference and self.loss_cfg.kl_coef > 0:
            self.reference = load_causal_lm(self.model_path, device, self.cfg.dtype, self.trust_remote_code)
            self.reference.eval().requires_grad_(False)
        model.train()
        self.model = model
        self.snapshots.clear()
        if self.collectives.sharded:
            self._shard()
        # parameters() yields a tied weight (lm_head = embed_tokens) once, so AdamW steps it once
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=self.cfg.lr, betas=tuple(self.cfg.betas),
                                           weight_decay=self.cfg.weight_decay)
        log.info("trainer_ready", device=self.cfg.device, update=self.cfg.update,
                 trainable_params=sum(p.numel() for p in params),
                 lora_rank=None if self.strategy.name == "full" else self.cfg.lora_rank)

    def _shard(self) -> None:
        """The model (and the KL reference) sharded over the ranks, before the optimizer takes the
        parameters, so that it holds (and steps) this rank's shard of every one."""
        c = self.collectives
        mesh = device_mesh(self.cfg.device, c.world_size)
        apply_fsdp(self.model, mesh, sum_gradients=True)
        if self.reference is not None:
            apply_fsdp(self.reference, mesh)
        log.info("trainer_rank_ready", rank=c.rank, world_size=c.world_size, device=self.cfg.device,
                 backend="nccl" if self.cfg.device.startswith("cuda") else "gloo",
                 shard_params=sum(local(p).numel() for p in self.model.parameters() if p.requires_grad))

    # ------------------------------------------------------------------ data

    def _rows(self, groups: Sequence[RolloutGroup], *, all_tokens: bool = False) -> Rows:
        return rows_of(groups, self.loss_cfg, all_tokens=all_tokens)

    def _micro_batches(self, rows: Sequence[int]) -> list[list[int]]:
        return micro_batches(rows, self.cfg.micro_batch_sequences)

    def _minibatches(self, n: int, step: int, epoch: int) -> list[list[int]]:
        return minibatches(n, self.cfg.minibatches, self.seed, step, epoch)

    def _forward(self, rows: Rows, idx: Sequence[int], *, entropy: bool = False,
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
    def _fixed_logprobs(self, rows: Rows, reference: bool) -> list[torch.Tensor]:
        """Per row, the log-probs [prompt + completion] under the weights at the start of the step
        (the proximal policy) or, with `reference`, under the reference policy: computed once, no grad."""
        out: list[torch.Tensor] = []
        with contextlib.ExitStack() as stack:
            model = self.model
            if reference:
                model = stack.enter_context(self.strategy.reference(self.model, self.reference))
            for idx in self._micro_batches(range(len(rows.comps))):
                lp, _, _ = self._forward(rows, idx, model=model)
                out.extend(lp[i, :len(rows.prompts[r]) + len(rows.comps[r])].detach() for i, r in enumerate(idx))
        return out

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
        acc, weights = pooled(self.collectives.gather((acc, weights)))
        if skipped:
            self.skipped_steps += 1
            self.consecutive_skips += 1
            log.warning("train_step_skipped", step=batch.step, loss=losses[-1], grad_norm=norms[-1],
                        optimizer_steps_taken=len(losses) - 1, consecutive_skips=self.consecutive_skips)
        else:
            self.consecutive_skips = 0
        self.version += 1
        self.snapshots.prune(self.version)
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
        stats = TrainStats(step=batch.step, version=self.version, metrics=metrics, t_start=t0, t_end=time.monotonic())
        if self.collectives.sharded:  # the slowest rank's step, which every rank waited for
            stats.metrics["train/rank_step_max_s"] = self.collectives.max([time.monotonic() - t0])[0]
        return stats

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

    def _clip_gradients(self) -> float:
        """The gradient norm, before clipping it to trainer.grad_clip (when on)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.cfg.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        return value(norm)

    def _backward(self, rows: Rows, part: list[int], advs: torch.Tensor, prox: list[torch.Tensor] | None,
                  ref: list[torch.Tensor] | None, acc: dict[str, float], weights: list[float] | None, *,
                  entropy: bool, share: float) -> float:
        """Forward and backward over the rows `part` (one optimizer step's; this rank's share of
        them), in micro-batches whose losses are weighed so their sum over the ranks is the loss of
        the whole part; returns that loss, the same on every rank (so all take the same decision on
        a non-finite one), the gradients left in place. Statistics go into `acc` (each optimizer
        step's weighed by `share` of the step), the importance-weight sums into `weights` when given."""
        part_tokens = rows.sampled_tokens(part)  # what token_mean averages over: sampled tokens only
        all_tokens = rows.sampled_tokens() if entropy else 0  # the entropy's mean is over the whole batch
        loss_total = 0.0
        c = self.collectives
        passes = rank_passes(part, self.cfg.micro_batch_sequences, c.rank, c.world_size)
        for i, idx in enumerate(passes):
            if c.sharded and not self.strategy.reduce_every_pass:
                self.model.set_requires_gradient_sync(i == len(passes) - 1)
            if not idx:  # this rank's share is used up: a pass that weighs nothing, to meet the others' collectives
                lp, _, _ = self._forward(rows, part[:1])
                (lp.sum() * 0.0).backward()
                continue
            lp, cmask, ent = self._forward(rows, idx, entropy=entropy)
            beh = behaviour_logprobs(rows, idx, lp)
            loss, stats = policy_loss(
                lp, beh, advs[idx].to(lp.device), cmask, self.loss_cfg,
                proximal_logprobs=None if prox is None else padded_rows(prox, idx, lp),
                reference_logprobs=None if ref is None else padded_rows(ref, idx, lp),
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
        return c.sum([loss_total])[0]

    # ------------------------------------------------------------------ versions

    def _trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return trainable_parameters(self.model)

    def _keep_current_version(self) -> None:
        """Copy the current version's trainable weights to the CPU before a step changes them."""
        self.snapshots.take(self.version, self._trainable())

    def kept_versions(self) -> list[int]:
        """The versions `recompute_logprobs` can use: the older ones kept, and the current one."""
        return self.snapshots.versions(self.version)

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
                with self.snapshots.weights_of(version, self.version, self._trainable()):
                    for part in self._micro_batches(range(len(rows.comps))):
                        lp, _, _ = self._forward(rows, part)
                        for i, r in enumerate(part):
                            (gi, ci), start = rows.owner[r], len(rows.prompts[r])
                            out[idx[gi]][ci] = lp[i, start:start + len(rows.comps[r])].float().cpu().numpy()
        finally:
            self.model.train(was_training)
        return out

    def save_adapter(self, directory: Path) -> None:
        """Write the current version into the existing `directory` (blocking), as the update
        strategy publishes it (pipeline.trainer.update); of trainer ranks, rank 0 writes."""
        assert self.model is not None, "call setup() first"
        self.strategy.publish(self.model, Path(directory), self.collectives)

    def share_weights(self, keep_from: int) -> dict[str, Any]:
        """The current version handed over in memory (trainer.publish = "memory"), as plain data:
        the strategy's `share` (LoRA: the adapter's tensors and config; full weights: a GPU buffer
        kept until `keep_from`, the oldest version an engine may still load, passes its version)."""
        assert self.model is not None, "call setup() first"
        if self.collectives.sharded:
            raise TrainerError('trainer.publish = "memory" needs one trainer process, not trainer ranks')
        return self.strategy.share(self.model, self.version, keep_from)

    # ------------------------------------------------------------------ state (checkpoint and resume)

    def save_state(self, directory: Path) -> dict[str, str]:
        """Write everything the next step depends on into the existing `directory` (blocking, fsynced):
        the files pipeline.trainer.state describes (trainer ranks: each rank its directory, then
        rank 0 ranks.json once every rank has written). Returns the sha256 of each file written
        into `directory` itself (none for trainer ranks)."""
        self.writer.join()  # a state written behind the steps is complete first
        c = self.collectives
        here = self._state_dir(Path(directory))
        if c.sharded:
            here.mkdir(exist_ok=True)
        extra = {"rank": c.rank, "world_size": c.world_size} if c.sharded else {}
        digests = write_state(here, self.cfg, *self._state(), extra=extra)
        log.debug("trainer_state_saved", path=str(here), version=self.version, update=self.cfg.update)
        if not c.sharded:
            return digests
        c.barrier()
        if c.rank == 0:
            write_ranks_file(Path(directory), c.devices)
        return {}

    def begin_save_state(self, directory: Path) -> None:
        """`save_state` behind the steps: the state is copied to host memory now and a thread writes it
        while later calls run, then puts STATE_WRITTEN (pipeline.trainer.state.StateWriter). Trainer
        ranks write at once (each rank's write ends at a barrier), then rank 0 puts the marker."""
        if self.collectives.sharded:
            self.save_state(directory)
            if self.collectives.rank == 0:
                mark_written(Path(directory), {"error": None, "sha256": {}})
        else:
            self.writer.begin(Path(directory), self.cfg, *self._state())

    def _state(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, dict[str, torch.Tensor]], Counters]:
        """This rank's trainable weights by name, their AdamW moments and the counters."""
        assert self.model is not None and self.optimizer is not None, "call setup() first"
        trainable = self._trainable()
        moments = {n: {k: local(v) for k, v in self.optimizer.state.get(p, {}).items()} for n, p in trainable}
        counters = Counters(self.version, self.skipped_steps, self.consecutive_skips)
        return [(n, local(p)) for n, p in trainable], moments, counters

    def load_state(self, directory: Path) -> None:
        """Restore a state written by `save_state` (after `setup()`; blocking).

        Everything is checked before anything changes (pipeline.trainer.state.read_state): a state
        that does not fit this trainer raises TrainerError naming the file or parameter; of trainer
        ranks, every rank checks its own first and none loads unless all accept.
        Afterwards only the restored version can be recomputed (the older copies are gone).
        """
        assert self.model is not None and self.optimizer is not None, "call setup() first"
        directory = Path(directory)
        c = self.collectives
        if not c.sharded:
            refuse_ranks_state(directory)
            saved = self._read_state(directory)
        else:
            error = None
            try:
                check_ranks_file(directory, c.world_size)
                saved = self._read_state(self._state_dir(directory))
            except TrainerError as e:
                error = str(e)
            refused = [(r, e) for r, e in enumerate(c.gather(error)) if e is not None]
            if refused:
                rank, why = refused[0]
                raise TrainerError(f"trainer rank {rank} ({c.devices[rank]}) refused the state, so no rank "
                                   f"loaded it: {why}")
        self._apply_state(saved, self._state_dir(directory))

    def _state_dir(self, directory: Path) -> Path:
        """Where this trainer's part of a state in `directory` is: all of it, or this rank's directory."""
        return rank_dir(directory, self.collectives.rank) if self.collectives.sharded else directory

    def _read_state(self, directory: Path) -> SavedState:
        """The state in `directory`, checked against this trainer (TrainerError when it does not fit)."""
        return read_state(directory, self.cfg, {n: local(p) for n, p in self._trainable()})

    def _apply_state(self, saved: SavedState, directory: Path) -> None:
        """Put a state read by `_read_state` in place: weights, AdamW moments, RNG, counters."""
        trainable = dict(self._trainable())
        with torch.no_grad():
            for n, p in trainable.items():
                view = local(p)
                view.copy_(saved.weights[n].to(view.device))
        index = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        sd = self.optimizer.state_dict()
        sd["state"] = {index[id(trainable[n])]: {k: v if k == "step" else like_parameter(trainable[n], v)
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
        self.snapshots.clear()
        log.info("trainer_state_loaded", path=str(directory), version=self.version, update=self.cfg.update)

    def close(self) -> None:
        """Nothing to release beyond memory (the process-based trainer stops its child here)."""

