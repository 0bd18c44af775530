"""Prompt sources and the built-in tasks.

A prompt source yields `Prompt`s in epochs (reshuffled each epoch from a seed), so a run can
cycle a small data set; `item_at(position)` gives the item at any stream position, so a group
id (a position) names the same prompt in every session of a resumed run.

Built-in tasks are small enough for a random-weight tiny model to learn on a CPU in minutes:
- `char_class`: the prompt names a character class (digits or vowels); the reward is the share
  of the completion's `max_new_tokens` positions that hold a character of that class. A
  uniformly random policy over the built-in tokenizer's 320 tokens (one per byte) scores about
  0.02-0.03; a perfect one scores 1.
  The policy has to read the prompt: the two classes want different characters.
- `copy`: the prompt shows a short word; the reward is the share of positions where the
  completion repeats the word's characters in order (harder: it needs attention to the prompt).
- `calculator` (multi-turn, `Task.environment`): the prompt is a sum ("12+34 calc:"). A first
  turn holding CALL ("=") calls the calculator, which replies with the sum (" = 46") for the
  second turn, the answer; a first turn without a call ends the episode with reward 0 (only
  answers checked with the calculator are graded). The episode's reward, in [0, 1], is
  CALL_REWARD for the call and the rest for the answer (`calculator_score`): for writing a
  number (the share of its characters that are digits, learnable as char_class's digits are),
  for writing the sum's digits and for being exactly the sum, which only the reply tells. A
  uniformly random policy scores about 0.005 (it calls 3-4% of the time); a perfect one ("=",
  then the sum and the end of the sequence) scores 1.
- `addition`: the prompt is a sum of two `task.digits`-digit numbers ("37+45="); the reward is 1
  for exactly the sum (whitespace around it aside) and 0 otherwise. A random model never gets
  one right; a warm-started one (`model.warm_start`, pipeline.models.warm_start) gets 20-50% and RL
  has the rest to learn. The problem space is split once, by a hash of each problem, into
  "eval" (1 in 10), "valid" (1 in 20) and "train": the held-out problems (`Task.eval_prompts`)
  and the warm start's validation problems can never be trained on, whatever the seeds.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from pipeline.config.schema import TaskConfig
from pipeline.envs.protocol import Environment, EnvStep
from pipeline.errors import ConfigError

CLASSES = {"digits": set("0123456789"), "vowels": set("aeiou")}
LETTERS = "bcdfghjklmnpqrstvwxyz"


@dataclass(frozen=True)
class Task:
    """A named prompt set and the reward that scores its completions."""

    name: str
    prompts: list[dict[str, Any]]  # each {"id": str, "prompt": str, **extra columns}
    reward: Callable[..., list[float]]  # with an environment: applied to the final transcript (env.reward)
    environment: Callable[[], Environment] | None = None  # multi-turn: one instance per episode, reset(row)
    eval_prompts: list[dict[str, Any]] | None = None  # held out, never trained on; None: drawn with another seed
    # a fresh (prompt, answer) of the training split from the rng, for supervised warm starts; None: none
    demonstrate: Callable[[random.Random], tuple[str, str]] | None = None
    validation: list[tuple[str, str]] | None = None  # (prompt, answer) a warm start measures itself on
    settings: tuple[tuple[str, Any], ...] = ()  # what its problems depend on besides the name (for caches)


def char_class_task(num_prompts: int, seed: int, max_new_tokens: int) -> Task:
    rng = random.Random(seed)
    prompts = []
    for i in range(num_prompts):
        cls = "digits" if i % 2 == 0 else "vowels"
        noise = "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 5)))
        prompts.append({"id": f"char_class-{i}", "prompt": f"{noise} {cls}:", "target_class": cls})

    def char_class_reward(prompts: list[str], completions: list[str], target_class: list[str],
                          **kwargs: Any) -> list[float]:
        """Share of the max_new_tokens positions filled with characters of the asked class."""
        return [sum(ch in CLASSES[c] for ch in text[:max_new_tokens]) / max_new_tokens
                for text, c in zip(completions, target_class)]

    return Task("char_class", prompts, char_class_reward)


def copy_task(num_prompts: int, seed: int, max_new_tokens: int) -> Task:
    rng = random.Random(seed)
    prompts = []
    for i in range(num_prompts):
        word = "".join(rng.choice(LETTERS) for _ in range(3))
        prompts.append({"id": f"copy-{i}", "prompt": f"copy {word}:", "word": word})

    def copy_reward(prompts: list[str], completions: list[str], word: list[str], **kwargs: Any) -> list[float]:
        """Share of positions where the completion continues the word repeated (w, o, r, w, o, r, ...)."""
        out = []
        for text, w in zip(completions, word):
            target = (w * max_new_tokens)[:max_new_tokens]
            out.append(sum(a == b for a, b in zip(text, target)) / max_new_tokens)
        return out

    return Task("copy", prompts, copy_reward)


CALL = "="  # a first turn holding it calls the calculator: one byte, so a random policy writes it at times
# The call earns a share of its own: with the answer's reward alone, a tiny model drifts into
# writing digits everywhere, the calls die out and no group is left to learn them back from
# (3 seeds x 300 steps of `python run.py --set task.name=calculator` on 2 CPU cores: with it, all
# three keep calling 77-96% of the time).
CALL_REWARD = 0.1
# The answer's score: for digits (a number), for the sum's digits, for exactly the sum. The first
# part is what a tiny model learns in minutes (char_class's digits); the other two need the reply.
DIGITS, SUM_DIGITS, EXACT = 0.5, 0.25, 0.25


def calculator_reply(answer: str) -> str:
    """The calculator's reply to a call: the sum, which the answer may copy."""
    return f" = {answer}"


