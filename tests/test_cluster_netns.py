"""Two hosts with networks of their own on one PostgreSQL, and a network partition.

Each host is a network namespace (tests/netns.py) joined to the test's by a veth pair;
PostgreSQL (a server of this module, tests/pg_server.py) listens on TCP on this side of both
pairs. On each host run a real ``chandrad run`` and its own stand-in engine, both inside
the namespace, on one shared inbox (``daemon.lease_s = 3``). The failure a ``kill -9`` does
not show: host B is cut off (its link goes down: its packets vanish, its TCP connections
are left half-open) while it holds jobs, and keeps running. What must hold: a store call
on a silent server fails within a third of the lease instead of the kernel's ~15 minutes
of retransmissions, and the server ends the session of a host cut off mid-transaction so
that its row locks go; B's leases expire and A takes its jobs over and finishes them; B
says its store is unreachable (``chandractl status``, ``STATUS=``); healed, B reconnects,
its answers for the jobs A took are refused (``job_lease_lost``), it moves no file and
writes no output; every file is done once, with the outputs of a single host.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import netns
import psycopg
import pytest
from daemon_harness import OCR, Daemon, drop, free_port
from pg_server import PgServer
from standin_engine import StandinServer
from test_cluster import LEASE_S, LONG, NO_METRICS, HostDaemon, _outputs
from test_job_errors import Notify
from waiting import wait_until

from chandrad.store.pg_database import ATTEMPT_WAIT_S, RECONNECT_S

REASON = netns.unavailable()
pytestmark = pytest.mark.skipif(
    REASON is not None, reason=f"network namespaces cannot be created here: {REASON}")

SMALL = ("image_multipage-fax-g3_3p.tif", "image_hi-devanagari.png")


@pytest.fixture(scope="module")
def net() -> Iterator[tuple[netns.NetHost, netns.NetHost, PgServer]]:
    """Hosts A and B, and a PostgreSQL listening on this side of both links."""
    with netns.hosts(2) as (a, b):
        server = PgServer(listen=(a.outer_ip, b.outer_ip), port=free_port()).start()
        try:
            yield a, b, server
        finally:
            server.close()


def _dbname(url: str) -> str:
    return url.split("?")[0].rsplit("/", 1)[1]


# A store connection on host B: one session holds a row lock in an open transaction, the
# other is idle; after the cut (stdin says so) the idle one's next calls are timed.
PROBE = r"""
import json, sys, time
from chandrad.errors import StoreUnreachable
from chandrad.store.pg_database import PgDatabase
url, lease_s = sys.argv[1], float(sys.argv[2])
locker, idle = PgDatabase.connect(url, lease_s), PgDatabase.connect(url, lease_s)
locker.raw().execute("BEGIN")
locker.raw().execute("SELECT id FROM held WHERE id = 1 FOR UPDATE")
print("locked", flush=True)

def timed():
    t0 = time.monotonic()
    try:
        idle.conn.execute("SELECT 1").fetchone()
        return {"ok": True, "s": time.monotonic() - t0}
    except StoreUnreachable as exc:
        return {"ok": False, "s": time.monotonic() - t0, "error": exc.message}

sys.stdin.readline()  # cut
print(json.dumps([timed(), timed()]), flush=True)
sys.stdin.readline()  # restored
t0 = time.monotonic()
while not timed()["ok"]:
    time.sleep(0.05)
