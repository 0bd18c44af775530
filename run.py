"""Run asynchronous GRPO end to end.

    python run.py                                  # the CPU default: tiny model, built-in task
    python run.py --config examples/two_gpus.toml  # real runs: a TOML file describes them
    python run.py --steps 50 --max-staleness 2 --set trainer.lr=0 --out runs/control

Every knob lives in the TOML file (see README's config reference); the flags below override
the few you change most, and `--set section.key=value` overrides any other. The resolved config
is written to <out>/config.toml, so `python run.py --config <out>/config.toml` repeats a run.
Exit codes: 0 done, 1 the run failed, 2 bad configuration or flags, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# Idle OpenMP threads sleep instead of spinning: engine and trainer share the CPU cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, no usage dump
        print(f"error: {message} (see python run.py --help)", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--config", metavar="FILE.toml", help="run configuration (default: built-in CPU defaults)")
    p.add_argument("--steps", type=int, metavar="N", help="training steps (pipeline.steps)")
    p.add_argument("--max-staleness", type=int, metavar="K", help="staleness bound (pipeline.max_staleness)")
    p.add_argument("--out", metavar="DIR", help="run directory (default runs/<timestamp>)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set trainer.lr=0 (repeatable)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pipeline.config import load_config
    from pipeline.errors import ConfigError

    overrides = list(args.set)
    if args.steps is not None:
        overrides.append(f"pipeline.steps={args.steps}")
    if args.max_staleness is not None:
        overrides.append(f"pipeline.max_staleness={args.max_staleness}")
    if args.out is not None:
        overrides.append(f"out={json.dumps(args.out)}")
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from pipeline.orchestrator import Pipeline

    pipeline = Pipeline(cfg)
    try:
        summary = pipeline.run_sync()
    except KeyboardInterrupt:
        print(f"interrupted; what was produced is in {pipeline.run_dir}", file=sys.stderr)
        return 130
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the run's own error, said in one line; the traceback is in events.jsonl
        print(f"error: the run failed: {type(e).__name__}: {e} (details: {pipeline.run_dir}/events.jsonl)",
              file=sys.stderr)
        return 1
    print(json.dumps({k: summary[k] for k in ("run_dir", "steps", "wall_s", "reward_first_window",
                                              "reward_final_window", "groups_trained", "groups_dropped",
                                              "groups_failed", "staleness_max", "accounting_ok")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
