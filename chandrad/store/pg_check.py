"""``chandrad store check`` and ``chandrad store repair`` on the PostgreSQL store.

PostgreSQL keeps its own files sound (WAL, checksums, its own tools), so what a check can
find wrong is chandrad's: the schema version, and the per-state count rows (``job_counts``,
``page_counts``, kept by triggers) against ``COUNT(*)`` of the rows themselves. Beside
those problems it notes what waits on hosts that are not up: pages in flight of jobs whose
host is silent or stopped, and open jobs whose lease expired. Those are no damage: the
next host that claims such a job releases its pages in flight and resumes it
(``JobRunner.run``), so they are listed, not changed.

Both run while hosts work. ``check`` reads one snapshot (a read-only ``REPEATABLE READ``
transaction: the counts and the rows of one instant). ``repair`` recounts: it locks
``jobs`` and ``pages`` against writes (``SHARE`` mode: hosts' writes wait for a few
milliseconds, reads go on) and rewrites the count rows from ``COUNT(*)`` in one
transaction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from psycopg import IsolationLevel

from chandrad.errors import StoreDamaged
from chandrad.store.leases import NOW
from chandrad.store.pg_database import PgDatabase, safe_url
from chandrad.store.pg_schema import PG_MIGRATIONS

__all__ = ["COUNTED", "PgCheck", "check", "recount", "safe_url"]

#: Each count table and the table whose rows it counts by ``state``.
COUNTED = (("job_counts", "jobs"), ("page_counts", "pages"))


@dataclass(frozen=True)
class PgCheck:
    """What :func:`check` found: problems (the exit status says so) and notes."""

    location: str
    version: int
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def check(url: str) -> PgCheck:
    """``chandrad store check`` on ``url``: the schema version, the count rows against
    ``COUNT(*)`` (problems), pages in flight of hosts not up and expired leases (notes).

    Raises StoreUnreachable when the server cannot be reached.
    """
    db = PgDatabase.connect(url)
    try:
        raw = db.raw()
        raw.isolation_level = IsolationLevel.REPEATABLE_READ
        raw.read_only = True
        with db.reachable(), raw.transaction():
            version = _version(db)
            if version is None:
                return PgCheck(db.location, 0, notes=[
                    "no chandrad schema yet: the first host to start creates it"])
            problems, notes = [], []
            if version > len(PG_MIGRATIONS):
                problems.append(f"schema version {version} is newer than this chandrad "
                                f"understands ({len(PG_MIGRATIONS)}): use a newer chandrad")
                return PgCheck(db.location, version, problems)
            if version < len(PG_MIGRATIONS):
                notes.append(f"schema version {version}: a host of this chandrad migrates "
                             f"it to {len(PG_MIGRATIONS)} when it starts")
            problems += _count_problems(db)
            notes += _waiting_on_hosts(db)
    finally:
        db.close()
    return PgCheck(db.location, version, problems, notes)


def recount(url: str) -> dict[str, tuple[int, int]]:
    """``chandrad store repair`` on ``url``: rewrite ``job_counts`` and ``page_counts`` from
    the rows, with writers held off for the transaction; returns each changed count as
    ``"<table> <state>": (was, now)``.

    Raises StoreUnreachable when the server cannot be reached, StoreDamaged (exit 78)
    when its schema is missing or newer than this chandrad.
    """
    db = PgDatabase.connect(url)
    try:
        with db.tx() as c:
            version = _version(db)
            if version is None or version > len(PG_MIGRATIONS):
                raise StoreDamaged(
                    f"{db.location} has schema version {version or 'none'}; this chandrad "
                    f"repairs versions 1 to {len(PG_MIGRATIONS)}", path=db.location)
            c.execute("LOCK TABLE jobs, pages IN SHARE MODE")
            changed: dict[str, tuple[int, int]] = {}
            for counts, table in COUNTED:
                was = _counted(db, counts)
                now = _actual(db, table)
                c.execute(f"DELETE FROM {counts}")
                for state, n in sorted(now.items()):
                    c.execute(f"INSERT INTO {counts} (state, n) VALUES (?, ?)", (state, n))
                for state in sorted(set(was) | set(now)):
                    if was.get(state, 0) != now.get(state, 0):
                        changed[f"{counts} {state}"] = (was.get(state, 0), now.get(state, 0))
    finally:
        db.close()
    return changed


def _version(db: PgDatabase) -> int | None:
    if db.conn.execute("SELECT to_regclass('schema_version')").fetchone()[0] is None:
        return None
    row = db.conn.execute("SELECT version FROM schema_version").fetchone()
    return None if row is None else int(row[0])


def _counted(db: PgDatabase, counts: str) -> dict[str, int]:
    return {str(s): int(n) for s, n in db.conn.execute(f"SELECT state, n FROM {counts}")}


def _actual(db: PgDatabase, table: str) -> dict[str, int]:
    return {str(s): int(n) for s, n in
            db.conn.execute(f"SELECT state, COUNT(*) FROM {table} GROUP BY state")}


def _count_problems(db: PgDatabase) -> list[str]:
    out = []
    for counts, table in COUNTED:
        was, now = _counted(db, counts), _actual(db, table)
        for state in sorted(set(was) | set(now)):
            if was.get(state, 0) != now.get(state, 0):
                out.append(f"{counts} says {was.get(state, 0)} {state}, {table} holds "
                           f"{now.get(state, 0)}: `chandrad store repair` recounts")
    return out


def _waiting_on_hosts(db: PgDatabase) -> list[str]:
    """Pages in flight of jobs whose host is not up, and open jobs whose lease expired."""
    host_state = (f"CASE WHEN h.host IS NULL THEN 'unknown' WHEN h.stopped_at IS NOT NULL "
                  f"THEN 'stopped' WHEN {NOW} - h.seen_at <= h.lease_s THEN 'up' "
                  "ELSE 'silent' END")
    rows: list[Any] = db.conn.execute(
        f"SELECT COALESCE(p.holder, j.owner, ''), {host_state}, COUNT(DISTINCT j.id), "
        "COUNT(*) FROM pages p JOIN jobs j ON j.id = p.job_id LEFT JOIN hosts h "
        "ON h.host = COALESCE(p.holder, j.owner) "
        "WHERE p.state = 'in_flight' GROUP BY 1, 2 ORDER BY 1").fetchall()
    # A page's holder is the host helping with another host's job (page_leases).
    notes = [f"{pages} pages in flight on {jobs} jobs of "
             + (f"host {owner} ({state})" if owner else "no host")
             + ": they go back to pending when a host takes the job (or, a helper's, "
               "when the job's owner takes them back)"
             for owner, state, jobs, pages in rows if state != "up"]
    expired = db.conn.execute(
        "SELECT owner, COUNT(*) FROM jobs WHERE state IN ('pending', 'running', 'held') "
        f"AND owner IS NOT NULL AND lease_until < {NOW} GROUP BY owner ORDER BY owner"
    ).fetchall()
    notes += [f"{n} open jobs of host {owner} whose lease expired: the next host that "
              "polls takes them over" for owner, n in expired]
    return notes
