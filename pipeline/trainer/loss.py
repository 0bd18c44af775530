"""Advantages and the importance-corrected policy loss family, as pure tensor functions.

The loss of a token is built from three parts, each a small function here, chosen by config:
- `behaviour_weights`: the importance weight w of the proximal policy over the engine's (behaviour)
  one, per token or per sequence (`ratio_level`), truncated at `is_cap` or masked above it (`is_mode`).
- `surrogate`: the policy-gradient term, plain (none, tis) or decoupled PPO's clipped ratio to the
  proximal policy (ppo), per token or per sequence (GSPO).
- `aggregate`: token_mean (DAPO), seq_mean (GRPO) or a constant denominator (Dr.GRPO).
Plus `kl_k3`, the penalty to a reference policy, and `group_advantages` (GRPO's, or Dr.GRPO's
without the std).

Invariants:
- No model code, no I/O: tensors in, a scalar loss and python-float statistics out.
- When the behaviour (engine) log-probs equal the trainer's, every correction ("tis", "ppo")
  gives exactly the plain on-policy GRPO loss, in value and in gradient (at either ratio level,
  in either is_mode: no weight exceeds the cap).
- Log-ratios are clamped before `exp` and non-finite inputs are masked out (and counted), so
  the loss is always finite and always connected to the graph: `.backward()` works even when
  no token is left.
- Only `logprobs` carries gradient: behaviour, proximal and reference log-probs, advantages and
  the importance weights are detached.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pipeline.config.schema import LossConfig
from pipeline.errors import ConfigError

# The band of the logprob-contract check: a token whose ratio exp(trainer - engine) leaves
# [0.8, 1.25] counts as mismatched (symmetric in log space: 0.8 = 1 / 1.25).
MISMATCH_RATIO_BAND = (0.8, 1.25)
# logprob_mismatch has no config; it clamps like LossConfig's default so its KL cannot overflow.
_MISMATCH_LOGRATIO_CLAMP = 20.0
# The statistics when no valid token is left: neutral (nothing weighed, nothing mismatched)
# and finite, so per-step metrics stay plottable.
_EMPTY_STATS = {"ratio_mean": 1.0, "ratio_max": 1.0, "is_weight_mean": 1.0, "truncated_frac": 0.0,
                "clipped_frac": 0.0, "ess": 1.0, "kl_behaviour_trainer": 0.0, "mean_abs_logprob_diff": 0.0,
                "kl_ref": 0.0, "is_weight_sum": 0.0, "is_weight_sq_sum": 0.0}


def group_advantages(rewards: Tensor, scale: bool, eps: float = 1e-6, std: str = "population") -> Tensor:
    """GRPO advantages: each reward minus its group's mean, divided by the group's std if `scale`.

    rewards: [G, n] (G groups of n completions) -> [G, n], floating point.
    std: "population" (divide by n, as the GRPO paper) or "sample" (n - 1, Bessel's, as TRL).
    A group whose rewards are all equal (a group of one among them) carries no learning signal
    and gets exactly 0 (no NaN, no rounding residue from the mean).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [G, n], got shape {tuple(rewards.shape)}")
    if std not in ("population", "sample"):
        raise ConfigError(f"loss.std must be 'population' or 'sample', got {std!r}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale and rewards.shape[1] > 1:  # a group of one is flat: 0 below, with no std of one value to take
        centred = centred / (rewards.std(dim=1, keepdim=True, unbiased=std == "sample") + eps)
    flat = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    return torch.where(flat, torch.zeros_like(centred), centred)


def sequence_mean(x: Tensor, valid: Tensor) -> Tensor:
    """Per row, the mean of x over its valid tokens, broadcast back to [N, T] (0 for a row without one)."""
    validf = valid.to(x.dtype)
    return ((x * validf).sum(dim=1, keepdim=True) / validf.sum(dim=1, keepdim=True).clamp(min=1)).expand_as(x)


def behaviour_weights(proximal: Tensor, behaviour: Tensor, valid: Tensor,
                      cfg: LossConfig) -> tuple[Tensor, Tensor]:
    """The importance weight of the proximal policy over the behaviour one, detached: (w, above cap).

    Token level: w = exp(prox - beh) per token. Sequence level: per sequence, exp of the mean of its
    tokens' log-ratios (the geometric mean of their ratios), on every token of it. Above the cap
    the weight is C (is_mode "truncate", truncated IS) or 0 (is_mode "mask", as AReaL filters
    such tokens: they stay in the denominator and add nothing). correction "none": all 1.
    """
    if cfg.correction == "none":
        ones = torch.ones_like(proximal)
        return ones, torch.zeros_like(valid)
    log_w = (proximal - behaviour).clamp(-cfg.logratio_clamp, cfg.logratio_clamp)
    if cfg.ratio_level == "sequence":
        log_w = sequence_mean(log_w, valid)
    raw = log_w.exp()
    above = raw > cfg.is_cap
    if cfg.is_mode == "mask":
        return torch.where(above, torch.zeros_like(raw), raw), above
    return raw.clamp(max=cfg.is_cap), above


def surrogate(logprobs: Tensor, proximal: Tensor, adv: Tensor, valid: Tensor,
              cfg: LossConfig) -> tuple[Tensor, Tensor]:
    """The policy-gradient term per token, to be weighed and negated: (surrogate, clipped).

    none, tis: exp(lp - lp.detach()) * A: value A, gradient A * grad lp.
    ppo: min(r A, clip(r, 1 - eps, 1 + eps) A) with r = exp(lp - prox) per token (decoupled PPO,
    Hilton et al. 2021, as in AReaL), or per sequence r = exp(mean over its tokens of lp - prox)
    on each of its tokens (GSPO, Zheng et al. 2025). `clipped` marks where min() took the clipped
    branch, whose gradient is 0.
    """
    if cfg.correction != "ppo":
        return (logprobs - logprobs.detach()).exp() * adv, torch.zeros_like(valid)  # exp(0): nothing to clamp
    log_r = (logprobs - proximal).clamp(-cfg.logratio_clamp, cfg.logratio_clamp)
    if cfg.ratio_level == "sequence":
        log_r = sequence_mean(log_r, valid)
    r = log_r.exp()
    eps = cfg.clip_eps
    clipped = ((adv > 0) & (r > 1 + eps)) | ((adv < 0) & (r < 1 - eps))
    return torch.where(clipped, r.clamp(1 - eps, 1 + eps) * adv, r * adv), clipped


def kl_k3(logprobs: Tensor, reference: Tensor, bound: float) -> Tensor:
    """Per token, the k3 estimate of KL(policy || reference) at the sampled token (Schulman's):
    exp(ref - lp) - (ref - lp) - 1 >= 0, 0 where they agree; its gradient flows through lp."""
    d = (reference - logprobs).clamp(-bound, bound)
    return d.exp() - d - 1


def aggregate(per_token: Tensor, valid: Tensor, cfg: LossConfig, norm_tokens: int) -> Tensor:
    """token_mean: sum over valid tokens / their count (DAPO). seq_mean: mean over sequences with
    a valid token of each one's token mean (GRPO). constant: sum over valid tokens / (sequences x
    norm_tokens) (Dr.GRPO: no length bias)."""
    validf = valid.to(per_token.dtype)
    if cfg.aggregation == "token_mean":
        return per_token.sum() / validf.sum().clamp(min=1)
    if cfg.aggregation == "constant":
        return per_token.sum() / (per_token.shape[0] * max(1, norm_tokens))
    count = validf.sum(dim=1)
    return (per_token.sum(dim=1) / count.clamp(min=1)).sum() / (count > 0).sum().clamp(min=1)


def _check(logprobs: Tensor, behaviour: Tensor, advantages: Tensor, mask: Tensor,
           others: dict[str, Tensor | None], cfg: LossConfig) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [N, T], got shape {tuple(logprobs.shape)}")
    for name, t in (("behaviour_logprobs", behaviour), ("mask", mask), *others.items()):
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} must have the shape of logprobs {tuple(logprobs.shape)}, got {tuple(t.shape)}")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [N] = [{logprobs.shape[0]}], got shape {tuple(advantages.shape)}")
    if cfg.correction not in ("none", "tis", "ppo"):
        raise ConfigError(f"loss.correction must be one of 'tis', 'ppo', 'none', got {cfg.correction!r}")
    if cfg.aggregation not in ("token_mean", "seq_mean", "constant"):
        raise ConfigError(f"loss.aggregation must be 'token_mean', 'seq_mean' or 'constant', got {cfg.aggregation!r}")


