"""Helping: this host's engines take pages of jobs other hosts own (a shared store).

On PostgreSQL a long document is not bound to the one host that owns its job: a host whose
engines have free request slots and none of its own pages waiting for them leases pending
pages of other live hosts' running jobs (``StoreBackend.claim_helped_pages``, last pages
first), renders each from the shared input, infers it on its own engines and stores the
result fenced by the page's lease (a :class:`~chandrad.pipeline.worker.PageWorker` with
``helping``). A page whose lease it lost (it stalled past ``daemon.lease_s``; the owner
took the page back) is dropped, nothing stored; a page it cannot finish (the daemon
stops or is paused, its engine failed under the page, the job ended) is given back at
once. The job's owner writes the outputs once
every page is stored. On SQLite (one host) there is nothing to help with: the loop asks
the store, which answers none without a query.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

import structlog

from chandrad.errors import StoreFull
from chandrad.pipeline.worker import PageWorker
from chandrad.store import Job, StoreBackend
from chandrad.tasks import cancel_and_wait

log = structlog.get_logger("chandrad.pipeline")

#: Seconds between looks for pages to help with.
HELP_POLL_S = 0.5


class Helper:
    """The pages of other hosts' jobs this host works on."""

    def __init__(self, store: StoreBackend, worker: PageWorker, own: PageWorker,
                 roots: Callable[[], list[Path]], busy: Callable[[], bool]) -> None:
        self.store = store
        self.worker = worker  # ``helping``: shares the request slots with ``own``
        self._own = own
        self._roots = roots  # the configured watches' input folders
        self._busy = busy  # this host has work of its own to start or send
        self._tasks: dict[tuple[int, int], asyncio.Task[None]] = {}
        self._undropped: set[tuple[int, int]] = set()  # a give-back the store refused

    @property
    def pages_held(self) -> int:
        """Pages of other hosts' jobs this host is working on now."""
        return len(self._tasks)

    async def loop(self) -> None:
        """Look for pages to help with every ``HELP_POLL_S``, until cancelled (then the
        pages being worked on are given back)."""
        try:
            while True:
                if not self.worker.dispatching.is_set():
                    # Paused: the pages of other hosts' jobs go back to their owners now
                    # instead of waiting here for a resume.
                    await cancel_and_wait(list(self._tasks.values()))
                    await self.worker.dispatching.wait()
                try:
                    self._give_back_undropped()
                    self._claim()
                except StoreFull:  # unreachable or full: the pipeline says so; look later
                    pass
                await asyncio.sleep(HELP_POLL_S)
        finally:
            await cancel_and_wait(list(self._tasks.values()))

    def _room(self) -> int:
        """Pages to take now: while a request slot is free with no page of this host
        waiting for it, as many as keep this host's helped pages within its render-ahead
        window (what it would hold of its own job: rendered ahead, then in flight)."""
        limits = self.worker.limits
        free = (limits.request_limit() - limits.inflight.in_use - self._own.pages_waiting
                - self.worker.pages_waiting)
        if free <= 0:
            return 0
        return limits.window_limit() - len(self._tasks)

    def _claim(self) -> None:
        if self._busy():
            return
        room = self._room()
        if room <= 0:
            return
        for job, index in self.store.claim_helped_pages(self._roots(), room):
            key = (job.id, index)
            self._tasks[key] = asyncio.create_task(self._run(job, index))

    async def _run(self, job: Job, index: int) -> None:
        key = (job.id, index)
        done = False
        try:
            done = await self.worker.run(job, index)
        except Exception as exc:  # the store refused, or a bug: the page goes back
            log.warning("page_help_failed", job=job.id, page=index + 1,
                        error=f"{type(exc).__name__}: {exc}")
        finally:
            self._tasks.pop(key, None)
            if not done:
                self._undropped.add(key)
                with contextlib.suppress(StoreFull):
                    self._give_back_undropped()

    def _give_back_undropped(self) -> None:
        """Give back the pages this host held and did not finish (a no-op for a page
        stored, failed or taken back meanwhile)."""
        for job_id, index in sorted(self._undropped):
            self.store.drop_helped_page(job_id, index)
            self._undropped.discard((job_id, index))
