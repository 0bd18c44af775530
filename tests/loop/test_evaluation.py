"""Evaluation: rounds at step 0, every eval.every steps and at the end, on the engines at the
current version, logged with fate "eval", never trained and outside the training accounting."""

from __future__ import annotations

import asyncio
from collections import Counter
from itertools import combinations
from math import comb

import numpy as np
import pytest
from conftest import sim_config
from hypothesis import given
from hypothesis import strategies as st
from test_orchestrator import PROMPTS, length_reward

from pipeline.config.schema import SimulatedEngineConfig
from pipeline.engines.simulated import SimulatedEngine
from pipeline.errors import ConfigError, GenerationError
from pipeline.loop.evaluation import eval_group_id, is_due, pass_at_k
from pipeline.observe.metrics import read_jsonl
from pipeline.loop.orchestrator import Pipeline
from pipeline.store.rollout_log import read_rollouts

# length_reward gives 4 + label % 3 to every completion (the simulated engine samples 4 tokens):
# labels 0..4 score 4, 5, 6, 4, 5, so at threshold 5 three prompts of five always pass
EVAL = [{"id": f"e{i}", "prompt": f"eval {i}", "token_ids": [5, 6, 7], "label": i} for i in range(5)]


@given(n=st.integers(1, 9), data=st.data())
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_pass(n: int, data) -> None:
    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    samples = [True] * c + [False] * (n - c)
    subsets = list(combinations(samples, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k))


def test_pass_at_1_is_the_pass_rate_and_bad_arguments_are_refused() -> None:
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_rounds_come_at_step_zero_every_few_steps_and_at_the_end() -> None:
    assert [s for s in range(0, 8) if is_due(s, 3, 7)] == [0, 3, 6, 7]
    assert not any(is_due(s, 0, 7) for s in range(8))
    ids = {eval_group_id(s, i) for s in range(8) for i in range(5)}
    assert len(ids) == 40 and max(ids) < 0
    # unique whatever a round's size: a resumed run may evaluate a larger set than its first session
    assert {eval_group_id(2, i) for i in range(10)}.isdisjoint({eval_group_id(4, i) for i in range(5)})


def _run(tmp, engines=None, eval_prompts=EVAL, **extra):
    overrides = {"eval.every": 2, "eval.n": 3, "eval.pass_threshold": 5.0, **extra}
    steps = overrides.pop("steps", 6)
    cfg = sim_config(tmp, K=overrides.pop("K", 1), B=2, n=2, steps=steps, **overrides)
    p = Pipeline(cfg, prompts=PROMPTS, reward=length_reward, tokenizer=False, console=False, engines=engines,
                 eval_prompts=eval_prompts)
    return p, p.run_sync()


def _eval_rows(p):
    return [r for r in read_jsonl(p.run_dir / "metrics.jsonl") if "eval/groups" in r]


def test_eval_rounds_are_logged_scored_and_never_trained(tmp_path) -> None:
    p, summary = _run(tmp_path)
    rows = _eval_rows(p)
    assert [r["step"] for r in rows] == [0, 2, 4, 6]
    for r in rows:
        assert r["version"] >= r["step"]  # the policy of its step, or a newer one already served
        assert r["eval/groups"] == 5 and r["eval/failed"] == 0
        assert r["eval/reward_mean"] == pytest.approx(np.mean([4, 5, 6, 4, 5]))
        assert r["eval/pass@1"] == pytest.approx(0.6) and r["eval/pass@3"] == pytest.approx(0.6)
    log = read_rollouts(p.run_dir / "rollouts.zarr")
    fates = log.groups["fate"].tolist()
    assert Counter(fates)["eval"] == 4 * 5
    ev = np.array([f == "eval" for f in fates])
    assert (log.groups["group_id"][ev] < 0).all() and (log.groups["group_id"][~ev] >= 0).all()
    assert set(log.groups["prompt_id"][ev]) == {e["id"] for e in EVAL}
    assert set(log.groups["prompt_id"][~ev]).isdisjoint({e["id"] for e in EVAL})  # never trained
    assert log.groups["comp_count"][ev].tolist() == [3] * 20
    for r in rows:  # each round's groups were sampled with the version its row names
        mine = ev & (log.groups["step"] == r["step"])
        assert set(log.groups["version"][mine].tolist()) == {r["version"]}
    # outside the training accounting
    assert summary["accounting_ok"] and summary["groups_started"] == summary["groups_trained"] == 12
    assert summary["groups_logged"] == 12 and summary["eval_groups_logged"] == 20 and summary["eval_rounds"] == 4
    assert all("eval/groups" not in r for r in p.metrics_rows)


