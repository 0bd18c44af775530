"""run.py's command line: bad input is one "error:" line and exit 2; --resume continues a run in place.

Most tests here start no real run: the error cases stop before the pipeline is built, and the
--resume and signal cases replace the Pipeline class with a recorder. Those under "Runs that go
wrong" run run.py for real, with the simulated engine and trainer (a few seconds each).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, load_script, run_py, start_run_py, wait_for_steps

# run.py is a script at the repository root, not part of the package: load it by path
run = load_script(REPO / "run.py", "run_cli")


def _assert_one_error_line(stderr: str, *named: str) -> None:
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for text in named:
        assert text in lines[0], lines[0]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    (d / "broken.toml").write_text("[pipeline\nsteps = 3\n")
    (d / "unknown.toml").write_text("[pipeline]\nstepz = 3\n")
    (d / "wrong_type.toml").write_text('[trainer]\nlr = "fast"\n')
    (d / "run").mkdir()  # a directory with no config.toml: not a run to resume
    return d


@pytest.mark.parametrize("args, named", [
    (["--config", "{d}/broken.toml"], ["broken.toml", "not valid TOML", "line 1"]),
    (["--config", "{d}/unknown.toml"], ["'pipeline.stepz'", "allowed here: steps"]),
    (["--config", "{d}/wrong_type.toml"], ["trainer.lr must be a finite number", "'fast'"]),
    (["--config", "{d}/missing.toml"], ["missing.toml", "does not exist"]),
    (["--max-staleness", "-1"], ["pipeline.max_staleness must be >= 0, got -1"]),
    (["--set", "model.path={d}/no-model"], ["model.path", "no-model", "does not exist"]),
    (["--set", "seed.x=1"], ["seed.x", "not a section"]),
    (["--steps", "ten"], ["--steps", "invalid int value", "'ten'"]),
    (["--resume", "{d}/no-run"], ["--resume", "no-run", "does not exist"]),
    (["--resume", "{d}/run", "--config", "{d}/unknown.toml"], ["--resume", "--config"]),
    (["--force-resume"], ["--force-resume", "--resume DIR"]),
])
def test_bad_input_is_one_error_line_naming_the_field_and_exit_code_2(files: Path, args: list[str],
                                                                       named: list[str]) -> None:
    proc = run_py(*(a.format(d=files) for a in args), timeout=60)
    assert proc.returncode == 2, proc
    assert proc.stdout == ""
    _assert_one_error_line(proc.stderr, *named)


@pytest.mark.parametrize("args, named", [
    (["--resume", "{d}/run"], ["--resume", "config.toml", "does not exist", "run directory"]),
    (["--resume", "{d}/run", "--out", "{d}/elsewhere"], ["--resume", "--out"]),
    (["--set", "pipeline.steps"], ["pipeline.steps", "section.key=value"]),
    (["--set", "engine.kind=tpu"], ["engine.kind must be one of", "'tpu'"]),
    (["--set", "engine.devices=[0]"], ["engine.devices[0] must be a string"]),
    (["--set", "trainer.lr=1e400"], ["trainer.lr must be a finite number"]),
    (["--set", "model.path={d}/run"], ["model.path", "run", "has no config.json"]),
])
def test_bad_input_in_process_returns_2_with_one_error_line(files: Path, capsys: pytest.CaptureFixture[str],
                                                             args: list[str], named: list[str]) -> None:
    assert run.main([a.format(d=files) for a in args]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    _assert_one_error_line(err, *named)


# --------------------------------------------------------------------------- --resume and signals


class _Recorder:
    """Stands in for Pipeline: records how run.py built it and returns a set summary."""

    built: list[_Recorder] = []
    summary: dict[str, Any] = {}

    def __init__(self, cfg: Any, **kwargs: Any) -> None:
        self.cfg, self.kwargs = cfg, kwargs
        self.run_dir = Path(cfg.out)
        _Recorder.built.append(self)

    def run_sync(self) -> dict[str, Any]:
        return dict(_Recorder.summary)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> type[_Recorder]:
    # a stand-in module, so the test neither imports torch nor builds anything
    monkeypatch.setitem(sys.modules, "pipeline.loop.orchestrator", types.SimpleNamespace(Pipeline=_Recorder))
    monkeypatch.setattr(_Recorder, "built", [])
    monkeypatch.setattr(_Recorder, "summary", {"run_dir": "x", "steps": 4, "accounting_ok": True})
    return _Recorder


def _write_run_dir(path: Path) -> Path:
    from pipeline.config.io import dump_toml, load_config

    path.mkdir()
    cfg = load_config(None, {"out": "/where/it/was/first", "pipeline.steps": 4, "engine.kind": "simulated",
                             "trainer.lr": 0.5})
    (path / "config.toml").write_text(dump_toml(cfg))
    return path


def test_resume_reads_the_runs_config_applies_flags_and_stays_in_the_run_dir(
        tmp_path: Path, recorder: type[_Recorder], capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _write_run_dir(tmp_path / "run")
    assert run.main(["--resume", str(run_dir), "--steps", "9", "--set", "trainer.lr=0.25"]) == 0
    (p,) = recorder.built
    assert p.kwargs == {"resume": True, "force_resume": False, "handle_signals": True}
    assert p.cfg.out == str(run_dir)  # forced to DIR, whatever the old config said
    assert (p.cfg.pipeline.steps, p.cfg.trainer.lr, p.cfg.engine.kind) == (9, 0.25, "simulated")
    assert '"steps": 4' in capsys.readouterr().out


def test_force_resume_reaches_the_pipeline(tmp_path: Path, recorder: type[_Recorder]) -> None:
    run_dir = _write_run_dir(tmp_path / "run")
    assert run.main(["--resume", str(run_dir), "--force-resume"]) == 0
    (p,) = recorder.built
    assert p.kwargs == {"resume": True, "force_resume": True, "handle_signals": True}


def test_a_fresh_run_handles_signals_and_does_not_resume(tmp_path: Path, recorder: type[_Recorder]) -> None:
    assert run.main(["--out", str(tmp_path / "new"), "--set", "engine.kind=simulated"]) == 0
    (p,) = recorder.built
    assert p.kwargs == {"resume": False, "force_resume": False, "handle_signals": True}
    assert p.cfg.out == str(tmp_path / "new")


def test_a_run_stopped_by_a_signal_says_how_to_continue_and_returns_130(
        tmp_path: Path, recorder: type[_Recorder], capsys: pytest.CaptureFixture[str]) -> None:
    recorder.summary = {"stopped_by": "SIGTERM", "checkpoint_step": 7}
    run_dir = tmp_path / "stopped run"
    assert run.main(["--out", str(run_dir)]) == 130
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [f"stopped by SIGTERM after checkpoint at step 7; continue with: "
                                f"python run.py --resume '{run_dir}'"]


def test_help_documents_resume_and_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        run.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "--resume DIR" in text and "Exit codes:" in text and "130" in text


# --------------------------------------------------------------------------- runs that go wrong

# a real run.py, as small and fast as it gets: the simulated engine and trainer, the built-in task
_SIM = ("--set", "engine.kind=simulated", "--set", "trainer.kind=simulated", "--set", "log.progress=false",
        "--set", "pipeline.batch_groups=2", "--set", "sampling.n=2", "--set", "engine.simulated.completion_tokens=4",
        # the char_class task of 512 prompts without eval rounds, whatever run.py's default config is
        "--set", 'task.name="char_class"', "--set", "task.num_prompts=512", "--set", "model.warm_start=false",
        "--set", "eval.every=0")


def _sim_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return run_py(*_SIM, *args, timeout=timeout)


def _events(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def _last_error_line(stderr: str, *named: str) -> str:
    # the console's log lines come first; run.py's own verdict is the last line
    last = stderr.splitlines()[-1]
    assert last.startswith("error: "), stderr[-2000:]
    for text in named:
        assert text in last, last
    return last


@pytest.mark.slow
def test_a_run_whose_every_prompt_is_refused_stops_at_once_with_exit_2_and_the_reasons(tmp_path: Path) -> None:
    # every prompt of the built-in task + 600 new tokens exceeds the tiny model's context of 512:
    # this run used to spin forever, deaf to signals, writing hundreds of MB of events
    run_dir = tmp_path / "run"
    proc = _sim_cli("--set", "sampling.max_new_tokens=600", "--out", str(run_dir), timeout=90)
    assert proc.returncode == 2, proc.stderr[-2000:]
    _last_error_line(proc.stderr, "every prompt", "512 of 512", "too_long", "exceeds the context of 512")
    refused = [e for e in _events(run_dir) if e["event"] == "prompt_refused"]
    assert 1 <= len(refused) <= 3  # a few examples, not one line per refusal
    assert (run_dir / "events.jsonl").stat().st_size < 200_000


@pytest.mark.slow
def test_out_to_a_directory_holding_a_run_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = _sim_cli("--steps", "1", "--out", str(run_dir))
    assert first.returncode == 0, first.stderr[-2000:]
    before = {p.name: p.read_bytes() for p in (run_dir / "config.toml", run_dir / "events.jsonl")}
    again = _sim_cli("--steps", "3", "--set", "trainer.lr=0.5", "--out", str(run_dir))
    assert again.returncode == 2, again.stderr[-2000:]
    _assert_one_error_line(again.stderr, "already holds a run", "--resume")
    assert {p.name: p.read_bytes() for p in (run_dir / "config.toml", run_dir / "events.jsonl")} == before


@pytest.mark.slow
def test_a_failed_run_exits_1_and_leaves_its_traceback_in_events_jsonl(tmp_path: Path) -> None:
    # every generate call fails and the lone engine is never restarted: EngineDeadError ends the run
    run_dir = tmp_path / "run"
    proc = _sim_cli("--set", "engine.simulated.fail_rate=1.0", "--set", "engine.retries=0",
                    "--set", "engine.restarts=0", "--out", str(run_dir))
    assert proc.returncode == 1, proc.stderr[-2000:]
    _last_error_line(proc.stderr, "the run failed: EngineDeadError", "events.jsonl")
    assert "Traceback" not in proc.stderr  # the console gets the one line; the file gets the traceback
    (failed,) = [e for e in _events(run_dir) if e["event"] == "run_failed"]
    assert failed["level"] == "error"
    assert "Traceback (most recent call last)" in failed["exception"]
    assert "EngineDeadError: no engine is left in rotation" in failed["exception"]


@pytest.mark.parametrize("make_out, named", [
    (lambda d: (d / "a-file").touch() or d / "a-file", ["a-file", "File exists"]),
    (lambda d: Path("/proc/no-such-dir"), ["/proc/no-such-dir"]),
    # config.toml on a device that is always full: the first write of the run meets ENOSPC
    (lambda d: (d / "full").mkdir() or (d / "full" / "config.toml").symlink_to("/dev/full") or d / "full",
     ["full", "No space left on device"]),
])
def test_a_run_directory_that_cannot_be_made_or_written_is_exit_2_naming_out(tmp_path: Path, make_out: Any,
                                                                           named: list[str]) -> None:
    # this run used to hang silently forever: the step loop waited for an end nobody announced
    proc = run_py("--steps", "1", "--out", str(make_out(tmp_path)), timeout=60)
    assert proc.returncode == 2, proc
    _assert_one_error_line(proc.stderr, "out: cannot use", *named)


@pytest.mark.slow
def test_a_reward_that_always_raises_stops_the_run_naming_the_function_and_keeps_its_traceback(tmp_path: Path) -> None:
    rewards = tmp_path / "my_rewards.py"
    rewards.write_text("def lookup(prompts, completions, **kw):\n"
                       "    table = {}\n"
                       "    return [table[c] for c in completions]  # the user's bug\n")
    run_dir = tmp_path / "run"
    proc = _sim_cli("--set", f'reward.functions=["{rewards}:lookup"]', "--out", str(run_dir))
    assert proc.returncode == 1, proc.stderr[-2000:]
    _last_error_line(proc.stderr, "64 groups failed in a row", "reward_error",
                     "reward function 'lookup' raised KeyError")
    failed = [e for e in _events(run_dir) if e["event"] == "group_failed"]
    assert len(failed) >= 64 and all(e["function"] == "lookup" for e in failed)
    shown = [e["exception"] for e in failed if "exception" in e]
    assert len(shown) == 3  # the first few, not one per group
    assert all(str(rewards) in tb and "return [table[c] for c in completions]" in tb and "KeyError" in tb
               for tb in shown)  # the user's own frame and line
    assert json.loads((run_dir / "summary.json").read_text())["groups_failed"]["reward_error"] >= 64


@pytest.mark.slow
def test_a_full_disk_on_resume_names_the_stage_in_one_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = _sim_cli("--steps", "4", "--out", str(run_dir))
    assert first.returncode == 0, first.stderr[-2000:]
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    # the disk is full for what the resume writes: the metrics it cuts, and every event
    (run_dir / "metrics.jsonl.tmp").symlink_to("/dev/full")
    (run_dir / "events.jsonl").unlink()
    (run_dir / "events.jsonl").symlink_to("/dev/full")
    proc = _sim_cli("--resume", str(run_dir), "--steps", "6")
    assert proc.returncode == 1, proc.stderr[-2000:]
    _last_error_line(proc.stderr, "StoreError", "resuming the run", "at step 4", "rewriting metrics.jsonl",
                     "No space left on device")
    assert "Traceback" not in proc.stderr and "Logging error" not in proc.stderr
    assert proc.stderr.count("events.jsonl cannot be written") == 1
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == checkpoints  # nothing produced was lost


@pytest.mark.slow
def test_a_real_run_prints_no_library_warnings(tmp_path: Path) -> None:
    # peft's read of a deprecated transformers attribute printed a FutureWarning twice every run
    proc = run_py("--steps", "2", "--set", "log.progress=false", "--out", str(tmp_path / "run"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Warning" not in proc.stderr and "warn(" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_a_reward_that_never_returns_for_some_prompts_fails_their_groups_and_the_run_ends(tmp_path: Path) -> None:
    # a sync reward ran inline on the event loop once it had been fast: its first hang froze the
    # whole process, deaf to signals
    rewards = tmp_path / "stuck_rewards.py"
    rewards.write_text("import time\n"
                       "def sometimes_stuck(prompts, completions, **kw):\n"
                       "    while any(p.startswith('b') for p in prompts):\n"
                       "        time.sleep(0.05)\n"
                       "    return [0.5] * len(completions)\n")
    run_dir = tmp_path / "run"
    proc = _sim_cli("--steps", "6", "--set", f'reward.functions=["{rewards}:sometimes_stuck"]',
                    "--set", "reward.timeout_s=1", "--out", str(run_dir), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["accounting_ok"] and summary["groups_failed"]["reward_error"] >= 1
    timed_out = [e for e in _events(run_dir) if e["event"] == "group_failed" and "reward.timeout_s" in e["error"]]
    assert timed_out and all(e["function"] == "sometimes_stuck" for e in timed_out)


_STUCK = ("--set", "env.step_timeout_s=1", "--set", 'env.reward="env"', "--set", "env.max_turns=2")


@pytest.mark.slow
def test_a_run_ends_on_time_while_an_environment_step_never_returns(tmp_path: Path) -> None:
    # the hung steps' threads used to keep the process alive for ever after run_finished, and once
    # they held every worker of the default executor nothing else ran off the loop: no summary
    run_dir = tmp_path / "run"
    proc = _sim_cli("--steps", "4", "--set", 'env.factory="tests/episode_envs.py:Stuck"', *_STUCK,
                    "--out", str(run_dir), timeout=90)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["accounting_ok"]
    assert summary["groups_failed"].get("env_timeout", 0) >= 1, summary["groups_failed"]


@pytest.mark.slow
def test_a_run_whose_every_environment_step_hangs_fails_on_time_with_its_summary(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _sim_cli("--steps", "4", "--set", 'env.factory="tests/episode_envs.py:StuckAlways"', *_STUCK,
                    "--out", str(run_dir), timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    # the stuck steps' threads reach the bound before 64 groups have failed in a row (n = 2 a group)
    _last_error_line(proc.stderr, "calls of your code outlived their timeouts", "environment StuckAlways.step")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 0 and summary["accounting_ok"]
    assert summary["groups_failed"]["env_timeout"] >= 1


@pytest.mark.slow
def test_one_ctrl_c_stops_a_run_whose_environment_step_never_returns(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_run_py(*_SIM, "--steps", "1000", "--set", 'env.factory="tests/episode_envs.py:Stuck"', *_STUCK,
                        "--out", str(run_dir))
    try:
        wait_for_steps(proc, run_dir, 2, limit_s=60)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "--resume" in err.splitlines()[-1]
    assert json.loads((run_dir / "summary.json").read_text())["stopped_by"] == "SIGINT"


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("models")
    (d / "garbage").mkdir()
    (d / "garbage" / "config.json").write_text("garbage{")
    (d / "no-weights").mkdir()  # a valid config, a tokenizer even, but no weights
    (d / "no-weights" / "config.json").write_text(json.dumps({"model_type": "qwen2",
                                                              "architectures": ["Qwen2ForCausalLM"]}))
    (d / "no-weights" / "tokenizer_config.json").write_text("{}")
    return d


@pytest.mark.parametrize("folder, named", [
    ("garbage", ["model.path", "config.json", "not valid JSON"]),
    ("no-weights", ["model.path", "no weights", "safetensors"]),
])
def test_a_bad_model_folder_gives_the_same_clear_error_every_run(
        bad_models: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], folder: str, named: list[str]) -> None:
    errors = []
    for i in range(2):
        code = run.main(["--set", f"model.path={bad_models / folder}", "--out", str(tmp_path / f"run{i}")])
        out, err = capsys.readouterr()
        assert code == 2, err
        _assert_one_error_line(err, folder, *named)
        errors.append(err)
    assert errors[0] == errors[1]


@pytest.mark.parametrize("args, named", [
    (["--set", "trainer.device=cuda:0", "--set", "engine.kind=simulated"],
     ['trainer.device = "cuda:0"', "this machine has no CUDA device"]),
    (["--set", 'engine.devices=["cpu", "cuda:1"]', "--set", "trainer.kind=simulated"],
     ['engine.devices[1] = "cuda:1"', "this machine has no CUDA device"]),
])
def test_a_cuda_device_on_a_machine_without_cuda_is_exit_2_naming_the_field(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str],
        named: list[str]) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # what a GPU machine would say without them
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert run.main([*args, "--out", str(tmp_path / "run")]) == 2
    out, err = capsys.readouterr()
    _assert_one_error_line(err, *named)
