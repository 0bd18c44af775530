"""The vLLM server stub answers vLLM 0.24's shapes with the wrapped engine's real tokens and log-probs."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from pipeline.config.schema import SimulatedEngineConfig
from pipeline.engines.simulated import SimulatedEngine
from pipeline.types import AdapterRef, GroupRequest, Prompt
from vllm_server_stub import VLLMServerStub


async def _sim(latency_s: float = 0.0) -> SimulatedEngine:
    engine = SimulatedEngine(SimulatedEngineConfig(latency_s=latency_s, completion_tokens=4), name="sim")
    await engine.start()
    return engine


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
        stub = VLLMServerStub(engine, model_name="base-model")
        url = await stub.start()
        try:
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
        finally:
            await stub.close()
        assert status == 200, out
        assert stub.requests == [body]
        # the stub's first group is group 0: the same call in process gives the same samples
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
        stub = VLLMServerStub(engine, model_name="base-model")
        url = await stub.start()
        try:
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
        finally:
            await stub.close()

    asyncio.run(main())


def test_api_key_and_client_disconnect_abort() -> None:
    async def main() -> None:
        engine = await _sim(latency_s=30.0)
        stub = VLLMServerStub(engine, api_key="secret", runtime_lora=False)
        url = await stub.start()
        body = {"prompt": [1, 2], "max_tokens": 2}
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{url}/health") as r:
                    assert r.status == 200
                status, out = await _post(s, f"{url}/v1/completions", body)
                assert (status, out) == (401, {"error": "Unauthorized"})
            async with aiohttp.ClientSession(headers={"Authorization": "Bearer secret"}) as s:
                status, out = await _post(s, f"{url}/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"})
                assert (status, out) == (404, {"detail": "Not Found"})  # runtime LoRA off: no such route
                call = asyncio.create_task(_post(s, f"{url}/v1/completions", body))
                await asyncio.wait_for(stub.wait_for_in_flight(1), 5)
                call.cancel()  # the client goes away: the server cancels the engine call
                await asyncio.gather(call, return_exceptions=True)
            await asyncio.wait_for(stub.wait_for_in_flight(0), 5)
            assert stub.aborted == 1 and engine.stats["cancelled"] == 1
        finally:
            await stub.close()

    asyncio.run(main())
