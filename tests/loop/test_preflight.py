"""pipeline.loop.preflight: what a config names on this machine is looked up there, not in the schema.

A config naming a path, a package or a device this machine lacks builds without touching the
filesystem; the preflight refuses it with a ConfigError naming the key, and both run.py (exit 2,
nothing written) and a Pipeline's set-up (before anything is built) reach it.
"""

from __future__ import annotations

import builtins
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import REPO, load_script, sim_config

from pipeline.config.io import load_config
from pipeline.errors import ConfigError
from pipeline.loop import preflight as preflight_module
from pipeline.loop.preflight import preflight

# run.py is a script at the repository root, not part of the package: load it by path
run = load_script(REPO / "run.py", "run_cli_preflight")


def _hide(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))


def test_a_config_naming_what_this_machine_lacks_builds_without_looking(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    missing = str(tmp_path / "nowhere")
    overrides = {"model.path": missing, "data.train": f"{missing}/train.jsonl", "data.eval": missing,
                 "data.chat_template": f"{missing}/chat.jinja", "reward.functions": ["my_rewards.py:correct"],
                 "log.trackers": ["tensorboard", "wandb"], "engine.devices": ["cuda:5"], "trainer.device": "cuda:7"}
    touched: list[str] = []

    def spy(module: Any, name: str) -> None:
        real = getattr(module, name)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            touched.append(f"{name}{args[:1]}")
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, recorded)

    load_config(None, overrides)  # whatever loading imports lazily, imported before the spies go in
    with monkeypatch.context() as m:
        # os.path's exists, isdir and isfile (and pathlib's) all go through os.stat
        for module, name in [(os, "stat"), (os, "lstat"), (os, "scandir"), (os, "listdir"), (os, "access"),
                             (builtins, "open"), (importlib.util, "find_spec")]:
            spy(module, name)
        cfg = load_config(None, overrides)
        m.undo()
    assert touched == []
    assert (cfg.model.path, cfg.data.eval, cfg.log.trackers) == (missing, missing, ("tensorboard", "wandb"))
    with pytest.raises(ConfigError, match=r"^model\.path must be an existing model directory; .* does not exist$"):
        preflight(cfg)


def _file(tmp_path: Path, name: str, text: str = "x") -> str:
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


def _dir(tmp_path: Path, name: str) -> str:
    (tmp_path / name).mkdir()
    return str(tmp_path / name)


