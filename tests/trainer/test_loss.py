"""The loss's invariants: on-policy equivalence, truncation, clipping, finiteness, aggregation, stats."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config.schema import LossConfig
from pipeline.errors import ConfigError
from pipeline.trainer.loss import group_advantages, logprob_mismatch, policy_loss

CORRECTIONS = ("none", "tis", "ppo")
AGGREGATIONS = ("token_mean", "seq_mean", "constant")


def cfg(**kw) -> LossConfig:
    return LossConfig(**kw)


def run(lp_values: torch.Tensor, beh: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, c: LossConfig,
        prox: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Loss, its gradient w.r.t. logprobs (a fresh leaf), and the stats."""
    lp = lp_values.detach().clone().requires_grad_(True)
    loss, stats = policy_loss(lp, beh, adv, mask, c, prox)
    loss.backward()
    return loss.detach(), lp.grad, stats


def random_batch(n: int = 4, t: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probs [n, t] in (-3, 0), advantages [n], and a mask [n, t] of unequal lengths >= 1."""
    g = torch.Generator().manual_seed(seed)
    lp = -3 * torch.rand(n, t, generator=g)
    adv = torch.randn(n, generator=g)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return lp, adv, mask


# --------------------------------------------------------------------------- advantages


def test_advantages_are_zero_mean_per_group():
    rewards = torch.randn(5, 8, generator=torch.Generator().manual_seed(1)) * 3 + 2
    for scale in (True, False):
        adv = group_advantages(rewards, scale=scale)
        assert adv.shape == rewards.shape
        assert torch.allclose(adv.mean(dim=1), torch.zeros(5), atol=1e-5)


def test_scaled_advantages_have_unit_population_std():
    rewards = torch.randn(5, 8, generator=torch.Generator().manual_seed(2)) * 3 + 2
    adv = group_advantages(rewards, scale=True)
    assert torch.allclose(adv.std(dim=1, unbiased=False), torch.ones(5), atol=1e-4)


def test_all_equal_group_gets_zero_advantage():
    # eight 0.1s (float32) leave a mean residue of -7e-9, which scaling would blow up to -0.0074
    rewards = torch.tensor([[0.1] * 8, [1.0] + [0.0] * 7, [7.0] * 8])
    for scale in (True, False):
        adv = group_advantages(rewards, scale=scale)
        assert torch.equal(adv[0], torch.zeros(8)) and torch.equal(adv[2], torch.zeros(8))
        assert adv[1].abs().sum() > 0 and torch.isfinite(adv).all()
    single = group_advantages(torch.tensor([[3.0], [-1.0]]), scale=True)  # groups of one: std 0
    assert torch.equal(single, torch.zeros(2, 1))


def test_unscaled_advantages_are_raw_centred_rewards():
    rewards = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 4.0]])
    expected = torch.tensor([[-1.0, 0.0, 1.0], [-4 / 3, -4 / 3, 8 / 3]])
    assert torch.allclose(group_advantages(rewards, scale=False), expected)
    scaled = group_advantages(rewards, scale=True, eps=0.0)
    assert torch.allclose(scaled[0], expected[0] / math.sqrt(2 / 3))  # population std of 1, 2, 3


def test_advantages_reject_wrong_rank():
    with pytest.raises(ValueError, match=r"\[G, n\]"):
        group_advantages(torch.zeros(4), scale=True)


# --------------------------------------------------------------------------- on-policy equivalence


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("correction", ["tis", "ppo"])
def test_loss_equals_on_policy_grpo_loss_when_behaviour_and_trainer_logprobs_agree(correction, aggregation):
    g = torch.Generator().manual_seed(3)
    n, t, v = 4, 6, 11
    logits = torch.randn(n, t, v, generator=g)
    tokens = torch.randint(0, v, (n, t, 1), generator=g)
    _, adv, mask = random_batch(n, t, seed=3)

    def loss_and_grad(c: LossConfig) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        leaf = logits.clone().requires_grad_(True)
        lp = torch.log_softmax(leaf, dim=-1).gather(-1, tokens).squeeze(-1)
        loss, stats = policy_loss(lp, lp.detach(), adv, mask, c)
        loss.backward()
        return loss.detach(), leaf.grad, stats

    ref_loss, ref_grad, _ = loss_and_grad(cfg(correction="none", aggregation=aggregation))
    for is_cap in (1.0, 2.0):  # a weight of exactly 1 = cap is not truncated
        loss, grad, stats = loss_and_grad(cfg(correction=correction, aggregation=aggregation, is_cap=is_cap))
        assert torch.allclose(loss, ref_loss) and torch.allclose(grad, ref_grad)
        assert stats["truncated_frac"] == 0.0 and stats["ess"] == 1.0 and stats["is_weight_mean"] == 1.0
    assert ref_grad.abs().sum() > 0


def test_on_policy_loss_value_is_minus_mean_advantage_over_tokens():
    lp, adv, mask = random_batch(seed=4)
    loss, grad, stats = run(lp, lp, adv, mask, cfg(correction="none"))
    per_token = -adv[:, None].expand_as(lp)
    n = mask.sum()
    assert torch.allclose(loss, per_token[mask].sum() / n)
    assert torch.allclose(grad, torch.where(mask, per_token / n, 0.0))
    assert stats["tokens"] == n.item()


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_ppo_with_default_proximal_equals_tis_for_any_behaviour(aggregation):
    lp, adv, mask = random_batch(seed=5)
    beh = lp + 2 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(5))
    loss_t, grad_t, stats_t = run(lp, beh, adv, mask, cfg(correction="tis", aggregation=aggregation))
    loss_p, grad_p, stats_p = run(lp, beh, adv, mask, cfg(correction="ppo", aggregation=aggregation))
    assert torch.allclose(loss_t, loss_p) and torch.allclose(grad_t, grad_p)
    assert stats_p["clipped_frac"] == 0.0 and stats_t["truncated_frac"] == stats_p["truncated_frac"] > 0


def test_none_ignores_behaviour_logprobs():
    lp, adv, mask = random_batch(seed=6)
    loss_a, grad_a, _ = run(lp, lp, adv, mask, cfg(correction="none"))
    loss_b, grad_b, stats = run(lp, lp - 5.0, adv, mask, cfg(correction="none"))
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)
    assert stats["is_weight_mean"] == 1.0 and stats["ess"] == 1.0 and stats["ratio_mean"] > 100


# --------------------------------------------------------------------------- truncation


def test_tis_truncates_weights_at_the_cap_when_behaviour_is_much_lower():
    lp, adv, mask = random_batch(seed=7)
    low = torch.zeros_like(mask)
    low[:, ::2] = True  # every other token: behaviour far below the trainer, raw weight e^5 > cap
    beh = torch.where(low, lp - 5.0, lp)
    c = cfg(correction="tis", is_cap=3.0)
    _, grad, stats = run(lp, beh, adv, mask, c)
    _, grad_none, _ = run(lp, beh, adv, mask, cfg(correction="none"))
    assert torch.allclose(grad[low], 3.0 * grad_none[low])
    assert torch.allclose(grad[~low], grad_none[~low])
    truncated = (low & mask).sum() / mask.sum()
    assert stats["truncated_frac"] == pytest.approx(truncated.item())
    assert stats["is_weight_mean"] == pytest.approx(1 + 2 * truncated.item(), rel=1e-6)
    assert stats["ratio_max"] == pytest.approx(math.exp(5.0), rel=1e-5)


def test_tis_scales_gradient_down_by_the_ratio_when_behaviour_is_higher():
    lp, adv, mask = random_batch(seed=8)
    beh = lp + 2 * torch.rand(lp.shape, generator=torch.Generator().manual_seed(8))
    _, grad, stats = run(lp, beh, adv, mask, cfg(correction="tis"))
    _, grad_none, _ = run(lp, beh, adv, mask, cfg(correction="none"))
    assert torch.allclose(grad, torch.exp(lp - beh) * grad_none)
    assert stats["truncated_frac"] == 0.0 and stats["is_weight_mean"] < 1.0


def test_weight_never_falls_below_exp_minus_clamp():
    lp, adv, mask = random_batch(seed=15)
    beh = lp + 50.0  # raw weight e^-50; the clamped log-ratio keeps it at e^-5
    _, grad, stats = run(lp, beh, adv, mask, cfg(correction="tis", logratio_clamp=5.0))
    _, grad_none, _ = run(lp, beh, adv, mask, cfg(correction="none"))
    assert torch.allclose(grad, math.exp(-5.0) * grad_none)
    assert stats["is_weight_mean"] == pytest.approx(math.exp(-5.0), rel=1e-5)


# --------------------------------------------------------------------------- ppo clipping


def test_ppo_clipped_tokens_get_zero_gradient_and_are_counted():
    lp = torch.full((5, 1), -1.0)
    shift = torch.tensor([[0.5], [0.5], [-0.5], [-0.5], [0.1]])  # r = exp(shift): 1.65, 0.61, 1.11
    prox = lp - shift
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0])
    mask = torch.ones(5, 1, dtype=torch.bool)
    # behaviour = proximal: the IS weight is 1, only the clip acts
    loss, grad, stats = run(lp, prox, adv, mask, cfg(correction="ppo", clip_eps=0.2), prox)
    r = torch.exp(shift).squeeze(1)
    clipped = torch.tensor([True, False, True, False, False])  # A>0 & r>1.2, A<0 & r<0.8
    assert torch.equal(grad.squeeze(1)[clipped], torch.zeros(2))
    assert torch.allclose(grad.squeeze(1)[~clipped], -(adv * r)[~clipped] / 5)
    assert stats["clipped_frac"] == pytest.approx(2 / 5)
    expected = -torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv).mean()
    assert torch.allclose(loss, expected)


# --------------------------------------------------------------------------- finiteness


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_huge_mismatch_gives_a_finite_loss_thanks_to_the_clamp(correction):
    assert torch.isinf(torch.exp(torch.tensor(1e4)))  # what the clamp prevents
    lp, adv, mask = random_batch(seed=9)
    c = cfg(correction=correction, logratio_clamp=20.0)
    for beh in (torch.full_like(lp, -1e4), torch.zeros_like(lp) + 1e4):
        loss, grad, stats = run(lp, beh, adv, mask, c)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert all(math.isfinite(v) for v in stats.values())
        assert 0 < stats["ess"] <= 1
    _, _, stats = run(lp, torch.full_like(lp, -1e4), adv, mask, c)
    assert stats["ratio_max"] == pytest.approx(math.exp(20.0), rel=1e-6)
    assert stats["truncated_frac"] == (0.0 if correction == "none" else 1.0)
    # ppo with a far proximal policy and negative advantages: r is unclipped, so it must be clamped
    prox = torch.full_like(lp, -1e4)
    loss, grad, _ = run(lp, prox, -adv.abs() - 0.1, mask, cfg(correction="ppo"), prox)
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and loss > 0


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("correction", CORRECTIONS)
def test_nonfinite_inputs_are_masked_counted_and_backward_works(correction, aggregation):
    lp, adv, mask = random_batch(n=5, t=6, seed=10)
    mask[:, :3] = True  # at least three tokens per sequence
    beh = lp - 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(10))
    prox = lp + 0.05
    bad_lp, bad_beh, bad_adv = lp.clone(), beh.clone(), adv.clone()
    bad_prox = prox.clone()
    bad_lp[0, 0] = float("nan")
    bad_beh[1, 1] = float("inf")
    bad_beh[2, 0] = float("-inf")
    bad_prox[3, 2] = float("nan")
    bad_adv[4] = float("nan")
    bad_lp[0, 5] = float("nan")
    mask[0, 5] = False  # non-finite outside the mask: neither used nor counted
    dropped = torch.zeros_like(mask)
    dropped[0, 0] = dropped[1, 1] = dropped[2, 0] = dropped[3, 2] = True
    dropped[4] = mask[4]
    c = cfg(correction=correction, aggregation=aggregation)

    loss, grad, stats = run(bad_lp, bad_beh, bad_adv, mask, c, bad_prox)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert stats["masked_nonfinite"] == dropped.sum().item()
    assert stats["tokens"] == (mask & ~dropped).sum().item()
    assert torch.equal(grad[dropped], torch.zeros(int(dropped.sum())))
    # the same as if those tokens had never been in the mask
    clean_adv = torch.where(torch.isfinite(bad_adv), bad_adv, 0.0)
    ref_loss, ref_grad, _ = run(lp, beh, clean_adv, mask & ~dropped, c, prox)
    assert torch.allclose(loss, ref_loss) and torch.allclose(grad, ref_grad)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("correction", CORRECTIONS)
def test_no_valid_token_gives_zero_loss_still_connected(correction, aggregation):
    lp, adv, _ = random_batch(seed=11)
    c = cfg(correction=correction, aggregation=aggregation)
    for values, mask in ((lp, torch.zeros(lp.shape, dtype=torch.bool)), (torch.full_like(lp, float("nan")),
                                                                          torch.ones(lp.shape))):
        loss, grad, stats = run(values, lp, adv, mask, c)
        assert loss.item() == 0.0 and torch.equal(grad, torch.zeros_like(lp))
        assert stats["tokens"] == 0 and stats["ess"] == 1.0
        assert all(math.isfinite(v) for v in stats.values())


# --------------------------------------------------------------------------- aggregation


def test_token_mean_and_seq_mean_differ_on_unequal_lengths():
    lp = torch.full((3, 3), -1.0)
    adv = torch.tensor([2.0, 1.0, 5.0])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.float32)  # lengths 1, 3, 0
    loss_t, grad_t, _ = run(lp, lp, adv, mask, cfg(correction="none", aggregation="token_mean"))
    loss_s, grad_s, _ = run(lp, lp, adv, mask, cfg(correction="none", aggregation="seq_mean"))
    assert loss_t.item() == pytest.approx((-2 - 1 - 1 - 1) / 4)  # -1.25: every token counts once
    assert loss_s.item() == pytest.approx((-2 + -1) / 2)  # -1.5: every non-empty sequence counts once
    assert torch.allclose(grad_t, torch.tensor([[-0.5, 0, 0], [-0.25, -0.25, -0.25], [0, 0, 0]]))
    assert torch.allclose(grad_s, torch.tensor([[-1.0, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [0, 0, 0]]))


# --------------------------------------------------------------------------- statistics


def test_ess_is_one_for_equal_weights_and_below_one_otherwise():
    lp, adv, mask = random_batch(seed=12)
    _, _, equal = run(lp, lp - 0.3, adv, mask, cfg(correction="tis"))  # every weight e^0.3 < cap
    assert equal["ess"] == pytest.approx(1.0, abs=1e-9) and equal["truncated_frac"] == 0.0
    lp2 = torch.tensor([[-1.0, -1.0]])
    beh2 = torch.tensor([[-1.0, -1.0 - math.log(2.0)]])  # weights 1 and 2
    _, _, unequal = run(lp2, beh2, torch.ones(1), torch.ones(1, 2), cfg(correction="tis", is_cap=4.0))
    assert unequal["ess"] == pytest.approx(9 / (2 * 5))  # (1 + 2)^2 / (2 * (1 + 4))
    assert unequal["is_weight_mean"] == pytest.approx(1.5)
    assert unequal["ratio_mean"] == pytest.approx(1.5) and unequal["ratio_max"] == pytest.approx(2.0)


def test_kl_is_zero_when_logprobs_agree_and_positive_otherwise():
    lp, adv, mask = random_batch(seed=13)
    _, _, same = run(lp, lp, adv, mask, cfg())
    assert same["kl_behaviour_trainer"] == 0.0 and same["mean_abs_logprob_diff"] == 0.0
    assert same["ratio_mean"] == same["ratio_max"] == 1.0
    lp2 = torch.tensor([[-1.0, -1.0]])
    beh2 = torch.tensor([[-1.0 - math.log(2.0), -1.0 + 0.5]])  # d = log 2 and -0.5
    _, _, diff = run(lp2, beh2, torch.ones(1), torch.ones(1, 2), cfg())
    k3 = ((2 - 1 - math.log(2)) + (math.exp(-0.5) - 1 + 0.5)) / 2
    assert diff["kl_behaviour_trainer"] == pytest.approx(k3, rel=1e-5) and k3 > 0
    assert diff["mean_abs_logprob_diff"] == pytest.approx((math.log(2) + 0.5) / 2, rel=1e-5)


def test_logprob_mismatch_statistics():
    engine = torch.tensor([-1.0, -2.0, -0.5, -3.0, float("nan")])
    trainer = torch.tensor([-1.0, -2.1, -0.5 + math.log(1.5), -3.0, -1.0])  # ratios 1, 0.905, 1.5, 1
    out = logprob_mismatch(engine, trainer)
    assert out["tokens"] == 4 and out["nonfinite"] == 1
    assert out["mean_abs_diff"] == pytest.approx((0.1 + math.log(1.5)) / 4, rel=1e-5)
    assert out["max_abs_diff"] == pytest.approx(math.log(1.5), rel=1e-5)
    assert out["ratio_outside_frac"] == pytest.approx(1 / 4)
    k3 = ((math.exp(-0.1) - 1 + 0.1) + (1.5 - 1 - math.log(1.5))) / 4
    assert out["kl"] == pytest.approx(k3, rel=1e-4)
    same = logprob_mismatch(engine[:4], engine[:4])
    assert same["mean_abs_diff"] == same["max_abs_diff"] == same["kl"] == same["ratio_outside_frac"] == 0.0
    huge = logprob_mismatch(torch.tensor([-1e4]), torch.tensor([-1.0]))
    assert all(math.isfinite(v) for v in huge.values()) and huge["ratio_outside_frac"] == 1.0
    with pytest.raises(ValueError, match="same shape"):
        logprob_mismatch(torch.zeros(3), torch.zeros(4))


def test_policy_loss_refuses_wrong_shapes_and_unknown_modes():
    lp, adv, mask = random_batch(seed=14)
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        policy_loss(lp, lp[:, :-1], adv, mask, cfg())
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(lp, lp, adv[:-1], mask, cfg())
    with pytest.raises(ValueError, match=r"\[N, T\]"):
        policy_loss(lp[0], lp[0], adv, mask[0], cfg())
    with pytest.raises(ConfigError, match="loss.correction"):
        policy_loss(lp, lp, adv, mask, cfg(correction="is"))


# --------------------------------------------------------------------------- property


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 6), t=st.integers(1, 8), seed=st.integers(0, 2**31 - 1),
    correction=st.sampled_from(CORRECTIONS), aggregation=st.sampled_from(AGGREGATIONS),
    log10_mismatch=st.floats(-3, 4), log10_adv=st.floats(-3, 3), nonfinite_p=st.sampled_from([0.0, 0.1, 0.5]),
    is_cap=st.floats(1, 10), clip_eps=st.floats(0.01, 0.99), clamp=st.floats(0.5, 50),
    with_proximal=st.booleans(), is_mode=st.sampled_from(["truncate", "mask"]), sequence=st.booleans(),
    kl_coef=st.sampled_from([0.0, 0.1, 10.0]),
)
def test_loss_and_stats_are_always_finite(n, t, seed, correction, aggregation, log10_mismatch, log10_adv,
                                          nonfinite_p, is_cap, clip_eps, clamp, with_proximal, is_mode, sequence,
                                          kl_coef):
    g = torch.Generator().manual_seed(seed)
    lp = -10 * torch.rand(n, t, generator=g)
    beh = lp + 10**log10_mismatch * torch.randn(n, t, generator=g)
    adv = 10**log10_adv * torch.randn(n, generator=g)
    mask = torch.rand(n, t, generator=g) < 0.7
    prox = lp + torch.randn(n, t, generator=g) if with_proximal else None
    specials = torch.tensor([float("nan"), float("inf"), float("-inf")])
    for x in (lp, beh) + ((prox,) if prox is not None else ()):
        hit = torch.rand(n, t, generator=g) < nonfinite_p
        x[hit] = specials[torch.randint(0, 3, (int(hit.sum()),), generator=g)]
    adv[torch.rand(n, generator=g) < nonfinite_p / 2] = float("nan")
    if correction == "none":
        is_mode = "truncate"  # mask needs a weight to compare with the cap
    if sequence:
        aggregation = "seq_mean"
    c = cfg(correction=correction, aggregation=aggregation, is_cap=is_cap, clip_eps=clip_eps, logratio_clamp=clamp,
            is_mode=is_mode, ratio_level="sequence" if sequence else "token", kl_coef=kl_coef, norm_tokens=t)
    ref = lp + 10**log10_mismatch * torch.randn(n, t, generator=g)

    lp_leaf = lp.detach().clone().requires_grad_(True)
    loss, stats = policy_loss(lp_leaf, beh, adv, mask, c, prox, ref)
    loss.backward()
    grad = lp_leaf.grad
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(math.isfinite(v) for v in stats.values()), stats
    assert (0 if is_mode == "mask" else 1e-300) <= stats["ess"] <= 1
    assert stats["tokens"] + stats["masked_nonfinite"] == mask.sum().item()
    for key in ("truncated_frac", "clipped_frac"):
        assert 0 <= stats[key] <= 1
    assert stats["kl_behaviour_trainer"] >= -1e-12 and stats["is_weight_mean"] <= is_cap * (1 + 1e-6)


# --------------------------------------------------------------------------- the loss family


def test_sample_std_is_bessel_corrected():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 7.0]])
    pop = group_advantages(rewards, scale=True, eps=0.0, std="population")
    sample = group_advantages(rewards, scale=True, eps=0.0, std="sample")
    centred = rewards - rewards.mean()
    assert torch.allclose(pop, centred / rewards.std(unbiased=False))
    assert torch.allclose(sample, centred / rewards.std(unbiased=True))
    assert torch.allclose(sample / pop, torch.full_like(pop, math.sqrt(3 / 4)))
    assert torch.equal(group_advantages(torch.tensor([[2.0]]), scale=True, std="sample"), torch.zeros(1, 1))
    with pytest.raises(ConfigError, match="loss.std"):
        group_advantages(rewards, scale=True, std="unbiased")


def test_mask_mode_drops_tokens_above_the_cap_and_keeps_them_in_the_denominator():
    lp, adv, mask = random_batch(seed=21)
    mask = torch.ones_like(mask)
    beh = lp.clone()
    beh[:, ::2] -= 2.0  # weight e^2 = 7.4 > cap 2 on even tokens; 1 on odd ones
    loss_m, grad_m, stats_m = run(lp, beh, adv, mask, cfg(correction="tis", is_mode="mask"))
    loss_t, grad_t, stats_t = run(lp, beh, adv, mask, cfg(correction="tis", is_mode="truncate"))
    n = mask.sum()
    assert torch.equal(grad_m[:, ::2], torch.zeros_like(grad_m[:, ::2]))
    assert torch.allclose(grad_m[:, 1::2], -adv[:, None].expand_as(lp)[:, 1::2] / n)  # same denominator: all tokens
    assert torch.allclose(grad_t[:, ::2], -2.0 * adv[:, None].expand_as(lp)[:, ::2] / n)  # truncated to C = 2
    assert stats_m["truncated_frac"] == stats_t["truncated_frac"] == pytest.approx(0.5)
    assert stats_m["is_weight_mean"] == pytest.approx(0.5) and stats_t["is_weight_mean"] == pytest.approx(1.5)
    assert stats_m["ess"] == pytest.approx(0.5)  # half the weights 0, half equal


def test_sequence_level_ratio_is_the_geometric_mean_of_the_tokens_ratios():
    """GSPO: one ratio per sequence, exp(mean over its tokens of lp - prox), clipped as a whole."""
    lp, adv, mask = random_batch(n=3, t=5, seed=22)
    g = torch.Generator().manual_seed(22)
    prox = lp + 0.05 * torch.randn(lp.shape, generator=g)
    eps = 0.01
    c = cfg(correction="ppo", ratio_level="sequence", aggregation="seq_mean", clip_eps=eps)
    loss, grad, stats = run(lp, lp.clone(), adv, mask, c, prox)  # behaviour = trainer: weight exp(prox - beh)
    leaf = lp.clone().requires_grad_(True)
    m = mask.float()
    s = torch.exp(((leaf - prox) * m).sum(1) / m.sum(1))
    w = torch.exp(((prox - lp) * m).sum(1) / m.sum(1)).clamp(max=2.0)
    obj = torch.minimum(s * adv, s.clamp(1 - eps, 1 + eps) * adv)
    want = -(w * obj).mean()
    want.backward()
    assert torch.allclose(loss, want.detach(), atol=1e-6)
    assert torch.allclose(grad, leaf.grad, atol=1e-6)
    clipped_rows = ((adv > 0) & (s > 1 + eps)) | ((adv < 0) & (s < 1 - eps))
    assert clipped_rows.any() and (~clipped_rows).any(), "the example must clip some sequences and not others"
    assert torch.equal(grad[clipped_rows], torch.zeros_like(grad[clipped_rows]))


def test_sequence_ratio_level_needs_seq_mean_and_mask_needs_a_correction():
    with pytest.raises(ConfigError, match='loss.aggregation = "seq_mean"'):
        cfg(ratio_level="sequence")
    with pytest.raises(ConfigError, match='loss.is_mode = "mask"'):
        cfg(correction="none", is_mode="mask")
    with pytest.raises(ConfigError, match="loss.kl_coef"):
        cfg(kl_coef=-1.0)


def test_constant_aggregation_divides_by_sequences_times_norm_tokens():
    """Dr.GRPO: sum over tokens / (N x L), so a long sequence's tokens weigh what a short one's do."""
    lp, adv, mask = random_batch(n=4, t=6, seed=23)
    loss, grad, _ = run(lp, lp, adv, mask, cfg(correction="none", aggregation="constant"), None)
    # norm_tokens defaults to 0 at the loss (the trainer passes sampling.max_new_tokens): max(1, 0) = 1
    loss8, grad8, _ = run(lp, lp, adv, mask, cfg(correction="none", aggregation="constant", norm_tokens=8), None)
    leaf = lp.clone().requires_grad_(True)
    loss8b, _ = policy_loss(leaf, lp, adv, mask, cfg(correction="none", aggregation="constant"), norm_tokens=8)
    per_token = -adv[:, None].expand_as(lp)
    assert torch.allclose(loss8b.detach(), per_token[mask].sum() / (4 * 8))
    assert torch.allclose(loss, per_token[mask].sum() / 4)
    loss8b.backward()
    assert torch.allclose(leaf.grad, torch.where(mask, per_token / 32, 0.0))


def test_k3_penalty_value_and_gradient():
    """kl_coef * (exp(ref - lp) - (ref - lp) - 1) per token: 0 and no gradient where policy and
    reference agree; its gradient 1 - exp(ref - lp) elsewhere, pulling lp towards ref."""
    lp, adv, mask = random_batch(seed=24)
    zero_adv = torch.zeros_like(adv)
    c = cfg(correction="none", kl_coef=0.5)
    ref = lp + torch.randn(lp.shape, generator=torch.Generator().manual_seed(24))
    leaf = lp.clone().requires_grad_(True)
    loss, stats = policy_loss(leaf, lp, zero_adv, mask, c, reference_logprobs=ref)
    loss.backward()
    d = ref - lp
    k3 = d.exp() - d - 1
    n = mask.sum()
    assert torch.allclose(loss, 0.5 * k3[mask].sum() / n, atol=1e-6)
    assert torch.allclose(leaf.grad, torch.where(mask, 0.5 * (1 - d.exp()) / n, 0.0), atol=1e-6)
    assert stats["kl_ref"] == pytest.approx(float(k3[mask].mean()), rel=1e-5)
    same, stats0 = policy_loss(lp.clone().requires_grad_(True), lp, adv, mask, c, reference_logprobs=lp)
    plain, _ = policy_loss(lp.clone().requires_grad_(True), lp, adv, mask, cfg(correction="none"))
    assert torch.allclose(same, plain) and stats0["kl_ref"] == 0.0
    off, stats_off = policy_loss(lp.clone().requires_grad_(True), lp, adv, mask, cfg(correction="none"),
                                 reference_logprobs=ref)  # kl_coef 0: the reference is not read
    assert torch.allclose(off, plain) and stats_off["kl_ref"] == 0.0
