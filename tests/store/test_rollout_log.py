import asyncio
import tempfile
from pathlib import Path

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.store import rollout_log as rl
from pipeline.errors import ConfigError
from pipeline.store.rollout_log import RolloutLog, read_rollouts
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
    episodes: bool = False,
) -> GroupOutcome:
    """A random outcome; with `episodes`, its completions are multi-turn episodes (a random mask
    of sampled tokens with 0 log-probs elsewhere, turns, an environment reward)."""
    rng = rng if rng is not None else np.random.default_rng(gid)
    prompt = Prompt(id=f"p{gid}", text=f"prompt {gid}",
                    token_ids=tuple(int(t) for t in rng.integers(0, 150_000, prompt_len)))
    gen = None
    if with_generation:
        comps = tuple(_completion(rng, n, k, episodes) for k, n in enumerate(lengths))
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


def _completion(rng: np.random.Generator, n: int, k: int, episode: bool) -> Completion:
    logprobs = (-rng.exponential(size=n)).astype(np.float32)
    if not episode:
        return Completion(token_ids=rng.integers(0, 2**31 - 1, n).astype(np.int64), logprobs=logprobs,
                          finish_reason=("stop", "length")[k % 2], text="t")
    mask = rng.random(n) < 0.6
    return Completion(token_ids=rng.integers(0, 2**31 - 1, n).astype(np.int64),
                      logprobs=np.where(mask, logprobs, np.float32(0)), finish_reason=("stop", "length")[k % 2],
                      text="t", mask=mask, turns=int(rng.integers(1, 5)), env_reward=float(rng.normal()))


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
        assert got["masks"] == [] and len(got["turns"]) == len(got["env_rewards"]) == 0
        return
    gen = o.generation
    assert (got["engine"], got["t_gen_start"], got["t_gen_end"]) == (gen.engine, gen.t_start, gen.t_end)
    assert len(got["completions"]) == len(gen.completions) == len(got["rewards"])
    for (tok, lp, fr), c in zip(got["completions"], gen.completions):
        np.testing.assert_array_equal(tok, c.token_ids)
        assert tok.dtype == np.int64 and lp.dtype == np.float32
        assert lp.tobytes() == c.logprobs.tobytes()  # bitwise
        assert fr == c.finish_reason
    assert len(got["masks"]) == len(gen.completions)
    for m, (tok, _, _), c in zip(got["masks"], got["completions"], gen.completions):
        assert m.dtype == np.bool_ and len(m) == len(tok)
        np.testing.assert_array_equal(m, c.sampled)  # all True for a single turn
    assert got["turns"].tolist() == [c.turns for c in gen.completions]
    np.testing.assert_array_equal(got["env_rewards"], [np.nan if c.env_reward is None else c.env_reward
                                                       for c in gen.completions])
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
        assert log.counts() == {"trained": 2, "dropped": 2, "failed": 2, "eval": 0}
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
    assert log2.counts() == {"trained": 2, "dropped": 2, "failed": 1, "eval": 0}
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
        st.booleans(),  # multi-turn episodes
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
                     with_rewards=has_rewards, episodes=episodes)
        for i, (fate, lengths, plen, has_rewards, episodes) in enumerate(shapes)
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


def _mixed_outcomes(start: int = 0) -> list[GroupOutcome]:
    """Every shape a batch can hold: all fates, no generation, no rewards, empty completions."""
    return [
        make_outcome(start + 0, "trained", version=2, step=4, lengths=(5, 1, 3)),
        make_outcome(start + 1, "failed", with_generation=False),
        make_outcome(start + 2, "dropped", lengths=(0, 7)),
        make_outcome(start + 3, "failed", reason="reward_error", with_rewards=False),
        make_outcome(start + 4, "trained", lengths=(2,), prompt_len=0, version=1, step=2),
        make_outcome(start + 5, "dropped", reason="stale", lengths=()),
        make_outcome(start + 6, "trained", lengths=(4, 4)),
        make_outcome(start + 7, "trained", lengths=(6, 0, 3), episodes=True),
        make_outcome(start + 8, "dropped", lengths=(5,), episodes=True),
    ]


