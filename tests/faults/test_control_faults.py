"""Control-socket faults: a flood of connections, silent clients, a 200 MB line, deaf clients.

The server is the real ``ControlServer`` (``control_harness.ServerThread`` with its
recording daemon) in a child process of its own, with the file-descriptor limit a
foreground ``chandrad run`` gets from a shell (``ulimit -n`` 1024). Hostile clients are
other child processes on the same Unix socket; the test process measures ``status``
round trips, one new connection per request, as ``bench/bench_status.py`` does
("reconnect"). The budget for the p99 under fault is ``P99_BUDGET_S``, the p99 that
bench reports today for a daemon whose loop is busy (0.36 s on 2 shared cores; idle,
0.44 ms): a hostile client may cost what ordinary load costs, not more. Measured here
with the fixes: 76–160 ms, depending on the machine's other load.

Every hostile loop is bounded (a count and a deadline) and uses only this Unix socket.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from waiting import wait_until

from chandrad.control.server import LISTEN_BACKLOG
from chandrad.ctl.client import call
from chandrad.protocol import encode_request
from faults.faultkit import record

TESTS = Path(__file__).resolve().parent.parent
ROOT = TESTS.parent

#: ``status`` p99 (new connection per request) that must hold under every fault here:
#: bench/bench_status.py's busy_reconnect p99.
P99_BUDGET_S = 0.36
#: The server's read timeout in these tests (the daemon's default is 30 s).
READ_TIMEOUT_S = 3.0

SERVER = r"""
import json, os, resource, sys
sys.path.insert(0, sys.argv[3])
from pathlib import Path
from control_harness import ServerThread
from chandrad.logs import configure_logging

configure_logging("json", "info", stream=sys.stderr)
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
with ServerThread(Path(sys.argv[1]), read_timeout=float(sys.argv[2])) as st:
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "fds":
            print(json.dumps({"fds": len(os.listdir("/proc/self/fd"))}), flush=True)
    calls = len(st.daemon.calls)
status = open("/proc/self/status").read().split("\n")
peak = next(x for x in status if x.startswith("VmHWM:")).split()[1]
print(json.dumps({"rss_peak_kb": int(peak), "calls": calls}), flush=True)
"""

FLOOD = r"""
import json, resource, selectors, socket, sys, time
path, count, hold = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
resource.setrlimit(resource.RLIMIT_NOFILE, (count + 64, count + 64))
sel = selectors.DefaultSelector()
stats = {"connected": 0, "connect_failed": 0, "closed_by_server": 0, "replies": {}}

def connect():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(path)
    except OSError:
        stats["connect_failed"] += 1
        s.close()
        return
    stats["connected"] += 1
    s.setblocking(False)
    sel.register(s, selectors.EVENT_READ)

for _ in range(count):
    connect()
print("flooding", flush=True)
deadline = time.monotonic() + hold
while time.monotonic() < deadline:
    for key, _ in sel.select(0.1):
        s = key.fileobj
        try:
            data = s.recv(65536)
        except BlockingIOError:
            continue
        except OSError:
            data = b""
        for line in data.splitlines():
            try:
                code = json.loads(line)["error"]["code"]
            except (ValueError, KeyError, TypeError):
                code = "?"
            stats["replies"][code] = stats["replies"].get(code, 0) + 1
        if not data:
            stats["closed_by_server"] += 1
            sel.unregister(s)
            s.close()
            if time.monotonic() < deadline:
                connect()  # keep the pressure on
stats["open_at_end"] = len(sel.get_map())
print(json.dumps(stats), flush=True)
"""


class Server:
    """The control server in its own process, with a 1024-descriptor limit."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.log = path.with_name("server.log")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", SERVER, str(path), str(READ_TIMEOUT_S), str(TESTS)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", line

    def fds(self) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("fds\n")
        self.proc.stdin.flush()
        count: int = json.loads(self.proc.stdout.readline())["fds"]
        return count

    def events(self, name: str) -> list[dict[str, Any]]:
        """The server's log events called ``name`` (it logs JSON lines)."""
        found = []
        for line in self.log.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == name:
                found.append(event)
        return found

    def stop(self) -> dict[str, Any]:
        """Close the server; its peak RSS and how many daemon calls it answered."""
        out, _ = self.proc.communicate("", timeout=30)
        result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return result


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    srv = Server(tmp_path / "control.sock")
    try:
        yield srv
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
        for pipe in (srv.proc.stdin, srv.proc.stdout):  # communicate() closed them if it ran
            if pipe is not None:
                pipe.close()