def calculator_score(text: str, answer: str) -> float:
    """An answer's reward in [0, 1]: DIGITS x the share of its characters that are digits, SUM_DIGITS
    x the share that are characters of `answer`, EXACT if it is `answer` (spaces around it aside)."""
    text = text.strip()
    if not text:
        return 0.0
    digits = sum(ch.isdigit() and ch.isascii() for ch in text) / len(text)
    of_sum = sum(ch in answer for ch in text) / len(text)
    return DIGITS * digits + SUM_DIGITS * of_sum + EXACT * (text == answer)


class CalculatorEnv:
    """The calculator task's episode: a call, then the answer (two steps), or no call (one step, reward 0)."""

    def __init__(self) -> None:
        self.answer = ""
        self.called = False

    def reset(self, row: Mapping[str, Any]) -> str:
        self.answer = str(row["answer"])
        self.called = False
        return row["prompt"]

    def step(self, action: str) -> EnvStep:
        if self.called:
            return EnvStep(None, reward=(1 - CALL_REWARD) * calculator_score(action, self.answer), done=True)
        if CALL not in action:
            return EnvStep(None, reward=0.0, done=True, info={"called": False})
        self.called = True
        return EnvStep(calculator_reply(self.answer), reward=CALL_REWARD, info={"called": True})


