"""Throughput against max_staleness: one process sweeps the staleness bound over one workload.

    python benchmarks/throughput_vs_staleness.py                        # simulated, balanced
    python benchmarks/throughput_vs_staleness.py --ratios 3,1,0.33      # generator 3x slower, balanced, 3x faster
    python benchmarks/throughput_vs_staleness.py --engine transformers  # tiny model, real LoRA trainer, CPU
    python benchmarks/throughput_vs_staleness.py --engine vllm --model-shape qwen2.5-0.5b \\
        --engine-device cuda:0 --trainer-device cuda:1                  # vLLM on one GPU, trainer on another
    python benchmarks/throughput_vs_staleness.py --engine vllm --trainer sim \\
        --engine-device cuda:0 --trainer-device cuda:0                  # one GPU: what the pipeline costs vLLM
    python benchmarks/throughput_vs_staleness.py --update full          # full-weight updates instead of LoRA

Every value of max_staleness (K) runs the same workload, seed and hardware in this process, and
is compared with K=0 (the synchronous baseline) of the same run.

How the figures are measured:
- Standalone, before the sweep: t_gen = seconds for the engine alone to sample one batch of B
  groups (all submitted at once), t_train = seconds for one trainer step plus publishing its
  adapter; each the median of --repeats after one warm-up. ideal = (t_gen + t_train) /
  max(t_gen, t_train): the speedup over K=0 that a perfect overlap of the two would reach.
- In the sweep: groups/s and tokens/s are steady state, counted from the end of step
  --warmup-steps to the end of the last step. Busy fractions (union of each tier's busy
  intervals) are over the same window, the generator's up to the end of the run's last
  generation (after it the engines have no work left while the last steps train); "gen kept"
  is the tokens the engine generated in the window per second of its busy time, over its
  standalone tokens/s.
- Generator idle: the times in that window when no engine had work, each second put down to
  what the pipeline was doing: a group started but not yet running on its engine (vLLM:
  loading its adapter), a group admitted but not yet started, or nothing admitted (admission
  waited for room: the staleness bound holds the generator until the trainer's next version).
- gen depth: the mean number of groups the engines held (from the generate() call to its
  result) while they held any, over the generator's window. The staleness bound caps it at
  (K + 1) * B; an engine that decodes deeper batches faster (vLLM) is faster at larger K for it.
- train gap: the trainer tier's mean idle time between one step's publish and the next step
  (waiting for a batch, plus the train loop's own bookkeeping).
- speedup = groups/s at K / groups/s at K=0. Staleness, event-loop lag and publish-to-loaded
  latency cover the whole run; for real engines the reward is the mean over the last fifth of
  the steps (every K trains the same number of samples).
- The event loop's lag with nothing else to do (the same 10 ms timer, 3 s after the standalone
  measurements; 1 s with --quick) is printed as the floor under the lag column: timer
  granularity and the machine's own scheduling noise.
- --update full: trainer.update = "full" (every weight trained, whole models published; engines
  hold one version, so each load waits for the groups in flight: "drain ms" is that wait per
  version). t_train then includes writing the whole model.
- vLLM, "gen kept at the same depth": the same tokens per busy second over the engine alone
  under the run's load (the pipeline at K keeps up to (K + 1) * B groups in flight on up to
  K + 1 adapter versions): (K + 1) * B groups at once, round-robin over K + 1 of the real
  trainer's adapters, the median of --repeats measured just before the run at K (this engine's
  rate drifts by 10-20% over minutes).
- --trainer sim (real engines): the real trainer is timed as usual, then every run trains with a
  stand-in that sleeps that step time and publishes the real trainer's adapter again as each
  version (copied: the store hashes and fsyncs real bytes, the engine loads real weights from
  disk). The engine then sees what it sees with the trainer on another GPU, on one GPU. The
  reward is not reported (nothing learns); the file name ends in _simtrainer before the hardware.
- --engine sim takes its speeds from --gen-ratio (generator seconds per batch / trainer seconds
  per batch) and --train-step-s: the engine samples B groups at once (concurrency = B), each
  taking gen_ratio * train_step_s, and the trainer sleeps train_step_s per step.

Writes <out>/throughput_vs_staleness_<engine>_<shape>_<hardware>.json and .png (one pair per
ratio with --ratios; "_full" before the hardware with --update full).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

# As run.py does: idle OpenMP threads sleep instead of spinning, since engine and trainer share the
# CPU cores (set before torch is imported; no effect when this module is imported later).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (the benchmarks' shared helpers sit next to this script)

from pipeline.adapter_store import MANIFEST, AdapterStore  # noqa: E402
from pipeline.config import RunConfig, load_config, parse_override  # noqa: E402
from pipeline.errors import ConfigError  # noqa: E402
from pipeline.metrics import BusyMeter  # noqa: E402
from pipeline.orchestrator import Pipeline  # noqa: E402
from pipeline.rollout_log import read_rollouts  # noqa: E402
from pipeline.trainer import SimulatedTrainer  # noqa: E402
from pipeline.types import AdapterRef, Batch, Generation, GroupRequest, Prompt, RolloutGroup  # noqa: E402

BENCHMARK = "throughput_vs_staleness"
SIM_TRAIN_STEP_S = 0.05  # the simulated trainer's default seconds per step: the sweep shows its curve in seconds
REWARD_WINDOW = 5  # the reward is averaged over the last 1/REWARD_WINDOW of the steps
STANDALONE_IDS = 10**9  # group ids of standalone requests, far from any run's
RATIO_NAMES = {3.0: "gen3x-slower", 1.0: "balanced", 0.33: "gen3x-faster"}

DEFAULTS = {  # per engine: steps, batch groups B, max_new_tokens, model shape
    "sim": {"steps": 40, "batch_groups": 8, "max_new_tokens": 16, "model_shape": ""},
    "transformers": {"steps": 30, "batch_groups": 8, "max_new_tokens": 16, "model_shape": "tiny"},
    "vllm": {"steps": 12, "batch_groups": 32, "max_new_tokens": 128, "model_shape": "qwen2.5-0.5b"},
}
QUICK = {  # --quick: under a minute on a 2-core CPU
    "sim": {"steps": 10, "staleness": "0,1,2", "train_step_s": 0.05},
    "transformers": {"steps": 4, "staleness": "0,1", "batch_groups": 2, "group_size": 4, "max_new_tokens": 8,
                     "warmup_steps": 1},
    "vllm": {"steps": 6, "staleness": "0,1", "batch_groups": 8, "max_new_tokens": 64, "enforce_eager": True},
}


# ====================================================================== command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("sim", "transformers", "vllm"), default="sim")
    p.add_argument("--staleness", default=None, metavar="K,K,...", help="max_staleness values (default 0,1,2,4,8)")
    p.add_argument("--steps", type=int, help="training steps per K (default: sim 40, transformers 30, vllm 12)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="steps left out of the steady-state window (default 2)")
    p.add_argument("--batch-groups", type=int, help="B, groups per step (default: sim 8, transformers 8, vllm 32)")
    p.add_argument("--group-size", type=int, default=None, help="n, completions per group (default 8)")
    p.add_argument("--max-new-tokens", type=int, help="completion length cap (default: 16, vllm 128)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--update", choices=("lora", "full"), default="lora",
                   help="trainer.update: publish LoRA adapters (default) or the full weights")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats of each standalone measurement")
    p.add_argument("--out", default=str(common.RESULTS_DIR), help="directory for the JSON and PNG")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run and standalone measurement, as run.py's --set "
                        "(e.g. trainer.sched_idle=true); repeatable")
    p.add_argument("--keep-runs", metavar="DIR", help="keep every run's directory under DIR (default: deleted)")
    p.add_argument("--quick", action="store_true", help="a short smoke test (under a minute on 2 CPU cores)")
    s = p.add_argument_group("simulated engine and trainer (--engine sim)")
    s.add_argument("--gen-ratio", type=float, default=1.0,
                   help="generator seconds per batch / trainer seconds per batch (3 = generator 3x slower)")
    s.add_argument("--ratios", help="several ratios in one go, e.g. 3,1,0.33 (overrides --gen-ratio)")
    s.add_argument("--train-step-s", type=float, default=None,
                   help=f"simulated trainer seconds per step ({SIM_TRAIN_STEP_S}; another value adds _step<s>s to "
                        "the file name)")
    m = p.add_argument_group("real engines (--engine transformers|vllm)")
    m.add_argument("--trainer", choices=("peft", "sim"), default="peft",
                   help="peft: the LoRA trainer (default). sim: a stand-in that trains nothing: each step "
                        "sleeps as long as the real trainer's step took in the standalone measurement and "
                        "publishes that trainer's adapter again as the next version (real files, store and "
                        "engine loads). One GPU then measures what the pipeline costs the engine, as with "
                        "the trainer on a second GPU (the trainer's own CPU use is left out)")
    m.add_argument("--trainer-process", choices=("yes", "no"), default="yes",
                   help="train in a child process (trainer.separate_process, the default); no: in a thread, "
                        "where the step's GIL time slows the event loop and the engine it drives")
    m.add_argument("--model-shape", help="built-in model shape (default: tiny; vllm: qwen2.5-0.5b)")
    m.add_argument("--model-cache", default=".cache/models", help="where built-in models are built once")
    m.add_argument("--lr", type=float, help="learning rate (default: the trainer config's)")
    m.add_argument("--lora-rank", type=int, help="LoRA rank (default: 8; vllm 16)")
    m.add_argument("--lora-alpha", type=float, help="LoRA alpha (default: 2 x rank)")
    m.add_argument("--standalone-groups", type=int, help="groups of the engine's standalone measurement (default B)")
    g = p.add_argument_group("vLLM (--engine vllm)")
    g.add_argument("--engine-device", default="cuda:0")
    g.add_argument("--trainer-device", default="cuda:1")
    g.add_argument("--trainer-dtype", default="bfloat16", choices=("float32", "bfloat16"))
    g.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    g.add_argument("--max-model-len", type=int, default=1024)
    g.add_argument("--max-num-seqs", type=int, default=None, help="engine.vllm.max_num_seqs (default: the config's)")
    g.add_argument("--enforce-eager", action="store_true", help="no torch.compile/CUDA graphs (faster start)")
    args = p.parse_args(argv)

    d = DEFAULTS[args.engine]
    q = QUICK[args.engine] if args.quick else {}
    for key in ("steps", "batch_groups", "max_new_tokens"):
        if getattr(args, key) is None:
            setattr(args, key, q.get(key, d[key]))
    if args.staleness is None:
        args.staleness = q.get("staleness", "0,1,2,4,8")
    if args.group_size is None:
        args.group_size = q.get("group_size", 8)
    if args.warmup_steps is None:
        args.warmup_steps = q.get("warmup_steps", 2)
    args.default_train_step_s = q.get("train_step_s", SIM_TRAIN_STEP_S)
    if args.train_step_s is None:
        args.train_step_s = args.default_train_step_s
    if args.model_shape is None:
        args.model_shape = d["model_shape"]
    if args.lora_rank is None:
        args.lora_rank = 16 if args.engine == "vllm" else 8
    if args.lora_alpha is None:
        args.lora_alpha = 2.0 * args.lora_rank
    args.enforce_eager = args.enforce_eager or q.get("enforce_eager", False)
    args.staleness_list = common.parse_list(args.staleness, int)
    args.ratio_list = common.parse_list(args.ratios, float) if args.ratios else [args.gen_ratio]
    if any(k < 0 for k in args.staleness_list):
        p.error(f"--staleness values must be >= 0, got {args.staleness}")
    if not 1 <= args.warmup_steps < args.steps:
        p.error(f"--warmup-steps must be in [1, --steps), got {args.warmup_steps} with --steps {args.steps}")
    if any(r <= 0 for r in args.ratio_list) or args.train_step_s <= 0:
        p.error("--gen-ratio/--ratios and --train-step-s must be > 0")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    try:
        args.set_overrides = {".".join(key): value for key, value in map(parse_override, args.set)}
        load_config(None, args.set_overrides)
    except ConfigError as e:
        p.error(f"--set: {e}")
    return args


def vllm_missing(engine_device: str, trainer_device: str) -> str | None:
    """Why --engine vllm cannot run here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (pip install 'pipeline[vllm]'; it needs a CUDA GPU)"
    import torch

    if not torch.cuda.is_available():
        return "vLLM needs a CUDA GPU and torch sees none"
    count = torch.cuda.device_count()
    for dev in (engine_device, trainer_device):
        if not dev.startswith("cuda:") or not dev[5:].isdigit() or int(dev[5:]) >= count:
            return f"device {dev!r} is not one of the {count} CUDA GPUs here (cuda:0..cuda:{count - 1})"
    return None


