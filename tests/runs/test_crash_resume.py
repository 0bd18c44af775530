"""kill -9 at named points, then `run.py --resume`, to the end of a fixed data set.

Each case starts `python run.py` with PIPELINE_CRASH_AT set (pipeline.faults), expects it to die
by SIGKILL at that point, resumes it (without the variable) and checks the finished run: every
prompt of the data set trained exactly once, no group twice in the zarr log, the staleness bound,
one metrics row per step, and an adapter store and checkpoints that verify.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from conftest import check_finished_run, run_py, start_run_py, wait_for_steps

from pipeline.store.checkpoint import CheckpointStore
from pipeline.faults import CRASH_POINTS
from pipeline.store.rollout_log import read_rollouts

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


# multi-turn: the simulated engine's episodes of tests/episode_envs.py's Slow environment
EPISODES = SIM.replace("[trainer]", """[env]
factory = "tests/episode_envs.py:Slow"
max_turns = 3
[trainer]""")
EPISODE_KILLS = [("episode.after_step", 5), ("episode.after_step", 40)]


def test_the_kill_list_covers_every_crash_point() -> None:
    assert {name for name, _ in KILLS + EPISODE_KILLS} == set(CRASH_POINTS)


@pytest.mark.parametrize("point,hit", KILLS, ids=[f"{p}:{h}" for p, h in KILLS])
def test_kill_9_then_resume_trains_every_prompt_once(tmp_path: Path, point: str, hit: int) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(SIM)
    out = tmp_path / "run"
    first = run_py("--config", str(cfg), "--out", str(out), crash=f"{point}:{hit}")
    assert first.returncode == -signal.SIGKILL, f"not killed at {point}:{hit}: rc {first.returncode}\n{first.stderr}"
    assert not (out / "summary.json").exists()
    resumed = run_py("--resume", str(out))
    assert resumed.returncode == 0, resumed.stderr
    check_finished_run(out, B, STEPS, K)


@pytest.mark.parametrize("point,hit", EPISODE_KILLS, ids=[f"{p}:{h}" for p, h in EPISODE_KILLS])
def test_kill_9_mid_episode_then_resume_trains_every_prompt_once(tmp_path: Path, point: str, hit: int) -> None:
    """Killed between two turns of an episode: the interrupted group is generated again from its
    first turn, under its id, and trained exactly once."""
    cfg = tmp_path / "run.toml"
    cfg.write_text(EPISODES)
    out = tmp_path / "run"
    first = run_py("--config", str(cfg), "--out", str(out), crash=f"{point}:{hit}")
    assert first.returncode == -signal.SIGKILL, f"not killed at {point}:{hit}: rc {first.returncode}\n{first.stderr}"
    resumed = run_py("--resume", str(out))
    assert resumed.returncode == 0, resumed.stderr
    check_finished_run(out, B, STEPS, K)
    r = read_rollouts(out / "rollouts.zarr")
    assert set(r.completions["turns"].tolist()) == {3} and not r.mask.all()  # whole episodes, replies masked


def test_three_kills_in_a_row_then_resume(tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(SIM)
    out = tmp_path / "run"
    r = run_py("--config", str(cfg), "--out", str(out), crash="step.after_train:3")
    assert r.returncode == -signal.SIGKILL, r.stderr
    for crash in ("publish.before_rename:2", "log.mid_flush:1"):
        r = run_py("--resume", str(out), crash=crash)
        assert r.returncode == -signal.SIGKILL, f"{crash}: rc {r.returncode}\n{r.stderr}"
    r = run_py("--resume", str(out))
    assert r.returncode == 0, r.stderr
    check_finished_run(out, B, STEPS, K)


@pytest.mark.parametrize("crash", ["checkpoint.mid_write:2", "publish.before_rename:5", "step.after_train:6"])
def test_kill_9_with_the_real_model_and_lora_trainer(tmp_path_factory: pytest.TempPathFactory, crash: str) -> None:
    cache = tmp_path_factory.getbasetemp() / "model-cache"  # shared: the tiny model is built once
    tmp = tmp_path_factory.mktemp("real")
    cfg = tmp / "run.toml"
    cfg.write_text(REAL.format(cache=cache))
    out = tmp / "run"
    first = run_py("--config", str(cfg), "--out", str(out), crash=crash)
    assert first.returncode == -signal.SIGKILL, first.stderr
    resumed = run_py("--resume", str(out))
    assert resumed.returncode == 0, resumed.stderr
    check_finished_run(out, B, STEPS, K)


def test_sigterm_checkpoints_and_a_second_signal_exits_at_once(tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    # slow steps: the signal lands mid-run
    cfg.write_text(SIM.replace("step_s = 0.05", "step_s = 0.4").replace("checkpoint_every = 2", "checkpoint_every = 0"))
    out = tmp_path / "run"
    proc = start_run_py("--config", str(cfg), "--out", str(out))
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
    proc = start_run_py("--resume", str(out))
    wait_for_steps(proc, out, step + 1)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode in (130, -signal.SIGINT, 128 + signal.SIGINT)
    r = run_py("--resume", str(out))
    assert r.returncode == 0, r.stderr
    check_finished_run(out, B, STEPS, K)


def _trained_prompts(out: Path) -> dict[int, str]:
    r = read_rollouts(out / "rollouts.zarr")
    return {g: p for g, p, f in zip(r.groups["group_id"].tolist(), r.groups["prompt_id"].tolist(),
                                    r.groups["fate"].tolist()) if f == "trained"}


def test_a_run_killed_in_a_later_epoch_resumes_with_the_prompt_order_of_the_uninterrupted_run(tmp_path: Path) -> None:
    """Six prompts, 32 groups: the stream wraps five times. Killed at step 6 (its newest checkpoint,
    step 4, is 16 groups in: the third epoch), the resumed run must draw every later position's
    prompt as a run never killed does, epoch order included."""
    cfg = tmp_path / "run.toml"
    cfg.write_text(SIM.replace(f"num_prompts = {PROMPTS}", "num_prompts = 6"))
    whole = run_py("--config", str(cfg), "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    out = tmp_path / "killed"
    first = run_py("--config", str(cfg), "--out", str(out), crash="step.after_train:6")
    assert first.returncode == -signal.SIGKILL, first.stderr
    assert CheckpointStore(out / "checkpoints").latest().step == 4
    resumed = run_py("--resume", str(out))
    assert resumed.returncode == 0, resumed.stderr
    want, got = _trained_prompts(tmp_path / "whole"), _trained_prompts(out)
    assert sorted(want) == list(range(B * STEPS)) and len(set(want.values())) == 6  # every epoch, every prompt
    assert got == want
