"""The per-token loss mask of multi-turn episodes: environment tokens are context, never trained on.

Each test here fails when environment tokens (Completion.mask False) get gradient or enter a
statistic: making pack_sequences' completion mask all True, or counting every completion token
in the step's token total, breaks at least one of them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.models import builtin as models
from pipeline.config.schema import LossConfig, TrainerConfig
from pipeline.trainer.loss import group_advantages, policy_loss
from pipeline.trainer.policy import PolicyTrainer
from pipeline.trainer.process import ProcessTrainer
from pipeline.types import Batch, Completion, Generation, GroupRequest, Prompt, RolloutGroup
# the trainer and helpers of test_trainer (tests/ is on sys.path)
from test_trainer import _assert_same, _group, _trainer, _weights

# Per completion of an episode group, which tokens the policy sampled. The last one has none: an
# episode whose every completion token came from the environment carries no token to train on.
MASKS = (
    (1, 1, 1, 0, 0, 0, 1, 1),  # a turn, the environment's reply, a turn
    (1, 0, 0, 1, 1, 1, 1, 0, 0),  # ending on the environment's reply
    (1, 1, 1, 1, 1, 1),  # a single turn inside an episode group
    (1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1),
    (0, 0, 0, 0, 0),
)
SAMPLED_PER_GROUP = sum(map(sum, MASKS))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.build_model("tiny", tmp_path_factory.mktemp("models"))


def _episode_group(group_id: int, text: str, seed: int = 0, env_logprob: float = 0.0, version: int = 0,
                   masks: tuple[tuple[int, ...], ...] = MASKS) -> RolloutGroup:
    """A group of multi-turn episodes: random tokens, the engine's log-probs where sampled and
    `env_logprob` (the contract says 0) on environment tokens, rewards 1, 2, 4, ... in some order."""
    rng = np.random.default_rng(seed)
    ids = tuple(text.encode())
    completions = []
    for m in masks:
        mask = np.array(m, dtype=bool)
        logprobs = np.where(mask, rng.uniform(-6.5, -5.0, len(m)), env_logprob).astype(np.float32)
        completions.append(Completion(token_ids=rng.integers(0, models.EOS_ID, size=len(m)).astype(np.int64),
                                      logprobs=logprobs, finish_reason="stop", mask=mask, turns=2))
    request = GroupRequest(group_id=group_id, prompt=Prompt(id=f"p{group_id}", text=text, token_ids=ids),
                           n=len(masks), max_new_tokens=16)
    generation = Generation(request=request, completions=tuple(completions), version=version, engine="test",
                            t_start=0.0, t_end=0.0)
    rewards = rng.permutation(np.exp2(np.arange(len(masks))))  # distinct, none at their mean: no advantage is 0
    return RolloutGroup(generation=generation, rewards=rewards, t_scored=0.0)


def _trainer_with(model_dir: Path, loss_cfg: LossConfig, **cfg: object) -> PolicyTrainer:
    trainer = PolicyTrainer(model_dir, TrainerConfig(lora_rank=4, **cfg), loss_cfg)
    trainer.setup()
    return trainer


def _episode_batch(env_logprob: float = 0.0) -> Batch:
    return Batch(step=1, version=0, groups=(_episode_group(0, "Hello there", seed=1, env_logprob=env_logprob),
                                            _episode_group(1, "2+2=", seed=2, env_logprob=env_logprob)))


def _with_masks(group: RolloutGroup, mask_of) -> RolloutGroup:
    """The same group with each completion's mask replaced by `mask_of(completion)`."""
    comps = tuple(Completion(token_ids=c.token_ids, logprobs=c.logprobs, finish_reason=c.finish_reason,
                             mask=mask_of(c)) for c in group.completions)
    gen = group.generation
    return RolloutGroup(generation=Generation(request=gen.request, completions=comps, version=gen.version,
                                              engine=gen.engine, t_start=0.0, t_end=0.0),
                        rewards=group.rewards, t_scored=0.0)


