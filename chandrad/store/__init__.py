"""The durable queue: jobs, pages and learned profiles (SQLite, ``<state_dir>/chandrad.sqlite3``).

The source of truth for what was accepted, what is done and what failed. Every public
method of :class:`Store` is one short transaction, so a ``kill -9`` at any instant leaves
either the old or the new state, never a mix. One daemon per store, and no start on a
damaged one (``guard``); a write the filesystem refuses (disk full, quota) raises
:class:`~chandrad.errors.StoreFull`: the transaction is rolled back and the caller waits
for space.

Threading: one :class:`Store` holds one connection and must be used from one thread, the
daemon's event-loop thread (sqlite3 enforces it). Calls are short (sub-millisecond plus
one fsync), so they run inline on the loop.

The modules, by concern:

- ``records``: ``Job``, ``Page``, ``Recovered``: what the store hands out (backend-neutral);
- ``contract``: ``StoreBackend``, the operations the daemon's services call
  (backend-neutral);
- ``sqlite``: ``Store``, the SQLite backend: open (lock, check, migrate, recover), close,
  and each operation handed to the table that owns its SQL;
- ``jobs``, ``pages``, ``profiles``: one table each, all of its SQL;
- ``database``: the connection's settings and its (nesting) write transaction;
- ``schema``: ``MIGRATIONS`` and running them;
- ``guard``: the state dir's lock, ``PRAGMA quick_check``, ``chandrad.store-used``, and
  the message a damaged store is refused with;
- ``repair``: ``chandrad store check`` and ``chandrad store repair``.

The package must not import any other chandrad adapter or service (only the leaves
``errors``, ``names``, ``states``); its modules import each other, never this file.
"""

from __future__ import annotations

from chandrad.store.contract import StoreBackend
from chandrad.store.guard import CHECK_BUDGET_S, DB_NAME, LOCK_NAME, USED_MARKER
from chandrad.store.records import DUPLICATE_POLICIES, Job, Page, Recovered
from chandrad.store.repair import Repaired, check, repair
from chandrad.store.schema import MIGRATIONS
from chandrad.store.sqlite import Store

__all__ = [
    "CHECK_BUDGET_S",
    "DB_NAME",
    "DUPLICATE_POLICIES",
    "LOCK_NAME",
    "MIGRATIONS",
    "USED_MARKER",
    "Job",
    "Page",
    "Recovered",
    "Repaired",
    "Store",
    "StoreBackend",
    "check",
    "repair",
]
