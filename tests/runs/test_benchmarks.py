"""The benchmark scripts' --quick modes: they run, and their JSON holds sane figures and the hardware.

Each script is loaded from benchmarks/ and its `main(argv)` run in this process (the TRL one in
a subprocess, marked slow, skipped without TRL). Figures are checked for sense, not speed,
except the simulated balanced sweep, whose overlap at max_staleness=1 must show (> 1.3x).
"""

from __future__ import annotations

import importlib
import json
import math
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from conftest import REPO, load_script

BENCH = REPO / "benchmarks"
HARDWARE_KEYS = {"cpu_model", "cpu_cores", "gpus", "versions", "loadavg_1m"}


def load(name: str) -> ModuleType:
    return load_script(BENCH / f"{name}.py", f"bench_{name}")


def load_part(name: str) -> ModuleType:
    """A module of benchmarks/staleness/, the sweep's parts, imported as the sweep script imports it."""
    load("throughput_vs_staleness")  # puts benchmarks/ on sys.path, as running the script does
    return importlib.import_module(f"staleness.{name}")


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def read_json(path: str) -> dict:
    data = json.loads(Path(path).read_text())
    assert HARDWARE_KEYS <= set(data["hardware"]), data["hardware"]
    assert data["hardware"]["versions"]["torch"]
    assert data["settings"] and data["printed"]
    return data


@pytest.mark.parametrize("name", ["throughput_vs_staleness", "overhead", "vs_trl"])
def test_every_script_has_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        load(name).parse_args(["--help"])
    assert e.value.code == 0
    assert "--quick" in capsys.readouterr().out


def test_every_probe_imports_and_has_help() -> None:
    # probes run only on a GPU: here, at least their imports (vLLM's come later, inside them) hold;
    # one interpreter runs each probe's --help in turn (torch is imported once, not per probe)
    probes = sorted(str(p) for p in (BENCH / "probes").glob("*.py"))
    code = ("import runpy, sys\n"
            "for path in sys.argv[1:]:\n"
            "    sys.argv = [path, '--help']\n"
            "    try:\n"
            "        runpy.run_path(path, run_name='__main__')\n"
            "    except SystemExit as e:\n"
            "        print('exit', e.code, path, flush=True)\n")
    done = subprocess.run([sys.executable, "-c", code, *probes], capture_output=True, text=True, timeout=180, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [line for line in done.stdout.splitlines() if line.startswith("exit ")] == [f"exit 0 {p}" for p in probes]
    assert done.stdout.count("usage:") == len(probes) >= 3


def test_machine_load_counts_a_finished_child_process_as_the_benchmarks_own() -> None:
    # a trainer process of a finished run is the benchmark's own work, not "other processes"
    common = load("common")
    meter = common.MachineLoad()
    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\n"
                    "while time.process_time() - t < 1.0: pass"], check=True)
    assert meter.own_cpu_s() >= 0.9  # the child's second is ours (before: counted as other processes)


def test_sweep_set_overrides_reach_every_runs_config_and_bad_ones_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tvs = load("throughput_vs_staleness")
    args = tvs.parse_args(["--set", "pipeline.switch_interval_ms=0.5", "--set", "trainer.sched_idle=true"])
    cfg = tvs.SimWorkload(args, 1.0).config(2, tmp_path)
    assert (cfg.pipeline.switch_interval_ms, cfg.trainer.sched_idle, cfg.pipeline.max_staleness) == (0.5, True, 2)
    with pytest.raises(SystemExit):
        tvs.parse_args(["--set", "trainer.nice=99"])
    assert "--set: trainer.nice must be in [0, 19], got 99" in capsys.readouterr().err


def test_simulated_balanced_sweep_overlaps_generation_and_training(tmp_path: Path) -> None:
    tvs = load("throughput_vs_staleness")
    [rec] = tvs.main(["--quick", "--ratios", "1", "--staleness", "0,1", "--out", str(tmp_path)])
    data = read_json(rec["files"]["json"])
    assert Path(rec["files"]["png"]).stat().st_size > 10_000
    assert "sim_balanced" in Path(rec["files"]["json"]).name and "_step" not in Path(rec["files"]["json"]).name
    st = data["standalone"]
    assert st["t_gen_s"] > 0 and st["t_train_s"] >= st["t_train_step_s"] > 0
    assert 1.0 <= st["ideal_speedup"] <= 2.0
    # the idle loop's own lag, 1 s of a 10 ms timer: the floor printed under the lag column
    idle = st["idle_loop_lag"]
    assert 50 <= idle["samples"] <= 100 and 0 <= idle["p50_ms"] <= idle["p99_ms"] <= idle["max_ms"]
    assert "the floor under the lag column" in data["printed"]
    assert math.isclose(st["ideal_speedup"], (st["t_gen_s"] + st["t_train_s"]) / max(st["t_gen_s"], st["t_train_s"]))
    # the simulated generator is shaped as asked: B groups take one latency, 2B take two
    c = data["checks"]
    assert 0.9 < c["batch_s_over_latency_s"] < 1.5 and 1.7 < c["two_batches_over_one"] < 2.5
    k0, k1 = data["results"]
    assert (k0["max_staleness"], k1["max_staleness"]) == (0, 1)
    assert k0["speedup"] == 1.0 and k1["speedup"] > 1.3, k1
    assert k1["ideal"] == st["ideal_speedup"]
    for r in data["results"]:
        assert r["accounting_ok"] and r["steps"] == data["settings"]["steps"]
        assert r["staleness_max"] <= r["max_staleness"]
        assert sum(r["staleness_hist"].values()) == r["steps"] * data["settings"]["batch_groups"]
        assert 0 < r["busy_generator"] <= 1.0 and 0 < r["busy_trainer"] <= 1.0
        # the generator's fraction stops at the last generation: the last step trains after it
        assert r["window_s"] - r["generator_window_s"] >= 0.5 * st["t_train_step_s"]
        # its idle time, gap by gap, is the rest of that window, every second put down to one cause
        idle = r["generator_idle"]
        assert idle["idle_s"] == pytest.approx((1 - r["busy_generator"]) * r["generator_window_s"], abs=1e-6)
        assert idle["idle_s"] == pytest.approx(idle["nothing_admitted_s"] + idle["admitted_not_started_s"]
                                               + idle["started_not_running_s"])
        assert min(idle["nothing_admitted_s"], idle["admitted_not_started_s"], idle["started_not_running_s"]) >= -1e-9
        assert r["groups_per_s"] > 0 and r["tokens_per_s"] > r["groups_per_s"]
        assert r["loop_lag_p99_ms"] >= 0 and r["publish_to_loaded_ms_mean"] > 0
        # the engines held at least a wave at a time, never more than the staleness bound lets live
        B = data["settings"]["batch_groups"]
        assert 0.5 * B <= r["gen_depth_groups"] <= (r["max_staleness"] + 1) * B
        # every group ran at the simulated engine's own speed
        assert 0.8 < r["gen_kept_of_standalone"] < 1.25
    assert k0["staleness_max"] == 0 and k1["staleness_mean"] > 0
    # at K = 0 a version's groups start only once it serves: none is published while an engine generates
    assert k0["versions_published_generating"] == 0 and k0["publish_to_loaded_idle_ms_p50"] > 0
    assert k0["publish_to_loaded_generating_ms_p50"] is None


def test_publish_to_serving_under_load_takes_the_versions_published_while_an_engine_generated() -> None:
    analysis = load_part("analysis")
    published = {1: 1.0, 2: 3.0, 3: 5.0, 4: 7.0}
    to_loaded = {1: 0.05, 2: 0.2, 3: 0.1}  # version 4 never served: left out
    # two engines, intervals overlapping; version 2 comes just after one ends, and is served as the next
    # begins: published to idle engines
    busy = [(4.0, 5.5), (0.5, 1.5), (5.2, 6.0), (2.0, 2.9), (3.1, 3.5)]
    r = analysis.under_load(published, to_loaded, busy)
    assert r["versions_published_generating"] == 2 and r["published_generating"] == [1, 3]
    assert r["publish_to_loaded_ms_by_version"] == {1: 50.0, 2: 200.0, 3: 100.0}
    assert r["publish_to_loaded_generating_ms_p50"] == pytest.approx(75.0)  # versions 1 and 3
    assert r["publish_to_loaded_idle_ms_p50"] == pytest.approx(200.0) == r["publish_to_loaded_idle_ms_p99"]
    none = analysis.under_load(published, to_loaded, [])
    assert none["versions_published_generating"] == 0 and none["publish_to_loaded_generating_ms_p99"] is None


