"""Full-weight updates through the Pipeline (trainer.update = "full"), with the simulated engine.

The simulated engine in full-weight mode holds one version and refuses a group of another
version or a load while its groups run, so a drain bug in the orchestrator fails a group here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_accounted, sim_config
from test_orchestrator import PROMPTS, length_reward, run

from pipeline.engines.simulated import SimulatedEngine
from pipeline.errors import AdapterCorruptError, ConfigError
from pipeline.loop.orchestrator import Pipeline
from pipeline.loop.preflight import check_memory_publish, preflight
from pipeline.observe.metrics import read_jsonl
from pipeline.store.weights import AdapterStore
from pipeline.trainer.simulated import SimulatedTrainer
from pipeline.types import AdapterRef


@pytest.mark.parametrize("K,latency,step_s", [(0, 0.002, 0.0), (1, 0.003, 0.004), (2, 0.001, 0.006), (3, 0.004, 0.0)])
def test_a_full_weight_run_never_samples_a_group_across_versions(tmp_path, K, latency, step_s):
    cfg = sim_config(tmp_path, K=K, B=3, n=2, steps=8, latency=latency, concurrency=2, step_s=step_s,
                     **{"trainer.update": "full", "engine.devices": ["cpu", "cpu"]})
    p, summary = run(cfg, prompts=PROMPTS * 2)
    assert summary["error"] is None and summary["steps"] == 8, summary
    assert summary["groups_failed"] == {} and summary["generation_retries"] == 0, summary
    assert_accounted(p, summary)
    assert summary["staleness_max"] <= K
    assert summary["drain_s_mean"] is not None
    rows = read_jsonl(p.run_dir / "metrics.jsonl")
    assert all("adapter/drain_s" in r for r in rows)
    for e in p.engines:  # every engine ends on one version, and it served every version on its way
        assert len(e.loaded_versions) <= 1
    # every published version is a model directory: the store refuses anything else in full mode
    versions = sorted((p.run_dir / "adapters").glob("v*"))
    assert versions
    for d in versions:
        manifest = json.loads((d / "manifest.json").read_text())
        assert manifest["kind"] == "full" and "config.json" in manifest["files"]


def test_a_lora_run_writes_no_drain_column(tmp_path):
    p, summary = run(sim_config(tmp_path, K=1, steps=3))
    assert summary["drain_s_mean"] is None
    assert all("adapter/drain_s" not in r for r in read_jsonl(p.run_dir / "metrics.jsonl"))


def test_resuming_with_the_other_update_kind_is_refused_clearly(tmp_path):
    """A run's adapter store holds one kind: switching trainer.update on resume is a config error."""
    cfg = sim_config(tmp_path, K=1, steps=3)
    run(cfg)
    full = sim_config(tmp_path, K=1, steps=5, **{"trainer.update": "full"})
    with pytest.raises(ConfigError, match="trained with trainer.update = .lora.; it cannot continue with .full."):
        run(full, resume=True)
    assert Path(tmp_path / "run" / "summary.json").exists()


def test_a_restarted_full_weight_engine_serves_the_served_version_again(tmp_path):
    """An engine that dies mid-run is restarted and loads the version being served (not the base)."""
    cfg = sim_config(tmp_path, K=1, B=3, n=2, steps=12, latency=0.002, concurrency=2,
                     **{"trainer.update": "full", "engine.simulated.die_after": 20, "engine.restart_backoff_s": 0.01})
    p, summary = run(cfg, prompts=PROMPTS * 2)
    assert summary["error"] is None and summary["steps"] == 12, summary
    assert sum(summary["engine_restarts"].values()) >= 1
    assert summary["groups_failed"] == {}, summary
    assert_accounted(p, summary)


# --------------------------------------------------------------------------- trainer.publish = "memory"


def refuse_versions_not_kept(monkeypatch, trainer: SimulatedTrainer) -> list[AdapterRef]:
    """Full-weight simulated engines that refuse a version handed over in memory whose payload the
    trainer no longer keeps (a real engine would find the buffer gone); returns what they load."""
    loads: list[AdapterRef] = []
    load = SimulatedEngine.load_adapter

    async def checked(self: SimulatedEngine, adapter: AdapterRef) -> None:
        if adapter.version:
            if adapter.shared is None or adapter.version not in trainer.shared:
                raise AdapterCorruptError(f"{self.name}: version {adapter.version} is not kept by the trainer "
                                          f"(it keeps {sorted(trainer.shared)})")
            assert adapter.shared["version"] == adapter.version and adapter.path is None
        loads.append(adapter)
        await load(self, adapter)

    monkeypatch.setattr(SimulatedEngine, "load_adapter", checked)
    return loads


class ServedKept(SimulatedTrainer):
    """Notes each share after which the trainer no longer keeps the version the engines serve (an
    engine restarted then would have nothing to load)."""

    pipeline: Pipeline
    served_not_kept: list[tuple[int, int, list[int]]] = []

    def share_weights(self, keep_from: int) -> dict:
        payload = super().share_weights(keep_from)
        served = self.pipeline.versions.served
        if served and served not in self.shared:
            self.served_not_kept = [*self.served_not_kept, (keep_from, served, sorted(self.shared))]
        return payload


