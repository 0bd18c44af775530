"""Multi-turn episodes (pipeline.loop.episodes) through the whole pipeline, on the simulated engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import assert_accounted, sim_config
from episode_envs import Echo, Endless, Flaky, Random

from pipeline.engines.simulated import SimulatedEngine
from pipeline.envs import ToolEnvironment, from_trl
from pipeline.loop.orchestrator import Pipeline
from pipeline.store.rollout_log import read_rollouts
from pipeline.trainer.simulated import SimulatedTrainer
from pipeline.types import AdapterRef, Batch, GroupRequest

ROWS = [{"id": str(i)} for i in range(64)]


class RecordingEngine(SimulatedEngine):
    """The simulated engine, remembering every request and what it returned."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[GroupRequest, int, list[tuple[list[int], list[float]]]]] = []

    async def generate(self, request: GroupRequest, adapter: AdapterRef) -> Any:
        gen = await super().generate(request, adapter)
        self.calls.append((request, adapter.version, [(c.token_ids.tolist(), c.logprobs.tolist())
                                                      for c in gen.completions]))
        return gen

    async def generate_many(self, requests: Any, adapter: AdapterRef) -> Any:
        out = await super().generate_many(requests, adapter)
        for r, g in zip(requests, out):
            self.calls.append((r, adapter.version, [(c.token_ids.tolist(), c.logprobs.tolist())
                                                    for c in g.completions]))
        return out


