"""The trainer: one LoRA (peft) policy update per batch on its own device.

Invariants:
- Version t of the policy is the base model plus the adapter after t steps; version 0 is
  exactly the base model (LoRA B starts at zero), so engines at version 0 sample the same
  policy the trainer starts from.
- `step` is synchronous and blocking: the orchestrator runs it in a worker thread, never on
  the event loop. The proximal policy of the decoupled PPO loss is the weights at the start of
  the step; with one optimizer step per batch that is the detached current log-probs.
- A step whose loss or gradient norm is not finite changes no weight (it is skipped and counted).
- Adapters are written only as safetensors + adapter_config.json (peft's save_pretrained).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import structlog
import torch

from pipeline.config import LossConfig, TrainerConfig
from pipeline.loss import group_advantages, policy_loss
from pipeline.models import building_modules, load_causal_lm, pack_sequences, token_logprobs
from pipeline.types import Batch, RolloutGroup, TrainStats

log = structlog.get_logger(__name__)


class LoRATrainer:
    """A peft LoRA policy, its optimizer, and the corrected GRPO step."""

    def __init__(self, model_path: str | Path, cfg: TrainerConfig, loss_cfg: LossConfig, *, seed: int = 0,
                 trust_remote_code: bool = False, keep_versions: int = 3) -> None:
        self.model_path = str(model_path)
        self.keep_versions = keep_versions  # LoRA weights of this many recent versions stay in memory
        self._snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.cfg = cfg
        self.loss_cfg = loss_cfg
        self.seed = seed
        self.trust_remote_code = trust_remote_code
        self.version = 0
        self.skipped_steps = 0
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.pad_id = 0

    def setup(self) -> None:
        """Load the base model and wrap it with a fresh LoRA adapter (blocking)."""
        from peft import LoraConfig, get_peft_model
        from transformers import AutoTokenizer

        torch.manual_seed(self.seed)
        base = load_causal_lm(self.model_path, self.cfg.device, self.cfg.dtype, self.trust_remote_code)
        tok = AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=self.trust_remote_code)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
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
        model.train()
        self.model = model
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=self.cfg.lr, betas=tuple(self.cfg.betas),
                                           weight_decay=self.cfg.weight_decay)
        self._snapshot()
        log.info("trainer_ready", device=self.cfg.device, trainable_params=sum(p.numel() for p in params),
                 lora_rank=self.cfg.lora_rank)

    # ------------------------------------------------------------------ data

    def _rows(self, groups: Sequence[RolloutGroup]) -> tuple[list, list, list, torch.Tensor, list[int]]:
        """Flatten groups into rows: prompt ids, completion ids, behaviour log-probs, advantages [N], group index."""
        rewards = [torch.as_tensor(g.rewards, dtype=torch.float32) for g in groups]
        prompts, comps, behaviour, advs, owner = [], [], [], [], []
        for gi, (g, r) in enumerate(zip(groups, rewards)):
            a = group_advantages(r[None, :], scale=self.loss_cfg.scale_rewards)[0]
            for c, adv in zip(g.completions, a.tolist()):
                if len(c.token_ids) == 0:
                    continue  # nothing was sampled: no token to weigh
                prompts.append(list(g.prompt.token_ids))
                comps.append(c.token_ids.tolist())
                behaviour.append(c.logprobs)
                advs.append(adv)
                owner.append(gi)
        return prompts, comps, behaviour, torch.tensor(advs, dtype=torch.float32), owner

    def _micro_batches(self, n: int) -> list[slice]:
        m = self.cfg.micro_batch_sequences
        return [slice(i, min(n, i + m)) for i in range(0, n, m)]

    def _forward(self, prompts: list, comps: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Completion log-probs under the current weights: ([N, L] log-probs, [N, L] completion mask)."""
        ids, attn, cmask = pack_sequences(prompts, comps, self.pad_id)
        dev = self.cfg.device
        lp = token_logprobs(self.model, ids.to(dev), attn.to(dev))
        return lp, cmask.to(dev)

    # ------------------------------------------------------------------ step

    def step(self, batch: Batch) -> TrainStats:
        """One corrected GRPO step on a batch; returns the stats of the step (blocking)."""
        assert self.model is not None and self.optimizer is not None, "call setup() first"
        t0 = time.monotonic()
        prompts, comps, behaviour, advs, owner = self._rows(batch.groups)
        n = len(comps)
        total_tokens = sum(len(c) for c in comps)
        acc: dict[str, float] = {}
        ratio_max = 0.0
        loss_total = 0.0
        self.optimizer.zero_grad(set_to_none=True)
        for sl in self._micro_batches(n):
            lp, cmask = self._forward(prompts[sl], comps[sl])
            beh = torch.zeros_like(lp)
            for i, b in enumerate(behaviour[sl]):
                start = len(prompts[sl][i])
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
        if skipped:
            self.skipped_steps += 1
            self.optimizer.zero_grad(set_to_none=True)
            log.warning("train_step_skipped", step=batch.step, loss=loss_total, grad_norm=grad_norm)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        self._snapshot()
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

    def _snapshot(self) -> None:
        """Keep this version's LoRA weights (small) so log-probs can be recomputed under it later."""
        self._snapshots[self.version] = {n: p.detach().to("cpu", copy=True) for n, p in self._trainable()}
        for v in sorted(self._snapshots)[: max(0, len(self._snapshots) - self.keep_versions)]:
            del self._snapshots[v]

    def _load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, p in self._trainable():
                p.copy_(weights[n].to(p.device))

    @torch.no_grad()
    def recompute_logprobs(self, groups: Sequence[RolloutGroup]) -> list[list[np.ndarray]]:
        """Log-probs of each group's sampled tokens under the weights of the version that sampled it.

        Used by the log-prob contract check: engine and trainer must agree on the same policy.
        Raises KeyError if a group's version is older than the snapshots kept.
        """
        assert self.model is not None, "call setup() first"
        missing = {g.version for g in groups} - set(self._snapshots)
        if missing:
            raise KeyError(f"trainer keeps versions {sorted(self._snapshots)}, not {sorted(missing)}")
        out: list[list[np.ndarray]] = [[] for _ in groups]
        was_training = self.model.training
        self.model.eval()
        try:
            for version in sorted({g.version for g in groups}):
                self._load_weights(self._snapshots[version])
                idx = [i for i, g in enumerate(groups) if g.version == version]
                prompts, comps, _, _, owner = self._rows([groups[i] for i in idx])
                for sl in self._micro_batches(len(comps)):
                    lp, cmask = self._forward(prompts[sl], comps[sl])
                    for i in range(sl.stop - sl.start):
                        out[idx[owner[sl.start + i]]].append(lp[i][cmask[i]].float().cpu().numpy())
        finally:
            self._load_weights(self._snapshots[self.version])
            self.model.train(was_training)
        return out

    def save_adapter(self, directory: Path) -> None:
        """Write the current adapter (safetensors + adapter_config.json) into `directory` (blocking)."""
        assert self.model is not None, "call setup() first"
        self.model.save_pretrained(str(directory), safe_serialization=True)

    def close(self) -> None:
        """Nothing to release beyond memory (the process-based trainer stops its child here)."""


class SimulatedTrainer:
    """A trainer that only waits `step_s` per step: for benchmarks of the orchestration itself."""

    def __init__(self, step_s: float = 0.0) -> None:
        self.step_s = step_s
        self.version = 0
        self.skipped_steps = 0

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
        """A minimal valid adapter directory, so the store and engines exercise the real path."""
        import json

        from safetensors.numpy import save_file

        save_file({"version": np.array([self.version], dtype=np.int64)},
                  str(Path(directory) / "adapter_model.safetensors"))
        (Path(directory) / "adapter_config.json").write_text(json.dumps({"simulated": True, "version": self.version}))
