"""Throughput against max_staleness: one process sweeps the staleness bound over one workload.

    python benchmarks/throughput_vs_staleness.py                        # simulated, balanced
    python benchmarks/throughput_vs_staleness.py --ratios 3,1,0.33      # generator 3x slower, balanced, 3x faster
    python benchmarks/throughput_vs_staleness.py --engine transformers  # tiny model, real LoRA trainer, CPU
    python benchmarks/throughput_vs_staleness.py --engine vllm --model-shape qwen2.5-0.5b \\
        --engine-device cuda:0 --trainer-device cuda:1                  # vLLM on one GPU, trainer on another
    python benchmarks/throughput_vs_staleness.py --engine vllm --trainer sim \\
        --engine-device cuda:0 --trainer-device cuda:0                  # one GPU: what the pipeline costs vLLM
    python benchmarks/throughput_vs_staleness.py --update full          # full-weight updates instead of LoRA
    python benchmarks/throughput_vs_staleness.py --engine vllm_server --compare-in-process --trainer sim \\
        --engine-device cuda:0 --trainer-device cuda:0                  # `vllm serve` against in-process vLLM

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
  the steps (every K trains the same number of samples). Publish-to-loaded is also given apart
  for the versions published while an engine was generating ("generating"): a run whose engine
  is idle whenever a version comes (K = 0, or a trainer-bound run) measures a load with no
  requests to queue behind.
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
- --engine vllm_server: one `vllm serve` on --engine-device (pipeline/engines/vllm_launch.py),
  started once with the in-process engine's settings and adapter slots, and one HTTP engine on it
  (engine.kind = "vllm_server") shared by every run. The engine alone is timed by the same client
  code as the in-process engine's (groups submitted at once through generate). "load ms" is the
  engine's own load of a version from the runs' events (the server: its POST /v1/load_lora_adapter;
  in process: vLLM's add_lora).
- --compare-in-process (with --engine vllm_server): the in-process vLLM sweep first, its engine
  closed, then the server's on the same GPU, replaying the trainer step timed in the first; one
  JSON holds both sweeps and a table per K and engine (groups/s and over in-process at the same
  K, gen kept, lag p99, publish-to-loaded mean and max, load ms mean and max).
- --engine sim takes its speeds from --gen-ratio (generator seconds per batch / trainer seconds
  per batch) and --train-step-s: the engine samples B groups at once (concurrency = B), each
  taking gen_ratio * train_step_s, and the trainer sleeps train_step_s per step.

Writes <out>/throughput_vs_staleness_<engine>_<shape>_<hardware>.json and .png (one pair per
ratio with --ratios; "_full" before the hardware with --update full, "_full_memory" with
--set trainer.publish=memory too, then "_in_flight" with --set pipeline.full_weight_swap=in_flight),
each as its sweep ends.
--compare-in-process writes each engine's pair, then one JSON holding both sweeps and the table
per K, <engine> = vllm_server_vs_in_process.
"""

# This script is the command line and the sweep driver. The workloads it runs (engines, trainers,
# their standalone rates) are in staleness/workloads.py; what it measures from the runs, and the
# report it prints, in staleness/analysis.py (kept out of the docstring: that is --help's text).

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

# As run.py does: idle OpenMP threads sleep instead of spinning, since engine and trainer share the
# CPU cores (set before torch is imported; no effect when this module is imported later).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (the benchmarks' shared helpers sit next to this script)
from staleness import analysis  # noqa: E402  (this sweep's parts, in benchmarks/staleness/)
from staleness.workloads import (  # noqa: E402
    SimWorkload, TransformersWorkload, VLLMServerWorkload, VLLMWorkload, Workload, free_memory, vllm_missing)

from pipeline.config.io import load_config, parse_override  # noqa: E402
from pipeline.errors import ConfigError  # noqa: E402
from pipeline.loop.orchestrator import Pipeline  # noqa: E402

BENCHMARK = "throughput_vs_staleness"
VLLM_ENGINES = ("vllm", "vllm_server")  # engines that need vLLM and a GPU
COMPARED_NAME = "vllm_server_vs_in_process"  # the engine part of a --compare-in-process result's name
SIM_TRAIN_STEP_S = 0.05  # the simulated trainer's default seconds per step: the sweep shows its curve in seconds

