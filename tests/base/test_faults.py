"""Faults the run survives (engine errors, hangs, deaths; bad adapters; a diverging trainer) and a soak."""

from __future__ import annotations

import asyncio
import gc
import os
from collections import Counter
from pathlib import Path

import conftest
import numpy as np
import pytest
from conftest import assert_accounted

from pipeline.store.checkpoint import CheckpointStore
from pipeline.config.schema import SimulatedEngineConfig
from pipeline.engines.simulated import SimulatedEngine
from pipeline.errors import AdapterCorruptError, AdapterError, EngineDeadError, TrainerError
from pipeline.observe.metrics import read_jsonl
from pipeline.loop.orchestrator import Pipeline
from pipeline.store.rollout_log import read_rollouts
from pipeline.trainer.simulated import SimulatedTrainer

PROMPTS = [{"id": f"p{i}", "prompt": f"prompt {i}", "token_ids": [1 + i % 50, 2, 3]} for i in range(64)]


def reward(prompts, completions, completion_ids, **kw):
    return [float(sum(ids) % 7) for ids in completion_ids]


def sim_config(tmp_path: Path, **overrides):
    """conftest's simulated run as the fault tests take it: 20 steps of 4 groups, a 2 ms engine, quick retries."""
    return conftest.sim_config(tmp_path, B=4, steps=20, latency=0.002,
                               **{"engine.retry_backoff_s": 0.001, **overrides})


def run(cfg, **kw) -> tuple[Pipeline, dict]:
    p = Pipeline(cfg, prompts=PROMPTS, reward=reward, tokenizer=False, console=False, **kw)
    return p, p.run_sync()


def test_injected_failures_and_hangs_are_retried_and_counted(tmp_path: Path) -> None:
    cfg = sim_config(tmp_path, **{"pipeline.steps": 40, "engine.simulated.fail_rate": 0.10,
                                  "engine.simulated.hang_rate": 0.02, "engine.request_timeout_s": 0.1,
                                  "engine.retries": 1, "engine.max_consecutive_errors": 1000})
    p, s = run(cfg)
    assert s["error"] is None and s["steps"] == 40
    assert_accounted(p, s)
    st = p.engines[0].stats
    assert st["injected_failures"] > 0 and st["injected_hangs"] > 0
    failed = sum(s["groups_failed"].values())
    # each injected failure, and each group of a hung call, is one failed attempt: followed by a
    # retry, or the last attempt of a failed group
    assert st["injected_failures"] + st["hung_groups"] == s["generation_retries"] + failed
    events = read_jsonl(p.run_dir / "events.jsonl")
    retried = Counter(e["group_id"] for e in events if e["event"] == "generation_retry")
    gave_up = [e["group_id"] for e in events if e["event"] == "group_failed"]
    assert len(gave_up) == failed and all(retried[g] == cfg.engine.retries for g in gave_up)
    r = read_rollouts(p.run_dir / "rollouts.zarr")
    reasons = set(r.groups["reason"][r.groups["fate"] == "failed"].tolist())
    assert reasons <= {"generation_error", "generation_timeout"}
    assert (r.groups["fate"] == "trained").sum() == 40 * 4  # failures gave their slots back: no step starved
    print(f"faults: {st['requests']} groups asked for, {st['injected_failures']} raised and {st['injected_hangs']} calls "
          f"hung with {st['hung_groups']} groups (injected); {s['generation_retries']} retries; {failed} groups failed after {cfg.engine.retries + 1} "
          f"attempts; {s['groups_trained']} trained; accounting ok")


def test_a_dead_engine_leaves_the_rotation_and_the_other_finishes(tmp_path: Path) -> None:
    cfg = sim_config(tmp_path, **{"pipeline.steps": 12})
    good = SimulatedEngine(SimulatedEngineConfig(latency_s=0.002, completion_tokens=4), name="good")
    dying = SimulatedEngine(SimulatedEngineConfig(latency_s=0.002, completion_tokens=4), name="dying", seed=1)

    async def main() -> tuple[Pipeline, dict]:
        p = Pipeline(cfg, prompts=PROMPTS, reward=reward, tokenizer=False, console=False, engines=[good, dying])
        async for res in p.steps():
            if res.step == 3:
                await dying.close()  # every later call raises EngineDeadError
        return p, p.summary

    p, s = asyncio.run(main())
    assert s["error"] is None and s["steps"] == 12
    assert s["engines_out_of_rotation"] == ["dying"]
    assert sum(s["groups_failed"].values()) == 0  # its groups went to the other engine
    assert_accounted(p, s)


