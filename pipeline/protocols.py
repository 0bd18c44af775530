"""The roles the orchestrator wires together: an Engine samples groups, a Trainer learns from them.

Each role is a Protocol: anything with these members fills it (the built-in engines in
`pipeline/engines/`, the trainers in `pipeline/trainer/policy.py` and `pipeline/trainer/process.py`, or
a caller's own). A capability only some engines have is a Protocol of its own (`BatchEngine`),
checked with `isinstance`, never probed attribute by attribute.

Engine invariants:
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
- `max_context` is the most tokens (prompt + completion) one sequence may hold on this engine,
  or None where the engine knows no limit; it is read after `start()` (a server reports its own).
- `start()` is idempotent: a Pipeline calls it on every engine, including engines the caller
  built and started already (those it does not close either: the caller owns them).
- `start()` after `close()` starts the same object afresh (a restart): the model is loaded again,
  no adapter is loaded, and calls made before the close never complete on the new start (they
  raise EngineDeadError or an error of their own). The Pipeline restarts only engines it built.
- Engines never call back into the orchestrator.
- Full-weight updates (built with `full_weights=True`): a version is a whole model directory
  and an engine holds one version at a time. `load_adapter` replaces the weights (the caller
  drains the engine's groups first; the engine waits for any still running); `generate` for
  any version but the loaded one raises GenerationError; `unload_adapter` does nothing. With
  in-flight swaps (built with `in_flight=True`) the caller does not drain: the running calls go
  on with the new weights, `generate` serves the version held or an older one (the label), and
  each Generation's `last_version` names the newest version that may have sampled it.
- `BatchEngine.generate_many(requests, adapter)` samples several groups in one call and returns,
  in order, each one's Generation or the exception that failed it. An engine offers it when
  one call for many groups is cheaper than one per group (the simulated engine, where the
  per-call cost is all there is); the orchestrator then starts the groups admitted together
  as one call. Other engines get one `generate` per group, each finishing on its own.

Trainer invariants:
- Every call blocks: the orchestrator makes them from worker threads, never on the event loop.
  `setup()` comes first (it loads the model); `close()` is safe to call twice.
- `version` is the number of steps taken (0: the base model); `step(batch)` trains one step and
  returns TrainStats whose `version` is the new `version`. A step whose loss or gradient is not
  finite changes no weight and adds one to `consecutive_skips` (a finite step resets it); the
  orchestrator stops the run at `trainer.max_consecutive_skips`.
- `save_adapter(dir)` writes the current version into the existing `dir`: a LoRA adapter
  directory, or a whole model directory with `trainer.update = "full"`.
- `recompute_logprobs(groups)` gives, per group and per completion, the log-probs [T] of every
  completion token (an episode's environment tokens too, aligned with `Completion.logprobs`; the
  caller keeps the sampled ones, `Completion.sampled`) under the weights of the group's version;
  KeyError for a version it no longer keeps.
- `step(batch)` trains on the sampled tokens only: environment tokens (mask False) are context,
  never a term of the loss or its statistics.
- `save_state(dir)` writes everything the next step depends on; `load_state(dir)` restores it
  (and `version` with it) or refuses it whole, changing nothing. A trainer may also have
  `begin_save_state(dir)`: the same state, copied at the call and written while later calls run,
  with `pipeline.store.checkpoint.STATE_WRITTEN` put into `dir` last (JSON {"error", "sha256"}).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from pipeline.observe.metrics import BusyMeter
from pipeline.types import AdapterRef, Batch, Generation, GroupRequest, RolloutGroup, TrainStats


@runtime_checkable
class Engine(Protocol):
    """An inference engine that samples whole groups."""

    name: str
    busy: BusyMeter  # entered while at least one request runs: the engine's busy time

    @property
    def max_context(self) -> int | None:
        """Most prompt + completion tokens per sequence (None: no limit known); read after `start()`."""
        ...

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


@runtime_checkable
class BatchEngine(Engine, Protocol):
    """An engine that samples several groups of one version in one call."""

    async def generate_many(self, requests: Sequence[GroupRequest],
                            adapter: AdapterRef) -> list[Generation | Exception]:
        """Each request's Generation, or the exception that failed that group, in order."""
        ...


@runtime_checkable
class Trainer(Protocol):
    """The policy's trainer: one update per batch, each version published as a directory."""

    version: int  # steps taken; 0 is the base model
    consecutive_skips: int  # non-finite steps in a row

    def setup(self) -> None:
        """Load the model and the optimizer (blocking), before any other call."""
        ...

    def step(self, batch: Batch) -> TrainStats:
        """Train one step on `batch`; the stats carry the new version."""
        ...

    def recompute_logprobs(self, groups: Sequence[RolloutGroup]) -> list[list[np.ndarray]]:
        """Per group and completion, every completion token's log-prob [T] under the group's version."""
        ...

    def save_adapter(self, directory: Path) -> None:
        """Write the current version into the existing `directory`."""
        ...

    def save_state(self, directory: Path) -> None:
        """Write everything the next step depends on into the existing `directory`."""
        ...

    def load_state(self, directory: Path) -> None:
        """Restore a state written by `save_state`, or refuse it whole."""
        ...

    def close(self) -> None:
        """Free the trainer's resources (its process, if it has one). Safe to call twice."""
        ...
