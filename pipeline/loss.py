"""Advantages and the importance-corrected policy loss, as pure tensor functions.

Invariants:
- No model code, no I/O: tensors in, a scalar loss and python-float statistics out.
- When the behaviour (engine) log-probs equal the trainer's, every correction ("tis", "ppo")
  gives exactly the plain on-policy GRPO loss, in value and in gradient.
- Log-ratios are clamped before `exp` and non-finite inputs are masked out (and counted), so
  the loss is always finite and always connected to the graph: `.backward()` works even when
  no token is left.
- Only `logprobs` carries gradient: behaviour and proximal log-probs, advantages and the
  importance weights are detached.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pipeline.config import LossConfig
from pipeline.errors import ConfigError

# The band of the logprob-contract check: a token whose ratio exp(trainer - engine) leaves
# [0.8, 1.25] counts as mismatched (symmetric in log space: 0.8 = 1 / 1.25).
MISMATCH_RATIO_BAND = (0.8, 1.25)
# logprob_mismatch has no config; it clamps like LossConfig's default so its KL cannot overflow.
_MISMATCH_LOGRATIO_CLAMP = 20.0
# The statistics when no valid token is left: neutral (nothing weighed, nothing mismatched)
# and finite, so per-step metrics stay plottable.
_EMPTY_STATS = {"ratio_mean": 1.0, "ratio_max": 1.0, "is_weight_mean": 1.0, "truncated_frac": 0.0,
                "clipped_frac": 0.0, "ess": 1.0, "kl_behaviour_trainer": 0.0, "mean_abs_logprob_diff": 0.0}


def group_advantages(rewards: Tensor, scale: bool, eps: float = 1e-6) -> Tensor:
    """GRPO advantages: each reward minus its group's mean, divided by the group's std if `scale`.

    rewards: [G, n] (G groups of n completions) -> [G, n], floating point.
    The std is the population one (unbiased=False, divide by n, as GRPO and TRL use): it is 0,
    not NaN, for a group of one. A group whose rewards are all equal carries no learning signal
    and gets exactly 0 (no NaN, no rounding residue from the mean).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [G, n], got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (rewards.std(dim=1, keepdim=True, unbiased=False) + eps)
    flat = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    return torch.where(flat, torch.zeros_like(centred), centred)


def _check(logprobs: Tensor, behaviour: Tensor, advantages: Tensor, mask: Tensor,
           proximal: Tensor | None, cfg: LossConfig) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [N, T], got shape {tuple(logprobs.shape)}")
    for name, t in (("behaviour_logprobs", behaviour), ("mask", mask), ("proximal_logprobs", proximal)):
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} must have the shape of logprobs {tuple(logprobs.shape)}, got {tuple(t.shape)}")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [N] = [{logprobs.shape[0]}], got shape {tuple(advantages.shape)}")
    if cfg.correction not in ("none", "tis", "ppo"):
        raise ConfigError(f"loss.correction must be one of 'tis', 'ppo', 'none', got {cfg.correction!r}")
    if cfg.aggregation not in ("token_mean", "seq_mean"):
        raise ConfigError(f"loss.aggregation must be 'token_mean' or 'seq_mean', got {cfg.aggregation!r}")


