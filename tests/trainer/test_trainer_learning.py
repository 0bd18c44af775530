"""The trainer learns what the loss says: gradients against the formula, rewards that rise, the
decoupled-PPO clip that acts once a step takes several optimizer steps, the KL reference, entropy.

Each test here names the mistake it exists to catch (the audit of issue 19 found them passing).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.models import builtin as models
from pipeline.config.schema import LossConfig, TrainerConfig
from pipeline.trainer.policy import PolicyTrainer
from pipeline.types import Batch, Completion, Generation, GroupRequest, Prompt, RolloutGroup

PROMPTS = ("Hello there", "2+2=", "abc", "The quick brown fox")


def _trainer(model_dir: Path, loss: LossConfig | None = None, **cfg: object) -> PolicyTrainer:
    cfg.setdefault("lora_rank", 4)
    trainer = PolicyTrainer(model_dir, TrainerConfig(**cfg), loss or LossConfig(), seed=0)
    trainer.setup()
    return trainer


def _group(gid: int, text: str, tokens: list[np.ndarray], behaviour: list[np.ndarray], rewards: np.ndarray,
           version: int = 0) -> RolloutGroup:
    ids = tuple(text.encode())  # the built-in tokenizer's ids are the bytes
    request = GroupRequest(group_id=gid, prompt=Prompt(id=f"p{gid}", text=text, token_ids=ids), n=len(tokens),
                           max_new_tokens=max(len(t) for t in tokens))
    completions = tuple(Completion(token_ids=t.astype(np.int64), logprobs=b.astype(np.float32), finish_reason="length")
                        for t, b in zip(tokens, behaviour))
    gen = Generation(request=request, completions=completions, version=version, engine="test", t_start=0.0, t_end=0.0)
    return RolloutGroup(generation=gen, rewards=rewards.astype(np.float64), t_scored=0.0)


def _random_batch(seed: int = 0, n: int = 4, lengths: tuple[int, ...] = (2, 7, 4, 5), behaviour_shift: float = 0.0,
                  trainer: PolicyTrainer | None = None) -> Batch:
    """Groups of completions of unequal lengths with distinct rewards; behaviour log-probs are the
    trainer's own (from `trainer`) plus a per-token random shift of scale `behaviour_shift`, or -5.8."""
    rng = np.random.default_rng(seed)
    groups = []
    for gi, text in enumerate(PROMPTS):
        tokens = [rng.integers(0, models.EOS_ID, size=lengths[(gi + i) % len(lengths)]) for i in range(n)]
        behaviour = [np.full(len(t), -5.8) for t in tokens]
        groups.append(_group(gi, text, tokens, behaviour, rng.permutation(n).astype(float)))
    version = 0
    if trainer is not None:  # sampled at the trainer's current version
        version = trainer.version
        own = trainer.recompute_logprobs([replace(g, generation=replace(g.generation, version=version)) for g in groups])
        groups = [_group(gi, PROMPTS[gi], [c.token_ids for c in g.completions],
                         [lp + behaviour_shift * rng.standard_normal(len(lp)) for lp in own[gi]], g.rewards, version)
                  for gi, g in enumerate(groups)]
    return Batch(step=version + 1, version=version, groups=tuple(groups))


def _reference_gradients(trainer: PolicyTrainer, batch: Batch, cap: float) -> dict[str, torch.Tensor]:
    """TIS token_mean written out independently: -(1/T) sum_t min(exp(lp_t - beh_t), C) A lp_t."""
    rewards = [torch.as_tensor(g.rewards, dtype=torch.float32) for g in batch.groups]
    advantages = [(r - r.mean()) / (r.std(unbiased=False) + 1e-6) for r in rewards]
    return _gradients_for(trainer, batch, advantages, sum(len(c.token_ids) for g in batch.groups for c in g.completions),
                          cap)


