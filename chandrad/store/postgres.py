"""The PostgreSQL store: one database, several hosts (``daemon.store = "postgresql://…"``).

:class:`PgStore` keeps the queue's contract (``StoreBackend``) with the same tables as the
SQLite store, and adds what sharing it between hosts needs:

- **a file is accepted once cluster-wide**: a unique index on the open jobs' (path,
  content) and ``INSERT … ON CONFLICT DO NOTHING`` (two hosts watching one inbox);
- **a job is leased to one host**: :meth:`PgStore.next_jobs` claims the jobs it returns
  (``owner`` = this host's id, ``lease_until`` = the server's clock + ``lease_s``) with
  ``FOR UPDATE SKIP LOCKED``, so hosts polling together never get the same job; a job
  whose lease expired (its host died or lost the database) is claimed by another host and
  resumed at page granularity: its done pages are kept, the dead host's in-flight pages
  go back to pending (``JobRunner.run``), nothing done is done again;
- **leases are kept alive** by a :class:`~chandrad.store.leases.LeaseKeeper` thread with
  its own connection, every ``lease_s / 3``; a clean close gives the leases back at once;
- **a host that lost its lease stops touching the job** (fencing): every page and job
  step checks, in its own transaction, that the job is still this host's, else raises
  LeaseLost and changes nothing; the host that owns the job writes its outputs and moves
  its input;
- **at open, only this host's in-flight pages are released** (on SQLite: all of them);
  another host's pages are not ours to release, its lease expiry hands them over;
- **pages of one job are shared**: a host with room helps with other hosts' running jobs
  page by page (``page_leases``: a page leased to its helper, renewed by the same
  heartbeat, fenced by page); the owner leaves those pages to their helper, takes back
  any whose lease expired, and writes the outputs once every page is stored;
- **learned profiles stay per host** (they are per GPU): keys are prefixed with the host id;
- **idle hosts hear of new work at once**: the schema's triggers NOTIFY in the transaction
  that makes work another host could take, and :meth:`PgStore.listen_for_work` hears it on
  a :class:`~chandrad.store.pg_listen.WorkListener` thread with its own connection (the
  dispatcher's poll stays the fallback); a retried job belongs to no host, so any takes it.

Use from one thread (the event loop's), like the SQLite store.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from chandrad import names
from chandrad.errors import HostIdInUse, LeaseLost
from chandrad.states import JobState
from chandrad.store.jobs import _JOB_COLUMNS, job_from_row
from chandrad.store.leases import NOW, LeaseKeeper
from chandrad.store.operations import TableStore
from chandrad.store.page_leases import PageLeases
from chandrad.store.pages import _PAGE_COLUMNS, _RELEASE, page_from_row
from chandrad.store.pg_database import PgDatabase
from chandrad.store.pg_listen import WorkListener
from chandrad.store.pg_schema import migrate, schema_version
from chandrad.store.records import ClusterCounts, Job, Page, Recovered

#: Default seconds a job stays leased to its host without a heartbeat (``daemon.lease_s``).
DEFAULT_LEASE_S = 30.0
#: A host in ``hosts``: beating within its lease, silent for longer, or stopped cleanly.
HOST_STATES = ("up", "silent", "stopped")
_OPEN = "('pending', 'running', 'held')"
_HOST_STATE = (f"CASE WHEN stopped_at IS NOT NULL THEN 'stopped' WHEN {NOW} - seen_at <= "
               "lease_s THEN 'up' ELSE 'silent' END")
#: :meth:`PgStore.cluster_counts`' one query: ``(kind, state, owner, count)`` rows.
_CLUSTER_COUNTS = (
    f"SELECT 'host', {_HOST_STATE}, '', COUNT(*) FROM hosts GROUP BY 2 "
    f"UNION ALL SELECT 'job', state, COALESCE(owner, ''), COUNT(*) FROM jobs "
    f"WHERE state IN {_OPEN} GROUP BY state, owner "
    f"UNION ALL SELECT 'expired', '', '', COUNT(*) FROM jobs WHERE state IN {_OPEN} "
    f"AND owner IS NOT NULL AND lease_until < {NOW}")



class PgStore(TableStore):
    """The PostgreSQL store of one host. Build with :meth:`open`; use from one thread."""

    def __init__(self, db: PgDatabase, host: str, lease_s: float) -> None:
        super().__init__(db)
        self._db = db
        self.host = host
        self.lease_s = lease_s
        self.location = db.location
        self._keeper = LeaseKeeper(db.url, host, lease_s)
        self._listener = WorkListener(db.url, host, lease_s)
        self._held = PageLeases(db, host, lease_s)
        #: Jobs this host claimed from another host whose lease had expired.
        self.takeovers = 0
        #: Pages of other hosts' jobs this host stored (it helped with them).
        self.pages_helped = 0

    @classmethod
    def open(cls, url: str, host: str, lease_s: float = DEFAULT_LEASE_S) -> PgStore:
        """Connect, migrate, release this host's in-flight pages, start the heartbeat.

        Raises:
            StoreUnreachable: the server cannot be reached (nothing was changed).
            HostIdInUse: another live host has this id (nothing was changed).
            InternalError: the database's schema is newer than this chandrad.
        """
        db = PgDatabase.connect(url, lease_s)
        try:
            migrate(db)
            _refuse_live_namesake(db, host)
            store = cls(db, host, lease_s)
            store.recovered = store._recover()
            store._keeper.start()
        except BaseException:
            db.close()
            raise
        return store

    def _recover(self) -> Recovered:
        with self._db.tx() as c:
            released = self._release_own() + self._held.drop_all()
            running = c.execute("SELECT COUNT(*) FROM jobs WHERE state = 'running' "
                                "AND owner = ?", (self.host,)).fetchone()[0]
        return Recovered(pages_released=int(released), jobs_running=int(running))

    def close(self) -> None:
        """Stop listening and the heartbeat, give this host's leases back (others may take
        its jobs at once), close the connection."""
        self._listener.stop()
        self._keeper.stop()
        try:
            self._keeper.give_back()
        finally:
            self._db.close()

    def schema_version(self) -> int:
        return schema_version(self._db)

    def _tx(self) -> AbstractContextManager[Any]:
        """A write transaction (``PgDatabase.tx``), for tests that change rows directly."""
        return self._db.tx()

    def listen_for_work(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` (from the listener's thread) when a host committed work this host
        could take (``pg_listen``); until :meth:`close`."""
        self._listener.start(wake)

    # -- claiming jobs ---------------------------------------------------------------

    def next_jobs(self, roots: Collection[Path], exclude: Collection[int],
                  limit: int) -> list[Job]:
        """Jobs to start, claimed for this host (``SELECT … FOR UPDATE SKIP LOCKED``):
        running ones first (this host's own, or any whose lease expired), then held, then
        pending, each oldest first; only those of ``roots`` and not in ``exclude``."""
        if limit <= 0 or not roots:
            return []
        root_marks = ", ".join("?" * len(roots))
        not_ids = f"AND id NOT IN ({', '.join('?' * len(exclude))}) " if exclude else ""
        ids: list[int] = []
        for state in (JobState.RUNNING, JobState.HELD, JobState.PENDING):
            with self._db.tx() as c:
                rows = c.execute(
                    "WITH c AS (SELECT id, owner FROM jobs WHERE state = ? AND input_root IN "
                    f"({root_marks}) {not_ids}AND (owner IS NULL OR owner = ? OR "
                    f"lease_until < {NOW}) ORDER BY id LIMIT ? FOR UPDATE SKIP LOCKED) "
                    f"UPDATE jobs j SET owner = ?, lease_until = {NOW} + ? FROM c "
                    "WHERE j.id = c.id RETURNING j.id, c.owner",
                    (state.value, *(names.fsbytes(r) for r in roots), *exclude, self.host,
                     limit - len(ids), self.host, self.lease_s)).fetchall()
            ids += sorted(int(r[0]) for r in rows)
            # Another host's job whose lease expired: a takeover (metrics count them).
            self.takeovers += sum(1 for _, owner in rows if owner not in (None, self.host))
            if len(ids) >= limit:
                break
        if not ids:
            return []
        rows = self._db.conn.execute(
            f"SELECT {_JOB_COLUMNS} FROM jobs j WHERE j.id IN ({', '.join('?' * len(ids))})",
            ids).fetchall()
        by_id = {int(r[0]): job_from_row(r) for r in rows}
        return [by_id[i] for i in ids if i in by_id]

    def owner(self, job_id: int) -> tuple[str | None, float | None]:
        """The host a job is leased to and the seconds its lease has left (negative:
        expired), or ``(None, None)``."""
        row = self._db.conn.execute(
            f"SELECT owner, lease_until - {NOW} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return (None, None) if row is None else (row[0], row[1])

    def _fence(self, job_id: int, *, cancelled_ok: bool = False) -> None:
        """Raise LeaseLost unless the job is this host's and (unless ``cancelled_ok``) not
        cancelled: an operator may cancel it from any host. One no host owns becomes this
        host's (a step on it is a claim). Locks its row for the caller's transaction."""
        row = self._db.conn.execute("SELECT owner, state FROM jobs WHERE id = ? FOR UPDATE",
                                    (job_id,)).fetchone()
        if row is not None and row[1] == JobState.CANCELLED and not cancelled_ok:
            raise LeaseLost(f"job {job_id} was cancelled; this host leaves it", job=job_id,
                            owner=row[0])
        if row is not None and row[0] is None:
            self._db.conn.execute(f"UPDATE jobs SET owner = ?, lease_until = {NOW} + ? "
                                  "WHERE id = ?", (self.host, self.lease_s, job_id))
        elif row is not None and row[0] != self.host:
            raise LeaseLost(f"job {job_id} was taken over by host {row[0]} (this host's "
                            "lease expired); this host leaves it", job=job_id, owner=row[0])

    # -- the steps of a job's run, fenced ----------------------------------------------

    def set_job_state(self, job_id: int, state: JobState, *, error_code: str | None = None,
                      error_message: str | None = None, pages_total: int | None = None,
                      output_dir: Path | None = None, final_path: Path | None = None) -> None:
        with self._db.tx():
            if state is not JobState.CANCELLED:  # a cancel is the operator's, from any host
                self._fence(job_id)
            super().set_job_state(job_id, state, error_code=error_code,
                                  error_message=error_message, pages_total=pages_total,
                                  output_dir=output_dir, final_path=final_path)

    def init_pages(self, job_id: int, count: int) -> None:
        with self._db.tx():
            self._fence(job_id)
            super().init_pages(job_id, count)

    def claim_page(self, job_id: int, index: int, *, helped: bool = False) -> None:
        with self._db.tx():
            self._fence_page(job_id, index, helped)
            super().claim_page(job_id, index)

    def finish_page(self, job_id: int, index: int, *, result: dict[str, Any], width: int,
                    height: int, seconds: float, helped: bool = False) -> None:
        with self._db.tx():
            self._fence_page(job_id, index, helped)
            super().finish_page(job_id, index, result=result, width=width, height=height,
                                seconds=seconds)
        if helped:
            self.pages_helped += 1

    def fail_page(self, job_id: int, index: int, error: str, *, helped: bool = False) -> None:
        with self._db.tx():
            self._fence_page(job_id, index, helped)
            super().fail_page(job_id, index, error)

    def release_page(self, job_id: int, index: int, *, charge: bool = False,
                     helped: bool = False) -> None:
        with self._db.tx():
            if helped:
                self._held.fence(job_id, index)
            else:
                self._fence(job_id, cancelled_ok=True)  # giving a page back is always safe
                self._held.check_unheld(job_id, index)
            super().release_page(job_id, index, charge=charge)

    def release_all_in_flight(self) -> int:
        """Give this host's in-flight pages back (its engine died, or it stops): those of
        its own jobs that no helper holds, and those it holds for other hosts' jobs;
        other hosts' pages are theirs."""
        with self._db.tx():
            return self._release_own() + self._held.drop_all()

    def _release_own(self) -> int:
        with self._db.tx() as c:
            return int(c.execute(
                _RELEASE + "WHERE state = 'in_flight' AND holder IS NULL AND job_id IN "
                "(SELECT id FROM jobs WHERE owner = ?)", (self.host,)).rowcount)

    # -- retries: work for any host -----------------------------------------------------

    def retry(self, job_id: int) -> bool:
        """Requeue a finished job for whichever host is free: it belongs to no host any
        more (its last owner's heartbeat would keep it for that host alone)."""
        with self._db.tx() as c:
            if not super().retry(job_id):
                return False
            c.execute("UPDATE jobs SET owner = NULL, lease_until = NULL WHERE id = ?",
                      (job_id,))
            self._held.unhold_requeued()  # nor do its pages belong to a helper
            return True

    def retry_all_failed(self) -> int:
        """Requeue every failed job, each for whichever host is free (:meth:`retry`)."""
        with self._db.tx() as c:
            c.execute("UPDATE jobs SET owner = NULL, lease_until = NULL "
                      "WHERE state = 'failed'")
            retried = super().retry_all_failed()
            self._held.unhold_requeued()  # nor do their pages belong to a helper
            return retried

    # -- pages of other hosts' jobs (helping), and pages others help with ---------------

    def pages(self, job_id: int) -> list[Page]:
        """All pages of a job, in page order, with the helping host holding each."""
        rows = self._db.conn.execute(
            f"SELECT {_PAGE_COLUMNS}, holder FROM pages WHERE job_id = ? ORDER BY page_index",
            (job_id,)).fetchall()
        return [dataclasses.replace(page_from_row(r[:-1]), holder=r[-1]) for r in rows]

    def page(self, job_id: int, index: int) -> Page | None:
        row = self._db.conn.execute(
            f"SELECT {_PAGE_COLUMNS}, holder FROM pages WHERE job_id = ? AND page_index = ?",
            (job_id, index)).fetchone()
        return None if row is None else dataclasses.replace(page_from_row(row[:-1]),
                                                            holder=row[-1])

    def open_pages(self, job_id: int) -> list[tuple[int, str | None]]:
        return [(int(i), h) for i, h in self._db.conn.execute(
            "SELECT page_index, holder FROM pages WHERE job_id = ? AND state IN "
            "('pending', 'in_flight') ORDER BY page_index", (job_id,)).fetchall()]

    def claim_helped_pages(self, roots: Collection[Path],
                           limit: int) -> list[tuple[Job, int]]:
        """Lease up to ``limit`` pending pages of other live hosts' running jobs to this
        host (``PageLeases.claim``): ``(job, page index)``."""
        claimed = self._held.claim(roots, limit)
        jobs = {j: self.get(j) for j in {j for j, _ in claimed}}
        out = []
        for job_id, index in claimed:
            job = jobs[job_id]
            if job is None:  # deleted meanwhile: nothing to help with
                continue
            out.append((job, index))
        return out

    def drop_helped_page(self, job_id: int, index: int) -> None:
        """Give up a page this host holds for another host's job and did not finish."""
        self._held.drop(job_id, index)

    def reclaim_pages(self, job_id: int) -> int:
        """Take back the job's open pages whose helping host's lease expired."""
        with self._db.tx():
            self._fence(job_id)
            return self._held.reclaim(job_id)

    def _fence_page(self, job_id: int, index: int, helped: bool) -> None:
        """A step on a page: this host's page lease (``helped``), else the job's lease
        and no helper holding the page."""
        if helped:
            self._held.fence(job_id, index)
        else:
            self._fence(job_id)
            self._held.check_unheld(job_id, index)

    # -- the cluster, for metrics -------------------------------------------------------

    def cluster_counts(self) -> ClusterCounts:
        """Hosts by state, open jobs by (owner, state) and open jobs whose lease expired,
        in one round trip (a metrics scrape reads it; ``cluster_status`` is the full view)."""
        rows = self._db.conn.execute(_CLUSTER_COUNTS).fetchall()
        hosts = {state: 0 for state in HOST_STATES}
        jobs: dict[tuple[str, str], int] = {}
        expired = 0
        for kind, state, owner, n in rows:
            if kind == "host":
                hosts[str(state)] = int(n)
            elif kind == "job":
                jobs[(str(owner), str(state))] = int(n)
            else:
                expired = int(n)
        return ClusterCounts(hosts, jobs, expired, self.takeovers, self.pages_helped)

    # -- learned profiles: per host ----------------------------------------------------

    def save_learned_profile(self, key: str, profile: dict[str, Any]) -> None:
        super().save_learned_profile(f"{self.host}/{key}", profile)

    def load_learned_profile(self, key: str) -> dict[str, Any] | None:
        return super().load_learned_profile(f"{self.host}/{key}")

    def learned_profile_saved_at(self, key: str) -> float | None:
        return super().learned_profile_saved_at(f"{self.host}/{key}")


def _refuse_live_namesake(db: PgDatabase, host: str) -> None:
    """Raise HostIdInUse when another live process beats as ``host``. A row that stopped
    cleanly, or whose heartbeat is older than its lease, is free; one seen within its
    lease (this host crashed a moment ago, or a namesake lives) is watched for one beat
    (its ``lease_s / 3``, plus a margin): a heartbeat meanwhile is a live namesake."""
    query = (f"SELECT seen_at, lease_s, {NOW} - seen_at, pid FROM hosts "
             "WHERE host = ? AND stopped_at IS NULL")
    row = db.conn.execute(query, (host,)).fetchone()
    if row is None or row[2] > row[1]:
        return
    time.sleep(row[1] / 3 + 0.5)
    again = db.conn.execute(query, (host,)).fetchone()
    if again is not None and again[0] > row[0]:
        raise HostIdInUse(f"another chandrad (pid {again[3]}) uses daemon.host_id "
                          f"{host!r} on the store {db.location} (its heartbeat is live); "
                          "give each host its own id", host=host, pid=again[3])


def cluster_status(url: str) -> dict[str, Any]:
    """The hosts sharing the queue at ``url`` and where each stands (``chandractl status
    --cluster``): ``up`` (heartbeat within its lease), ``silent`` (none for longer: dead,
    stalled or cut off; its expired leases go to the others) or ``stopped``; its jobs
    running and waiting, pages in flight and done in the last minute (its own jobs' and
    those it helps with), pages it holds of other hosts' jobs, leases expired.
    One read-only connection of its own."""
    db = PgDatabase.connect(url)
    try:
        rows = db.conn.execute(
            f"SELECT h.host, h.pid, h.lease_s, {NOW} - h.seen_at, h.stopped_at IS NOT NULL, "
            "(SELECT COUNT(*) FROM jobs j WHERE j.owner = h.host AND j.state = 'running'), "
            "(SELECT COUNT(*) FROM jobs j WHERE j.owner = h.host "
            " AND j.state IN ('pending', 'held')), "
            "(SELECT COUNT(*) FROM pages p JOIN jobs j ON j.id = p.job_id "
            " WHERE COALESCE(p.holder, j.owner) = h.host AND p.state = 'in_flight'), "
            "(SELECT COUNT(*) FROM pages p JOIN jobs j ON j.id = p.job_id WHERE "
            f" COALESCE(p.holder, j.owner) = h.host AND p.state = 'done' AND p.finished_at >= "
            f" {NOW} - 60), "
            "(SELECT COUNT(*) FROM pages p WHERE p.holder = h.host "
            " AND p.state IN ('pending', 'in_flight')), "
            "(SELECT COUNT(*) FROM jobs j WHERE j.owner = h.host AND j.state IN "
            f" ('pending', 'running', 'held') AND j.lease_until < {NOW}) "
            "FROM hosts h ORDER BY h.host").fetchall()
        unclaimed = db.conn.execute(
            "SELECT COUNT(*) FROM jobs WHERE state IN ('pending', 'running', 'held') AND "
            f"(owner IS NULL OR lease_until < {NOW})").fetchone()[0]
        counts = {str(s): int(n) for s, n in db.conn.execute(
            "SELECT state, n FROM job_counts WHERE n > 0")}
    finally:
        db.close()
    hosts = [{
        "host": host, "pid": pid, "state": "stopped" if stopped else
        "up" if seen <= lease_s else "silent", "seen_s_ago": round(float(seen), 1),
        "lease_s": lease_s, "jobs_running": int(running), "jobs_waiting": int(waiting),
        "pages_in_flight": int(in_flight), "pages_done_1m": int(done_1m),
        "pages_helping": int(helping), "leases_expired": int(expired)}
        for host, pid, lease_s, seen, stopped, running, waiting, in_flight, done_1m, helping,
        expired in rows]
    return {"store": db.location, "hosts": hosts, "jobs": counts,
            "jobs_unclaimed": int(unclaimed)}