class KeepingTrainer(SimulatedTrainer):
    """The simulated trainer, keeping every batch it trained."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[Batch] = []

    def step(self, batch: Batch) -> Any:
        self.batches.append(batch)
        return super().step(batch)


def _run(tmp_path: Path, env: Any, *, engine: SimulatedEngine | None = None, trainer: Any = None,
         **extra: Any) -> Pipeline:
    cfg = sim_config(tmp_path, **{"engine.simulated.completion_tokens": 3, "sampling.max_new_tokens": 3, **extra})
    p = Pipeline(cfg, prompts=ROWS, environment=env, engines=[engine] if engine else None, trainer=trainer,
                 console=False)
    p.run_sync()
    return p


def test_the_tokens_trained_are_exactly_the_engines_then_the_environments(tmp_path: Path) -> None:
    """Token in, token out: every trained completion is its turns' sampled tokens (mask 1, the
    engine's log-probs) and the environment's rendered replies (mask 0, log-prob 0) in order, and
    each later turn's prompt is the group's prompt followed by exactly the tokens so far."""
    engine, trainer = RecordingEngine(name="rec"), KeepingTrainer()
    Echo.log.clear()
    p = _run(tmp_path, Echo, engine=engine, trainer=trainer, **{"sampling.n": 3})
    assert_accounted(p, p.summary)
    tok = p.tokenizer
    reply_ids = {reply: tok(reply, add_special_tokens=False)["input_ids"] for _, _, reply in Echo.log}
    by_prompt = {}  # (group, prompt tokens) -> (completion tokens, log-probs, version) of later turns
    firsts = {}
    for req, version, comps in engine.calls:
        if req.turn == 0:
            firsts[req.group_id] = (comps, version)
        else:
            by_prompt[(req.group_id, tuple(req.prompt.token_ids))] = (comps[0], version)
    checked = 0
    for batch in trainer.batches:
        for g in batch.groups:
            prompt = list(g.prompt.token_ids)
            assert prompt == tok(f"q{g.prompt.id}:", add_special_tokens=False)["input_ids"]
            first, v0 = firsts[g.group_id]
            assert v0 == g.version
            for i, c in enumerate(g.completions):
                ids, lps, mask = c.token_ids.tolist(), c.logprobs.tolist(), c.mask.tolist()
                assert c.turns == 3 and c.env_reward == 3.0 and c.finish_reason == "stop"
                sampled, sampled_lp = first[i]
                pos = 0
                for turn in range(3):
                    assert ids[pos:pos + len(sampled)] == sampled and lps[pos:pos + len(sampled)] == sampled_lp
                    assert all(mask[pos:pos + len(sampled)])
                    pos += len(sampled)
                    if turn == 2:
                        break
                    reply = reply_ids[f" r{turn + 1} "]
                    assert ids[pos:pos + len(reply)] == reply and not any(mask[pos:pos + len(reply)])
                    assert lps[pos:pos + len(reply)] == [0.0] * len(reply)
                    pos += len(reply)
                    (sampled, sampled_lp), v = by_prompt[(g.group_id, tuple(prompt + ids[:pos]))]
                    assert v == g.version  # every turn on the group's version
                assert pos == len(ids)
                checked += 1
    assert checked == p.summary["groups_trained"] * 3 > 0


@pytest.mark.parametrize("K,seed", [(0, 1), (1, 2), (2, 3), (1, 4)])
def test_the_staleness_bound_holds_over_episodes_of_random_lengths_and_latencies(tmp_path: Path, K: int,
                                                                                  seed: int) -> None:
    """Episodes end out of order (random lengths and step latencies, random engine latency); every
    trained group is within K of the step that trained it, counted from its episodes' start, and
    every turn of a group was sampled with the version it was admitted with."""
    engine = RecordingEngine(seed=seed, name="rec")
    engine.cfg = engine.cfg.__class__(latency_s=0.002 * seed, turn_latency_s=0.003, completion_tokens=3)
    p = _run(tmp_path, lambda: Random(latency=0.01), engine=engine, K=K, B=3, steps=8,
             **{"sampling.n": 3, "env.max_turns": 5, "seed": seed})
    r = assert_accounted(p, p.summary)
    versions: dict[int, set[int]] = {}
    for req, version, _ in engine.calls:
        versions.setdefault(req.group_id, set()).add(version)
    turns = []
    for i in range(r.num_groups):
        g = r.group(i)
        if g["fate"] == "trained":
            assert 0 <= (g["step"] - 1) - g["version"] <= K
            assert versions[g["group_id"]] == {g["version"]}
            turns += list(g["turns"])
    assert p.summary["staleness_max"] <= K
    assert len(set(turns)) >= 3, f"episode lengths too alike to test anything: {sorted(set(turns))}"


def test_an_environment_that_raises_or_hangs_fails_its_group_not_the_run(tmp_path: Path) -> None:
    p = _run(tmp_path, Flaky, steps=4, **{"env.step_timeout_s": 0.5})
    assert p.summary["error"] is None and p.summary["steps"] == 4
    failed = p.summary["groups_failed"]
    assert failed.get("env_error", 0) >= 1 and failed.get("env_timeout", 0) >= 1, failed
    r = assert_accounted(p, p.summary)
    reasons = {str(r.groups["prompt_id"][i])[-1]: str(r.groups["reason"][i]) for i in range(r.num_groups)
               if r.groups["fate"][i] == "failed"}
    assert reasons.get("3") in (None, "env_error") and reasons.get("7") in (None, "env_timeout")
    # the environment's own traceback, down to the line that raised, is in events.jsonl
    import json

    events = [json.loads(line) for line in (p.run_dir / "events.jsonl").read_text().splitlines()]
    raised = [e for e in events if e["event"] == "group_failed" and e["reason"] == "env_error"]
    assert raised and all('raise KeyError("the tool crashed")' in e["exception"] and "episode_envs.py" in e["exception"]
                          for e in raised)


def test_max_turns_and_the_token_budget_end_episodes(tmp_path: Path) -> None:
    p = _run(tmp_path, Endless, steps=2, **{"env.max_turns": 4})
    r = assert_accounted(p, p.summary)
    g = r.group(0)
    assert list(g["turns"]) == [4, 4] and {c[2] for c in g["completions"]} == {"max_turns"}
    # docs/environments.md: an episode cut short gets the rewards of the steps it took, its last
    # turn's included: Endless pays 1 a step, so 4 turns earn exactly 4
    for i in range(r.num_groups):
        assert list(r.group(i)["env_rewards"]) == [4.0, 4.0] and list(r.group(i)["rewards"]) == [4.0, 4.0]

    budget = 16
    p = _run(tmp_path / "b", Endless, steps=2, **{"env.max_turns": 50, "env.max_episode_tokens": budget})
    r = assert_accounted(p, p.summary)
    for i in range(r.num_groups):
        g = r.group(i)
        for tokens, _, finish in g["completions"]:
            assert finish == "length" and len(g["prompt_token_ids"]) + len(tokens) <= budget
        assert list(g["env_rewards"]) == [float(t) for t in g["turns"]] == list(g["rewards"])  # a step a turn


def test_the_rollout_log_holds_each_episodes_mask_and_turns(tmp_path: Path) -> None:
    p = _run(tmp_path, Echo, steps=2)
    r = read_rollouts(p.run_dir / "rollouts.zarr")
    assert r.mask.shape == r.tokens.shape and 0 < r.mask.sum() < r.mask.size
    assert set(r.completions["turns"].tolist()) == {3}
    assert np.all(r.logprobs[~r.mask] == 0)


def test_rewards_env_functions_or_their_sum(tmp_path: Path) -> None:
    def length(prompts: list[str], completions: list[str], **kw: Any) -> list[float]:
        return [float(len(c)) for c in completions]

    # a weight of 2: the weighted total and each part's own (unweighted) values differ
    for mode, expect in (("env", lambda env, fn: env), ("functions", lambda env, fn: 2 * fn),
                         ("sum", lambda env, fn: env + 2 * fn)):
        cfg = sim_config(tmp_path / mode, steps=2, **{"env.reward": mode, "engine.simulated.completion_tokens": 3,
                                                      "sampling.max_new_tokens": 3})
        trainer = KeepingTrainer()
        p = Pipeline(cfg, prompts=ROWS, environment=Echo, reward=length, reward_weights=[2.0], trainer=trainer,
                     console=False)
        p.run_sync()
        g = trainer.batches[0].groups[0]
        texts = [p.tokenizer.decode(c.token_ids.tolist(), skip_special_tokens=True) for c in g.completions]
        fn = np.array([len(t) for t in texts], dtype=float)
        np.testing.assert_allclose(g.rewards, expect(np.full(2, 3.0), fn))
        assert p.scoring.names == {"env": ["env"], "functions": ["length"], "sum": ["env", "length"]}[mode]
        step1 = trainer.batches[0].groups
        if mode != "env":  # reward/<function> is the function's own mean over the step's batch, unweighted
            lengths = [len(p.tokenizer.decode(c.token_ids.tolist(), skip_special_tokens=True))
                       for gr in step1 for c in gr.completions]
            assert p.metrics_rows[0]["reward/length"] == pytest.approx(np.mean(lengths))
        if mode != "functions":
            assert p.metrics_rows[0]["reward/env"] == pytest.approx(3.0)


@pytest.mark.parametrize("engine_kind", ["transformers", "vllm_server"])
def test_chat_episodes_on_real_engines_keep_the_logprob_check(tmp_path: Path, model_dir: Path,
                                                             engine_kind: str) -> None:
    """Chat episodes with tool replies on the tiny model, in the transformers engine and over HTTP
    through the vLLM server stand-in (token-id prompts): the trainer's log-probs of the sampled tokens
    match the engine's, with the replies as context."""
    import asyncio
    import json

    from vllm_stand_in import VLLMStandIn

    from pipeline.config.schema import SamplingConfig, TransformersEngineConfig
    from pipeline.config.io import load_config
    from pipeline.engines.transformers import TransformersEngine
    from pipeline.observe.metrics import read_jsonl

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": str(i)}) + "\n" for i in range(40)))
    sets = {"out": str(tmp_path / "run"), "model.path": str(model_dir), "trainer.separate_process": False,
            "sampling.n": 2, "sampling.max_new_tokens": 6, "pipeline.steps": 3, "pipeline.batch_groups": 2,
            "pipeline.logprob_check_every": 1, "log.progress": False, "data.train": str(rows),
            "env.factory": "tests/episode_envs.py:ChatTool", "env.max_turns": 3}

    async def main() -> Pipeline:
        if engine_kind == "transformers":
            p = Pipeline(load_config(None, sets), console=False)
            await p.run()
            return p
        inner = TransformersEngine(model_dir, sampling=SamplingConfig(), cfg=TransformersEngineConfig(),
                                   device="cpu", dtype="float32", max_loaded_adapters=3, seed=0, name="inner")
        await inner.start()
        stub = VLLMStandIn(inner, model_name="tiny")
        url = await stub.start()
        try:
            p = Pipeline(load_config(None, {**sets, "engine.kind": "vllm_server",
                                            "engine.vllm_server.urls": [url]}), console=False)
            await p.run()
        finally:
            await stub.close()
            await inner.close()
        assert any(len(r["prompt"]) > 40 for r in stub.requests), "later turns reached the server as token ids"
        return p

    p = asyncio.run(main())
    r = assert_accounted(p, p.summary)
    assert set(r.completions["turns"].tolist()) == {3} and 0 < r.mask.sum() < r.mask.size
    text = p.tokenizer.decode(r.tokens[~r.mask].tolist())
    assert "<|im_start|>tool\ncalculator:" in text  # the replies, rendered as chat tool turns
    checks = [row for row in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "check/max_abs_diff" in row]
    assert checks and max(c["check/max_abs_diff"] for c in checks) < 1e-3, checks
    assert all(c["check/tokens"] <= r.mask.sum() for c in checks)


