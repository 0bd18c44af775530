"""Environments: the runner's checks, timeouts and threads; loading by import path; tool use; the
calculator task and the example game; observations rendered as tokens that extend the policy's."""

from __future__ import annotations

import asyncio
import json
import math
import random
import threading
import time
from typing import Any, Mapping

import numpy as np
import pytest

from pipeline.config.schema import TaskConfig
from pipeline.envs import (
    EnvError,
    Environment,
    EnvRunner,
    EnvStep,
    EnvTimeoutError,
    ToolEnvironment,
    ToolUser,
    from_trl,
    load_environment_factory,
    parse_hermes_call,
)
from pipeline.errors import ConfigError, PromptError, RecoverableError
from pipeline.models.builtin import build_tokenizer
from pipeline.data.prompts import PromptBuilder, end_of_turn_token, render_observation
from pipeline.data.tasks import (CALL_REWARD, DIGITS, SUM_DIGITS, CalculatorEnv, build_task, calculator_reply,
                            calculator_score)

ROW = {"id": "r0", "prompt": "2+3 calc:", "answer": "5"}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def episode(env: Any, actions: list[str], row: Mapping[str, Any] = ROW, timeout_s: float = 5.0
                  ) -> tuple[Any, list[EnvStep]]:
    """reset, then one step per action until done: (first observation, steps)."""
    runner = EnvRunner(env, step_timeout_s=timeout_s)
    first = await runner.reset(row)
    steps = []
    for a in actions:
        steps.append(await runner.step(a))
        if steps[-1].done:
            break
    await runner.close()
    return first, steps


# --------------------------------------------------------------------------- the runner


class Recording:
    """A sync environment that records the thread of each call; `out` is what step returns."""

    def __init__(self, out: Any = None, delay_s: float = 0.0) -> None:
        self.out = EnvStep("next", reward=0.5) if out is None else out
        self.delay_s = delay_s
        self.threads: list[int] = []
        self.closed = 0

    def reset(self, row: Mapping[str, Any]) -> str:
        self.threads.append(threading.get_ident())
        return row["prompt"]

    def step(self, action: str) -> Any:
        self.threads.append(threading.get_ident())
        time.sleep(self.delay_s)
        return self.out

    def close(self) -> None:
        self.closed += 1


class AsyncEcho:
    """An async environment: replies with the action, done after `turns` steps."""

    def __init__(self, turns: int = 2, delay_s: float = 0.0) -> None:
        self.turns = turns
        self.delay_s = delay_s
        self.threads: list[int] = []

    async def reset(self, row: Mapping[str, Any]) -> list[dict[str, str]]:
        self.threads.append(threading.get_ident())
        return [{"role": "user", "content": row["prompt"]}]

    async def step(self, action: str) -> EnvStep:
        self.threads.append(threading.get_ident())
        await asyncio.sleep(self.delay_s)
        self.turns -= 1
        return EnvStep(f"echo {action}", reward=1.0, done=self.turns == 0)


def test_a_sync_environment_runs_off_the_event_loop() -> None:
    env = Recording()

    async def main() -> int:
        await episode(env, ["a", "b"])
        return threading.get_ident()

    loop_thread = run(main())
    assert len(env.threads) == 3 and loop_thread not in env.threads
    assert env.closed == 1


def test_an_async_environment_is_awaited_on_the_loop() -> None:
    env = AsyncEcho(turns=2)

    async def main() -> tuple[int, Any, list[EnvStep]]:
        first, steps = await episode(env, ["a", "b", "c"])
        return threading.get_ident(), first, steps

    loop_thread, first, steps = run(main())
    assert set(env.threads) == {loop_thread}
    assert first == [{"role": "user", "content": "2+3 calc:"}]
    assert [s.observation for s in steps] == ["echo a", "echo b"] and steps[-1].done
    assert isinstance(env, Environment) and not isinstance(Recording(), ToolUser)