def test_a_sweep_cut_off_after_its_first_k_keeps_that_k(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a device call's time limit ends a sweep mid-way: what it measured before is on disk
    tvs = load("throughput_vs_staleness")
    real = tvs.run_one

    async def cut_at_second(w, K, scratch):  # noqa: ANN001, ANN202
        if K == 1:
            raise KeyboardInterrupt("the call's time is up")
        return await real(w, K, scratch)

    monkeypatch.setattr(tvs, "run_one", cut_at_second)
    with pytest.raises(KeyboardInterrupt):
        tvs.main(["--quick", "--ratios", "1", "--staleness", "0,1", "--out", str(tmp_path)])
    [partial] = tmp_path.glob("throughput_vs_staleness_sim_balanced_*.partial.json")
    data = json.loads(partial.read_text())
    assert data["hardware"]["versions"]["torch"] and data["partial"] and data["settings"]["staleness"] == [0, 1]
    [k0] = data["results"]
    assert k0["max_staleness"] == 0 and k0["accounting_ok"] and k0["groups_per_s"] > 0
    assert data["standalone"]["t_gen_s"] > 0
    # a sweep that ends keeps its whole record alone
    monkeypatch.setattr(tvs, "run_one", real)
    [rec] = tvs.main(["--quick", "--ratios", "1", "--staleness", "0", "--out", str(tmp_path)])
    assert Path(rec["files"]["json"]).exists() and not partial.exists()


def test_simulated_sweep_at_another_step_time_is_named_for_it(tmp_path: Path) -> None:
    tvs = load("throughput_vs_staleness")
    [rec] = tvs.main(["--quick", "--ratios", "1", "--staleness", "0", "--train-step-s", "0.03", "--out", str(tmp_path)])
    assert Path(rec["files"]["json"]).name.startswith("throughput_vs_staleness_sim_balanced_step0.03s_")
    assert read_json(rec["files"]["json"])["standalone"]["t_train_step_s"] == pytest.approx(0.03, rel=0.5)


def test_generator_idle_puts_each_idle_second_down_to_what_the_groups_were_doing() -> None:
    analysis = load_part("analysis")
    nan = float("nan")
    # busy 1-2 and 3-4 in a window 0-5; group a: admitted 0.5, started 0.8, generated until 2;
    # group b: admitted and started at 2.5 (waits for its adapter until 3); c never generated
    admitted, started, ended = (np.array(x) for x in ([0.5, 2.5, 0.1], [0.8, 2.5, nan], [2.0, 4.0, nan]))
    idle = analysis.generator_idle([(3.0, 4.0), (1.0, 2.0)], admitted, started, ended, 0.0, 5.0)
    assert idle["gaps"] == 3 and idle["idle_s"] == pytest.approx(3.0)
    assert idle["admitted_not_started_s"] == pytest.approx(0.3)  # a: 0.5-0.8
    assert idle["started_not_running_s"] == pytest.approx(0.2 + 0.5)  # a: 0.8-1, b: 2.5-3
    assert idle["nothing_admitted_s"] == pytest.approx(0.5 + 0.5 + 1.0)  # 0-0.5, 2-2.5, 4-5
    # busy throughout: nothing idle
    assert analysis.generator_idle([(0.0, 5.0)], admitted, started, ended, 0.0, 5.0)["idle_s"] == 0.0


def test_mean_depth_is_groups_held_per_second_of_holding_any() -> None:
    analysis = load_part("analysis")
    nan = float("nan")
    # in the window 0-10: a holds 1-5, b 3-5, c 8-9 (and before the window), d never generated
    started, ended = np.array([1.0, 3.0, -2.0, nan]), np.array([5.0, 5.0, 9.0, nan])
    # held: 4 + 2 + 9 group-seconds (c clipped to 0-9); some group was held during 0-9 (c spans
    # a and b), 9 s
    assert analysis.mean_depth(started, ended, 0.0, 10.0) == pytest.approx((4 + 2 + 9) / 9)
    # without c: 6 group-seconds over 4 s held
    assert analysis.mean_depth(started[:2], ended[:2], 0.0, 10.0) == pytest.approx(6 / 4)
    assert analysis.mean_depth(started[3:], ended[3:], 0.0, 10.0) is None


def test_full_weight_sweep_reports_the_drain(tmp_path: Path) -> None:
    """--update full: engines hold one version, so every load waits for what is in flight."""
    tvs = load("throughput_vs_staleness")
    [rec] = tvs.main(["--quick", "--ratios", "1", "--staleness", "0,2", "--update", "full", "--out", str(tmp_path)])
    assert "sim_balanced_full_" in Path(rec["files"]["json"]).name
    data = read_json(rec["files"]["json"])
    by_k = {r["max_staleness"]: r for r in data["results"]}
    assert all(r["accounting_ok"] and r["drain_ms_mean"] is not None for r in by_k.values())
    # with K=2 a whole batch is in flight when a version is published: the drain waits for it
    assert by_k[2]["drain_ms_mean"] > by_k[0]["drain_ms_mean"]
    assert "drain ms" in data["printed"]


def test_transformers_sweep_reports_reward_at_equal_samples(tmp_path: Path, model_cache: Path) -> None:
    tvs = load("throughput_vs_staleness")
    [rec] = tvs.main(["--quick", "--engine", "transformers", "--out", str(tmp_path), "--model-cache",
                      str(model_cache), "--repeats", "1"])
    data = read_json(rec["files"]["json"])
    assert data["standalone"]["gen_tokens_per_s"] > 0
    samples = {r["samples"] for r in data["results"]}
    assert len(samples) == 1  # every K trained the same number of samples
    for r in data["results"]:
        assert 0.0 <= r["reward_final"] <= 1.0 and len(r["reward_curve"]) == r["steps"]
        assert r["gen_kept_of_standalone"] > 0


def test_vllm_sweep_refuses_clearly_without_vllm_or_gpus() -> None:
    tvs = load("throughput_vs_staleness")
    if tvs.vllm_missing("cuda:0", "cuda:1") is None:
        pytest.skip("vLLM and two GPUs are here: the refusal cannot be shown")
    with pytest.raises(SystemExit, match="--engine vllm cannot run here: .*(vLLM|GPU|device)"):
        tvs.main(["--engine", "vllm", "--quick"])


class StandInVLLM:
    """The VLLMEngine API the sweep uses, over the simulated engine (no GPU): adapters by name."""

    instances: list["StandInVLLM"] = []

    def __init__(self, model_path, *, sampling, cfg, device, max_staleness, name, seed, full_weights=False) -> None:
        assert not full_weights, "the sweep's default is LoRA"
        from pipeline.config.schema import SimulatedEngineConfig
        from pipeline.engines.simulated import SimulatedEngine

        self.sim = SimulatedEngine(SimulatedEngineConfig(latency_s=0.002, completion_tokens=sampling.max_new_tokens),
                                   seed=seed, name=name)
        self.name, self.busy, self.max_loras = name, self.sim.busy, max_staleness + 2
        self.graph_batch_max = 0  # no CUDA graphs in a stand-in
        self.cfg = cfg
        self.max_context = cfg.max_model_len
        self.adapters: dict[str, str | None] = {}  # name -> directory
        self.closed = 0
        StandInVLLM.instances.append(self)

    @property
    def loaded_adapters(self) -> tuple[str, ...]:
        return tuple(self.adapters)

    async def start(self) -> None:
        return None

    async def load_adapter(self, adapter) -> None:
        if adapter.version == 0:
            return
        if self.adapters.get(adapter.name, adapter.path) != adapter.path:  # VLLMEngine refuses this too
            raise ValueError(f"adapter name {adapter.name} loaded from another directory")
        if not (Path(adapter.path) / "adapter_config.json").is_file():
            raise FileNotFoundError(f"no adapter_config.json in {adapter.path}")
        self.adapters[adapter.name] = adapter.path

    async def unload_adapter(self, adapter) -> None:
        self.adapters.pop(adapter.name, None)

    async def generate(self, request, adapter):
        await self.load_adapter(adapter)
        return await self.sim.generate(request, adapter)

    async def standalone_throughput(self, prompts, n, max_new_tokens, adapters=()) -> dict:
        import asyncio
        import time

        from pipeline.types import AdapterRef, GroupRequest, Prompt

        on = list(adapters) or [AdapterRef.base()]
        t0 = time.monotonic()
        gens = await asyncio.gather(*(self.generate(GroupRequest(i, Prompt(str(i), "", tuple(p)), n, max_new_tokens),
                                                    on[i % len(on)]) for i, p in enumerate(prompts)))
        seconds = time.monotonic() - t0
        tokens = sum(g.num_tokens for g in gens)
        return {"groups": len(gens), "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}

    async def close(self) -> None:
        self.closed += 1


def test_vllm_depth_measures_every_setting_and_depth_on_the_adapters(tmp_path: Path, model_cache: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # benchmarks/vllm_depth.py's plumbing with a stand-in engine: one engine per setting, each
    # closed; the adapters are real peft directories, all loaded; every depth sampled twice
    depth = load("vllm_depth")
    StandInVLLM.instances.clear()
    monkeypatch.setattr(depth, "VLLMEngine", StandInVLLM)
    args = depth.parse_args(["--settings", "64:0,32:16:nocompile", "--groups", "2,3", "--group-size", "2", "--max-new-tokens",
                             "4", "--adapters", "2", "--lora-rank", "8", "--model-shape", "tiny", "--model-cache",
                             str(model_cache), "--device", "cpu", "--out", str(tmp_path)])
    depth.common.run_async(depth.main(args))
    [path] = tmp_path.glob("vllm_depth_tiny_*.json")
    assert sorted(x.name for x in tmp_path.iterdir()) == [path.name]  # results only: no adapters in --out
    data = read_json(path)
    assert list(data["settings"]) == ["64:0", "32:16:nocompile"] and data["hardware"]["cpu_cores"] >= 1
    assert [e.cfg.torch_compile for e in StandInVLLM.instances] == [True, False]  # the engine was built so
    for engine, row in zip(StandInVLLM.instances, data["settings"].values(), strict=True):
        assert engine.closed == 1 and sorted(engine.adapters) == ["depth-probe-1", "depth-probe-2"]
        # loaded from real directories (the stand-in checks), scratch beside the model, removed at the end
        assert all(Path(p).is_relative_to(model_cache) and not Path(p).exists() for p in engine.adapters.values())
        for kind in ("base", "adapters"):
            assert {g: r["tokens"] for g, r in row[kind].items()} == {"2": 2 * 2 * 4, "3": 3 * 2 * 4}
            assert all(r["tokens_per_s"] > 0 for r in row[kind].values())
    assert [(r["max_num_seqs"], r["max_cudagraph_capture_size"], r["torch_compile"]) for r in data["settings"].values()] \
        == [(64, 0, True), (32, 16, False)]
    with pytest.raises(SystemExit, match="only ':nocompile' may follow"):
        depth.parse_setting("64:0:eager")


def stand_in_sweep(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The sweep script with StandInVLLM in place of vLLM (no GPU)."""
    import torch

    import pipeline.engines.vllm

    tvs = load("throughput_vs_staleness")
    StandInVLLM.instances.clear()
    monkeypatch.setattr(pipeline.engines.vllm, "VLLMEngine", StandInVLLM)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)  # the config names "cuda:0"; nothing uses it
    monkeypatch.setattr(tvs, "vllm_missing", lambda *a: None)
    return tvs


def stand_in_argv(tmp_path: Path, model_cache: Path, *extra: str) -> list[str]:
    """A short --engine vllm sweep of the tiny model (K = 0 and 1), its LoRA trainer on the CPU."""
    return ["--engine", "vllm", "--quick", "--model-shape", "tiny", "--trainer-device", "cpu", "--trainer-dtype",
            "float32", "--steps", "4", "--batch-groups", "2", "--group-size", "4", "--max-new-tokens", "8",
            "--repeats", "1", "--out", str(tmp_path), "--model-cache", str(model_cache), *extra]


def test_vllm_sweep_shares_one_engine_and_leaves_it_clean(tmp_path: Path, model_cache: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # the vLLM path's plumbing with a stand-in engine: one engine for every run, never closed by a
    # Pipeline, no adapter of one run left loaded for the next, the standalone rate from its own API
    tvs = stand_in_sweep(monkeypatch)
    loaded_after_runs: list[tuple[str, ...]] = []
    after_run = tvs.VLLMWorkload.after_run

    async def spy(self) -> None:
        await after_run(self)
        loaded_after_runs.append(self.engine.loaded_adapters)

    monkeypatch.setattr(tvs.VLLMWorkload, "after_run", spy)
    [rec] = tvs.main(stand_in_argv(tmp_path, model_cache))
    [engine] = StandInVLLM.instances
    # after each K's measurement of the engine alone, and after each run
    assert engine.closed == 1 and loaded_after_runs == [(), (), (), ()]
    data = read_json(rec["files"]["json"])
    assert data["settings"]["max_loras"] == 1 + 2  # sized for the sweep's largest K
    by_depth = data["standalone"]["standalone_by_depth"]
    for r in data["results"]:
        K = r["max_staleness"]
        assert r["gen_kept_of_standalone"] > 0 and r["accounting_ok"]
        assert f"max_staleness={K}: generation inside the pipeline keeps" in data["printed"]
        # the engine alone under run K's load: (K + 1) * B groups on K + 1 of the trainer's versions
        depth = by_depth[str(K)]
        assert (depth["groups"], depth["adapters"], len(depth["tokens_per_s_all"])) == ((K + 1) * 2, K + 1, 1)
        assert r["gen_kept_of_standalone_same_depth"] == pytest.approx(r["gen_tokens_per_busy_s"]
                                                                       / depth["tokens_per_s"])


def test_replay_trainer_publishes_the_templates_files_as_every_version(tmp_path: Path) -> None:
    from pipeline.store.weights import MANIFEST, AdapterStore
    from pipeline.types import Batch

    workloads = load_part("workloads")
    template = tmp_path / "v3"
    template.mkdir()
    (template / "adapter_config.json").write_text('{"r": 16}')
    (template / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 64)
    (template / MANIFEST).write_text("{}")  # the template's own manifest is the store's, not copied
    trainer = workloads.ReplayTrainer(0.0, template)
    store = AdapterStore(tmp_path / "store")
    refs = []
    for step in (1, 2):
        stats = trainer.step(Batch(step=step, version=trainer.version, groups=()))
        refs.append(store.publish(stats.version, trainer.save_adapter))
    assert [r.version for r in refs] == [1, 2]
    for ref in refs:
        out = Path(ref.path)
        assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors", MANIFEST]
        assert (out / "adapter_model.safetensors").read_bytes() == (template / "adapter_model.safetensors").read_bytes()
        store.verify_dir(out)


def test_vllm_sweep_with_the_simulated_trainer_replays_the_real_trainers_step_and_adapter(
        tmp_path: Path, model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # --trainer sim: the real trainer is timed, then every run's trainer sleeps its step and
    # publishes its adapter; the engine loads those real files, and no reward is claimed
    tvs = stand_in_sweep(monkeypatch)
    loaded: dict[str, bytes] = {}  # path -> weights, read as the engine loads them (runs prune old versions)
    load_adapter = StandInVLLM.load_adapter

    async def spy(self, adapter) -> None:
        await load_adapter(self, adapter)
        if adapter.version:
            loaded[adapter.path] = (Path(adapter.path) / "adapter_model.safetensors").read_bytes()

    monkeypatch.setattr(StandInVLLM, "load_adapter", spy)
    [rec] = tvs.main(stand_in_argv(tmp_path, model_cache, "--trainer", "sim", "--keep-runs", str(tmp_path / "runs")))
    assert "_simtrainer_" in Path(rec["files"]["json"]).name
    data = read_json(rec["files"]["json"])
    st, settings = data["standalone"], data["settings"]
    assert settings["trainer"] == "sim" and settings["replayed_step_s"] == pytest.approx(st["t_train_step_s"])
    assert "trainer simulated" in data["printed"] and "reward" not in data["table"]
    # the engine alone was measured on versions the real trainer published; the runs load copies of its newest
    trained = {p: w for p, w in loaded.items() if "/standalone/store/" in p}
    in_runs = {p: w for p, w in loaded.items() if "/K0/" in p or "/K1/" in p}
    assert trained and len(in_runs) >= 2 * 3 and len(trained) + len(in_runs) == len(loaded)
    newest = max(trained, key=lambda p: Path(p).name)
    assert all(w == trained[newest] for w in in_runs.values())
    for r in data["results"]:
        assert r["accounting_ok"] and r["logprob_check"] == {} and "reward_final" not in r
        cfg = tomllib.loads((tmp_path / "runs" / "vllm-tiny" / f"K{r['max_staleness']}" / "config.toml").read_text())
        assert cfg["trainer"]["kind"] == "simulated" and cfg["trainer"]["step_s"] == pytest.approx(st["t_train_step_s"])


def test_vllm_sweeps_simulated_trainer_sleeps_a_step_it_is_given(tmp_path: Path, model_cache: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """--replay-step-s: the stand-in sleeps the step given (the run's config says so), not the real
    trainer's; the file says so in its name, and a value without --trainer sim is refused."""
    tvs = stand_in_sweep(monkeypatch)
    [rec] = tvs.main(stand_in_argv(tmp_path, model_cache, "--trainer", "sim", "--replay-step-s", "0.0123",
                                   "--keep-runs", str(tmp_path / "runs")))
    assert "_simtrainer_replay0.0123s_" in Path(rec["files"]["json"]).name
    data = read_json(rec["files"]["json"])
    assert data["settings"]["replayed_step_s"] == 0.0123 != data["standalone"]["t_train_step_s"]
    for r in data["results"]:
        cfg = tomllib.loads((tmp_path / "runs" / "vllm-tiny" / f"K{r['max_staleness']}" / "config.toml").read_text())
        assert cfg["trainer"]["step_s"] == 0.0123
    with pytest.raises(SystemExit):
        tvs.parse_args(["--engine", "vllm", "--replay-step-s", "0.5"])  # the real trainer: nothing to replay


@pytest.mark.skipif(not Path("/proc/self/mounts").exists(), reason="reads Linux's mount table")
def test_filesystem_names_the_mount_holding_a_path(tmp_path: Path) -> None:
    common = load("common")
    assert common.filesystem("/proc/self") == "proc"
    assert common.filesystem(tmp_path) == common.filesystem(tmp_path / "not" / "there")
    assert common.filesystem(tmp_path) not in ("unknown", "proc")


def test_overhead_reports_rates_costs_and_a_profile(tmp_path: Path) -> None:
    ov = load("overhead")
    runs = tmp_path / "runs"
    runs.mkdir()
    rec = ov.main(["--quick", "--cpus", "0", "--group-sizes", "1,8", "--groups", "640", "--batch-groups", "32",
                   "--large-batch-groups", "64", "--repeats", "2", "--out", str(tmp_path), "--dir", str(runs)])
    data = read_json(rec["files"]["json"])
    fs = load("common").filesystem(runs)
    assert data["hardware"]["run_filesystem"] == fs and f"runs on {fs}" in data["printed"]
    assert data["settings"]["dir"] == str(runs) and list(runs.iterdir()) == []  # nothing left behind
    assert [r["group_size"] for r in data["results"]] == [1, 8]
    assert [(r["batch_groups"], r["reward"]) for r in data["variants"]] == [
        (8, "sync (thread)"), (32, "async"), (64, "sync (thread)")]  # small B, async reward, large B
    assert data["target_n8_met_large_batch"] == (data["variants"][2]["groups_per_s"] >= 20_000)
    for r in data["results"] + data["variants"]:
        assert r["groups_per_s"] > 0 and r["cpu_us_per_group"] > 0
        # the figures are those of the median run of the two (the lower one of two)
        assert len(r["repeats_groups_per_s"]) == 2 and r["groups_per_s"] == min(r["repeats_groups_per_s"])
        assert r["loop_thread_cpu_us_per_group"] <= r["cpu_us_per_group"] * 1.05
        assert math.isclose(r["groups_per_s"] * r["us_per_group_wall"], 1e6, rel_tol=1e-6)
    assert data["target_n8_met"] == (data["results"][1]["groups_per_s"] >= 20_000)
    for r, c in zip(data["results"], data["components"]):
        assert c["group_size"] == r["group_size"]
        assert 0 < c["engine_generate_cpu_us"] < r["cpu_us_per_group"]
        own = r["cpu_us_per_group"] - c["engine_generate_cpu_us"]
        assert r["cpu_us_per_group_without_engine"] == pytest.approx(own)
        assert c["log_append_cpu_us"] > 0 and c["log_flush_cpu_us"] > 0 and c["reward_async_cpu_us"] > 0
    sc = data["step_components"]
    assert sc["versions"] == 20 and all(sc[f"{w}_cpu_us"] > 0 and sc[f"{w}_wall_us"] > 0
                                        for w in ("publish", "verify", "prune"))
    assert "of a step, the adapter store's work alone" in data["printed"]
    prof = data["profile_n8"]
    assert prof["top_own_time"] and all("(" in e["function"] for e in prof["top_own_time"])
    assert any(e["function"].startswith("pipeline/") for e in prof["pipeline_cumulative"])
    shares = [m["share"] for m in prof["own_time_by_module"]]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1.0 + 1e-9


def test_checkpoint_stall_times_both_ways_and_the_write_behind_completes(tmp_path: Path) -> None:
    data = read_json(str(load("checkpoint_stall").main(["--shape", "tiny", "--repeats", "2", "--tokens", "8",
                                                         "--out", str(tmp_path), "--scratch", str(tmp_path)])))
    assert len(data["rounds"]) == 2
    for r in data["rounds"]:
        assert r["state_bytes"] > 0 and r["waited_s"] > 0 and r["step_alone_s"] > 0
        assert 0 < r["copied_s"] < r["behind_s"]  # the loop waits for the copy; the files come later
    for k in ("waited_s", "copied_s", "behind_s"):
        assert data["median"][k] == pytest.approx(sum(r[k] for r in data["rounds"]) / 2)  # the median of two
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == []  # the model and states went with the scratch


def test_vs_trl_our_side_alone(tmp_path: Path, model_cache: Path) -> None:
    vt = load("vs_trl")
    rec = vt.main(["--quick", "--skip-trl", "--out", str(tmp_path), "--model-cache", str(model_cache)])
    data = read_json(rec["files"]["json"])
    assert [s["system"] for s in data["summary"]] == ["pipeline K=0", "pipeline K=2"]
    for s in data["summary"]:
        assert s["samples"] == 3 * 2 * 4  # --quick: 3 steps of 2 prompts x 4 completions
        assert s["samples_per_s"]["mean"] > 0 and 0.0 <= s["reward_final"]["mean"] <= 1.0


def test_vs_trl_micro_workload_and_full_weights(tmp_path: Path, model_cache: Path) -> None:
    vt = load("vs_trl")
    micro = vt.parse_args(["--workload", "micro"])
    assert (micro.steps, micro.batch_groups * micro.group_size, micro.max_new_tokens, micro.lora_rank) == (60, 64, 8, 16)
    assert vt.parse_args([]).lora_rank == 8 and vt.parse_args(["--workload", "micro", "--lora-rank", "4"]).lora_rank == 4
    rec = vt.main(["--quick", "--skip-trl", "--update", "full", "--staleness", "0", "--out", str(tmp_path),
                   "--model-cache", str(model_cache)])
    assert Path(rec["files"]["json"]).name.startswith("vs_trl_default_full_tiny_")
    assert [r["update"] for r in rec["runs"]] == ["full"] and "full weights" in rec["printed"]


@pytest.mark.slow
def test_vs_trl_runs_trl_and_ours_on_equal_samples(tmp_path: Path, model_cache: Path) -> None:
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    proc = subprocess.run([sys.executable, str(BENCH / "vs_trl.py"), "--quick", "--out", str(tmp_path),
                           "--model-cache", str(model_cache)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [path] = tmp_path.glob("vs_trl_*.json")
    data = read_json(str(path))
    systems = {s["system"]: s for s in data["summary"]}
    assert set(systems) == {"trl", "pipeline K=0", "pipeline K=2"}
    assert len({s["samples"] for s in systems.values()}) == 1
    assert data["trl"]["beta"] == 0.0 and data["trl"]["top_k"] == 0 and data["trl"]["num_iterations"] == 1
    assert data["trl"]["gradient_checkpointing"] is False and data["trl"]["bf16"] is False
    assert set(data["ratios"]) == {"pipeline K=0", "pipeline K=2"}
    for run in data["runs"]:
        assert run["samples_per_s"] > 0 and len(run["reward_curve"]) == data["settings"]["steps"]


def test_episode_latency_shows_k1_hiding_environment_latency(tmp_path: Path) -> None:
    """benchmarks/episode_latency.py: with 50 ms environment steps, K = 1 trains faster than K = 0
    (the next steps' episodes run while the trainer trains), within the trainer bound."""
    bench = load("episode_latency")
    bench.main(["--quick", "--latencies", "0.05", "--ks", "0,1", "--out", str(tmp_path),
                "--scratch", str(tmp_path / "runs")])
    data = json.loads(next(tmp_path.glob("episode_latency_sim_*.json")).read_text())
    k0, k1 = data["runs"]
    assert (k0["K"], k1["K"]) == (0, 1) and k0["accounting_ok"] and k1["accounting_ok"]
    assert k1["staleness_max"] <= 1 and k1["env_steps"] > 0
    assert k1["speedup_vs_K0"] > 1.3 and k1["of_bound"] <= 1.05, data["runs"]


def test_staleness_learning_pairs_seeds_across_arms(tmp_path: Path) -> None:
    """benchmarks/staleness_learning.py end to end on a tiny grid: deterministic runs, K-stale
    batches exactly K old, and paired differences that are the mean of per-seed differences."""
    bench = load("staleness_learning")
    assert bench.mean_ci([1.0, 2.0, 3.0]) == {"mean": 2.0, "ci95": pytest.approx(4.303 / 3 ** 0.5), "n": 3}
    proc = subprocess.run([sys.executable, str(BENCH / "staleness_learning.py"), "--ks", "0", "2", "--arms", "none",
                           "tis", "--seeds", "2", "--steps", "3", "--workers", "2", "--eval-prompts", "4",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(next(tmp_path.glob("staleness_learning_transformers_tiny_*.json")).read_text())
    runs = {(r["k"], r["arm"], r["seed"]): r for r in data["runs"]}
    assert len(runs) == 8
    assert all(r["staleness_max"] == r["k"] for r in runs.values())  # deterministic: exactly K old at step 3
    for arm in ("none", "tis"):
        diffs = [runs[(2, arm, s)]["final_eval"] - runs[(0, arm, s)]["final_eval"] for s in (0, 1)]
        assert data["table"][f"K2-{arm}"]["minus_K0"]["mean"] == pytest.approx(sum(diffs) / 2)
    assert "| 2 |" in proc.stdout and (tmp_path / next(tmp_path.glob("*.json")).name).exists()


# --------------------------------------------------------------------------- --engine vllm_server


def test_vllm_server_engine_takes_the_vllm_defaults_and_refuses_what_it_cannot_run(
        capsys: pytest.CaptureFixture[str]) -> None:
    tvs = load("throughput_vs_staleness")
    args = tvs.parse_args(["--engine", "vllm_server", "--compare-in-process"])
    assert (args.steps, args.batch_groups, args.max_new_tokens, args.model_shape, args.lora_rank) == \
        (12, 32, 128, "qwen2.5-0.5b", 16)
    assert args.compare_in_process and not tvs.parse_args(["--engine", "vllm_server"]).compare_in_process
    assert [w.kind for w in tvs.workloads_of(args)] == ["vllm", "vllm_server"]
    assert [w.kind for w in tvs.workloads_of(tvs.parse_args(["--engine", "vllm_server"]))] == ["vllm_server"]
    refused = {("--engine", "vllm", "--compare-in-process"):
               "--compare-in-process compares --engine vllm_server with the in-process engine",
               ("--engine", "vllm_server", "--update", "full"): "--engine vllm_server takes LoRA updates only"}
    for argv, said in refused.items():
        with pytest.raises(SystemExit):
            tvs.parse_args(argv)
        assert said in capsys.readouterr().err


def test_vllm_server_sweep_refuses_clearly_without_vllm_or_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    tvs = load("throughput_vs_staleness")
    if tvs.vllm_missing("cuda:0", "cuda:1") is None:
        pytest.skip("vLLM and two GPUs are here: the refusal cannot be shown")

    def past_the_refusal(args):
        raise AssertionError("main went on to build the sweep without vLLM or GPUs")

    monkeypatch.setattr(tvs, "workloads_of", past_the_refusal)
    with pytest.raises(SystemExit, match="--engine vllm_server cannot run here: .*(vLLM|GPU|device)"):
        tvs.main(["--engine", "vllm_server", "--compare-in-process", "--quick"])


def test_side_by_side_has_a_row_per_k_and_engine_against_the_baseline_at_the_same_k() -> None:
    analysis = load_part("analysis")

    def run(K: int, groups_per_s: float, load_ms: float | None) -> dict:
        return {"max_staleness": K, "groups_per_s": groups_per_s, "gen_kept_of_standalone": 0.9,
                "gen_kept_of_standalone_same_depth": 0.8, "loop_lag_p99_ms": 2.0 + K,
                "publish_to_loaded_ms_mean": 40.0, "publish_to_loaded_ms_max": 90.0,
                "engine_load_ms_mean": load_ms, "engine_load_ms_max": load_ms}

    st = {"gen_tokens_per_s": 1000.0, "groups": 32, "engine_start_s": 90.0, "t_train_s": 0.5}
    sweeps = {"vllm": {"standalone": st, "results": [run(0, 2.0, 50.0), run(1, 4.0, 52.0)]},
              "vllm_server": {"standalone": st, "results": [run(0, 3.0, 60.0), run(1, 5.0, 61.0), run(2, 6.0, None)]}}
    rows = analysis.side_by_side(sweeps, "vllm")
    assert [(r["max_staleness"], r["engine"]) for r in rows] == \
        [(0, "vllm"), (0, "vllm_server"), (1, "vllm"), (1, "vllm_server"), (2, "vllm_server")]
    assert [r["groups_per_s_over_baseline"] for r in rows] == [1.0, 1.5, 1.0, 1.25, None]  # no K=2 in process
    assert rows[3]["loop_lag_p99_ms"] == 3.0 and rows[1]["engine_load_ms_mean"] == 60.0
    text, tbl = analysis.side_by_side_report(sweeps, "vllm", rows)
    assert tbl in text and "x vllm" in tbl.splitlines()[0] and "load ms" in tbl.splitlines()[0]
    assert len(tbl.splitlines()) == 2 + len(rows)
    # the engine's own loads, from a run's events: only adapter_loaded events with their seconds
    events = [{"event": "adapter_loaded", "seconds": 0.05}, {"event": "adapter_loaded", "seconds": 0.07},
              {"event": "adapter_loaded", "version": 3}, {"event": "adapter_unloaded", "seconds": 9.0}]
    assert analysis.engine_loads(events) == pytest.approx(
        {"engine_loads": 2, "engine_load_ms_mean": 60.0, "engine_load_ms_max": 70.0})
    assert analysis.engine_loads([]) == {"engine_loads": 0, "engine_load_ms_mean": None, "engine_load_ms_max": None}


class StandInServe:
    """VLLMServeProcess's API over tests/vllm_stand_in.py serving the simulated engine (no vLLM, no GPU).

    The stand-in runs on its own event loop in a thread, as a server runs apart from the pipeline's loop
    (and a stop the sweep forgets fails the test instead of leaving it on the sweep's loop)."""

    instances: list["StandInServe"] = []

    def __init__(self, model_path, log_path, *, device, port, max_loras, extra, **kw) -> None:
        self.model_path, self.log_path, self.port = model_path, Path(log_path), port
        self.url = f"http://127.0.0.1:{port}"
        self.argv = ["vllm", "serve", str(model_path), "--max-loras", str(max_loras), *extra]
        self.started = self.stopped = 0
        self.in_process_closed_at_start: list[int] = []
        StandInServe.instances.append(self)

    async def _serve(self) -> str:
        from vllm_stand_in import VLLMStandIn

        from pipeline.config.schema import SimulatedEngineConfig
        from pipeline.engines.simulated import SimulatedEngine

        engine = SimulatedEngine(SimulatedEngineConfig(latency_s=0.002, completion_tokens=8), name="served")
        self.stub = VLLMStandIn(engine, model_name=str(self.model_path), port=self.port)
        return await self.stub.start()

    async def start(self, timeout_s: float = 600.0) -> str:
        import asyncio
        import threading

        self.in_process_closed_at_start = [e.closed for e in StandInVLLM.instances]
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="stand-in-vllm-serve", daemon=True)
        self.thread.start()
        assert await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._serve(), self.loop)) == self.url
        self.log_path.parent.mkdir(parents=True, exist_ok=True)  # as the launcher makes it
        self.log_path.write_text("stand-in for vllm serve\n")
        self.started += 1
        return self.url

    async def stop(self) -> None:
        import asyncio

        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.stub.close(), self.loop))
        self.loop.call_soon_threadsafe(self.loop.stop)
        await asyncio.to_thread(self.thread.join)
        self.loop.close()
        self.stopped += 1


def test_compare_in_process_sweeps_both_engines_into_one_json(tmp_path: Path, model_cache: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # the in-process sweep first (its engine closed before the server starts), then the server's
    # through the real HTTP engine, replaying the trainer step the first timed; one JSON for both.
    # At K = 2 the engine alone runs on 3 versions, one a copy of the replayed adapter published as
    # v3, the name run K = 2 publishes again from its own store: left registered, it refuses that run
    import pipeline.engines.vllm_launch

    tvs = stand_in_sweep(monkeypatch)
    StandInServe.instances.clear()
    monkeypatch.setattr(pipeline.engines.vllm_launch, "VLLMServeProcess", StandInServe)
    # the plumbing is under test, not the speeds: each run replays a 10 ms step, whatever this
    # machine's trainer took, and the idle loop is timed for 0.1 s (1 s per sweep otherwise)
    workloads = load_part("workloads")
    time_trainer = workloads.time_trainer
    monkeypatch.setattr(workloads, "time_trainer", lambda *a, **kw: {**time_trainer(*a, **kw), "t_train_step_s": 0.01})
    idle_loop_lag = tvs.common.idle_loop_lag
    monkeypatch.setattr(tvs.common, "idle_loop_lag", lambda seconds: idle_loop_lag(0.1))
    argv = [*stand_in_argv(tmp_path, model_cache, "--trainer", "sim", "--keep-runs", str(tmp_path / "runs")),
            "--steps", "5", "--warmup-steps", "1", "--staleness", "0,2"]
    argv[argv.index("vllm")] = "vllm_server"
    [rec] = tvs.main([*argv, "--compare-in-process"])
    assert len(StandInVLLM.instances) == 1
    [server] = StandInServe.instances
    assert server.in_process_closed_at_start == [1] and (server.started, server.stopped) == (1, 1)
    name = Path(rec["files"]["json"]).name
    assert name.startswith("throughput_vs_staleness_vllm_server_vs_in_process_tiny_simtrainer_"), name
    data = read_json(rec["files"]["json"])
    assert list(data["sweeps"]) == ["vllm", "vllm_server"] and data["settings"]["baseline"] == "vllm"
    vllm, served = data["sweeps"]["vllm"], data["sweeps"]["vllm_server"]
    # each sweep's own pair, written as it ended, under the name a sweep of that engine alone gets
    assert sorted(p.name for p in tmp_path.glob("*.json")) == sorted(
        Path(r["files"]["json"]).name for r in (rec, vllm, served))
    assert [Path(r["files"]["json"]).name.split("_tiny_")[0] for r in (vllm, served)] == \
        ["throughput_vs_staleness_vllm", "throughput_vs_staleness_vllm_server"]
    assert all(Path(r["files"]["png"]).stat().st_size > 10_000 for r in (vllm, served))
    # both replay the one trainer timing; the server has the in-process engine's adapter slots
    assert served["settings"]["trainer_timed_in"] == "vllm" and vllm["settings"]["trainer_timed_in"] == "vllm"
    assert served["settings"]["replayed_step_s"] == vllm["settings"]["replayed_step_s"] > 0
    assert served["standalone"]["t_train_s"] == vllm["standalone"]["t_train_s"]
    assert served["settings"]["max_loras"] == vllm["settings"]["max_loras"] == 2 + 2
    flags = served["settings"]["server_argv"]
    assert flags[flags.index("--max-cpu-loras") + 1] == "6" and served["standalone"]["gen_tokens_per_s"] > 0
    assert served["standalone"]["standalone_by_depth"]["2"]["adapters"] == 3
    for K in (0, 2):
        cfg = tomllib.loads((tmp_path / "runs" / "vllm_server-tiny" / f"K{K}" / "config.toml").read_text())
        assert cfg["engine"]["kind"] == "vllm_server" and cfg["engine"]["vllm_server"]["urls"] == [server.url]
    for r in served["results"]:
        assert r["accounting_ok"] and r["gen_kept_of_standalone"] > 0 and r["gen_kept_of_standalone_same_depth"] > 0
        assert r["engine_loads"] >= 1 and r["engine_load_ms_mean"] > 0  # each registration POST, from events.jsonl
    assert all(r["engine_loads"] == 0 for r in vllm["results"])  # the stand-in for vLLM logs no loads
    rows = data["side_by_side"]
    assert [(r["max_staleness"], r["engine"]) for r in rows] == [(0, "vllm"), (0, "vllm_server"), (2, "vllm"),
                                                                 (2, "vllm_server")]
    by = {(r["max_staleness"], r["engine"]): r for r in rows}
    for i, K in enumerate((0, 2)):
        assert by[K, "vllm"]["groups_per_s_over_baseline"] == 1.0
        assert by[K, "vllm_server"]["groups_per_s_over_baseline"] == pytest.approx(
            served["results"][i]["groups_per_s"] / vllm["results"][i]["groups_per_s"])
    assert data["table"] in data["printed"] and "side by side: vllm, vllm_server" in data["printed"]


def test_setup_time_sets_trl_up_beside_on_the_same_model_and_settings_with_caches_of_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/setup_time.py --trl: TRL's set-up runs cold then warm in child processes of its own, on
    the model our cold run built, with the config's group, length, micro-batch, LoRA and GPU share,
    and its own compile caches; the ratios printed are of the figures the runs gave."""
    st = load("setup_time")
    ours: list[dict] = []
    trl: list[tuple[dict, dict]] = []
    real_run = subprocess.run

    def fake_run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess:
        env = kw.get("env")
        if cmd[1] == "-c":  # the built-in model, built before the runs
            return built_model(cmd)
        if "--trl-child" in cmd:
            call = json.loads(Path(cmd[cmd.index("--trl-child") + 1]).read_text())
            trl.append((call, env))
            Path(env["VLLM_CACHE_ROOT"]).mkdir(parents=True, exist_ok=True)  # as vLLM's start does
            Path(call["result"]).write_text(json.dumps({"imports_s": 1.0, "setup_s": 20.0 if len(trl) == 1 else 10.0,
                                                        "steps_s": 3.0, "first_step_s": 1.5, "steps": 2}))
            return subprocess.CompletedProcess(cmd, 0, stdout="", stderr=vllm_log(compile_s=9.5, capture_s=3))
        if not str(cmd[1]).endswith("run.py"):
            return real_run(cmd, **kw)
        ours.append(env)
        Path(env["VLLM_CACHE_ROOT"]).mkdir(parents=True, exist_ok=True)
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        (out / "events.jsonl").write_text(json.dumps({"event": "engine_started", "import_s": 4.25}) + "\n"
                                          + json.dumps({"event": "pipeline_ready", "model": "/models/built"}) + "\n")
        (out / "summary.json").write_text(json.dumps({
            "setup_s": 15.0 if len(ours) == 1 else 5.0, "wall_s": 1.0, "steps": 2, "groups_per_s": 3.0, "error": None,
            "setup": {"data_s": 0.1, "model_s": 1.0, "tokenizer_s": 1.0, "engines_start_s": 2.0, "trainer_start_s": 3.0}}))
        return subprocess.CompletedProcess(cmd, 0, stdout="ready\n", stderr=vllm_log(compile_s=30.0, capture_s=25))

    monkeypatch.setattr(st.subprocess, "run", fake_run)
    rec = st.main(["--config", str(REPO / "examples" / "one_gpu.toml"), "--steps", "2", "--warm", "1", "--trl",
                   "--set", "trainer.micro_batch_sequences=16", "--scratch", str(tmp_path / "scratch"), "--out", str(tmp_path)])
    assert [r["cache"] for r in rec["trl"]] == ["cold", "warm"] and [r["setup_s"] for r in rec["trl"]] == [20.0, 10.0]
    settings = trl[0][0]["settings"]
    assert settings["model_path"] == "/models/built" and trl[0][0]["steps"] == 2
    assert (settings["batch_groups"], settings["n"], settings["max_new_tokens"], settings["micro_batch"],
            settings["lora_rank"], settings["gpu_memory_utilization"]) == (32, 8, 256, 16, 16, 0.45)  # --set too
    assert {env["VLLM_CACHE_ROOT"] for _, env in trl} != {env["VLLM_CACHE_ROOT"] for env in ours}
    assert len({env["VLLM_CACHE_ROOT"] for _, env in trl}) == 1  # TRL's warm run reuses its cold run's caches
    assert all(env["VLLM_LOGGING_LEVEL"] == "INFO" for _, env in trl)  # TRL would set ERROR: no start-up lines
    assert "set-up: cold 0.75x, warm 0.50x" in rec["printed"]
    # each side's vLLM start in the parts its log names
    assert [r["vllm_parts"]["capture_s"] for r in rec["runs"] + rec["trl"]] == [25.0, 25.0, 3.0, 3.0]
    assert [r["vllm_parts"].get("import_s") for r in rec["runs"] + rec["trl"]] == [4.25, 4.25, None, None]
    # every run's console output is kept beside it, TRL's too
    assert "Graph capturing finished in 3 secs" in (tmp_path / "scratch" / "trl-run-1.console.log").read_text()
    assert "Graph capturing finished in 25 secs" in (tmp_path / "scratch" / "run-0.console.log").read_text()
    assert rec["trl"][0]["vllm_parts"]["profile_s"] == pytest.approx(50.0 - 9.5 - 3.0)

    # TRL's half alone, in a later invocation on the same scratch: on the model our cold run built
    ours.clear(), trl.clear()
    rec = st.main(["--config", str(REPO / "examples" / "one_gpu.toml"), "--steps", "2", "--warm", "0", "--trl-only",
                   "--scratch", str(tmp_path / "scratch"), "--out", str(tmp_path)])
    assert not ours and rec["runs"] == [] and trl[0][0]["settings"]["model_path"] == "/models/built"
    # its runs compared with ours of the earlier invocation on that scratch: TRL's (now warm) 20 s with our warm 5 s
    assert "ours / TRL (ours: runs 1 on this scratch), set-up: warm 0.25x" in rec["printed"]
    assert Path(rec["files"]["json"]).name.startswith("setup_time_trl_one_gpu_")
    with pytest.raises(SystemExit, match="no model under"):
        st.main(["--config", str(REPO / "examples" / "one_gpu.toml"), "--trl-only", "--scratch", str(tmp_path / "new"),
                 "--out", str(tmp_path)])
    # a TRL run that writes no result is an error, not the result an earlier invocation left there

    def no_result(cmd: list[str], **kw: object) -> subprocess.CompletedProcess:
        if "--trl-child" in cmd:
            return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")
        return fake_run(cmd, **kw)

    monkeypatch.setattr(st.subprocess, "run", no_result)
    with pytest.raises(SystemExit, match="TRL run 0 exited with 0"):
        st.main(["--config", str(REPO / "examples" / "one_gpu.toml"), "--steps", "2", "--warm", "0", "--trl-only",
                 "--scratch", str(tmp_path / "scratch"), "--out", str(tmp_path)])


def test_setup_time_reads_a_launched_servers_start_from_its_log_and_sets_trl_beside_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run on a `vllm serve` it launches: vLLM's parts come from the server's log under the run (its
    console has none), and TRL's side takes the same settings; servers someone else started are refused."""
    from pipeline.config.io import load_config

    st = load("setup_time")
    real_run = subprocess.run

    def fake_run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess:
        if cmd[1] == "-c":
            return built_model(cmd)
        if not str(cmd[1]).endswith("run.py"):
            return real_run(cmd, **kw)
        Path(kw["env"]["VLLM_CACHE_ROOT"]).mkdir(parents=True, exist_ok=True)
        out = Path(cmd[cmd.index("--out") + 1])
        (out / "servers").mkdir(parents=True)
        (out / "servers" / "vllm-server-0.log").write_text(vllm_log(compile_s=7.5, capture_s=4))
        (out / "summary.json").write_text(json.dumps({
            "setup_s": 9.0, "wall_s": 1.0, "steps": 2, "groups_per_s": 3.0, "error": None,
            "setup": {"data_s": 0.1, "model_s": 1.0, "engines_start_s": 2.0, "trainer_start_s": 3.0}}))
        return subprocess.CompletedProcess(cmd, 0, stdout="ready\n", stderr="")

    monkeypatch.setattr(st.subprocess, "run", fake_run)
    launched = ["engine.kind=vllm_server", "engine.vllm_server.launch=true", "engine.devices=[\"cuda:0\"]"]
    rec = st.main(["--config", str(REPO / "examples" / "one_gpu.toml"), "--warm", "0", "--out", str(tmp_path),
                   "--scratch", str(tmp_path / "scratch"), *[a for kv in launched for a in ("--set", kv)]])
    assert rec["runs"][0]["vllm_parts"]["compile_s"] == 7.5 and rec["runs"][0]["vllm_parts"]["capture_s"] == 4
    cfg = load_config(str(REPO / "examples" / "one_gpu.toml"), launched)
    assert st.trl_settings_of(cfg, "/m")["gpu_memory_utilization"] == 0.45
    external = load_config(None, ["engine.kind=vllm_server", "engine.vllm_server.urls=[\"http://h:8000\"]"])
    with pytest.raises(SystemExit, match="one vLLM engine on one GPU"):
        st.trl_settings_of(external, "/m")


def built_model(cmd: list[str]) -> subprocess.CompletedProcess:
    """setup_time's model build (`python -c CODE CONFIG OVERRIDES...`), as the code does it: the model
    directory made under the model.cache_dir override, its path printed."""
    cache = Path(next(a for a in cmd if a.startswith("model.cache_dir=")).partition("=")[2])
    (cache / "built").mkdir(parents=True)
    return subprocess.CompletedProcess(cmd, 0, stdout=f"{cache / 'built'}\n", stderr="")


def vllm_log(compile_s: float, capture_s: int) -> str:
    """vLLM 0.24's start-up lines, as an engine core logs them (whole-init 50 s)."""
    return (f"(EngineCore pid=1) INFO [gpu_model_runner.py:5255] Model loading took 0.99 GiB memory and 0.95 seconds\n"
            f"(EngineCore pid=1) INFO [monitor.py:53] torch.compile took {compile_s} s in total\n"
            "(EngineCore pid=1) INFO [gpu_model_runner.py:6483] Profiling CUDA graph memory: PIECEWISE=83 "
            "(largest=512), FULL=83 (largest=512)\n"
            f"(EngineCore pid=1) INFO [gpu_model_runner.py:6656] Graph capturing finished in {capture_s} secs, took 1.00 GiB\n"
            "(EngineCore pid=1) INFO [core.py:337] init engine (profile, create kv cache, warmup model) took 50.00 s "
            f"(compilation: {compile_s} s)\n")


def test_setup_times_vllm_parts_read_a_real_engine_logs_start() -> None:
    """The parts come from vLLM 0.24's own lines: a committed log of a LoRA engine's cold start."""
    st = load("setup_time")
    results = REPO / "benchmarks" / "results"
    log = (results / "throughput_vs_staleness_vllm_server_vs_in_process_qwen2.5-0.5b_simtrainer_1xH200.log").read_text()
    parts = st.vllm_parts(log)
    assert parts == pytest.approx({"weights_s": 0.955868, "compile_s": 29.02, "graphs": 166, "graphs_full": 166,
                                   "capture_s": 36, "init_engine_s": 82.80, "profile_s": 82.80 - 29.02 - 36,
                                   "before_core_s": 32.0})  # 10:30:53 "Resolved architecture", 10:31:25 the core's
    # a warm full-weight start: the front end at 02:47:59, the core's first line at 02:48:24
    warm = st.vllm_parts((results / "throughput_vs_staleness_vllm_qwen2.5-0.5b_full_memory_1xH100-80GB-HBM3.log").read_text())
    assert warm["before_core_s"] == 25.0 and warm["compile_s"] == 3.16 and warm["graphs"] == 35
    assert st.vllm_parts("no engine here") == {}


def test_setup_time_runs_cold_then_warm_on_one_set_of_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/setup_time.py: every run gets the same scratch caches (the first finds them empty),
    and a row from its summary.json; a run that fails stops the benchmark with its output."""
    st = load("setup_time")
    calls: list[tuple[list[str], dict]] = []
    real_run = subprocess.run

    builds: list[list[str]] = []

    def fake_run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess:
        if cmd[1] == "-c":  # the built-in model, built before the runs
            builds.append(cmd)
            return built_model(cmd)
        if not str(cmd[1]).endswith("run.py"):  # what else asks the system (nvidia-smi, say)
            return real_run(cmd, **kw)
        env = kw["env"]
        assert builds, "a run started before its model was built"
        calls.append((cmd, env))
        Path(env["VLLM_CACHE_ROOT"]).mkdir(parents=True, exist_ok=True)  # as run.py's engine or model cache does
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        first = len(calls) == 1
        (out / "summary.json").write_text(json.dumps({
            "setup_s": 9.0 if first else 4.0, "wall_s": 1.0, "steps": 2, "groups_per_s": 3.0, "error": None,
            "setup": {"data_s": 0.1, "model_s": 5.0 if first else 1.0, "engines_start_s": 2.0, "trainer_start_s": 3.0}}))
        return subprocess.CompletedProcess(cmd, 0, stdout="ready\n", stderr="")

    monkeypatch.setattr(st.subprocess, "run", fake_run)
    rec = st.main(["--steps", "2", "--warm", "2", "--scratch", str(tmp_path / "scratch"), "--out", str(tmp_path)])
    assert [r["cache"] for r in rec["runs"]] == ["cold", "warm", "warm"]
    assert [r["model_s"] for r in rec["runs"]] == [5.0, 1.0, 1.0] and rec["runs"][0]["setup_s"] == 9.0
    caches = {(env["VLLM_CACHE_ROOT"], env["TORCHINDUCTOR_CACHE_DIR"], cmd[cmd.index("--set") + 1])
              for cmd, env in calls}
    assert len(caches) == 1 and str(tmp_path / "scratch") in caches.pop()[0]  # one set of caches for all runs
    assert all(cmd[cmd.index("--steps") + 1] == "2" for cmd, _ in calls)
    assert Path(rec["files"]["json"]).name.startswith("setup_time_cpu_default_")
    # the model was built once, apart, where every run finds it (outside the compile caches)
    assert len(builds) == 1 and rec["model_build_s"] is not None
    assert {cmd[cmd.index("--set") + 1] for cmd, _ in calls} == {f"model.cache_dir={tmp_path / 'scratch' / 'models'}"}
    assert builds[0][-1] == f"model.cache_dir={tmp_path / 'scratch' / 'models'}"
    # a later invocation on that scratch directory: its runs follow the earlier ones, the first warm too
    calls.clear()
    rec = st.main(["--steps", "2", "--warm", "0", "--scratch", str(tmp_path / "scratch"), "--out", str(tmp_path),
                   "--tag", "_again"])
    assert [(r["run"], r["cache"]) for r in rec["runs"]] == [(3, "warm")]
    assert len(builds) == 1 and rec["model_build_s"] is None  # found built
    assert (tmp_path / "scratch" / "run-0" / "summary.json").is_file()  # the earlier runs are left as they were
    # one with the caches copied to a new directory: warm as well
    shutil.copytree(tmp_path / "scratch" / "caches", tmp_path / "again" / "caches")
    rec = st.main(["--steps", "2", "--warm", "0", "--scratch", str(tmp_path / "again"), "--out", str(tmp_path),
                   "--tag", "_again"])
    assert [(r["run"], r["cache"]) for r in rec["runs"]] == [(0, "warm")]

    def failing(cmd: list[str], **kw: object) -> subprocess.CompletedProcess:
        if cmd[1] == "-c":
            return built_model(cmd)
        if not str(cmd[1]).endswith("run.py"):
            return real_run(cmd, **kw)
        return subprocess.CompletedProcess(cmd, 2, stdout="", stderr="error: model.path does not exist")

    monkeypatch.setattr(st.subprocess, "run", failing)
    with pytest.raises(SystemExit, match="model.path does not exist"):
        st.main(["--warm", "0", "--scratch", str(tmp_path / "other"), "--out", str(tmp_path)])


@pytest.mark.slow
def test_trainer_scaling_times_one_process_then_each_world_size(tmp_path: Path, model_cache: Path) -> None:
    """On two gloo ranks (the GPU command differs only in --devices): the one-process baseline, then
    ranks on 1 and 2 devices, per update mode, each with its speed-up over the baseline of its run."""
    load("trainer_scaling").main(["--devices", "cpu,cpu", "--shape", "tiny", "--cache", str(model_cache),
                                  "--groups", "2", "--n", "4", "--tokens", "8", "--prompt-tokens", "4",
                                  "--steps", "2", "--out", str(tmp_path)])
    [path] = tmp_path.glob("trainer_scaling_tiny_*.json")
    data = json.loads(path.read_text())
    rows = [(r["update"], r["trainer"], r["world_size"]) for r in data["results"]]
    assert rows == [(u, t, w) for u in ("lora", "full") for t, w in (("one process", 1), ("ranks", 1), ("ranks", 2))]
    for r in data["results"]:
        assert len(r["step_s_all"]) == 2 and r["samples_per_s"] == pytest.approx(8 / r["step_s"])
        assert 0 < r["rank_step_max_s"] <= r["step_s"]
    base = {r["update"]: r["step_s"] for r in data["results"] if r["trainer"] == "one process"}
    assert all(r["speedup_vs_one_process"] == pytest.approx(base[r["update"]] / r["step_s"]) for r in data["results"])


def test_no_benchmark_writes_into_the_committed_results_unless_told_to() -> None:
    """A newcomer trying a script must not overwrite a committed result: every --out defaults to
    the git-ignored runs/benchmarks (benchmarks/results only when --out names it)."""
    import re

    defaults = {}
    for script in sorted(BENCH.glob("*.py")):
        found = re.findall(r'add_argument\("--out", default=([^),]+)', script.read_text())
        if found:
            defaults[script.name] = found
    assert len(defaults) >= 10, defaults
    for name, values in defaults.items():
        assert all("DEFAULT_OUT" in v or v.strip("\"'") == "runs/benchmarks" for v in values), (name, values)
    common = load("common")
    assert common.DEFAULT_OUT == REPO / "runs" / "benchmarks" and "runs/" in (REPO / ".gitignore").read_text()


# --------------------------------------------------------------------------- time to accuracy


@pytest.fixture
def quick_warm_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny shape's warm start cut to 20 steps (its target out of reach): a model in seconds."""
    from pipeline.models import warm_start as ws
    monkeypatch.setitem(ws.RECIPES, "tiny", ws.Recipe(lr=1e-3, batch=64, max_steps=20, check_every=10))


def test_time_to_accuracy_times_each_arm_and_pairs_seeds(tmp_path: Path, quick_warm_start: None) -> None:
    tta = load("time_to_accuracy")
    rec = tta.main(["--ks", "0", "1", "--arms", "tis", "--seeds", "2", "--steps", "6", "--eval-every", "3",
                    "--eval-prompts", "500", "--eval-n", "1", "--num-prompts", "64", "--model-cache", str(tmp_path / "m"),
                    "--warm-start-accuracy", "0.9", "--out", str(tmp_path)])
    data = read_json(tmp_path / f"time_to_accuracy_transformers_tiny_{rec['hardware_tag']}.json")
    assert sorted(r["name"] for r in data["runs"]) == sorted(f"K{k}-{a}-s{s}" for s in (0, 1)
                                                              for k, a in ((0, "tis"), (1, "tis"), (0, "lr0")))
    for r in data["runs"]:
        assert [c[0] for c in r["curve"]] == [0, 3, 6] and r["curve"][0][1] == 0.0
        assert r["curve"][1][1] < r["curve"][2][1]  # wall time at each eval's version, increasing
    a = data["analysis"]
    assert a["target"] == pytest.approx(a["start"] + 0.5 * (a["k0_best"] - a["start"]))
    k1 = a["table"]["K1-tis"]
    # the paired difference is the mean of each seed's difference
    finals = {(r["k"], r["seed"]): r["final"] for r in data["runs"] if r["arm"] == "tis"}
    assert k1["final_minus_K0"]["mean"] == pytest.approx(np.mean([finals[(1, s)] - finals[(0, s)] for s in (0, 1)]))
    # a target never reached is said, never timed
    again = tta.analyse(data["runs"], target=2.0)
    assert all(row["time_to_target_s"] is None and row["reached"] == 0 for row in again["table"].values())
    assert "not reached (0/2)" in tta.markdown(again, 2)
    assert (tmp_path / f"time_to_accuracy_transformers_tiny_{rec['hardware_tag']}.png").stat().st_size > 0


def test_time_to_accuracy_refuses_an_eval_set_too_small_to_tell_arms_apart(capsys: pytest.CaptureFixture[str]) -> None:
    tta = load("time_to_accuracy")
    with pytest.raises(SystemExit) as e:
        tta.parse_args(["--eval-prompts", "100"])
    assert e.value.code == 2 and "--eval-prompts must be >= 500" in capsys.readouterr().err
    from pipeline.config.schema import TaskConfig
    from pipeline.errors import ConfigError
    from pipeline.data.tasks import build_task

    with pytest.raises(ConfigError, match="fewer than the 900 asked for"):  # more than the held-out split holds
        build_task(TaskConfig(name="addition", num_eval_prompts=900), 4)


def test_the_mean_curve_crossing_interpolates_between_eval_rounds() -> None:
    tta = load("time_to_accuracy")
    curve = [(0, 0.0, 0.2), (10, 4.0, 0.3), (20, 8.0, 0.5)]
    assert tta.crossing(curve, 0.4, 1) == pytest.approx(6.0) and tta.crossing(curve, 0.4, 0) == pytest.approx(15.0)
    assert tta.crossing(curve, 0.1, 1) == 0.0 and tta.crossing(curve, 0.6, 1) is None


@pytest.mark.slow
def test_vs_trl_races_trl_to_an_accuracy_on_the_same_model(tmp_path: Path, quick_warm_start: None) -> None:
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    vt = load("vs_trl")
    rec = vt.main(["--task", "addition", "--staleness", "0,1", "--steps", "4", "--eval-every", "2", "--eval-n", "1",
                   "--eval-prompts", "500", "--model-cache", str(tmp_path / "m"), "--out", str(tmp_path)])
    assert [r["system"] for r in rec["trl_runs"]] == ["trl"] and [c[0] for c in rec["trl_runs"][0]["curve"]] == [0, 2, 4]
    table = rec["analysis"]["table"]
    assert set(table) == {"K0-tis", "K1-tis", "trl"} and "time_ratio_to_trl" in table["K1-tis"]
    # the same warm-started model on both sides: their first evals sample one model
    assert abs(rec["trl_runs"][0]["first"] - rec["runs"][0]["first"]) < 0.1


def test_the_standalone_trainer_timing_shares_in_memory_when_the_runs_do(tmp_path: Path) -> None:
    """--set trainer.publish=memory: the publish timed before a sweep is the version's share, not a
    write, and the store still gets the last version (what --trainer sim replays)."""
    from pipeline.store.weights import AdapterStore
    from pipeline.trainer.simulated import SimulatedTrainer

    workloads = load_part("workloads")
    trainer = SimulatedTrainer(update="full")
    workloads.time_trainer(trainer, [], tmp_path / "store", 3, "full", "memory")
    assert sorted(trainer.shared) == [4]  # each version was shared, the older ones let go
    assert AdapterStore(tmp_path / "store", kind="full").versions() == [4]
    files = SimulatedTrainer(update="full")
    workloads.time_trainer(files, [], tmp_path / "files", 3, "full")
    assert files.shared == {} and AdapterStore(tmp_path / "files", kind="full").versions() == [1, 2, 3, 4]


def test_the_sweeps_trl_race_times_trl_over_the_same_steady_window_and_settings(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """throughput_vs_staleness --trl: TRL runs on the sweep's model and settings (full weights: no peft
    config); its samples/s counts the steps after --warmup-steps over their own span, and each K's
    samples/s is divided by it."""
    from pipeline.config.io import load_config

    tvs = load("throughput_vs_staleness")
    import setup_time

    calls = []

    def fake_child(settings, steps, scratch, index, timeout_s):
        calls.append((settings, steps))
        # step k ends at 10 + 2k s: steps after the first two take 2 s each
        return {"setup_s": 50.0, "steps_s": 40.0, "step_ends_s": [10.0 + 2 * k for k in range(1, steps + 1)]}

    monkeypatch.setattr(setup_time, "run_trl_child", fake_child)
    args = tvs.parse_args(["--engine", "vllm", "--update", "full", "--steps", "6", "--batch-groups", "4",
                           "--group-size", "8", "--trainer-device", "cuda:0", "--trl",
                           "--set", "trainer.micro_batch_sequences=8"])

    class Workload:
        model_path, kind, shape = Path("/models/built"), "vllm", "qwen2.5-0.5b"

        def config(self, K, run_dir):
            return load_config(None, {"engine.kind": "vllm", "engine.devices": ["cuda:0"], "trainer.device": "cuda:0",
                                      "trainer.update": args.update, "pipeline.batch_groups": 4,
                                      "sampling.n": 8, "trainer.micro_batch_sequences": 8})

    out = tvs.trl_beside(Workload(), args, [{"max_staleness": 0, "groups_per_s": 2.0},
                                            {"max_staleness": 1, "groups_per_s": 4.0}], tmp_path)
    (settings, steps), = calls
    assert steps == 6 and settings["update"] == "full" and settings["model_path"] == "/models/built"
    assert settings["micro_batch"] == 8 and settings["batch_groups"] == 4
    assert out["samples_per_s"] == pytest.approx(32 / 2.0)  # 4 x 8 samples a step, one step per 2 s
    assert out["ours_over_trl"] == {0: pytest.approx(16 / 16.0), 1: pytest.approx(32 / 16.0)}
    with pytest.raises(SystemExit):
        tvs.parse_args(["--engine", "sim", "--trl"])


def test_the_sweeps_overrides_are_checked_against_its_own_engine(tmp_path: Path) -> None:
    """--set is checked as the runs will read it: with the sweep's engine kind and devices (an override
    that needs the vLLM engine is not refused for the config's default engine)."""
    tvs = load("throughput_vs_staleness")
    args = tvs.parse_args(["--engine", "vllm", "--update", "full", "--trainer-device", "cuda:0",
                           "--set", "pipeline.full_weight_swap=in_flight"])
    assert args.set_overrides == {"pipeline.full_weight_swap": "in_flight"}
    with pytest.raises(SystemExit):  # the transformers engine takes no in-flight swaps
        tvs.parse_args(["--engine", "transformers", "--update", "full", "--set", "pipeline.full_weight_swap=in_flight"])
