"""Log shipping from the trainer's process: the child's events, and its libraries' logs, into the parent's handlers.

The child's end is `log_to_parent` (structlog configured to end in an `EventShipper`); the
parent's end is `forward_events`, run in a thread of its own for as long as the child lives.
On the pipe, each event is its JSON prefixed by its length (_FRAME).

Invariants:
- The child's structlog events are the run's events: each is rendered to JSON in the child,
  tagged `process="trainer"` (a trainer rank > 0: "trainer-rank-N") and `pid`, and written to a
  pipe that a thread of the parent reads and hands to the parent's logging handlers, so they land
  in events.jsonl (and on the console) under the parent's level filtering, with the child's own
  timestamp. The child logs at the level it is given (the parent's `pipeline` loggers' level at setup).
- The child never waits on the pipe: what it cannot take at once waits in a bounded buffer
  (_PENDING_LIMIT), in order; events beyond that are dropped, counted and reported by a
  `trainer_log_events_dropped` warning once the buffer has drained.
- What reached the pipe survives the child's death (os._exit, SIGKILL): the parent's reader
  reads it all, after the child's sentinel is ready, before it returns. `EventShipper.flush`
  lets a stopping child wait for its buffer to drain.
- What libraries in the child (transformers, peft, torch) say through stdlib logging or Python
  warnings takes the same way, as `library_log` events, instead of the child's stderr, which
  nobody may be reading.
- One unreadable event is logged as `trainer_event_unreadable` and the forwarding goes on.
"""

from __future__ import annotations

import json
import logging
import os
import select
import struct
import threading
from multiprocessing.connection import Connection, wait
from typing import Any

import structlog

_FRAME = struct.Struct("!I")  # the length of one event's JSON, before it on the events pipe
# Bytes of events that may wait for a slow reader before new ones are dropped: a thousand
# tracebacks' worth, far more than a reader thread that is merely starved of the GIL falls behind.
_PENDING_LIMIT = 1 << 20
_FORWARD = logging.getLogger(__name__)  # the parent's logger that the child's events go out through
_STAMP = structlog.processors.TimeStamper(fmt="iso", utc=True)  # the parent's timestamps, in the child


def _jsonable(value: Any) -> Any:
    """json.dumps fallback: numbers from numpy and torch scalars, text for everything else."""
    if getattr(value, "shape", None) == () and hasattr(value, "item"):
        return value.item()
    return str(value)


class EventShipper:
    """The child's end of the events pipe: the last structlog processor, it never waits for the reader.

    An event goes straight into the pipe when the pipe has room and nothing is waiting; otherwise
    it waits in a bounded buffer that a thread writes out as the reader catches up, in order.
    Beyond `limit` bytes events are dropped and counted; once the buffer has drained, a warning
    says how many.
    """

    def __init__(self, conn: Connection, limit: int = _PENDING_LIMIT) -> None:
        self._conn = conn  # held so that its descriptor stays open
        self._fd = conn.fileno()
        os.set_blocking(self._fd, False)
        self.limit = limit
        self.tags = {"process": "trainer", "pid": os.getpid()}
        self.dropped = 0
        self._pending = bytearray()
        self._gone = False  # the reader closed its end: nothing more can be delivered
        self._cond = threading.Condition()
        threading.Thread(target=self._drain_loop, name="trainer-events", daemon=True).start()

    def __call__(self, logger: Any, method: str, event: dict) -> Any:
        event.update(self.tags)
        self.ship(event)
        raise structlog.DropEvent  # shipped: nothing left for the child's own logger to print

    def ship(self, event: dict) -> None:
        data = json.dumps(event, default=_jsonable).encode()
        frame = _FRAME.pack(len(data)) + data
        with self._cond:
            if self._gone:
                return
            if self._pending:  # behind what is waiting, to keep the order
                if len(self._pending) + len(frame) > self.limit:
                    self.dropped += 1
                    return
                self._pending += frame
                return
            # once part of a frame is in the pipe its rest must follow, whatever the bound
            self._pending += frame[self._write(frame):]
            if self._pending:
                self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until every event shipped so far is in the pipe (or the reader is gone); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._gone or not (self._pending or self.dropped), timeout)

    def _write(self, data: bytes | bytearray) -> int:
        """Write what the pipe takes now; the number of bytes written (all of them once the reader is gone)."""
        try:
            return os.write(self._fd, data)
        except BlockingIOError:  # the pipe is full: the caller keeps the bytes for later
            return 0
        except OSError:  # the reader closed its end (the parent is gone): nothing can be delivered
            self._gone = True
            self._pending.clear()
            self._cond.notify_all()
            return len(data)

    def _drain_loop(self) -> None:
        """Writes the buffer out as the pipe takes it, then the count of dropped events."""
        writable = select.poll()
        writable.register(self._fd, select.POLLOUT)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._gone)
                if self._gone:
                    self._cond.notify_all()
                    return
            # only this thread writes while the buffer is not empty, so waiting without the lock is safe
            writable.poll()
            with self._cond:
                del self._pending[:self._write(bytes(self._pending[:1 << 16]))]
                if not self._pending and self.dropped:
                    notice = {"event": "trainer_log_events_dropped", "dropped": self.dropped,
                              "limit_bytes": self.limit, "level": "warning", "logger": __name__,
                              "timestamp": _STAMP(None, "", {})["timestamp"],
                              **self.tags}
                    self.dropped = 0
                    data = json.dumps(notice).encode()
                    frame = _FRAME.pack(len(data)) + data
                    self._pending += frame[self._write(frame):]
                self._cond.notify_all()