def test_a_sync_method_returning_a_coroutine_is_awaited() -> None:
    class Deferred(Recording):
        def step(self, action: str) -> Any:
            async def later() -> EnvStep:
                return EnvStep(f"later {action}", done=True)
            return later()

    _, [step] = run(episode(Deferred(), ["a"]))
    assert step == EnvStep("later a", done=True)


def test_a_four_tuple_and_numpy_values_become_an_env_step() -> None:
    env = Recording(out=({"role": "tool", "content": "5"}, np.float32(1.5), np.bool_(True), None))
    _, [step] = run(episode(env, ["a"]))
    assert step == EnvStep([{"role": "tool", "content": "5"}], reward=1.5, done=True, info={})
    assert type(step.reward) is float and type(step.done) is bool


@pytest.mark.parametrize("out, words", [
    (("o", None, False, {}), "reward of NoneType"),
    (("o", float("nan"), False, {}), "non-finite reward (nan)"),
    (("o", math.inf, False, {}), "non-finite reward (inf)"),
    (("o", "1.0", False, {}), "reward of str"),
    (("o", True, False, {}), "reward of bool"),
    (("o", 1.0, 1, {}), "done = 1 (int); it must be a bool"),
    ((5, 1.0, False, {}), "observation of int"),
    (([{"role": "user"}], 1.0, False, {}), "observation of list"),
    (([], 1.0, False, {}), "observation of list"),
    ((None, 0.0, False, {}), "no observation (None) for an episode that goes on"),
    (("o", 1.0, False, ["x"]), "info of list"),
    (("o", 1.0), "must return an EnvStep or a tuple"),
    ("obs", "must return an EnvStep or a tuple"),
])
def test_a_bad_step_is_refused_with_what_was_wrong(out: Any, words: str) -> None:
    runner = EnvRunner(Recording(out=out), step_timeout_s=5.0)

    async def main() -> None:
        await runner.reset(ROW)
        await runner.step("a")

    with pytest.raises(EnvError, match="Recording.step") as e:
        run(main())
    assert words in str(e.value) and e.value.reason == "env_error" and isinstance(e.value, RecoverableError)
    assert runner.finished


def test_reset_must_return_an_observation() -> None:
    class NoPrompt(Recording):
        def reset(self, row: Mapping[str, Any]) -> None:
            return None

    with pytest.raises(EnvError, match="reset returned None"):
        run(EnvRunner(NoPrompt(), step_timeout_s=5.0).reset(ROW))


@pytest.mark.parametrize("make", [lambda: Recording(delay_s=2.0), lambda: AsyncEcho(delay_s=2.0)],
                         ids=["sync", "async"])
def test_a_step_over_the_timeout_raises_the_timeout_error(make: Any) -> None:
    runner = EnvRunner(make(), step_timeout_s=0.1)

    async def main() -> float:
        await runner.reset(ROW)
        t = time.perf_counter()
        with pytest.raises(EnvTimeoutError, match=r"step took longer than env.step_timeout_s = 0.1 s") as e:
            await runner.step("a")
        assert e.value.reason == "env_timeout" and isinstance(e.value, EnvError)
        return time.perf_counter() - t

    assert run(main()) < 1.5  # it stopped waiting at the timeout, not when the step returned
    assert runner.finished


def test_a_step_that_raises_is_wrapped_with_its_cause() -> None:
    class Broken(Recording):
        def step(self, action: str) -> EnvStep:
            raise KeyError("no such state")

    runner = EnvRunner(Broken(), step_timeout_s=5.0)

    async def main() -> None:
        await runner.reset(ROW)
        await runner.step("a")

    with pytest.raises(EnvError, match="Broken.step raised KeyError: 'no such state'") as e:
        run(main())
    assert isinstance(e.value.__cause__, KeyError) and e.value.reason == "env_error"

    class OwnTimeout(Recording):
        def step(self, action: str) -> EnvStep:
            raise TimeoutError("the sandbox did not answer")

    with pytest.raises(EnvError, match="raised TimeoutError: the sandbox did not answer") as e:
        run(episode(OwnTimeout(), ["a"]))
    assert e.value.reason == "env_error" and not isinstance(e.value, EnvTimeoutError)
    with pytest.raises(RuntimeError, match="stepped after its episode ended"):
        run(runner.step("b"))