class Lookup(ToolEnvironment):
    """A tool environment of a user's own: one tool, the answer scored 1."""

    def lookup(self, key: str) -> str:
        """Find a key in the table of answers.

        Args:
            key: The key to look up.
        """
        return key.upper()

    def score(self, action: str) -> float:
        return 1.0


class TRLWeather:
    """A class written for TRL's environment_factory: public methods are its tools."""

    def reset(self, **row: Any) -> None:
        return None

    def forecast(self, city: str, days: int) -> str:
        """Tomorrow's weather in a city.

        Args:
            city: The city.
            days: How many days ahead.
        """
        return "sunny"


# a template that prints what it is given as `tools`, then ChatML
PRINTS_TOOLS = ("{% for tool in tools %}TOOL {{ tool.function.name }}: {{ tool.function.description }} "
                "({{ tool.function.parameters.properties | list | join(', ') }})\n{% endfor %}"
                "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("env, shown", [
    (Lookup, "TOOL lookup: Find a key in the table of answers. (key)\n"),
    (from_trl(TRLWeather), "TOOL forecast: Tomorrow's weather in a city. (city, days)\n"),
], ids=["tool_environment", "from_trl"])
def test_an_environments_tool_schemas_reach_the_model_through_the_chat_template(tmp_path: Path, env: Any,
                                                                                shown: str) -> None:
    template = tmp_path / "tools.jinja"
    template.write_text(PRINTS_TOOLS)
    cfg = sim_config(tmp_path, steps=2, **{"engine.simulated.completion_tokens": 3, "sampling.max_new_tokens": 3,
                                           "data.chat_template": str(template), "eval.every": 1, "eval.n": 2})
    rows = [{"id": str(i), "prompt": f"question {i}"} for i in range(16)]
    p = Pipeline(cfg, prompts=rows, eval_prompts=rows[:2], environment=env, console=False)
    p.run_sync()
    assert p.summary["accounting_ok"] and p.summary["groups_trained"] == 4
    r = read_rollouts(p.run_dir / "rollouts.zarr")
    assert set(r.groups["fate"].tolist()) == {"trained", "eval"}
    for i in range(r.num_groups):  # every group's prompt, eval rounds too, as the engine got it
        g = r.group(i)
        text = p.tokenizer.decode(list(g["prompt_token_ids"]))
        assert text.startswith(shown) and "<|im_start|>user\nquestion " in text, text


