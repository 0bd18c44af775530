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
- Trainer state (`save_state`/`load_state`) is safetensors + JSON only, never pickle: trainable
  weights, AdamW moments keyed by parameter name, RNG state, counters, and the update mode.
  `trainer.json` holds the sha256 of each tensor file, because safetensors checks no data bytes.
  A restored trainer's next step gives bit-identical weights to the original's; a state that
  does not fit (missing or corrupt file, the other update mode, other parameters, shapes or
  dtypes, other LoRA rank) is refused whole, nothing changed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import structlog
import torch

from pipeline.config import LossConfig, TrainerConfig
from pipeline.durable import fsync_dir, write_synced
from pipeline.errors import ConfigError, TrainerError
from pipeline.loss import group_advantages, policy_loss
from pipeline.models import quiet_progress, building_modules, load_causal_lm, pack_sequences, token_logprobs
from pipeline.types import Batch, RolloutGroup, TrainStats

log = structlog.get_logger(__name__)

# Bump when what save_state writes changes; load_state refuses any other format. (The update
# mode was added to trainer.json within format 1: a state without it was written in LoRA mode.)
STATE_FORMAT = 1
STATE_FILES = ("lora.safetensors", "optimizer.safetensors", "rng.safetensors")  # LoRA mode; hashed in trainer.json
FULL_STATE_FILES = ("model.safetensors", "optimizer.safetensors", "rng.safetensors")  # full mode: every weight
UPDATE_MODES = ("lora", "full")
ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")  # what AdamW keeps per parameter once stepped
FULL_KEEP_VERSIONS = 2  # full mode: the current version and the previous one (a CPU copy of the whole model)


