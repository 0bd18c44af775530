"""`engine.vllm_server.launch = true`: the pipeline starts one server per engine.devices entry.

On the CPU the servers are tests/vllm_stand_in.py as processes (vLLM's HTTP API over the tiny
model's in-process engine), given as engine.vllm_server.command; the real `vllm serve` runs in
tests/engines/test_vllm_server_gpu.py. Checked: a run on two launched servers accounts for every group
and leaves no server process; a server killed mid-run is restarted through the engine restarts;
a run killed with SIGKILL leaves none either; the config is checked.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, run_py, start_run_py, wait_for_steps

from pipeline.config.io import load_config
from pipeline.errors import ConfigError

STAND_IN = REPO / "tests" / "vllm_stand_in.py"

RUN = f"""
seed = 3
[model]
cache_dir = "{{cache}}"
[task]
num_prompts = 64
[sampling]
n = 4
max_new_tokens = 6
[engine]
kind = "vllm_server"
devices = ["cuda:0", "cuda:0"]
restart_backoff_s = 0.2
start_timeout_s = 120
[engine.vllm]
gpu_memory_utilization = 0.4
[engine.vllm_server]
launch = true
command = [{json.dumps(sys.executable)}, {json.dumps(str(STAND_IN))}]
[trainer]
step_s = 0.0
[pipeline]
steps = {{steps}}
batch_groups = 4
max_staleness = 1
checkpoint_every = 0
[log]
level = "info"
progress = false
"""


def _events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]


def _group_alive(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(entry.name))
    return alive


def _none_left(pgids: list[int], timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := [p for g in pgids for p in _group_alive(g)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _config(factory: pytest.TempPathFactory, name: str, steps: int) -> tuple[Path, Path]:
    """(config file, run directory) of a run of `steps` steps, the tiny model shared between tests."""
    tmp = factory.mktemp(name)
    path = tmp / "run.toml"
    path.write_text(RUN.format(cache=factory.getbasetemp() / "model-cache", steps=steps))
    return path, tmp / "run"


@pytest.mark.slow
def test_a_run_on_two_launched_servers_accounts_for_every_group_and_leaves_none(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    config, out = _config(tmp_path_factory, "launch", 6)
    done = run_py("--config", str(config), "--out", str(out), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accounting_ok"] and summary["steps"] == 6 and summary["groups_trained"] == 24
    events = _events(out)
    started = [e for e in events if e.get("event") == "vllm_serve_started"]
    assert len(started) == 2 and len({e["url"] for e in started}) == 2
    assert {e["gpu"] for e in started} == {"0"}  # both on cuda:0, each told so through CUDA_VISIBLE_DEVICES
    for i in range(2):  # each server's log under the run, with the flags from the config
        seen = json.loads((out / "servers" / f"vllm-server-{i}.log").read_text().splitlines()[0])
        argv = seen["argv"]
        assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.4"
        assert argv[argv.index("--max-loras") + 1] == "3" and "--enable-lora" in argv
        # CUDA graphs for the most sequences a server can run here: (K + 1) x B x n over 2 servers
        assert argv[argv.index("--max-cudagraph-capture-size") + 1] == str((1 + 1) * 4 * 4 // 2)
        assert "--skip-tokenizer-init" in argv  # the built-in tokenizer's files give its eos id
    stopped = [e for e in events if e.get("event") == "vllm_serve_stopped"]
    assert len(stopped) == 2
    assert _none_left([e["pid"] for e in started]) == []


@pytest.mark.slow
def test_a_launched_server_that_dies_is_restarted_and_a_killed_run_leaves_no_server(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    config, out = _config(tmp_path_factory, "launch-faults", 400)
    run = start_run_py("--config", str(config), "--out", str(out))
    try:
        wait_for_steps(run, out, 2, limit_s=120)
        first = [e for e in _events(out) if e.get("event") == "vllm_serve_started"]
        assert len(first) == 2
        os.killpg(first[0]["pid"], signal.SIGKILL)  # server 0 and all of its group, as a crash would
        deadline = time.monotonic() + 60
        while len(started := [e for e in _events(out) if e.get("event") == "vllm_serve_started"]) < 3:
            assert run.poll() is None, run.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the dead server was not started again"
            time.sleep(0.2)
        assert started[2]["url"] == first[0]["url"]  # the same engine, its server on the same port
        steps = (out / "metrics.jsonl").read_text().count("\n")
        wait_for_steps(run, out, steps + 3, limit_s=120)  # the run goes on
        run.kill()  # the whole pipeline, without a chance to stop anything
        run.wait(10)
        assert _none_left([e["pid"] for e in started]) == [], "a launched server outlived its killed run"
    finally:
        if run.poll() is None:
            run.kill()
        run.communicate()


def test_launch_is_checked() -> None:
    base = {"engine.kind": "vllm_server", "engine.vllm_server.launch": True}
    assert load_config(None, {**base, "engine.devices": ["cuda:0", "cuda:1"]}).engine.vllm_server.launch
    with pytest.raises(ConfigError, match=r'engine.devices\[0\] must be a GPU \("cuda:N"\) for a launched vllm serve'):
        load_config(None, base)  # engine.devices defaults to ["cpu"]
    with pytest.raises(ConfigError, match="leave engine.vllm_server.urls out"):
        load_config(None, {**base, "engine.devices": ["cuda:0"], "engine.vllm_server.urls": ["http://h:8000"]})
    with pytest.raises(ConfigError, match=r"engine.vllm_server.port must be in \[0, 65535\]"):
        load_config(None, {**base, "engine.devices": ["cuda:0"], "engine.vllm_server.port": 70000})
    with pytest.raises(ConfigError, match="or engine.vllm_server.launch = true"):
        load_config(None, {"engine.kind": "vllm_server"})
