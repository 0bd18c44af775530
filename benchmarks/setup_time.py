"""How long `python run.py` takes before its first step, cold and warm, and on what.

    python benchmarks/setup_time.py                                   # the CPU default, 3 steps
    python benchmarks/setup_time.py --config examples/one_gpu.toml --steps 3

Each repeat runs `python run.py --config C --steps N` as a user would, in a child process. A
built-in model (model.path = "") is built first, in a process of its own and timed apart
(`model_build_s`): a user's model is on disk before a run, and TRL's side reads the same one. The
first run is cold: empty compile caches (vLLM's `VLLM_CACHE_ROOT`, torch inductor's and triton's),
all in a scratch directory (unless `--scratch` names one an earlier invocation filled: then it is
warm too, and the runs are numbered after that invocation's); the runs after it are warm (the same
caches, so vLLM's compiled graphs are reused). For each run: the child's whole
wall time, the set-up the run reports in its summary.json (`setup_s` and its parts: data, model,
engines' start, trainer's start; engines and the trainer start together, so their parts
overlap), the steps' wall time, and the rest (Python and library imports, shutdown).

With `--trl` (a vLLM config, one GPU, the engine in process or a `vllm serve` the run launches;
needs the `bench` extra), TRL's GRPOTrainer is set up beside it the same way, cold then warm, each
in a child process with caches of its own: the same built model (ours builds it first), vLLM in
colocate mode at the same share of the GPU, the same LoRA, group size, completion length and
micro-batch, and the same number of steps. Its set-up is the GRPOTrainer constructor (the model,
vLLM, the trainer), its steps the first `--steps` steps. With `--trl-only`, TRL's runs alone, on the
model an earlier invocation with the same `--scratch` built (so the two halves fit in separate calls
of a machine lent by the call), its ratios against that invocation's runs (kept in the scratch's
runs.json), cold with cold and warm with warm.

Every run's vLLM start is split into the parts vLLM logs (a launched server's in its log under the
run; `vllm_parts`: the front end's time from its config to the engine core's first line, which for
an AsyncLLM holds the spawn of the core's process and its imports; then the core's weights,
torch.compile, the memory profile before the KV cache, CUDA-graph capture and how many graphs, and
its whole init), for ours and TRL's alike, so a gap between the two says where it is.

Writes setup_time_<config>_<hardware>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (the benchmarks' shared helpers sit next to this script)

BENCHMARK = "setup_time"
REPO = Path(__file__).resolve().parent.parent
PARTS = ("data_s", "model_s", "tokenizer_s", "engines_start_s", "trainer_start_s")
# vLLM 0.24's start-up log lines, each a part of an engine's start (seconds unless named otherwise)
VLLM_PARTS = {
    "weights_s": r"Model loading took [\d.]+ GiB memory and ([\d.]+) seconds",
    "compile_s": r"torch\.compile took ([\d.]+) s in total",
    "graphs": r"Profiling CUDA graph memory: PIECEWISE=(\d+)",
    "graphs_full": r"Profiling CUDA graph memory: .*FULL=(\d+)",
    "capture_s": r"Graph capturing finished in ([\d.]+) secs",
    "init_engine_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
}
# between these two lines (their timestamps, to the second): the front end's work after its config
# (its tokenizer) and, for an AsyncLLM, the spawn of the engine core's process and its imports
_STAMP = r"(\d\d-\d\d \d\d:\d\d:\d\d) \[[\w.]+:\d+\] "
FRONT_END, CORE_FIRST = _STAMP + "Resolved architecture", _STAMP + "Initializing a V1 LLM engine"


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
    p.add_argument("--trl", action="store_true", help="TRL's GRPOTrainer (vLLM colocate) set up beside, cold and warm")
    p.add_argument("--trl-only", action="store_true",
                   help="TRL's runs alone, on the model an earlier run with the same --scratch built")
    p.add_argument("--trl-child", help=argparse.SUPPRESS)  # internal: one TRL set-up, in a process of its own
    args = p.parse_args(argv)
    if args.steps < 1 or args.warm < 0:
        p.error("--steps must be >= 1 and --warm >= 0")
    if args.trl_only and not args.scratch:
        p.error("--trl-only takes the model an earlier run built under --scratch: name that directory")
    args.trl = args.trl or args.trl_only
    return args


def cache_env(caches: Path) -> dict[str, str]:
    """This process's environment with vLLM's, torch inductor's and triton's caches under `caches`."""
    return {**os.environ, "VLLM_CACHE_ROOT": str(caches / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
            "TRITON_CACHE_DIR": str(caches / "triton"), "PYTHONUNBUFFERED": "1"}


def build_model(args: argparse.Namespace, scratch: Path) -> float | None:
    """The run's built-in model built into scratch/models by a process of its own, as run.py would
    build it; its seconds (None: model.path names the user's, or an earlier invocation built it)."""
    models = scratch / "models"
    if models.is_dir():
        return None
    # the config as run.py resolves it (its own default without --config); run.py is in the working directory
    code = ("import sys, run; from pipeline.config.io import load_config; from pipeline.loop import build; "
            "cfg = load_config(sys.argv[1] or run.DEFAULT_CONFIG, sys.argv[2:]); "
            "print(build.model_dir(cfg) if not cfg.model.path else '')")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code, args.config or "", *args.set, f"model.cache_dir={models}"],
                          cwd=REPO, capture_output=True, text=True, timeout=args.timeout_s)
    if proc.returncode != 0:
        raise SystemExit(f"error: building the model exited with {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return time.monotonic() - t0 if proc.stdout.strip() else None


def one_run(args: argparse.Namespace, scratch: Path, index: int) -> dict[str, Any]:
    """`python run.py` once, its caches under `scratch`; what it took."""
    caches = scratch / "caches"
    out = scratch / f"run-{index}"
    cache = "warm" if caches.is_dir() else "cold"  # a scratch directory an earlier invocation filled is warm
    env = cache_env(caches)
    cmd = [sys.executable, str(REPO / "run.py"), "--steps", str(args.steps), "--out", str(out),
           "--set", f"model.cache_dir={scratch / 'models'}", *[a for kv in args.set for a in ("--set", kv)]]
    if args.config:
        cmd[2:2] = ["--config", args.config]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    process_s = time.monotonic() - t0
    (scratch / f"run-{index}.console.log").write_text(proc.stdout + proc.stderr)  # vLLM's own lines among them
    summary_path = out / "summary.json"
    if proc.returncode != 0 or not summary_path.is_file():
        raise SystemExit(f"error: run {index} ({' '.join(cmd)}) exited with {proc.returncode}:\n"
                         f"{(proc.stdout + proc.stderr)[-4000:]}")
    s = json.loads(summary_path.read_text())
    if s.get("error"):
        raise SystemExit(f"error: run {index} ended with an error: {s['error']}")
    parts = vllm_parts(proc.stdout + proc.stderr + server_log(out))
    started = first_event(out, "engine_started")  # the in-process engine's import of vLLM, before its start
    if "import_s" in started:
        parts["import_s"] = started["import_s"]
    return {"run": index, "cache": cache, "process_s": process_s,
            "setup_s": s["setup_s"], **{k: s["setup"].get(k) for k in PARTS}, "steps_s": s["wall_s"],
            "rest_s": process_s - s["setup_s"] - s["wall_s"], "steps": s["steps"],
            "groups_per_s": s.get("groups_per_s"), "model_path": model_of(out), "vllm_parts": parts,
            "console_tail": proc.stdout.splitlines()[-12:]}


def server_log(run_dir: Path) -> str:
    """The first launched `vllm serve`'s log of a run (engine.vllm_server.launch), where its start-up
    lines are; "" for an in-process engine, whose lines are on the run's console."""
    logs = sorted((run_dir / "servers").glob("vllm-server-*.log"))
    return logs[0].read_text(errors="replace") if logs else ""


def vllm_parts(log: str) -> dict[str, float]:
    """The parts of a vLLM start that its log names (VLLM_PARTS; the first engine's, those it logged)."""
    found = {}
    for part, pattern in VLLM_PARTS.items():
        m = re.search(pattern, log)
        if m:
            found[part] = float(m.group(1))
    if "init_engine_s" in found:  # what the init spent outside compiling and capturing: mostly the memory profile
        found["profile_s"] = found["init_engine_s"] - found.get("compile_s", 0.0) - found.get("capture_s", 0.0)
    front, core = re.search(FRONT_END, log), re.search(CORE_FIRST, log)
    if front and core:
        def at(stamp: str) -> datetime:
            return datetime.strptime(stamp, "%m-%d %H:%M:%S")

        found["before_core_s"] = (at(core.group(1)) - at(front.group(1))).total_seconds()
    return found


def compared(ours: list[dict[str, Any]], trl: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Each TRL run with the first of our runs not yet taken whose caches were as cold or warm."""
    left = list(ours)
    pairs = []
    for t in trl:
        o = next((o for o in left if o["cache"] == t["cache"]), None)
        if o is not None:
            left.remove(o)
            pairs.append((o, t))
    return pairs


def model_of(run_dir: Path) -> str | None:
    """The model directory a run used (its pipeline_ready event; None if it logged none)."""
    return first_event(run_dir, "pipeline_ready").get("model")


def first_event(run_dir: Path, name: str) -> dict[str, Any]:
    """A run's first event of that name in its events.jsonl ({} if none)."""
    events = run_dir / "events.jsonl"
    for line in events.read_text().splitlines() if events.is_file() else ():
        event = json.loads(line)
        if event.get("event") == name:
            return event
    return {}


# ====================================================================== TRL beside it


def trl_settings(config: str | None, overrides: Sequence[str], model_path: str) -> dict[str, Any]:
    """The run's settings that TRL's side takes, from the resolved config of ours."""
    from pipeline.config.io import load_config, parse_override

    return trl_settings_of(load_config(config, {".".join(key): value for key, value in map(parse_override, overrides)}),
                           model_path)


def trl_settings_of(cfg: Any, model_path: str) -> dict[str, Any]:
    """What TRL's side takes from a resolved RunConfig of ours (full weights: TRL without a peft config)."""
    launched = cfg.engine.kind == "vllm_server" and cfg.engine.vllm_server.launch
    if cfg.engine.kind != "vllm" and not launched or len(cfg.engine.devices) != 1:
        raise SystemExit("error: --trl compares one vLLM engine on one GPU: in process (engine.kind = \"vllm\") or "
                         "a `vllm serve` the run launches (engine.kind = \"vllm_server\", vllm_server.launch = true)")
    t = cfg.trainer
    return {"model_path": model_path, "batch_groups": cfg.pipeline.batch_groups, "n": cfg.sampling.n,
            "max_new_tokens": cfg.sampling.max_new_tokens, "micro_batch": t.micro_batch_sequences or
            cfg.pipeline.batch_groups * cfg.sampling.n, "lr": t.lr, "lora_rank": t.lora_rank,
            "lora_alpha": t.lora_alpha, "bf16": t.dtype == "bfloat16",
            "gpu_memory_utilization": cfg.engine.vllm.gpu_memory_utilization,
            "max_model_len": cfg.engine.vllm.max_model_len, "seed": cfg.seed, "update": t.update}


def trl_child(call_path: str) -> None:
    """One TRL set-up and its first steps (in a process of its own); writes its timings beside the call."""
    t_process = time.monotonic()
    call = json.loads(Path(call_path).read_text())
    st, steps = call["settings"], call["steps"]
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    t_imported = time.monotonic()
    B, n = st["batch_groups"], st["n"]
    data = Dataset.from_list([{"prompt": f"Say something about {i}:"} for i in range(B * max(steps, 1) * 2)])
    step_ends: list[float] = []

    class Steps(TrainerCallback):
        def on_step_end(self, *a: Any, **kw: Any) -> None:
            step_ends.append(time.monotonic())

    def length(prompts: list[str], completions: list[str], **kw: Any) -> list[float]:
        return [float(len(c) % 7) for c in completions]

    targs = GRPOConfig(
        output_dir=call["out_dir"], seed=st["seed"], max_steps=steps, learning_rate=st["lr"],
        per_device_train_batch_size=st["micro_batch"], gradient_accumulation_steps=B * n // st["micro_batch"],
        num_generations=n, max_completion_length=st["max_new_tokens"], temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, loss_type="dapo", lr_scheduler_type="constant", bf16=st["bf16"], use_vllm=True,
        vllm_mode="colocate", vllm_gpu_memory_utilization=st["gpu_memory_utilization"],
        vllm_max_model_length=st["max_model_len"], report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True, gradient_checkpointing=False, log_completions=False)
    t0 = time.monotonic()
    lora = LoraConfig(r=st["lora_rank"], lora_alpha=st["lora_alpha"], lora_dropout=0.0, target_modules="all-linear",
                      bias="none", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=st["model_path"], reward_funcs=length, args=targs, train_dataset=data,
                          processing_class=AutoTokenizer.from_pretrained(st["model_path"]),
                          peft_config=None if st.get("update") == "full" else lora,  # full: every weight, synced in memory
                          callbacks=[Steps()])
    t_built = time.monotonic()
    trainer.train()
    t_trained = time.monotonic()
    Path(call["result"]).write_text(json.dumps({
        "imports_s": t_imported - t_process, "setup_s": t_built - t0, "steps_s": t_trained - t_built,
        "first_step_s": step_ends[0] - t_built if step_ends else None, "steps": len(step_ends),
        "step_ends_s": [t - t_built for t in step_ends]}))


def trl_run(args: argparse.Namespace, scratch: Path, index: int, settings: dict[str, Any]) -> dict[str, Any]:
    """TRL's set-up once, in a child process, its compile caches under scratch/trl-caches."""
    return run_trl_child(settings, args.steps, scratch, index, args.timeout_s)


def run_trl_child(settings: dict[str, Any], steps: int, scratch: Path, index: int, timeout_s: float) -> dict[str, Any]:
    """TRL's GRPOTrainer for `steps` steps in a child process (`trl_child`), its compile caches under
    scratch/trl-caches (run 0 cold, later ones warm); its timings."""
    from pipeline.engines.vllm_launch import free_port

    caches = scratch / "trl-caches"
    out = scratch / f"trl-run-{index}"
    cache = "warm" if caches.is_dir() else "cold"
    out.mkdir(parents=True, exist_ok=True)
    call, result = out / "call.json", out / "result.json"
    result.unlink(missing_ok=True)  # an earlier invocation's, on the same scratch directory
    call.write_text(json.dumps({"settings": settings, "steps": steps, "out_dir": str(out / "trainer"),
                                "result": str(result)}))
    env = {**cache_env(caches),
           # TRL sets vLLM's logging to ERROR unless told: its start-up lines are what vllm_parts reads
           "VLLM_LOGGING_LEVEL": "INFO",
           # TRL's colocated vLLM starts torch.distributed as one process of one
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--trl-child", str(call)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout_s)
    process_s = time.monotonic() - t0
    (scratch / f"trl-run-{index}.console.log").write_text(proc.stdout + proc.stderr)  # as ours are kept
    if proc.returncode != 0 or not result.is_file():
        raise SystemExit(f"error: TRL run {index} exited with {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    r = json.loads(result.read_text())
    return {"run": index, "cache": cache, "process_s": process_s, **r,
            "rest_s": process_s - r["setup_s"] - r["steps_s"], "vllm_parts": vllm_parts(proc.stdout + proc.stderr)}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.trl_child:
        trl_child(args.trl_child)
        return {}
    hw = common.hardware()
    config = Path(args.config).stem if args.config else "cpu_default"
    name = f"{BENCHMARK}{'_trl' if args.trl_only else ''}_{config}_{common.hardware_tag(hw)}{args.tag}"
    path = Path(args.out) / f"{name}.json"
    runs: list[dict[str, Any]] = []
    trl: list[dict[str, Any]] = []
    built: dict[str, float | None] = {"model_build_s": None}

    def keep_partial() -> None:  # what is measured so far survives a run that fails or a machine taken back
        common.write_json(path, {**common.header(BENCHMARK, argv), "hardware": hw, "settings": vars(args), **built,
                                 "runs": runs, "trl": trl, "partial": True})

    with tempfile.TemporaryDirectory(prefix="setup-time-") as tmp:
        scratch = Path(args.scratch) if args.scratch else Path(tmp)
        scratch.mkdir(parents=True, exist_ok=True)
        if not args.trl_only:
            built["model_build_s"] = build_model(args, scratch)
            if built["model_build_s"] is not None:
                print(f"model built in {built['model_build_s']:.1f} s (before the runs, apart)", flush=True)
        first = 0  # a scratch directory an earlier invocation used: its runs stay, these follow them
        while (scratch / f"run-{first}").exists():
            first += 1
        earlier = scratch / "runs.json"  # ours, kept for a later --trl-only on this scratch to compare with
        ours = json.loads(earlier.read_text()) if earlier.is_file() else []
        for i in range(first, first if args.trl_only else first + 1 + args.warm):
            runs.append(one_run(args, scratch, i))
            ours.append({k: runs[-1][k] for k in ("run", "cache", "process_s", "setup_s")})
            earlier.write_text(json.dumps(ours))
            keep_partial()
            r = runs[-1]
            print(f"run {i} ({r['cache']}): {r['process_s']:.1f} s in all, set-up {r['setup_s']:.1f} s, "
                  f"steps {r['steps_s']:.1f} s", flush=True)
        if args.trl:
            model = runs[0]["model_path"] if runs else model_of(scratch / "run-0")
            if model is None:
                raise SystemExit(f"error: no model under {scratch}: --trl-only needs an earlier run of ours there")
            settings = trl_settings(args.config, args.set, model)
            for i in range(1 + args.warm):
                trl.append(trl_run(args, scratch, i, settings))
                keep_partial()
                r = trl[-1]
                print(f"TRL run {i} ({r['cache']}): {r['process_s']:.1f} s in all, set-up {r['setup_s']:.1f} s, "
                      f"steps {r['steps_s']:.1f} s", flush=True)
    cols = ["run", "cache", "process_s", "setup_s", *PARTS, "steps_s", "rest_s"]
    tbl = common.table(cols, [[r[c] for c in cols] for r in runs]) if runs else ""
    if trl:
        trl_cols = ["run", "cache", "process_s", "setup_s", "imports_s", "steps_s", "first_step_s", "rest_s"]
        tbl += "\nTRL GRPOTrainer, vLLM colocate (set-up: its constructor)\n" + common.table(
            trl_cols, [[r[c] for c in trl_cols] for r in trl])
        pairs = compared(runs or ours, trl)
        tbl += f"\nours / TRL{'' if runs else ' (ours: runs ' + ', '.join(str(o['run']) for o, _ in pairs) + ' on this scratch)'}"
        tbl += ", set-up: " + ", ".join(f"{o['cache']} {o['setup_s'] / t['setup_s']:.2f}x" for o, t in pairs)
        tbl += "; whole process: " + ", ".join(f"{o['cache']} {o['process_s'] / t['process_s']:.2f}x" for o, t in pairs)
    parts = ["import_s", "before_core_s", "init_engine_s", "weights_s", "compile_s", "profile_s", "capture_s",
             "graphs", "graphs_full"]
    tbl += "\nvLLM's start, as its log gives it\n" + common.table(
        ["who", "cache", *parts], [[who, r["cache"], *(r["vllm_parts"].get(p) for p in parts)]
                                   for who, rows in (("ours", runs), ("TRL", trl)) for r in rows])
    title = f"python run.py{' --config ' + args.config if args.config else ''} --steps {args.steps} | " \
            f"{common.hardware_tag(hw)}"
    text = f"set-up time -- {title}\n{tbl}"
    print(text, flush=True)
    record = {**common.header(BENCHMARK, argv), "hardware": hw, "settings": vars(args), **built, "runs": runs, "trl": trl,
              "table": tbl, "printed": text, "files": {"json": str(path)}}
    common.write_json(path, record)
    print(f"wrote {path}", flush=True)
    return record


if __name__ == "__main__":
    main()
