"""The update strategy (`trainer.update`): which parameters train, the KL reference, what a version publishes.

- "lora" (`LoraUpdate`): a fresh peft LoRA adapter on the frozen base model; only the adapter
  trains, in float32 whatever the base dtype. The KL reference (loss.kl_coef) is the base with
  the adapter disabled: no second model. A version is adapter_config.json +
  adapter_model.safetensors, the bytes peft's save_pretrained writes.
- "full" (`FullUpdate`): every weight trains, in trainer.dtype (float32 by default; bfloat16
  halves the memory but AdamW on bf16 weights and moments loses small updates to rounding). The
  KL reference is a frozen copy of the base, loaded once. A version is a whole model directory
  as `from_pretrained` and vLLM read it: config.json (+ generation_config.json when the base has
  one) and model.safetensors, or model-*-of-*.safetensors with model.safetensors.index.json.

What a state saves follows from the strategy: the parameters it trains and their AdamW moments,
in the files pipeline.trainer.state names for its mode.

Invariants:
- Version 0 is exactly the base model: LoRA B starts at zero; full weights start as loaded.
- Versions are safetensors + JSON only, and no tokenizer (engines keep the base model's).
  Full-weight tensors carry the base model's Hugging Face names (what `from_pretrained` and
  vLLM's weight loader read); tied embeddings stay tied and are written once, as the base model
  writes them.
- Full mode keeps at most FULL_KEEP_VERSIONS versions for recomputing log-probs: each older one
  is a CPU copy of the whole model.
- On trainer ranks every rank publishes (gathering a sharded parameter is a collective) and
  rank 0 alone writes.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, ContextManager, Iterator, Protocol

import torch

from pipeline.config.schema import TrainerConfig
from pipeline.errors import ConfigError, TrainerError
from pipeline.models.builtin import building_modules, quiet_progress
from pipeline.trainer.collectives import Collectives
from pipeline.trainer.fsdp import full_state_dict, whole

FULL_KEEP_VERSIONS = 2  # full mode: the current version and the previous one (a CPU copy of the whole model)


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters that train, by name; a tied weight once."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


class UpdateStrategy(Protocol):
    """What differs between the update modes; the trainer's step is the same for every one."""

    name: str  # trainer.update
    separate_reference: bool  # the KL reference is a model of its own (else the policy's base, adapter off)
    reduce_every_pass: bool  # sharded: gradients are reduced after every pass, not an optimizer step's last

    def versions_kept(self, asked: int) -> int:
        """How many versions log-probs can be recomputed under, of the `asked` (the current one included)."""
        ...

    def trainable(self, base: torch.nn.Module) -> torch.nn.Module:
        """The policy built on the loaded base model, its trainable parameters marked."""
        ...

    def reference(self, model: torch.nn.Module, reference: torch.nn.Module | None) -> ContextManager[torch.nn.Module]:
        """The KL reference policy to run while the context is open."""
        ...

    def publish(self, model: torch.nn.Module, directory: Path, collectives: Collectives) -> None:
        """Write the current version into the existing `directory`."""
        ...

    def share(self, model: torch.nn.Module, version: int, keep_from: int) -> dict[str, Any]:
        """The current version handed over in memory (trainer.publish = "memory"), as plain data an
        engine loads it from; what stays behind for it is kept until `keep_from` (the oldest version
        an engine may still load) passes its version."""
        ...


class LoraUpdate:
    """trainer.update = "lora": a peft LoRA adapter trains, and each version is that adapter."""

    name = "lora"
    separate_reference = False
    # the adapter's gradients accumulate unsharded over an optimizer step's passes and are reduced
    # over the ranks after its last: one reduce-scatter a step, not one a pass (the adapter is small)
    reduce_every_pass = False

    def __init__(self, cfg: TrainerConfig) -> None:
        self.cfg = cfg
        self._layout: tuple[dict[str, str], bytes] | None = None  # saved tensor -> parameter name, config bytes

    def versions_kept(self, asked: int) -> int:
        return asked

    def trainable(self, base: torch.nn.Module) -> torch.nn.Module:
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
        self._layout = _peft_layout(model)  # from the whole adapter, before any sharding: the names peft saves
        return model

    @contextlib.contextmanager
    def reference(self, model: torch.nn.Module, reference: torch.nn.Module | None) -> Iterator[torch.nn.Module]:
        with model.disable_adapter():  # peft: the base model, adapter off
            yield model

    def publish(self, model: torch.nn.Module, directory: Path, collectives: Collectives) -> None:
        """adapter_config.json + adapter_model.safetensors. peft's save_pretrained writes these two
        files and a README model card, which takes most of its time; the same bytes here: the
        adapter's tensors under peft's saved names, the config peft would write."""
        from pipeline.store.weights import write_adapter

        tensors, config = self.adapter(model)
        if collectives.rank == 0:
            write_adapter(Path(directory), tensors, config)

    def share(self, model: torch.nn.Module, version: int, keep_from: int) -> dict[str, Any]:
        """The adapter's tensors (host copies) and config, what its two files would hold
        (`pipeline.engines.shared_weights.adapter_payload`): nothing stays behind."""
        from pipeline.engines import shared_weights

        return shared_weights.adapter_payload(version, *self.adapter(model))

    def adapter(self, model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], bytes]:
        """What a version's two files hold: the adapter's tensors under peft's saved names (views of
        the parameters, whole on every rank) and the bytes of adapter_config.json."""
        assert self._layout is not None, "build the model first (trainable)"
        names, config = self._layout
        params = dict(trainable_parameters(model))
        return {key: whole(params[name]) for key, name in names.items()}, config


