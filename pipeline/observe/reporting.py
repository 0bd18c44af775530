"""Reporting: each step's metrics row, the run's summary and report.png, from the components' own counts.

A component's counter reaches Reporting as a `Count` the component increments and the
orchestrator hands to `watch` by name (`retries`, `version_mismatches`): Reporting reads the
counts, never the component that keeps them.

Invariants:
- Every metrics row (a training step's or an evaluation round's) goes to metrics.jsonl and then
  to the trackers, at its step (`write`).
- The run's totals count every session: this session's buffer counts plus the fates of earlier
  sessions that the checkpoint's ledger carried (`base`). `accounting_ok` holds when nothing is
  live, started = trained + dropped + failed, and the RolloutLog holds each started group once
  (eval groups counted apart).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import structlog

from pipeline.loop.buffer import RolloutBuffer
from pipeline.config.schema import RunConfig
from pipeline.store.ledger import Ledger
from pipeline.observe.metrics import BusyMeter, Count, LoopLagMonitor, MetricsWriter
from pipeline.store.rollout_log import RolloutLog
from pipeline.loop.rotation import EngineRotation
from pipeline.observe.trackers import Trackers, open_trackers
from pipeline.types import AdapterRef, Batch
from pipeline.loop.versions import Versions

log = structlog.get_logger(__name__)


class Reporting:
    """Metrics rows, the summary and the report of one session, over every session of the run."""

    def __init__(self, *, run_dir: Path, metrics: MetricsWriter, trackers: Trackers | None,
                 rows: list[dict[str, Any]], base: Mapping[str, int], wall0: float, lag: LoopLagMonitor,
                 timeline: dict[str, list[tuple[float, float]]]) -> None:
        self.run_dir = run_dir
        self.metrics = metrics
        self.trackers = trackers
        self.trainer_busy = BusyMeter()  # entered by Training around each step
        self.rows = rows  # one per training step, earlier sessions' kept ones first
        self.base = Counter(base)  # groups of earlier sessions, by fate (the checkpoint's ledger)
        self.wall0 = wall0  # wall seconds of earlier sessions
        self.lag = lag
        self.timeline = timeline
        self.t_start = time.monotonic()
        self._busy0: dict[str, float] = {}
        # the components whose counts the rows and the summary read; set by `watch` once they exist
        self.buffer: RolloutBuffer | None = None
        self.rotation: EngineRotation | None = None
        self.versions: Versions | None = None
        self.retries = Count()  # generation attempts retried (the Generator's)
        self.version_mismatches = Count()  # generations of another version than their group's (Scoring's)
        self.reward_names: list[str] = []
        self.full_weights = False

    @classmethod
    async def open(cls, cfg: RunConfig, run_dir: Path, **kwargs: Any) -> Reporting:
        """metrics.jsonl (appended to) and the trackers of log.trackers, opened in a thread (wandb starts
        a process); `kwargs` as the constructor's."""
        trackers = await asyncio.to_thread(open_trackers, cfg.log.trackers, run_dir,
                                           replace(cfg, out=str(run_dir))) if cfg.log.trackers else None
        return cls(run_dir=run_dir, metrics=MetricsWriter(run_dir / "metrics.jsonl"), trackers=trackers, **kwargs)

    def watch(self, *, buffer: RolloutBuffer, rotation: EngineRotation, versions: Versions, retries: Count,
              version_mismatches: Count, reward_names: list[str], full_weights: bool) -> None:
        self.buffer, self.rotation, self.versions = buffer, rotation, versions
        self.retries, self.version_mismatches = retries, version_mismatches
        self.reward_names, self.full_weights = reward_names, full_weights

    def start(self) -> None:
        """The session's clock starts: busy time counts from here (engines may have served earlier runs)."""
        self.t_start = time.monotonic()
        self._busy0 = {e.name: e.busy.busy_total() for e in self.rotation.engines}

    def write(self, row: dict[str, Any]) -> None:
        """A metrics row to metrics.jsonl, then to the trackers (log.trackers) at its step."""
        self.metrics.write(row)
        if self.trackers is not None:
            self.trackers.log(row, step=row["step"])

    def step_row(self, batch: Batch, train: Mapping[str, float], check: Mapping[str, float],
                 times: Mapping[str, float], ref: AdapterRef) -> dict[str, Any]:
        """The metrics.jsonl row of a step; `times` are its time/* parts (training.Training measures them)."""
        wall = time.monotonic() - self.t_start
        stal = batch.staleness
        rewards = np.concatenate([g.rewards for g in batch.groups])
        reward_mean = float(rewards.mean())
        dev = rewards - reward_mean
        c = self.buffer.counts
        started, trained, dropped, failed = self.totals()
        row: dict[str, Any] = {
            "step": batch.step, "version": ref.version, "wall_s": self.wall0 + wall,
            "reward_mean": reward_mean, "reward_std": math.sqrt(float(dev @ dev) / dev.size),
            "staleness_max": int(max(stal)), "staleness_mean": sum(stal) / len(stal),
            "groups": len(batch.groups), "tokens": batch.num_tokens,
            "rollout/started": started, "rollout/trained": trained, "rollout/in_flight": c.in_flight,
            "rollout/buffered": c.buffered, "rollout/dropped": sum(dropped.values()),
            "rollout/failed": sum(failed.values()), "rollout/version_mismatch": self.version_mismatches.value,
            "rollout/retries": self.retries.value,
            "engine/in_rotation": len(self.rotation.healthy),
            "rollout/versions_verified": len(batch.groups),
            **times,
            **self.versions.metrics(ref.version - 1),
            "busy/generator": self.generator_busy() / max(wall, 1e-9),
            "busy/trainer": self.trainer_busy.busy_total() / max(wall, 1e-9),
            "loop/lag_p99_ms": self.lag.percentile_ms(99, last=2000),
        }
        if self.full_weights:  # how long admission waited for the drain before the load
            row["adapter/drain_s"] = self.versions.drain_s.get(ref.version - 1, float("nan"))
            # in-flight swaps: the batch's groups whose tokens a newer version's weights sampled in part
            row["rollout/spanning_versions"] = sum(g.generation.spans_versions for g in batch.groups)
        parts = [g.reward_parts for g in batch.groups if g.reward_parts is not None]
        if len(parts) == len(batch.groups):  # each function's own mean, beside the weighted reward_mean
            means = np.concatenate(parts, axis=1).mean(axis=1)
            row.update({f"reward/{name}": float(m) for name, m in zip(self.reward_names, means)})
        row.update(train)
        row.update(check)
        return row

    def generator_busy(self) -> float:
        """Busy seconds of the generation tier: mean over engines of each engine's own busy time."""
        return float(np.mean([e.busy.busy_total() - self._busy0.get(e.name, 0.0) for e in self.rotation.engines]))

    def totals(self) -> tuple[int, int, Counter[str], Counter[str]]:
        """Groups started, trained, dropped and failed (by reason) over the whole run, every session."""
        c = self.buffer.counts
        dropped, failed = Counter(c.dropped), Counter(c.failed)
        for key, n in self.base.items():
            fate, _, reason = key.partition(":")
            if fate == "dropped":
                dropped[reason] += n
            elif fate == "failed":
                failed[reason] += n
        trained = c.trained + self.base["trained"]
        started = c.started + sum(n for k, n in self.base.items() if k != "refused")
        return started, trained, dropped, failed

    def summary(self, *, wall: float, error: BaseException | None, setup_s: float, setup: dict[str, float],
                ledger: Ledger,
                rollout_log: RolloutLog, eval_rows: list[dict[str, Any]], start_step: int, resumed: bool,
                checkpoint_step: int | None, stopped_by: str | None) -> dict[str, Any]:
        c = self.buffer.counts
        rows = self.rows
        window = max(1, len(rows) // 5)
        session_rows = [r for r in rows if r["step"] > start_step]
        trained_tokens = sum(r["tokens"] for r in session_rows)
        eval_logged = rollout_log.counts()["eval"]
        logged = len(rollout_log) - eval_logged
        started, trained, dropped, failed = self.totals()
        live = c.in_flight + c.buffered + c.training
        versions = self.versions
        session_wall = max(wall, 1e-9)
        total_wall = max(self.wall0 + wall, 1e-9)
        return {
            # steps, wall_s and the rates cover the whole run, every session; "session" this one alone
            "steps": len(rows),
            "wall_s": self.wall0 + wall,
            "setup_s": setup_s,
            "setup": dict(setup),  # its parts: data_s, model_s, tokenizer_s (beside the starts), engines_start_s, trainer_start_s
            "groups_started": started,
            "groups_trained": trained,
            "groups_dropped": dict(dropped),
            "groups_failed": dict(failed),
            "groups_logged": logged,
            "eval_groups_logged": eval_logged,
            "eval_rounds": len(eval_rows),
            "eval_first": eval_rows[0] if eval_rows else None,
            "eval_final": eval_rows[-1] if eval_rows else None,
            "prompts_refused": ledger.fates["refused"],
            "accounting_ok": live == 0 and started == trained + sum(dropped.values()) + sum(failed.values())
            and logged == started,
            "ledger": {"cursor": ledger.cursor, **ledger.states()},
            "resumed_from_step": start_step if resumed else None,
            "checkpoint_step": checkpoint_step,
            "stopped_by": stopped_by,
            **self.rotation.summary(),
            "adapter_load_failures": dict(versions.load_failures),
            "generation_retries": self.retries.value,
            "groups_per_s": trained / total_wall,
            "tokens_per_s": sum(r["tokens"] for r in rows) / total_wall,
            "session": {"steps": len(session_rows), "wall_s": wall, "groups_trained": c.trained,
                        "groups_per_s": c.trained / session_wall, "tokens_per_s": trained_tokens / session_wall},
            "reward_first_window": float(np.mean([r["reward_mean"] for r in rows[:window]])) if rows else None,
            "reward_final_window": float(np.mean([r["reward_mean"] for r in rows[-window:]])) if rows else None,
            "staleness_max": max((r["staleness_max"] for r in rows), default=None),
            "staleness_mean": float(np.mean([r["staleness_mean"] for r in rows])) if rows else None,
            "busy_generator": self.generator_busy() / max(wall, 1e-9),
            "busy_trainer": self.trainer_busy.busy_total() / max(wall, 1e-9),
            "publish_to_loaded_s_mean": float(np.mean(list(versions.publish_to_loaded.values())))
            if versions.publish_to_loaded else None,
            "publish_to_loaded_s_p99": float(np.percentile(list(versions.publish_to_loaded.values()), 99))
            if versions.publish_to_loaded else None,
            "drain_s_mean": float(np.mean(list(versions.drain_s.values()))) if versions.drain_s else None,
            "groups_spanning_versions": sum(r.get("rollout/spanning_versions", 0) for r in rows),
            "loop_lag_p99_ms": self.lag.percentile_ms(99),
            "version_mismatches": self.version_mismatches.value,
            "error": repr(error) if error is not None and not isinstance(error, asyncio.CancelledError) else None,
            "cancelled": isinstance(error, asyncio.CancelledError),
            "run_dir": str(self.run_dir),
        }

    async def finish(self, summary: dict[str, Any], t_start: float, eval_rows: list[dict[str, Any]]) -> None:
        """summary.json, report.png, and the run_finished event (an error when the accounting is off)."""
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        await self.write_report(t_start, eval_rows)
        level = "info" if summary["accounting_ok"] else "error"
        getattr(log, level)("run_finished", **{k: v for k, v in summary.items() if k in (
            "steps", "wall_s", "groups_started", "groups_trained", "accounting_ok", "error")})

    async def write_report(self, t_start: float, eval_rows: list[dict[str, Any]]) -> None:
        """report.png: reward and eval curves, staleness histogram, busy timeline; a failed plot is only a warning."""
        try:
            from pipeline.observe.plots import write_report

            await asyncio.to_thread(write_report, self.run_dir, self.rows, self.timeline, t_start, eval_rows)
        except Exception as e:  # a failed plot must not hide the run's own outcome
            log.warning("report_failed", error=repr(e))

    async def close(self) -> None:
        self.metrics.close()
        if self.trackers is not None:
            await asyncio.to_thread(self.trackers.close)