def _assert_same_store(a: rl.Rollouts, b: rl.Rollouts) -> None:
    for section in ("groups", "completions"):
        x, y = getattr(a, section), getattr(b, section)
        assert x.keys() == y.keys()
        for name in x:
            assert x[name].dtype == y[name].dtype, name
            np.testing.assert_array_equal(x[name], y[name], err_msg=name)  # NaN == NaN here
    for name in ("prompt_tokens", "tokens", "logprobs", "mask"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), name


@pytest.mark.parametrize("batches", [(7,), (1, 3, 3), (2, 5)])
def test_append_many_stores_what_single_appends_store(tmp_path: Path, batches: tuple[int, ...]) -> None:
    outcomes = _mixed_outcomes() + _mixed_outcomes(start=100)
    with RolloutLog(tmp_path / "one.zarr") as one:
        for o in outcomes:
            one.append(o)
        one_counts, one_reasons = one.counts(), one.reasons()
    with RolloutLog(tmp_path / "many.zarr", flush_every=5) as many:
        rest, calls = list(outcomes), 0
        while rest:
            k = batches[calls % len(batches)]
            many.append_many(rest[:k])
            rest, calls = rest[k:], calls + 1
        assert not rest and len(many) == len(outcomes)
        assert (many.counts(), many.reasons()) == (one_counts, one_reasons)
    a, b = read_rollouts(tmp_path / "one.zarr"), read_rollouts(tmp_path / "many.zarr")
    _assert_same_store(a, b)
    for i, o in enumerate(outcomes):
        assert_group_equal(b.group(i), o)


def _with(o: GroupOutcome, **changes) -> GroupOutcome:
    return GroupOutcome(**{**{f: getattr(o, f) for f in o.__slots__}, **changes})


def _bad_completion_token(o: GroupOutcome, value: int, completion: int = -1, at: int = 1) -> GroupOutcome:
    comps = list(o.generation.completions)
    ids = comps[completion].token_ids.copy()
    ids[at] = value
    comps[completion] = Completion(token_ids=ids, logprobs=comps[completion].logprobs, finish_reason="stop")
    gen = o.generation
    return _with(o, generation=Generation(request=gen.request, completions=tuple(comps), version=gen.version,
                                          engine=gen.engine, t_start=gen.t_start, t_end=gen.t_end))


@pytest.mark.parametrize("spoil, match", [
    (lambda o: _with(o, fate="lost"), "group 12: fate must be one of"),
    (lambda o: _with(o, step=-1), "group 12: a trained group needs step >= 1"),
    (lambda o: _with(o, rewards=np.zeros(1)), "group 12: 1 rewards for 2 completions"),
    (lambda o: _bad_completion_token(o, 2**31), r"group 12 completion has token ids outside .*max 2147483648"),
    (lambda o: _bad_completion_token(o, -3), r"group 12 completion has token ids outside .*min -3"),
    (lambda o: _with(o, prompt=Prompt(id="p", text="", token_ids=(5, 2**40))), "group 12 prompt has token ids"),
])
def test_a_bad_outcome_refuses_the_whole_batch(tmp_path: Path, spoil, match: str) -> None:
    log = RolloutLog(tmp_path / "r.zarr", flush_every=2)  # a batch that went in would flush at once
    batch = [make_outcome(i) for i in range(10, 15)]
    batch[2] = spoil(batch[2])
    with pytest.raises(ValueError, match=match):
        log.append_many(batch)
    assert len(log) == 0 and log.pending == 0 and sum(log.counts().values()) == 0 and log.reasons() == {}
    assert read_rollouts(tmp_path / "r.zarr").num_groups == 0
    good = [make_outcome(i) for i in range(10, 15)]  # no id was reserved by the refused batch
    log.append_many(good)
    log.close()
    r = read_rollouts(tmp_path / "r.zarr")
    assert r.num_groups == 5
    for i, o in enumerate(good):
        assert_group_equal(r.group(i), o)


