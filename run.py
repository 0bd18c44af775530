"""Run asynchronous GRPO end to end.

    python run.py                                  # the CPU default: examples/cpu_default.toml
    python run.py --config examples/two_gpus.toml  # real runs: a TOML file describes them
    python run.py --steps 50 --max-staleness 2 --set trainer.lr=0 --out runs/control
    python run.py --resume runs/control --steps 80 # continue a stopped run, or extend a finished one

Every knob lives in the TOML file (see docs/configuration.md); the flags above override
the few you change most, and `--set section.key=value` overrides any other. The resolved config
is written to <out>/config.toml, so `python run.py --config <out>/config.toml` repeats a run.

SIGINT or SIGTERM (Ctrl-C, a scheduler's preemption) writes a checkpoint and stops the run; a
second one stops it at once. `--resume DIR` continues the run in DIR from its newest checkpoint,
with DIR/config.toml and any --steps, --max-staleness and --set given now (not with --config
or --out: the run stays in DIR); with other prompts or reward functions than its checkpoint's it
is refused, unless --force-resume.

Exit codes: 0 done; 1 the run failed (the traceback is in <out>/events.jsonl); 2 bad
configuration or flags (one line starting with "error:" on stderr, naming the field or file);
130 stopped by a signal (continue with --resume).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import NoReturn

# Idle OpenMP threads sleep instead of spinning: engine and trainer share the CPU cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# what a run without --config is: the tiny model warm-started on addition, trained on the CPU
DEFAULT_CONFIG = Path(__file__).resolve().parent / "examples" / "cpu_default.toml"
SUMMARY_KEYS = ("run_dir", "steps", "wall_s", "reward_first_window", "reward_final_window", "eval_first",
                "eval_final", "groups_trained", "groups_dropped", "groups_failed", "staleness_max", "accounting_ok")


def _error_line(message: str) -> str:
    # one line, whatever the message: a caller greps stderr for "error:"
    return "error: " + " ".join(str(message).split())


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, no usage dump
        print(_error_line(f"{message} (see python run.py --help)"), file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    title, examples, rest = __doc__.split("\n\n", 2)
    p = _Parser(description=f"{title}\n\n{examples}", formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog=rest)
    p.add_argument("--config", metavar="FILE.toml",
                   help="run configuration (default: examples/cpu_default.toml, the CPU demo)")
    p.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its newest checkpoint")
    p.add_argument("--force-resume", action="store_true",
                   help="with --resume: continue even with other prompts or reward functions than the checkpoint's")
    p.add_argument("--steps", type=int, metavar="N", help="training steps (pipeline.steps)")
    p.add_argument("--max-staleness", type=int, metavar="K", help="staleness bound (pipeline.max_staleness)")
    p.add_argument("--out", metavar="DIR", help="run directory (default runs/<timestamp>)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set trainer.lr=0 (repeatable)")
    return p.parse_args(argv)


def _resume_config_file(run_dir: str) -> Path:
    """DIR/config.toml of the run to continue; a ConfigError naming what is missing."""
    from pipeline.errors import ConfigError

    if not os.path.isdir(run_dir):
        raise ConfigError(f"--resume: run directory {run_dir!r} does not exist")
    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        raise ConfigError(f"--resume: {str(path)!r} does not exist; is {run_dir!r} a run directory?")
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pipeline.config.io import load_config, parse_override
    from pipeline.errors import ConfigError
    from pipeline.loop.preflight import preflight

    try:
        if args.resume is not None and args.config is not None:
            raise ConfigError("--resume continues with DIR/config.toml; it cannot be combined with --config")
        if args.resume is not None and args.out is not None:
            raise ConfigError("--resume continues the run in its own directory; it cannot be combined with --out")
        if args.force_resume and args.resume is None:
            raise ConfigError("--force-resume only applies with --resume DIR")
        # typed values, not TOML text, so any --out path and any number reach the config as given
        overrides = {".".join(key): value for key, value in map(parse_override, args.set)}
        if args.steps is not None:
            overrides["pipeline.steps"] = args.steps
        if args.max_staleness is not None:
            overrides["pipeline.max_staleness"] = args.max_staleness
        if args.resume is not None:
            overrides["out"] = args.resume
            cfg = load_config(_resume_config_file(args.resume), overrides)
        else:
            if args.out is not None:
                overrides["out"] = args.out
            cfg = load_config(args.config or DEFAULT_CONFIG, overrides)
        preflight(cfg)  # the paths, packages and devices it names, before the run directory is made
    except ConfigError as e:
        print(_error_line(str(e)), file=sys.stderr)
        return 2

    from pipeline.loop.orchestrator import Pipeline

    try:
        pipeline = Pipeline(cfg, resume=args.resume is not None, force_resume=args.force_resume,
                            handle_signals=True)
    except ConfigError as e:
        print(_error_line(str(e)), file=sys.stderr)
        return 2
    try:
        summary = pipeline.run_sync()
    except KeyboardInterrupt:
        print(f"interrupted; what was produced is in {pipeline.run_dir}", file=sys.stderr)
        return 130
    except ConfigError as e:
        print(_error_line(str(e)), file=sys.stderr)
        return 2
    except Exception as e:  # the run's own error, said in one line; the traceback is in events.jsonl
        print(_error_line(f"the run failed: {type(e).__name__}: {e} (details: {pipeline.run_dir}/events.jsonl)"),
              file=sys.stderr)
        return 1
    stopped_by = summary.get("stopped_by")
    if stopped_by in signal.Signals.__members__:
        print(f"stopped by {stopped_by} after checkpoint at step {summary.get('checkpoint_step')}; "
              f"continue with: python run.py --resume {shlex.quote(str(pipeline.run_dir))}", file=sys.stderr)
        return 130
    shown = {k: summary.get(k) for k in SUMMARY_KEYS}
    for k in ("eval_first", "eval_final"):  # the held-out accuracy, not every eval/* figure of the round
        if shown[k]:
            shown[k] = {key: shown[k][key] for key in ("step", "eval/pass@1", "eval/reward_mean") if key in shown[k]}
    print(json.dumps(shown, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
