"""The whole loop on GPUs (vLLM engine, LoRA trainer in its own process), stopped by SIGTERM and resumed.

Marked `gpu`: skips without CUDA and vLLM. With two GPUs the engine takes cuda:0 and the trainer
cuda:1; with one they share it.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from conftest import check_finished_run, run_py, start_run_py, wait_for_steps
from test_engine_contract import VLLM_WARNING_FILTERS, vllm_unavailable

from pipeline.observe.metrics import read_jsonl

pytestmark = [pytest.mark.gpu, *VLLM_WARNING_FILTERS]

B, STEPS, K = 8, 6, 1


def _config(cache: Path, trainer_device: str, util: float) -> str:
    return f"""
seed = 1
[model]
shape = "small"
cache_dir = "{cache}"
dtype = "bfloat16"
[task]
num_prompts = {B * STEPS}
[sampling]
n = 4
max_new_tokens = 32
[engine]
kind = "vllm"
devices = ["cuda:0"]
[engine.vllm]
gpu_memory_utilization = {util}
enforce_eager = true
max_model_len = 512
[trainer]
device = "{trainer_device}"
separate_process = true
lr = 1e-4
[pipeline]
steps = {STEPS}
batch_groups = {B}
max_staleness = {K}
checkpoint_every = 2
[log]
level = "warning"
progress = false
"""


@pytest.mark.skipif(vllm_unavailable() is not None, reason=str(vllm_unavailable()))
def test_sigterm_then_resume_on_gpus_trains_every_prompt_once(tmp_path: Path) -> None:
    import torch

    two = torch.cuda.device_count() >= 2
    cfg = tmp_path / "gpu.toml"
    cfg.write_text(_config(tmp_path / "models", "cuda:1" if two else "cuda:0", 0.4 if two else 0.3))
    out = tmp_path / "run"
    proc = start_run_py("--config", str(cfg), "--out", str(out))
    wait_for_steps(proc, out, 3, limit_s=400)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    first = json.loads((out / "summary.json").read_text())
    assert first["stopped_by"] == "SIGTERM" and first["accounting_ok"], first
    assert 3 <= first["checkpoint_step"] < STEPS

    resumed = run_py("--resume", str(out), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    s = check_finished_run(out, b=B, steps=STEPS, k=K)
    assert s["resumed_from_step"] == first["checkpoint_step"], s
    # the engine served the versions the ledger says, and they match the trainer's log-probs
    rows = read_jsonl(out / "metrics.jsonl")
    assert all(row["rollout/version_mismatch"] == 0 for row in rows)
    checks = [row["check/mean_abs_diff"] for row in rows if "check/mean_abs_diff" in row]
    assert checks and max(checks) < 0.1, checks
    print(f"gpu resume: stopped at step {first['checkpoint_step']}, resumed to {STEPS}; "
          f"logprob check mean |d| {checks}; wall {first['wall_s']:.1f} s + {s['wall_s']:.1f} s")
