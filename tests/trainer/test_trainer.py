"""The trainer's invariants on the tiny CPU model: steps, snapshots, skips, saved state, the child process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pipeline.models import builtin as models
from pipeline.config.schema import LossConfig, TrainerConfig
from pipeline.errors import TrainerError
from pipeline.trainer.policy import PolicyTrainer
from pipeline.trainer.simulated import SimulatedTrainer
from pipeline.trainer.process import ProcessTrainer
from pipeline.trainer.state import STATE_FILES
from pipeline.types import Batch, Completion, Generation, GroupRequest, Prompt, RolloutGroup

N = 4  # completions per group
T = 6  # tokens per completion


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.build_model("tiny", tmp_path_factory.mktemp("models"))


def _group(group_id: int, text: str, version: int = 0, seed: int = 0) -> RolloutGroup:
    """A group of N random completions with distinct rewards (so every advantage is nonzero)."""
    rng = np.random.default_rng(seed)
    ids = tuple(text.encode())  # the built-in tokenizer's ids are the bytes
    request = GroupRequest(group_id=group_id, prompt=Prompt(id=f"p{group_id}", text=text, token_ids=ids), n=N,
                           max_new_tokens=T)
    # behaviour log-probs near a uniform policy's log(1/320): the tiny random model is close to it
    completions = tuple(Completion(token_ids=rng.integers(0, models.EOS_ID, size=T).astype(np.int64),
                                   logprobs=np.full(T, -5.8, dtype=np.float32), finish_reason="length")
                        for _ in range(N))
    generation = Generation(request=request, completions=completions, version=version, engine="test",
                            t_start=0.0, t_end=0.0)
    return RolloutGroup(generation=generation, rewards=rng.permutation(N).astype(np.float64), t_scored=0.0)


def _batch(step: int, version: int | None = None) -> Batch:
    version = step - 1 if version is None else version
    return Batch(step=step, version=version,
                 groups=(_group(2 * step, "Hello there", version, seed=step), _group(2 * step + 1, "2+2=", version,
                                                                                    seed=100 + step)))


def _trainer(model_dir: Path, seed: int = 0, keep_versions: int = 3, **cfg: object) -> PolicyTrainer:
    cfg.setdefault("lora_rank", 4)
    trainer = PolicyTrainer(model_dir, TrainerConfig(**cfg), LossConfig(), seed=seed, keep_versions=keep_versions)
    trainer.setup()
    return trainer


def _weights(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def _optimizer_state(trainer: PolicyTrainer) -> dict[str, dict[str, torch.Tensor]]:
    return {n: {k: v.clone() for k, v in trainer.optimizer.state[p].items()}
            for n, p in trainer.model.named_parameters() if p.requires_grad}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n


# --------------------------------------------------------------------------- steps and snapshots


def test_step_changes_lora_weights_and_bumps_version(model_dir: Path):
    trainer = _trainer(model_dir)
    before = _weights(trainer)
    # version 0 is the base model exactly: every LoRA B starts at zero
    assert all(not w.any() for n, w in before.items() if "lora_B" in n)
    stats = trainer.step(_batch(1))
    assert trainer.version == stats.version == 1
    assert stats.metrics["train/skipped"] == 0.0 and trainer.skipped_steps == trainer.consecutive_skips == 0
    assert all(np.isfinite(v) for v in stats.metrics.values())
    after = _weights(trainer)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert any("lora_B" in n for n in changed)

    frozen = _trainer(model_dir, lr=0.0)
    before = _weights(frozen)
    frozen.step(_batch(1))
    assert frozen.version == 1
    _assert_same(before, _weights(frozen))


def test_version_zero_logprobs_are_the_base_models(model_dir: Path):
    trainer = _trainer(model_dir)
    group = _group(0, "Hello there")
    lp = trainer.recompute_logprobs([group])[0]
    base = models.load_causal_lm(model_dir, "cpu", "float32")
    expected = models.completion_logprobs(base, [list(group.prompt.token_ids)] * N,
                                          [c.token_ids.tolist() for c in group.completions], "cpu")
    for a, b in zip(lp, expected):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_recompute_uses_the_snapshot_of_the_groups_version(model_dir: Path):
    trainer = _trainer(model_dir, keep_versions=2)
    groups = [_group(0, "Hello there", version=0), _group(1, "2+2=", version=0)]
    before = trainer.recompute_logprobs(groups)
    trainer.step(_batch(1))
    weights_v1 = _weights(trainer)
    # under version 0 after a step: the same numbers as before it; the trainer keeps its current weights
    for a, b in zip(trainer.recompute_logprobs(groups), before):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    _assert_same(weights_v1, _weights(trainer))
    at_v1 = trainer.recompute_logprobs([_group(0, "Hello there", version=1)])[0]
    assert any(not np.array_equal(x, y) for x, y in zip(at_v1, before[0]))
    # mixed versions in one call: each group under its own
    mixed = trainer.recompute_logprobs([_group(0, "Hello there", version=1), groups[1]])
    for x, y in zip(mixed[0], at_v1):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(mixed[1], before[1]):  # alone, not padded with group 0: rounding may differ
        np.testing.assert_allclose(x, y, atol=1e-5)
    trainer.step(_batch(2))  # keep_versions=2: versions 1 and 2 stay, 0 is evicted
    with pytest.raises(KeyError, match=r"\[1, 2\]"):
        trainer.recompute_logprobs(groups)
    with pytest.raises(KeyError):
        trainer.recompute_logprobs([_group(0, "x", version=3)])  # not trained yet


def test_nonfinite_step_is_skipped_and_counted(model_dir: Path):
    trainer = _trainer(model_dir)
    trainer.step(_batch(1))
    name, param = next((n, p) for n, p in trainer.model.named_parameters() if "lora_A" in n)
    good = param.detach().clone()
    optimizer_before = _optimizer_state(trainer)
    with torch.no_grad():
        param[0, 0] = float("nan")
    poisoned = _weights(trainer)
    for k in (1, 2):
        stats = trainer.step(_batch(1 + k))
        assert stats.metrics["train/skipped"] == 1.0
        assert not np.isfinite(stats.metrics["train/grad_norm"])
        assert trainer.skipped_steps == trainer.consecutive_skips == k
        assert trainer.version == 1 + k
        for n, w in _weights(trainer).items():
            assert torch.equal(w.isnan(), poisoned[n].isnan()), n
            assert torch.equal(w.nan_to_num(), poisoned[n].nan_to_num()), n
        for n, st in _optimizer_state(trainer).items():  # no moment moved either
            _assert_same(st, optimizer_before[n])
    with torch.no_grad():
        param.copy_(good)
    stats = trainer.step(_batch(4))
    assert stats.metrics["train/skipped"] == 0.0
    assert trainer.consecutive_skips == 0 and trainer.skipped_steps == 2 and trainer.version == 4


# --------------------------------------------------------------------------- state


def test_save_then_load_continues_bit_identically(model_dir: Path, tmp_path: Path):
    # dropout draws from the RNG during the step: the restored RNG state must be the saved one
    original = _trainer(model_dir, lora_dropout=0.1)
    original.step(_batch(1))
    original.skipped_steps, original.consecutive_skips = 5, 2  # as if two non-finite steps came last
    original.save_state(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted((*STATE_FILES, "trainer.json"))
    meta = json.loads((tmp_path / "trainer.json").read_text())
    assert (meta["version"], meta["skipped_steps"], meta["consecutive_skips"], meta["lora_rank"]) == (1, 5, 2, 4)
    at_v1 = original.recompute_logprobs([_group(0, "Hello there", version=1)])
    original.step(_batch(2))
    expected_weights, expected_optimizer = _weights(original), _optimizer_state(original)

    resumed = _trainer(model_dir, seed=7, lora_dropout=0.1)  # another seed: another initial lora_A
    resumed.load_state(tmp_path)
    assert (resumed.version, resumed.skipped_steps, resumed.consecutive_skips) == (1, 5, 2)
    # the snapshots restart at the restored version
    with pytest.raises(KeyError):
        resumed.recompute_logprobs([_group(0, "Hello there", version=0)])
    for x, y in zip(resumed.recompute_logprobs([_group(0, "Hello there", version=1)])[0], at_v1[0]):
        np.testing.assert_array_equal(x, y)
    stats = resumed.step(_batch(2))
    assert stats.version == resumed.version == 2 and resumed.consecutive_skips == 0
    _assert_same(_weights(resumed), expected_weights)
    got = _optimizer_state(resumed)
    assert got.keys() == expected_optimizer.keys()
    for n in got:
        assert set(got[n]) >= {"exp_avg", "exp_avg_sq", "step"}
        _assert_same(got[n], expected_optimizer[n])


def test_state_before_any_step_round_trips(model_dir: Path, tmp_path: Path):
    """A fresh trainer has no optimizer moments yet; its state still loads, and steps like the original."""
    original = _trainer(model_dir)
    original.save_state(tmp_path)
    original.step(_batch(1))
    resumed = _trainer(model_dir, seed=3)
    resumed.load_state(tmp_path)
    assert resumed.version == 0
    resumed.step(_batch(1))
    _assert_same(_weights(resumed), _weights(original))


@pytest.fixture(scope="module")
def saved_state(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("state")
    trainer = _trainer(model_dir)
    trainer.step(_batch(1))
    trainer.save_state(directory)
    return directory


def _copy(state: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(state, tmp_path / "copy"))


@pytest.mark.parametrize("name", [*STATE_FILES, "trainer.json"])
def test_load_state_refuses_a_missing_file(model_dir: Path, saved_state: Path, tmp_path: Path, name: str):
    state = _copy(saved_state, tmp_path)
    (state / name).unlink()
    trainer = _trainer(model_dir)
    before = _weights(trainer)
    with pytest.raises(TrainerError, match=f"{name} is missing"):
        trainer.load_state(state)
    assert trainer.version == 0  # refused whole: nothing changed
    _assert_same(before, _weights(trainer))


@pytest.mark.parametrize("name", STATE_FILES)
def test_load_state_refuses_corrupted_bytes(model_dir: Path, saved_state: Path, tmp_path: Path, name: str):
    state = _copy(saved_state, tmp_path)
    data = bytearray((state / name).read_bytes())
    data[-5] ^= 0xFF  # in the tensor data, which safetensors itself does not check
    (state / name).write_bytes(bytes(data))
    trainer = _trainer(model_dir)
    with pytest.raises(TrainerError, match=f"{name} is corrupt"):
        trainer.load_state(state)
    assert trainer.version == 0


def test_load_state_refuses_a_bad_trainer_json(model_dir: Path, saved_state: Path, tmp_path: Path):
    state = _copy(saved_state, tmp_path)
    trainer = _trainer(model_dir)
    (state / "trainer.json").write_bytes(b'{"format": 1, "versi')
    with pytest.raises(TrainerError, match="trainer.json cannot be read as JSON"):
        trainer.load_state(state)
    meta = json.loads((saved_state / "trainer.json").read_text())
    name = next(iter(meta["parameters"]))
    meta["parameters"][name] = [3, 3]
    (state / "trainer.json").write_text(json.dumps(meta))
    with pytest.raises(TrainerError, match=rf"parameter '{name}' has shape \[3, 3\]"):
        trainer.load_state(state)
    meta = json.loads((saved_state / "trainer.json").read_text()) | {"version": -1}
    (state / "trainer.json").write_text(json.dumps(meta))
    with pytest.raises(TrainerError, match="version must be an integer >= 0"):
        trainer.load_state(state)
    assert trainer.version == 0


def test_load_state_refuses_another_lora_rank_or_targets(model_dir: Path, saved_state: Path):
    with pytest.raises(TrainerError, match="saved with lora_rank 4, this trainer has lora_rank 2"):
        _trainer(model_dir, lora_rank=2).load_state(saved_state)
    with pytest.raises(TrainerError, match="k_proj.*is not in this trainer.*other target_modules"):
        _trainer(model_dir, target_modules=("q_proj", "v_proj")).load_state(saved_state)


def test_simulated_trainer_state(model_dir: Path, saved_state: Path, tmp_path: Path):
    sim = SimulatedTrainer(step_s=0.0)
    sim.step(_batch(1))
    sim.step(_batch(2))
    sim.save_state(tmp_path)
    restored = SimulatedTrainer()
    restored.load_state(tmp_path)
    assert restored.version == 2 and restored.consecutive_skips == 0
    with pytest.raises(TrainerError, match="not written by the simulated trainer"):
        restored.load_state(saved_state)
    with pytest.raises(TrainerError, match="written by the simulated trainer"):
        _trainer(model_dir).load_state(tmp_path)
    with pytest.raises(TrainerError, match="does not exist"):
        sim.save_state(tmp_path / "absent")


# --------------------------------------------------------------------------- the trainer in a child process


def test_process_trainer_before_setup_is_not_running(model_dir: Path):
    trainer = ProcessTrainer(model_dir, TrainerConfig(lora_rank=4), LossConfig())
    with pytest.raises(TrainerError, match="not running"):
        trainer.step(_batch(1))
    trainer.close()


def test_process_trainer_matches_the_in_thread_trainer(model_dir: Path, tmp_path: Path):
    cfg = TrainerConfig(lora_rank=4)
    local = _trainer(model_dir)
    child = ProcessTrainer(model_dir, cfg, LossConfig(), seed=0)
    try:
        child.setup()
        assert child.pid is not None and child.pid != os.getpid()
        assert (child.version, child.skipped_steps, child.consecutive_skips) == (0, 0, 0)

        ours, theirs = local.step(_batch(1)), child.step(_batch(1))
        assert child.version == theirs.version == 1
        assert theirs.metrics["train/loss"] == pytest.approx(ours.metrics["train/loss"], abs=1e-6)
        group = _group(0, "Hello there", version=1)
        for x, y in zip(child.recompute_logprobs([group])[0], local.recompute_logprobs([group])[0]):
            np.testing.assert_allclose(x, y, atol=1e-5)
        with pytest.raises(KeyError):
            child.recompute_logprobs([_group(0, "x", version=99)])

        # a failure in the child arrives as TrainerError, and the child keeps serving
        with pytest.raises(TrainerError, match="load_state failed in its process.*trainer.json is missing"):
            child.load_state(tmp_path / "absent")

        # state through the process: save, step on, load back, and the same step again gives the same result
        saved = tmp_path / "child"
        saved.mkdir()
        child.save_state(saved)
        lora = load_file(str(saved / "lora.safetensors"))
        for n, w in _weights(local).items():
            torch.testing.assert_close(lora[n], w, atol=1e-6, rtol=0)
        first = child.step(_batch(2))
        child.load_state(saved)
        assert child.version == 1
        again = child.step(_batch(2))
        assert again.metrics["train/loss"] == first.metrics["train/loss"]
        assert again.metrics["train/grad_norm"] == first.metrics["train/grad_norm"]

        # a state saved in-thread loads into the child, counters mirrored in the parent
        local.skipped_steps, local.consecutive_skips = 4, 1
        in_thread = tmp_path / "local"
        in_thread.mkdir()
        local.save_state(in_thread)
        child.load_state(in_thread)
        assert (child.version, child.skipped_steps, child.consecutive_skips) == (1, 4, 1)

        proc = child._proc  # the process object, to see how it ends
    finally:
        child.close()
    assert child.pid is None and not proc.is_alive() and proc.exitcode == 0  # stopped on request, not killed
    child.close()  # idempotent
    with pytest.raises(TrainerError, match="not running"):
        child.step(_batch(1))


def test_process_trainer_killed_child_is_not_running(model_dir: Path):
    """SIGKILL while it starts (cheap: before it has imported torch); that call and every later one raise."""
    child = ProcessTrainer(model_dir, TrainerConfig(lora_rank=4), LossConfig())
    errors: list[BaseException] = []

    def setup() -> None:
        try:
            child.setup()
        except BaseException as e:  # handed to the test thread, which checks it
            errors.append(e)

    thread = threading.Thread(target=setup)
    thread.start()
    deadline = time.monotonic() + 10
    while child.pid is None and time.monotonic() < deadline:
        time.sleep(0.001)
    os.kill(child.pid, signal.SIGKILL)
    thread.join(10)
    assert len(errors) == 1 and isinstance(errors[0], TrainerError) and "not running" in str(errors[0])
    assert "exit code -9" in str(errors[0])
    with pytest.raises(TrainerError, match=r"not running \(exit code -9\); step failed"):
        child.step(_batch(1))
    child.close()
    child.close()
    assert child.pid is None


def test_a_lora_version_is_written_as_peft_writes_it_without_the_model_card(model_dir, tmp_path):
    """save_adapter writes peft's two files byte for byte (config) and tensor for tensor
    (weights), after every step and after a restored state, and peft loads them back exactly."""
    from peft import PeftModel
    from safetensors import safe_open

    trainer = _trainer(model_dir, lora_rank=16)
    for step in (1, 2):
        trainer.step(_batch(step))
        ours, peft_dir = tmp_path / f"ours{step}", tmp_path / f"peft{step}"
        ours.mkdir()
        trainer.save_adapter(ours)
        trainer.model.save_pretrained(str(peft_dir), safe_serialization=True)
        assert sorted(p.name for p in ours.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        assert (ours / "adapter_config.json").read_bytes() == (peft_dir / "adapter_config.json").read_bytes()
        a, b = load_file(ours / "adapter_model.safetensors"), load_file(peft_dir / "adapter_model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        with safe_open(ours / "adapter_model.safetensors", "pt") as f:
            assert f.metadata() == {"format": "pt"}
    state = tmp_path / "state"
    state.mkdir()
    trainer.save_state(state)
    other = _trainer(model_dir, lora_rank=16, seed=5)
    (tmp_path / "before").mkdir()
    other.save_adapter(tmp_path / "before")  # lays its names out before the state is restored
    other.load_state(state)
    (tmp_path / "restored").mkdir()
    other.save_adapter(tmp_path / "restored")
    restored = load_file(tmp_path / "restored" / "adapter_model.safetensors")
    assert all(torch.equal(restored[k], a[k]) for k in a)  # the restored weights, not the ones first laid out
    ids = torch.tensor([list(b"Hello there")])
    loaded = PeftModel.from_pretrained(models.load_causal_lm(model_dir, "cpu", "float32"), str(tmp_path / "ours2"))
    trainer.model.eval()
    with torch.no_grad():
        assert torch.equal(loaded.eval()(input_ids=ids).logits, trainer.model(input_ids=ids).logits)


def test_the_ranks_statistics_pool_to_those_of_all_their_rows() -> None:
    """Each rank sums its rows' statistics and importance weights; pooled, they are the sums over every
    row (ratio_max the largest), whatever the split, and one rank's come back as they are."""
    from pipeline.trainer.rows import pooled

    rng = np.random.default_rng(0)
    rows = [{"loss_sum": float(rng.normal()), "tokens": float(rng.integers(1, 9)), "ratio_max": float(rng.uniform(1, 3))}
            for _ in range(7)]
    weights = rng.uniform(0, 2, size=(7, 3))

    def rank(lo: int, hi: int) -> tuple[dict[str, float], list[float]]:
        part = rows[lo:hi]
        return ({"loss_sum": sum(r["loss_sum"] for r in part), "tokens": sum(r["tokens"] for r in part),
                 "ratio_max": max(r["ratio_max"] for r in part)}, weights[lo:hi].sum(axis=0).tolist())

    whole = rank(0, 7)
    for cuts in ([3], [1, 5], [2, 4, 6]):
        bounds = [0, *cuts, 7]
        acc, w = pooled([rank(a, b) for a, b in zip(bounds, bounds[1:])])
        assert acc.keys() == whole[0].keys() and all(acc[k] == pytest.approx(whole[0][k]) for k in acc)
        assert w == pytest.approx(whole[1])
    assert pooled([whole]) == whole
