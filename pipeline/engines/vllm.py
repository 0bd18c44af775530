"""The vLLM engine: one AsyncLLM in this process, awaited directly.

vLLM is imported only by `start()`, so `import pipeline.engines.vllm` works where vLLM is not
installed (the CPU suite); `start()` there raises EngineDeadError with the install hint.

Invariants (beyond the Engine protocol's):
- One group is one vLLM request: `SamplingParams(n=G, output_kind=FINAL_ONLY, logprobs=0)`. The
  scheduler shares the prompt's KV cache across the group; the caller awaits one final output.
- `logprobs[t]` is the log-prob vLLM reports for the sampled token at position t (`logprobs=0`
  returns exactly that entry). Under the on-policy settings that is the log-softmax of the raw
  logits; with any other setting the engine starts with `logprobs_mode="processed_logprobs"`, so
  they are taken after temperature, penalties and truncation: the distribution actually sampled.
- Every adapter is its own LoRARequest: lora_name = AdapterRef.name, an int id from a per-engine
  counter that is never reused, the directory as published. Never `load_inplace=True` (with
  vLLM 0.24.0 it generated with weights matching neither version; docs/architecture.md#measurements-behind-the-code).
- Which adapters stay is decided by a `residency.Residency` (bound: max_loras). An adapter with
  requests in flight is never removed, so a group that started on version k ends on k. Loading
  version v removes the idle adapters older than v - max_staleness and then the oldest idle ones
  until at most max_loras are resident; busy ones go when their last request ends. vLLM gets a
  removal before the add_lora it makes room for: the removal's task is created first, and
  AsyncLLM's client sends a call to the engine core in its task's first step.
- `max_loras` (adapters resident on the GPU at once) >= max_staleness + 1, so every version a
  running group may still use fits into one scheduler step next to the others.
- The version is checked, not assumed: `RequestOutput.lora_request` must be the LoRARequest sent.
- vLLM starts without a tokenizer (`skip_tokenizer_init`) where the tokenizer's files give its eos
  id (`tokenizer_eos`): prompts and completions are token ids, and each request names that id as a
  stop token, so it stops where vLLM's own tokenizer would have made it stop (generation_config's
  eos ids vLLM reads itself). Otherwise vLLM loads the tokenizer as usual.
- Full-weight updates (`full_weights=True`): no LoRA; the engine holds one version's weights.
  `load_adapter(v)` waits until none of its requests runs, pauses vLLM's scheduler (which also
  clears the prefix cache: blocks computed with the old weights must not be reused), reloads the
  weights in place from v's directory (`reload_weights` on the workers, vLLM's own loader), or
  from the trainer's GPU memory for a version shared there (`AdapterRef.shared`: the worker
  extension pipeline.engines.shared_weights checks its checksum first), and resumes. `generate`
  for any version but the one loaded (or while a load is under way) raises GenerationError, so a
  group is never sampled with other weights than its label. A failed reload leaves no version
  loaded until a load succeeds (the weights may be half-replaced).
- In-flight swaps (`in_flight=True`, pipeline.full_weight_swap = "in_flight"): a load does not wait
  for the requests running. It pauses the scheduler with `mode="keep"` and clears the caches, which
  preempts every running request (its KV blocks freed), reloads, and resumes: each request
  recomputes its KV cache from its prompt and the tokens it has so far with the new weights and
  goes on sampling with them. So every token is sampled, and its log-prob reported, by one
  version's weights over a context those weights computed. A group may ask for the version held or
  an older one (the serving version moves only once every engine has loaded); its Generation keeps
  that version as its label and sets `last_version` to the newest version whose load had begun
  when it finished (every version of its tokens lies in between). A reload that fails aborts the
  requests it paused (their next tokens would come from half-replaced weights) before resuming.
- Cancelling `generate` aborts the vLLM request: `AsyncLLM.generate` aborts on CancelledError
  once its request is queued; this engine aborts again by request id, which also covers a cancel
  that lands while vLLM is still adding the n child requests (before `generate` can abort them).

Placement. vLLM's engine core runs in a child process (`CoreEngineProcManager` starts
`EngineCoreProc.run_engine_core` through multiprocessing; with one GPU the uniprocess executor runs
the model in that child, on local rank 0 = the first GPU it can see), forked where this process has
not initialised the CUDA driver (the child inherits this process's imports of torch and vLLM) and
spawned where it has, or as engine.vllm.start_method says (`start_method`). A child's visible GPUs
are fixed by the environment it starts with, so `start()` sets CUDA_VISIBLE_DEVICES to the one
physical GPU that `device` names (mapped through any CUDA_VISIBLE_DEVICES already set) only while
the AsyncLLM is constructed -- the constructor starts the child and blocks until it reports ready --
and restores it right after. Later calls go to the child over ZMQ and the child keeps its own copy
of the environment, so nothing reads the narrowed value again. This process's own CUDA (a trainer on
another GPU) is unaffected once initialised; vLLM's front end does not initialise it (it queries
GPUs through NVML), and `start()` warns if that ever changes. Two engines on one GPU work when
started one after the other, each with its own `gpu_memory_utilization` (<= 0.45 each). Both, and an
engine placed on the second GPU of two, are checked on H200s by tests/engines/test_vllm_gpu.py.

Start-up runs the AsyncLLM constructor in a worker thread: it waits for the engine core
synchronously (tens of seconds even in eager mode, more with torch.compile and CUDA graphs), and a restart in the middle of a run must not stall the loop, the
other engines and the trainer meanwhile. Constructed outside the loop, AsyncLLM starts its output
task lazily, on the first request or adapter load, on the loop that makes it; the engine must
then be used from the event loop that awaited `start()`. CUDA_VISIBLE_DEVICES is process-wide, so
one engine at a time narrows it, under `pipeline.devices.ENV_LOCK`, which the trainer process's
start takes too (spawned inside that window, it saw only the engine's GPU: "invalid device
ordinal" for a trainer on cuda:1); the physical GPU is read under the same lock.

Restart. `close()` aborts what runs and shuts the AsyncLLM down (its engine-core process, and with
it the GPU memory and every adapter); `start()` after `close()` builds a new AsyncLLM on the same
GPU and forgets the old adapters (lora ids keep counting, never reused). A call that was inside the
engine when it closed raises EngineDeadError even if the engine has started again since.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import structlog

from pipeline.config.schema import SamplingConfig, VLLMEngineConfig
from pipeline.devices import ENV_LOCK, cuda_driver_initialized, visible_devices
from pipeline.engines.base import (
    check_adapter_dir,
    check_group_request,
    check_model_dir,
    held_versions,
    same_version,
)
from pipeline.engines.residency import Residency, Resident
from pipeline.errors import (
    AdapterCorruptError,
    AdapterError,
    ConfigError,
    EngineDeadError,
    GenerationError,
    PipelineError,
)
from pipeline.models import model_json
from pipeline.observe.metrics import BusyMeter
from pipeline.types import AdapterRef, Completion, Generation, GroupRequest, Prompt

log = structlog.get_logger(__name__)

INSTALL_HINT = "pip install 'pipeline[vllm]'"

# Set (unless already set) before vLLM is imported; every one is read by vLLM or its children.
ENV_DEFAULTS = {
    # flashinfer is not shipped on our GPU host; without this vLLM's sampler tries to import it.
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",  # models and adapters are local directories; never reach for the hub
    # torch.cuda.is_available() through NVML: cuInit in this process, which torch does not notice,
    # leaves a forked engine core (engine.vllm.start_method = "fork") without CUDA
    "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
}

SHARED_WEIGHTS_WORKER = "pipeline.engines.shared_weights.SharedWeightsWorker"  # vLLM's worker_extension_cls
_FINISH_REASONS = {"stop": "stop", "length": "length"}  # vLLM's finish_reason -> ours; others kept as is
_FAILED_REASONS = ("abort", "error")  # a completion that ended like this is no sample of the policy


def start_method(asked: str, engine: str) -> str:
    """How vLLM starts an engine core from this process (engine.vllm.start_method): fork only where
    this process has not initialised the CUDA driver, whose forked child could not use CUDA. vLLM's
    own check sees only torch's CUDA state; "fork" asked for where it cannot be is logged."""
    if asked == "spawn":
        return "spawn"
    if not cuda_driver_initialized():
        return "fork"
    if asked == "fork":
        log.warning("engine_core_spawned", engine=engine,
                    note='engine.vllm.start_method = "fork", but this process has initialised CUDA (a model built '
                         "or a trainer on a GPU here), so the engine core is spawned instead")
    return "spawn"


