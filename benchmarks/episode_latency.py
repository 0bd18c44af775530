"""How much environment latency the pipeline hides: multi-turn episodes, step latency x max_staleness.

    python benchmarks/episode_latency.py                    # env latency 0, 50, 200 ms; K = 0, 1, 2
    python benchmarks/episode_latency.py --quick            # fewer steps (a smoke run)

The simulated engine and trainer (no model): every group is n episodes of `--turns` policy turns;
the first turn of a group takes --gen-s, each later turn --turn-s, and each environment step
sleeps the latency (asynchronously, as a tool call or a remote sandbox waits). The trainer sleeps
--train-s per step of B groups. One episode therefore takes

    t_episode = gen_s + (turns - 1) * turn_s + turns * latency

and the trainer bound, the most any schedule can train, is B / train_s groups per second.
At K = 0 (synchronous) a step costs t_episode + train_s; at K >= 1 the episodes of the next
steps run while the trainer trains, so the run approaches the trainer bound until K + 1
versions' worth of episodes in flight no longer cover the latency. Steady-state groups/s are
counted from the end of step --warmup-steps to the end of the last step.

Writes <out>/episode_latency_sim_<hardware>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import DEFAULT_OUT, hardware, hardware_tag, header, parse_list, run_async, table, write_json  # noqa: E402
from pipeline.config.io import load_config  # noqa: E402
from pipeline.envs import EnvStep  # noqa: E402
from pipeline.loop.orchestrator import Pipeline  # noqa: E402


class LatentEnv:
    """Waits `latency` s per step (off nothing: an await, as a remote tool's reply); done after `turns`."""

    def __init__(self, latency: float, turns: int) -> None:
        self.latency, self.turns, self.t = latency, turns, 0

    async def reset(self, row: dict[str, Any]) -> str:
        return f"task {row['id']}:"

    async def step(self, action: str) -> EnvStep:
        self.t += 1
        if self.latency:
            await asyncio.sleep(self.latency)
        return EnvStep(observation=" tool says 42 ", reward=float(self.t == self.turns), done=self.t >= self.turns)


async def one_run(args: argparse.Namespace, latency: float, K: int, out: Path) -> dict[str, Any]:
    cfg = load_config(None, {
        "out": str(out), "engine.kind": "simulated", "trainer.kind": "simulated", "log.progress": False,
        "log.level": "warning", "pipeline.steps": args.steps, "pipeline.batch_groups": args.batch,
        "pipeline.max_staleness": K, "pipeline.checkpoint_every": 0, "sampling.n": args.n,
        "sampling.max_new_tokens": 8, "engine.simulated.completion_tokens": 8,
        "engine.simulated.latency_s": args.gen_s, "engine.simulated.turn_latency_s": args.turn_s,
        "trainer.step_s": args.train_s, "env.max_turns": args.turns,
    })
    rows = [{"id": str(i)} for i in range(args.steps * args.batch * 2)]
    p = Pipeline(cfg, prompts=rows, environment=lambda: LatentEnv(latency, args.turns), console=False)
    ends: list[float] = []
    async for _ in p.steps():
        ends.append(time.monotonic())
    w = min(args.warmup_steps, len(ends) - 2)
    groups_per_s = (len(ends) - 1 - w) * args.batch / (ends[-1] - ends[w])
    return {"env_latency_s": latency, "K": K, "groups_per_s": groups_per_s,
            "staleness_max": p.summary["staleness_max"], "accounting_ok": p.summary["accounting_ok"],
            "env_steps": p.generator.episodes.env_steps, "turns": p.generator.episodes.turns}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--latencies", default="0,0.05,0.2", help="environment step latencies, seconds")
    ap.add_argument("--ks", default="0,1,2", help="max_staleness values")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--n", type=int, default=4, help="episodes per group")
    ap.add_argument("--batch", type=int, default=4, help="groups per step (B)")
    ap.add_argument("--gen-s", type=float, default=0.05, help="seconds for a group's first turn")
    ap.add_argument("--turn-s", type=float, default=0.02, help="seconds for a later turn")
    ap.add_argument("--train-s", type=float, default=0.3, help="seconds per training step")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="6 steps, 1 warm-up")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--scratch", default="runs/bench_episode_latency")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup_steps = 6, 1
    result = {**header("episode_latency", argv), "hardware": hardware(gpus=False), "settings": vars(args), "runs": []}
    bound = args.batch / args.train_s
    rows = []
    for latency in parse_list(args.latencies, float):
        t_episode = args.gen_s + (args.turns - 1) * args.turn_s + args.turns * latency
        base = None
        for K in parse_list(args.ks, int):
            out = Path(args.scratch) / f"lat{latency}_K{K}_{time.time_ns()}"
            r = run_async(one_run(args, latency, K, out))
            base = base or r["groups_per_s"]
            r.update(t_episode_s=t_episode, of_bound=r["groups_per_s"] / bound, speedup_vs_K0=r["groups_per_s"] / base)
            result["runs"].append(r)
            rows.append([f"{latency * 1000:.0f}", K, f"{t_episode:.2f}", f"{r['groups_per_s']:.2f}", f"{bound:.2f}",
                         f"{r['of_bound']:.2f}", f"{r['speedup_vs_K0']:.2f}", r["staleness_max"], r["accounting_ok"]])
    print(table(["env ms", "K", "t_episode s", "groups/s", "bound", "of bound", "vs K=0", "stale max", "ok"], rows))
    path = write_json(Path(args.out) / f"episode_latency_sim_{hardware_tag(result['hardware'])}.json", result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
