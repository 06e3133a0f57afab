"""Pages leased to a helping host on PostgreSQL: one long document shared by several hosts.

A job is leased to one host, its *owner*, which probes it, creates its pages, runs them,
writes the outputs and moves the input. Another host whose engines have room *helps*:
:meth:`PageLeases.claim` leases it pending pages of running jobs owned by other live hosts
(``holder`` = the helper, ``hold_until`` = the server's clock + ``lease_s``; ``FOR UPDATE
SKIP LOCKED``, last pages first, as the owner works from the first). The helper renders,
infers and stores those pages itself; every step on such a page checks, in its own
transaction, that the page is still the helper's and its job still running
(:meth:`PageLeases.fence`, else PageTaken: the helper drops the page, storing nothing).
The helper's heartbeat renews its pages with its jobs (``leases.LeaseKeeper``); a helper
that dies stops renewing, and the owner takes back pages whose lease expired
(:meth:`PageLeases.reclaim`). The owner leaves a page a helper holds (:meth:`PageLeases.
check_unheld`, else PageTaken). A page a helper stored or failed keeps its ``holder`` (who
did it) until a retry of the job requeues it.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from chandrad import names
from chandrad.errors import PageTaken
from chandrad.store.leases import HELD_STATES, NOW
from chandrad.store.pg_database import PgDatabase

#: A held page given up: back to pending and to no holder; an in-flight one gives its
#: attempt back and counts a release, as ``pages._RELEASE`` does.
_UNHOLD = (
    "UPDATE pages SET holder = NULL, hold_until = NULL, state = 'pending', "
    "attempts = CASE WHEN state = 'in_flight' AND attempts > 0 THEN attempts - 1 "
    "ELSE attempts END, releases = releases + CASE WHEN state = 'in_flight' THEN 1 "
    f"ELSE 0 END, started_at = NULL WHERE state IN {HELD_STATES} ")


class PageLeases:
    """The page leases of one host on one database (used from the event loop's thread)."""

    def __init__(self, db: PgDatabase, host: str, lease_s: float) -> None:
        self._db = db
        self.host = host
        self.lease_s = lease_s

    def claim(self, roots: Collection[Path], limit: int) -> list[tuple[int, int]]:
        """Lease up to ``limit`` pending pages of running jobs of ``roots`` that other
        live hosts own (not held by anyone): ``(job id, page index)``, last pages first."""
        if limit <= 0 or not roots:
            return []
        marks = ", ".join("?" * len(roots))
        with self._db.tx() as c:
            rows = c.execute(
                "WITH c AS (SELECT p.job_id, p.page_index FROM pages p "
                "JOIN jobs j ON j.id = p.job_id WHERE p.state = 'pending' "
                "AND p.holder IS NULL AND j.state = 'running' AND j.owner <> ? "
                f"AND j.lease_until > {NOW} AND j.input_root IN ({marks}) "
                "ORDER BY p.job_id, p.page_index DESC LIMIT ? FOR UPDATE OF p SKIP LOCKED) "
                f"UPDATE pages p SET holder = ?, hold_until = {NOW} + ? FROM c "
                "WHERE p.job_id = c.job_id AND p.page_index = c.page_index "
                "RETURNING p.job_id, p.page_index",
                (self.host, *(names.fsbytes(r) for r in roots), limit, self.host,
                 self.lease_s)).fetchall()
        return sorted((int(j), int(i)) for j, i in rows)

    def fence(self, job_id: int, index: int) -> None:
        """Raise PageTaken unless this host holds the page and its job is running (the
        owner took the page back after its lease expired, or the job ended). Locks the
        page's row for the caller's transaction."""
        row = self._db.conn.execute(
            "SELECT p.holder, j.state FROM pages p JOIN jobs j ON j.id = p.job_id "
            "WHERE p.job_id = ? AND p.page_index = ? FOR UPDATE OF p",
            (job_id, index)).fetchone()
        if row is None or row[0] != self.host or row[1] != "running":
            holder, state = (None, None) if row is None else row
            raise PageTaken(f"page {index + 1} of job {job_id} is no longer this host's "
                            f"(held by {holder or 'no host'}, job {state}); this host "
                            "leaves it", job=job_id, page=index, owner=holder)

    def check_unheld(self, job_id: int, index: int) -> None:
        """The owner's check: raise PageTaken when a helping host holds the page (or
        finished it). Locks the page's row for the caller's transaction."""
        row = self._db.conn.execute(
            "SELECT holder FROM pages WHERE job_id = ? AND page_index = ? FOR UPDATE",
            (job_id, index)).fetchone()
        if row is not None and row[0] is not None:
            raise PageTaken(f"page {index + 1} of job {job_id} is held by host {row[0]}, "
                            "which helps with it; this host leaves it", job=job_id,
                            page=index, owner=row[0])

    def unhold_requeued(self) -> None:
        """Pages of jobs waiting to start (a retry requeued them) belong to no helper."""
        with self._db.tx() as c:
            c.execute("UPDATE pages SET holder = NULL, hold_until = NULL WHERE state = "
                      "'pending' AND holder IS NOT NULL AND job_id IN "
                      "(SELECT id FROM jobs WHERE state = 'pending')")

    def drop(self, job_id: int, index: int) -> None:
        """Give up a page this host holds and did not finish (its work was cancelled)."""
        with self._db.tx() as c:
            c.execute(_UNHOLD + "AND holder = ? AND job_id = ? AND page_index = ?",
                      (self.host, job_id, index))

    def drop_all(self) -> int:
        """Give up every open page this host holds (it starts, stops, or its engine died);
        returns how many."""
        with self._db.tx() as c:
            return int(c.execute(_UNHOLD + "AND holder = ?", (self.host,)).rowcount)

    def reclaim(self, job_id: int) -> int:
        """The owner takes back the job's open pages whose helper's lease expired (the
        helper died, stalled or lost the store); returns how many."""
        with self._db.tx() as c:
            return int(c.execute(
                _UNHOLD + f"AND job_id = ? AND holder IS NOT NULL AND hold_until < {NOW}",
                (job_id,)).rowcount)