def _peft_layout(model: torch.nn.Module) -> tuple[dict[str, str], bytes]:
    """Each tensor name peft saves with the name of the parameter it holds, and the bytes of
    adapter_config.json, both as peft's save_pretrained makes them (the config never changes)."""
    import tempfile

    from peft import get_peft_model_state_dict

    by_storage = {p.data_ptr(): n for n, p in trainable_parameters(model)}
    saved = get_peft_model_state_dict(model, adapter_name="default")
    missing = [k for k, t in saved.items() if t.data_ptr() not in by_storage]
    if missing:  # a tensor peft saves that is no trainable parameter: not a layout this code knows
        raise TrainerError(f"the LoRA adapter saves tensors that are not its parameters: {missing[:3]}")
    cfg = model.peft_config["default"]
    inference_mode, cfg.inference_mode = cfg.inference_mode, True  # as save_pretrained writes it
    if cfg.base_model_name_or_path is None:
        cfg.base_model_name_or_path = model.base_model.model.__dict__.get("name_or_path") or None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cfg.save_pretrained(tmp)
            config = (Path(tmp) / "adapter_config.json").read_bytes()
    finally:
        cfg.inference_mode = inference_mode
    return {k: by_storage[t.data_ptr()] for k, t in saved.items()}, config


class FullUpdate:
    """trainer.update = "full": every weight trains, and each version is the whole model."""

    name = "full"
    separate_reference = True
    reduce_every_pass = True  # the gradients stay sharded, so each pass reduces its own

    def __init__(self, cfg: TrainerConfig) -> None:
        self.cfg = cfg
        self.shared: dict[int, Any] = {}  # trainer.publish = "memory": version -> its packed weights, kept for the engines

    def versions_kept(self, asked: int) -> int:
        return min(asked, FULL_KEEP_VERSIONS)

    def trainable(self, base: torch.nn.Module) -> torch.nn.Module:
        """Every weight trains, in the dtype it was loaded in (trainer.dtype)."""
        for p in base.parameters():
            p.requires_grad_(True)
        return base

    @contextlib.contextmanager
    def reference(self, model: torch.nn.Module, reference: torch.nn.Module | None) -> Iterator[torch.nn.Module]:
        assert reference is not None, "the reference is loaded when loss.kl_coef > 0"
        yield reference

    def publish(self, model: torch.nn.Module, directory: Path, collectives: Collectives) -> None:
        """The whole model, as save_pretrained writes it: weights in the trainer's dtype under the
        base model's tensor names, a tied lm_head left out as HF does."""
        # transformers >= 5 writes only safetensors (it has no safe_serialization switch left);
        # no "Writing model shards" bar in the run's log for every version
        if not collectives.sharded:
            with quiet_progress():
                model.save_pretrained(str(directory))
            return
        state = full_state_dict(model)
        if collectives.rank == 0:
            with quiet_progress():
                model.save_pretrained(str(directory), state_dict=state)

    def share(self, model: torch.nn.Module, version: int, keep_from: int) -> dict[str, Any]:
        """The weights packed into a GPU buffer of their own, as another process on this GPU opens it
        (`pipeline.engines.shared_weights.share`). Each buffer shared stays until `keep_from` passes
        its version: CUDA IPC memory stays the producer's, so a buffer released early would leave an
        engine nothing to load."""
        from pipeline.engines import shared_weights

        for kept in [v for v in self.shared if v < keep_from]:
            del self.shared[kept]
        if version not in self.shared:
            self.shared[version] = shared_weights.pack(version, model.named_parameters())
        if self.cfg.device.startswith("cuda"):
            torch.cuda.ipc_collect()  # the memory of buffers released above, once no engine holds them open
        return shared_weights.share(self.shared[version])


UPDATES = {"lora": LoraUpdate, "full": FullUpdate}


def strategy_of(cfg: TrainerConfig) -> UpdateStrategy:
    """The strategy of `cfg.update`."""
    if cfg.update not in UPDATES:
        raise ConfigError(f"trainer.update must be one of {', '.join(UPDATES)}, got {cfg.update!r}")
    return UPDATES[cfg.update](cfg)
