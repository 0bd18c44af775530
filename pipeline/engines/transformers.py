"""The transformers engine: batched group sampling on CPU or GPU, adapters through peft.

Concurrent `generate` calls queue their groups; one batching task takes the queue head's
weights (an adapter, or the base model) and every queued group on the same weights (up to
`max_batch_groups`) and samples all their rows in one decoding loop (`decoding.GroupDecoder`).
Which adapters stay loaded is decided by a `residency.Residency`.

Invariants (beyond the Engine protocol's):
- All torch work (model load, adapter load and delete, decoding) runs on one worker thread owned
  by the engine, one job at a time, in submission order; never on the event loop.
- Adapter loads and deletes are side jobs, kept in their own queue in submission order: the
  worker runs them as a job of their own, or, while it decodes a batch, between two of its
  forward passes, so that a version does not wait for a whole batch on another version to end.
  Between forward passes only what cannot touch the batch's weights runs: deletes (the residency
  never deletes an adapter in use) and loads that fill a free slot; a load that would make peft
  inject layers stops the side queue there until the batch ends, so the order holds.
- Bookkeeping on the event loop (`loaded_versions`, which requests use which adapter) describes
  the state after every job submitted so far; because jobs run in submission order and the
  residency submits an eviction's delete at once, an adapter chosen for eviction is deleted
  before any later job could need it again.
- Loading a version fills the peft adapter of an unloaded version with the same
  adapter_config.json, in place (a free slot), after checking every tensor name and shape; only
  without one does peft inject a new adapter. Unloading frees the slot rather than deleting it,
  so the adapters held in memory are the most ever loaded at once, not more. A version handed
  over in memory (trainer.publish = "memory": `AdapterRef.shared`) loads the same way from its
  payload, whose sha256 is checked first; only an injection writes it to a temporary directory.
- A decoding batch holds groups of a single adapter. Groups of other adapters wait for the next
  batch (sub-batches by adapter, in queue order), rather than use peft's mixed-batch
  `adapter_names=`, so every forward pass is a plain single-adapter LoRA forward.
- An adapter with pending or running requests is never unloaded; when every loaded adapter is in
  use, the engine exceeds `max_loaded_adapters` rather than break a running group.
- Full-weight updates (`full_weights=True`): no peft; the model holds one version's weights.
  `load_adapter(v)` waits until none of the engine's requests is queued or running (queued
  groups are not worker jobs yet, so job order alone would not keep them on the old weights),
  then, on the worker, reads v's safetensors (the base model's directory for version 0) into a
  staging state dict, checks every name and shape against the model (`full_weights.stage_weights`)
  and copies the tensors into the model's own parameters in place. A directory that does not
  check out is refused before any weight is written: the engine keeps serving the previous
  version intact. `generate` for any version but the one held (or, while a load is under way,
  the one being loaded, which the call waits for) raises GenerationError: a group is never
  sampled with other weights than its label. `unload_adapter` does nothing.
- Deterministic (`deterministic=True`): the model is wrapped in peft's LoRA layers from the
  start (an all-linear adapter of zeros, never used), so version 0 always runs as the wrapped
  layers with adapters disabled. Unwrapped linear layers and disabled LoRA ones differ in the
  last bits of a log-prob (~1e-6), so otherwise a version-0 group's numbers would depend on
  whether an adapter had been loaded before it was decoded. The config also decodes each group
  alone (`max_batch_groups` 1) and seeds it from its id.
- `close()` fails every pending request with EngineDeadError and shuts the worker thread down;
  `start()` after it starts afresh on a new worker thread (the model loaded again, no adapter).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import structlog
import torch
from peft import PeftModel

from pipeline.models import builtin as models
from pipeline.config.schema import SamplingConfig, TransformersEngineConfig
from pipeline.devices import sched_idle
from pipeline.engines.base import check_adapter_dir, check_group_request, check_model_dir, held_versions, same_version
from pipeline.engines.decoding import GroupDecoder, process_logits
from pipeline.engines.full_weights import stage_weights
from pipeline.store.weights import write_adapter
from pipeline.engines.residency import Residency, Resident
from pipeline.errors import (
    AdapterCorruptError,
    AdapterError,
    AdapterNotFoundError,
    ConfigError,
    EngineDeadError,
    GenerationError,
)
from pipeline.observe.metrics import BusyMeter
from pipeline.types import AdapterRef, Completion, Generation, GroupRequest

__all__ = ["EngineStats", "TransformersEngine", "process_logits"]  # process_logits: where callers found it

log = structlog.get_logger(__name__)

# deterministic mode: the adapter of zeros that wraps every linear layer from the start (never active)
_WRAPPER_ADAPTER = "deterministic-wrapper"


@dataclass
class EngineStats:
    """Counters since start (written on the event loop, except `tokens_generated`: worker only)."""

    requests: int = 0  # generate calls accepted
    cancelled: int = 0  # generate calls cancelled by their caller
    batches: int = 0  # decoding loops run
    tokens_generated: int = 0  # tokens sampled, including those of rows later cancelled


@dataclass(eq=False)
class _Pending:
    """A queued or running request. `cancelled` is set on the loop and read by the worker between steps."""

    request: GroupRequest
    adapter: AdapterRef
    future: asyncio.Future[Generation]
    t_start: float
    cancelled: bool = False

    @property
    def weights(self) -> str | None:
        """What the group samples with: its adapter's name, None for the base model (or the full weights held)."""
        return self.adapter.name if self.adapter.version else None


