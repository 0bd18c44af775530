"""Full-weight updates in the transformers and simulated engines: one version held, swapped whole.

Versions are the tiny model with every 2-d weight perturbed (a seed per version), saved with
`save_pretrained` and published through a full-weight AdapterStore, as the trainer publishes them.
The log-probs an engine returns are checked against a plain transformers forward of that model.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path
from typing import Any, Awaitable, Callable

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pipeline.models import builtin as models
from pipeline.store.weights import AdapterStore
from pipeline.config.schema import SimulatedEngineConfig, TransformersEngineConfig
from pipeline.engines.simulated import SimulatedEngine
from pipeline.engines.transformers import TransformersEngine
from pipeline.errors import AdapterError, EngineDeadError, GenerationError
from pipeline.types import AdapterRef, Generation
from test_engine_transformers import _request  # tests/ is on sys.path
from test_engine_transformers import _run as run_engine

# Each 2-d weight W gets W.std() * REL_STD * N(0, 1) added: far above float32 noise, so a
# version's log-probs are told apart from every other's by a wide margin.
REL_STD = 0.3
TIGHT = 1e-4  # engine vs recomputation in float32: the same weights give the same log-probs
APART = 0.05  # mean |dlogprob| between two different versions' weights on the same tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.build_model("tiny", tmp_path_factory.mktemp("models"))


def _perturbed(model_dir: Path, seed: int) -> torch.nn.Module:
    model = models.load_causal_lm(model_dir, "cpu", "float32")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * REL_STD)
    return model


@pytest.fixture(scope="module")
def versions(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[AdapterRef, Any]]:
    """version -> (its ref, its model): 0 the base, 1 one safetensors file, 2 sharded with an index."""
    store = AdapterStore(tmp_path_factory.mktemp("versions"), base_model=str(model_dir), kind="full")
    out: dict[int, tuple[AdapterRef, Any]] = {0: (AdapterRef.base(), models.load_causal_lm(model_dir, "cpu", "float32"))}
    for v, shard in [(1, None), (2, "100KB")]:
        model = _perturbed(model_dir, seed=1000 + v)
        kw = {} if shard is None else {"max_shard_size": shard}
        ref = store.publish(v, lambda d, m=model, kw=kw: m.save_pretrained(str(d), safe_serialization=True, **kw))
        out[v] = (ref, model)
    return out




def _run(model_dir: Path, body: Callable[[TransformersEngine], Awaitable[Any]], **kwargs: Any) -> Any:
    """test_engine_transformers' harness, with a full-weight engine."""
    return run_engine(model_dir, body, full_weights=True, **kwargs)


def _dlogprob(model: torch.nn.Module, gen: Generation) -> np.ndarray:
    """|engine log-prob - model's log-prob| of every sampled token of `gen`: [total tokens]."""
    prompt = list(gen.request.prompt.token_ids)
    recomputed = models.completion_logprobs(model, [prompt] * len(gen.completions),
                                            [c.token_ids.tolist() for c in gen.completions], "cpu")
    return np.concatenate([np.abs(r - c.logprobs) for r, c in zip(recomputed, gen.completions)])


def _assert_sampled_by(gen: Generation, version: int, versions: dict[int, tuple[AdapterRef, Any]]) -> None:
    assert gen.version == version
    assert _dlogprob(versions[version][1], gen).max() < TIGHT
    for other, (_, model) in versions.items():
        if other != version:
            assert _dlogprob(model, gen).mean() > APART, f"version {version}'s group also fits version {other}"