def test_no_step_after_done_and_close_never_raises() -> None:
    class BadClose(Recording):
        def close(self) -> None:
            self.closed += 1
            raise OSError("already gone")

    env = BadClose(out=EnvStep(None, reward=1.0, done=True))
    runner = EnvRunner(env, step_timeout_s=5.0)

    async def main() -> None:
        await runner.reset(ROW)
        assert (await runner.step("a")).done
        with pytest.raises(RuntimeError, match="stepped after its episode ended"):
            await runner.step("b")
        await runner.close()
        await runner.close()

    run(main())
    assert env.closed == 1


def test_open_builds_the_instance_and_wraps_a_failing_factory() -> None:
    runner = run(EnvRunner.open(CalculatorEnv, step_timeout_s=5.0))
    assert isinstance(runner.env, CalculatorEnv)

    def broken() -> Any:
        raise RuntimeError("no sandbox")

    with pytest.raises(EnvError, match=r"broken\(\) raised RuntimeError: no sandbox"):
        run(EnvRunner.open(broken, step_timeout_s=5.0))
    with pytest.raises(TypeError, match="is not an environment"):
        EnvRunner(object(), step_timeout_s=5.0)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- loading by import path


def test_the_factory_loads_from_a_file_and_from_a_module() -> None:
    game = load_environment_factory("examples/multi_turn/guess.py:GuessNumber")
    assert game.__name__ == "GuessNumber" and isinstance(game(), Environment)
    assert load_environment_factory("pipeline.data.tasks:CalculatorEnv") is CalculatorEnv


@pytest.mark.parametrize("entry, words", [
    ("examples/multi_turn/missing.py:Game", "does not exist"),
    ("examples/multi_turn/guess.py:Missing", "has no attribute 'Missing'"),
    ("examples/multi_turn/guess.py:MAX_GUESSES", "is a int, not a function"),
    ("no_such_package.envs:Game", "importing 'no_such_package.envs' failed: ModuleNotFoundError"),
])
def test_a_bad_factory_entry_names_the_key(entry: str, words: str) -> None:
    with pytest.raises(ConfigError, match=r"env\.factory entry") as e:
        load_environment_factory(entry)
    assert words in str(e.value)


# --------------------------------------------------------------------------- the example game


def test_the_guessing_game_answers_higher_lower_and_rewards_finding_it() -> None:
    row = {"id": "g1", "prompt": "", "secret": 13}
    game = load_environment_factory("examples/multi_turn/guess.py:GuessNumber")
    first, steps = run(episode(game(), ["10", "15", "13"], row=row))
    assert first.startswith("Guess my number")
    assert [s.observation for s in steps] == [" higher. Guess:", " lower. Guess:", None]
    assert steps[-1].done and sum(s.reward for s in steps) == pytest.approx(0.6)
    _, lost = run(episode(game(), ["1", "2", "x", "3"], row=row))
    assert lost[-1].done and len(lost) == 4 and sum(s.reward for s in lost) == 0.0
    _, won = run(episode(game(), ["  13!"], row=row))
    assert sum(s.reward for s in won) == 1.0


def test_the_guessing_game_draws_a_fixed_secret_per_row() -> None:
    game = load_environment_factory("examples/multi_turn/guess.py:GuessNumber")

    def bisect(row: Mapping[str, Any]) -> float:
        env = game()
        env.reset(row)
        lo, hi, total = 1, 20, 0.0
        for _ in range(5):
            guess = (lo + hi) // 2
            step = env.step(str(guess))
            total += step.reward
            if step.done:
                return total
            lo, hi = (guess + 1, hi) if "higher" in step.observation else (lo, guess - 1)
        return total

    secrets = set()
    for i in range(40):
        a, b = game(), game()
        a.reset({"id": f"p{i}"})
        b.reset({"id": f"p{i}"})
        assert a.secret == b.secret and 1 <= a.secret <= 20
        secrets.add(a.secret)
    assert len(secrets) > 5
    first = game()
    first.reset({"id": "p1"})
    assert first.secret == 8  # crc32, not hash(): the same number in every process, so a resumed run replays it
    assert bisect({"id": "p1", "secret": 10}) == 1.0 and bisect({"id": "p1", "secret": 20}) < 1.0


