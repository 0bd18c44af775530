"""Building a run's parts: the CUDA-graph size a vLLM engine is given is the most sequences the run
can have running on it, on vLLM's capture grid.

The bound is checked against runs: a simulated engine records the sequences it holds at once, and
they never pass `graph_sequences`, while a slow trainer lets them reach it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import pytest
from conftest import sim_config
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config.io import load_config
from pipeline.engines.simulated import SimulatedEngine
from pipeline.engines.vllm import VLLMEngine
from pipeline.loop.build import build_engines, graph_sequences
from pipeline.loop.orchestrator import Pipeline
from pipeline.types import AdapterRef, Generation, GroupRequest


def on_vllm_grid(size: int) -> bool:
    """vLLM 0.24's capture sizes: 1, 2, 4, multiples of 8 below 256, multiples of 16 from 256."""
    return size in (1, 2, 4) or (size < 256 and size % 8 == 0) or (size >= 256 and size % 16 == 0)


def grid_below(size: int) -> int:
    return max((g for g in range(1, size) if on_vllm_grid(g)), default=0)


@settings(max_examples=300, deadline=None)
@given(K=st.integers(0, 8), B=st.integers(1, 64), n=st.integers(1, 16), engines=st.integers(1, 4),
       eval_every=st.sampled_from([0, 5]), eval_prompts=st.integers(1, 64), eval_n=st.integers(1, 8),
       max_num_seqs=st.sampled_from([64, 256, 1024, 4096]))