def test_no_engine_left_is_a_clear_error_and_keeps_what_was_produced(tmp_path: Path) -> None:
    cfg = sim_config(tmp_path, **{"pipeline.steps": 12})
    engine = SimulatedEngine(SimulatedEngineConfig(latency_s=0.002, completion_tokens=4), name="only")

    async def main() -> Pipeline:
        p = Pipeline(cfg, prompts=PROMPTS, reward=reward, tokenizer=False, console=False, engines=[engine])
        with pytest.raises(EngineDeadError, match="no engine is left in rotation"):
            async for res in p.steps():
                if res.step == 2:
                    await engine.close()
        return p

    p = asyncio.run(main())
    assert p.summary["steps"] >= 2
    assert_accounted(p, p.summary)


def test_a_hung_engine_is_found_by_its_timeouts(tmp_path: Path) -> None:
    cfg = sim_config(tmp_path, **{"pipeline.steps": 10, "engine.request_timeout_s": 0.05,
                                  "engine.max_consecutive_errors": 3})
    good = SimulatedEngine(SimulatedEngineConfig(latency_s=0.002, completion_tokens=4), name="good")
    hung = SimulatedEngine(SimulatedEngineConfig(hang_rate=1.0, completion_tokens=4), name="hung", seed=1)
    p, s = run(cfg, engines=[good, hung])
    assert s["error"] is None and s["steps"] == 10
    assert s["engines_out_of_rotation"] == ["hung"]
    # three timeouts in a row take it out; only calls already sent to it (at most the live groups) hang
    assert 3 <= hung.stats["injected_hangs"] <= (cfg.pipeline.max_staleness + 1) * cfg.pipeline.batch_groups
    r = read_rollouts(p.run_dir / "rollouts.zarr")
    assert set(r.groups["engine"][r.groups["fate"] == "trained"].tolist()) == {"good"}
    assert_accounted(p, s)


class DivergingTrainer(SimulatedTrainer):
    """Steps 3 onwards have a non-finite loss (skipped, as PolicyTrainer skips them)."""

    def step(self, batch):
        stats = super().step(batch)
        if batch.step >= 3:
            self.skipped_steps += 1
            self.consecutive_skips += 1
        return stats


def test_repeated_non_finite_steps_stop_the_run_after_a_checkpoint(tmp_path: Path) -> None:
    cfg = sim_config(tmp_path, **{"trainer.max_consecutive_skips": 3, "pipeline.checkpoint_every": 0})
    p = Pipeline(cfg, prompts=PROMPTS, reward=reward, tokenizer=False, console=False, trainer=DivergingTrainer())
    with pytest.raises(TrainerError, match="3 training steps in a row had a non-finite"):
        p.run_sync()
    assert p.summary["steps"] == 5 and p.summary["checkpoint_step"] == 5
    assert CheckpointStore(p.run_dir / "checkpoints").latest().step == 5
    assert_accounted(p, p.summary)


def _corrupt_versions(p: Pipeline, bad: set[int]) -> None:
    real = p.store.verify_dir

    def verify(path):
        ref = real(path)
        if ref.version in bad:
            raise AdapterCorruptError(f"{path}: adapter_model.safetensors does not match its sha256")
        return ref

    p.store.verify_dir = verify


def test_a_corrupt_version_is_refused_and_the_last_good_one_served(tmp_path: Path) -> None:
    # the adapter loop takes the newest version published: with instant steps it could find 4
    # already there and never try 3; 20 ms steps give it time to meet each version in turn
    cfg = sim_config(tmp_path, **{"pipeline.max_staleness": 2, "pipeline.steps": 10, "trainer.step_s": 0.02})

    async def main() -> tuple[Pipeline, dict]:
        p = Pipeline(cfg, prompts=PROMPTS, reward=reward, tokenizer=False, console=False)
        it = p.steps()
        async for res in it:
            if res.step == 1:
                _corrupt_versions(p, {3})
        return p, p.summary

    p, s = asyncio.run(main())
    assert s["error"] is None and s["steps"] == 10
    assert list(s["adapter_load_failures"]) == [3]
    r = read_rollouts(p.run_dir / "rollouts.zarr")
    assert 3 not in set(r.groups["version"].tolist())  # nothing was ever sampled with the refused version
    assert_accounted(p, s)