def test_behaviour_logprobs_change_the_gradient_as_the_formula_says(model_dir):
    """Catches: the trainer using its own log-probs as the behaviour policy (ratio 1 everywhere)."""
    trainer = _trainer(model_dir, lora_dropout=0.0)
    with torch.no_grad():  # B != 0, so the adapter is not the identity and every LoRA gradient is nonzero
        for n, p in trainer._trainable():
            p.add_(0.05 * torch.randn_like(p))
    batch = _random_batch(seed=1, trainer=trainer, behaviour_shift=0.5)
    _, got = trainer.loss_gradients(batch)
    want = _reference_gradients(trainer, batch, cap=LossConfig().is_cap)
    on_policy = _reference_gradients(trainer, _random_batch(seed=1, trainer=trainer, behaviour_shift=0.0), cap=2.0)
    total = sum(float((want[n] - on_policy[n]).norm()) for n in want)
    assert total > 1e-3 * sum(float(on_policy[n].norm()) for n in want), "the shift must matter for the test to mean anything"
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=2e-4, atol=1e-7, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean", "constant"])
def test_gradients_are_invariant_to_the_micro_batch_size(model_dir, aggregation):
    """Catches: micro-batch losses summed without their weights (each micro-batch's mean counted as a whole)."""
    loss = LossConfig(aggregation=aggregation, norm_tokens=8)
    grads = []
    for m in (64, 3, 1):
        trainer = _trainer(model_dir, loss, micro_batch_sequences=m)
        with torch.no_grad():
            torch.manual_seed(3)
            for _, p in trainer._trainable():
                p.add_(0.05 * torch.randn_like(p))
        batch = _random_batch(seed=2, lengths=(1, 9, 3, 6, 2))
        value, g = trainer.loss_gradients(batch)
        grads.append((value, g))
    (v0, g0) = grads[0]
    for value, g in grads[1:]:
        assert value == pytest.approx(v0, rel=1e-5)
        for n in g0:
            scale = float(g0[n].abs().max())
            torch.testing.assert_close(g[n], g0[n], rtol=1e-4, atol=1e-5 * scale, msg=lambda m: f"{n}: {m}")


def _one_token_policy(trainer: PolicyTrainer, text: str) -> torch.Tensor:
    """The trainer's next-token distribution [V] after `text` (its exact probabilities)."""
    with torch.no_grad():
        ids = torch.tensor([list(text.encode())])
        return torch.softmax(trainer.model(input_ids=ids).logits[0, -1].float(), dim=-1)


def test_a_few_steps_raise_the_expected_reward(model_dir):
    """Catches: the advantage's sign flipped (training to lower the reward), or no learning at all.

    One-token completions sampled from the trainer's own distribution, reward 1 for a token below
    160 (about half the vocabulary): the expected reward sum_{t < 160} p(t) is exact, no sampling noise.
    """
    trainer = _trainer(model_dir, lr=5e-3)
    gen = torch.Generator().manual_seed(0)

    def expected() -> float:
        return float(np.mean([float(_one_token_policy(trainer, t)[:160].sum()) for t in PROMPTS]))

    before = expected()
    for step in range(1, 7):
        groups = []
        for gi, text in enumerate(PROMPTS):
            p = _one_token_policy(trainer, text)
            toks = torch.multinomial(p, 64, replacement=True, generator=gen)
            rewards = (toks < 160).double().numpy()
            groups.append(_group(step * 10 + gi, text, [np.array([t]) for t in toks.tolist()],
                                 [np.array([float(torch.log(p[t]))]) for t in toks.tolist()], rewards, step - 1))
        trainer.step(Batch(step=step, version=step - 1, groups=tuple(groups)))
    after = expected()
    # +0.02 here (0.618 -> 0.639); with the advantage's sign flipped it falls as much
    assert after > before + 0.01, f"expected reward {before:.3f} -> {after:.3f}: the policy did not learn"


def _stale_batch(trainer: PolicyTrainer, seed: int = 4) -> Batch:
    return _random_batch(seed=seed, trainer=trainer, behaviour_shift=0.3, lengths=(6, 8, 5, 7))


