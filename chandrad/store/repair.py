"""``chandrad store check`` and ``chandrad store repair``: the SQLite store, daemon or not.

``check`` reads (safe while the daemon runs); ``repair`` takes the store's lock (the daemon
stopped), rebuilds the database from the rows SQLite can still read and keeps the damaged
file beside it.
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chandrad.errors import StoreDamaged
from chandrad.store.database import Database
from chandrad.store.guard import DB_NAME, USED_MARKER, lock_database, recovery
from chandrad.store.schema import MIGRATIONS, migrate


def check(state_dir: Path) -> list[str]:
    """``chandrad store check``: SQLite's full ``integrity_check`` of the store, read only
    (safe while the daemon runs); what is wrong, [] when it is sound or not made yet."""
    path = state_dir / DB_NAME
    if not path.exists() or path.stat().st_size == 0:
        if (state_dir / USED_MARKER).exists():
            return [f"{path} is missing or empty, but {state_dir / USED_MARKER} says it "
                    "held jobs"]
        return []
    try:
        conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, timeout=10.0)
    except sqlite3.Error as exc:
        return [f"cannot open {path}: {exc}"]
    try:
        rows = [str(r[0]) for r in conn.execute("PRAGMA integrity_check(20)")]
    except sqlite3.DatabaseError as exc:
        return [str(exc)]
    finally:
        conn.close()
    return [] if rows == ["ok"] else rows


@dataclass(frozen=True)
class Repaired:
    """What :func:`repair` did: where the damaged file went, how many jobs were saved."""

    damaged: Path
    jobs: int
    how: str


def repair(state_dir: Path) -> Repaired:
    """``chandrad store repair`` (the daemon stopped): rebuild the store from the rows
    SQLite can still read, keep the damaged file beside it as
    ``chandrad.sqlite3.damaged-<time>`` (and its ``-wal``).

    Raises:
        StateDirInUse: a daemon holds the store.
        StoreDamaged: nothing usable could be rebuilt (the message says how to start fresh).
    """
    path = state_dir / DB_NAME
    if not path.exists():
        raise StoreDamaged(f"there is no store at {path} to repair", path=str(path))
    fd = lock_database(path)
    try:
        fresh = path.with_name(f"{DB_NAME}.recovered")
        for leftover in (fresh, Path(f"{fresh}-wal"), Path(f"{fresh}-shm")):
            leftover.unlink(missing_ok=True)
        try:
            how = _rebuild(path, fresh)
            conn = sqlite3.connect(fresh)
            try:
                jobs = int(conn.execute("SELECT COUNT(*) FROM jobs").fetchone()[0])
            finally:
                conn.close()
        except sqlite3.DatabaseError as exc:
            fresh.unlink(missing_ok=True)
            raise StoreDamaged(f"{path} could not be rebuilt ({exc}); " + recovery(path),
                               path=str(path)) from None
        damaged = path.with_name(f"{DB_NAME}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
        for suffix in ("", "-wal", "-shm"):
            if Path(f"{path}{suffix}").exists():
                os.rename(f"{path}{suffix}", f"{damaged}{suffix}")
        os.rename(fresh, path)
    finally:
        os.close(fd)
    return Repaired(damaged=damaged, jobs=jobs, how=how)


def _rebuild(path: Path, fresh: Path) -> str:
    """Copy every row SQLite can still read from ``path``'s tables (by their own b-trees,
    no index used: indexes are rebuilt) into ``fresh``, made with this version's schema;
    the per-state counts follow from the triggers. What was lost, in words."""
    conn = sqlite3.connect(fresh.as_uri(), uri=True, isolation_level=None)  # uri: ATTACH's
    try:
        migrate(Database(conn, fresh))
        conn.execute("ATTACH DATABASE ? AS old", (f"{path.as_uri()}?mode=ro",))
        try:
            version = int(conn.execute("SELECT version FROM old.schema_version").fetchone()[0])
        except (sqlite3.DatabaseError, TypeError) as exc:
            raise sqlite3.DatabaseError(f"its schema version cannot be read: {exc}") from None
        if version != len(MIGRATIONS):
            raise sqlite3.DatabaseError(f"it has schema version {version}; this chandrad "
                                        f"repairs version {len(MIGRATIONS)} only")
        lost: list[str] = []
        conn.execute("BEGIN")
        jobs = _copy_rows(conn, "jobs", lambda row: True, lost)
        _copy_rows(conn, "pages", lambda row: row[0] in jobs, lost)
        _copy_rows(conn, "learned_profiles", lambda row: True, lost)
        # The HTTP API's: a job's owner token (without it the job is no token's but an
        # admin's) and its webhooks, delivered or still owed.
        _copy_rows(conn, "api_jobs", lambda row: row[0] in jobs, lost)
        _copy_rows(conn, "webhook_outbox", lambda row: row[1] in jobs, lost)
        conn.execute("COMMIT")
        conn.execute("DETACH DATABASE old")
    finally:
        conn.close()
    return "every row read" if not lost else "rows lost after damage in " + ", ".join(lost)


def _copy_rows(conn: sqlite3.Connection, table: str, keep: Any, lost: list[str]) -> set[Any]:
    """Copy ``old.table``'s readable rows into ``main.table``, up to the first damaged
    page; the first column of each copied row (for jobs: the ids)."""
    firsts: set[Any] = set()
    try:
        for row in conn.execute(f"SELECT * FROM old.{table} NOT INDEXED").fetchall():
            if keep(row):
                conn.execute(f"INSERT INTO main.{table} VALUES "
                             f"({', '.join('?' * len(row))})", row)
                firsts.add(row[0])
    except sqlite3.DatabaseError:
        lost.append(table)
    return firsts
