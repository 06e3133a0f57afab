"""The SQLite connection: its settings, and the one transaction helper every write uses.

A :class:`Database` is one connection, used from one thread (sqlite3 enforces it). Its
:meth:`Database.tx` is the only way the store writes: ``BEGIN IMMEDIATE`` … ``COMMIT``,
rolled back on any exception; a write the filesystem refuses (SQLITE_FULL: disk full,
quota) raises :class:`~chandrad.errors.StoreFull`. Transactions nest: an inner
``tx()`` joins the outer one, so a repository method that is one transaction on its own is
also a step of a larger one (``supersede`` ends a job and accepts its new content at once).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Protocol

from chandrad.errors import StoreFull

#: SQLite's primary result code for a write the filesystem refused.
_FULL_CODES = frozenset({13})  # SQLITE_FULL


class SqlDatabase(Protocol):
    """What the tables (``jobs``, ``pages``, ``profiles``) need of a database, whichever
    backend: a connection with ``?`` placeholders, its nesting write transaction, and the
    two places their SQL differs (``lock_rows``, ``dialect``)."""

    #: ``execute(sql, params)`` returning a cursor, and ``executemany``.
    conn: Any
    #: Appended to a read that a transaction's write depends on: ``""`` on SQLite (its
    #: write transaction already excludes every other writer), ``" FOR UPDATE"`` on
    #: PostgreSQL (other hosts write at the same time).
    lock_rows: str
    #: ``"sqlite"`` or ``"postgresql"``.
    dialect: str

    def tx(self) -> AbstractContextManager[Any]: ...


class Database:
    """One SQLite connection and its write transactions."""

    lock_rows = ""
    dialect = "sqlite"

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        self.conn = conn
        self.path = path
        self._depth = 0

    @classmethod
    def connect(cls, path: Path) -> Database:
        """Open ``path`` with the store's settings (WAL, ``synchronous=FULL``, foreign keys)."""
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, one per method.
        conn = sqlite3.connect(path, isolation_level=None, timeout=10.0)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            # FULL, not NORMAL: in WAL mode NORMAL survives kill -9 but a power cut may
            # roll back the last commits. Ours record facts with side effects outside the
            # database (an input moved to done/, outputs written), so a lost commit would
            # disagree with the filesystem after a reboot. The cost is one fsync per state
            # change, which is small next to a page of OCR; bulk intake uses accept_many.
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA foreign_keys=ON")
        except BaseException:
            conn.close()
            raise
        return cls(conn, path)

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; IMMEDIATE so the read-check-write inside is atomic.

        Inside another ``tx()`` it joins that one (the outer one commits or rolls back).
        A write the filesystem refuses (SQLITE_FULL) rolls back and raises StoreFull.
        """
        if self._depth:
            self._depth += 1
            try:
                yield self.conn
            finally:
                self._depth -= 1
            return
        try:
            self.conn.execute("BEGIN IMMEDIATE")
            self._depth = 1
            try:
                yield self.conn
                self.conn.execute("COMMIT")
            except BaseException:
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
                raise
            finally:
                self._depth = 0
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorcode", 0) & 0xFF in _FULL_CODES:
                raise StoreFull(f"the store's filesystem is full: {self.path} cannot grow "
                                f"({exc}); free space there and chandrad goes on by itself",
                                path=str(self.path)) from None
            raise

    def close(self) -> None:
        """Close the connection (checkpoints the WAL)."""
        self.conn.close()