DEFAULTS = {  # per engine: steps, batch groups B, max_new_tokens, model shape
    "sim": {"steps": 40, "batch_groups": 8, "max_new_tokens": 16, "model_shape": ""},
    "transformers": {"steps": 30, "batch_groups": 8, "max_new_tokens": 16, "model_shape": "tiny"},
    "vllm": {"steps": 12, "batch_groups": 32, "max_new_tokens": 128, "model_shape": "qwen2.5-0.5b"},
}
DEFAULTS["vllm_server"] = DEFAULTS["vllm"]
QUICK = {  # --quick: under a minute on a 2-core CPU
    "sim": {"steps": 10, "staleness": "0,1,2", "train_step_s": 0.05},
    "transformers": {"steps": 4, "staleness": "0,1", "batch_groups": 2, "group_size": 4, "max_new_tokens": 8,
                     "warmup_steps": 1},
    "vllm": {"steps": 6, "staleness": "0,1", "batch_groups": 8, "max_new_tokens": 64, "enforce_eager": True},
}
QUICK["vllm_server"] = QUICK["vllm"]


# ====================================================================== command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("sim", "transformers", *VLLM_ENGINES), default="sim",
                   help="vllm_server: one `vllm serve` started on --engine-device, the pipeline's HTTP engine on it")
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
    p.add_argument("--out", default=str(common.DEFAULT_OUT), help="directory for the JSON and PNG")
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
    m = p.add_argument_group("real engines (--engine transformers|vllm|vllm_server)")
    m.add_argument("--trainer", choices=("peft", "sim"), default="peft",
                   help="peft: the LoRA trainer (default). sim: a stand-in that trains nothing: each step "
                        "sleeps as long as the real trainer's step took in the standalone measurement and "
                        "publishes that trainer's adapter again as the next version (real files, store and "
                        "engine loads). One GPU then measures what the pipeline costs the engine, as with "
                        "the trainer on a second GPU (the trainer's own CPU use is left out)")
    m.add_argument("--replay-step-s", type=float, default=0.0,
                   help="with --trainer sim: the stand-in sleeps this long a step instead of the real trainer's "
                        "timed step (shorter: a generation-bound run, the engine busy when versions come; "
                        "_replay<s>s in the file name); the ideal column still uses the real step")
    m.add_argument("--trainer-process", choices=("yes", "no"), default="yes",
                   help="train in a child process (trainer.separate_process, the default); no: in a thread, "
                        "where the step's GIL time slows the event loop and the engine it drives")
    m.add_argument("--model-shape", help="built-in model shape (default: tiny; vllm: qwen2.5-0.5b)")
    m.add_argument("--model-cache", default=".cache/models", help="where built-in models are built once")
    m.add_argument("--lr", type=float, help="learning rate (default: the trainer config's)")
    m.add_argument("--lora-rank", type=int, help="LoRA rank (default: 8; vllm 16)")
    m.add_argument("--lora-alpha", type=float, help="LoRA alpha (default: 2 x rank)")
    m.add_argument("--standalone-groups", type=int, help="groups of the engine's standalone measurement (default B)")
    g = p.add_argument_group("vLLM (--engine vllm|vllm_server)")
    g.add_argument("--compare-in-process", action="store_true",
                   help="with --engine vllm_server: sweep the in-process vLLM engine first, on the same GPU, and "
                        "write one JSON with both sweeps side by side")
    g.add_argument("--engine-device", default="cuda:0", help="the engine's GPU (the server's, for vllm_server)")
    g.add_argument("--trainer-device", default="cuda:1")
    g.add_argument("--trainer-dtype", default="bfloat16", choices=("float32", "bfloat16"))
    g.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="the engine's share of its GPU")
    g.add_argument("--max-model-len", type=int, default=1024)
    g.add_argument("--max-num-seqs", type=int, default=None, help="engine.vllm.max_num_seqs (default: the config's)")
    g.add_argument("--enforce-eager", action="store_true", help="no torch.compile/CUDA graphs (faster start)")
    g.add_argument("--trl", action="store_true",
                   help="with --engine vllm on one GPU: TRL's GRPOTrainer (vLLM colocate) on the same workload after "
                        "the sweep, same steps and steady window; each K's samples/s over TRL's (needs trl)")
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
        args.lora_rank = 16 if args.engine in VLLM_ENGINES else 8
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
    if args.replay_step_s and (args.replay_step_s < 0 or args.engine == "sim" or args.trainer != "sim"):
        p.error(f"--replay-step-s takes a time > 0 with --trainer sim and a real engine, got {args.replay_step_s} "
                f"with --engine {args.engine} --trainer {args.trainer}")
    if args.compare_in_process and args.engine != "vllm_server":
        p.error(f"--compare-in-process compares --engine vllm_server with the in-process engine, not --engine "
                f"{args.engine}")
    if args.trl and args.engine != "vllm":
        p.error(f"--trl races TRL's GRPOTrainer in vLLM colocate mode against --engine vllm, not --engine {args.engine}")
    if args.engine == "vllm_server" and args.update == "full":
        p.error('--engine vllm_server takes LoRA updates only (engine.kind = "vllm_server" loads no full weights)')
    try:
        args.set_overrides = {".".join(key): value for key, value in map(parse_override, args.set)}
        kind = {"sim": "simulated", "vllm_server": "vllm"}.get(args.engine, args.engine)
        devices = {"engine.devices": [args.engine_device], "trainer.device": args.trainer_device} \
            if args.engine in VLLM_ENGINES else {}
        load_config(None, {"trainer.update": args.update, "engine.kind": kind, **devices,
                           **args.set_overrides})  # as the runs will read them
    except ConfigError as e:
        p.error(f"--set: {e}")
    return args