# --------------------------------------------------------------------------- tool use


class Calculator(ToolEnvironment):
    """Tools: add and divide; the answer is scored against the row's."""

    def reset(self, row: Mapping[str, Any]) -> Any:
        self.answer = row["answer"]
        return super().reset(row)

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        return a + b

    def divide(self, a: float, b: float) -> float:
        """Divide a by b.

        Args:
            a: The dividend.
            b: The divisor.
        """
        return a / b

    def score(self, action: str) -> float:
        return float(action.strip() == self.answer)


def call(name: str, **args: Any) -> str:
    import json

    return f'Let me compute. <tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def test_a_tool_call_is_parsed_run_and_observed_then_the_answer_scored() -> None:
    env = Calculator()
    assert set(env.tools) == {"add", "divide"}  # the base class's own methods are not tools
    _, steps = run(episode(env, [call("add", a=2, b=3), "5"]))
    assert steps[0] == EnvStep([{"role": "tool", "name": "add", "content": "5"}], info={"tool": "add"})
    assert steps[1] == EnvStep(None, reward=1.0, done=True)


@pytest.mark.parametrize("action, words, error", [
    (call("multiply", a=2, b=3), "no tool named 'multiply' (tools: add, divide)", "unknown_tool"),
    (call("add", a=2), "bad arguments for add: missing a required argument: 'b'", "bad_arguments"),
    (call("add", a=2, b=3, c=4), "bad arguments for add", "bad_arguments"),
    (call("divide", a=1, b=0), "error: ZeroDivisionError: division by zero", "raised"),
    ("<tool_call>{'name': 'add'}</tool_call>", "not valid JSON", "malformed"),
    ('<tool_call>{"arguments": {}}</tool_call>', "must be a JSON object {\"name\"", "malformed"),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "arguments must be an object", "malformed"),
])
def test_a_bad_tool_call_is_answered_and_the_episode_goes_on(action: str, words: str, error: str) -> None:
    _, steps = run(episode(Calculator(), [action, "5"]))
    [message] = steps[0].observation
    assert message["role"] == "tool" and words in message["content"]
    assert not steps[0].done and steps[0].info["tool_error"] == error
    assert steps[1].done and steps[1].reward == 1.0


def test_tools_given_by_name_and_the_hermes_parser() -> None:
    def lookup(key: str) -> str:
        """Look a key up.

        Args:
            key: The key.
        """
        return key.upper()

    env = ToolEnvironment(tools={"find": lookup})
    assert list(env.tools) == ["find"] and env.tool_schemas()[0]["function"]["name"] == "find"
    _, steps = run(episode(env, [call("find", key="abc"), "done"]))
    assert steps[0].observation[0]["content"] == "ABC" and steps[1] == EnvStep(None, reward=0.0, done=True)
    assert parse_hermes_call("no call here") is None
    assert parse_hermes_call('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}') == ("f", {"x": 1})


def test_tool_schemas_come_from_signatures_and_docstrings() -> None:
    schemas = {s["function"]["name"]: s["function"] for s in Calculator().tool_schemas()}
    assert set(schemas) == {"add", "divide"}
    add = schemas["add"]
    assert add["description"] == "Add two integers."
    assert add["parameters"]["properties"] == {"a": {"type": "integer", "description": "The first number."},
                                               "b": {"type": "integer", "description": "The second number."}}
    assert add["parameters"]["required"] == ["a", "b"]

    def undocumented(x: int) -> int:
        return x

    with pytest.raises(ConfigError, match="tool 'mine' has no schema"):
        ToolEnvironment(tools={"mine": undocumented}).tool_schemas()


