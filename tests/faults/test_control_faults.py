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
#: Connections accepted but not yet released while they are refused: asyncio accepts up
#: to the backlog per turn of the loop, and a refused connection's descriptor is closed a
#: few turns after its accept (its transport is made in a task, then the client task
#: writes ``busy`` and closes, then the close runs), so the next batch can arrive before
#: the last is released. Two batches: seen 157 above idle with 16 held (one batch is 144).
IN_FLIGHT_REFUSALS = 2 * LISTEN_BACKLOG

SERVER = r"""
import json, os, resource, sys
sys.path.insert(0, sys.argv[3])
from pathlib import Path
from control_harness import RecordingDaemon, ServerThread
from chandrad import malloc
from chandrad.daemon.core import DAEMON_MMAP_THRESHOLD_BYTES
from chandrad.logs import configure_logging

configure_logging("json", "info", stream=sys.stderr)
malloc.set_option(malloc.M_MMAP_THRESHOLD, DAEMON_MMAP_THRESHOLD_BYTES)  # as the daemon runs
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
daemon = RecordingDaemon()
for i in range(100, 100 + int(sys.argv[4])):  # a long queue: ~370 bytes of reply a job
    daemon.jobs[i] = {"id": i, "path": f"in/scans/batch-{i:06d}-" + "x" * 200 + ".pdf",
                      "state": "pending", "pages_done": 0, "pages_total": 12, "attempts": 0,
                      "error_code": None, "error_message": None}
with ServerThread(Path(sys.argv[1]), daemon, read_timeout=float(sys.argv[2])) as st:
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "fds":
            rss = next(x for x in open("/proc/self/status") if x.startswith("VmRSS:"))
            print(json.dumps({"fds": len(os.listdir("/proc/self/fd")),
                              "rss_kb": int(rss.split()[1])}), flush=True)
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


#: Keeps ``count`` connections that each send one request and then never read a byte;
#: one the server closes is opened again (seen by POLLHUP, without reading), for ``hold`` s.
SLOW_READERS = r"""
import json, select, socket, sys, time
path, count, hold, request = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
poll = select.poll()
socks = {}
reopened = 0

def connect():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.sendall(request.encode())
    socks[s.fileno()] = s
    poll.register(s, select.POLLRDHUP)

for _ in range(count):
    connect()
print("waiting", flush=True)
deadline = time.monotonic() + hold
while time.monotonic() < deadline:
    for fd, _ in poll.poll(100):
        poll.unregister(fd)
        socks.pop(fd).close()
        reopened += 1
        try:
            connect()
        except OSError:
            pass
print(json.dumps({"reopened": reopened}), flush=True)
"""


class Server:
    """The control server in its own process, with a 1024-descriptor limit."""

    def __init__(self, path: Path, jobs: int = 0) -> None:
        self.path = path
        self.log = path.with_name("server.log")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", SERVER, str(path), str(READ_TIMEOUT_S), str(TESTS),
                 str(jobs)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", line

    def fds(self) -> int:
        count: int = self._usage()["fds"]
        return count

    def rss_kb(self) -> int:
        """The server's resident memory now (VmRSS), in KiB."""
        rss: int = self._usage()["rss_kb"]
        return rss

    def _usage(self) -> dict[str, int]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("fds\n")
        self.proc.stdin.flush()
        usage: dict[str, int] = json.loads(self.proc.stdout.readline())
        return usage

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

    def error_lines(self) -> list[str]:
        """The server's log lines at level error, or with a traceback."""
        return [line for line in self.log.read_text().splitlines()
                if '"level": "error"' in line or "Traceback" in line]

    def stop(self) -> dict[str, Any]:
        """Close the server; its peak RSS and how many daemon calls it answered."""
        out, _ = self.proc.communicate("", timeout=30)
        result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return result


def _serving(srv: Server) -> Iterator[Server]:
    try:
        yield srv
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
        for pipe in (srv.proc.stdin, srv.proc.stdout):  # communicate() closed them if it ran
            if pipe is not None:
                pipe.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    yield from _serving(Server(tmp_path / "control.sock"))


@pytest.fixture
def queue_server(tmp_path: Path) -> Iterator[Server]:
    """A server whose daemon has 2,000 more jobs (a ``queue`` reply of ~750 KB)."""
    yield from _serving(Server(tmp_path / "control.sock", jobs=2000))


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
    # Bounded by the limits (16 places for the one flooding process, plus the accept
    # batches being answered busy), not by the flood's 1,000 connections.
    assert held_fds <= idle_fds + 16 + IN_FLIGHT_REFUSALS + 4, (idle_fds, held_fds)
    assert result["replies"].get("busy", 0) > 0, result  # refusals come with a reason
    stats = server.stop()
    assert stats["calls"] >= 350
    warnings = server.events("control_connection_limit")
    assert 1 <= len(warnings) <= 2, warnings  # one per 10 s at most, with counts
    assert warnings[0]["per_process"] == 16 and warnings[0]["refused"] >= 1


