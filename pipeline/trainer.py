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
  the event loop. The proximal policy of the decoupled PPO loss is the weights at the start of
  the step; with one optimizer step per batch that is the detached current log-probs.
- A step whose loss or gradient norm is not finite changes no weight (it is skipped and counted).
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
  parameter name, RNG state, counters and the update mode, as pipeline.trainer_state writes and
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
from typing import Iterator, Sequence

import numpy as np
import structlog
import torch

from pipeline.config import LossConfig, TrainerConfig
from pipeline.errors import ConfigError
from pipeline.loss import group_advantages, policy_loss
from pipeline.models import quiet_progress, building_modules, load_causal_lm, pack_sequences, token_logprobs
from pipeline.trainer_state import (UPDATE_MODES, Counters, read_simulated_state, read_state, write_simulated_state,
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

    def sampled_tokens(self) -> int:
        """How many tokens the policy sampled, over every row (the tokens a loss weighs)."""
        return sum(len(c) if m is None else int(np.count_nonzero(m)) for c, m in zip(self.comps, self.sampled))


class LoRATrainer:
    """The policy (a peft LoRA adapter, or with `cfg.update == "full"` every weight), its optimizer,
    and the corrected GRPO step. The name predates full-weight updates; both modes live here
    because they share everything but which parameters train and what a version directory holds.
    """

    def __init__(self, model_path: str | Path, cfg: TrainerConfig, loss_cfg: LossConfig, *, seed: int = 0,
                 trust_remote_code: bool = False, keep_versions: int = 3) -> None:
        """keep_versions: log-probs can be recomputed under this many recent versions (>= 1);
        full mode keeps at most FULL_KEEP_VERSIONS, since each older one is a whole-model copy."""
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
        self.version = 0
        self.skipped_steps = 0
        self.consecutive_skips = 0  # non-finite steps in a row; the orchestrator stops the run at a limit
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.pad_id = 0

    def setup(self) -> None:
        """Load the base model; wrap it with a fresh LoRA adapter, or make every weight trainable (blocking)."""
        from transformers import AutoTokenizer

        torch.manual_seed(self.seed)
        base = load_causal_lm(self.model_path, self.cfg.device, self.cfg.dtype, self.trust_remote_code)
        tok = AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=self.trust_remote_code)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        model = self._full_model(base) if self.full else self._lora_model(base)
        model.train()
        self.model = model
        # parameters() yields a tied weight (lm_head = embed_tokens) once, so AdamW steps it once
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=self.cfg.lr, betas=tuple(self.cfg.betas),
                                           weight_decay=self.cfg.weight_decay)
        self._snapshots = {}
        log.info("trainer_ready", device=self.cfg.device, update=self.cfg.update,
                 trainable_params=sum(p.numel() for p in params),
                 lora_rank=None if self.full else self.cfg.lora_rank)

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
            a = group_advantages(r[None, :], scale=self.loss_cfg.scale_rewards)[0]
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

    def _micro_batches(self, n: int) -> list[slice]:
        m = self.cfg.micro_batch_sequences
        return [slice(i, min(n, i + m)) for i in range(0, n, m)]

    def _forward(self, rows: _Rows, sl: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of the rows `sl` under the current weights, over every token (environment
        tokens are context): ([n, L] log-probs, [n, L] mask of the sampled completion tokens)."""
        ids, attn, cmask = pack_sequences(rows.prompts[sl], rows.comps[sl], self.pad_id, rows.sampled[sl])
        dev = self.cfg.device
        lp = token_logprobs(self.model, ids.to(dev), attn.to(dev))
        return lp, cmask.to(dev)

    # ------------------------------------------------------------------ step

    def step(self, batch: Batch) -> TrainStats:
        """One corrected GRPO step on a batch; returns the stats of the step (blocking)."""
        assert self.model is not None and self.optimizer is not None, "call setup() first"
        t0 = time.monotonic()
        rows = self._rows(batch.groups)
        n = len(rows.comps)
        total_tokens = rows.sampled_tokens()  # what token_mean averages over: sampled tokens only
        advs = torch.tensor(rows.advantages, dtype=torch.float32)
        acc: dict[str, float] = {}
        ratio_max = 0.0
        loss_total = 0.0
        self.optimizer.zero_grad(set_to_none=True)
        for sl in self._micro_batches(n):
            lp, cmask = self._forward(rows, sl)
            # the engine's log-probs where it sampled; its 0 on environment tokens lies outside cmask
            beh = torch.zeros_like(lp)
            for i, b in enumerate(rows.behaviour[sl]):
                start = len(rows.prompts[sl][i])
                beh[i, start:start + len(b)] = torch.as_tensor(b, device=lp.device)
            adv = advs[sl].to(lp.device)
            loss, stats = policy_loss(lp, beh, adv, cmask, self.loss_cfg)
            if self.loss_cfg.aggregation == "token_mean":
                weight = float(cmask.sum()) / max(1, total_tokens)
            else:
                weight = (sl.stop - sl.start) / max(1, n)
            (loss * weight).backward()
            loss_total += float(loss.detach()) * weight
            for k, v in stats.items():
                if k == "ratio_max":
                    ratio_max = max(ratio_max, v)
                elif k in ("tokens", "masked_nonfinite"):
                    acc[k] = acc.get(k, 0.0) + v
                else:
                    acc[k] = acc.get(k, 0.0) + v * float(cmask.sum()) / max(1, total_tokens)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.cfg.grad_clip > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip))
        else:
            grad_norm = float(torch.sqrt(sum((p.grad.float() ** 2).sum() for p in params if p.grad is not None)))
        skipped = not (math.isfinite(loss_total) and math.isfinite(grad_norm))
        if batch.keep_version:
            self._keep_current_version()
        if skipped:
            self.skipped_steps += 1
            self.consecutive_skips += 1
            self.optimizer.zero_grad(set_to_none=True)
            log.warning("train_step_skipped", step=batch.step, loss=loss_total, grad_norm=grad_norm,
                        consecutive_skips=self.consecutive_skips)
        else:
            self.consecutive_skips = 0
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        for v in [v for v in self._snapshots if v <= self.version - self.keep_versions]:
            del self._snapshots[v]
        rewards = np.concatenate([g.rewards for g in batch.groups]) if batch.groups else np.zeros(0)
        metrics = {f"train/{k}": v for k, v in acc.items()}
        metrics.update({
            "train/loss": loss_total, "train/grad_norm": grad_norm, "train/ratio_max": ratio_max,
            "train/skipped": float(skipped), "train/sequences": float(n), "train/lr": self.cfg.lr,
            "train/reward_mean": float(rewards.mean()) if rewards.size else float("nan"),
        })
        return TrainStats(step=batch.step, version=self.version, metrics=metrics, t_start=t0, t_end=time.monotonic())

    # ------------------------------------------------------------------ other services

    def _trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def _keep_current_version(self) -> None:
        """Copy the current version's trainable weights to the CPU before a step changes them, so
        log-probs can be recomputed under it later (skipped when only the current version is kept)."""
        if self.keep_versions > 1:
            self._snapshots[self.version] = {n: p.detach().to("cpu", copy=True) for n, p in self._trainable()}

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
                    for sl in self._micro_batches(len(rows.comps)):
                        lp, _ = self._forward(rows, sl)
                        for i in range(sl.stop - sl.start):
                            (gi, ci), start = rows.owner[sl.start + i], len(rows.prompts[sl.start + i])
                            end = start + len(rows.comps[sl.start + i])
                            out[idx[gi]][ci] = lp[i, start:end].float().cpu().numpy()
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
        else:
            self.model.save_pretrained(str(directory), safe_serialization=True)

    # ------------------------------------------------------------------ state (checkpoint and resume)

    def save_state(self, directory: Path) -> None:
        """Write everything the next step depends on into the existing `directory` (blocking, fsynced):
        the files pipeline.trainer_state describes."""
        assert self.model is not None and self.optimizer is not None, "call setup() first"
        write_state(Path(directory), self.cfg, self._trainable(), self.optimizer,
                    Counters(self.version, self.skipped_steps, self.consecutive_skips))
        log.debug("trainer_state_saved", path=str(directory), version=self.version, update=self.cfg.update)

    def load_state(self, directory: Path) -> None:
        """Restore a state written by `save_state` (after `setup()`; blocking).

        Everything is checked before anything changes (pipeline.trainer_state.read_state): a state
        that does not fit this trainer raises TrainerError naming the file or parameter.
        Afterwards only the restored version can be recomputed (the older copies are gone).
        """
        assert self.model is not None and self.optimizer is not None, "call setup() first"
        directory = Path(directory)
        trainable = dict(self._trainable())
        saved = read_state(directory, self.cfg, trainable)
        with torch.no_grad():
            for n, p in trainable.items():
                p.copy_(saved.weights[n].to(p.device))
        index = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        sd = self.optimizer.state_dict()
        sd["state"] = {index[id(trainable[n])]: st for n, st in saved.optimizer.items()}
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
