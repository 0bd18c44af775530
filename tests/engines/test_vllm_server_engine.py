"""engine.kind = "vllm_server": a run against a server, and what goes wrong with servers, said clearly.

The server is tests/vllm_stand_in.py: vLLM 0.24's HTTP surface (status codes and JSON shapes
read from its source) in front of one of this repo's engines, on the test's event loop. The
Engine contract itself runs on this engine in test_engine_contract.py (param vllm_server), and
against a real `vllm serve` on a GPU (param vllm_server_gpu; tests/engines/test_vllm_server_gpu.py runs
a whole run there).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from vllm_stand_in import VLLMStandIn

from pipeline.config.schema import ConfigError, SamplingConfig, SimulatedEngineConfig, VLLMServerEngineConfig
from pipeline.config.io import load_config
from pipeline.engines.simulated import SimulatedEngine
from pipeline.engines.vllm_server import VLLMServerEngine
from pipeline.errors import AdapterError, GenerationError
from pipeline.observe.metrics import read_jsonl
from pipeline.loop.orchestrator import Pipeline
from pipeline.store.rollout_log import read_rollouts
from pipeline.types import AdapterRef, GroupRequest, Prompt


def request(group_id: int = 1, n: int = 3) -> GroupRequest:
    return GroupRequest(group_id=group_id, prompt=Prompt(f"p{group_id}", "", (5, 6, 7)), n=n, max_new_tokens=4)


def adapter_dir(root: Path, version: int) -> AdapterRef:
    """A version directory as far as the HTTP engine looks (the simulated engine reads no weights)."""
    d = root / f"v{version:06d}-0000000{version}"
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text("{}")
    (d / "adapter_model.safetensors").write_bytes(b"")  # checked for, never read
    return AdapterRef(version, d.name, str(d))


async def with_server(fn: Any, *, cfg: VLLMServerEngineConfig | None = None, **stub_kw: Any) -> Any:
    """Run fn(stub, engine) with a started stub (over a simulated engine) and an HTTP engine on it."""
    inner = SimulatedEngine(SimulatedEngineConfig(latency_s=0.0, completion_tokens=4), name="inner")
    await inner.start()
    stub = VLLMStandIn(inner, model_name="base-model", **stub_kw)
    url = await stub.start()
    engine = VLLMServerEngine(url, sampling=SamplingConfig(), cfg=cfg or VLLMServerEngineConfig(urls=(url,)),
                              max_staleness=1, name="http-0")
    try:
        return await fn(stub, engine)
    finally:
        await engine.close()
        await stub.close()
        await inner.close()


def test_a_run_trains_through_a_server_with_every_version_registered(tmp_path: Path) -> None:
    """The whole loop over HTTP: the tiny model sampled by the transformers engine behind the stub,
    the LoRA trainer on the CPU, each version registered from the run's adapter store."""
    from pipeline.engines.transformers import TransformersEngine
    from pipeline.models.builtin import build_model

    model_path = build_model("tiny", tmp_path / "models")
    steps, B = 4, 4

    async def main() -> tuple[Pipeline, dict[str, Any], VLLMStandIn]:
        from pipeline.config.schema import TransformersEngineConfig

        inner = TransformersEngine(model_path, sampling=SamplingConfig(), cfg=TransformersEngineConfig(),
                                   device="cpu", dtype="float32", max_loaded_adapters=3, seed=0, name="inner")
        await inner.start()
        stub = VLLMStandIn(inner, model_name="tiny")
        url = await stub.start()
        cfg = load_config(None, {
            "out": str(tmp_path / "run"), "model.path": str(model_path), "engine.kind": "vllm_server",
            "engine.vllm_server.urls": [url], "trainer.separate_process": False, "sampling.n": 4,
            "sampling.max_new_tokens": 8, "pipeline.steps": steps, "pipeline.batch_groups": B,
            "pipeline.max_staleness": 1, "pipeline.logprob_check_every": 2, "log.progress": False,
        })
        try:
            p = Pipeline(cfg, console=False)
            summary = await p.run()
        finally:
            await stub.close()
            await inner.close()
        return p, summary, stub

    p, summary, stub = asyncio.run(main())
    assert summary["accounting_ok"] and summary["groups_trained"] == steps * B, summary
    # every request asked for the on-policy contract explicitly, one group per call
    assert stub.requests and all(
        (r["temperature"], r["top_p"], r["top_k"], r["min_p"], r["logprobs"], r["return_token_ids"], r["n"])
        == (1.0, 1.0, 0, 0.0, 0, True, 4) for r in stub.requests)
    # each version the trainer published reached the server from the run's store, under its own name
    store = (tmp_path / "run" / "adapters").resolve()
    registered = {d["lora_name"]: d["lora_path"] for d in stub.loads}
    assert len(registered) == len(stub.loads) >= steps - 1
    assert all(Path(path).parent == store for path in registered.values())
    assert all(name.startswith(Path(path).name + "-") for name, path in registered.items())
    # and every group trained says which version sampled it; the server answered for that adapter
    r = read_rollouts(tmp_path / "run" / "rollouts.zarr")
    assert max(r.groups["version"].tolist()) >= 1
    models = {req["model"] for req in stub.requests}
    assert "tiny" in models and models - {"tiny"} <= set(registered)
    # engine and trainer agree on the log-probs (float32 both sides: only summation order differs)
    checks = [row["check/max_abs_diff"] for row in read_jsonl(tmp_path / "run" / "metrics.jsonl")
              if "check/max_abs_diff" in row]
    assert checks and max(checks) < 1e-3, checks
    # versions older than the window were unregistered again
    assert stub.unloads


