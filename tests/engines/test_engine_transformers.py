"""Tests for pipeline.engines.transformers on a tiny CPU model built offline."""

from __future__ import annotations

import asyncio
import math
import os
import threading
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from pipeline.models import builtin as models
from pipeline.config.schema import SamplingConfig, TransformersEngineConfig
from pipeline.engines.base import Engine
from pipeline.engines.transformers import TransformersEngine, process_logits
from pipeline.errors import AdapterError, EngineDeadError, PromptError
from pipeline.types import AdapterRef, Generation, GroupRequest, Prompt

EOS = models.EOS_ID  # the tiny tokenizer's <|endoftext|>


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.build_model("tiny", tmp_path_factory.mktemp("models"))


def _make_adapter(model_dir: Path, out: Path, seed: int) -> Path:
    """A LoRA on every linear layer with non-zero lora_B, so it changes the model's outputs."""
    base = models.load_causal_lm(model_dir, "cpu", "float32")
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    peft_model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, AdapterRef]:
    root = tmp_path_factory.mktemp("adapters")
    return {v: AdapterRef(version=v, name=f"v{v:06d}-test", path=str(_make_adapter(model_dir, root / f"v{v}", seed=v)))
            for v in (1, 2, 3)}


def _request(group_id: int, text: str, n: int = 4, max_new_tokens: int = 12, seed: int | None = None) -> GroupRequest:
    ids = tuple(text.encode())  # the built-in tokenizer's ids are the bytes
    return GroupRequest(group_id=group_id, prompt=Prompt(id=f"p{group_id}", text=text, token_ids=ids), n=n,
                        max_new_tokens=max_new_tokens, seed=seed)


def _run(model_dir: Path, body: Callable[[TransformersEngine], Awaitable[Any]], **kwargs: Any) -> Any:
    kwargs.setdefault("sampling", SamplingConfig())
    kwargs.setdefault("cfg", TransformersEngineConfig())

    async def main() -> Any:
        engine = TransformersEngine(model_dir, **kwargs)
        await engine.start()
        try:
            return await body(engine)
        finally:
            await engine.close()

    return asyncio.run(main())


def _recompute(model: torch.nn.Module, gen: Generation) -> list[np.ndarray]:
    prompt = list(gen.request.prompt.token_ids)
    return models.completion_logprobs(model, [prompt] * len(gen.completions),
                                      [c.token_ids.tolist() for c in gen.completions], "cpu")


def _max_abs_diff(model: torch.nn.Module, gen: Generation) -> float:
    return max(float(np.abs(r - c.logprobs).max()) for r, c in zip(_recompute(model, gen), gen.completions))


def _adapted(model_dir: Path, adapter: AdapterRef) -> torch.nn.Module:
    base = models.load_causal_lm(model_dir, "cpu", "float32")
    return PeftModel.from_pretrained(base, adapter.path).eval()


def test_engine_satisfies_the_protocol(model_dir: Path) -> None:
    engine = TransformersEngine(model_dir, sampling=SamplingConfig(), cfg=TransformersEngineConfig())
    assert isinstance(engine, Engine)
    asyncio.run(engine.close())
    asyncio.run(engine.close())  # idempotent