@pytest.mark.parametrize("update", ["lora", "full"])
@pytest.mark.parametrize("correction", ["tis", "ppo"])
def test_behaviour_logprobs_of_environment_tokens_change_nothing(model_dir: Path, update: str,
                                                                 correction: str) -> None:
    """Whatever the engine put at mask-0 positions (0 by contract, or anything else), the step's
    weights and every statistic are bitwise the same."""
    results = []
    for env_logprob in (0.0, -3.0, float("nan")):
        trainer = _trainer_with(model_dir, LossConfig(correction=correction), update=update, micro_batch_sequences=3)
        stats = trainer.step(_episode_batch(env_logprob))
        results.append((_weights(trainer), stats.metrics))
    (w0, m0), rest = results[0], results[1:]
    assert m0["train/skipped"] == 0.0 and m0["train/masked_nonfinite"] == 0.0
    for w, m in rest:
        _assert_same(w0, w)
        assert m == m0


@pytest.mark.parametrize("update", ["lora", "full"])
def test_no_gradient_reaches_the_logits_of_environment_tokens(model_dir: Path, update: str) -> None:
    """d loss / d logits is exactly 0 on every row that predicts an environment token (and on the
    prompt and padding), and nonzero on every row that predicts a sampled token."""
    trainer = _trainer(model_dir, update=update, micro_batch_sequences=2)
    grads: list[torch.Tensor] = []

    def keep_grad(module: torch.nn.Module, args: tuple, output) -> None:
        output.logits.register_hook(lambda g: grads.append(g.detach().clone()))

    handle = trainer.model.register_forward_hook(keep_grad)
    try:
        batch = _episode_batch()
        trainer.step(batch)
    finally:
        handle.remove()
    rows = [(g, c) for g in batch.groups for c in g.completions if c.sampled.any()]  # what the trainer trains
    got = [g[i] for g in grads for i in range(g.shape[0])]  # [L, V] per row, in row order
    assert len(got) == len(rows) == 2 * (len(MASKS) - 1)
    for grad, (g, c) in zip(got, rows):
        per_row = grad.abs().sum(dim=-1)  # [L]
        # logits at position p predict token p + 1; completion token j sits at len(prompt) + j
        predicts_sampled = torch.zeros_like(per_row, dtype=torch.bool)
        predicts_sampled[len(g.prompt.token_ids) - 1 + np.flatnonzero(c.sampled)] = True
        assert torch.all(per_row[~predicts_sampled] == 0), "gradient on a row that predicts no sampled token"
        assert torch.all(per_row[predicts_sampled] > 0)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_loss_and_statistics_count_sampled_tokens_only(model_dir: Path, aggregation: str) -> None:
    """The step's loss and statistics, over uneven micro-batches, are those of the whole batch at
    once with a mask of exactly the sampled tokens; its token count is the masks' sum."""
    loss_cfg = LossConfig(aggregation=aggregation)
    trainer = _trainer_with(model_dir, loss_cfg, micro_batch_sequences=3)
    batch = _episode_batch()
    stats = trainer.step(batch).metrics
    assert stats["train/tokens"] == 2 * SAMPLED_PER_GROUP
    assert stats["train/sequences"] == 2 * (len(MASKS) - 1)  # the episode without a sampled token is left out

    # the reference: version 0 is the base model; one forward of every row, the mask built by hand
    base = models.load_causal_lm(model_dir, "cpu", "float32")
    prompts = [list(g.prompt.token_ids) for g in batch.groups for _ in g.completions]
    comps = [c.token_ids.tolist() for g in batch.groups for c in g.completions]
    ids, attn, _ = models.pack_sequences(prompts, comps, pad_id=0)
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    beh = torch.zeros(ids.shape)
    for i, c in enumerate(c for g in batch.groups for c in g.completions):
        start = len(prompts[i])
        mask[i, start:start + len(c.token_ids)] = torch.from_numpy(c.sampled)
        beh[i, start:start + len(c.token_ids)] = torch.from_numpy(c.logprobs)
    adv = torch.cat([group_advantages(torch.as_tensor(g.rewards)[None], scale=loss_cfg.scale_rewards)[0]
                     for g in batch.groups]).float()
    with torch.no_grad():
        lp = models.token_logprobs(base, ids, attn)
    loss, ref = policy_loss(lp, beh, adv, mask, loss_cfg)
    assert ref["tokens"] == stats["train/tokens"]
    assert stats["train/loss"] == pytest.approx(float(loss), rel=1e-5, abs=1e-7)
    for k in ("ratio_mean", "is_weight_mean", "kl_behaviour_trainer", "mean_abs_logprob_diff"):
        assert stats[f"train/{k}"] == pytest.approx(ref[k], rel=1e-5, abs=1e-7), k
    assert stats["train/ratio_max"] == pytest.approx(ref["ratio_max"], rel=1e-5)


