"""Trackers: every metrics row mirrored to external experiment trackers (TensorBoard, wandb).

Invariants:
- metrics.jsonl stays the record; a tracker gets each row's finite numbers under the same keys
  (`reward_mean`, `train/loss`), at step `row["step"]`. What metrics.jsonl writes as null (NaN,
  inf) and what is not a number are left out; a bool is 0 or 1.
- The resolved config goes with the run: TensorBoard gets its TOML as text, wandb the nested dict.
- A tracker that raises while logging or closing is warned about once and left out for the rest
  of the run; it never fails the run. Opening one that cannot start (wandb online with no network)
  fails the run at its start, before anything is trained.
- A resumed run opens them again: TensorBoard adds an event file to the same directory (its steps
  continue from the checkpoint), wandb starts a new run of the same name.
- TensorBoard and wandb are imported only when a tracker of theirs is opened; `LogConfig` has
  already refused a tracker whose package is missing (naming the extra to install).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

import structlog

from pipeline.config.schema import RunConfig
from pipeline.config.io import dump_toml

log = structlog.get_logger(__name__)


class Tracker(Protocol):
    """One external tracker. `row` holds a metrics row's finite numbers, keyed as in metrics.jsonl."""

    name: str

    def log(self, row: Mapping[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics row, but its step (that is the x axis, not a series)."""
    out = {}
    for key, value in row.items():
        if key != "step" and isinstance(value, numbers.Real) and math.isfinite(value):
            out[key] = float(value)
    return out


class TensorBoardTracker:
    """Event files under `<run_dir>/tensorboard/` (torch's SummaryWriter): a scalar per key."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, config: RunConfig) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        # fenced, so TensorBoard's markdown shows the TOML as written rather than as one paragraph
        self._writer.add_text("config", f"```toml\n{dump_toml(config)}```")

    def log(self, row: Mapping[str, Any], step: int) -> None:
        for key, value in row.items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


def wandb_mode() -> str | None:
    """Offline unless the environment says otherwise: WANDB_MODE set, or an API key to go online with.
    None lets wandb decide from that environment."""
    return None if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY") else "offline"


class WandbTracker:
    """A wandb run in `<run_dir>/wandb/`, named after the run directory, project WANDB_PROJECT or "pipeline"."""

    name = "wandb"

    def __init__(self, run_dir: Path, config: RunConfig) -> None:
        import wandb

        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "pipeline", name=run_dir.name,
                               dir=str(run_dir), config=dataclasses.asdict(config), mode=wandb_mode())
        # an evaluation round finishes after later training steps were logged, and wandb drops a row
        # at a step below one it has seen: eval rows carry their own x axis instead
        self._run.define_metric("eval/step")
        self._run.define_metric("eval/*", step_metric="eval/step")

    def log(self, row: Mapping[str, Any], step: int) -> None:
        if any(key.startswith("eval/") for key in row):
            self._run.log({**row, "eval/step": step})
        else:
            self._run.log(dict(row), step=step)

    def close(self) -> None:
        self._run.finish()


_TRACKERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker}


class Trackers:
    """Fans each row out to the open trackers; one that raises is warned about once and dropped."""

    def __init__(self, trackers: Sequence[Tracker]) -> None:
        self._trackers = list(trackers)

    def log(self, row: Mapping[str, Any], step: int) -> None:
        values = scalars(row)
        for t in list(self._trackers):
            try:
                t.log(values, step)
            except Exception as e:  # a tracker is a mirror of metrics.jsonl: losing it must not end the run
                self._drop(t, "tracker_log_failed", e, step=step)

    def close(self) -> None:
        for t in list(self._trackers):
            try:
                t.close()
            except Exception as e:  # closing runs at shutdown: the run's own outcome matters more
                self._drop(t, "tracker_close_failed", e)
        self._trackers = []

    def _drop(self, tracker: Tracker, event: str, error: Exception, **fields: Any) -> None:
        self._trackers.remove(tracker)
        log.warning(event, tracker=tracker.name, error=repr(error), hint="metrics.jsonl still has every row",
                    **fields)


def open_trackers(names: Sequence[str], run_dir: str | Path, config: RunConfig) -> Trackers:
    """Open the named trackers (log.trackers) for the run in `run_dir` with its resolved `config`.
    If one fails to open, those already open are closed and the error is raised."""
    opened: list[Tracker] = []
    try:
        for name in names:
            opened.append(_TRACKERS[name](Path(run_dir), config))
    except BaseException:
        Trackers(opened).close()
        raise
    log.info("trackers_opened", trackers=list(names))
    return Trackers(opened)
