"""examples/own_task on a GPU: data files, rewards by path, chat prompts and eval rounds through a
real vLLM engine, the LoRA trainer beside it, and TensorBoard reading the run back.

Marked `gpu`: skips without CUDA and vLLM. With two GPUs the engine takes cuda:0 and the trainer
cuda:1; with one they share it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import keep_result, run_py
from test_engine_contract import VLLM_WARNING_FILTERS, vllm_unavailable

from pipeline.observe.metrics import read_jsonl
from pipeline.store.rollout_log import read_rollouts

pytestmark = [pytest.mark.gpu, *VLLM_WARNING_FILTERS]

STEPS = 20


def test_own_task_runs_on_vllm_with_chat_prompts_and_eval(tmp_path: Path) -> None:
    why = vllm_unavailable()
    if why:
        pytest.skip(why)
    import torch

    trainer = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    out = tmp_path / "run"
    sets = {
        "model.shape": "small", "model.cache_dir": str(tmp_path / "models"), "model.dtype": "bfloat16",
        "engine.kind": "vllm", "engine.devices": '["cuda:0"]', "engine.vllm.gpu_memory_utilization": 0.3,
        "engine.vllm.enforce_eager": "true", "engine.vllm.max_model_len": 512, "trainer.device": trainer,
        "trainer.lr": 1e-3, "eval.every": 10, "log.trackers": '["tensorboard"]', "log.progress": "false",
        "pipeline.logprob_check_every": 10,
    }
    args = ["--config", "examples/own_task/config.toml", "--steps", str(STEPS), "--out", str(out)]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    proc = run_py(*args, timeout=900)
    keep_result("own_task_gpu_stderr.txt", proc.stderr[-20000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accounting_ok"] and summary["prompts_refused"] == 0, summary
    rows = read_jsonl(out / "metrics.jsonl")
    evals = [r for r in rows if "eval/groups" in r]
    steps = [r for r in rows if "eval/groups" not in r]
    assert [r["step"] for r in evals] == [0, 10, 20] and all(r["eval/failed"] == 0 for r in evals), evals
    assert all(r["eval/groups"] == 20 for r in evals)
    checks = [r["check/mean_abs_diff"] for r in steps if "check/mean_abs_diff" in r]
    assert checks and max(checks) < 0.1, checks  # vLLM's sampling log-probs against the trainer's
    log = read_rollouts(out / "rollouts.zarr")
    fates = log.groups["fate"].tolist()
    assert fates.count("eval") == 60 and fates.count("trained") == summary["groups_trained"]
    chat = [i for i in range(log.num_groups) if str(log.groups["prompt_id"][i]).endswith("-chat")]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(next((tmp_path / "models").iterdir())))
    text = tok.decode(log.group(chat[0])["prompt_token_ids"].tolist())
    assert text.startswith("<|im_start|>user\nWhat is ") and text.endswith("<|im_start|>assistant\n")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert {"reward_mean", "reward/correct", "eval/pass@1", "eval/pass@8"} <= set(acc.Tags()["scalars"])
    result = {"steps": steps[-1], "evals": evals, "summary": {k: summary[k] for k in (
        "wall_s", "setup_s", "groups_trained", "eval_groups_logged", "busy_generator", "busy_trainer")}}
    keep_result("own_task_gpu.json", result)
