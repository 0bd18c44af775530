"""Trainer ranks (`trainer.devices`): two gloo ranks on the CPU, FSDP2-sharded.

What they must give: the one-process trainer's step (loss, statistics, weights) for LoRA and full
weights; a checkpoint that a killed run resumes bit for bit onto the same number of ranks, and
refuses onto another; a rank that dies or hangs ends the call with its rank named, every rank
gone; and a pipeline run on them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, check_finished_run, run_py
from safetensors.numpy import load_file
from test_trainer_learning import _random_batch

from pipeline.config.schema import LossConfig, TrainerConfig
from pipeline.errors import ConfigError, TrainerError
from pipeline.trainer.policy import PolicyTrainer
from pipeline.trainer.ranks import RankedTrainer

TWO = ("cpu", "cpu")
LOSS = LossConfig(norm_tokens=8)
# 9 rows (one empty completion per group is left out): shares of 4 and 5 rows, so with micro-batches
# of 2 rank 0 makes 2 passes with rows and one that weighs nothing, to meet rank 1's third
LENGTHS = (2, 7, 0, 5)


def _cfg(**kw: object) -> TrainerConfig:
    kw.setdefault("lora_rank", 4)
    kw.setdefault("micro_batch_sequences", 2)
    kw.setdefault("threads", 1)
    return TrainerConfig(**kw)


def _ranked(model_dir: Path, **kw: object) -> RankedTrainer:
    t = RankedTrainer(model_dir, _cfg(devices=TWO, **kw), LOSS, seed=0, keep_versions=3)
    t.setup()
    return t


def _weights(trainer: object, directory: Path, update: str) -> dict[str, np.ndarray]:
    directory.mkdir()
    trainer.save_adapter(directory)
    return load_file(str(directory / ("model.safetensors" if update == "full" else "adapter_model.safetensors")))


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"


@pytest.mark.parametrize("update", ["lora", "full"])
def test_two_ranks_take_the_one_process_trainers_step(model_dir: Path, tmp_path: Path, update: str) -> None:
    """Loss, every train/* statistic and the updated weights equal the one-process trainer's on the
    same batch, over two optimizer steps (minibatches = 2), one rank making a pass without rows."""
    batch = _random_batch(seed=1, n=3, lengths=LENGTHS)
    one = PolicyTrainer(model_dir, _cfg(update=update, minibatches=2), LOSS, seed=0)
    one.setup()
    expected = one.step(batch)
    two = _ranked(model_dir, update=update, minibatches=2)
    try:
        got = two.step(batch)
        assert got.version == two.version == 1
        for k, v in expected.metrics.items():
            if k.endswith("_s"):  # seconds
                continue
            assert got.metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
        # the slowest rank's step: rank 0's own (t_start to t_end) or a later rank's, never less
        assert got.metrics["train/rank_step_max_s"] >= got.t_end - got.t_start > 0
        assert expected.metrics["train/sequences"] == 9 and expected.metrics["train/optimizer_steps"] == 2
        a, b = _weights(one, tmp_path / "one", update), _weights(two, tmp_path / "two", update)
        assert a.keys() == b.keys()
        moved = max(float(np.abs(a[k] - w).max()) for k, w in _weights(_fresh(model_dir, update), tmp_path / "base",
                                                                         update).items())
        assert moved > 1e-3  # the step changed the weights, so equal weights say something
        for k in a:
            np.testing.assert_allclose(b[k], a[k], rtol=0, atol=5e-5, err_msg=k)
        if update == "full":  # the published directory is the one-process trainer's: same config, tied once
            assert json.loads((tmp_path / "two/config.json").read_text()) == \
                json.loads((tmp_path / "one/config.json").read_text())
        else:
            cfg_a, cfg_b = (json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("one", "two"))
            assert sorted(cfg_a.pop("target_modules")) == sorted(cfg_b.pop("target_modules")) and cfg_a == cfg_b
    finally:
        two.close()


def _fresh(model_dir: Path, update: str) -> PolicyTrainer:
    t = PolicyTrainer(model_dir, _cfg(update=update), LOSS, seed=0)
    t.setup()
    return t


def test_two_ranks_recompute_an_older_versions_logprobs_as_one_process(model_dir: Path) -> None:
    """Log-probs under a kept older version (the log-prob check's) and the current one agree with the
    one-process trainer's, and the current weights are back in place after."""
    b1 = replace(_random_batch(seed=1, n=3, lengths=LENGTHS), keep_version=True)  # version 0 is kept
    one = PolicyTrainer(model_dir, _cfg(), LOSS, seed=0, keep_versions=3)
    one.setup()
    two = _ranked(model_dir)
    try:
        for t in (one, two):
            t.step(b1)
        b2 = _random_batch(seed=2, n=3, lengths=LENGTHS)
        for version in (0, 1):
            groups = [replace(g, generation=replace(g.generation, version=version)) for g in b2.groups]
            x, y = one.recompute_logprobs(groups), two.recompute_logprobs(groups)
            for gx, gy in zip(x, y):
                for cx, cy in zip(gx, gy):
                    np.testing.assert_allclose(cy, cx, rtol=0, atol=1e-4)
        s1, s2 = one.step(b2), two.step(b2)  # after the recompute under version 0: version 1 is back in place
        assert s2.metrics["train/loss"] == pytest.approx(s1.metrics["train/loss"], rel=1e-5)
    finally:
        two.close()


KILLED_RUN = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path[:0] = [{repo!r}, {tests!r}, {here!r}]
    from test_trainer_ranks import LOSS, LENGTHS, TWO, _cfg
    from test_trainer_learning import _random_batch
    from pipeline.trainer.ranks import RankedTrainer

    if __name__ == "__main__":
        t = RankedTrainer({model!r}, _cfg(devices=TWO), LOSS, seed=0)
        t.setup()
        t.step(_random_batch(seed=1, n=3, lengths=LENGTHS))
        t.save_state(Path({state!r}))
        print("PIDS", *t.pids, flush=True)
        t.step(_random_batch(seed=2, n=3, lengths=LENGTHS))  # killed in or after this step
        time.sleep(600)
""")


def test_kill_9_of_the_run_then_resume_onto_two_ranks_is_bit_identical(model_dir: Path, tmp_path: Path) -> None:
    """A run checkpoints its two ranks, is killed with SIGKILL (its ranks end with it); two new ranks
    load that state and their next step equals, bit for bit, the step of ranks that never stopped."""
    state = tmp_path / "state"
    state.mkdir()
    script = tmp_path / "run.py"
    script.write_text(KILLED_RUN.format(repo=str(REPO), tests=str(REPO / "tests"), here=str(Path(__file__).parent),
                                        model=str(model_dir), state=str(state)))
    run = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        pids = next((line.split()[1:] for line in run.stdout if line.startswith("PIDS")), [])
    finally:
        run.kill()
        run.communicate(timeout=10)
    pids = [int(p) for p in pids]
    assert len(pids) == 2, "the run died before its checkpoint"
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids):  # each rank's parent watch ends it
        assert time.monotonic() < deadline, f"ranks {pids} outlived their killed run"
        time.sleep(0.05)
    assert json.loads((state / "ranks.json").read_text())["world_size"] == 2
    assert sorted(p.name for p in state.iterdir()) == ["rank-00000", "rank-00001", "ranks.json"]

    b2 = _random_batch(seed=2, n=3, lengths=LENGTHS)
    never_stopped = _ranked(model_dir)
    resumed = _ranked(model_dir)
    try:
        never_stopped.step(_random_batch(seed=1, n=3, lengths=LENGTHS))
        resumed.load_state(state)
        assert resumed.version == 1
        a, b = never_stopped.step(b2), resumed.step(b2)
        assert a.metrics["train/loss"] == b.metrics["train/loss"]
        wa, wb = _weights(never_stopped, tmp_path / "a", "lora"), _weights(resumed, tmp_path / "b", "lora")
        assert wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)
    finally:
        never_stopped.close()
        resumed.close()

    one = PolicyTrainer(model_dir, _cfg(), LOSS, seed=0)
    one.setup()
    with pytest.raises(TrainerError, match=r"written by 2 trainer ranks.*one process"):
        one.load_state(state)


def test_a_state_any_rank_refuses_is_loaded_by_none(model_dir: Path, tmp_path: Path) -> None:
    t = _ranked(model_dir)
    try:
        t.save_state(tmp_path)
        before = _weights(t, tmp_path / "before", "lora")
        t.step(_random_batch(seed=1, n=3, lengths=LENGTHS))
        (tmp_path / "rank-00001" / "lora.safetensors").write_bytes(b"torn")
        with pytest.raises(TrainerError, match=r"trainer rank 1 \(cpu\).*lora\.safetensors is corrupt"):
            t.load_state(tmp_path)
        assert t.version == 1  # nothing loaded: rank 0's state was good, and it kept its weights
        after = _weights(t, tmp_path / "after", "lora")
        assert any(not np.array_equal(after[k], before[k]) for k in after)
        meta = json.loads((tmp_path / "ranks.json").read_text())
        (tmp_path / "ranks.json").write_text(json.dumps({**meta, "world_size": 3}))
        with pytest.raises(TrainerError, match=r"written by 3 trainer ranks, this run has 2 \(trainer\.devices\)"):
            t.load_state(tmp_path)
    finally:
        t.close()


def _step_in_thread(t: RankedTrainer, batch: object) -> tuple[threading.Thread, list]:
    out: list = []

    def go() -> None:
        try:
            out.append(t.step(batch))
        except Exception as e:
            out.append(e)

    th = threading.Thread(target=go)
    th.start()
    return th, out


def test_a_rank_killed_mid_step_ends_the_step_naming_it(model_dir: Path) -> None:
    # micro-batches of one row: a step of ~30 passes, long enough to be killed inside
    t = _ranked(model_dir, micro_batch_sequences=1)
    pids = t.pids
    try:
        batch = _random_batch(seed=1, n=8)
        th, out = _step_in_thread(t, batch)
        time.sleep(0.3)
        assert th.is_alive()
        os.kill(pids[1], signal.SIGKILL)
        th.join(30)
        assert not th.is_alive()
        assert isinstance(out[0], TrainerError)
        assert "trainer rank 1 (cpu) died (exit code -9) during step; every rank was stopped" in str(out[0])
        assert all(_gone(p) for p in pids)
        with pytest.raises(TrainerError, match="rank 0"):
            t.step(batch)
    finally:
        t.close()


def test_a_hung_rank_is_named_after_trainer_step_timeout_s(model_dir: Path) -> None:
    t = _ranked(model_dir, micro_batch_sequences=1, step_timeout_s=3.0)
    pids = t.pids
    try:
        t.step(_random_batch(seed=1, n=3))
        os.kill(pids[1], signal.SIGSTOP)  # hangs without dying: rank 0 waits on it in a collective
        t0 = time.monotonic()
        with pytest.raises(TrainerError, match=r"did not answer step within trainer\.step_timeout_s = 3\.0 s "
                                               r"\(rank 0 on cpu: \w+, rank 1 on cpu: stopped\); every rank was killed"):
            t.step(_random_batch(seed=2, n=3))
        assert time.monotonic() - t0 < 10
        assert all(_gone(p) for p in pids)
    finally:
        t.close()


def test_trainer_devices_are_checked() -> None:
    with pytest.raises(ConfigError, match=r'trainer.devices must be all "cpu" \(gloo\) or all "cuda:N"'):
        TrainerConfig(devices=("cpu", "cuda:0"))
    with pytest.raises(ConfigError, match=r"trainer.devices must be each GPU once"):
        TrainerConfig(devices=("cuda:0", "cuda:0"))
    with pytest.raises(ConfigError, match=r"trainer.devices\[1\] must be \"cpu\" or \"cuda:N\""):
        TrainerConfig(devices=("cpu", "gpu1"))
    with pytest.raises(ConfigError, match=r"trainer.devices must be unset with trainer.separate_process = false"):
        TrainerConfig(devices=TWO, separate_process=False)
    with pytest.raises(ConfigError, match=r'trainer.devices must be unset for trainer.kind = "simulated"'):
        TrainerConfig(devices=TWO, kind="simulated")
    assert TrainerConfig(devices=TWO).rank_devices == TWO and TrainerConfig().rank_devices == ("cpu",)


RUN = """
seed = 3
deterministic = true
[model]
cache_dir = "{cache}"
[task]
num_prompts = 32
[sampling]
n = 4
max_new_tokens = 6
[trainer]
devices = {devices}
[pipeline]
steps = 8
batch_groups = 4
max_staleness = 1
checkpoint_every = 3
[log]
level = "info"
progress = false
"""


@pytest.mark.slow
def test_run_py_on_two_ranks_learns_like_one_and_resumes_after_kill_9(tmp_path_factory: pytest.TempPathFactory) -> None:
    """`run.py` with trainer.devices = ["cpu", "cpu"]: the trainer_ranks event, the slowest rank's
    time per step, the one-rank run's rewards and losses at every step; killed with SIGKILL after step 4 and
    resumed, every prompt trained exactly once."""
    cache = tmp_path_factory.getbasetemp() / "model-cache"
    tmp = tmp_path_factory.mktemp("ranks")
    rows = {}
    for name, devices in (("one", "[]"), ("two", '["cpu", "cpu"]')):
        (tmp / f"{name}.toml").write_text(RUN.format(cache=cache, devices=devices))
        out = tmp / name
        done = run_py("--config", str(tmp / f"{name}.toml"), "--out", str(out))
        assert done.returncode == 0, done.stderr[-3000:]
        rows[name] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # deterministic runs: the same groups sampled, so the same rewards at every step while the weights agree
    assert [r["reward_mean"] for r in rows["two"]] == [r["reward_mean"] for r in rows["one"]]
    assert [r["train/loss"] for r in rows["two"]] == pytest.approx([r["train/loss"] for r in rows["one"]],
                                                                   rel=1e-3, abs=1e-6)
    assert all(r["train/rank_step_max_s"] > 0 for r in rows["two"])
    events = [json.loads(line) for line in (tmp / "two" / "events.jsonl").read_text().splitlines()]
    ranks = [e for e in events if e.get("event") == "trainer_ranks"]
    assert ranks and ranks[0]["world_size"] == 2 and ranks[0]["devices"] == ["cpu", "cpu"]
    ready = {e["rank"]: e["process"] for e in events if e.get("event") == "trainer_rank_ready"}
    assert ready == {0: "trainer", 1: "trainer-rank-1"}  # each rank's events in the run's, named

    out = tmp / "killed"
    first = run_py("--config", str(tmp / "two.toml"), "--out", str(out), crash="step.after_train:4")
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    resumed = run_py("--resume", str(out))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    check_finished_run(out, 4, 8, 1)


def test_a_rank_started_by_torchrun_elsewhere_joins_at_the_rendezvous(model_dir: Path, tmp_path: Path) -> None:
    """trainer.remote_ranks: rank 1 is started as on another host, with the documented torchrun
    command; the two ranks take the one-process step, and closing the trainer ends that rank."""
    from pipeline.engines.vllm_launch import free_port

    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    batch = _random_batch(seed=1, n=3, lengths=LENGTHS)
    one = PolicyTrainer(model_dir, _cfg(), LOSS, seed=0)
    one.setup()
    expected = one.step(batch)
    t = RankedTrainer(model_dir, _cfg(devices=("cpu",), remote_ranks=1, rendezvous=rendezvous), LOSS, seed=0)
    ready = threading.Thread(target=t.setup)
    ready.start()  # rank 0 waits at the rendezvous for rank 1
    remote = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m",
         "pipeline.trainer.ranks", "--rendezvous", rendezvous, "--first-rank", "1", "--world-size", "2",
         "--device", "cpu"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ready.join(120)
        assert not ready.is_alive() and t.version == 0, "the remote rank did not join"
        got = t.step(batch)
        assert got.metrics["train/loss"] == pytest.approx(expected.metrics["train/loss"], rel=1e-5)
        assert got.metrics["train/sequences"] == 9
        t.close()
        assert remote.wait(30) == 0, remote.communicate()[0][-3000:]
    finally:
        t.close()
        if remote.poll() is None:
            remote.kill()
        log = remote.communicate()[0]
    assert "trainer_rank_joining" in log and "trainer_rank_ready" in log, log[-3000:]


def test_remote_ranks_need_a_tcp_rendezvous_and_local_ranks_none() -> None:
    with pytest.raises(ConfigError, match=r'trainer.rendezvous must be "tcp://HOST:PORT"'):
        TrainerConfig(devices=("cpu",), remote_ranks=1)
    with pytest.raises(ConfigError, match=r"trainer.devices must be set when trainer.remote_ranks is"):
        TrainerConfig(remote_ranks=1, rendezvous="tcp://h:1")
    with pytest.raises(ConfigError, match=r"trainer.rendezvous must be unset without trainer.remote_ranks"):
        TrainerConfig(devices=TWO, rendezvous="tcp://h:1")
    assert TrainerConfig(devices=("cuda:0",), remote_ranks=4, rendezvous="tcp://10.0.0.1:29500").remote_ranks == 4


def _listening(pid: int) -> list[str]:
    """The local addresses process `pid` listens on (TCP, IPv4 and IPv6), as /proc shows them."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                found.append(f[1])
    return found


LOOPBACK = ("0100007F:", "00000000000000000000000001000000:")  # 127.0.0.1 and ::1, as /proc writes them


def test_ranks_of_one_host_listen_on_the_loopback_interface_only(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What docs/fault-tolerance.md#security states: ranks on one host meet through a file, and
    gloo's connections between them accept on 127.0.0.1 alone (no store, no other interface),
    even where the environment names another interface (a cluster's setting)."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    t = _ranked(model_dir)
    try:
        t.step(_random_batch(seed=1, n=3))
        addresses = [a for pid in t.pids for a in _listening(pid)]
        assert addresses, "gloo's pairs listen somewhere: the check must see them"
        assert all(a.startswith(LOOPBACK) for a in addresses), addresses
    finally:
        t.close()
