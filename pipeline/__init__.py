"""pipeline: asynchronous GRPO with vLLM or transformers engines, a LoRA trainer and a staleness bound.

    from pipeline import Pipeline, load_config

Names are imported on first use, so `import pipeline.config.schema` (the CLI's fast path for config
errors) does not load torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Pipeline", "StepResult", "RunConfig", "load_config", "read_rollouts"]

_WHERE = {"Pipeline": "pipeline.loop.orchestrator", "StepResult": "pipeline.loop.orchestrator",
          "RunConfig": "pipeline.config.schema", "load_config": "pipeline.config.io", "read_rollouts": "pipeline.store.rollout_log"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
