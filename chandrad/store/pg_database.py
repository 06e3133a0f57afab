"""The PostgreSQL connection: psycopg 3, the tables' ``?`` SQL, one nesting transaction.

A :class:`PgDatabase` is one connection (autocommit; ``tx`` issues ``BEGIN``/``COMMIT``),
used from one thread. It offers the tables the interface of the SQLite ``Database``
(``database.SqlDatabase``): ``conn.execute(sql, params)`` with ``?`` placeholders (our SQL
holds no ``?`` or ``%`` in literals), ``executemany``, and ``tx()`` that an inner ``tx()``
joins. Reads that a write depends on take their rows ``FOR UPDATE`` (``lock_rows``):
other hosts write the same tables at the same time.

A lost connection is opened again, for up to ``RECONNECT_S`` (a ``pg_ctl restart`` takes
about a second; once that was spent in vain, a call starts one attempt and waits for it
``ATTEMPT_WAIT_S`` at most, later calls take the connection it made: a refused socket
answers in milliseconds, a silent server is tried on a thread of its own, so that a down
server costs a reader milliseconds, not seconds), and a read outside a
transaction that the server cut is run once more on the new connection; a server still
gone then raises :class:`~chandrad.errors.StoreUnreachable`, which the pipeline treats as
a full store (the work waits where the store has it; a transaction cut midway raises it
at once: the caller runs its step again) and readers (status, control, metrics) answer
without (``daemon/report``). A server out of disk raises StoreFull.

A server that goes silent (a network partition, a host powered off: no answer, no TCP
acknowledgement, no reset) fails a call within a bound instead of the kernel's ~15 minutes
of retransmissions: every connection sets, both on this side and for the server's side of
its socket, a TCP user timeout and keepalives of a third of the host's lease, and the
session's ``idle_in_transaction_session_timeout`` is the lease, so that the row locks of a
host cut off mid-transaction are released for the host that takes its jobs over
(:func:`session_params`).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg.conninfo import conninfo_to_dict

from chandrad.errors import StoreFull, StoreUnreachable

#: Seconds a connection attempt may take before the server counts as unreachable.
CONNECT_TIMEOUT_S = 5
#: Seconds a lost connection is tried again (every ``RECONNECT_EVERY_S``) before the call
#: raises StoreUnreachable: long enough for a server restart, short enough for the loop.
RECONNECT_S = 3.0
RECONNECT_EVERY_S = 0.2
#: Seconds a call waits for a connection attempt once the server is down: one that
#: answers (or refuses) does so in milliseconds; a silent one is tried on in the background.
ATTEMPT_WAIT_S = 0.5
#: Seconds a silent server may keep a call of a connection that keeps no lease waiting
#: (``chandractl status --cluster``); a host's connections wait a third of its lease.
SILENT_S = 10.0


def safe_url(url: str) -> str:
    """``url`` without its password, for messages and logs."""
    return re.sub(r"(://[^:/@]*):[^@/]*@", r"\1:***@", url)


def session_params(url: str, lease_s: float | None = None) -> dict[str, Any]:
    """The connection parameters that bound a wait on a silent peer, both ways.

    A silent server fails a call after ``lease_s / 3`` (else ``SILENT_S``): libpq's
    ``tcp_user_timeout`` (data unacknowledged that long) and TCP keepalives (a connection
    idle or waiting for a reply probes the server); the server's socket gets the same
    (``options``: this session's settings), so that its reply to a host cut off is not
    retransmitted for minutes. ``idle_in_transaction_session_timeout`` (the lease, else
    ``3 * SILENT_S``) ends the session of a host cut off mid-transaction, releasing its row
    locks when its lease expires, not when the server's keepalive (2 hours by default)
    finds it gone: other hosts' claims skip locked jobs. What the URL sets itself wins.
    """
    silent_s = lease_s / 3 if lease_s else SILENT_S
    user_ms = max(1000, round(silent_s * 1000))
    idle_tx_ms = max(1000, round((lease_s or 3 * SILENT_S) * 1000))
    probe_s = max(1, round(silent_s / 3))
    given = conninfo_to_dict(url)
    params: dict[str, Any] = {
        k: v for k, v in {"connect_timeout": CONNECT_TIMEOUT_S, "keepalives": 1,
                          "keepalives_idle": probe_s, "keepalives_interval": probe_s,
                          "keepalives_count": 3, "tcp_user_timeout": user_ms}.items()
        if k not in given}
    server = (f"-c tcp_user_timeout={user_ms} -c tcp_keepalives_idle={probe_s} "
              f"-c tcp_keepalives_interval={probe_s} -c tcp_keepalives_count=3 "
              f"-c idle_in_transaction_session_timeout={idle_tx_ms}")
    params["options"] = f"{server} {given.get('options', '')}".strip()
    return params


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


def first_line(exc: BaseException) -> str:
    """A psycopg error's first line (its reason), or its class name when it has none."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


class _Attempt:
    """One connection attempt, on a thread of its own: a caller waits for it as long as it
    chooses (a silent server holds a connect for its timeout); the connection it makes
    after the caller gave up is taken by a later call, or closed if abandoned."""

    def __init__(self, url: str, params: dict[str, Any]) -> None:
        self.conn: psycopg.Connection[Any] | None = None
        self.error: psycopg.Error | None = None
        self._abandoned = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._connect, args=(url, params),
                                        name="chandrad-pg-connect", daemon=True)
        self._thread.start()

    def _connect(self, url: str, params: dict[str, Any]) -> None:
        try:
            conn = psycopg.connect(url, autocommit=True, **params)
        except psycopg.Error as exc:
            self.error = exc
            return
        with self._lock:
            if self._abandoned:
                conn.close()
            else:
                self.conn = conn

    def wait(self, timeout: float) -> bool:
        """Whether the attempt ended (``conn`` or ``error`` set) within ``timeout`` s."""
        self._thread.join(max(0.0, timeout))
        return not self._thread.is_alive()

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            if self.conn is not None:
                self.conn.close()
                self.conn = None


