"""Full-weight updates (trainer.update = "full") on the tiny CPU model: every weight trains, a
version is a whole model directory, tied embeddings stay tied, state resumes only in its own mode."""

from __future__ import annotations

import dataclasses

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from pipeline.models import builtin as models
from pipeline.store.weights import AdapterStore
from pipeline.config.schema import LossConfig, TrainerConfig
from pipeline.errors import AdapterCorruptError, ConfigError, TrainerError
from pipeline.trainer.policy import PolicyTrainer
from pipeline.trainer.simulated import SimulatedTrainer
from pipeline.trainer.process import ProcessTrainer
from pipeline.trainer.state import FULL_STATE_FILES
from pipeline.trainer.update import FULL_KEEP_VERSIONS
from pipeline.types import Batch, RolloutGroup
# the groups and helpers of test_trainer (tests/ is on sys.path)
from test_trainer import N, _group, _optimizer_state, _weights
from test_trainer import _trainer as trainer_of

PROMPT = "Hello there"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.build_model("tiny", tmp_path_factory.mktemp("models"))


def _batch(step: int) -> Batch:
    return Batch(step=step, version=step - 1, groups=(_group(2 * step, PROMPT, step - 1, seed=step),
                                                      _group(2 * step + 1, "2+2=", step - 1, seed=100 + step)))


def _trainer(model_dir: Path, update: str = "full", keep_versions: int = 3, **cfg: object) -> PolicyTrainer:
    """test_trainer's trainer, in full-weight mode unless told otherwise."""
    return trainer_of(model_dir, keep_versions=keep_versions, update=update, **cfg)


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n


def _assert_tied(model: torch.nn.Module) -> None:
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@torch.no_grad()
def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([list(b"The quick brown fox")])
    was_training = model.training
    model.eval()
    try:
        return model(input_ids=ids).logits
    finally:
        model.train(was_training)


def _logprobs(model: torch.nn.Module, group: RolloutGroup) -> list[np.ndarray]:
    """The model's own log-probs of the group's completions (the reference for recompute_logprobs)."""
    return models.completion_logprobs(model, [list(group.prompt.token_ids)] * N,
                                      [c.token_ids.tolist() for c in group.completions], "cpu")


def _base_state(model_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


# --------------------------------------------------------------------------- steps


def test_version_zero_is_the_base_and_a_step_moves_every_weight(model_dir: Path):
    base = models.load_causal_lm(model_dir, "cpu", "float32")
    assert base.config.tie_word_embeddings  # the tied case is the one under test below
    trainer = _trainer(model_dir)
    before = _weights(trainer)
    _assert_same(before, {n: p.detach() for n, p in base.named_parameters()})
    # a tied weight is one parameter: named once, optimised once
    optimised = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert len(optimised) == len({id(p) for p in optimised}) == len(before)
    assert "lm_head.weight" not in before and all(p.dtype == torch.float32 for p in optimised)

    stats = trainer.step(_batch(1))
    assert trainer.version == stats.version == 1 and stats.metrics["train/skipped"] == 0.0
    assert all(np.isfinite(v) for v in stats.metrics.values())
    after = _weights(trainer)
    assert [n for n in before if torch.equal(before[n], after[n])] == []  # every base weight moved
    trainer.step(_batch(2))
    _assert_tied(trainer.model)


def test_nonfinite_full_step_changes_no_weight(model_dir: Path):
    trainer = _trainer(model_dir)
    with torch.no_grad():
        trainer.model.model.norm.weight[0] = float("inf")
    poisoned = _weights(trainer)
    stats = trainer.step(_batch(1))
    assert stats.metrics["train/skipped"] == 1.0 and trainer.skipped_steps == 1 and trainer.version == 1
    for n, w in _weights(trainer).items():
        assert torch.equal(w.nan_to_num(), poisoned[n].nan_to_num()), n
    assert trainer.optimizer.state == {}  # AdamW never stepped: no moment exists


# --------------------------------------------------------------------------- published versions


def test_saved_version_is_a_model_directory_with_the_base_names(model_dir: Path, tmp_path: Path):
    trainer = _trainer(model_dir)
    trainer.step(_batch(1))
    trainer.save_adapter(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "generation_config.json", "model.safetensors"]
    base = _base_state(model_dir)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    # the names and shapes the base model was saved with (tied lm_head left out, as there)
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in base.items()}
    _assert_same(saved, _weights(trainer))
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True

    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    _assert_tied(loaded)
    expected = _logits(trainer.model)
    torch.testing.assert_close(_logits(loaded), expected, rtol=0, atol=1e-6)
    base_model = models.load_causal_lm(model_dir, "cpu", "float32")
    assert (_logits(base_model) - expected).abs().max() > 1e-3


