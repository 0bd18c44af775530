"""pipeline/engines/vllm_launch.py: the `vllm serve` launcher's process handling, on the CPU.

The server is tests/vllm_stand_in.py as a process, over the simulated engine (no model to
load); its knobs make it slow to start, fail, ignore SIGTERM or start a child that ignores it.
Checked: start waits for health and hands only the child its narrowed GPU; stop leaves no live
process of the server's group; a server that exits or never answers raises with its log and is
not left running; a killed owner leaves no server.
The launcher with real vLLM runs in tests/engines/test_engine_contract.py (param vllm_server_gpu, -m gpu).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, word_level_tokenizer
from transformers import AutoTokenizer

from pipeline.config.schema import SamplingConfig, VLLMServerEngineConfig
from pipeline.engines.simulated import SimulatedEngine
from pipeline.engines.vllm_launch import VLLMServeProcess
from pipeline.engines.vllm_server import VLLMServerEngine
from pipeline.errors import EngineDeadError
from pipeline.types import AdapterRef, Completion, GroupRequest, Prompt

STAND_IN = Path(__file__).resolve().parents[1] / "vllm_stand_in.py"
SIMULATED = ("--stand-in-engine", "simulated")  # the model path names no model
linux_only = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")


def launcher(tmp_path: Path, *knobs: str, **kw: object) -> VLLMServeProcess:
    return VLLMServeProcess(tmp_path / "model", tmp_path / "serve.log", program=(sys.executable, str(STAND_IN)),
                            extra=(*SIMULATED, *knobs), **kw)


def run(coro: object) -> object:
    """Run on a fresh loop, closed without waiting for its worker threads: a stop() stuck in one
    fails its test by the test's timeout instead of hanging the test."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def health(url: str) -> int:
    with urllib.request.urlopen(url + "/health", timeout=2) as r:
        return r.status


def log_lines(server: VLLMServeProcess) -> list[dict]:
    return [json.loads(line) for line in server.log_path.read_text().splitlines() if line.startswith("{")]


def state(pid: int) -> tuple[str, int] | None:
    """(state letter, process group) of a process, or None when there is none."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):  # it is gone
        return None
    return fields[0], int(fields[2])


def live_in_group(pgid: int) -> list[int]:
    """Processes of group `pgid` that still run (a zombie, dead but not yet reaped, does not count)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (s := state(int(entry.name))) is not None and s[1] == pgid and s[0] != "Z":
            out.append(int(entry.name))
    return out