def test_out_of_range_token_names_its_group_among_many(tmp_path: Path) -> None:
    log = RolloutLog(tmp_path / "r.zarr")
    batch = [make_outcome(i, lengths=(3, 0, 4)) for i in range(40)]
    batch[1] = make_outcome(1, "failed", with_generation=False)  # no completions before the bad group
    # the first id of the group's run: the boundary between groups 28 and 29 must be placed right
    batch[29] = _bad_completion_token(batch[29], 2**31 + 5, completion=0, at=0)
    with pytest.raises(ValueError, match=r"^group 29 completion .*max 2147483653"):
        log.append_many(batch)
    batch[29] = _with(batch[29], prompt=Prompt(id="p", text="", token_ids=(-1, 1)))  # prompts are checked too
    with pytest.raises(ValueError, match=r"^group 29 prompt .*min -1"):
        log.append_many(batch)
    assert len(log) == 0


def test_duplicates_refused_within_one_call_and_against_the_log(tmp_path: Path) -> None:
    log = RolloutLog(tmp_path / "r.zarr")
    with pytest.raises(ValueError, match="group 5 appears twice in one append"):
        log.append_many([make_outcome(5), make_outcome(6), make_outcome(5, "dropped")])
    assert len(log) == 0 and log.pending == 0
    log.append_many([make_outcome(5), make_outcome(6)])
    with pytest.raises(ValueError, match="group 6 is already"):
        log.append_many([make_outcome(7), make_outcome(6, "failed")])  # 6 is pending
    log.flush()
    with pytest.raises(ValueError, match="group 5 is already"):
        log.append_many([make_outcome(8), make_outcome(5, "failed")])  # 5 is written
    assert len(log) == 2
    log.append_many([make_outcome(7), make_outcome(8)])  # the refused calls reserved nothing
    log.close()
    assert read_rollouts(tmp_path / "r.zarr").groups["group_id"].tolist() == [5, 6, 7, 8]


def test_pending_counts_groups_and_a_batch_triggers_the_auto_flush(tmp_path: Path) -> None:
    path = tmp_path / "r.zarr"
    log = RolloutLog(path, flush_every=5)
    log.append_many([make_outcome(i) for i in range(3)])
    log.append(make_outcome(3))
    log.append_many([])
    assert log.pending == 4 and len(log) == 4
    assert read_rollouts(path).num_groups == 0
    log.append_many([make_outcome(i) for i in range(4, 7)])  # 7 pending >= 5: all written now
    assert log.pending == 0 and read_rollouts(path).num_groups == 7
    log.close()


def test_mixed_fates_in_one_call_round_trip(tmp_path: Path) -> None:
    outcomes = _mixed_outcomes()
    with RolloutLog(tmp_path / "r.zarr") as log:
        log.append_many(outcomes)
        assert log.counts() == {"trained": 4, "dropped": 3, "failed": 2, "eval": 0}
    r = read_rollouts(tmp_path / "r.zarr")
    assert r.num_groups == len(outcomes)
    for i, o in enumerate(outcomes):
        assert_group_equal(r.group(i), o)
    # 3 + 0 + 2 + 2 + 1 + 0 + 2 completions; only group 3's two were never scored
    assert np.flatnonzero(np.isnan(r.completions["reward"])).tolist() == [5, 6]