class TRLGame:
    """A TRL environment_factory class: reset(**row), public methods as tools, get_reward()."""

    def reset(self, **row: Any) -> str:
        self.target = row["answer"]
        self.reward = 0.0
        return " (use the tools)"

    def check(self, guess: str) -> str:
        """Check a guess.

        Args:
            guess: The guess.
        """
        self.reward = float(guess == self.target)
        return "right" if self.reward else "wrong"

    def get_reward(self) -> float:
        return self.reward


def test_a_trl_environment_runs_through_from_trl() -> None:
    make = from_trl(TRLGame)
    env = make()
    assert list(env.tools) == ["check"]  # reset and get_reward are not tools, as in TRL
    first, steps = run(episode(env, [call("check", guess="5"), "I am done"]))
    assert first == "2+3 calc: (use the tools)"
    assert steps[0].observation[0]["content"] == "right"
    assert steps[1] == EnvStep(None, reward=1.0, done=True)
    chat = {"id": "c", "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], "answer": "5"}
    first, _ = run(episode(make(), ["x"], row=chat))
    assert first[1] == {"role": "user", "content": "q (use the tools)"} and chat["prompt"][1]["content"] == "q"


# --------------------------------------------------------------------------- the calculator task


def test_the_calculator_task_builds_rows_and_an_environment() -> None:
    task = build_task(TaskConfig(name="calculator", num_prompts=64, seed=3), max_new_tokens=16)
    assert task.name == "calculator" and task.environment is CalculatorEnv and len(task.prompts) == 64
    for row in task.prompts:
        assert row["prompt"] == f"{row['a']}+{row['b']} calc:" and row["answer"] == str(row["a"] + row["b"])
        assert 20 <= row["a"] + row["b"] <= 98
    assert len({r["answer"] for r in task.prompts}) > 20
    assert build_task(TaskConfig(name="char_class"), 16).environment is None


def scripted(actions: list[str], row: Mapping[str, Any]) -> tuple[float, list[EnvStep]]:
    _, steps = run(episode(CalculatorEnv(), actions, row=row))
    return sum(s.reward for s in steps), steps


def test_a_perfect_calculator_policy_scores_one_and_one_without_calls_zero() -> None:
    task = build_task(TaskConfig(name="calculator", num_prompts=32), max_new_tokens=16)
    for row in task.prompts:
        answer = row["answer"]
        total, steps = scripted(["=", answer], row)
        assert total == pytest.approx(1.0) and len(steps) == 2 and steps[-1].done
        assert steps[0].reward == CALL_REWARD
        assert steps[0].observation == calculator_reply(answer) and steps[0].info == {"called": True}
        assert steps[0].observation.endswith(answer)
        # without a call the episode ends at once, worth nothing, whatever the first turn says
        total, steps = scripted([answer, answer], row)
        assert total == 0.0 and len(steps) == 1 and steps[0] == EnvStep(None, 0.0, True, {"called": False})
    # partial credit: digits, the sum's digits, exactly the sum
    row = task.prompts[0]
    answer, wrong = row["answer"], next(d for d in "0123456789" if d not in row["answer"])
    def answer_part(score: float) -> float:
        return pytest.approx(CALL_REWARD + (1 - CALL_REWARD) * score)

    assert scripted(["=", wrong * 16], row)[0] == answer_part(DIGITS)
    assert scripted(["=", answer[-1] * 16], row)[0] == answer_part(DIGITS + SUM_DIGITS)
    assert scripted(["=", "xyz"], row)[0] == answer_part(0.0)
    assert scripted(["calc: =", f"  {answer}\n"], row)[0] == pytest.approx(1.0)


def test_the_calculator_reward_stays_in_zero_one_for_any_text() -> None:
    rng = random.Random(0)
    task = build_task(TaskConfig(name="calculator", num_prompts=16), max_new_tokens=16)
    alphabet = "0123456789= ?abc\n\ufffd\u0663"  # U+0663: a digit to str.isdigit, not to the reward
    seen = set()
    for _ in range(400):
        row = rng.choice(task.prompts)
        actions = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 16))) for _ in range(2)]
        total, steps = scripted(actions, row)
        assert 0.0 <= total <= 1.0 and steps[-1].done
        seen.add(round(total, 1))
    assert len(seen) > 5
    assert calculator_score("", "42") == 0.0 and calculator_score("\u0663\u0663", "42") == 0.0


