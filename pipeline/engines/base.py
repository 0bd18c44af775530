"""The Engine protocol: how the orchestrator asks for a group of completions.

Invariants every engine keeps:
- `generate(request, adapter)` returns exactly `request.n` completions sampled with the weights
  of `adapter.version`, each with its token ids and the log-probability of every sampled token
  under the distribution it was sampled from; `Generation.version == adapter.version`.
- A group that started on version k finishes on k, even if newer versions are loaded meanwhile.
- Cancelling `generate` aborts the request: the engine stops spending work on it.
- `load_adapter` makes a version ready so that no request pays for loading it;
  `unload_adapter` frees it. Engines keep a bounded number of versions loaded.
- Adapters are identified by `AdapterRef.name` (unique, content-hashed), never by the version
  number alone: one engine may serve several runs in turn (a benchmark sweep), and version 3
  of one run is not version 3 of another.
- `start()` is idempotent: a Pipeline calls it on every engine, including engines the caller
  built and started already (those it does not close either: the caller owns them).
- `start()` after `close()` starts the same object afresh (a restart): the model is loaded again,
  no adapter is loaded, and calls made before the close never complete on the new start (they
  raise EngineDeadError or an error of their own). The Pipeline restarts only engines it built.
- Engines never call back into the orchestrator.
- Full-weight updates (built with `full_weights=True`): a version is a whole model directory
  and an engine holds one version at a time. `load_adapter` replaces the weights (the caller
  drains the engine's groups first; the engine waits for any still running); `generate` for
  any version but the loaded one raises GenerationError; `unload_adapter` does nothing.
- Optional: `generate_many(requests, adapter)` samples several groups in one call and returns,
  in order, each one's Generation or the exception that failed it. An engine offers it when
  one call for many groups is cheaper than one per group (the simulated engine, where the
  per-call cost is all there is); the orchestrator then starts the groups admitted together
  as one call. Engines without it get one `generate` per group, each finishing on its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from pipeline.errors import AdapterCorruptError, AdapterError, AdapterNotFoundError, PromptError
from pipeline.metrics import BusyMeter
from pipeline.types import AdapterRef, Generation, GroupRequest


@runtime_checkable
class Engine(Protocol):
    """An inference engine that samples whole groups."""

    name: str
    busy: BusyMeter  # entered while at least one request runs: the engine's busy time

    async def start(self) -> None:
        """Load the model, inside the running event loop, before any other call; after `close()`, again."""
        ...

    async def generate(self, request: GroupRequest, adapter: AdapterRef) -> Generation:
        """Sample `request.n` completions of `request.prompt` with `adapter`'s weights."""
        ...

    async def load_adapter(self, adapter: AdapterRef) -> None:
        """Load a published version (its directory on the shared filesystem) ahead of use."""
        ...

    async def unload_adapter(self, adapter: AdapterRef) -> None:
        """Free an adapter no request will use again (deferred while requests use it). Unknown ones are ignored."""
        ...

    async def close(self) -> None:
        """Abort what is running and free the engine's resources. Safe to call twice."""
        ...


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
