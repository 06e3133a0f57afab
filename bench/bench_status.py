"""Benchmark: ``status`` round-trip latency on the control socket while the daemon is busy.

Runs a real ``ControlServer`` in this process's event loop next to a CPU-bound task that
works in small chunks (like the daemon's own bookkeeping between awaits), and a client in
a separate process (so it does not share our GIL) that sends ``status`` N times, both on
one connection and with a new connection per request. Also times whole ``chandractl
status --json`` invocations (interpreter start-up included).

    .venv/bin/python bench/bench_status.py [--requests 200] [--chunk-ms 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from chandrad.control.handlers import Handlers
from chandrad.control.server import ControlServer

CLIENT = r"""
import json, sys, time
from pathlib import Path
from chandrad.ctl.client import ControlClient
path, n = Path(sys.argv[1]), int(sys.argv[2])
out = {"persistent": [], "reconnect": []}
with ControlClient(path) as c:
    c.request("status")
    for _ in range(n):
        t = time.perf_counter()
        c.request("status")
        out["persistent"].append(time.perf_counter() - t)
for _ in range(n):
    t = time.perf_counter()
    with ControlClient(path) as c:
        c.request("status")
    out["reconnect"].append(time.perf_counter() - t)
print(json.dumps(out))
"""


class BusyDaemon:
    """DaemonControl with a realistic status and no-op commands."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def status(self) -> dict[str, Any]:
        return {
            "daemon": {"state": "running", "pid": os.getpid(),
                       "uptime_s": time.monotonic() - self.started},
            "engine": {"state": "ready", "pid": 1234, "restarts": 0,
                       "profile": {"gpu_memory_utilization": 0.9, "max_num_seqs": 64},
                       "last_failure": None, "profile_changes": []},
            "queue": {"pending": 9000, "active": 64, "done": 1000, "failed": 3},
            "throughput": {"pages_per_min_1m": 800.0, "pages_per_min_15m": 790.0},
            "gpus": [{"index": i, "name": "NVIDIA H200", "memory_used_bytes": 120 << 30,
                      "memory_total_bytes": 140 << 30, "processes": []} for i in range(8)],
        }

    def queue(self, state: str | None = None, limit: int = 1000) -> list[dict[str, Any]]:
        return []

    def gpu(self) -> dict[str, Any]:
        return {"gpus": []}

    def version(self) -> dict[str, Any]:
        return {"daemon": "bench"}

    async def _ok(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {}

    pause = resume = drain = retry = cancel = reload = engine_restart = rescan = _ok


async def burn(chunk_s: float, stop: asyncio.Event) -> int:
    """Hog the loop in ``chunk_s`` slices of pure CPU, yielding between them."""
    chunks = 0
    while not stop.is_set():
        end = time.perf_counter() + chunk_s
        x = 0
        while time.perf_counter() < end:
            x += 1
        chunks += 1
        await asyncio.sleep(0)
    return chunks


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] * 1000


async def run(requests: int, chunk_ms: float) -> dict[str, Any]:
    sock = Path(tempfile.mkdtemp(prefix="chandrad-bench-")) / "control.sock"
    server = ControlServer(sock, Handlers(BusyDaemon()))  # type: ignore[arg-type]
    await server.start()
    report: dict[str, Any] = {"requests": requests, "chunk_ms": chunk_ms}
    try:
        for label, chunk in (("idle", 0.0), ("busy", chunk_ms / 1000)):
            stop = asyncio.Event()
            burner = asyncio.create_task(burn(chunk, stop)) if chunk else None
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", CLIENT, str(sock), str(requests),
                stdout=asyncio.subprocess.PIPE)
            out, _ = await proc.communicate()
            stop.set()
            if burner:
                await burner
            samples = json.loads(out)
            for mode, values in samples.items():
                report[f"{label}_{mode}"] = {"p50_ms": round(pct(values, 50), 3),
                                             "p99_ms": round(pct(values, 99), 3)}
        walls = []
        for _ in range(10):
            t = time.perf_counter()
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "chandrad.ctl.main", "--socket", str(sock), "status",
                "--json", stdout=asyncio.subprocess.DEVNULL)
            await proc.wait()
            walls.append(time.perf_counter() - t)
        report["chandractl_status_process_ms"] = {
            "median": round(statistics.median(walls) * 1000, 1),
            "max": round(max(walls) * 1000, 1)}
    finally:
        await server.close()
        sock.parent.rmdir()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--chunk-ms", type=float, default=5.0,
                        help="length of each CPU-bound slice of the busy task")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args.requests, args.chunk_ms)), indent=2))


if __name__ == "__main__":
    main()