# ====================================================================== one run, one sweep


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
    out = analysis.run_figures(p, K, w.args.warmup_steps, w.learns, cfg.sampling.n, run_threads)
    del p
    free_memory()
    await w.after_run()
    return out


async def sweep(w: Workload, scratch: Path, keep: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """The workload's standalone rates, then one run per K (each after the engine alone at its depth,
    where the workload measures that), each compared with K=0 of the same sweep. `keep` gets what is
    measured so far after each K, for a sweep cut off before its end (a device call's time limit)."""
    a = w.args
    try:
        await w.prepare(scratch)
        print(f"[{w.kind} {w.shape}] standalone rates ...", flush=True)
        st = await w.standalone(scratch / "standalone")
        st["idle_loop_lag"] = await common.idle_loop_lag(1.0 if a.quick else 3.0)
        st["ideal_speedup"] = analysis.ideal_speedup(st)
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
                  f"({time.perf_counter() - t0:.1f} s); publish to serving p50 {_ms(r, 'publish_to_loaded_ms_p50')} "
                  f"p99 {_ms(r, 'publish_to_loaded_ms_p99')} ms (loop's wait {_ms(r, 'adapter_wait_ms_p50')}, "
                  f"verify {_ms(r, 'adapter_verify_ms_p50')}, engines' load {_ms(r, 'adapter_load_ms_p50')} ms p50); "
                  f"{r['versions_published_generating']} of {r['steps']} versions published while generating, "
                  f"p50 {_ms(r, 'publish_to_loaded_generating_ms_p50')} p99 "
                  f"{_ms(r, 'publish_to_loaded_generating_ms_p99')} ms", flush=True)
            if keep is not None:
                keep({"standalone": st, "results": results})
    finally:
        await w.close()
        free_memory()  # what the engine held here (GPU memory too) goes before another workload starts
    sync = analysis.against_baselines(results, st, a.batch_groups)
    out: dict[str, Any] = {"standalone": st, "results": results, "settings_extra": w.settings(), **sync}
    if (checks := w.checks(st, results)) is not None:
        out["checks"] = checks
    return out