@pytest.mark.parametrize("update", ["lora", "full"])
def test_single_turns_train_alike_with_no_mask_and_an_all_true_mask(model_dir: Path, update: str) -> None:
    plain = Batch(step=1, version=0, groups=(_group(0, "Hello there", seed=1), _group(1, "2+2=", seed=2)))
    all_true = Batch(step=1, version=0, groups=tuple(
        _with_masks(g, lambda c: np.ones(len(c.token_ids), dtype=bool)) for g in plain.groups))
    a, b = _trainer(model_dir, update=update), _trainer(model_dir, update=update)
    sa, sb = a.step(plain), b.step(all_true)
    _assert_same(_weights(a), _weights(b))
    assert sa.metrics == sb.metrics
    for x, y in zip(a.recompute_logprobs(plain.groups), b.recompute_logprobs(all_true.groups)):
        for p, q in zip(x, y):
            assert p.tobytes() == q.tobytes()


def test_recompute_logprobs_covers_every_completion_token_of_every_completion(model_dir: Path) -> None:
    """The contract: per completion one [T] array aligned with its token ids, environment tokens
    included (the caller masks), an empty array for an empty completion."""
    trainer = _trainer(model_dir)
    group = _episode_group(0, "Hello there", seed=3)
    empty = Completion(token_ids=np.zeros(0, np.int64), logprobs=np.zeros(0, np.float32), finish_reason="length")
    gen = group.generation
    group = RolloutGroup(generation=Generation(request=gen.request, completions=gen.completions + (empty,),
                                               version=0, engine="test", t_start=0.0, t_end=0.0),
                         rewards=np.arange(len(MASKS) + 1, dtype=np.float64), t_scored=0.0)
    got = trainer.recompute_logprobs([group])[0]
    assert [len(x) for x in got] == [len(c.token_ids) for c in group.completions]
    base = models.load_causal_lm(model_dir, "cpu", "float32")
    want = models.completion_logprobs(base, [list(group.prompt.token_ids)] * len(group.completions),
                                      [c.token_ids.tolist() for c in group.completions], "cpu")
    for x, y in zip(got, want):
        np.testing.assert_allclose(x, y, atol=1e-5)
    assert all((x[~c.sampled] < 0).all() for x, c in zip(got, group.completions))  # real log-probs there too


def test_the_trainer_in_its_own_process_gets_the_masks(model_dir: Path) -> None:
    """Episodes cross the pipe to the child trainer with their masks: it weighs the sampled tokens only."""
    local = _trainer(model_dir)
    child = ProcessTrainer(model_dir, TrainerConfig(lora_rank=4), LossConfig())
    try:
        child.setup()
        ours, theirs = local.step(_episode_batch()).metrics, child.step(_episode_batch()).metrics
        assert theirs["train/tokens"] == ours["train/tokens"] == 2 * SAMPLED_PER_GROUP
        assert theirs["train/loss"] == pytest.approx(ours["train/loss"], abs=1e-6)
        group = _episode_group(0, "Hello there", version=1)
        for x, y in zip(child.recompute_logprobs([group])[0], local.recompute_logprobs([group])[0]):
            np.testing.assert_allclose(x, y, atol=1e-5)
    finally:
        child.close()