def policy_loss(logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                cfg: LossConfig, proximal_logprobs: Tensor | None = None, reference_logprobs: Tensor | None = None,
                norm_tokens: int = 0) -> tuple[Tensor, dict[str, float]]:
    """The GRPO policy loss, importance-corrected for the engine having sampled from another policy.

    logprobs: [N, T] trainer log-probs of the sampled tokens under the current weights (with grad).
    behaviour_logprobs: [N, T] the engine's stored sampling log-probs.
    advantages: [N] one per sequence, broadcast over its tokens.
    mask: [N, T] bool or 0/1, nonzero on the tokens to weigh: the completion tokens the policy
        sampled (a multi-turn episode's environment tokens are 0, and nothing of them is read).
    proximal_logprobs: [N, T] or None = logprobs.detach(): the weights at the start of the step
        (the trainer computes them once before its first optimizer step when it takes several).
    reference_logprobs: [N, T] or None: the reference policy's, for the KL penalty (cfg.kl_coef).
    norm_tokens: aggregation "constant"'s tokens per sequence.

    Per token: -w * surrogate + kl_coef * k3(lp, ref), with w from `behaviour_weights` and the
    surrogate from `surrogate`, aggregated by `aggregate`. Tokens with a non-finite logprob,
    behaviour, proximal, reference or advantage are dropped and counted.

    Returns (loss: [] scalar, stats) with python floats: ratio_mean, ratio_max (of
    exp(lp - behaviour)), is_weight_mean, truncated_frac (weight above the cap: truncated, or
    masked), clipped_frac (ppo: the clipped branch dropped a nonzero gradient), ess ((sum w)^2 /
    (n sum w^2), in [0, 1]), is_weight_sum and is_weight_sq_sum (to pool the ESS of several calls),
    kl_behaviour_trainer (k3: mean of exp(d) - 1 - d, d = lp - behaviour), mean_abs_logprob_diff,
    kl_ref (mean k3 to the reference; 0 without one), tokens (valid), masked_nonfinite. Weight
    statistics are of the weights applied (all 1 for none).
    """
    _check(logprobs, behaviour_logprobs, advantages, mask,
           {"proximal_logprobs": proximal_logprobs, "reference_logprobs": reference_logprobs}, cfg)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)  # bf16 log-ratios lose the signal
    lp = logprobs.to(dtype)

    def detached(t: Tensor) -> Tensor:
        return t.detach().to(device=lp.device, dtype=dtype)

    beh = detached(behaviour_logprobs)
    adv = detached(advantages)[:, None].expand_as(lp)
    prox = lp.detach() if proximal_logprobs is None else detached(proximal_logprobs)
    ref = None if reference_logprobs is None or cfg.kl_coef == 0 else detached(reference_logprobs)
    in_mask = mask.to(lp.device) != 0
    finite = lp.detach().isfinite() & beh.isfinite() & adv.isfinite() & prox.isfinite()
    if ref is not None:
        finite &= ref.isfinite()
    valid = in_mask & finite
    # Dropped tokens become zeros before any arithmetic: NaN * 0 is still NaN, in values and gradients.
    zero = torch.zeros((), dtype=dtype, device=lp.device)
    lp, beh, adv, prox = (torch.where(valid, x, zero) for x in (lp, beh, adv, prox))

    w, above = behaviour_weights(prox, beh, valid, cfg)
    surr, clipped = surrogate(lp, prox, adv, valid, cfg)
    per_token = -w * surr
    k3 = None
    if ref is not None:
        k3 = kl_k3(lp, torch.where(valid, ref, zero), cfg.logratio_clamp)
        per_token = per_token + cfg.kl_coef * k3
    loss = aggregate(torch.where(valid, per_token, zero), valid, cfg, norm_tokens)

    with torch.no_grad():
        tokens = int(valid.sum())
        stats = {"tokens": float(tokens), "masked_nonfinite": float((in_mask & ~finite).sum())}
        if tokens == 0:
            return loss, stats | _EMPTY_STATS
        bound = cfg.logratio_clamp
        d = (lp - beh)[valid].double()
        dc = d.clamp(-bound, bound)
        ratio = dc.exp()
        wv = w[valid].double()
        w_sum, w_sq = wv.sum(), (wv * wv).sum()
        values = torch.stack([
            ratio.mean(), ratio.max(), wv.mean(), above[valid].double().mean(),
            clipped[valid].double().mean(), (ratio - 1 - dc).mean(), d.abs().mean(),
            k3[valid].double().mean() if k3 is not None else torch.zeros((), dtype=torch.float64, device=lp.device),
            w_sum, w_sq,
        ]).tolist()
    names = ["ratio_mean", "ratio_max", "is_weight_mean", "truncated_frac", "clipped_frac",
             "kl_behaviour_trainer", "mean_abs_logprob_diff", "kl_ref", "is_weight_sum", "is_weight_sq_sum"]
    stats |= dict(zip(names, values))
    stats["ess"] = effective_sample_size(stats["is_weight_sum"], stats["is_weight_sq_sum"], tokens)
    return loss, stats