def test_many_silent_processes_share_the_global_limit(server: Server) -> None:
    """8 processes keep 16 silent connections each (128 > the global 64) for 5 s.

    Each newcomer past 64 closes the longest-idle connection of the process holding
    the most; status from another process is served within budget throughout, and the
    evictions log no error.
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
    # The 64 places, plus the accept batches in flight: each newcomer of a batch closes a
    # victim, whose descriptor the loop releases a turn later.
    assert held_fds <= idle_fds + 64 + IN_FLIGHT_REFUSALS + 4, (idle_fds, held_fds)
    assert busy >= 64, results
    server.stop()
    assert server.events("control_connection_limit")[0]["evicted_idle"] >= 1
    # An eviction closes the connection; it used to cancel its task, which asyncio
    # (3.11) logged as an ERROR "Exception in callback" traceback, one per eviction.
    assert not server.error_lines(), server.error_lines()[:1]


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


def test_clients_that_never_read_a_long_queue_do_not_block_status(queue_server: Server) -> None:
    """4 processes × 16 connections ask for a 2,000-job ``queue`` (~750 KB) and never read.

    All 64 places are taken by connections waiting on a reply nobody reads. ``status``
    from another client is still answered at once (a connection blocked on an unread
    reply is evicted first, aborted since the ``busy`` line could not reach it), the
    bytes held for the slow readers stay within the server's budget, and evictions log
    no error and no traceback.
    """
    server = queue_server
    readers: list[subprocess.Popen[str]] = []
    try:
        reply = len(json.dumps(call(server.path, "queue", {"limit": 2000})))
        idle_rss = server.rss_kb()
        request = encode_request("queue", {"limit": 2000}, id=1).decode()
        for _ in range(4):
            proc = subprocess.Popen([sys.executable, "-c", SLOW_READERS, str(server.path),
                                     "16", "3", request], stdout=subprocess.PIPE, text=True)
            readers.append(proc)
            assert proc.stdout is not None and proc.stdout.readline().strip() == "waiting"
        time.sleep(0.5)  # every reply written as far as the kernel takes it
        held_rss = server.rss_kb()
        samples: list[float] = []
        failures: list[str] = []
        for _ in range(10):
            started = time.perf_counter()
            try:
                status_once(server.path, timeout=5.0)
            except Exception as exc:  # noqa: BLE001 - a refusal is the failure we count
                failures.append(f"{type(exc).__name__}: {exc}")
            samples.append(time.perf_counter() - started)
            time.sleep(0.1)
        held_rss = max(held_rss, server.rss_kb())
    finally:
        reopened = []
        for proc in readers:
            try:
                reopened.append(json.loads(proc.communicate(timeout=20)[0])["reopened"])
            except (subprocess.TimeoutExpired, ValueError):
                proc.kill()
                proc.communicate()
    stats = server.stop()
    growth_mb = (held_rss - idle_rss) / 1024
    print(f"64 slow readers of a {reply / 1e3:.0f} KB queue: status failures {len(failures)} "
          f"{failures[:1]}, slowest {max(samples) * 1000:.0f} ms; server RSS {idle_rss // 1024}"
          f" → {held_rss // 1024} MiB (+{growth_mb:.0f}), peak {stats['rss_peak_kb'] // 1024}"
          f" MiB; readers {reopened}")
    record("control socket: 64 connections that ask for a 750 KB queue and never read",
           f"status answered {10 - len(failures)}/10, slowest {max(samples) * 1000:.0f} ms; "
           f"server RSS +{growth_mb:.0f} MiB while they hold", lost="-", twice="-",
           serving_s="0 (never stopped)", engine="-")
    assert reply > 700_000, reply
    assert not failures, failures
    assert max(samples) < 2.0, samples
    assert not server.error_lines(), server.error_lines()[:3]
    assert growth_mb < 36, (idle_rss, held_rss)  # before: +73 MiB
    assert not server.error_lines(), server.error_lines()[:3]
    assert server.events("control_connection_limit")[0]["evicted_not_reading"] >= 1


def test_stopping_with_open_connections_logs_no_error(server: Server) -> None:
    """The daemon stops while clients are connected: their connections end quietly
    (each used to end as a cancelled task, which asyncio 3.11 logged as an ERROR
    traceback)."""
    clients = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(5)]
    try:
        for sock in clients:
            sock.connect(str(server.path))
        status_once(server.path)  # every connection is being served
        server.stop()
    finally:
        for sock in clients:
            sock.close()
    assert not server.error_lines(), server.error_lines()[:1]
