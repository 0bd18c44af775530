"""The Pipeline: builds the components from a config, in data-flow order, and supervises their loops.

    ledger ids ─► Admitter.admission_loop ─► Generator (group / wave tasks) ─► Scoring.accept ─► buffer
                  Outcomes.admit(): the      engine calls through the          decode, rewards,     │ EDF
                  staleness bound            EngineRotation, retried           filters              ▼ batch
    serving version ◄─ Versions.adapter_loop ◄─ AdapterStore.publish ◄──────── Training.train_loop
                       verify, load on every engine  (shared filesystem)       trainer.step (thread)
    Episodes (with an environment) ─► in place of one engine call: the group's n episodes, turn by turn
    Evaluator.eval_loop ─► rounds at step 0, every eval.every steps and at the end, on the same engines
    Outcomes: each group's life, admit ─► buffered ─► select ─► trained | dropped | failed, one call
              each (the buffer's side with it); its one exit into the ledger + RolloutLog (zarr)
    Reporting ─► metrics.jsonl, trackers, summary.json, report.png; checkpoints/ ◄─ Training

Invariants:
- Only this module wires components together; each component gets its collaborators through
  its constructor and none references the Pipeline.
- Every admitted group leaves exactly once, through `Outcomes`; at the end of a run started =
  trained + dropped + failed over every session, and the RolloutLog has one entry per started
  group (eval groups apart). Resume (`pipeline.loop.session`) continues from the newest checkpoint.
- The event loop never blocks: model loading, training steps, publishing, checkpoints and zarr
  flushes run in worker threads; engines run their own threads or processes. Every wait on an
  engine or the trainer has a timeout.
- The first task to fail ends the run with that error; shutdown closes the buffer, cancels,
  gathers under a timeout, records what was in flight as dropped ("shutdown"), flushes the log
  and closes what the pipeline built. CancelledError is never swallowed. A stop request (the
  first SIGINT/SIGTERM with handle_signals) finishes the step, checkpoints and shuts down; a
  second signal exits at once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable, Sequence

import structlog

from pipeline.loop import build
from pipeline.loop.admission import Admitter
from pipeline.loop.buffer import RolloutBuffer
from pipeline.config.schema import RunConfig
from pipeline.loop.evaluation import MAX_EVAL_PROMPTS, Evaluator, is_due
from pipeline.loop.episodes import EpisodeRows
from pipeline.loop.generation import Generator
from pipeline.observe.log import close_logging, configure_logging
from pipeline.observe.metrics import LoopLagMonitor
from pipeline.loop.outcomes import Outcomes
from pipeline.protocols import BatchEngine, Engine, Trainer
from pipeline.observe.reporting import Reporting
from pipeline.data.rewards import RewardFn, RewardScorer
from pipeline.loop.rotation import EngineRotation
from pipeline.loop.runtime import Runtime, Supervisor
from pipeline.loop.scoring import Scoring, Texts, reward_names
from pipeline.loop.session import continue_trainer, open_run_dir, open_session, refuse_existing_run
from pipeline.loop.training import Training
from pipeline.loop.versions import VersionPins, Versions, VersionSet

log = structlog.get_logger(__name__)

_DONE = object()


@dataclass(frozen=True)
class StepResult:
    """What each training step yields to `async for result in pipeline.steps()`."""

    step: int
    version: int  # version published by this step
    metrics: dict[str, Any]


class Pipeline:
    """Asynchronous GRPO: engines generate while the trainer learns, under a staleness bound.

    Build it from a config; pass your own prompts, reward function(s), engines or trainer to
    replace the built-in ones. Run it with `await pipeline.run()`, iterate steps with
    `async for result in pipeline.steps()`, or call `pipeline.run_sync()` from plain code.
    """

    def __init__(self, config: RunConfig | None = None, *, prompts: Iterable[Any] | None = None,
                 reward: RewardFn | Sequence[RewardFn] | None = None, reward_weights: Sequence[float] | None = None,
                 engines: Sequence[Engine] | None = None, trainer: Trainer | None = None,
                 tokenizer: Any | None = None, run_dir: str | Path | None = None, epochs: int | None = None,
                 console: bool = True, resume: bool = False, handle_signals: bool = False,
                 eval_prompts: Iterable[Any] | None = None, force_resume: bool = False,
                 environment: Callable[[], Any] | None = None) -> None:
        self.config = cfg = config or RunConfig()
        self._environment = environment or build.environment(cfg, prompts is not None)  # None: single-turn
        self._user_reward, self._reward_weights = build.rewards(cfg, reward, reward_weights, prompts is not None,
                                                                env=self._environment is not None)
        self._user_prompts = prompts  # None: data.train's rows, or the built-in task's prompts
        self._user_eval_prompts = eval_prompts  # None: data.eval's rows, or the built-in task's held-out prompts
        self._user_engines = list(engines) if engines is not None else None
        self._user_trainer = trainer
        self._tokenizer = tokenizer  # False: no text (prompts carry token ids)
        self._epochs = epochs
        self._console = console
        self._resume = resume  # continue the run in run_dir from its newest checkpoint
        self._force_resume = force_resume  # ... even with other data or rewards than the checkpoint's (warned)
        self._handle_signals = handle_signals  # SIGINT/SIGTERM: checkpoint and stop; a second one exits at once
        self.run_dir = Path(run_dir or cfg.out or f"runs/{datetime.now().strftime('%Y%m%d-%H%M%S-%f')}")
        self.summary: dict[str, Any] = {}
        # busy spans (monotonic start, end): one per engine call (its groups share it), one per step
        self.timeline: dict[str, list[tuple[float, float]]] = {"generation": [], "training": []}
        self.metrics_rows: list[dict[str, Any]] = []  # one per training step
        self.eval_rows: list[dict[str, Any]] = []  # one per evaluation round (eval/* keys)
        # set-up's parts in seconds: reading the data, the model (built the first time into
        # model.cache_dir, then reused), the engines' and the trainer's starts (concurrent)
        self.setup: dict[str, float] = {}
        self.stopped_by: str | None = None  # what asked the run to stop early (a signal name, "request")

    # ================================================================== public entry points

    async def run(self) -> dict[str, Any]:
        """Run to the end; returns the summary (also written to summary.json)."""
        async for _ in self.steps():
            pass
        return self.summary

    def run_sync(self) -> dict[str, Any]:
        """Run from synchronous code on a uvloop event loop (asyncio's where uvloop is missing)."""
        try:
            import uvloop

            return uvloop.run(self.run())
        except ImportError:  # uvloop is optional on platforms without it
            return asyncio.run(self.run())

    async def steps(self) -> AsyncIterator[StepResult]:
        """Yield each step's result as it completes. Leaving the loop early shuts the run down."""
        if not self._resume:
            refuse_existing_run(self.run_dir)  # before anything is written: the files there are another run's
        queue: asyncio.Queue[Any] = asyncio.Queue()
        runner = asyncio.get_running_loop().create_task(self._run(queue), name="pipeline-run")
        # however the run ends (an error before its first line of set-up included), the wait below ends
        runner.add_done_callback(lambda _: queue.put_nowait(_DONE))
        try:
            while (item := await queue.get()) is not _DONE:
                yield item
            await runner
        finally:
            if not runner.done():
                runner.cancel()
                try:
                    await runner
                except asyncio.CancelledError:
                    if asyncio.current_task().cancelling():  # our own caller was cancelled too
                        raise

    def request_stop(self, reason: str = "request") -> None:
        """Stop after the step in progress: checkpoint, record what is in flight, shut down.

        Safe from the event loop's thread (signal handlers, tasks); `run()` returns normally.
        """
        if self.stopped_by is None:
            self.stopped_by = reason
            log.warning("stop_requested", reason=reason, hint="finishing the step, then checkpointing")
        self._stop.set()

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.stopped_by is not None:  # the second signal: exit now; the last checkpoint resumes the run
            log.error("exiting_now", signal=sig.name, checkpoint_step=self.training.checkpoint_step)
            close_logging()
            os._exit(128 + sig.value)
        self.request_stop(sig.name)

    # ================================================================== the run

    async def _run(self, queue: asyncio.Queue[Any]) -> None:
        """The whole run; `queue` gets each step's StepResult."""
        open_run_dir(self.config, self.run_dir, resume=self._resume)
        configure_logging(self.run_dir, self.config.log.level, console=self._console)
        self._queue = queue
        self.supervisor = Supervisor()
        self._stop = asyncio.Event()
        self._ready = False  # set-up has finished: shutdown has groups to account for and a summary to write
        self._built_engines: list[Engine] = []
        self._closers: list[Any] = []  # what set-up opened that shutdown closes, in the order opened
        self._early_trainer: Any = None  # the trainer's process, started before the model is read
        self.runtime = Runtime(self.config)
        self.lag = LoopLagMonitor()
        self.trainer: Any = None
        self._t_start = time.monotonic()
        error: BaseException | None = None
        try:
            await self._setup()
            await self._main()
        except BaseException as e:
            error = e
            if isinstance(e, Exception):  # not a cancellation or an interrupt: the run failed, say why in full
                log.error("run_failed", error=f"{type(e).__name__}: {e}", exc_info=e)
            raise
        finally:
            await self._shutdown(error)

    async def _setup(self) -> None:
        """Build the components in data-flow order: prompts and rewards, model and tokenizer, the session
        (start or resume), engines and trainer, then the loops' components."""
        cfg, pc = self.config, self.config.pipeline
        t0 = time.monotonic()
        build.check_devices(cfg, builds_engines=self._user_engines is None, builds_trainer=self._user_trainer is None)
        if self._user_trainer is None:  # its imports run while the data and the model are read
            self._early_trainer = await asyncio.to_thread(build.early_trainer_process, cfg)
        # prompts and rewards first: a bad data file is said before a model is built
        items, eval_items, reward = await asyncio.to_thread(build.prompt_sets, cfg, self._user_prompts,
                                                            self._user_eval_prompts, self._user_reward,
                                                            self._environment is not None)
        self.source = build.prompt_source(cfg, items, own=self._user_prompts is None, epochs=self._epochs)
        self.scorer = RewardScorer(reward, self._reward_weights, timeout_s=cfg.reward.timeout_s)
        env_reward = cfg.env.reward if self._environment is not None else None
        # what a checkpoint must have been trained on to be resumed: hashed once, off the loop
        fingerprint = {"data": await asyncio.to_thread(self.source.fingerprint),
                       "reward": reward_names(self.scorer, env_reward), "reward_weights": list(self.scorer.weights)}
        t_model = time.monotonic()
        self.setup["data_s"] = t_model - t0
        self.model_path = await asyncio.to_thread(build.model_path, cfg, self._tokenizer,
                                                  engines=self._user_engines is None,
                                                  trainer=self._user_trainer is None)
        self.setup["model_s"] = time.monotonic() - t_model  # building the built-in model the first time
        # the tokenizer loads (seconds, for a large vocabulary) while the session opens and the engines
        # and the trainer start: only the prompts and texts built after them need it
        tokenizing = asyncio.create_task(asyncio.to_thread(_timed, build.tokenizer_of, cfg, self._tokenizer,
                                                           self.model_path), name="tokenizer_load")
        # a set-up that fails before reading it leaves no "exception never retrieved"
        tokenizing.add_done_callback(lambda t: t.cancelled() or t.exception())

        session = await asyncio.to_thread(open_session, cfg, self.run_dir, resume=self._resume,
                                          force=self._force_resume, fingerprint=fingerprint, total=self.source.total,
                                          model_path=self.model_path)
        self.start_step, self.start_version = session.start_step, session.start_version
        self.ledger, self.rollout_log, self.store = session.ledger, session.rollout_log, session.store
        self._closers.append(self.rollout_log)
        self.metrics_rows[:], self.eval_rows[:] = session.step_rows, session.eval_rows
        self.reporting = await Reporting.open(cfg, self.run_dir, rows=self.metrics_rows, base=self.ledger.fates,
                                              wall0=session.wall0, lag=self.lag, timeline=self.timeline)
        self._closers.append(self.reporting)

        self.runtime.share_cpu()
        build.init_cuda(cfg)
        self.engines = self._user_engines or build.build_engines(cfg, self.model_path, self.start_step, self.run_dir)
        self._built_engines = [] if self._user_engines else list(self.engines)
        self.buffer = RolloutBuffer(pc.batch_groups, pc.max_staleness, pc.capacity,
                                    max_groups=(pc.steps - self.start_step) * pc.batch_groups,
                                    start_version=self.start_version, deterministic=cfg.deterministic)
        self.outcomes = Outcomes(self.ledger, self.rollout_log, self.buffer)
        pins = VersionPins()  # versions evaluation rounds sample with
        version_set = VersionSet(buffer=self.buffer, pins=pins, start_version=self.start_version)
        self.rotation = EngineRotation(self.engines, built=self._user_engines is None, cfg=cfg.engine,
                                       close_timeout_s=pc.shutdown_timeout_s, spawn=self.supervisor.spawn,
                                       in_use=version_set)
        self.versions = Versions(rotation=self.rotation, version_set=version_set, store=self.store, buffer=self.buffer,
                                 pins=pins, max_staleness=pc.max_staleness, full_weights=cfg.trainer.update == "full",
                                 in_flight=pc.full_weight_swap == "in_flight")
        self.trainer = self._user_trainer or build.build_trainer(cfg, self.model_path, self._early_trainer)
        self.setup.update(await build.start(self.engines, self.trainer, cfg.engine.start_timeout_s))
        self.tokenizer, self.setup["tokenizer_s"] = await tokenizing
        builder = build.prompt_builder(cfg, self.tokenizer, self.model_path, self.engines)  # needs started engines
        if session.checkpoint is not None:
            await continue_trainer(self.trainer, session.checkpoint, self.store, self.versions, self.start_version,
                                   memory=cfg.trainer.publish == "memory")

        self.scoring = Scoring(texts=Texts(self.tokenizer), scorer=self.scorer,
                               outcomes=self.outcomes, filter_zero_advantage=pc.filter_zero_advantage,
                               spans=self.timeline["generation"], env_reward=env_reward)
        episodes = build.episodes(cfg, self._environment, builder, self.tokenizer)
        self.generator = Generator(rotation=self.rotation, versions=self.versions, outcomes=self.outcomes,
                                   cfg=cfg.engine, spawn=self.supervisor.spawn, accept=self.scoring.accept,
                                   episodes=episodes)
        batch = pc.batch_groups if all(isinstance(e, BatchEngine) for e in self.engines) and not episodes else 1
        rows = EpisodeRows() if episodes else builder  # an episode's prompt is its first observation
        # a deterministic run seeds every group from (seed, group id), so no draw depends on arrival order
        sampling = replace(cfg.sampling, per_request_seed=True) if cfg.deterministic else cfg.sampling
        self.admitter = Admitter(ledger=self.ledger, source=self.source, buffer=self.buffer, builder=rows,
                                 outcomes=self.outcomes, generator=self.generator, sampling=sampling,
                                 seed=cfg.seed, max_wave=batch, spawn=self.supervisor.spawn)
        eval_items = eval_items[:cfg.eval.max_prompts or MAX_EVAL_PROMPTS] if cfg.eval.every else []
        self.evaluator = Evaluator(eval_items, cfg=cfg.eval, sampling=sampling, seed=cfg.seed, builder=rows,
                                   generator=self.generator, versions=self.versions, pins=pins, scoring=self.scoring,
                                   outcomes=self.outcomes, write_row=self.reporting.write, batch=batch,
                                   done=session.eval_done, rows=self.eval_rows) if eval_items else None
        self.reporting.watch(buffer=self.buffer, rotation=self.rotation, versions=self.versions,
                             retries=self.generator.retries, version_mismatches=self.scoring.version_mismatches,
                             reward_names=self.scoring.names,
                             full_weights=cfg.trainer.update == "full")
        self.training = Training(
            cfg=cfg, trainer=self.trainer, store=self.store, ledger=self.ledger,
            rollout_log=self.rollout_log, outcomes=self.outcomes, versions=self.versions,
            checkpoints=session.checkpoints, reporting=self.reporting, evaluator=self.evaluator,
            trainer_busy=self.reporting.trainer_busy, timeline=self.timeline["training"], stop=self._stop,
            on_step=lambda step, version, row: self._queue.put_nowait(StepResult(step, version, row)),
            fingerprint=fingerprint, start_step=self.start_step, start_version=self.start_version,
            checkpoint_step=session.checkpoint.step if session.checkpoint else None,
            show_progress=cfg.log.progress and self._console)
        self.setup_s = time.monotonic() - t0
        self._ready = True
        log.info("pipeline_ready", run_dir=str(self.run_dir), engines=[e.name for e in self.engines],
                 model=self.model_path, setup_s=round(self.setup_s, 2),
                 **{k: round(v, 2) for k, v in self.setup.items()}, batch_groups=pc.batch_groups,
                 max_staleness=pc.max_staleness, group_size=cfg.sampling.n)

    async def _main(self) -> None:
        """The loops, supervised: the run ends when training does or when any loop fails."""
        self.runtime.enter(self._on_signal if self._handle_signals else None)
        self.lag.start()
        self._t_start = time.monotonic()
        self.reporting.start()
        self.supervisor.spawn(self.admitter.admission_loop(), "admission-loop")
        self.supervisor.spawn(self.versions.adapter_loop(), "adapter-loop")
        self.supervisor.spawn(self.outcomes.flush_loop(), "rollout-log-flush-loop")
        if self.evaluator is not None:
            self.supervisor.spawn(self.evaluator.eval_loop(), "eval-loop")
            if is_due(self.start_step, self.config.eval.every, self.config.pipeline.steps):
                self.evaluator.request(self.start_step)  # before the first step (again on resume, if it was cut)
        await self.supervisor.until_done_or_failed(self.supervisor.spawn(self.training.train_loop(), "train-loop"))

    async def _shutdown(self, error: BaseException | None) -> None:
        """Cancel the loops, account for every group still in the system, close what set-up opened."""
        timeout = self.config.pipeline.shutdown_timeout_s
        wall = time.monotonic() - self._t_start
        self.runtime.remove_signal_handlers()
        if self._ready:  # the buffer first: no loop may take a group from it once cancelled
            await self.outcomes.close()
        await self.supervisor.cancel_all(timeout)
        if self._ready:
            self.outcomes.drop_live("shutdown")
        await self.lag.stop()
        if self._user_engines and self._ready:
            # leave a caller's engine as it was found: without this run's adapters
            for ref in [r for v, r in self.versions.adapters.items() if v > 0]:
                await self.versions.unload_on_engines(ref, self._user_engines)
        self.runtime.restore()
        await build.close(self._built_engines, self.trainer if self._user_trainer is None else None, timeout)
        if self._early_trainer is not None:  # set-up failed before a trainer took it over
            await asyncio.to_thread(self._early_trainer.close)
        for closer in self._closers:  # the RolloutLog's close is a last flush to disk: in a thread
            await (asyncio.to_thread(closer.close) if closer is self.rollout_log else closer.close())
        if self._ready:
            if self.admitter.refusals.by_reason:  # what prompt_refused stopped logging
                log.warning("prompts_refused", total=self.admitter.refusals.by_reason.total(),
                            by_reason=dict(self.admitter.refusals.by_reason))
            self.summary = self.reporting.summary(
                wall=wall, error=error, setup_s=self.setup_s, setup=self.setup, ledger=self.ledger,
                rollout_log=self.rollout_log,
                eval_rows=self.eval_rows, start_step=self.start_step, resumed=self._resume,
                checkpoint_step=self.training.checkpoint_step, stopped_by=self.stopped_by)
            await self.reporting.finish(self.summary, self._t_start, self.eval_rows)
        close_logging()


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """fn(*args) and the seconds it took (in a worker thread, beside what the loop awaits meanwhile)."""
    t = time.monotonic()
    return fn(*args), time.monotonic() - t
