"""The transformers engine: batched group sampling on CPU or GPU, adapters through peft.

Concurrent `generate` calls queue their groups; one batching task takes the queue head's
version and every queued group of that version (up to `max_batch_groups`) and samples all their
rows in one decoding loop (left padding, explicit position ids, a KV cache, float32 logits).

Invariants (beyond the Engine protocol's):
- All torch work (model load, adapter load and delete, decoding) runs on one worker thread owned
  by the engine, one job at a time, in submission order; never on the event loop.
- Bookkeeping on the event loop (`loaded_versions`, which requests use which version) describes
  the state after every job submitted so far; because jobs run in submission order, a version
  chosen for eviction is deleted before any later job could need it again.
- A decoding batch holds groups of a single version. Groups of other versions wait for the next
  batch (sub-batches by version, in queue order), rather than use peft's mixed-batch
  `adapter_names=`, so every forward pass is a plain single-adapter LoRA forward.
- Each sampled token's log-prob is taken under the processed distribution it was sampled from
  (temperature, top-k, top-p, min-p applied in that order); with the default sampling settings
  this is the log-softmax of the raw logits, i.e. the policy's own log-prob.
- A row ends at an end-of-sequence token (kept, with its log-prob; "stop") or after
  `max_new_tokens` tokens ("length"). Finished and cancelled rows leave the batch between steps.
- A version with pending or running requests is never unloaded; when every loaded version is in
  use, the engine exceeds `max_loaded_adapters` rather than break a running group.
- Full-weight updates (`full_weights=True`): no peft; the model holds one version's weights.
  `load_adapter(v)` waits until none of the engine's requests is queued or running (queued
  groups are not worker jobs yet, so job order alone would not keep them on the old weights),
  then, on the worker, reads v's safetensors (the base model's directory for version 0) into a
  staging state dict, checks every name and shape against the model and copies the tensors
  into the model's own parameters in place. A directory that does not check out is refused
  before any weight is written: the engine keeps serving the previous version intact.
  `generate` for any version but the one held (or, while a load is under way, the one being
  loaded, which the call waits for) raises GenerationError: a group is never sampled with
  other weights than its label. `unload_adapter` does nothing.
- `close()` fails every pending request with EngineDeadError and shuts the worker thread down;
  `start()` after it starts afresh on a new worker thread (the model loaded again, no adapter).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import structlog
import torch
from peft import PeftModel
from safetensors import safe_open
from transformers import DynamicCache

from pipeline import models
from pipeline.config import SamplingConfig, TransformersEngineConfig
from pipeline.devices import sched_idle
from pipeline.engines.base import check_group_request, check_model_dir, held_versions, same_version
from pipeline.errors import (
    AdapterCorruptError,
    AdapterError,
    AdapterNotFoundError,
    ConfigError,
    EngineDeadError,
    GenerationError,
)
from pipeline.metrics import BusyMeter
from pipeline.types import AdapterRef, Completion, Generation, GroupRequest

log = structlog.get_logger(__name__)


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


def process_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Log-probs of the distribution tokens are sampled from: logits [R, V] float32 -> [R, V].

    Tokens removed by top-k, top-p or min-p get -inf. The defaults leave log_softmax(logits).
    """
    if sampling.temperature != 1.0:
        logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens more likely than it already reach top_p (the first always stays).
        drop_sorted = (probs.cumsum(-1) - probs) > sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if sampling.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < sampling.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return logits.log_softmax(-1)


