"""A generation labelled with another version than its group was admitted with is never trained.

Scoring fails such a group (reason "version_mismatch", counted as `version_mismatches`) before
it is scored or buffered: a group trained under the wrong version would have its importance
ratios computed against weights it was not sampled with. No engine of the package breaks the
contract, so an engine here does, for some groups, in a real run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

from conftest import assert_accounted, sim_config

from pipeline.config.schema import SimulatedEngineConfig
from pipeline.engines.simulated import SimulatedEngine
from pipeline.observe.metrics import read_jsonl
from pipeline.loop.orchestrator import Pipeline
from pipeline.types import AdapterRef, Generation, GroupRequest

PROMPTS = [{"id": f"p{i}", "prompt": f"prompt {i}", "token_ids": [1 + i % 50, 2, 3]} for i in range(64)]
STEPS, B = 6, 2


def reward(prompts, completions, completion_ids, **kw):
    return [float(sum(ids) % 7) for ids in completion_ids]


class MislabellingEngine(SimulatedEngine):
    """The simulated engine, but a group whose id is divisible by 3 comes back labelled with the
    version after the one it was asked for (id 3, 9, ...: the one before, where there is one)."""

    def __init__(self, cfg: SimulatedEngineConfig) -> None:
        super().__init__(cfg, name="mislabelling")
        self.reported: dict[int, tuple[int, int]] = {}  # group id -> (version asked for, version reported)

    def _label(self, gen: Generation, asked: int) -> Generation:
        gid = gen.request.group_id
        if gid % 3 == 0:
            shift = -1 if gid % 2 and asked > 0 else 1
            gen = dataclasses.replace(gen, version=asked + shift)
        self.reported[gid] = (asked, gen.version)
        return gen

    async def generate(self, request: GroupRequest, adapter: AdapterRef) -> Generation:
        return self._label(await super().generate(request, adapter), adapter.version)

    async def generate_many(self, requests: Sequence[GroupRequest],
                            adapter: AdapterRef) -> list[Generation | Exception]:
        return [r if isinstance(r, Exception) else self._label(r, adapter.version)
                for r in await super().generate_many(requests, adapter)]


def test_a_group_reported_with_another_version_fails_and_is_never_trained(tmp_path: Path) -> None:
    cfg = sim_config(tmp_path, K=1, B=B, steps=STEPS, latency=0.002)
    engine = MislabellingEngine(SimulatedEngineConfig(latency_s=0.002, completion_tokens=4))
    p = Pipeline(cfg, prompts=PROMPTS, reward=reward, tokenizer=False, console=False, engines=[engine])
    summary = p.run_sync()

    assert summary["error"] is None and summary["steps"] == STEPS, summary
    r = assert_accounted(p, summary)
    mislabelled = {gid for gid, (asked, got) in engine.reported.items() if got != asked}
    assert {engine.reported[g][1] - engine.reported[g][0] for g in mislabelled} == {-1, 1}  # both ways were tried
    fate = dict(zip(r.groups["group_id"].tolist(), zip(r.groups["fate"].tolist(), r.groups["reason"].tolist())))
    failed = {g for g, (f, why) in fate.items() if (f, why) == ("failed", "version_mismatch")}
    # every mislabelled group the run took in failed as a mismatch (one still running at the end
    # was dropped at shutdown), and nothing else failed so
    assert len(failed) >= 4 and failed <= mislabelled, (sorted(failed), sorted(mislabelled))
    assert all(fate[g] in {("failed", "version_mismatch"), ("dropped", "shutdown")} for g in mislabelled), \
        {g: fate[g] for g in mislabelled}
    assert summary["version_mismatches"] == len(failed) == summary["groups_failed"]["version_mismatch"]
    assert 0 < read_jsonl(p.run_dir / "metrics.jsonl")[-1]["rollout/version_mismatch"] <= len(failed)  # so far
    broken = [e for e in read_jsonl(p.run_dir / "events.jsonl") if e["event"] == "generation_contract_broken"]
    assert {e["group_id"] for e in broken} == failed and all(e["got_version"] != e["asked_version"] for e in broken)

    # what was trained came back with the version it was admitted (and logged) with
    trained = [(g, v) for g, v, f in zip(r.groups["group_id"].tolist(), r.groups["version"].tolist(),
                                         r.groups["fate"].tolist()) if f == "trained"]
    assert len(trained) == STEPS * B
    assert all(engine.reported[g] == (v, v) for g, v in trained), \
        [(g, v, engine.reported[g]) for g, v in trained if engine.reported[g] != (v, v)]
