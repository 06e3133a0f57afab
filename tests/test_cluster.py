"""Several hosts, one spool: real daemons on one inbox and one PostgreSQL database.

Two ``chandrad run`` (tests/daemon_harness.py), each with its own state dir and control
socket, watch one inbox and share ``daemon.store = "postgresql://…"`` (the session's real
server, tests/pg_server.py) and one stand-in engine (``engine.url``). Leases are short
(``daemon.lease_s = 3``) so a takeover fits in seconds. What must hold: every file is
done exactly once with the outputs a single daemon writes; a daemon killed mid-document
has its job finished by the other, no page stored twice; one long document is inferred
on both hosts' engines, page by page, and a helping host killed mid-document has its pages
finished by the owner; ``pg_ctl restart`` mid-run loses nothing; a server unreachable at
start is retried with ``STATUS=`` saying why; a job retried on one host is started at once
by an idle other (LISTEN/NOTIFY).
"""

from __future__ import annotations

import functools
import json
import os
import socket
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pymupdf
import pytest
from daemon_harness import Daemon, drop, free_port
from pg_server import PORT, PgServer
from standin_engine import StandinServer
from test_job_errors import Notify
from waiting import wait_until

from chandrad.ctl.client import call

FILES = ("image_hi-devanagari.png", "image_multipage-fax-g3_3p.tif",
         "digital_sf424-federal-form.pdf", "scan_filled-court-form.pdf")
LONG = "digital_federal-register_15p.pdf"  # 15 pages
LEASE_S = 3.0
NO_METRICS = '[metrics]\nlisten = ""\n'


@dataclass
class HostDaemon(Daemon):
    """A harness daemon on the shared folders under ``shared`` and a PostgreSQL store."""

    shared: Path = Path()
    store: str = ""
    host_id: str = ""

    def config_text(self) -> str:
        text = super().config_text()
        keys = f'store = "{self.store}"\nhost_id = "{self.host_id}"\nlease_s = {LEASE_S}\n'
        return text.replace("[daemon]\n", "[daemon]\n" + keys, 1)

    @property
    def folders(self) -> Path:
        return self.shared


@dataclass
class Cluster:
    url: str
    engine: StandinServer
    shared: Path
    made: list[Daemon]

    def host(self, name: str, engine: StandinServer | None = None, **env: str) -> HostDaemon:
        url = (engine or self.engine).url
        # An engine of its own is declared with its real concurrency (a GPU's shape).
        seqs = "[engine.memory]\nmax_num_seqs = 2\n" if engine else ""
        d = HostDaemon(self.shared.parent / name, f'[engine]\nurl = "{url}"\n{seqs}',
                       settle=0.3, poll_interval=0.3, tables=NO_METRICS, shared=self.shared,
                       store=self.url, host_id=name, env=env)
        self.made.append(d)
        return d

    def rows(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.url, autocommit=True) as conn:
            return conn.execute(sql, args).fetchall()

    def jobs(self) -> dict[str, tuple[str, str | None]]:
        """File name → (state, owner) of every job."""
        return {bytes(p).decode(): (s, o) for p, s, o in
                self.rows("SELECT path, state, owner FROM jobs ORDER BY id")}

    def wait_final(self, names: set[str], timeout: float, *daemons: Daemon) -> None:
        def final() -> bool:
            jobs = self.jobs()
            return names <= set(jobs) and all(jobs[n][0] in ("done", "partial", "failed")
                                               for n in names)
        wait_until(final, timeout, f"jobs final: {sorted(names)}", every=0.3,
                   context=lambda: "\n".join(d.tail(30) for d in daemons))


@pytest.fixture
def cluster(tmp_path: Path, pg_server: PgServer) -> Iterator[Cluster]:
    # Two pages at once, like a small GPU: a 15-page document takes seconds, not one.
    # Pages named by their pixels: the same pixels may come in other PNG bytes.
    engine = StandinServer(tmp_path / "engine", {"delay_s": 0.15, "max_running": 2,
                                                 "page_id": "pixels"}).start()
    c = Cluster(pg_server.new_database(), engine, tmp_path / "spool", [])
    try:
        yield c
    finally:
        for d in c.made:
            d.cleanup()
        engine.stop()


def _outputs(folder: Path) -> dict[str, str]:
    """Every Markdown and HTML output under ``folder`` by relative path (the metadata
    JSON holds timings, which differ from run to run)."""
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*"))
            if p.suffix in (".md", ".html")}