def memory_config(tmp_path, K: int, steps: int, **extra):
    return sim_config(tmp_path, K=K, B=3, n=2, steps=steps, latency=0.002, concurrency=2,
                      **{"trainer.update": "full", "trainer.publish": "memory", "engine.restart_backoff_s": 0.01,
                         **extra})


@pytest.mark.parametrize("K", [0, 1, 2])
def test_a_memory_run_hands_every_version_over_in_memory_and_writes_only_its_last(tmp_path, monkeypatch, K):
    """trainer.publish = "memory": every version reaches the engines as the trainer's payload while the
    trainer still keeps it (across an engine's restart too), no version is written but the last, and
    the trainer keeps no more than the versions from the served one on."""
    trainer = ServedKept(step_s=0.004, update="full")
    loads = refuse_versions_not_kept(monkeypatch, trainer)
    cfg = memory_config(tmp_path, K, steps=10, **{"engine.devices": ["cpu", "cpu"], "engine.simulated.die_after": 15})
    p = trainer.pipeline = Pipeline(cfg, prompts=PROMPTS * 2, reward=length_reward, trainer=trainer, tokenizer=False,
                                    console=False)
    summary = p.run_sync()
    assert trainer.served_not_kept == [], trainer.served_not_kept
    assert summary["error"] is None and summary["steps"] == 10, summary
    assert summary["groups_failed"] == {} and summary["adapter_load_failures"] == {}, summary
    assert sum(summary["engine_restarts"].values()) >= 1, summary
    assert_accounted(p, summary)
    loaded = {ref.version for ref in loads if ref.version}
    assert loaded and max(loaded) >= 10 - K - 1, loaded
    store = AdapterStore(p.run_dir / "adapters", base_model="", kind="full", readonly=True)
    assert store.versions() == [10]  # the run's trained model, on disk at the end
    # what it keeps: the versions from the one served at its last step on (the newest K + 2 at most)
    kept = sorted(trainer.shared)
    assert kept == list(range(kept[0], 11)) and len(kept) <= K + 2, kept
    rows = read_jsonl(p.run_dir / "metrics.jsonl")
    assert all(r["time/publish_s"] >= 0 for r in rows)


def test_a_memory_run_resumes_from_its_checkpoint(tmp_path):
    """The checkpoint's version is handed over in memory again on resume; the store keeps the last one only."""
    cfg = memory_config(tmp_path, 1, steps=4, **{"pipeline.checkpoint_every": 2})
    p, summary = run(cfg, prompts=PROMPTS * 2)
    assert summary["error"] is None and summary["steps"] == 4, summary
    p2, summary2 = run(memory_config(tmp_path, 1, steps=7, **{"pipeline.checkpoint_every": 2}), prompts=PROMPTS * 2,
                       resume=True)
    assert summary2["error"] is None and summary2["steps"] == 7, summary2
    assert_accounted(p2, summary2)
    store = AdapterStore(p2.run_dir / "adapters", base_model="", kind="full", readonly=True)
    assert store.versions() == [7]