def trl_beside(w: Workload, args: argparse.Namespace, results: list[dict[str, Any]], scratch: Path) -> dict[str, Any]:
    """--trl: TRL's GRPOTrainer on the sweep's workload, in a child process (benchmarks/setup_time.py's):
    the same built model, B x n, completion length, learning rate, dtype, micro-batch, vLLM share of
    the GPU and update (full: no peft config, TRL syncs the weights to vLLM in memory), the same
    number of steps; its samples/s over the same steady window (after --warmup-steps steps), and
    each K's over it. TRL's prompts are short fixed strings, ours the task's (completions dominate)."""
    import setup_time

    settings = setup_time.trl_settings_of(w.config(0, scratch / "config"), str(w.model_path))
    print(f"[{w.kind} {w.shape}] TRL GRPOTrainer, vLLM colocate, {args.steps} steps ...", flush=True)
    r = setup_time.run_trl_child(settings, args.steps, scratch, 0, timeout_s=3600.0)
    ends, wu = r["step_ends_s"], args.warmup_steps
    if len(ends) != args.steps:
        raise RuntimeError(f"TRL ran {len(ends)} steps, not {args.steps}")
    samples = args.batch_groups * args.group_size
    rate = samples * (len(ends) - wu) / (ends[-1] - ends[wu - 1])
    ours = {r_["max_staleness"]: r_["groups_per_s"] * args.group_size for r_ in results}
    print(f"[{w.kind} {w.shape}] TRL: {rate:.1f} samples/s steady; ours / TRL: "
          + ", ".join(f"K={k} {v / rate:.2f}x" for k, v in ours.items()), flush=True)
    return {"settings": settings, "samples_per_s": rate, "setup_s": r["setup_s"], "steps_s": r["steps_s"],
            "step_ends_s": ends, "ours_samples_per_s": ours, "ours_over_trl": {k: v / rate for k, v in ours.items()}}


def _ms(r: dict[str, Any], key: str) -> str:
    """A run's figure in ms for a progress line ("-" where the run has none)."""
    return "-" if r.get(key) is None else f"{r[key]:.0f}"


# ====================================================================== files


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



def result_name(w: Workload, args: argparse.Namespace, hw: dict[str, Any], kind: str | None = None) -> str:
    """The JSON/PNG file name: the benchmark, the workload (its engine: `kind`, default the workload's),
    what changes its figures, the hardware."""
    full = "_full" if args.update == "full" else ""
    if args.set_overrides.get("trainer.publish") == "memory":  # versions through GPU memory, not files
        full += "_memory"
    if args.set_overrides.get("pipeline.full_weight_swap") == "in_flight":  # groups carried across swaps
        full += "_in_flight"
    sim_trainer = "_simtrainer" if w.kind != "sim" and args.trainer == "sim" else ""
    if sim_trainer and args.replay_step_s:
        sim_trainer += f"_replay{args.replay_step_s:g}s"
    # a simulated sweep at another step time is another result, not a rerun of the default's
    step_s = f"_step{args.train_step_s:g}s" \
        if w.kind == "sim" and args.train_step_s != args.default_train_step_s else ""
    return (f"{BENCHMARK}_{kind or w.kind}_{w.shape}{full}{step_s}{sim_trainer}_{common.hardware_tag(hw)}"
            f"{'_quick' if args.quick else ''}")


def workloads_of(args: argparse.Namespace) -> list[Workload]:
    """What to sweep, in order: one workload per ratio (sim), the one engine, or the two engines compared."""
    if args.engine == "vllm_server":
        if not args.compare_in_process:
            return [VLLMServerWorkload(args)]
        # in process first: its engine is closed, its GPU memory freed, before the server starts
        in_process = VLLMWorkload(args)
        return [in_process, VLLMServerWorkload(args, trainer_from=in_process)]
    if args.engine == "vllm":
        return [VLLMWorkload(args)]
    if args.engine == "transformers":
        return [TransformersWorkload(args)]
    return [SimWorkload(args, r) for r in args.ratio_list]


