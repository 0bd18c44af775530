"""The trainer's child process: its events reach the run's events.jsonl, and no call waits on it forever.

Most checks use `Scripted`, a trainer without torch that does what a test asks (its child starts in
about a second); one uses the real PolicyTrainer on the tiny model. The calls that `ProcessTrainer`
mirrors with the in-thread trainer are checked in test_trainer.py.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import structlog

from pipeline.config.schema import LossConfig, TrainerConfig
from pipeline.errors import TrainerError
from pipeline.observe.log import close_logging, configure_logging
from pipeline.trainer.log_shipping import EventShipper, forward_events
from pipeline.trainer.process import ProcessTrainer

log = structlog.get_logger(__name__)


class Scripted:
    """A trainer that does what the test asks, cheaply; built in the child by ProcessTrainer."""

    def __init__(self, model_path: str, cfg: TrainerConfig, loss_cfg: LossConfig, **kwargs: object) -> None:
        if model_path == "absent":
            raise FileNotFoundError(f"no model at {model_path}")
        self.version = self.skipped_steps = self.consecutive_skips = 0

    def setup(self) -> None:
        log.debug("scripted_debug")
        # what a library says through stdlib logging and warnings, as transformers and peft do
        logging.getLogger("transformers.scripted").warning("library says %s", "hello")
        warnings.warn("scripted deprecation", FutureWarning, stacklevel=1)
        # values that are not JSON: a numpy scalar arrives as a number, a path as its text
        log.info("scripted_ready", value=np.float32(0.5), path=Path("/x"))

    def step(self, seconds: float) -> float:
        log.warning("scripted_step", seconds=seconds)
        time.sleep(seconds)
        self.version += 1
        return seconds

    def save_state(self, directory: Path) -> None:
        """Dies without any clean-up, the way a segfault or the OOM killer ends a process."""
        log.warning("scripted_last_words", directory=str(directory))
        try:
            raise ValueError("scripted failure")
        except ValueError:  # logged with its traceback, then the process ends
            log.exception("scripted_traceback")
        os._exit(3)


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def _named(events: list[dict], name: str) -> list[dict]:
    return [e for e in events if e["event"] == name]


def _scripted(model_path: str = "unused", **cfg: object) -> ProcessTrainer:
    return ProcessTrainer(model_path, TrainerConfig(**cfg), LossConfig(), start_timeout_s=60, trainer_cls=Scripted)


def test_a_trainer_class_of_the_script_being_run_is_refused_before_the_child_starts():
    # the child never imports the parent's __main__ (a script without a main guard would run again there)
    class InMain(Scripted):
        pass

    InMain.__module__ = "__main__"
    trainer = ProcessTrainer("unused", TrainerConfig(), LossConfig(), start_timeout_s=60, trainer_cls=InMain)
    with pytest.raises(TrainerError, match=r"InMain is defined in the script being run \(__main__\)"):
        trainer.setup()
    assert trainer.pid is None
    trainer.close()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
@pytest.mark.parametrize("idle", [True, False])
def test_a_cpu_trainer_process_is_idle_scheduled_and_niced_in_every_thread(idle: bool) -> None:
    # on the CPU the child yields a core the moment the parent's event loop wakes
    trainer = _scripted(nice=7, sched_idle=idle)
    try:
        trainer.setup()
        tids = [int(t) for t in os.listdir(f"/proc/{trainer.pid}/task")]
        assert len(tids) >= 2  # the main thread and the parent watch, at least
        assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_IDLE if idle else os.SCHED_OTHER}
        assert {os.getpriority(os.PRIO_PROCESS, t) for t in tids} == {7}
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the parent is untouched
    finally:
        trainer.close()


def test_the_real_trainers_events_reach_events_jsonl(tmp_path: Path):
    from pipeline.models import builtin as models
    model_dir = models.build_model("tiny", tmp_path / "models")
    configure_logging(tmp_path, "info", console=False)
    trainer = ProcessTrainer(model_dir, TrainerConfig(lora_rank=4), LossConfig())
    try:
        trainer.setup()
        pid = trainer.pid
        (tmp_path / "state").mkdir()
        trainer.save_state(tmp_path / "state")  # logs trainer_state_saved at debug: below this run's floor
    finally:
        trainer.close()
        close_logging()
    events = _events(tmp_path)
    [ready] = _named(events, "trainer_ready")
    assert ready["process"] == "trainer" and ready["pid"] == pid != os.getpid()
    assert ready["level"] == "info" and ready["logger"] == "pipeline.trainer.policy" and ready["trainable_params"] > 0
    assert ready["timestamp"].endswith("Z")  # stamped in the child, as the parent stamps its own
    assert not _named(events, "trainer_state_saved")
    assert all(e.get("process") != "trainer" or e["pid"] == pid for e in events)


def test_debug_events_and_a_step_past_the_timeout_kill_the_child(tmp_path: Path):
    configure_logging(tmp_path, "debug", console=False)
    trainer = _scripted(step_timeout_s=1.0)
    try:
        trainer.setup()
        pid = trainer.pid
        assert trainer.step(0.0) == 0.0 and trainer.version == 1
        os.kill(pid, signal.SIGINT)  # a Ctrl-C reaches the whole process group; the child leaves it to the parent
        assert trainer.step(0.0) == 0.0 and trainer.version == 2

        t0 = time.monotonic()
        with pytest.raises(TrainerError, match=r"did not answer step within trainer\.step_timeout_s = 1\.0 s; "
                                               r"it was killed \(exit code -9\)"):
            trainer.step(60.0)
        assert time.monotonic() - t0 < 4.0
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # gone and reaped: it holds no device any more
        with pytest.raises(TrainerError, match=r"not running \(exit code -9\); save_adapter failed"):
            trainer.save_adapter(tmp_path)
    finally:
        trainer.close()
        close_logging()
    events = _events(tmp_path)
    assert [e["level"] for e in _named(events, "scripted_debug")] == ["debug"]
    [ready] = _named(events, "scripted_ready")
    assert ready["value"] == 0.5 and ready["path"] == "/x" and ready["pid"] == pid
    # the step that hung had logged that it started, and that event was delivered
    assert [e["seconds"] for e in _named(events, "scripted_step")] == [0.0, 0.0, 60.0]
    # a library's stdlib log record and a Python warning reach events.jsonl, not the child's stderr
    library = {e["source"]: e for e in _named(events, "library_log")}
    said = library["transformers.scripted"]
    assert (said["message"], said["level"], said["process"], said["pid"]) == ("library says hello", "warning",
                                                                              "trainer", pid)
    assert "FutureWarning: scripted deprecation" in library["py.warnings"]["message"]


class _Slow(logging.Handler):
    """A parent whose logging is slow (a loaded disk): the reader lags behind the child."""

    def emit(self, record: logging.LogRecord) -> None:
        time.sleep(0.1)


def test_a_crashing_child_delivers_its_last_events_before_its_death_is_reported(tmp_path: Path):
    configure_logging(tmp_path, "info", console=False)
    slow = _Slow()
    logging.getLogger("pipeline").addHandler(slow)
    trainer = _scripted()
    try:
        trainer.setup()
        pid = trainer.pid
        with pytest.raises(TrainerError, match=r"not running \(exit code 3\); save_state failed"):
            trainer.save_state(tmp_path)
        events = _events(tmp_path)  # before close: the error is raised only after the child's events are logged
        trainer.close()

        # a child that cannot build its trainer logs why before it exits
        trainer = _scripted("absent")
        with pytest.raises(TrainerError, match=r"not running \(exit code 1\); setup failed"):
            trainer.setup()
        [failed] = _named(_events(tmp_path), "trainer_process_failed")
        assert failed["stage"] == "start" and "FileNotFoundError: no model at absent" in failed["exception"]
    finally:
        trainer.close()
        logging.getLogger("pipeline").removeHandler(slow)
        close_logging()
    [words] = _named(events, "scripted_last_words")
    [tb] = _named(events, "scripted_traceback")
    assert words["process"] == tb["process"] == "trainer" and words["pid"] == tb["pid"] == pid
    assert tb["level"] == "error" and "ValueError: scripted failure" in tb["exception"]
    assert "test_trainer_process.py" in tb["exception"]
    assert not _named(events, "scripted_debug")  # an info run: the child logged at info and up


def test_the_shipper_never_waits_for_its_reader_and_counts_what_it_drops(tmp_path: Path):
    """No reader while 300 events of 2 kB are logged: they cannot all wait; the rest arrive in order."""
    configure_logging(tmp_path, "info", console=False)
    reader, writer = mp.Pipe(duplex=False)
    child_gone, end = os.pipe()  # stands in for the child's sentinel: readable once `end` is closed
    try:
        shipper = EventShipper(writer, limit=1 << 16)
        burst = threading.Thread(target=lambda: [
            shipper.ship({"event": "burst", "i": i, "pad": "x" * 2000, "level": "info", **shipper.tags})
            for i in range(300)], daemon=True)  # a daemon: a shipper that blocks fails this test, not the session
        burst.start()
        burst.join(2)
        assert not burst.is_alive()
        thread = threading.Thread(target=forward_events, args=(reader, SimpleNamespace(sentinel=child_gone)))
        thread.start()
        assert shipper.flush(10)  # the buffer drained into the pipe, the count of drops after it
        os.close(end)
        thread.join(10)
        assert not thread.is_alive()
    finally:
        close_logging()
        os.close(child_gone)
        reader.close()  # closed by forward_events already, unless it failed
        writer.close()
    events = _events(tmp_path)
    kept = [e["i"] for e in _named(events, "burst")]
    assert 0 < len(kept) < 300 and kept == list(range(len(kept)))  # the first ones, in order
    [dropped] = _named(events, "trainer_log_events_dropped")
    assert dropped["dropped"] == 300 - len(kept) and dropped["level"] == "warning"
    assert dropped["process"] == "trainer" and dropped["pid"] == os.getpid()
    assert events[-1] == dropped  # after every event that was kept


def _gone(pid: int) -> bool:
    """No such process, or a zombie (an orphan whose new parent, in a container, may never reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_child_ends_when_its_parent_dies_in_the_middle_of_a_step():
    """A parent killed mid-step (os._exit, as on a second Ctrl-C) leaves no trainer holding its device."""
    code = f"""
import os, sys, threading, time
sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]
from test_trainer_process import _scripted
trainer = _scripted()
trainer.setup()
threading.Thread(target=trainer.step, args=(60.0,), daemon=True).start()
time.sleep(0.3)
print(trainer.pid, flush=True)
os._exit(0)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 5
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid)


def test_a_trainer_process_started_early_builds_its_trainer_once_given_the_arguments(tmp_path: Path) -> None:
    """TrainerProcess: the process runs (importing) before the trainer's arguments exist; the
    ProcessTrainer given it builds the trainer there at setup, with the priority it was started with."""
    from pipeline.trainer.process import TrainerProcess

    cfg = TrainerConfig(nice=6)
    early = TrainerProcess(cfg, trainer_cls=Scripted)
    pid = early.parts[0].pid
    assert early.parts[0].is_alive()
    trainer = ProcessTrainer("unused", cfg, LossConfig(), start_timeout_s=60, trainer_cls=Scripted, process=early)
    try:
        trainer.setup()
        assert trainer.pid == pid and os.getpriority(os.PRIO_PROCESS, pid) == 6
        assert trainer.step(0.0) == 0.0 and trainer.version == 1
        early.close()  # taken over: closing it now does nothing to the trainer's process
        assert trainer.step(0.0) == 0.0 and trainer.version == 2
    finally:
        trainer.close()
    with pytest.raises(TrainerError, match="another trainer class or priority"):
        ProcessTrainer("unused", TrainerConfig(nice=1), LossConfig(), trainer_cls=Scripted,
                       process=TrainerProcess(cfg, trainer_cls=Scripted))


def test_an_early_trainer_process_nobody_used_ends_with_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A set-up that fails after the trainer's process started (reading the prompts, here) leaves no
    trainer process behind; nor does TrainerProcess.close() of one never used."""
    from pipeline.loop import build
    from pipeline.config.io import load_config
    from pipeline.errors import ConfigError
    from pipeline.loop.orchestrator import Pipeline
    from pipeline.trainer.process import TrainerProcess

    early = TrainerProcess(TrainerConfig(), trainer_cls=Scripted)
    proc = early.parts[0]
    early.close()
    assert not proc.is_alive()
    started: list[TrainerProcess] = []
    spawn = build.early_trainer_process
    monkeypatch.setattr(build, "early_trainer_process", lambda cfg: started.append(spawn(cfg)) or started[-1])

    def unreadable(*args: object) -> None:
        raise ConfigError("data.train: the prompts could not be read")

    monkeypatch.setattr(build, "prompt_sets", unreadable)
    with pytest.raises(ConfigError, match="could not be read"):
        Pipeline(load_config(None, {"out": str(tmp_path / "run")}), console=False).run_sync()
    [early] = started
    assert early.parts is None and [p for p in mp.active_children() if p.name == "pipeline-trainer"] == []
