"""The store's per-tick queries cost the same with 100 jobs as with thousands (a
"10,000-file backlog while the engine restarts every 60 s").

``Store.counts()`` feeds the status line, which the daemon rebuilds every main-loop tick
(and on every engine or daemon state change); ``page_counts()`` feeds every metrics
scrape. The cost is counted in SQLite virtual-machine steps on a real database (a progress
handler), not in seconds, so a loaded machine cannot make the test pass or fail.
"""

from __future__ import annotations

import functools
import hashlib
import re
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chandrad.states import JobState
from chandrad.store import DB_NAME, MIGRATIONS, Store

ROOT = Path("/srv/inbox")


def _fill(store: Store, jobs: int) -> None:
    """``jobs`` accepted files: a fifth finished with one page each, two running, the rest
    pending; the shape of a large backlog being worked through."""
    items = [(0, ROOT, ROOT / f"b{n:05d}.png", 100, 1.0,
              hashlib.sha256(str(n).encode()).hexdigest()) for n in range(jobs)]
    accepted = store.accept_many(items)
    for job in accepted[: jobs // 5 + 2]:
        store.set_job_state(job.id, JobState.RUNNING)
        store.init_pages(job.id, 1)
        if job.id > 2:
            store.claim_page(job.id, 0)
            store.finish_page(job.id, 0, result={"markdown": ""}, width=1, height=1,
                              seconds=0.1)
            store.set_job_state(job.id, JobState.DONE)


def _steps(store: Store, call: Callable[[], Any]) -> int:
    """SQLite VM instructions (in units of 10) that ``call`` executes."""
    conn: sqlite3.Connection = store._conn
    count = [0]

    def tick() -> int:
        count[0] += 1
        return 0

    conn.set_progress_handler(tick, 10)
    try:
        call()
    finally:
        conn.set_progress_handler(None, 10)
    return count[0]


def _truth(store: Store, table: str) -> dict[str, int]:
    return {s: n for s, n in store._conn.execute(
        f"SELECT state, COUNT(*) FROM {table} GROUP BY state")}


def test_status_counts_cost_does_not_grow_with_the_backlog(tmp_path: Path) -> None:
    cost: dict[int, tuple[int, int]] = {}
    for jobs in (100, 3000):
        store = Store.open(tmp_path / f"state-{jobs}")
        try:
            _fill(store, jobs)
            counts = store.counts()
            assert counts["pending"] == jobs - (jobs // 5 + 2)
            assert counts["done"] == jobs // 5 and counts["active"] == 2
            cost[jobs] = (_steps(store, store.counts), _steps(store, store.page_counts))
        finally:
            store.close()
    small, large = cost[100], cost[3000]
    # 30 times the jobs: the same few rows read (before: a scan of every job and page).
    assert large[0] <= small[0] + 5, cost
    assert large[1] <= small[1] + 5, cost


def test_counts_follow_every_state_change(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state")
    try:
        _fill(store, 40)
        jobs = store.list_jobs(limit=100)
        running = [j for j in jobs if j.state is JobState.RUNNING]
        pending = [j for j in jobs if j.state is JobState.PENDING]
        # Pages in every state, a release of everything in flight, a retry, a cancel,
        # content replaced under a running job and under a pending one.
        store.claim_page(running[0].id, 0)
        store.release_all_in_flight()
        store.claim_page(running[0].id, 0)
        store.fail_page(running[0].id, 0, "bad page")
        store.set_job_state(running[0].id, JobState.FAILED)
        assert store.retry(running[0].id)
        assert store.cancel(pending[0].id)
        store.supersede(running[1].id, 5, 2.0, "f" * 64)
        store.accept(0, ROOT, pending[1].abs_path, 7, 3.0, "e" * 64)
        store.set_job_state(pending[2].id, JobState.RUNNING)
        store.init_pages(pending[2].id, 3)
        store.claim_page(pending[2].id, 1)
        with store._tx() as c:  # a job removed with its pages (ON DELETE CASCADE)
            c.execute("DELETE FROM jobs WHERE id = ?", (pending[3].id,))
        truth = _truth(store, "jobs")
        expected = {"pending": 0, "active": 0, "held": 0, "done": 0, "failed": 0,
                    "partial": 0, "cancelled": 0}
        for state, n in truth.items():
            expected["active" if state == JobState.RUNNING else state] = n
        assert store.counts() == expected
        assert store.page_counts() == _truth(store, "pages")
    finally:
        store.close()


def test_counts_of_a_store_from_before_the_counters(tmp_path: Path) -> None:
    """A database written by a chandrad without the counters (schema 3) is counted right
    after the upgrade."""
    state = tmp_path / "state"
    store = Store.open(state)
    _fill(store, 30)
    before = (store.counts(), store.page_counts())
    store.close()
    conn = sqlite3.connect(state / DB_NAME)
    # Back to schema 3: drop what the later migrations create (triggers and indexes first).
    created = re.findall(r"CREATE\s+(TRIGGER|INDEX|TABLE)\s+(\w+)", "\n".join(MIGRATIONS[3:]))
    for kind, name in sorted(created, key=lambda c: c[0] == "TABLE"):
        conn.execute(f"DROP {kind} IF EXISTS {name}")
    conn.execute("UPDATE schema_version SET version = 3")
    conn.commit()
    conn.close()
    store = Store.open(state)
    try:
        assert store.schema_version() == len(MIGRATIONS)
        assert (store.counts(), store.page_counts()) == before
        assert before[0]["done"] == 6 and before[1] == {"done": 6, "pending": 2}
    finally:
        store.close()


def test_pages_per_minute_reads_only_the_index(tmp_path: Path) -> None:
    """``pages_done_since`` (the pages/min of every status call and metrics scrape) counts
    from the index alone: pages finished before the window cost nothing, and no page's row,
    whose result can hold its crops in overflow pages, is read (schema 5)."""
    cost: dict[int, int] = {}
    for jobs in (100, 3000):
        store = Store.open(tmp_path / f"state-{jobs}")
        try:
            _fill(store, jobs)
            done = jobs // 5
            # All but three pages finished an hour ago, outside the 15-minute window.
            store._conn.execute("UPDATE pages SET finished_at = finished_at - 3600 "
                                "WHERE state = 'done' AND job_id > 5")
            store._conn.commit()
            since = time.time() - 900
            assert store.pages_done_since(since) == 3
            assert store.pages_done_since(since - 7200) == done
            plan = " ".join(str(row) for row in store._conn.execute(
                "EXPLAIN QUERY PLAN SELECT COUNT(*) FROM pages "
                "WHERE state = 'done' AND finished_at >= ?", (since,)))
            assert "COVERING INDEX" in plan, plan
            cost[jobs] = _steps(store, functools.partial(store.pages_done_since, since))
        finally:
            store.close()
    # 30 times the history: the same three rows read (before: every done page's row).
    assert cost[3000] <= cost[100] + 5, cost
