"""tests/vllm_stand_in.py: the `vllm serve` stand-in answers vLLM 0.24's shapes with the wrapped engine's
real tokens and log-probs, in process and as a process of its own."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp
import numpy as np
import pytest

from pipeline.config.schema import SimulatedEngineConfig
from pipeline.engines.vllm_launch import free_port
from pipeline.engines.simulated import SimulatedEngine
from pipeline.types import AdapterRef, GroupRequest, Prompt
from vllm_stand_in import VLLMStandIn

STAND_IN = Path(__file__).resolve().parents[1] / "vllm_stand_in.py"


async def _sim(latency_s: float = 0.0) -> SimulatedEngine:
    engine = SimulatedEngine(SimulatedEngineConfig(latency_s=latency_s, completion_tokens=4), name="sim")
    await engine.start()
    return engine


@contextlib.asynccontextmanager
async def _serving(engine: SimulatedEngine, **kw: Any) -> AsyncIterator[tuple[VLLMStandIn, str]]:
    """The stand-in serving `engine`, and its URL; closed at the end."""
    server = VLLMStandIn(engine, **kw)
    url = await server.start()
    try:
        yield server, url
    finally:
        await server.close()


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with session.post(url, json=body) as r:
        text = await r.text()
        return r.status, json.loads(text) if r.content_type == "application/json" else text


def _error(status: int, body: Any, err_type: str, param: str | None = None) -> str:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    assert body["error"]["code"] == status and body["error"]["type"] == err_type, body
    assert body["error"]["param"] == param, body
    return body["error"]["message"]


def test_completion_returns_the_engines_tokens_and_logprobs() -> None:
    async def main() -> None:
        engine = await _sim()
        async with _serving(engine, model_name="base-model") as (server, url):
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{url}/v1/models") as r:
                    models = await r.json()
                assert r.status == 200 and models["object"] == "list"
                [base] = models["data"]
                assert (base["id"], base["root"], base["parent"], base["max_model_len"]) == ("base-model", "base-model",
                                                                                             None, 2048)
                body = {"model": "base-model", "prompt": [5, 6, 7], "n": 3, "max_tokens": 4, "temperature": 1.0,
                        "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True}
                status, out = await _post(s, f"{url}/v1/completions", body)
        assert status == 200, out
        assert server.requests == [body]
        # the server's first group is group 0: the same call in process gives the same samples
        want = await engine.generate(GroupRequest(0, Prompt("x", "", (5, 6, 7)), n=3, max_new_tokens=4),
                                     AdapterRef.base())
        assert out["object"] == "text_completion" and out["model"] == "base-model" and out["id"].startswith("cmpl-")
        assert [c["index"] for c in out["choices"]] == [0, 1, 2]
        for choice, c in zip(out["choices"], want.completions, strict=True):
            lp = choice["logprobs"]
            assert choice["token_ids"] == c.token_ids.tolist() and choice["prompt_token_ids"] == [5, 6, 7]
            assert len(lp["token_logprobs"]) == len(choice["token_ids"]) == 4
            np.testing.assert_array_equal(np.asarray(lp["token_logprobs"], dtype=np.float32), c.logprobs)
            assert lp["tokens"] == [f"token_id:{t}" for t in c.token_ids]
            assert lp["top_logprobs"] == [{k: v} for k, v in zip(lp["tokens"], lp["token_logprobs"])]
            assert choice["finish_reason"] == c.finish_reason and choice["stop_reason"] is None
        assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15,
                                "prompt_tokens_details": None}

    asyncio.run(main())


def test_adapters_and_errors_answer_as_vllm(tmp_path: Path) -> None:
    adapter = tmp_path / "v000007-1a2b3c4d"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "manifest.json").write_text(json.dumps({"version": 7, "content_sha256": "ab" * 32}))

    async def main() -> None:
        engine = await _sim()
        async with _serving(engine, model_name="base-model") as (server, url):
            async with aiohttp.ClientSession() as s:
                status, out = await _post(s, f"{url}/v1/completions", {"model": "v1", "prompt": [1], "max_tokens": 2})
                assert status == 404 and _error(404, out, "NotFoundError", "model") == "The model `v1` does not exist."
                missing = str(tmp_path / "gone")
                status, out = await _post(s, f"{url}/v1/load_lora_adapter", {"lora_name": "a", "lora_path": missing})
                assert status == 404
                assert _error(404, out, "NotFoundError") == f"Loading lora a failed: No adapter found for {missing}"
                status, out = await _post(s, f"{url}/v1/unload_lora_adapter", {"lora_name": "a"})
                assert status == 404 and _error(404, out, "NotFoundError") == "The lora adapter 'a' cannot be found."

                load = {"lora_name": adapter.name, "lora_path": str(adapter)}
                status, out = await _post(s, f"{url}/v1/load_lora_adapter", load)
                assert (status, out) == (200, f"Success: LoRA adapter '{adapter.name}' added successfully.")
                assert 7 in engine.loaded_versions
                status, out = await _post(s, f"{url}/v1/load_lora_adapter", load)
                assert status == 400 and "has already been loaded" in _error(400, out, "InvalidUserInput")
                async with s.get(f"{url}/v1/models") as r:
                    cards = (await r.json())["data"]
                assert [(c["id"], c["root"], c["parent"], c["max_model_len"]) for c in cards] == [
                    ("base-model", "base-model", None, 2048), (adapter.name, str(adapter), "base-model", None)]
                status, out = await _post(s, f"{url}/v1/completions", {"model": adapter.name, "prompt": [1, 2],
                                                                        "max_tokens": 3, "logprobs": 0,
                                                                        "return_tokens_as_token_ids": True})
                assert status == 200 and out["model"] == adapter.name, out
                want = await engine.generate(GroupRequest(0, Prompt("x", "", (1, 2)), n=1, max_new_tokens=3),
                                             AdapterRef(7, adapter.name, str(adapter)))
                np.testing.assert_array_equal(np.asarray(out["choices"][0]["logprobs"]["token_logprobs"],
                                                         dtype=np.float32), want.completions[0].logprobs)
                status, out = await _post(s, f"{url}/v1/unload_lora_adapter", {"lora_name": adapter.name})
                assert (status, out) == (200, f"Success: LoRA adapter '{adapter.name}' removed successfully.")
                assert 7 not in engine.loaded_versions

    asyncio.run(main())


def test_api_key_and_client_disconnect_abort() -> None:
    async def main() -> None:
        engine = await _sim(latency_s=30.0)
        body = {"prompt": [1, 2], "max_tokens": 2}
        async with _serving(engine, api_key="secret", runtime_lora=False) as (server, url):
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{url}/health") as r:
                    assert r.status == 200
                status, out = await _post(s, f"{url}/v1/completions", body)
                assert (status, out) == (401, {"error": "Unauthorized"})
            async with aiohttp.ClientSession(headers={"Authorization": "Bearer secret"}) as s:
                status, out = await _post(s, f"{url}/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"})
                assert (status, out) == (404, {"detail": "Not Found"})  # runtime LoRA off: no such route
                call = asyncio.create_task(_post(s, f"{url}/v1/completions", body))
                await asyncio.wait_for(server.wait_for_in_flight(1), 5)
                call.cancel()  # the client goes away: the server cancels the engine call
                await asyncio.gather(call, return_exceptions=True)
            await asyncio.wait_for(server.wait_for_in_flight(0), 5)
            assert server.aborted == 1 and engine.stats["cancelled"] == 1

    asyncio.run(main())


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1, whatever http_proxy says


def _call(url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    """(status, JSON answer or None) of a GET, or of a POST of `body`."""
    request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with _DIRECT.open(request, timeout=2) as r:
            status, text = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read()
    return status, json.loads(text) if text else None


@pytest.mark.parametrize("runtime_lora", [False, True], ids=["no-runtime-lora", "runtime-lora"])
def test_as_a_process_it_serves_the_model_by_its_path_and_ends_on_sigterm(tmp_path: Path,
                                                                          runtime_lora: bool) -> None:
    """The command line VLLMServeProcess runs: its first line says what it was given, it serves MODEL
    under its path, the LoRA routes exist only under VLLM_ALLOW_RUNTIME_LORA_UPDATING (as vLLM's), and
    SIGTERM ends it by the signal."""
    port = free_port()
    model = str(tmp_path / "no-model-here")  # the simulated engine reads nothing
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ALLOW_RUNTIME_LORA_UPDATING"}
    if runtime_lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    proc = subprocess.Popen([sys.executable, str(STAND_IN), model, "--port", str(port), "--max-num-seqs", "8",
                             "--stand-in-engine", "simulated"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        assert first["argv"][:3] == [model, "--port", str(port)] and first["pid"] == proc.pid
        assert first["env"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == ("True" if runtime_lora else None)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if _call(f"{url}/health")[0] == 200:
                    break
            except OSError:  # not listening yet
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the stand-in did not come up"
            time.sleep(0.05)
        status, models = _call(f"{url}/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == [model]
        status, answer = _call(f"{url}/v1/unload_lora_adapter", {"lora_name": "a"})
        if runtime_lora:  # the route exists and says the name is unknown
            assert status == 404 and answer["error"]["type"] == "NotFoundError", answer
        else:  # no such route
            assert (status, answer) == (404, {"detail": "Not Found"})
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
