"""Full-weight updates through the Pipeline (trainer.update = "full"), with the simulated engine.

The simulated engine in full-weight mode holds one version and refuses a group of another
version or a load while its groups run, so a drain bug in the orchestrator fails a group here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_accounted, sim_config
from test_orchestrator import PROMPTS, run

from pipeline.errors import ConfigError
from pipeline.observe.metrics import read_jsonl


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
