"""What a throughput-vs-staleness sweep measured: steady-state rates, busy fractions, idle and depth.

Reads finished runs (their Pipeline, rollout log and busy meters) and the standalone rates, and
writes no file. Figures and how they are taken (the script's docstring says the same for users):
- The steady-state window runs from the end of step `warmup` to the end of the last step; the
  generator's part of it ends at the run's last generation (the engines have no work after it).
- ideal = (t_gen + t_train) / max(t_gen, t_train), the overlap bound: the speedup over K=0 that
  a perfect overlap of generation and training would reach. speedup = groups/s at K over K=0.
- Generator idle: every second of the window in which no engine had work is put down to exactly
  one of: started but not running, admitted but not started, nothing admitted.
- Depth: groups the engines held per second of holding any; the staleness bound caps it at (K + 1) * B.
- Engine loads: the `seconds` of the run's `adapter_loaded` events (events.jsonl), each engine's
  own load of a version (vLLM's add_lora; a server's registration POST), apart from
  publish-to-loaded, which also holds the manifest check and the wait for every engine.
- Publish-to-loaded under load: the versions published while an engine's busy interval held the
  publish moment, apart from those published to idle engines.
- Side by side (sweeps of two engines in one invocation): per K and engine, the figures above,
  and groups/s over the baseline engine's at the same K.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

import common  # benchmarks/common.py: benchmarks/ is on sys.path, as the sweep script puts it

from pipeline.observe.metrics import BusyMeter, read_jsonl
from pipeline.loop.orchestrator import Pipeline
from pipeline.store.rollout_log import read_rollouts

REWARD_WINDOW = 5  # the reward is averaged over the last 1/REWARD_WINDOW of the steps


# ====================================================================== intervals


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


# ====================================================================== one run


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
    busy = [iv for iv in p.reporting.trainer_busy.intervals if iv[0] >= t0 - 1e-9]
    gaps = np.asarray([b[0] - a[1] for a, b in zip(busy, busy[1:])], dtype=np.float64) * 1000.0
    waits = np.asarray([row["time/wait_batch_s"] for row in rows[warmup:]], dtype=np.float64) * 1000.0
    return {
        "window_s": span, "window_groups": groups,
        "groups_per_s": groups / span, "tokens_per_s": tokens / span,
        "busy_generator": gen_busy / gen_span, "busy_trainer": busy_fraction(p.reporting.trainer_busy, t0, t1),
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


def run_figures(p: Pipeline, K: int, warmup: int, learns: bool, group_size: int, torch_threads: int) -> dict[str, Any]:
    """Every figure of one finished run at max_staleness K (`learns`: its reward and log-prob check count)."""
    s = p.summary
    out = {"max_staleness": K, "steps": s["steps"], **window_figures(p, warmup)}
    # engine vs trainer log-probs of the groups the run's own checks recomputed (check/* rows)
    checks = [row for row in p.metrics_rows if "check/mean_abs_diff" in row] if learns else []
    out["logprob_check"] = {k: float(np.mean([row[f"check/{k}"] for row in checks]))
                            for k in ("mean_abs_diff", "max_abs_diff", "kl") if checks and f"check/{k}" in checks[0]}
    p2l = np.asarray(list(p.versions.publish_to_loaded.values()), dtype=np.float64) * 1000.0
    rewards = [row["reward_mean"] for row in p.metrics_rows]
    tail = max(1, len(rewards) // REWARD_WINDOW)
    out.update({
        "groups_per_s_overall": s["groups_per_s"], "tokens_per_s_overall": s["tokens_per_s"],
        "wall_s": s["wall_s"], "setup_s": s["setup_s"],
        "loop_lag_p99_ms": s["loop_lag_p99_ms"],
        "publish_to_loaded_ms_mean": float(p2l.mean()) if p2l.size else None,
        "publish_to_loaded_ms_p50": float(np.median(p2l)) if p2l.size else None,
        "publish_to_loaded_ms_p99": float(np.percentile(p2l, 99)) if p2l.size else None,
        "publish_to_loaded_ms_max": float(p2l.max()) if p2l.size else None,
        **version_parts(p.versions.parts),
        **under_load(p.versions.publish_t, p.versions.publish_to_loaded,
                     [iv for e in p.engines for iv in e.busy.intervals]),
        "publish_ms_mean": 1000.0 * float(np.mean([row["time/publish_s"] for row in p.metrics_rows])),
        "drain_ms_mean": 1000.0 * s["drain_s_mean"] if s["drain_s_mean"] is not None else None,
        "groups_spanning_versions": s["groups_spanning_versions"],
        "groups_dropped": s["groups_dropped"], "groups_failed": s["groups_failed"],
        "accounting_ok": s["accounting_ok"], "torch_threads": torch_threads,
        **engine_loads(read_jsonl(p.run_dir / "events.jsonl")),
    })
    if learns:
        out.update({"reward_final": float(np.mean(rewards[-tail:])), "reward_mean": float(np.mean(rewards)),
                    "reward_curve": rewards, "samples": s["groups_trained"] * group_size})
    return out


def version_parts(parts: Mapping[int, Mapping[str, float]]) -> dict[str, Any]:
    """Where publish-to-loaded went, over the run's versions: the adapter loop getting to a version,
    verifying it, the engines loading it (ms, p50 and p99 each)."""
    out: dict[str, Any] = {}
    for part in ("wait_s", "verify_s", "load_s"):
        ms = np.asarray([v[part] for v in parts.values()], dtype=np.float64) * 1000.0
        name = part.removesuffix("_s")
        out[f"adapter_{name}_ms_p50"] = float(np.median(ms)) if ms.size else None
        out[f"adapter_{name}_ms_p99"] = float(np.percentile(ms, 99)) if ms.size else None
    return out


def under_load(published: Mapping[int, float], to_loaded: Mapping[int, float],
               busy: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """Publish to serving of the versions published while an engine was generating (its busy
    interval holds the publish moment), apart from those published to idle engines: a load that
    queues behind running requests shows only in the first (ms, p50 and p99; and how many)."""
    runs = merged(list(busy))
    loaded = {v: s for v, s in to_loaded.items() if v in published}
    busy_at = {v: any(a <= published[v] < b for a, b in runs) for v in loaded}
    out: dict[str, Any] = {"versions_published_generating": sum(busy_at.values()),
                           # each version's own figure, for what a p99 over a few versions hides
                           "publish_to_loaded_ms_by_version": {v: round(1000.0 * s, 3) for v, s in loaded.items()},
                           "published_generating": sorted(v for v, b in busy_at.items() if b)}
    for name, want in (("generating", True), ("idle", False)):
        ms = np.asarray([1000.0 * s for v, s in loaded.items() if busy_at[v] is want], dtype=np.float64)
        out[f"publish_to_loaded_{name}_ms_p50"] = float(np.median(ms)) if ms.size else None
        out[f"publish_to_loaded_{name}_ms_p99"] = float(np.percentile(ms, 99)) if ms.size else None
    return out


def engine_loads(events: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The engines' own adapter loads in a run's events: how many logged their seconds, mean and max ms."""
    ms = np.asarray([1000.0 * e["seconds"] for e in events if e.get("event") == "adapter_loaded" and "seconds" in e],
                    dtype=np.float64)
    return {"engine_loads": int(ms.size), "engine_load_ms_mean": float(ms.mean()) if ms.size else None,
            "engine_load_ms_max": float(ms.max()) if ms.size else None}