def test_groups_have_n_completions_with_valid_lengths_and_finish_reasons(model_dir: Path) -> None:
    requests = [_request(0, "abc", n=3, max_new_tokens=5), _request(1, "hello there", n=5, max_new_tokens=9)]

    async def body(engine: TransformersEngine) -> list[Generation]:
        return await asyncio.gather(*(engine.generate(r, AdapterRef.base()) for r in requests))

    # Many end-of-sequence ids, so that both finish reasons occur.
    eos_ids = set(range(0, 128, 9))
    for gens, eos in [(_run(model_dir, body), {EOS}), (_run(model_dir, body, eos_token_ids=sorted(eos_ids)), eos_ids)]:
        reasons = set()
        for req, gen in zip(requests, gens):
            assert gen.request is req and gen.version == 0 and gen.engine == "transformers-0"
            assert len(gen.completions) == req.n
            assert gen.t_start <= gen.t_end
            for c in gen.completions:
                assert c.token_ids.dtype == np.int64 and c.logprobs.dtype == np.float32
                assert 1 <= len(c.token_ids) == len(c.logprobs) <= req.max_new_tokens
                assert np.all(np.isfinite(c.logprobs)) and np.all(c.logprobs <= 0)
                assert not any(int(t) in eos for t in c.token_ids[:-1])  # a row ends at its first eos
                if c.finish_reason == "stop":
                    assert int(c.token_ids[-1]) in eos  # the eos token is kept, with its log-prob
                else:
                    assert c.finish_reason == "length" and len(c.token_ids) == req.max_new_tokens
                reasons.add(c.finish_reason)
        if eos is eos_ids:
            assert reasons == {"stop", "length"}


def test_logprobs_match_recomputation_for_base_and_adapter(model_dir: Path, adapters: dict[int, AdapterRef]) -> None:
    async def body(engine: TransformersEngine) -> tuple[list[Generation], list[Generation]]:
        base = await asyncio.gather(*(engine.generate(_request(i, "x" * (1 + 3 * i), n=4), AdapterRef.base())
                                      for i in range(3)))
        await engine.load_adapter(adapters[1])
        lora = await asyncio.gather(*(engine.generate(_request(10 + i, "q" * (2 + i), n=4), adapters[1])
                                      for i in range(3)))
        return base, lora

    base_gens, lora_gens = _run(model_dir, body)
    base = models.load_causal_lm(model_dir, "cpu", "float32")
    for gen in base_gens:
        assert _max_abs_diff(base, gen) < 1e-4
    adapted = _adapted(model_dir, adapters[1])
    for gen in lora_gens:
        assert gen.version == 1
        assert _max_abs_diff(adapted, gen) < 1e-4
        assert _max_abs_diff(base, gen) > 1e-2  # the adapter really was applied


def test_concurrent_requests_are_batched_and_each_gets_its_own_group(model_dir: Path) -> None:
    requests = [_request(i, "batch" + "!" * i, n=2 + i % 3, max_new_tokens=4 + i) for i in range(6)]

    async def body(engine: TransformersEngine) -> tuple[list[Generation], int]:
        gens = await asyncio.gather(*(engine.generate(r, AdapterRef.base()) for r in requests))
        return gens, engine.stats.batches

    gens, batches = _run(model_dir, body)
    assert batches < len(requests)
    for req, gen in zip(requests, gens):
        assert gen.request is req and len(gen.completions) == req.n
        assert all(len(c.token_ids) <= req.max_new_tokens for c in gen.completions)


def test_same_seed_same_tokens_different_seed_different_tokens(model_dir: Path) -> None:
    async def body(engine: TransformersEngine) -> list[list[list[int]]]:
        out = []
        for gid, seed in enumerate([7, 7, 8, None, None]):
            gen = await engine.generate(_request(gid, "seed me", n=4, max_new_tokens=16, seed=seed), AdapterRef.base())
            out.append([c.token_ids.tolist() for c in gen.completions])
        return out

    same_a, same_b, other, free_a, free_b = _run(model_dir, body, eos_token_ids=[])
    assert same_a == same_b
    assert other != same_a
    assert free_a != free_b  # the engine's own generator moves on
    assert _run(model_dir, body, eos_token_ids=[])[3] == free_a  # ... from the same engine seed


