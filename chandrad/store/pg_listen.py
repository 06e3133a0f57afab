"""Hearing of work other hosts made, on PostgreSQL: ``LISTEN`` on a thread, its own connection.

The schema's triggers (``pg_schema``, version 4) ``NOTIFY`` :data:`WORK_CHANNEL` in the
transaction that makes work another host could take: a job inserted, a job set back to
pending (a retry), a job's lease given back (a host stopping cleanly), a page set back to
pending. PostgreSQL delivers a notification at commit to every listening connection (this
host's own included), once per transaction and payload (``'job'`` or ``'page'``).

:class:`WorkListener` holds one connection that listens, in a thread of its own (waiting
for a notification blocks; the event loop never does), and calls ``wake`` for each
notification heard: the daemon hands it to the event loop thread-safely, where it wakes
the dispatcher. A lost connection (a server restart, an outage) is said once in the
journal (``store_listen_lost``), tried again every :data:`RETRY_S`, and once back
(``store_listen_back``) listens again and calls ``wake`` once: what was notified meanwhile
is lost, so the dispatcher looks now. The dispatcher's poll stays the fallback
(docs/cluster.md). The connection's parameters are every store connection's
(``pg_database.session_params``): a server cut off without a reset is found lost within
a third of the lease, as the other connections find it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import psycopg
import structlog

from chandrad.store.pg_database import first_line, safe_url, session_params

log = structlog.get_logger("chandrad.store")

#: The channel the schema's triggers notify (``pg_schema``, version 4).
WORK_CHANNEL = "chandrad_work"
#: The longest one wait for a notification lasts before the thread checks it should stop
#: (so a stop takes at most this long).
WAIT_S = 0.25
#: Seconds between two attempts to listen again after the connection was lost.
RETRY_S = 0.5


class WorkListener:
    """One host's ``LISTEN`` on :data:`WORK_CHANNEL`, in a thread: :meth:`start`, :meth:`stop`."""

    def __init__(self, url: str, host: str, lease_s: float | None = None) -> None:
        self._url = url
        self._params = session_params(url, lease_s)
        self._host = host
        self.location = safe_url(url)
        self._wake: Callable[[], None] = lambda: None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chandrad-listen", daemon=True)
        #: Notifications heard (tests and the bench read it).
        self.heard = 0
        #: Set while a connection listens (a test waits for it).
        self.listening = threading.Event()

    def start(self, wake: Callable[[], None]) -> None:
        """Listen from now on, calling ``wake`` (from this object's thread) for each
        notification and after each reconnect. A second call only replaces ``wake``."""
        self._wake = wake
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()

    def stop(self) -> None:
        """Stop listening and close the connection (within ``WAIT_S``; a connection
        attempt under way is not waited for: the thread closes what it gets and ends)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * WAIT_S)

    def _connect(self) -> psycopg.Connection[tuple[object, ...]]:
        conn = psycopg.connect(self._url, autocommit=True, **self._params)
        try:
            conn.execute(f"LISTEN {WORK_CHANNEL}")
        except BaseException:
            conn.close()
            raise
        return conn

    def _run(self) -> None:
        structlog.contextvars.bind_contextvars(host_id=self._host)
        conn: psycopg.Connection[tuple[object, ...]] | None = None
        lost = False
        try:
            while not self._stop.is_set():
                try:
                    if conn is None:
                        conn = self._connect()
                        if self._stop.is_set():
                            break
                        self.listening.set()
                        if lost:
                            log.info("store_listen_back", store=self.location)
                            lost = False
                        self._call_wake()  # notifications sent while not listening are lost
                    for _ in conn.notifies(timeout=WAIT_S):
                        self.heard += 1
                        self._call_wake()
                except psycopg.Error as exc:
                    self.listening.clear()
                    if conn is not None:
                        conn.close()
                        conn = None
                    if not lost:
                        log.warning("store_listen_lost", store=self.location,
                                    reason=first_line(exc),
                                    retry_every_s=RETRY_S,
                                    meanwhile="this host finds new work by the dispatcher's "
                                              "poll")
                        lost = True
                    self._stop.wait(RETRY_S)
        finally:
            self.listening.clear()
            if conn is not None:
                conn.close()

    def _call_wake(self) -> None:
        if self._stop.is_set():
            return
        try:
            self._wake()
        except Exception:  # a bug in the callback: say so, keep listening
            log.exception("store_listen_wake_failed")