class SlowEvalEngine(SimulatedEngine):
    """Eval calls take long, and fail if their version was unloaded while they ran."""

    async def generate_many(self, requests, adapter):
        out = await super().generate_many(requests, adapter)
        if requests[0].group_id < 0:
            await asyncio.sleep(0.03)
            held = {self._weights.version} if self.full_weights else self.loaded_versions
            if adapter.version not in held:
                raise GenerationError(f"version {adapter.version} was unloaded during an eval call")
        return out


def test_a_version_stays_loaded_until_its_rounds_last_call_returns(tmp_path) -> None:
    engine = SlowEvalEngine(SimulatedEngineConfig(completion_tokens=4), name="slow-eval")
    p, summary = _run(tmp_path, engines=[engine], K=0, steps=8, **{"eval.every": 1, "engine.retries": 0})
    rows = _eval_rows(p)
    assert len(rows) == 9 and all(r["eval/failed"] == 0 for r in rows), rows
    assert summary["accounting_ok"]


@pytest.mark.parametrize("swap", ["drain", "in_flight"])
def test_eval_with_full_weight_updates_never_samples_across_a_swap(tmp_path, swap) -> None:
    """An eval round scores one version: a swap waits for it, whether training groups drain or not."""
    engine = SlowEvalEngine(SimulatedEngineConfig(completion_tokens=4), name="slow-eval", full_weights=True,
                            in_flight=swap == "in_flight")
    p, summary = _run(tmp_path, engines=[engine], steps=8, **{"trainer.update": "full", "engine.retries": 0,
                                                               "eval.every": 1, "pipeline.full_weight_swap": swap})
    rows = _eval_rows(p)
    assert [r["step"] for r in rows] == list(range(9)) and all(r["eval/failed"] == 0 for r in rows), rows
    assert summary["accounting_ok"] and summary["version_mismatches"] == 0


def test_every_eval_prompt_refused_ends_the_run_with_a_config_error(tmp_path) -> None:
    bad = [{"id": "e", "prompt": "x", "token_ids": []}]
    with pytest.raises(ConfigError, match=r"every one of the 1 eval prompts was refused \(empty: 1\)"):
        _run(tmp_path, eval_prompts=bad)


def test_eval_every_without_eval_prompts_is_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no eval prompts"):
        _run(tmp_path, eval_prompts=[])


def test_a_resumed_run_keeps_the_rounds_its_checkpoint_covers_and_adds_the_rest(tmp_path) -> None:
    p, _ = _run(tmp_path, steps=4)
    assert [r["step"] for r in _eval_rows(p)] == [0, 2, 4]
    cfg = sim_config(tmp_path, K=1, B=2, n=2, steps=8, **{"eval.every": 2, "eval.n": 3, "eval.pass_threshold": 5.0})
    p2 = Pipeline(cfg, prompts=PROMPTS, reward=length_reward, tokenizer=False, console=False, eval_prompts=EVAL,
                  resume=True)
    summary = p2.run_sync()
    assert [r["step"] for r in _eval_rows(p2)] == [0, 2, 4, 6, 8]
    log = read_rollouts(p2.run_dir / "rollouts.zarr")
    ev = log.groups["fate"] == "eval"
    assert ev.sum() == 25 and len(set(log.groups["group_id"].tolist())) == log.num_groups
    assert summary["accounting_ok"] and summary["eval_rounds"] == 5