def test_versions_have_their_own_logprobs_and_old_versions_still_serve(
    model_dir: Path, adapters: dict[int, AdapterRef]
) -> None:
    async def body(engine: TransformersEngine) -> list[Generation]:
        await engine.load_adapter(adapters[1])
        await engine.load_adapter(adapters[2])
        # Both versions asked for at once: each group must be sampled with its own version.
        return await asyncio.gather(*(engine.generate(_request(i, "versions", n=4), adapters[1 + i % 2])
                                      for i in range(4)))

    gens = _run(model_dir, body)
    v1, v2 = _adapted(model_dir, adapters[1]), _adapted(model_dir, adapters[2])
    for gen in gens:
        own, other = (v1, v2) if gen.version == 1 else (v2, v1)
        assert _max_abs_diff(own, gen) < 1e-4
        diffs = np.concatenate([np.abs(r - c.logprobs) for r, c in zip(_recompute(other, gen), gen.completions)])
        assert diffs.mean() > 0.05  # a clear margin: the other version's log-probs are not these
    assert sorted(g.version for g in gens) == [1, 1, 2, 2]


def test_cancelling_queued_and_running_requests(model_dir: Path, adapters: dict[int, AdapterRef]) -> None:
    long_req = _request(0, "long", n=8, max_new_tokens=480)

    async def body(engine: TransformersEngine) -> None:
        running = asyncio.create_task(engine.generate(long_req, AdapterRef.base()))
        while engine.stats.tokens_generated == 0:
            await asyncio.sleep(0.005)
        queued = asyncio.create_task(engine.generate(_request(1, "queued"), AdapterRef.base()))
        await asyncio.sleep(0.02)
        assert not queued.done()  # waits behind the running batch
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert engine.stats.cancelled == 1
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert engine.stats.cancelled == 2
        after = await engine.generate(_request(2, "after", n=3, max_new_tokens=5), AdapterRef.base())
        assert len(after.completions) == 3
        # The cancelled request stopped early: far fewer tokens than its 8 x 480.
        assert engine.stats.tokens_generated < long_req.n * long_req.max_new_tokens / 2
        assert engine.stats.batches == 2  # the queued request never ran

    _run(model_dir, body, eos_token_ids=[])


def test_bad_adapter_directories_are_refused_with_their_path(
    model_dir: Path, adapters: dict[int, AdapterRef], tmp_path: Path
) -> None:
    missing = tmp_path / "missing"
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    (no_config / "adapter_model.safetensors").write_bytes(b"x")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_text((Path(adapters[1].path) / "adapter_config.json").read_text())
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text((Path(adapters[1].path) / "adapter_config.json").read_text())
    (corrupt / "adapter_model.safetensors").write_bytes(b"not a safetensors file" * 8)

    async def body(engine: TransformersEngine) -> Generation:
        for v, path in enumerate([missing, no_config, no_weights, corrupt], start=5):
            ref = AdapterRef(version=v, name=f"bad{v}", path=str(path))
            with pytest.raises(AdapterError, match=str(path)):
                await engine.load_adapter(ref)
            with pytest.raises(AdapterError, match=str(path)):
                await engine.generate(_request(v, "bad"), ref)
            assert v not in engine.loaded_versions
        with pytest.raises(AdapterError, match="no path"):
            await engine.load_adapter(AdapterRef(version=9, name="nopath", path=None))
        # The engine still serves the base model and good adapters, with the right weights.
        assert len((await engine.generate(_request(1, "fine"), AdapterRef.base())).completions) == 4
        return await engine.generate(_request(2, "fine"), adapters[1])

    gen = _run(model_dir, body)
    assert _max_abs_diff(_adapted(model_dir, adapters[1]), gen) < 1e-4


