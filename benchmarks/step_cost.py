"""Where a step's wall time goes, on a workload small enough that the fixed costs decide the race.

    python benchmarks/step_cost.py                  # the micro workload, K = 0 and 1, LoRA r16
    python benchmarks/step_cost.py --update full    # full-weight versions
    python benchmarks/step_cost.py --steps 80 --ks 0 --tag _after
    python benchmarks/step_cost.py --publish memory  # each adapter handed to the engine in the step's reply

The workload is issue 20's: the built-in tiny model (2 layers, d = 64), 8 groups x 8 completions
of 8 tokens (64 samples a step), the transformers engine and the LoRA trainer in its process on
the CPU, the built-in task. Each K runs --repeats times; every part is the median over the steps
after --warmup of the run with the median step period. From the metrics rows the pipeline writes:

  period          wall time from one step's end to the next's (1 / steps per second)
  wait_batch      the trainer waiting for its batch (at K = 0: the version's load into the engine,
                  admission and generation of the whole batch)
  publish_to_loaded  of that wait: the version published until every engine has loaded it
  train           the trainer's own step, measured in its process (forward, backward, optimizer)
  trainer_ipc     the step call as the pipeline sees it minus `train`: pickling the batch, the pipe,
                  the stats coming back
  save            the trainer writing the version's files (in its process, through the pipe); with
                  --publish memory, the adapter's tensors packed into the step's reply
  store           the rest of the publish: hashes, manifest, fsyncs, rename (none with memory)
  thread_hop      handing the step to a worker thread and back
  record          committing the batch, logging its groups, building the metrics row
  checkpoint      checkpoints, spread over the steps (checkpoint_every = 10)
  fixed           period - train - generation (at K = 0, generation = wait_batch - publish_to_loaded):
                  what the pipeline adds to the two computations it orchestrates

Writes step_cost_<hardware><tag>.json. docs/benchmarks.md says how to read it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PARTS = {  # name -> metrics key (seconds)
    "wait_batch": "time/wait_batch_s", "publish_to_loaded": "adapter/publish_to_loaded_s", "train": "time/train_s",
    "trainer_call": "time/trainer_call_s", "save": "time/save_s", "publish": "time/publish_s",
    "thread_hop": "time/thread_hop_s", "record": "time/record_s", "checkpoint": "time/checkpoint_s",
}


def one_run(k: int, args: argparse.Namespace) -> dict:
    from pipeline.config.io import load_config
    from pipeline.loop.orchestrator import Pipeline

    with tempfile.TemporaryDirectory(prefix="step_cost-") as out:
        cfg = load_config(None, {
            "out": out, "pipeline.steps": args.steps, "pipeline.max_staleness": k, "pipeline.batch_groups": 8,
            "sampling.n": 8, "sampling.max_new_tokens": 8, "trainer.lora_rank": 16, "trainer.update": args.update,
            "pipeline.logprob_check_every": 0, "log.progress": False, "seed": args.seed,
            "trainer.publish": args.publish,
        })
        p = Pipeline(cfg, console=False)
        summary = p.run_sync()
    if summary.get("error"):
        raise RuntimeError(summary["error"])
    rows = p.metrics_rows[args.warmup:]
    walls = [r["wall_s"] for r in p.metrics_rows[args.warmup - 1:]]
    med = lambda xs: statistics.median(x for x in xs if x == x)  # NaN-free median
    parts = {name: 1000 * med(r[key] for r in rows) for name, key in PARTS.items()}
    parts["checkpoint"] = 1000 * sum(r["time/checkpoint_s"] for r in rows) / len(rows)  # spread, not median
    parts["period"] = 1000 * med(b - a for a, b in zip(walls, walls[1:]))
    parts["trainer_ipc"] = parts.pop("trainer_call") - parts["train"]
    parts["store"] = parts.pop("publish") - parts["save"]
    generation = parts["wait_batch"] - parts["publish_to_loaded"] if k == 0 else float("nan")
    parts["fixed"] = parts["period"] - parts["train"] - generation if k == 0 else float("nan")
    return {"k": k, "ms": parts, "samples_per_s": summary["groups_per_s"] * 8, "setup_s": summary["setup_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--update", default="lora", choices=["lora", "full"])
    ap.add_argument("--publish", default="files", choices=["files", "memory"],
                    help="trainer.publish: each version through files, or handed to the engine in the step's reply")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/benchmarks")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    t0 = time.monotonic()
    result = {"benchmark": "step_cost", "settings": vars(args),
              "hardware": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}, "runs": []}
    order = ["period", "wait_batch", "publish_to_loaded", "train", "trainer_ipc", "save", "store", "thread_hop",
             "record", "checkpoint", "fixed"]
    print("K  " + " ".join(f"{n:>17}" for n in order) + "   samples/s  (ms, medians)")
    for k in args.ks:
        runs = []
        for _ in range(args.repeats):  # alternating would mix K; repeats of one K back to back, median kept
            runs.append(one_run(k, args))
        runs.sort(key=lambda r: r["ms"]["period"])
        kept = runs[len(runs) // 2]
        kept["periods_ms"] = [r["ms"]["period"] for r in runs]
        result["runs"].append(kept)
        print(f"{k:<2} " + " ".join(f"{kept['ms'][n]:17.2f}" for n in order) + f"   {kept['samples_per_s']:9.1f}",
              flush=True)
    result["wall_s"] = time.monotonic() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    memory = "_memory" if args.publish == "memory" else ""
    name = (f"step_cost_{args.update}{memory}_{result['hardware']['cpu'].replace(' ', '-')}-{os.cpu_count()}c"
            f"{args.tag}.json")
    (out / name).write_text(json.dumps(result, indent=1))
    print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
