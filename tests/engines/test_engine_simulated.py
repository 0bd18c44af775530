"""The simulated engine: a batch call gives each group what a call of its own gives."""

from __future__ import annotations

import asyncio

import numpy as np

from pipeline.config.schema import SimulatedEngineConfig
from pipeline.engines.simulated import SimulatedEngine
from pipeline.types import AdapterRef, GroupRequest, Prompt


def test_generate_many_gives_each_group_what_generate_gives_it() -> None:
    # groups of two shapes and with and without seeds, in one call: the shapes are gathered apart
    prompt = Prompt("p", "", (1, 2, 3))
    requests = [GroupRequest(i, prompt, n, max_new, seed) for i, (n, max_new, seed) in
                enumerate([(4, 16, None), (4, 16, 7), (2, 5, None), (4, 16, None), (2, 5, 3)])]
    v2 = AdapterRef(2, "v2", None)

    async def main() -> tuple[list, list, list, list]:
        engine = SimulatedEngine(SimulatedEngineConfig(latency_s=0.0, concurrency=0, completion_tokens=12), seed=5)
        await engine.start()
        many = await engine.generate_many(requests, v2)  # two shapes: group by group
        alike = [r for r in requests if r.n == 4]
        gathered = await engine.generate_many(alike, v2)  # one shape: one gather for all
        one = [await engine.generate(r, v2) for r in requests]
        base = await engine.generate_many(requests, AdapterRef.base())
        return many, gathered, one, base

    many, gathered, one, base = asyncio.run(main())
    for g, o in zip(gathered, [o for o in one if o.request.n == 4]):
        assert g.request is o.request
        for cg, co in zip(g.completions, o.completions, strict=True):
            np.testing.assert_array_equal(cg.token_ids, co.token_ids)
            np.testing.assert_array_equal(cg.logprobs, co.logprobs)
    for m, o, b, r in zip(many, one, base, requests):
        assert len(m.completions) == r.n and m.version == 2
        for cm, co, cb in zip(m.completions, o.completions, b.completions):
            assert len(cm.token_ids) == min(12, r.max_new_tokens) == len(cm.logprobs)
            np.testing.assert_array_equal(cm.token_ids, co.token_ids)
            np.testing.assert_array_equal(cm.logprobs, co.logprobs)
        # another version samples something else
        assert not all(np.array_equal(cm.token_ids, cb.token_ids) for cm, cb in zip(m.completions, b.completions))
    # two groups of one prompt are not the same sample
    assert not np.array_equal(many[0].completions[0].token_ids, many[3].completions[0].token_ids)
