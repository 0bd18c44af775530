"""The parent of a launched `vllm serve`: ends the server's whole process group when its owner dies.

Run as `python serve_guard.py OWNER_PID -- COMMAND...` (by pipeline.engines.vllm_launch, as the
leader of a new process group, with the kernel told to send it SIGUSR1 when the thread that
started it ends: PR_SET_PDEATHSIG). It starts COMMAND in its group and waits for it.

Invariants:
- Its owner gone (SIGUSR1, or a parent other than OWNER_PID once the handler is in place), it
  SIGKILLs its group: the server and every process the server started (vLLM's engine core), which
  the death signal alone would leave running.
- A SIGTERM to the group (the launcher's stop) reaches the server itself; the guard waits for the
  server to end, then ends the way it did (its exit code, or the same signal), so the launcher
  reads the server's own end.
- Standard library only, and nothing of the pipeline imported: it starts in tens of milliseconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def _kill_group(*_: object) -> None:
    os.killpg(0, signal.SIGKILL)  # this process included


def main(argv: list[str]) -> None:
    owner, sep, command = argv[0], argv[1], argv[2:]
    if sep != "--" or not command:
        sys.exit("usage: serve_guard.py OWNER_PID -- COMMAND...")
    signal.signal(signal.SIGUSR1, _kill_group)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the server gets it too, and decides how it ends
    if os.getppid() != int(owner):  # the owner died before the handler was in place
        _kill_group()
    # the server takes the default SIGTERM back: ignored signals are inherited across exec
    server = subprocess.Popen(command, preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    code = server.wait()
    if code < 0:  # end by the same signal
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