def _pages(c: Cluster) -> list[tuple[str, int, str, int, float | None]]:
    return [(bytes(p).decode(), i, s, a, f) for p, i, s, a, f in c.rows(
        "SELECT j.path, p.page_index, p.state, p.attempts, p.finished_at FROM pages p "
        "JOIN jobs j ON j.id = p.job_id ORDER BY j.path, p.page_index")]


def test_two_daemons_on_one_inbox_do_every_file_once_as_one_daemon_would(
        cluster: Cluster, corpus_dir: Path, tmp_path: Path) -> None:
    c = cluster
    single = Daemon(tmp_path / "single", f'[engine]\nurl = "{c.engine.url}"\n', settle=0.3,
                    poll_interval=0.3, tables=NO_METRICS)
    c.made.append(single)
    a, b = c.host("host-a"), c.host("host-b")
    for d in (single, a, b):
        d.start()
    for d in (single, a, b):
        d.wait_answering(60)
    for name in FILES:
        drop(corpus_dir / "good" / name, single.inbox)
        drop(corpus_dir / "good" / name, a.inbox)
    single.wait_jobs_final(set(FILES), 90)
    c.wait_final(set(FILES), 90, a, b)
    jobs = c.jobs()
    assert {n: s for n, (s, _) in jobs.items()} == dict.fromkeys(FILES, "done")
    assert sorted(p.name for p in a.done.iterdir()) == sorted(FILES)
    assert not list(a.inbox.iterdir()) and not list(a.failed.iterdir())
    pages = _pages(c)
    assert all(state == "done" and attempts == 1 for _, _, state, attempts, _ in pages)
    # One engine request per page: nothing was sent by both hosts.
    assert len(c.engine.chats()) == len(pages) * 2  # the single daemon's and the cluster's
    assert _outputs(a.output) == _outputs(single.output) != {}
    cluster_view = json.loads(a.ctl("status", "--cluster", "--json", "--config",
                                    str(a.config)).stdout)
    assert [(h["host"], h["state"]) for h in cluster_view["hosts"]] == [
        ("host-a", "up"), ("host-b", "up")]
    assert cluster_view["jobs"] == {"done": len(FILES)}
    assert cluster_view["jobs_unclaimed"] == 0
    owners = {o for _, o in jobs.values()}
    print(f"jobs by host: { {h: sum(o == h for _, o in jobs.values()) for h in owners} }")


def test_a_daemon_killed_mid_document_is_finished_by_the_other(
        cluster: Cluster, corpus_dir: Path) -> None:
    c = cluster
    c.engine.update(default={"delay_s": 0.4})
    a = c.host("host-a")
    a.start()
    a.wait_answering(60)
    drop(corpus_dir / "good" / LONG, a.inbox)
    wait_until(lambda: sum(s == "done" for _, _, s, _, _ in _pages(c)) >= 3, 60,
               "three pages done by host a", context=a.tail)
    a.kill9()
    killed = time.time()
    before = {(n, i): f for n, i, s, _, f in _pages(c) if s == "done"}
    b = c.host("host-b")
    b.start()
    wait_until(lambda: c.jobs()[LONG][1] == "host-b", 30, "host b takes the job over",
               context=b.tail)
    takeover_s = time.time() - killed
    c.wait_final({LONG}, 60, b)
    assert c.jobs()[LONG] == ("done", "host-b")
    pages = _pages(c)
    assert len(pages) == 15 and all(s == "done" and att == 1 for _, _, s, att, _ in pages)
    # The pages host a stored were kept, not computed again.
    assert {(n, i): f for n, i, s, _, f in pages if (n, i) in before} == before
    assert [p.name for p in c.shared.joinpath("done").iterdir()] == [LONG]
    md = list(c.shared.joinpath("output").rglob("*.md"))
    assert len(md) == 1 and md[0].read_text().count("stand-in page") == 15
    table = b.ctl("status", "--cluster", "--config", str(b.config)).stdout
    states = {line.split()[0]: line.split()[1] for line in table.splitlines()[1:3]}
    assert states == {"host-a": "silent", "host-b": "up"}, table
    done_lines = [line for line in b.log_path.read_text().splitlines() if "job_done" in line]
    assert done_lines and all('"host_id": "host-b"' in line for line in done_lines)
    print(f"takeover after kill -9: {takeover_s:.1f} s (lease {LEASE_S} s)")