def test_other_array_types_are_cast_like_the_declared_ones(tmp_path: Path) -> None:
    """int32, list, strided and float64 token ids, float64 logprobs and list rewards store the same values."""
    base = make_outcome(0, lengths=(4, 3, 5, 2))
    gen = base.generation
    c = gen.completions
    odd = (
        Completion(token_ids=c[0].token_ids.astype(np.int32), logprobs=c[0].logprobs.astype(np.float64),
                   finish_reason=c[0].finish_reason),
        Completion(token_ids=[int(t) for t in c[1].token_ids], logprobs=c[1].logprobs, finish_reason="stop"),
        Completion(token_ids=np.repeat(c[2].token_ids, 2)[::2], logprobs=c[2].logprobs, finish_reason="length"),
        Completion(token_ids=c[3].token_ids.astype(np.float64), logprobs=c[3].logprobs, finish_reason="stop"),
    )
    assert not odd[2].token_ids.flags.c_contiguous
    changed = _with(base, group_id=1, rewards=[float(x) for x in base.rewards],
                    generation=Generation(request=gen.request, completions=odd, version=gen.version,
                                          engine=gen.engine, t_start=gen.t_start, t_end=gen.t_end))
    with RolloutLog(tmp_path / "r.zarr") as log:
        log.append_many([base, changed])
    r = read_rollouts(tmp_path / "r.zarr")
    a, b = r.group(0), r.group(1)
    np.testing.assert_array_equal(a["rewards"], b["rewards"])
    for (ta, la, _), (tb, lb, _) in zip(a["completions"], b["completions"]):
        np.testing.assert_array_equal(ta, tb)
        np.testing.assert_array_equal(la, lb)


