"""pipeline/loop/session.py: a fresh start, or a resume from the newest checkpoint with everything after it cut.

A crashed run is written here as the loop writes one (groups settled in the ledger and logged at
once, a version published and a metrics row written per step, checkpoints every two steps), in
random order: groups run up to two steps ahead and some fail out of order. Removing its newest
checkpoints leaves a log, metrics and adapters that run past the checkpoint a resume finds, as a
crash leaves them. Checked on `open_session` itself: a resume keeps exactly what the checkpoint
covers (the log's rows the checkpoint's ledger settled, every other id queued to be redone first,
the step rows up to it, the versions before the one the trainer republishes) and continues the
checkpoint's step, version and wall time; a fresh start carries nothing over; a resume with other
prompts, another order, other rewards, another update kind or no steps left is refused with what
changed, and refusing touches nothing in the run directory, unless forced.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import shutil
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import sim_config
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file
from test_rollout_log import make_outcome

from pipeline.errors import ConfigError
from pipeline.loop.session import Session, keep_metrics, open_session, refuse_existing_run
from pipeline.observe.metrics import read_jsonl
from pipeline.store.checkpoint import CheckpointStore
from pipeline.store.ledger import Ledger
from pipeline.store.rollout_log import RolloutLog, read_rollouts
from pipeline.store.weights import AdapterStore

STEPS, B, TOTAL = 6, 2, 40  # steps of the crashed run, groups per step, ids in the stream
RUN = {"pipeline.checkpoint_every": 2, "pipeline.keep_checkpoints": 3}  # checkpoints 2, 4 and 6 all kept
FINGERPRINT = {"data": {"sha256": "ab" * 32, "items": TOTAL, "seed": 0, "shuffle": True},
               "reward": ["length_reward"], "reward_weights": [1.0]}


def write_adapter(d: Path) -> None:
    save_file({"lora_A": np.zeros((2, 3), dtype=np.float32)}, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({"r": 2, "peft_type": "LORA"}))


def write_trainer(d: Path) -> None:
    (d / "trainer.json").write_text("{}")


def write_crashed_run(run_dir: Path, seed: int) -> None:
    """STEPS steps as the loop leaves them, then a crash: in-flight groups run ahead of the trainer,
    some fail out of order, and at each checkpoint the ledger and the log agree."""
    rng = random.Random(seed)
    ledger, live = Ledger(TOTAL), []
    log = RolloutLog(run_dir / "rollouts.zarr")
    store = AdapterStore(run_dir / "adapters", keep_last=STEPS + 1)
    checkpoints = CheckpointStore(run_dir / "checkpoints", keep=3)
    metrics = run_dir / "metrics.jsonl"
    for step in range(1, STEPS + 1):
        while len(live) < 3 * B:  # generation runs ahead of the trainer
            live.append(ledger.next_id())
        rng.shuffle(live)
        failed = live[B:B + 1] if rng.random() < 0.5 else []
        trained, live = sorted(live[:B]), live[B + len(failed):]
        outcomes = [make_outcome(g, version=step - 1, step=step) for g in trained]
        outcomes += [make_outcome(g, "failed", version=step - 1) for g in failed]
        log.append_many(outcomes)
        for o in outcomes:
            ledger.settle(o.group_id, o.fate, o.reason)
        store.publish(step, write_adapter)
        with metrics.open("a") as f:
            f.write(json.dumps({"step": step, "loss": rng.random()}) + "\n")
        if step % 2 == 0:
            log.flush()
            state = {"ledger": ledger.snapshot(), "log_rows": len(log), "version": step, "update": "lora",
                     "eval_done": [], "fingerprint": FINGERPRINT, "wall_s": 1.5 * step}
            checkpoints.write(step, state, write_trainer)
    log.append_many([make_outcome(g, "dropped", reason="shutdown") for g in live])  # what shutdown saw in flight
    log.close()


class Run:
    """A crashed run, kept to be copied."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.total = TOTAL
        self.model_path = None
        self.fingerprint = FINGERPRINT

    def crashed_at(self, tmp_path: Path, step: int) -> Path:
        """A copy of the run whose newest checkpoint is `step`'s (0: none was written)."""
        run_dir = tmp_path / "run"
        shutil.copytree(self.path, run_dir)
        for path in (run_dir / "checkpoints").glob("step-*"):
            if int(path.name.split("-")[1]) > step:
                shutil.rmtree(path)
        return run_dir


