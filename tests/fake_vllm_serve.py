"""A stand-in for the `vllm serve` process (its start, health and end, not its API), for test_vllm_serve.py.

Run as `python fake_vllm_serve.py MODEL --port P [vLLM's flags, ignored] [knobs]`. It first prints
one JSON line: its arguments and the environment variables the launcher sets. Then it answers
GET /health with 200 on 127.0.0.1:P until it is killed. Knobs:
  --fake-delay S      listen only after S seconds (a server still loading its model)
  --fake-exit CODE    print an error and exit with CODE instead (a bad flag, a GPU out of memory)
  --fake-ignore-term  ignore SIGTERM (a server stuck in its shutdown)
  --fake-child        first start a child that ignores SIGTERM (an engine core stuck in shutdown)
                      and print {"child": pid}
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import signal
import subprocess
import sys
import time

CHILD = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:  # quiet: the log holds what the tests read
        pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--fake-delay", type=float, default=0.0)
    p.add_argument("--fake-exit", type=int)
    p.add_argument("--fake-ignore-term", action="store_true")
    p.add_argument("--fake-child", action="store_true")
    a, _ = p.parse_known_args()
    keys = ("CUDA_VISIBLE_DEVICES", "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "PYTHONUNBUFFERED")
    env = {k: os.environ.get(k) for k in keys}
    print(json.dumps({"argv": sys.argv[1:], "env": env}), flush=True)
    if a.fake_ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if a.fake_child:
        child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"  # SIGTERM is ignored now
        print(json.dumps({"child": child.pid}), flush=True)
    if a.fake_exit is not None:
        print("ValueError: fake vllm serve was told to fail", flush=True)
        sys.exit(a.fake_exit)
    time.sleep(a.fake_delay)
    http.server.HTTPServer((a.host, a.port), Health).serve_forever()


if __name__ == "__main__":
    main()
