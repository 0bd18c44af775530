"""What every benchmark script shares: the hardware record, result files, tables, the event loop.

Invariants:
- A result file names the benchmark, its engine/shape and the hardware (`<bench>_<what>_<hw>.json`),
  and holds the hardware, the settings and every figure the script printed.
- The hardware record reads package versions from their metadata, so recording the vLLM version
  never imports vLLM, and it notes the load average: a figure taken on a busy machine says so.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import math
import os
import platform
import re
import socket
import sys
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Coroutine, Iterable, Mapping, Sequence

RESULTS_DIR = Path(__file__).resolve().parent / "results"  # the committed results: --out here to keep one
# where a benchmark writes by default: git-ignored, so trying a script never overwrites a committed result
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "runs" / "benchmarks"
ENV_KEYS = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")  # settings that change the figures
PACKAGES = ("torch", "transformers", "peft", "vllm", "trl", "accelerate", "numpy", "zarr", "uvloop")


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux, else platform's best guess)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # not Linux: fall back to what platform knows
        pass
    return platform.processor() or platform.machine()


def package_versions(names: Iterable[str] = PACKAGES) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def gpu_names() -> list[str]:
    """Names of the CUDA GPUs torch sees ([] without CUDA). Initialises CUDA where there is one."""
    try:
        import torch
    except ImportError:  # no torch, no GPUs to name
        return []
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def hardware(gpus: bool = True) -> dict[str, Any]:
    """Where a benchmark ran: CPU, cores, GPUs, library versions, load average."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_affinity": affinity,
        "gpus": gpu_names() if gpus else [],
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": package_versions(),
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "env": {k: os.environ.get(k) for k in ENV_KEYS},
    }


def filesystem(path: str | Path) -> str:
    """The type of the filesystem holding `path` ("ext4", "tmpfs", ...; "unknown" off Linux).

    Publishing a version creates and fsyncs files every step, so the filesystem under a run
    sets much of a fast pipeline's cost per step: say which one a figure was measured on.
    """
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/self/mounts").read_text().splitlines()]
    except OSError:
        return "unknown"
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    for point, fstype in mounts:
        point = point.replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fstype
    return kind


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")


def hardware_tag(hw: Mapping[str, Any]) -> str:
    """A short file-name tag for the hardware: `2xH200` on GPUs, `AMD-EPYC-2c` on the CPU."""
    gpus = hw.get("gpus") or []
    if gpus:
        names = sorted(set(gpus))
        short = "+".join(_slug(n.replace("NVIDIA", "").strip()) for n in names)
        return f"{len(gpus)}x{short}"
    return f"{_slug(hw['cpu_model'])}-{hw['cpu_affinity']}c"