def compilation_config(cfg: VLLMEngineConfig, *, lora: bool) -> dict[str, Any]:
    """vLLM's compilation_config for an engine of `cfg` (in process, or `vllm serve`'s flag).

    With LoRA, one graph per size, with LoRA: vLLM would capture each size again without it, for
    batches on no adapter, which a run has only before its first version; the capture costs set-up
    time. Without torch.compile (`torch_compile = false`), whole-batch CUDA graphs alone (vLLM's
    "FULL", which on Hopper's FlashAttention 3 covers mixed prefill and decode batches; vLLM steps
    down where an attention backend cannot): no compile, and half the graphs to capture."""
    config: dict[str, Any] = {"cudagraph_specialize_lora": False} if lora else {}
    if not cfg.torch_compile and not cfg.enforce_eager:
        config.update(mode="NONE", cudagraph_mode="FULL")
    return config


@dataclass
class VLLMEngineStats:
    """Counters since start (all written on the event loop)."""

    requests: int = 0  # generate calls accepted
    cancelled: int = 0  # generate calls cancelled by their caller (their vLLM request aborted)
    failed: int = 0  # generate calls that raised
    tokens: int = 0  # completion tokens returned
    adapters_loaded: int = 0
    adapters_unloaded: int = 0


_Lora = Resident[Any]  # one adapter as this engine holds it in vLLM; its handle is the vllm LoRARequest