def test_postgres_restart_mid_run_loses_nothing(
        cluster: Cluster, corpus_dir: Path, pg_server: PgServer) -> None:
    c = cluster
    c.engine.update(default={"delay_s": 0.3})
    a, b = c.host("host-a"), c.host("host-b")
    for d in (a, b):
        d.start()
    for d in (a, b):
        d.wait_answering(60)
    for name in (LONG, *FILES):
        drop(corpus_dir / "good" / name, a.inbox)
    wait_until(lambda: sum(s == "done" for _, _, s, _, _ in _pages(c)) >= 3, 60,
               "pages done before the restart", context=a.tail)
    done_before = sum(s == "done" for _, _, s, _, _ in _pages(c))
    t0 = time.monotonic()
    pg_server.restart()
    wait_until(lambda: sum(s == "done" for _, _, s, _, _ in _pages(c)) > done_before, 30,
               "a page done after the restart", context=lambda: a.tail() + b.tail())
    resumed_s = time.monotonic() - t0
    c.wait_final({LONG, *FILES}, 90, a, b)
    assert {n: s for n, (s, _) in c.jobs().items()} == dict.fromkeys((LONG, *FILES), "done")
    assert all(s == "done" and att == 1 for _, _, s, att, _ in _pages(c))
    assert sorted(p.name for p in a.done.iterdir()) == sorted((LONG, *FILES))
    assert a.alive() and b.alive()
    print(f"pg_ctl restart: first page stored {resumed_s:.1f} s after it began")


def test_a_job_cancelled_from_another_host_is_left_by_its_owner(
        cluster: Cluster, corpus_dir: Path) -> None:
    """``chandractl cancel`` on a host that does not run the job: the input goes to
    ``failed/`` with its ``cancelled`` error, and the owner drops the job at its next step
    without failing it, moving anything or writing outputs."""
    c = cluster
    c.engine.update(default={"delay_s": 0.4})
    hosts = {"host-a": c.host("host-a"), "host-b": c.host("host-b")}
    for d in hosts.values():
        d.start()
    for d in hosts.values():
        d.wait_answering(60)
    drop(corpus_dir / "good" / LONG, c.shared / "inbox")
    wait_until(lambda: sum(s == "done" for _, _, s, _, _ in _pages(c)) >= 2, 60,
               "pages done", context=lambda: "".join(d.tail() for d in hosts.values()))
    state, owner = c.jobs()[LONG]
    assert state == "running" and owner in hosts
    runs = hosts[owner]
    other = hosts["host-b" if owner == "host-a" else "host-a"]
    (job_id,), = c.rows("SELECT id FROM jobs")
    assert other.ctl_json("cancel", str(job_id))["cancelled"] == job_id
    wait_until(lambda: "job_lease_lost" in runs.log_path.read_text(), 20,
               "the owner leaves the cancelled job", context=runs.tail)
    assert c.jobs()[LONG][0] == "cancelled"
    assert json.loads((runs.failed / f"{LONG}.error.json").read_text())["code"] == "cancelled"
    assert not list(runs.output.rglob("*.md")) and not list(runs.done.iterdir())
    log = runs.log_path.read_text()
    assert "job_failed" not in log and "job_stuck" not in log and runs.alive()


def test_unreachable_postgres_at_start_is_retried_with_status_saying_why(
        cluster: Cluster, pg_server: PgServer, tmp_path: Path) -> None:
    c = cluster
    hidden = tmp_path / "pg-socket"  # the server's socket appears here later
    hidden.mkdir()
    os.chmod(hidden, 0o777)
    notify_path = tmp_path / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.settimeout(0.2)
    try:
        c.url = c.url.replace(f"host={pg_server.socket_dir}", f"host={hidden}")
        a = c.host("host-a", NOTIFY_SOCKET=str(notify_path))
        a.start()
        statuses: list[str] = []

        def said() -> bool:
            try:
                statuses.extend(line[7:] for line in notify.recv(1 << 16).decode().splitlines()
                                if line.startswith("STATUS="))
            except TimeoutError:
                pass
            return any("waiting for the store" in s for s in statuses)

        wait_until(said, 30, "STATUS= says the store is unreachable", context=a.tail)
        assert a.alive() and "store_unreachable" in a.tail()
        assert str(hidden) in statuses[-1] and "cannot be reached" in statuses[-1]
        (hidden / f".s.PGSQL.{PORT}").symlink_to(pg_server.socket_dir / f".s.PGSQL.{PORT}")
        a.wait_answering(30)
        assert a.ctl_json("status")["daemon"]["state"] == "running"
    finally:
        notify.close()


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return str(reply.read().decode())


