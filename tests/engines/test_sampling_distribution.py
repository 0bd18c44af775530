"""Engines draw their tokens from the distribution whose log-probs they report.

The engine contract tests compare the reported log-probs with a recomputation, which says
nothing about which tokens come: an engine that sampled at temperature 2 and reported the
temperature-1 log-probs would pass them. Here many samples are held against the reported
distribution: a chi-square goodness-of-fit test of the counts of each token id, and, at every
position, the mean log-prob against minus the entropy of the model's own softmax.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import torch

from pipeline.models import builtin as models
from pipeline.config.schema import SamplingConfig, SimulatedEngineConfig, TransformersEngineConfig
from pipeline.engines.simulated import SimulatedEngine
from pipeline.engines.transformers import TransformersEngine
from pipeline.types import AdapterRef, Generation, GroupRequest, Prompt

P_MIN = 1e-3  # chi-square p-value a fair sampler stays above (the seeds are fixed: no flakes)
MIN_EXPECTED = 5.0  # least expected count per bin for the chi-square approximation to hold
Z_MAX = 4.0  # |z| of the summed log-prob surprise a fair sampler stays below (two-sided p ~ 6e-5)


def reported_distribution(tokens: np.ndarray, logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids seen, their counts, their reported probabilities) from samples of one distribution:
    tokens [N] int64 and logprobs [N]. Every sample of one id must report the same log-prob."""
    ids, inverse, counts = np.unique(tokens, return_inverse=True, return_counts=True)
    lp = logprobs.astype(np.float64)
    lo = np.full(len(ids), np.inf)
    hi = np.full(len(ids), -np.inf)
    np.minimum.at(lo, inverse, lp)
    np.maximum.at(hi, inverse, lp)
    spread = hi - lo
    assert spread.max() < 1e-5, (f"token {ids[spread.argmax()]} reported with log-probs {lo[spread.argmax()]} "
                                 f"to {hi[spread.argmax()]}: not one distribution")
    probs = np.exp(hi)
    assert probs.sum() <= 1 + 1e-4, f"the reported probabilities of the ids seen sum to {probs.sum()} > 1"
    return ids, counts, probs


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int, float]:
    """Pearson's goodness-of-fit test of the ids seen, counts [V'], against their reported probs
    [V']; the ids never seen share the rest of the mass (1 - sum(probs)). Bins expected fewer
    than MIN_EXPECTED times are merged into one, itself topped up with the next least likely
    ids until it is expected that often. Returns (statistic, degrees of freedom, p-value)."""
    n = counts.sum()
    observed = np.append(counts, 0).astype(np.float64)
    expected = n * np.append(probs, max(0.0, 1.0 - probs.sum()))
    small = expected < MIN_EXPECTED
    order = np.argsort(expected)  # the small bins first
    while small.any() and expected[small].sum() < MIN_EXPECTED and not small.all():
        small[order[small.sum()]] = True
    obs = np.append(observed[~small], observed[small].sum()) if small.any() else observed
    exp = np.append(expected[~small], expected[small].sum()) if small.any() else expected
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, df, p


def _first_tokens(gens: list[Generation]) -> tuple[np.ndarray, np.ndarray]:
    """Every completion's first token and its log-prob: [N] each."""
    comps = [c for g in gens for c in g.completions]
    return (np.array([c.token_ids[0] for c in comps], dtype=np.int64),
            np.array([c.logprobs[0] for c in comps], dtype=np.float32))


# --------------------------------------------------------------------------- transformers


N_SAMPLES = 4000  # completions of one prompt: ~240 of the 320 ids are expected >= 5 times each
T_SAMPLES = 4  # tokens per completion, for the entropy check at later positions
TEXT = "The cat"