def test_same_version_number_from_another_run_is_another_adapter(
        model_dir: Path, adapters: dict[int, AdapterRef]) -> None:
    # One engine serving two runs in turn: version 1 of the second run is not version 1 of the first.
    async def body(engine: TransformersEngine) -> tuple[Generation, Generation]:
        await engine.load_adapter(adapters[1])
        other = AdapterRef(version=1, name="v000001-otherrun", path=adapters[2].path)
        # both at once: each group samples with its own adapter, though their version numbers agree
        gens = await asyncio.gather(engine.generate(_request(0, "other run"), other),
                                    engine.generate(_request(1, "first run"), adapters[1]))
        assert engine.loaded_versions == (1, 1)
        return gens[0], gens[1]

    gen_other, gen_first = _run(model_dir, body)
    assert _max_abs_diff(_adapted(model_dir, adapters[2]), gen_other) < 1e-4
    assert _max_abs_diff(_adapted(model_dir, adapters[1]), gen_first) < 1e-4


def test_eviction_keeps_at_most_max_loaded_adapters(model_dir: Path, adapters: dict[int, AdapterRef]) -> None:
    async def body(engine: TransformersEngine) -> tuple[Generation, Generation]:
        await engine.load_adapter(adapters[1])
        await engine.load_adapter(adapters[2])
        assert engine.loaded_versions == (1, 2)
        await engine.load_adapter(adapters[3])
        assert engine.loaded_versions == (2, 3)  # the oldest unused version went
        await engine.generate(_request(0, "evict"), adapters[1])  # loads 1 again, evicting 2
        assert engine.loaded_versions == (1, 3)
        await engine.unload_adapter(adapters[3])
        await engine.unload_adapter(AdapterRef(version=42, name="v000042-unknown", path="/nowhere"))  # ignored
        await engine.unload_adapter(AdapterRef(version=1, name="v000001-another-run", path="/nowhere"))  # not ours
        assert engine.loaded_versions == (1,)
        # Versions in use are never evicted: the bound is exceeded instead, and restored afterwards.
        running = asyncio.create_task(engine.generate(_request(1, "in use", n=4, max_new_tokens=120), adapters[1]))
        while engine.stats.tokens_generated < 40:
            await asyncio.sleep(0.005)
        waiting = asyncio.create_task(engine.generate(_request(2, "waits", n=2, max_new_tokens=4), adapters[2]))
        loading = asyncio.create_task(engine.load_adapter(adapters[3]))
        await asyncio.sleep(0)
        assert engine.loaded_versions == (1, 2, 3)
        gens = await asyncio.gather(running, waiting, loading)
        assert engine.loaded_versions == (2, 3)
        return gens[0], gens[1]

    gen1, gen2 = _run(model_dir, body, max_loaded_adapters=2, eos_token_ids=[])
    assert (gen1.version, gen2.version) == (1, 2)
    # Each group finished on the version it started on.
    assert _max_abs_diff(_adapted(model_dir, adapters[1]), gen1) < 1e-4
    assert _max_abs_diff(_adapted(model_dir, adapters[2]), gen2) < 1e-4


def test_top_k_1_samples_greedily_with_logprob_zero(model_dir: Path) -> None:
    async def body(engine: TransformersEngine) -> Generation:
        return await engine.generate(_request(0, "greedy", n=3, max_new_tokens=10), AdapterRef.base())

    gen = _run(model_dir, body, sampling=SamplingConfig(top_k=1), eos_token_ids=[])
    model = models.load_causal_lm(model_dir, "cpu", "float32")
    prompt = list(gen.request.prompt.token_ids)
    for c in gen.completions:
        assert np.all(c.logprobs == 0.0)  # the processed distribution has one token
        assert c.token_ids.tolist() == gen.completions[0].token_ids.tolist()
        seq = prompt + c.token_ids.tolist()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq])).logits[0]
        assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == c.token_ids.tolist()