def state_files(update: str) -> tuple[str, str, str]:
    """The tensor files save_state writes in an update mode: weights, optimizer moments, RNG state."""
    return FULL_STATE_FILES if update == "full" else STATE_FILES


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
        """Log-probs of each group's sampled tokens under the weights of the version that sampled it.

        Used by the log-prob contract check: engine and trainer must agree on the same policy.
        Raises KeyError if a group's version is not one of `kept_versions()`.
        """
        assert self.model is not None, "call setup() first"
        kept = self.kept_versions()
        missing = {g.version for g in groups} - set(kept)
        if missing:
            raise KeyError(f"trainer keeps versions {kept}, not {sorted(missing)}")
        out: list[list[np.ndarray]] = [[] for _ in groups]
        was_training = self.model.training
        self.model.eval()
        try:
            for version in sorted({g.version for g in groups}):
                idx = [i for i, g in enumerate(groups) if g.version == version]
                prompts, comps, _, _, owner = self._rows([groups[i] for i in idx])
                with self._weights_of(version):
                    for sl in self._micro_batches(len(comps)):
                        lp, cmask = self._forward(prompts[sl], comps[sl])
                        for i in range(sl.stop - sl.start):
                            out[idx[owner[sl.start + i]]].append(lp[i][cmask[i]].float().cpu().numpy())
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
        """Write everything the next step depends on into the existing `directory` (blocking, fsynced).

        lora.safetensors (LoRA) or model.safetensors (full): each trainable parameter by name, in
        its own dtype (LoRA: float32; full: trainer.dtype); a tied weight once, under its first
        name. optimizer.safetensors: "<name>.exp_avg", "<name>.exp_avg_sq", "<name>.step" for each
        parameter AdamW has stepped. rng.safetensors: "cpu" (and "cuda" on a cuda device) RNG
        state as uint8. trainer.json: format, update mode, version, counters, lr, lora_rank (LoRA),
        dtype, parameter shapes and each file's sha256. One file's tensors are in memory at a time.
        """
        assert self.model is not None and self.optimizer is not None, "call setup() first"
        directory = Path(directory)
        if not directory.is_dir():
            raise TrainerError(f"trainer state directory {str(directory)!r} does not exist")
        trainable = self._trainable()
        from safetensors.torch import save

        digests = {}
        for name, tensors in zip(state_files(self.cfg.update), self._state_tensors(trainable)):
            data = save(tensors)
            write_synced(directory / name, data)
            digests[name] = hashlib.sha256(data).hexdigest()
            del tensors, data  # before the next file's tensors are gathered: a full model's state is large
        meta = {
            "format": STATE_FORMAT, "update": self.cfg.update, "version": self.version,
            "skipped_steps": self.skipped_steps, "consecutive_skips": self.consecutive_skips, "lr": self.cfg.lr,
            "lora_rank": None if self.full else self.cfg.lora_rank, "dtype": self.cfg.dtype,
            "device": self.cfg.device, "parameters": {n: list(p.shape) for n, p in trainable}, "sha256": digests,
        }
        write_synced(directory / "trainer.json", json.dumps(meta, indent=1).encode())
        fsync_dir(directory)
        log.debug("trainer_state_saved", path=str(directory), version=self.version, update=self.cfg.update)

    def _state_tensors(self, trainable: list[tuple[str, torch.nn.Parameter]]) -> Iterator[dict[str, torch.Tensor]]:
        """The weights, optimizer and RNG files' tensors, one file at a time."""
        yield {n: p.detach().to("cpu").contiguous() for n, p in trainable}
        yield {f"{n}.{k}": torch.as_tensor(v).detach().cpu().contiguous()
               for n, p in trainable for k, v in self.optimizer.state.get(p, {}).items()}
        rng = {"cpu": torch.get_rng_state()}
        if self.cfg.device.startswith("cuda"):
            rng["cuda"] = torch.cuda.get_rng_state(self.cfg.device)
        yield rng

    def load_state(self, directory: Path) -> None:
        """Restore a state written by `save_state` (after `setup()`; blocking).

        Everything is checked before anything changes: a missing or corrupt file, a state of the
        other update mode (trainer.json without "update" was written in LoRA mode), other parameter
        names, shapes or dtypes, or another lora_rank raise TrainerError naming the file or parameter.
        Afterwards only the restored version can be recomputed (the older copies are gone).
        """
        assert self.model is not None and self.optimizer is not None, "call setup() first"
        directory = Path(directory)
        meta_path = directory / "trainer.json"
        meta = _read_meta(meta_path)
        if meta.get("format") != STATE_FORMAT:
            raise TrainerError(f"{meta_path}: format {meta.get('format')!r}, this trainer reads {STATE_FORMAT}")
        if meta.get("simulated"):
            raise TrainerError(f"{meta_path} was written by the simulated trainer, which has no weights to restore")
        _check_update(meta_path, meta, self.cfg.update)
        if not self.full and meta.get("lora_rank") != self.cfg.lora_rank:
            raise TrainerError(f"{meta_path}: saved with lora_rank {meta.get('lora_rank')!r}, "
                               f"this trainer has lora_rank {self.cfg.lora_rank}")
        if self.full and meta.get("dtype") != self.cfg.dtype:
            raise TrainerError(f"{meta_path}: full weights saved in dtype {meta.get('dtype')!r}, "
                               f"this trainer has trainer.dtype {self.cfg.dtype!r}")
        counters = {k: _counter(meta_path, meta, k) for k in ("version", "skipped_steps", "consecutive_skips")}
        trainable = dict(self._trainable())
        shapes = {n: list(p.shape) for n, p in trainable.items()}
        saved_shapes = meta.get("parameters")
        if not isinstance(saved_shapes, dict):
            raise TrainerError(f"{meta_path}: 'parameters' must map parameter names to shapes")
        _check_same_parameters(meta_path, saved_shapes, shapes)
        digests = meta.get("sha256")
        if not isinstance(digests, dict):
            raise TrainerError(f"{meta_path}: 'sha256' must map file names to digests")
        files = state_files(self.cfg.update)
        weights, optim, rng = (_read_tensors(directory / f, digests.get(f)) for f in files)

        weights_path = directory / files[0]
        _check_same_parameters(weights_path, {n: list(t.shape) for n, t in weights.items()}, shapes)
        for n, t in weights.items():
            if t.dtype != trainable[n].dtype:
                raise TrainerError(f"{weights_path}: parameter {n!r} is {t.dtype}, expected {trainable[n].dtype}")
        optim_state = _optimizer_state(directory / files[1], optim, trainable)
        rng_path = directory / files[2]
        if "cpu" not in rng or rng["cpu"].dtype != torch.uint8:
            raise TrainerError(f"{rng_path}: no uint8 'cpu' RNG state")

        with torch.no_grad():
            for n, p in trainable.items():
                p.copy_(weights[n].to(p.device))
        index = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        sd = self.optimizer.state_dict()
        sd["state"] = {index[id(trainable[n])]: st for n, st in optim_state.items()}
        self.optimizer.load_state_dict(sd)  # places each moment on its parameter's device
        torch.set_rng_state(rng["cpu"])
        if self.cfg.device.startswith("cuda"):
            if "cuda" in rng:
                torch.cuda.set_rng_state(rng["cuda"], self.cfg.device)
            else:
                log.warning("trainer_state_no_cuda_rng", path=str(directory), device=self.cfg.device)
        if meta.get("lr") != self.cfg.lr:
            log.info("trainer_lr_changed", saved=meta.get("lr"), now=self.cfg.lr)
        self.version = counters["version"]
        self.skipped_steps = counters["skipped_steps"]
        self.consecutive_skips = counters["consecutive_skips"]
        self._snapshots = {}
        log.info("trainer_state_loaded", path=str(directory), version=self.version, update=self.cfg.update)

    def close(self) -> None:
        """Nothing to release beyond memory (the process-based trainer stops its child here)."""