def test_ppo_clip_acts_from_the_second_optimizer_step(model_dir):
    """Catches: decoupled PPO without a proximal policy fixed at the start of the step (r = 1
    always, so the clip never acts and "ppo" is "tis" under another name)."""
    loss = LossConfig(correction="ppo", clip_eps=0.02)
    one = _trainer(model_dir, loss, lr=5e-2)
    stats_one = one.step(_stale_batch(one)).metrics
    four = _trainer(model_dir, loss, lr=5e-2, minibatches=4)
    stats_four = four.step(_stale_batch(four)).metrics
    assert stats_one["train/clipped_frac"] == 0.0 and stats_one["train/optimizer_steps"] == 1
    assert stats_four["train/optimizer_steps"] == 4
    assert stats_four["train/clipped_frac"] > 0.01, stats_four
    assert stats_four["train/proximal_s"] > 0
    # and ppo with several optimizer steps is not tis with several: the clip changed the update
    tis = _trainer(model_dir, replace(loss, correction="tis"), lr=5e-2, minibatches=4)
    tis.step(_stale_batch(tis))
    diff = sum(float((a - b).detach().abs().sum()) for (_, a), (_, b) in zip(four._trainable(), tis._trainable()))
    assert diff > 0


def test_epochs_and_minibatches_take_that_many_optimizer_steps_and_publish_one_version(model_dir):
    trainer = _trainer(model_dir, minibatches=2, epochs=3)
    stats = trainer.step(_stale_batch(trainer))
    assert stats.version == 1 and trainer.version == 1
    assert stats.metrics["train/optimizer_steps"] == 6
    assert stats.metrics["train/tokens"] == sum(len(c.token_ids) for g in _stale_batch(trainer).groups
                                                for c in g.completions)


def test_batch_ess_pools_the_whole_batch_not_a_mean_of_micro_batches(model_dir):
    """Catches: train/ess averaged over micro-batches (each can be 1 while the batch's is not)."""
    from pipeline.trainer.loss import effective_sample_size

    trainer = _trainer(model_dir, micro_batch_sequences=1)
    batch = _stale_batch(trainer)
    own = trainer.recompute_logprobs(batch.groups)
    w = np.concatenate([np.minimum(np.exp(lp - c.logprobs), 2.0) for g, lps in zip(batch.groups, own)
                        for c, lp in zip(g.completions, lps)]).astype(np.float64)
    stats = trainer.step(batch).metrics
    assert stats["train/ess"] == pytest.approx(effective_sample_size(w.sum(), (w * w).sum(), len(w)), rel=1e-3)
    assert stats["train/ess"] < 0.99


def test_kl_reference_is_the_base_model_and_pulls_nothing_at_version_zero(model_dir):
    """k3 to the base (adapter disabled): 0 with a zero adapter, positive once the policy moved,
    and the reference log-probs are the base model's own."""
    loss = LossConfig(kl_coef=0.5)
    trainer = _trainer(model_dir, loss)
    batch = _stale_batch(trainer)
    _, with_kl = trainer.loss_gradients(batch)
    plain = _trainer(model_dir)
    _, without = plain.loss_gradients(batch)
    for n in with_kl:  # k3's gradient is 0 where policy and reference agree
        torch.testing.assert_close(with_kl[n], without[n], rtol=1e-5, atol=1e-8)
    first = trainer.step(batch).metrics
    assert first["train/kl_ref"] == pytest.approx(0.0, abs=1e-9) and first["train/reference_s"] > 0
    for step in range(2, 5):
        stats = trainer.step(_stale_batch(trainer, seed=step)).metrics
    assert stats["train/kl_ref"] > 1e-6
    base = models.load_causal_lm(str(model_dir), "cpu", "float32")
    rows = trainer._rows(batch.groups)
    got = trainer._fixed_logprobs(rows, reference=True)
    want = models.completion_logprobs(base, rows.prompts, rows.comps, "cpu")
    for g, w, p in zip(got, want, rows.prompts):
        np.testing.assert_allclose(g[len(p):].numpy(), w, rtol=1e-5, atol=1e-6)


def test_kl_penalty_holds_the_policy_nearer_the_reference(model_dir):
    """Eight steps on one batch: with kl_coef = 5 the policy ends far nearer the base than with a
    negligible coefficient (measured 0.027 against 1.2 in k3 at the batch's tokens)."""
    def final_kl(coef: float) -> float:
        trainer = _trainer(model_dir, LossConfig(kl_coef=coef), lr=1e-2)
        batch = _random_batch(seed=3)
        for step in range(1, 9):
            stats = trainer.step(replace(batch, step=step, version=step - 1)).metrics
        return stats["train/kl_ref"]
    assert final_kl(5.0) < 0.2 * final_kl(1e-6)