def test_process_logits_truncations() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    assert torch.allclose(process_logits(logits, SamplingConfig()), logits, atol=1e-6)
    kept_two = torch.tensor([[0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]])
    assert torch.allclose(process_logits(logits, SamplingConfig(top_p=0.7)).exp(), kept_two, atol=1e-6)
    assert torch.allclose(process_logits(logits, SamplingConfig(min_p=0.5)).exp(), kept_two, atol=1e-6)
    assert torch.allclose(process_logits(logits, SamplingConfig(top_k=2)).exp(), kept_two, atol=1e-6)
    hot = process_logits(logits, SamplingConfig(temperature=2.0)).exp()
    assert torch.allclose(hot, probs.sqrt() / probs.sqrt().sum(), atol=1e-6)
    assert math.isinf(float(process_logits(logits, SamplingConfig(top_k=1))[0, 1]))


def test_refusals_and_closed_engine(model_dir: Path) -> None:
    async def body(engine: TransformersEngine) -> TransformersEngine:
        with pytest.raises(PromptError, match="no tokens"):
            await engine.generate(_request(0, ""), AdapterRef.base())
        with pytest.raises(PromptError, match="positions"):
            await engine.generate(_request(1, "x" * 10, max_new_tokens=510), AdapterRef.base())
        pending = asyncio.create_task(engine.generate(_request(2, "closing", max_new_tokens=400), AdapterRef.base()))
        await asyncio.sleep(0.01)
        await engine.close()
        with pytest.raises(EngineDeadError):
            await pending
        return engine

    engine = _run(model_dir, body, eos_token_ids=[])
    with pytest.raises(EngineDeadError, match="closed"):
        asyncio.run(engine.generate(_request(3, "late"), AdapterRef.base()))


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
@pytest.mark.parametrize("idle", [True, False])
def test_the_torch_thread_on_the_cpu_is_idle_scheduled_and_the_loop_is_not(model_dir: Path, idle: bool) -> None:
    # the event loop must take the core at once when it wakes (loop lag), so the CPU-bound thread
    # beside it is SCHED_IDLE; the loop's own thread keeps the normal policy
    async def body(engine: TransformersEngine) -> tuple[int, int]:
        [thread] = [t for t in threading.enumerate() if t.name.startswith(f"{engine.name}-torch")]
        return os.sched_getscheduler(thread.native_id), os.sched_getscheduler(0)

    torch_policy, loop_policy = _run(model_dir, body, cfg=TransformersEngineConfig(sched_idle=idle))
    assert torch_policy == (os.SCHED_IDLE if idle else os.SCHED_OTHER)
    assert loop_policy == os.SCHED_OTHER



async def _load_and_sample(engine: TransformersEngine, refs: dict[int, AdapterRef], order: Sequence[int],
                           label: str) -> tuple[dict[int, Generation], list[int]]:
    """Load each version of `order` in turn and sample a group with it: the generations by version,
    and how many peft adapters the engine held after each load."""
    gens, slots = {}, []
    for v in order:
        await engine.load_adapter(refs[v])
        slots.append(len(engine._peft.peft_config))
        gens[v] = await engine.generate(_request(v, f"{label} {v}", n=4), refs[v])
    return gens, slots


