"""Checkpoints: the trainer's state and the ledger at the end of a step, written atomically.

Layout under `root` (a run's `checkpoints/`):

    root/step-000012/{trainer/..., ledger.json, manifest.json}
    root/.tmp-*/      a checkpoint being written or deleted: never read, removed on open

Invariants:
- A checkpoint directory appears only by `os.rename` of a complete, fsynced temporary directory
  whose manifest (written last) lists the sha256 of every file; a write killed at any point
  leaves only a `.tmp-*` directory.
- `latest()` returns the newest checkpoint whose manifest and hashes verify; a damaged one is
  skipped with a warning (the one before it still resumes the run), never half-read.
- Only safetensors and JSON are written or read (the trainer's `save_state` decides which
  safetensors files); nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import structlog

from pipeline.store.durable import fsync_dir, fsync_file, sha256_file, write_synced
from pipeline.errors import StoreError
from pipeline.faults import crash_point

log = structlog.get_logger(__name__)

MANIFEST = "manifest.json"
LEDGER = "ledger.json"
FORMAT_VERSION = 1
TMP_PREFIX = ".tmp-"
# put into trainer/ by a trainer writing its state behind the steps once the files are in place
# (pipeline.trainer.state.StateWriter); removed before the checkpoint is completed
STATE_WRITTEN = ".state-written"
_NAME_RE = re.compile(r"^step-(\d{6,})$")


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint on disk."""

    step: int
    path: Path
    state: dict[str, Any]  # ledger.json: the ledger snapshot plus the pipeline's own fields

    @property
    def trainer_dir(self) -> Path:
        return self.path / "trainer"


class CheckpointStore:
    """Write, find and prune the checkpoints of one run."""

    def __init__(self, root: str | os.PathLike[str], keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            for p in self.root.glob(f"{TMP_PREFIX}*"):  # left by a write or delete that was killed
                shutil.rmtree(p, ignore_errors=True)
        except OSError as e:
            raise StoreError(f"cannot use checkpoint directory {self.root}: {e}") from e

    def steps(self) -> list[int]:
        """Steps of the checkpoint directories present (verified or not), oldest first."""
        out = []
        for p in self.root.iterdir():
            m = _NAME_RE.match(p.name)
            if m and p.is_dir():
                out.append(int(m.group(1)))
        return sorted(out)

    def write(self, step: int, state: dict[str, Any], save_trainer: Callable[[Path], Mapping[str, str] | None]) -> Path:
        """Write checkpoint `step` atomically (blocking: run it in a thread); prune old ones.

        `save_trainer(dir)` writes the trainer's state into `dir` and may return the sha256 of files
        it wrote and fsynced there, by name: those are not read again."""
        tmp = self.begin(step)
        if tmp is None:
            return self.path_of(step)
        try:
            known = save_trainer(tmp / "trainer")
        except BaseException:
            self.abandon(tmp)
            raise
        return self.finish(step, tmp, state, {f"trainer/{k}": v for k, v in (known or {}).items()})

    def path_of(self, step: int) -> Path:
        return self.root / f"step-{step:06d}"

    def begin(self, step: int) -> Path | None:
        """A new temporary directory for checkpoint `step`, with its empty `trainer/` for the trainer's
        state; None when step `step` is already checkpointed (a resumed run stopped before its first
        step: that checkpoint stays valid, whatever settled since is after its log_rows and is cut)."""
        if self.path_of(step).exists():
            return None
        tmp = self.root / f"{TMP_PREFIX}step-{step:06d}-{uuid.uuid4().hex[:8]}"
        try:
            (tmp / "trainer").mkdir(parents=True)
        except OSError as e:
            raise StoreError(f"writing checkpoint of step {step} under {self.root} failed: {e}") from e
        return tmp

    def finish(self, step: int, tmp: Path, state: dict[str, Any], known: Mapping[str, str] | None = None) -> Path:
        """Complete checkpoint `step` from `tmp` (from `begin`, the trainer's state in its `trainer/`):
        the ledger, every file's hash (`known`: those already hashed and fsynced, by path in the
        checkpoint), the manifest, the rename into place, then old ones pruned (blocking)."""
        final = self.path_of(step)
        known = dict(known or {})
        t0 = time.monotonic()
        try:
            crash_point("checkpoint.mid_write")
            (tmp / LEDGER).write_text(json.dumps({"format": FORMAT_VERSION, "step": step, **state}), encoding="utf-8")
            files = {}
            for p in sorted(tmp.rglob("*")):
                if p.is_file():
                    name = str(p.relative_to(tmp))
                    files[name] = known.get(name) or sha256_file(p)
                    if name not in known:
                        fsync_file(p)
            write_synced(tmp / MANIFEST, json.dumps({"format": FORMAT_VERSION, "step": step, "created": time.time(),
                                                     "files": files}).encode())
            fsync_dir(tmp / "trainer")
            fsync_dir(tmp)
            crash_point("checkpoint.before_rename")
            os.rename(tmp, final)
            fsync_dir(self.root)
        except BaseException as e:
            self.abandon(tmp)
            if isinstance(e, OSError):
                raise StoreError(f"writing checkpoint of step {step} under {self.root} failed: {e}") from e
            raise
        crash_point("checkpoint.after_rename")
        self.prune()
        log.info("checkpoint_written", step=step, path=str(final), seconds=round(time.monotonic() - t0, 3))
        return final

    @staticmethod
    def abandon(tmp: Path) -> None:
        """Remove a checkpoint's temporary directory that will not be completed."""
        shutil.rmtree(tmp, ignore_errors=True)

    def prune(self) -> None:
        """Delete all but the newest `keep` checkpoints (each renamed away before removal)."""
        for step in self.steps()[: -self.keep]:
            old = self.root / f"step-{step:06d}"
            gone = self.root / f"{TMP_PREFIX}del-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(old, gone)
                shutil.rmtree(gone, ignore_errors=True)
            except OSError as e:  # a checkpoint we could not delete costs disk, not correctness
                log.warning("checkpoint_prune_failed", path=str(old), error=repr(e))

    def verify(self, path: Path) -> Checkpoint:
        """Read a checkpoint directory, checking its manifest and every file's hash (ValueError if not)."""
        try:
            manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
            files = manifest["files"]
            for name, digest in files.items():
                if "/" in name and (".." in Path(name).parts or name.startswith("/")):
                    raise ValueError(f"file name {name!r} leaves the checkpoint directory")
                if sha256_file(path / name) != digest:
                    raise ValueError(f"{name} does not match its sha256 in the manifest")
            state = json.loads((path / LEDGER).read_text(encoding="utf-8"))
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"unreadable: {e!r}") from None
        if state.get("format") != FORMAT_VERSION or manifest.get("step") != state.get("step"):
            raise ValueError(f"format {state.get('format')!r} / step {state.get('step')!r} not understood")
        return Checkpoint(int(state["step"]), path, state)

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint that verifies (a damaged newer one is logged and skipped)."""
        for step in reversed(self.steps()):
            path = self.root / f"step-{step:06d}"
            try:
                return self.verify(path)
            except ValueError as e:
                log.error("checkpoint_damaged", path=str(path), error=str(e), action="using an older checkpoint")
        return None