class PgDatabase:
    """One PostgreSQL connection and its write transactions; reconnects when lost."""

    lock_rows = " FOR UPDATE"
    dialect = "postgresql"

    def __init__(self, url: str, lease_s: float | None = None) -> None:
        self.url = url
        self.location = safe_url(url)
        #: How a connection is made (:func:`session_params`: the lease bounds a silent peer).
        self.params = session_params(url, lease_s)
        self.conn = _Conn(self)
        self._raw: psycopg.Connection[Any] | None = None
        self._depth = 0
        #: True once a reconnect spent ``RECONNECT_S`` in vain, until one succeeds.
        self.down = False
        #: A connection attempt that outlived the call that made it (a silent server).
        self._attempt: _Attempt | None = None
        self._reason = "connection lost"

    @classmethod
    def connect(cls, url: str, lease_s: float | None = None) -> PgDatabase:
        """Connect now (raises StoreUnreachable when the server cannot be reached)."""
        db = cls(url, lease_s)
        with db.reachable():
            db._raw = psycopg.connect(url, autocommit=True, **db.params)
        return db

    @property
    def in_transaction(self) -> bool:
        return self._depth > 0

    def raw(self) -> psycopg.Connection[Any]:
        """The live connection, connecting again (for up to ``RECONNECT_S``; once the
        server is down, one attempt of ``ATTEMPT_WAIT_S``) if the last one was lost."""
        if self._raw is None or self._raw.closed or self._raw.broken:
            if self._depth:
                raise StoreUnreachable(f"the store {self.location} was lost mid-transaction",
                                       path=self.location)
            # The first loss is waited out for RECONNECT_S (a restart); once that was
            # spent, the server is down: a call waits for one attempt, ATTEMPT_WAIT_S at
            # most, so that every reader (the status line, a control request, a scrape)
            # answers at once, not in 3 s, nor in a silent server's connect timeout.
            deadline = time.monotonic() + (0.0 if self.down else RECONNECT_S)
            while True:
                # An earlier call's attempt, still running, is not waited for.
                wait = 0.0 if self._attempt else max(ATTEMPT_WAIT_S, deadline - time.monotonic())
                attempt = self._attempt = self._attempt or _Attempt(self.url, self.params)
                if not attempt.wait(wait):
                    self.down = True  # it goes on: a later call takes its connection
                    raise psycopg.OperationalError(f"{self._reason} (connecting again)")
                self._attempt = None
                if attempt.conn is not None:
                    self._raw, self.down = attempt.conn, False
                    break
                assert attempt.error is not None
                self._reason = first_line(attempt.error)
                if time.monotonic() >= deadline:
                    self.down = True
                    raise attempt.error
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
            reason = first_line(exc)
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
        if self._attempt is not None:
            self._attempt.abandon()
            self._attempt = None
        if self._raw is not None:
            self._raw.close()
            self._raw = None
