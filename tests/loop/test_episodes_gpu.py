"""Multi-turn episodes on vLLM: chat episodes with tool replies, prefix caching on, and the
engine-vs-trainer log-prob check over the sampled tokens within the single-turn threshold.

Marked `gpu`: skips without CUDA and vLLM. With two GPUs the engine takes cuda:0 and the trainer
cuda:1; with one they share it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import keep_result, run_py
from test_engine_contract import VLLM_WARNING_FILTERS, vllm_unavailable

from pipeline.observe.metrics import read_jsonl
from pipeline.store.rollout_log import read_rollouts

pytestmark = [pytest.mark.gpu, *VLLM_WARNING_FILTERS]

STEPS = 12
SINGLE_TURN_THRESHOLD = 0.1  # what test_own_task_gpu and pipeline.logprob_warn_mean_abs hold single turns to


def test_chat_episodes_on_vllm_keep_the_logprob_check(tmp_path: Path) -> None:
    why = vllm_unavailable()
    if why:
        pytest.skip(why)
    import torch

    trainer = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    out = tmp_path / "run"
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": str(i)}) + "\n" for i in range(200)))
    sets = {
        "model.shape": "small", "model.cache_dir": str(tmp_path / "models"), "model.dtype": "bfloat16",
        "engine.kind": "vllm", "engine.devices": '["cuda:0"]', "engine.vllm.gpu_memory_utilization": 0.3,
        "engine.vllm.enforce_eager": "true", "engine.vllm.max_model_len": 1024, "trainer.device": trainer,
        "trainer.lr": 1e-4, "log.progress": "false", "pipeline.logprob_check_every": 2,
        "pipeline.logprob_check_groups": 4, "pipeline.max_staleness": 1, "pipeline.batch_groups": 4,
        "sampling.n": 4, "sampling.max_new_tokens": 32, "data.train": str(rows),
        "env.factory": "tests/episode_envs.py:ChatTool", "env.max_turns": 3, "eval.every": 0,
    }
    args = ["--steps", str(STEPS), "--out", str(out)]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    proc = run_py(*args, timeout=900)
    keep_result("episodes_gpu_stderr.txt", proc.stderr[-20000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accounting_ok"] and summary["steps"] == STEPS, summary
    rows_ = read_jsonl(out / "metrics.jsonl")
    checks = [r["check/mean_abs_diff"] for r in rows_ if "check/mean_abs_diff" in r]
    log = read_rollouts(out / "rollouts.zarr")
    turns = log.completions["turns"]
    sampled = int(log.mask.sum())
    result = {"steps": STEPS, "checks_mean_abs_diff": checks, "threshold": SINGLE_TURN_THRESHOLD,
              "turns_mean": float(turns.mean()), "turns_max": int(turns.max()),
              "tokens": int(log.mask.size), "sampled_tokens": sampled,
              "summary": {k: summary[k] for k in ("wall_s", "setup_s", "groups_trained", "groups_failed",
                                                   "busy_generator", "busy_trainer", "reward_final_window")}}
    keep_result("episodes_vllm_small.json", result)
    assert turns.max() >= 2 and 0 < sampled < log.mask.size, "episodes of several turns, replies masked"
    assert np.all(log.logprobs[~log.mask] == 0)
    assert checks and max(checks) < SINGLE_TURN_THRESHOLD, checks
