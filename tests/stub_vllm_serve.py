"""`vllm serve` for CPU tests, as a process: the HTTP stub (vllm_server_stub.py) over a TransformersEngine.

Run as `python stub_vllm_serve.py MODEL --host H --port P [vLLM's flags]` (the command an
engine.vllm_server.launch run is given in engine.vllm_server.command): it serves MODEL under its
path, as `vllm serve MODEL` names it, with --max-loras adapters at most; vLLM's other flags are
read and ignored. It prints one JSON line of what it was given, then serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from vllm_server_stub import VLLMServerStub  # noqa: E402

from pipeline.config.schema import SamplingConfig, TransformersEngineConfig  # noqa: E402
from pipeline.engines.transformers import TransformersEngine  # noqa: E402


async def serve(a: argparse.Namespace) -> None:
    engine = TransformersEngine(a.model, sampling=SamplingConfig(), cfg=TransformersEngineConfig(), device="cpu",
                                max_loaded_adapters=a.max_loras + 1, name="stub")
    await engine.start()
    stub = VLLMServerStub(engine, model_name=a.model, port=a.port, max_model_len=a.max_model_len)
    await stub.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await stub.close()
    await engine.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-loras", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=2048)
    a, rest = p.parse_known_args()
    print(json.dumps({"argv": sys.argv[1:], "pid": os.getpid(), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}),
          flush=True)
    asyncio.run(serve(a))


if __name__ == "__main__":
    main()
