"""The built-in models: random-weight Qwen2 shapes with a byte-level tokenizer, built offline and
cached (`builtin.py`, also token log-probabilities), and the warm start that fine-tunes one on a
task until it is partly competent (`warm_start.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def model_json(model_path: str | Path, name: str) -> dict[str, Any]:
    """The JSON object in the model directory's file `name` (config.json, tokenizer_config.json, ...);
    {} where that file is missing, unreadable or not an object."""
    try:
        value = json.loads((Path(model_path) / name).read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
