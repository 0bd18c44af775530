"""A user's prompt data set from disk: JSONL, JSON, Parquet, CSV, or a `datasets.save_to_disk` directory.

Files are read with the `datasets` library's local builders, offline (nothing is downloaded,
nothing is cached outside a temporary directory), and come back as plain rows (dicts).

Invariants:
- A file that is missing, unreadable, unparsable or empty is a `ConfigError` naming it and its
  config key (the CLI exits 2); a file that reads gives every one of its rows, in file order.
- A JSONL line that is not JSON is named by its line number (1-based) and what is wrong there.
- Rows are not judged here: a bad row (no prompt, a malformed message list) is refused on its
  own later, when it becomes a Prompt (`pipeline.data.prompts`), so one bad row never sinks the set.
  Only the prompt column is looked for at once (`prompt_field`): a set where no row has it is a
  ConfigError naming the columns it has; rows without it are counted and named in a warning.
- Every row gets an `id`: its own, or `<key>-<row index>`, so a row is named the same way in
  every session of a resumed run.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import structlog

from pipeline.errors import ConfigError

log = structlog.get_logger(__name__)

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_EVAL_SPLITS = ("test", "validation", "eval")  # a DatasetDict's split that data.eval takes, in this order


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _bad_jsonl_line(path: str) -> str | None:
    """"line N: what is wrong" for the first line of a JSONL file that is not a JSON object, or None."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                return f"line {n}: {e.msg} (column {e.colno})"
            if not isinstance(row, dict):
                return f"line {n}: a row must be a JSON object, got {type(row).__name__}"
    return None


def load_rows(path: str, key: str, prompt_field: str | None = None) -> list[dict[str, Any]]:
    """Every row of the data set at `path` (the value of config key `key`, for messages); with
    `prompt_field`, the column each row's prompt is in, looked for at once."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never ask a hub
    import datasets

    datasets.utils.logging.disable_progress_bar()
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)  # its errors become ours, said once
    where = f"{key} = {path!r}"
    if not os.path.exists(path):
        raise ConfigError(f"{where} does not exist")
    try:
        if os.path.isdir(path):
            ds = _from_disk(datasets, path, key, where)
        else:
            builder = _BUILDERS.get(Path(path).suffix.lower())
            if builder is None:
                raise ConfigError(f"{where}: a data file must end in {', '.join(_BUILDERS)}")
            with open(path, "rb"):  # permission and I/O errors said plainly, before the builder's own
                pass
            with tempfile.TemporaryDirectory(prefix="pipeline-data-") as cache:
                ds = datasets.load_dataset(builder, data_files=path, split="train", cache_dir=cache,
                                           keep_in_memory=True)
        rows = ds.to_list()
    except ConfigError:
        raise
    except OSError as e:  # unreadable: permissions, a directory entry gone, an I/O error
        raise ConfigError(f"{where} cannot be read: {e.strerror or _short(e)}") from None
    except Exception as e:  # the builders raise many types for a file they cannot parse; each is bad input
        bad = _bad_jsonl_line(path) if path.lower().endswith(".jsonl") else None
        if bad is not None:
            raise ConfigError(f"{where} is not valid JSON lines: {bad}") from None
        raise ConfigError(f"{where} cannot be read as a data set: {type(e).__name__}: {_short(e)}") from None
    if not rows:
        raise ConfigError(f"{where} holds no rows")
    prefix = key.rsplit(".", 1)[-1]
    for i, row in enumerate(rows):
        if row.get("id") is None:
            row["id"] = f"{prefix}-{i}"
    if prompt_field is not None:
        _look_for_prompts(rows, prompt_field, where)
    return rows


def _look_for_prompts(rows: list[dict[str, Any]], field: str, where: str) -> None:
    """ConfigError if no row has `field` (nor token ids); a warning naming the rows that lack it."""
    # a column the file lacks in some rows comes back as None in those (datasets fills the schema)
    missing = [r["id"] for r in rows if r.get(field) is None and r.get("token_ids") is None]
    if len(missing) == len(rows):
        columns = sorted({k for r in rows[:100] for k, v in r.items() if v is not None and k != "id"})
        raise ConfigError(f"{where}: no row has a {field!r} column (data.prompt_field); its columns are "
                          f"{', '.join(columns) or 'none'}: set data.prompt_field to the one holding the prompts")
    if missing:
        log.warning("rows_without_prompt", data=where, rows=len(missing), first=missing[:5], field=field,
                    hint="each is refused when the stream reaches it (reason malformed)")


def _from_disk(datasets: Any, path: str, key: str, where: str) -> Any:
    """A Dataset saved with save_to_disk; of a DatasetDict, the split `key` means."""
    ds = datasets.load_from_disk(path, keep_in_memory=True)
    if not isinstance(ds, datasets.DatasetDict):
        return ds
    wanted = ("train",) if key.endswith("train") else _EVAL_SPLITS
    for split in wanted:
        if split in ds:
            return ds[split]
    if len(ds) == 1:
        return next(iter(ds.values()))
    raise ConfigError(f"{where} holds the splits {sorted(ds)}; {key} takes one named {' or '.join(wanted)}")
