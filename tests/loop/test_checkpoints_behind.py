"""Checkpoints written behind the steps: the trainer copies its state and writes it while the next
steps run; the checkpoint is completed (ledger, hashes, rename) once its files are in place."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_accounted, check_finished_run, sim_config

from pipeline.errors import TrainerError
from pipeline.models import builtin as models
from pipeline.loop.orchestrator import Pipeline
from pipeline.observe.metrics import read_jsonl
from pipeline.store.checkpoint import STATE_WRITTEN, TMP_PREFIX, CheckpointStore
from pipeline.trainer import state as trainer_state
from pipeline.trainer.simulated import SimulatedTrainer, write_simulated_state
from pipeline.trainer.state import STATE_FILES, mark_written
# the trainer tests' batches and trainers (tests/ is on sys.path)
from test_trainer import _batch, _trainer

PROMPTS = [{"id": f"p{i}", "prompt": f"prompt {i}", "token_ids": [1 + i % 50, 2, 3]} for i in range(40)]
WRITE_S = 0.6  # how long the trainer below takes to write a state


def reward(prompts, completions, completion_ids, **kw):
    return [float(len(ids)) for ids in completion_ids]


class SlowWriter(SimulatedTrainer):
    """A trainer whose state takes WRITE_S to write, either way: `save_state` blocks that long;
    `begin_save_state` returns at once and a thread writes (or, for a version in `fail`, puts the
    error in the marker)."""

    def __init__(self, fail: set[int] = frozenset()) -> None:
        super().__init__()
        self.fail = fail

    def save_state(self, directory: Path) -> None:
        time.sleep(WRITE_S)
        super().save_state(directory)

    def begin_save_state(self, directory: Path) -> None:
        version = self.version

        def write() -> None:
            time.sleep(WRITE_S)
            if version in self.fail:
                mark_written(directory, {"error": "OSError: [Errno 28] No space left on device", "sha256": {}})
                return
            with contextlib.suppress(FileNotFoundError, TrainerError):  # the run ended, the directory went
                write_simulated_state(directory, self.update, version, self.step_s)
                mark_written(directory, {"error": None, "sha256": {}})

        threading.Thread(target=write, daemon=True).start()


def _run(tmp_path: Path, trainer: SlowWriter, **extra: object) -> Pipeline:
    cfg = sim_config(tmp_path, steps=6, **{"pipeline.checkpoint_every": 2, "pipeline.keep_checkpoints": 5, **extra})
    p = Pipeline(cfg, prompts=PROMPTS, reward=reward, tokenizer=False, console=False, trainer=trainer)
    p.run_sync()
    return p


@pytest.mark.parametrize("behind", [True, False])
def test_the_steps_after_a_checkpoint_do_not_wait_for_its_files(tmp_path: Path, behind: bool) -> None:
    p = _run(tmp_path, SlowWriter(), **{"pipeline.checkpoint_behind": behind})
    rows = {r["step"]: r for r in read_jsonl(p.run_dir / "metrics.jsonl")}
    waited = [rows[s]["time/checkpoint_s"] for s in (3, 5)]  # the checkpoints of steps 2 and 4
    if behind:
        assert max(waited) < WRITE_S / 3, waited
    else:  # the control: the loop waits for the whole write
        assert min(waited) >= WRITE_S, waited
    # every checkpoint is complete and verifies, the last one before the run returned
    assert not list((p.run_dir / "checkpoints").glob(f"{TMP_PREFIX}*"))
    store = CheckpointStore(p.run_dir / "checkpoints")
    assert store.steps() == [2, 4, 6]
    for step in (2, 4, 6):
        cp = store.verify(store.path_of(step))
        assert cp.state["version"] == step
        assert json.loads((cp.trainer_dir / "trainer.json").read_text())["version"] == step
        assert not (cp.trainer_dir / STATE_WRITTEN).exists()
    assert_accounted(p, p.summary)


def test_a_state_that_fails_behind_the_steps_stops_the_run_naming_it(tmp_path: Path) -> None:
    with pytest.raises(TrainerError, match=r"checkpoint of step 4 .*No space left on device"):
        _run(tmp_path, SlowWriter(fail={4}))
    assert not list((tmp_path / "run" / "checkpoints").glob(f"{TMP_PREFIX}*"))  # before a store's open removes them
    assert CheckpointStore(tmp_path / "run" / "checkpoints").latest().step == 2  # the one before stays, as after a kill


# --------------------------------------------------------------------------- the trainer's side


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.build_model("tiny", tmp_path_factory.mktemp("models"))


def test_a_state_written_behind_is_the_state_of_the_moment_it_began(model_dir: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The step that follows `begin_save_state` changes nothing in its files: they are byte for byte
    what `save_state` writes of a twin trainer at that moment, and the marker lists their digests."""
    stepped = threading.Event()
    write_files = trainer_state._write_files

    def after_the_next_step(*args, **kwargs):
        if threading.current_thread().name == "trainer-state-writer":
            assert stepped.wait(30)
        return write_files(*args, **kwargs)

    monkeypatch.setattr(trainer_state, "_write_files", after_the_next_step)
    a, b = _trainer(model_dir, lora_dropout=0.1), _trainer(model_dir, lora_dropout=0.1)
    a.step(_batch(1))
    b.load_state(_saved(a, tmp_path / "a1"))  # b: a twin of a after step 1, RNG state included
    behind, now = tmp_path / "behind", tmp_path / "now"
    behind.mkdir()
    now.mkdir()
    a.begin_save_state(behind)
    digests = b.save_state(now)
    a.step(_batch(2))  # changes the weights, the moments and the RNG state while the files wait
    stepped.set()
    a.writer.join()
    written = json.loads((behind / STATE_WRITTEN).read_text())
    assert written == {"error": None, "sha256": digests}
    assert sorted(digests) == sorted((*STATE_FILES, "trainer.json"))
    for name in digests:
        assert (behind / name).read_bytes() == (now / name).read_bytes(), name
    # and a trainer resumed from it steps as a did
    resumed = _trainer(model_dir, seed=5, lora_dropout=0.1)
    resumed.load_state(behind)
    resumed.step(_batch(2))
    for (n, x), (_, y) in zip(resumed._trainable(), a._trainable()):
        np.testing.assert_array_equal(x.detach().numpy(), y.detach().numpy(), err_msg=n)


