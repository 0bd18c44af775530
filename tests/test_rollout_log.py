import asyncio
import tempfile
from pathlib import Path

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import rollout_log as rl
from pipeline.errors import ConfigError
from pipeline.rollout_log import RolloutLog, read_rollouts
from pipeline.types import Completion, Generation, GroupOutcome, GroupRequest, Prompt


def make_outcome(
    gid: int,
    fate: str = "trained",
    *,
    rng: np.random.Generator | None = None,
    lengths: tuple[int, ...] = (3, 5),
    prompt_len: int = 4,
    version: int = 0,
    step: int | None = None,
    reason: str | None = None,
    with_generation: bool = True,
    with_rewards: bool = True,
) -> GroupOutcome:
    rng = rng if rng is not None else np.random.default_rng(gid)
    prompt = Prompt(id=f"p{gid}", text=f"prompt {gid}",
                    token_ids=tuple(int(t) for t in rng.integers(0, 150_000, prompt_len)))
    gen = None
    if with_generation:
        comps = tuple(
            Completion(
                token_ids=rng.integers(0, 2**31 - 1, n).astype(np.int64),
                logprobs=(-rng.exponential(size=n)).astype(np.float32),
                finish_reason=("stop", "length")[k % 2],
                text="t",
            )
            for k, n in enumerate(lengths)
        )
        gen = Generation(request=GroupRequest(group_id=gid, prompt=prompt, n=len(lengths), max_new_tokens=32),
                         completions=comps, version=version, engine=f"eng{gid % 3}",
                         t_start=10.0 + gid, t_end=11.5 + gid)
    rewards = rng.normal(size=len(lengths)) if (with_generation and with_rewards) else None
    if step is None:
        step = version + 1 + gid % 2 if fate == "trained" else -1
    if reason is None:
        reason = "" if fate == "trained" else f"{fate}_because_{gid % 2}"
    return GroupOutcome(group_id=gid, prompt=prompt, version=version, fate=fate, reason=reason, step=step,
                        generation=gen, rewards=rewards, t_admitted=1.0 + gid, t_done=20.0 + gid)


def assert_group_equal(got: dict, o: GroupOutcome) -> None:
    assert got["group_id"] == o.group_id
    assert got["prompt_id"] == o.prompt.id
    assert got["version"] == o.version
    assert (got["fate"], got["reason"], got["step"]) == (o.fate, o.reason, o.step)
    assert got["t_admitted"] == o.t_admitted and got["t_done"] == o.t_done
    assert got["prompt_token_ids"].dtype == np.int64
    np.testing.assert_array_equal(got["prompt_token_ids"], np.array(o.prompt.token_ids, dtype=np.int64))
    if o.generation is None:
        assert got["engine"] == "" and np.isnan(got["t_gen_start"]) and np.isnan(got["t_gen_end"])
        assert got["completions"] == [] and len(got["rewards"]) == 0
        return
    gen = o.generation
    assert (got["engine"], got["t_gen_start"], got["t_gen_end"]) == (gen.engine, gen.t_start, gen.t_end)
    assert len(got["completions"]) == len(gen.completions) == len(got["rewards"])
    for (tok, lp, fr), c in zip(got["completions"], gen.completions):
        np.testing.assert_array_equal(tok, c.token_ids)
        assert tok.dtype == np.int64 and lp.dtype == np.float32
        assert lp.tobytes() == c.logprobs.tobytes()  # bitwise
        assert fr == c.finish_reason
    if o.rewards is None:
        assert np.isnan(got["rewards"]).all()
    else:
        assert got["rewards"].tobytes() == np.asarray(o.rewards, dtype=np.float64).tobytes()


