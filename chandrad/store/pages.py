"""The ``pages`` table (and its per-state counts): every SQL statement on a job's pages.

A page moves along ``PAGE_TRANSITIONS`` only; each move is one transaction that checks the
page's current state first (an illegal move raises InternalError and changes nothing).
Steps that belong to a job's own transaction (its content replaced, its retry) join the
caller's transaction (``tx`` nests).
"""

from __future__ import annotations

import json
import time
from typing import Any

from chandrad import names
from chandrad.errors import InternalError
from chandrad.states import PAGE_TRANSITIONS, PageState, is_legal
from chandrad.store.database import SqlDatabase
from chandrad.store.records import Page

_PAGE_COLUMNS = """
    job_id, page_index, state, attempts, releases, width, height, result_json, error,
    seconds, started_at, finished_at
"""
#: A page back to pending, attempts as they are (the answer was unusable, or is for
#: content that is gone).
_REQUEUE = "UPDATE pages SET state = 'pending', started_at = NULL "
#: An in-flight page given back without an answer: the attempt is returned, a release
#: counted (the engine died under it, or the daemon stopped).
_RELEASE = ("UPDATE pages SET state = 'pending', "
            "attempts = CASE WHEN attempts > 0 THEN attempts - 1 ELSE 0 END, "
            "releases = releases + 1, started_at = NULL ")


