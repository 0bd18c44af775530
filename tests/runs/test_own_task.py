"""A researcher's own task from run.py alone: data files, rewards by path, chat prompts, evaluation
(examples/own_task), and the clear refusals of bad data and reward entries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO, run_py

from pipeline.observe.metrics import read_jsonl
from pipeline.store.rollout_log import read_rollouts

EXAMPLE = REPO / "examples" / "own_task"


@pytest.mark.slow
def test_the_own_task_example_runs_from_run_py_with_chat_prompts_and_eval(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_py("--config", str(EXAMPLE / "config.toml"), "--steps", "6", "--out", str(out),
                  "--set", "eval.every=3", "--set", f"model.cache_dir={tmp_path / 'models'}", "--set", "log.progress=false",
                  timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accounting_ok"] and summary["prompts_refused"] == 0  # chat rows rendered, none refused
    rows = read_jsonl(out / "metrics.jsonl")
    steps = [r for r in rows if "eval/groups" not in r]
    evals = [r for r in rows if "eval/groups" in r]
    assert [r["step"] for r in steps] == list(range(1, 7))
    for r in steps:  # each reward function's own mean beside the weighted one
        assert r["reward_mean"] == pytest.approx(r["reward/correct"] + 0.5 * r["reward/digits"])
    assert [r["step"] for r in evals] == [0, 3, 6]
    assert all(r["eval/groups"] == 20 and 0 <= r["eval/pass@1"] <= r["eval/pass@8"] <= 1 for r in evals)
    log = read_rollouts(out / "rollouts.zarr")
    chat = [i for i in range(log.num_groups) if log.groups["prompt_id"][i].endswith("-chat")]
    assert chat, "the chat rows of train.jsonl were trained too"
    prompt = log.group(chat[0])["prompt_token_ids"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(next((tmp_path / "models").iterdir())))
    text = tok.decode(prompt.tolist())
    assert text.startswith("<|im_start|>user\nWhat is ") and text.endswith("<|im_start|>assistant\n")


def test_a_reward_entry_that_fails_to_import_exits_2_before_anything_is_written(tmp_path: Path) -> None:
    (tmp_path / "r.py").write_text("import not_a_module_anywhere\n")
    out = tmp_path / "run"
    proc = run_py("--config", str(EXAMPLE / "config.toml"), "--out", str(out),
                  "--set", f'reward.functions=["{tmp_path / "r.py"}:correct"]', "--set", "reward.weights=[]",
                  timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: reward.functions[0] entry") and "ModuleNotFoundError" in proc.stderr
    assert not out.exists()


def test_a_data_file_that_is_not_a_data_set_exits_2_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "train.jsonl"
    bad.write_text("this is not json\n")
    proc = run_py("--config", str(EXAMPLE / "config.toml"), "--out", str(tmp_path / "run"),
                  "--set", f"data.train={bad}", "--set", f"model.cache_dir={tmp_path / 'models'}", timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "data.train" in proc.stderr and "train.jsonl" in proc.stderr and "not valid JSON lines: line 1" in proc.stderr


def test_message_rows_without_a_chat_template_end_the_run_naming_the_reason(tmp_path: Path) -> None:
    from pipeline.config.io import load_config
    from pipeline.errors import ConfigError
    from pipeline.models.builtin import build_tokenizer
    from pipeline.loop.orchestrator import Pipeline

    tok = build_tokenizer()
    tok.chat_template = None
    rows = [{"id": f"m{i}", "prompt": [{"role": "user", "content": f"q {i}"}]} for i in range(6)]
    cfg = load_config(None, {"out": str(tmp_path / "run"), "engine.kind": "simulated", "trainer.kind": "simulated",
                             "pipeline.steps": 2, "pipeline.batch_groups": 2, "log.progress": False})
    p = Pipeline(cfg, prompts=rows, reward=lambda prompts, completions, **kw: [0.0] * len(completions),
                 tokenizer=tok, console=False)
    with pytest.raises(ConfigError, match=r"every prompt .* refused.*no_chat_template: 6"):
        p.run_sync()