def test_round_trip_every_field(tmp_path: Path) -> None:
    outcomes = [
        make_outcome(0, "trained", version=2, step=4),
        make_outcome(1, "dropped", lengths=(0, 7, 1)),  # dropped groups keep generation and rewards
        make_outcome(2, "failed", with_generation=False),  # generation failed: nothing but the prompt
        make_outcome(3, "failed", reason="reward_error", with_rewards=False),  # scored no rewards
        make_outcome(4, "trained", lengths=(2,), prompt_len=0, version=1, step=2),
        make_outcome(5, "dropped", reason="stale"),
    ]
    with RolloutLog(tmp_path / "r.zarr", meta={"run": "x", "B": 4}) as log:
        for o in outcomes:
            log.append(o)
        log.flush()
        assert log.counts() == {"trained": 2, "dropped": 2, "failed": 2}
        assert log.reasons() == {"trained:": 2, "dropped:dropped_because_1": 1, "dropped:stale": 1,
                                 "failed:failed_because_0": 1, "failed:reward_error": 1}
    r = read_rollouts(tmp_path / "r.zarr")
    assert r.num_groups == len(outcomes)
    for i, o in enumerate(outcomes):
        assert_group_equal(r.group(i), o)
    assert r.attrs["meta"] == {"run": "x", "B": 4}
    assert r.attrs["format_version"] == rl.FORMAT_VERSION
    assert dict(zip(*np.unique(r.groups["fate"].astype(str), return_counts=True))) == {
        "trained": 2, "dropped": 2, "failed": 2}
    records = r.to_records()
    assert [rec["group_id"] for rec in records] == list(range(6))
    assert records[1]["n_completions"] == 3 and records[1]["num_tokens"] == 8
    assert records[2]["n_completions"] == 0 and np.isnan(records[2]["reward_mean"])
    assert records[0]["reward_mean"] == pytest.approx(float(np.mean(outcomes[0].rewards)))


def test_duplicate_group_id_refused_pending_and_written(tmp_path: Path) -> None:
    log = RolloutLog(tmp_path / "r.zarr")
    log.append(make_outcome(7))
    with pytest.raises(ValueError, match="group 7 is already"):
        log.append(make_outcome(7, "dropped"))  # still pending
    log.flush()
    with pytest.raises(ValueError, match="group 7 is already"):
        log.append(make_outcome(7, "failed"))  # written
    assert len(log) == 1
    log.close()
    assert read_rollouts(tmp_path / "r.zarr").num_groups == 1


def test_reopen_continues_appending_and_remembers_ids(tmp_path: Path) -> None:
    path = tmp_path / "r.zarr"
    first = [make_outcome(i, ("trained", "dropped", "failed")[i % 3]) for i in range(5)]
    with RolloutLog(path, meta={"a": 1}) as log:
        for o in first:
            log.append(o)
    log2 = RolloutLog(path, meta={"b": 2})
    assert len(log2) == 5
    assert log2.counts() == {"trained": 2, "dropped": 2, "failed": 1}
    with pytest.raises(ValueError, match="group 3 is already"):
        log2.append(make_outcome(3))
    second = [make_outcome(i) for i in range(5, 9)]
    for o in second:
        log2.append(o)
    assert len(log2) == 9
    log2.close()
    r = read_rollouts(path)
    assert r.num_groups == 9
    for i, o in enumerate(first + second):
        assert_group_equal(r.group(i), o)
    assert r.attrs["meta"] == {"a": 1, "b": 2}


@pytest.mark.parametrize("keep", [0, 1, 4, 6])
def test_truncate_keeps_a_prefix_and_appends_after_it(tmp_path: Path, keep: int) -> None:
    path = tmp_path / "r.zarr"
    rows = [make_outcome(i, ("trained", "dropped", "failed")[i % 3], lengths=(i + 1, 2)) for i in range(6)]
    with RolloutLog(path) as log:
        for o in rows:
            log.append(o)
    log = RolloutLog(path)
    log.append(make_outcome(50))
    with pytest.raises(RuntimeError, match="pending"):
        log.truncate(keep)
    log.flush()
    assert log.truncate(keep) == 7 - keep
    assert len(log) == keep and sum(log.counts().values()) == keep
    # a cut group may be logged again (a resumed run redoes it); a kept one may not
    again = [make_outcome(5, lengths=(7,))] if keep <= 5 else []
    for o in again + [make_outcome(100)]:
        log.append(o)
    with pytest.raises(ValueError, match="already"):
        log.append(make_outcome(0) if keep else make_outcome(100))
    log.close()
    r = read_rollouts(path)
    expected = rows[:keep] + again + [make_outcome(100)]
    assert r.num_groups == len(expected)
    for i, o in enumerate(expected):
        assert_group_equal(r.group(i), o)