# ====================================================================== the sweep against its baselines


def ideal_speedup(standalone: dict[str, Any]) -> float:
    """The overlap bound: K=0 takes t_gen + t_train per step, a perfect overlap max(t_gen, t_train)."""
    t_gen, t_train = standalone["t_gen_s"], standalone["t_train_s"]
    return (t_gen + t_train) / max(t_gen, t_train)


def against_baselines(results: list[dict[str, Any]], standalone: dict[str, Any],
                      batch_groups: int) -> dict[str, float]:
    """Add each run's speedup over K=0, its ideal and the generation rate it kept of the engine alone
    (at one batch, and at the run's depth where measured); returns what K=0 cost per step (none without K=0)."""
    st = standalone
    base = next((r for r in results if r["max_staleness"] == 0), None)
    for r in results:
        r["speedup"] = r["groups_per_s"] / base["groups_per_s"] if base else None
        r["ideal"] = 1.0 if r["max_staleness"] == 0 else st["ideal_speedup"]
        r["speedup_over_ideal"] = r["speedup"] / r["ideal"] if base else None
        r["gen_kept_of_standalone"] = (r["gen_tokens_per_busy_s"] / st["gen_tokens_per_s"]
                                       if r["gen_tokens_per_busy_s"] else None)
        depth = st.get("standalone_by_depth", {}).get(r["max_staleness"])
        r["gen_kept_of_standalone_same_depth"] = (r["gen_tokens_per_busy_s"] / depth["tokens_per_s"]
                                                  if depth and r["gen_tokens_per_busy_s"] else None)
    if base is None:
        return {}
    # what K=0 cost per step beyond t_gen + t_train: the orchestration's share of the sync baseline
    sync_step_s = batch_groups / base["groups_per_s"]
    return {"sync_step_s": sync_step_s, "sync_step_overhead_s": sync_step_s - st["t_gen_s"] - st["t_train_s"]}


# ====================================================================== report


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


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