def test_store_of_full_versions_accepts_the_trainers_and_the_simulated_directories(model_dir: Path, tmp_path: Path):
    store = AdapterStore(tmp_path / "full", base_model=str(model_dir), kind="full")
    trainer = _trainer(model_dir)
    trainer.step(_batch(1))
    ref = store.publish(1, trainer.save_adapter)
    assert store.verify_dir(ref.path).version == 1
    sim = SimulatedTrainer(update="full")
    sim.step(_batch(1))
    sim.step(_batch(2))
    ref = store.publish(2, sim.save_adapter)
    assert sorted(os.listdir(ref.path)) == ["config.json", "manifest.json", "model.safetensors"]
    assert json.loads((Path(ref.path) / "config.json").read_text())["version"] == 2
    # a LoRA store refuses the whole-model directory
    with pytest.raises(AdapterCorruptError, match="kind 'full'"):
        AdapterStore(tmp_path / "full", kind="lora", readonly=True).verify_dir(ref.path)
    assert sorted(os.listdir(_published(SimulatedTrainer(), tmp_path / "lora"))) == [
        "adapter_config.json", "adapter_model.safetensors", "manifest.json"]
    with pytest.raises(ConfigError, match="trainer.update must be one of lora, full, got 'qlora'"):
        SimulatedTrainer(update="qlora")


def _published(sim: SimulatedTrainer, root: Path) -> str:
    sim.step(_batch(1))
    return AdapterStore(root).publish(1, sim.save_adapter).path


# --------------------------------------------------------------------------- recomputed log-probs