def test_a_version_fills_the_slot_of_an_unloaded_one_and_samples_from_its_own_weights(
        model_dir: Path, adapters: dict[int, AdapterRef], tmp_path: Path) -> None:
    """With one adapter resident, every load after the first overwrites the freed peft adapter in
    place (no new one injected); each version still samples with exactly its own weights, and a
    file whose tensors do not fit is refused with the slot left free and usable."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(adapters[3].path, bad)
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    first = sorted(tensors)[0]
    tensors[first] = torch.zeros(tensors[first].shape[0] + 1, tensors[first].shape[1])  # same config, wrong shape
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    bad_ref = AdapterRef(version=9, name="v000009-bad", path=str(bad))
    nan = tmp_path / "nan"  # right names and shapes, one value not finite
    shutil.copytree(adapters[3].path, nan)
    tensors = load_file(str(nan / "adapter_model.safetensors"))
    last = sorted(tensors)[-1]
    tensors[last][0, 0] = float("nan")
    save_file(tensors, str(nan / "adapter_model.safetensors"))
    nan_ref = AdapterRef(version=10, name="v000010-nan", path=str(nan))

    async def body(engine: TransformersEngine) -> tuple[dict[int, Generation], list[int], str, str]:
        gens, slots = await _load_and_sample(engine, adapters, (1, 2, 3, 1), "slot")
        await engine.unload_adapter(adapters[1])
        with pytest.raises(AdapterError) as e:
            await engine.load_adapter(bad_ref)
        with pytest.raises(AdapterError) as e_nan:
            await engine.load_adapter(nan_ref)
        gens[2] = await engine.generate(_request(20, "after the refusal", n=4), adapters[2])  # the free slot serves again
        slots.append(len(engine._peft.peft_config))
        return gens, slots, str(e.value), str(e_nan.value)

    gens, slots, error, nan_error = _run(model_dir, body, max_loaded_adapters=1)
    assert slots == [1, 1, 1, 1, 1]  # one peft adapter throughout, refilled in place
    assert "does not hold the tensors" in error and "bad" in error
    assert "does not hold the tensors" in nan_error and last in nan_error
    for v, gen in gens.items():
        assert gen.version == v
        assert _max_abs_diff(_adapted(model_dir, adapters[v]), gen) < 1e-4
    assert _max_abs_diff(_adapted(model_dir, adapters[1]), gens[2]) > 1e-2  # not the previous occupant's weights


async def _until_decoding(engine: TransformersEngine, task: asyncio.Task[Generation]) -> None:
    """Until `task`'s batch has sampled tokens (the only one running)."""
    before = engine.stats.tokens_generated
    while engine.stats.tokens_generated == before:
        assert not task.done()
        await asyncio.sleep(0.002)


def test_a_version_loads_between_forward_passes_of_a_batch_on_another(
        model_dir: Path, adapters: dict[int, AdapterRef]) -> None:
    """A load that fills a free slot does not wait for a running batch on another version to end,
    and that batch samples exactly as it does alone; a load that peft must inject waits for its end."""
    long = _request(1, "a long batch", n=8, max_new_tokens=300, seed=7)

    async def body(engine: TransformersEngine) -> dict[str, Any]:
        await engine.load_adapter(adapters[1])
        await engine.load_adapter(adapters[2])
        await engine.unload_adapter(adapters[1])  # its slot is free: version 3's load fills it
        running = asyncio.create_task(engine.generate(long, adapters[2]))
        await _until_decoding(engine, running)
        await engine.load_adapter(adapters[3])
        filled_while_running = not running.done()
        beside = await running
        three = await engine.generate(_request(3, "version three", n=4), adapters[3])
        alone = await engine.generate(long, adapters[2])
        await engine.unload_adapter(adapters[3])
        await engine.unload_adapter(adapters[2])
        running = asyncio.create_task(engine.generate(long, adapters[2]))  # reloads 2 into a free slot
        await _until_decoding(engine, running)
        # 1 and 2 fill the two free slots; a third version has none left and peft injects one
        await engine.load_adapter(adapters[1])
        await engine.load_adapter(adapters[3])
        injected_after_the_batch = running.done()
        await running
        return {"filled_while_running": filled_while_running, "beside": beside, "alone": alone, "three": three,
                "injected_after_the_batch": injected_after_the_batch, "slots": len(engine._peft.peft_config)}

    r = _run(model_dir, body, max_loaded_adapters=3, eos_token_ids=[])
    assert r["filled_while_running"]
    for b, a in zip(r["beside"].completions, r["alone"].completions, strict=True):
        assert len(b.token_ids) == 300
        np.testing.assert_array_equal(b.token_ids, a.token_ids)
        np.testing.assert_array_equal(b.logprobs, a.logprobs)
    assert _max_abs_diff(_adapted(model_dir, adapters[3]), r["three"]) < 1e-4  # the slot holds version 3 whole
    assert r["injected_after_the_batch"] and r["slots"] == 3


