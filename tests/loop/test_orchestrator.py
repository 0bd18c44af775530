"""The Pipeline's invariants, with the simulated engine and trainer (fast, no model)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time

import numpy as np
import pytest
from conftest import assert_accounted, sim_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config.io import load_config
from pipeline.errors import ConfigError
from pipeline.observe.metrics import read_jsonl
from pipeline.loop.orchestrator import Pipeline
from pipeline.data.prompts import PromptBuilder
from pipeline.store.rollout_log import read_rollouts
from pipeline.loop.rotation import settled as _settled

PROMPTS = [{"id": f"p{i}", "prompt": f"prompt {i}", "token_ids": [1 + i % 50, 2, 3], "label": i} for i in range(40)]


def length_reward(prompts, completions, completion_ids, label, **kw):
    return [float(len(ids) + lab % 3) for ids, lab in zip(completion_ids, label)]


def run(cfg, **kw):
    p = Pipeline(cfg, prompts=kw.pop("prompts", PROMPTS), reward=kw.pop("reward", length_reward),
                 tokenizer=False, console=False, **kw)
    summary = p.run_sync()
    return p, summary


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(K=st.integers(0, 4), B=st.integers(1, 3), latency=st.sampled_from([0.0, 0.001, 0.004]),
       concurrency=st.sampled_from([0, 1, 3]), step_s=st.sampled_from([0.0, 0.002, 0.006]))
def test_every_trained_group_is_at_most_max_staleness_old(tmp_path_factory, K, B, latency, concurrency, step_s):
    tmp = tmp_path_factory.mktemp("prop")
    p, summary = run(sim_config(tmp, K=K, B=B, steps=8, latency=latency, concurrency=concurrency, step_s=step_s))
    r = assert_accounted(p, summary)
    stal = r.staleness()
    assert len(stal) == 8 * B
    assert stal.min() >= 0 and stal.max() <= K
    rows = read_jsonl(p.run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, 9))
    assert max(row["staleness_max"] for row in rows) <= K


def test_max_staleness_zero_serialises_generation_and_training(tmp_path):
    p, summary = run(sim_config(tmp_path, K=0, B=3, steps=6, latency=0.01, step_s=0.01))
    assert_accounted(p, summary)
    gens, trains = p.timeline["generation"], p.timeline["training"]
    assert 6 <= len(gens) <= 18 and len(trains) == 6  # a span per engine call, of 1 to B = 3 groups
    for gs, ge in gens:
        for ts, te in trains:
            assert ge <= ts or gs >= te, f"generation {gs, ge} overlaps training {ts, te}"


def test_max_staleness_one_overlaps_generation_and_training(tmp_path):
    # the counterpart of the test above: with K >= 1 the two tiers do run at the same time
    p, summary = run(sim_config(tmp_path, K=1, B=3, steps=6, latency=0.01, step_s=0.02))
    overlaps = sum(1 for gs, ge in p.timeline["generation"] for ts, te in p.timeline["training"]
                   if gs < te and ge > ts)
    assert overlaps > 0


def test_the_trainer_keeps_a_version_only_when_a_check_may_look_back_at_it(tmp_path, monkeypatch):
    # checks at steps 1, 6 and 11; with K=2 a check at step s may meet groups of versions s-3 and
    # s-2, which steps s-2 and s-1 train from: only steps 4, 5, 9 and 10 keep their version
    from pipeline.trainer.simulated import SimulatedTrainer

    seen: dict[int, bool] = {}
    step = SimulatedTrainer.step

    def spy(self, batch):
        seen[batch.step] = batch.keep_version
        return step(self, batch)

    monkeypatch.setattr(SimulatedTrainer, "step", spy)
    p, summary = run(sim_config(tmp_path, K=2, steps=12, **{"pipeline.logprob_check_every": 5}))
    assert_accounted(p, summary)
    assert sorted(s for s, keep in seen.items() if keep) == [4, 5, 9, 10] and len(seen) == 12
    checked = [r["step"] for r in read_jsonl(p.run_dir / "metrics.jsonl") if "check/mean_abs_diff" in r]
    assert checked == [1, 6, 11]


def test_reward_that_raises_fails_its_group_and_the_run_goes_on(tmp_path):
    def flaky(prompts, completions, label, **kw):
        if label[0] % 4 == 0:
            raise ZeroDivisionError("bad label")
        return [1.0] * len(prompts)

    p, summary = run(sim_config(tmp_path, steps=5), reward=flaky)
    assert summary["steps"] == 5
    assert summary["groups_failed"].get("reward_error", 0) >= 1
    r = assert_accounted(p, summary)
    failed = [i for i in range(r.num_groups) if r.groups["fate"][i] == "failed"]
    assert all(r.groups["reason"][i] == "reward_error" for i in failed)
    # what the engine produced for a failed group is kept
    assert all(len(r.group(i)["completions"]) == 2 for i in failed)
    events = [json.loads(x) for x in (p.run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "group_failed" and "ZeroDivisionError" in e.get("error", "") for e in events)


def test_reward_that_returns_nan_or_the_wrong_count_fails_the_group(tmp_path):
    def bad(prompts, completions, label, **kw):
        if label[0] % 2:
            return [math.nan] * len(prompts)
        return [1.0]  # wrong length for n=2

    cfg = sim_config(tmp_path, steps=1, B=1)
    p = Pipeline(cfg, prompts=PROMPTS, reward=bad, tokenizer=False, console=False)
    with pytest.raises(Exception, match="groups failed in a row"):
        p.run_sync()
    assert p.summary["accounting_ok"]
    assert p.summary["groups_failed"]["reward_error"] >= 64


def test_async_reward_and_async_step_iterator(tmp_path):
    async def slow_reward(prompts, completions, **kw):
        await asyncio.sleep(0.001)
        return [0.5] * len(prompts)

    async def main():
        p = Pipeline(sim_config(tmp_path, steps=4), prompts=PROMPTS, reward=slow_reward, tokenizer=False,
                     console=False)
        seen = [r.step async for r in p.steps()]
        return p, seen

    p, seen = asyncio.run(main())
    assert seen == [1, 2, 3, 4]
    assert_accounted(p, p.summary)


def test_leaving_the_step_iterator_early_shuts_down_cleanly(tmp_path):
    async def main():
        p = Pipeline(sim_config(tmp_path, steps=50, latency=0.002), prompts=PROMPTS, reward=length_reward,
                     tokenizer=False, console=False)
        async for r in p.steps():
            if r.step == 3:
                break
        return p

    p = asyncio.run(main())
    assert p.summary["steps"] == 3 and p.summary["cancelled"]
    r = assert_accounted(p, p.summary)
    assert (r.groups["reason"] == "shutdown").sum() == sum(p.summary["groups_dropped"].values())


def test_cancelling_a_run_keeps_everything_produced(tmp_path):
    async def main():
        p = Pipeline(sim_config(tmp_path, steps=1000, latency=0.002, step_s=0.002), prompts=PROMPTS,
                     reward=length_reward, tokenizer=False, console=False)
        task = asyncio.create_task(p.run())
        while len(p.metrics_rows) < 5:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return p

    p = asyncio.run(main())
    assert 0 < p.summary["steps"] < 1000
    assert_accounted(p, p.summary)
    assert (p.run_dir / "summary.json").exists() and (p.run_dir / "metrics.jsonl").exists()
    assert not [t for t in p.supervisor.tasks if not t.done()]


def test_malformed_prompts_are_refused_one_by_one(tmp_path):
    prompts = [{"id": "empty", "prompt": "", "token_ids": []}, {"no_prompt": 1}] + PROMPTS
    p, summary = run(sim_config(tmp_path, steps=25), prompts=prompts)
    assert summary["prompts_refused"] >= 2 and summary["steps"] == 25
    events = [json.loads(x) for x in (p.run_dir / "events.jsonl").read_text().splitlines()]
    reasons = [e["reason"] for e in events if e["event"] == "prompt_refused"]
    assert any("'empty' is empty" in r for r in reasons)


def test_refusals_are_logged_a_few_times_per_reason_and_all_counted(tmp_path):
    # three empty prompts among eight good ones, drawn again every epoch (about eight epochs here)
    prompts = [{"id": f"empty{i}", "prompt": "", "token_ids": []} for i in range(3)] + PROMPTS[:8]
    p, summary = run(sim_config(tmp_path, steps=40), prompts=prompts)
    assert summary["steps"] == 40
    assert summary["prompts_refused"] >= 15
    events = [json.loads(x) for x in (p.run_dir / "events.jsonl").read_text().splitlines()]
    refused = [e for e in events if e["event"] == "prompt_refused"]
    assert 1 <= len(refused) <= 3 and {e["kind"] for e in refused} == {"empty"}
    (counted,) = [e for e in events if e["event"] == "prompts_refused"]
    assert counted["by_reason"] == {"empty": summary["prompts_refused"]}


def test_a_source_whose_every_prompt_is_refused_is_a_config_error_and_the_loop_stays_responsive(tmp_path):
    # 2,000 distinct items, every one refused: the run stops with the reasons, and while it refuses
    # them the admission loop yields to the event loop (a loop that never awaits starves signal handlers)
    prompts = [{"id": f"e{i}", "prompt": "", "token_ids": []} for i in range(1500)]
    prompts += [{"id": f"bad{i}"} for i in range(500)]
    p = Pipeline(sim_config(tmp_path), prompts=prompts, reward=length_reward, tokenizer=False, console=False)
    ticks = 0
    result: list[BaseException] = []

    async def main():
        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.create_task(ticker())
        try:
            async for _ in p.steps():
                pass
        except ConfigError as e:
            result.append(e)
        finally:
            t.cancel()

    import threading  # a thread with a deadline: a loop that never yields would hang the test, not fail it

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the run neither ended nor yielded"
    (error,) = result
    assert "every prompt of the data set was refused" in str(error)
    assert "2000 of 2000" in str(error) and "empty: 1500" in str(error) and "malformed: 500" in str(error)
    assert ticks >= 1000  # the ticker ran while the prompts were refused


def test_a_failed_start_lets_the_others_finish_before_shutdown_closes_them(tmp_path, monkeypatch):
    # closing a trainer still starting raced its start (a ProcessTrainer's close then failed in its own
    # way, hiding the engine's error), and whichever start failed first varied from run to run
    import time

    from pipeline.engines.simulated import SimulatedEngine
    from pipeline.trainer.simulated import SimulatedTrainer

    calls: list[str] = []

    async def start(self):
        raise RuntimeError("the engine cannot start")

    def setup(self):
        time.sleep(0.3)
        calls.append("setup done")

    monkeypatch.setattr(SimulatedEngine, "start", start)
    monkeypatch.setattr(SimulatedTrainer, "setup", setup)
    monkeypatch.setattr(SimulatedTrainer, "close", lambda self: calls.append("close"))
    with pytest.raises(RuntimeError, match="the engine cannot start"):
        run(sim_config(tmp_path))
    assert calls == ["setup done", "close"]


def test_numpy_token_ids_become_ints_and_fractional_ones_are_refused(tmp_path):
    """Ids from a numpy or pandas data set reach engines as plain ints (vLLM cannot serialise numpy's)."""
    prompts = [{"id": f"np{i}", "prompt": "", "token_ids": np.array([1 + i, 2, 3], dtype=np.int64), "label": i}
               for i in range(8)]
    prompts.append({"id": "frac", "prompt": "", "token_ids": [1.5, 2.0], "label": 0})
    p, summary = run(sim_config(tmp_path, steps=4), prompts=prompts)
    assert summary["steps"] == 4 and summary["prompts_refused"] >= 1
    prompt = p.admitter.builder.build(prompts[0])
    assert prompt.token_ids == (1, 2, 3) and all(type(t) is int for t in prompt.token_ids)
    events = [json.loads(x) for x in (p.run_dir / "events.jsonl").read_text().splitlines()]
    assert any("'frac': token_ids must be integers" in e.get("reason", "") for e in events
               if e["event"] == "prompt_refused")


class CountingTokenizer:
    """Text to ids (one per character) and back, counting how often each text is tokenized."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        self.calls[text] = self.calls.get(text, 0) + 1
        return {"input_ids": [1 + ord(c) % 50 for c in text]}

    def batch_decode(self, ids: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return ["x" * len(x) for x in ids]


def test_each_item_becomes_a_prompt_once_however_often_the_stream_draws_it(tmp_path, monkeypatch):
    items = [{"id": f"t{i}", "prompt": f"text {i}", "label": i} for i in range(4)]
    tok = CountingTokenizer()
    p = Pipeline(sim_config(tmp_path, steps=12, B=2), prompts=items, reward=length_reward, tokenizer=tok,
                 console=False)
    converted: list[str] = []
    build = PromptBuilder.build
    monkeypatch.setattr(PromptBuilder, "build", lambda self, item: converted.append(item["id"]) or build(self, item))
    summary = p.run_sync()
    assert summary["steps"] == 12 and summary["groups_started"] >= 24  # six passes over the four items
    assert sorted(converted) == ["t0", "t1", "t2", "t3"]
    assert tok.calls == {f"text {i}": 1 for i in range(4)}
    r = read_rollouts(p.run_dir / "rollouts.zarr")
    assert sorted(set(r.groups["prompt_id"].tolist())) == ["t0", "t1", "t2", "t3"]


def test_a_large_wave_is_decoded_off_the_event_loop(tmp_path, monkeypatch):
    import threading

    import pipeline.loop.scoring as scoring

    class ThreadTokenizer(CountingTokenizer):
        def __init__(self) -> None:
            super().__init__()
            self.threads: set[int] = set()

        def batch_decode(self, ids, skip_special_tokens=True):
            self.threads.add(threading.get_ident())
            return super().batch_decode(ids, skip_special_tokens)

    seen: list[str] = []

    def text_reward(prompts, completions, **kw):
        seen.extend(completions)
        return [float(len(c)) for c in completions]

    items = [{"id": f"t{i}", "prompt": f"text {i}", "label": i} for i in range(4)]
    monkeypatch.setattr(scoring, "DECODE_OFF_LOOP_TOKENS", 1)  # every wave counts as large
    tok = ThreadTokenizer()
    p = Pipeline(sim_config(tmp_path, steps=3, B=2), prompts=items, reward=text_reward, tokenizer=tok, console=False)
    loop_thread = threading.get_ident()  # run_sync runs the loop on this thread
    summary = p.run_sync()
    assert summary["steps"] == 3 and tok.threads and loop_thread not in tok.threads
    assert seen and set(seen) == {"xxxx"}  # the decoded texts reached the reward (4 tokens each)


def test_a_finite_data_set_trains_every_prompt_once(tmp_path):
    p, summary = run(sim_config(tmp_path, steps=100, B=4, K=2), epochs=1)
    r = assert_accounted(p, summary)
    trained = [r.groups["prompt_id"][i] for i in range(r.num_groups) if r.groups["fate"][i] == "trained"]
    assert sorted(trained) == sorted(x["id"] for x in PROMPTS)
    assert summary["steps"] == 10


def test_run_directory_layout(tmp_path):
    p, summary = run(sim_config(tmp_path, steps=3))
    for name in ("config.toml", "metrics.jsonl", "events.jsonl", "rollouts.zarr", "adapters", "summary.json",
                 "report.png"):
        assert (p.run_dir / name).exists(), name
    assert load_config(p.run_dir / "config.toml").pipeline.steps == 3
    rows = read_jsonl(p.run_dir / "metrics.jsonl")
    for key in ("step", "version", "reward_mean", "staleness_max", "staleness_mean", "groups", "tokens", "wall_s"):
        assert key in rows[0]
    assert np.isfinite(rows[-1]["reward_mean"])


def test_settled_gives_what_gather_with_exceptions_gives_for_one_coroutine_or_many() -> None:
    # _settled awaits a lone coroutine in place (engine loads, twice a step); the results must not differ
    async def ok() -> int:
        return 1

    async def bad() -> int:
        raise ValueError("bad")

    async def own_cancel() -> int:
        raise asyncio.CancelledError()

    def kinds(results: list) -> list:
        return [type(r) if isinstance(r, BaseException) else r for r in results]

    async def main() -> None:
        for makers in ([ok], [bad], [own_cancel], [ok, bad, own_cancel]):
            ours = await _settled([m() for m in makers])
            theirs = await asyncio.gather(*(m() for m in makers), return_exceptions=True)
            assert kinds(ours) == kinds(theirs)
        started = asyncio.Event()

        async def slow() -> None:
            started.set()
            await asyncio.sleep(10)

        task = asyncio.ensure_future(_settled([slow()]))
        await started.wait()
        task.cancel()  # the caller's cancellation is not turned into a result
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def other_reward(prompts, completions, completion_ids, **kw):
    return [1.0] * len(prompts)


def _events(p):
    return [json.loads(x) for x in (p.run_dir / "events.jsonl").read_text().splitlines()]


def test_resume_refuses_other_data_or_another_reward_and_changes_nothing(tmp_path):
    run(sim_config(tmp_path, steps=4))
    more = sim_config(tmp_path, steps=6)
    config = (tmp_path / "run" / "config.toml").read_bytes()
    with pytest.raises(ConfigError, match="other prompts than the checkpoint's"):
        run(more, prompts=PROMPTS[:-1], resume=True)
    changed = [dict(x, label=x["label"] + 1) if i == 7 else x for i, x in enumerate(PROMPTS)]  # one value
    with pytest.raises(ConfigError, match="other prompts than the checkpoint's"):
        run(more, prompts=changed, resume=True)
    with pytest.raises(ConfigError, match=r"reward functions \['length_reward'\] -> \['other_reward'\]"):
        run(more, reward=other_reward, resume=True)
    with pytest.raises(ConfigError, match="seed"):
        run(sim_config(tmp_path, steps=6, seed=1), resume=True)  # the same items, another order
    # nothing of the run was touched: its config, and it still resumes as it was
    assert (tmp_path / "run" / "config.toml").read_bytes() == config
    from pipeline.store.checkpoint import CheckpointStore

    wall0 = CheckpointStore(tmp_path / "run" / "checkpoints").latest().state["wall_s"]  # the first session's, at step 4
    p, summary = run(more, resume=True)
    assert summary["steps"] == 6 and summary["resumed_from_step"] == 4
    assert_accounted(p, summary)
    # the run's totals cover both sessions; "session" this one alone
    session = summary["session"]
    assert session["steps"] == 2 and session["groups_trained"] == summary["groups_trained"] - 4 * 2
    assert session["wall_s"] > 0 and summary["wall_s"] == pytest.approx(wall0 + session["wall_s"])
    assert summary["groups_per_s"] == pytest.approx(summary["groups_trained"] / summary["wall_s"])


def test_force_resume_continues_with_other_data_and_says_so(tmp_path):
    run(sim_config(tmp_path, steps=4))
    p, summary = run(sim_config(tmp_path, steps=6), prompts=PROMPTS[:-1], reward=other_reward, resume=True,
                     force_resume=True)
    assert summary["steps"] == 6 and summary["resumed_from_step"] == 4
    (forced,) = [e for e in _events(p) if e["event"] == "resume_forced"]
    assert forced["level"] == "warning" and set(forced["changed"]) == {"data", "reward"}
    # the checkpoints now hold the new fingerprint: resuming again needs no force
    p, summary = run(sim_config(tmp_path, steps=8), prompts=PROMPTS[:-1], reward=other_reward, resume=True)
    assert summary["steps"] == 8


def test_resume_with_other_reward_weights_continues_and_warns_with_both(tmp_path):
    run(sim_config(tmp_path, steps=4), reward=[length_reward, other_reward], reward_weights=[1.0, 0.5])
    p, summary = run(sim_config(tmp_path, steps=6), reward=[length_reward, other_reward], reward_weights=[1.0, 2.0],
                     resume=True)
    assert summary["steps"] == 6
    (warned,) = [e for e in _events(p) if e["event"] == "resume_reward_weights_changed"]
    assert warned["level"] == "warning" and warned["was"] == [1.0, 0.5] and warned["now"] == [1.0, 2.0]
    p, summary = run(sim_config(tmp_path, steps=8), reward=[length_reward, other_reward], reward_weights=[1.0, 2.0],
                     resume=True)  # the checkpoints now hold the new weights: no warning again
    assert summary["steps"] == 8
    assert len([e for e in _events(p) if e["event"] == "resume_reward_weights_changed"]) == 1  # the file has all three


def test_a_checkpoint_without_a_fingerprint_resumes_with_a_warning(tmp_path):
    from pipeline.store.checkpoint import CheckpointStore

    run(sim_config(tmp_path, steps=4))
    ck = CheckpointStore(tmp_path / "run" / "checkpoints").latest()
    ledger = ck.path / "ledger.json"
    state = json.loads(ledger.read_text())
    del state["fingerprint"]  # as checkpoints written before fingerprints were
    ledger.write_text(json.dumps(state))
    manifest = json.loads((ck.path / "manifest.json").read_text())
    manifest["files"]["ledger.json"] = hashlib.sha256(ledger.read_bytes()).hexdigest()  # so that it verifies
    (ck.path / "manifest.json").write_text(json.dumps(manifest))
    assert CheckpointStore(tmp_path / "run" / "checkpoints").latest().step == 4
    p, summary = run(sim_config(tmp_path, steps=6), prompts=PROMPTS[:-1], resume=True)
    assert summary["steps"] == 6
    assert [e["level"] for e in _events(p) if e["event"] == "resume_unchecked"] == ["warning"]


def test_the_summary_says_how_long_set_up_took_and_on_what(tmp_path, monkeypatch):
    """The tokenizer loads while the engines start: a slow one costs the set-up no more than its excess."""
    from pipeline.engines.simulated import SimulatedEngine
    from pipeline.loop import build

    def slow_tokenizer(cfg, tokenizer, path):
        time.sleep(0.8)
        return tokenizer or None

    start = SimulatedEngine.start

    async def slow_start(self):
        await asyncio.sleep(1.0)
        await start(self)

    monkeypatch.setattr(build, "tokenizer_of", slow_tokenizer)
    monkeypatch.setattr(SimulatedEngine, "start", slow_start)
    p, summary = run(sim_config(tmp_path, steps=2, step_s=0.0))
    parts = summary["setup"]
    assert set(parts) == {"data_s", "model_s", "tokenizer_s", "engines_start_s", "trainer_start_s"}
    # asyncio's loop clock may end a sleep up to its resolution early: 1.0 s read as 0.9997 s
    assert all(v >= 0 for v in parts.values()) and parts["tokenizer_s"] >= 0.8 and parts["engines_start_s"] >= 0.99
    # data and model one after the other, then engines and trainer together, the tokenizer beside them
    serial = parts["data_s"] + parts["model_s"]
    assert summary["setup_s"] >= serial + max(parts["engines_start_s"], parts["trainer_start_s"], parts["tokenizer_s"])
    assert summary["setup_s"] < serial + parts["engines_start_s"] + parts["tokenizer_s"] - 0.5