# ====================================================================== measurements shared by every engine


async def sample_batch(engine: Any, prompts: Sequence[Prompt], n: int, max_new_tokens: int,
                       adapter: AdapterRef | None = None) -> tuple[float, list[Generation]]:
    """Submit one group per prompt at once; seconds until the last finishes, and the generations."""
    adapter = adapter or AdapterRef.base()
    t0 = time.perf_counter()
    gens = await asyncio.gather(*(engine.generate(GroupRequest(STANDALONE_IDS + i, p, n, max_new_tokens), adapter)
                                  for i, p in enumerate(prompts)))
    return time.perf_counter() - t0, list(gens)


def time_trainer(trainer: Any, groups: Sequence[RolloutGroup], store_root: Path, repeats: int,
                 update: str = "lora") -> dict[str, float]:
    """Median seconds of one trainer step and of publishing its adapter (blocking; after one warm-up)."""
    trainer.setup()
    store = AdapterStore(store_root, kind=update)
    steps, publishes = [], []
    for i in range(repeats + 1):
        # as most of the pipeline's steps: no copy of the old version kept for a log-prob check
        batch = Batch(step=i + 1, version=trainer.version, groups=tuple(groups), keep_version=False)
        t0 = time.perf_counter()
        stats = trainer.step(batch)
        t1 = time.perf_counter()
        store.publish(stats.version, trainer.save_adapter)
        t2 = time.perf_counter()
        if i > 0:
            steps.append(t1 - t0)
            publishes.append(t2 - t1)
    step, pub = statistics.median(steps), statistics.median(publishes)
    return {"t_train_step_s": step, "t_publish_s": pub, "t_train_s": step + pub,
            "t_train_all_s": [a + b for a, b in zip(steps, publishes)]}