def test_eval_rounds_run_episodes_too(tmp_path: Path) -> None:
    """An evaluation round samples each eval prompt's episodes like a training group, and logs them."""
    cfg = sim_config(tmp_path, steps=2, **{"eval.every": 1, "eval.n": 2, "engine.simulated.completion_tokens": 3,
                                           "sampling.max_new_tokens": 3})
    p = Pipeline(cfg, prompts=ROWS, eval_prompts=[{"id": f"e{i}", "turns": 2} for i in range(3)], environment=Echo,
                 console=False)
    p.run_sync()
    assert [row["eval/groups"] for row in p.eval_rows] == [3, 3, 3] and all(row["eval/failed"] == 0
                                                                          for row in p.eval_rows)
    assert all(row["eval/reward_mean"] == 2.0 for row in p.eval_rows)  # two steps of reward 1 each
    r = read_rollouts(p.run_dir / "rollouts.zarr")
    evals = [i for i in range(r.num_groups) if r.groups["fate"][i] == "eval"]
    assert len(evals) == 9 and all(list(r.group(i)["turns"]) == [2, 2] for i in evals)


class TurnVersions(SimulatedEngine):
    """The simulated engine, remembering each turn's last_version per group."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.last: dict[int, list[int]] = {}

    async def generate(self, request: GroupRequest, adapter: AdapterRef) -> Any:
        gen = await super().generate(request, adapter)
        self.last.setdefault(request.group_id, []).append(gen.last_version)
        return gen

    async def generate_many(self, requests: Any, adapter: AdapterRef) -> Any:
        out = await super().generate_many(requests, adapter)
        for r, g in zip(requests, out):
            self.last.setdefault(r.group_id, []).append(g.last_version)
        return out


def test_an_episode_carried_across_in_flight_swaps_names_the_newest_version_of_its_turns(tmp_path: Path) -> None:
    """Full weights swapped in flight: an episode's later turns may be sampled with newer weights than
    its first; its group keeps the first version as its label and records the newest turn's."""
    engine = TurnVersions(name="turns", full_weights=True, in_flight=True)
    engine.cfg = engine.cfg.__class__(latency_s=0.004, turn_latency_s=0.004, completion_tokens=3)
    p = _run(tmp_path, lambda: Random(latency=0.005), engine=engine, K=1, B=3, steps=8, step_s=0.01,
             **{"sampling.n": 3, "env.max_turns": 5, "seed": 2, "trainer.update": "full",
                "pipeline.full_weight_swap": "in_flight"})
    r = assert_accounted(p, p.summary)
    trained = [r.group(i) for i in range(r.num_groups) if r.groups["fate"][i] == "trained"]
    for g in trained:
        assert g["last_version"] == max(engine.last[g["group_id"]]) >= g["version"]
    assert sum(g["last_version"] > g["version"] for g in trained) == p.summary["groups_spanning_versions"] > 0
    assert p.summary["staleness_max"] <= 1
