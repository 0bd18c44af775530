"""The whole loop on a GPU with a vLLM engine whose engine-core process is killed mid-run.

Marked `gpu`: skips without CUDA and vLLM. The pipeline notices the dead core (vLLM's
EngineDeadError), takes the engine out of rotation, closes it, waits engine.restart_backoff_s,
builds a new AsyncLLM on the same GPU (in a worker thread, so the loop keeps running), loads the
adapter versions in use and puts it back; the groups that were on it wait and are generated
again. The run must end as an uninterrupted one would: every prompt trained exactly once.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from conftest import check_finished_run
from test_engine_contract import VLLM_WARNING_FILTERS, vllm_unavailable

from pipeline.config.io import load_config
from pipeline.observe.metrics import read_jsonl
from pipeline.loop.orchestrator import Pipeline

pytestmark = [pytest.mark.gpu, *VLLM_WARNING_FILTERS]

B, STEPS, K = 8, 6, 1
KILL_AT_STEP = 2


def _engine_core_processes() -> list:
    """This process's descendants but multiprocessing's resource tracker: vLLM's engine core
    (the trainer runs in a thread here, so it has no process of its own)."""
    import psutil

    return [c for c in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(c.cmdline())]


@pytest.mark.skipif(vllm_unavailable() is not None, reason=str(vllm_unavailable()))
def test_a_killed_vllm_engine_core_is_restarted_and_the_run_finishes(tmp_path: Path) -> None:
    import torch

    two = torch.cuda.device_count() >= 2
    out = tmp_path / "run"
    cfg = load_config(None, {
        "seed": 1, "out": str(out),
        "model.shape": "small", "model.cache_dir": str(tmp_path / "models"), "model.dtype": "bfloat16",
        "task.num_prompts": B * STEPS, "sampling.n": 4, "sampling.max_new_tokens": 32,
        "engine.kind": "vllm", "engine.devices": ["cuda:0"], "engine.restarts": 2, "engine.restart_backoff_s": 5.0,
        "engine.vllm.gpu_memory_utilization": 0.3, "engine.vllm.enforce_eager": True, "engine.vllm.max_model_len": 512,
        "trainer.device": "cuda:1" if two else "cuda:0", "trainer.separate_process": False, "trainer.lr": 1e-4,
        "pipeline.steps": STEPS, "pipeline.batch_groups": B, "pipeline.max_staleness": K,
        "pipeline.checkpoint_every": 2, "log.level": "warning", "log.progress": False,
    })
    killed: list[int] = []

    async def main() -> Pipeline:
        p = Pipeline(cfg, console=False)
        async for res in p.steps():
            if res.step == KILL_AT_STEP:
                for proc in _engine_core_processes():
                    proc.kill()  # SIGKILL: a crash, not a shutdown
                    killed.append(proc.pid)
        return p

    p = asyncio.run(main())
    assert killed, "found no engine-core process to kill"
    s = check_finished_run(out, b=B, steps=STEPS, k=K)
    assert s["engine_restarts"] == {"vllm-0": 1} and s["engines_out_of_rotation"] == [], s
    events = read_jsonl(out / "events.jsonl")
    restarted = [e for e in events if e["event"] == "engine_restarted"]
    assert len(restarted) == 1 and restarted[0]["versions"], restarted
    rows = read_jsonl(out / "metrics.jsonl")
    assert all(row["rollout/version_mismatch"] == 0 for row in rows)
    checks = [row["check/mean_abs_diff"] for row in rows if "check/mean_abs_diff" in row]
    assert checks and max(checks) < 0.1, checks
    # the loop kept running while vLLM came up again in a worker thread (on the loop, the
    # constructor would have held it for the whole start: 20-45 s for this model)
    worst_lag_s = max(p.lag.lags)
    assert worst_lag_s < 5.0, f"the event loop stalled {worst_lag_s:.1f} s"
    print(f"gpu restart: killed engine core {killed} after step {KILL_AT_STEP}; restarted in "
          f"{restarted[0]['seconds']} s with versions {restarted[0]['versions']}; run finished "
          f"{s['steps']} steps in {s['wall_s']:.1f} s; worst loop lag {worst_lag_s * 1000:.0f} ms")