def test_recompute_keeps_the_current_and_the_previous_version(model_dir: Path, tmp_path: Path):
    trainer = _trainer(model_dir, keep_versions=5)
    assert trainer.keep_versions == FULL_KEEP_VERSIONS == 2  # a whole-model copy each: bounded
    groups = [_group(0, PROMPT, version=0), _group(1, "2+2=", version=0)]
    at_v0 = trainer.recompute_logprobs(groups)
    for got, want in zip(at_v0[0], _logprobs(models.load_causal_lm(model_dir, "cpu", "float32"), groups[0])):
        np.testing.assert_allclose(got, want, atol=1e-5)

    trainer.step(_batch(1))
    weights_v1 = _weights(trainer)
    # the previous version after the step: the same numbers as before it; current weights untouched
    for a, b in zip(trainer.recompute_logprobs(groups), at_v0):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    _assert_same(weights_v1, _weights(trainer))
    _assert_tied(trainer.model)
    # the current version: what the published model gives
    trainer.save_adapter(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    g1 = _group(0, PROMPT, version=1)
    at_v1 = trainer.recompute_logprobs([g1])[0]
    for got, want in zip(at_v1, _logprobs(loaded, g1)):
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert any(not np.allclose(x, y, atol=1e-4) for x, y in zip(at_v1, at_v0[0]))

    trainer.step(_batch(2))
    assert trainer.kept_versions() == [1, 2] and trainer.snapshots.copies() == [1]  # one copy, not two
    with pytest.raises(KeyError, match=r"keeps versions \[1, 2\], not \[0\]"):
        trainer.recompute_logprobs(groups)
    for x, y in zip(trainer.recompute_logprobs([g1])[0], at_v1):
        np.testing.assert_array_equal(x, y)

    single = _trainer(model_dir, keep_versions=1)
    single.step(_batch(1))
    assert single.snapshots.copies() == [] and single.kept_versions() == [1]
    with pytest.raises(KeyError):
        single.recompute_logprobs(groups)

    # a batch no check will look back at: no whole-model copy of the version it trains from
    trainer.step(dataclasses.replace(_batch(3), keep_version=False))
    assert trainer.kept_versions() == [3] and trainer.snapshots.copies() == []
    with pytest.raises(KeyError, match=r"keeps versions \[3\], not \[2\]"):
        trainer.recompute_logprobs([_group(0, PROMPT, version=2)])


# --------------------------------------------------------------------------- state


def test_full_state_round_trip_continues_bit_identically(model_dir: Path, tmp_path: Path):
    original = _trainer(model_dir)
    original.step(_batch(1))
    original.skipped_steps = 3
    original.save_state(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted((*FULL_STATE_FILES, "trainer.json"))
    meta = json.loads((tmp_path / "trainer.json").read_text())
    assert (meta["update"], meta["version"], meta["lora_rank"], meta["dtype"]) == ("full", 1, None, "float32")
    assert set(meta["parameters"]) == set(_weights(original))  # the tied weight once
    original.step(_batch(2))
    expected_weights, expected_optimizer = _weights(original), _optimizer_state(original)

    resumed = _trainer(model_dir)
    resumed.load_state(tmp_path)
    assert (resumed.version, resumed.skipped_steps) == (1, 3)
    _assert_tied(resumed.model)
    resumed.step(_batch(2))
    _assert_same(_weights(resumed), expected_weights)
    got = _optimizer_state(resumed)
    assert got.keys() == expected_optimizer.keys()
    for n in got:
        _assert_same(got[n], expected_optimizer[n])
    _assert_tied(resumed.model)


def test_state_of_the_other_mode_is_refused_naming_both(model_dir: Path, tmp_path: Path):
    lora, full = tmp_path / "lora", tmp_path / "full"
    lora.mkdir()
    full.mkdir()
    lora_trainer = _trainer(model_dir, update="lora")
    lora_trainer.step(_batch(1))
    lora_trainer.save_state(lora)
    full_trainer = _trainer(model_dir)
    full_trainer.step(_batch(1))
    full_trainer.save_state(full)

    fresh = _trainer(model_dir)
    before = _weights(fresh)
    with pytest.raises(TrainerError, match=r"written by a trainer with trainer.update = 'lora' \(LoRA adapter "
                                           r"weights\); this trainer has trainer.update = 'full'"):
        fresh.load_state(lora)
    # a state from before the field existed was written in LoRA mode
    meta = json.loads((lora / "trainer.json").read_text())
    del meta["update"]
    (lora / "trainer.json").write_text(json.dumps(meta))
    with pytest.raises(TrainerError, match="trainer.update = 'lora'"):
        fresh.load_state(lora)
    assert fresh.version == 0
    _assert_same(before, _weights(fresh))  # refused whole: nothing changed
    _trainer(model_dir, update="lora").load_state(lora)  # and LoRA mode still reads it

    with pytest.raises(TrainerError, match=r"trainer.update = 'full' \(all model weights\); this trainer has "
                                           r"trainer.update = 'lora'"):
        _trainer(model_dir, update="lora").load_state(full)
    with pytest.raises(TrainerError, match="full weights saved in dtype 'float32', this trainer has "
                                           "trainer.dtype 'bfloat16'"):
        _trainer(model_dir, dtype="bfloat16").load_state(full)


def test_bfloat16_full_mode_trains_and_saves_in_bfloat16(model_dir: Path, tmp_path: Path):
    trainer = _trainer(model_dir, dtype="bfloat16")
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    trainer.step(_batch(1))
    assert {v.dtype for st in _optimizer_state(trainer).values() for k, v in st.items() if k != "step"} == {
        torch.bfloat16}
    trainer.save_adapter(tmp_path / "version")
    with safe_open(str(tmp_path / "version" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    (tmp_path / "state").mkdir()
    trainer.save_state(tmp_path / "state")
    trainer.step(_batch(2))
    resumed = _trainer(model_dir, dtype="bfloat16")
    resumed.load_state(tmp_path / "state")
    resumed.step(_batch(2))
    _assert_same(_weights(resumed), _weights(trainer))


# --------------------------------------------------------------------------- in a child process


def test_process_trainer_in_full_mode_matches_the_in_thread_trainer(model_dir: Path, tmp_path: Path):
    local = _trainer(model_dir)
    child = ProcessTrainer(model_dir, TrainerConfig(update="full"), LossConfig())
    try:
        child.setup()
        ours, theirs = local.step(_batch(1)), child.step(_batch(1))
        assert child.version == 1 and theirs.metrics["train/loss"] == pytest.approx(ours.metrics["train/loss"],
                                                                                    abs=1e-6)
        child.save_adapter(tmp_path)
        loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path))
        torch.testing.assert_close(_logits(loaded), _logits(local.model), rtol=0, atol=1e-5)
        with pytest.raises(KeyError):
            child.recompute_logprobs([_group(0, PROMPT, version=5)])
    finally:
        child.close()


def test_the_kl_reference_of_full_weights_is_the_frozen_base_model(model_dir: Path):
    """loss.kl_coef > 0 with full weights: every weight trains, so the reference is a copy of the
    starting model that no step moves; the penalty is 0 at the first step and grows as the policy leaves it."""
    trainer = PolicyTrainer(model_dir, TrainerConfig(update="full", lora_rank=4), LossConfig(kl_coef=0.5), seed=0)
    trainer.setup()
    first = trainer.step(_batch(1)).metrics
    assert first["train/kl_ref"] == pytest.approx(0.0, abs=1e-9)
    for step in range(2, 5):
        stats = trainer.step(_batch(step)).metrics
    assert stats["train/kl_ref"] > 1e-6
    base = models.load_causal_lm(model_dir, "cpu", "float32")
    group = _batch(1).groups[0]
    rows = trainer._rows([group])
    got = trainer._fixed_logprobs(rows, reference=True)[0][len(group.prompt.token_ids):].numpy()
    np.testing.assert_allclose(got, _logprobs(base, group)[0], rtol=1e-5, atol=1e-6)
    assert not np.allclose(got, _logprobs(trainer.model, group)[0], atol=1e-4)  # the policy moved, not it


# --------------------------------------------------------------------------- trainer.publish = "memory"


def test_shared_versions_are_the_weights_of_their_step_and_kept_until_engines_pass_them(model_dir, monkeypatch):
    """share_weights packs the version just trained (a copy later steps leave alone) and keeps each
    packed version until a later call's keep_from passes it. CUDA IPC needs a GPU: `share` is
    stood in for by the packed buffer itself."""
    from pipeline.engines import shared_weights

    monkeypatch.setattr(shared_weights, "share", lambda packed: {"version": packed.version, "packed": packed})
    trainer = _trainer(model_dir)
    trainer.setup()
    payloads = {}
    for step, keep_from in ((1, 0), (2, 1), (3, 1), (4, 3)):
        trainer.step(_batch(step))
        payloads[step] = trainer.share_weights(keep_from)
        assert payloads[step]["version"] == trainer.version == step
        assert sorted(trainer.strategy.shared) == [v for v in range(keep_from, step + 1) if v >= 1]
        now = dict(trainer.model.named_parameters())
        for name, tensor in shared_weights.unpack(payloads[step]["packed"].flat, payloads[step]["packed"].layout):
            assert torch.equal(tensor, now[name].detach()), name
    # version 3's buffer still holds version 3 after step 4 moved the weights
    before = {n: t.clone() for n, t in shared_weights.unpack(payloads[3]["packed"].flat, payloads[3]["packed"].layout)}
    assert any(not torch.equal(before[n], p.detach()) for n, p in trainer.model.named_parameters())
    assert trainer.strategy.shared[3] is payloads[3]["packed"]
    # a second call for the same version shares the same buffer, not a second copy
    assert trainer.share_weights(3)["packed"] is payloads[4]["packed"]


def test_a_shared_lora_version_holds_what_its_files_would(model_dir, tmp_path):
    """LoRA with trainer.publish = "memory": the payload reads back (its sha256 checked) into exactly
    the tensors and the config bytes save_adapter writes for the same version."""
    from safetensors.torch import load_file

    from pipeline.engines import shared_weights

    lora = _trainer(model_dir, update="lora")
    lora.setup()
    lora.step(_batch(1))
    payload = lora.share_weights(0)
    tensors, config = shared_weights.adapter_tensors(payload)
    lora.save_adapter(tmp_path)
    files = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert payload["version"] == 1 and tensors.keys() == files.keys() and files
    assert all(torch.equal(tensors[k], files[k]) for k in files)
    assert config == (tmp_path / "adapter_config.json").read_bytes()
    lora.step(_batch(2))  # the payload is a copy: a later step leaves it as it was
    assert all(torch.equal(shared_weights.adapter_tensors(payload)[0][k], files[k]) for k in files)
