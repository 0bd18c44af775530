"""Logging set-up: structlog events as JSON lines in the run directory, readable lines on the console.

Configured once per run by the orchestrator (`configure_logging`), undone by `close_logging`.
Every module logs with `structlog.get_logger(__name__)` and snake_case event names with fields
(`adapter_published version=7 seconds=0.041`); `policy_version` and `engine` are bound through
contextvars where they apply. The file gets info and up (debug too when `level` is debug);
the console gets `level` and up, written through tqdm so a progress bar is not torn. Debug
events are per step or per version (publishes, loads, flushes): writing each to the file is a
cost the overhead benchmark sees every step, and metrics.jsonl has their figures anyway; a
debug call below the loggers' level is dropped before any processor runs.

The trainer's child process (pipeline/trainer/process.py) logs at the same floor; its events,
rendered and tagged `process="trainer"` and `pid` there, come back through a pipe and are handed
to these same handlers (through the `pipeline.trainer.log_shipping` logger) with their own timestamps,
so events.jsonl and the console hold both processes' events under one level filter.

Tracebacks are text in events.jsonl (an `exception` field, as the trainer's process writes them).
`run_failed`, the error that ended a run with its traceback, goes to the file only: run.py says it
on stderr in one line, and a caller embedding the pipeline gets the exception itself.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import structlog

_HANDLERS: list[logging.Handler] = []
_LOGGER_NAMES = ("pipeline", "benchmarks", "__main__", "run")
FILE_ONLY_EVENTS = frozenset({"run_failed"})  # events.jsonl only, never the console


class _NotOnConsole(logging.Filter):
    """Drops the events of FILE_ONLY_EVENTS (a structlog event reaches a handler as the record's msg dict)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, dict) and record.msg.get("event") in FILE_ONLY_EVENTS)


class _TqdmHandler(logging.StreamHandler):
    """Writes console lines through tqdm when it is installed, so progress bars stay intact."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = self.format(record)
            try:
                from tqdm import tqdm

                tqdm.write(msg, file=self.stream)
            except ImportError:
                self.stream.write(msg + "\n")
            self.flush()
        except Exception:  # logging must never take the run down
            self.handleError(record)


class _EventsFile(logging.FileHandler):
    """events.jsonl. A write that fails (a full disk) is said once on stderr, in one line, instead of
    logging's traceback per event; the run's own error reaches the console and the caller anyway."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:
        if not self.failed:
            self.failed = True
            error = sys.exc_info()[1]
            what = getattr(error, "strerror", None) or repr(error)
            sys.stderr.write(f"warning: {self.baseFilename} cannot be written ({what}); "
                             "events from here on are on the console only\n")


def _shared_processors() -> list:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]


def configure_logging(run_dir: str | Path | None = None, level: str = "info", console: bool = True) -> None:
    """Route structlog through stdlib logging to events.jsonl (info+, or debug+) and stderr (`level`+)."""
    close_logging()
    floor = logging.DEBUG if level.lower() == "debug" else logging.INFO
    structlog.configure(
        processors=[structlog.stdlib.filter_by_level] + _shared_processors() + [structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    if console:
        h = _TqdmHandler(sys.stderr)
        h.setLevel(getattr(logging, level.upper()))
        h.addFilter(_NotOnConsole())
        h.setFormatter(structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                        structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())],
            foreign_pre_chain=_shared_processors()))
        _HANDLERS.append(h)
    if run_dir is not None:
        f = _EventsFile(Path(run_dir) / "events.jsonl", encoding="utf-8")
        f.setLevel(floor)
        f.setFormatter(structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                        structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
            foreign_pre_chain=_shared_processors()))
        _HANDLERS.append(f)
    for name in _LOGGER_NAMES:
        lg = logging.getLogger(name)
        lg.setLevel(floor)
        lg.propagate = False
        for h in _HANDLERS:
            lg.addHandler(h)


def close_logging() -> None:
    """Flush and detach the handlers installed by configure_logging."""
    structlog.contextvars.clear_contextvars()
    for name in _LOGGER_NAMES:
        lg = logging.getLogger(name)
        for h in _HANDLERS:
            lg.removeHandler(h)
    for h in _HANDLERS:
        try:
            h.flush()
            h.close()
        except OSError:  # events.jsonl on a full disk, said once already: closing must not hide the run's own error
            pass
    _HANDLERS.clear()