# each case: the overrides (made from tmp_path), the message it is refused with
REFUSED: dict[str, tuple[Callable[[Path], dict[str, Any]], str]] = {
    "a missing model": (lambda t: {"model.path": str(t / "no-such-model")},
                        r"^model\.path must be an existing model directory; '.*no-such-model' does not exist$"),
    "a file as the model": (lambda t: {"model.path": _file(t, "weights")},
                            r"^model\.path must be an existing model directory; '.*weights' is not a directory$"),
    "a model path too long to stat": (lambda t: {"model.path": "a" * 5000},
                                      r"^model\.path must be an existing model directory; 'a+.*' does not exist$"),
    "a model without config.json": (lambda t: {"model.path": str(t)},
                                    r"^model\.path must be a transformers model directory; .* has no config\.json$"),
    "missing training prompts": (lambda t: {"data.train": str(t / "nope.jsonl"), "reward.functions": ["m:f"]},
                                 r"^data\.train: '.*nope\.jsonl' does not exist$"),
    "eval prompts of no known format": (lambda t: {"data.eval": _file(t, "x.txt")},
                                        r"^data\.eval must be a \.jsonl, \.json, \.parquet, \.csv file or a "
                                        r"datasets\.save_to_disk directory, got '.*x\.txt'$"),
    "a directory not from save_to_disk": (lambda t: {"data.eval": _dir(t, "d")},
                                          r"^data\.eval: directory '.*d' is not one written by datasets' "
                                          r"save_to_disk \(no dataset_info\.json or dataset_dict\.json\)$"),
    "a missing chat template": (lambda t: {"data.chat_template": str(t / "chat.jinja")},
                                r"^data\.chat_template must be a jinja file; '.*chat\.jinja' does not exist$"),
    "a directory as the chat template": (lambda t: {"data.chat_template": str(t)},
                                         r"^data\.chat_template must be a jinja file; .* is not a file$"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_the_config_names_and_this_machine_lacks_is_refused_naming_the_key(tmp_path: Path, case: str) -> None:
    make, message = REFUSED[case]
    cfg = load_config(None, make(tmp_path))  # the schema lets it through: it checks values only
    with pytest.raises(ConfigError, match=message):
        preflight(cfg)


@pytest.mark.parametrize("package", ["wandb", "tensorboard"])
def test_a_tracker_whose_package_is_missing_is_refused_naming_the_extra(monkeypatch: pytest.MonkeyPatch,
                                                                        package: str) -> None:
    cfg = load_config(None, {"log.trackers": [package]})
    _hide(monkeypatch, package)
    with pytest.raises(ConfigError, match=rf'^log\.trackers includes "{package}" but the {package} package is not '
                                          rf'installed; pip install -e "\.\[{package}\]"$'):
        preflight(cfg)


@pytest.mark.parametrize("key", ["data.train", "data.eval"])
def test_a_data_file_without_the_datasets_package_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path, key: str) -> None:
    cfg = load_config(None, {key: _file(tmp_path, "rows.jsonl"), "reward.functions": ["m:f"]})
    _hide(monkeypatch, "datasets")
    with pytest.raises(ConfigError, match=rf"^{key} = '.*rows\.jsonl' is read with the datasets package, which is not "
                                          r"installed; pip install 'datasets>=2\.19'$"):
        preflight(cfg)


def test_what_this_machine_has_passes(tmp_path: Path) -> None:
    model = Path(_dir(tmp_path, "model"))
    (model / "config.json").write_text("{}")
    saved = Path(_dir(tmp_path, "saved"))
    (saved / "dataset_dict.json").write_text("{}")
    trackers = [n for n in ("tensorboard", "wandb") if importlib.util.find_spec(n)]
    assert trackers, "no tracker package installed: this test would not check one"
    cfg = load_config(None, {"model.path": str(model), "data.train": _file(tmp_path, "train.JSONL"),
                             "data.eval": str(saved), "data.chat_template": _file(tmp_path, "chat.jinja"),
                             "reward.functions": ["m:f"], "log.trackers": trackers})
    preflight(cfg)


def test_cuda_devices_are_looked_up_for_what_the_pipeline_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[list[tuple[str, str]]] = []
    monkeypatch.setattr(preflight_module, "check_cuda_devices", lambda named: asked.append(list(named)))
    cfg = load_config(None, {"engine.devices": ["cpu", "cuda:1"], "trainer.devices": ["cuda:2", "cuda:3"]})
    preflight(cfg)
    preflight(cfg, builds_engines=False)
    preflight(cfg, builds_trainer=False)
    preflight(load_config(None, {"engine.kind": "simulated", "engine.devices": ["cuda:1"],
                                 "trainer.kind": "simulated", "trainer.device": "cuda:0"}))
    trainer = [("trainer.devices[0]", "cuda:2"), ("trainer.devices[1]", "cuda:3")]
    engines = [("engine.devices[0]", "cpu"), ("engine.devices[1]", "cuda:1")]
    assert asked == [engines + trainer, trainer, engines, []]


def test_run_py_refuses_a_missing_model_with_exit_2_before_making_the_run_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing, out = tmp_path / "no-model", tmp_path / "run"
    assert run.main(["--set", f"model.path={missing}", "--out", str(out)]) == 2
    stdout, stderr = capsys.readouterr()
    assert stdout == "" and stderr.splitlines() == [
        f"error: model.path must be an existing model directory; {str(missing)!r} does not exist"]
    assert not out.exists()


def test_a_pipeline_refuses_at_set_up_before_building_anything(tmp_path: Path) -> None:
    from pipeline.loop.orchestrator import Pipeline

    chat = tmp_path / "chat.jinja"
    pipe = Pipeline(sim_config(tmp_path, **{"data.chat_template": str(chat)}), console=False)
    # without the preflight, the run would fail later, at reading the template, with another message
    with pytest.raises(ConfigError, match=rf"^data\.chat_template must be a jinja file; {re.escape(repr(str(chat)))} "
                                          "does not exist$"):
        pipe.run_sync()
    assert not (pipe.run_dir / "rollouts.zarr").exists() and not (pipe.run_dir / "checkpoints").exists()


def test_the_preflight_imports_none_of_the_packages_it_looks_for() -> None:
    # find_spec's lookup: importing torch, TensorBoard or wandb costs seconds before any error is said
    # (nor does importing the trackers' module, which imports each package only when a run opens it)
    code = ("import importlib.util, sys; from pipeline.config.io import load_config; import pipeline.observe.trackers; "
            "from pipeline.loop.preflight import preflight; "
            "names = [n for n in ('tensorboard', 'wandb') if importlib.util.find_spec(n)]; "
            "assert 'tensorboard' in names; preflight(load_config(None, {'log.trackers': names})); "
            "print(sorted(m for m in ('torch', 'tensorboard', 'wandb') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