class ReplayTrainer(SimulatedTrainer):
    """--trainer sim: trains nothing, and publishes a real trainer's adapter as every version.

    Each step sleeps `step_s` (the real trainer's step, timed in the standalone measurement); each
    version's files are copied from `template`, a version directory that trainer published, so
    the store hashes and fsyncs as many bytes as a real publish and engines load real weights of
    the real shapes from disk."""

    def __init__(self, step_s: float, template: Path, update: str = "lora") -> None:
        super().__init__(step_s, update=update)
        self.template = Path(template)
        self.files = sorted(e.name for e in os.scandir(self.template) if e.name != MANIFEST)

    def save_adapter(self, directory: Path) -> None:
        for name in self.files:
            shutil.copyfile(self.template / name, Path(directory) / name)


def busy_in(intervals: Sequence[tuple[float, float]], t0: float, t1: float) -> float:
    """Seconds of [t0, t1] covered by the (disjoint) busy intervals."""
    return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in intervals)


def busy_fraction(meter: BusyMeter, t0: float, t1: float) -> float:
    return busy_in(list(meter.intervals), t0, t1) / max(t1 - t0, 1e-12)


def merged(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals, as sorted disjoint intervals."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def generator_idle(busy: Sequence[tuple[float, float]], admitted: np.ndarray, started: np.ndarray,
                   ended: np.ndarray, t0: float, t1: float) -> dict[str, float]:
    """When no engine had work in [t0, t1], and what the pipeline was doing meanwhile.

    busy: the engines' busy intervals; admitted/started/ended: each generated group's admission,
    generate() call and result times. Each idle second is one of: a group was started but not
    yet running on its engine (vLLM: loading its adapter; the simulated engine: its queue); a
    group was admitted but not yet started (the pipeline's own latency); or nothing was admitted
    (admission had no room: the staleness bound waits for the trainer's next version)."""
    runs = merged([(max(a, t0), min(b, t1)) for a, b in busy if b > t0 and a < t1])
    edges = [t0, *(x for run in runs for x in run), t1]
    gaps = [(a, b) for a, b in zip(edges[::2], edges[1::2]) if b > a]
    ok = np.isfinite(admitted) & np.isfinite(started) & np.isfinite(ended)
    in_engine = merged(list(zip(started[ok], ended[ok])))
    in_pipeline = merged(list(zip(admitted[ok], ended[ok])))
    idle = sum(b - a for a, b in gaps)
    waiting_in_engine = sum(busy_in(in_engine, a, b) for a, b in gaps)
    not_started = sum(busy_in(in_pipeline, a, b) for a, b in gaps) - waiting_in_engine
    return {"idle_s": idle, "gaps": len(gaps), "started_not_running_s": waiting_in_engine,
            "admitted_not_started_s": not_started, "nothing_admitted_s": idle - waiting_in_engine - not_started}


def mean_depth(started: np.ndarray, ended: np.ndarray, t0: float, t1: float) -> float | None:
    """Mean number of groups the engines held (from generate() call to result) over the seconds of
    [t0, t1] in which they held any: how deep the batches the engines ran were. None if none."""
    ok = np.isfinite(started) & np.isfinite(ended)
    a, b = np.clip(started[ok], t0, t1), np.clip(ended[ok], t0, t1)
    held = float((b - a).sum())
    busy = sum(y - x for x, y in merged([(x, y) for x, y in zip(a, b) if y > x]))
    return held / busy if busy > 0 else None


# ====================================================================== workloads


class Workload:
    """One engine kind's workload: its config per K, its standalone rates, what the Pipeline is given."""

    learns = False  # a trainer that learns: its reward and its log-prob check are figures of the run
    kind = ""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    @property
    def shape(self) -> str:
        return self.args.model_shape

    def overrides(self, K: int, run_dir: Path) -> dict[str, Any]:
        a = self.args
        return {"out": str(run_dir), "seed": a.seed, "trainer.update": a.update,
                "pipeline.steps": a.steps, "pipeline.batch_groups": a.batch_groups,
                "pipeline.max_staleness": K, "pipeline.checkpoint_every": 0, "sampling.n": a.group_size, "sampling.max_new_tokens": a.max_new_tokens,
                "log.progress": False, "log.level": "warning"}

    def config(self, K: int, run_dir: Path) -> RunConfig:
        return load_config(None, {**self.overrides(K, run_dir), **self.args.set_overrides})

    def settings(self) -> dict[str, Any]:
        return {}

    def pipeline_kwargs(self) -> dict[str, Any]:
        return {}

    async def prepare(self) -> None:
        return None

    async def standalone(self, scratch: Path) -> dict[str, Any]:
        raise NotImplementedError

    async def alone_at_depth(self, K: int) -> dict[str, Any] | None:
        """The engine alone under the run's load at max_staleness K (None: not measured for this engine)."""
        return None

    async def after_run(self) -> None:
        """Bring what the next run shares with this one back to its starting state."""
        return None

    async def close(self) -> None:
        return None