def test_entropy_statistic_is_the_policy_entropy_at_the_sampled_tokens(model_dir):
    trainer = _trainer(model_dir)
    batch = _random_batch(seed=5, lengths=(1,))
    want = np.mean([float(-(p * p.log()).sum()) for g in batch.groups
                    for p in [_one_token_policy(trainer, g.prompt.text)] for _ in g.completions])
    stats = trainer.step(batch).metrics
    assert stats["train/entropy"] == pytest.approx(want, rel=1e-4)
    assert 0 < stats["train/entropy"] <= np.log(models.EOS_ID + 64)


# --------------------------------------------------------------------------- properties of the batch's statistics


def _perturbed(model_dir: Path, loss: LossConfig | None = None, **cfg: object) -> PolicyTrainer:
    """A trainer whose adapter is not the identity, so every LoRA weight has a nonzero gradient."""
    trainer = _trainer(model_dir, loss, lora_dropout=0.0, **cfg)
    with torch.no_grad():
        torch.manual_seed(11)
        for _, p in trainer._trainable():
            p.add_(0.05 * torch.randn_like(p))
    return trainer


def _uneven_batch(rewards: list[list[float]], lengths: tuple[int, ...] = (2, 7, 4, 5, 3), seed: int = 6) -> Batch:
    """Groups of completions of unequal lengths with the given rewards (one list a group)."""
    rng = np.random.default_rng(seed)
    groups = []
    for gi, rs in enumerate(rewards):
        tokens = [rng.integers(0, models.EOS_ID, size=lengths[(gi + i) % len(lengths)]) for i in range(len(rs))]
        groups.append(_group(gi, PROMPTS[gi % len(PROMPTS)], tokens, [np.full(len(t), -5.8) for t in tokens],
                             np.asarray(rs, dtype=float)))
    return Batch(step=1, version=0, groups=tuple(groups))