def status_once(path: Path, timeout: float = 10.0) -> float:
    """One ``status`` through chandractl's client, on a new connection; seconds it took."""
    started = time.perf_counter()
    result = call(path, "status", timeout=timeout)
    assert result["daemon"]["state"] == "running", result
    return time.perf_counter() - started


def status_p99(path: Path, n: int = 200) -> dict[str, float]:
    """p50/p99/max in ms of ``n`` status round trips, a new connection each."""
    samples = [status_once(path) for _ in range(n)]
    q = statistics.quantiles(samples, n=100, method="inclusive")
    return {"p50_ms": q[49] * 1000, "p99_ms": q[98] * 1000, "max_ms": max(samples) * 1000}


def flood(path: Path, count: int, hold: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", FLOOD, str(path), str(count), str(hold)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "flooding", line
    return proc


def flood_result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=60)
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def test_thousand_silent_connections_do_not_starve_status(server: Server) -> None:
    """1,000 clients connect and never send, reconnecting when closed, for 6 s.

    ``status`` on a fresh connection keeps its p99 within budget; the server never holds
    more than the per-process cap (16) of the flooder's connections plus one accept batch,
    so the rest of the daemon (store, render pool, engine connections) keeps descriptors.
    """
    baseline = status_p99(server.path, 100)
    idle_fds = server.fds()
    flooder = flood(server.path, 1000, hold=6.0)
    try:
        during = status_p99(server.path, 200)
        held_fds = server.fds()
    finally:
        result = flood_result(flooder)
    after = status_p99(server.path, 50)
    print(f"baseline {baseline}, during 1000-connection flood {during}, after {after}; "
          f"server fds idle {idle_fds}, during {held_fds}; flooder {result}")
    record("control socket: 1,000 concurrent silent connections", f"per-process cap 16, "
           f"the rest refused busy; status p99 {during['p99_ms']:.0f} ms during (budget "
           f"{P99_BUDGET_S * 1000:.0f} ms); server fds {idle_fds} → {held_fds}",
           lost="-", twice="-", serving_s="0 (never stopped)", engine="-")
    assert during["p99_ms"] < P99_BUDGET_S * 1000, during
    # Bounded by the limits (16 places for the one flooding process, plus at most one
    # accept batch being answered busy), not by the flood's 1,000 connections.
    assert held_fds <= idle_fds + 16 + LISTEN_BACKLOG + 4, (idle_fds, held_fds)
    assert result["replies"].get("busy", 0) > 0, result  # refusals come with a reason
    stats = server.stop()
    assert stats["calls"] >= 350
    warnings = server.events("control_connection_limit")
    assert 1 <= len(warnings) <= 2, warnings  # one per 10 s at most, with counts
    assert warnings[0]["per_process"] == 16 and warnings[0]["refused"] >= 1


def test_many_silent_processes_share_the_global_limit(server: Server) -> None:
    """8 processes keep 16 silent connections each (128 > the global 64) for 5 s.

    Each newcomer past 64 closes the longest-idle connection of the process holding
    the most; status from another process is served within budget throughout.
    """
    idle_fds = server.fds()
    flooders = [flood(server.path, 16, hold=5.0) for _ in range(8)]
    try:
        during = status_p99(server.path, 200)
        held_fds = server.fds()
    finally:
        results = [flood_result(f) for f in flooders]
    busy = sum(r["replies"].get("busy", 0) for r in results)
    print(f"8 x 16 silent connections: status {during}; server fds idle {idle_fds}, "
          f"during {held_fds}; busy replies {busy}")
    assert during["p99_ms"] < P99_BUDGET_S * 1000, during
    assert held_fds <= idle_fds + 64 + 2, (idle_fds, held_fds)
    assert busy >= 64, results
    server.stop()
    assert server.events("control_connection_limit")[0]["evicted_idle"] >= 1