class SimWorkload(Workload):
    """The simulated engine (concurrency B, latency gen_ratio * step) and the sleeping trainer."""

    kind = "sim"

    def __init__(self, args: argparse.Namespace, ratio: float) -> None:
        super().__init__(args)
        self.ratio = ratio
        self.latency_s = ratio * args.train_step_s
        self.prompts = [{"id": f"sim-{i}", "prompt": "", "token_ids": [1 + i % 97, 2, 3, 4]} for i in range(1024)]

    @property
    def shape(self) -> str:
        return RATIO_NAMES.get(round(self.ratio, 2), f"ratio{self.ratio:g}")

    def overrides(self, K: int, run_dir: Path) -> dict[str, Any]:
        a = self.args
        o = super().overrides(K, run_dir)
        o.update({"engine.kind": "simulated", "trainer.kind": "simulated", "trainer.step_s": a.train_step_s,
                  "engine.simulated.latency_s": self.latency_s, "engine.simulated.concurrency": a.batch_groups,
                  "engine.simulated.completion_tokens": a.max_new_tokens})
        return o

    def settings(self) -> dict[str, Any]:
        return {"gen_ratio": self.ratio, "train_step_s": self.args.train_step_s, "latency_s": self.latency_s,
                "concurrency": self.args.batch_groups}

    @staticmethod
    def reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]], **kw: Any) -> list[float]:
        return [float(sum(ids) % 7) / 7.0 for ids in completion_ids]

    def pipeline_kwargs(self) -> dict[str, Any]:
        return {"prompts": self.prompts, "reward": self.reward, "tokenizer": False}

    async def standalone(self, scratch: Path) -> dict[str, Any]:
        from pipeline.engines.simulated import SimulatedEngine

        a = self.args
        cfg = self.config(0, scratch / "cfg")
        engine = SimulatedEngine(cfg.engine.simulated, seed=a.seed, name="standalone")
        prompts = [Prompt(p["id"], "", tuple(p["token_ids"])) for p in self.prompts[: 2 * a.batch_groups]]
        B = a.batch_groups
        times = []
        for _ in range(a.repeats + 1):
            t, gens = await sample_batch(engine, prompts[:B], a.group_size, a.max_new_tokens)
            times.append(t)
        t_gen = statistics.median(times[1:])
        t_two, _ = await sample_batch(engine, prompts, a.group_size, a.max_new_tokens)
        rng = np.random.default_rng(a.seed)
        groups = [RolloutGroup(g, rng.random(a.group_size), time.monotonic()) for g in gens]
        tr = await asyncio.to_thread(time_trainer, SimulatedTrainer(a.train_step_s, update=a.update), groups,
                                     scratch / "store", a.repeats, a.update)
        tokens = sum(g.num_tokens for g in gens)
        return {"t_gen_s": t_gen, "t_gen_all_s": times[1:], "gen_tokens_per_s": tokens / t_gen,
                "groups": B, "two_batches_s": t_two, **tr}

    def checks(self, standalone: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any]:
        """Is the simulated workload shaped as asked? At the largest K the slower tier must be the busy one."""
        last = max(results, key=lambda r: r["max_staleness"])
        gen, train = last["busy_generator"], last["busy_trainer"]
        t_ratio = standalone["t_gen_s"] / standalone["t_train_s"]
        if t_ratio > 1.25:
            expected, shaped = "generator", gen >= 0.9 and gen > train + 0.2
        elif t_ratio < 0.8:
            expected, shaped = "trainer", train > gen + 0.2
        else:  # either tier may bind; both must be kept busy
            expected, shaped = "either", min(gen, train) >= 0.6
        batch_over_latency = standalone["t_gen_s"] / self.latency_s
        two_over_one = standalone["two_batches_s"] / standalone["t_gen_s"]
        return {
            "measured_gen_over_train": t_ratio,
            "batch_s_over_latency_s": batch_over_latency,  # ~1: B groups at once take one latency
            "two_batches_over_one": two_over_one,  # ~2: the concurrency cap of B binds
            "expected_limit": expected,
            "busy_generator_at_max_staleness": gen,
            "busy_trainer_at_max_staleness": train,
            "ok": shaped and 0.9 < batch_over_latency < 1.5 and 1.7 < two_over_one < 2.5,
        }