def policy_loss(logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                cfg: LossConfig, proximal_logprobs: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """The GRPO policy loss, importance-corrected for the engine having sampled from another policy.

    logprobs: [N, T] trainer log-probs of the sampled tokens under the current weights (with grad).
    behaviour_logprobs: [N, T] the engine's stored sampling log-probs.
    advantages: [N] one per sequence, broadcast over its tokens.
    mask: [N, T] bool or 0/1, nonzero on the tokens to weigh: the completion tokens the policy
        sampled (a multi-turn episode's environment tokens are 0, and nothing of them is read).
    proximal_logprobs: [N, T] or None = logprobs.detach(), the weights at the start of the step
        (exact with one optimizer step per batch).

    Per token, with w = min(exp(proximal - behaviour), is_cap) (detached):
      none: -A * exp(lp - lp.detach())        value -A, gradient -A * grad lp; behaviour unused
      tis:  -w * A * exp(lp - lp.detach())
      ppo:  -w * min(r A, clip(r, 1 - eps, 1 + eps) A), r = exp(lp - proximal)  (decoupled PPO,
            Hilton et al. 2021, as in AReaL)
    Tokens with a non-finite logprob, behaviour, proximal or advantage are dropped and counted.
    Aggregation: token_mean = sum over valid tokens / their count (DAPO); seq_mean = mean over
    sequences with a valid token of each one's token mean.

    Returns (loss: [] scalar, stats) with python floats: ratio_mean, ratio_max (of
    exp(lp - behaviour)), is_weight_mean, truncated_frac (weight hit the cap), clipped_frac (ppo:
    the clipped branch dropped a nonzero gradient), ess ((sum w)^2 / (n sum w^2), in (0, 1]),
    kl_behaviour_trainer (k3: mean of exp(d) - 1 - d, d = lp - behaviour), mean_abs_logprob_diff,
    tokens (valid), masked_nonfinite. Weight statistics are of the weights applied (all 1 for none).
    """
    _check(logprobs, behaviour_logprobs, advantages, mask, proximal_logprobs, cfg)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)  # bf16 log-ratios lose the signal
    lp = logprobs.to(dtype)
    beh = behaviour_logprobs.detach().to(device=lp.device, dtype=dtype)
    adv = advantages.detach().to(device=lp.device, dtype=dtype)[:, None].expand_as(lp)
    prox = lp.detach() if proximal_logprobs is None else proximal_logprobs.detach().to(device=lp.device, dtype=dtype)
    in_mask = mask.to(lp.device) != 0
    finite = lp.detach().isfinite() & beh.isfinite() & adv.isfinite() & prox.isfinite()
    valid = in_mask & finite
    # Dropped tokens become zeros before any arithmetic: NaN * 0 is still NaN, in values and gradients.
    zero = torch.zeros((), dtype=dtype, device=lp.device)
    lp, beh, adv, prox = (torch.where(valid, x, zero) for x in (lp, beh, adv, prox))
    bound = cfg.logratio_clamp  # every log-ratio is clamped so a large mismatch cannot overflow

    log_w = torch.zeros_like(beh) if cfg.correction == "none" else (prox - beh).clamp(-bound, bound)
    raw_w = log_w.exp()
    w = raw_w.clamp(max=cfg.is_cap)
    if cfg.correction == "ppo":
        r = (lp - prox).clamp(-bound, bound).exp()
        eps = cfg.clip_eps
        # where min() takes the clipped branch, whose gradient is 0 (written out to count it)
        clipped = ((adv > 0) & (r > 1 + eps)) | ((adv < 0) & (r < 1 - eps))
        surrogate = torch.where(clipped, r.clamp(1 - eps, 1 + eps) * adv, r * adv)
    else:
        clipped = torch.zeros_like(valid)
        surrogate = (lp - lp.detach()).exp() * adv  # exp(0) exactly: nothing to clamp
    per_token = torch.where(valid, -w * surrogate, zero)

    validf = valid.to(dtype)
    if cfg.aggregation == "token_mean":
        loss = per_token.sum() / validf.sum().clamp(min=1)
    else:
        count = validf.sum(dim=1)
        loss = (per_token.sum(dim=1) / count.clamp(min=1)).sum() / (count > 0).sum().clamp(min=1)

    with torch.no_grad():
        tokens = int(valid.sum())
        stats = {"tokens": float(tokens), "masked_nonfinite": float((in_mask & ~finite).sum())}
        if tokens == 0:
            return loss, stats | _EMPTY_STATS
        d = (lp - beh)[valid].double()
        dc = d.clamp(-bound, bound)
        ratio = dc.exp()
        # ESS from log-weights shifted by their max: scale-free, and no 0/0 if all weights underflow
        lw = log_w.clamp(max=math.log(cfg.is_cap))[valid].double()
        e = (lw - lw.max()).exp()
        values = torch.stack([
            ratio.mean(), ratio.max(), w[valid].double().mean(), (raw_w > cfg.is_cap)[valid].double().mean(),
            clipped[valid].double().mean(), e.sum() ** 2 / (tokens * (e * e).sum()),
            (ratio - 1 - dc).mean(), d.abs().mean(),
        ]).tolist()
    names = ["ratio_mean", "ratio_max", "is_weight_mean", "truncated_frac", "clipped_frac", "ess",
             "kl_behaviour_trainer", "mean_abs_logprob_diff"]
    stats |= dict(zip(names, values))
    stats["ess"] = min(stats["ess"], 1.0)  # <= 1 exactly (Cauchy-Schwarz); rounding may overshoot
    return loss, stats


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
