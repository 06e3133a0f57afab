"""The SQLite store: ``<state_dir>/chandrad.sqlite3``, opened, checked, recovered.

:class:`Store` is what the daemon holds. :meth:`Store.open` takes the state dir's lock,
refuses a damaged store (``guard``), brings the schema up to date (``schema``) and recovers
from a crash: pages left ``in_flight`` go back to ``pending`` (their result never reached
the store, so they must be recomputed); ``running`` jobs stay ``running`` and are resumed
at page granularity. Its other methods are the queue's operations, each one short
transaction, handed to the table that owns the SQL (``jobs``, ``pages``, ``profiles``).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from contextlib import AbstractContextManager
from pathlib import Path

from chandrad.errors import StoreDamaged
from chandrad.store import guard
from chandrad.store.database import Database
from chandrad.store.guard import DB_NAME, StateDirLock, UsedMarker
from chandrad.store.operations import TableStore
from chandrad.store.records import Job, Recovered
from chandrad.store.schema import migrate, schema_version


class Store(TableStore):
    """The SQLite store. Build with :meth:`open`; use from one thread."""

    def __init__(self, db: Database, lock: StateDirLock) -> None:
        super().__init__(db)
        self._db = db
        self._lock = lock
        self._marker = UsedMarker(db.path)
        self.path = db.path
        self.location = str(db.path)
        #: ``PRAGMA quick_check`` at open: seconds it took, and whether it covered the
        #: whole store within ``guard.CHECK_BUDGET_S``.
        self.check_s = 0.0
        self.check_complete = True

    # -- lifecycle -------------------------------------------------------------------

    @classmethod
    def open(cls, state_dir: Path) -> Store:
        """Open (creating if needed) the store in ``state_dir`` and recover from a crash.

        Raises:
            StateDirInUse: another process holds the store's lock; nothing was changed.
            StoreDamaged: the database is damaged, or empty where it held jobs.
            StoreFull: the filesystem refused the writes of opening (migration, recovery).
            OSError: ``state_dir`` cannot be created or written.
        """
        lock = StateDirLock.take(state_dir)
        try:
            return cls._open_locked(state_dir / DB_NAME, lock)
        except BaseException:
            lock.release()
            raise

    @classmethod
    def _open_locked(cls, path: Path, lock: StateDirLock) -> Store:
        db: Database | None = None
        try:
            db = Database.connect(path)
            store = cls(db, lock)
            store.check_s, store.check_complete = guard.quick_check(db.conn, path)
            migrate(db)
            store.recovered = store._recover()
            store._marker.mark(store._jobs.any_job())
            return store
        except sqlite3.DatabaseError as exc:
            if db is not None:
                db.close()
            if guard.damaged(exc):
                raise StoreDamaged(f"the store {path} is damaged ({exc}); "
                                   + guard.recovery(path), path=str(path)) from None
            raise
        except BaseException:
            if db is not None:
                db.close()
            raise

    def _recover(self) -> Recovered:
        with self._db.tx():
            released = self._pages.release_all_in_flight()
            running = self._jobs.count_running()
        return Recovered(pages_released=released, jobs_running=running)

    def close(self) -> None:
        """Close the connection (checkpoints the WAL), then release the state dir."""
        self._db.close()
        self._lock.release()

    def schema_version(self) -> int:
        """The schema version stored in the database."""
        return schema_version(self._db.conn)

    @property
    def _conn(self) -> sqlite3.Connection:
        """The connection, for tests that look at SQLite itself (plans, pragmas)."""
        return self._db.conn

    def _tx(self) -> AbstractContextManager[sqlite3.Connection]:
        """A write transaction (``Database.tx``), for tests that change rows directly."""
        return self._db.tx()

    # -- jobs: the used marker follows the first job (``guard.UsedMarker``) ----------

    def accept(self, watch_index: int, input_root: Path, path: Path, size: int, mtime: float,
               sha256: str, duplicates: str = "process") -> Job | None:
        """A settled file as a new pending job; ``None`` when it is not new work
        (:meth:`JobTable.accept`)."""
        job = super().accept(watch_index, input_root, path, size, mtime, sha256, duplicates)
        self._marker.mark(job is not None)
        return job

    def accept_many(self, items: Iterable[tuple[int, Path, Path, int, float, str]],
                    duplicates: str = "process") -> list[Job]:
        """:meth:`accept` for a backlog in one transaction (:meth:`JobTable.accept_many`)."""
        jobs = super().accept_many(items, duplicates)
        self._marker.mark(bool(jobs))
        return jobs
