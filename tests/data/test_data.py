"""Data files: every supported format reads to the same rows; a bad file is a ConfigError naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.config.io import load_config
from pipeline.data.files import load_rows
from pipeline.errors import ConfigError
from pipeline.loop.preflight import preflight

ROWS = [
    {"id": "a", "prompt": "What is 1+1?", "answer": "2"},
    {"id": "b", "prompt": "What is 2+2?", "answer": "4"},
    {"id": "c", "prompt": "What is 3+3?", "answer": "6"},
]
CHAT = [
    {"prompt": [{"role": "user", "content": "hi"}], "answer": "1"},
    {"prompt": "plain", "answer": "2"},
]


def _write(tmp: Path, fmt: str, rows: list[dict]) -> Path:
    import datasets

    path = tmp / f"data.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "csv":
        path.write_text("id,prompt,answer\n" + "".join(f'{r["id"]},"{r["prompt"]}",{r["answer"]}\n' for r in rows))
    elif fmt == "parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    elif fmt == "disk":
        path = tmp / "saved"
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    elif fmt == "dict":
        path = tmp / "saved_dict"
        datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                              "test": datasets.Dataset.from_list(rows[:1])}).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet", "disk", "dict"])
def test_every_format_reads_the_same_rows(tmp_path: Path, fmt: str) -> None:
    path = _write(tmp_path, fmt, ROWS)
    rows = load_rows(str(path), "data.train")
    assert [{k: str(v) for k, v in r.items()} for r in rows] == ROWS
    assert load_config(None, {"data.train": str(path), "reward.functions": ["m:f"]}).data.train == str(path)


def test_a_dataset_dict_gives_its_train_split_to_train_and_its_test_split_to_eval(tmp_path: Path) -> None:
    path = _write(tmp_path, "dict", ROWS)
    assert len(load_rows(str(path), "data.train")) == 3
    assert [r["id"] for r in load_rows(str(path), "data.eval")] == ["a"]


def test_string_and_message_prompts_mix_in_one_jsonl_and_rows_without_id_get_one(tmp_path: Path) -> None:
    rows = load_rows(str(_write(tmp_path, "jsonl", CHAT)), "data.eval")
    assert rows[0]["prompt"] == [{"role": "user", "content": "hi"}] and rows[1]["prompt"] == "plain"
    assert [r["id"] for r in rows] == ["eval-0", "eval-1"]  # stable names: the row's index


def test_nothing_is_cached_outside_a_temporary_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    load_rows(str(_write(tmp_path, "jsonl", ROWS)), "data.train")
    assert not (tmp_path / "hf" / "datasets").exists() or not any((tmp_path / "hf" / "datasets").rglob("*.arrow"))


def test_a_missing_file_is_refused_before_the_run_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.train: .*nope.jsonl.* does not exist"):
        preflight(load_config(None, {"data.train": str(tmp_path / "nope.jsonl"), "reward.functions": ["m:f"]}))
    with pytest.raises(ConfigError, match=r"data.eval must be a .jsonl"):
        (tmp_path / "x.txt").write_text("hi")
        preflight(load_config(None, {"data.eval": str(tmp_path / "x.txt")}))
    with pytest.raises(ConfigError, match="save_to_disk"):
        (tmp_path / "d").mkdir()
        preflight(load_config(None, {"data.eval": str(tmp_path / "d")}))


def test_data_train_needs_a_reward() -> None:
    with pytest.raises(ConfigError, match="needs reward.functions"):
        load_config(None, {"data.train": "examples/own_task/train.jsonl"})


@pytest.mark.parametrize("content, match", [
    ("{not json\n", "not valid JSON lines: line 1: Expecting property name"),
    ('{"prompt": "a"}\n\n{"prompt": "b"}\n{"prompt": "c", oops}\n', "not valid JSON lines: line 4: .*column 17"),
    ('{"prompt": "a"}\n[1, 2]\n', "line 2: a row must be a JSON object, got list"),
    ("", "holds no rows|cannot be read"),
])
def test_an_unparsable_or_empty_file_is_a_config_error_naming_it(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=match) as e:
        load_rows(str(path), "data.train")
    assert "data.train" in str(e.value) and "bad.jsonl" in str(e.value)


def test_an_unreadable_file_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pipeline.data.files

    path = _write(tmp_path, "jsonl", ROWS)

    def denied(*args, **kwargs):  # what open() raises for a file without read permission (CI runs as root)
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(pipeline.data.files, "open", denied, raising=False)
    with pytest.raises(ConfigError, match="data.train = .*data.jsonl.* cannot be read: Permission denied"):
        load_rows(str(path), "data.train")


def test_a_set_without_its_prompt_column_is_refused_at_once_naming_the_columns(tmp_path: Path) -> None:
    path = _write(tmp_path, "jsonl", [{"question": r["prompt"], "answer": r["answer"]} for r in ROWS])
    with pytest.raises(ConfigError, match="no row has a 'prompt' column .* its columns are answer, question"):
        load_rows(str(path), "data.train", "prompt")
    assert len(load_rows(str(path), "data.train", "question")) == 3


def test_rows_without_the_prompt_column_are_named_at_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.observe.log import close_logging, configure_logging

    path = _write(tmp_path, "jsonl", [ROWS[0], {"id": "x", "answer": "1"}, ROWS[1], {"id": "y", "answer": "3"}])
    configure_logging(None, "info")
    try:
        rows = load_rows(str(path), "data.train", "prompt")
    finally:
        close_logging()
    assert [r["id"] for r in rows] == ["a", "x", "b", "y"]  # kept: each is refused when reached
    err = capsys.readouterr().err
    assert "rows_without_prompt" in err and "['x', 'y']" in err and "rows=2" in err
