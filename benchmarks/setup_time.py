"""How long `python run.py` takes before its first step, cold and warm, and on what.

    python benchmarks/setup_time.py                                   # the CPU default, 3 steps
    python benchmarks/setup_time.py --config examples/one_gpu.toml --steps 3

Each repeat runs `python run.py --config C --steps N` as a user would, in a child process. The
first run is cold: an empty model cache (`model.cache_dir`, where built-in models are built once)
and empty compile caches (vLLM's `VLLM_CACHE_ROOT`, torch inductor's and triton's), all in a
scratch directory; the runs after it are warm (the same caches, so the model and vLLM's compiled
graphs are reused). For each run: the child's whole wall time, the set-up the run reports in its
summary.json (`setup_s` and its parts: data, model, engines' start, trainer's start; engines and
the trainer start together, so their parts overlap), the steps' wall time, and the rest (Python
and library imports, shutdown).

Writes setup_time_<config>_<hardware>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (the benchmarks' shared helpers sit next to this script)

BENCHMARK = "setup_time"
REPO = Path(__file__).resolve().parent.parent
PARTS = ("data_s", "model_s", "tokenizer_s", "engines_start_s", "trainer_start_s")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="run configuration (default: run.py's built-in CPU defaults)")
    p.add_argument("--steps", type=int, default=3, help="training steps of each run")
    p.add_argument("--warm", type=int, default=2, help="warm runs after the cold one")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed on to run.py")
    p.add_argument("--scratch", help="where the caches and runs go (default: a temporary directory, removed)")
    p.add_argument("--out", default=str(common.DEFAULT_OUT))
    p.add_argument("--tag", default="", help="appended to the result's file name")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="a run that takes longer is an error")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warm < 0:
        p.error("--steps must be >= 1 and --warm >= 0")
    return args


def one_run(args: argparse.Namespace, scratch: Path, index: int) -> dict[str, Any]:
    """`python run.py` once, its caches under `scratch`; what it took."""
    caches = scratch / "caches"
    out = scratch / f"run-{index}"
    env = {**os.environ, "VLLM_CACHE_ROOT": str(caches / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
           "TRITON_CACHE_DIR": str(caches / "triton"), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(REPO / "run.py"), "--steps", str(args.steps), "--out", str(out),
           "--set", f"model.cache_dir={caches / 'models'}", *[a for kv in args.set for a in ("--set", kv)]]
    if args.config:
        cmd[2:2] = ["--config", args.config]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    process_s = time.monotonic() - t0
    summary_path = out / "summary.json"
    if proc.returncode != 0 or not summary_path.is_file():
        raise SystemExit(f"error: run {index} ({' '.join(cmd)}) exited with {proc.returncode}:\n"
                         f"{(proc.stdout + proc.stderr)[-4000:]}")
    s = json.loads(summary_path.read_text())
    if s.get("error"):
        raise SystemExit(f"error: run {index} ended with an error: {s['error']}")
    return {"run": index, "cache": "cold" if index == 0 else "warm", "process_s": process_s,
            "setup_s": s["setup_s"], **{k: s["setup"].get(k) for k in PARTS}, "steps_s": s["wall_s"],
            "rest_s": process_s - s["setup_s"] - s["wall_s"], "steps": s["steps"],
            "groups_per_s": s.get("groups_per_s"), "console_tail": proc.stdout.splitlines()[-12:]}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    hw = common.hardware()
    with tempfile.TemporaryDirectory(prefix="setup-time-") as tmp:
        scratch = Path(args.scratch) if args.scratch else Path(tmp)
        scratch.mkdir(parents=True, exist_ok=True)
        runs = []
        for i in range(1 + args.warm):
            runs.append(one_run(args, scratch, i))
            r = runs[-1]
            print(f"run {i} ({r['cache']}): {r['process_s']:.1f} s in all, set-up {r['setup_s']:.1f} s, "
                  f"steps {r['steps_s']:.1f} s", flush=True)
    cols = ["run", "cache", "process_s", "setup_s", *PARTS, "steps_s", "rest_s"]
    tbl = common.table(cols, [[r[c] for c in cols] for r in runs])
    config = Path(args.config).stem if args.config else "cpu_default"
    title = f"python run.py{' --config ' + args.config if args.config else ''} --steps {args.steps} | " \
            f"{common.hardware_tag(hw)}"
    text = f"set-up time -- {title}\n{tbl}"
    print(text, flush=True)
    out = Path(args.out)
    path = out / f"{BENCHMARK}_{config}_{common.hardware_tag(hw)}{args.tag}.json"
    record = {**common.header(BENCHMARK, argv), "hardware": hw, "settings": vars(args), "runs": runs,
              "table": tbl, "printed": text, "files": {"json": str(path)}}
    common.write_json(path, record)
    print(f"wrote {path}", flush=True)
    return record


if __name__ == "__main__":
    main()
