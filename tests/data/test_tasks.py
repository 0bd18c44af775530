"""The built-in addition task: its fixed split, its exact-match reward, its held-out eval set."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from pipeline.loop.build import prompt_sets
from pipeline.config.schema import TaskConfig
from pipeline.config.io import load_config
from pipeline.errors import ConfigError
from pipeline.data.tasks import addition_split, build_task, exact_match


def _sums(rows: list[dict]) -> set[str]:
    return {r["prompt"] for r in rows}


@pytest.mark.parametrize("digits", [2, 3])
@pytest.mark.parametrize("seed", [0, 1, 7])
def test_train_eval_and_validation_problems_never_meet(digits: int, seed: int) -> None:
    task = build_task(TaskConfig(name="addition", digits=digits, num_prompts=2000, seed=seed), digits + 2)
    train, held = _sums(task.prompts), _sums(task.eval_prompts)
    valid = {p for p, _ in task.validation}
    assert len(train) == 2000 and len(held) == 512 and len(valid) == len(task.validation)
    assert not train & held and not train & valid and not held & valid
    rng = random.Random(seed)
    demos = {task.demonstrate(rng)[0] for _ in range(5000)}  # what a warm start learns from
    assert not demos & held and not demos & valid
    for rows in (task.prompts, task.eval_prompts):
        for r in rows[:200]:
            a, b = map(int, r["prompt"].rstrip("=").split("+"))
            assert len(str(a)) == len(str(b)) == digits and r["answer"] == str(a + b)


def test_the_split_is_a_fixed_share_of_the_problem_space_whatever_the_seed() -> None:
    shares = Counter(addition_split(a, b) for a in range(10, 100) for b in range(10, 100))
    assert abs(shares["eval"] / 8100 - 0.10) < 0.02 and abs(shares["valid"] / 8100 - 0.05) < 0.015
    held = [_sums(build_task(TaskConfig(name="addition", seed=s), 4).eval_prompts) for s in (0, 5)]
    assert held[0] == held[1]  # the held-out set does not move with the run's seed


def test_exact_match_is_one_only_for_exactly_the_sum() -> None:
    completions = ["82", " 82\n", "820", "8", "82 ", "28", "", "82<|im_end|>"]
    assert exact_match([""] * 8, completions, answer=["82"] * 8) == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    # paired by position: each completion against its own answer
    assert exact_match(["", ""], ["5", "7"], answer=["7", "7"]) == [0.0, 1.0]


def test_a_split_too_small_for_what_is_asked_names_the_settings() -> None:
    with pytest.raises(ConfigError, match=r"task.digits = 1: the 'eval' split of 1-digit addition holds \d+ problems"):
        build_task(TaskConfig(name="addition", digits=1, num_prompts=10), 3)
    with pytest.raises(ConfigError, match="fewer than the 9000 asked for"):
        build_task(TaskConfig(name="addition", digits=2, num_prompts=9000), 4)


def test_eval_rounds_of_the_built_in_task_use_its_held_out_split() -> None:
    cfg = load_config(None, {"task.name": "addition", "eval.every": 10})
    items, eval_items, reward = prompt_sets(cfg, None, None, None)
    task = build_task(cfg.task, cfg.sampling.max_new_tokens)
    assert eval_items == task.eval_prompts and not _sums(items) & _sums(eval_items)
    assert reward is exact_match
    # other built-in tasks still hold out prompts drawn with another seed
    cfg = replace(cfg, task=replace(cfg.task, name="char_class"))
    _, eval_items, _ = prompt_sets(cfg, None, None, None)
    assert eval_items == build_task(replace(cfg.task, seed=1), 16).prompts