def until_none_live(pgid: int, timeout_s: float = 3.0) -> list[int]:
    """Wait for a SIGKILL to land (it is delivered, not awaited); what is still live after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (left := live_in_group(pgid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def kill_leftovers(pgid: int) -> None:
    """What a broken launcher left running, so one failing test does not leave processes behind."""
    for pid in live_in_group(pgid):
        os.kill(pid, signal.SIGKILL)


def test_start_waits_for_health_and_narrows_the_gpu_for_the_child_only(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    server = launcher(tmp_path, "--stand-in-delay", "0.6", device="cuda:1", max_loras=7, enforce_eager=True)
    assert server.port != 0 and server.url == f"http://127.0.0.1:{server.port}"

    async def scenario() -> float:
        t0 = time.monotonic()
        assert await server.start(timeout_s=10) == server.url
        waited = time.monotonic() - t0
        assert await asyncio.to_thread(health, server.url) == 200
        await server.stop()
        return waited

    assert run(scenario()) >= 0.6  # it did not return before the server listened
    [seen] = log_lines(server)
    assert seen["env"] == {"CUDA_VISIBLE_DEVICES": "5", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
                           "PYTHONUNBUFFERED": "1"}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5"  # this process's view is untouched
    argv = seen["argv"]
    assert argv[0] == str(tmp_path / "model")
    for flag, value in (("--port", str(server.port)), ("--host", "127.0.0.1"), ("--max-loras", "7"),
                        ("--max-lora-rank", "16"), ("--max-num-seqs", "1024")):
        assert argv[argv.index(flag) + 1] == value, (flag, argv)
    assert {"--enable-lora", "--enforce-eager", "--stand-in-delay"} <= set(argv)
    assert json.loads(argv[argv.index("--compilation-config") + 1]) == {"cudagraph_specialize_lora": False}
    assert "--skip-tokenizer-init" not in argv and server.eos_id is None  # no tokenizer files: vLLM loads its own


def test_a_server_whose_tokenizer_names_its_eos_starts_without_it_and_stops_there(tmp_path: Path) -> None:
    """Asked to, the server skips its tokenizer where the files give the eos id, and every completion
    the engine gets from it ends at its first eos (which the stand-in, like vLLM without a
    tokenizer, only knows from the request); flags naming another tokenizer keep vLLM's own, and
    so does a server not asked to (a client that knows only its URL sends no stop ids)."""
    # the eos: the id the stand-in's simulated engine samples most often (p 0.12-0.42), so completions reach it
    likeliest = int(np.argmax(SimulatedEngine(name="stand-in").policy_logprobs()))
    word_level_tokenizer(tmp_path / "model", eos=f"t{likeliest}", eos_added=False,
                         words=("[UNK]", *(f"t{i}" for i in range(1, 128))))
    eos = AutoTokenizer.from_pretrained(tmp_path / "model").eos_token_id
    server = launcher(tmp_path, skip_tokenizer_init=True)
    engine = VLLMServerEngine(server.url, sampling=SamplingConfig(), cfg=VLLMServerEngineConfig(), server=server)

    async def scenario() -> list[Completion]:
        await engine.start()
        try:
            groups = [await engine.generate(GroupRequest(group_id=g, prompt=Prompt(str(g), "", (1, 2)), n=8,
                                                         max_new_tokens=16), AdapterRef.base()) for g in range(8)]
        finally:
            await engine.close()
        return [c for generation in groups for c in generation.completions]

    completions = run(scenario())
    assert "--skip-tokenizer-init" in log_lines(server)[0]["argv"] and server.eos_id == eos == likeliest
    stopped = [c for c in completions if eos in c.token_ids.tolist()]
    assert len(stopped) >= 16, f"only {len(stopped)} of {len(completions)} completions sampled the eos"
    for c in completions:
        if eos in c.token_ids.tolist():
            assert c.token_ids.tolist().index(eos) == len(c.token_ids) - 1 and c.finish_reason == "stop"
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 16

    for knobs, skip in ((("--tokenizer", str(tmp_path / "model")), True), ((), False)):
        other = launcher(tmp_path, *knobs, skip_tokenizer_init=skip)
        run(other.start(timeout_s=10))
        run(other.stop())
        assert "--skip-tokenizer-init" not in log_lines(other)[0]["argv"] and other.eos_id is None, knobs


@linux_only
@pytest.mark.parametrize("server_ignores_term", [False, True], ids=["server-stops", "server-stuck"])
def test_stop_leaves_no_live_process_of_the_servers_group(tmp_path: Path, server_ignores_term: bool) -> None:
    # the server's child ignores SIGTERM in both cases: only a SIGKILL to the group ends it
    knobs = ("--stand-in-child", *(("--stand-in-ignore-term",) if server_ignores_term else ()))
    server = launcher(tmp_path, *knobs, grace_s=0.5)

    async def scenario() -> None:
        await server.start(timeout_s=10)
        assert server.pid is not None and len(live_in_group(server.pid)) == 3  # the guard, the server, its child
        await asyncio.wait_for(server.stop(), timeout=5)

    run(scenario())
    child = log_lines(server)[1]["child"]
    try:
        assert until_none_live(server.pid) == []
        assert state(child) is None or state(child)[0] == "Z"
        assert server.returncode == (-signal.SIGKILL if server_ignores_term else -signal.SIGTERM)
    finally:
        kill_leftovers(server.pid)


def test_a_server_that_exits_early_raises_with_the_end_of_its_log(tmp_path: Path) -> None:
    server = launcher(tmp_path, "--stand-in-exit", "3")
    with pytest.raises(EngineDeadError, match=r"(?s)exited with code 3 before answering .*/health.*"
                                              r"the end of its log .*ValueError: the stand-in was told to fail"):
        run(server.start(timeout_s=10))
    assert server.returncode == 3


@linux_only
def test_a_server_that_never_answers_is_stopped_after_the_timeout(tmp_path: Path) -> None:
    server = launcher(tmp_path, "--stand-in-delay", "60", "--stand-in-child", grace_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"did not answer .*/health within 1 s"):
        run(server.start(timeout_s=1))
    assert time.monotonic() - t0 < 4
    assert server.pid is not None
    try:
        assert until_none_live(server.pid) == []
    finally:
        kill_leftovers(server.pid)


@linux_only
def test_a_killed_owner_leaves_no_server(tmp_path: Path) -> None:
    # the owner process starts the server from its main thread, says the server's pid, and is SIGKILLed;
    # the server has a child that ignores SIGTERM, as vLLM's engine core is a process of its own
    owner_code = (
        "import asyncio, sys\n"
        "from pipeline.engines.vllm_launch import VLLMServeProcess\n"
        f"s = VLLMServeProcess({str(tmp_path / 'model')!r}, {str(tmp_path / 'serve.log')!r}, "
        f"program=(sys.executable, {str(STAND_IN)!r}), extra={[*SIMULATED, '--stand-in-child']!r})\n"
        "asyncio.run(s.start(timeout_s=10))\n"
        "print('server-pid', s.pid, flush=True)\n"
        "sys.stdin.read()\n")  # until the test kills it
    owner = subprocess.Popen([sys.executable, "-c", owner_code], cwd=REPO, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    server = next(int(line.split()[1]) for line in owner.stdout if line.startswith("server-pid "))  # after its logs
    try:
        assert state(server) is not None and state(server)[0] != "Z"
        assert len(live_in_group(server)) == 3  # the guard, the server, the server's child
        owner.kill()
        owner.wait()
        assert until_none_live(server) == [], "the server or its child outlived its killed owner"
    finally:
        kill_leftovers(server)
        owner.stdin.close()
        owner.stdout.close()