def report(res: dict[str, Any], title: str, batch_groups: int, learns: bool, note: str | None) -> tuple[str, str]:
    """The sweep's printed report and its table: standalone rates, the table, then per-K notes."""
    st = res["standalone"]
    lines = [
        f"throughput vs max_staleness -- {title}",
        f"standalone: t_gen {st['t_gen_s']:.4f} s per batch of {batch_groups} groups "
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
    tbl = render_table(res, learns)
    lines.append(tbl)
    lines.append("a version's way to the engines, publish to serving and its parts (ms, p50 / p99): the adapter "
                 "loop getting to it, verifying it, the engines loading it")
    lines.append(common.table(
        ["K", "versions", "publish->serving", "loop wait", "verify", "engines load", "of them generating",
         "publish->serving, generating"],
        [[r["max_staleness"], r["steps"],
          *(f"{_ms(r.get(f'{k}_ms_p50'))} / {_ms(r.get(f'{k}_ms_p99'))}"
            for k in ("publish_to_loaded", "adapter_wait", "adapter_verify", "adapter_load")),
          r.get("versions_published_generating"),
          f"{_ms(r.get('publish_to_loaded_generating_ms_p50'))} / {_ms(r.get('publish_to_loaded_generating_ms_p99'))}"]
         for r in res["results"]]))
    lines.append("of them generating: the versions published while an engine was generating; their publish to "
                 "serving apart (a load queued behind running requests shows there)")
    if "standalone_by_depth" in st:  # the engine alone was measured at each run's depth too (vLLM)
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
    if "trl" in res:  # --trl: TRL's GRPOTrainer on the same workload, after the sweep
        t = res["trl"]
        lines.append(f"TRL GRPOTrainer (vLLM colocate, update {t['settings']['update']}): "
                     f"{t['samples_per_s']:.1f} samples/s steady (set-up {t['setup_s']:.1f} s); ours / TRL: "
                     + ", ".join(f"K={k} {v:.2f}x" for k, v in t["ours_over_trl"].items()))
    if any(r.get("groups_spanning_versions") for r in res["results"]):  # in-flight full-weight swaps
        lines.append("groups carried across a swap (pipeline.full_weight_swap = in_flight): "
                     + ", ".join(f"K={r['max_staleness']} {r['groups_spanning_versions']}" for r in res["results"]))
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
    return text, tbl


# ====================================================================== two engines side by side

COMPARED = ("groups_per_s", "gen_kept_of_standalone", "gen_kept_of_standalone_same_depth", "loop_lag_p99_ms",
            "publish_to_loaded_ms_mean", "publish_to_loaded_ms_max", "engine_load_ms_mean", "engine_load_ms_max")


def side_by_side(sweeps: Mapping[str, Mapping[str, Any]], baseline: str) -> list[dict[str, Any]]:
    """One row per K and engine (engines in the sweeps' order): the COMPARED figures of its run, and
    its groups/s over `baseline`'s run at the same K (None where the baseline has no such run)."""
    runs = {engine: {r["max_staleness"]: r for r in res["results"]} for engine, res in sweeps.items()}
    rows = []
    for K in sorted({K for by_k in runs.values() for K in by_k}):
        base = runs[baseline].get(K)
        for engine, by_k in runs.items():
            if (r := by_k.get(K)) is None:
                continue
            rows.append({"max_staleness": K, "engine": engine, **{key: r[key] for key in COMPARED},
                         "groups_per_s_over_baseline": r["groups_per_s"] / base["groups_per_s"] if base else None})
    return rows


def side_by_side_report(sweeps: Mapping[str, Mapping[str, Any]], baseline: str,
                        rows: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    """The printed comparison and its table: each engine alone, then the runs per K and engine."""
    lines = [f"side by side: {', '.join(sweeps)} in one invocation, one after the other on the same hardware"]
    for engine, res in sweeps.items():
        st = res["standalone"]
        lines.append(f"{engine}: alone {st['gen_tokens_per_s']:.0f} tokens/s ({st['groups']} groups at once), "
                     f"started in {st['engine_start_s']:.1f} s; t_train {st['t_train_s']:.4f} s")
    tbl = common.table(
        ["K", "engine", "groups/s", f"x {baseline}", "gen kept", "kept same depth", "lag p99 ms", "pub->load ms",
         "pub->load max", "load ms", "load max"],
        [[r["max_staleness"], r["engine"], r["groups_per_s"], r["groups_per_s_over_baseline"],
          *(r[key] for key in COMPARED[1:])] for r in rows])
    lines += [tbl, "gen kept: tokens per busy second over the engine's own standalone rate (one batch; at the run's "
                   "depth); pub->load: publish until every engine serves the version; load: the engine's own load "
                   "of it (in process: vLLM's add_lora; server: its POST /v1/load_lora_adapter)"]
    return "\n".join(lines), tbl
