"""The HTTP job API's tables: who owns a job (``api_jobs``) and the webhook outbox.

A job uploaded through the API is accepted with ``jobs``' own ``accept`` and its
``api_jobs`` row (owner token, outputs, webhook URL) in the same transaction
(:meth:`ApiTable.accept`), so no job is ever without its owner. The outbox rows are written
by the schema's ``webhook_on_finish`` trigger in the transaction that ends such a job
(``done``, ``partial``, ``failed``); the sender (``chandrad.api.webhooks``) reads the due
ones and records each attempt here.

The same SQL runs on both backends (SQLite's migration 6, PostgreSQL's 3). On PostgreSQL
every host with ``[api]`` on runs a sender against the one outbox, so :meth:`ApiTable.due`
claims what it returns: the due rows are taken ``FOR UPDATE SKIP LOCKED`` (two hosts
polling together never get the same row) and their ``next_at`` moved ``hold_s`` ahead, past
the claiming host's attempts; the attempt's outcome sets it again. A host that dies
mid-attempt leaves its rows due again after ``hold_s``: delivery stays at least once, with
the same body and idempotency key, and never once per host.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from chandrad.store.database import SqlDatabase
from chandrad.store.records import Job


@dataclass(frozen=True)
class ApiJob:
    """What the API stored with a job it accepted."""

    job_id: int
    owner: str
    outputs: tuple[str, ...]
    callback_url: str | None


@dataclass(frozen=True)
class OutboxItem:
    """One webhook to deliver: a job's outcome."""

    id: int
    job_id: int
    state: str
    created_at: float
    attempts: int
    body: str | None
    url: str | None