print(json.dumps({"reconnect_s": time.monotonic() - t0}), flush=True)
"""


def test_a_silent_server_fails_a_call_within_a_third_of_the_lease_and_drops_held_locks(
        net: tuple[netns.NetHost, netns.NetHost, PgServer]) -> None:
    _, b, server = net
    url = server.new_database()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE held (id INTEGER PRIMARY KEY)")
        conn.execute("INSERT INTO held VALUES (1)")

    def lock_free() -> bool:  # what another host's claim needs
        try:
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("SELECT id FROM held WHERE id = 1 FOR UPDATE NOWAIT")
            return True
        except psycopg.errors.LockNotAvailable:
            return False

    with subprocess.Popen([*b.prefix, sys.executable, "-c", PROBE,
                           server.tcp_url(b.outer_ip, _dbname(url)), str(LEASE_S)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as probe:
        lines = _lines(probe)
        try:
            assert lines.get(timeout=30).strip() == "locked"
            assert not lock_free()
            b.cut()
            cut = time.monotonic()
            _say(probe, "cut")
            wait_until(lock_free, LEASE_S + 5, "the cut-off session's row lock released",
                       every=0.1)
            released_s = time.monotonic() - cut
            first, later = json.loads(lines.get(timeout=LEASE_S + 10))
            b.restore()
            _say(probe, "restored")
            reconnect_s = json.loads(lines.get(timeout=20))["reconnect_s"]
        finally:
            b.restore()
            probe.kill()
    # The first call: the silent third of the lease, then the reconnect window a restart
    # would need (the kernel's default, no timeouts set: ~15 minutes of retransmissions).
    assert not first["ok"] and "cannot be reached" in first["error"], first
    assert first["s"] < LEASE_S / 3 + RECONNECT_S + 1.5, first
    # Later calls wait for no connect timeout: the attempt goes on in the background.
    assert not later["ok"] and later["s"] < ATTEMPT_WAIT_S + 0.5, later
    assert released_s < LEASE_S + 2, released_s  # the server's keepalive: 2 hours
    print(f"silent server (lease {LEASE_S:g} s): first call failed in {first['s']:.1f} s, "
          f"the next in {later['s']:.1f} s; the cut-off transaction's lock released "
          f"{released_s:.1f} s after the cut; reconnected {reconnect_s:.1f} s after the link "
          "was back")


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    """The lines ``proc`` prints, as they come (``get(timeout=…)``)."""
    out: queue.Queue[str] = queue.Queue()
    stdout = proc.stdout
    assert stdout is not None

    def read() -> None:
        for line in stdout:
            out.put(line)

    threading.Thread(target=read, daemon=True).start()
    return out


def _say(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def _tree(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder``: relative path → (size, mtime in ns)."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _events(d: Daemon, event: str) -> list[dict[str, Any]]:
    """The daemon's JSON log lines of ``event``."""
    out = []
    for line in d.log_path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == event:
            out.append(record)
    return out


