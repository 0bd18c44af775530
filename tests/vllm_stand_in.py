"""The one stand-in for vLLM 0.24's `vllm serve`, for CPU tests: its OpenAI-compatible HTTP server
over one of the repo's in-process engines, in the test's process or as a process of its own.

In process, `VLLMStandIn(engine).start()` serves on the caller's event loop (the HTTP engine's
tests, the engine contract over HTTP, scoring and episodes through a server). As a process,
`python vllm_stand_in.py MODEL --port P [vLLM's flags] [knobs]` is what VLLMServeProcess starts
in place of `vllm serve` (its `program`, or engine.vllm_server.command): see `main`.

It answers the routes the pipeline's HTTP engine uses with vLLM 0.24's JSON shapes, messages and
status codes (read from vllm/entrypoints/{openai,serve}/ of the 0.24 source), and samples with
the wrapped engine, so that token ids and log-probs are real ones that a trainer in the same test
can check.

Invariants:
- Routes: GET /health; GET /v1/models; POST /v1/completions; POST /v1/load_lora_adapter and
  /v1/unload_lora_adapter only with `runtime_lora` (vLLM registers them only under
  VLLM_ALLOW_RUNTIME_LORA_UPDATING; without it they are FastAPI's 404 `{"detail": "Not Found"}`).
  With `api_key`, every path under /v1 needs `Authorization: Bearer <key>`, else 401
  `{"error": "Unauthorized"}`; /health never does.
- Errors are vLLM's ErrorResponse `{"error": {"message", "type", "param", "code"}}` with
  `code` the HTTP status; checks run in vLLM's order: body validation (400 "Bad Request"),
  model (404 NotFoundError, param "model"), lengths and sampling settings (400
  BadRequestError), then the engine (its exception: 500 InternalServerError).
- Each completion request is one `engine.generate` call for one group (a fresh `group_id`);
  choice i is the Generation's completion i: its token ids, and its log-probs clamped at
  -9999 as vLLM clamps them.
- A completion whose client disconnects, or that is running when `close()` is called, has its
  generate call cancelled and is counted in `aborted`; it gets no answer.
- A stand-in lives on the event loop it was started on (aiohttp's runner and its asyncio
  primitives); `start()` after `close()` listens on the same port again, as a restarted server would.
- The server behaves as `vllm serve --skip-tokenizer-init` unless a `decode` function is given:
  choice text is the engine's Completion.text (usually ""), and log-probs need
  `return_tokens_as_token_ids` (tokens read "token_id:<id>").
- `stop_token_ids`: a completion ends at the first of them it samples, that token kept, with
  finish_reason "stop" (vLLM stops sampling there; the stand-in cuts the engine's longer sample,
  whose tokens and log-probs up to that point are the same).
- An adapter's version is the "version" of the manifest.json in its directory (the
  AdapterStore writes one), else the number in an AdapterStore directory name
  ("v000007-1a2b3c4d"), else a per-server counter from 1 (the same path keeps its number on a
  reload). The AdapterRef's name is the lora_name, its path the lora_path.
- Unloading removes the name from the registry (as vLLM does) and, unlike vLLM (which leaves
  the adapter in its engine's cache until evicted), also calls `engine.unload_adapter` when no
  other registered name holds the same version, so a long test keeps the engine bounded.
- As a process: its first line of output is one JSON object (its argv, pid, and the environment
  variables the launcher sets), before anything can fail; SIGTERM ends it at once (its default
  action), so the launcher reads -SIGTERM as its end, unless a knob says to ignore it.

Not reproduced: streaming (`stream: true` answers 400), text prompts and batches of prompts
(only one list of token ids), top log-probs beyond the sampled token (exact for `logprobs: 0`),
FastAPI's exact pydantic validation messages (the status, type and param match), LoRA resolvers.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Sequence

if __name__ == "__main__":  # run as `vllm serve`: the package of this checkout, wherever the interpreter is
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiohttp import web  # noqa: E402

from pipeline.config.schema import SamplingConfig  # noqa: E402
from pipeline.engines.base import Engine  # noqa: E402
from pipeline.types import AdapterRef, Completion, Generation, GroupRequest, Prompt  # noqa: E402

VLLM_VERSION = "0.24.0"
GUARDED_PREFIX = ("/v1", "/v2", "/inference")  # vLLM's AuthenticationMiddleware guards these
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
DEFAULT_MAX_TOKENS = 16  # CompletionRequest.max_tokens when left out or null
_VERSION_DIR = re.compile(r"^v(\d{6,})-[0-9a-f]{8}$")  # AdapterStore's version directory names
LOGPROB_FLOOR = -9999.0  # vLLM clamps -inf log-probs to this (JSON has no -inf)
SAMPLING_EPS = 1e-5  # vLLM: a temperature below this is greedy sampling
# vLLM's defaults for sampling fields a request leaves out, when the model's generation_config
# gives none (CompletionRequest._DEFAULT_SAMPLING_PARAMS); penalties default to 0 in the request
SAMPLING_DEFAULTS: dict[str, float] = {"repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0,
                                       "top_k": 0, "min_p": 0.0}


def _random_id() -> str:
    """vLLM's random_uuid: 16 hex characters."""
    return f"{uuid.uuid4().int & ((1 << 64) - 1):016x}"