def physical_gpu(device: str) -> str:
    """The CUDA_VISIBLE_DEVICES entry for `device` ("cuda:N"), seen through the current setting."""
    if not (device.startswith("cuda:") and device[5:].isdigit()):
        raise ConfigError(f'engine.devices: the vLLM engine needs a GPU like "cuda:0", got {device!r}')
    index = int(device[5:])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return str(index)
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if index >= len(entries):
        raise ConfigError(f"engine.devices: {device} is not visible: CUDA_VISIBLE_DEVICES={visible!r} "
                          f"lists {len(entries)} GPU(s)")
    return entries[index]


def tokenizer_eos(model_path: Path) -> tuple[bool, int | None]:
    """The end-of-sequence id the model's tokenizer has, read from its files without loading it:
    (known, id). vLLM stops a request at that id (besides generation_config.json's, which it reads
    itself); loading the tokenizer only to learn it costs vLLM's start two loads in a row (its front
    end, then its engine core), seconds each for a large vocabulary. known is False where the files
    name an eos token but not its id (no tokenizer.json, say): then vLLM loads the tokenizer."""
    eos = model_json(model_path, "tokenizer_config.json").get("eos_token") or \
        model_json(model_path, "special_tokens_map.json").get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if eos is None:
        known = (model_path / "tokenizer_config.json").is_file()  # a tokenizer without one: vLLM has None too
        return known, None
    if not isinstance(eos, str):
        return False, None
    tokenizer = model_json(model_path, "tokenizer.json")
    for token in tokenizer.get("added_tokens") or ():
        if isinstance(token, dict) and token.get("content") == eos and isinstance(token.get("id"), int):
            return True, token["id"]
    vocab = (tokenizer.get("model") or {}).get("vocab")
    found = vocab.get(eos) if isinstance(vocab, dict) else None
    return (True, found) if isinstance(found, int) else (False, None)


def sampled_logprobs(token_ids: Sequence[int], logprobs: Any) -> np.ndarray:
    """Log-prob of the sampled token at each position: [T] float32.

    `logprobs` is vLLM's per-position container for one completion: a FlatLogprobs
    (flat_logprobs=True) or a list of {token_id: Logprob} dicts. With logprobs=0 each position
    holds the sampled token's entry (first, by vLLM's sampler; looked up by id to be safe).
    """
    T = len(token_ids)
    if logprobs is None:
        raise GenerationError("vLLM returned no log-probs (the request did not ask for logprobs=0)")
    if len(logprobs) != T:
        raise GenerationError(f"vLLM returned {len(logprobs)} log-prob positions for {T} tokens")
    out = np.empty(T, dtype=np.float32)
    if hasattr(logprobs, "start_indices"):  # FlatLogprobs: read its flat lists, no per-position dicts
        ids, values = logprobs.token_ids, logprobs.logprobs
        for t, tok in enumerate(token_ids):
            start, end = logprobs.start_indices[t], logprobs.end_indices[t]
            j = start if start < end and ids[start] == tok else next(
                (k for k in range(start, end) if ids[k] == tok), -1)
            if j < 0:
                raise GenerationError(f"vLLM's log-probs at position {t} do not include the sampled token {tok}")
            out[t] = values[j]
        return out
    for t, (tok, entries) in enumerate(zip(token_ids, logprobs)):
        entry = entries.get(tok) if entries else None
        if entry is None:
            raise GenerationError(f"vLLM's log-probs at position {t} do not include the sampled token {tok}")
        out[t] = entry.logprob
    return out