def test_silent_client_is_closed_after_the_read_timeout(server: Server) -> None:
    """A client that connects and never sends gets ``timeout`` and EOF; status meanwhile."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.settimeout(READ_TIMEOUT_S + 5)
        silent.connect(str(server.path))
        started = time.monotonic()
        during = status_p99(server.path, 100)
        data = b""
        while not data.endswith(b"\n"):
            chunk = silent.recv(4096)
            assert chunk, data
            data += chunk
        waited = time.monotonic() - started
        assert json.loads(data)["error"]["code"] == "timeout"
        assert silent.recv(1) == b""
    record("control socket: a client that connects and never sends", f"closed with "
           f"'timeout' after {waited:.1f} s; status p99 {during['p99_ms']:.0f} ms meanwhile",
           lost="-", twice="-", serving_s="0 (never stopped)", engine="-")
    assert READ_TIMEOUT_S - 0.5 <= waited < READ_TIMEOUT_S + 3, waited
    assert during["p99_ms"] < P99_BUDGET_S * 1000, during


def test_200_mb_line_is_refused_and_memory_stays_bounded(server: Server) -> None:
    """A 200 MB request line: ``too_large`` after 1 MiB, the rest is not buffered.

    Meanwhile status keeps its p99, and the server's peak RSS grows by less than 64 MiB.
    """
    replies: list[bytes] = []
    sent = [0]

    def hostile() -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(20)
            sock.connect(str(server.path))
            chunk = b'{"v":1,"id":1,"cmd":"status","args":{"x":"' + b"a" * (1 << 20)
            try:
                for _ in range(200):
                    sock.sendall(chunk)
                    sent[0] += len(chunk)
                sock.sendall(b'"}}\n')
            except OSError:
                pass  # the server closed its end once it had refused the line
            try:
                while data := sock.recv(65536):
                    replies.append(data)
            except OSError:
                pass

    thread = threading.Thread(target=hostile)
    thread.start()
    during = status_p99(server.path, 200)
    thread.join(60)
    assert not thread.is_alive()
    reply = json.loads(b"".join(replies).splitlines()[0])
    assert reply["error"]["code"] == "too_large", reply
    after = status_p99(server.path, 20)
    stats = server.stop()
    print(f"200 MB line: sent {sent[0] / 1e6:.0f} MB before the close; status during "
          f"{during}, after {after}; server peak RSS {stats['rss_peak_kb'] / 1024:.0f} MiB")
    record("control socket: a 200 MB request line", f"too_large after 1 MiB, connection "
           f"closed; status p99 {during['p99_ms']:.0f} ms during; server peak RSS "
           f"{stats['rss_peak_kb'] / 1024:.0f} MiB", lost="-", twice="-",
           serving_s="0 (never stopped)", engine="-")
    assert during["p99_ms"] < P99_BUDGET_S * 1000, during
    assert stats["rss_peak_kb"] < 160 * 1024, stats


def test_client_that_never_reads_is_dropped(server: Server) -> None:
    """A client that pipelines status requests but never reads a reply is closed.

    Replies pile up in the socket until the server cannot write; after the read timeout
    it drops the client instead of holding a connection (and its buffers) for ever.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as deaf:
        deaf.settimeout(0.5)
        deaf.connect(str(server.path))
        request = encode_request("status", id=1) * 100

        def dropped() -> bool:
            try:
                deaf.sendall(request)
            except TimeoutError:
                return False  # our send buffer is full: the server stopped reading us
            except (BrokenPipeError, ConnectionResetError):
                return True
            return False

        wait_until(dropped, READ_TIMEOUT_S + 10, "the server drops a client that reads "
                   "nothing", every=0)
    during = status_p99(server.path, 50)
    assert during["p99_ms"] < P99_BUDGET_S * 1000, during