def check_adapter_dir(adapter: AdapterRef) -> Path:
    """Refuse an adapter directory that peft could not load, naming the path."""
    if adapter.path is None:
        raise AdapterNotFoundError(f"adapter version {adapter.version} ({adapter.name}) has no path")
    path = Path(adapter.path)
    if not path.is_dir():
        raise AdapterNotFoundError(f"adapter version {adapter.version}: directory {str(path)!r} does not exist")
    if not (path / "adapter_config.json").is_file():
        raise AdapterCorruptError(f"adapter version {adapter.version}: {str(path)!r} has no adapter_config.json")
    if not any(path.glob("*.safetensors")):
        raise AdapterCorruptError(f"adapter version {adapter.version}: {str(path)!r} has no safetensors weights")
    return path


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
        # pending or running generate calls per version; kept across a restart, where calls made
        # before the close still give their counts back as they unwind
        self._in_use: Counter[int] = Counter()
        self._closes = 0  # close() calls so far: a wait that spans one learns the engine closed under it
        self.full_weights = full_weights
        self._idle = asyncio.Event()  # set whenever no generate call is queued or running (tracks _in_use)
        self._fresh_state()

    def _fresh_state(self) -> None:
        """The state of an engine not yet started: set at construction and again by a restart."""
        background = self.cfg.sched_idle and self.device.type == "cpu"  # computing on cores the event loop needs
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.name}-torch",
                                            initializer=sched_idle if background else None)

        # Event-loop state.
        self._queue: deque[_Pending] = deque()
        self._wakeup = asyncio.Event()
        self._running: list[_Pending] = []
        self._batch_task: asyncio.Task[None] | None = None
        self._loaded: dict[int, AdapterRef] = {}  # versions loaded or being loaded (not 0)
        self._loading: dict[int, asyncio.Task[None]] = {}
        self._unload_requested: set[int] = set()
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
        self._peft: PeftModel | None = None
        self._peft_names: dict[int, str] = {}  # version -> peft adapter name, as peft holds them
        self._cache_kwarg = "past_key_values"
        self._has_logits_to_keep = False
        self._vocab_size = 0
        self._max_positions = 0
        self._worker_weights: AdapterRef | None = AdapterRef.base()  # what the parameters hold now

    # ------------------------------------------------------------------ public API

    @property
    def loaded_versions(self) -> tuple[int, ...]:
        """Adapter versions loaded or being loaded (the base model, version 0, is not listed)."""
        if self.full_weights:
            return held_versions(self._weights)
        return tuple(sorted(self._loaded))

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
        version = adapter.version
        self._in_use[version] += 1
        item: _Pending | None = None
        try:
            if version != 0 and not self.full_weights:
                await self._ensure_loaded(adapter, own_use=1)
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
            self._release(version)

    async def load_adapter(self, adapter: AdapterRef) -> None:
        self._check_open()
        if self.full_weights:
            await self._load_weights(adapter)
            return
        if adapter.version == 0:
            return
        self._unload_requested.discard(adapter.version)
        await self._ensure_loaded(adapter)

    async def unload_adapter(self, adapter: AdapterRef) -> None:
        if self.full_weights:
            return  # one version's weights at a time: the next load replaces them
        version = adapter.version
        if self._closed or version == 0 or version not in self._loaded:
            return
        if self._loaded[version].name != adapter.name:
            return  # another run's adapter under the same version number: not this one
        task = self._loading.get(version)
        if task is not None:
            # A failed load leaves nothing to unload; its error went to whoever asked for it.
            with contextlib.suppress(AdapterError):
                await asyncio.shield(task)
        if version not in self._loaded:
            return
        if self._in_use[version]:
            self._unload_requested.add(version)
            return
        del self._loaded[version]
        await asyncio.get_running_loop().run_in_executor(self._executor, self._delete_adapter, version)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._closes += 1
        error = EngineDeadError(f"engine {self.name} closed")
        for item in [*self._running, *self._queue]:
            item.cancelled = True  # the worker stops at its next step
            if not item.future.done():
                item.future.set_exception(error)
        self._queue.clear()
        tasks = [t for t in [self._batch_task, *self._loading.values()] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)
        self._model = None
        self._peft = None
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

    def _release(self, version: int) -> None:
        """A generate call on `version` ended: unload the version if that was asked and it is now unused."""
        self._in_use[version] -= 1
        if self._in_use[version] > 0:
            return
        del self._in_use[version]
        if not self._in_use:
            self._idle.set()
        if self._closed or version == 0:
            return
        if version in self._unload_requested:
            self._unload_requested.discard(version)
            self._loaded.pop(version, None)
            self._executor.submit(self._delete_adapter, version)
        # Back under the bound once the versions it was exceeded for are free again.
        for v in self._choose_victims(extra=0):
            self._executor.submit(self._delete_adapter, v)

    async def _ensure_loaded(self, adapter: AdapterRef, own_use: int = 0) -> None:
        """Make `adapter.version` loaded (loading it now if needed) without blocking the loop.

        `own_use` is how many of the version's in-use counts belong to the caller itself.
        """
        version = adapter.version
        closes = self._closes
        task = self._loading.get(version)
        if task is None:
            known = self._loaded.get(version)
            if known is not None and known.name != adapter.name:
                # The same version number from another run (an engine reused across runs): adapters
                # are identified by name, so replace it, unless a group still samples with it.
                if self._in_use[version] > own_use:
                    raise AdapterError(f"version {version} is loaded as {known.name!r} and still in use; "
                                       f"cannot load {adapter.name!r} under the same version number")
                del self._loaded[version]
                await asyncio.get_running_loop().run_in_executor(self._executor, self._delete_adapter, version)
                known = None
            if known is not None:
                return
            check_adapter_dir(adapter)
            victims = self._choose_victims()
            self._loaded[version] = adapter
            task = asyncio.get_running_loop().create_task(
                self._load_job(adapter, victims), name=f"{self.name}-load-v{version}")
            # Retrieve the outcome even if every awaiter was cancelled (no "never retrieved" noise).
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            self._loading[version] = task
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            # closed under us, even if started again since: the load was cancelled, not this call
            if task.cancelled() and self._closes != closes and not (current is not None and current.cancelling()):
                raise EngineDeadError(f"engine {self.name} closed while loading adapter version {version}") from None
            raise

    def _choose_victims(self, extra: int = 1) -> list[int]:
        """Versions to forget so that `extra` more fit under `max_loaded_adapters`: the oldest unused.

        The caller deletes them on the worker (in submission order, before anything loaded later).
        """
        excess = len(self._loaded) + extra - self.max_loaded_adapters
        if excess <= 0:
            return []
        idle = sorted(v for v in self._loaded if not self._in_use[v] and v not in self._loading)
        victims = idle[:excess]
        for v in victims:
            del self._loaded[v]
            self._unload_requested.discard(v)
        if len(victims) < excess and extra:
            log.warning("adapter_bound_exceeded", engine=self.name, bound=self.max_loaded_adapters,
                        loaded=sorted(self._loaded), in_use=sorted(v for v in self._in_use if self._in_use[v]))
        return victims

    async def _load_job(self, adapter: AdapterRef, victims: list[int]) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._load_adapter, adapter, victims)
        except BaseException:
            if self._loaded.get(adapter.version) is adapter:
                del self._loaded[adapter.version]
            raise
        finally:
            self._loading.pop(adapter.version, None)

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
        """The queue head's version and every queued group of that version, up to max_batch_groups."""
        version = self._queue[0].adapter.version
        batch: list[_Pending] = []
        rest: deque[_Pending] = deque()
        for item in self._queue:
            if item.adapter.version == version and len(batch) < self.cfg.max_batch_groups:
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
        params = inspect.signature(type(model).forward).parameters
        # transformers >= 5.2x names the cache argument `cache` (and warns on `past_key_values`).
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._has_logits_to_keep = "logits_to_keep" in params
        self._vocab_size = int(model.config.vocab_size)
        self._max_positions = int(model.config.max_position_embeddings)
        self._eos_ids = self._eos_arg if self._eos_arg is not None else frozenset(self._default_eos_ids(model))
        self._model = model
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

    def _load_adapter(self, adapter: AdapterRef, victims: list[int]) -> None:
        t0 = time.monotonic()
        for v in victims:
            self._delete_adapter(v)
        assert adapter.path is not None  # check_adapter_dir refused it on the loop
        try:
            with models.building_modules():
                if self._peft is None:
                    self._peft = PeftModel.from_pretrained(self._model, adapter.path, adapter_name=adapter.name,
                                                           is_trainable=False)
                else:
                    self._peft.load_adapter(adapter.path, adapter_name=adapter.name, is_trainable=False)
        except Exception as e:  # any failure to read the published files is this adapter's fault
            if self._peft is not None and adapter.name in self._peft.peft_config:
                self._peft.delete_adapter(adapter.name)
            raise AdapterCorruptError(
                f"adapter version {adapter.version}: peft could not load {adapter.path!r}: {e}") from e
        self._peft_names[adapter.version] = adapter.name
        # A first load that failed after peft injected its layers leaves a stray adapter behind.
        for stray in set(self._peft.peft_config) - set(self._peft_names.values()):
            self._peft.delete_adapter(stray)
        log.debug("adapter_loaded", engine=self.name, version=adapter.version, adapter=adapter.name,
                 seconds=round(time.monotonic() - t0, 4), evicted=victims)

    def _delete_adapter(self, version: int) -> None:
        name = self._peft_names.pop(version, None)
        if name is None or self._peft is None:
            return
        others = list(self._peft_names.values())
        if name in self._peft.active_adapters and others:
            self._peft.set_adapter(others[-1])  # peft warns when the active adapter is deleted
        self._peft.delete_adapter(name)
        log.debug("adapter_unloaded", engine=self.name, version=version, adapter=name)

    @contextlib.contextmanager
    def _weights_of(self, version: int) -> Iterator[None]:
        """Forward passes inside use the weights of `version` (0 = the base model)."""
        if self.full_weights:
            held = self._worker_weights
            if held is None or held.version != version:
                raise GenerationError(f"engine {self.name} holds the full weights of "
                                      f"{'no version' if held is None else f'version {held.version}'}, "
                                      f"not version {version}")
            yield
            return
        if version == 0:
            if self._peft is not None and self._peft_names:
                with self._peft.disable_adapter():
                    yield
            else:
                yield
            return
        name = self._peft_names.get(version)
        if name is None or self._peft is None:
            raise AdapterNotFoundError(f"engine {self.name}: adapter version {version} is not loaded")
        self._peft.set_adapter(name)
        yield

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 cache: DynamicCache) -> torch.Tensor:
        """Next-token logits [R, V] float32 for input_ids, attention_mask (past + new), position_ids [R, T]."""
        kwargs = {self._cache_kwarg: cache}
        if self._has_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        assert self._model is not None
        out = self._model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=True, **kwargs)
        return out.logits[:, -1, :].float()

    def _decode_batch(self, batch: list[_Pending], loop: asyncio.AbstractEventLoop) -> None:
        """Sample every row of `batch` (one version) to the end; hand each group to the loop as it finishes."""
        groups = [it for it in batch if not it.cancelled]
        if not groups:
            return
        with self.busy, torch.inference_mode(), self._weights_of(groups[0].adapter.version):
            self._decode(groups, loop)

    def _decode(self, groups: list[_Pending], loop: asyncio.AbstractEventLoop) -> None:
        assert self._model is not None  # loaded by start(), which every caller went through
        dev = self.device
        pad = 0  # padding is masked everywhere: any id in the vocabulary serves
        width = max(len(g.request.prompt.token_ids) for g in groups)
        # Rows are group-contiguous and stay so as rows leave, so each group is one slice of the batch.
        row_group: list[int] = []
        prompt_ids = torch.full((len(groups), width), pad, dtype=torch.long)
        prompt_mask = torch.zeros((len(groups), width), dtype=torch.long)
        for gi, g in enumerate(groups):
            ids = g.request.prompt.token_ids
            prompt_ids[gi, width - len(ids):] = torch.as_tensor(ids, dtype=torch.long)
            prompt_mask[gi, width - len(ids):] = 1
            row_group.extend([gi] * g.request.n)
        expand = torch.as_tensor(row_group, dtype=torch.long)
        input_ids = prompt_ids[expand].to(dev)  # [R, P]
        mask = prompt_mask[expand].to(dev)  # [R, P]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [R, P]; left padding shifts every row to start at 0
        generators = [torch.Generator(device=dev).manual_seed(g.request.seed) if g.request.seed is not None
                      else self._generator for g in groups]

        tokens: list[list[int]] = [[] for _ in row_group]
        logprobs: list[list[float]] = [[] for _ in row_group]
        reasons: list[str] = ["" for _ in row_group]
        rows_left = [g.request.n for g in groups]
        active = list(range(len(row_group)))  # original row index of each batch row

        cache = DynamicCache(config=self._model.config)
        logits = self._forward(input_ids, mask, positions, cache)  # [R, V]
        next_pos = positions[:, -1] + 1  # [R]
        while True:
            lp = process_logits(logits, self.sampling)  # [R, V]
            sampled = torch.empty(len(active), dtype=torch.long, device=dev)
            start = 0
            while start < len(active):  # one slice per group, sampled with that group's generator
                gi = row_group[active[start]]
                stop = start + 1
                while stop < len(active) and row_group[active[stop]] == gi:
                    stop += 1
                sampled[start:stop] = torch.multinomial(lp[start:stop].exp(), 1, generator=generators[gi]).squeeze(1)
                start = stop
            sampled_lp = lp.gather(1, sampled.unsqueeze(1)).squeeze(1)
            self.stats.tokens_generated += len(active)

            keep: list[int] = []
            for i, (tok, tok_lp) in enumerate(zip(sampled.tolist(), sampled_lp.tolist())):
                row = active[i]
                g = groups[row_group[row]]
                if g.cancelled:
                    continue
                tokens[row].append(tok)
                logprobs[row].append(tok_lp)
                if tok in self._eos_ids:
                    reasons[row] = "stop"
                elif len(tokens[row]) >= g.request.max_new_tokens:
                    reasons[row] = "length"
                else:
                    keep.append(i)
                    continue
                rows_left[row_group[row]] -= 1
                if rows_left[row_group[row]] == 0:
                    loop.call_soon_threadsafe(self._deliver, g, self._generation(g, row_group[row], row_group,
                                                                                   tokens, logprobs, reasons))
            if not keep:
                return
            if len(keep) < len(active):
                sel = torch.as_tensor(keep, dtype=torch.long, device=dev)
                cache.batch_select_indices(sel)
                mask, next_pos, sampled = mask[sel], next_pos[sel], sampled[sel]
                active = [active[i] for i in keep]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            logits = self._forward(sampled.unsqueeze(1), mask, next_pos.unsqueeze(1), cache)
            next_pos = next_pos + 1

    def _generation(self, g: _Pending, gi: int, row_group: list[int], tokens: list[list[int]],
                    logprobs: list[list[float]], reasons: list[str]) -> Generation:
        completions = tuple(
            Completion(token_ids=np.asarray(tokens[r], dtype=np.int64),
                       logprobs=np.asarray(logprobs[r], dtype=np.float32),
                       finish_reason=reasons[r])
            for r in range(len(row_group)) if row_group[r] == gi
        )
        return Generation(request=g.request, completions=completions, version=g.adapter.version,
                          engine=self.name, t_start=g.t_start, t_end=time.monotonic())

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
            while self._in_use:
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
        """Worker: (model tensor, new value in its dtype) for every distinct tensor; nothing is written.

        Refuses, naming the path, a directory whose config is not this model's kind, whose
        safetensors do not read, or whose tensor names and shapes are not exactly the model's
        (a tied tensor, like lm_head.weight tied to embed_tokens.weight, may be omitted).
        """
        assert self._model is not None  # loaded by start()

        def bad(why: str) -> AdapterCorruptError:
            return AdapterCorruptError(f"engine {self.name}: version {adapter.version}: {str(path)!r} {why}")

        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise bad(f"has no readable config.json ({e})") from e
        model_type = config.get("model_type") if isinstance(config, dict) else None
        if model_type != self._model.config.model_type:
            raise bad(f"holds a {model_type!r} model; the engine serves {self._model.config.model_type!r}")
        # persistent tensors by name; tied names share one tensor object
        expected: dict[str, torch.Tensor] = self._model.state_dict(keep_vars=True)
        staged: dict[str, torch.Tensor] = {}
        for file in self._weight_files(path, bad):
            try:
                with safe_open(str(file), framework="pt", device="cpu") as st:
                    for name in st.keys():
                        target = expected.get(name)
                        if target is None:
                            raise bad(f"{file.name} holds tensor {name!r}, which the model does not have")
                        if name in staged:
                            raise bad(f"holds tensor {name!r} twice (again in {file.name})")
                        shape = list(st.get_slice(name).get_shape())
                        if shape != list(target.shape):
                            raise bad(f"{file.name}: tensor {name!r} has shape {shape}, the model's is "
                                      f"{list(target.shape)}")
                        value = st.get_tensor(name)
                        if value.is_floating_point() != target.is_floating_point():
                            raise bad(f"{file.name}: tensor {name!r} is {value.dtype}, the model's is {target.dtype}")
                        staged[name] = value.to(target.dtype)
            except AdapterCorruptError:
                raise
            except Exception as e:  # safetensors' own error (truncated file, bad header) or a read error
                raise bad(f"{file.name} does not read as safetensors: {type(e).__name__}: {e}") from e
        tied: dict[int, list[str]] = {}
        for name, tensor in expected.items():
            tied.setdefault(id(tensor), []).append(name)
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        missing: list[str] = []
        for names in tied.values():
            present = [n for n in names if n in staged]
            if not present:
                missing.append(names[0])
                continue
            value = staged[present[0]]
            for other in present[1:]:
                if not torch.equal(staged[other], value):
                    raise bad(f"holds different values for the tied tensors {present[0]!r} and {other!r}")
            pairs.append((expected[names[0]], value))
        if missing:
            raise bad(f"lacks {len(missing)} of the model's tensors: {', '.join(missing[:5])}"
                      + (", ..." if len(missing) > 5 else ""))
        return pairs

    @staticmethod
    def _weight_files(path: Path, bad: Callable[[str], AdapterCorruptError]) -> list[Path]:
        """The safetensors files of a model directory: those its shard index names, or all of them."""
        index = path / "model.safetensors.index.json"
        if not index.is_file():
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise bad("has no safetensors weights")
            return files
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise bad(f"has an unreadable {index.name} ({type(e).__name__}: {e})") from e
        for name in names:
            if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors"):
                raise bad(f"{index.name} names {name!r}, not a safetensors file of the directory")
            if not (path / name).is_file():
                raise bad(f"{index.name} names {name!r}, which is missing")
        return [path / n for n in names]
