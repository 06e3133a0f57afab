"""Pages/s of chandrad against its engines' summed capacity: one host with 1, 2, 4, 8
engines (SQLite and PostgreSQL store), then two hosts on one PostgreSQL against one host
with the same engines.

The engines are stand-ins with a GPU's shape and no CPU of their own to speak of
(``tests/standin_engine.py``: each request sleeps ``--latency`` s, at most
``--concurrency`` at once, the rest wait their turn), reached through ``engine.url`` with
``max_num_seqs`` = the concurrency, so an engine's capacity is exactly
``concurrency / latency`` pages/s. The daemons are real (``tests/daemon_harness.py``),
render for real (``ocr.render_workers``), and share one inbox; the PostgreSQL server is
the tests' own (``tests/pg_server.py``). One run: ``--copies`` copies of a 15-page PDF
renamed into the inbox at once, timed from the first rename to the last input in
``done/``. PostgreSQL's commits per page come from ``pg_stat_database.xact_commit``.

The JSON goes to ``bench/results/DATE-cluster.json`` and a table is printed. On a shared
2-core box the render CPU is the first limit; the ratios within one run are what counts.

``--one-document N``: instead, one N-page PDF (the 15-page one repeated) on PostgreSQL:
1 host with 1 engine, 1 host with 2 engines, 2 hosts with 1 engine each (the second host
helps with the first one's document page by page); ``DATE-cluster-one-document.json``.

Usage: ``.venv/bin/python bench/cluster.py [--latency 0.5] [--concurrency 4] [--copies 8]
[--one-document 60]``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import psycopg  # noqa: E402
import pymupdf  # noqa: E402
from daemon_harness import Daemon  # noqa: E402
from pg_server import PgServer  # noqa: E402
from standin_engine import StandinServer  # noqa: E402
from waiting import wait_until  # noqa: E402

DOC = REPO / "tests" / "corpus" / "good" / "digital_federal-register_15p.pdf"
PAGES_PER_DOC = 15


class HostDaemon(Daemon):
    """A harness daemon on shared folders, with ``[daemon]`` keys added."""

    def __init__(self, root: Path, engine: str, shared: Path, daemon_keys: str,
                 render_workers: int) -> None:
        self.shared = shared
        self.daemon_keys = daemon_keys
        super().__init__(root, engine, settle=0.2, poll_interval=0.2,
                         ocr={"max_output_tokens": 48, "retries": 1, "request_timeout": 60,
                              "render_workers": render_workers},
                         tables='[metrics]\nlisten = ""\n')

    def config_text(self) -> str:
        return super().config_text().replace("[daemon]\n", "[daemon]\n" + self.daemon_keys, 1)

    @property
    def folders(self) -> Path:
        return self.shared


def engine_toml(urls: list[str], concurrency: int) -> str:
    listed = ", ".join(f'"{u}"' for u in urls)
    return f"[engine]\nurl = [{listed}]\n\n[engine.memory]\nmax_num_seqs = {concurrency}\n"


def commits(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT xact_commit FROM pg_stat_database "
                           "WHERE datname = current_database()").fetchone()
    return int(row[0]) if row else 0


def long_pdf(pages: int) -> bytes:
    """The 15-page PDF repeated (and cut) to ``pages`` pages."""
    mupdf: Any = pymupdf  # untyped
    with mupdf.open() as out, mupdf.open(DOC) as src:
        while out.page_count < pages:
            out.insert_pdf(src, to_page=min(PAGES_PER_DOC, pages - out.page_count) - 1)
        return bytes(out.tobytes())


def one_run(root: Path, engines: list[StandinServer], hosts: int, store_url: str,
            args: argparse.Namespace) -> dict[str, Any]:
    shared = root / "spool"
    daemons: list[HostDaemon] = []
    per_host = [engines[i::hosts] for i in range(hosts)]
    for i, mine in enumerate(per_host):
        keys = (f'store = "{store_url}"\nhost_id = "host-{i}"\nlease_s = 30.0\n'
                if store_url else "")
        daemons.append(HostDaemon(root / f"host-{i}", engine_toml([e.url for e in mine],
                                                                  args.concurrency),
                                  shared, keys, args.render_workers))
    try:
        for d in daemons:
            d.start()
        for d in daemons:
            d.wait_answering(60)
        before = commits(store_url) if store_url else 0
        staging = root / "staging"
        staging.mkdir()
        if args.one_document:
            names, per_doc, body = ["long.pdf"], args.one_document, long_pdf(args.one_document)
        else:
            names = [f"doc-{i:02d}.pdf" for i in range(args.copies)]
            per_doc, body = PAGES_PER_DOC, DOC.read_bytes()
        for name in names:
            (staging / name).write_bytes(body)
        t0 = time.monotonic()
        for name in names:
            (staging / name).rename(daemons[0].inbox / name)
        wait_until(lambda: len(list(daemons[0].done.glob("*.pdf"))) == len(names), 600,
                   "every input in done/", every=0.1,
                   context=lambda: "\n".join(d.tail(20) for d in daemons))
        seconds = time.monotonic() - t0
        pages = len(names) * per_doc
        capacity = len(engines) * args.concurrency / args.latency
        out: dict[str, Any] = {
            "hosts": hosts, "engines": len(engines), "store": "postgresql" if store_url
            else "sqlite", "pages": pages, "seconds": round(seconds, 2),
            "pages_per_s": round(pages / seconds, 2), "capacity_pages_per_s": capacity,
            "of_capacity": round(pages / seconds / capacity, 3)}
        if store_url:
            out["pg_commits_per_page"] = round((commits(store_url) - before) / pages, 2)
            with psycopg.connect(store_url, autocommit=True) as conn:
                out["pages_by_host"] = dict(conn.execute(
                    "SELECT COALESCE(p.holder, j.owner), COUNT(*) FROM pages p "
                    "JOIN jobs j ON j.id = p.job_id GROUP BY 1 ORDER BY 1").fetchall())
        return out
    finally:
        for d in daemons:
            d.cleanup(grace=10)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--latency", type=float, default=0.5)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--copies", type=int, default=8)
    p.add_argument("--render-workers", type=int, default=2)
    p.add_argument("--engines", default="1,2,4,8")
    p.add_argument("--one-document", type=int, default=0, metavar="PAGES")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    counts = [int(n) for n in args.engines.split(",")]
    server = PgServer().start()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="chandrad-cluster-bench-") as tmp:
        top = Path(tmp)
        engines = [StandinServer(top / f"engine-{i}", {"delay_s": args.latency,
                                                      "max_running": args.concurrency}).start()
                   for i in range(2 if args.one_document else max(counts))]
        try:
            if args.one_document:
                plan = [(1, 1, "postgresql"), (2, 1, "postgresql"), (2, 2, "postgresql")]
            else:
                plan = [(n, 1, store) for n in counts for store in ("sqlite", "postgresql")]
                plan += [(n, 2, "postgresql") for n in counts if n >= 2]
            for i, (n, hosts, store) in enumerate(plan):
                url = server.new_database() if store == "postgresql" else ""
                row = one_run(top / f"run-{i}", engines[:n], hosts, url, args)
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            for e in engines:
                e.stop()
            server.close()
    result = {"date": dt.date.today().isoformat(), "latency_s": args.latency,
              "concurrency": args.concurrency, "copies": args.copies,
              "render_workers": args.render_workers, "one_document": args.one_document,
              "rows": rows}
    name = "cluster-one-document" if args.one_document else "cluster"
    out = args.out or REPO / "bench" / "results" / f"{result['date']}-{name}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'hosts':>5} {'engines':>7} {'store':>10} {'pages/s':>8} {'capacity':>8} "
          f"{'of cap':>6} {'commits/page':>12}")
    for r in rows:
        print(f"{r['hosts']:>5} {r['engines']:>7} {r['store']:>10} {r['pages_per_s']:>8} "
              f"{r['capacity_pages_per_s']:>8} {r['of_capacity']:>6} "
              f"{r.get('pg_commits_per_page', '-'):>12}")
    print(f"written: {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
