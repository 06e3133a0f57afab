"""How soon an idle host starts work another host freed, on one PostgreSQL store: from
``chandractl retry`` sent to host A to the job started on idle host B, and from host A's
leases given back (SIGTERM) to host B holding its job; and the connections one host holds.

Two real daemons (``tests/daemon_harness.py``) on one inbox, one stand-in engine each
(``tests/standin_engine.py``), the tests' own PostgreSQL (``tests/pg_server.py``).

- **retry**: host A paused; a broken file fails on host B (so B ran it last); each trial
  sleeps a random 0-1 s (a random phase against B's 1 s poll), sends ``retry`` on A's
  control socket (``chandrad.ctl.client.call``, no CLI start-up in the figure) and reads
  B's ``started_at`` for the job: the latency is ``started_at`` - the moment it was sent.
- **given back**: host B paused while host A takes a 15-page PDF, then resumed (idle);
  after a random 0-1 s host A is paused and gets SIGTERM (the operator's hand-over): it
  stores the pages at its engine and gives its leases back (``hosts.stopped_at`` in that
  transaction); the latency is host B's claim (its ``lease_until`` - ``lease_s``, the
  server's clock) - that transaction's commit (``track_commit_timestamp`` is turned on).

Run it on the code to measure; for the code before LISTEN/NOTIFY, an export of that
commit first on the path, from outside the checkout (``python -m`` puts the working
directory first): ``cd /tmp && PYTHONPATH=/tmp/old /repo/.venv/bin/python
/repo/bench/cluster_wake.py --label poll`` (the daemons inherit it). The JSON goes to
``bench/results/DATE-cluster-wake-LABEL.json``; ``2026-12-06-cluster-wake.json`` holds
the runs docs/cluster.md quotes.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(1, str(REPO / "bench"))

import psycopg  # noqa: E402
from cluster import HostDaemon, engine_toml  # noqa: E402
from daemon_harness import drop  # noqa: E402
from pg_server import PgServer  # noqa: E402
from standin_engine import StandinServer  # noqa: E402
from waiting import wait_until  # noqa: E402

import chandrad  # noqa: E402
from chandrad.ctl.client import call  # noqa: E402

CORPUS = REPO / "tests" / "corpus"
BROKEN = CORPUS / "bad" / "broken_not-a-pdf-text.pdf"
LONG = CORPUS / "good" / "digital_federal-register_15p.pdf"
LEASE_S = 30.0
#: ``watch.settle_seconds`` (``--settle``): host B's own watcher also takes a retried input
#: moved back into the shared inbox once it settled, which woke B's dispatcher before.
SETTLE_S = [2.0]


def rows(url: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(sql, args).fetchall()


def until(url: str, sql: str, args: tuple[Any, ...], want: list[tuple[Any, ...]],
          timeout: float, what: str, context: Callable[[], str]) -> None:
    """Poll ``sql`` every 50 ms until its rows are ``want``."""
    wait_until(lambda: rows(url, sql, *args) == want, timeout, what, every=0.05,
               context=context)


def host(root: Path, name: str, engine: StandinServer, shared: Path, url: str) -> HostDaemon:
    keys = f'store = "{url}"\nhost_id = "{name}"\nlease_s = {LEASE_S}\n'
    # The engine's capacity is its 2 slots: a stop does not find the whole job at it.
    d = HostDaemon(root / name, engine_toml([engine.url], 2), shared, keys, 1)
    d.settle = SETTLE_S[0]
    d.config.write_text(d.config_text())
    return d


def retry_trials(root: Path, engines: list[StandinServer], url: str, n: int) -> list[float]:
    shared = root / "spool"
    a, b = (host(root, name, e, shared, url) for name, e in zip(("host-a", "host-b"),
                                                                 engines, strict=True))
    try:
        for d in (a, b):
            d.start()
        for d in (a, b):
            d.wait_answering(60)
        call(a.socket, "pause")
        drop(BROKEN, a.inbox)
        wait_until(lambda: rows(url, "SELECT state, owner FROM jobs") == [("failed", "host-b")],
                   60, "the broken file failed on host b", context=b.tail)
        (job_id,), = rows(url, "SELECT id FROM jobs")
        out = []
        for _ in range(n):
            time.sleep(random.random())
            sent = time.time()
            call(a.socket, "retry", {"job": job_id})
            until(url, "SELECT state, started_at > %s FROM jobs", (sent,), [("failed", True)],
                  30, "host b ran it again", b.tail)
            (started, owner), = rows(url, "SELECT started_at, owner FROM jobs")
            assert owner == "host-b", owner
            out.append(started - sent)
        return out
    finally:
        for d in (a, b):
            d.cleanup(grace=10)


def given_back_trials(root: Path, engines: list[StandinServer], url: str,
                      n: int) -> list[float]:
    shared = root / "spool"
    b = host(root, "host-b", engines[1], shared, url)
    out = []
    engines[0].update(default={"delay_s": 1.0})  # 15 pages, 2 at once: A is mid-job a while
    try:
        b.start()
        b.wait_answering(60)
        for i in range(n):
            call(b.socket, "pause")
            a = host(root / f"a{i}", "host-a", engines[0], shared, url)
            a.start()
            a.wait_answering(60)
            name = f"long-{i}.pdf".encode()
            drop(LONG, a.inbox, name.decode())
            until(url, "SELECT COUNT(*) >= 2 FROM pages p JOIN jobs j ON j.id = p.job_id "
                  "WHERE p.state = 'done' AND j.path = %s", (name,), [(True,)], 60,
                  "two pages done on host a", a.tail)
            call(b.socket, "resume")
            time.sleep(random.random())
            call(a.socket, "pause")  # the stop then ends once the pages at its engine are in
            a.stop()
            (job_id,), = rows(url, "SELECT id FROM jobs WHERE path = %s", name)
            wait_until(lambda: rows(url, "SELECT owner = 'host-b' OR state = 'done' FROM jobs "
                                    "WHERE id = %s", job_id)[0][0], 30,  # noqa: B023
                       "host b took the job", every=0.05, context=b.tail)
            if rows(url, "SELECT owner FROM jobs WHERE id = %s", job_id)[0][0] != "host-b":
                print("host a finished the job before it stopped: trial left out", flush=True)
                continue
            (claimed, stopped, committed), = rows(
                url, "SELECT j.lease_until - %s, h.stopped_at, EXTRACT(EPOCH FROM "
                "pg_xact_commit_timestamp(h.xmin))::double precision FROM jobs j, hosts h "
                "WHERE j.id = %s AND h.host = 'host-a'", LEASE_S, job_id)
            out.append(claimed - committed)
            if committed - stopped > 0.1:  # host a took long to commit its give-back
                print(f"host a's give-back committed {committed - stopped:.3f} s after its "
                      f"statement; host b claimed {claimed - committed:.3f} s after the "
                      "commit", flush=True)
            until(url, "SELECT state FROM jobs WHERE id = %s", (job_id,), [("done",)], 120,
                  "host b finished it", b.tail)
        return out
    finally:
        engines[0].update(default={"delay_s": 0.3})
        b.cleanup(grace=10)


def connections(root: Path, engine: StandinServer, url: str) -> int:
    """Connections to the database while one host runs (idle)."""
    a = host(root, "host-a", engine, root / "spool", url)
    try:
        a.start()
        a.wait_answering(60)
        time.sleep(1)
        return int(rows(url, "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = "
                        "current_database() AND pid <> pg_backend_pid()")[0][0])
    finally:
        a.cleanup(grace=10)


def summary(values: list[float]) -> dict[str, Any]:
    return {"n": len(values), "median_ms": round(statistics.median(values) * 1000),
            "max_ms": round(max(values) * 1000), "min_ms": round(min(values) * 1000),
            "ms": [round(v * 1000) for v in values]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", default="notify")
    p.add_argument("--retries", type=int, default=10)
    p.add_argument("--given-back", type=int, default=3)
    p.add_argument("--settle", type=float, default=2.0,
                   help="watch.settle_seconds (2.0, the default)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    SETTLE_S[0] = args.settle
    server = PgServer().start()
    # The give-back's commit time (pg_xact_commit_timestamp), not its statement's.
    with psycopg.connect(server.url(), autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET track_commit_timestamp = on")
    server.restart()
    code = ("this checkout" if Path(chandrad.__file__).resolve().is_relative_to(REPO)
            else "an export on PYTHONPATH")
    result: dict[str, Any] = {"date": dt.date.today().isoformat(), "label": args.label,
                              "code": code, "settle_seconds": args.settle}
    with tempfile.TemporaryDirectory(prefix="chandrad-wake-bench-") as tmp:
        top = Path(tmp)
        engines = [StandinServer(top / f"engine-{i}", {"delay_s": 0.3, "max_running": 2}
                                 ).start() for i in range(2)]
        try:
            result["connections_per_host"] = connections(top / "conn", engines[0],
                                                         server.new_database())
            result["retry"] = summary(retry_trials(top / "retry", engines,
                                                   server.new_database(), args.retries))
            print(json.dumps(result["retry"]), flush=True)
            if args.given_back:
                result["given_back"] = summary(given_back_trials(
                    top / "given", engines, server.new_database(), args.given_back))
                print(json.dumps(result["given_back"]), flush=True)
        finally:
            for e in engines:
                e.stop()
            server.close()
    result["load_1m"] = round(os.getloadavg()[0], 1)
    out = args.out or REPO / "bench" / "results" / (
        f"{result['date']}-cluster-wake-{args.label}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
