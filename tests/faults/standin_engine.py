"""A stand-in engine *process* for the fault suite: what vLLM looks like from outside.

chandrad starts it through ``engine.command`` exactly as it would start vLLM (own session,
the same flags), reads its stdout/stderr, probes ``/health`` and ``/v1/models`` and posts
``/v1/chat/completions``. It prints vLLM's real start-up and access-log lines, serves those
endpoints and ``/metrics``, and answers each page with a short Chandra-layout HTML naming
the sha256 of the image it was sent, so a test can tell which page a result came from.

Its behaviour for this start is read from the JSON file named by ``$STANDIN_CONTROL`` (read
once at start, so a test can change what the *next* generation does without a reload):

* ``mode``: ``serve`` (default); ``never_ready`` (prints the loading lines, never listens);
  ``term_crash`` (serves, but dies with SIGSEGV-like exit 139 on SIGTERM, mid-shutdown);
  ``term_ignore`` (serves, ignores SIGTERM: only SIGKILL ends it).
* ``startup_s``: seconds of "loading" before it listens (default 0.5).
* ``delay_s``: seconds each chat request takes (default 0.2).

Every completed request appends ``<unix time> <image sha256> <pid>`` to ``$STANDIN_LOG``.
This is vLLM as seen at the process boundary, not a mock of chandrad's code.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

VERSION = "0.32.0"


def _log(level: str, where: str, message: str) -> None:
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"(APIServer pid={os.getpid()}) {level} {stamp} [{where}] {message}", flush=True)


def _control() -> dict[str, Any]:
    path = os.environ.get("STANDIN_CONTROL", "")
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            data: dict[str, Any] = json.load(fh)
            return data
    return {}


class Handler(BaseHTTPRequestHandler):
    """The four endpoints chandrad uses, with uvicorn's access-log line per request."""

    server_version = "uvicorn"
    model = "chandra"
    delay_s = 0.2
    running = 0
    lock = threading.Lock()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
        return

    def _send(self, code: int, body: dict[str, Any] | str, ctype: str = "application/json") -> None:
        data = (json.dumps(body) if isinstance(body, dict) else body).encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        print(f'INFO:     {self.client_address[0]}:{self.client_address[1]} - '
              f'"{self.command} {self.path} HTTP/1.1" {code} OK', flush=True)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path == "/health":
            self._send(200, "", "text/plain")
        elif self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": self.model, "object": "model"}]})
        elif self.path == "/metrics":
            with Handler.lock:
                running = Handler.running
            self._send(200, f"vllm:num_requests_running{{model_name=\"{self.model}\"}} "
                       f"{running}.0\nvllm:num_requests_waiting{{model_name=\"{self.model}\"}}"
                       " 0.0\n", "text/plain")
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        length = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(length))
        if self.path != "/v1/chat/completions":
            self._send(404, {"detail": "Not Found"})
            return
        url = body["messages"][0]["content"][0]["image_url"]["url"]
        digest = hashlib.sha256(base64.b64decode(url.split(",", 1)[1])).hexdigest()
        with Handler.lock:
            Handler.running += 1
        try:
            time.sleep(self.delay_s)
        finally:
            with Handler.lock:
                Handler.running -= 1
        html = (f'<div data-bbox="10 10 500 60" data-label="Text"><p>stand-in page '
                f"{digest[:16]}</p></div>")
        self._send(200, {
            "id": f"chatcmpl-{digest[:8]}", "object": "chat.completion", "model": self.model,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": html}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        })
        log = os.environ.get("STANDIN_LOG")
        if log:
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, f"{time.time():.3f} {digest} {os.getpid()}\n".encode())
            finally:
                os.close(fd)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--model", default="")
    parser.add_argument("--served-model-name", default="chandra")
    args, _unknown = parser.parse_known_args()
    control = _control()
    mode = str(control.get("mode", "serve"))
    _log("INFO", "api_utils.py:347", f"version {VERSION}  model   {args.model}")
    _log("INFO", "api_utils.py:286", f"non-default args: {{'port': {args.port}, "
         f"'model': '{args.model}', 'served_model_name': ['{args.served_model_name}']}}")
    _log("INFO", "model.py:733", "Resolved architecture: Idefics3ForConditionalGeneration")
    time.sleep(float(control.get("startup_s", 0.5)))
    if mode == "never_ready":
        _log("INFO", "default_loader.py:291", "Loading weights took 0.02 seconds")
        while True:  # a load that never finishes: only startup_timeout ends it
            time.sleep(3600)
    if mode == "term_crash":
        def crash(signum: int, frame: Any) -> None:
            print("Fatal Python error: Segmentation fault", file=sys.stderr, flush=True)
            os._exit(139)
        signal.signal(signal.SIGTERM, crash)
    elif mode == "term_ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Handler.model = args.served_model_name
    Handler.delay_s = float(control.get("delay_s", 0.2))
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    _log("INFO", "api_server.py:1890", f"Starting vLLM API server 0 on http://{args.host}:"
         f"{args.port}")
    print(f"INFO:     Started server process [{os.getpid()}]", flush=True)
    print("INFO:     Waiting for application startup.", flush=True)
    print("INFO:     Application startup complete.", flush=True)
    if mode == "serve":
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        print("INFO:     Shutting down", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