@pytest.fixture(scope="module", params=[0, 1], ids=["run-a", "run-b"])
def finished(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Run:
    path = tmp_path_factory.mktemp("session") / "run"
    path.mkdir()
    write_crashed_run(path, seed=request.param)
    return Run(path)


def resume(run: Run, tmp_path: Path, *, steps: int = 8, force: bool = False,
           fingerprint: dict[str, Any] | None = None, **overrides: Any) -> Session:
    cfg = sim_config(tmp_path, B=B, steps=steps, **RUN, **overrides)
    return open_session(cfg, tmp_path / "run", resume=True, force=force, fingerprint=fingerprint or run.fingerprint,
                        total=run.total, model_path=run.model_path)


def files(run_dir: Path) -> dict[str, str]:
    """Every file under the run directory, by path, to its sha256."""
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("step", [4, 2, 0], ids=["at-4", "at-2", "no-checkpoint"])
def test_a_resume_keeps_exactly_what_its_checkpoint_covers(finished: Run, tmp_path: Path, step: int) -> None:
    run_dir = finished.crashed_at(tmp_path, step)
    ck = CheckpointStore(run_dir / "checkpoints").latest()
    assert (ck.step if ck else 0) == step
    before = read_rollouts(run_dir / "rollouts.zarr")
    rows_before = read_jsonl(run_dir / "metrics.jsonl")
    versions_before = AdapterStore(run_dir / "adapters", readonly=True).versions()
    log_rows = ck.state["log_rows"] if ck else 0
    assert before.num_groups > log_rows, "the crashed run logged groups after its checkpoint"

    session = resume(finished, tmp_path)
    session.rollout_log.close()
    assert (session.start_step, session.start_version) == ((step, ck.state["version"]) if ck else (0, 0))
    assert session.wall0 == (ck.state["wall_s"] if ck else 0.0)

    # the log: cut to the checkpoint's rows, which are exactly the ids its ledger called settled
    after = read_rollouts(run_dir / "rollouts.zarr")
    ids = after.groups["group_id"].tolist()
    assert ids == before.groups["group_id"].tolist()[:log_rows]
    snap = ck.state["ledger"] if ck else {"cursor": 0, "settled_below": 0, "settled_above": []}
    settled = set(range(snap["settled_below"])) | set(snap["settled_above"])
    assert set(ids) == settled
    # the ledger: every other id the checkpoint had handed out is redone, first, in id order
    ledger = session.ledger
    redo = [ledger.next_id() for _ in range(ledger.queued)]
    assert redo == sorted(set(range(snap["cursor"])) - settled)
    fresh = [ledger.next_id() for _ in range(finished.total - snap["cursor"] + 1)]
    assert fresh == [*range(snap["cursor"], finished.total), None], "then new ids, to the end of the stream"

    # metrics: the step rows up to the checkpoint, in the file and in the session
    kept = [r for r in rows_before if r["step"] <= step]
    assert [r["step"] for r in kept] == list(range(1, step + 1))
    assert read_jsonl(run_dir / "metrics.jsonl") == kept and session.step_rows == kept
    # adapters: those before the version the trainer publishes again
    assert session.store.versions() == [v for v in versions_before if v < session.start_version]
    # accepted: the run continues with this config
    assert tomllib.loads((run_dir / "config.toml").read_text())["pipeline"]["steps"] == 8


def test_a_fresh_start_carries_nothing_over(finished: Run, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    refuse_existing_run(run_dir)  # nothing there: a start is allowed
    cfg = sim_config(tmp_path, B=B, steps=STEPS, **RUN)
    session = open_session(cfg, run_dir, resume=False, force=False, fingerprint=finished.fingerprint,
                           total=finished.total, model_path=finished.model_path)
    session.rollout_log.close()
    assert session.checkpoint is None and (session.start_step, session.start_version, session.wall0) == (0, 0, 0.0)
    assert len(read_rollouts(run_dir / "rollouts.zarr").groups["group_id"]) == 0
    assert session.step_rows == session.eval_rows == [] and session.eval_done == set()
    assert session.store.versions() == []
    ids = [session.ledger.next_id() for _ in range(finished.total + 1)]
    assert ids == [*range(finished.total), None], "every id of the stream once, from 0"


@pytest.mark.parametrize("holds", ["rollouts.zarr", "checkpoints"])
def test_a_fresh_start_is_refused_where_a_run_is(finished: Run, tmp_path: Path, holds: str) -> None:
    run_dir = finished.crashed_at(tmp_path, STEPS)
    shutil.rmtree(run_dir / ({"rollouts.zarr", "checkpoints"} - {holds}).pop())
    with pytest.raises(ConfigError, match=r"already holds a run; continue it with python run.py --resume"):
        refuse_existing_run(run_dir)


OTHER_PROMPTS = "other prompts than the checkpoint's"
ANOTHER_ORDER = "the prompts in another order"
CHANGES = {  # what a group id would name differently: (the fingerprint's part, its change, the refusal's words)
    "other-items": ("data", {"sha256": "0" * 64}, OTHER_PROMPTS),
    "one-item-less": ("data", {"items": TOTAL - 1}, OTHER_PROMPTS),
    "other-seed": ("data", {"seed": 1}, rf"{ANOTHER_ORDER} \(seed 0 -> 1"),
    "no-shuffle": ("data", {"shuffle": False}, rf"{ANOTHER_ORDER} .*shuffle True -> False"),
    "other-rewards": (None, {"reward": ["length_reward", "other_reward"]},
                      r"reward functions \['length_reward'\] -> \['length_reward', 'other_reward'\]"),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_resume_that_would_rename_a_group_is_refused_and_touches_nothing(finished: Run, tmp_path: Path,
                                                                           change: str) -> None:
    part, values, words = CHANGES[change]
    run_dir = finished.crashed_at(tmp_path, 4)
    before = files(run_dir)
    fingerprint = copy.deepcopy(finished.fingerprint)
    (fingerprint[part] if part else fingerprint).update(values)
    with pytest.raises(ConfigError, match=f"cannot resume with {words}.*--force-resume"):
        resume(finished, tmp_path, fingerprint=fingerprint)
    assert files(run_dir) == before, "a refused resume changed the run directory"

    forced = resume(finished, tmp_path, fingerprint=fingerprint, force=True)
    forced.rollout_log.close()
    assert forced.start_step == 4 and files(run_dir) != before, "forced, it resumes (and cuts) as any resume"


def test_other_reward_weights_resume_without_force(finished: Run, tmp_path: Path) -> None:
    run_dir = finished.crashed_at(tmp_path, 4)
    fingerprint = copy.deepcopy(finished.fingerprint)
    fingerprint["reward_weights"] = [w * 2 for w in fingerprint["reward_weights"]]
    session = resume(finished, tmp_path, fingerprint=fingerprint)  # the same groups; their score is weighed anew
    session.rollout_log.close()
    assert session.start_step == 4
    assert len(read_rollouts(run_dir / "rollouts.zarr").groups["group_id"]) == session.checkpoint.state["log_rows"]


@pytest.mark.parametrize("bad", ["other-update", "no-steps-left"])
def test_a_resume_that_cannot_continue_is_refused_and_touches_nothing(finished: Run, tmp_path: Path, bad: str) -> None:
    run_dir = finished.crashed_at(tmp_path, 4)
    before = files(run_dir)
    if bad == "other-update":
        with pytest.raises(ConfigError, match=r"trained with trainer.update = 'lora'; it cannot continue with 'full'"):
            resume(finished, tmp_path, **{"trainer.update": "full"})
    else:
        with pytest.raises(ConfigError, match=r"checkpointed at step 4 and pipeline.steps is 4; raise it"):
            resume(finished, tmp_path, steps=4)
    assert files(run_dir) == before


ROW = st.fixed_dictionaries({"step": st.integers(1, 8), "eval": st.booleans(), "x": st.integers()})


@settings(max_examples=80, deadline=None)
@given(rows=st.lists(ROW, max_size=20), step=st.integers(0, 8), done=st.sets(st.integers(0, 8)))
def test_keep_metrics_keeps_step_rows_up_to_the_step_and_eval_rows_of_rounds_done(rows: list[dict[str, Any]], step: int,
                                                                                 done: set[int]) -> None:
    rows = [{"step": r["step"], "x": r["x"], **({"eval/groups": 1} if r["eval"] else {})} for r in rows]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "metrics.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        kept = keep_metrics(path, step, done)
        want = [r for r in rows if r["step"] <= step and ("eval/groups" not in r or r["step"] in done)]
        assert kept == want and read_jsonl(path) == want, "in order, in the file and returned"
