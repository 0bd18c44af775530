"""Warm-started built-in models: competent on held-out problems, cached by recipe, never half-written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.models import warm_start as ws
from pipeline.config.schema import TaskConfig
from pipeline.config.io import load_config
from pipeline.errors import ConfigError
from pipeline.data.tasks import build_task

TASK = build_task(TaskConfig(name="addition", num_prompts=64), 4)


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> ws.Recipe:
    """The tiny shape's recipe cut to 20 steps, a check every 10: a build of a few seconds."""
    recipe = ws.Recipe(lr=1e-3, batch=64, max_steps=20, check_every=10)
    monkeypatch.setitem(ws.RECIPES, "tiny", recipe)
    return recipe


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.slow
def test_the_warm_start_solves_held_out_problems_and_records_how_it_got_there(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ws.warm_start("tiny", TASK, tmp_path, target=0.15, progress=False)
    record = __import__("json").loads((path / "warm_start.json").read_text())
    assert record["reached"] and record["accuracy"] >= 0.15 and record["steps"] % ws.RECIPES["tiny"].check_every == 0
    assert record["curve"][-1] == [record["steps"], record["accuracy"]]
    assert record["task"] == {"name": "addition", "digits": 2} and record["target"] == 0.15
    # measured again here, on the eval split it never saw (not the validation split it stopped on)
    model = AutoModelForCausalLM.from_pretrained(str(path))
    tok = AutoTokenizer.from_pretrained(str(path))
    held = [(r["prompt"], r["answer"]) for r in TASK.eval_prompts]
    torch.manual_seed(0)
    assert ws.sampled_accuracy(model, tok, held, "cpu") >= 0.08
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "tiny-v5"))
    assert ws.sampled_accuracy(base, tok, held, "cpu") == 0.0  # the random model it started from gets none


def test_a_build_is_cached_by_its_recipe_and_deterministic(tmp_path: Path, quick: ws.Recipe,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    first = ws.warm_start("tiny", TASK, tmp_path / "a", target=0.9, progress=False)
    again = ws.warm_start("tiny", TASK, tmp_path / "b", target=0.9, progress=False)
    assert first.name == again.name  # the name is the recipe's hash
    a, b = _weights(first), _weights(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    record = __import__("json").loads((first / "warm_start.json").read_text())
    assert not record["reached"] and record["steps"] == quick.max_steps  # said, not hidden

    def no_build(*args: object, **kw: object) -> None:
        raise AssertionError("a cached warm start was built again")

    monkeypatch.setattr(ws, "_fine_tune", no_build)
    assert ws.warm_start("tiny", TASK, tmp_path / "a", target=0.9, progress=False) == first
    with pytest.raises(AssertionError, match="built again"):  # another target is another model
        ws.warm_start("tiny", TASK, tmp_path / "a", target=0.8, progress=False)
    three = build_task(TaskConfig(name="addition", digits=3, num_prompts=8), 5)
    with pytest.raises(AssertionError, match="built again"):  # so is another task setting
        ws.warm_start("tiny", three, tmp_path / "a", target=0.9, progress=False)


def test_an_interrupted_build_leaves_nothing_to_load_and_the_next_run_builds_it(tmp_path: Path, quick: ws.Recipe,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    real = ws._fine_tune

    def killed(base: Path, out: Path, *args: object) -> dict:
        (out / "model.safetensors").write_bytes(b"half a model")
        raise KeyboardInterrupt  # Ctrl-C in the middle of the build

    monkeypatch.setattr(ws, "_fine_tune", killed)
    with pytest.raises(KeyboardInterrupt):
        ws.warm_start("tiny", TASK, tmp_path, target=0.9, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-v5"]  # the random base only: no temporary, no target
    monkeypatch.setattr(ws, "_fine_tune", real)
    path = ws.warm_start("tiny", TASK, tmp_path, target=0.9, progress=False)
    assert (path / "warm_start.json").is_file() and _weights(path)


@pytest.mark.parametrize("overrides, words", [
    ({"model.warm_start": True}, ["model.warm_start", "'char_class' has none", "addition"]),
    ({"model.warm_start_accuracy": 1.5}, ["model.warm_start_accuracy must be in (0, 1)"]),
])
def test_a_warm_start_that_cannot_be_is_refused_naming_the_key(overrides: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    for w in words:
        assert w in str(e.value)


def test_a_shape_without_a_recipe_or_a_task_without_answers_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no recipe for model.shape 'huge'"):
        ws.warm_start("huge", TASK, tmp_path)
    with pytest.raises(ConfigError, match="'char_class' has none"):
        ws.warm_start("tiny", build_task(TaskConfig(), 16), tmp_path)


def test_a_model_path_of_your_own_is_used_as_it_is(tmp_path: Path, model_dir: Path) -> None:
    """model.warm_start concerns the built-in model, as model.shape does: with model.path it is not applied."""
    from pipeline.loop.build import model_dir as resolve

    cfg = load_config(None, {"model.warm_start": True, "model.path": str(model_dir), "task.name": "char_class"})
    assert resolve(cfg) == str(model_dir)
