"""Building a run's parts from its config: the model, the tokenizer, the engines, the trainer and the
prompt sets, each by kind.

Invariants:
- Bad input found here is a ConfigError naming the key (a CUDA device this machine lacks, a
  model.path that gives no tokenizer, no eval prompts while eval.every is set).
- Nothing here starts anything: engines and the trainer are built, not started.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

from pipeline.config import RunConfig
from pipeline.engines.base import Engine
from pipeline.errors import ConfigError
from pipeline.tasks import build_task


def check_devices(cfg: RunConfig, *, builds_engines: bool, builds_trainer: bool) -> None:
    """Each CUDA device the pipeline builds an engine or the trainer on exists (ConfigError naming its key)."""
    from pipeline.devices import check_cuda_devices

    named: list[tuple[str, str]] = []
    if builds_engines and cfg.engine.kind in ("transformers", "vllm"):
        named += [(f"engine.devices[{i}]", d) for i, d in enumerate(cfg.engine.devices)]
    if builds_trainer and cfg.trainer.kind == "peft":
        named.append(("trainer.device", cfg.trainer.device))
    check_cuda_devices(named)


def prompt_sets(cfg: RunConfig, prompts: Sequence[Any] | None, eval_prompts: Sequence[Any] | None,
                reward: Any) -> tuple[list[Any], list[Any], Any]:
    """(training items, eval items, reward) from the caller, the data files or the built-in task."""
    from pipeline.data import load_rows

    task = None
    if (prompts is None and not cfg.data.train) or reward is None:  # the built-in task gives prompts or reward
        task = build_task(cfg.task, cfg.sampling.max_new_tokens)
    if prompts is not None:
        items = list(prompts)
    else:
        items = load_rows(cfg.data.train, "data.train") if cfg.data.train else task.prompts
    eval_items: list[Any] = []
    if eval_prompts is not None:
        eval_items = list(eval_prompts)
    elif cfg.data.eval:
        eval_items = load_rows(cfg.data.eval, "data.eval")
    elif cfg.eval.every and task is not None and prompts is None and not cfg.data.train:
        # the built-in task holds out prompts drawn with another seed
        eval_items = build_task(replace(cfg.task, seed=cfg.task.seed + 1), cfg.sampling.max_new_tokens).prompts
    if cfg.eval.every and not eval_items:
        raise ConfigError("eval.every is set but there are no eval prompts: set data.eval to a file "
                          "(or pass eval_prompts= to Pipeline)")
    return items, eval_items, reward or task.reward


def model_dir(cfg: RunConfig) -> str:
    """model.path (checked), or the built-in model, built once into model.cache_dir."""
    if cfg.model.path:
        from pipeline.models import check_model_dir

        check_model_dir(cfg.model.path)
        return cfg.model.path
    from pipeline.models import build_model

    return str(build_model(cfg.model.shape, cfg.model.cache_dir, seed=cfg.seed))


def load_tokenizer(cfg: RunConfig, model_path: str | None) -> Any:
    """The model's tokenizer; one that model.path cannot give is bad input (ConfigError)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... for a folder it cannot read
        if not cfg.model.path:
            raise  # the built-in model's: our bug, not the input's
        raise ConfigError(f"model.path: no tokenizer could be loaded from {model_path!r}: "
                          f"{type(e).__name__}: {e}") from e


def max_context(model_path: str | None) -> int | None:
    """The longest prompt + completion the model takes (its max_position_embeddings), if it says;
    each engine reports its own limit besides (`Engine.max_context`)."""
    if model_path is None:
        return None
    try:
        conf = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):  # a model without a readable config.json gets no length check
        return None
    return conf.get("max_position_embeddings")


def build_engines(cfg: RunConfig, model_path: str | None, start_step: int) -> list[Engine]:
    """One engine per engine.devices entry (per vllm_server.urls entry for servers), of engine.kind."""
    K = cfg.pipeline.max_staleness
    full = cfg.trainer.update == "full"
    offset = 1009 * start_step  # a resumed run samples afresh, not the first session's draws
    if cfg.engine.kind == "vllm_server":  # servers someone else started: one engine per URL
        from pipeline.engines.vllm_server import VLLMServerEngine

        return [VLLMServerEngine(url, sampling=cfg.sampling, cfg=cfg.engine.vllm_server, max_staleness=K,
                                 name=f"vllm-server-{i}") for i, url in enumerate(cfg.engine.vllm_server.urls)]
    make: Callable[[int, str], Engine]
    if cfg.engine.kind == "simulated":
        from pipeline.engines.simulated import SimulatedEngine

        make = lambda i, dev: SimulatedEngine(cfg.engine.simulated, seed=cfg.seed + offset + i,
                                                             name=f"simulated-{i}", full_weights=full)
    elif cfg.engine.kind == "transformers":
        from pipeline.engines.transformers import TransformersEngine

        make = lambda i, dev: TransformersEngine(
            model_path, sampling=cfg.sampling, cfg=cfg.engine.transformers, device=dev, dtype=cfg.model.dtype,
            max_loaded_adapters=cfg.engine.transformers.max_loaded_adapters or K + 1, seed=cfg.seed + offset + i,
            name=f"transformers-{i}", trust_remote_code=cfg.model.trust_remote_code, full_weights=full)
    else:
        from pipeline.engines.vllm import VLLMEngine

        make = lambda i, dev: VLLMEngine(model_path, sampling=cfg.sampling, cfg=cfg.engine.vllm, device=dev,
                                                   max_staleness=K, name=f"vllm-{i}",
                                                   seed=cfg.engine.vllm.seed + offset + i, full_weights=full)
    return [make(i, dev) for i, dev in enumerate(cfg.engine.devices)]


def build_trainer(cfg: RunConfig, model_path: str | None) -> Any:
    """The trainer of trainer.kind: peft LoRA (or full weights) in its own process or a thread, or simulated."""
    if cfg.trainer.kind == "simulated":
        from pipeline.trainer import SimulatedTrainer

        return SimulatedTrainer(cfg.trainer.step_s, update=cfg.trainer.update)
    from pipeline.trainer import LoRATrainer
    from pipeline.trainer_process import ProcessTrainer

    cls = ProcessTrainer if cfg.trainer.separate_process else LoRATrainer
    return cls(model_path, cfg.trainer, cfg.loss, seed=cfg.seed, trust_remote_code=cfg.model.trust_remote_code,
               keep_versions=cfg.pipeline.max_staleness + 2)