def test_transformers_engine_samples_the_distribution_it_reports(model_dir: Path) -> None:
    prompt = tuple(TEXT.encode())  # the built-in tokenizer's ids are the bytes
    request = GroupRequest(0, Prompt("p0", TEXT, prompt), N_SAMPLES, T_SAMPLES, seed=1234)

    async def main() -> Generation:
        # no end-of-sequence ids: every row runs to T_SAMPLES tokens
        engine = TransformersEngine(model_dir, sampling=SamplingConfig(), cfg=TransformersEngineConfig(),
                                    eos_token_ids=[])
        await engine.start()
        try:
            return await engine.generate(request, AdapterRef.base())
        finally:
            await engine.close()

    gen = asyncio.run(main())
    tokens = np.stack([c.token_ids for c in gen.completions])  # [N, T]
    reported = np.stack([c.logprobs for c in gen.completions]).astype(np.float64)  # [N, T]
    assert tokens.shape == (N_SAMPLES, T_SAMPLES)

    # the first token: N draws of one distribution
    ids, counts, probs = reported_distribution(tokens[:, 0], reported[:, 0])
    stat, df, p = chi_square(counts, probs)
    assert p > P_MIN, (f"first tokens do not follow their reported probabilities: chi2 = {stat:.1f} on {df} "
                       f"degrees of freedom, p = {p:.3g}")

    # every position: the model's own softmax given each row's prefix
    model = models.load_causal_lm(model_dir, "cpu", "float32")
    P = len(prompt)
    ids_all = torch.cat([torch.tensor(prompt).expand(N_SAMPLES, P), torch.from_numpy(tokens)], dim=1)
    with torch.inference_mode():
        logits = model(input_ids=ids_all).logits[:, P - 1:P - 1 + T_SAMPLES].double()  # [N, T, V]
    logp = logits.log_softmax(-1)
    own = logp.gather(-1, torch.from_numpy(tokens).unsqueeze(-1)).squeeze(-1).numpy()  # [N, T]
    assert np.abs(own - reported).max() < 1e-4, "the reported log-probs are the model's own"
    entropy = -(logp.exp() * logp).sum(-1).numpy()  # [N, T]: H of each row's next-token distribution
    second = (logp.exp() * logp**2).sum(-1).numpy()  # E[(log p)^2]
    # -log p(x) - H has mean 0 and variance E[(log p)^2] - H^2 given the prefix, whatever came before
    surprise = -reported - entropy
    z = surprise.sum() / np.sqrt((second - entropy**2).sum())
    assert abs(z) < Z_MAX, (f"mean -log p of the sampled tokens {-reported.mean():.4f} vs the model's entropy "
                            f"{entropy.mean():.4f} (z = {z:.1f}): the tokens are not drawn from the reported "
                            "distribution")


# --------------------------------------------------------------------------- simulated


def test_simulated_engine_samples_the_distribution_it_reports() -> None:
    engine = SimulatedEngine(SimulatedEngineConfig(latency_s=0.0, completion_tokens=16), seed=3)
    prompt = Prompt("p", "", (1, 2, 3))
    # 4 groups of 512 x 16 tokens: 32,768 samples. Few large groups, not many small ones: the pool
    # slices of two groups may overlap (200 groups of 8 x 16 share ~17% of their tokens), which
    # would count one draw twice; these four slices are apart in both versions.
    requests = [GroupRequest(i, prompt, 512, 16) for i in range(4)]
    policy = engine.policy_logprobs()

    async def main(version: int) -> list[Generation]:
        await engine.start()
        adapter = AdapterRef(version, f"v{version}", None)
        half = len(requests) // 2  # both ways of synthesizing: group by group, and gathered
        return ([await engine.generate(r, adapter) for r in requests[:half]]
                + await engine.generate_many(requests[half:], adapter))

    for version in (0, 3):
        gens = asyncio.run(main(version))
        tokens = np.concatenate([c.token_ids for g in gens for c in g.completions])
        logprobs = np.concatenate([c.logprobs for g in gens for c in g.completions])
        assert tokens.min() >= 1 and tokens.max() < engine.cfg.vocab_size
        ids, counts, probs = reported_distribution(tokens, logprobs)
        stat, df, p = chi_square(counts, probs)
        assert p > P_MIN, (f"version {version}: tokens do not follow their reported probabilities: "
                           f"chi2 = {stat:.1f} on {df} degrees of freedom, p = {p:.3g}")
        # ... and that distribution is the one the engine declares, in every version
        np.testing.assert_allclose(np.log(probs), policy[ids], atol=1e-5,
                                   err_msg=f"version {version}: reported log-probs are not the policy's")