def _saved(trainer, directory: Path) -> Path:
    directory.mkdir()
    trainer.save_state(directory)
    return directory


def test_a_write_that_fails_behind_puts_its_error_in_the_marker(model_dir: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import safetensors.torch

    def full_disk(tensors, path, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    t = _trainer(model_dir)
    t.step(_batch(1))
    t.begin_save_state(tmp_path)
    t.writer.join()
    written = json.loads((tmp_path / STATE_WRITTEN).read_text())
    assert "No space left on device" in written["error"] and written["sha256"] == {}


class FailsAtStep(SlowWriter):
    """SlowWriter whose step `at` raises, while the checkpoint before it is still being written."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def step(self, batch):
        if batch.step == self.at:
            raise TrainerError(f"step {batch.step} failed on purpose")
        return super().step(batch)


def test_a_run_that_fails_while_a_checkpoint_is_written_resumes_from_the_one_before(tmp_path: Path) -> None:
    B, STEPS = 2, 6
    prompts = [{"id": f"p{i}", "prompt": f"prompt {i}", "token_ids": [1 + i, 2, 3]} for i in range(B * STEPS)]
    cfg = sim_config(tmp_path, B=B, steps=STEPS, **{"pipeline.checkpoint_every": 2})
    first = Pipeline(cfg, prompts=prompts, reward=reward, tokenizer=False, console=False, trainer=FailsAtStep(5))
    with pytest.raises(TrainerError, match="step 5 failed on purpose"):
        first.run_sync()  # the checkpoint of step 4 is still being written (WRITE_S) when step 5 fails
    checkpoints = tmp_path / "run" / "checkpoints"
    assert not list(checkpoints.glob(f"{TMP_PREFIX}*"))  # the unfinished one is gone (before a store's open would)
    assert CheckpointStore(checkpoints).latest().step == 2
    resumed = Pipeline(sim_config(tmp_path, B=B, steps=STEPS, **{"pipeline.checkpoint_every": 2}), prompts=prompts,
                       reward=reward, tokenizer=False, console=False, trainer=SlowWriter(), resume=True)
    resumed.run_sync()
    check_finished_run(tmp_path / "run", B, STEPS, 1)
