"""The engine-vs-trainer log-prob check of the train loop, over the tokens the policy sampled only."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from pipeline.models import builtin as models
from pipeline.config.schema import RunConfig
from pipeline.errors import TrainerError
from pipeline.loop.training import Training, sampled_logprob_pairs
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


class _MergedTrainer:
    """A trainer whose step and save are one call (as the trainer process's `step_and_save`)."""

    def __init__(self, advance: int = 1) -> None:
        self.version, self.advance, self.calls = 0, advance, []

    def step_and_save(self, batch: Batch, directory: Path) -> tuple[object, float]:
        from safetensors.numpy import save_file

        from pipeline.types import TrainStats

        self.calls.append(Path(directory))
        self.version += self.advance
        save_file({"w": np.full(4, self.version, np.float32)}, str(Path(directory) / "adapter_model.safetensors"))
        (Path(directory) / "adapter_config.json").write_text("{}")
        return TrainStats(step=batch.step, version=self.version, metrics={}, t_start=0.0, t_end=0.0), 0.001


def _publishing(trainer: object, root: Path) -> Training:
    from pipeline.store.weights import AdapterStore

    from pipeline.config.schema import RunConfig

    training = Training.__new__(Training)
    training.cfg, training.trainer, training.store = RunConfig(), trainer, AdapterStore(root, sync=False)
    return training


def test_a_merged_step_writes_its_version_into_the_publish_in_one_call(tmp_path: Path) -> None:
    trainer = _MergedTrainer()
    training = _publishing(trainer, tmp_path / "adapters")
    stats, ref, times = training._step_and_publish(Batch(step=1, version=0, groups=()))
    assert stats.version == ref.version == 1 and len(trainer.calls) == 1
    assert trainer.calls[0].name.startswith(".tmp-")  # straight into the publish's temporary directory
    assert training.store.verify_dir(ref.path) == ref
    assert times["time/save_s"] == 0.001 and times["time/publish_s"] >= times["time/save_s"]


def test_a_merged_step_that_skips_a_version_publishes_nothing_and_says_so(tmp_path: Path) -> None:
    training = _publishing(_MergedTrainer(advance=2), tmp_path / "adapters")
    with pytest.raises(TrainerError, match="made version 2; a step makes the next version, 1"):
        training._step_and_publish(Batch(step=1, version=0, groups=()))
    assert training.store.versions() == [] and not list((tmp_path / "adapters").iterdir())
