"""The run report (report.png): the reward curve with the eval rounds' (every session's), the
staleness histogram, and the generator/trainer busy timeline of this session (earlier sessions'
spans are not kept)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence


def write_report(run_dir: str | Path, rows: Sequence[dict[str, Any]], timeline: dict[str, list[tuple[float, float]]],
                 t0: float, eval_rows: Sequence[dict[str, Any]] = ()) -> Path | None:
    """Plot what a run did; returns the PNG path (None when there is nothing to plot)."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    steps = [r["step"] for r in rows]
    ax = axes[0]
    ax.plot(steps, [r["reward_mean"] for r in rows], lw=1, alpha=0.5, label="batch mean")
    k = max(1, len(rows) // 20)
    smooth = [sum(r["reward_mean"] for r in rows[max(0, i - k + 1): i + 1]) / len(rows[max(0, i - k + 1): i + 1])
              for i in range(len(rows))]
    ax.plot(steps, smooth, lw=2, label=f"moving mean ({k} steps)")
    if eval_rows:  # held-out rounds: their reward and, where a pass threshold applies, pass@1
        ax.plot([r["step"] for r in eval_rows], [r.get("eval/reward_mean") for r in eval_rows], "o-", lw=1.5,
                label="eval reward (held out)")
        if any("eval/pass@1" in r for r in eval_rows):
            ax.plot([r["step"] for r in eval_rows], [r.get("eval/pass@1") for r in eval_rows], "s--", lw=1,
                    label="eval pass@1")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title("reward")
    ax.legend()

    ax = axes[1]
    stal = [r["staleness_max"] for r in rows]
    ax.hist([r["staleness_mean"] for r in rows], bins=20, alpha=0.7, label="per-step mean")
    ax.axvline(max(stal), color="k", ls="--", label=f"max {max(stal)}")
    ax.set_xlabel("staleness (versions)")
    ax.set_ylabel("steps")
    ax.set_title("staleness at consumption")
    ax.legend()

    ax = axes[2]
    for y, (name, spans) in enumerate([("generation", timeline.get("generation", [])),
                                       ("training", timeline.get("training", []))]):
        bars = [(a - t0, max(b - a, 1e-4)) for a, b in spans[-5000:]]
        ax.broken_barh(bars, (y - 0.4, 0.8), alpha=0.35 if name == "generation" else 0.8)
    ax.set_yticks([0, 1], ["generation\n(each group)", "training\n(step + publish)"])
    ax.set_xlabel("seconds since start")
    ax.set_title("busy timeline (this session: a resumed run's earlier sessions are not kept)")
    fig.tight_layout()
    out = Path(run_dir) / "report.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