def test_auto_flush_close_and_reader_sees_only_flushed(tmp_path: Path) -> None:
    path = tmp_path / "r.zarr"
    log = RolloutLog(path, flush_every=3)
    log.append(make_outcome(0))
    log.append(make_outcome(1))
    assert log.pending == 2 and len(log) == 2
    assert read_rollouts(path).num_groups == 0
    log.append(make_outcome(2))  # reaches flush_every: written now
    assert log.pending == 0
    assert read_rollouts(path).num_groups == 3
    log.append(make_outcome(3))
    assert read_rollouts(path).num_groups == 3
    log.close()
    assert read_rollouts(path).num_groups == 4
    log.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        log.append(make_outcome(4))


def _raise_at(monkeypatch: pytest.MonkeyPatch, stage: str) -> None:
    """Make the next flush die just before `stage` ("groups" section or "commit")."""
    real = RolloutLog._write_section

    def write_section(self, section, *args):
        if section == stage:
            raise OSError(f"simulated crash before {stage}")
        return real(self, section, *args)

    def commit(self, new):
        raise OSError("simulated crash before commit")

    if stage == "commit":
        monkeypatch.setattr(RolloutLog, "_commit", commit)
    else:
        monkeypatch.setattr(RolloutLog, "_write_section", write_section)


@pytest.mark.parametrize("stage", ["completions", "groups", "commit"])
def test_crash_mid_flush_leaves_whole_groups_and_reopen_continues(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str) -> None:
    path = tmp_path / "r.zarr"
    before = [make_outcome(i, lengths=(4, 2)) for i in range(3)]
    crashed = [make_outcome(i, lengths=(9, 9, 9)) for i in range(3, 6)]
    log = RolloutLog(path)
    for o in before:
        log.append(o)
    log.flush()
    for o in crashed:
        log.append(o)
    with monkeypatch.context() as m:
        _raise_at(m, stage)
        with pytest.raises(OSError, match="simulated crash"):
            log.flush()
    raw = zarr.open_group(path, mode="r")
    assert raw["tokens"].shape[0] > 3 * 6  # the crash really left trailing data behind
    r = read_rollouts(path)
    assert r.num_groups == 3
    for i, o in enumerate(before):
        assert_group_equal(r.group(i), o)
    assert len(r.tokens) == 18 and len(r.completions["reward"]) == 6

    # A new process resumes: the crashed groups were never logged, so they may be appended again.
    log2 = RolloutLog(path)
    assert len(log2) == 3
    raw = zarr.open_group(path, mode="r")  # reopening trimmed what the crash left
    assert raw["tokens"].shape[0] == raw["logprobs"].shape[0] == 18
    assert raw["reward"].shape[0] == 6 and raw["group_id"].shape[0] == 3
    after = [make_outcome(i, lengths=(1, 3)) for i in range(3, 7)]
    for o in after:
        log2.append(o)
    log2.close()
    r = read_rollouts(path)
    assert r.num_groups == 7
    for i, o in enumerate(before + after):
        assert_group_equal(r.group(i), o)
    raw = zarr.open_group(path, mode="r")
    assert raw["tokens"].shape[0] == raw["logprobs"].shape[0] == 3 * 6 + 4 * 4
    assert raw["reward"].shape[0] == 14 and raw["group_id"].shape[0] == 7
    assert raw["tok_off"][-1] + raw["tok_len"][-1] == 34
    assert raw["prompt_tok_off"][-1] + raw["prompt_tok_len"][-1] == raw["prompt_tokens"].shape[0] == 7 * 4


def test_failed_flush_retried_in_process_writes_each_group_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "r.zarr"
    log = RolloutLog(path)
    outcomes = [make_outcome(i) for i in range(4)]
    for o in outcomes:
        log.append(o)
    with monkeypatch.context() as m:
        _raise_at(m, "groups")
        with pytest.raises(OSError):
            log.flush()
    assert log.pending == 4
    log.close()
    r = read_rollouts(path)
    assert r.num_groups == 4 and len(r.tokens) == 4 * 8
    for i, o in enumerate(outcomes):
        assert_group_equal(r.group(i), o)