def log_to_parent(conn: Connection, floor: int) -> EventShipper:
    """Configure the child's structlog: events at `floor` and up go, rendered, into the events pipe."""
    shipper = EventShipper(conn)

    class _Named:  # what add_logger_name reads; the shipper ends the chain, so nothing is written to it
        def __init__(self, name: str = "pipeline") -> None:
            self.name = name

    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.stdlib.add_logger_name,
                    structlog.stdlib.add_log_level, _STAMP,
                    structlog.processors.format_exc_info, shipper],
        wrapper_class=structlog.make_filtering_bound_logger(floor),
        logger_factory=_Named,
        cache_logger_on_first_use=False,
    )
    # What libraries say through stdlib logging (transformers, peft, torch) and Python warnings
    # takes the same way, instead of the child's stderr, which nobody may be reading.
    root = logging.getLogger()
    root.handlers[:] = [_LibraryLogs()]
    root.setLevel(floor)
    logging.captureWarnings(True)
    return shipper


class _LibraryLogs(logging.Handler):
    """A stdlib logging record as a structlog event `library_log` (source: the library's logger)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            structlog.get_logger(record.name).log(record.levelno, "library_log", source=record.name,
                                                  message=record.getMessage(), exc_info=record.exc_info or False)
        except Exception:  # a record that cannot be formatted: stdlib's own report, never the caller's error
            self.handleError(record)


def forward_events(conn: Connection, proc: Any) -> None:
    """The parent's end: hands the child's events to this process's logging until the child is gone.

    Runs in its own thread, so the event loop never reads the pipe or writes events.jsonl for it.
    After the child's death (`proc.sentinel` ready) it reads what is left in the pipe, closes it and
    returns. It owns `conn` and holds `proc`, so that neither is closed under it while it lags.
    """
    with conn:
        _forward(conn.fileno(), proc.sentinel)


def _forward(fd: int, sentinel: int) -> None:
    os.set_blocking(fd, False)
    buf = bytearray()
    while True:
        ready = wait([fd, sentinel])
        eof = False
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:  # nothing more for now
                break
            if not chunk:
                eof = True
                break
            buf += chunk
        while len(buf) >= _FRAME.size:
            (n,) = _FRAME.unpack_from(buf)
            if len(buf) < _FRAME.size + n:
                break
            _emit(bytes(buf[_FRAME.size:_FRAME.size + n]))
            del buf[:_FRAME.size + n]
        if eof or sentinel in ready:
            return


def _emit(data: bytes) -> None:
    """One event from the child into the parent's handlers, filtered like the parent's own."""
    try:
        event = json.loads(data)
        level = logging.getLevelName(str(event.get("level", "info")).upper())
        level = level if isinstance(level, int) else logging.WARNING
        if not _FORWARD.isEnabledFor(level):
            return
        record = _FORWARD.makeRecord(_FORWARD.name, level, "(trainer process)", 0, event, (), None)
        # ProcessorFormatter formats a record carrying these as a structlog event dict, as it is
        record._logger, record._name = _FORWARD, logging.getLevelName(level).lower()
        _FORWARD.handle(record)
    except Exception:  # one unreadable event must not stop the forwarding of the rest
        _FORWARD.error("trainer_event_unreadable %r", data[:200], exc_info=True)
