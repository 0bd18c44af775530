"""A user's prompt data set from disk: JSONL, JSON, Parquet, CSV, or a `datasets.save_to_disk` directory.

Files are read with the `datasets` library's local builders, offline (nothing is downloaded,
nothing is cached outside a temporary directory), and come back as plain rows (dicts).

Invariants:
- A file that is missing, unreadable, unparsable or empty is a `ConfigError` naming it and its
  config key (the CLI exits 2); a file that reads gives every one of its rows, in file order.
- Rows are not judged here: a bad row (no prompt, a malformed message list) is refused on its
  own later, when it becomes a Prompt (`pipeline.prompts`), so one bad row never sinks the set.
- Every row gets an `id`: its own, or `<key>-<row index>`, so a row is named the same way in
  every session of a resumed run.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_EVAL_SPLITS = ("test", "validation", "eval")  # a DatasetDict's split that data.eval takes, in this order


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def load_rows(path: str, key: str) -> list[dict[str, Any]]:
    """Every row of the data set at `path` (the value of config key `key`, for messages)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never ask a hub
    import datasets

    datasets.utils.logging.disable_progress_bar()
    datasets.utils.logging.set_verbosity_error()
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
        raise ConfigError(f"{where} cannot be read as a data set: {type(e).__name__}: {_short(e)}") from None
    if not rows:
        raise ConfigError(f"{where} holds no rows")
    prefix = key.rsplit(".", 1)[-1]
    for i, row in enumerate(rows):
        if row.get("id") is None:
            row["id"] = f"{prefix}-{i}"
    return rows


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