def test_the_graph_size_is_the_smallest_grid_size_holding_the_runs_sequences(
        K: int, B: int, n: int, engines: int, eval_every: int, eval_prompts: int, eval_n: int,
        max_num_seqs: int) -> None:
    cfg = load_config(None, {"pipeline.max_staleness": K, "pipeline.batch_groups": B, "sampling.n": n,
                             "engine.devices": ["cpu"] * engines, "eval.every": eval_every,
                             "eval.max_prompts": eval_prompts, "eval.n": eval_n,
                             "engine.vllm.max_num_seqs": max_num_seqs})
    need = -(-(K + 1) * B * n // engines) + (eval_prompts * eval_n if eval_every else 0)
    size = graph_sequences(cfg)
    if need >= max_num_seqs:
        assert size == max_num_seqs  # the scheduler never runs more than max_num_seqs at once
    else:
        assert on_vllm_grid(size) and size >= need and grid_below(size) < need


def test_a_set_graph_size_is_kept_and_every_eval_prompt_at_once_takes_the_schedulers_limit() -> None:
    assert graph_sequences(load_config(None, {"engine.vllm.max_cudagraph_capture_size": 48})) == 48
    every = load_config(None, {"eval.every": 5, "eval.max_prompts": 0, "engine.vllm.max_num_seqs": 300})
    assert graph_sequences(every) == 300


def test_the_vllm_engines_are_built_with_the_runs_graph_size(tmp_path: Path) -> None:
    cfg = load_config(None, {"engine.kind": "vllm", "engine.devices": ["cuda:0", "cuda:1"],
                             "pipeline.batch_groups": 12, "pipeline.max_staleness": 2, "sampling.n": 4})
    engines = build_engines(cfg, str(tmp_path), start_step=0)  # built, not started: no GPU, no vLLM needed
    assert all(isinstance(e, VLLMEngine) for e in engines)
    assert [e.cfg.max_cudagraph_capture_size for e in engines] == [72, 72]  # 3 x 12 x 4 over 2 engines


class Peak(SimulatedEngine):
    """A simulated engine that records the most sequences it held at once."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.running = self.peak = 0

    def _enter(self, seqs: int) -> None:
        self.running += seqs
        self.peak = max(self.peak, self.running)

    async def generate(self, request: GroupRequest, adapter: AdapterRef) -> Generation:
        self._enter(request.n)
        try:
            return await super().generate(request, adapter)
        finally:
            self.running -= request.n

    async def generate_many(self, requests: Sequence[GroupRequest], adapter: AdapterRef) -> list[Any]:
        seqs = sum(r.n for r in requests)
        self._enter(seqs)
        try:
            return await super().generate_many(requests, adapter)
        finally:
            self.running -= seqs


PROMPTS = [{"id": f"p{i}", "prompt": f"prompt {i}", "token_ids": [1 + i % 50, 2, 3]} for i in range(64)]


def constant(prompts: list[str], completions: list[str], **kw: Any) -> list[float]:
    return [float(len(c) % 3) for c in completions]


@pytest.mark.parametrize("K,B,n,evals", [(0, 3, 2, False), (1, 2, 3, False), (2, 4, 2, True)])
def test_no_run_holds_more_sequences_on_an_engine_than_its_graph_size(tmp_path: Path, K: int, B: int, n: int,
                                                                      evals: bool) -> None:
    """A slow trainer and a fast engine: admission fills every slot the staleness bound allows."""
    extra = {"eval.every": 2, "eval.max_prompts": 5, "eval.n": 3} if evals else {}
    cfg = sim_config(tmp_path, K=K, B=B, n=n, steps=6, latency=0.002, step_s=0.03, **extra)
    engine = Peak(cfg=cfg.engine.simulated, seed=0, name="peak-0")
    p = Pipeline(cfg, prompts=PROMPTS, eval_prompts=PROMPTS[:5] if evals else None, reward=constant,
                 tokenizer=False, console=False, engines=[engine])
    summary = p.run_sync()
    assert summary["accounting_ok"] and summary["steps"] == 6
    training = (K + 1) * B * n
    assert training <= engine.peak <= graph_sequences(cfg)


def test_a_model_path_without_a_tokenizer_is_refused_naming_it_once_the_engines_have_started(tmp_path: Path) -> None:
    """The tokenizer loads beside the engines' start; one that cannot load still ends the set-up with
    a ConfigError naming model.path, and the run's directory holds its summary."""
    from pipeline.errors import ConfigError

    import shutil

    from pipeline.models.builtin import build_model

    built = build_model("tiny", tmp_path / "cache", seed=0)
    model = tmp_path / "model"  # the tiny model's weights and config, without its tokenizer's files
    model.mkdir()
    for f in [built / "config.json", *built.glob("*.safetensors")]:
        shutil.copy(f, model)
    cfg = sim_config(tmp_path, steps=2, **{"model.path": str(model)})
    p = Pipeline(cfg, prompts=PROMPTS, reward=constant, console=False)
    with pytest.raises(ConfigError, match=r"^model\.path: no tokenizer could be loaded from .*model"):
        p.run_sync()


def test_without_torch_compile_engines_and_launched_servers_capture_whole_batch_graphs_only(tmp_path: Path) -> None:
    """engine.vllm.torch_compile = false reaches vLLM, in process and in `vllm serve`'s flags: no
    compile, whole-batch graphs (FULL) with LoRA's single set; eager engines are left eager."""
    import json

    from pipeline.engines.vllm import compilation_config

    for compiled in (True, False):
        cfg = load_config(None, {"engine.kind": "vllm", "engine.devices": ["cuda:0"],
                                 "engine.vllm.torch_compile": compiled})
        [engine] = build_engines(cfg, str(tmp_path), start_step=0)
        assert engine.cfg.torch_compile is compiled
        config = compilation_config(engine.cfg, lora=True)
        assert config["cudagraph_specialize_lora"] is False  # one graph per size, with LoRA
        assert (config.get("mode"), config.get("cudagraph_mode")) == ((None, None) if compiled else ("NONE", "FULL"))
        served = load_config(None, {"engine.kind": "vllm_server", "engine.vllm_server.launch": True,
                                    "engine.devices": ["cuda:0"], "engine.vllm.torch_compile": compiled})
        [server] = build_engines(served, str(tmp_path), start_step=0, run_dir=tmp_path)
        argv = server.server.argv
        assert json.loads(argv[argv.index("--compilation-config") + 1]) == config
    eager = load_config(None, {"engine.vllm.torch_compile": False, "engine.vllm.enforce_eager": True})
    assert compilation_config(eager.engine.vllm, lora=False) == {}  # no graphs to capture at all


@pytest.mark.parametrize("overrides, initialised", [
    ({"engine.kind": "vllm", "engine.devices": ["cuda:0"], "trainer.device": "cuda:0"}, False),  # one_gpu.toml
    ({"engine.kind": "vllm", "engine.devices": ["cuda:0"], "trainer.device": "cuda:0",
      "trainer.separate_process": False}, True),  # the trainer loads in a thread of this process
    ({"engine.kind": "transformers", "engine.devices": ["cuda:0"], "trainer.device": "cpu"}, True),
    ({"engine.kind": "vllm_server", "engine.vllm_server.urls": ["http://h:8000"], "trainer.device": "cuda:0"}, False),
    ({"engine.kind": "vllm", "engine.devices": ["cuda:0"], "trainer.kind": "simulated",
      "trainer.separate_process": False}, False),
])
def test_cuda_is_initialised_here_only_where_this_process_computes_on_a_gpu(
        overrides: dict[str, Any], initialised: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM engine core and a trainer process compute apart: this process then leaves CUDA alone,
    so vLLM can fork its engine core (engine.vllm.start_method = "fork")."""
    import torch

    from pipeline.loop import build

    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "init", lambda: calls.append(1))
    build.init_cuda(load_config(None, overrides))
    assert bool(calls) is initialised


def test_forking_the_engine_core_beside_a_trainer_in_this_process_is_refused() -> None:
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match='start_method = "fork" needs trainer.separate_process = true'):
        load_config(None, {"engine.kind": "vllm", "engine.devices": ["cuda:0"], "trainer.device": "cuda:0",
                           "trainer.separate_process": False, "engine.vllm.start_method": "fork"})
    load_config(None, {"engine.kind": "vllm", "engine.devices": ["cuda:0"], "trainer.device": "cuda:0",
                       "engine.vllm.start_method": "fork"})  # the trainer in its own process: fine