def test_a_server_without_runtime_adapters_is_named_with_the_fix(tmp_path: Path) -> None:
    async def scenario(stub: VLLMStandIn, engine: VLLMServerEngine) -> None:
        await engine.start()
        with pytest.raises(AdapterError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"):
            await engine.load_adapter(adapter_dir(tmp_path, 1))

    asyncio.run(with_server(scenario, runtime_lora=False))


def test_a_model_the_server_does_not_serve_is_refused_at_start(tmp_path: Path) -> None:
    async def scenario(stub: VLLMStandIn, engine: VLLMServerEngine) -> None:
        wrong = VLLMServerEngine(engine.url, sampling=SamplingConfig(),
                                 cfg=VLLMServerEngineConfig(urls=(engine.url,), model="other"), name="wrong")
        with pytest.raises(ConfigError, match="'other' is not served by .* \\(it serves \\['base-model'\\]"):
            await wrong.start()

    asyncio.run(with_server(scenario))


def test_start_waits_for_a_server_that_is_still_coming_up(tmp_path: Path) -> None:
    """A refused connection is a server starting (vLLM takes minutes): start() waits for it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main() -> None:
        inner = SimulatedEngine(SimulatedEngineConfig(latency_s=0.0, completion_tokens=4), name="inner")
        await inner.start()
        url = f"http://127.0.0.1:{port}"
        engine = VLLMServerEngine(url, sampling=SamplingConfig(), cfg=VLLMServerEngineConfig(urls=(url,)),
                                  name="early")
        starting = asyncio.ensure_future(engine.start())
        await asyncio.sleep(1.5)
        assert not starting.done(), "start() gave up on a server that is still starting"
        stub = VLLMStandIn(inner, model_name="base-model", port=port)
        await stub.start()
        try:
            await asyncio.wait_for(starting, 10)
            gen = await engine.generate(request(), AdapterRef.base())
            assert len(gen.completions) == 3 and gen.version == 0
        finally:
            await engine.close()
            await stub.close()
            await inner.close()

    asyncio.run(main())


def test_a_server_that_forgot_an_adapter_gets_it_again(tmp_path: Path) -> None:
    async def scenario(stub: VLLMStandIn, engine: VLLMServerEngine) -> None:
        await engine.start()
        ref = adapter_dir(tmp_path, 1)
        await engine.load_adapter(ref)
        stub.forget_adapters()  # as if the server restarted between the load and the request
        gen = await engine.generate(request(), ref)
        assert gen.version == 1 and len(gen.completions) == 3
        assert engine.stats.reregistered == 1 and len(stub.loads) == 2

    asyncio.run(with_server(scenario))


def test_a_failed_completion_fails_the_group_with_the_servers_message(tmp_path: Path) -> None:
    async def scenario(stub: VLLMStandIn, engine: VLLMServerEngine) -> None:
        await engine.start()
        stub.fail_next_completions = 1
        with pytest.raises(GenerationError, match=f"{engine.url} answered 500 to group 1"):
            await engine.generate(request(), AdapterRef.base())
        assert len((await engine.generate(request(2), AdapterRef.base())).completions) == 3  # the next one works

    asyncio.run(with_server(scenario))


def test_a_failed_registration_is_an_adapter_error_and_a_later_load_tries_again(tmp_path: Path) -> None:
    async def scenario(stub: VLLMStandIn, engine: VLLMServerEngine) -> None:
        await engine.start()
        ref = adapter_dir(tmp_path, 1)
        stub.fail_next_loads = 1
        with pytest.raises(AdapterError, match=f"could not load adapter version 1 from '{ref.path}'"):
            await engine.load_adapter(ref)
        assert 1 not in engine.loaded_versions
        await engine.load_adapter(ref)
        assert engine.loaded_versions == (1,)

    asyncio.run(with_server(scenario))


def test_the_api_key_comes_from_the_environment_variable_named(tmp_path: Path, monkeypatch: Any) -> None:
    async def main() -> None:
        async def scenario(stub: VLLMStandIn, engine: VLLMServerEngine) -> None:
            def keyed(env: str) -> VLLMServerEngine:
                return VLLMServerEngine(engine.url, sampling=SamplingConfig(), name="keyed",
                                        cfg=VLLMServerEngineConfig(urls=(engine.url,), api_key_env=env))

            with pytest.raises(ConfigError, match="refused the API key"):
                await engine.start()  # no key sent
            monkeypatch.delenv("PIPELINE_TEST_KEY", raising=False)
            with pytest.raises(ConfigError, match="PIPELINE_TEST_KEY.* is not set"):
                await keyed("PIPELINE_TEST_KEY").start()
            monkeypatch.setenv("PIPELINE_TEST_KEY", "wrong")
            with pytest.raises(ConfigError, match="refused the API key from \\$PIPELINE_TEST_KEY"):
                await keyed("PIPELINE_TEST_KEY").start()
            monkeypatch.setenv("PIPELINE_TEST_KEY", "sesame")
            good = keyed("PIPELINE_TEST_KEY")
            await good.start()
            try:
                assert len((await good.generate(request(), AdapterRef.base())).completions) == 3
            finally:
                await good.close()

        await with_server(scenario, api_key="sesame")

    asyncio.run(main())


def test_unused_versions_are_unregistered_but_not_while_a_group_uses_them(tmp_path: Path) -> None:
    async def scenario(stub: VLLMStandIn, engine: VLLMServerEngine) -> None:
        await engine.start()
        refs = [adapter_dir(tmp_path, v) for v in (1, 2, 3, 4)]
        for ref in refs[:3]:
            await engine.load_adapter(ref)
        assert engine.loaded_versions == (1, 2, 3)  # max_staleness 1: up to 3 registered
        await engine.load_adapter(refs[3])  # a fourth: the oldest idle one goes
        await asyncio.sleep(0.05)
        assert engine.loaded_versions == (2, 3, 4)
        assert [u["lora_name"] for u in stub.unloads] == [f"{refs[0].name}-{engine._tag}"]
        await engine.unload_adapter(refs[1])
        assert engine.loaded_versions == (3, 4) and len(stub.unloads) == 2

    asyncio.run(with_server(scenario))


def test_a_server_that_dies_mid_run_is_waited_for_and_nothing_is_lost(tmp_path: Path) -> None:
    """The server goes away after step 3 (its running completions get no answer) and comes back on
    the same port a second later, with no adapters: the engine leaves the rotation, is restarted
    (start() waits for the server), registers the versions in use again, and every group is
    accounted for."""
    import json

    from pipeline.models.builtin import build_model

    prompts = [{"id": f"p{i}", "prompt": "", "token_ids": [1 + i % 50, 2, 3]} for i in range(64)]
    steps, B = 8, 2

    async def main() -> tuple[dict[str, Any], VLLMStandIn, int]:
        inner = SimulatedEngine(SimulatedEngineConfig(latency_s=0.05, completion_tokens=4), name="inner")
        await inner.start()
        stub = VLLMStandIn(inner, model_name="base-model")
        url = await stub.start()
        cfg = load_config(None, {
            "out": str(tmp_path / "run"), "model.path": str(build_model("tiny", tmp_path / "models")),
            "engine.kind": "vllm_server", "engine.vllm_server.urls": [url], "engine.restart_backoff_s": 0.1,
            "trainer.kind": "simulated", "trainer.step_s": 0.05, "sampling.n": 2, "pipeline.steps": steps,
            "pipeline.batch_groups": B, "pipeline.max_staleness": 1, "log.progress": False,
        })
        p = Pipeline(cfg, prompts=prompts, reward=lambda prompts, completions, completion_ids, **kw:
                     [float(len(ids)) for ids in completion_ids], tokenizer=False, console=False)
        loads_before = 0
        try:
            async for res in p.steps():
                if res.step == 3:
                    loads_before = len(stub.loads)
                    await stub.close()  # the server dies
                    asyncio.get_running_loop().call_later(1.0, lambda: asyncio.ensure_future(stub.start()))
        finally:
            await stub.close()
            await inner.close()
        return json.loads((tmp_path / "run" / "summary.json").read_text()), stub, loads_before

    summary, stub, loads_before = asyncio.run(main())
    assert summary["accounting_ok"] and summary["groups_trained"] == steps * B, summary
    assert summary["engine_restarts"] == {"vllm-server-0": 1} and summary["engines_out_of_rotation"] == [], summary
    assert len(stub.loads) > loads_before, "the restarted engine did not register the versions in use again"


def test_a_prompt_longer_than_the_servers_context_is_refused_by_name(tmp_path: Path) -> None:
    """The server's --max-model-len (from /v1/models), not only the model's own, bounds prompt + completion."""
    import json

    from pipeline.models.builtin import build_model

    long_prompt = {"id": "long", "prompt": "", "token_ids": list(range(1, 10))}
    prompts = [long_prompt] + [{"id": f"p{i}", "prompt": "", "token_ids": [1 + i % 50, 2, 3]} for i in range(32)]

    async def main() -> dict[str, Any]:
        inner = SimulatedEngine(SimulatedEngineConfig(latency_s=0.0, completion_tokens=4), name="inner")
        await inner.start()
        stub = VLLMStandIn(inner, model_name="base-model", max_model_len=12)
        url = await stub.start()
        cfg = load_config(None, {
            "out": str(tmp_path / "run"), "model.path": str(build_model("tiny", tmp_path / "models")),
            "engine.kind": "vllm_server", "engine.vllm_server.urls": [url], "trainer.kind": "simulated",
            "sampling.n": 2, "sampling.max_new_tokens": 4, "pipeline.steps": 3, "pipeline.batch_groups": 2,
            "log.progress": False,
        })
        p = Pipeline(cfg, prompts=prompts, reward=lambda prompts, completions, completion_ids, **kw:
                     [float(len(ids)) for ids in completion_ids], tokenizer=False, console=False)
        try:
            summary = await p.run()
        finally:
            await stub.close()
            await inner.close()
        return summary

    summary = asyncio.run(main())
    assert summary["accounting_ok"] and summary["prompts_refused"] >= 1 and summary["steps"] == 3, summary
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    reasons = [e["reason"] for e in events if e["event"] == "prompt_refused"]
    # the server's 12, not the tiny model's own 512
    assert any("'long' has 9 tokens; with max_new_tokens 4 it exceeds the context of 12" in r for r in reasons), reasons


def test_config_refuses_what_a_server_cannot_do() -> None:
    with pytest.raises(ConfigError, match="needs engine.vllm_server.urls"):
        load_config(None, {"engine.kind": "vllm_server"})
    with pytest.raises(ConfigError, match="engine.vllm_server.urls\\[0\\]"):
        load_config(None, {"engine.kind": "vllm_server", "engine.vllm_server.urls": ["gpu-host:8000"]})
    with pytest.raises(ConfigError, match='engine.devices does not apply to engine.kind = "vllm_server"'):
        load_config(None, {"engine.kind": "vllm_server", "engine.vllm_server.urls": ["http://h:8000"],
                           "engine.devices": ["cuda:0"]})
    with pytest.raises(ConfigError, match='trainer.update = "full" is not supported by engine.kind = "vllm_server"'):
        load_config(None, {"engine.kind": "vllm_server", "engine.vllm_server.urls": ["http://h:8000"],
                           "trainer.update": "full"})
