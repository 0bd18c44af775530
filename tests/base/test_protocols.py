"""pipeline.protocols: every built-in engine and trainer fills its role, and declares what it can do.

Nothing here starts a model: the protocols are about members, and `max_context` before start.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config.schema import (
    LossConfig,
    SamplingConfig,
    SimulatedEngineConfig,
    TrainerConfig,
    TransformersEngineConfig,
    VLLMEngineConfig,
    VLLMServerEngineConfig,
)
from pipeline.engines import base
from pipeline.protocols import BatchEngine, Engine, Trainer


def engines(tmp_path: Path) -> dict[str, object]:
    from pipeline.engines.simulated import SimulatedEngine
    from pipeline.engines.transformers import TransformersEngine
    from pipeline.engines.vllm import VLLMEngine
    from pipeline.engines.vllm_server import VLLMServerEngine

    url = "http://127.0.0.1:9"
    return {
        "simulated": SimulatedEngine(SimulatedEngineConfig()),
        "transformers": TransformersEngine(tmp_path, sampling=SamplingConfig(), cfg=TransformersEngineConfig()),
        "vllm": VLLMEngine(tmp_path, sampling=SamplingConfig(), cfg=VLLMEngineConfig(max_model_len=1024)),
        "vllm_server": VLLMServerEngine(url, sampling=SamplingConfig(), cfg=VLLMServerEngineConfig(urls=(url,))),
    }


def test_every_engine_is_an_engine_and_only_the_simulated_one_samples_many_groups_per_call(tmp_path: Path) -> None:
    built = engines(tmp_path)
    assert all(isinstance(e, Engine) for e in built.values())
    assert [k for k, e in built.items() if isinstance(e, BatchEngine)] == ["simulated"]
    assert base.Engine is Engine and base.BatchEngine is BatchEngine  # where callers import them from


def test_max_context_is_declared_by_every_engine(tmp_path: Path) -> None:
    built = engines(tmp_path)
    # before start: the vLLM engine knows its configured limit, the others learn theirs at start
    assert {k: e.max_context for k, e in built.items()} == {  # type: ignore[attr-defined]
        "simulated": None, "transformers": None, "vllm": 1024, "vllm_server": None}
    server = built["vllm_server"]
    server.max_model_len = 12  # type: ignore[attr-defined]  # what start() reads from /v1/models
    assert server.max_context == 12  # type: ignore[attr-defined]


def test_an_object_missing_a_member_is_not_an_engine() -> None:
    class NoContext:
        name = "x"
        busy = None

        async def start(self) -> None: ...
        async def generate(self, request, adapter): ...  # type: ignore[no-untyped-def]
        async def load_adapter(self, adapter) -> None: ...  # type: ignore[no-untyped-def]
        async def unload_adapter(self, adapter) -> None: ...  # type: ignore[no-untyped-def]
        async def close(self) -> None: ...

    assert not isinstance(NoContext(), Engine)
    NoContext.max_context = None  # type: ignore[attr-defined]
    assert isinstance(NoContext(), Engine) and not isinstance(NoContext(), BatchEngine)


@pytest.mark.parametrize("kind", ["simulated", "lora", "process"])
def test_every_trainer_is_a_trainer(kind: str, tmp_path: Path) -> None:
    from pipeline.trainer.policy import PolicyTrainer
    from pipeline.trainer.simulated import SimulatedTrainer
    from pipeline.trainer.process import ProcessTrainer

    trainer = {"simulated": lambda: SimulatedTrainer(),
               "lora": lambda: PolicyTrainer(tmp_path, TrainerConfig(), LossConfig()),
               "process": lambda: ProcessTrainer(tmp_path, TrainerConfig(), LossConfig())}[kind]()
    assert isinstance(trainer, Trainer)
    assert trainer.version == 0 and trainer.consecutive_skips == 0