def run_settings(w: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """The settings every run of a sweep shares, as its record keeps them."""
    return {"engine": w.kind, "shape": w.shape, "staleness": args.staleness_list, "steps": args.steps,
            "warmup_steps": args.warmup_steps, "batch_groups": args.batch_groups, "group_size": args.group_size,
            "max_new_tokens": args.max_new_tokens, "seed": args.seed, "repeats": args.repeats, "quick": args.quick,
            "set": args.set_overrides}


def sweep_record(w: Workload, res: dict[str, Any], load: common.MachineLoad, args: argparse.Namespace,
                 argv: Sequence[str] | None, out_dir: Path) -> dict[str, Any]:
    """One finished sweep's record, its report printed and its PNG written (its JSON is the caller's to write)."""
    hw = common.hardware()
    machine_load = load.record()
    note = common.load_note(machine_load, hw["cpu_affinity"])
    name = result_name(w, args, hw)
    title = f"{w.describe()} | B={args.batch_groups} x n={args.group_size}, {args.steps} steps | " \
            f"{common.hardware_tag(hw)}"
    text, tbl = analysis.report(res, title, args.batch_groups, w.learns, note)
    print(text, flush=True)
    record = {
        **common.header(BENCHMARK, argv), "hardware": hw, "machine_load": machine_load, "load_note": note,
        "settings": {**run_settings(w, args), **res.pop("settings_extra")},
        **res, "table": tbl, "printed": text,
    }
    png = out_dir / f"{name}.png"
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(res, title, png)
    record["files"] = {"json": str(out_dir / f"{name}.json"), "png": str(png)}
    return record


def comparison_record(workloads: Sequence[Workload], records: Sequence[dict[str, Any]], args: argparse.Namespace,
                      argv: Sequence[str] | None, out_dir: Path) -> dict[str, Any]:
    """--compare-in-process: both sweeps' records under "sweeps" (by engine; each also written on its
    own) and the table per K and engine, in one record named for both; the first sweep is the baseline."""
    sweeps = {w.kind: rec for w, rec in zip(workloads, records, strict=True)}
    baseline = workloads[0].kind
    rows = analysis.side_by_side(sweeps, baseline)
    text, tbl = analysis.side_by_side_report(sweeps, baseline, rows)
    print(text, flush=True)
    hw = records[-1]["hardware"]
    name = result_name(workloads[-1], args, hw, kind=COMPARED_NAME)
    return {**common.header(BENCHMARK, argv), "hardware": hw,
            "settings": {**run_settings(workloads[-1], args), "engines": list(sweeps), "baseline": baseline},
            "side_by_side": rows, "table": tbl, "printed": text, "sweeps": sweeps,
            "files": {"json": str(out_dir / f"{name}.json")}}


async def main_async(args: argparse.Namespace, argv: Sequence[str] | None) -> list[dict[str, Any]]:
    workloads = workloads_of(args)
    out_dir = Path(args.out)
    records = []
    # one scratch root for the invocation: a later sweep replays what an earlier one's trainer published
    with tempfile.TemporaryDirectory(prefix="tvs-") as tmp:
        root = Path(args.keep_runs) if args.keep_runs else Path(tmp)
        for w in workloads:
            load = common.MachineLoad()
            hw = common.hardware()
            partial = out_dir / f"{result_name(w, args, hw)}.partial.json"

            def keep(so_far: dict[str, Any], w: Workload = w, hw: dict[str, Any] = hw, partial: Path = partial) -> None:
                common.write_json(partial, {**common.header(BENCHMARK, argv), "hardware": hw, "partial": True,
                                            "settings": run_settings(w, args), **so_far})

            res = await sweep(w, root / f"{w.kind}-{w.shape}", keep)
            if args.trl:
                keep({"standalone": res["standalone"], "results": res["results"]})
                res["trl"] = await asyncio.to_thread(trl_beside, w, args, res["results"], root / "trl")
            records.append(rec := sweep_record(w, res, load, args, argv, out_dir))
            # kept as soon as it is done: a later sweep that fails (a server that does not start) loses nothing
            common.write_json(Path(rec["files"]["json"]), rec)
            partial.unlink(missing_ok=True)  # the whole record holds all it held
            print(f"wrote {rec['files']['json']} and .png", flush=True)
    if not args.compare_in_process:
        return records
    rec = comparison_record(workloads, records, args, argv, out_dir)
    common.write_json(Path(rec["files"]["json"]), rec)
    print(f"wrote {rec['files']['json']}", flush=True)
    return [rec]


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    from pipeline.observe.log import configure_logging

    configure_logging(None, "warning", console=True)  # the standalone measurements log like a run: quietly
    if args.engine in VLLM_ENGINES and (why := vllm_missing(args.engine_device, args.trainer_device)):
        raise SystemExit(f"error: --engine {args.engine} cannot run here: {why}")
    return common.run_async(main_async(args, argv))


if __name__ == "__main__":
    main()
