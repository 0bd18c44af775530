"""A whole run against a real `vllm serve`: engine.kind = "vllm_server", the trainer on a GPU.

Marked `gpu`; skips without CUDA and vLLM. The server (the "small" model, eager, 30% of GPU 0,
adapters loadable at run time) is started by the test as a child process, as a user would start
it on another host. Set OUT to a directory to keep the run's summary (`vllm_server_run.json`).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from test_engine_contract import VLLM_MEAN_ABS_DLOGPROB, VLLM_WARNING_FILTERS, vllm_unavailable

from pipeline.config.io import load_config
from pipeline.engines.vllm_launch import VLLMServeProcess
from pipeline.observe.metrics import read_jsonl
from pipeline.loop.orchestrator import Pipeline
from pipeline.store.rollout_log import read_rollouts

pytestmark = [pytest.mark.gpu, *VLLM_WARNING_FILTERS]

B, STEPS, K = 8, 6, 1


def test_a_run_trains_on_a_vllm_server(tmp_path: Path) -> None:
    if reason := vllm_unavailable():
        pytest.skip(reason)
    import torch

    from pipeline.models.builtin import build_model

    model_path = build_model("small", tmp_path / "models")
    server = VLLMServeProcess(model_path, tmp_path / "vllm-serve.log", gpu_memory_utilization=0.3,
                              enforce_eager=True, max_num_seqs=256, max_loras=4)
    url = asyncio.run(server.start())
    two = torch.cuda.device_count() >= 2
    out = tmp_path / "run"
    cfg = load_config(None, {
        "seed": 1, "out": str(out), "model.path": str(model_path), "model.dtype": "bfloat16",
        "task.num_prompts": B * STEPS, "sampling.n": 4, "sampling.max_new_tokens": 32,
        "engine.kind": "vllm_server", "engine.vllm_server.urls": [url],
        "trainer.device": "cuda:1" if two else "cuda:0", "trainer.lr": 1e-4, "trainer.lora_rank": 16,
        "pipeline.steps": STEPS, "pipeline.batch_groups": B, "pipeline.max_staleness": K,
        "pipeline.logprob_check_every": 2, "log.level": "info", "log.progress": False,
    })
    try:
        summary = Pipeline(cfg, console=False).run_sync()
    finally:
        asyncio.run(server.stop())
    assert summary["accounting_ok"] and summary["groups_trained"] == B * STEPS, summary
    r = read_rollouts(out / "rollouts.zarr")
    trained = r.groups["fate"] == "trained"
    assert set(r.groups["version"][trained].tolist()) >= {0, 1, STEPS - K - 1}, "groups were sampled on new versions"
    rows = read_jsonl(out / "metrics.jsonl")
    assert all(row["rollout/version_mismatch"] == 0 for row in rows)
    checks = [row["check/mean_abs_diff"] for row in rows if "check/mean_abs_diff" in row]
    assert len(checks) >= 2 and max(checks) < VLLM_MEAN_ABS_DLOGPROB, checks
    events = read_jsonl(out / "events.jsonl")
    loaded = [e for e in events if e["event"] == "adapter_loaded"]
    assert {e["version"] for e in loaded} >= set(range(1, STEPS)), loaded
    # the server's own log shows it loaded each adapter the engine registered
    served = (tmp_path / "vllm-serve.log").read_text(errors="replace")
    missing = [e["adapter"] for e in loaded if f"name '{e['adapter']}'" not in served]
    assert not missing, f"the server's log does not show these adapters loaded: {missing}"
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "vllm_server_run.json").write_text(json.dumps({
            "summary": summary, "logprob_checks": checks, "adapters_loaded": len(loaded),
            "gpu": torch.cuda.get_device_name(0)}, indent=1, default=str) + "\n")