class PageTable:
    """The pages of every job."""

    def __init__(self, db: SqlDatabase) -> None:
        self._db = db

    def create(self, job_id: int, count: int) -> None:
        """Pages ``0..count-1`` of a job as pending; those that exist are kept."""
        with self._db.tx() as c:
            c.executemany(
                "INSERT INTO pages (job_id, page_index, state) "
                "VALUES (?, ?, 'pending') ON CONFLICT DO NOTHING",
                ((job_id, i) for i in range(count)),
            )

    def pages(self, job_id: int) -> list[Page]:
        """All pages of a job, in page order."""
        rows = self._db.conn.execute(
            f"SELECT {_PAGE_COLUMNS} FROM pages WHERE job_id = ? ORDER BY page_index",
            (job_id,),
        ).fetchall()
        return [page_from_row(r) for r in rows]

    def page(self, job_id: int, index: int) -> Page | None:
        """One page of a job, or ``None``."""
        row = self._db.conn.execute(
            f"SELECT {_PAGE_COLUMNS} FROM pages WHERE job_id = ? AND page_index = ?",
            (job_id, index),
        ).fetchone()
        return None if row is None else page_from_row(row)

    def claim(self, job_id: int, index: int) -> None:
        """``pending -> in_flight``; charges one attempt."""
        with self._db.tx() as c:
            self._check(job_id, index, PageState.IN_FLIGHT)
            c.execute(
                "UPDATE pages SET state = 'in_flight', attempts = attempts + 1, "
                "started_at = ? WHERE job_id = ? AND page_index = ?",
                (time.time(), job_id, index),
            )

    def finish(
        self, job_id: int, index: int, *, result: dict[str, Any], width: int, height: int,
        seconds: float,
    ) -> None:
        """``in_flight -> done``, storing the parsed result so a restart never recomputes it."""
        payload = json.dumps(names.clean(result), ensure_ascii=False, separators=(",", ":"))
        with self._db.tx() as c:
            self._check(job_id, index, PageState.DONE)
            c.execute(
                "UPDATE pages SET state = 'done', result_json = ?, width = ?, height = ?, "
                "seconds = ?, error = NULL, finished_at = ? WHERE job_id = ? AND page_index = ?",
                (payload, width, height, seconds, time.time(), job_id, index),
            )

    def fail(self, job_id: int, index: int, error: str) -> None:
        """``pending|in_flight -> failed`` with the reason."""
        with self._db.tx() as c:
            self._check(job_id, index, PageState.FAILED)
            c.execute(
                "UPDATE pages SET state = 'failed', error = ?, finished_at = ? "
                "WHERE job_id = ? AND page_index = ?",
                (names.text(error), time.time(), job_id, index),
            )

    def release(self, job_id: int, index: int, *, charge: bool = False) -> None:
        """``in_flight -> pending``. Uncharged (the default: the engine failed under the
        page) gives the attempt back and counts a release; charged keeps the attempt
        (the answer was unusable and the page will be tried again)."""
        with self._db.tx() as c:
            self._check(job_id, index, PageState.PENDING)
            c.execute((_REQUEUE if charge else _RELEASE) + "WHERE job_id = ? AND page_index = ?",
                      (job_id, index))

    def open_pages(self, job_id: int) -> list[int]:
        """The indexes of a job's pages not done or failed yet (pending, in flight)."""
        return [int(r[0]) for r in self._db.conn.execute(
            "SELECT page_index FROM pages WHERE job_id = ? AND state IN ('pending', "
            "'in_flight') ORDER BY page_index", (job_id,))]

    def release_all_in_flight(self) -> int:
        """Give every in-flight page back to the queue (engine died, or the daemon stopped
        without doing so); returns how many."""
        with self._db.tx() as c:
            return int(c.execute(_RELEASE + "WHERE state = 'in_flight'").rowcount)

    def requeue_in_flight(self, job_id: int) -> None:
        """A job's in-flight pages back to pending, attempts as they are (its input was
        replaced: the answers on their way are for content that is gone)."""
        with self._db.tx() as c:
            c.execute(_REQUEUE + "WHERE job_id = ? AND state = 'in_flight'", (job_id,))

    def requeue_failed(self, job_id: int) -> None:
        """A job's failed pages back to pending with a fresh attempt budget (a retry is
        the operator's call)."""
        with self._db.tx() as c:
            c.execute(
                "UPDATE pages SET state = 'pending', attempts = 0, error = NULL, "
                "finished_at = NULL WHERE job_id = ? AND state = 'failed'",
                (job_id,),
            )

    def discard(self, job_id: int) -> None:
        """Delete a job's pages (computed from content the job no longer has)."""
        with self._db.tx() as c:
            c.execute("DELETE FROM pages WHERE job_id = ?", (job_id,))

    def done_since(self, t: float) -> int:
        """Pages finished ``done`` at or after wall-clock time ``t`` (for pages/min)."""
        row = self._db.conn.execute(
            "SELECT COUNT(*) FROM pages WHERE state = 'done' AND finished_at >= ?", (t,)
        ).fetchone()
        return int(row[0])

    def counts(self) -> dict[str, int]:
        """Pages per state (pending, in_flight, done, failed), over every job."""
        return {str(state): int(n) for state, n in self._db.conn.execute(
            "SELECT state, n FROM page_counts WHERE n > 0")}

    def _check(self, job_id: int, index: int, new: PageState) -> None:
        row = self._db.conn.execute(
            "SELECT state FROM pages WHERE job_id = ? AND page_index = ?"
            + self._db.lock_rows, (job_id, index)
        ).fetchone()
        if row is None:
            raise InternalError(f"job {job_id} has no page {index}", job=job_id, page=index)
        old = PageState(row[0])
        if not is_legal(PAGE_TRANSITIONS, old, new):
            raise InternalError(f"job {job_id} page {index}: illegal transition {old} -> {new}",
                                job=job_id, page=index, old=old.value, new=new.value)


def page_from_row(row: tuple[Any, ...]) -> Page:
    """A ``Page`` from a row of ``_PAGE_COLUMNS``."""
    return Page(
        job_id=row[0], index=row[1], state=PageState(row[2]), attempts=row[3],
        releases=row[4], width=row[5], height=row[6],
        result=json.loads(row[7]) if row[7] is not None else None, error=row[8],
        seconds=row[9], started_at=row[10], finished_at=row[11],
    )