def test_the_calculator_reward_function_reads_the_answer_off_the_transcript() -> None:
    task = build_task(TaskConfig(name="calculator", num_prompts=8), max_new_tokens=16)
    transcripts, answers, env_rewards = [], [], []
    for row, (a1, a2) in zip(task.prompts, [("=", None), ("x", "7"), ("a=b", "1 1"), ("=", "")] * 2):
        a2 = row["answer"] if a2 is None else a2
        total, steps = scripted([a1, a2], row)
        transcripts.append(a1 + (steps[0].observation or "") + (a2 if len(steps) == 2 else ""))
        answers.append(row["answer"])
        env_rewards.append(total)
    assert task.reward([""] * 8, transcripts, answer=answers) == pytest.approx(env_rewards)
    assert task.reward([""], [answers[0]], answer=[answers[0]]) == [0.0]  # no call, no grade


# --------------------------------------------------------------------------- observations as tokens

TOK = build_tokenizer()
IM_END = TOK.convert_tokens_to_ids("<|im_end|>")


def ids(text: str, tok: Any = TOK) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def chat_ids(messages: list[dict[str, Any]], tok: Any = TOK, template: str | None = None,
             tools: list[dict[str, Any]] | None = None) -> list[int]:
    return ids(tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                       add_generation_prompt=True, tools=tools), tok)


