"""kill -9 at named points, then `run.py --resume`, to the end of a fixed data set.

Each case starts `python run.py` with PIPELINE_CRASH_AT set (pipeline.faults), expects it to die
by SIGKILL at that point, resumes it (without the variable) and checks the finished run: every
prompt of the data set trained exactly once, no group twice in the zarr log, the staleness bound,
one metrics row per step, and an adapter store and checkpoints that verify.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from pipeline.adapter_store import AdapterStore
from pipeline.checkpoint import CheckpointStore
from pipeline.faults import CRASH_POINTS
from pipeline.metrics import read_jsonl
from pipeline.rollout_log import read_rollouts

ROOT = Path(__file__).resolve().parent.parent
B, STEPS, K = 4, 8, 1
PROMPTS = B * STEPS  # one epoch of the data set is exactly the run

SIM = f"""
seed = 3
[task]
num_prompts = {PROMPTS}
[sampling]
n = 4
max_new_tokens = 8
[engine]
kind = "simulated"
[engine.simulated]
latency_s = 0.01
completion_tokens = 8
vocab_size = 90
[trainer]
kind = "simulated"
step_s = 0.05
[pipeline]
steps = {STEPS}
batch_groups = {B}
max_staleness = {K}
checkpoint_every = 2
[log]
level = "error"
progress = false
"""

# the real thing: the tiny model, the transformers engine and the peft LoRA trainer
REAL = f"""
seed = 3
[model]
cache_dir = "{{cache}}"
[task]
num_prompts = {PROMPTS}
[sampling]
n = 4
max_new_tokens = 6
[pipeline]
steps = {STEPS}
batch_groups = {B}
max_staleness = {K}
checkpoint_every = 3
[log]
level = "error"
progress = false
"""


def _run_py(args: list[str], crash: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PIPELINE_CRASH_AT"}
    if crash:
        env["PIPELINE_CRASH_AT"] = crash
    return subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def check_finished_run(out: Path, b: int = B, steps: int = STEPS, k: int = K) -> dict:
    """A run of `steps` steps of `b` groups over a data set of b * steps prompts, resumed to its end:
    every prompt trained exactly once, nothing twice in the log, staleness <= k, stores that verify.
    Returns its summary (tests/test_gpu_resume.py checks the same on GPUs)."""
    prompts = b * steps
    summary = json.loads((out / "summary.json").read_text())
    assert summary["error"] is None and summary["accounting_ok"], summary
    assert summary["steps"] == steps and summary["checkpoint_step"] == steps

    r = read_rollouts(out / "rollouts.zarr")
    ids = r.groups["group_id"].tolist()
    assert len(ids) == len(set(ids)), f"groups repeated in the log: {[i for i, c in Counter(ids).items() if c > 1]}"
    fate = r.groups["fate"].tolist()
    trained = sorted(i for i, f in zip(ids, fate) if f == "trained")
    assert trained == list(range(prompts)), "every prompt of the data set is trained exactly once"
    prompt_ids = [p for p, f in zip(r.groups["prompt_id"].tolist(), fate) if f == "trained"]
    assert len(set(prompt_ids)) == prompts  # one epoch: each prompt once, none skipped
    trained_steps = [s for s, f in zip(r.groups["step"].tolist(), fate) if f == "trained"]
    assert Counter(trained_steps) == {s: b for s in range(1, steps + 1)}
    for s, v, f in zip(r.groups["step"].tolist(), r.groups["version"].tolist(), fate):
        if f == "trained":
            assert 0 <= (s - 1) - v <= k, "the staleness bound holds across the crash"
    assert summary["groups_started"] == len(ids) == summary["groups_logged"]

    assert [row["step"] for row in read_jsonl(out / "metrics.jsonl")] == list(range(1, steps + 1))
    store = AdapterStore(out / "adapters", readonly=True)
    assert store.versions() and max(store.versions()) == steps
    for v in store.versions():
        store.load(v)  # manifest and hashes verify
    assert not list((out / "adapters").glob(".tmp-*")) and not list((out / "checkpoints").glob(".tmp-*"))
    latest = CheckpointStore(out / "checkpoints").latest()
    assert latest is not None and latest.step == steps
    return summary


KILLS = [  # (crash point, which hit): 22 points over generation, training, publishing, logging, checkpoints
    ("admission", 5), ("admission", 22),
    ("group.after_generate", 3), ("group.after_generate", 18),
    ("step.after_train", 1), ("step.after_train", 4), ("step.after_train", 7),
    ("publish.before_rename", 2), ("publish.before_rename", 5),
    ("publish.after_rename", 3), ("publish.after_rename", 6),
    ("step.after_record", 2), ("step.after_record", 5),
    ("log.mid_flush", 1), ("log.mid_flush", 3),
    ("log.after_commit", 2),
    ("checkpoint.mid_write", 1), ("checkpoint.mid_write", 3),
    ("checkpoint.before_rename", 2),
    ("checkpoint.after_rename", 1), ("checkpoint.after_rename", 3),
]


def test_the_kill_list_covers_every_crash_point() -> None:
    assert {name for name, _ in KILLS} == set(CRASH_POINTS)


@pytest.mark.parametrize("point,hit", KILLS, ids=[f"{p}:{h}" for p, h in KILLS])
def test_kill_9_then_resume_trains_every_prompt_once(tmp_path: Path, point: str, hit: int) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(SIM)
    out = tmp_path / "run"
    first = _run_py(["--config", str(cfg), "--out", str(out)], crash=f"{point}:{hit}")
    assert first.returncode == -signal.SIGKILL, f"not killed at {point}:{hit}: rc {first.returncode}\n{first.stderr}"
    assert not (out / "summary.json").exists()
    resumed = _run_py(["--resume", str(out)])
    assert resumed.returncode == 0, resumed.stderr
    check_finished_run(out)


def test_three_kills_in_a_row_then_resume(tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(SIM)
    out = tmp_path / "run"
    r = _run_py(["--config", str(cfg), "--out", str(out)], crash="step.after_train:3")
    assert r.returncode == -signal.SIGKILL, r.stderr
    for crash in ("publish.before_rename:2", "log.mid_flush:1"):
        r = _run_py(["--resume", str(out)], crash=crash)
        assert r.returncode == -signal.SIGKILL, f"{crash}: rc {r.returncode}\n{r.stderr}"
    r = _run_py(["--resume", str(out)])
    assert r.returncode == 0, r.stderr
    check_finished_run(out)


@pytest.mark.parametrize("crash", ["checkpoint.mid_write:2", "publish.before_rename:5", "step.after_train:6"])
def test_kill_9_with_the_real_model_and_lora_trainer(tmp_path_factory: pytest.TempPathFactory, crash: str) -> None:
    cache = tmp_path_factory.getbasetemp() / "model-cache"  # shared: the tiny model is built once
    tmp = tmp_path_factory.mktemp("real")
    cfg = tmp / "run.toml"
    cfg.write_text(REAL.format(cache=cache))
    out = tmp / "run"
    first = _run_py(["--config", str(cfg), "--out", str(out)], crash=crash)
    assert first.returncode == -signal.SIGKILL, first.stderr
    resumed = _run_py(["--resume", str(out)])
    assert resumed.returncode == 0, resumed.stderr
    check_finished_run(out)


def wait_for_steps(proc: subprocess.Popen, out: Path, steps: int, limit_s: float = 60) -> None:
    """Wait until the run writing `out` has logged `steps` steps (failing if it exits or takes over limit_s)."""
    deadline = time.monotonic() + limit_s
    path = out / "metrics.jsonl"
    while not (path.exists() and path.read_text().count("\n") >= steps):  # whole lines only
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no {steps} steps within {limit_s} s"
        time.sleep(0.05)


def test_sigterm_checkpoints_and_a_second_signal_exits_at_once(tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    # slow steps: the signal lands mid-run
    cfg.write_text(SIM.replace("step_s = 0.05", "step_s = 0.4").replace("checkpoint_every = 2", "checkpoint_every = 0"))
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "PIPELINE_CRASH_AT"}
    proc = subprocess.Popen([sys.executable, "run.py", "--config", str(cfg), "--out", str(out)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_steps(proc, out, 2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and summary["accounting_ok"]
    step = summary["checkpoint_step"]
    assert 2 <= step < STEPS and CheckpointStore(out / "checkpoints").latest().step == step
    assert f"--resume {out}" in err

    # resume, then two signals: the second one exits at once, and the run still resumes
    proc = subprocess.Popen([sys.executable, "run.py", "--resume", str(out)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_steps(proc, out, step + 1)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode in (130, -signal.SIGINT, 128 + signal.SIGINT)
    r = _run_py(["--resume", str(out)])
    assert r.returncode == 0, r.stderr
    check_finished_run(out)