class ApiError(Exception):
    """An error answered as vLLM's ErrorResponse with `status`."""

    def __init__(self, status: int, message: str, err_type: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param

    def response(self) -> web.Response:
        return _json({"error": {"message": self.message, "type": self.err_type, "param": self.param,
                                "code": self.status}}, self.status)


def _bad_request(message: str, param: str | None = None) -> ApiError:
    """vLLM's create_error_response for a ValueError / VLLMValidationError: 400 BadRequestError."""
    return ApiError(400, message, "BadRequestError", param)


def _invalid_body(message: str, param: str | None) -> ApiError:
    """FastAPI's RequestValidationError as vLLM answers it: 400, type "Bad Request"."""
    return ApiError(400, message, "Bad Request", param)


def _from_exception(e: Exception) -> ApiError:
    """vLLM's create_error_response(exc) for an exception its handlers catch."""
    if isinstance(e, (ValueError, TypeError, OverflowError)):
        return ApiError(400, str(e), "BadRequestError")
    if isinstance(e, NotImplementedError):
        return ApiError(501, str(e), "NotImplementedError")
    return ApiError(500, str(e), "InternalServerError")


def _json(content: Any, status: int = 200) -> web.Response:
    # allow_nan=False as Starlette's JSONResponse: a NaN log-prob fails loudly rather than send invalid JSON
    text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return web.Response(text=text, status=status, content_type="application/json")


def _field(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], default: Any,
           *, required: bool = False) -> Any:
    """Body field `name` checked as pydantic would (an int passes as a float); null gives `default`."""
    value = body.get(name)
    if value is None:
        if required:
            raise _invalid_body(f"Field required: {name}", f"body.{name}")
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    accepted = (*kinds, int) if float in kinds else kinds
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, accepted):
        names = " or ".join(k.__name__ for k in kinds)
        raise _invalid_body(f"Input should be a valid {names}: {name}={value!r}", f"body.{name}")
    return float(value) if kinds == (float,) else value


@dataclass(frozen=True)
class _Lora:
    """A registered adapter: vLLM's LoRARequest as the stand-in keeps it."""

    name: str
    path: str
    ref: AdapterRef