class ApiTable:
    """``api_jobs`` and ``webhook_outbox`` on the store's connection."""

    def __init__(self, db: SqlDatabase) -> None:
        self._db = db

    @classmethod
    def of(cls, store: Any) -> ApiTable:
        """The API's tables of an open store, SQLite ``Store`` or ``PgStore`` (the same
        connection, so that a job and its owner are one transaction)."""
        return cls(store._db)

    # -- jobs ------------------------------------------------------------------------
    def accept(self, accept: Callable[[], Job | None], owner: str, outputs: tuple[str, ...],
               callback_url: str | None) -> Job | None:
        """Run the store's ``accept`` and record the job's owner in one transaction;
        ``None`` (nothing recorded) when the store did not take it as new work."""
        with self._db.tx() as c:
            job = accept()
            if job is not None:
                c.execute("INSERT INTO api_jobs (job_id, owner, outputs, callback_url) "
                          "VALUES (?, ?, ?, ?)",
                          (job.id, owner, json.dumps(list(outputs)), callback_url))
        return job

    def get(self, job_id: int) -> ApiJob | None:
        row = self._db.conn.execute(
            "SELECT job_id, owner, outputs, callback_url FROM api_jobs WHERE job_id = ?",
            (job_id,)).fetchone()
        return None if row is None else _api_job(row)

    def job_ids(self, owner: str | None, state: str | None, limit: int) -> list[int]:
        """Job ids, newest first: ``owner``'s API jobs, or every job when None (admin)."""
        where, args = [], []
        if owner is not None:
            where.append("j.id IN (SELECT job_id FROM api_jobs WHERE owner = ?)")
            args.append(owner)
        if state is not None:
            where.append("j.state = ?")
            args.append(state)
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        rows = self._db.conn.execute(
            f"SELECT j.id FROM jobs j {clause} ORDER BY j.id DESC LIMIT ?",
            (*args, limit)).fetchall()
        return [int(r[0]) for r in rows]

    def same_content(self, sha256: str) -> int | None:
        """The newest open or done job with this content (the ``skip`` duplicate)."""
        row = self._db.conn.execute(
            "SELECT id FROM jobs WHERE sha256 = ? AND state IN ('pending', 'running', "
            "'held', 'done') ORDER BY id DESC LIMIT 1", (sha256,)).fetchone()
        return None if row is None else int(row[0])

    def queue_position(self, job_id: int) -> int:
        """Pending jobs that start before this pending one (0: it is next)."""
        row = self._db.conn.execute(
            "SELECT COUNT(*) FROM jobs WHERE state = 'pending' AND id < ?",
            (job_id,)).fetchone()
        return int(row[0])

    def queue_positions(self, job_ids: list[int]) -> dict[int, int]:
        """:meth:`queue_position` of each pending job among ``job_ids`` (others left out),
        from one scan of the pending jobs."""
        if not job_ids:
            return {}
        pending = [int(r[0]) for r in self._db.conn.execute(
            "SELECT id FROM jobs WHERE state = 'pending' AND id <= ? ORDER BY id",
            (max(job_ids),)).fetchall()]
        wanted = set(job_ids)
        return {job_id: rank for rank, job_id in enumerate(pending) if job_id in wanted}

    # -- the webhook outbox ----------------------------------------------------------
    def due(self, now: float, limit: int = 50, hold_s: float = 60.0) -> list[OutboxItem]:
        """Webhooks due now (neither delivered nor given up), oldest first. On a shared
        (PostgreSQL) store they are claimed for this sender: no other host gets them for
        ``hold_s`` seconds, unless an attempt's outcome (:meth:`delivered`,
        :meth:`failed`) comes first."""
        if self._db.dialect == "sqlite":  # one daemon per store: nothing to claim
            rows = self._db.conn.execute(
                f"SELECT {_ITEM} FROM webhook_outbox o LEFT JOIN api_jobs a ON "
                "a.job_id = o.job_id WHERE o.delivered_at IS NULL AND o.given_up_at IS NULL "
                "AND o.next_at <= ? ORDER BY o.next_at, o.id LIMIT ?", (now, limit)).fetchall()
            return [OutboxItem(*r) for r in rows]
        with self._db.tx() as c:
            rows = c.execute(
                "WITH c AS (SELECT id, next_at FROM webhook_outbox WHERE delivered_at IS NULL "
                "AND given_up_at IS NULL AND next_at <= ? ORDER BY next_at, id LIMIT ? "
                "FOR UPDATE SKIP LOCKED), claimed AS (UPDATE webhook_outbox o SET next_at = ? "
                "FROM c WHERE o.id = c.id RETURNING o.*, c.next_at AS was) "
                f"SELECT {_ITEM} FROM claimed o LEFT JOIN api_jobs a ON a.job_id = o.job_id "
                "ORDER BY o.was, o.id", (now, limit, now + hold_s)).fetchall()
        return [OutboxItem(*r) for r in rows]

    def freeze_body(self, item_id: int, body: str) -> str:
        """Keep the first body composed for a webhook, so every attempt sends the same
        bytes; returns the body stored."""
        with self._db.tx() as c:
            c.execute("UPDATE webhook_outbox SET body = ? WHERE id = ? AND body IS NULL",
                      (body, item_id))
            row = c.execute("SELECT body FROM webhook_outbox WHERE id = ?",
                            (item_id,)).fetchone()
        return str(row[0])

    def delivered(self, item_id: int) -> None:
        with self._db.tx() as c:
            c.execute("UPDATE webhook_outbox SET delivered_at = ?, attempts = attempts + 1, "
                      "last_error = NULL WHERE id = ?", (time.time(), item_id))

    def failed(self, item_id: int, error: str, next_at: float | None) -> None:
        """One attempt failed: try again at ``next_at``, or give up (None)."""
        with self._db.tx() as c:
            if next_at is None:
                c.execute("UPDATE webhook_outbox SET given_up_at = ?, attempts = attempts + 1, "
                          "last_error = ? WHERE id = ?", (time.time(), error, item_id))
            else:
                c.execute("UPDATE webhook_outbox SET next_at = ?, attempts = attempts + 1, "
                          "last_error = ? WHERE id = ?", (next_at, error, item_id))

    def outbox_counts(self) -> dict[str, int]:
        """Webhooks pending, delivered and given up."""
        row = self._db.conn.execute(
            "SELECT COUNT(*) FILTER (WHERE delivered_at IS NULL AND given_up_at IS NULL), "
            "COUNT(delivered_at), COUNT(given_up_at) FROM webhook_outbox").fetchone()
        return {"pending": int(row[0]), "delivered": int(row[1]), "undeliverable": int(row[2])}

    def undeliverable(self, limit: int = 20) -> list[dict[str, Any]]:
        """The newest webhooks given up: job, outcome, attempts, last error."""
        rows = self._db.conn.execute(
            "SELECT job_id, state, attempts, last_error, given_up_at FROM webhook_outbox "
            "WHERE given_up_at IS NOT NULL ORDER BY given_up_at DESC LIMIT ?",
            (limit,)).fetchall()
        return [{"job": r[0], "state": r[1], "attempts": r[2], "error": r[3],
                 "given_up_at": r[4]} for r in rows]


#: An outbox row as :class:`OutboxItem`, over ``webhook_outbox o`` joined with ``api_jobs a``.
_ITEM = "o.id, o.job_id, o.state, o.created_at, o.attempts, o.body, a.callback_url"


def _api_job(row: tuple[Any, ...]) -> ApiJob:
    return ApiJob(job_id=int(row[0]), owner=str(row[1]), outputs=tuple(json.loads(row[2])),
                  callback_url=row[3])