def _sample(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_postgres_down_for_seconds_the_daemon_answers_and_carries_on(
        cluster: Cluster, corpus_dir: Path, pg_server: PgServer, tmp_path: Path) -> None:
    """PostgreSQL stopped for ~8 s (longer than a reconnect waits) under a working daemon:
    ``status`` answers from memory and says the store is unreachable, ``queue`` answers the
    typed ``store_unreachable`` error, ``pause``/``resume`` work, ``/metrics`` answers with
    ``chandrad_store_up 0``, ``STATUS=`` says ``STORE UNREACHABLE``; started again, every
    file is done once and the daemon never stopped."""
    c = cluster
    c.engine.update(default={"delay_s": 0.3})
    port = free_port()
    notify = Notify(tmp_path / "notify.sock")
    a = HostDaemon(c.shared.parent / "host-a", f'[engine]\nurl = "{c.engine.url}"\n',
                   settle=0.3, poll_interval=0.3, shared=c.shared, store=c.url,
                   host_id="host-a", tables=f'[metrics]\nlisten = "127.0.0.1:{port}"\n',
                   env={"NOTIFY_SOCKET": str(notify.path)})
    c.made.append(a)
    try:
        a.start()
        a.wait_answering(60)
        for name in (LONG, *FILES):
            drop(corpus_dir / "good" / name, a.inbox)
        wait_until(lambda: sum(s == "done" for _, _, s, _, _ in _pages(c)) >= 3, 60,
                   "pages done before the outage", context=a.tail)
        assert _sample(_scrape(port), "chandrad_cluster_hosts") is not None
        pg_server.stop()
        stopped = time.monotonic()
        try:
            time.sleep(4)  # past the 3 s a lost connection is waited for
            t0 = time.monotonic()
            status = a.ctl_json("status")
            status_s = time.monotonic() - t0
            assert status["daemon"]["store"]["problem"] == "store_unreachable", status
            assert status["queue"].get("pending", 0) + status["queue"].get("active", 0) > 0
            text = a.ctl("status").stdout
            assert "store unreachable: " in text and "cannot be reached" in text, text
            queue = a.ctl("queue", check=False)
            assert queue.returncode == 1 and "store_unreachable" in queue.stderr, queue
            assert a.ctl_json("pause")["state"] == "paused"
            assert a.ctl_json("resume")["state"] == "running"
            metrics = _scrape(port)
            assert _sample(metrics, "chandrad_store_up") == 0.0
            assert _sample(metrics, "chandrad_jobs") is None  # store-derived: absent
            line = next(s for s in reversed(notify.statuses()) if "STORE" in s)
            assert line.startswith("STORE UNREACHABLE: ") and "STORE FULL" not in line, line
            while time.monotonic() - stopped < 8:
                assert a.alive(), a.tail()
                time.sleep(0.5)
        finally:
            pg_server.start()
        down_s, back_at = time.monotonic() - stopped, time.time()
        c.wait_final({LONG, *FILES}, 90, a)
        # The server's clock stamps finished_at; this machine's is the same one.
        resumed_s = min(f for _, _, _, _, f in _pages(c) if f is not None and f > back_at
                        ) - back_at
        assert a.alive(), a.tail()
        assert {n: s for n, (s, _) in c.jobs().items()} == dict.fromkeys((LONG, *FILES), "done")
        assert sorted(p.name for p in a.done.iterdir()) == sorted((LONG, *FILES))
        md = [p for p in a.output.rglob("*.md") if p.name.startswith(Path(LONG).stem)]
        assert len(md) == 1 and md[0].read_text().count("stand-in page") == 15
        assert _sample(_scrape(port), "chandrad_store_up") == 1.0
        wait_until(lambda: not notify.statuses()[-1].startswith("STORE"), 10,
                   "STATUS= no longer says the store is unreachable")
        log = a.log_path.read_text()
        assert "task_crashed" not in log and "job_failed" not in log
        print(f"PostgreSQL down {down_s:.1f} s: status answered in {status_s:.2f} s; first "
              f"page stored {resumed_s:.1f} s after the server was back; STATUS={line[:90]}")
    finally:
        notify.close()


def test_an_idle_host_starts_a_job_retried_on_another_host_at_once(
        cluster: Cluster, corpus_dir: Path) -> None:
    """``retry`` on a paused host A: idle host B starts the job within 0.3 s (the retry's
    NOTIFY wakes it). Nothing else could: each retry is sent right after the job failed
    again, when B's 1 s poll is nearly a second away, and B's own watcher takes the input
    moved back to the inbox only once it settled (``settle_seconds`` 2, the default)."""
    c = cluster
    a, b = c.host("host-a"), c.host("host-b")
    for d in (a, b):
        d.settle = 2.0
        d.config.write_text(d.config_text())
    for d in (a, b):
        d.start()
    for d in (a, b):
        d.wait_answering(60)
    call(a.socket, "pause")
    drop(corpus_dir / "bad" / "broken_not-a-pdf-text.pdf", a.inbox)
    wait_until(lambda: list(c.jobs().values()) == [("failed", "host-b")], 60,
               "the broken file failed on host b", context=b.tail)
    (job_id,), = c.rows("SELECT id FROM jobs")

    def ran_again(since: float) -> bool:
        return c.rows("SELECT state, started_at > %s FROM jobs", since) == [("failed", True)]

    took = []
    for _ in range(3):
        sent = time.time()
        assert call(a.socket, "retry", {"job": job_id})["retried"] == [job_id]
        wait_until(functools.partial(ran_again, sent), 30, "host b ran it again", every=0.05,
                   context=b.tail)
        (started, owner), = c.rows("SELECT started_at, owner FROM jobs")
        assert owner == "host-b"
        took.append(started - sent)
    print("retry on host a -> started on host b: "
          + ", ".join(f"{s * 1000:.0f} ms" for s in took))
    assert sorted(took)[1] < 0.3, took  # the median: one stall of a loaded box aside


LONG_PAGES = 36


def _long_pdf(corpus_dir: Path, path: Path) -> Path:
    """A 36-page PDF: the 15-page document twice, then its first 6 pages."""
    mupdf: Any = pymupdf  # untyped
    with mupdf.open() as out, mupdf.open(corpus_dir / "good" / LONG) as src:
        out.insert_pdf(src)
        out.insert_pdf(src)
        out.insert_pdf(src, from_page=0, to_page=5)
        assert out.page_count == LONG_PAGES
        out.save(path)
    return path


def _engines(tmp_path: Path, delay_s: float) -> dict[str, StandinServer]:
    """One stand-in engine per host (two pages at once), to count whose engine did what."""
    return {name: StandinServer(tmp_path / f"engine-{name}", {
        "delay_s": delay_s, "max_running": 2, "page_id": "pixels"}).start()
            for name in ("host-a", "host-b")}


def test_one_long_document_is_inferred_by_both_hosts_page_by_page(
        cluster: Cluster, corpus_dir: Path, tmp_path: Path) -> None:
    """Two hosts, one 36-page PDF: the host that does not own the job helps with its pages
    (renders them from the shared inbox, infers them on its own engine, stores them under
    its page lease); every page is stored once, and the outputs are a single daemon's."""
    c = cluster
    doc = _long_pdf(corpus_dir, tmp_path / "long-36p.pdf")
    engines = _engines(tmp_path, 0.3)
    try:
        single = Daemon(tmp_path / "single", f'[engine]\nurl = "{c.engine.url}"\n',
                        settle=0.3, poll_interval=0.3, tables=NO_METRICS)
        c.made.append(single)
        hosts = {name: c.host(name, engine) for name, engine in engines.items()}
        for d in (single, *hosts.values()):
            d.start()
        for d in (single, *hosts.values()):
            d.wait_answering(60)
        drop(doc, single.inbox)
        drop(doc, c.shared / "inbox")
        single.wait_jobs_final({doc.name}, 120)
        c.wait_final({doc.name}, 120, *hosts.values())
        state, owner = c.jobs()[doc.name]
        assert state == "done" and owner is not None
        helper = next(h for h in hosts if h != owner)
        pages = c.rows("SELECT page_index, state, attempts, holder FROM pages ORDER BY 1")
        assert [(i, s, a) for i, s, a, _ in pages] == [
            (i, "done", 1) for i in range(LONG_PAGES)]
        helped = sum(holder == helper for *_, holder in pages)
        chats = {name: len(e.chats()) for name, e in engines.items()}
        # Both hosts' engines inferred pages of the one document, each page once.
        assert chats[helper] == helped > 0 and chats[owner] == LONG_PAGES - helped > 0, chats
        assert _outputs(c.shared / "output") == _outputs(single.output) != {}
        assert [p.name for p in c.shared.joinpath("done").iterdir()] == [doc.name]
        view = json.loads(hosts[owner].ctl("status", "--cluster", "--json", "--config",
                                           str(hosts[owner].config)).stdout)
        assert all(h["pages_helping"] == 0 for h in view["hosts"])
        print(f"pages inferred per host: {chats} (owner {owner})")
    finally:
        for e in engines.values():
            e.stop()


def test_a_helping_host_killed_mid_document_leaves_its_pages_to_the_owner(
        cluster: Cluster, corpus_dir: Path, tmp_path: Path) -> None:
    """kill -9 of the host helping with another host's document: its page leases expire,
    the owner takes those pages back and finishes the job; the pages the helper stored are
    kept (not computed again), none is stored twice, none is lost. Before, the helper is
    paused (it gives its pages back at once) and resumed."""
    c = cluster
    doc = _long_pdf(corpus_dir, tmp_path / "long-36p.pdf")
    engines = _engines(tmp_path, 0.4)
    try:
        a = c.host("host-a", engines["host-a"])
        a.start()
        a.wait_answering(60)
        drop(doc, a.inbox)
        wait_until(lambda: c.jobs().get(doc.name, ("", None))[1] == "host-a" and c.rows(
            "SELECT COUNT(*) FROM pages")[0][0] == LONG_PAGES, 60, "host a runs the job",
            context=a.tail)
        b = c.host("host-b", engines["host-b"])
        b.start()

        def helper_busy() -> bool:
            (stored, held), = c.rows(
                "SELECT COUNT(*) FILTER (WHERE state = 'done'), COUNT(*) FILTER (WHERE "
                "state IN ('pending', 'in_flight')) FROM pages WHERE holder = 'host-b'")
            return bool(stored >= 2 and held >= 2)
        wait_until(helper_busy, 60, "host b stores pages and holds more",
                   context=lambda: a.tail() + b.tail())
        # Paused, the helper gives its pages back at once; resumed, it helps again.
        assert b.ctl_json("pause")["state"] == "paused"
        wait_until(lambda: c.rows("SELECT COUNT(*) FROM pages WHERE holder = 'host-b' AND "
                                  "state IN ('pending', 'in_flight')")[0][0] == 0, 5,
                   "the paused helper gives its pages back", context=b.tail)
        assert b.ctl_json("resume")["state"] == "running"
        wait_until(helper_busy, 60, "host b helps again", context=lambda: a.tail() + b.tail())
        b.kill9()
        killed = time.time()
        rows = c.rows("SELECT page_index, state, finished_at FROM pages "
                      "WHERE holder = 'host-b'")
        before = {i: f for i, s, f in rows if s == "done"}
        held = {i for i, s, _ in rows if s in ("pending", "in_flight")}
        c.wait_final({doc.name}, 90, a)
        assert c.jobs()[doc.name] == ("done", "host-a")
        pages = c.rows("SELECT page_index, state, attempts, holder, finished_at FROM pages "
                       "ORDER BY 1")
        assert [(i, s, att) for i, s, att, _, _ in pages] == [
            (i, "done", 1) for i in range(LONG_PAGES)]
        # The helper's stored pages were kept as they were; the ones it held went back.
        assert {i: f for i, _, _, h, f in pages if h == "host-b"} == before
        taken_back = {i: f for i, _, _, h, f in pages if i in held}
        assert held and all(pages[i][3] is None for i in held)  # done by the owner
        after_s = min(taken_back.values()) - killed
        md = list(c.shared.joinpath("output").rglob("*.md"))
        assert len(md) == 1 and md[0].read_text().count("stand-in page") == LONG_PAGES
        assert [p.name for p in c.shared.joinpath("done").iterdir()] == [doc.name]
        log = a.log_path.read_text()
        assert "pages_reclaimed" in log and "job_failed" not in log and a.alive()
        print(f"helper killed: {len(before)} of its pages kept, {len(held)} taken back by "
              f"the owner, the first stored {after_s:.1f} s after the kill (lease {LEASE_S} s)")
    finally:
        for e in engines.values():
            e.stop()
