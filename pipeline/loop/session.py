"""A session of a run: a fresh start, or a resume from the newest checkpoint with everything after it cut.

Invariants:
- A resume continues only a run trained the same way (trainer.update) on the same prompts in the
  same order with the same reward functions (the checkpoint's fingerprint), unless forced.
- What happened after the checkpoint is redone: the RolloutLog is cut to the rows it covers,
  adapter versions after its own are discarded, metrics.jsonl keeps the step rows up to it and
  the evaluation rounds it covers; every id it did not see settled is queued again (the Ledger).
- The run's config.toml is written only once these checks have passed.
- A resumed trainer holds the checkpoint's version, and every engine serves it, before the first
  group is admitted (`continue_trainer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import structlog

from pipeline.store.weights import AdapterStore
from pipeline.store.checkpoint import CheckpointStore
from pipeline.config.schema import RunConfig
from pipeline.config.io import dump_toml
from pipeline.errors import ConfigError, StoreError, TrainerError
from pipeline.store.ledger import Ledger
from pipeline.observe.metrics import read_jsonl
from pipeline.loop.outcomes import FLUSH_GROUPS
from pipeline.types import AdapterRef
from pipeline.store.rollout_log import RolloutLog

log = structlog.get_logger(__name__)


@dataclass
class Session:
    """Where this session starts, and the stores it continues."""

    checkpoint: Any  # the checkpoint resumed from, or None
    start_step: int
    start_version: int
    wall0: float  # wall seconds of earlier sessions
    ledger: Ledger
    checkpoints: CheckpointStore
    store: AdapterStore
    rollout_log: RolloutLog
    step_rows: list[dict[str, Any]]  # metrics rows kept from earlier sessions
    eval_rows: list[dict[str, Any]]
    eval_done: set[int]  # evaluation rounds the checkpoint covers


@contextlib.contextmanager
def _writing(what: str) -> Iterator[None]:
    """An OSError inside (a full disk, a read-only mount) as a StoreError saying what was being written."""
    try:
        yield
    except OSError as e:
        named = f" ({e.filename})" if e.filename else ""
        raise StoreError(f"{what} failed: {e.strerror or type(e).__name__}{named}") from e


def refuse_existing_run(run_dir: Path) -> None:
    """A fresh run in a directory that holds one is refused (ConfigError), before anything is written."""
    if (run_dir / "rollouts.zarr").exists() or (run_dir / "checkpoints").exists():
        raise ConfigError(f"run directory {run_dir} already holds a run; continue it with "
                          f"python run.py --resume {run_dir}, or choose another out directory")


def write_config(cfg: RunConfig, run_dir: Path) -> None:
    """The resolved config as <run dir>/config.toml: `run.py --config` it to repeat the run."""
    (run_dir / "config.toml").write_text(dump_toml(replace(cfg, out=str(run_dir))), encoding="utf-8")


def open_run_dir(cfg: RunConfig, run_dir: Path, *, resume: bool) -> None:
    """Make the run directory and, for a fresh run, write its config.toml there.

    ConfigError naming `out` when either cannot be done (a file in the way, no permission, a full
    disk): nothing has been produced yet, so the run is refused like any bad config value."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not resume:  # a resumed run's config.toml is replaced only once the session accepts the resume
            write_config(cfg, run_dir)
    except OSError as e:
        what = e.strerror or type(e).__name__
        raise ConfigError(f"out: cannot use {str(run_dir)!r} as the run directory: {what}"
                          + (f" ({e.filename})" if e.filename and str(e.filename) != str(run_dir) else "")) from e