def conversation_tokens(tok: Any, template: str | None, turns: list[tuple[list[int], Any]], eot: int | None,
                        ended: bool = True, tools: list[dict[str, Any]] | None = None
                        ) -> tuple[list[int], list[dict[str, Any]]]:
    """prompt + (sampled turn + rendered observation)... as the episode runner appends them, and the
    conversation they stand for. The policy's turns are ids that were never text."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2+3?"}]
    builder = PromptBuilder(tok, max_new_tokens=4, chat_template=template)
    seq = list(builder.build({"prompt": messages}, tools=tools).token_ids)
    for sampled, observation in turns:
        seq += sampled + ([eot] if ended and eot is not None else [])
        seq += render_observation(tok, observation, chat=True, chat_template=template, turn_ended=ended,
                                  tools=tools)
        messages.append({"role": "assistant", "content": tok.decode(sampled)})
        messages += [{"role": "user", "content": observation}] if isinstance(observation, str) else observation
    return seq, messages


TOOL = [{"role": "tool", "content": "5"}]
TURNS = [(ids("<tool_call>add</tool_call>"), TOOL), (ids("So 5?"), "Yes. And 2+4?"),
         (ids("twice"), [{"role": "tool", "content": "3"}, {"role": "tool", "content": "3"}])]


def test_chatml_tokens_in_tokens_out() -> None:
    assert end_of_turn_token(TOK) == IM_END
    seq, messages = conversation_tokens(TOK, None, TURNS, IM_END)
    assert seq == chat_ids(messages)
    reply = render_observation(TOK, TOOL, chat=True)
    assert TOK.decode(reply) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    # a turn cut at max_new_tokens has no end token: the reply closes it first
    cut = render_observation(TOK, TOOL, chat=True, turn_ended=False)
    assert cut == [IM_END, *reply]
    seq, messages = conversation_tokens(TOK, None, TURNS, IM_END, ended=False)
    assert seq == chat_ids(messages)


def test_tool_schemas_are_in_the_prompt_and_the_conversation_stays_token_exact() -> None:
    schemas = Calculator().tool_schemas()
    builder = PromptBuilder(TOK, max_new_tokens=4)
    text = builder.build({"id": "q", "prompt": "What is 2+3?"}, tools=schemas).text  # a string: made a chat
    assert text.startswith("<|im_start|>system\n# Tools") and text.endswith("<|im_start|>assistant\n")
    block = text.partition("\n<tools>\n")[2].partition("\n</tools>")[0]  # as Qwen2.5's: a JSON line each
    assert block.split("\n") == [json.dumps(schema) for schema in schemas]
    assert "<|im_start|>user\nWhat is 2+3?<|im_end|>" in text
    system = builder.build({"prompt": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "q"}]}, tools=schemas).text
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and system.count("<|im_start|>system") == 1
    assert builder.build({"prompt": "q"}).text == "q"  # no tools: a plain string stays as it is
    for ended in (True, False):
        seq, messages = conversation_tokens(TOK, None, TURNS, IM_END, ended=ended, tools=schemas)
        assert seq == chat_ids(messages, tools=schemas)


# Qwen2.5's handling of tool results (its template, without the tool-call and system parts): tool
# messages become one user turn of <tool_response> blocks.
QWEN_TOOLS = (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Llama 3's shape: headers of special tokens, <|eot_id|> with nothing after it.
LLAMA3 = (
    "{{- '<|begin_of_text|>' }}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def llama3_tokenizer() -> Any:
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|begin_of_text|>", "<|start_header_id|>",
                                                          "<|end_header_id|>", "<|eot_id|>"]})
    return tok


@pytest.mark.parametrize("template, make", [(QWEN_TOOLS, build_tokenizer), (LLAMA3, llama3_tokenizer)],
                         ids=["qwen2.5-tools", "llama3"])
def test_other_templates_tokens_in_tokens_out(template: str, make: Any) -> None:
    tok = make()
    eot = end_of_turn_token(tok, template)
    assert eot == tok.convert_tokens_to_ids("<|im_end|>" if template is QWEN_TOOLS else "<|eot_id|>")
    for ended in (True, False):
        seq, messages = conversation_tokens(tok, template, TURNS, eot, ended=ended)
        assert seq == chat_ids(messages, tok, template)
    if template is QWEN_TOOLS:
        reply = tok.decode(render_observation(tok, TURNS[2][1], chat=True, chat_template=template))
        assert reply == ("\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n3\n"
                         "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_a_template_that_ends_turns_with_text_writes_that_text() -> None:
    template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    assert end_of_turn_token(TOK, template) is None
    reply = render_observation(TOK, "ok", chat=True, chat_template=template)
    assert TOK.decode(reply) == "\n[user] ok\n[assistant] "
    seq, messages = conversation_tokens(TOK, template, TURNS, None)
    assert seq == chat_ids(messages, TOK, template)


def test_plain_observations_are_their_text() -> None:
    assert render_observation(TOK, " = 46", chat=False) == ids(" = 46")
    assert render_observation(TOK, [{"role": "tool", "content": "4"}, {"role": "user", "content": "6"}],
                              chat=False) == ids("46")
    assert render_observation(TOK, "", chat=False) == []


def test_a_bad_observation_or_a_missing_template_is_refused() -> None:
    with pytest.raises(PromptError, match="an observation must be") as e:
        render_observation(TOK, [{"role": "tool", "content": 5}], chat=True)
    assert e.value.reason == "malformed"
    bare = build_tokenizer()
    bare.chat_template = None
    with pytest.raises(PromptError, match="no chat template") as e:
        render_observation(bare, "hi", chat=True)
    assert e.value.reason == "no_chat_template"
    assert render_observation(bare, "hi", chat=False) == ids("hi")
    with pytest.raises(PromptError, match="chat template failed") as e:
        render_observation(TOK, "hi", chat=True, chat_template="{{ raise_exception('no tools here') }}")
    assert e.value.reason == "template_error"
