"""vLLM alone: tokens/s against the number of groups in flight, for several engine settings.

The pipeline at max_staleness K keeps up to (K + 1) * B groups in flight on an engine; this
measures what the engine alone does at each of those depths, so a setting (max_num_seqs, the
largest CUDA-graph batch) can be chosen from figures rather than guessed. Each setting starts its
own AsyncLLM on one GPU; every depth is sampled twice: all groups on the base model, and the
groups spread round-robin over `--adapters` random LoRA adapters (the pipeline's case: several
versions in flight at once).

    python benchmarks/vllm_depth.py --settings 1024:512,1024:0,512:0 --groups 32,64,96,128,160

A setting is `max_num_seqs:max_cudagraph_capture_size` (0 = max_num_seqs, the pipeline's default;
vLLM's own default is min(2 x max_num_seqs, 512)), with `:nocompile` after it for an engine without
torch.compile (engine.vllm.torch_compile = false: whole-batch CUDA graphs alone); the JSON records
the largest graph vLLM captured.
The JSON is rewritten after every setting, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import common  # noqa: E402
from pipeline.models import builtin as models  # noqa: E402
from pipeline.config.schema import SamplingConfig, VLLMEngineConfig  # noqa: E402
from pipeline.engines.vllm import VLLMEngine  # noqa: E402
from pipeline.types import AdapterRef  # noqa: E402


def random_adapters(model_path: Path, count: int, rank: int, out: Path) -> list[AdapterRef]:
    """`count` LoRA adapters with random (non-zero) weights on every linear layer, as peft saves them."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    refs = []
    for k in range(1, count + 1):
        torch.manual_seed(k)
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                                     init_lora_weights=False, task_type="CAUSAL_LM"))
        path = out / f"adapter-{k}"
        peft_model.save_pretrained(path)
        refs.append(AdapterRef(version=k, name=f"depth-probe-{k}", path=str(path)))
    return refs


async def main(a: argparse.Namespace) -> None:
    model_path = models.build_model(a.model_shape, a.model_cache)
    # scratch weights, not results: beside the model, not in --out (the results directory by default)
    scratch = Path(tempfile.mkdtemp(prefix="depth-adapters-", dir=a.model_cache))
    try:
        adapters = random_adapters(model_path, a.adapters, a.lora_rank, scratch) if a.adapters else []
        await measure(a, model_path, adapters)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


async def measure(a: argparse.Namespace, model_path: Path, adapters: list[AdapterRef]) -> None:
    """Every setting at every depth; writes the JSON after each setting."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    groups = common.parse_list(a.groups)
    prompts = [rng.integers(0, 1000, size=a.prompt_tokens).tolist() for _ in range(max(groups))]
    result: dict[str, Any] = {**common.header("vllm_depth", sys.argv[1:]), "settings": {}, "printed": ""}
    name = ""

    def say(line: str) -> None:
        print(line, flush=True)
        result["printed"] += line + "\n"

    def sample(engine: VLLMEngine, count: int, on: list[AdapterRef]) -> Any:
        return engine.standalone_throughput(prompts[:count], a.group_size, a.max_new_tokens, adapters=on)

    for setting in a.settings.split(","):
        seqs, capture, compiled = parse_setting(setting)
        cfg = VLLMEngineConfig(gpu_memory_utilization=a.gpu_memory_utilization, max_model_len=a.max_model_len,
                               max_num_seqs=seqs, max_cudagraph_capture_size=capture, max_lora_rank=a.lora_rank,
                               torch_compile=compiled)
        engine = VLLMEngine(model_path, sampling=SamplingConfig(), cfg=cfg, device=a.device,
                            max_staleness=max(a.adapters - 1, 0),
                            name=f"seqs{seqs}-graphs{capture}{'' if compiled else '-nocompile'}", seed=a.seed)
        t0 = time.monotonic()
        await engine.start()
        if not name:  # after vLLM's start: reading the GPUs' names initialises CUDA in this process
            result["hardware"] = common.hardware()
            name = f"vllm_depth_{a.model_shape}_{common.hardware_tag(result['hardware'])}.json"
        row: dict[str, Any] = {"max_num_seqs": seqs, "max_cudagraph_capture_size": capture, "torch_compile": compiled,
                               "graph_batch_max": engine.graph_batch_max, "start_s": round(time.monotonic() - t0, 1),
                               "base": {}, "adapters": {}}
        say(f"{setting}: started in {row['start_s']} s, CUDA graphs up to {engine.graph_batch_max} sequences")
        try:
            await sample(engine, groups[0], [AdapterRef.base(), *adapters])  # warm-up; loads the adapters
            for g in groups:
                row["base"][g] = await sample(engine, g, [])
                if adapters:
                    row["adapters"][g] = await sample(engine, g, adapters)
                say(f"{setting}: {g} groups ({g * a.group_size} sequences): base {row['base'][g]['tokens_per_s']:.0f} "
                    f"tokens/s" + (f", {len(adapters)} adapters {row['adapters'][g]['tokens_per_s']:.0f} tokens/s"
                                   if adapters else ""))
        finally:
            await engine.close()
        result["settings"][setting] = row
        common.write_json(out / name, result)
    rows = [[setting, row["start_s"], g * a.group_size, row["base"][g]["tokens_per_s"],
             row["adapters"].get(g, {}).get("tokens_per_s")] for setting, row in result["settings"].items() for g in groups]
    say(common.table(("setting", "start s", "sequences", "base tok/s", f"{a.adapters} adapters tok/s"), rows))
    common.write_json(out / name, result)
    print(f"wrote {out / name}")


def parse_setting(setting: str) -> tuple[int, int, bool]:
    """`seqs:graphs` or `seqs:graphs:nocompile` -> (max_num_seqs, max_cudagraph_capture_size, torch_compile)."""
    seqs, capture, *rest = setting.split(":")
    if rest not in ([], ["nocompile"]):
        raise SystemExit(f"error: setting {setting!r}: after max_num_seqs:max_cudagraph_capture_size only "
                         "':nocompile' may follow")
    return int(seqs), int(capture), not rest


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", default="1024:512,1024:0,512:0",
                   help="max_num_seqs:max_cudagraph_capture_size[:nocompile],... (0 = max_num_seqs)")
    p.add_argument("--groups", default="32,64,96,128,160", help="groups in flight, one measurement each")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=24)
    p.add_argument("--adapters", type=int, default=5, help="random LoRA adapters the groups are spread over (0: none)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--model-shape", default="qwen2.5-0.5b")
    p.add_argument("--model-cache", default=".cache/models")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(common.DEFAULT_OUT))
    return p.parse_args(argv)


if __name__ == "__main__":  # vLLM spawns its engine core, which re-imports this file
    common.run_async(main(parse_args()))
