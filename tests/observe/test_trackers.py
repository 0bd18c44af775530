"""Trackers mirror metrics.jsonl: TensorBoard and wandb (offline) read back, a failing tracker never
fails the run, and a tracker whose package is missing is a config error (exit 2) naming its extra."""

from __future__ import annotations

import importlib.util
import json
import math
import struct
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pytest
from conftest import REPO, load_script, sim_config
from structlog.testing import capture_logs

from pipeline.config.io import dump_toml, load_config
from pipeline.errors import ConfigError
from pipeline.loop.preflight import preflight
from pipeline.observe.metrics import read_jsonl
from pipeline.loop.orchestrator import Pipeline
from pipeline.observe.trackers import Trackers, scalars, wandb_mode

PROMPTS = [{"id": f"p{i}", "prompt": f"prompt {i}", "token_ids": [1 + i % 50, 2, 3]} for i in range(16)]


def length_reward(prompts, completions, completion_ids, **kw):
    return [float(len(ids) % 3) for ids in completion_ids]


def run_with_trackers(tmp_path: Path, trackers: list[str], steps: int = 4, eval_every: int = 0) -> Path:
    cfg = sim_config(tmp_path, steps=steps, **{"log.trackers": trackers, "eval.every": eval_every})
    p = Pipeline(cfg, prompts=PROMPTS, reward=length_reward, tokenizer=False, console=False,
                 eval_prompts=PROMPTS[:3] if eval_every else None)
    summary = p.run_sync()
    assert summary["accounting_ok"] and summary["steps"] == steps, summary
    return p.run_dir


def expected_series(rows: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """What a tracker should hold: per metrics.jsonl key (but step), {step: value} where it is a number."""
    series: dict[str, dict[int, float]] = {}
    for row in rows:
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):
                series.setdefault(key, {})[row["step"]] = float(value)
    return series


# --------------------------------------------------------------------------- TensorBoard


def test_tensorboard_holds_every_numeric_metric_per_step_and_the_config(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = run_with_trackers(tmp_path, ["tensorboard"])
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # metrics.jsonl writes NaN as null (publish_to_loaded_s at step 1): TensorBoard must skip it, not show 0
    assert any(v is None for r in rows for v in r.values())
    want = expected_series(rows)
    assert {"reward_mean", "train/reward_mean", "rollout/started"} <= want.keys()

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == sorted(want)
    for tag, by_step in want.items():
        got = {e.step: e.value for e in acc.Scalars(tag)}
        # TensorBoard keeps float32 scalars
        assert got == {s: float(np.float32(v)) for s, v in by_step.items()}, tag

    (text,) = acc.Tensors("config/text_summary")
    config = text.tensor_proto.string_val[0].decode()
    assert dump_toml(load_config(run_dir / "config.toml")) in config  # the resolved config, as written beside it
    assert 'trackers = ["tensorboard"]' in config


# --------------------------------------------------------------------------- wandb


def _wandb_records(path: Path) -> list[Any]:
    """The records of an offline run's .wandb file: a 7-byte header, then 32 KiB blocks of chunks
    (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last), each a protobuf Record."""
    from wandb.proto import wandb_internal_pb2

    block = 32768
    data = path.read_bytes()
    assert data[:7] == b":W&B\xe1\xbe\x00", data[:7]
    pos, chunk, out = 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (n == 0 and kind == 0):  # the rest of a block is padding
            pos += left
            continue
        chunk += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            out.append(record)
            chunk = b""
    return out


@pytest.fixture
def wandb_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No user settings reach the test: offline by default, wandb's own files under tmp_path."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # pytest captures the streams wandb would wrap


def test_wandb_offline_run_holds_the_config_and_every_numeric_metric(tmp_path: Path, wandb_env: None) -> None:
    pytest.importorskip("wandb")
    run_dir = run_with_trackers(tmp_path, ["wandb"], steps=3)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    (file,) = offline.glob("run-*.wandb")
    records = _wandb_records(file)

    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == run_dir.name and run.project == "pipeline"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["log"]["trackers"] == ["wandb"]
    assert config["pipeline"]["steps"] == 3 and config["out"] == str(run_dir)

    # an item is keyed by `key` or by `nested_key` (its parts), as wandb chose to write it
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    got: dict[str, dict[int, float]] = {}
    for h in history:
        for key, value in h.items():
            if not key.startswith("_"):  # wandb's own: _step, _runtime, _timestamp
                got.setdefault(key, {})[h["_step"]] = value
    assert got == expected_series(rows)


def test_wandb_is_offline_unless_the_environment_says_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode() is None  # wandb's own default: online with that key
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() is None  # wandb reads WANDB_MODE itself


# --------------------------------------------------------------------------- fan-out


class Recorder:
    def __init__(self, name: str, fail: bool = False) -> None:
        self.name, self.fail = name, fail
        self.rows: list[tuple[dict[str, Any], int]] = []
        self.closed = False

    def log(self, row: Mapping[str, Any], step: int) -> None:
        self.rows.append((dict(row), step))
        if self.fail:
            raise OSError("disk full")

    def close(self) -> None:
        self.closed = True
        if self.fail:
            raise OSError("disk full")


def test_a_failing_tracker_is_warned_about_once_and_the_others_get_every_row() -> None:
    bad, good = Recorder("bad", fail=True), Recorder("good")
    trackers = Trackers([bad, good])
    with capture_logs() as logs:
        for step in (1, 2, 3):
            trackers.log({"step": step, "reward_mean": 0.5, "train/loss": float("nan"), "note": "x"}, step=step)
        trackers.close()
    assert good.rows == [({"reward_mean": 0.5}, s) for s in (1, 2, 3)]
    assert len(bad.rows) == 1 and not bad.closed  # dropped after its failure: neither logged to nor closed
    assert good.closed
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert [(e["event"], e["tracker"], e["step"]) for e in warnings] == [("tracker_log_failed", "bad", 1)]


def test_a_tracker_failing_to_close_does_not_stop_the_others_closing() -> None:
    bad, good = Recorder("bad", fail=True), Recorder("good")
    with capture_logs() as logs:
        Trackers([bad, good]).close()
    assert bad.closed and good.closed
    assert [e["event"] for e in logs] == ["tracker_close_failed"]


def test_a_run_sends_every_row_at_its_step_survives_a_failing_tracker_and_closes_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pipeline.observe.reporting

    bad, good = Recorder("bad", fail=True), Recorder("good")
    opened: list[tuple[tuple[str, ...], Path, Any]] = []

    def fake_open(names, run_dir, config):
        opened.append((names, run_dir, config))
        return Trackers([bad, good])

    monkeypatch.setattr(pipeline.observe.reporting, "open_trackers", fake_open)
    run_dir = run_with_trackers(tmp_path, ["tensorboard"])  # accounting_ok: the failing tracker ended nothing
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [step for _, step in good.rows] == [1, 2, 3, 4]
    assert [row for row, _ in good.rows] == [{k: v for k, v in r.items() if k != "step" and v is not None}
                                             for r in rows]
    assert good.closed and len(bad.rows) == 1
    ((names, where, config),) = opened
    assert names == ("tensorboard",) and where == run_dir
    assert dump_toml(config) == (run_dir / "config.toml").read_text()  # the resolved config, out included


def test_scalars_are_the_finite_numbers_but_the_step() -> None:
    row = {"step": 3, "a": 1, "b/c": 2.5, "nan": math.nan, "inf": math.inf, "none": None, "text": "x",
           "np": np.float32(0.25), "flag": True, "nested": {"x": 1}}
    assert scalars(row) == {"a": 1.0, "b/c": 2.5, "np": 0.25, "flag": 1.0}


# --------------------------------------------------------------------------- config


def _hide(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))