def test_published_versions_are_what_the_engine_must_read(versions: dict[int, tuple[AdapterRef, Any]]) -> None:
    # The fixture covers both layouts, and a tied lm_head that save_pretrained leaves out.
    one, sharded = Path(versions[1][0].path), Path(versions[2][0].path)
    with safe_open(str(one / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 1


def test_each_loaded_version_samples_with_its_own_weights(
        model_dir: Path, versions: dict[int, tuple[AdapterRef, Any]]) -> None:
    refs = {v: ref for v, (ref, _) in versions.items()}

    async def body(engine: TransformersEngine) -> dict[int, list[Generation]]:
        assert engine._peft is None  # no LoRA wrapper in full-weight mode
        gens: dict[int, list[Generation]] = {}
        for step, v in enumerate([1, 2, 0, 1]):  # version 0 after a newer one restores the base
            await engine.load_adapter(refs[v])
            assert engine.loaded_versions == (() if v == 0 else (v,))
            await engine.unload_adapter(refs[v])  # a no-op: the weights stay until the next load
            gens.setdefault(v, []).extend(await asyncio.gather(
                *(engine.generate(_request(10 * step + i, "w" * (1 + 2 * i), n=3), refs[v]) for i in range(2))))
        assert engine._peft is None
        return gens

    gens = _run(model_dir, body)
    for v, gs in gens.items():
        for gen in gs:
            _assert_sampled_by(gen, v, versions)


def test_a_version_other_than_the_one_held_is_refused(
        model_dir: Path, versions: dict[int, tuple[AdapterRef, Any]]) -> None:
    refs = {v: ref for v, (ref, _) in versions.items()}

    async def body(engine: TransformersEngine) -> None:
        with pytest.raises(GenerationError, match=r"version 0 \(base\).*asked for version 1"):
            await engine.generate(_request(0, "no"), refs[1])
        await engine.load_adapter(refs[2])
        for v in (0, 1):
            with pytest.raises(GenerationError, match=rf"version 2 .*asked for version {v}"):
                await engine.generate(_request(1, "no"), refs[v])
        # the same version number under another name is other weights (another run's version 2)
        with pytest.raises(GenerationError, match="asked for version 2"):
            await engine.generate(_request(2, "no"), AdapterRef(2, "v000002-otherrun", refs[2].path))
        assert engine.stats.requests == 0  # refused before they were accepted

    _run(model_dir, body)


def _corrupt_dirs(good: Path, tensors: dict[str, torch.Tensor], root: Path) -> list[tuple[Path, str]]:
    """Directories that are not a full-weight version of the tiny model, each with what is wrong.

    `good` is a version's directory (its config.json is copied); `tensors` are other weights than
    the engine holds, so a loader that copied anything before refusing would change its output.
    """

    def variant(name: str, change: Callable[[dict[str, torch.Tensor]], None] | None = None,
                config: bool = True) -> Path:
        d = root / name
        d.mkdir()
        if config:
            shutil.copy(good / "config.json", d / "config.json")
        if change is not None:
            t = dict(tensors)
            change(t)
            save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
        return d

    out = [(root / "missing", "does not exist"),
           (variant("no_config", lambda t: None, config=False), "no config.json"),
           (variant("no_weights"), "no safetensors"),
           (variant("wrong_shape", lambda t: t.update({"model.norm.weight": torch.ones(63)})), "shape"),
           (variant("missing_tensor", lambda t: t.pop("model.layers.1.mlp.down_proj.weight")),
            "lacks 1 .*down_proj"),
           (variant("extra_tensor", lambda t: t.update({"model.layers.9.extra.weight": torch.ones(2)})),
            "does not have"),
           (variant("tied_differ", lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1})),
            "tied"),
           (variant("not_float", lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int64)})),
            "int64")]
    truncated = variant("truncated", lambda t: None)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    out.append((truncated, "does not read as safetensors"))
    pickled = variant("pickle_only")  # torch.save's format: never read (unpickling can run code)
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x02}q\x00.")
    out.append((pickled, "no safetensors"))
    other_kind = variant("other_model_type", lambda t: None)
    config = json.loads((good / "config.json").read_text())
    (other_kind / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    out.append((other_kind, "'llama' model"))
    bad_index = variant("missing_shard", lambda t: None)
    (bad_index / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    out.append((bad_index, "names 'model-00002-of-00002.safetensors', which is missing"))
    return out


def test_a_corrupt_directory_is_refused_and_the_held_weights_serve_on(
        model_dir: Path, versions: dict[int, tuple[AdapterRef, Any]], tmp_path: Path) -> None:
    ref1 = versions[1][0]
    other = {k: v.detach().clone() for k, v in versions[2][1].state_dict().items() if k != "lm_head.weight"}
    bad = _corrupt_dirs(Path(ref1.path), other, tmp_path)
    probe = _request(0, "probe", n=2, max_new_tokens=8, seed=5)

    async def body(engine: TransformersEngine) -> list[Generation]:
        await engine.load_adapter(ref1)
        before = await engine.generate(probe, ref1)
        gens = [before]
        for i, (path, why) in enumerate(bad):
            ref = AdapterRef(version=3 + i, name=f"v{3 + i:06d}-{path.name}", path=str(path))
            with pytest.raises(AdapterError, match=re.escape(str(path)) + ".*" + why):
                await engine.load_adapter(ref)
            assert engine.loaded_versions == (1,), path.name
            with pytest.raises(GenerationError, match=f"asked for version {ref.version}"):
                await engine.generate(_request(1, "no"), ref)
            after = await engine.generate(probe, ref1)
            for a, b in zip(after.completions, before.completions):  # the same seed on the same weights
                assert np.array_equal(a.token_ids, b.token_ids) and np.array_equal(a.logprobs, b.logprobs), path.name
            gens.append(after)
        return gens

    for gen in _run(model_dir, body):
        _assert_sampled_by(gen, 1, versions)


def test_a_load_waits_for_queued_and_running_groups_of_the_held_version(
        model_dir: Path, versions: dict[int, tuple[AdapterRef, Any]]) -> None:
    ref1 = versions[1][0]

    async def body(engine: TransformersEngine) -> tuple[list[Generation], list[Generation]]:
        # one group per decoding batch: when the load comes, one group runs and three are queued,
        # not yet jobs on the worker
        old = [asyncio.create_task(engine.generate(_request(i, "old" * (i + 1), n=3, max_new_tokens=24),
                                                   AdapterRef.base())) for i in range(4)]
        await asyncio.sleep(0)
        assert len(engine._queue) + len(engine._running) == 4
        load = asyncio.create_task(engine.load_adapter(ref1))
        await asyncio.sleep(0)
        new = [asyncio.create_task(engine.generate(_request(10 + i, "new", n=3), ref1)) for i in range(2)]
        # while the swap waits, the outgoing version takes no new group
        with pytest.raises(GenerationError, match="loading version 1"):
            await engine.generate(_request(20, "late"), AdapterRef.base())
        await load
        assert all(t.done() for t in old)  # the load returned after every group it waited for
        assert engine.loaded_versions == (1,)
        return [t.result() for t in old], list(await asyncio.gather(*new))

    old, new = _run(model_dir, body, cfg=TransformersEngineConfig(max_batch_groups=1))
    for gen in old:
        _assert_sampled_by(gen, 0, versions)
    for gen in new:
        _assert_sampled_by(gen, 1, versions)


def test_a_failed_load_fails_the_groups_waiting_for_it(model_dir: Path, tmp_path: Path,
                                                      versions: dict[int, tuple[AdapterRef, Any]]) -> None:
    (tmp_path / "config.json").write_text((Path(versions[1][0].path) / "config.json").read_text())
    save_file({}, str(tmp_path / "model.safetensors"))  # reads fine, holds no tensor
    bad = AdapterRef(version=1, name="v000001-empty", path=str(tmp_path))

    async def body(engine: TransformersEngine) -> Generation:
        running = asyncio.create_task(engine.generate(_request(0, "run", max_new_tokens=16), AdapterRef.base()))
        await asyncio.sleep(0)
        load = asyncio.create_task(engine.load_adapter(bad))
        await asyncio.sleep(0)
        waiting = asyncio.create_task(engine.generate(_request(1, "wait"), bad))
        with pytest.raises(AdapterError, match="lacks"):
            await load
        with pytest.raises(GenerationError, match="did not load"):
            await waiting
        await running
        return await engine.generate(_request(2, "still base", n=3), AdapterRef.base())

    _assert_sampled_by(_run(model_dir, body), 0, versions)


# --------------------------------------------------------------------------- simulated engine


def _ref(v: int) -> AdapterRef:
    return AdapterRef.base() if v == 0 else AdapterRef(v, f"v{v:06d}-sim", f"/nowhere/v{v}")


def test_simulated_engine_serves_one_version_and_refuses_a_load_while_calls_run() -> None:
    async def main() -> None:
        engine = SimulatedEngine(SimulatedEngineConfig(latency_s=0.05, completion_tokens=4), full_weights=True)
        await engine.start()
        assert (await engine.generate(_request(0, "a"), _ref(0))).version == 0
        with pytest.raises(GenerationError, match=r"version 0 .*asked for version 1"):
            await engine.generate(_request(1, "a"), _ref(1))
        with pytest.raises(GenerationError, match=r"groups \[2, 3\] asked for version 1"):
            await engine.generate_many([_request(2, "a"), _request(3, "a")], _ref(1))

        await engine.load_adapter(_ref(1))
        assert engine.loaded_versions == {1}
        await engine.unload_adapter(_ref(1))  # a no-op
        assert engine.loaded_versions == {1}
        gens = await engine.generate_many([_request(4, "a"), _request(5, "a")], _ref(1))
        assert [g.version for g in gens] == [1, 1]
        with pytest.raises(GenerationError, match="asked for version 0"):
            await engine.generate(_request(6, "a"), _ref(0))

        # a load while a call samples would make that group straddle two versions: refused
        for call in (lambda: engine.generate(_request(7, "a"), _ref(1)),
                     lambda: engine.generate_many([_request(8, "a")], _ref(1))):
            running = asyncio.create_task(call())
            await asyncio.sleep(0.01)
            with pytest.raises(GenerationError, match="1 call.*drain"):
                await engine.load_adapter(_ref(2))
            await engine.load_adapter(_ref(1))  # the version held: nothing to do
            await running
        cancelled = asyncio.create_task(engine.generate(_request(9, "a"), _ref(1)))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        await engine.load_adapter(_ref(2))  # a cancelled call no longer runs
        assert (await engine.generate(_request(10, "a"), _ref(2))).version == 2
        await engine.close()
        with pytest.raises(EngineDeadError):
            await engine.load_adapter(_ref(3))
        with pytest.raises(EngineDeadError):
            await engine.generate(_request(11, "a"), _ref(2))

    asyncio.run(main())


def test_simulated_engine_without_full_weights_serves_any_version() -> None:
    async def main() -> None:
        engine = SimulatedEngine(SimulatedEngineConfig(latency_s=0.0, completion_tokens=4))
        await engine.start()
        assert (await engine.generate(_request(0, "a"), _ref(3))).version == 3
        await engine.load_adapter(_ref(5))
        gens = await engine.generate_many([_request(1, "a")], _ref(0))
        assert gens[0].version == 0 and engine.loaded_versions == {0, 3, 5}
        await engine.close()

    asyncio.run(main())


def test_simulated_engine_with_in_flight_swaps_takes_a_load_mid_call_and_names_it() -> None:
    """in_flight: a load while a call runs is taken; the call keeps the version it asked for as its label
    and names the newer one it ended on; a call for an older version than held is served, a newer one not."""
    async def main() -> None:
        engine = SimulatedEngine(SimulatedEngineConfig(latency_s=0.05, completion_tokens=4), full_weights=True,
                                 in_flight=True)
        await engine.start()
        await engine.load_adapter(_ref(1))
        running = asyncio.create_task(engine.generate(_request(0, "a"), _ref(1)))
        await asyncio.sleep(0.01)
        await engine.load_adapter(_ref(2))  # mid-call
        gen = await running
        assert (gen.version, gen.last_version, gen.spans_versions) == (1, 2, True)
        older = await engine.generate(_request(1, "a"), _ref(1))  # the serving version may lag the engine's
        assert (older.version, older.last_version) == (1, 2)
        same = (await engine.generate_many([_request(2, "a")], _ref(2)))[0]
        assert (same.version, same.last_version, same.spans_versions) == (2, 2, False)
        with pytest.raises(GenerationError, match="asked for version 3"):
            await engine.generate(_request(3, "a"), _ref(3))

    asyncio.run(main())