@pytest.mark.parametrize("override,message", [
    ({"engine.kind": "transformers"}, 'full-weight version .* needs engine.kind = "vllm", got \'transformers\''),
    ({"trainer.kind": "peft", "trainer.device": "cpu"}, 'trainer.device must be a GPU \\("cuda:N"\\), got \'cpu\''),
    ({"trainer.kind": "peft", "trainer.devices": ["cpu", "cpu"]}, "one trainer process, not trainer ranks"),
])
def test_memory_publish_without_what_it_needs_is_refused_naming_the_key(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        preflight(memory_config(tmp_path, 1, steps=2, **override))


def test_memory_publish_refuses_an_engine_on_another_gpu_than_the_trainer(tmp_path):
    cfg = memory_config(tmp_path, 1, steps=2, **{"engine.kind": "vllm", "trainer.kind": "peft",
                                                 "trainer.device": "cuda:0", "engine.devices": ["cuda:0", "cuda:1"]})
    with pytest.raises(ConfigError, match='engine.devices\\[1\\] = "cuda:1" is not trainer.device = "cuda:0"'):
        check_memory_publish(cfg, builds_engines=True, builds_trainer=True)
    check_memory_publish(cfg, builds_engines=False, builds_trainer=True)  # engines of the caller's own: theirs to match


@pytest.mark.parametrize("separate_process", [True, False])
def test_a_lora_run_hands_each_adapter_to_the_transformers_engine_in_the_steps_reply(tmp_path, separate_process):
    """trainer.publish = "memory" with LoRA on the CPU: the real trainer (in its process or a thread)
    hands each adapter's tensors to the transformers engine; the engine samples with exactly the
    trainer's version (the log-prob check), and only the last version is written."""
    from pipeline.config.io import load_config

    cfg = load_config(None, {
        "out": str(tmp_path / "run"), "model.warm_start": False, "trainer.publish": "memory",
        "trainer.separate_process": separate_process, "pipeline.steps": 6, "pipeline.batch_groups": 4,
        "sampling.n": 4, "pipeline.max_staleness": 1, "pipeline.logprob_check_every": 2, "eval.every": 0,
        "log.progress": False})
    p = Pipeline(cfg, console=False)
    summary = p.run_sync()
    assert summary["error"] is None and summary["steps"] == 6 and summary["accounting_ok"], summary
    checks = {r["step"]: r["check/mean_abs_diff"] for r in p.metrics_rows if "check/mean_abs_diff" in r}
    # steps 3 and 5 check groups sampled with versions >= 1, which reached the engine in memory only
    assert sorted(checks) == [1, 3, 5] and max(checks.values()) < 1e-4, checks  # float32 both sides
    store = AdapterStore(p.run_dir / "adapters", base_model="", kind="lora", readonly=True)
    assert store.versions() == [6]


# --------------------------------------------------------------------------- pipeline.full_weight_swap = "in_flight"


class CheckedGroups(SimulatedTrainer):
    """Notes the groups each log-prob check recomputes."""

    checked: list = []

    def recompute_logprobs(self, groups):
        self.checked = [*self.checked, *groups]
        return super().recompute_logprobs(groups)


def in_flight_config(tmp_path, K: int, steps: int, **extra):
    # a group takes 5 trainer steps' time: every swap lands while groups run
    return sim_config(tmp_path, K=K, B=3, n=2, steps=steps, latency=0.02, concurrency=3, step_s=0.004,
                      **{"trainer.update": "full", "pipeline.full_weight_swap": "in_flight",
                         "engine.devices": ["cpu", "cpu"], "pipeline.logprob_check_every": 1, **extra})


@pytest.mark.parametrize("K", [1, 2])
def test_in_flight_swaps_load_each_version_while_groups_run_and_label_them_with_their_first(tmp_path, monkeypatch, K):
    """No admission pause and no drain: the engines take each version while their groups run; such a
    group keeps the version it started with as its label (its staleness counts from there, within K)
    and names the newer one it ended on; the log-prob checks take only groups of one version."""
    from pipeline.loop.buffer import RolloutBuffer

    def no_pause(self):
        raise AssertionError("admission paused for a drain")

    monkeypatch.setattr(RolloutBuffer, "pause_admission", no_pause)
    loads_while_running = []
    swap = SimulatedEngine._swap_weights

    def noted(self, adapter):
        loads_while_running.append(self._calls)
        swap(self, adapter)

    monkeypatch.setattr(SimulatedEngine, "_swap_weights", noted)
    trainer = CheckedGroups(step_s=0.004, update="full")
    p = Pipeline(in_flight_config(tmp_path, K, steps=12), prompts=PROMPTS * 2, reward=length_reward, trainer=trainer,
                 tokenizer=False, console=False)
    summary = p.run_sync()
    assert summary["error"] is None and summary["steps"] == 12, summary
    assert summary["groups_failed"] == {} and summary["generation_retries"] == 0, summary
    r = assert_accounted(p, summary)
    assert max(loads_while_running) > 0, loads_while_running  # versions were taken mid-group
    trained = r.groups["fate"] == "trained"  # rollouts.zarr names the newest version of each group
    assert (r.groups["last_version"][trained] >= r.groups["version"][trained]).all()
    assert int((r.groups["last_version"] > r.groups["version"])[trained].sum()) == summary["groups_spanning_versions"]
    rows = read_jsonl(p.run_dir / "metrics.jsonl")
    spanning = summary["groups_spanning_versions"]
    assert spanning == sum(r["rollout/spanning_versions"] for r in rows) > 0, rows
    assert summary["staleness_max"] <= K  # counted from each group's first version
    for r in rows:
        assert r["staleness_max"] <= K
    assert trainer.checked and not any(g.generation.spans_versions for g in trainer.checked)
    assert all(g.generation.last_version >= g.version for g in trainer.checked)


def test_a_drained_full_weight_run_has_no_group_spanning_versions(tmp_path):
    p, summary = run(in_flight_config(tmp_path, 1, steps=8, **{"pipeline.full_weight_swap": "drain"}),
                     prompts=PROMPTS * 2)
    assert summary["error"] is None and summary["groups_spanning_versions"] == 0, summary
    assert all(r["rollout/spanning_versions"] == 0 for r in read_jsonl(p.run_dir / "metrics.jsonl"))


@pytest.mark.parametrize("override,message", [
    ({"trainer.update": "lora"}, 'with trainer.update = "lora" every version loads beside the others'),
    ({"engine.kind": "transformers"}, 'needs engine.kind = "vllm" .*got \'transformers\''),
    ({"deterministic": True}, "deterministic = true cannot be combined with pipeline.full_weight_swap"),
])
def test_in_flight_swaps_without_what_they_need_are_refused_naming_the_key(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        in_flight_config(tmp_path, 1, steps=2, **override)