@pytest.mark.parametrize("package", ["wandb", "tensorboard"])
def test_a_tracker_whose_package_is_missing_is_a_config_error_naming_the_extra(
        monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    _hide(monkeypatch, package)
    with pytest.raises(ConfigError, match=rf'log.trackers includes "{package}" but the {package} package is not '
                                          rf'installed; pip install -e "\.\[{package}\]"'):
        preflight(load_config(None, {"log.trackers": [package]}))


@pytest.mark.parametrize("trackers, message", [
    (["tensorboard", "tensorboard"], "log.trackers must be distinct trackers"),
    (["mlflow"], "log.trackers[0] must be one of 'tensorboard', 'wandb', got 'mlflow'"),
])
def test_bad_trackers_are_refused_naming_the_field(trackers: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, {"log.trackers": trackers})
    assert message in str(e.value)


def test_run_py_exits_2_naming_the_extra_before_writing_anything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # run.py is a script at the repository root, not part of the package: load it by path
    run = load_script(REPO / "run.py", "run_cli_trackers")
    _hide(monkeypatch, "wandb")
    out = tmp_path / "run"
    assert run.main(["--out", str(out), "--set", 'log.trackers=["tensorboard", "wandb"]']) == 2
    stdout, stderr = capsys.readouterr()
    assert stdout == "" and stderr.splitlines() == [
        'error: log.trackers includes "wandb" but the wandb package is not installed; pip install -e ".[wandb]"']
    assert not out.exists()


def test_eval_rows_reach_both_trackers_at_their_step(tmp_path: Path, wandb_env: None) -> None:
    """An eval round ends after later steps were logged; TensorBoard takes any order, wandb gets eval/step."""
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = run_with_trackers(tmp_path, ["tensorboard", "wandb"], steps=4, eval_every=2)
    evals = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "eval/groups" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert {e.step: e.value for e in acc.Scalars("eval/reward_mean")} == \
        {r["step"]: float(np.float32(r["eval/reward_mean"])) for r in evals}
    (file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in _wandb_records(file) if r.WhichOneof("record_type") == "history"]
    got = {h["eval/step"]: h["eval/reward_mean"] for h in history if "eval/reward_mean" in h}
    assert got == {r["step"]: r["eval/reward_mean"] for r in evals}
