"""vLLM servers as engines: one `vllm serve` process (OpenAI-compatible HTTP) per engine.

The server runs where you start it, on this host or another; the pipeline only talks to it. Its
output handling (detokenizing, per-token log-probs) then runs in the server's process, not on the
pipeline's event loop, where an in-process AsyncLLM's output handling is most of the loop's CPU
at K >= 1 (docs/results.md, "Where the event loop's time goes").

Invariants (beyond the Engine protocol's):
- One group is one `POST /v1/completions`: the prompt's token ids, n = G, logprobs = 0,
  return_token_ids, and every sampling setting sent explicitly (a server applies the model's
  generation_config.json to whatever a request leaves out). The answer carries each completion's
  token ids and the log-prob of each sampled token.
- Each version is registered on the server under its own name, `<AdapterRef.name>-<tag>` (tag:
  random per engine, so runs that share a server never share a name), with
  `POST /v1/load_lora_adapter` and the directory as published: the server must see the adapter
  store at the same path (a shared filesystem). A request names its adapter, and the answer's
  `model` must be that name.
- A group that started on version k finishes on k: a registered adapter is unregistered only when
  none of this engine's requests uses it (deferred otherwise); at most `max_loaded_adapters`
  stay registered (the oldest idle ones go first). `residency.Residency` decides when.
- A server that forgot an adapter (it was restarted) answers 404 for its name: the engine
  registers it again and sends the request once more.
- Cancelling `generate` closes its HTTP request; vLLM aborts a completion whose client went away.
- Errors: a server that cannot be reached -> EngineDeadError (the pipeline takes the engine out
  of rotation and may restart it: `start()` probes the server again); an HTTP error on a
  completion -> GenerationError with the server's message; on a registration -> AdapterError.
- A server someone else started owns its GPU and its process: `close()` ends this engine's
  requests, unregisters its adapters and leaves the server running. A server the engine was
  given to launch (`server`, engine.vllm_server.launch) is started by `start()` and stopped, its
  whole process group, by `close()`: a restart of the engine is a new server on the same port,
  and a server that died is restarted that way. A launched server started without its tokenizer
  (vllm_launch says when) stops each completion at the tokenizer's eos because every request
  names it in stop_token_ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from pipeline.config.schema import ConfigError, SamplingConfig, VLLMServerEngineConfig
from pipeline.engines.base import check_adapter_dir, check_group_request
from pipeline.engines.residency import Residency, Resident
from pipeline.engines.vllm import _FAILED_REASONS, _FINISH_REASONS
from pipeline.errors import AdapterError, AdapterNotFoundError, EngineDeadError, GenerationError
from pipeline.observe.metrics import BusyMeter
from pipeline.types import AdapterRef, Completion, Generation, GroupRequest

log = structlog.get_logger(__name__)

_CONNECT_TIMEOUT_S = 10.0  # a server that does not accept a connection by then is unreachable
_START_LOG_EVERY_S = 15.0  # while a server is not up yet, say so this often
_UNREGISTER_AT_CLOSE_S = 5.0  # close() gives unregistering its adapters this long
_RUNTIME_LORA_HINT = ("start the server with the environment variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=True "
                      "and `vllm serve MODEL --enable-lora --max-lora-rank R` (R >= trainer.lora_rank)")


@dataclass
class VLLMServerEngineStats:
    """Counters since start (all written on the event loop)."""

    requests: int = 0  # generate calls accepted
    cancelled: int = 0  # generate calls cancelled by their caller (their HTTP request closed)
    failed: int = 0  # generate calls that raised
    tokens: int = 0  # completion tokens returned
    reregistered: int = 0  # adapters registered again because the server had forgotten them
    adapters_loaded: int = 0
    adapters_unloaded: int = 0


@dataclass(frozen=True)
class _Registration:
    """How the server knows one adapter version."""

    name: str  # the server's name for it: "<AdapterRef.name>-<tag>"
    path: str  # the directory, resolved, as the server is asked to read it


_Registered = Resident[_Registration]  # one adapter version as this engine registers it on the server


class VLLMServerEngine:
    """Samples whole groups on one vLLM server over HTTP; adapters registered at run time."""

    def __init__(self, url: str, *, sampling: SamplingConfig, cfg: VLLMServerEngineConfig,
                 max_staleness: int = 1, name: str = "vllm-server-0", server: Any = None,
                 server_timeout_s: float = 600.0, server_gate: asyncio.Lock | None = None) -> None:
        """server: a pipeline.engines.vllm_launch.VLLMServeProcess serving `url`, started and stopped
        with this engine (within `server_timeout_s` to answer /health); None: the server is yours.
        server_gate: held while the server starts (one start at a time per GPU)."""
        if max_staleness < 0:
            raise ConfigError(f"pipeline.max_staleness must be >= 0, got {max_staleness}")
        self.url = url.rstrip("/")
        self.name = name
        self.sampling = sampling
        self.cfg = cfg
        self.max_loaded = cfg.max_loaded_adapters or max_staleness + 2
        if self.max_loaded < max_staleness + 1:
            raise ConfigError(f"engine.vllm_server.max_loaded_adapters must be 0 (auto) or >= max_staleness + 1 = "
                              f"{max_staleness + 1} (every version a running group may use stays registered), "
                              f"got {cfg.max_loaded_adapters}")
        self.model = cfg.model  # the base model's name on the server; found by start() when ""
        self.max_model_len: int | None = None  # as the server reports it
        self.stats = VLLMServerEngineStats()
        self.busy = BusyMeter()
        self._tag = secrets.token_hex(4)
        self._headers: dict[str, str] = {}
        self._session: Any = None  # aiohttp.ClientSession once started
        self._start_lock = asyncio.Lock()
        self._residency = self._new_residency()  # the adapters registered or registering
        self._closed = False
        self._closes = 0  # close() calls so far: a call that spans one learns the engine closed under it
        self.server = server
        self._server_timeout_s = server_timeout_s
        self._server_gate = server_gate or asyncio.Lock()

    # ------------------------------------------------------------------ public API

    @property
    def loaded_versions(self) -> tuple[int, ...]:
        """Versions registered on the server by this engine (the base model, version 0, not listed)."""
        return tuple(sorted(r.ref.version for r in self._residency if r.loaded))

    @property
    def max_context(self) -> int | None:
        """The server's --max-model-len, as it reports it (None before `start()`)."""
        return self.max_model_len

    async def start(self) -> None:
        """Connect to the server and find its base model; after `close()`, again (no adapter registered)."""
        async with self._start_lock:
            if self._session is not None and not self._closed:
                return
            self._closed = False
            self._residency = self._new_residency()
            if self.server is not None:
                await self.server.stop()  # a server of ours that died: what is left of its group
                async with self._server_gate:
                    await self.server.start(timeout_s=self._server_timeout_s)
            import aiohttp

            key_env = self.cfg.api_key_env
            if key_env:
                key = os.environ.get(key_env)
                if not key:
                    raise ConfigError(f"engine.vllm_server.api_key_env = {key_env!r}, but that environment "
                                      "variable is not set")
                self._headers = {"Authorization": f"Bearer {key}"}
            # no total timeout: the pipeline times requests itself (engine.request_timeout_s) and cancels them
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=_CONNECT_TIMEOUT_S),
                connector=aiohttp.TCPConnector(limit=0), headers=self._headers)
            try:
                await self._find_model()
            except BaseException:
                await self._session.close()
                self._session = None
                raise

    async def generate(self, request: GroupRequest, adapter: AdapterRef) -> Generation:
        self._check_usable()
        t_start = time.monotonic()
        check_group_request(request)  # the server checks its context and vocabulary itself (a 400)
        self.stats.requests += 1
        residency = self._residency  # the one this call releases into, even after a restart
        entry: _Registered | None = None
        try:
            entry = await residency.acquire(adapter)
            data = await self._complete(request, entry)
            generation = self._generation(request, adapter, entry, data, t_start)
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
        await self._residency.load(adapter)

    async def unload_adapter(self, adapter: AdapterRef) -> None:
        await self._residency.unload(adapter)  # after close() it does nothing

    async def close(self) -> None:
        """End this engine's requests, unregister its adapters (best effort) and close the connections;
        then stop the server if this engine launched it."""
        try:
            await self._close_session()
        finally:
            if self.server is not None:
                await self.server.stop()

    async def _close_session(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._closes += 1
        session, self._session = self._session, None
        registered = await self._residency.close()  # registrations and unregistrations under way cancelled
        if session is None:
            return
        await session.close()  # closes its connections: the requests in flight end now (EngineDeadError)
        if not registered:
            return
        import aiohttp

        # the names are this engine's alone: left registered they would only pile up on the server
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_UNREGISTER_AT_CLOSE_S),
                                         headers=self._headers) as cleanup:
            try:
                async with asyncio.timeout(_UNREGISTER_AT_CLOSE_S):
                    await asyncio.gather(*(self._post_unregister(cleanup, e) for e in registered),
                                         return_exceptions=True)
            except TimeoutError:
                log.warning("adapter_unregister_timeout", engine=self.name, url=self.url, adapters=len(registered))

    # ------------------------------------------------------------------ HTTP

    async def _request(self, method: str, path: str, body: Any = None, *,
                       session: Any = None) -> tuple[int, Any]:
        """(status, parsed JSON or text) of one call; EngineDeadError if the server cannot be reached."""
        import aiohttp

        session = session or self._session
        if session is None:
            raise EngineDeadError(f"engine {self.name} is closed")
        closes = self._closes
        try:
            async with session.request(method, self.url + path, json=body) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, OSError) as e:
            if self._closes != closes:
                raise EngineDeadError(f"engine {self.name} closed during {method} {path}") from e
            raise EngineDeadError(f"engine {self.name}: cannot reach the vLLM server at {self.url} "
                                  f"({method} {path}): {type(e).__name__}: {e}") from e
        try:
            return status, json.loads(raw)
        except ValueError:  # a plain-text answer (load/unload success) or an HTML error page
            return status, raw.decode("utf-8", "replace")

    async def _find_model(self) -> None:
        """Wait for the server to accept connections, then take (or check) its base model."""
        t0 = last_log = time.monotonic()
        while True:
            try:
                status, data = await self._request("GET", "/v1/models")
                break
            except EngineDeadError as e:
                cause = e.__cause__
                if not _refused(cause):  # a refused connection is a server still starting; nothing else is
                    raise
                if time.monotonic() - last_log >= _START_LOG_EVERY_S:
                    last_log = time.monotonic()
                    log.warning("vllm_server_not_up", engine=self.name, url=self.url,
                                waited_s=round(last_log - t0, 1), error=str(cause))
                await asyncio.sleep(1.0)
        if status == 401:
            raise ConfigError(f"the vLLM server at {self.url} refused the API key"
                              + (f" from ${self.cfg.api_key_env}" if self.cfg.api_key_env else
                                 " (none sent: set engine.vllm_server.api_key_env)"))
        if status != 200 or not isinstance(data, dict):
            raise EngineDeadError(f"engine {self.name}: GET {self.url}/v1/models answered {status}: "
                                  f"{_message(data)}")
        bases = [c for c in data.get("data", []) if not c.get("parent")]
        names = [c.get("id") for c in bases]
        if self.cfg.model:
            card = next((c for c in bases if c.get("id") == self.cfg.model), None)
            if card is None:
                raise ConfigError(f"engine.vllm_server.model = {self.cfg.model!r} is not served by {self.url} "
                                  f"(it serves {names})")
        elif len(bases) == 1:
            card = bases[0]
        else:
            raise ConfigError(f"the vLLM server at {self.url} serves {names}: set engine.vllm_server.model "
                              "to the base model the trainer trains")
        self.model = card["id"]
        self.max_model_len = card.get("max_model_len")
        log.info("vllm_server_ready", engine=self.name, url=self.url, model=self.model,
                 max_model_len=self.max_model_len, waited_s=round(time.monotonic() - t0, 3))

    # ------------------------------------------------------------------ generation

    def _body(self, request: GroupRequest, entry: _Registered | None) -> dict[str, Any]:
        s = self.sampling
        body = {
            "model": entry.handle.name if entry is not None else self.model,
            "prompt": list(request.prompt.token_ids),
            "n": request.n,
            "max_tokens": request.max_new_tokens,
            # all sent, so the model's generation_config.json cannot change what is sampled
            "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p,
            "repetition_penalty": s.repetition_penalty, "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty,
            "logprobs": 0,  # just the sampled token's log-prob
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,  # no detokenizing of each logprob entry on the server
            "stream": False,
        }
        eos = None if self.server is None else self.server.eos_id
        if eos is not None:  # a server launched without its tokenizer knows no eos but generation_config's
            body["stop_token_ids"] = [eos]
        if request.seed is not None:
            body["seed"] = request.seed
        return body

    async def _complete(self, request: GroupRequest, entry: _Registered | None) -> dict[str, Any]:
        """The server's answer to the group's completion request (registering its adapter again, once,
        if the server has forgotten it)."""
        for attempt in (0, 1):
            self.busy.enter()
            try:
                status, data = await self._request("POST", "/v1/completions", self._body(request, entry))
            finally:
                self.busy.exit()
            if status == 200 and isinstance(data, dict):
                return data
            if status == 404 and entry is not None and attempt == 0 and "does not exist" in _message(data):
                # the server was restarted and lost its registrations: this one is still ours to use
                self.stats.reregistered += 1
                log.warning("adapter_reregistered", engine=self.name, url=self.url, adapter=entry.handle.name)
                await self._register(entry)
                continue
            raise GenerationError(f"engine {self.name}: the vLLM server at {self.url} answered {status} to group "
                                  f"{request.group_id}: {_message(data)}")
        raise AssertionError("unreachable")

    def _generation(self, request: GroupRequest, adapter: AdapterRef, entry: _Registered | None,
                    data: dict[str, Any], t_start: float) -> Generation:
        sent = entry.handle.name if entry is not None else self.model
        if data.get("model") != sent:
            raise GenerationError(f"engine {self.name}: group {request.group_id} asked {self.url} for {sent!r} "
                                  f"(version {adapter.version}) but the answer is from {data.get('model')!r}")
        choices = sorted(data.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != request.n:
            raise GenerationError(f"engine {self.name}: group {request.group_id} asked for {request.n} "
                                  f"completions, the server returned {len(choices)}")
        completions = []
        for c in choices:
            reason = str(c.get("finish_reason"))
            if reason in _FAILED_REASONS:
                raise GenerationError(f"engine {self.name}: completion {c.get('index')} of group {request.group_id} "
                                      f"ended with finish_reason {reason!r}")
            ids = c.get("token_ids")
            lps = (c.get("logprobs") or {}).get("token_logprobs")
            if ids is None or lps is None:
                raise GenerationError(f"engine {self.name}: the server at {self.url} returned no "
                                      f"{'token ids' if ids is None else 'log-probs'} for group {request.group_id} "
                                      "(a vLLM with return_token_ids, >= 0.10.2, is needed)")
            if len(lps) != len(ids) or any(x is None for x in lps):
                raise GenerationError(f"engine {self.name}: the server returned {len(lps)} log-probs for "
                                      f"{len(ids)} tokens in group {request.group_id}")
            if len(ids) > request.max_new_tokens:
                raise GenerationError(f"engine {self.name}: completion {c.get('index')} of group {request.group_id} "
                                      f"has {len(ids)} tokens, more than max_new_tokens {request.max_new_tokens}")
            completions.append(Completion(token_ids=np.asarray(ids, dtype=np.int64),
                                          logprobs=np.asarray(lps, dtype=np.float32),
                                          finish_reason=_FINISH_REASONS.get(reason, reason)))
        return Generation(request=request, completions=tuple(completions), version=adapter.version,
                          engine=self.name, t_start=t_start, t_end=time.monotonic())

    # ------------------------------------------------------------------ adapters

    def _new_residency(self) -> Residency[_Registration]:
        return Residency(self.name, self.max_loaded, prepare=self._prepare, load=self._register,
                         unload=self._unregister, held_as="registered")

    def _prepare(self, adapter: AdapterRef) -> _Registration:
        """The server's name for `adapter` and its directory, refused unless it holds an adapter."""
        return _Registration(name=f"{adapter.name}-{self._tag}", path=str(check_adapter_dir(adapter)))

    async def _register(self, entry: _Registered) -> None:
        t0 = time.monotonic()
        status, data = await self._request("POST", "/v1/load_lora_adapter",
                                           {"lora_name": entry.handle.name, "lora_path": entry.handle.path})
        msg = _message(data)
        if status == 400 and "already been loaded" in msg:
            pass  # ours (the name is this engine's alone): an earlier registration got through
        elif status == 404 and not (isinstance(data, dict) and "error" in data):
            raise AdapterError(f"the vLLM server at {self.url} does not register adapters at run time "
                               f"(POST /v1/load_lora_adapter: {status} {msg}); {_RUNTIME_LORA_HINT}")
        elif status == 404:
            raise AdapterNotFoundError(f"the vLLM server at {self.url} cannot read adapter version "
                                       f"{entry.ref.version} at {entry.handle.path!r}: {msg}; the adapter store "
                                       "must be on a filesystem the server sees at the same path")
        elif status != 200:
            raise AdapterError(f"the vLLM server at {self.url} could not load adapter version {entry.ref.version} "
                               f"from {entry.handle.path!r}: {status} {msg}")
        self.stats.adapters_loaded += 1
        log.info("adapter_loaded", engine=self.name, version=entry.ref.version, adapter=entry.handle.name,
                 seconds=round(time.monotonic() - t0, 4))

    async def _unregister(self, entry: _Registered) -> None:
        if self._session is None:
            return
        with contextlib.suppress(EngineDeadError):  # an unreachable server has forgotten it anyway
            await self._post_unregister(self._session, entry)

    async def _post_unregister(self, session: Any, entry: _Registered) -> None:
        status, data = await self._request("POST", "/v1/unload_lora_adapter", {"lora_name": entry.handle.name},
                                           session=session)
        if status not in (200, 404):  # 404: the server no longer has it (restarted); nothing to free
            log.warning("adapter_unload_failed", engine=self.name, adapter=entry.handle.name, status=status,
                        error=_message(data))
            return
        self.stats.adapters_unloaded += 1
        log.info("adapter_unloaded", engine=self.name, version=entry.ref.version, adapter=entry.handle.name)

    # ------------------------------------------------------------------ checks

    def _check_usable(self) -> None:
        if self._closed:
            raise EngineDeadError(f"engine {self.name} is closed")
        if self._session is None:
            raise EngineDeadError(f"engine {self.name} was not started")


def _refused(e: BaseException | None) -> bool:
    """Whether an aiohttp connection error is a refused connection (a server still starting)."""
    while e is not None:
        if isinstance(e, ConnectionRefusedError):
            return True
        e = getattr(e, "os_error", None) or e.__cause__
    return False


def _message(data: Any) -> str:
    """The error text of a server's answer: vLLM's {"error": {"message": ...}}, FastAPI's {"detail": ...}, or text."""
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err is not None:
            return str(err)
        if "detail" in data:
            return str(data["detail"])
    return str(data)[:500]