class ModelWorkload(Workload):
    """A real engine and the LoRA trainer (or, with --trainer sim, its replay) on the built-in char_class task."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.model_path: Path | None = None
        self.tokenizer: Any = None
        self.store_root: Path | None = None  # the versions the real trainer published while it was timed
        self.template: Path | None = None  # the newest of them: what --trainer sim publishes
        self.replay_step_s = 0.0  # the real trainer's step: what --trainer sim sleeps

    @property
    def learns(self) -> bool:
        """The LoRA trainer learns; --trainer sim replays one adapter, so neither the reward nor a
        log-prob check (it hands the engine's log-probs back) is a figure."""
        return self.args.trainer == "peft"

    async def prepare(self) -> None:
        from pipeline.models import build_model, load_tokenizer

        self.model_path = await asyncio.to_thread(build_model, self.args.model_shape, self.args.model_cache, 0)
        self.tokenizer = load_tokenizer(self.model_path)

    def overrides(self, K: int, run_dir: Path) -> dict[str, Any]:
        a = self.args
        o = super().overrides(K, run_dir)
        o.update({"model.path": str(self.model_path), "task.name": "char_class", "trainer.kind": "peft",
                  "trainer.lora_rank": a.lora_rank, "trainer.lora_alpha": a.lora_alpha,
                  "trainer.separate_process": a.trainer_process != "no"})
        if a.lr is not None:
            o["trainer.lr"] = a.lr
        if a.trainer == "sim":  # the run's config records what trained (pipeline_kwargs passes the trainer)
            o.update({"trainer.kind": "simulated", "trainer.step_s": self.replay_step_s})
        return o

    def pipeline_kwargs(self) -> dict[str, Any]:
        if self.args.trainer == "peft":
            return {}
        return {"trainer": ReplayTrainer(self.replay_step_s, self.template, update=self.args.update)}

    def settings(self) -> dict[str, Any]:
        cfg = self.config(0, Path("unused"))
        return {"model_shape": self.args.model_shape, "model_path": str(self.model_path), "task": cfg.task.name,
                "lr": cfg.trainer.lr, "lora_rank": cfg.trainer.lora_rank, "lora_alpha": cfg.trainer.lora_alpha,
                "target_modules": list(cfg.trainer.target_modules), "loss": cfg.loss.correction,
                "trainer_device": cfg.trainer.device, "trainer_dtype": cfg.trainer.dtype,
                "trainer": self.args.trainer, "replayed_step_s": self.replay_step_s if self.args.trainer == "sim" else None}

    def task_prompts(self, count: int) -> list[Prompt]:
        from pipeline.tasks import build_task

        cfg = self.config(0, Path("unused"))
        task = build_task(cfg.task, cfg.sampling.max_new_tokens)
        self.task_reward = task.reward
        out = []
        for item in task.prompts[:count]:
            ids = tuple(self.tokenizer(item["prompt"], add_special_tokens=False)["input_ids"])
            out.append(Prompt(item["id"], item["prompt"], ids, {k: v for k, v in item.items()
                                                                if k not in ("id", "prompt")}))
        return out

    def score(self, gens: Sequence[Generation]) -> list[RolloutGroup]:
        groups = []
        for g in gens:
            ids = [c.token_ids.tolist() for c in g.completions]
            texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
            n = len(ids)
            meta = {k: [v] * n for k, v in g.request.prompt.meta.items()}
            rewards = self.task_reward([g.request.prompt.text] * n, texts, completion_ids=ids, **meta)
            groups.append(RolloutGroup(g, np.asarray(rewards, dtype=np.float64), time.monotonic()))
        return groups

    async def time_lora_trainer(self, groups: list[RolloutGroup], scratch: Path) -> dict[str, Any]:
        from pipeline.trainer import LoRATrainer

        cfg = self.config(0, scratch / "cfg")
        # the real trainer is timed with either --trainer: --trainer sim replays its step time and adapter
        trainer = LoRATrainer(self.model_path, cfg.trainer, cfg.loss, seed=self.args.seed, keep_versions=2)
        self.store_root = scratch / "store"
        try:
            tr = await asyncio.to_thread(time_trainer, trainer, groups, self.store_root, self.args.repeats,
                                         self.args.update)
        finally:
            del trainer
            free_memory()
        self.template = Path(AdapterStore(self.store_root, kind=self.args.update).latest().path)
        self.replay_step_s = tr["t_train_step_s"]
        return tr


def free_memory() -> None:
    """Drop what a finished run or measurement held (GPU memory too), before the next one starts."""
    gc.collect()
    try:
        import torch
    except ImportError:  # nothing else to free without torch
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class TransformersWorkload(ModelWorkload):
    """The transformers engine and the LoRA trainer on the CPU; each Pipeline builds its own (same seed)."""

    kind = "transformers"

    def overrides(self, K: int, run_dir: Path) -> dict[str, Any]:
        o = super().overrides(K, run_dir)
        o.update({"engine.kind": "transformers", "engine.devices": ["cpu"], "trainer.device": "cpu"})
        return o

    async def standalone(self, scratch: Path) -> dict[str, Any]:
        from pipeline.engines.transformers import TransformersEngine

        a = self.args
        cfg = self.config(0, scratch / "cfg")
        G = a.standalone_groups or a.batch_groups
        prompts = self.task_prompts(G)
        engine = TransformersEngine(self.model_path, sampling=cfg.sampling, cfg=cfg.engine.transformers,
                                    device="cpu", dtype=cfg.model.dtype, max_loaded_adapters=1, seed=a.seed,
                                    name="standalone")
        await engine.start()
        try:
            times, tokens = [], []
            for _ in range(a.repeats + 1):
                t, gens = await sample_batch(engine, prompts, a.group_size, a.max_new_tokens)
                times.append(t)
                tokens.append(sum(g.num_tokens for g in gens))
        finally:
            await engine.close()
        rates = [k / t for k, t in zip(tokens[1:], times[1:])]
        tr = await self.time_lora_trainer(self.score(gens[: a.batch_groups]), scratch)
        import torch

        return {"t_gen_s": statistics.median(times[1:]) * a.batch_groups / G, "t_gen_all_s": times[1:],
                "gen_tokens_per_s": statistics.median(rates), "groups": G, "torch_threads": torch.get_num_threads(),
                **tr}


class VLLMWorkload(ModelWorkload):
    """One vLLM engine, started once and passed to every Pipeline of the sweep; the trainer on its own GPU."""

    kind = "vllm"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.engine: Any = None

    def overrides(self, K: int, run_dir: Path) -> dict[str, Any]:
        a = self.args
        o = super().overrides(K, run_dir)
        o.update({"engine.kind": "vllm", "engine.devices": [a.engine_device], "trainer.device": a.trainer_device,
                  "trainer.dtype": a.trainer_dtype, "model.dtype": "bfloat16",
                  "engine.vllm.gpu_memory_utilization": a.gpu_memory_utilization,
                  "engine.vllm.max_model_len": a.max_model_len, "engine.vllm.enforce_eager": a.enforce_eager,
                  "engine.vllm.max_lora_rank": a.lora_rank, "engine.vllm.seed": a.seed})
        if a.max_num_seqs is not None:
            o["engine.vllm.max_num_seqs"] = a.max_num_seqs
        return o

    def settings(self) -> dict[str, Any]:
        a = self.args
        return {**super().settings(), "engine_device": a.engine_device, "gpu_memory_utilization":
                a.gpu_memory_utilization, "max_model_len": a.max_model_len, "enforce_eager": a.enforce_eager,
                "max_num_seqs": self.config(0, Path("unused")).engine.vllm.max_num_seqs,
                "max_loras": getattr(self.engine, "max_loras", None)}

    async def prepare(self) -> None:
        from pipeline.engines.vllm import VLLMEngine

        await super().prepare()
        a = self.args
        cfg = self.config(max(a.staleness_list), Path("unused"))
        # max_staleness sizes the adapters the engine keeps: the largest K of the sweep serves them all
        self.engine = VLLMEngine(self.model_path, sampling=cfg.sampling, cfg=cfg.engine.vllm, device=a.engine_device,
                                 max_staleness=max(a.staleness_list), name="vllm-0", seed=cfg.engine.vllm.seed,
                                 full_weights=a.update == "full")
        t0 = time.perf_counter()
        await self.engine.start()
        self.engine_start_s = time.perf_counter() - t0
        print(f"vLLM started on {a.engine_device} in {self.engine_start_s:.1f} s", flush=True)

    def pipeline_kwargs(self) -> dict[str, Any]:
        return {**super().pipeline_kwargs(), "engines": [self.engine]}

    async def standalone(self, scratch: Path) -> dict[str, Any]:
        a = self.args
        G = a.standalone_groups or a.batch_groups
        prompts = self.task_prompts(max(G, a.batch_groups))
        # warm-up, and the batch the trainer is timed on
        _, gens = await sample_batch(self.engine, prompts[: a.batch_groups], a.group_size, a.max_new_tokens)
        runs = []
        for _ in range(a.repeats):
            runs.append(await self.engine.standalone_throughput([list(p.token_ids) for p in prompts[:G]],
                                                                a.group_size, a.max_new_tokens))
        tr = await self.time_lora_trainer(self.score(gens), scratch)
        seconds = statistics.median(r["seconds"] for r in runs)
        return {"t_gen_s": seconds * a.batch_groups / G, "t_gen_all_s": [r["seconds"] for r in runs],
                "gen_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
                "gen_tokens_per_s_all": [r["tokens_per_s"] for r in runs], "groups": G,
                "engine_start_s": self.engine_start_s, "graph_batch_max": self.engine.graph_batch_max, **tr}

    async def alone_at_depth(self, K: int) -> dict[str, Any]:
        """The engine alone under the load the pipeline gives it at max_staleness K, just before that run.

        The pipeline keeps up to (K + 1) * B groups in flight on up to K + 1 adapter versions, and
        vLLM is faster with more sequences per batch: the engine alone with as many groups, spread
        round-robin over as many of the real trainer's adapters (full weights: the one version an
        engine holds, here the base), is the fair limit. Measured --repeats times, right before the
        run: this engine's rate drifts by 10-20% over minutes, more than the gap being measured."""
        a = self.args
        n = (K + 1) * a.batch_groups
        prompts = [list(p.token_ids) for p in self.task_prompts(n)]
        adapters = await asyncio.to_thread(self.versions_for_depth, K + 1) if a.update == "lora" else []
        runs = []
        try:
            for _ in range(a.repeats):
                runs.append(await self.engine.standalone_throughput(prompts, a.group_size, a.max_new_tokens,
                                                                    adapters=adapters))
        finally:
            await self.after_run()  # the run starts from the base model, as every run does
        rates = [r["tokens_per_s"] for r in runs]
        return {"groups": n, "adapters": len(adapters), "tokens_per_s": statistics.median(rates),
                "tokens_per_s_all": rates, "seconds": [r["seconds"] for r in runs]}

    def versions_for_depth(self, count: int) -> list[AdapterRef]:
        """`count` adapter versions of the trainer's timing store (blocking): the newest ones it
        published, topped up with copies of the newest when it published fewer."""
        store = AdapterStore(self.store_root, kind="lora")
        while len(store.versions()) < count:
            store.publish(store.versions()[-1] + 1, ReplayTrainer(0.0, self.template).save_adapter)
        return [store.ref(v) for v in store.versions()[-count:]]

    async def after_run(self) -> None:
        """Unload the finished run's adapters, so every run starts from the base model alone.

        Runs publish under names `v{version:06d}-{hash8}`: two runs whose training left identical
        weights (zero advantages everywhere, as a random model's zero rewards give) publish the same
        name from different directories, which the engine refuses while the first is loaded.
        """
        if self.args.update == "full":  # back to the base weights
            await self.engine.load_adapter(AdapterRef.base())
            return
        for name in self.engine.loaded_adapters:
            version = int(name[1:].split("-", 1)[0])
            await self.engine.unload_adapter(AdapterRef(version=version, name=name, path=None))

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.close()


# ====================================================================== one run, one sweep


def window_figures(p: Pipeline, warmup: int) -> dict[str, Any]:
    """Steady-state throughput and busy fractions: from the end of step `warmup` to the end of the last."""
    rows = p.metrics_rows
    ends = [end for _, end in p.timeline["training"]]
    t0, t1 = ends[warmup - 1], ends[-1]
    span = t1 - t0
    groups = sum(r["groups"] for r in rows[warmup:])
    tokens = sum(r["tokens"] for r in rows[warmup:])
    gen_busy = float(np.mean([busy_in(list(e.busy.intervals), t0, t1) for e in p.engines]))
    # Once the run's last group is generated the engines have nothing left to do while the last
    # steps train: the generator's busy fraction stops there (else it reads low by a step or more)
    gen_end = min(t1, max((b for e in p.engines for _, b in e.busy.intervals), default=t1))
    gen_span = gen_end - t0 if gen_end > t0 else span
    # tokens the engines generated in the window: every group whose generation ended in it
    r = read_rollouts(p.run_dir / "rollouts.zarr")
    idle = generator_idle([iv for e in p.engines for iv in e.busy.intervals], r.groups["t_admitted"],
                          r.groups["t_gen_start"], r.groups["t_gen_end"], t0, t0 + gen_span)
    depth = mean_depth(r.groups["t_gen_start"], r.groups["t_gen_end"], t0, t0 + gen_span)
    tok_len = r.completions["tok_len"].astype(np.int64)
    gen_tokens = 0
    for end, off, cnt in zip(r.groups["t_gen_end"], r.groups["comp_off"], r.groups["comp_count"]):
        if np.isfinite(end) and t0 < end <= t1:
            gen_tokens += int(tok_len[int(off):int(off) + int(cnt)].sum())
    stal = r.staleness()
    values, counts = np.unique(stal, return_counts=True)
    # the trainer tier's idle time between one step's publish and the next step: waiting for a
    # batch (wait_batch) plus the train loop's own bookkeeping
    busy = [iv for iv in p.trainer_busy.intervals if iv[0] >= t0 - 1e-9]
    gaps = np.asarray([b[0] - a[1] for a, b in zip(busy, busy[1:])], dtype=np.float64) * 1000.0
    waits = np.asarray([row["time/wait_batch_s"] for row in rows[warmup:]], dtype=np.float64) * 1000.0
    return {
        "window_s": span, "window_groups": groups,
        "groups_per_s": groups / span, "tokens_per_s": tokens / span,
        "busy_generator": gen_busy / gen_span, "busy_trainer": busy_fraction(p.trainer_busy, t0, t1),
        "generator_window_s": gen_span, "generator_idle": idle, "gen_depth_groups": depth,
        "gen_tokens_in_window": gen_tokens,
        "gen_tokens_per_busy_s": gen_tokens / gen_busy if gen_busy > 0 else None,
        "staleness_hist": {int(v): int(c) for v, c in zip(values, counts)},
        "staleness_mean": float(stal.mean()) if stal.size else None,
        "staleness_max": int(stal.max()) if stal.size else None,
        "trainer_gap_ms_mean": float(gaps.mean()) if gaps.size else None,
        "trainer_gap_ms_median": float(np.median(gaps)) if gaps.size else None,
        "trainer_gap_ms_max": float(gaps.max()) if gaps.size else None,
        "wait_batch_ms_mean": float(waits.mean()) if waits.size else None,
    }


async def run_one(w: Workload, K: int, run_dir: Path) -> dict[str, Any]:
    import torch

    cfg = w.config(K, run_dir)
    p = Pipeline(cfg, console=False, **w.pipeline_kwargs())
    threads = torch.get_num_threads()
    try:
        await p.run()
        run_threads = torch.get_num_threads()
    finally:
        # the Pipeline may narrow torch's threads for the run (engine and trainer sharing the CPU);
        # every run and measurement starts from the same process state
        torch.set_num_threads(threads)
    s = p.summary
    if s["error"] or not s["accounting_ok"] or s["steps"] != cfg.pipeline.steps:
        raise RuntimeError(f"the run at max_staleness={K} did not finish cleanly: steps {s['steps']} of "
                           f"{cfg.pipeline.steps}, accounting_ok {s['accounting_ok']}, error {s['error']} "
                           f"(see {p.run_dir}/events.jsonl)")
    out = {"max_staleness": K, "steps": s["steps"], **window_figures(p, w.args.warmup_steps)}
    # engine vs trainer log-probs of the groups the run's own checks recomputed (check/* rows)
    checks = [row for row in p.metrics_rows if "check/mean_abs_diff" in row] if w.learns else []
    out["logprob_check"] = {k: float(np.mean([row[f"check/{k}"] for row in checks]))
                            for k in ("mean_abs_diff", "max_abs_diff", "kl") if checks and f"check/{k}" in checks[0]}
    p2l = np.asarray(list(p.publish_to_loaded.values()), dtype=np.float64) * 1000.0
    rewards = [row["reward_mean"] for row in p.metrics_rows]
    tail = max(1, len(rewards) // REWARD_WINDOW)
    out.update({
        "groups_per_s_overall": s["groups_per_s"], "tokens_per_s_overall": s["tokens_per_s"],
        "wall_s": s["wall_s"], "setup_s": s["setup_s"],
        "loop_lag_p99_ms": s["loop_lag_p99_ms"],
        "publish_to_loaded_ms_mean": float(p2l.mean()) if p2l.size else None,
        "publish_to_loaded_ms_p50": float(np.median(p2l)) if p2l.size else None,
        "publish_to_loaded_ms_max": float(p2l.max()) if p2l.size else None,
        "publish_ms_mean": 1000.0 * float(np.mean([row["time/publish_s"] for row in p.metrics_rows])),
        "drain_ms_mean": 1000.0 * s["drain_s_mean"] if s["drain_s_mean"] is not None else None,
        "groups_dropped": s["groups_dropped"], "groups_failed": s["groups_failed"],
        "accounting_ok": s["accounting_ok"], "torch_threads": run_threads,
    })
    if w.learns:
        out.update({"reward_final": float(np.mean(rewards[-tail:])), "reward_mean": float(np.mean(rewards)),
                    "reward_curve": rewards, "samples": s["groups_trained"] * cfg.sampling.n})
    del p
    free_memory()
    await w.after_run()
    return out


async def sweep(w: Workload, scratch: Path) -> dict[str, Any]:
    a = w.args
    await w.prepare()
    try:
        print(f"[{w.kind} {w.shape}] standalone rates ...", flush=True)
        st = await w.standalone(scratch / "standalone")
        st["idle_loop_lag"] = await common.idle_loop_lag(1.0 if a.quick else 3.0)
        ideal = (st["t_gen_s"] + st["t_train_s"]) / max(st["t_gen_s"], st["t_train_s"])
        st["ideal_speedup"] = ideal
        results = []
        for K in a.staleness_list:
            if (depth := await w.alone_at_depth(K)) is not None:
                st.setdefault("standalone_by_depth", {})[K] = depth
                print(f"[{w.kind} {w.shape}] engine alone at max_staleness={K}'s depth ({depth['groups']} groups, "
                      f"{depth['adapters']} adapters): {depth['tokens_per_s']:.0f} tokens/s", flush=True)
            t0 = time.perf_counter()
            r = await run_one(w, K, scratch / f"K{K}")
            results.append(r)
            print(f"[{w.kind} {w.shape}] max_staleness={K}: {r['groups_per_s']:.2f} groups/s "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)
    finally:
        await w.close()
    base = next((r for r in results if r["max_staleness"] == 0), None)
    for r in results:
        r["speedup"] = r["groups_per_s"] / base["groups_per_s"] if base else None
        r["ideal"] = 1.0 if r["max_staleness"] == 0 else ideal
        r["speedup_over_ideal"] = r["speedup"] / r["ideal"] if base else None
        r["gen_kept_of_standalone"] = (r["gen_tokens_per_busy_s"] / st["gen_tokens_per_s"]
                                       if r["gen_tokens_per_busy_s"] else None)
        depth = st.get("standalone_by_depth", {}).get(r["max_staleness"])
        r["gen_kept_of_standalone_same_depth"] = (r["gen_tokens_per_busy_s"] / depth["tokens_per_s"]
                                                  if depth and r["gen_tokens_per_busy_s"] else None)
    out: dict[str, Any] = {"standalone": st, "results": results, "settings_extra": w.settings()}
    if base is not None:
        # what K=0 cost per step beyond t_gen + t_train: the orchestration's share of the sync baseline
        out["sync_step_s"] = a.batch_groups / base["groups_per_s"]
        out["sync_step_overhead_s"] = out["sync_step_s"] - st["t_gen_s"] - st["t_train_s"]
    if isinstance(w, SimWorkload):
        out["checks"] = w.checks(st, results)
    return out


# ====================================================================== report


def render_table(res: dict[str, Any], reward: bool) -> str:
    headers = ["K", "groups/s", "tokens/s", "speedup", "ideal", "gen busy", "train busy", "stale mean",
               "stale max", "lag p99 ms", "pub->load ms", "train gap ms", "gen depth", "gen kept"]
    drain = any(r.get("drain_ms_mean") is not None for r in res["results"])
    if drain:
        headers.append("drain ms")
    if reward:
        headers.append("reward")
    rows = []
    for r in res["results"]:
        row = [r["max_staleness"], r["groups_per_s"], r["tokens_per_s"], r["speedup"], r["ideal"],
               r["busy_generator"], r["busy_trainer"], r["staleness_mean"], r["staleness_max"],
               r["loop_lag_p99_ms"], r["publish_to_loaded_ms_mean"], r["trainer_gap_ms_mean"],
               r["gen_depth_groups"], r["gen_kept_of_standalone"]]
        if drain:
            row.append(r.get("drain_ms_mean"))
        if reward:
            row.append(r["reward_final"])
        rows.append(row)
    return common.table(headers, rows)


def plot(res: dict[str, Any], title: str, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rs = res["results"]
    ks = [r["max_staleness"] for r in rs]
    x = np.arange(len(ks))
    fig = Figure(figsize=(15, 4.4))
    FigureCanvasAgg(fig)
    ax1, ax2, ax3 = fig.subplots(1, 3)

    gps = [r["groups_per_s"] for r in rs]
    ax1.plot(x, gps, "o-", label="measured")
    base = next((r["groups_per_s"] for r in rs if r["max_staleness"] == 0), None)
    if base is not None:
        ax1.plot(x, [base * r["ideal"] for r in rs], "k--", label="K=0 x ideal")
        for xi, r in zip(x, rs):
            ax1.annotate(f"x{r['speedup']:.2f}", (xi, r["groups_per_s"]), textcoords="offset points",
                         xytext=(0, 6), ha="center", fontsize=8)
    ax1.set(xticks=x, xticklabels=[str(k) for k in ks], xlabel="max_staleness", ylabel="groups/s trained",
            title="throughput (steady state)")
    ax1.set_ylim(bottom=0)
    ax1.legend(fontsize=8)

    ax2.plot(x, [r["busy_generator"] for r in rs], "o-", label="generator")
    ax2.plot(x, [r["busy_trainer"] for r in rs], "s-", label="trainer")
    ax2.set(xticks=x, xticklabels=[str(k) for k in ks], xlabel="max_staleness", ylabel="busy fraction",
            ylim=(0, 1.05), title="busy fractions")
    ax2.legend(fontsize=8)

    width = 0.8 / max(1, len(rs))
    top = max((max(r["staleness_hist"], default=0) for r in rs), default=0)
    values = np.arange(top + 1)
    for i, r in enumerate(rs):
        total = max(1, sum(r["staleness_hist"].values()))
        frac = [r["staleness_hist"].get(int(v), 0) / total for v in values]
        ax3.bar(values + (i - (len(rs) - 1) / 2) * width, frac, width, label=f"K={r['max_staleness']}")
    ax3.set(xlabel="staleness of trained groups", ylabel="share of groups", title="staleness histograms",
            xticks=values)
    ax3.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def describe(w: Workload) -> str:
    a = w.args
    if isinstance(w, SimWorkload):
        return (f"sim: gen/train ratio {w.ratio:g} ({w.shape}), trainer step {a.train_step_s:g} s, "
                f"engine latency {w.latency_s:g} s x concurrency {a.batch_groups}")
    what = f"{w.kind}: model {a.model_shape}, " + ("full-weight updates" if a.update == "full" else
                                                    f"LoRA rank {a.lora_rank}")
    if a.trainer == "sim":
        what += f", trainer simulated (sleeps the real step, {w.replay_step_s:.3f} s, publishes its adapter)"
    return what


async def main_async(args: argparse.Namespace, argv: Sequence[str] | None) -> list[dict[str, Any]]:
    if args.engine == "vllm":
        workloads: list[Workload] = [VLLMWorkload(args)]
    elif args.engine == "transformers":
        workloads = [TransformersWorkload(args)]
    else:
        workloads = [SimWorkload(args, r) for r in args.ratio_list]
    out_dir = Path(args.out)
    outputs = []
    for w in workloads:
        load = common.MachineLoad()
        with tempfile.TemporaryDirectory(prefix="tvs-") as tmp:
            scratch = Path(args.keep_runs) / f"{w.kind}-{w.shape}" if args.keep_runs else Path(tmp)
            res = await sweep(w, scratch)
        hw = common.hardware()
        machine_load = load.record()
        note = common.load_note(machine_load, hw["cpu_affinity"])
        full = "_full" if args.update == "full" else ""
        sim_trainer = "_simtrainer" if w.kind != "sim" and args.trainer == "sim" else ""
        # a simulated sweep at another step time is another result, not a rerun of the default's
        step_s = f"_step{args.train_step_s:g}s" \
            if w.kind == "sim" and args.train_step_s != args.default_train_step_s else ""
        name = (f"{BENCHMARK}_{w.kind}_{w.shape}{full}{step_s}{sim_trainer}_{common.hardware_tag(hw)}"
                f"{'_quick' if args.quick else ''}")
        st = res["standalone"]
        title = f"{describe(w)} | B={args.batch_groups} x n={args.group_size}, {args.steps} steps | " \
                f"{common.hardware_tag(hw)}"
        lines = [
            f"throughput vs max_staleness -- {title}",
            f"standalone: t_gen {st['t_gen_s']:.4f} s per batch of {args.batch_groups} groups "
            f"({st['gen_tokens_per_s']:.0f} tokens/s), t_train {st['t_train_s']:.4f} s "
            f"(step {st['t_train_step_s']:.4f} + publish {st['t_publish_s']:.4f}) -> ideal speedup "
            f"{st['ideal_speedup']:.3f}",
        ]
        idle = st["idle_loop_lag"]
        lines.append(f"event loop with nothing to do, on this machine: lag p99 {idle['p99_ms']:.2f} ms (max "
                     f"{idle['max_ms']:.2f}): the floor under the lag column")
        if "sync_step_s" in res:
            lines.append(f"sync baseline: {res['sync_step_s']:.4f} s per step, {res['sync_step_overhead_s']:.4f} s "
                         "beyond t_gen + t_train")
        tbl = render_table(res, w.learns)
        lines.append(tbl)
        if isinstance(w, VLLMWorkload):
            for r in res["results"]:
                if r["gen_kept_of_standalone"] is not None:
                    same = r.get("gen_kept_of_standalone_same_depth")
                    depth = st.get("standalone_by_depth", {}).get(r["max_staleness"])
                    lines.append(f"max_staleness={r['max_staleness']}: generation inside the pipeline keeps "
                                 f"{100 * r['gen_kept_of_standalone']:.1f}% of standalone tokens/s at one batch"
                                 + (f", {100 * same:.1f}% of the engine alone at the same depth "
                                    f"({depth['groups']} groups on {depth['adapters']} adapters: median "
                                    f"{depth['tokens_per_s']:.0f} tokens/s of "
                                    f"{', '.join(f'{x:.0f}' for x in depth['tokens_per_s_all'])})"
                                    if same is not None else ""))
        for r in res["results"]:
            g = r["generator_idle"]
            if g["gaps"]:
                lines.append(f"max_staleness={r['max_staleness']}: no engine had work for {g['idle_s']:.3f} s of "
                             f"{r['generator_window_s']:.2f} s ({g['gaps']} gaps): nothing admitted "
                             f"{g['nothing_admitted_s']:.3f} s (admission waited for a version), admitted but "
                             f"not started {g['admitted_not_started_s']:.3f} s, started but not running "
                             f"{g['started_not_running_s']:.3f} s (adapter load or engine queue)")
        if "checks" in res:
            c = res["checks"]
            lines.append(f"check: {c['expected_limit']}-limited expected; at the largest K the generator is "
                         f"{c['busy_generator_at_max_staleness']:.2f} busy, the trainer "
                         f"{c['busy_trainer_at_max_staleness']:.2f}; a batch takes "
                         f"{c['batch_s_over_latency_s']:.2f} x latency, two batches {c['two_batches_over_one']:.2f} "
                         f"x one -> {'ok' if c['ok'] else 'NOT AS ASKED'}")
        if note:
            lines.append(f"note: {note}")
        text = "\n".join(lines)
        print(text, flush=True)
        record = {
            **common.header(BENCHMARK, argv), "hardware": hw, "machine_load": machine_load, "load_note": note,
            "settings": {"engine": args.engine, "shape": w.shape, "staleness": args.staleness_list,
                         "steps": args.steps, "warmup_steps": args.warmup_steps, "batch_groups": args.batch_groups,
                         "group_size": args.group_size, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
                         "repeats": args.repeats, "quick": args.quick, "set": args.set_overrides,
                         **res.pop("settings_extra")},
            **res, "table": tbl, "printed": text,
        }
        png = out_dir / f"{name}.png"
        out_dir.mkdir(parents=True, exist_ok=True)
        plot(res, title, png)
        record["files"] = {"json": str(out_dir / f"{name}.json"), "png": str(png)}
        common.write_json(out_dir / f"{name}.json", record)
        print(f"wrote {out_dir / name}.json and .png", flush=True)
        outputs.append(record)
    return outputs


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    from pipeline.log import configure_logging

    configure_logging(None, "warning", console=True)  # the standalone measurements log like a run: quietly
    if args.engine == "vllm" and (why := vllm_missing(args.engine_device, args.trainer_device)):
        raise SystemExit(f"error: --engine vllm cannot run here: {why}")
    return common.run_async(main_async(args, argv))


if __name__ == "__main__":
    main()