class VLLMEngine:
    """Samples whole groups with one vLLM AsyncLLM on one GPU, adapters as LoRARequests."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        sampling: SamplingConfig,
        cfg: VLLMEngineConfig,
        device: str = "cuda:0",
        max_staleness: int = 1,
        name: str = "vllm-0",
        seed: int | None = None,
        full_weights: bool = False,
        in_flight: bool = False,
    ) -> None:
        if max_staleness < 0:
            raise ConfigError(f"pipeline.max_staleness must be >= 0, got {max_staleness}")
        self.max_loras = cfg.max_loras or max_staleness + 2
        if self.max_loras < max_staleness + 1:
            raise ConfigError(f"engine.vllm.max_loras must be 0 (auto) or >= max_staleness + 1 = {max_staleness + 1} "
                              f"(every version a running group may use must fit on the GPU at once), "
                              f"got {cfg.max_loras}")
        physical_gpu(device)  # refuse a bad device now, not at start
        self.name = name
        self.model_path = Path(model_path)
        self.sampling = sampling
        self.cfg = cfg
        self.device = device
        self.max_staleness = max_staleness
        self.seed = cfg.seed if seed is None else seed  # the engine's own seed (requests without a seed)
        # CPU-side cache of loaded adapters; 2 spare so that loading one before removing the oldest
        # never makes vLLM evict (and later reload from disk) an adapter a request still needs.
        self.max_cpu_loras = self.max_loras + 2
        self.stats = VLLMEngineStats()
        self.busy = BusyMeter()
        self._llm: Any = None  # vllm.v1.engine.async_llm.AsyncLLM once started
        self._vllm: dict[str, Any] = {}  # the vLLM names used after start, imported by start()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._start_lock = asyncio.Lock()
        self._max_model_len = 0
        self._vocab_size = 0
        self._eos_id: int | None = None  # the tokenizer's eos, a stop token of every request (start() reads it)
        self.graph_batch_max = 0
        self._next_lora_id = 1  # vLLM lora_int_id: > 0, never reused by this engine (across restarts too)
        self._residency = self._new_residency()  # the adapters vLLM holds or is loading, for this start
        self._running: set[str] = set()  # request ids of generate calls inside vLLM now
        self._closed = False
        self._closes = 0  # close() calls so far: a call that spans one learns the engine closed under it
        self.full_weights = full_weights
        # full-weight mode: the version whose weights vLLM holds (None: unknown after a failed reload)
        self._weights: AdapterRef | None = AdapterRef.base()
        self._swapping: AdapterRef | None = None  # the version being loaded; no request starts meanwhile (drain)
        self._swap_lock = asyncio.Lock()
        self.in_flight = in_flight  # full weights: a load pauses and resumes the requests running, not waits for them
        self._taken = 0  # in-flight: the version whose load began last (its weights may sample any token since)

    # ------------------------------------------------------------------ public API

    @property
    def loaded_versions(self) -> tuple[int, ...]:
        """Versions of the adapters vLLM holds for this engine (base, version 0, not listed)."""
        if self.full_weights:
            return held_versions(self._weights)
        return tuple(sorted(r.ref.version for r in self._residency if r.loaded))

    @property
    def max_context(self) -> int | None:
        """engine.vllm.max_model_len (after `start()`, as vLLM took it)."""
        return self._max_model_len or self.cfg.max_model_len

    @property
    def loaded_adapters(self) -> tuple[str, ...]:
        """Names of the adapters vLLM holds for this engine, oldest first."""
        return tuple(r.ref.name for r in self._residency if r.loaded)

    @property
    def unfinished_requests(self) -> int:
        """Requests vLLM's front end still tracks for this engine (each of the n children counts)."""
        if self._llm is None:
            return 0
        return int(self._llm.output_processor.get_num_unfinished_requests())

    async def start(self) -> None:
        """Start vLLM; after `close()`, start a new AsyncLLM (a restart: no adapter is loaded)."""
        async with self._start_lock:
            if self._closed:
                self._reopen()
            if self._llm is not None:
                return
            await self._start_locked()

    async def generate(self, request: GroupRequest, adapter: AdapterRef) -> Generation:
        self._check_usable()
        t_start = time.monotonic()
        self._check_request(request)
        self.stats.requests += 1
        closes = self._closes
        residency = self._residency  # the one this call releases into, even after a restart
        entry: _Lora | None = None
        request_id = f"{self.name}-{request.group_id}-{uuid.uuid4().hex}"
        if self.full_weights:
            self._check_weights(request, adapter)  # nothing is awaited between this and the request's start
        try:
            entry = None if self.full_weights else await residency.acquire(adapter)
            if self._closes != closes:
                raise EngineDeadError(f"engine {self.name} closed while group {request.group_id} "
                                      "waited for its adapter")
            self._check_usable()
            lora = entry.handle if entry is not None else None
            final = await self._run(request_id, request, lora, closes)
            generation = self._generation(request, adapter, lora, final, t_start, closes)
        except asyncio.CancelledError:
            self.stats.cancelled += 1
            raise
        except BaseException:
            self.stats.failed += 1
            raise
        finally:
            residency.release(entry)
        self.stats.tokens += generation.num_tokens
        return generation

    async def load_adapter(self, adapter: AdapterRef) -> None:
        self._check_usable()
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
        self._closes += 1
        await self._residency.close()  # loads and removals under way cancelled; shutdown frees the adapters
        if self._llm is None:
            return
        llm, self._llm = self._llm, None
        if self._running:
            # Each aborted request gets a final "abort" output, so its generate call returns (and
            # raises EngineDeadError, the engine being closed) instead of waiting forever.
            with contextlib.suppress(Exception):  # a dead engine core has nothing left to abort
                await llm.abort(list(self._running))
        llm.shutdown()
        log.info("engine_closed", engine=self.name, **vars(self.stats))

    async def standalone_throughput(self, prompts: list[list[int]], n: int, max_new_tokens: int,
                                    adapters: Sequence[AdapterRef] = (), concurrency: int | None = None) -> dict:
        """Sample one group per prompt through this engine, all at once (or `concurrency` at a time);
        group i on adapters[i % len(adapters)] (several versions in flight, as in the pipeline), or
        on the base model when `adapters` is empty.

        The engine's standalone limit, measured in the process that runs the pipeline: returns
        {"groups", "tokens", "seconds", "tokens_per_s"} (load time of the adapters not included).
        """
        adapters = list(adapters) or [AdapterRef.base()]
        for adapter in adapters:
            await self.load_adapter(adapter)
        slots = asyncio.Semaphore(concurrency) if concurrency else None

        async def one(i: int, ids: list[int]) -> Generation:
            req = GroupRequest(group_id=-(i + 1), prompt=Prompt(id=f"throughput-{i}", text="", token_ids=tuple(ids)),
                               n=n, max_new_tokens=max_new_tokens)
            adapter = adapters[i % len(adapters)]
            if slots is None:
                return await self.generate(req, adapter)
            async with slots:
                return await self.generate(req, adapter)

        t0 = time.monotonic()
        tasks = [asyncio.get_running_loop().create_task(one(i, p), name=f"{self.name}-throughput-{i}")
                 for i, p in enumerate(prompts)]
        try:
            gens = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        seconds = time.monotonic() - t0
        tokens = sum(g.num_tokens for g in gens)
        return {"groups": len(gens), "tokens": tokens, "seconds": seconds,
                "tokens_per_s": tokens / seconds if seconds > 0 else float("nan")}

    # ------------------------------------------------------------------ start-up

    def _reopen(self) -> None:
        """After close(): forget what the old AsyncLLM held (it is shut down, its adapters with it)."""
        self._closed = False
        self._residency = self._new_residency()
        self._weights = AdapterRef.base()  # a new AsyncLLM starts from the base model's weights
        self._taken = 0
        self._swapping = None
        self._running = set()
        self._loop = None

    async def _start_locked(self) -> None:
        for key, value in ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        t_import = time.monotonic()  # the first start of a process imports vLLM (seconds; cold caches: more)
        try:
            import torch
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.inputs import TokensPrompt
            from vllm.lora.request import LoRARequest
            from vllm.sampling_params import RequestOutputKind, SamplingParams
            from vllm.v1.engine.async_llm import AsyncLLM
            from vllm.v1.engine.exceptions import EngineDeadError as VLLMDeadError
            from vllm.v1.engine.exceptions import EngineGenerateError
        except ImportError as e:
            raise EngineDeadError(f"engine {self.name}: vLLM could not be imported ({e!r}); install it with "
                                  f"{INSTALL_HINT} (vllm==0.24.0, which needs a CUDA GPU)") from e
        import_s = time.monotonic() - t_import
        self._vllm = {"TokensPrompt": TokensPrompt, "LoRARequest": LoRARequest, "SamplingParams": SamplingParams,
                      "FINAL_ONLY": RequestOutputKind.FINAL_ONLY, "DeadError": VLLMDeadError,
                      "GenerateError": EngineGenerateError}
        if not self.model_path.is_dir():
            raise ConfigError(f"model directory {str(self.model_path)!r} does not exist")
        on_policy = not self.sampling.off_policy_settings()
        # requests are token ids and come back as token ids (detokenize=False): vLLM needs no tokenizer
        # where the eos id is known without one (it then stops on it as a stop token). Read off the
        # loop: tokenizer.json is 29 MB for the built-in models (0.4 s), and a restart runs mid-run.
        skip_tokenizer, self._eos_id = await asyncio.to_thread(tokenizer_eos, self.model_path)
        args = AsyncEngineArgs(
            model=str(self.model_path),
            dtype=self.cfg.dtype,
            seed=self.seed,
            max_model_len=self.cfg.max_model_len,
            max_num_seqs=self.cfg.max_num_seqs,
            gpu_memory_utilization=self.cfg.gpu_memory_utilization,
            enforce_eager=self.cfg.enforce_eager,
            # a run sizes it to its work (pipeline.loop.build.graph_sequences); 0 (an engine built on
            # its own): every batch the scheduler can form runs as a graph (vLLM alone stops at 512)
            max_cudagraph_capture_size=self.cfg.max_cudagraph_capture_size or self.cfg.max_num_seqs,
            compilation_config=compilation_config(self.cfg, lora=not self.full_weights),
            # full weights: the worker can also load a version from the trainer's GPU memory
            # (trainer.publish = "memory"; pipeline.engines.shared_weights)
            **({"worker_extension_cls": SHARED_WEIGHTS_WORKER} if self.full_weights else {
                "enable_lora": True, "max_lora_rank": self.cfg.max_lora_rank,
                "max_loras": self.max_loras, "max_cpu_loras": self.max_cpu_loras}),
            # raw == processed under the on-policy settings; raw is the path measured on our host.
            logprobs_mode="raw_logprobs" if on_policy else "processed_logprobs",
            disable_log_stats=True,  # vLLM's front end is CPU-bound here; its periodic stats are unused
            # an episode's later turn repeats its history: cached blocks (per adapter) are not recomputed
            enable_prefix_caching=True,
            skip_tokenizer_init=skip_tokenizer,
        )
        cuda_was_initialized = torch.cuda.is_initialized()
        # read by vLLM as the core starts; every engine of a run has the same engine.vllm
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = method = start_method(self.cfg.start_method, self.name)
        t0 = time.monotonic()
        closes = self._closes
        building = asyncio.get_running_loop().run_in_executor(None, self._build, AsyncLLM, args)
        try:
            llm, gpu = await asyncio.shield(building)
        except asyncio.CancelledError:
            # the constructor cannot be interrupted: shut down what it started once it is up
            building.add_done_callback(_shut_down_late)
            raise
        if self._closes != closes:  # closed while vLLM came up: nobody will use or close this one
            llm.shutdown()
            raise EngineDeadError(f"engine {self.name} was closed while it started")
        self._llm = llm
        if not cuda_was_initialized and torch.cuda.is_initialized():
            log.warning("cuda_initialized_while_narrowed", engine=self.name, visible=gpu,
                        note="this process initialised CUDA while CUDA_VISIBLE_DEVICES named only the engine's GPU")
        self._loop = asyncio.get_running_loop()
        self._max_model_len = int(self._llm.model_config.max_model_len)
        self._vocab_size = int(self._llm.model_config.get_vocab_size())
        # the largest batch that runs as a CUDA graph (0: eager); vLLM caps it at its batched tokens
        self.graph_batch_max = int(self._llm.vllm_config.compilation_config.max_cudagraph_capture_size or 0)
        log.info("engine_started", engine=self.name, model=str(self.model_path), device=self.device,
                 physical_gpu=gpu, seconds=round(time.monotonic() - t0, 2), dtype=self.cfg.dtype,
                 max_loras=self.max_loras, max_cpu_loras=self.max_cpu_loras, seed=self.seed,
                 logprobs_mode=args.logprobs_mode, max_model_len=self._max_model_len,
                 graph_batch_max=self.graph_batch_max, start_method=method, import_s=round(import_s, 2))

    def _build(self, async_llm: Any, args: Any) -> tuple[Any, str]:
        """The AsyncLLM on the engine's GPU, and that GPU's physical id (in a worker thread)."""
        with ENV_LOCK:  # physical_gpu reads the environment another start may be narrowing
            gpu = physical_gpu(self.device)
        try:
            with visible_devices(gpu):  # holds ENV_LOCK: no other child starts with this narrowed view
                return async_llm.from_engine_args(args), gpu
        except Exception as e:  # any start-up failure means this engine cannot serve; say where and why
            raise EngineDeadError(f"engine {self.name}: vLLM could not start model {str(self.model_path)!r} on "
                                  f"{self.device} (physical GPU {gpu}): {type(e).__name__}: {e}") from e

    # ------------------------------------------------------------------ requests

    def _check_not_closed(self) -> None:
        if self._closed:
            raise EngineDeadError(f"engine {self.name} is closed")

    def _check_usable(self) -> None:
        self._check_not_closed()
        if self._llm is None:
            raise EngineDeadError(f"engine {self.name} was not started")
        if asyncio.get_running_loop() is not self._loop:
            raise EngineDeadError(f"engine {self.name} must be used from the event loop that started it "
                                  "(vLLM's output task runs there)")
        if self._llm.errored:
            raise EngineDeadError(f"engine {self.name}: vLLM's engine core has died")

    def _check_request(self, request: GroupRequest) -> None:
        check_group_request(request, (self._max_model_len, f"engine.vllm.max_model_len = {self._max_model_len}"),
                            self._vocab_size)

    def _sampling_params(self, request: GroupRequest) -> Any:
        s = self.sampling
        return self._vllm["SamplingParams"](
            n=request.n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,  # 0 = off, as in vLLM 0.24 (which also accepts -1)
            min_p=s.min_p,
            repetition_penalty=s.repetition_penalty,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            max_tokens=request.max_new_tokens,
            # None = the engine's own seeded generator; a per-request seed costs vLLM throughput (docs/architecture.md#measurements-behind-the-code)
            # (seeded rows are sampled one by one). vLLM seeds child i of the group with seed + i.
            seed=request.seed,
            logprobs=0,  # just the sampled token's log-prob
            flat_logprobs=True,  # a few flat lists per completion instead of a dict per token
            detokenize=False,  # token ids are what the pipeline uses; text costs CPU time
            # without its tokenizer vLLM knows only generation_config.json's eos ids: the tokenizer's too
            stop_token_ids=None if self._eos_id is None else [self._eos_id],
            output_kind=self._vllm["FINAL_ONLY"],
        )

    async def _run(self, request_id: str, request: GroupRequest, lora: Any, closes: int) -> Any:
        """Run one vLLM request to its final RequestOutput; abort it if this call is cancelled.
        `closes`: close() calls before this one began (more now: the engine closed under it)."""
        prompt = self._vllm["TokensPrompt"](prompt_token_ids=list(request.prompt.token_ids))
        params = self._sampling_params(request)
        final = None
        self._running.add(request_id)
        self.busy.enter()
        try:
            async for out in self._llm.generate(prompt, params, request_id, lora_request=lora):
                final = out
        except asyncio.CancelledError:
            # AsyncLLM.generate has aborted its request if it got as far as queueing it; abort by
            # our id too, for a cancel that came while the n child requests were being added.
            if self._llm is not None:
                with contextlib.suppress(Exception):  # the request is abandoned either way
                    await self._llm.abort(request_id)
            raise
        except self._vllm["DeadError"] as e:
            raise EngineDeadError(f"engine {self.name}: vLLM's engine core died during group "
                                  f"{request.group_id}: {e}") from e
        except Exception as e:  # one failed vLLM request (bad input, a request-level error) fails its group only
            cause = e.__cause__ if isinstance(e, self._vllm["GenerateError"]) and e.__cause__ else e
            raise GenerationError(f"engine {self.name}: vLLM failed group {request.group_id}: "
                                  f"{type(cause).__name__}: {cause}") from e
        finally:
            self.busy.exit()
            self._running.discard(request_id)
        if final is None or not final.finished:
            if self._closes != closes:
                raise EngineDeadError(f"engine {self.name} closed during group {request.group_id}")
            raise GenerationError(f"engine {self.name}: vLLM ended group {request.group_id} without a final output")
        return final

    def _generation(self, request: GroupRequest, adapter: AdapterRef, lora: Any, final: Any,
                    t_start: float, closes: int) -> Generation:
        got = final.lora_request
        if (got is None) != (lora is None) or (
                got is not None and (got.lora_int_id != lora.lora_int_id or got.lora_name != lora.lora_name)):
            raise GenerationError(
                f"engine {self.name}: group {request.group_id} asked for version {adapter.version} "
                f"({_describe(lora)}) but vLLM reports {_describe(got)}")
        outputs = sorted(final.outputs, key=lambda c: c.index)
        if len(outputs) != request.n:
            raise GenerationError(f"engine {self.name}: group {request.group_id} asked for {request.n} "
                                  f"completions, vLLM returned {len(outputs)}")
        completions = []
        for c in outputs:
            reason = str(c.finish_reason)
            if reason in _FAILED_REASONS:
                if self._closes != closes:
                    raise EngineDeadError(f"engine {self.name} closed during group {request.group_id}")
                raise GenerationError(f"engine {self.name}: completion {c.index} of group {request.group_id} "
                                      f"ended with finish_reason {reason!r}")
            token_ids = np.asarray(list(c.token_ids), dtype=np.int64)
            if len(token_ids) > request.max_new_tokens:
                raise GenerationError(f"engine {self.name}: completion {c.index} of group {request.group_id} has "
                                      f"{len(token_ids)} tokens, more than max_new_tokens {request.max_new_tokens}")
            completions.append(Completion(token_ids=token_ids, logprobs=sampled_logprobs(c.token_ids, c.logprobs),
                                          finish_reason=_FINISH_REASONS.get(reason, reason)))
        return Generation(request=request, completions=tuple(completions), version=adapter.version,
                          engine=self.name, t_start=t_start, t_end=time.monotonic(),
                          last_version=self._taken if self.full_weights and self.in_flight else None)

    # ------------------------------------------------------------------ full weights

    def _check_weights(self, request: GroupRequest, adapter: AdapterRef) -> None:
        held = self._weights
        if self.in_flight:  # the version held (or being loaded) or an older one: the label is the oldest
            if held is not None and adapter.version <= max(held.version, self._taken):
                return
        elif self._swapping is None and same_version(held, adapter):
            return
        now = ("no version (a weight reload failed)" if held is None else f"version {held.version}") + (
            f", loading version {self._swapping.version}" if self._swapping is not None else "")
        raise GenerationError(f"engine {self.name} holds full weights of {now}; group {request.group_id} "
                              f"asked for version {adapter.version}")

    async def _load_weights(self, adapter: AdapterRef) -> None:
        """Replace the weights with `adapter`'s (its directory, its shared buffer, or the base model for version 0)."""
        async with self._swap_lock:
            if same_version(self._weights, adapter):
                return
            if adapter.shared is not None:  # in the trainer's GPU memory: the worker checks its checksum
                source, method = "the trainer's GPU memory", "load_shared_weights"
                call: dict[str, Any] = {"args": (dict(adapter.shared),)}
            else:
                path = self.model_path if adapter.version == 0 else check_model_dir(adapter)
                source, method, call = repr(str(path)), "reload_weights", {"kwargs": {"weights_path": str(path)}}
            self._swapping = adapter
            t0 = time.monotonic()
            try:
                if self.in_flight:
                    self._taken = adapter.version  # set before the pause: any token sampled after it may be this version's
                    # "keep" stops the running requests where they are; clearing the caches preempts them (their
                    # KV blocks, computed with the old weights, are dropped and recomputed on resume)
                    await self._llm.pause_generation(mode="keep", clear_cache=True)
                else:
                    while self._running:  # the orchestrator drains first; a caller that did not waits here
                        await asyncio.sleep(0.01)
                    self._weights = None
                    # pausing also clears the prefix cache: KV blocks of the old weights must not be reused
                    await self._llm.pause_generation(mode="wait")
                try:
                    await self._llm.collective_rpc(method, **call)
                except BaseException:
                    self._weights = None
                    if self.in_flight and self._running:  # their next tokens would come from half-replaced weights
                        with contextlib.suppress(Exception):
                            await self._llm.abort(list(self._running))
                    raise
                finally:
                    await self._llm.resume_generation()
            except Exception as e:
                if isinstance(e, PipelineError):
                    raise
                raise AdapterCorruptError(f"engine {self.name}: vLLM could not load the weights of version "
                                          f"{adapter.version} from {source}: {type(e).__name__}: {e}") from e
            finally:
                self._swapping = None
            self._weights = adapter
            self.stats.adapters_loaded += 1
            log.info("weights_loaded", engine=self.name, version=adapter.version, source=source,
                     seconds=round(time.monotonic() - t0, 3))

    # ------------------------------------------------------------------ adapters

    def _new_residency(self) -> Residency[Any]:
        return Residency(self.name, self.max_loras, prepare=self._prepare, load=self._add_lora,
                         unload=self._remove_lora, stale=self._stale)

    def _prepare(self, adapter: AdapterRef) -> Any:
        """The LoRARequest for `adapter` under a new id, refused unless its directory holds an adapter vLLM can take."""
        path = check_adapter_dir(adapter, (self.cfg.max_lora_rank, "engine.vllm.max_lora_rank"))
        lora_id = self._next_lora_id
        self._next_lora_id += 1
        return self._vllm["LoRARequest"](lora_name=adapter.name, lora_int_id=lora_id, lora_path=str(path))

    def _stale(self, resident: AdapterRef, incoming: AdapterRef) -> bool:
        """Whether no group may use `resident` once `incoming` loads: older than its version - max_staleness."""
        return resident.version < incoming.version - self.max_staleness

    async def _add_lora(self, entry: _Lora) -> None:
        lora = entry.handle
        t0 = time.monotonic()
        try:
            added = await self._llm.add_lora(lora)
        except PipelineError:
            raise
        except Exception as e:  # vLLM reports a failed load as a plain Exception carrying the worker's message
            raise AdapterError(f"engine {self.name}: vLLM could not load adapter version {entry.ref.version} "
                               f"from {lora.lora_path!r}: {e}") from e
        self.stats.adapters_loaded += 1
        log.info("adapter_loaded", engine=self.name, version=entry.ref.version, adapter=entry.ref.name,
                 lora_id=lora.lora_int_id, seconds=round(time.monotonic() - t0, 4), added=bool(added))

    async def _remove_lora(self, entry: _Lora) -> None:
        lora = entry.handle
        try:
            removed = await self._llm.remove_lora(lora.lora_int_id)
        except Exception as e:  # vLLM's LRU caches drop it eventually; a failed removal must not fail a request
            log.warning("adapter_unload_failed", engine=self.name, adapter=entry.ref.name, error=repr(e))
            return
        self.stats.adapters_unloaded += 1
        log.info("adapter_unloaded", engine=self.name, version=entry.ref.version, adapter=entry.ref.name,
                 lora_id=lora.lora_int_id, removed=bool(removed))


def _shut_down_late(building: asyncio.Future[Any]) -> None:
    """A start abandoned while vLLM came up: shut the AsyncLLM down once the constructor returns."""
    if not building.cancelled() and building.exception() is None:
        building.result()[0].shutdown()


def _describe(lora: Any) -> str:
    return "the base model" if lora is None else f"LoRA {lora.lora_name!r} id {lora.lora_int_id}"
