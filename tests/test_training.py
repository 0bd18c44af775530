"""The engine-vs-trainer log-prob check of the train loop, over the tokens the policy sampled only."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from pipeline import models
from pipeline.config import RunConfig
from pipeline.errors import TrainerError
from pipeline.training import Training, sampled_logprob_pairs
from pipeline.types import Batch, Completion, Generation, RolloutGroup
# groups and trainers of the trainer tests (tests/ is on sys.path)
from test_trainer import _group, _trainer
from test_trainer_mask import MASKS, SAMPLED_PER_GROUP, _episode_group

ENV_GARBAGE = -9.0  # what a stub trainer says of environment tokens: far from the engine's 0 there


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.build_model("tiny", tmp_path_factory.mktemp("models"))


class _EchoTrainer:
    """Agrees with the engine on every sampled token and gives ENV_GARBAGE on every environment token."""

    def recompute_logprobs(self, groups: list[RolloutGroup]) -> list[list[np.ndarray]]:
        return [[np.where(c.sampled, c.logprobs, np.float32(ENV_GARBAGE)) for c in g.completions] for g in groups]


def _check(trainer: object, groups: list[RolloutGroup]) -> dict[str, float]:
    """Training._logprob_check alone: it reads only the config and the trainer."""
    training = Training.__new__(Training)
    training.cfg, training.trainer = RunConfig(), trainer
    return asyncio.run(training._logprob_check(Batch(step=1, version=0, groups=tuple(groups))))


def test_pairs_are_the_sampled_positions_only() -> None:
    groups = [_episode_group(0, "Hello there", seed=1), _episode_group(1, "2+2=", seed=2)]
    eng, tr = sampled_logprob_pairs(groups, _EchoTrainer().recompute_logprobs(groups))
    assert len(eng) == len(tr) == 2 * SAMPLED_PER_GROUP
    assert eng.dtype == tr.dtype == np.float64
    np.testing.assert_array_equal(eng, tr)
    want = np.concatenate([c.logprobs[c.sampled] for g in groups for c in g.completions])
    np.testing.assert_array_equal(eng, want)


def test_pairs_of_single_turns_are_every_token() -> None:
    groups = [_group(0, "Hello there", seed=1), _group(1, "2+2=", seed=2)]
    trainer_lp = [[c.logprobs + 0.5 for c in g.completions] for g in groups]
    eng, tr = sampled_logprob_pairs(groups, trainer_lp)
    np.testing.assert_array_equal(eng, np.concatenate([c.logprobs for g in groups for c in g.completions]))
    np.testing.assert_array_equal(tr, np.concatenate([x for per in trainer_lp for x in per]))


def test_pairs_refuse_a_trainer_answer_of_another_length() -> None:
    groups = [_episode_group(0, "Hello there")]
    short = [[x[:-1] for x in _EchoTrainer().recompute_logprobs(groups)[0]]]
    with pytest.raises(TrainerError, match="log-probs for"):
        sampled_logprob_pairs(groups, short)


def test_the_check_ignores_environment_positions() -> None:
    groups = [_episode_group(0, "Hello there", seed=1), _episode_group(1, "2+2=", seed=2)]
    out = _check(_EchoTrainer(), groups)
    assert out["check/tokens"] == 2 * SAMPLED_PER_GROUP
    assert out["check/mean_abs_diff"] == out["check/max_abs_diff"] == out["check/kl"] == 0.0


def test_the_check_over_episodes_with_the_real_trainer(model_dir: Path) -> None:
    """An engine whose sampled log-probs are the trainer's own, 0 on environment tokens: no mismatch."""
    trainer = _trainer(model_dir)
    episode = _episode_group(0, "Hello there", seed=4)
    exact = trainer.recompute_logprobs([episode])[0]
    comps = tuple(Completion(token_ids=c.token_ids, logprobs=np.where(c.sampled, x, np.float32(0)),
                             finish_reason=c.finish_reason, mask=c.mask, turns=c.turns)
                  for c, x in zip(episode.completions, exact))
    gen = episode.generation
    engine_exact = RolloutGroup(generation=Generation(request=gen.request, completions=comps, version=0,
                                                      engine="test", t_start=0.0, t_end=0.0),
                                rewards=episode.rewards, t_scored=0.0)
    out = _check(trainer, [engine_exact])
    assert out["check/tokens"] == SAMPLED_PER_GROUP == sum(map(sum, MASKS))
    assert out["check/max_abs_diff"] < 1e-5
