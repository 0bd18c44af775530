"""Preflight: what a run's config names on this machine, checked before anything is made.

The schema (pipeline.config.schema) checks values alone, so a config naming a path that does not
exist builds; here the names are looked up: the model directory, the data files and the chat
template, the package of each tracker, the CUDA devices the pipeline builds on.

Invariants:
- Each refusal is a ConfigError naming the key and the value (`model.path`, `data.train`,
  `log.trackers`, `engine.devices[1]`, ...): run.py says it as one line and exits 2.
- It reads no file's contents and imports no package it checks (`find_spec` finds one without
  running it); torch is imported only to count CUDA devices when the config names one.
- It runs before anything is written or built: run.py calls it after loading the config, before
  the run directory exists; `Pipeline` set-up calls it (through `build.check_devices`) first.
"""

from __future__ import annotations

import importlib.util
import os

from pipeline.config.schema import RunConfig
from pipeline.devices import check_cuda_devices
# the schema's own rendering of a value, so a refusal reads the same whichever module says it
from pipeline.config.schema import _show
from pipeline.errors import ConfigError

_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")  # the files pipeline.data.files reads


def preflight(cfg: RunConfig, *, builds_engines: bool = True, builds_trainer: bool = True) -> None:
    """Refuse (ConfigError naming the key) a config whose paths, packages or CUDA devices this machine
    lacks. `builds_engines` / `builds_trainer`: whether the pipeline builds them (and so needs their devices)."""
    check_model_path(cfg.model.path)
    check_data_path("data.train", cfg.data.train)
    check_data_path("data.eval", cfg.data.eval)
    check_chat_template(cfg.data.chat_template)
    check_trackers(cfg.log.trackers)
    check_devices(cfg, builds_engines=builds_engines, builds_trainer=builds_trainer)
    check_memory_publish(cfg, builds_engines=builds_engines, builds_trainer=builds_trainer)


def check_memory_publish(cfg: RunConfig, *, builds_engines: bool, builds_trainer: bool) -> None:
    """trainer.publish = "memory" where the pipeline builds what it needs. Full weights: vLLM engines
    and one trainer process, all on one GPU (CUDA IPC opens memory of the same GPU only). LoRA:
    engines in this process (transformers), which take the adapter's tensors from the step's reply.
    Engines or a trainer of the caller's own are the caller's to match."""
    if cfg.trainer.publish != "memory":
        return
    full = cfg.trainer.update == "full"
    why = ('trainer.publish = "memory" hands each full-weight version to vLLM through the trainer\'s GPU memory'
           if full else 'trainer.publish = "memory" hands each LoRA version to the engines in the step\'s reply')
    wanted = "vllm" if full else "transformers"
    if builds_engines and cfg.engine.kind not in (wanted, "simulated"):
        raise ConfigError(f'{why}: it needs engine.kind = "{wanted}", got {cfg.engine.kind!r}'
                          + ("" if full else " (vLLM loads LoRA adapters from files)")
                          + '; use trainer.publish = "files"')
    if builds_trainer and cfg.trainer.kind == "peft":
        if cfg.trainer.devices:
            raise ConfigError(f"{why}: it needs one trainer process, not trainer ranks (trainer.devices = "
                              f"{_show(cfg.trainer.devices)})")
        if full and not cfg.trainer.device.startswith("cuda"):
            raise ConfigError(f'{why}: trainer.device must be a GPU ("cuda:N"), got {cfg.trainer.device!r}')
    if full and builds_engines and builds_trainer and cfg.engine.kind == "vllm" and cfg.trainer.kind == "peft":
        for i, device in enumerate(cfg.engine.devices):
            if device != cfg.trainer.device:
                raise ConfigError(f'{why}: engine.devices[{i}] = "{device}" is not trainer.device = '
                                  f'"{cfg.trainer.device}"; every engine must share the trainer\'s GPU')


# os.path's tests never raise: a too-long, unreadable or malformed path is simply "not there"


def check_model_path(path: str) -> None:
    """model.path, when set, is a directory holding a config.json (its contents: models.builtin.check_model_dir)."""
    if not path:
        return
    if not os.path.isdir(path):
        what = "is not a directory" if os.path.exists(path) else "does not exist"
        raise ConfigError(f"model.path must be an existing model directory; {_show(path)} {what}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"model.path must be a transformers model directory; {_show(path)} has no config.json")


def check_data_path(key: str, value: str) -> None:
    """A data file (by suffix) or a datasets.save_to_disk directory that exists, when set."""
    if not value:
        return
    if not os.path.exists(value):
        raise ConfigError(f"{key}: {_show(value)} does not exist")
    if os.path.isdir(value):
        if not os.path.isfile(os.path.join(value, "dataset_info.json")) and \
                not os.path.isfile(os.path.join(value, "dataset_dict.json")):
            raise ConfigError(f"{key}: directory {_show(value)} is not one written by datasets' save_to_disk "
                              "(no dataset_info.json or dataset_dict.json)")
    elif not value.lower().endswith(_DATA_SUFFIXES):
        raise ConfigError(f"{key} must be a {', '.join(_DATA_SUFFIXES)} file or a datasets.save_to_disk "
                          f"directory, got {_show(value)}")
    # pipeline.data.files reads every format through datasets, a dependency a trimmed environment can lack
    if importlib.util.find_spec("datasets") is None:
        raise ConfigError(f"{key} = {_show(value)} is read with the datasets package, which is not installed; "
                          "pip install 'datasets>=2.19'")


def check_chat_template(path: str) -> None:
    """data.chat_template, when set, is a file (read later by pipeline.data.prompts.read_chat_template)."""
    if path and not os.path.isfile(path):
        raise ConfigError(f"data.chat_template must be a jinja file; {_show(path)} "
                          + ("is not a file" if os.path.exists(path) else "does not exist"))


def check_trackers(trackers: tuple[str, ...]) -> None:
    """The package of each of log.trackers is installed."""
    for name in trackers:
        # find_spec finds the package without importing it (wandb and tensorboard take a second or two)
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f'log.trackers includes "{name}" but the {name} package is not installed; '
                              f'pip install -e ".[{name}]"')


def check_devices(cfg: RunConfig, *, builds_engines: bool, builds_trainer: bool) -> None:
    """Each CUDA device the pipeline builds an engine or the trainer on exists."""
    named: list[tuple[str, str]] = []
    if builds_engines and cfg.engine.kind in ("transformers", "vllm"):
        named += [(f"engine.devices[{i}]", d) for i, d in enumerate(cfg.engine.devices)]
    if builds_trainer and cfg.trainer.kind == "peft":
        named += [(f"trainer.devices[{i}]" if cfg.trainer.devices else "trainer.device", d)
                  for i, d in enumerate(cfg.trainer.rank_devices)]
    check_cuda_devices(named)