def calculator_task(num_prompts: int, seed: int, max_new_tokens: int) -> Task:
    rng = random.Random(seed)
    prompts = []
    for i in range(num_prompts):
        a, b = rng.randint(10, 49), rng.randint(10, 49)  # two-digit sums: a tiny model cannot add them
        prompts.append({"id": f"calculator-{i}", "prompt": f"{a}+{b} calc:", "a": a, "b": b, "answer": str(a + b)})

    def calculator_reward(prompts: list[str], completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
        """CalculatorEnv's reward, read off each transcript: the answer is the text after the
        calculator's reply; a transcript without the reply (no call) is worth 0."""
        out = []
        for text, ans in zip(completions, answer):
            _, reply, after = text.partition(calculator_reply(ans))
            out.append(CALL_REWARD + (1 - CALL_REWARD) * calculator_score(after, ans) if reply else 0.0)
        return out

    return Task("calculator", prompts, calculator_reward, environment=CalculatorEnv)


def addition_split(a: int, b: int) -> str:
    """"eval" (1 in 10), "valid" (1 in 20) or "train": the fixed split of the problem a+b, by a hash of it."""
    h = zlib.crc32(f"{a}+{b}".encode()) % 20
    return "eval" if h < 2 else "valid" if h < 3 else "train"


def addition_space(digits: int) -> int:
    """How many problems a+b of two `digits`-digit numbers there are."""
    return (9 * 10 ** (digits - 1)) ** 2


def _draw_addition(rng: random.Random, digits: int, split: str) -> tuple[int, int]:
    lo, hi = 10 ** (digits - 1), 10 ** digits - 1
    while True:  # a split holds at least 1 in 20 problems: a few draws on average
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if addition_split(a, b) == split:
            return a, b


_SHARE = {"eval": 0.10, "valid": 0.05, "train": 0.85}  # of the problem space, about, per split


@functools.lru_cache(maxsize=4)
def _split_pool(digits: int, split: str) -> tuple[tuple[int, int], ...]:
    lo, hi = 10 ** (digits - 1), 10 ** digits
    return tuple((a, b) for a in range(lo, hi) for b in range(lo, hi) if addition_split(a, b) == split)


def addition_problems(digits: int, split: str, count: int, seed: int) -> list[tuple[int, int]]:
    """`count` distinct problems of `split`, drawn with `seed`; ValueError when the split holds fewer."""
    space = addition_space(digits)
    rng = random.Random(seed)
    if count <= space * _SHARE[split] / 4:  # a small share of the split: distinct draws come quickly
        out: dict[tuple[int, int], None] = {}
        while len(out) < count:
            out[_draw_addition(rng, digits, split)] = None
        return list(out)
    if space > 10 ** 6:
        raise ValueError(f"{count} problems is more than a quarter of the {split!r} split of {digits}-digit addition")
    pool = _split_pool(digits, split)
    if len(pool) < count:
        raise ValueError(f"the {split!r} split of {digits}-digit addition holds {len(pool)} problems, "
                         f"fewer than the {count} asked for")
    return rng.sample(pool, count)


def _addition_row(i: int, a: int, b: int, prefix: str) -> dict[str, Any]:
    return {"id": f"{prefix}-{i}", "prompt": f"{a}+{b}=", "answer": str(a + b)}


def exact_match(prompts: list[str], completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 where the completion is exactly the answer (whitespace around it aside), else 0.0."""
    return [float(text.strip() == str(ans)) for text, ans in zip(completions, answer)]


VALIDATION_PROBLEMS = 256  # what a warm start measures its accuracy on: a binomial SE of ~3 points at 30%


def addition_task(num_prompts: int, seed: int, digits: int, num_eval: int) -> Task:
    train = addition_problems(digits, "train", num_prompts, seed)
    held = addition_problems(digits, "eval", num_eval, 0)  # the same held-out set whatever the run's seed
    valid = addition_problems(digits, "valid", VALIDATION_PROBLEMS, 0)

    def demonstrate(rng: random.Random) -> tuple[str, str]:
        a, b = _draw_addition(rng, digits, "train")
        return f"{a}+{b}=", str(a + b)

    return Task("addition", [_addition_row(i, a, b, "addition") for i, (a, b) in enumerate(train)], exact_match,
                eval_prompts=[_addition_row(i, a, b, "addition-eval") for i, (a, b) in enumerate(held)],
                demonstrate=demonstrate, validation=[(f"{a}+{b}=", str(a + b)) for a, b in valid],
                settings=(("digits", digits),))


def build_task(cfg: TaskConfig, max_new_tokens: int) -> Task:
    if cfg.name == "addition":
        try:
            return addition_task(cfg.num_prompts, cfg.seed, cfg.digits, cfg.num_eval_prompts)
        except ValueError as e:  # more problems asked for than the split holds: the config's numbers
            raise ConfigError(f"task.name = \"addition\" with task.digits = {cfg.digits}: {e}; lower "
                              "task.num_prompts or task.num_eval_prompts, or raise task.digits") from None
    makers = {"char_class": char_class_task, "copy": copy_task, "calculator": calculator_task}
    return makers[cfg.name](cfg.num_prompts, cfg.seed, max_new_tokens)


class PromptSource:
    """A stream of prompt-list items in epochs, reshuffled each epoch; `epochs=None` cycles forever.

    Position p of the stream is item `order(epoch)[index]` with (epoch, index) = divmod(p, len):
    a pure function of the seed, so a group id (a position) names the same prompt in every session.
    """

    def __init__(self, items: Iterable[Mapping[str, Any]] | Iterable[Any], seed: int = 0,
                 epochs: int | None = None, shuffle: bool = True) -> None:
        self.items = list(items)
        if not self.items:
            raise ValueError("the prompt source is empty")
        self.seed = seed
        self.epochs = epochs
        self.shuffle = shuffle
        self._epoch = 0  # the epoch whose order is cached: positions arrive nearly in order
        self._order = self._make_order(0)

    def _make_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    @property
    def total(self) -> int | None:
        """Items in the whole stream (epochs x items), None when it cycles forever."""
        return None if self.epochs is None else self.epochs * len(self.items)

    def item_at(self, position: int) -> Any:
        """Item `position` of the stream."""
        return self.items[self.index_at(position)]

    def index_at(self, position: int) -> int:
        """Index in `items` of the item at stream `position`."""
        if position < 0 or (self.total is not None and position >= self.total):
            raise IndexError(f"stream position {position} is outside [0, {self.total})")
        epoch, index = divmod(position, len(self.items))
        if epoch != self._epoch:
            self._order = self._make_order(epoch)
            self._epoch = epoch
        return self._order[index]

    def fingerprint(self) -> dict[str, Any]:
        """What makes a stream position name the same item: a sha256 of the items (as sorted-key
        JSON), their number, and the seed and shuffle that order them. A resumed run compares it.

        Hashed once at set-up, a chunk of items per json.dumps call (faster than a call per item),
        with one chunk's text in memory."""
        digest = hashlib.sha256()
        for i in range(0, len(self.items), _FINGERPRINT_CHUNK):
            chunk = self.items[i:i + _FINGERPRINT_CHUNK]
            digest.update(json.dumps(chunk, sort_keys=True, default=_plain, ensure_ascii=False).encode())
            digest.update(b"\n")  # chunk boundaries are part of the hash, so [a][b] != [a, b]
        return {"sha256": digest.hexdigest(), "items": len(self.items), "seed": self.seed, "shuffle": self.shuffle}


_FINGERPRINT_CHUNK = 4096  # items serialised per json.dumps call


def _plain(value: Any) -> Any:
    """json.dumps fallback for the fingerprint: arrays by their values (str() would elide a long one), else text."""
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    return str(value)
