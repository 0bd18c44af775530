"""vLLM's start with its engine core spawned against forked, as a run's engine is built.

    python benchmarks/probes/vllm_start_probe.py --config examples/one_gpu.toml --out DIR

A run's AsyncLLM starts its engine core as a second process, spawned by default
(engine.vllm.start_method): the child imports torch and vLLM afresh before it logs anything, 15-40 s
of a warm start in the committed logs, which TRL's colocated `LLM` does not pay. With
start_method = "fork" vLLM forks it, unless this process has initialised CUDA. This says what a
fork is worth, apart from the rest of a run.

Each start runs in a child process of its own that has not initialised CUDA and builds the run's
engine from the config as `python run.py` would (`build.build_engines`, the built-in model built
once into --cache): the first spawned with empty compile caches (cold), then --repeats rounds of
spawn and fork on the same caches (warm). For each start: the child's whole time to a started
engine, the engine's `start()` alone, vLLM's parts as its log gives them (setup_time.vllm_parts),
and whether vLLM overrode the method asked for (its log names the reason). Writes
<out>/vllm_start_<config>_<hardware>.json after every start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import setup_time  # noqa: E402  (its reader of vLLM's start-up lines)

from pipeline.config.io import load_config  # noqa: E402

OVERRIDDEN = "We must use the `spawn` multiprocessing start method"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="examples/one_gpu.toml", help="the run configuration whose engine starts")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides")
    p.add_argument("--repeats", type=int, default=1, help="warm rounds of spawn then fork")
    p.add_argument("--cache", help="where the model and compile caches go (default: a temporary directory)")
    p.add_argument("--out", default=str(common.DEFAULT_OUT))
    p.add_argument("--child", nargs=2, metavar=("METHOD", "CACHE"), help=argparse.SUPPRESS)  # internal: one start
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def child(args: argparse.Namespace) -> None:
    """One engine start in this fresh process; prints its timings as the last line of stdout."""
    t_process = time.monotonic()
    from pipeline.loop import build

    method, caches = args.child
    cfg = load_config(args.config, [*args.set, f"model.cache_dir={Path(caches) / 'models'}",
                                    f"engine.vllm.start_method={method}"])
    model = build.model_dir(cfg)
    t_model = time.monotonic()
    engine = build.build_engines(cfg, model, 0, Path(caches) / "run")[0]  # examples/one_gpu.toml: the only one

    async def start_and_close() -> float:
        t0 = time.monotonic()
        await engine.start()
        seconds = time.monotonic() - t0
        await engine.close()
        return seconds

    start_s = asyncio.run(start_and_close())
    print(json.dumps({"method": method, "imports_and_model_s": t_model - t_process, "start_s": start_s}), flush=True)


def one_start(args: argparse.Namespace, method: str, caches: Path) -> dict[str, Any]:
    env = setup_time.cache_env(caches)
    cache = "warm" if (caches / "vllm").is_dir() else "cold"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--config", args.config,
           *[a for kv in args.set for a in ("--set", kv)], "--child", method, str(caches)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=setup_time.REPO, env=env, capture_output=True, text=True, timeout=1800)
    process_s = time.monotonic() - t0
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"error: the {method} start exited with {proc.returncode}:\n{log[-4000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**r, "cache": cache, "process_s": process_s, "method_used": "spawn" if OVERRIDDEN in log else method,
            "vllm_parts": setup_time.vllm_parts(log)}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.child:
        child(args)
        return {}
    hw = common.hardware()
    path = Path(args.out) / f"vllm_start_{Path(args.config).stem}_{common.hardware_tag(hw)}.json"
    starts: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="vllm-start-") as tmp:
        caches = Path(args.cache or tmp)
        for method in ["spawn"] + ["spawn", "fork"] * args.repeats:
            starts.append(one_start(args, method, caches))
            common.write_json(path, {**common.header("vllm_start", argv), "hardware": hw, "settings": vars(args),
                                     "starts": starts})
            s = starts[-1]
            print(f"{s['method']} ({s['cache']}, vLLM used {s['method_used']}): {s['process_s']:.1f} s in all, "
                  f"start {s['start_s']:.1f} s, before the core {s['vllm_parts'].get('before_core_s')} s", flush=True)
    cols = ["method", "method_used", "cache", "process_s", "imports_and_model_s", "start_s"]
    parts = ["before_core_s", "init_engine_s", "compile_s", "capture_s"]
    print(common.table(cols + parts, [[s[c] for c in cols] + [s["vllm_parts"].get(p) for p in parts]
                                      for s in starts]), flush=True)
    print(f"wrote {path}", flush=True)
    return {"starts": starts, "path": str(path)}


if __name__ == "__main__":
    main()
