"""The Pipeline: builds the components from a config and runs the loops on one event loop.

    ledger ids ─► _admission_loop ─► _group_task (a group) or _wave_task ─────► RolloutBuffer
                 │ buffer.admit()   (the groups admitted together: generate_many)   │
                 │ (staleness bound)  generate(n) → decode → reward (_accept)       │ get_batch (EDF)
                 │                    (retried; failing engines leave rotation;     │
                 │                    _restart_loop restarts them and they return)  │
                 ▼                                                                  ▼
    serving version ◄─ _adapter_loop ◄─ AdapterStore.publish ◄──────────── _train_loop
                       verify, engine.load_adapter(v)   (shared filesystem)  trainer.step (thread)
    RolloutLog (zarr) ◄── every group that leaves: trained at step s, dropped or failed, and why
    checkpoints/ ◄── every pipeline.checkpoint_every steps, at the end and on a stop: trainer
                     state + ledger + how many RolloutLog rows it covers

Invariants:
- Only this module wires components together; components never call back into it.
- A group's id is its position in the prompt stream (the Ledger's id); every admitted group
  leaves exactly once, through `_record`: trained, dropped (reason) or failed (reason), and is
  appended to the RolloutLog. At the end of a run started = trained + dropped + failed over
  every session, and the log has one entry per started group.
- Resume continues from the newest checkpoint: the RolloutLog is cut to the rows the checkpoint
  covers, adapter versions after it are discarded and its own version published again, and
  every id the checkpoint did not see settled is generated again (same id, so never twice in
  the log). Admission counts from the checkpoint's version, so nothing bursts stale.
- The event loop never blocks: model loading, training steps, publishing, checkpoints and zarr
  flushes run in worker threads; engines run their own threads or processes. Every wait on an
  engine or the trainer has a timeout (engine.request_timeout_s, load_timeout_s,
  start_timeout_s, trainer.step_timeout_s).
- A generate call that raises or times out is retried (engine.retries, with backoff) and then
  counted as failed; an engine that is dead, or fails engine.max_consecutive_errors calls in a
  row, leaves the rotation and its groups go to the others. An adapter version that does not
  verify or load is skipped while an older one may still serve within max_staleness.
- Full-weight updates (trainer.update = "full"): an engine holds one version's weights, so
  before engines load a new version, admission pauses and the groups in flight finish on the
  weights they started with; then every engine loads the version (one directory, written once)
  and admission resumes at it. A group is never sampled across two versions.
- An engine this pipeline built that left the rotation is restarted in the background (closed,
  engine.restart_backoff_s, started, the adapter versions in use loaded) and rejoins; every
  attempt counts against engine.restarts, and once they are spent it stays out. An engine the
  caller passed in is never restarted (nor closed). While none is in rotation and one is being
  restarted, groups wait for it rather than fail (a death costs no retry); with none in rotation
  and none restarting the run fails with EngineDeadError. A failed call counts against an engine
  only if it was sent after the engine last left the rotation.
- The first task to fail ends the run with that error; shutdown closes the buffer, cancels,
  gathers under a timeout, records what was in flight as dropped ("shutdown"), flushes the log
  and closes what the pipeline built. CancelledError is never swallowed. A stop request (the
  first SIGINT/SIGTERM with handle_signals) finishes the step, checkpoints and shuts down; a
  second signal exits at once.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable, Sequence

import numpy as np
import structlog

from pipeline.adapter_store import AdapterStore
from pipeline.buffer import Admission, BufferClosed, RolloutBuffer
from pipeline.checkpoint import CheckpointStore
from pipeline.config import RunConfig
from pipeline.config_io import dump_toml
from pipeline.engines.base import Engine
from pipeline.evaluation import MAX_EVAL_PROMPTS, VersionPins, eval_group_id, eval_row, is_due, round_metrics
from pipeline.errors import (AdapterError, ConfigError, EngineDeadError, FatalError, GenerationError, PromptError,
                             RecoverableError, RewardError, TrainerError)
from pipeline.faults import crash_point
from pipeline.ledger import Ledger
from pipeline.log import close_logging, configure_logging
from pipeline.loss import logprob_mismatch
from pipeline.metrics import BusyMeter, LoopLagMonitor, MetricsWriter, read_jsonl
from pipeline.prompts import PromptBuilder, read_chat_template
from pipeline.rewards import RewardFn, RewardScorer
from pipeline.refusals import LOGGED_PER_REASON, Refusals
from pipeline.outcomes import FLUSH_GROUPS, Outcomes
from pipeline.rollout_log import RolloutLog
from pipeline.rotation import EngineRotation
from pipeline.versions import Versions, settled
from pipeline.tasks import PromptSource, build_task
from pipeline.trackers import Trackers, open_trackers
from pipeline.types import (AdapterRef, Batch, Generation, GroupOutcome, GroupRequest, Prompt, RolloutGroup,
                            TrainStats)

log = structlog.get_logger(__name__)

_DONE = object()
# completion tokens from which a wave is decoded in a worker thread: about a millisecond of
# decoding, ten times a thread hop; below, it is cheaper on the loop
DECODE_OFF_LOOP_TOKENS = 16384
# an engine call failing with one of these fails that attempt, not the run
_ENGINE_ERRORS = (RecoverableError, TimeoutError, EngineDeadError, RuntimeError, ValueError, OSError)


@dataclass(frozen=True)
class StepResult:
    """What each training step yields to `async for result in pipeline.steps()`."""

    step: int
    version: int  # version published by this step
    metrics: dict[str, Any]


def quiet_gc(threshold: int) -> tuple[int, ...]:
    """The collector as a run sets it: what exists now is frozen out of it, and a young pass comes
    every `threshold` allocations. Returns the thresholds before, for `restore_gc`.

    Each group allocates thousands of small acyclic objects (token lists, completions); a
    young-generation pass every 700 allocations, and full passes over everything set-up built
    (the model, the tokenizer), cost the overhead benchmark 15-40 us a group."""
    before = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(threshold, *before[1:])
    return before


def restore_gc(before: tuple[int, ...]) -> None:
    """Undo `quiet_gc`: its thresholds back, and the frozen objects collectable again."""
    gc.set_threshold(*before)
    gc.unfreeze()


class Pipeline:
    """Asynchronous GRPO: engines generate while the trainer learns, under a staleness bound.

    Build it from a config; pass your own prompts, reward function(s), engines or trainer to
    replace the built-in ones. Run it with `await pipeline.run()`, iterate steps with
    `async for result in pipeline.steps()`, or call `pipeline.run_sync()` from plain code.
    """

    def __init__(self, config: RunConfig | None = None, *, prompts: Iterable[Any] | None = None,
                 reward: RewardFn | Sequence[RewardFn] | None = None, reward_weights: Sequence[float] | None = None,
                 engines: Sequence[Engine] | None = None, trainer: Any | None = None,
                 tokenizer: Any | None = None, run_dir: str | Path | None = None, epochs: int | None = None,
                 console: bool = True, resume: bool = False, handle_signals: bool = False,
                 eval_prompts: Iterable[Any] | None = None, force_resume: bool = False) -> None:
        self.config = config or RunConfig()
        cfg = self.config
        if reward is None and cfg.reward.functions:  # imported now: a bad entry fails before anything is written
            from pipeline.rewards import load_reward_function

            reward = [load_reward_function(e, f"reward.functions[{i}]") for i, e in enumerate(cfg.reward.functions)]
            reward_weights = reward_weights or cfg.reward.weights or None
        if reward is None and (prompts is not None or cfg.data.train):
            raise ValueError("your own prompts need a reward: pass reward=..., or set reward.functions in the config")
        self._user_prompts = prompts  # None: data.train's rows, or the built-in task's prompts
        self._user_eval_prompts = eval_prompts  # None: data.eval's rows, or the built-in task's held-out prompts
        self._user_reward = reward  # None: the built-in task's reward
        self._reward_weights = reward_weights
        self._user_engines = list(engines) if engines is not None else None
        self._user_trainer = trainer
        self._tokenizer = tokenizer
        self._epochs = epochs
        self._console = console
        self._resume = resume  # continue the run in run_dir from its newest checkpoint
        self._force_resume = force_resume  # ... even with other data or rewards than the checkpoint's (warned)
        self._handle_signals = handle_signals  # SIGINT/SIGTERM: checkpoint and stop; a second one exits at once
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        self.run_dir = Path(run_dir or cfg.out or f"runs/{stamp}")
        self.summary: dict[str, Any] = {}
        # busy spans (monotonic start, end): one per engine call (its groups share it), one per step
        self.timeline: dict[str, list[tuple[float, float]]] = {"generation": [], "training": []}
        self.metrics_rows: list[dict[str, Any]] = []  # one per training step
        self.eval_rows: list[dict[str, Any]] = []  # one per evaluation round (eval/* keys)

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
        self._refuse_a_used_run_dir()  # before anything is written: the files there are another run's
        queue: asyncio.Queue[Any] = asyncio.Queue()
        runner = asyncio.get_running_loop().create_task(self._run(queue), name="pipeline-run")
        try:
            while True:
                item = await queue.get()
                if item is _DONE:
                    break
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

    # ================================================================== set-up

    def _refuse_a_used_run_dir(self) -> None:
        """ConfigError if a fresh run's directory already holds a run (its log or checkpoints)."""
        if not self._resume and ((self.run_dir / "rollouts.zarr").exists() or (self.run_dir / "checkpoints").exists()):
            raise ConfigError(f"run directory {self.run_dir} already holds a run; continue it with "
                              f"python run.py --resume {self.run_dir}, or choose another out directory")

    def _write_config(self) -> None:
        """The resolved config as <run dir>/config.toml: `run.py --config` it to repeat the run."""
        (self.run_dir / "config.toml").write_text(dump_toml(replace(self.config, out=str(self.run_dir))),
                                                  encoding="utf-8")

    async def _run(self, queue: asyncio.Queue[Any]) -> None:
        cfg = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not self._resume:  # a resumed run's config.toml is replaced only once set-up accepts the resume
            self._write_config()
        configure_logging(self.run_dir, cfg.log.level, console=self._console)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._failure: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        self._built_engines: list[Engine] = []
        self._queue = queue
        self.rollout_log: RolloutLog | None = None
        self.metrics: MetricsWriter | None = None
        self.trackers: Trackers | None = None  # log.trackers, opened with metrics.jsonl
        self.lag = LoopLagMonitor()
        self.buffer: RolloutBuffer | None = None
        self._ready = False  # set-up has finished: shutdown has groups to account for and a summary to write
        self.trainer: Any = None
        self._refusals: Refusals | None = None  # this session's refused prompts, once the source is built
        self._threads_before: int | None = None  # torch threads to restore at the end
        self._switch_before: float | None = None  # the GIL switch interval to restore at the end
        self._gc_before: tuple[int, ...] | None = None  # the collector's thresholds to restore at the end
        self._stop = asyncio.Event()
        self.stopped_by: str | None = None  # what asked the run to stop early (a signal name, "request")
        self._signals_installed = False
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
            try:
                await self._shutdown(error)
            finally:
                queue.put_nowait(_DONE)

    async def _setup(self) -> None:
        cfg = self.config
        t0 = time.monotonic()
        self._check_devices()
        # prompts and rewards first (a bad data file is said before a model is built): the
        # caller's, the data files', or the built-in task's
        items, eval_items, reward = await asyncio.to_thread(self._prompt_sets)
        if cfg.data.train and self._user_prompts is None:
            self.source = PromptSource(items, seed=cfg.data.seed, epochs=self._epochs, shuffle=cfg.data.shuffle)
        else:
            self.source = PromptSource(items, seed=cfg.seed, epochs=self._epochs, shuffle=True)
        self._eval_items = eval_items[:cfg.eval.max_prompts or MAX_EVAL_PROMPTS] if cfg.eval.every else []
        self.scorer = RewardScorer(reward, self._reward_weights)
        self._refusals = Refusals(len(self.source.items))
        # what a checkpoint must have been trained on to be resumed: hashed once, off the loop
        self._fingerprint = {"data": await asyncio.to_thread(self.source.fingerprint), "reward": self.scorer.names}
        needs_model = (self._user_engines is None and cfg.engine.kind != "simulated") or \
            (self._user_trainer is None and cfg.trainer.kind == "peft") or self._tokenizer is None
        self.model_path: str | None = None
        if needs_model and cfg.model.path:
            from pipeline.models import check_model_dir

            check_model_dir(cfg.model.path)
        if needs_model:
            self.model_path = cfg.model.path or str(await asyncio.to_thread(self._build_model))
        if self._tokenizer is None:
            self._tokenizer = await self._load_tokenizer()
        self.tokenizer = self._tokenizer or None  # tokenizer=False: no text (prompts carry token ids)
        if self.tokenizer is not None:
            from pipeline.models import batch_decoder

            self._decode = batch_decoder(self.tokenizer)  # on the loop's thread
            self._decode_parallel = batch_decoder(self.tokenizer, parallel=True)  # in a worker thread
        self.max_context = self._max_context()

        # id(item) -> (item, its Prompt or the PromptError refusing it): each item is converted (and
        # tokenized) once, not every time the stream draws it; the item is kept so a reused id cannot match
        self._prompts: dict[int, tuple[Any, Prompt | PromptError]] = {}

        # storage, and where a resumed run starts from
        pc = cfg.pipeline
        self.checkpoints = CheckpointStore(self.run_dir / "checkpoints", keep=pc.keep_checkpoints)
        ck = self.checkpoints.latest() if self._resume else None
        self.start_step = ck.step if ck else 0
        self.start_version = int(ck.state["version"]) if ck else 0
        self._wall0 = float(ck.state.get("wall_s", 0.0)) if ck else 0.0  # wall time of earlier sessions
        trained_with = ck.state.get("update", "lora") if ck is not None else cfg.trainer.update
        if trained_with != cfg.trainer.update:
            raise ConfigError(f"the run in {self.run_dir} was trained with trainer.update = {trained_with!r}; "
                              f"it cannot continue with {cfg.trainer.update!r} "
                              "(its checkpoints and published versions are of the other kind)")
        if self.start_step >= pc.steps:
            raise ConfigError(f"the run in {self.run_dir} is checkpointed at step {self.start_step} and "
                              f"pipeline.steps is {pc.steps}; raise it (--steps N) to train further")
        if ck is not None:
            self._check_resumed_inputs(ck)
        if self._resume:  # accepted: from here on the run continues with this config
            self._write_config()
        self.ledger = Ledger.from_snapshot(ck.state["ledger"], self.source.total) if ck else Ledger(self.source.total)
        self.checkpoint_step: int | None = ck.step if ck else None
        # evaluation rounds the checkpoint covers (their rows are within its log rows); the others are redone
        self._eval_done: set[int] = set(ck.state.get("eval_done", ())) if ck else set()
        self.store = AdapterStore(cfg.store.root or self.run_dir / "adapters", base_model=str(self.model_path or ""),
                                  keep_last=cfg.store.keep_last, kind=cfg.trainer.update)
        self.rollout_log = RolloutLog(self.run_dir / "rollouts.zarr", meta={"config": dump_toml(cfg)},
                                      flush_every=8 * FLUSH_GROUPS)
        if self._resume:
            # what happened after the checkpoint is redone: cut it from the log, the store and the metrics
            self.rollout_log.truncate(int(ck.state["log_rows"]) if ck else 0)
            await asyncio.to_thread(self.store.discard_after, max(0, self.start_version - 1))
            kept = self._keep_metrics(self.start_step)
            self.metrics_rows = [r for r in kept if "eval/groups" not in r]
            self.eval_rows = [r for r in kept if "eval/groups" in r]
            log.info("run_resumed", run_dir=str(self.run_dir), step=self.start_step, version=self.start_version,
                     requeued=self.ledger.queued, cursor=self.ledger.cursor)
        self.metrics = MetricsWriter(self.run_dir / "metrics.jsonl")
        if cfg.log.trackers:  # here, past the checks above: a refused run leaves no tracker files behind
            self.trackers = await asyncio.to_thread(open_trackers, cfg.log.trackers, self.run_dir,
                                                    replace(cfg, out=str(self.run_dir)))

        self._share_cpu()
        if any(d.startswith("cuda") for d in (*cfg.engine.devices, cfg.trainer.device)):
            import torch

            # Initialise CUDA here, seeing every GPU, before a vLLM engine narrows CUDA_VISIBLE_DEVICES
            # to its own GPU while it starts; the trainer loads in a thread meanwhile.
            torch.cuda.init()
        # engines and trainer (started concurrently: both are slow)
        self.engines = self._user_engines or self._build_engines()
        if self._user_engines is None:
            self._built_engines = list(self.engines)
        self.buffer = RolloutBuffer(pc.batch_groups, pc.max_staleness, pc.capacity,
                                    max_groups=(pc.steps - self.start_step) * pc.batch_groups,
                                    start_version=self.start_version)
        self.outcomes = Outcomes(self.ledger, self.rollout_log, self.buffer)
        self.rotation = EngineRotation(self.engines, built=self._user_engines is None, cfg=cfg.engine,
                                       close_timeout_s=pc.shutdown_timeout_s, spawn=self._spawn,
                                       refs_in_use=lambda: self.versions.refs_in_use(),
                                       load_one=lambda e, ref: self.versions.load_one(e, ref))
        self.eval_pins = VersionPins()  # versions evaluation rounds sample with
        self.versions = Versions(rotation=self.rotation, store=self.store, buffer=self.buffer, pins=self.eval_pins,
                                 max_staleness=pc.max_staleness, load_timeout_s=cfg.engine.load_timeout_s,
                                 full_weights=cfg.trainer.update == "full", start_version=self.start_version)
        self.trainer = self._user_trainer or self._build_trainer()
        try:
            async with asyncio.timeout(cfg.engine.start_timeout_s):
                # each start runs to its end before a failure ends the run: shutdown closing a trainer
                # or engine still starting raced its start, and whichever failed first was the error
                started = await asyncio.gather(*(e.start() for e in self.engines),
                                               asyncio.to_thread(self.trainer.setup), return_exceptions=True)
        except TimeoutError:
            raise EngineDeadError(f"engines and trainer did not start within engine.start_timeout_s = "
                                  f"{cfg.engine.start_timeout_s} s") from None
        for result in started:  # the first failure in a fixed order: engines, then the trainer
            if isinstance(result, BaseException):
                raise result
        # a vLLM server reports the context it was started with (--max-model-len): prompts must fit the smallest
        served = [n for e in self.engines if isinstance(n := getattr(e, "max_model_len", None), int)]
        if served:
            self.max_context = min(served + ([self.max_context] if self.max_context is not None else []))
        dc = cfg.data
        self.prompt_builder = PromptBuilder(
            self.tokenizer, max_new_tokens=cfg.sampling.max_new_tokens, max_context=self.max_context,
            prompt_field=dc.prompt_field, apply_chat_template=dc.apply_chat_template,
            chat_template=read_chat_template(dc.chat_template) if dc.chat_template else None,
            system_prompt=dc.system_prompt)
        if ck is not None:
            # the trainer continues from the checkpoint; its version is published again (the same
            # bytes, the same directory name) and every engine serves it before the first group
            await asyncio.to_thread(self.trainer.load_state, ck.trainer_dir)
            if self.trainer.version != self.start_version:
                raise TrainerError(f"checkpoint {ck.path} holds trainer version {self.trainer.version}, "
                                   f"its ledger says {self.start_version}")
            ref = await asyncio.to_thread(self.store.publish, self.start_version, self.trainer.save_adapter)
            await self.versions.load_on_engines(ref)
            self.versions.adapters[self.start_version] = ref

        # groups of earlier sessions, by fate: the run's totals are these plus this session's
        self._base = Counter(self.ledger.fates)
        self._eval_due: asyncio.Queue[int] = asyncio.Queue()  # steps whose policy is to be evaluated
        self._eval_queued: set[int] = set()
        self._eval_prompts: list[Prompt | None] | None = None  # the eval items as Prompts, converted once
        self._busy0: dict[str, float] = {}
        self._retries = 0
        self._training: list[RolloutGroup] = []
        self._version_mismatches = 0
        self.trainer_busy = BusyMeter()
        self.setup_s = time.monotonic() - t0
        self._ready = True
        log.info("pipeline_ready", run_dir=str(self.run_dir), engines=[e.name for e in self.engines],
                 model=self.model_path, setup_s=round(self.setup_s, 2), batch_groups=pc.batch_groups,
                 max_staleness=pc.max_staleness, group_size=cfg.sampling.n)

    def _prompt_sets(self) -> tuple[list[Any], list[Any], Any]:
        """(training items, eval items, reward) from the caller, the data files or the built-in task."""
        cfg = self.config
        from pipeline.data import load_rows

        task = None
        if self._user_prompts is None and not cfg.data.train or self._user_reward is None:
            task = build_task(cfg.task, cfg.sampling.max_new_tokens)
        if self._user_prompts is not None:
            items = list(self._user_prompts)
        else:
            items = load_rows(cfg.data.train, "data.train") if cfg.data.train else task.prompts
        eval_items: list[Any] = []
        if self._user_eval_prompts is not None:
            eval_items = list(self._user_eval_prompts)
        elif cfg.data.eval:
            eval_items = load_rows(cfg.data.eval, "data.eval")
        elif cfg.eval.every and task is not None and self._user_prompts is None and not cfg.data.train:
            # the built-in task holds out prompts drawn with another seed
            eval_items = build_task(replace(cfg.task, seed=cfg.task.seed + 1), cfg.sampling.max_new_tokens).prompts
        if cfg.eval.every and not eval_items:
            raise ConfigError("eval.every is set but there are no eval prompts: set data.eval to a file "
                              "(or pass eval_prompts= to Pipeline)")
        return items, eval_items, self._user_reward or task.reward

    def _check_devices(self) -> None:
        """Each CUDA device the pipeline builds an engine or the trainer on exists (ConfigError naming its key)."""
        from pipeline.devices import check_cuda_devices

        cfg = self.config
        named: list[tuple[str, str]] = []
        if self._user_engines is None and cfg.engine.kind in ("transformers", "vllm"):
            named += [(f"engine.devices[{i}]", d) for i, d in enumerate(cfg.engine.devices)]
        if self._user_trainer is None and cfg.trainer.kind == "peft":
            named.append(("trainer.device", cfg.trainer.device))
        check_cuda_devices(named)

    async def _load_tokenizer(self) -> Any:
        """The model's tokenizer; one that model.path cannot give is bad input (ConfigError)."""
        from transformers import AutoTokenizer

        try:
            return await asyncio.to_thread(AutoTokenizer.from_pretrained, self.model_path,
                                           trust_remote_code=self.config.model.trust_remote_code)
        except Exception as e:  # transformers raises OSError, ValueError, KeyError... for a folder it cannot read
            if not self.config.model.path:
                raise  # the built-in model's: our bug, not the input's
            raise ConfigError(f"model.path: no tokenizer could be loaded from {self.model_path!r}: "
                              f"{type(e).__name__}: {e}") from e

    def _check_resumed_inputs(self, ck: Any) -> None:
        """The checkpoint was trained on these prompts (same items, same order) and reward functions;
        ConfigError naming what changed, unless force_resume (then a warning). A checkpoint written
        before fingerprints were resumes unchecked, with a warning."""
        old = ck.state.get("fingerprint")
        if old is None:
            log.warning("resume_unchecked", checkpoint=str(ck.path),
                        reason="the checkpoint predates data and reward fingerprints")
            return
        new = self._fingerprint
        changed: dict[str, str] = {}
        was, now = old["data"], new["data"]
        if (was["sha256"], was["items"]) != (now["sha256"], now["items"]):
            changed["data"] = (f"other prompts than the checkpoint's ({now['items']} items, sha256 "
                               f"{now['sha256'][:12]}, against {was['items']} items, sha256 {was['sha256'][:12]})")
        elif (was["seed"], was["shuffle"]) != (now["seed"], now["shuffle"]):
            changed["data"] = (f"the prompts in another order (seed {was['seed']} -> {now['seed']}, "
                               f"shuffle {was['shuffle']} -> {now['shuffle']})")
        if old["reward"] != new["reward"]:
            changed["reward"] = f"reward functions {old['reward']} -> {new['reward']}"
        if not changed:
            return
        if self._force_resume:
            log.warning("resume_forced", checkpoint=str(ck.path), changed=sorted(changed), **changed)
            return
        raise ConfigError(f"the run in {self.run_dir} cannot resume with {'; and '.join(changed.values())}: a "
                          f"group id would name another prompt or score; pass --force-resume "
                          f"(Pipeline(force_resume=True)) to continue anyway")

    def _keep_metrics(self, step: int) -> list[dict[str, Any]]:
        """Rewrite metrics.jsonl with the step rows of steps <= `step` and the eval rows of the rounds
        the checkpoint covers only; return them."""
        path = self.run_dir / "metrics.jsonl"
        rows = [r for r in read_jsonl(path) if r.get("step", 0) <= step
                and ("eval/groups" not in r or r["step"] in self._eval_done)] if path.exists() else []
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        os.replace(tmp, path)
        return rows

    def _share_cpu(self) -> None:
        """Engine and trainer both computing on the CPU: give each half the cores.

        Two torch threads that each run a full-width OpenMP team oversubscribe the cores, and
        the spinning teams slowed the tiny model's decoding by up to 100x on a 2-core machine.
        Also at max_staleness 0, where they take turns: the tiny model's ops are too small for
        a second thread to pay (vs_trl on 2 cores: 207 samples/s with both, 354 with half).
        """
        cfg = self.config
        if cfg.trainer.device == "cpu" and cfg.trainer.kind == "peft" and cfg.engine.kind == "transformers" \
                and "cpu" in cfg.engine.devices:
            import os

            import torch

            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))

    def _build_model(self) -> Path:
        from pipeline.models import build_model

        return build_model(self.config.model.shape, self.config.model.cache_dir, seed=self.config.seed)

    def _max_context(self) -> int | None:
        cfg = self.config
        if cfg.engine.kind == "vllm":
            return cfg.engine.vllm.max_model_len
        if self.model_path is None:
            return None
        try:
            conf = json.loads((Path(self.model_path) / "config.json").read_text())
        except (OSError, ValueError):  # a model without a readable config.json gets no length check
            return None
        return conf.get("max_position_embeddings")

    def _build_engines(self) -> list[Engine]:
        cfg = self.config
        K = cfg.pipeline.max_staleness
        full = self._full_weights
        offset = 1009 * self.start_step  # a resumed run samples afresh, not the first session's draws
        engines: list[Engine] = []
        if cfg.engine.kind == "vllm_server":  # servers someone else started: one engine per URL
            from pipeline.engines.vllm_server import VLLMServerEngine

            return [VLLMServerEngine(url, sampling=cfg.sampling, cfg=cfg.engine.vllm_server, max_staleness=K,
                                     name=f"vllm-server-{i}") for i, url in enumerate(cfg.engine.vllm_server.urls)]
        for i, dev in enumerate(cfg.engine.devices):
            if cfg.engine.kind == "simulated":
                from pipeline.engines.simulated import SimulatedEngine

                engines.append(SimulatedEngine(cfg.engine.simulated, seed=cfg.seed + offset + i, name=f"simulated-{i}",
                                               full_weights=full))
            elif cfg.engine.kind == "transformers":
                from pipeline.engines.transformers import TransformersEngine

                engines.append(TransformersEngine(
                    self.model_path, sampling=cfg.sampling, cfg=cfg.engine.transformers, device=dev,
                    dtype=cfg.model.dtype, max_loaded_adapters=cfg.engine.transformers.max_loaded_adapters or K + 1,
                    seed=cfg.seed + offset + i, name=f"transformers-{i}", trust_remote_code=cfg.model.trust_remote_code,
                    full_weights=full))
            else:
                from pipeline.engines.vllm import VLLMEngine

                engines.append(VLLMEngine(self.model_path, sampling=cfg.sampling, cfg=cfg.engine.vllm, device=dev,
                                          max_staleness=K, name=f"vllm-{i}",
                                          seed=cfg.engine.vllm.seed + offset + i, full_weights=full))
        return engines

    def _build_trainer(self) -> Any:
        cfg = self.config
        if cfg.trainer.kind == "simulated":
            from pipeline.trainer import SimulatedTrainer

            return SimulatedTrainer(cfg.trainer.step_s, update=cfg.trainer.update)
        from pipeline.trainer import LoRATrainer
        from pipeline.trainer_process import ProcessTrainer

        cls = ProcessTrainer if cfg.trainer.separate_process else LoRATrainer
        return cls(self.model_path, cfg.trainer, cfg.loss, seed=cfg.seed,
                           trust_remote_code=cfg.model.trust_remote_code,
                           keep_versions=cfg.pipeline.max_staleness + 2)

    # ================================================================== task bookkeeping

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and not isinstance(exc, BufferClosed) and not self._failure.done():
            self._failure.set_result(exc)

    async def _main(self) -> None:
        if self._handle_signals:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self._on_signal, sig)
            self._signals_installed = True
        if self.config.pipeline.switch_interval_ms:
            # a worker thread holding the GIL (the engine's Python glue, a zarr flush) keeps the
            # loop waiting up to this long; Python's 5 ms default was the loop's lag on 2 cores
            self._switch_before = sys.getswitchinterval()
            sys.setswitchinterval(self.config.pipeline.switch_interval_ms / 1000)
        if self.config.pipeline.gc_threshold:
            self._gc_before = quiet_gc(self.config.pipeline.gc_threshold)  # undone at the end
        self.lag.start()
        self._t_start = time.monotonic()
        # engines may have served earlier runs: this run's busy time counts from here
        self._busy0 = {e.name: e.busy.busy_total() for e in self.engines}
        self._spawn(self._admission_loop(), "admission-loop")
        self._spawn(self.versions.adapter_loop(), "adapter-loop")
        self._spawn(self.outcomes.flush_loop(), "rollout-log-flush-loop")
        if self._eval_items:
            self._spawn(self._eval_loop(), "eval-loop")
            if is_due(self.start_step, self.config.eval.every, self.config.pipeline.steps):
                self._request_eval(self.start_step)  # before the first step (again on resume, if it was cut)
        train = self._spawn(self._train_loop(), "train-loop")
        done, _ = await asyncio.wait({train, self._failure}, return_when=asyncio.FIRST_COMPLETED)
        if self._failure.done():
            raise self._failure.result()
        train.result()

    # ================================================================== the loops

    def _to_prompt(self, item: Any) -> Prompt:
        """A data-source item as a validated Prompt (PromptError, with its reason, if it cannot be one)."""
        return self.prompt_builder.build(item)

    async def _admission_loop(self) -> None:
        """Consumes ledger ids (stream positions); produces generation tasks; waits on admission.

        Groups admitted together share a version: with an engine that samples many groups per
        call (`generate_many`) they go as one call, up to batch_groups at a time; otherwise each
        gets its own task. One task per group costs more than the group itself once the engine
        is fast, so batching is what keeps the loop's cost per group small.
        """
        batching = [hasattr(e, "generate_many") for e in self.engines]
        max_wave = self.config.pipeline.batch_groups if all(batching) else 1
        while (gid := self.ledger.next_id()) is not None:
            prompt = self._prompt_or_refuse(gid)
            if prompt is None:
                await asyncio.sleep(0)  # a run of refusals must not hold the loop: signal handlers run on it
                continue
            adm = await self.buffer.admit(gid)
            if adm is None:
                self.ledger.give_back(gid)
                return
            # more groups that may start now, without waiting: the same version, so one call
            room = self.buffer.admission_room()
            ids, prompts = [gid], [prompt]
            while len(ids) <= room and (gid := self.ledger.next_id()) is not None:
                prompt = self._prompt_or_refuse(gid)
                if prompt is None:
                    break  # refusals end the wave: the outer loop yields between them
                ids.append(gid)
                prompts.append(prompt)
            adms = [adm, *self.buffer.try_admit_many(ids[1:])]
            for gid in reversed(ids[len(adms):]):  # not started (nothing awaited since `room`, so none)
                self.ledger.give_back(gid)
            wave = self._start(adms, prompts)
            for i in range(0, len(wave), max_wave):
                part = wave[i:i + max_wave]
                if max_wave == 1:
                    self._spawn(self._group_task(*part[0]), f"group-{part[0][0].group_id}")
                else:
                    self._spawn(self._wave_task(part), f"groups-{part[0][0].group_id}+{len(part)}")
        await self.buffer.finish_admission()
        log.info("prompts_exhausted", cursor=self.ledger.cursor)

    def _prompt_or_refuse(self, gid: int) -> Prompt | None:
        """Item `gid` of the stream as a Prompt; a malformed one is refused (settled), not the run,
        unless every item of the source is (ConfigError: the run could only refuse them again)."""
        index = self.source.index_at(gid)
        item = self.source.items[index]
        hit = self._prompts.get(id(item))
        if hit is None or hit[0] is not item:
            try:
                hit = (item, self._to_prompt(item))
                self._refusals.accept()
            except PromptError as e:  # this item is refused, now and whenever the stream draws it again
                hit = (item, e)
            self._prompts[id(item)] = hit
        if not isinstance(hit[1], PromptError):
            return hit[1]
        error = hit[1]
        self.ledger.settle(gid, "refused", error.reason)
        n = self._refusals.refuse(index, error.reason, str(error))
        if n <= LOGGED_PER_REASON:
            more = {"hint": "further refusals of this kind are counted, not logged"} if n == LOGGED_PER_REASON else {}
            log.warning("prompt_refused", group_id=gid, reason=str(error), kind=error.reason, **more)
        if self._refusals.everything_refused:
            raise ConfigError(f"every prompt of the data set was refused: {self._refusals.items} of "
                              f"{self._refusals.items} distinct prompts, none usable ({self._refusals.describe()})")
        return None

    def _start(self, adms: list[Admission], prompts: list[Prompt]) -> list[tuple[Admission, GroupRequest]]:
        """Admitted groups are in flight: each one's request, and its entry among the live groups."""
        sampling = self.config.sampling
        base = self.config.seed * 1_000_003
        wave = []
        for adm, prompt in zip(adms, prompts):
            crash_point("admission")
            gid = adm.group_id
            seed = (base + gid) % 2**31 if sampling.per_request_seed else None
            wave.append((adm, GroupRequest(gid, prompt, sampling.n, sampling.max_new_tokens, seed)))
        self.outcomes.start(adms, prompts)
        return wave

    async def _generate(self, adm: Admission, request: GroupRequest, attempt: int = 0) -> Generation | None:
        """One group from the engines: retried (with backoff, on the least loaded engine) until it
        succeeds or engine.retries are spent; None means it failed for good (already settled).
        `attempt` > 0 continues the retries of a group whose batch call failed it."""
        ec = self.config.engine
        while True:
            if attempt:
                await asyncio.sleep(ec.retry_backoff_s * 2 ** (attempt - 1))
            async with self.rotation.call() as (engine, epoch):
                try:
                    async with asyncio.timeout(ec.request_timeout_s):
                        gen = await engine.generate(request, self.versions.adapters[adm.version])
                    self.rotation.succeeded(engine)
                    return gen
                except _ENGINE_ERRORS as e:
                    error = e
            self.rotation.failed(engine, error, epoch)
            attempt = await self._after_failed_attempt(adm, engine, error, attempt)
            if attempt < 0:
                return None

    async def _after_failed_attempt(self, adm: Admission, engine: Engine, error: BaseException, attempt: int) -> int:
        """The attempt to retry next, or -1: the group failed for good (settled here).

        An engine call failing is this attempt's failure, counted and logged, not the run's; a
        dead engine's calls do not use up retries (another engine, or this one restarted, takes the
        group)."""
        ec = self.config.engine
        reason = "generation_timeout" if isinstance(error, TimeoutError) else "generation_error"
        can_generate = self.rotation.can_generate
        if isinstance(error, EngineDeadError) and can_generate:
            return attempt
        if attempt >= ec.retries or not can_generate:
            log.warning("group_failed", group_id=adm.group_id, engine=engine.name, reason=reason,
                        attempts=attempt + 1, error=repr(error))
            await self.outcomes.settle_failed(adm.group_id, reason, None, None)
            if not can_generate:
                raise self.rotation.no_engine_error()  # nothing can generate any more
            return -1
        self._retries += 1
        log.info("generation_retry", group_id=adm.group_id, engine=engine.name, attempt=attempt + 1,
                 reason=reason, error=repr(error))
        return attempt + 1

    async def _group_task(self, adm: Admission, request: GroupRequest, attempt: int = 0) -> None:
        """Generates, scores and buffers one group; every outcome leaves through _settle."""
        gen = await self._generate(adm, request, attempt)
        if gen is not None:
            await self._accept([(adm, gen)])

    async def _wave_task(self, wave: list[tuple[Admission, GroupRequest]]) -> None:
        """Groups admitted together (one version), sampled by one `generate_many` call; a group
        the call failed goes on alone, through the per-group retries."""
        ec = self.config.engine
        async with self.rotation.call() as (engine, epoch):
            try:
                async with asyncio.timeout(ec.request_timeout_s):
                    results = await engine.generate_many([r for _, r in wave],
                                                         self.versions.adapters[wave[0][0].version])
                if len(results) != len(wave):
                    raise GenerationError(f"engine {engine.name} returned {len(results)} results for {len(wave)} groups")
            except _ENGINE_ERRORS as e:  # this call failed: each group goes on alone through its retries
                results = [e] * len(wave)
        done: list[tuple[Admission, Generation]] = []
        failed = False
        for (adm, request), r in zip(wave, results):
            if isinstance(r, Generation):
                done.append((adm, r))
                continue
            if not failed:  # one failed call counts once against the engine
                self.rotation.failed(engine, r, epoch)
                failed = True
            attempt = await self._after_failed_attempt(adm, engine, r, 0)
            if attempt >= 0:
                self._spawn(self._group_task(adm, request, attempt), f"group-{adm.group_id}")
        if not failed:
            self.rotation.succeeded(engine)
        if done:
            await self._accept(done)

    async def _accept(self, items: list[tuple[Admission, Generation]]) -> None:
        """Check, decode, score and buffer generated groups; each one that cannot be kept is settled."""
        cfg = self.config
        keep: list[tuple[Admission, Generation]] = []
        spans = self.timeline["generation"]
        for adm, gen in items:
            crash_point("group.after_generate")
            if not spans or spans[-1] != (gen.t_start, gen.t_end):  # the groups of one call share theirs
                spans.append((gen.t_start, gen.t_end))
            if gen.version != adm.version or len(gen.completions) != gen.request.n:
                self._version_mismatches += gen.version != adm.version
                log.error("generation_contract_broken", group_id=adm.group_id, engine=gen.engine,
                          asked_version=adm.version, got_version=gen.version, completions=len(gen.completions))
                await self.outcomes.settle_failed(adm.group_id, "version_mismatch" if gen.version != adm.version
                                          else "wrong_completion_count", gen, None)
                continue
            keep.append((adm, gen))
        ids = [[c.token_ids.tolist() for c in gen.completions] for _, gen in keep]
        texts = await self._texts(ids)
        scores = await self.scorer.score_many_parts([gen.request.prompt for _, gen in keep], texts, ids)
        groups: list[RolloutGroup] = []
        now = time.monotonic()
        for (adm, gen), scored in zip(keep, scores):
            if isinstance(scored, RewardError):  # a reward bug fails this group; the run goes on
                log.warning("group_failed", group_id=adm.group_id, reason="reward_error", error=str(scored))
                await self.outcomes.settle_failed(adm.group_id, "reward_error", gen, None)
                continue
            rewards, parts = scored
            self.outcomes.scored()
            if cfg.pipeline.filter_zero_advantage and rewards.min() == rewards.max():
                await self.buffer.drop(adm.group_id, "zero_advantage")
                self.outcomes.record(adm.group_id, "dropped", "zero_advantage", -1, gen, rewards)
                continue
            groups.append(RolloutGroup(gen, rewards, now, parts))
        try:
            await self.buffer.put_many(groups)
            self.ledger.set_state_many([g.group_id for g in groups], "buffered")
        except BufferClosed:
            # shutting down: keep what was produced in the log (what was put is the buffer's to report)
            for g in groups:
                if self.buffer.is_in_flight(g.group_id):  # not stored before the close
                    self.buffer.settle_in_flight(g.group_id, "shutdown")
                    self.outcomes.record(g.group_id, "dropped", "shutdown", -1, g.generation, g.rewards)

    async def _texts(self, ids: list[list[list[int]]]) -> list[list[str]]:
        """Each group's completions [groups][n] of token ids decoded ("" each without a tokenizer)."""
        if self.tokenizer is None:
            return [[""] * len(per) for per in ids]
        every = [x for per in ids for x in per]
        if sum(map(len, every)) >= DECODE_OFF_LOOP_TOKENS:  # off the loop: vLLM's output handling runs there
            flat = await asyncio.to_thread(self._decode_parallel, every)
        else:
            flat = self._decode(every)
        texts, i = [], 0
        for per in ids:
            texts.append(flat[i:i + len(per)])
            i += len(per)
        return texts

    async def _train_loop(self) -> None:
        """Consumes batches (EDF under the staleness bound); produces published versions; waits on the buffer."""
        from tqdm import tqdm

        pc = self.config.pipeline

        bar = tqdm(total=pc.steps, desc="steps", unit="step", dynamic_ncols=True,
                   disable=not (self.config.log.progress and self._console and sys.stderr.isatty()))
        try:
            await self._train_steps(bar)
        finally:
            bar.close()

    async def _until_stopped(self, coro: Any) -> Any:
        """Await `coro` unless a stop is requested first (then cancel it and return _DONE)."""
        if self._stop.is_set():
            coro.close()
            return _DONE
        task = asyncio.ensure_future(coro)
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()  # no orphan: a get_batch left running could take groups nobody trains
            if task.done() and not task.cancelled() and task.exception() is None:
                self._take_selection(task.result())  # it finished as we were cancelled
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
        return _DONE

    def _take_selection(self, sel: Any) -> None:
        """Record what the buffer dropped at selection; hold the batch as training (shutdown drops it if need be)."""
        for g, reason in sel.dropped:
            self.outcomes.record(g.group_id, "dropped", reason, -1, g.generation, g.rewards)
        self._training = sel.groups
        self.ledger.set_state_many([g.group_id for g in sel.groups], "training")

    async def _trainer_call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """A blocking trainer call in a thread, under trainer.step_timeout_s."""
        timeout = self.config.trainer.step_timeout_s
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.to_thread(fn, *args)
        except TimeoutError:
            raise TrainerError(f"trainer {what} took longer than trainer.step_timeout_s = {timeout} s") from None

    def _step_and_publish(self, batch: Batch) -> tuple[TrainStats, AdapterRef, float]:
        """A training step, then the publish of the version it made, in one worker-thread call
        (one thread hop a step, not two); returns the step's stats, the ref and the publish's seconds."""
        stats = self.trainer.step(batch)
        crash_point("step.after_train")
        t_pub = time.monotonic()
        ref = self.store.publish(stats.version, self.trainer.save_adapter)
        return stats, ref, time.monotonic() - t_pub

    async def _checkpoint(self, step: int) -> None:
        """Write the checkpoint of `step`: trainer state and the ledger, with the log rows it covers."""
        if step == 0 or step == self.checkpoint_step:
            return  # nothing trained yet, or this step is already checkpointed
        # one moment on the loop: the ledger and the RolloutLog agree on what has settled
        state = {"ledger": self.ledger.snapshot(), "log_rows": len(self.rollout_log), "version": self.trainer.version,
                 "update": self.config.trainer.update, "eval_done": sorted(self._eval_done),
                 "fingerprint": self._fingerprint,
                 "metrics_rows": len(self.metrics_rows), "wall_s": self._wall0 + time.monotonic() - self._t_start}
        await asyncio.to_thread(self.rollout_log.flush)  # rows [0, log_rows) are durable before the checkpoint
        await self._trainer_call("checkpoint", self.checkpoints.write, step, state, self.trainer.save_state)
        self.checkpoint_step = step

    async def _train_steps(self, bar: Any) -> None:
        pc = self.config.pipeline
        version = self.start_version
        bar.update(self.start_step)
        for step in range(self.start_step + 1, pc.steps + 1):
            t_wait = time.monotonic()
            sel = await self._until_stopped(self.buffer.get_batch(version))
            if sel is _DONE:
                break
            wait_s = time.monotonic() - t_wait
            self._take_selection(sel)
            if not sel.groups:
                log.info("out_of_data", step=step)
                break
            # the version this step trains from is worth keeping only if a check within the next
            # max_staleness steps may meet groups sampled with it (in full mode, a whole model a step)
            keep = any(self._checks_at(s) for s in range(step + 1, step + pc.max_staleness + 1))
            batch = Batch(step, version, tuple(sel.groups), keep_version=keep)
            check: dict[str, float] = {}
            if self._checks_at(step):
                check = await self._logprob_check(batch)
            with self.trainer_busy:
                stats, ref, publish_s = await self._trainer_call(f"step {step} and its publish",
                                                                 self._step_and_publish, batch)
            self.timeline["training"].append((stats.t_start, time.monotonic()))
            self.versions.published(ref)
            self.buffer.commit(sel.groups)
            self._training = []
            self.outcomes.record_many([(g.group_id, "trained", "", step, g.generation, g.rewards) for g in batch.groups])
            crash_point("step.after_record")
            version = stats.version
            row = self._step_row(batch, stats.metrics, check, wait_s, publish_s, ref)
            self._write_metrics(row)
            self.metrics_rows.append(row)
            self._queue.put_nowait(StepResult(step, version, row))
            log.debug("step", step=step, version=version, reward_mean=round(row["reward_mean"], 4),
                      staleness_max=row["staleness_max"], wait_s=round(wait_s, 3),
                      train_s=round(stats.t_end - stats.t_start, 3))
            bar.update(1)
            if not bar.disable:  # formatting the postfix costs even when nothing is shown
                bar.set_postfix(reward=f"{row['reward_mean']:.3f}", stale=row["staleness_max"], refresh=False)
            skips = self.trainer.consecutive_skips
            if skips >= self.config.trainer.max_consecutive_skips:
                await self._checkpoint(step)
                raise TrainerError(f"{skips} training steps in a row had a non-finite loss or gradient "
                                   f"(trainer.max_consecutive_skips = {self.config.trainer.max_consecutive_skips}); "
                                   f"stopped after checkpointing step {step}: lower trainer.lr or check the rewards")
            if step < pc.steps and is_due(step, self.config.eval.every, pc.steps):
                self._request_eval(step)
            # the last step's checkpoint is the end's, after its evaluation, so the checkpoint covers it
            if pc.checkpoint_every and step % pc.checkpoint_every == 0 and (step < pc.steps or not self._eval_items):
                await self._checkpoint(step)
            if self._stop.is_set():
                break
        last = self.metrics_rows[-1]["step"] if self.metrics_rows else self.start_step
        if self._eval_items and not self._stop.is_set():  # the end of the run (not a stop): evaluate the last policy
            self._request_eval(last)
            await self._until_stopped(self._eval_due.join())
        # the end of the run, or a stop request: the state to continue from
        await self._checkpoint(last)

    def _request_eval(self, step: int) -> None:
        """Queue an evaluation round of the policy of `step` (once per step)."""
        if step not in self._eval_queued and step not in self._eval_done:
            self._eval_queued.add(step)
            self._eval_due.put_nowait(step)

    async def _eval_loop(self) -> None:
        """Consumes steps to evaluate; produces eval rows (metrics.jsonl, trackers) and eval groups
        (rollouts.zarr, fate "eval"); waits on the step's version being served, then on the engines.

        A round samples at the serving version once it is the step's (or, if engines could not load
        that one, at the one they serve); it shares the engines with training groups, never the buffer.
        """
        while True:
            step = await self._eval_due.get()
            try:
                await self.versions.wait_serving(step)
                await self._eval_round(step)
            finally:
                self._eval_due.task_done()

    def _eval_prompt_list(self) -> list[Prompt | None]:
        """The eval prompts (None where one is refused), converted once; ConfigError if all are refused."""
        if self._eval_prompts is None:
            prompts: list[Prompt | None] = []
            reasons: Counter[str] = Counter()
            for item in self._eval_items:
                try:
                    prompts.append(self._to_prompt(item))
                except PromptError as e:
                    prompts.append(None)
                    if not reasons[e.reason]:
                        log.warning("eval_prompt_refused", reason=e.reason, error=str(e))
                    reasons[e.reason] += 1
            if not any(p is not None for p in prompts):
                raise ConfigError(f"every one of the {len(prompts)} eval prompts was refused "
                                  f"({', '.join(f'{r}: {n}' for r, n in reasons.items())}); see events.jsonl")
            self._eval_prompts = prompts
        return self._eval_prompts

    async def _eval_round(self, step: int) -> None:
        """One evaluation of the serving policy: every eval prompt sampled eval.n times, scored, logged."""
        ec, sampling = self.config.eval, self.config.sampling
        t0 = time.monotonic()
        prompts = self._eval_prompt_list()
        base = self.config.seed * 1_000_003
        requests = [GroupRequest(eval_group_id(step, i), p, ec.n, sampling.max_new_tokens,
                                 (base + eval_group_id(step, i)) % 2**31 if sampling.per_request_seed else None)
                    for i, p in enumerate(prompts) if p is not None]
        version = await self.eval_pins.pin(lambda: self.versions.served)
        try:
            results = await self._eval_generate(requests, self.versions.adapters[version])
        finally:
            await self.eval_pins.unpin(version)
        gens = [r for r in results if isinstance(r, Generation)]
        texts = await self._texts([[c.token_ids.tolist() for c in g.completions] for g in gens])
        scores = await self.scorer.score_many_parts([g.request.prompt for g in gens], texts,
                                                    [[c.token_ids.tolist() for c in g.completions] for g in gens])
        by_id = {g.request.group_id: s for g, s in zip(gens, scores)}
        now = time.monotonic()
        outcomes, rewards, parts = [], [], []
        for request, r in zip(requests, results):
            scored = by_id.get(request.group_id)
            if not isinstance(r, Generation):
                log.warning("eval_group_failed", step=step, group_id=request.group_id, error=repr(r))
                outcomes.append(GroupOutcome(request.group_id, request.prompt, version, "eval", "generation_error",
                                             step, None, None, t0, now))
            elif isinstance(scored, RewardError):
                log.warning("eval_group_failed", step=step, group_id=request.group_id, error=str(scored))
                outcomes.append(GroupOutcome(request.group_id, request.prompt, version, "eval", "reward_error",
                                             step, r, None, t0, now))
            else:
                rewards.append(scored[0])
                parts.append(scored[1])
                outcomes.append(GroupOutcome(request.group_id, request.prompt, version, "eval", "", step, r,
                                             scored[0], t0, now))
        # one moment on the loop: the round's rows and its metrics row appear together, or neither does
        self.outcomes.record_eval(outcomes)
        metrics = round_metrics(rewards, parts, self.scorer.names, ec.n, ec.pass_threshold)
        row = eval_row(step, version, metrics, len(rewards), len(requests) - len(rewards),
                       len(prompts) - len(requests), time.monotonic() - t0)
        self._write_metrics(row)
        self.eval_rows.append(row)
        self._eval_done.add(step)
        log.info("eval_done", step=step, version=version, groups=len(rewards), seconds=round(row["eval/seconds"], 3),
                 **{k.split("/", 1)[1]: round(v, 4) for k, v in metrics.items()})

    async def _eval_generate(self, requests: list[GroupRequest], ref: AdapterRef) -> list[Generation | BaseException]:
        """Each eval group's Generation or its last error: in calls of up to batch_groups groups
        (generate_many where every engine has it, else one group a call), all at once; a call that
        fails is retried (engine.retries, with backoff) for the groups it failed."""
        ec = self.config.engine
        size = self.config.pipeline.batch_groups if all(hasattr(e, "generate_many") for e in self.engines) else 1

        async def chunk(part: list[GroupRequest]) -> list[Generation | BaseException]:
            out: list[Generation | BaseException] = [GenerationError("not generated")] * len(part)
            todo = list(range(len(part)))
            for attempt in range(ec.retries + 1):
                if attempt:
                    await asyncio.sleep(ec.retry_backoff_s * 2 ** (attempt - 1))
                async with self.rotation.call() as (engine, epoch):
                    try:
                        async with asyncio.timeout(ec.request_timeout_s):
                            if len(todo) == 1:
                                got: list[Any] = [await engine.generate(part[todo[0]], ref)]
                            else:
                                got = list(await engine.generate_many([part[i] for i in todo], ref))
                        if len(got) != len(todo):
                            raise GenerationError(f"engine {engine.name} returned {len(got)} results for "
                                                  f"{len(todo)} groups")
                    except _ENGINE_ERRORS as e:  # this call failed: counted against the engine, retried
                        got = [e] * len(todo)
                for i, r in zip(todo, got):
                    out[i] = r
                todo = [i for i in todo if not isinstance(out[i], Generation)]
                if not todo:
                    self.rotation.succeeded(engine)
                    break
                self.rotation.failed(engine, out[todo[0]], epoch)
            return out

        parts = await asyncio.gather(*(chunk(requests[i:i + size]) for i in range(0, len(requests), size)))
        return [r for part in parts for r in part]

    def _write_metrics(self, row: dict[str, Any]) -> None:
        """A metrics row to metrics.jsonl, then to the trackers (log.trackers) at its step."""
        self.metrics.write(row)
        if self.trackers is not None:
            self.trackers.log(row, step=row["step"])

    @property
    def _full_weights(self) -> bool:
        """Versions are whole models (trainer.update = "full"): engines drain before loading one."""
        return self.config.trainer.update == "full"

    def _checks_at(self, step: int) -> bool:
        """Whether `step` starts with a log-prob check: the run's first step, then every logprob_check_every."""
        every = self.config.pipeline.logprob_check_every
        return step == self.start_step + 1 or bool(every and (step - 1) % every == 0)

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
            log.error("exiting_now", signal=sig.name, checkpoint_step=self.checkpoint_step)
            close_logging()
            os._exit(128 + sig.value)
        self.request_stop(sig.name)

    async def _logprob_check(self, batch: Batch) -> dict[str, float]:
        """Recompute the trainer's log-probs of a few groups (under their own versions) against the engine's."""
        n = self.config.pipeline.logprob_check_groups
        groups = [g for g in batch.groups][:n]
        if not groups:
            return {}
        try:
            trainer_lp = await asyncio.to_thread(self.trainer.recompute_logprobs, groups)
        except KeyError as e:  # the trainer no longer holds that version's weights: skip this check
            log.warning("logprob_check_skipped", reason=str(e))
            return {}
        eng = np.concatenate([c.logprobs for g in groups for c in g.completions]).astype(np.float64)
        tr = np.concatenate([x for per in trainer_lp for x in per]).astype(np.float64)
        import torch

        mm = logprob_mismatch(torch.from_numpy(eng), torch.from_numpy(tr))
        out = {f"check/{k}": float(v) for k, v in mm.items()}
        lvl = "warning" if out.get("check/mean_abs_diff", 0.0) > self.config.pipeline.logprob_warn_mean_abs else "info"
        getattr(log, lvl)("logprob_check", step=batch.step, groups=len(groups),
                          **{k.split("/")[1]: round(v, 5) for k, v in out.items()})
        if lvl == "warning":
            log.warning("logprob_contract_violated", mean_abs_diff=out.get("check/mean_abs_diff"),
                        threshold=self.config.pipeline.logprob_warn_mean_abs,
                        hint="engine and trainer disagree on the policy: check dtype, adapter loading, sampling")
        return out

    def _step_row(self, batch: Batch, train: dict[str, float], check: dict[str, float], wait_s: float,
                  publish_s: float, ref: AdapterRef) -> dict[str, Any]:
        now = time.monotonic()
        wall = now - self._t_start
        stal = batch.staleness
        rewards = np.concatenate([g.rewards for g in batch.groups])
        reward_mean = float(rewards.mean())
        dev = rewards - reward_mean
        c = self.buffer.counts
        started, trained, dropped, failed = self._totals()
        row: dict[str, Any] = {
            "step": batch.step, "version": ref.version, "wall_s": self._wall0 + wall,
            "reward_mean": reward_mean, "reward_std": math.sqrt(float(dev @ dev) / dev.size),
            "staleness_max": int(max(stal)), "staleness_mean": sum(stal) / len(stal),
            "groups": len(batch.groups), "tokens": batch.num_tokens,
            "rollout/started": started, "rollout/trained": trained, "rollout/in_flight": c.in_flight,
            "rollout/buffered": c.buffered, "rollout/dropped": sum(dropped.values()),
            "rollout/failed": sum(failed.values()), "rollout/version_mismatch": self._version_mismatches,
            "rollout/retries": self._retries,
            "engine/in_rotation": len(self.rotation.healthy),
            "rollout/versions_verified": len(batch.groups),
            "time/wait_batch_s": wait_s, "time/publish_s": publish_s,
            "adapter/publish_to_loaded_s": self.versions.publish_to_loaded.get(ref.version - 1, float("nan")),
            "busy/generator": self._generator_busy() / max(wall, 1e-9),
            "busy/trainer": self.trainer_busy.busy_total() / max(wall, 1e-9),
            "loop/lag_p99_ms": self.lag.percentile_ms(99, last=2000),
        }
        if self._full_weights:  # how long admission waited for the drain before the load
            row["adapter/drain_s"] = self.versions.drain_s.get(ref.version - 1, float("nan"))
        parts = [g.reward_parts for g in batch.groups if g.reward_parts is not None]
        if len(parts) == len(batch.groups):  # each function's own mean, beside the weighted reward_mean
            means = np.concatenate(parts, axis=1).mean(axis=1)
            row.update({f"reward/{name}": float(m) for name, m in zip(self.scorer.names, means)})
        row.update(train)
        row.update(check)
        return row

    def _generator_busy(self) -> float:
        """Busy seconds of the generation tier: mean over engines of each engine's own busy time."""
        return float(np.mean([e.busy.busy_total() - self._busy0.get(e.name, 0.0) for e in self.engines]))

    # ================================================================== shutdown

    async def _shutdown(self, error: BaseException | None) -> None:
        timeout = self.config.pipeline.shutdown_timeout_s
        wall = time.monotonic() - self._t_start
        if self._signals_installed:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        if self._ready:
            left, _ = await self.buffer.close()
            for g in left:
                self.outcomes.record(g.group_id, "dropped", "shutdown", -1, g.generation, g.rewards)
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=timeout)
            if pending:
                log.error("shutdown_tasks_stuck", tasks=[t.get_name() for t in pending])
        if self._ready:
            self.buffer.abandon(self._training, "shutdown")
            for g in self._training:
                self.outcomes.record(g.group_id, "dropped", "shutdown", -1, g.generation, g.rewards)
            self._training = []
            self.outcomes.drop_live("shutdown")
        await self.lag.stop()
        if self._user_engines and self._ready:
            # leave a caller's engine as it was found: without this run's adapters
            for ref in [r for v, r in self.versions.adapters.items() if v > 0]:
                await self.versions.unload_on_engines(ref, self._user_engines)
        if self._threads_before is not None:
            import torch

            torch.set_num_threads(self._threads_before)
        if self._switch_before is not None:
            sys.setswitchinterval(self._switch_before)
        if self._gc_before is not None:
            restore_gc(self._gc_before)
        if self._user_trainer is None and self.trainer is not None:
            await asyncio.to_thread(self.trainer.close)
        if self._built_engines:
            results = await asyncio.gather(*(asyncio.wait_for(e.close(), timeout) for e in self._built_engines),
                                           return_exceptions=True)
            for e, r in zip(self._built_engines, results):
                if isinstance(r, BaseException):
                    log.error("engine_close_failed", engine=e.name, error=repr(r))
        if self.rollout_log is not None:
            await asyncio.to_thread(self.rollout_log.close)
        if self.metrics is not None:
            self.metrics.close()
        if self.trackers is not None:
            await asyncio.to_thread(self.trackers.close)
        if self._refusals is not None and self._refusals.by_reason:  # what prompt_refused stopped logging
            log.warning("prompts_refused", total=self._refusals.by_reason.total(),
                        by_reason=dict(self._refusals.by_reason))
        if self._ready:
            self.summary = self._summary(wall, error)
            (self.run_dir / "summary.json").write_text(json.dumps(self.summary, indent=1, default=str))
            try:
                from pipeline.report import write_report

                await asyncio.to_thread(write_report, self.run_dir, self.metrics_rows, self.timeline, self._t_start)
            except Exception as e:  # a failed plot must not hide the run's own outcome
                log.warning("report_failed", error=repr(e))
            level = "info" if self.summary["accounting_ok"] else "error"
            getattr(log, level)("run_finished", **{k: v for k, v in self.summary.items()
                                                   if k in ("steps", "wall_s", "groups_started", "groups_trained",
                                                            "accounting_ok", "error")})
        close_logging()

    def _totals(self) -> tuple[int, int, Counter[str], Counter[str]]:
        """Groups started, trained, dropped and failed (by reason) over the whole run, every session."""
        c = self.buffer.counts
        dropped, failed = Counter(c.dropped), Counter(c.failed)
        for key, n in self._base.items():
            fate, _, reason = key.partition(":")
            if fate == "dropped":
                dropped[reason] += n
            elif fate == "failed":
                failed[reason] += n
        trained = c.trained + self._base["trained"]
        started = c.started + sum(n for k, n in self._base.items() if k != "refused")
        return started, trained, dropped, failed

    def _summary(self, wall: float, error: BaseException | None) -> dict[str, Any]:
        c = self.buffer.counts
        rows = self.metrics_rows
        window = max(1, len(rows) // 5)
        session_rows = [r for r in rows if r["step"] > self.start_step]
        trained_tokens = sum(r["tokens"] for r in session_rows)
        eval_logged = self.rollout_log.counts()["eval"] if self.rollout_log is not None else 0
        logged = len(self.rollout_log) - eval_logged if self.rollout_log is not None else 0
        started, trained, dropped, failed = self._totals()
        live = c.in_flight + c.buffered + c.training
        return {
            "steps": len(rows),
            "wall_s": wall,
            "setup_s": self.setup_s,
            "groups_started": started,
            "groups_trained": trained,
            "groups_dropped": dict(dropped),
            "groups_failed": dict(failed),
            "groups_logged": logged,
            "eval_groups_logged": eval_logged,
            "eval_rounds": len(self.eval_rows),
            "eval_final": self.eval_rows[-1] if self.eval_rows else None,
            "prompts_refused": self.ledger.fates["refused"],
            "accounting_ok": live == 0 and started == trained + sum(dropped.values()) + sum(failed.values())
            and logged == started,
            "ledger": {"cursor": self.ledger.cursor, **self.ledger.states()},
            "resumed_from_step": self.start_step if self._resume else None,
            "checkpoint_step": self.checkpoint_step,
            "stopped_by": self.stopped_by,
            **self.rotation.summary(),
            "adapter_load_failures": dict(self.versions.load_failures),
            "generation_retries": self._retries,
            "groups_per_s": c.trained / max(wall, 1e-9),
            "tokens_per_s": trained_tokens / max(wall, 1e-9),
            "reward_first_window": float(np.mean([r["reward_mean"] for r in rows[:window]])) if rows else None,
            "reward_final_window": float(np.mean([r["reward_mean"] for r in rows[-window:]])) if rows else None,
            "staleness_max": max((r["staleness_max"] for r in rows), default=None),
            "staleness_mean": float(np.mean([r["staleness_mean"] for r in rows])) if rows else None,
            "busy_generator": self._generator_busy() / max(wall, 1e-9),
            "busy_trainer": self.trainer_busy.busy_total() / max(wall, 1e-9),
            "publish_to_loaded_s_mean": float(np.mean(list(self.versions.publish_to_loaded.values())))
            if self.versions.publish_to_loaded else None,
            "drain_s_mean": float(np.mean(list(self.versions.drain_s.values()))) if self.versions.drain_s else None,
            "loop_lag_p99_ms": self.lag.percentile_ms(99),
            "version_mismatches": self._version_mismatches,
            "error": repr(error) if error is not None and not isinstance(error, asyncio.CancelledError) else None,
            "cancelled": isinstance(error, asyncio.CancelledError),
            "run_dir": str(self.run_dir),
        }