class TransformersEngine:
    """Samples whole groups with a transformers model (+ peft adapters) on one device."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        sampling: SamplingConfig,
        cfg: TransformersEngineConfig,
        device: str = "cpu",
        dtype: str = "float32",
        max_loaded_adapters: int = 2,
        eos_token_ids: Sequence[int] | None = None,
        seed: int = 0,
        name: str = "transformers-0",
        trust_remote_code: bool = False,
        full_weights: bool = False,
        deterministic: bool = False,
    ) -> None:
        if max_loaded_adapters < 1:
            raise ConfigError(f"max_loaded_adapters must be >= 1, got {max_loaded_adapters}")
        if sampling.repetition_penalty != 1.0 or sampling.presence_penalty != 0.0 or sampling.frequency_penalty != 0.0:
            raise ConfigError("sampling penalties are not supported by the transformers engine; leave them off")
        self.name = name
        self.model_path = Path(model_path)
        self.sampling = sampling
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_loaded_adapters = max_loaded_adapters
        self.trust_remote_code = trust_remote_code
        self.stats = EngineStats()
        self.busy = BusyMeter()
        self._eos_arg = None if eos_token_ids is None else frozenset(int(t) for t in eos_token_ids)
        self._eos_ids: frozenset[int] = frozenset()  # set by start(); empty = rows always run to max_new_tokens
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        # generate calls queued or running; kept across a restart, where calls made before the
        # close still give their counts back as they unwind
        self._calls = 0
        self.full_weights = full_weights
        self.deterministic = deterministic
        self._idle = asyncio.Event()  # set whenever no generate call is queued or running (tracks _calls)
        self._fresh_state()

    def _fresh_state(self) -> None:
        """The state of an engine not yet started: set at construction and again by a restart."""
        background = self.cfg.sched_idle and self.device.type == "cpu"  # computing on cores the event loop needs
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.name}-torch",
                                            initializer=sched_idle if background else None)

        # adapter loads and deletes in submission order, run by the worker (`_run_side_jobs`)
        self._side: deque[tuple[Future[None], Callable[..., None], tuple[Any, ...]]] = deque()
        self._side_lock = threading.Lock()
        # the load at the head that found no free slot between this batch's passes: none frees
        # while it blocks the queue, so it is not looked at again until the batch ends
        self._blocked: Future[None] | None = None

        # Event-loop state.
        self._queue: deque[_Pending] = deque()
        self._wakeup = asyncio.Event()
        self._running: list[_Pending] = []
        self._batch_task: asyncio.Task[None] | None = None
        self._residency: Residency[Path] = Residency(
            self.name, self.max_loaded_adapters, prepare=_check_version, load=self._submit_load,
            unload=self._submit_delete)
        self._started = False
        self._closed = False
        self._dead: EngineDeadError | None = None  # set if the batching task itself failed
        # full-weight mode: the version the model holds once every submitted job ran (None: a copy
        # into the parameters failed half-way, so no version until a load succeeds); a restart
        # loads the base model again
        self._weights: AdapterRef | None = AdapterRef.base()
        self._swap: tuple[AdapterRef, asyncio.Task[None]] | None = None  # the weight load under way

        # Worker-thread state.
        self._model: torch.nn.Module | None = None  # the transformers model; peft injects LoRA layers into it
        self._decoder: GroupDecoder | None = None
        self._peft: PeftModel | None = None
        self._peft_loaded: list[str] = []  # names of the adapters loaded, in load order
        self._slot_of: dict[str, str] = {}  # loaded adapter's name -> the peft adapter holding its weights
        self._slot_configs: dict[str, bytes] = {}  # every peft adapter -> the adapter_config.json it was made from
        self._slot_params: dict[str, dict[str, torch.nn.Parameter]] = {}  # slot -> its tensors by saved name
        self._free_slots: list[str] = []  # peft adapters of unloaded versions, oldest first, to be filled again
        self._vocab_size = 0
        self._max_positions = 0
        self._worker_weights: AdapterRef | None = AdapterRef.base()  # what the parameters hold now

    # ------------------------------------------------------------------ public API

    @property
    def loaded_versions(self) -> tuple[int, ...]:
        """Adapter versions loaded or being loaded (the base model, version 0, is not listed)."""
        if self.full_weights:
            return held_versions(self._weights)
        return tuple(sorted(r.ref.version for r in self._residency))

    @property
    def max_context(self) -> int | None:
        """The model's max_position_embeddings (None before `start()`)."""
        return self._max_positions or None

    async def start(self) -> None:
        """Load the model and start batching; after `close()`, do it again on a fresh worker thread."""
        if self._closed:
            # the old worker thread was shut down by close(); its model and adapters went with it
            self._fresh_state()
        if self._started:
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._load_model)
        self._started = True
        self._batch_task = loop.create_task(self._batch_loop(), name=f"{self.name}-batch-loop")
        self._batch_task.add_done_callback(self._on_batch_loop_done)
        log.info("engine_started", engine=self.name, model=str(self.model_path), device=str(self.device),
                 dtype=self.dtype, eos_token_ids=sorted(self._eos_ids))

    async def generate(self, request: GroupRequest, adapter: AdapterRef) -> Generation:
        self._check_open()
        t_start = time.monotonic()
        self._check_request(request)
        if self.full_weights:
            await self._await_weights(request, adapter)  # nothing is awaited from here to the queue
        self.stats.requests += 1
        residency = self._residency  # the one this call releases into, even after a restart
        self._calls += 1
        self._idle.clear()
        resident: Resident[Path] | None = None
        item: _Pending | None = None
        try:
            if not self.full_weights:
                resident = await residency.acquire(adapter)
            self._check_open()
            item = _Pending(request, adapter, asyncio.get_running_loop().create_future(), t_start)
            self._queue.append(item)
            self._wakeup.set()
            return await item.future
        except asyncio.CancelledError:
            self.stats.cancelled += 1
            if item is not None:
                item.cancelled = True
                with contextlib.suppress(ValueError):  # not queued any more: the worker drops its rows
                    self._queue.remove(item)
            raise
        finally:
            residency.release(resident)
            self._calls -= 1
            if not self._calls:
                self._idle.set()

    async def load_adapter(self, adapter: AdapterRef) -> None:
        self._check_open()
        if self.full_weights:
            await self._load_weights(adapter)
            return
        await self._residency.load(adapter)

    async def unload_adapter(self, adapter: AdapterRef) -> None:
        if self.full_weights:
            return  # one version's weights at a time: the next load replaces them
        await self._residency.unload(adapter)  # after close() it does nothing

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        error = EngineDeadError(f"engine {self.name} closed")
        for item in [*self._running, *self._queue]:
            item.cancelled = True  # the worker stops at its next step
            if not item.future.done():
                item.future.set_exception(error)
        self._queue.clear()
        if self._batch_task is not None:
            self._batch_task.cancel()
        await self._residency.close()  # its loads and deletes cancelled; the worker's adapters go with the model
        await asyncio.gather(*[t for t in [self._batch_task] if t is not None], return_exceptions=True)
        await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)
        with self._side_lock:  # side jobs the shut-down worker will not run (their callers gave up on them)
            for done, _, _ in self._side:
                done.cancel()
            self._side.clear()
        self._model = None
        self._decoder = None
        self._peft = None
        self._peft_loaded, self._slot_of, self._free_slots, self._slot_configs, self._slot_params = [], {}, [], {}, {}
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        log.info("engine_closed", engine=self.name, **vars(self.stats))

    # ------------------------------------------------------------------ event-loop side

    def _check_open(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        if self._closed:
            raise EngineDeadError(f"engine {self.name} closed")
        if not self._started:
            raise EngineDeadError(f"engine {self.name} was not started")

    def _check_request(self, request: GroupRequest) -> None:
        check_group_request(request, (self._max_positions, f"the model's {self._max_positions} positions"),
                            self._vocab_size)

    def _submit_load(self, resident: Resident[Path]) -> asyncio.Future[None]:
        return self._submit_side(self._load_adapter, resident.ref)

    def _submit_delete(self, resident: Resident[Path]) -> asyncio.Future[None]:
        """Submitted when called: the worker deletes it before any job submitted later."""
        return self._submit_side(self._delete_adapter, resident.ref.name)

    def _submit_side(self, fn: Callable[..., None], *args: Any) -> asyncio.Future[None]:
        """Queue a side job; the worker runs it between forward passes of a batch, or as a job of its own."""
        done: Future[None] = Future()
        with self._side_lock:
            self._side.append((done, fn, args))
        self._executor.submit(self._run_side_jobs)  # runs whatever no batch ran before it
        return asyncio.wrap_future(done)

    async def _batch_loop(self) -> None:
        """Consumes queued requests; produces Generations (set on each request's future as its
        group finishes); waits on `_wakeup` while the queue is empty and on the worker while decoding."""
        loop = asyncio.get_running_loop()
        while True:
            while not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
            batch = self._take_batch()
            self.stats.batches += 1
            self._running = batch
            try:
                await loop.run_in_executor(self._executor, self._decode_batch, batch, loop)
            except asyncio.CancelledError:
                for item in batch:
                    item.cancelled = True
                raise
            except Exception as e:  # one failed batch fails its own requests; the engine keeps serving
                log.exception("batch_failed", engine=self.name, groups=[it.request.group_id for it in batch])
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(e)
            finally:
                self._running = []
            for item in batch:
                if not item.future.done() and not item.cancelled:
                    item.future.set_exception(EngineDeadError(
                        f"engine {self.name} finished a batch without a result for group {item.request.group_id}"))

    def _take_batch(self) -> list[_Pending]:
        """The queue head's weights and every queued group on the same weights, up to max_batch_groups."""
        weights = self._queue[0].weights
        batch: list[_Pending] = []
        rest: deque[_Pending] = deque()
        for item in self._queue:
            if item.weights == weights and len(batch) < self.cfg.max_batch_groups:
                batch.append(item)
            else:
                rest.append(item)
        self._queue = rest
        return batch

    def _deliver(self, item: _Pending, generation: Generation) -> None:
        if not item.future.done():
            item.future.set_result(generation)

    def _on_batch_loop_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        self._dead = EngineDeadError(f"engine {self.name}: batching task failed: {task.exception()!r}")
        log.error("engine_dead", engine=self.name, error=repr(task.exception()))
        for item in [*self._running, *self._queue]:
            item.cancelled = True
            if not item.future.done():
                item.future.set_exception(self._dead)
        self._queue.clear()

    # ------------------------------------------------------------------ worker thread

    def _load_model(self) -> None:
        model = models.load_causal_lm(self.model_path, str(self.device), self.dtype, self.trust_remote_code)
        self._vocab_size = int(model.config.vocab_size)
        self._max_positions = int(model.config.max_position_embeddings)
        self._eos_ids = self._eos_arg if self._eos_arg is not None else frozenset(self._default_eos_ids(model))
        self._decoder = GroupDecoder(model, sampling=self.sampling, eos_ids=self._eos_ids, device=self.device)
        self._model = model
        if self.deterministic and not self.full_weights:
            from peft import LoraConfig, get_peft_model

            with models.building_modules():  # LoRA B starts at 0: the wrapped model computes the base
                self._peft = get_peft_model(model, LoraConfig(r=1, target_modules="all-linear", task_type="CAUSAL_LM"),
                                            adapter_name=_WRAPPER_ADAPTER)
        # a (re)start holds the base model; start() awaits this job before anything reads these
        self._worker_weights = self._weights = AdapterRef.base()

    def _default_eos_ids(self, model: torch.nn.Module) -> list[int]:
        eos = None
        gen_path = self.model_path / "generation_config.json"
        if gen_path.is_file():
            eos = json.loads(gen_path.read_text()).get("eos_token_id")
        if eos is None:
            eos = model.config.eos_token_id
        if eos is None:
            eos = models.load_tokenizer(self.model_path).eos_token_id
        if eos is None:
            raise ConfigError(f"model {str(self.model_path)!r} names no end-of-sequence token; pass eos_token_ids")
        return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]

    def _load_adapter(self, adapter: AdapterRef) -> None:
        """Load a version: into the peft adapter of an unloaded version with the same config when
        there is one (its tensors overwritten in place, where peft's load_adapter injects new layers,
        slower with every adapter it holds), else as a new peft adapter."""
        t0 = time.monotonic()
        config = _config_of(adapter)
        slot = self._free_slot(config)
        if slot is not None:
            self._fill_slot(slot, adapter)
        else:
            slot = adapter.name
            with contextlib.ExitStack() as stack:
                path = adapter.path
                if path is None:  # handed over in memory: peft injects layers from a directory, once per slot
                    path = stack.enter_context(tempfile.TemporaryDirectory(prefix="adapter-"))
                    write_adapter(Path(path), _tensors_of(adapter), config)
                try:
                    with models.building_modules():
                        if self._peft is None:
                            self._peft = PeftModel.from_pretrained(self._model, path, adapter_name=slot,
                                                                   is_trainable=False)
                        else:
                            self._peft.load_adapter(path, adapter_name=slot, is_trainable=False)
                except Exception as e:  # any failure to read the published files is this adapter's fault
                    if self._peft is not None and slot in self._peft.peft_config:
                        self._peft.delete_adapter(slot)
                    raise AdapterCorruptError(
                        f"adapter version {adapter.version}: peft could not load {_where(adapter)}: {e}") from e
            self._slot_configs[slot] = config
        self._peft_loaded.append(adapter.name)
        self._slot_of[adapter.name] = slot
        # A first load that failed after peft injected its layers leaves a stray adapter behind.
        for stray in set(self._peft.peft_config) - {*self._slot_of.values(), *self._free_slots, _WRAPPER_ADAPTER}:
            self._peft.delete_adapter(stray)
        log.debug("adapter_loaded", engine=self.name, version=adapter.version, adapter=adapter.name, slot=slot,
                  seconds=round(time.monotonic() - t0, 4))

    def _fill_slot(self, slot: str, adapter: AdapterRef) -> None:
        """Copy `adapter`'s tensors into the free peft adapter `slot`, after checking every name,
        shape and value: a file that does not fit is refused with nothing copied, the slot kept free."""
        tensors = _tensors_of(adapter)
        params = self._slot_params.get(slot)
        if params is None:  # once per slot: its parameters under the names the file uses
            marker = f".{slot}."
            params = self._slot_params[slot] = {n.replace(marker, "."): p for n, p in self._peft.named_parameters()
                                                if marker in n}
        problems = sorted(set(params) ^ set(tensors))[:3] or [
            k for k, t in tensors.items() if t.shape != params[k].shape][:3]
        if not problems and not _all_finite(list(tensors.values())):
            problems = [k for k, t in tensors.items() if not torch.isfinite(t).all()][:3]
        if problems:
            raise AdapterCorruptError(f"adapter version {adapter.version}: {_where(adapter)} does not hold the "
                                      f"tensors its adapter_config.json describes (first: {problems})")
        with torch.no_grad():
            for k, t in tensors.items():
                params[k].copy_(t)
        self._free_slots.remove(slot)

    def _run_side_jobs(self, between_steps: bool = False) -> None:
        """Run queued side jobs in order (on the worker). Between a batch's forward passes, stop at the
        first one that could change the weights the batch runs on: a load with no free slot to fill."""
        while True:
            with self._side_lock:  # the loop only appends: the head stays ours until this thread pops it
                if not self._side:
                    return
                done, fn, args = self._side[0]
            if between_steps and fn == self._load_adapter and (
                    done is self._blocked or self._slot_for(args[0]) is None):
                self._blocked = done
                return
            with self._side_lock:
                self._side.popleft()
            if not done.set_running_or_notify_cancel():
                continue  # its caller gave up on it (a closing residency)
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # the caller's to handle, as from run_in_executor
                done.set_exception(e)

    def _between_steps(self) -> None:
        """The decoder's hook: side jobs that may run beside the batch, outside inference mode (the
        parameters they write are the model's own, read by later batches)."""
        if self._side:
            with torch.inference_mode(False):
                self._run_side_jobs(between_steps=True)

    def _slot_for(self, adapter: AdapterRef) -> str | None:
        """A free slot `adapter`'s load would fill, or None (a load that peft would inject, or fail)."""
        if not self._free_slots:
            return None
        try:
            return self._free_slot(_config_of(adapter))
        except (OSError, AdapterCorruptError):
            return None  # its load says what is wrong, after the batch

    def _free_slot(self, config: bytes) -> str | None:
        """The oldest free peft adapter made from the same adapter_config.json, or None."""
        return next((name for name in self._free_slots if self._slot_configs[name] == config), None)

    def _delete_adapter(self, name: str) -> None:
        """Unload a version: its peft adapter stays, as a free slot the next version's tensors fill."""
        if name not in self._peft_loaded or self._peft is None:
            return
        self._peft_loaded.remove(name)
        slot = self._slot_of.pop(name)
        self._free_slots.append(slot)
        log.debug("adapter_unloaded", engine=self.name, adapter=name, slot=slot)

    @contextlib.contextmanager
    def _weights_of(self, adapter: AdapterRef) -> Iterator[None]:
        """Forward passes inside use the weights of `adapter` (version 0: the base model)."""
        if self.full_weights:
            held = self._worker_weights
            if held is None or held.version != adapter.version:
                raise GenerationError(f"engine {self.name} holds the full weights of "
                                      f"{'no version' if held is None else f'version {held.version}'}, "
                                      f"not version {adapter.version}")
            yield
            return
        if adapter.version == 0:
            if self._peft is not None:  # LoRA layers are in the model, holding versions or free slots
                with self._peft.disable_adapter():
                    yield
            else:
                yield
            return
        if adapter.name not in self._peft_loaded or self._peft is None:
            raise AdapterNotFoundError(f"engine {self.name}: adapter version {adapter.version} "
                                       f"({adapter.name}) is not loaded")
        self._peft.set_adapter(self._slot_of[adapter.name])
        yield

    def _decode_batch(self, batch: list[_Pending], loop: asyncio.AbstractEventLoop) -> None:
        """Sample every row of `batch` (one adapter) to the end; hand each group to the loop as it finishes."""
        groups = [it for it in batch if not it.cancelled]
        if not groups:
            return
        assert self._decoder is not None  # made by start(), which every caller went through

        def finished(gi: int, completions: tuple[Completion, ...]) -> None:
            g = groups[gi]
            generation = Generation(request=g.request, completions=completions, version=g.adapter.version,
                                    engine=self.name, t_start=g.t_start, t_end=time.monotonic())
            loop.call_soon_threadsafe(self._deliver, g, generation)

        with self.busy, torch.inference_mode(), self._weights_of(groups[0].adapter):
            self._decoder.decode([g.request for g in groups], generator=self._generator,
                                 cancelled=lambda gi: groups[gi].cancelled, finished=finished,
                                 sampled=self._count_tokens, between=self._between_steps)

    def _count_tokens(self, count: int) -> None:
        self.stats.tokens_generated += count

    # ------------------------------------------------------------------ full weights

    def _holding(self) -> str:
        """The weights the engine serves, for error messages."""
        held = self._weights
        text = "no version (a weight copy failed)" if held is None else f"version {held.version} ({held.name})"
        if self._swap is not None:
            text += f", loading version {self._swap[0].version} ({self._swap[0].name})"
        return text

    async def _await_weights(self, request: GroupRequest, adapter: AdapterRef) -> None:
        """Return once the model holds `adapter`'s weights (waiting for its load if under way); refuse any other."""
        while self._swap is not None and same_version(self._swap[0], adapter):
            try:
                await self._wait_swap(self._swap[1])
            except AdapterError as e:
                raise GenerationError(f"engine {self.name}: group {request.group_id} waited for version "
                                      f"{adapter.version}, whose weights did not load: {e}") from e
            self._check_open()
        if self._swap is not None or not same_version(self._weights, adapter):
            raise GenerationError(f"engine {self.name} holds the full weights of {self._holding()}; "
                                  f"group {request.group_id} asked for version {adapter.version} ({adapter.name})")

    async def _wait_swap(self, task: asyncio.Task[None]) -> None:
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and not (current is not None and current.cancelling()):
                raise EngineDeadError(f"engine {self.name} closed while loading weights") from None
            raise

    async def _load_weights(self, adapter: AdapterRef) -> None:
        """Replace the model's weights with `adapter`'s (the base model's for version 0)."""
        while self._swap is not None:
            target, task = self._swap
            if same_version(target, adapter):
                await self._wait_swap(task)
                return
            with contextlib.suppress(AdapterError):  # that load's failure went to its own caller
                await self._wait_swap(task)
            self._check_open()
        if same_version(self._weights, adapter):
            return
        path = self.model_path if adapter.version == 0 else check_model_dir(adapter)
        task = asyncio.get_running_loop().create_task(self._swap_job(adapter, path),
                                                      name=f"{self.name}-weights-v{adapter.version}")
        # Retrieve the outcome even if every awaiter was cancelled (no "never retrieved" noise).
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self._swap = (adapter, task)
        await self._wait_swap(task)

    async def _swap_job(self, adapter: AdapterRef, path: Path) -> None:
        """Waits until no generate call is queued or running, then replaces the weights on the worker."""
        t0 = time.monotonic()
        try:
            # Queued groups are not worker jobs yet, so submission order alone would let them run
            # after the copy: every one of them finishes on the old weights first.
            while self._calls:
                self._idle.clear()
                await self._idle.wait()
            self._check_open()
            t_drained = time.monotonic()
            await asyncio.get_running_loop().run_in_executor(self._executor, self._replace_weights, adapter, path)
        finally:
            self._weights = self._worker_weights
            self._swap = None
        log.info("weights_loaded", engine=self.name, version=adapter.version, path=str(path),
                 drain_s=round(t_drained - t0, 4), seconds=round(time.monotonic() - t_drained, 4))

    def _replace_weights(self, adapter: AdapterRef, path: Path) -> None:
        """Worker: read and check every tensor of `path`, then copy them into the model's parameters."""
        pairs = self._stage_weights(adapter, path)
        self._worker_weights = None  # from the first tensor copied to the last, no version is whole
        try:
            with torch.no_grad():
                for param, value in pairs:
                    param.copy_(value)
        except Exception as e:  # already-copied tensors cannot be taken back; the next load replaces them
            raise AdapterError(f"engine {self.name}: copying the weights of version {adapter.version} from "
                               f"{str(path)!r} failed half-way ({type(e).__name__}: {e}); the engine serves no "
                               "version until a load succeeds") from e
        self._worker_weights = adapter

    def _stage_weights(self, adapter: AdapterRef, path: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Worker: (model tensor, new value) for every distinct tensor of `path`; nothing is written."""
        assert self._model is not None  # loaded by start()
        return stage_weights(self._model, path, f"engine {self.name}: version {adapter.version}")


def _check_version(adapter: AdapterRef) -> Path | None:
    """On the loop, before a load: a version's directory (`check_adapter_dir`), or nothing for one
    handed over in memory (its load checks the payload's sha256)."""
    return None if adapter.shared is not None else check_adapter_dir(adapter)


def _where(adapter: AdapterRef) -> str:
    return "the adapter handed over in memory" if adapter.path is None else repr(adapter.path)


def _config_of(adapter: AdapterRef) -> bytes:
    """The bytes of a version's adapter_config.json (from its directory, or its payload)."""
    if adapter.shared is not None:
        return bytes(adapter.shared["config"])
    assert adapter.path is not None  # check_adapter_dir refused it on the loop
    return (Path(adapter.path) / "adapter_config.json").read_bytes()


def _tensors_of(adapter: AdapterRef) -> dict[str, torch.Tensor]:
    """A version's adapter tensors, read and checked: from its safetensors file, or its payload
    (whose sha256 must be the trainer's); AdapterCorruptError naming the version otherwise."""
    from safetensors.torch import load

    from pipeline.engines.shared_weights import adapter_tensors
    from pipeline.store.durable import read_file

    assert adapter.shared is not None or adapter.path is not None  # check_adapter_dir refused it on the loop
    try:
        if adapter.shared is not None:
            return adapter_tensors(adapter.shared)[0]
        # one read and a parse from memory: a third of load_file's time (its mmap slices every tensor)
        return load(read_file(Path(adapter.path) / "adapter_model.safetensors"))
    except Exception as e:  # a torn or foreign file, or a payload that changed on its way
        raise AdapterCorruptError(f"adapter version {adapter.version}: cannot read {_where(adapter)}: {e}") from e


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every value of every tensor is finite: one check over them all (one per tensor costs
    more on an adapter's many small tensors)."""
    if not tensors:
        return True
    dtypes = {t.dtype for t in tensors}
    flat = [t.reshape(-1) for t in tensors] if len(dtypes) == 1 else [t.reshape(-1).float() for t in tensors]
    return bool(torch.isfinite(torch.cat(flat)).all())