def _read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise TrainerError(f"trainer state file {path} is missing") from None
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
        raise TrainerError(f"trainer state file {path} cannot be read as JSON: {e}") from None
    if not isinstance(meta, dict):
        raise TrainerError(f"trainer state file {path} must hold a JSON object, got {type(meta).__name__}")
    return meta


def _check_update(path: Path, meta: dict[str, Any], update: str) -> None:
    """Refuse a state written in the other update mode (no "update" field: written in LoRA mode)."""
    saved = meta.get("update", "lora")
    if saved not in UPDATE_MODES:
        raise TrainerError(f"{path}: update must be one of {', '.join(UPDATE_MODES)}, got {saved!r}")
    if saved != update:
        what = {"lora": "LoRA adapter weights", "full": "all model weights"}
        raise TrainerError(f"{path} was written by a trainer with trainer.update = {saved!r} ({what[saved]}); "
                           f"this trainer has trainer.update = {update!r} ({what[update]}): a state resumes "
                           "only in the mode that wrote it")


def _counter(path: Path, meta: dict[str, Any], key: str) -> int:
    v = meta.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise TrainerError(f"{path}: {key} must be an integer >= 0, got {v!r}")
    return v


def _read_tensors(path: Path, sha256: Any) -> dict[str, torch.Tensor]:
    """The tensors of one state file, after checking its bytes against the digest in trainer.json."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TrainerError(f"trainer state file {path} is missing") from None
    except OSError as e:
        raise TrainerError(f"trainer state file {path} cannot be read: {e}") from None
    if not isinstance(sha256, str):
        raise TrainerError(f"trainer.json has no sha256 for {path.name}")
    if hashlib.sha256(data).hexdigest() != sha256:
        raise TrainerError(f"trainer state file {path} is corrupt: its sha256 does not match trainer.json")
    try:
        return load(data)
    except (SafetensorError, ValueError, RuntimeError) as e:  # the digest matched a file that is not safetensors
        raise TrainerError(f"trainer state file {path} is not valid safetensors: {e}") from None


def _check_same_parameters(path: Path, saved: dict[str, Any], expected: dict[str, list[int]]) -> None:
    """Raise TrainerError naming the first parameter missing, unexpected or of another shape."""
    missing = [n for n in expected if n not in saved]
    if missing:
        raise TrainerError(f"{path}: no parameter {missing[0]!r} ({len(missing)} of this trainer's "
                           f"{len(expected)} missing; other target_modules?)")
    extra = [n for n in saved if n not in expected]
    if extra:
        raise TrainerError(f"{path}: parameter {extra[0]!r} is not in this trainer ({len(extra)} unknown; "
                           f"other target_modules?)")
    for n, shape in expected.items():
        if saved[n] != shape:
            raise TrainerError(f"{path}: parameter {n!r} has shape {saved[n]}, this trainer's is {shape}")


def _optimizer_state(path: Path, tensors: dict[str, torch.Tensor],
                     params: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Group "<name>.<key>" tensors by parameter and check each is a complete AdamW state
    (moments of the parameter's shape and dtype)."""
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name, _, field = key.rpartition(".")
        if name not in params:
            raise TrainerError(f"{path}: {key!r} is for parameter {name!r}, which is not in this trainer")
        state.setdefault(name, {})[field] = t
    for name, st in state.items():
        absent = [k for k in ADAM_STATE_KEYS if k not in st]
        if absent:
            raise TrainerError(f"{path}: parameter {name!r} has no {absent[0]!r}")
        p = params[name]
        for k in ("exp_avg", "exp_avg_sq"):
            if st[k].shape != p.shape or st[k].dtype != p.dtype:
                raise TrainerError(f"{path}: {name}.{k} is {st[k].dtype} {list(st[k].shape)}, "
                                   f"expected {p.dtype} {list(p.shape)}")
        if st["step"].numel() != 1:
            raise TrainerError(f"{path}: {name}.step must be a scalar, got shape {list(st['step'].shape)}")
    return state


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
        directory = Path(directory)
        if not directory.is_dir():
            raise TrainerError(f"trainer state directory {str(directory)!r} does not exist")
        meta = {"format": STATE_FORMAT, "simulated": True, "update": self.update, "version": self.version,
                "step_s": self.step_s}
        write_synced(directory / "trainer.json", json.dumps(meta).encode())
        fsync_dir(directory)

    def load_state(self, directory: Path) -> None:
        path = Path(directory) / "trainer.json"
        meta = _read_meta(path)
        if not meta.get("simulated"):
            raise TrainerError(f"{path} was not written by the simulated trainer")
        _check_update(path, meta, self.update)
        self.version = _counter(path, meta, "version")