def _system_busy_seconds() -> float | None:
    """CPU seconds every process on the machine has used since boot (Linux /proc/stat), or None."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:9]
    except (OSError, IndexError):  # not Linux: other processes' load cannot be told apart
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields)
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class MachineLoad:
    """How much CPU other processes used while a benchmark ran, in cores (this process excluded).

    The benchmark's own child processes that have exited and been waited for (trainer processes
    of finished runs) are the benchmark's; a child still running when the figure is read (vLLM's
    engine core) counts among the others, since its CPU time cannot be read until it exits.
    """

    def __init__(self) -> None:
        self.loadavg_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        self.wall0 = time.perf_counter()
        self.own0 = self._own()
        self.system0 = _system_busy_seconds()

    @staticmethod
    def _own() -> float:
        t = os.times()
        return time.process_time() + t.children_user + t.children_system

    def own_cpu_s(self) -> float:
        """CPU seconds of this process and its waited-for children since construction."""
        return self._own() - self.own0

    def others_cores(self) -> float | None:
        system = _system_busy_seconds()
        if system is None or self.system0 is None:
            return None
        wall = time.perf_counter() - self.wall0
        own = self.own_cpu_s()
        return max(0.0, (system - self.system0 - own) / wall) if wall > 0 else None

    def record(self) -> dict[str, Any]:
        return {"loadavg_1m_at_start": self.loadavg_start, "other_processes_cpu_cores": self.others_cores()}


def load_note(load: dict[str, Any], cores: int | None) -> str | None:
    """A warning when other processes used a fair share of the cores while the benchmark ran."""
    others = load.get("other_processes_cpu_cores")
    if others is None or not cores or others <= max(0.25, 0.25 * cores):
        return None
    return (f"other processes used {others:.2f} of {cores} CPU cores on average while this ran "
            f"(1-minute load average {load.get('loadavg_1m_at_start')} at start): timings may be pessimistic")


def jsonable(v: Any) -> Any:
    """Plain JSON values: numpy scalars as Python numbers, NaN and inf as null, tuples as lists."""
    try:
        import numpy as np
    except ImportError:  # numpy is a dependency; this only keeps the helper importable alone
        np = None
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, int):
        return v
    if isinstance(v, float) or (np is not None and isinstance(v, np.floating)):
        f = float(v)
        return f if math.isfinite(f) else None
    if np is not None and isinstance(v, np.integer):
        return int(v)
    if np is not None and isinstance(v, np.ndarray):
        return [jsonable(x) for x in v.tolist()]
    if isinstance(v, Mapping):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, Path):
        return str(v)
    return repr(v)


def write_json(path: Path, obj: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(jsonable(obj), indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # a reader never sees half a file
    return path


def header(benchmark: str, argv: Sequence[str] | None) -> dict[str, Any]:
    """The fields every result file starts with."""
    return {
        "benchmark": benchmark,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": [Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])],
    }


def fmt(v: Any) -> str:
    """A table cell: floats to about three significant digits, None and NaN as '-'."""
    if v is None:
        return "-"
    if isinstance(v, float):
        a = abs(v)
        if not math.isfinite(v):
            return "-"
        if a >= 100:
            return f"{v:.0f}"
        if a >= 1:
            return f"{v:.2f}"
        return "0" if a == 0 else f"{v:.3g}"
    return str(v)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table with right-aligned columns."""
    cells = [[str(h) for h in headers]] + [[fmt(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_async(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run on uvloop where it is installed (as Pipeline.run_sync does), else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:  # uvloop is optional; the default loop measures the same code, a little slower
        return asyncio.run(coro)
    return uvloop.run(coro)


async def idle_loop_lag(seconds: float = 2.0) -> dict[str, float]:
    """The event loop's lag with nothing else to do, as the pipeline measures lag (a 10 ms timer).

    The floor under every lag figure a run reports on this machine: timer granularity, and the
    scheduling noise of a shared or virtual machine (a 2-core VM showed p99 ~3 ms on an idle loop)."""
    from pipeline.observe.metrics import LoopLagMonitor

    monitor = LoopLagMonitor()
    monitor.start()
    try:
        await asyncio.sleep(seconds)
    finally:
        await monitor.stop()
    return {"seconds": seconds, "samples": len(monitor.lags), "p50_ms": monitor.percentile_ms(50),
            "p99_ms": monitor.percentile_ms(99), "max_ms": 1000.0 * max(monitor.lags, default=0.0)}


def parse_list(text: str, kind: type = int) -> list[Any]:
    """'0,1,2' -> [0, 1, 2]; refuses an empty list."""
    items = [kind(x) for x in text.split(",") if x.strip()]
    if not items:
        raise ValueError(f"expected a comma-separated list, got {text!r}")
    return items


class Clock:
    """Wall and CPU seconds since construction (CPU: the whole process, every thread)."""

    def __init__(self) -> None:
        self.wall0 = time.perf_counter()
        self.cpu0 = time.process_time()

    def wall(self) -> float:
        return time.perf_counter() - self.wall0

    def cpu(self) -> float:
        return time.process_time() - self.cpu0


# two-sided 97.5% quantiles of Student's t, by degrees of freedom (30+ is within 2% of 1.96)
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 24: 2.064, 29: 2.045}


def t975(df: int) -> float:
    if df <= 0:
        return float("nan")
    return _T975.get(df) or next((v for k, v in sorted(_T975.items(), reverse=True) if k <= df), 1.96)


def mean_ci(xs: list[float]) -> dict:
    """Mean and the half-width of its 95% t-interval (nan for fewer than two values)."""
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return {"mean": m, "ci95": float("nan"), "n": n}
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    return {"mean": m, "ci95": t975(n - 1) * sd / math.sqrt(n), "n": n}


async def runs_on_one_vllm_engine(todo: Sequence[Mapping[str, Any]], model_path: str, max_staleness: int,
                                  collect: Any, report: Any, prefix: str) -> list[dict[str, Any]]:
    """Each job's Pipeline run in turn on one vLLM engine on cuda:0, started once (a Pipeline leaves
    an engine it did not build running, without its adapters), the trainer beside it on the same
    GPU; `collect(job, pipeline, summary, seconds)` makes each run's record, `report(record)` prints it."""
    import tempfile

    from pipeline.config.io import load_config
    from pipeline.engines.vllm import VLLMEngine
    from pipeline.loop.build import graph_sequences
    from pipeline.loop.orchestrator import Pipeline

    cfgs = [load_config(None, {**job["overrides"], "model.path": model_path}) for job in todo]
    # CUDA graphs for the deepest job's batches, as each job's own engine would capture for it
    vcfg = replace(cfgs[0].engine.vllm, max_cudagraph_capture_size=max(map(graph_sequences, cfgs)))
    engine = VLLMEngine(model_path, sampling=cfgs[0].sampling, cfg=vcfg, device="cuda:0",
                        max_staleness=max_staleness, name="vllm-0")
    t = time.monotonic()
    await engine.start()
    print(f"vLLM engine started in {time.monotonic() - t:.1f} s", flush=True)
    runs = []
    try:
        for job in todo:
            with tempfile.TemporaryDirectory(prefix=f"{prefix}-") as out:
                t0 = time.monotonic()
                p = Pipeline(load_config(None, {**job["overrides"], "model.path": model_path, "out": out}),
                             engines=[engine], console=False)
                summary = await p.run()
            runs.append(record := collect(job, p, summary, time.monotonic() - t0))
            report(record)
    finally:
        await engine.close()
    return runs
