"""`vllm serve` as a child process on one GPU of this host: started, health-checked, stopped whole.

The HTTP engine (vllm_server.py) talks to a server that is already up; this starts one here, for
the sweep benchmark's `--engine vllm_server` and the GPU tests. The server is vLLM's own CLI, run
by this interpreter, with adapters registered at run time (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True,
--enable-lora). It listens on 127.0.0.1 unless told otherwise: it serves anyone who reaches it.

Invariants:
- Only the child sees the narrowed GPU list: CUDA_VISIBLE_DEVICES is set in the environment handed
  to it, a copy of this process's taken under devices.ENV_LOCK; os.environ is never changed.
- The server and every process it starts (vLLM's engine core) form their own process group
  (start_new_session). `stop()` signals the whole group: SIGTERM, SIGKILL after `grace_s`, then
  SIGKILL to whatever of the group outlived the server, so nothing of it holds the GPU afterwards.
- The server's parent is a guard (serve_guard.py), the group's leader, and `pid` is the guard's.
  On Linux the kernel signals the guard when the thread that started it ends (PR_SET_PDEATHSIG),
  and the guard SIGKILLs the whole group: this process killed, or exiting without `stop()`,
  leaves neither the server nor vLLM's engine core. Call `start()` from a thread that lives as
  long as the server (an event loop's).
- `start()` returns once GET /health answers 200. If the server exits first or does not answer
  within the timeout, it is stopped and EngineDeadError is raised with the end of its log.
- With `skip_tokenizer_init`, the server starts with --skip-tokenizer-init where the model's
  tokenizer files give its eos id (`eos_id`, read by `start()`; engines.vllm.tokenizer_eos), as
  the in-process engine does; not where the flags name another tokenizer. Such a server stops a
  completion at that eos only when the request names it in stop_token_ids: a VLLMServerEngine
  given the server does (pipeline runs launch servers so), a client that knows only its URL does not.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Sequence

import structlog

from pipeline.config.schema import VLLMEngineConfig
from pipeline.devices import ENV_LOCK
from pipeline.engines.vllm import compilation_config, physical_gpu, tokenizer_eos
from pipeline.errors import ConfigError, EngineDeadError

log = structlog.get_logger(__name__)

# `vllm serve`, run by this interpreter, so it uses the vLLM this process would import
VLLM_SERVE = (sys.executable, "-m", "vllm.entrypoints.cli.main", "serve")
_POLL_S = 0.5  # how often a starting server is asked for /health: it gives no other sign that it is up
_PROBE_TIMEOUT_S = 2.0  # one /health request; a server still loading may not accept yet
_LOG_TAIL_BYTES = 4000  # how much of the server's log an error quotes
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_GUARD = Path(__file__).with_name("serve_guard.py")  # the server's parent, which ends its group when we die
# free_port draws from below Linux's default ephemeral range (32768-60999), where outgoing
# connections take their local ports
_PORTS = (20000, 32767)
# Plain urllib without proxies: an http_proxy in the environment must not carry requests to
# 127.0.0.1 elsewhere (aiohttp, the engine's client, ignores proxy variables too)
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class VLLMServeProcess:
    """One `vllm serve MODEL` on `device`, with LoRA adapters loadable at run time; its URL is `url`."""

    def __init__(self, model_path: str | Path, log_path: str | Path, *, device: str = "cuda:0",
                 host: str = "127.0.0.1", port: int = 0, gpu_memory_utilization: float = 0.85,
                 max_model_len: int = 2048, max_num_seqs: int = 1024, max_lora_rank: int = 16, max_loras: int = 3,
                 enforce_eager: bool = False, max_cudagraph_capture_size: int = 0,
                 compilation: dict[str, Any] | None = None, extra: Sequence[str] = (),
                 skip_tokenizer_init: bool = False, program: Sequence[str] = VLLM_SERVE,
                 grace_s: float = 30.0) -> None:
        """The defaults are engine.vllm's (max_loras: max_staleness + 2 at max_staleness 1).

        port: 0 = a free one, chosen now (so `url` is known before `start()`).
        max_cudagraph_capture_size: the largest batch captured as a CUDA graph; 0 = vLLM's own default.
        compilation: `--compilation-config`; None = the in-process engine's with LoRA on engine.vllm's
            defaults (pipeline.engines.vllm.compilation_config).
        extra: more `vllm serve` flags, appended as given.
        skip_tokenizer_init: start without the tokenizer where its files give the eos id (see above).
        program: the command the model path and flags are appended to; tests put a stand-in here.
        grace_s: how long `stop()` waits after SIGTERM before SIGKILL.
        """
        if not (device.startswith("cuda:") and device[5:].isdigit()):
            raise ConfigError(f'vllm serve needs a GPU like "cuda:0", got device {device!r}')
        if not 0 <= port <= 65535:
            raise ConfigError(f"vllm serve port must be in [0, 65535] (0 = a free one), got {port}")
        self.model_path = Path(model_path)
        self.log_path = Path(log_path)
        self.device = device
        self.host = host
        self.port = port or free_port()
        self.grace_s = grace_s
        self.skip_tokenizer_init = skip_tokenizer_init
        self.argv = [*program, str(self.model_path), "--host", host, "--port", str(self.port),
                     "--gpu-memory-utilization", str(gpu_memory_utilization), "--max-model-len", str(max_model_len),
                     "--max-num-seqs", str(max_num_seqs), "--enable-lora", "--max-lora-rank", str(max_lora_rank),
                     "--compilation-config", json.dumps(compilation_config(VLLMEngineConfig(), lora=True)
                                                        if compilation is None else compilation),
                     "--max-loras", str(max_loras), *(["--enforce-eager"] if enforce_eager else []),
                     *(["--max-cudagraph-capture-size", str(max_cudagraph_capture_size)]
                       if max_cudagraph_capture_size and not enforce_eager else []), *extra]
        # a server on every interface is still reached through this host's loopback
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{self.port}"
        self.pid: int | None = None  # the server's, once started; also its process group's id
        self.eos_id: int | None = None  # the tokenizer's eos, once started without its tokenizer
        self.returncode: int | None = None  # once stopped
        self._proc: subprocess.Popen[bytes] | None = None

    async def start(self, timeout_s: float = 600.0) -> str:
        """Start the server and return `url` once GET /health answers 200 (within `timeout_s`)."""
        if self._proc is not None:
            raise RuntimeError(f"vllm serve on {self.url} is already started")
        # without its tokenizer, vLLM's front end and its engine core each skip a load of it (seconds
        # for a large vocabulary); tokenizer.json is read off the loop (29 MB for the built-in models)
        skip, self.eos_id = False, None
        if self.skip_tokenizer_init and not any(a == "--tokenizer" or a.startswith("--tokenizer=") for a in self.argv):
            skip, self.eos_id = await asyncio.to_thread(tokenizer_eos, self.model_path)
        # on this thread, not a worker's: the death signal follows the thread that starts the child
        # (a fork and an exec: quick)
        self._proc = self._spawn(["--skip-tokenizer-init"] if skip else [])
        self.pid, self.returncode = self._proc.pid, None
        t0 = time.monotonic()
        try:
            while not await asyncio.to_thread(self._healthy):
                if (code := self._proc.poll()) is not None:
                    raise EngineDeadError(f"vllm serve exited with code {code} before answering {self.url}/health; "
                                          f"the end of its log ({self.log_path}):\n{self.log_tail()}")
                if time.monotonic() - t0 > timeout_s:
                    raise EngineDeadError(f"vllm serve did not answer {self.url}/health within {timeout_s:g} s; "
                                          f"the end of its log ({self.log_path}):\n{self.log_tail()}")
                await asyncio.sleep(_POLL_S)
        except BaseException:  # a server that is not up (or a cancelled start) is not left running
            await self.stop()
            raise
        log.info("vllm_serve_ready", pid=self.pid, url=self.url, seconds=round(time.monotonic() - t0, 1))
        return self.url

    async def stop(self) -> None:
        """End the server's process group: SIGTERM, SIGKILL after `grace_s`. Safe to call twice."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, self.grace_s)
            except subprocess.TimeoutExpired:
                log.warning("vllm_serve_killed", pid=proc.pid, grace_s=self.grace_s)
                _signal_group(proc.pid, signal.SIGKILL)
                await asyncio.to_thread(proc.wait)
        # the server is gone; a process it started may not be (an engine core stuck in shutdown)
        _signal_group(proc.pid, signal.SIGKILL)
        self.returncode = proc.returncode
        log.info("vllm_serve_stopped", pid=proc.pid, returncode=proc.returncode)

    def log_tail(self) -> str:
        """The last few thousand characters the server wrote."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - _LOG_TAIL_BYTES))
                return f.read().decode("utf-8", "replace")
        except OSError as e:  # the error it is quoted in matters more than the tail
            return f"(cannot read {self.log_path}: {e})"

    def _spawn(self, flags: list[str]) -> subprocess.Popen[bytes]:
        """The server's process (`argv` and `flags`), in its own process group, its output in the log."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = self._child_env()
        with open(self.log_path, "wb") as out:  # the child writes through its own copy of the descriptor
            # preexec_fn is unsafe beside threads when it takes a lock another thread held at the
            # fork; this one calls only prctl (looked up before the fork) and getppid
            proc = subprocess.Popen([sys.executable, str(_GUARD), str(os.getpid()), "--", *self.argv, *flags], env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=_die_with_parent())
        log.info("vllm_serve_started", pid=proc.pid, url=self.url, gpu=env["CUDA_VISIBLE_DEVICES"],
                 flags=flags, log=str(self.log_path))  # flags: those added to `argv` for this start
        return proc

    def _child_env(self) -> dict[str, str]:
        with ENV_LOCK:  # a copy no other start is narrowing at this moment, and the device read through it
            env = dict(os.environ)
            gpu = physical_gpu(self.device)
        env.update(CUDA_VISIBLE_DEVICES=gpu, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
                   PYTHONUNBUFFERED="1")  # the log is current when a stuck server is killed
        return env

    def _healthy(self) -> bool:
        """Whether GET /health answers 200 now (blocking)."""
        try:
            with _DIRECT.open(self.url + "/health", timeout=_PROBE_TIMEOUT_S) as r:
                return r.status == 200
        except OSError:  # not listening yet, or answering an error while it starts
            return False


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that refuses connections now. Probed by connecting, not binding: this package
    opens no socket of its own (tests/base/test_security.py). Another process may take it before the server."""
    for _ in range(100):
        port = random.randint(*_PORTS)
        try:
            _DIRECT.open(f"http://{host}:{port}/", timeout=_PROBE_TIMEOUT_S).close()
        except urllib.error.URLError as e:
            if isinstance(e.reason, ConnectionRefusedError):
                return port
        except OSError:  # something answered there, if not over HTTP: taken
            pass
    raise EngineDeadError(f"no free port found on {host} in {_PORTS[0]}..{_PORTS[1]} after 100 tries")


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # nothing of the group is left
        pass


def _die_with_parent() -> Callable[[], None] | None:
    """The guard's pre-exec step on Linux: SIGUSR1 (its cue to SIGKILL the server's group) when the
    thread starting it ends. None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the forked child only calls it
    except (OSError, AttributeError):  # no prctl in this libc: the server then outlives a killed owner
        return None
    parent, cue = os.getpid(), int(signal.SIGUSR1)

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, cue)
        if os.getppid() != parent:  # the owner died before the signal was armed
            os._exit(1)

    return preexec
