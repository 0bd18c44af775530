"""run.py's command line: bad input is one "error:" line and exit 2; --resume continues a run in place.

No test here starts a real run: the error cases stop before the pipeline is built, and the
--resume and signal cases replace the Pipeline class with a recorder.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
# run.py is a script at the repository root, not part of the package: load it by path
_spec = importlib.util.spec_from_file_location("run_cli", REPO / "run.py")
run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "run.py", *args], cwd=REPO, capture_output=True, text=True, timeout=60)


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
])
def test_bad_input_is_one_error_line_naming_the_field_and_exit_code_2(files: Path, args: list[str],
                                                                       named: list[str]) -> None:
    proc = _cli(*(a.format(d=files) for a in args))
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
    monkeypatch.setitem(sys.modules, "pipeline.orchestrator", types.SimpleNamespace(Pipeline=_Recorder))
    monkeypatch.setattr(_Recorder, "built", [])
    monkeypatch.setattr(_Recorder, "summary", {"run_dir": "x", "steps": 4, "accounting_ok": True})
    return _Recorder


def _write_run_dir(path: Path) -> Path:
    from pipeline.config import dump_toml, load_config

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
    assert p.kwargs == {"resume": True, "handle_signals": True}
    assert p.cfg.out == str(run_dir)  # forced to DIR, whatever the old config said
    assert (p.cfg.pipeline.steps, p.cfg.trainer.lr, p.cfg.engine.kind) == (9, 0.25, "simulated")
    assert '"steps": 4' in capsys.readouterr().out


def test_a_fresh_run_handles_signals_and_does_not_resume(tmp_path: Path, recorder: type[_Recorder]) -> None:
    assert run.main(["--out", str(tmp_path / "new"), "--set", "engine.kind=simulated"]) == 0
    (p,) = recorder.built
    assert p.kwargs == {"resume": False, "handle_signals": True}
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
