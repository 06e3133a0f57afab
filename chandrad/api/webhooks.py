"""Webhooks: each API job's outcome POSTed to its callback URL, signed, at least once.

The outbox rows come from the store (a trigger writes one in the transaction that ends a
job with a callback), so a ``kill -9`` between a job's end and its delivery loses nothing:
the next daemon sends it. The body is composed once and kept, so every attempt sends the
same bytes with the same ``Idempotency-Key`` (``chandrad-<outbox id>``); receivers drop
repeats by that key. Signature, as Stripe signs: ``Chandrad-Signature: t=<unix seconds>,
v1=<hex HMAC-SHA256 of "<t>.<body>">`` keyed by ``api.webhook_secret_file``. An answer
other than 2xx, or none within :data:`TIMEOUT_S`, is retried with exponential backoff
(:data:`BACKOFF_FIRST_S` doubling to :data:`BACKOFF_MAX_S`) until ``api.webhook_deadline``
after the outcome; then it is given up: logged ``webhook_undeliverable``, counted, listed
in ``status``. On a shared (PostgreSQL) store every host with ``[api]`` on runs a sender;
each claims the rows it sends (``ApiTable.due``), so a webhook goes out once cluster-wide,
not once per host.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import structlog

from chandrad import names
from chandrad.store import StoreBackend
from chandrad.store.api import ApiTable, OutboxItem

log = structlog.get_logger("chandrad.api")

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 300.0
TIMEOUT_S = 10.0
#: Seconds between two looks at the outbox when nothing is due sooner.
POLL_S = 0.5
#: Webhooks taken from the outbox at once, and the seconds they stay this sender's (on a
#: shared store no other host sends them meanwhile): time for each to use its whole
#: timeout, and a margin.
BATCH = 4
HOLD_S = BATCH * TIMEOUT_S + 20.0
SIGNATURE_HEADER = "Chandrad-Signature"


def sign(secret: bytes, body: bytes, t: int) -> str:
    """The ``Chandrad-Signature`` value of ``body`` at unix time ``t``."""
    mac = hmac.new(secret, f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={t},v1={mac}"


def backoff(attempts: int) -> float:
    """Seconds before the next try after ``attempts`` failed ones (1, 2, 4, … 300)."""
    return float(min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** max(0, attempts - 1)))


class WebhookSender:
    """The outbox's delivery loop."""

    def __init__(self, store: StoreBackend, secret: bytes | None, deadline: float,
                 on_undeliverable: Callable[[], None] = lambda: None) -> None:
        self.store = store
        self.table = ApiTable.of(store)
        self.secret = secret
        self.deadline = deadline
        self._on_undeliverable = on_undeliverable
        self.delivered = 0
        self.undeliverable = 0
        self.failed_attempts = 0

    def body(self, item: OutboxItem) -> str:
        """The webhook's JSON: the job's summary at its outcome."""
        job = self.store.get(item.job_id)
        api = self.table.get(item.job_id)
        outputs = api.outputs if api else ()
        finished = item.state in ("done", "partial")
        summary: dict[str, Any] = {
            "event": "job.finished",
            "id": item.job_id,
            "state": item.state,
            "file": names.display(job.path.name) if job else None,
            "pages_total": job.pages_total if job else None,
            "pages_done": job.pages_done if job else None,
            "pages_failed": job.pages_failed if job else None,
            "error": ({"code": job.error_code, "message": job.error_message}
                      if job and job.error_code else None),
            "results": ({f: f"/v1/jobs/{item.job_id}/result?format={f}" for f in outputs}
                        if finished else {}),
            "finished_at": item.created_at,
        }
        return json.dumps(summary, sort_keys=True, separators=(",", ":"))

    async def run(self) -> None:
        """Deliver due webhooks until cancelled."""
        async with httpx.AsyncClient(timeout=TIMEOUT_S, follow_redirects=False) as client:
            while True:
                due = self.table.due(time.time(), BATCH, HOLD_S)
                for item in due:
                    await self._attempt(client, item)
                if not due:
                    await asyncio.sleep(POLL_S)

    async def _attempt(self, client: httpx.AsyncClient, item: OutboxItem) -> None:
        body = item.body or self.table.freeze_body(item.id, self.body(item))
        if item.url is None or self.secret is None:
            self._give_up(item, "no callback URL or no webhook secret")
            return
        t = int(time.time())
        headers = {"Content-Type": "application/json",
                   SIGNATURE_HEADER: sign(self.secret, body.encode(), t),
                   "Idempotency-Key": f"chandrad-{item.id}",
                   "User-Agent": "chandrad-webhook"}
        error = ""
        try:
            answer = await client.post(item.url, content=body.encode(), headers=headers)
            if 200 <= answer.status_code < 300:
                self.table.delivered(item.id)
                self.delivered += 1
                log.info("webhook_delivered", job=item.job_id, state=item.state,
                         attempts=item.attempts + 1, status=answer.status_code)
                return
            error = f"HTTP {answer.status_code}"
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
        self.failed_attempts += 1
        if time.time() - item.created_at >= self.deadline:
            self._give_up(item, error)
            return
        delay = backoff(item.attempts + 1)
        self.table.failed(item.id, error, time.time() + delay)
        log.warning("webhook_failed", job=item.job_id, state=item.state,
                    attempts=item.attempts + 1, error=error, retry_in_s=delay)

    def _give_up(self, item: OutboxItem, error: str) -> None:
        self.table.failed(item.id, error, None)
        self.undeliverable += 1
        self._on_undeliverable()
        log.error("webhook_undeliverable", job=item.job_id, state=item.state,
                  attempts=item.attempts + 1, error=error, url=item.url)

    def status(self) -> dict[str, Any]:
        """``status``'s ``api.webhooks``: the outbox's counts and the last given up."""
        return {**self.table.outbox_counts(), "given_up": self.table.undeliverable(5)}
