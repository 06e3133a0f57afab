"""A stand-in for the engine's interpreter, at the process boundary (no vLLM, no GPU here).

Used as ``engine.python`` through a small wrapper script the tests write
(:func:`write_standin`): ``<wrapper> -m vllm.entrypoints.openai.api_server FLAGS`` plays
the engine: it prints vLLM's real log lines, fails the way vLLM fails on a GPU that
is too small (the exact messages of vLLM 0.32, see tests/fixtures/classify/cases.jsonl),
or serves ``/health``, ``/v1/models`` and ``/metrics`` on its port.
``<wrapper> -m chandrad check-flags`` plays the flag-check child (a verdict, a crash,
a kill or a slow answer); anything else (``-c CODE``) runs the real interpreter.

Several replicas share one scenario; ``per_port`` gives the one on a port its own
behaviour. The scenario is a JSON file beside the wrapper; what happened is appended to
``events.jsonl`` in the same folder, so a test can read the sequence of spawns.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
TOTAL_GIB = 79.19


def write_standin(folder: Path, scenario: dict[str, Any]) -> Path:
    """Write the scenario and an executable wrapper in ``folder``; returns the wrapper."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "scenario.json").write_text(json.dumps(scenario))
    wrapper = folder / "python"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} "
                       f"{folder / 'scenario.json'} \"$@\"\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return wrapper


def events(folder: Path) -> list[dict[str, Any]]:
    """What the stand-in recorded so far, oldest first."""
    path = folder / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _record(folder: Path, **event: Any) -> None:
    with (folder / "events.jsonl").open("a") as fh:
        fh.write(json.dumps(event) + "\n")


def _next_behaviour(folder: Path, name: str, plan: list[str]) -> str:
    """The next entry of ``plan`` (the last one repeats), counted in a file."""
    counter = folder / f"{name}.count"
    n = int(counter.read_text()) if counter.exists() else 0
    counter.write_text(str(n + 1))
    return plan[min(n, len(plan) - 1)] if plan else "ok"


def check_flags(folder: Path, scenario: dict[str, Any]) -> int:
    flags = json.loads(sys.stdin.read())
    behaviour = _next_behaviour(folder, "check_flags", scenario.get("check_flags", ["ok"]))
    _record(folder, what="check_flags", behaviour=behaviour, pid=os.getpid())
    if behaviour.startswith("sleep:"):
        time.sleep(float(behaviour.split(":", 1)[1]))
        behaviour = "ok"
    if behaviour == "ok":
        print("[]")
        return 0
    if behaviour == "bad_flag":
        bad = next((f for f in flags if f.startswith("--no-such")), flags[-1])
        print(json.dumps([{"key": "engine.extra_args", "code": "engine_flag_invalid",
                           "message": f"{bad} is not an option of the installed vLLM 0.32.0"}]))
        return 0
    if behaviour == "import_error":
        print("Traceback (most recent call last):\n  File \"<frozen runpy>\", line 198\n"
              "ModuleNotFoundError: No module named 'vllm'", file=sys.stderr)
        return 1
    if behaviour == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    raise SystemExit(f"unknown check_flags behaviour {behaviour!r}")


def _flag(argv: list[str], name: str, default: str | None = None) -> str | None:
    for i, token in enumerate(argv):
        if token == name and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith(name + "="):
            return token.split("=", 1)[1]
    return default


def _log(level: str, text: str, who: str = "APIServer") -> None:
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"({who} pid={os.getpid()}) {level} {stamp} [api_server.py:1] {text}", flush=True)


class _Handler(BaseHTTPRequestHandler):
    served = "chandra"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/health":
            self._send(200, b"", "text/plain")
        elif self.path == "/v1/models":
            body = json.dumps({"object": "list", "data": [{"id": self.served,
                                                           "object": "model"}]})
            self._send(200, body.encode(), "application/json")
        elif self.path == "/metrics":
            self._send(200, b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n",
                       "text/plain")
        else:
            self._send(404, b"{}", "application/json")

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        return


def serve(folder: Path, scenario: dict[str, Any], argv: list[str]) -> int:
    port = int(_flag(argv, "--port", "8000") or 8000)
    # One scenario file for several replicas: "per_port" overrides what the engine on that
    # port does (replica i listens on engine.port + i).
    scenario = {**scenario, **scenario.get("per_port", {}).get(str(port), {})}
    host = _flag(argv, "--host", "127.0.0.1") or "127.0.0.1"
    util = float(_flag(argv, "--gpu-memory-utilization", "0.9") or 0.9)
    eager = "--enforce-eager" in argv
    _record(folder, what="spawn", pid=os.getpid(), util=util, eager=eager, argv=argv,
            sid=os.getsid(0), t=time.monotonic(), port=port,
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            cpus=sorted(os.sched_getaffinity(0)))
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    _log("INFO", "vLLM API server version 0.32.0")
    if scenario.get("setsid_grandchild"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 start_new_session=True)
        _record(folder, what="grandchild", pid=child.pid)
    free = scenario.get("free_fraction")
    if free is not None and util > float(free):
        free_gib = round(float(free) * TOTAL_GIB, 2)
        _log("ERROR", f"ValueError: Free memory on device cuda:0 ({free_gib:.2f}/{TOTAL_GIB} "
             f"GiB) on startup is less than the engine's budget after excluding external "
             f"process's weights ({util}, {util * TOTAL_GIB:.2f} GiB). Decrease GPU memory "
             "utilization or reduce GPU memory used by other processes.", "EngineCore_DP0")
        return 1
    if scenario.get("kv_needs_eager") and not eager:
        _log("ERROR", "ValueError: No available memory for the cache blocks. Try increasing "
             "`gpu_memory_utilization` when initializing the engine (this flag also controls "
             "CPU memory reservation on the CPU backend, despite its name). See "
             "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more "
             "details.", "EngineCore_DP0")
        _log("ERROR", "EngineCore failed to start.", "EngineCore_DP0")
        return 1
    time.sleep(float(scenario.get("listen_delay", 0)))
    _Handler.served = _flag(argv, "--served-model-name", "chandra") or "chandra"
    try:
        server = ThreadingHTTPServer((host, port), _Handler)
    except OSError as exc:
        _log("ERROR", f"OSError: [Errno {exc.errno}] {exc.strerror}")
        return 1
    server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    _log("INFO", f"Starting vLLM server on http://{host}:{port}")
    print("INFO:     Application startup complete.", flush=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    while True:
        time.sleep(3600)


def main() -> int:
    scenario_path = Path(sys.argv[1])
    args = sys.argv[2:]
    scenario: dict[str, Any] = json.loads(scenario_path.read_text())
    folder = scenario_path.parent
    if args[:3] == ["-m", "chandrad", "check-flags"]:
        return check_flags(folder, scenario)
    if args[:2] == ["-m", API_SERVER_MODULE]:
        return serve(folder, scenario, args[2:])
    os.execv(sys.executable, [sys.executable, *args])
    return 127  # pragma: no cover - execv does not return


if __name__ == "__main__":
    sys.exit(main())
