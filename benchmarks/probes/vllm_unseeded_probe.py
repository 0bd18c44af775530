"""Do two unseeded vLLM requests for the same prompt sample different tokens? (engine seeded once)

    python benchmarks/probes/vllm_unseeded_probe.py   (on a GPU with vLLM; prints first tokens)
"""
import argparse
import asyncio
import numpy as np
from pipeline.models import builtin as models
from pipeline.config.schema import SamplingConfig, VLLMEngineConfig
from pipeline.engines.vllm import VLLMEngine
from pipeline.types import AdapterRef, GroupRequest, Prompt

async def main():
    path = models.build_model("small", "/tmp/models")
    eng = VLLMEngine(path, sampling=SamplingConfig(), cfg=VLLMEngineConfig(gpu_memory_utilization=0.3, enforce_eager=True,
                     max_model_len=512), device="cuda:0", max_staleness=1, name="probe", seed=0)
    await eng.start()
    ids = tuple(int(x) for x in np.random.default_rng(0).integers(0, 90, size=16))
    p = Prompt("p", "", ids)
    for label, seed in (("unseeded", None), ("unseeded", None), ("unseeded-concurrent", None), ("seeded", 7), ("seeded", 7)):
        if label.endswith("concurrent"):
            gens = await asyncio.gather(*(eng.generate(GroupRequest(100 + k, p, 8, 8, None), AdapterRef.base()) for k in range(2)))
            for g in gens: print(label, [int(c.token_ids[0]) for c in g.completions], flush=True)
            continue
        g = await eng.generate(GroupRequest(hash(label) % 1000, p, 8, 8, seed), AdapterRef.base())
        print(label, [int(c.token_ids[0]) for c in g.completions], [c.token_ids[:4].tolist() for c in g.completions[:2]], flush=True)
    await eng.close()

if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    asyncio.run(main())