def open_session(cfg: RunConfig, run_dir: Path, *, resume: bool, force: bool, fingerprint: dict[str, Any],
                 total: int | None, model_path: str | None) -> Session:
    """Start the run in `run_dir`, or resume it from its newest checkpoint (ConfigError if it cannot)."""
    pc = cfg.pipeline
    checkpoints = CheckpointStore(run_dir / "checkpoints", keep=pc.keep_checkpoints)
    ck = checkpoints.latest() if resume else None
    start_step = ck.step if ck else 0
    trained_with = ck.state.get("update", "lora") if ck is not None else cfg.trainer.update
    if trained_with != cfg.trainer.update:
        raise ConfigError(f"the run in {run_dir} was trained with trainer.update = {trained_with!r}; "
                          f"it cannot continue with {cfg.trainer.update!r} "
                          "(its checkpoints and published versions are of the other kind)")
    if start_step >= pc.steps:
        raise ConfigError(f"the run in {run_dir} is checkpointed at step {start_step} and "
                          f"pipeline.steps is {pc.steps}; raise it (--steps N) to train further")
    if ck is not None:
        check_resumed_inputs(ck, fingerprint, run_dir, force)
    if resume:  # accepted: from here on the run continues with this config
        with _writing(f"resuming the run in {run_dir}: writing config.toml"):
            write_config(cfg, run_dir)
    eval_done: set[int] = set(ck.state.get("eval_done", ())) if ck else set()
    store = AdapterStore(cfg.store.root or run_dir / "adapters", base_model=str(model_path or ""),
                         keep_last=cfg.store.keep_last, kind=cfg.trainer.update, sync=cfg.store.sync)
    with _writing(f"opening {run_dir / 'rollouts.zarr'}"):
        rollout_log = RolloutLog(run_dir / "rollouts.zarr", meta={"config": dump_toml(cfg)},
                                 flush_every=8 * FLUSH_GROUPS)
    session = Session(checkpoint=ck, start_step=start_step, start_version=int(ck.state["version"]) if ck else 0,
                      wall0=float(ck.state.get("wall_s", 0.0)) if ck else 0.0,
                      ledger=Ledger.from_snapshot(ck.state["ledger"], total) if ck else Ledger(total),
                      checkpoints=checkpoints, store=store, rollout_log=rollout_log, step_rows=[], eval_rows=[],
                      eval_done=eval_done)
    if resume:
        # what happened after the checkpoint is redone: cut it from the log, the store and the metrics
        where = f"resuming the run in {run_dir} at step {start_step}"
        with _writing(f"{where}: cutting rollouts.zarr to the checkpoint's rows"):
            rollout_log.truncate(int(ck.state["log_rows"]) if ck else 0)
        with _writing(f"{where}: discarding the versions after {max(0, session.start_version - 1)}"):
            store.discard_after(max(0, session.start_version - 1))
        with _writing(f"{where}: rewriting metrics.jsonl up to the checkpoint"):
            kept = keep_metrics(run_dir / "metrics.jsonl", start_step, eval_done)
        session.step_rows = [r for r in kept if "eval/groups" not in r]
        session.eval_rows = [r for r in kept if "eval/groups" in r]
        log.info("run_resumed", run_dir=str(run_dir), step=start_step, version=session.start_version,
                 requeued=session.ledger.queued, cursor=session.ledger.cursor)
    return session


async def continue_trainer(trainer: Any, ck: Any, store: AdapterStore, versions: Any, version: int, *,
                           memory: bool = False) -> None:
    """The trainer continues from checkpoint `ck`; its version is published again (the same bytes, the
    same directory name) and every engine serves it before the first group."""
    await asyncio.to_thread(trainer.load_state, ck.trainer_dir)
    if trainer.version != version:
        raise TrainerError(f"checkpoint {ck.path} holds trainer version {trainer.version}, its ledger says {version}")
    if memory:  # trainer.publish = "memory": handed over in memory, as every later version
        ref = AdapterRef.in_memory(version, await asyncio.to_thread(trainer.share_weights, version))
    else:
        ref = await asyncio.to_thread(store.publish, version, trainer.save_adapter)
    await versions.load_on_engines(ref)
    versions.adapters[version] = ref


def check_resumed_inputs(ck: Any, fingerprint: dict[str, Any], run_dir: Path, force: bool) -> None:
    """The checkpoint was trained on these prompts (same items, same order) and reward functions;
    ConfigError naming what changed, unless `force` (then a warning). A checkpoint written before
    fingerprints were resumes unchecked, with a warning."""
    old = ck.state.get("fingerprint")
    if old is None:
        log.warning("resume_unchecked", checkpoint=str(ck.path),
                    reason="the checkpoint predates data and reward fingerprints")
        return
    changed: dict[str, str] = {}
    was, now = old["data"], fingerprint["data"]
    if (was["sha256"], was["items"]) != (now["sha256"], now["items"]):
        changed["data"] = (f"other prompts than the checkpoint's ({now['items']} items, sha256 "
                           f"{now['sha256'][:12]}, against {was['items']} items, sha256 {was['sha256'][:12]})")
    elif (was["seed"], was["shuffle"]) != (now["seed"], now["shuffle"]):
        changed["data"] = (f"the prompts in another order (seed {was['seed']} -> {now['seed']}, "
                           f"shuffle {was['shuffle']} -> {now['shuffle']})")
    if old["reward"] != fingerprint["reward"]:
        changed["reward"] = f"reward functions {old['reward']} -> {fingerprint['reward']}"
    weights = old.get("reward_weights")  # absent from checkpoints written before weights were kept
    if weights is not None and weights != fingerprint["reward_weights"] and "reward" not in changed:
        log.warning("resume_reward_weights_changed", checkpoint=str(ck.path), was=weights,
                    now=fingerprint["reward_weights"],
                    hint="the run trains on another weighted reward from here; reward_mean before and after "
                         "the resume are not comparable")
    if not changed:
        return
    if force:
        log.warning("resume_forced", checkpoint=str(ck.path), changed=sorted(changed), **changed)
        return
    raise ConfigError(f"the run in {run_dir} cannot resume with {'; and '.join(changed.values())}: a "
                      f"group id would name another prompt or score; pass --force-resume "
                      f"(Pipeline(force_resume=True)) to continue anyway")


def keep_metrics(path: Path, step: int, eval_done: set[int]) -> list[dict[str, Any]]:
    """Rewrite metrics.jsonl with the step rows of steps <= `step` and the eval rows of the rounds
    in `eval_done` only; return them."""
    rows = [r for r in read_jsonl(path) if r.get("step", 0) <= step
            and ("eval/groups" not in r or r["step"] in eval_done)] if path.exists() else []
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, path)
    return rows
