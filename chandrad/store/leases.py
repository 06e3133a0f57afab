"""Keeping a host's leases alive on PostgreSQL: a heartbeat thread, its own connection.

:class:`LeaseKeeper` extends ``lease_until`` of every open job this host owns and
``hold_until`` of every open page it holds for another host's job, every
``lease_s / 3`` seconds (one statement), on a connection of its own (the event loop's
connection is used from one thread). It runs while the process lives: a host killed stops
renewing, and its jobs' and pages' leases expire ``lease_s`` after the last beat at most.
Lease times are the server's clock (``NOW``), so hosts' clocks need not agree. A lost
server is retried at the next beat; a beat that fails says so once in the journal.
"""

from __future__ import annotations

import os
import threading

import structlog

from chandrad.errors import StoreFull
from chandrad.store.pg_database import PgDatabase

log = structlog.get_logger("chandrad.store")

#: The server's clock in seconds since the epoch, as SQL.
NOW = "EXTRACT(EPOCH FROM clock_timestamp())::double precision"
#: The page states in which a helping host's page lease counts (open pages).
HELD_STATES = "('pending', 'in_flight')"


class LeaseKeeper:
    """The heartbeat of one host's leases."""

    def __init__(self, url: str, host: str, lease_s: float) -> None:
        self._db = PgDatabase(url, lease_s)
        self._host = host
        self._lease_s = lease_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chandrad-leases", daemon=True)
        self._failing = False
        #: Beats that reached the server (tests and status read it).
        self.beats = 0

    def start(self) -> None:
        """Record this host in ``hosts`` (started now, not stopped) and start beating."""
        with self._db.tx() as c:
            c.execute(
                "INSERT INTO hosts AS h (host, pid, lease_s, started_at, seen_at) "
                f"VALUES (?, ?, ?, {NOW}, {NOW}) ON CONFLICT (host) DO UPDATE SET "
                "pid = excluded.pid, lease_s = excluded.lease_s, started_at = "
                "excluded.started_at, seen_at = excluded.seen_at, stopped_at = NULL",
                (self._host, os.getpid(), self._lease_s))
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)

    def beat(self) -> int:
        """Renew this host's leases and its ``hosts`` row now; returns how many jobs."""
        with self._db.tx() as c:
            # One statement, one round trip: the pages this host holds for other hosts'
            # jobs, its ``hosts`` row and its jobs.
            n = c.execute(
                f"WITH p AS (UPDATE pages SET hold_until = {NOW} + ? WHERE holder = ? "
                f"AND state IN {HELD_STATES} RETURNING 1), "
                f"h AS (UPDATE hosts SET seen_at = {NOW} WHERE host = ? RETURNING 1) "
                f"UPDATE jobs SET lease_until = {NOW} + ? WHERE owner = ? "
                "AND state IN ('pending', 'running', 'held')",
                (self._lease_s, self._host, self._host, self._lease_s, self._host)).rowcount
        self.beats += 1
        return int(n)

    def give_back(self) -> None:
        """End this host's leases now (a clean stop): other hosts may take its jobs and
        the pages it held."""
        try:
            with self._db.tx() as c:
                c.execute(f"UPDATE jobs SET lease_until = {NOW} WHERE owner = ? "
                          "AND state IN ('pending', 'running', 'held')", (self._host,))
                c.execute(f"UPDATE pages SET hold_until = {NOW} WHERE holder = ? "
                          f"AND state IN {HELD_STATES}", (self._host,))
                c.execute(f"UPDATE hosts SET stopped_at = {NOW} WHERE host = ?", (self._host,))
        except StoreFull as exc:
            log.warning("leases_not_given_back", reason=exc.message,
                        expire_in_s=self._lease_s)
        finally:
            self._db.close()

    def _run(self) -> None:
        structlog.contextvars.bind_contextvars(host_id=self._host)
        while not self._stop.wait(self._lease_s / 3):
            try:
                self.beat()
            except StoreFull as exc:
                if not self._failing:
                    log.warning("lease_heartbeat_failed", reason=exc.message,
                                lease_s=self._lease_s)
                self._failing = True
                continue
            if self._failing:
                log.info("lease_heartbeat_back")
                self._failing = False
