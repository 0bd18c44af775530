"""CheckpointStore: atomic checkpoints that verify, the newest good one found, old ones pruned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.store.checkpoint import CheckpointStore


def _save(directory: Path) -> None:
    (directory / "weights.safetensors").write_bytes(b"\x00" * 64)


def test_write_latest_and_prune(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ck", keep=2)
    for step in (2, 4, 6):
        store.write(step, {"version": step, "ledger": {}}, _save)
    assert store.steps() == [4, 6]
    ck = store.latest()
    assert ck.step == 6 and ck.state["version"] == 6
    assert (ck.trainer_dir / "weights.safetensors").exists()


def test_a_damaged_checkpoint_is_skipped_for_the_one_before(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ck", keep=3)
    store.write(1, {"version": 1}, _save)
    p2 = store.write(2, {"version": 2}, _save)
    (p2 / "trainer" / "weights.safetensors").write_bytes(b"\x01" * 64)  # bytes changed on disk
    assert store.latest().step == 1
    (store.root / "step-000001" / "ledger.json").unlink()
    assert store.latest() is None


def test_a_write_that_fails_leaves_nothing_and_the_same_step_is_not_rewritten(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ck")

    def broken(directory: Path) -> None:
        (directory / "half.safetensors").write_bytes(b"x")
        raise RuntimeError("trainer died while saving")

    with pytest.raises(RuntimeError):
        store.write(3, {}, broken)
    assert store.steps() == [] and list(store.root.iterdir()) == []
    store.write(3, {"version": 3}, _save)
    store.write(3, {"version": 99}, _save)  # already checkpointed: kept as it was
    assert store.latest().state["version"] == 3


def test_leftover_temporary_directories_are_removed_on_open(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    (root / ".tmp-step-000005-dead").mkdir(parents=True)
    (root / ".tmp-step-000005-dead" / "ledger.json").write_text(json.dumps({"step": 5}))
    store = CheckpointStore(root)
    assert list(root.iterdir()) == [] and store.latest() is None
