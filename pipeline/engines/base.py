"""Checks every engine makes: a group request it can sample, an adapter or model directory it can load.

The Engine protocol itself lives in `pipeline.protocols`; `Engine` and `BatchEngine` are
importable from here too, where engine code and callers have always found them.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.errors import AdapterCorruptError, AdapterError, AdapterNotFoundError, PromptError
from pipeline.protocols import BatchEngine, Engine
from pipeline.types import AdapterRef, GroupRequest

__all__ = ["BatchEngine", "Engine", "check_adapter_dir", "check_group_request", "check_model_dir",
           "check_same_adapter", "held_versions", "same_version"]


def check_group_request(request: GroupRequest, context: tuple[int, str] | None = None,
                        vocab_size: int | None = None) -> None:
    """Refuse a request no engine can sample: n or max_new_tokens below 1, an empty prompt, a prompt
    that with its completion needs more than `context` (the limit, and how a message names it), or
    token ids outside [0, vocab_size)."""
    if request.n < 1 or request.max_new_tokens < 1:
        raise ValueError(f"group {request.group_id}: n and max_new_tokens must be >= 1, "
                         f"got n={request.n}, max_new_tokens={request.max_new_tokens}")
    ids = request.prompt.token_ids
    if len(ids) == 0:
        raise PromptError(f"prompt {request.prompt.id!r} has no tokens")
    if context is not None and len(ids) + request.max_new_tokens > context[0]:
        raise PromptError(f"prompt {request.prompt.id!r}: {len(ids)} tokens + max_new_tokens "
                          f"{request.max_new_tokens} exceed {context[1]}")
    if vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
        raise PromptError(f"prompt {request.prompt.id!r} has token ids outside [0, {vocab_size})")


def check_same_adapter(held: AdapterRef, asked: AdapterRef, how: str = "loaded") -> None:
    """Refuse an adapter name asked for as another version or directory than the one `held` under it."""
    if held.version != asked.version or held.path != asked.path:
        raise AdapterError(f"adapter name {asked.name!r} is {how} as version {held.version} from {held.path!r} "
                           f"but was asked for as version {asked.version} from {asked.path!r}; "
                           "adapter names must be unique")


def same_version(held: AdapterRef | None, asked: AdapterRef) -> bool:
    """Full-weight mode: whether the weights held (None: none whole) are `asked`'s (number and name)."""
    return held is not None and held.version == asked.version and held.name == asked.name


def held_versions(held: AdapterRef | None) -> tuple[int, ...]:
    """Full-weight mode's `loaded_versions`: the version held, none for the base model or none whole."""
    return () if held is None or held.version == 0 else (held.version,)


def check_model_dir(adapter: AdapterRef) -> Path:
    """A full-weight version's absolute directory, refused (naming the path) unless it holds a model.

    Cheap (no weights read): config.json and at least one safetensors file must be there.
    """
    if adapter.path is None:
        raise AdapterNotFoundError(f"version {adapter.version} ({adapter.name}) has no path")
    path = Path(adapter.path).resolve()
    if not path.is_dir():
        raise AdapterNotFoundError(f"version {adapter.version}: directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise AdapterCorruptError(f"version {adapter.version}: {str(path)!r} has no config.json "
                                  "(a full-weight version is a model directory; is trainer.update right?)")
    if not any(path.glob("*.safetensors")):
        raise AdapterCorruptError(f"version {adapter.version}: {str(path)!r} has no safetensors weights")
    return path


def check_adapter_dir(adapter: AdapterRef, rank_limit: tuple[int, str] | None = None) -> Path:
    """A LoRA version's absolute directory, refused (naming the path) unless it holds an adapter.

    Cheap (no weights read): adapter_config.json, readable JSON, and at least one safetensors
    file must be there; with `rank_limit` (the largest rank the engine takes, and the setting
    that sets it) the adapter's rank, `r` or any of `rank_pattern`, must not exceed it.
    """
    if adapter.path is None:
        raise AdapterNotFoundError(f"adapter version {adapter.version} ({adapter.name}) has no path")
    path = Path(adapter.path).resolve()
    if not path.is_dir():
        raise AdapterNotFoundError(f"adapter version {adapter.version}: directory {str(path)!r} does not exist")
    config_path = path / "adapter_config.json"
    if not config_path.is_file():
        raise AdapterCorruptError(f"adapter version {adapter.version}: {str(path)!r} has no adapter_config.json")
    if not any(path.glob("*.safetensors")):
        raise AdapterCorruptError(f"adapter version {adapter.version}: {str(path)!r} has no safetensors weights")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise AdapterCorruptError(f"adapter version {adapter.version}: {str(config_path)!r} is not readable "
                                  f"JSON: {e}") from e
    if not isinstance(config, dict):
        raise AdapterCorruptError(f"adapter version {adapter.version}: {str(config_path)!r} holds no JSON object")
    if rank_limit is not None:
        limit, setting = rank_limit
        ranks = [config.get("r", 0), *(config.get("rank_pattern") or {}).values()]
        rank = max(int(r) for r in ranks)
        if rank > limit:
            raise AdapterError(f"adapter version {adapter.version} at {str(path)!r} has LoRA rank {rank} but "
                               f"{setting} = {limit}; raise {setting}")
    return path
