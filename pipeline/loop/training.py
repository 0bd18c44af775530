"""Training: batches from the buffer to trainer steps, published versions, trained outcomes and checkpoints.

Invariants:
- Each step takes the buffer's EDF batch for the trainer's version (`Outcomes.select`), so no
  trained group is older than max_staleness; the groups it trains leave as trained at that step
  (`Outcomes.trained`) only after the trainer stepped and the version it made was published. A
  batch taken and not trained (shutdown cut its step) is dropped by `Outcomes.drop_live`.
- The step and its publish run in one worker thread under trainer.step_timeout_s.
- A checkpoint is taken between two steps, at one moment on the loop: the ledger snapshot and
  the RolloutLog row count agree, and the rows it covers are flushed first. One is written every
  pipeline.checkpoint_every steps, at the end (after the last evaluation round) and on a stop.
  A trainer with `begin_save_state` copies its state then and writes it behind the next steps;
  the checkpoint is renamed into place only once the trainer's marker says its files are in
  place, one at a time; the run's last checkpoint is complete before the train loop returns, and
  a failed write stops the run (the checkpoint before stays the newest).
- The engine-vs-trainer log-prob check compares the tokens the policy sampled only
  (`Completion.sampled`); environment tokens of an episode never enter it.
- A stop request ends the loop after the step in progress; trainer.max_consecutive_skips
  non-finite steps in a row end the run with a TrainerError after a checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import structlog

from pipeline.store.weights import AdapterStore
from pipeline.loop.buffer import BufferClosed
from pipeline.store.checkpoint import STATE_WRITTEN, CheckpointStore
from pipeline.config.schema import RunConfig
from pipeline.errors import TrainerError
from pipeline.loop.evaluation import Evaluator, is_due
from pipeline.faults import crash_point
from pipeline.store.ledger import Ledger
from pipeline.trainer.loss import logprob_mismatch
from pipeline.observe.metrics import BusyMeter
from pipeline.loop.outcomes import Outcomes
from pipeline.observe.reporting import Reporting
from pipeline.store.rollout_log import RolloutLog
from pipeline.types import AdapterRef, Batch, RolloutGroup, TrainStats
from pipeline.loop.versions import Versions

log = structlog.get_logger(__name__)

STOPPED = object()  # what `until_stopped` returns when a stop request came first
WRITTEN_POLL_S = 0.02  # how often a checkpoint written behind the steps looks for the trainer's marker


class Training:
    """The train loop and the checkpoints it writes."""

    def __init__(self, *, cfg: RunConfig, trainer: Any, store: AdapterStore, ledger: Ledger,
                 rollout_log: RolloutLog, outcomes: Outcomes, versions: Versions, checkpoints: CheckpointStore,
                 reporting: Reporting, evaluator: Evaluator | None, trainer_busy: BusyMeter,
                 timeline: list[tuple[float, float]], stop: asyncio.Event, on_step: Callable[[int, int, dict], None],
                 fingerprint: dict[str, Any], start_step: int, start_version: int, checkpoint_step: int | None,
                 show_progress: bool) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.store = store
        self.ledger = ledger
        self.rollout_log = rollout_log
        self.outcomes = outcomes
        self.versions = versions
        self.checkpoints = checkpoints
        self.reporting = reporting
        self.evaluator = evaluator
        self.trainer_busy = trainer_busy
        self.timeline = timeline  # (start, end) of each step, for the report
        self.stop = stop
        self.on_step = on_step  # (step, version, row) to whoever iterates the run's steps
        self.fingerprint = fingerprint  # what the checkpoint was trained on: prompts and reward names
        self.start_step = start_step
        self.start_version = start_version
        self.checkpoint_step = checkpoint_step
        self._checkpoint_s = 0.0  # seconds of checkpoints since the last step's row
        self._writing: asyncio.Task[None] | None = None  # the checkpoint being written behind the steps
        self.show_progress = show_progress

    async def train_loop(self) -> None:
        """Consumes batches (EDF under the staleness bound); produces published versions; waits on the buffer."""
        from tqdm import tqdm

        bar = tqdm(total=self.cfg.pipeline.steps, desc="steps", unit="step", dynamic_ncols=True,
                   disable=not (self.show_progress and sys.stderr.isatty()))
        try:
            await self._train_steps(bar)
        finally:
            bar.close()
            if self._writing is not None and not self._writing.done():  # the run failed or was cancelled
                self._writing.cancel()  # its temporary directory is removed; the checkpoint before stays

    async def _train_steps(self, bar: Any) -> None:
        cfg, pc = self.cfg, self.cfg.pipeline
        version = self.start_version
        bar.update(self.start_step)
        rows = self.reporting.rows
        for step in range(self.start_step + 1, pc.steps + 1):
            self._check_writing()
            t_wait = time.monotonic()
            sel = await self.until_stopped(self.outcomes.select(version))
            if sel is STOPPED:
                break
            wait_s = time.monotonic() - t_wait
            if not sel.groups:
                log.info("out_of_data", step=step)
                break
            # the version this step trains from is worth keeping only if a check within the next
            # max_staleness steps may meet groups sampled with it (in full mode, a whole model a step)
            keep = any(self._checks_at(s) for s in range(step + 1, step + pc.max_staleness + 1))
            batch = Batch(step, version, tuple(sel.groups), keep_version=keep)
            check: dict[str, float] = {}
            t_check = time.monotonic()
            if self._checks_at(step):
                check = await self._logprob_check(batch)
            t_call = time.monotonic()
            with self.trainer_busy:
                stats, ref, times = await self._trainer_call(f"step {step} and its publish",
                                                             self._step_and_publish, batch)
            t_done = time.monotonic()
            self.timeline.append((stats.t_start, t_done))
            # where the step's wall time went (docs/benchmarks.md, step_cost.py): the trainer's own
            # compute, the call around it (IPC), the publish, the hop to and from the worker thread
            times.update({"time/wait_batch_s": wait_s, "time/check_s": t_call - t_check,
                          "time/train_s": stats.t_end - stats.t_start,
                          "time/thread_hop_s": t_done - t_call - times["time/trainer_call_s"] - times["time/publish_s"],
                          "time/checkpoint_s": self._checkpoint_s})
            self._checkpoint_s = 0.0
            self.versions.published(ref)
            self.outcomes.trained(batch.groups, step)
            crash_point("step.after_record")
            version = stats.version
            times["time/record_s"] = time.monotonic() - t_done  # commit, outcomes to the log, the row
            row = self.reporting.step_row(batch, stats.metrics, check, times, ref)
            self.reporting.write(row)
            rows.append(row)
            self.on_step(step, version, row)
            log.debug("step", step=step, version=version, reward_mean=round(row["reward_mean"], 4),
                      staleness_max=row["staleness_max"], wait_s=round(wait_s, 3),
                      train_s=round(stats.t_end - stats.t_start, 3))
            bar.update(1)
            if not bar.disable:  # formatting the postfix costs even when nothing is shown
                bar.set_postfix(reward=f"{row['reward_mean']:.3f}", stale=row["staleness_max"], refresh=False)
            skips = self.trainer.consecutive_skips
            if skips >= cfg.trainer.max_consecutive_skips:
                await self.checkpoint(step, final=True)
                raise TrainerError(f"{skips} training steps in a row had a non-finite loss or gradient "
                                   f"(trainer.max_consecutive_skips = {cfg.trainer.max_consecutive_skips}); "
                                   f"stopped after checkpointing step {step}: lower trainer.lr or check the rewards")
            if self.evaluator is not None and step < pc.steps and is_due(step, cfg.eval.every, pc.steps):
                self.evaluator.request(step)
            # the last step's checkpoint is the end's, after its evaluation, so the checkpoint covers it
            if pc.checkpoint_every and step % pc.checkpoint_every == 0 and (step < pc.steps or self.evaluator is None):
                await self.checkpoint(step)
            if self.stop.is_set():
                break
        last = rows[-1]["step"] if rows else self.start_step
        if self.evaluator is not None and not self.stop.is_set():  # the run's end (not a stop): evaluate the last policy
            self.evaluator.request(last)
            await self.until_stopped(self.evaluator.join())
        # the end of the run, or a stop request: the state to continue from
        await self.checkpoint(last, final=True)
        await self.publish_files(version)

    def _checks_at(self, step: int) -> bool:
        """Whether `step` starts with a log-prob check: the run's first step, then every logprob_check_every."""
        every = self.cfg.pipeline.logprob_check_every
        return step == self.start_step + 1 or bool(every and (step - 1) % every == 0)

    async def until_stopped(self, coro: Any) -> Any:
        """Await `coro` unless a stop is requested first (then cancel it and return STOPPED)."""
        if self.stop.is_set():
            coro.close()
            return STOPPED
        task = asyncio.ensure_future(coro)
        stop = asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()  # no orphan: a select left running could take groups nobody trains
            raise
        finally:
            stop.cancel()
        if task.done():
            return task.result()
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, BufferClosed):
            if asyncio.current_task().cancelling():  # we are being cancelled ourselves
                raise
        return STOPPED

    async def _trainer_call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """A blocking trainer call in a thread, under trainer.step_timeout_s."""
        timeout = self.cfg.trainer.step_timeout_s
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.to_thread(fn, *args)
        except TimeoutError:
            raise TrainerError(f"trainer {what} took longer than trainer.step_timeout_s = {timeout} s") from None

    def _step_and_publish(self, batch: Batch) -> tuple[TrainStats, AdapterRef, dict[str, float]]:
        """A training step, then the publish of the version it made, in one worker-thread call
        (one thread hop a step, not two); returns the step's stats, the ref and the seconds of the
        trainer call, of the publish and, within it, of the trainer writing the version's files.

        A trainer in its own process steps and writes the version into the publish's temporary
        directory in one round trip (`step_and_save`); its version must then be the next one.
        With trainer.publish = "memory" the version is handed over in memory instead."""
        if self.cfg.trainer.publish == "memory":
            return self._step_and_share(batch)
        merged = getattr(self.trainer, "step_and_save", None)
        if merged is None:
            t0 = time.monotonic()
            stats = self.trainer.step(batch)
            crash_point("step.after_train")
            t_pub = time.monotonic()
            save_s = [0.0]

            def save(directory: Path) -> None:
                t = time.monotonic()
                self.trainer.save_adapter(directory)
                save_s[0] = time.monotonic() - t

            ref = self.store.publish(stats.version, save)
            return stats, ref, {"time/trainer_call_s": t_pub - t0, "time/publish_s": time.monotonic() - t_pub,
                                "time/save_s": save_s[0]}
        version = self.trainer.version + 1
        done: list[Any] = []

        def step_and_save(directory: Path) -> None:
            t = time.monotonic()
            stats, save_s = merged(batch, directory)
            done.extend((stats, save_s, time.monotonic() - t))
            if stats.version != version:
                raise TrainerError(f"the trainer's step {batch.step} made version {stats.version}; a step makes "
                                   f"the next version, {version}")
            crash_point("step.after_train")

        t0 = time.monotonic()
        ref = self.store.publish(version, step_and_save)
        stats, save_s, call_s = done
        # the call held the step and the save: the save is the publish's, as in the two-call path
        return stats, ref, {"time/trainer_call_s": call_s - save_s,
                            "time/publish_s": time.monotonic() - t0 - call_s + save_s, "time/save_s": save_s}

    def _step_and_share(self, batch: Batch) -> tuple[TrainStats, AdapterRef, dict[str, float]]:
        """A training step, then its version handed over in memory (trainer.publish = "memory": full
        weights in the trainer's GPU memory, a LoRA adapter's tensors in the reply): nothing is
        written. The trainer may let go of every version older than the one the engines serve now
        (a restarted engine loads that one; the served version only moves up)."""
        keep_from = self.versions.served
        merged = getattr(self.trainer, "step_and_share", None)
        t0 = time.monotonic()
        if merged is not None:
            stats, payload, share_s = merged(batch, keep_from)
            call_s = time.monotonic() - t0 - share_s
        else:
            stats = self.trainer.step(batch)
            t_share = time.monotonic()
            payload = self.trainer.share_weights(keep_from)
            call_s, share_s = t_share - t0, time.monotonic() - t_share
        crash_point("step.after_train")
        if payload.get("version") != stats.version:
            raise TrainerError(f"the trainer's step {batch.step} made version {stats.version} but shared the "
                               f"weights of version {payload.get('version')}")
        return stats, AdapterRef.in_memory(stats.version, payload), {
            "time/trainer_call_s": call_s, "time/publish_s": share_s, "time/save_s": share_s}

    async def publish_files(self, version: int) -> None:
        """trainer.publish = "memory": the run's last version written to the store as well, so the run
        ends with its trained model on disk as a run publishing files does."""
        if self.cfg.trainer.publish != "memory" or version == 0 or version in self.store.versions():
            return
        ref = await self._trainer_call(f"the publish of version {version} to {self.store.root}",
                                       self.store.publish, version, self.trainer.save_adapter)
        log.info("weights_published", version=version, path=ref.path)

    async def checkpoint(self, step: int, *, final: bool = False) -> None:
        """Write the checkpoint of `step`: trainer state and the ledger, with the log rows it covers.

        A trainer that can (`begin_save_state`, with pipeline.checkpoint_behind) copies its state and
        writes it behind the next steps; the checkpoint is completed when its files are in place
        (`_complete`), one at a time. `final`: the run's last one, complete when this returns."""
        await self.checkpoint_written()  # the one before, first
        if step == 0 or step == self.checkpoint_step:
            return  # nothing trained yet, or this step is already checkpointed
        # one moment on the loop: the ledger and the RolloutLog agree on what has settled
        done = sorted(self.evaluator.done) if self.evaluator is not None else []
        state = {"ledger": self.ledger.snapshot(), "log_rows": len(self.rollout_log), "version": self.trainer.version,
                 "update": self.cfg.trainer.update, "eval_done": done, "fingerprint": self.fingerprint,
                 "metrics_rows": len(self.reporting.rows),
                 "wall_s": self.reporting.wall0 + time.monotonic() - self.reporting.t_start}
        await asyncio.to_thread(self.rollout_log.flush)  # rows [0, log_rows) are durable before the checkpoint
        t = time.monotonic()
        behind = getattr(self.trainer, "begin_save_state", None) if self.cfg.pipeline.checkpoint_behind else None
        if behind is None:
            await self._trainer_call("checkpoint", self.checkpoints.write, step, state, self.trainer.save_state)
        else:
            tmp = await asyncio.to_thread(self.checkpoints.begin, step)
            if tmp is not None:
                try:
                    await self._trainer_call("checkpoint", behind, tmp / "trainer")
                except BaseException:
                    self.checkpoints.abandon(tmp)
                    raise
                self._writing = asyncio.create_task(self._complete(step, tmp, state), name=f"checkpoint-{step}")
                # raised between steps or by checkpoint_written; never an "exception never retrieved"
                self._writing.add_done_callback(lambda t: t.cancelled() or t.exception())
        self._checkpoint_s += time.monotonic() - t  # reported in the next step's row
        self.checkpoint_step = step
        if final:
            await self.checkpoint_written()

    async def checkpoint_written(self) -> None:
        """Until the checkpoint being written behind the steps (if any) is in place; raises its error."""
        writing, self._writing = self._writing, None
        if writing is not None:
            await writing

    def _check_writing(self) -> None:
        """Raise the error of a checkpoint written behind the steps that failed (between two steps)."""
        w = self._writing
        if w is not None and w.done() and not w.cancelled() and w.exception() is not None:
            raise w.exception()

    async def _complete(self, step: int, tmp: Path, state: dict[str, Any]) -> None:
        """Checkpoint `step` once the trainer has written its state into `tmp`/trainer (its
        STATE_WRITTEN marker, within trainer.step_timeout_s): the ledger, the hashes, the rename."""
        t0 = time.monotonic()
        marker = tmp / "trainer" / STATE_WRITTEN
        timeout = self.cfg.trainer.step_timeout_s
        try:
            while not marker.exists():
                if time.monotonic() - t0 > timeout:
                    raise TrainerError(f"the trainer did not write its state for the checkpoint of step {step} "
                                       f"within trainer.step_timeout_s = {timeout} s")
                await asyncio.sleep(WRITTEN_POLL_S)
            written = json.loads(marker.read_text(encoding="utf-8"))
            marker.unlink()
            if written["error"]:
                raise TrainerError(f"the trainer could not write its state for the checkpoint of step {step} "
                                   f"into {tmp / 'trainer'}: {written['error']}")
            known = {f"trainer/{k}": v for k, v in written["sha256"].items()}
            await asyncio.to_thread(self.checkpoints.finish, step, tmp, state, known)
        except BaseException:
            self.checkpoints.abandon(tmp)  # the one before stays the newest, as after a kill
            raise
        log.debug("checkpoint_behind", step=step, seconds=round(time.monotonic() - t0, 3))

    async def _logprob_check(self, batch: Batch) -> dict[str, float]:
        """Recompute the trainer's log-probs of a few groups (under their own versions) against the
        engine's, over the tokens the policy sampled (`sampled_logprob_pairs`). Groups an in-flight
        swap carried across versions are not one version's sample: they are left out."""
        pc = self.cfg.pipeline
        groups = [g for g in batch.groups if not g.generation.spans_versions][:pc.logprob_check_groups]
        if not groups:
            return {}
        try:
            trainer_lp = await asyncio.to_thread(self.trainer.recompute_logprobs, groups)
        except KeyError as e:  # the trainer no longer holds that version's weights: skip this check
            log.warning("logprob_check_skipped", reason=str(e))
            return {}
        eng, tr = sampled_logprob_pairs(groups, trainer_lp)
        import torch

        mm = logprob_mismatch(torch.from_numpy(eng), torch.from_numpy(tr))
        out = {f"check/{k}": float(v) for k, v in mm.items()}
        lvl = "warning" if out.get("check/mean_abs_diff", 0.0) > pc.logprob_warn_mean_abs else "info"
        getattr(log, lvl)("logprob_check", step=batch.step, groups=len(groups),
                          **{k.split("/")[1]: round(v, 5) for k, v in out.items()})
        if lvl == "warning":
            log.warning("logprob_contract_violated", mean_abs_diff=out.get("check/mean_abs_diff"),
                        threshold=pc.logprob_warn_mean_abs,
                        hint="engine and trainer disagree on the policy: check dtype, adapter loading, sampling")
        return out


def sampled_logprob_pairs(groups: list[RolloutGroup],
                          trainer_lp: list[list[np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """The engine's and the trainer's log-probs of the sampled tokens of `groups`: ([M], [M]) float64.

    trainer_lp: what `recompute_logprobs(groups)` returned, per group and per completion an
    array [T] over every completion token. Only positions where `Completion.sampled` is True
    are kept: on environment tokens the engine's log-prob is 0 by contract, not a log-prob, and
    would enter the mean |diff| as a mismatch of the trainer's whole log-prob there.
    """
    eng = np.concatenate([np.zeros(0, np.float32)] + [c.logprobs[c.sampled] for g in groups for c in g.completions])
    mask = np.concatenate([np.zeros(0, bool)] + [c.sampled for g in groups for c in g.completions])
    tr = np.concatenate([np.zeros(0, np.float32)] + [x for per in trainer_lp for x in per])
    if len(tr) != len(mask):
        raise TrainerError(f"recompute_logprobs gave {len(tr)} log-probs for {len(mask)} completion tokens")
    return eng.astype(np.float64), tr[mask].astype(np.float64)