def _gradients_for(trainer: PolicyTrainer, batch: Batch, advantages: list[torch.Tensor], denominator: float,
                   cap: float = 2.0) -> dict[str, torch.Tensor]:
    """-(1 / denominator) sum over tokens of min(exp(lp - beh), C) A grad lp, with the advantages given."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    terms = []
    for g, adv in zip(batch.groups, advantages):
        for c, a in zip(g.completions, adv):
            ids = torch.tensor([list(g.prompt.token_ids) + c.token_ids.tolist()])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
            start = len(g.prompt.token_ids) - 1
            lp = logp[start:start + len(c.token_ids)].gather(-1, torch.as_tensor(c.token_ids)[:, None]).squeeze(-1)
            w = torch.exp(lp.detach() - torch.as_tensor(c.logprobs)).clamp(max=cap)
            terms.append((w * float(a) * lp).sum())
    (-torch.stack(terms).sum() / denominator).backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer._trainable()}
    model.zero_grad(set_to_none=True)
    return grads


def _assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for n in want:
        scale = float(want[n].abs().max())
        torch.testing.assert_close(got[n], want[n], rtol=2e-4, atol=1e-6 * scale, msg=lambda m: f"{n}: {m}")


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sum(float((a[n] - b[n]).norm()) for n in a) > 1e-2 * sum(float(b[n].norm()) for n in b)


# groups of different means and scales, and a flat one: pooled and per-group statistics differ
MIXED = [[0.0, 1.0, 0.0, 1.0], [10.0, 30.0, 20.0, 40.0], [5.0, 5.0, 5.0, 5.0], [-3.0, -2.0, -1.0, -2.5]]


def test_advantages_are_normalised_within_each_group_not_over_the_batch(model_dir):
    """Catches: the mean and std taken over the whole batch (every earlier test group was a
    permutation of 0..n-1, where pooled and per-group statistics coincide)."""
    trainer = _perturbed(model_dir)
    batch = _uneven_batch(MIXED)
    tokens = sum(len(c.token_ids) for g in batch.groups for c in g.completions)
    per_group = [torch.tensor(g.rewards) for g in batch.groups]
    per_group = [torch.zeros_like(r) if (r == r[0]).all() else (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
                 for r in per_group]
    pooled_r = torch.tensor(np.concatenate([g.rewards for g in batch.groups]))
    pooled = ((pooled_r - pooled_r.mean()) / (pooled_r.std(unbiased=False) + 1e-6)).split(4)
    want = _gradients_for(trainer, batch, per_group, tokens)
    assert _differ(want, _gradients_for(trainer, batch, list(pooled), tokens)), "the groups must tell the two apart"
    _, got = trainer.loss_gradients(batch)
    _assert_grads_close(got, want)


def test_a_flat_group_contributes_exactly_zero_gradient(model_dir):
    trainer = _perturbed(model_dir)
    _, got = trainer.loss_gradients(_uneven_batch([[5.0, 5.0, 5.0, 5.0], [0.25] * 3]))
    assert all(float(g.abs().max()) == 0.0 for g in got.values())


@pytest.mark.parametrize("norm_tokens", [8, 20])
def test_dr_grpo_divides_by_sequences_times_the_constant_whatever_the_lengths(model_dir, norm_tokens):
    """Catches: Dr.GRPO's constant normaliser replaced by the batch's actual token count or
    lengths (which brings back the length bias it exists to remove)."""
    loss = LossConfig(aggregation="constant", norm_tokens=norm_tokens, scale_rewards=False)
    trainer = _perturbed(model_dir, loss, micro_batch_sequences=3)
    batch = _uneven_batch(MIXED, lengths=(1, 6, 2, 5, 3))
    sequences = sum(len(g.completions) for g in batch.groups)
    centred = [torch.tensor(g.rewards) - float(np.mean(g.rewards)) for g in batch.groups]
    _, got = trainer.loss_gradients(batch)
    _assert_grads_close(got, _gradients_for(trainer, batch, centred, sequences * norm_tokens))
    tokens = sum(len(c.token_ids) for g in batch.groups for c in g.completions)
    assert tokens != sequences * norm_tokens  # the two normalisers differ, so the test tells them apart


def test_gradient_clipping_bounds_the_norm_the_optimizer_steps_with(model_dir):
    """Catches: grad_clip read but not applied (the reported norm is the pre-clip one)."""
    clip = 1e-3
    trainer = _perturbed(model_dir, grad_clip=clip)
    seen: list[float] = []
    step = trainer.optimizer.step

    def recording_step(*a: object, **kw: object) -> object:
        grads = [p.grad for _, p in trainer._trainable() if p.grad is not None]
        seen.append(float(torch.nn.utils.get_total_norm(grads)))
        return step(*a, **kw)

    trainer.optimizer.step = recording_step
    stats = trainer.step(_uneven_batch(MIXED)).metrics
    assert len(seen) == 1 and seen[0] <= clip * (1 + 1e-4), seen
    assert stats["train/grad_norm"] > 10 * clip  # reported before clipping, and clipping had work to do


def test_each_epochs_minibatches_partition_the_batch_in_a_seeded_order_of_their_own(model_dir):
    trainer = _perturbed(model_dir, minibatches=3, epochs=3)
    batch = _uneven_batch(MIXED)
    rows = len(trainer._rows(batch.groups).comps)
    parts: list[list[int]] = []
    backward = trainer._backward

    def recording(rows_: object, part: list[int], *a: object, **kw: object) -> float:
        parts.append(list(part))
        return backward(rows_, part, *a, **kw)

    trainer._backward = recording
    trainer.step(batch)
    assert len(parts) == 9
    epochs = [parts[i:i + 3] for i in range(0, 9, 3)]
    for epoch in epochs:  # each epoch: every row once, in three non-empty parts
        assert sorted(r for p in epoch for r in p) == list(range(rows)) and all(epoch)
    orders = [[r for p in epoch for r in p] for epoch in epochs]
    assert len({tuple(o) for o in orders}) == 3, "every epoch draws its own order"
    # reproducible: the same (seed, step, epoch) gives the same parts; another step another
    assert trainer._minibatches(rows, 1, 1) == epochs[1]
    assert trainer._minibatches(rows, 2, 1) != epochs[1]