def test_corrupt_versions_beyond_the_staleness_bound_stop_the_run_clearly(tmp_path: Path) -> None:
    cfg = sim_config(tmp_path, **{"pipeline.max_staleness": 1, "pipeline.steps": 10})

    async def main() -> Pipeline:
        p = Pipeline(cfg, prompts=PROMPTS, reward=reward, tokenizer=False, console=False)
        with pytest.raises(AdapterError, match=r"engines could not load adapter versions 2\.\.3"):
            async for res in p.steps():
                if res.step == 1:
                    _corrupt_versions(p, {2, 3, 4, 5, 6})
        return p

    p = asyncio.run(main())
    assert_accounted(p, p.summary)


def _open_files() -> list[str]:
    """What this process's file descriptors point at (sockets and pipes show as such).

    Leaves out matplotlib's font files: it caches an open font per thread that draws (the report
    is drawn in a worker thread), at most 64 of them, so they are bounded, not leaked.
    """
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the fd of the listdir itself, closed by now
            continue
        if "mpl-data/fonts" not in target:
            out.append(target)
    return out


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_soak_10000_groups_memory_flat_buffer_bounded_nothing_leaked(tmp_path: Path) -> None:
    B, K, steps = 16, 2, 625  # 10,000 groups
    cfg = sim_config(tmp_path, **{"pipeline.steps": steps, "pipeline.batch_groups": B, "pipeline.max_staleness": K,
                                  "engine.simulated.latency_s": 0.0, "pipeline.checkpoint_every": 50})
    prompts = [{"id": f"p{i}", "prompt": "", "token_ids": [1 + i % 90, 2, 3]} for i in range(1000)]
    # a short run first: libraries open what they cache for the process (matplotlib keeps its fonts open)
    run(sim_config(tmp_path / "warm", **{"pipeline.steps": 2}))
    gc.collect()
    fds_before = _open_files()
    rss: dict[int, int] = {}
    peak = {"live": 0, "buffered": 0}

    async def main() -> Pipeline:
        p = Pipeline(cfg, prompts=prompts, reward=reward, tokenizer=False, console=False)
        async for res in p.steps():
            c = p.buffer.counts
            peak["live"] = max(peak["live"], c.in_flight + c.buffered + c.training)
            peak["buffered"] = max(peak["buffered"], c.buffered)
            if res.step in (125, steps):
                gc.collect()
                rss[res.step] = _rss_bytes()
        await asyncio.sleep(0)
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
        return p

    p = asyncio.run(main())
    s = p.summary
    assert s["groups_trained"] == 10_000 and s["accounting_ok"]
    growth = rss[steps] / rss[125] - 1
    print(f"soak: 10,000 groups, RSS {rss[125] / 2**20:.1f} MiB after warm-up -> {rss[steps] / 2**20:.1f} MiB "
          f"at the end ({growth:+.1%}); peak live {peak['live']}, peak buffered {peak['buffered']}")
    assert growth < 0.10, f"resident memory grew {growth:.1%} after warm-up"
    assert peak["buffered"] <= cfg.pipeline.capacity and peak["live"] <= (K + 1) * B
    rows = read_jsonl(p.run_dir / "metrics.jsonl")
    assert max(r["rollout/buffered"] for r in rows) <= cfg.pipeline.capacity
    gc.collect()
    fds_after = _open_files()
    assert len(fds_after) <= len(fds_before), f"file handles leaked: {sorted(fds_after)} against {sorted(fds_before)} before"
    assert np.isfinite(s["groups_per_s"])


class BuggyEngine(SimulatedEngine):
    """An engine with a programming error: its calls raise TypeError, which no retry can cure."""

    asked: list[int] = []

    async def generate_many(self, requests, adapter):
        self.asked.extend(r.group_id for r in requests)
        raise TypeError("unsupported operand type(s) for +: 'int' and 'str'")


def test_a_bug_inside_an_engine_call_ends_the_run_and_is_not_retried(tmp_path: Path) -> None:
    engine = BuggyEngine(SimulatedEngineConfig(completion_tokens=4), name="buggy")
    engine.asked = []
    cfg = conftest.sim_config(tmp_path, **{"engine.retries": 3})
    p = Pipeline(cfg, prompts=PROMPTS, reward=reward, tokenizer=False, console=False, engines=[engine])
    with pytest.raises(TypeError, match="unsupported operand"):
        p.run_sync()
    # no group asked for twice: a TypeError is a bug, not a failed generation to retry
    assert engine.asked and len(engine.asked) == len(set(engine.asked))
    assert p.summary["generation_retries"] == 0 and p.summary["accounting_ok"], p.summary
