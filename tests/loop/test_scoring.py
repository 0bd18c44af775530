"""Reward i belongs to completion i: from the engine's answer to the trainer's batch and the log.

The reward here is a function of each completion's own token ids (their sum and their number),
on completions of different contents and lengths, so a reward handed to a neighbour, to another
group's completion or to the completion reversed shows at once: every logged and trained reward
must be the function of its own completion's tokens.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import sim_config
from episode_envs import Echo
from test_episodes import KeepingTrainer

from pipeline.config.io import load_config
from pipeline.engines.simulated import SimulatedEngine
from pipeline.loop.orchestrator import Pipeline
from pipeline.store.rollout_log import read_rollouts
from pipeline.types import Completion


def of_tokens(ids: Any) -> float:
    ids = [int(t) for t in ids]
    return ((sum(ids) * 31 + 7 * len(ids)) % 97) / 97


def token_reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]], **kw: Any) -> list[float]:
    return [of_tokens(ids) for ids in completion_ids]


ROWS = [{"id": f"r{i}", "prompt": f"say {i}:"} for i in range(48)]


def _cut(c: Completion, k: int) -> Completion:
    return replace(c, token_ids=c.token_ids[:k], logprobs=c.logprobs[:k])


class Ragged(SimulatedEngine):
    """The simulated engine, each completion cut to a length of its own."""

    def _ragged(self, gen: Any) -> Any:
        rid = gen.request.group_id
        return replace(gen, completions=tuple(_cut(c, 1 + (3 * i + rid) % len(c.token_ids))
                                              for i, c in enumerate(gen.completions)))

    async def generate(self, request: Any, adapter: Any) -> Any:
        return self._ragged(await super().generate(request, adapter))

    async def generate_many(self, requests: Any, adapter: Any) -> Any:
        return [self._ragged(g) for g in await super().generate_many(requests, adapter)]


class OneAtATime:
    """An engine without generate_many: one engine call per group."""

    def __init__(self, inner: SimulatedEngine) -> None:
        self.inner, self.name, self.busy = inner, inner.name, inner.busy

    @property
    def max_context(self) -> int | None:
        return self.inner.max_context

    async def start(self) -> None:
        await self.inner.start()

    async def generate(self, request: Any, adapter: Any) -> Any:
        return await self.inner.generate(request, adapter)

    async def load_adapter(self, adapter: Any) -> None:
        await self.inner.load_adapter(adapter)

    async def unload_adapter(self, adapter: Any) -> None:
        await self.inner.unload_adapter(adapter)

    async def close(self) -> None:
        await self.inner.close()


def _assert_paired_in_the_log(p: Pipeline) -> int:
    r = read_rollouts(p.run_dir / "rollouts.zarr")
    checked, lengths = 0, set()
    for i in range(r.num_groups):
        g = r.group(i)
        if g["fate"] not in ("trained", "eval"):
            continue
        for (tokens, _, _), reward in zip(g["completions"], g["rewards"]):
            assert reward == pytest.approx(of_tokens(tokens)), f"group {g['group_id']}: a reward of another completion"
            lengths.add(len(tokens))
            checked += 1
    assert checked and p.summary["accounting_ok"]
    return len(lengths)


def _assert_paired_in_training(trainer: KeepingTrainer) -> None:
    assert trainer.batches
    for batch in trainer.batches:
        for g in batch.groups:
            assert g.rewards.tolist() == pytest.approx([of_tokens(c.token_ids) for c in g.completions])


@pytest.mark.parametrize("max_wave", [1, 4], ids=["group_calls", "batched_calls"])
def test_each_reward_is_its_own_completions_on_the_simulated_engine(tmp_path: Path, max_wave: int) -> None:
    cfg = sim_config(tmp_path, B=4, n=4, steps=5, **{"engine.simulated.completion_tokens": 9,
                                                     "sampling.max_new_tokens": 9, "eval.every": 2, "eval.n": 3})
    trainer = KeepingTrainer()
    engine = Ragged(cfg.engine.simulated, name="ragged", seed=0)
    p = Pipeline(cfg, prompts=ROWS, reward=token_reward, engines=[engine if max_wave > 1 else OneAtATime(engine)],
                 trainer=trainer,
                 eval_prompts=ROWS[:5], console=False)
    p.run_sync()
    assert _assert_paired_in_the_log(p) > 3, "completions of several lengths"
    _assert_paired_in_training(trainer)


def test_each_reward_is_its_own_episodes(tmp_path: Path) -> None:
    """An episode's reward functions score its whole transcript: the policy's turns and the replies."""
    cfg = sim_config(tmp_path, B=3, n=3, steps=4, **{"engine.simulated.completion_tokens": 3,
                                                     "sampling.max_new_tokens": 3, "env.reward": "functions"})
    trainer = KeepingTrainer()
    rows = [{"id": str(i), "turns": 1 + i % 3} for i in range(30)]  # episodes of one to three turns
    p = Pipeline(cfg, prompts=rows, reward=token_reward, environment=Echo, trainer=trainer, console=False)
    p.run_sync()
    assert _assert_paired_in_the_log(p) >= 2
    _assert_paired_in_training(trainer)


@pytest.mark.parametrize("engine_kind", ["transformers", "vllm_server"])
def test_each_reward_is_its_own_completions_on_real_engines(tmp_path: Path, model_dir: Path, engine_kind: str) -> None:
    from vllm_stand_in import VLLMStandIn

    from pipeline.config.schema import SamplingConfig, TransformersEngineConfig
    from pipeline.engines.transformers import TransformersEngine

    sets = {"out": str(tmp_path / "run"), "model.path": str(model_dir), "trainer.separate_process": False,
            "sampling.n": 4, "sampling.max_new_tokens": 5, "pipeline.steps": 3, "pipeline.batch_groups": 3,
            "log.progress": False, "eval.every": 3, "eval.n": 2}

    async def main() -> Pipeline:
        if engine_kind == "transformers":
            p = Pipeline(load_config(None, sets), prompts=ROWS, reward=token_reward, eval_prompts=ROWS[:4],
                         console=False)
            await p.run()
            return p
        inner = TransformersEngine(model_dir, sampling=SamplingConfig(), cfg=TransformersEngineConfig(),
                                   device="cpu", dtype="float32", max_loaded_adapters=3, seed=0, name="inner")
        await inner.start()
        stub = VLLMStandIn(inner, model_name="tiny")
        url = await stub.start()
        try:
            p = Pipeline(load_config(None, {**sets, "engine.kind": "vllm_server", "engine.vllm_server.urls": [url]}),
                         prompts=ROWS, reward=token_reward, eval_prompts=ROWS[:4], console=False)
            await p.run()
        finally:
            await stub.close()
            await inner.close()
        return p

    p = asyncio.run(main())
    _assert_paired_in_the_log(p)
    assert json.loads((p.run_dir / "summary.json").read_text())["groups_trained"] == 9