class VLLMStandIn:
    """vLLM 0.24's HTTP server over an in-process Engine, on the caller's event loop."""

    def __init__(self, engine: Engine, *, model_name: str = "base-model", model_path: str | None = None,
                 max_model_len: int = 2048, runtime_lora: bool = True, api_key: str | None = None,
                 host: str = "127.0.0.1", port: int = 0, sampling: SamplingConfig | None = None,
                 generation_config: Mapping[str, float] | None = None,
                 decode: Callable[[Sequence[int]], str] | None = None) -> None:
        """Serve `engine` as `model_name` (its card's root is `model_path`, default the name).

        host, port: where to listen; port 0 = a free port, chosen at the first `start()`.

        sampling: what the engine samples with; a request asking for other settings answers 400
            (a stand-in check, not vLLM's: the log-probs it reports would not be the request's). None:
            the engine's own `sampling` (TransformersEngine has one), else no check.
        generation_config: the sampling defaults vLLM would read from the model's
            generation_config.json for fields a request leaves out; None: vLLM's own defaults.
        decode: token ids -> text; without it the server acts as one started with
            --skip-tokenizer-init.
        """
        self.engine = engine
        self.model_name = model_name
        self.model_path = model_path or model_name
        self.max_model_len = max_model_len
        self.runtime_lora = runtime_lora
        self.api_key = api_key
        engine_sampling = getattr(engine, "sampling", None)  # an Engine need not have one
        self.sampling = sampling if sampling is not None else (
            engine_sampling if isinstance(engine_sampling, SamplingConfig) else None)
        self.generation_config = dict(generation_config or {})
        self.decode = decode
        self.fingerprint = f"vllm-{VLLM_VERSION}-{hashlib.sha256(model_name.encode()).hexdigest()[:8]}"
        # inspection and fault knobs for tests
        self.requests: list[dict[str, Any]] = []  # every /v1/completions JSON body, in order
        self.loads: list[dict[str, Any]] = []  # every load_lora_adapter JSON body, in order
        self.unloads: list[dict[str, Any]] = []  # every unload_lora_adapter JSON body, in order
        self.aborted = 0  # completions cancelled before their answer (client gone or server closed)
        self.in_flight = 0  # completions inside engine.generate now
        self.fail_next_completions = 0  # the next N completions answer 500 before reaching the engine
        self.fail_next_loads = 0  # the next N loads answer 500 without loading
        self.healthy = True  # False: /health answers 503, as vLLM's with a dead engine
        self.url = ""
        self._loras: dict[str, _Lora] = {}
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)  # vLLM locks per lora name
        self._group_ids = itertools.count()
        self._next_version = 1  # for adapter directories that name no version
        self._path_versions: dict[str, int] = {}  # versions given to such directories, reused on a reload
        self._handlers: set[asyncio.Task[Any]] = set()  # completion handlers running
        self._changed = asyncio.Event()  # set (and replaced) whenever in_flight changes
        self._runner: web.AppRunner | None = None
        self._host = host
        self._port = port  # kept across close(): a restarted stand-in listens where it did

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> str:
        """Listen on the host and port (after `close()`, the same port) and return the base URL.

        A start after `close()` is a server restart: no adapter is registered.
        """
        if self._runner is not None:
            return self.url
        app = web.Application(middlewares=[self._middleware])
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        if self.runtime_lora:
            app.router.add_post("/v1/load_lora_adapter", self._load)
            app.router.add_post("/v1/unload_lora_adapter", self._unload)
        # handler_cancellation: a client that goes away cancels its handler, as vLLM's with_cancellation
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, self._host, self._port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self._port = runner.addresses[0][1]
        self._loras.clear()
        # a server on every interface is still reached through this host's loopback
        self.url = f"http://{'127.0.0.1' if self._host in ('0.0.0.0', '') else self._host}:{self._port}"
        return self.url

    async def close(self) -> None:
        """Stop as a killed server would: running completions are cancelled unanswered. Safe twice."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        if handlers:
            await asyncio.wait(handlers)
        await runner.cleanup()

    def forget_adapters(self) -> None:
        """Empty the adapter registry, as a server restart does (the engine keeps what it loaded)."""
        self._loras.clear()

    async def wait_for_in_flight(self, count: int) -> None:
        """Wait until exactly `count` completions are inside engine.generate (0: all answered or aborted)."""
        while self.in_flight != count:
            await self._changed.wait()

    def _count_in_flight(self, delta: int) -> None:
        self.in_flight += delta
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # ------------------------------------------------------------------ plumbing

    @web.middleware
    async def _middleware(self, request: web.Request,
                          handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if (self.api_key is not None and request.method != "OPTIONS"
                and request.path.startswith(GUARDED_PREFIX) and not self._authorized(request)):
            return _json({"error": "Unauthorized"}, 401)
        try:
            return await handler(request)
        except ApiError as e:
            return e.response()
        except web.HTTPNotFound:  # FastAPI's body for a route it does not have
            return _json({"detail": "Not Found"}, 404)
        except web.HTTPMethodNotAllowed:
            return _json({"detail": "Method Not Allowed"}, 405)

    def _authorized(self, request: web.Request) -> bool:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        assert self.api_key is not None
        return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), self.api_key.encode())

    @staticmethod
    async def _body(request: web.Request) -> dict[str, Any]:
        """The JSON object of a POST, refused as vLLM's validate_json_request and FastAPI refuse it."""
        if request.content_type != "application/json":
            raise _invalid_body("Unsupported Media Type: Only 'application/json' is allowed", None)
        try:
            body = await request.json()
        except ValueError as e:  # malformed JSON is the client's error, answered as FastAPI does
            raise _invalid_body(f"JSON decode error: {e}", "body") from e
        if not isinstance(body, dict):
            raise _invalid_body("Input should be a valid dictionary or object", "body")
        return body

    # ------------------------------------------------------------------ routes

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _models(self, request: web.Request) -> web.Response:
        def card(id_: str, root: str, parent: str | None, max_model_len: int | None) -> dict[str, Any]:
            now = int(time.time())
            permission = {"id": f"modelperm-{_random_id()}", "object": "model_permission", "created": now,
                          "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                          "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                          "organization": "*", "group": None, "is_blocking": False}
            return {"id": id_, "object": "model", "created": now, "owned_by": "vllm", "root": root,
                    "parent": parent, "max_model_len": max_model_len, "permission": [permission]}

        cards = [card(self.model_name, self.model_path, None, self.max_model_len)]
        cards += [card(lora.name, lora.path, self.model_name, None) for lora in self._loras.values()]
        return _json({"object": "list", "data": cards})

    async def _load(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        self.loads.append(body)
        name = _field(body, "lora_name", str, None, required=True)
        path = _field(body, "lora_path", str, None, required=True)
        inplace = _field(body, "load_inplace", bool, False)
        async with self._locks[name]:
            if not name or not path:
                raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
            old = self._loras.get(name)
            if old is not None and not inplace:
                raise ApiError(400, f"The lora adapter '{name}' has already been loaded. If you want to load "
                                    "the adapter in place, set 'load_inplace' to True.", "InvalidUserInput")
            if self.fail_next_loads > 0:
                self.fail_next_loads -= 1
                raise ApiError(500, f"stand-in: injected failure loading lora adapter '{name}'", "InternalServerError")
            if not (Path(path) / "adapter_config.json").is_file():
                # vLLM's worker turns the FileNotFoundError of reading adapter_config.json into this
                raise ApiError(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
            ref = self._adapter_ref(name, path)
            try:
                await self.engine.load_adapter(ref)
            except Exception as e:  # vLLM answers any other load failure as a 500 with its text
                raise ApiError(500, str(e), "InternalServerError") from e
            self._loras[name] = _Lora(name, path, ref)
            if old is not None and old.ref.version != ref.version:
                await self._release(old.ref)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        self.unloads.append(body)
        name = _field(body, "lora_name", str, None, required=True)
        async with self._locks[name]:
            if not name:
                raise ApiError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
            lora = self._loras.pop(name, None)
            if lora is None:
                raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
            await self._release(lora.ref)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    def _adapter_ref(self, name: str, path: str) -> AdapterRef:
        """The ref the engine loads. Its version: the manifest's, else the one the directory's name
        gives (AdapterStore's "v000007-1a2b3c4d"), else the one this path got before, else a new one."""
        try:
            manifest = json.loads((Path(path) / "manifest.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):  # no readable manifest: not an AdapterStore directory
            manifest = {}
        if not isinstance(manifest, dict):
            manifest = {}
        version = manifest.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            named = _VERSION_DIR.match(Path(path).name)
            version = int(named.group(1)) if named else self._path_versions.get(path)
        if version is None or version < 1:
            version, self._next_version = self._next_version, self._next_version + 1
            self._path_versions[path] = version
        sha = manifest.get("content_sha256", "")
        return AdapterRef(version=version, name=name, path=path, sha256=sha if isinstance(sha, str) else "")

    async def _release(self, ref: AdapterRef) -> None:
        """Unload `ref` from the engine unless another registered name holds its version."""
        if all(lora.ref.version != ref.version for lora in self._loras.values()):
            await self.engine.unload_adapter(ref)

    async def _completions(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        self.requests.append(body)
        model = _field(body, "model", str, None)
        prompt = body.get("prompt")
        if prompt is None or prompt == "":
            raise _invalid_body("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        if not isinstance(prompt, list) or not prompt or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise _bad_request("stand-in: only a single non-empty list of token ids (>= 0) is supported as prompt",
                               "prompt")
        logprobs = _field(body, "logprobs", int, None)
        if logprobs is not None and logprobs < 0:
            raise _invalid_body("`logprobs` must be a positive value.", "logprobs")
        if _field(body, "stream", bool, False):
            raise _bad_request("stand-in: stream=true is not supported", "stream")
        n = _field(body, "n", int, 1)
        max_tokens = _field(body, "max_tokens", int, DEFAULT_MAX_TOKENS)
        seed = _field(body, "seed", int, None)
        stop_ids = _field(body, "stop_token_ids", list, [])
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
            raise _invalid_body("stop_token_ids must be a list of integers", "stop_token_ids")
        as_ids = _field(body, "return_tokens_as_token_ids", bool, False)
        with_ids = _field(body, "return_token_ids", bool, False)
        sampling = {k: _field(body, k, int if k == "top_k" else float, None)
                    for k in (*SAMPLING_DEFAULTS, "presence_penalty", "frequency_penalty")}

        adapter = self._adapter_for(model)
        if max_tokens > self.max_model_len:
            raise _bad_request(f"max_tokens={max_tokens} cannot be greater than max_model_len="
                               f"max_total_tokens={self.max_model_len}. Please request fewer output tokens.",
                               "max_tokens")
        if len(prompt) > self.max_model_len - max_tokens:
            raise _bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                               f"you requested {max_tokens} output tokens and your prompt contains {len(prompt)} "
                               f"input tokens, for a total of {len(prompt) + max_tokens} tokens. Please reduce "
                               "the length of the input prompt or the number of requested output tokens.",
                               "input_tokens")
        settings = self._sampling_settings(sampling)
        self._check_sampling_params(n, max_tokens, settings)
        if logprobs is not None and logprobs > MAX_LOGPROBS:
            raise _bad_request(f"Requested sample logprobs of {logprobs}, which is greater than max allowed: "
                               f"{MAX_LOGPROBS}", "logprobs")
        self._check_engine_sampling(settings)
        if self.fail_next_completions > 0:
            self.fail_next_completions -= 1
            raise ApiError(500, "stand-in: injected failure of this completion", "InternalServerError")

        request_id = f"cmpl-{request.headers.get('X-Request-Id') or _random_id()}"
        group = GroupRequest(group_id=next(self._group_ids), prompt=Prompt(request_id, "", tuple(prompt)),
                             n=n, max_new_tokens=max_tokens, seed=seed)
        generation = _stopped(await self._generate(group, adapter), set(stop_ids))
        return _json(self._response(generation, request_id, model or self.model_name,
                                    logprobs, as_ids, with_ids))

    def _adapter_for(self, model: str | None) -> AdapterRef:
        """The ref a request's `model` names: the base model (also when left out) or a registered LoRA."""
        if not model or model == self.model_name:
            return AdapterRef.base()
        lora = self._loras.get(model)
        if lora is None:
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        return lora.ref

    def _sampling_settings(self, sent: Mapping[str, float | None]) -> dict[str, float]:
        """The settings vLLM samples with: the request's, else generation_config's, else vLLM's defaults."""
        out = {k: v for k, v in sent.items() if v is not None}
        for k, default in SAMPLING_DEFAULTS.items():
            out.setdefault(k, self.generation_config.get(k, default))
        out.setdefault("presence_penalty", 0.0)
        out.setdefault("frequency_penalty", 0.0)
        return out

    @staticmethod
    def _check_sampling_params(n: int, max_tokens: int, s: Mapping[str, float]) -> None:
        """SamplingParams._verify_args of vLLM 0.24 for the fields the stand-in takes."""
        if n < 1:
            raise _bad_request(f"n must be at least 1, got {n}.")
        for k in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= s[k] <= 2.0:
                raise _bad_request(f"{k} must be in [-2, 2], got {s[k]}.")
        if not math.isfinite(s["repetition_penalty"]) or s["repetition_penalty"] <= 0.0:
            raise _bad_request(f"repetition_penalty must be greater than zero, got {s['repetition_penalty']}.")
        t = s["temperature"]
        if not math.isfinite(t) or not 0.0 <= t <= 2.0:
            raise _bad_request(f"temperature must be in [0, 2], got {t}.", "temperature")
        if not 0.0 < s["top_p"] <= 1.0:
            raise _bad_request(f"top_p must be in (0, 1], got {s['top_p']}.", "top_p")
        if s["top_k"] < -1:
            raise _bad_request(f"top_k must be 0 (disable), or at least 1, got {s['top_k']}.")
        if not 0.0 <= s["min_p"] <= 1.0:
            raise _bad_request(f"min_p must be in [0, 1], got {s['min_p']}.")
        if max_tokens < 1:
            raise _bad_request(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
        if t < SAMPLING_EPS and n > 1:
            raise _bad_request(f"n must be 1 when using greedy sampling, got {n}.")

    def _check_engine_sampling(self, s: Mapping[str, float]) -> None:
        """Refuse settings the wrapped engine does not sample with (a stand-in check, not vLLM's)."""
        if self.sampling is None:
            return
        for k in s:
            asked, engine = s[k], getattr(self.sampling, k)
            if k == "top_k" and asked == -1:
                asked = 0  # vLLM takes -1 as "off", as 0
            if asked != engine:
                raise _bad_request(f"stand-in: this request samples with {k}={asked} but the wrapped engine samples "
                                   f"with {k}={engine}; the log-probs it reports would not be the request's", k)

    async def _generate(self, group: GroupRequest, adapter: AdapterRef) -> Generation:
        """One engine.generate call, cancelled (and counted in `aborted`) if the handler is."""
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._count_in_flight(+1)
        try:
            return await self.engine.generate(group, adapter)
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        except Exception as e:  # vLLM's exception handler answers an engine failure with its text
            raise _from_exception(e) from e
        finally:
            self._handlers.discard(task)
            self._count_in_flight(-1)

    def _response(self, generation: Generation, request_id: str, model: str, logprobs: int | None,
                  as_ids: bool, with_ids: bool) -> dict[str, Any]:
        """vLLM's CompletionResponse.model_dump() for one prompt's n completions."""
        prompt_ids = list(generation.request.prompt.token_ids)
        choices = []
        for i, c in enumerate(generation.completions):
            ids = [int(t) for t in c.token_ids]
            text = self.decode(ids) if self.decode is not None else c.text
            choices.append({
                "index": i, "text": text,
                "logprobs": None if logprobs is None else self._logprobs(ids, c.logprobs.tolist(), as_ids),
                "finish_reason": c.finish_reason, "stop_reason": None,
                "token_ids": ids if with_ids else None, "prompt_logprobs": None,
                "prompt_token_ids": prompt_ids if with_ids else None, "routed_experts": None,
            })
        generated = sum(len(c.token_ids) for c in generation.completions)
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": choices, "service_tier": None, "system_fingerprint": self.fingerprint,
                "usage": {"prompt_tokens": len(prompt_ids), "total_tokens": len(prompt_ids) + generated,
                          "completion_tokens": generated, "prompt_tokens_details": None},
                "kv_transfer_params": None}

    def _logprobs(self, ids: list[int], lps: list[float], as_ids: bool) -> dict[str, Any]:
        """vLLM's CompletionLogProbs, with the sampled token as the only top log-prob.

        lps: [T] the sampled tokens' log-probs.
        """
        if as_ids:
            tokens = [f"token_id:{t}" for t in ids]
        elif self.decode is not None:
            tokens = [self.decode([t]) for t in ids]
        else:  # vLLM's _get_decoded_token under --skip-tokenizer-init: a ValueError, so a 400
            raise _bad_request("Unable to get tokenizer because `skip_tokenizer_init=True`")
        clamped = [max(lp, LOGPROB_FLOOR) for lp in lps]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {"text_offset": offsets, "token_logprobs": clamped, "tokens": tokens,
                "top_logprobs": [{token: lp} for token, lp in zip(tokens, clamped)]}


def _stopped(generation: Generation, stop_ids: set[int]) -> Generation:
    """`generation` with each completion cut after the first token in `stop_ids` (finish_reason "stop")."""
    def cut(c: Completion) -> Completion:
        at = next((i for i, t in enumerate(c.token_ids.tolist()) if t in stop_ids), None)
        if at is None:
            return c
        return dataclasses.replace(c, token_ids=c.token_ids[:at + 1], logprobs=c.logprobs[:at + 1],
                                   finish_reason="stop")
    if not stop_ids:
        return generation
    return dataclasses.replace(generation, completions=tuple(cut(c) for c in generation.completions))


# --------------------------------------------------------------------------- as a process

# a grandchild that ignores SIGTERM, as vLLM's engine core stuck in its shutdown; it says "ready" once it does
_STUCK_CHILD = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
                "time.sleep(60)")
_LAUNCHER_ENV = ("CUDA_VISIBLE_DEVICES", "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "PYTHONUNBUFFERED")


def _engine(a: argparse.Namespace) -> Engine:
    """What samples behind the server: the model at MODEL, or the simulated engine (no model needed)."""
    if a.stand_in_engine == "simulated":
        from pipeline.engines.simulated import SimulatedEngine
        return SimulatedEngine(name="stand-in")
    from pipeline.config.schema import TransformersEngineConfig
    from pipeline.engines.transformers import TransformersEngine
    return TransformersEngine(a.model, sampling=SamplingConfig(), cfg=TransformersEngineConfig(), device="cpu",
                              max_loaded_adapters=a.max_loras + 1, name="stand-in")


async def _serve(a: argparse.Namespace) -> None:
    """Serve MODEL until the process is killed (SIGTERM's default action ends it)."""
    engine = _engine(a)
    await engine.start()
    server = VLLMStandIn(engine, model_name=a.model, host=a.host, port=a.port, max_model_len=a.max_model_len,
                         runtime_lora=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"))
    await server.start()
    await asyncio.Event().wait()


def main() -> None:
    """`vllm serve MODEL --host H --port P [vLLM's flags] [knobs]` as the launcher runs it.

    It serves MODEL under its path, as `vllm serve MODEL` names it, with --max-loras adapters at most,
    and registers the LoRA routes only under VLLM_ALLOW_RUNTIME_LORA_UPDATING (as vLLM does); vLLM's
    other flags are read and ignored. Its first line is one JSON object: {"argv", "pid", "env"}, env
    the variables the launcher sets. The knobs play a server's ways of starting and ending:
      --stand-in-engine simulated  sample with the simulated engine: MODEL need not exist
      --stand-in-delay S      listen only after S seconds (a server still loading its model)
      --stand-in-exit CODE    print an error and exit with CODE instead (a bad flag, a GPU out of memory)
      --stand-in-ignore-term  ignore SIGTERM (a server stuck in its shutdown)
      --stand-in-child        first start a child that ignores SIGTERM (an engine core stuck in its
                              shutdown) and print {"child": pid}
    """
    p = argparse.ArgumentParser(prog="vllm_stand_in.py")
    p.add_argument("model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-loras", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--stand-in-engine", choices=("transformers", "simulated"), default="transformers")
    p.add_argument("--stand-in-delay", type=float, default=0.0)
    p.add_argument("--stand-in-exit", type=int)
    p.add_argument("--stand-in-ignore-term", action="store_true")
    p.add_argument("--stand-in-child", action="store_true")
    a, _ = p.parse_known_args()  # vLLM's other flags
    env = {k: os.environ.get(k) for k in _LAUNCHER_ENV}
    print(json.dumps({"argv": sys.argv[1:], "pid": os.getpid(), "env": env}), flush=True)
    if a.stand_in_ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if a.stand_in_child:
        child = subprocess.Popen([sys.executable, "-c", _STUCK_CHILD], stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"  # SIGTERM is ignored now
        print(json.dumps({"child": child.pid}), flush=True)
    if a.stand_in_exit is not None:
        print("ValueError: the stand-in was told to fail", flush=True)
        sys.exit(a.stand_in_exit)
    time.sleep(a.stand_in_delay)
    asyncio.run(_serve(a))


if __name__ == "__main__":
    main()
