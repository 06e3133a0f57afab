"""The PostgreSQL connection: psycopg 3, the tables' ``?`` SQL, one nesting transaction.

A :class:`PgDatabase` is one connection (autocommit; ``tx`` issues ``BEGIN``/``COMMIT``),
used from one thread. It offers the tables the interface of the SQLite ``Database``
(``database.SqlDatabase``): ``conn.execute(sql, params)`` with ``?`` placeholders (our SQL
holds no ``?`` or ``%`` in literals), ``executemany``, and ``tx()`` that an inner ``tx()``
joins. Reads that a write depends on take their rows ``FOR UPDATE`` (``lock_rows``):
other hosts write the same tables at the same time.

A lost connection is opened again, for up to ``RECONNECT_S`` (a ``pg_ctl restart`` takes
about a second; once that was spent in vain, each later call tries once until the server
answers: a down server costs a reader milliseconds, not seconds), and a read outside a
transaction that the server cut is run once more on the new connection; a server still
gone then raises :class:`~chandrad.errors.StoreUnreachable`, which the pipeline treats as
a full store (the work waits where the store has it; a transaction cut midway raises it
at once: the caller runs its step again) and readers (status, control, metrics) answer
without (``daemon/report``). A server out of disk raises StoreFull.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import errors as pg_errors

from chandrad.errors import StoreFull, StoreUnreachable

#: Seconds a connection attempt may take before the server counts as unreachable.
CONNECT_TIMEOUT_S = 5
#: Seconds a lost connection is tried again (every ``RECONNECT_EVERY_S``) before the call
#: raises StoreUnreachable: long enough for a server restart, short enough for the loop.
RECONNECT_S = 3.0
RECONNECT_EVERY_S = 0.2


def safe_url(url: str) -> str:
    """``url`` without its password, for messages and logs."""
    return re.sub(r"(://[^:/@]*):[^@/]*@", r"\1:***@", url)


def _sql(sql: str) -> str:
    return sql.replace("%", "%%").replace("?", "%s")


class _Conn:
    """The tables' view of the connection: sqlite3's ``execute`` with ``?`` marks."""

    def __init__(self, db: PgDatabase) -> None:
        self._db = db

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        try:
            with self._db.reachable():
                return self._db.raw().execute(_sql(sql), tuple(params))
        except StoreUnreachable:
            if self._db.in_transaction:
                raise
        # A read the server cut (a restart): once more, on a new connection.
        with self._db.reachable():
            return self._db.raw().execute(_sql(sql), tuple(params))

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        with self._db.reachable(), self._db.raw().cursor() as cur:
            cur.executemany(_sql(sql), [tuple(r) for r in rows])


class PgDatabase:
    """One PostgreSQL connection and its write transactions; reconnects when lost."""

    lock_rows = " FOR UPDATE"
    dialect = "postgresql"

    def __init__(self, url: str) -> None:
        self.url = url
        self.location = safe_url(url)
        self.conn = _Conn(self)
        self._raw: psycopg.Connection[Any] | None = None
        self._depth = 0
        #: True once a reconnect spent ``RECONNECT_S`` in vain, until one succeeds.
        self.down = False

    @classmethod
    def connect(cls, url: str) -> PgDatabase:
        """Connect now (raises StoreUnreachable when the server cannot be reached)."""
        db = cls(url)
        with db.reachable():
            db._raw = psycopg.connect(url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S)
        return db

    @property
    def in_transaction(self) -> bool:
        return self._depth > 0

    def raw(self) -> psycopg.Connection[Any]:
        """The live connection, connecting again (for up to ``RECONNECT_S``) if the last
        one was lost."""
        if self._raw is None or self._raw.closed or self._raw.broken:
            if self._depth:
                raise StoreUnreachable(f"the store {self.location} was lost mid-transaction",
                                       path=self.location)
            # The first loss is waited out for RECONNECT_S (a restart); once that was
            # spent, the server is down: one attempt per call, so that every reader (the
            # status line, a control request, a scrape) answers at once, not in 3 s.
            deadline = time.monotonic() + (0.0 if self.down else RECONNECT_S)
            while True:
                try:
                    self._raw = psycopg.connect(self.url, autocommit=True,
                                                connect_timeout=CONNECT_TIMEOUT_S)
                    self.down = False
                    break
                except psycopg.OperationalError:
                    if time.monotonic() >= deadline:
                        self.down = True
                        raise
                    time.sleep(RECONNECT_EVERY_S)
        return self._raw

    @contextmanager
    def reachable(self) -> Iterator[None]:
        """Server-side conditions as chandrad's errors: lost or refused connection →
        StoreUnreachable; disk full → StoreFull."""
        try:
            yield
        except pg_errors.DiskFull as exc:
            raise StoreFull(f"the store's server is out of disk: {self.location} cannot "
                            f"grow ({exc}); free space there and chandrad goes on by itself",
                            path=self.location) from None
        except (psycopg.OperationalError, pg_errors.AdminShutdown) as exc:
            if self._raw is not None and not self._raw.closed and self._raw.broken:
                self._raw.close()
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise StoreUnreachable(f"the store {self.location} cannot be reached ({reason}); "
                                   "chandrad connects again by itself", path=self.location
                                   ) from None

    @contextmanager
    def tx(self) -> Iterator[_Conn]:
        """One write transaction; inside another ``tx()`` it joins that one."""
        if self._depth:
            self._depth += 1
            try:
                yield self.conn
            finally:
                self._depth -= 1
            return
        with self.reachable():
            raw = self.raw()
            try:
                with raw.transaction():
                    self._depth = 1
                    yield self.conn
            finally:
                self._depth = 0

    def close(self) -> None:
        if self._raw is not None:
            self._raw.close()
            self._raw = None