def test_a_partitioned_host_loses_its_jobs_to_the_other_and_its_late_answers_are_refused(
        net: tuple[netns.NetHost, netns.NetHost, PgServer], corpus_dir: Path,
        tmp_path: Path) -> None:
    a_net, b_net, server = net
    url = server.new_database()
    files = (LONG, *SMALL)
    # Pages named by their pixels: the same pixels may come in other PNG bytes.
    engines = {"host-a": StandinServer(tmp_path / "engine-a",
                                       {"delay_s": 0.05, "page_id": "pixels"},
                                       prefix=a_net.prefix),
               "host-b": StandinServer(tmp_path / "engine-b",
                                       {"delay_s": 0.3, "page_id": "pixels"},
                                       prefix=b_net.prefix),
               "single": StandinServer(tmp_path / "engine-single",
                                       {"delay_s": 0.05, "page_id": "pixels"})}
    notify = Notify(tmp_path / "notify.sock")
    made: list[Daemon] = []

    def host(name: str, where: netns.NetHost, **env: str) -> HostDaemon:
        d = HostDaemon(tmp_path / name, f'[engine]\nurl = "{engines[name].url}"\n',
                       settle=0.3, poll_interval=0.3, tables=NO_METRICS, env=env,
                       ocr={**OCR, "max_in_flight": 2},  # B's two pages wait at its engine
                       prefix=where.prefix, shared=tmp_path / "spool",
                       store=server.tcp_url(where.outer_ip, _dbname(url)), host_id=name)
        made.append(d)
        return d

    def rows(sql: str, *args: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(url, autocommit=True) as conn:
            return conn.execute(sql, args).fetchall()

    def jobs() -> dict[str, tuple[int, str, str | None]]:
        return {bytes(p).decode(): (i, s, o) for i, p, s, o in
                rows("SELECT id, path, state, owner FROM jobs ORDER BY id")}

    def pages() -> dict[tuple[int, int], tuple[str, float | None]]:
        return {(j, i): (s, f) for j, i, s, f in
                rows("SELECT job_id, page_index, state, finished_at FROM pages")}

    try:
        for engine in engines.values():
            engine.start()
        single = Daemon(tmp_path / "single", f'[engine]\nurl = "{engines["single"].url}"\n',
                        settle=0.3, poll_interval=0.3, tables=NO_METRICS)
        made.append(single)
        a, b = host("host-a", a_net), host("host-b", b_net, NOTIFY_SOCKET=str(notify.path))
        for d in made:
            d.start()
        for d in made:
            d.wait_answering(60)
        a.ctl_json("pause")  # B takes every job
        for name in files:
            drop(corpus_dir / "good" / name, single.inbox)
            drop(corpus_dir / "good" / name, a.inbox)

        def b_runs_long() -> bool:
            job = jobs().get(LONG)
            return (job is not None and job[2] == "host-b"
                    and sum(s == "done" for (j, _), (s, _) in pages().items() if j == job[0]) >= 3)

        wait_until(b_runs_long, 60, "host b has done pages of the long document",
                   context=b.tail)
        # B's next pages are answered only once the link is back and the jobs are A's: they
        # wait at its engine, and every page answered before is stored (no write of B's
        # is cut midway).
        release = tmp_path / "answer-late-pages"
        engines["host-b"].update(default={"until": str(release)})
        sent = len(engines["host-b"].chats())

        def late_pages_wait() -> bool:
            states = [s for s, _ in pages().values()]
            asked = len(engines["host-b"].chats())
            return (asked >= sent + 2 and states.count("in_flight") == 2
                    and states.count("done") == asked - 2)

        wait_until(late_pages_wait, 20, "host b's next two pages at its engine",
                   context=b.tail)
        held = {n: i for n, (i, s, o) in jobs().items()
                if o == "host-b" and s in ("pending", "running", "held")}
        assert LONG in held, jobs()
        done_by_b = {k for k, (s, _) in pages().items() if s == "done"}

        b_net.cut()
        cut = time.monotonic()
        a.ctl_json("resume")
        wait_until(lambda: all(jobs()[n][2] == "host-a" for n in held), LEASE_S + 20,
                   "host a takes host b's jobs over", context=a.tail)
        takeover_s = time.monotonic() - cut
        # B, cut off, knows it: its status answers and says so, as STATUS= does.
        wait_until(lambda: (b.status(timeout=10) or {}).get("daemon", {}).get(
            "store", {}).get("problem") == "store_unreachable", 20,
            "host b's status says its store is unreachable", context=b.tail)
        t0 = time.monotonic()
        text = b.ctl("status", timeout=10).stdout
        status_s = time.monotonic() - t0
        assert "store unreachable: " in text and "cannot be reached" in text, text
        line = next(s for s in reversed(notify.statuses()) if "STORE" in s)
        assert line.startswith("STORE UNREACHABLE: "), line
        cluster = json.loads(a.ctl("status", "--cluster", "--json", "--config",
                                   str(a.config)).stdout)
        assert {h["host"]: h["state"] for h in cluster["hosts"]} == {
            "host-a": "up", "host-b": "silent"}, cluster
        wait_until(lambda: all(jobs()[n][1] == "done" for n in held), 60,
                   "host a finishes host b's jobs", context=a.tail)
        finished_s = time.monotonic() - cut
        assert b.alive(), b.tail()
        shared_after_a = _tree(tmp_path / "spool")
        pages_after_a = pages()

        b_net.restore()
        restored = time.monotonic()
        wait_until(lambda: (b.status(timeout=10) or {}).get("daemon", {}).get(
            "store", {}).get("problem", "?") is None, 30, "host b reaches its store again",
            context=b.tail)
        reconnect_s = time.monotonic() - restored
        # B's late answers come back: each job they belong to is refused, none is written.
        release.touch()
        wait_until(lambda: {e.get("job") for e in _events(b, "job_lease_lost")}
                   >= {held[LONG]}, 20, "host b's late answers refused", context=b.tail)
        single.wait_jobs_final(files, 60)
        time.sleep(1)  # what B might still do with them, it has done by now
        assert _tree(tmp_path / "spool") == shared_after_a  # B moved and wrote nothing
        assert pages() == pages_after_a  # and stored nothing: no page was done twice
        assert {k for k, (s, _) in pages_after_a.items() if s == "done"} >= done_by_b
        assert all(s == "done" for s, _ in pages_after_a.values())
        assert {n: s for n, (_, s, _) in jobs().items()} == dict.fromkeys(files, "done")
        assert sorted(p.name for p in a.done.iterdir()) == sorted(files)
        assert not list(a.inbox.iterdir()) and not list(a.failed.iterdir())
        assert _outputs(a.output) == _outputs(single.output) != {}
        lost = _events(b, "job_lease_lost")
        assert all(e["owner"] == "host-a" for e in lost), lost
        assert not [e for e in _events(b, "job_done") if e.get("job") in held.values()]
        assert not _events(b, "job_failed") and not _events(b, "task_crashed")
        assert b.alive() and a.alive()
        print(f"partition of host b (lease {LEASE_S:g} s, jobs held {sorted(held)}): "
              f"taken over by host a {takeover_s:.1f} s after the cut, finished by it "
              f"{finished_s:.1f} s after; host b's status answered in {status_s:.2f} s "
              f"while cut off; reconnected {reconnect_s:.1f} s after the link was back; "
              f"{len(lost)} late job(s) refused")
    finally:
        b_net.restore()
        for d in made:
            d.cleanup()
        for engine in engines.values():
            engine.stop()
        notify.close()