def test_reopen_after_an_unclosed_log_trims_the_grown_arrays(tmp_path: Path) -> None:
    """A run killed between flushes leaves arrays grown past the committed rows; reopening copes."""
    path = tmp_path / "r.zarr"
    first = [make_outcome(i) for i in range(3)]
    log = RolloutLog(path)
    log.append_many(first)
    log.flush()  # never closed, as after kill -9
    raw = zarr.open_group(path, mode="r")
    assert raw["group_id"].shape[0] == rl.GROUP_CHUNK  # grown a chunk at a time while open
    assert read_rollouts(path).num_groups == 3
    log2 = RolloutLog(path)
    raw = zarr.open_group(path, mode="r")
    assert raw["group_id"].shape[0] == 3 and raw["tokens"].shape[0] == 3 * 8
    second = [make_outcome(i) for i in range(3, 6)]
    log2.append_many(second)
    log2.close()
    r = read_rollouts(path)
    assert r.num_groups == 6
    for i, o in enumerate(first + second):
        assert_group_equal(r.group(i), o)
    raw = zarr.open_group(path, mode="r")
    assert raw["group_id"].shape[0] == 6 and raw["tokens"].shape[0] == 6 * 8


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes=group_shapes, cuts=st.lists(st.integers(1, 5), min_size=1, max_size=12), seed=st.integers(0, 2**32 - 1))
def test_random_batches_round_trip(shapes: list, cuts: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    outcomes = [
        make_outcome(i, fate, rng=rng, lengths=tuple(lengths), prompt_len=plen, with_rewards=has_rewards,
                     episodes=episodes)
        for i, (fate, lengths, plen, has_rewards, episodes) in enumerate(shapes)
    ]
    with tempfile.TemporaryDirectory() as d:
        with RolloutLog(Path(d) / "r.zarr", flush_every=4) as log:
            rest, k = list(outcomes), 0
            while rest:
                log.append_many(rest[:cuts[k % len(cuts)]])
                rest, k = rest[cuts[k % len(cuts)]:], k + 1
        r = read_rollouts(Path(d) / "r.zarr")
        assert r.num_groups == len(outcomes)
        for i, o in enumerate(outcomes):
            assert_group_equal(r.group(i), o)


def test_one_failed_array_write_fails_the_flush_and_a_retry_completes_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The arrays of a section are written together; one failing among them still fails the flush."""
    path = tmp_path / "r.zarr"
    log = RolloutLog(path)
    outcomes = _mixed_outcomes()
    log.append_many(outcomes)
    real = zarr.AsyncArray.setitem

    async def setitem(self, *args, **kwargs):
        if self.path == "fate":
            raise OSError("simulated disk error on fate")
        return await real(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(zarr.AsyncArray, "setitem", setitem)
        with pytest.raises(OSError, match="fate"):
            log.flush()
    assert log.pending == len(outcomes) and read_rollouts(path).num_groups == 0
    log.close()
    r = read_rollouts(path)
    assert r.num_groups == len(outcomes)
    for i, o in enumerate(outcomes):
        assert_group_equal(r.group(i), o)


def test_pending_tokens_count_the_completion_tokens_not_yet_flushed(tmp_path: Path) -> None:
    log = RolloutLog(tmp_path / "r.zarr", flush_every=100)
    log.append_many([make_outcome(0, lengths=(3, 5)), make_outcome(1, lengths=(2,))])
    log.append(make_outcome(2, "failed", with_generation=False))
    assert log.pending == 3 and log.pending_tokens == 10
    log.flush()
    assert log.pending == 0 and log.pending_tokens == 0
    log.append(make_outcome(3, lengths=(4, 4)))
    assert log.pending_tokens == 8
    log.close()


def test_eval_groups_have_negative_ids_and_their_rounds_step(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    ok = [make_outcome(-1, "eval", step=0, reason="", rng=rng),
          make_outcome(-2, "eval", step=5, reason="reward_error", with_rewards=False, rng=rng)]
    with RolloutLog(tmp_path / "r.zarr") as log:
        log.append_many([make_outcome(0), *ok])
        assert log.counts() == {"trained": 1, "dropped": 0, "failed": 0, "eval": 2}
        for bad, match in ((make_outcome(3, "eval", step=0, reason=""), "negative id"),
                           (make_outcome(-3, "eval", step=-1, reason="", rng=rng), "step >= 0")):
            with pytest.raises(ValueError, match=match):
                log.append_many([bad])
    r = read_rollouts(tmp_path / "r.zarr")
    for i, o in enumerate(ok, start=1):
        assert_group_equal(r.group(i), o)
    assert r.staleness().tolist() == [r.groups["step"][0] - 1]  # eval groups are not trained groups


# --------------------------------------------------------------------------- multi-turn episodes and format 1


def test_a_multi_turn_groups_mask_and_turns_round_trip(tmp_path: Path) -> None:
    """The per-token mask (aligned with tokens) and per-completion turns and env_reward, beside single turns."""
    mask = np.array([True, True, False, False, False, True, True, False, True])
    lp = np.where(mask, np.float32(-0.5), np.float32(0))
    ids = np.arange(100, 109, dtype=np.int64)
    episode = Completion(token_ids=ids, logprobs=lp.astype(np.float32), finish_reason="stop", mask=mask, turns=3,
                         env_reward=1.5)
    unmasked = Completion(token_ids=ids[:4], logprobs=np.full(4, -1.0, np.float32), finish_reason="length", turns=2)
    base = make_outcome(1, lengths=(2,))
    gen = base.generation
    multi = _with(base, rewards=np.array([1.0, 0.0]), generation=Generation(
        request=gen.request, completions=(episode, unmasked), version=0, engine="e", t_start=0.0, t_end=1.0))
    single = make_outcome(2, lengths=(3, 5))
    with RolloutLog(tmp_path / "r.zarr") as log:
        log.append_many([make_outcome(0, lengths=(4,)), multi])
        log.append(single)
    r = read_rollouts(tmp_path / "r.zarr")
    assert r.mask.dtype == np.bool_ and len(r.mask) == len(r.tokens) == 4 + 9 + 4 + 8
    np.testing.assert_array_equal(r.mask, np.concatenate([np.ones(4, bool), mask, np.ones(4 + 8, bool)]))
    assert r.completions["turns"].tolist() == [1, 3, 2, 1, 1]
    np.testing.assert_array_equal(r.completions["env_reward"], [np.nan, 1.5, np.nan, np.nan, np.nan])
    g = r.group(1)
    np.testing.assert_array_equal(g["masks"][0], mask)
    assert g["masks"][1].all() and g["turns"].tolist() == [3, 2]
    assert g["env_rewards"][0] == 1.5 and np.isnan(g["env_rewards"][1])
    assert_group_equal(g, multi)
    assert_group_equal(r.group(2), single)
    rec = r.to_records()[1]
    assert rec["num_tokens"] == 13 and rec["num_sampled_tokens"] == 5 + 4 and rec["turns"] == [3, 2]


def test_a_mask_of_another_dtype_is_stored_as_bool(tmp_path: Path) -> None:
    m = np.array([1, 0, 1], dtype=np.uint8)
    c = Completion(token_ids=np.arange(3), logprobs=np.array([-1, 0, -1], np.float32), finish_reason="stop", mask=m)
    base = make_outcome(0, lengths=(1,))
    gen = base.generation
    o = _with(base, rewards=np.zeros(1), generation=Generation(request=gen.request, completions=(c,), version=0,
                                                               engine="e", t_start=0.0, t_end=1.0))
    with RolloutLog(tmp_path / "r.zarr") as log:
        log.append(o)
    assert read_rollouts(tmp_path / "r.zarr").mask.tolist() == [True, False, True]


# The arrays of a format-1 store, as the format-1 writer created them.
V1_ARRAYS = {"group_id", "prompt_id", "version", "fate", "reason", "step", "engine", "t_admitted", "t_gen_start",
             "t_gen_end", "t_done", "prompt_tok_off", "prompt_tok_len", "comp_off", "comp_count", "reward",
             "finish_reason", "tok_off", "tok_len", "prompt_tokens", "tokens", "logprobs"}


def _format_1_writer(m: pytest.MonkeyPatch) -> None:
    """Make RolloutLog write what the format-1 code wrote: version 1, without the arrays format 2 added."""
    m.setattr(rl, "FORMAT_VERSION", 1)
    for section, (arrays, chunk, key) in rl._SECTIONS.items():
        m.setitem(rl._SECTIONS, section, ({k: v for k, v in arrays.items() if k not in rl._missing(1)}, chunk, key))


def _write_format_1(path: Path, outcomes: list[GroupOutcome], close: bool = True) -> None:
    with pytest.MonkeyPatch.context() as m:
        _format_1_writer(m)
        log = RolloutLog(path, meta={"old": True})
        log.append_many(outcomes)
        log.flush()
        if close:
            log.close()
    raw = zarr.open_group(path, mode="r")
    assert set(raw.array_keys()) == V1_ARRAYS and raw.attrs["format_version"] == 1  # what format 1 wrote


def test_a_format_1_log_reads_as_single_turns_and_is_not_changed(tmp_path: Path) -> None:
    path = tmp_path / "r.zarr"
    old = _mixed_outcomes()[:7]  # single turns only: what format 1 could hold
    _write_format_1(path, old)
    r = read_rollouts(path)
    assert r.attrs["format_version"] == 1 and r.num_groups == len(old)
    assert r.mask.dtype == np.bool_ and len(r.mask) == len(r.tokens) and r.mask.all()
    assert (r.completions["turns"] == 1).all() and np.isnan(r.completions["env_reward"]).all()
    for i, o in enumerate(old):
        assert_group_equal(r.group(i), o)
    assert set(zarr.open_group(path, mode="r").array_keys()) == V1_ARRAYS  # reading upgrades nothing


@pytest.mark.parametrize("closed", [True, False])
def test_a_format_1_log_opened_for_appending_is_upgraded_and_continued(tmp_path: Path, closed: bool) -> None:
    """A resumed run of an old run directory: open (upgrade), truncate to the checkpoint, append episodes."""
    path = tmp_path / "r.zarr"
    old = [make_outcome(i, lengths=(3, 2)) for i in range(5)]
    _write_format_1(path, old, close=closed)  # not closed: a kill -9 left the arrays grown
    log = RolloutLog(path, meta={"new": True})
    raw = zarr.open_group(path, mode="r")
    assert raw.attrs["format_version"] == rl.FORMAT_VERSION == 3
    assert raw["mask"].shape[0] == raw["tokens"].shape[0] == 25 and raw["turns"].shape[0] == 10
    assert log.truncate(3) == 2  # what session.open_session does on a resume
    new = [make_outcome(i, lengths=(4, 6), episodes=True) for i in range(3, 6)]
    log.append_many(new)
    log.close()
    r = read_rollouts(path)
    assert r.num_groups == 6 and r.attrs["meta"] == {"old": True, "new": True}
    for i, o in enumerate(old[:3] + new):
        assert_group_equal(r.group(i), o)
    assert r.mask[:15].all() and not r.mask[15:].all()
    assert r.completions["turns"][:6].tolist() == [1] * 6


def test_an_upgrade_cut_short_is_done_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "r.zarr"
    old = [make_outcome(i) for i in range(3)]
    _write_format_1(path, old)
    real, made = rl._create_array, []

    def create_array(group, name, *args, **kwargs):
        if made:
            raise OSError("simulated crash mid-upgrade")
        made.append(name)
        real(group, name, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(rl, "_create_array", create_array)
        with pytest.raises(OSError, match="mid-upgrade"):
            RolloutLog(path)
    raw = zarr.open_group(path, mode="r")
    assert raw.attrs["format_version"] == 1 and made[0] in raw.array_keys()  # one array made, version not bumped
    r = read_rollouts(path)  # still a readable format-1 store
    for i, o in enumerate(old):
        assert_group_equal(r.group(i), o)
    log = RolloutLog(path)
    log.append(make_outcome(3, episodes=True))
    log.close()
    r = read_rollouts(path)
    assert r.attrs["format_version"] == 3
    for i, o in enumerate(old + [make_outcome(3, episodes=True)]):
        assert_group_equal(r.group(i), o)


def _spanning(o: GroupOutcome, last: int) -> GroupOutcome:
    """`o` as an in-flight swap leaves it: sampled from its version on, up to version `last`."""
    gen = o.generation
    return _with(o, generation=Generation(request=gen.request, completions=gen.completions, version=gen.version,
                                          engine=gen.engine, t_start=gen.t_start, t_end=gen.t_end, last_version=last))


def test_last_version_holds_the_newest_version_whose_weights_sampled_a_group(tmp_path: Path) -> None:
    outcomes = [_spanning(make_outcome(0, version=3), last=5), make_outcome(1, version=4),
                make_outcome(2, "failed", with_generation=False), _spanning(make_outcome(3, version=2), last=2)]
    with RolloutLog(tmp_path / "r.zarr") as log:
        log.append_many(outcomes)
    r = read_rollouts(tmp_path / "r.zarr")
    assert r.groups["version"].tolist() == [3, 4, 0, 2]
    assert r.groups["last_version"].tolist() == [5, 4, -1, 2]
    assert [r.group(i)["last_version"] for i in range(4)] == [5, 4, -1, 2]


def test_a_format_2_log_reads_without_last_versions_and_is_upgraded_on_append(tmp_path: Path) -> None:
    path = tmp_path / "r.zarr"
    old = [make_outcome(i, lengths=(3, 2), episodes=True) for i in range(3)]
    with pytest.MonkeyPatch.context() as m:  # what the format-2 code wrote
        m.setattr(rl, "FORMAT_VERSION", 2)
        for section, (arrays, chunk, key) in rl._SECTIONS.items():
            m.setitem(rl._SECTIONS, section, ({k: v for k, v in arrays.items() if k not in rl._missing(2)}, chunk, key))
        m.setattr(rl, "_ROW", tuple(c for c in rl._ROW if c != "last_version"))
        real_block = rl._to_block

        def format_2_block(*a, **kw):  # the format-2 row: no last_version
            b = real_block(*a, **kw)
            b.rows = tuple(row[:3] + row[4:] for row in b.rows)
            return b

        m.setattr(rl, "_to_block", format_2_block)
        with RolloutLog(path) as log:
            log.append_many(old)
    raw = zarr.open_group(path, mode="r")
    assert raw.attrs["format_version"] == 2 and "last_version" not in raw.array_keys()
    r = read_rollouts(path)
    assert r.groups["last_version"].tolist() == [-1, -1, -1]
    for i, o in enumerate(old):
        assert_group_equal(r.group(i), o)
    with RolloutLog(path) as log:  # a resumed run appends
        log.append(_spanning(make_outcome(3, version=1), last=2))
    r = read_rollouts(path)
    assert r.attrs["format_version"] == 3 and r.groups["last_version"].tolist() == [-1, -1, -1, 2]
    for i, o in enumerate(old):
        assert_group_equal(r.group(i), o)