def test_closing_with_a_load_queued_behind_a_batch_ends_the_load_and_restarts_clean(
        model_dir: Path, adapters: dict[int, AdapterRef]) -> None:
    """A load that waits for a running batch's end (no free slot) does not outlive close(): its
    caller gets an error, nothing hangs, and a restart loads and samples that version afresh."""
    long = _request(1, "a long batch", n=8, max_new_tokens=300, seed=7)

    async def body(engine: TransformersEngine) -> tuple[BaseException | None, Generation]:
        await engine.load_adapter(adapters[1])
        running = asyncio.create_task(engine.generate(long, adapters[1]))
        await _until_decoding(engine, running)
        load = asyncio.create_task(engine.load_adapter(adapters[2]))  # peft must inject: after the batch
        await asyncio.sleep(0.02)
        assert not load.done()
        await asyncio.wait_for(engine.close(), timeout=30)
        error = (await asyncio.gather(asyncio.wait_for(load, timeout=30), return_exceptions=True))[0]
        await asyncio.gather(running, return_exceptions=True)
        await engine.start()
        await engine.load_adapter(adapters[2])
        return error, await engine.generate(_request(2, "after the restart", n=4), adapters[2])

    error, gen = _run(model_dir, body, max_loaded_adapters=3, eos_token_ids=[])
    assert isinstance(error, (asyncio.CancelledError, EngineDeadError)), error
    assert _max_abs_diff(_adapted(model_dir, adapters[2]), gen) < 1e-4


def _in_memory(adapter: AdapterRef) -> AdapterRef:
    """`adapter` as trainer.publish = "memory" hands it over: its two files' contents as a payload."""
    from safetensors.torch import load_file

    from pipeline.engines.shared_weights import adapter_payload

    path = Path(adapter.path)
    payload = adapter_payload(adapter.version, load_file(str(path / "adapter_model.safetensors")),
                              (path / "adapter_config.json").read_bytes())
    return AdapterRef.in_memory(adapter.version, payload)


def test_versions_handed_over_in_memory_sample_as_their_directories_do(
        model_dir: Path, adapters: dict[int, AdapterRef]) -> None:
    """trainer.publish = "memory" with LoRA: the first version injects peft's layers from its payload,
    later ones fill the freed slot from theirs; each samples with exactly its own weights, and a
    payload changed on its way is refused with the slot left free and usable."""
    refs = {v: _in_memory(a) for v, a in adapters.items()}
    payload = dict(refs[3].shared)
    payload["tensors"] = {k: dict(t) for k, t in payload["tensors"].items()}
    first = sorted(payload["tensors"])[0]
    payload["tensors"][first]["data"] = bytes(len(payload["tensors"][first]["data"]))  # zeros, same size
    tampered = AdapterRef(version=9, name="v000009-memtampered", path=None, sha256=refs[3].sha256, shared=payload)

    async def body(engine: TransformersEngine) -> tuple[dict[int, Generation], list[int], str]:
        gens, slots = await _load_and_sample(engine, refs, (1, 2, 3), "memory")
        await engine.unload_adapter(refs[3])
        with pytest.raises(AdapterError) as e:
            await engine.load_adapter(tampered)
        await engine.load_adapter(refs[1])  # the free slot serves again
        gens[1] = await engine.generate(_request(10, "after the refusal", n=4), refs[1])
        return gens, slots, str(e.value)

    gens, slots, error = _run(model_dir, body, max_loaded_adapters=1)
    assert slots == [1, 1, 1]  # injected once from a payload, then refilled in place
    assert "version 9" in error and "in memory" in error and "changed on its way" in error
    for v, gen in gens.items():
        assert gen.version == v
        assert _max_abs_diff(_adapted(model_dir, adapters[v]), gen) < 1e-4
    assert _max_abs_diff(_adapted(model_dir, adapters[2]), gens[3]) > 1e-2