def test_appends_on_loop_with_flushes_in_threads_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "r.zarr"
    log = RolloutLog(path, flush_every=10_000)

    async def main() -> None:
        async def flusher() -> None:
            for _ in range(8):
                await asyncio.to_thread(log.flush)

        task = asyncio.create_task(flusher(), name="flusher")
        for i in range(200):
            log.append(make_outcome(i, lengths=(2,)))
            if i % 10 == 0:
                await asyncio.sleep(0)
        await task
        await asyncio.to_thread(log.close)

    asyncio.run(main())
    r = read_rollouts(path)
    assert sorted(r.groups["group_id"].tolist()) == list(range(200))
    for i in range(r.num_groups):
        gid = int(r.groups["group_id"][i])
        assert_group_equal(r.group(i), make_outcome(gid, lengths=(2,)))


def test_staleness_of_trained_groups(tmp_path: Path) -> None:
    path = tmp_path / "r.zarr"
    spec = [(0, 1), (0, 3), (2, 3), (5, 9)]  # (version, step)
    with RolloutLog(path) as log:
        for i, (v, s) in enumerate(spec):
            log.append(make_outcome(i, version=v, step=s))
            log.append(make_outcome(100 + i, "dropped", version=v))
    st_ = read_rollouts(path).staleness()
    np.testing.assert_array_equal(st_, [0, 2, 0, 3])
    assert st_.dtype == np.int64


@pytest.mark.parametrize("kwargs, match", [
    ({"fate": "lost"}, "fate must be one of"),
    ({"fate": "trained", "step": -1}, "trained group needs step >= 1"),
    ({"fate": "dropped", "step": 3}, "dropped group needs step -1"),
    ({"fate": "dropped", "reason": ""}, "needs step -1 and a reason"),
])
def test_inconsistent_outcomes_are_refused(tmp_path: Path, kwargs: dict, match: str) -> None:
    log = RolloutLog(tmp_path / "r.zarr")
    with pytest.raises(ValueError, match=match):
        log.append(make_outcome(1, **kwargs))
    assert len(log) == 0


def test_rewards_length_and_token_range_are_checked(tmp_path: Path) -> None:
    log = RolloutLog(tmp_path / "r.zarr")
    o = make_outcome(1)
    with pytest.raises(ValueError, match="1 rewards for 2 completions"):
        log.append(GroupOutcome(**{**{f: getattr(o, f) for f in o.__slots__}, "rewards": np.zeros(1)}))
    big = Prompt(id="big", text="", token_ids=(2**31,))
    with pytest.raises(ValueError, match="outside"):
        log.append(GroupOutcome(**{**{f: getattr(o, f) for f in o.__slots__}, "prompt": big}))
    assert len(log) == 0


def test_wrong_format_version_refused(tmp_path: Path) -> None:
    path = tmp_path / "r.zarr"
    RolloutLog(path).close()
    zarr.open_group(path, mode="r+").attrs["format_version"] = 99
    with pytest.raises(ConfigError, match="format_version 99"):
        RolloutLog(path)
    with pytest.raises(ConfigError, match="format_version 99"):
        read_rollouts(path)


group_shapes = st.lists(
    st.tuples(
        st.sampled_from(["trained", "dropped", "failed"]),
        st.lists(st.integers(0, 20), min_size=0, max_size=4),  # completion lengths
        st.integers(0, 20),  # prompt length
        st.booleans(),  # has rewards
    ),
    min_size=0, max_size=12,
)


# Each flush costs tens of ms of zarr I/O, so few examples and mostly multi-group flushes.
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes=group_shapes, flush_every=st.sampled_from([3, 1000]), seed=st.integers(0, 2**32 - 1))
def test_random_ragged_groups_round_trip(shapes: list, flush_every: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    outcomes = [
        make_outcome(i, fate, rng=rng, lengths=tuple(lengths), prompt_len=plen, version=i % 3,
                     with_rewards=has_rewards)
        for i, (fate, lengths, plen, has_rewards) in enumerate(shapes)
    ]
    with tempfile.TemporaryDirectory() as d:
        with RolloutLog(Path(d) / "r.zarr", flush_every=flush_every) as log:
            for o in outcomes:
                log.append(o)
        r = read_rollouts(Path(d) / "r.zarr")
        assert r.num_groups == len(outcomes)
        for i, o in enumerate(outcomes):
            assert_group_equal(r.group(i), o)
        assert len(r.tokens) == sum(sum(s[1]) for s in shapes)