def effective_sample_size(w_sum: float, w_sq_sum: float, n: float) -> float:
    """(sum w)^2 / (n sum w^2), in [0, 1]: 1 when every weight is equal, 0 when none is left
    (all masked); 1 for no token (nothing was weighed unequally)."""
    if n <= 0:
        return 1.0
    if w_sq_sum <= 0:
        return 0.0
    return min(1.0, w_sum * w_sum / (n * w_sq_sum))  # <= 1 exactly (Cauchy-Schwarz); rounding may overshoot


def logprob_mismatch(engine_logprobs: Tensor, trainer_logprobs: Tensor) -> dict[str, float]:
    """How far the engine's sampling log-probs are from the trainer's, for the same tokens.

    engine_logprobs, trainer_logprobs: [M] (any two equal shapes; flattened).
    Returns python floats: mean_abs_diff, max_abs_diff, kl (k3 estimate of KL(engine || trainer),
    log-ratios clamped to +-20), ratio_outside_frac (share of tokens with exp(trainer - engine)
    outside [0.8, 1.25]), tokens (finite pairs compared) and nonfinite (pairs skipped).
    """
    if engine_logprobs.shape != trainer_logprobs.shape:
        raise ValueError(f"engine_logprobs {tuple(engine_logprobs.shape)} and trainer_logprobs "
                         f"{tuple(trainer_logprobs.shape)} must have the same shape")
    d = (trainer_logprobs.detach().double().flatten() - engine_logprobs.detach().double().flatten().to(
        trainer_logprobs.device))
    finite = d.isfinite()
    d = d[finite]
    out = {"tokens": float(d.numel()), "nonfinite": float((~finite).sum())}
    if d.numel() == 0:
        return out | {"mean_abs_diff": 0.0, "max_abs_diff": 0.0, "kl": 0.0, "ratio_outside_frac": 0.0}
    dc = d.clamp(-_MISMATCH_LOGRATIO_CLAMP, _MISMATCH_LOGRATIO_CLAMP)
    low, high = (math.log(b) for b in MISMATCH_RATIO_BAND)
    values = torch.stack([d.abs().mean(), d.abs().max(), (dc.exp() - 1 - dc).mean(),
                          ((d < low) | (d > high)).double().mean()]).tolist()
    return out | dict(zip(["mean_abs_diff", "max_abs_diff", "kl", "ratio_outside_frac"], values))
