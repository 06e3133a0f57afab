"""Intake: settled files from the watcher, hashed off the loop and accepted as jobs.

A batch of up to :data:`INTAKE_BATCH` files is one store transaction (one fsync), so a
backlog of thousands of files is queued in seconds. A batch leaves the queue only once
accepted; while the store's filesystem is full (:class:`StoreRoom`) it waits, the files
stay in the inbox and nothing goes to ``failed/``. An item that makes the loop raise is
named to the task supervisor (``chandrad.tasks.working_on``), which hands it to
:meth:`Intake.quarantine` and restarts the loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from chandrad import names, outputs
from chandrad.config import Config
from chandrad.errors import StoreFull, StoreUnreachable
from chandrad.events import Event
from chandrad.pipeline.content import sha256_file
from chandrad.store import StoreBackend
from chandrad.tasks import working_on

log = structlog.get_logger("chandrad.pipeline")

#: Settled files hashed and accepted per store transaction.
INTAKE_BATCH = 2000
#: Seconds between two tries to write to a store whose filesystem is full.
STORE_FULL_RETRY_S = 2.0


@dataclass(frozen=True)
class Settled:
    """A file the watcher saw finish arriving, as it saw it."""

    watch_index: int  # its watch's position in the config the watcher was started with
    root: Path  # that watch's input folder, resolved
    path: Path
    size: int
    mtime: float

    def row(self, digest: str) -> tuple[int, Path, Path, int, float, str]:
        """The store's ``accept`` arguments."""
        return self.watch_index, self.root, self.path, self.size, self.mtime, digest


class StoreRoom:
    """Whether the store takes writes, and why not (``status``, ``STATUS=``), said once:
    its filesystem is full (``store_full``) or its server cannot be reached
    (``store_unreachable``); the error's ``title`` is what the operator reads."""

    def __init__(self) -> None:
        #: The last refusal, until the store takes writes (or, unreachable, answers) again.
        self.error: StoreFull | None = None

    @property
    def message(self) -> str:
        """Why the store refuses writes ("" while it takes them)."""
        return self.error.message if self.error else ""

    def full(self, exc: StoreFull) -> None:
        """A write or read was refused: say so once (a warning, no traceback)."""
        if self.error is None or self.error.code != exc.code:
            log.warning(exc.code, path=exc.details.get("path"), reason=exc.message,
                        retry_every_s=STORE_FULL_RETRY_S)
        self.error = exc

    def room(self) -> None:
        if self.error is not None:
            log.info("store_reachable" if isinstance(self.error, StoreUnreachable)
                     else "store_has_room")
            self.error = None

    def reached(self) -> None:
        """A read succeeded: an unreachable store is back (a full one still may be full)."""
        if isinstance(self.error, StoreUnreachable):
            self.room()


def _hash_all(items: list[Settled]) -> list[tuple[Settled, str | None]]:
    out: list[tuple[Settled, str | None]] = []
    for item in items:
        try:
            out.append((item, sha256_file(item.path)))
        except OSError as exc:
            log.warning("accept_skipped", file=names.display(item.path),
                        reason=names.text(str(exc)))
            out.append((item, None))
    return out


class Intake:
    """The queue of settled files and the loop that accepts them."""

    def __init__(self, config: Config, store: StoreBackend, room: StoreRoom,
                 accepted: Callable[[], None]) -> None:
        self.config = config
        self.store = store
        self.room = room
        self._accepted = accepted  # new jobs may be waiting: wake the dispatcher
        self.queue: list[Settled] = []
        self._ready = asyncio.Event()
        self.busy = False  # a batch is being hashed/accepted

    def submit(self, item: Settled) -> None:
        self.queue.append(item)
        self._ready.set()

    async def loop(self) -> None:
        """Hash and accept settled files in batches, until cancelled."""
        while True:
            if not self.queue:
                await self._ready.wait()
                self._ready.clear()
            while self.queue:
                batch = self.queue[:INTAKE_BATCH]
                self.busy = True
                try:
                    # Hash what is new or changed; a file whose active job recorded the
                    # same size and mtime is that job's content (it re-hashes at start).
                    fresh = await self._fresh_when_reachable(batch)
                    hashed = await asyncio.to_thread(_hash_all, fresh)
                    await self._accept_when_room(hashed)
                finally:
                    self.busy = False
                del self.queue[:len(batch)]

    async def _fresh_when_reachable(self, batch: list[Settled]) -> list[Settled]:
        """The items of ``batch`` the store does not know as they are, waiting while the
        store cannot be read (its server is down): the files stay in the inbox."""
        while True:
            try:
                fresh = []
                for item in batch:
                    with working_on(item):
                        if not self._known(item):
                            fresh.append(item)
                return fresh
            except StoreUnreachable as exc:
                self.room.full(exc)
                await asyncio.sleep(STORE_FULL_RETRY_S)

    async def _accept_when_room(self, hashed: list[tuple[Settled, str | None]]) -> None:
        """Accept a hashed batch, waiting while the store's filesystem is full."""
        while True:
            try:
                self._accept_batch(hashed)
            except StoreFull as exc:
                self.room.full(exc)
                await asyncio.sleep(STORE_FULL_RETRY_S)
                continue
            self.room.room()
            return

    def _known(self, item: Settled) -> bool:
        job = self.store.find_active(item.path)
        return job is not None and job.size == item.size and job.mtime == item.mtime

    def _accept_batch(self, hashed: list[tuple[Settled, str | None]]) -> None:
        by_policy: dict[str, list[tuple[int, Path, Path, int, float, str]]] = {}
        settled: dict[Path, Settled] = {}
        for item, digest in hashed:
            if digest is None:
                continue  # vanished or unreadable; a later event or rescan brings it back
            if not item.path.exists():
                # Gone since it was hashed: with hosts sharing the inbox, another host may
                # have finished it and moved it to done/ meanwhile (not new work).
                continue
            settled[item.path] = item
            policy = self.config.watch[item.watch_index].duplicates
            by_policy.setdefault(policy, []).append(item.row(digest))
        for policy, items in by_policy.items():
            try:
                jobs = self.store.accept_many(items, policy)
            except StoreFull:
                raise  # not an item's fault: the whole batch waits for space
            except Exception:
                # One item spoiled the batch's transaction: accept one by one, so the
                # supervisor learns which item it was.
                jobs = []
                for one in items:
                    with working_on(settled[one[2]]):
                        job = self.store.accept(*one, duplicates=policy)
                    if job is not None:
                        jobs.append(job)
            for job in jobs:
                log.info(Event.JOB_ACCEPTED, job=job.id, file=names.display(job.abs_path),
                         size=job.size, sha256=job.sha256)
            skipped = len(items) - len(jobs)
            if skipped and policy == "skip":
                log.info("duplicates_skipped", count=skipped)
        self._accepted()

    def quarantine(self, item: Settled, exc: BaseException) -> None:
        """Move an item that crashed a supervised loop out of the way (``chandrad.tasks``):
        a settled file not yet a job goes to ``failed/`` with ``intake_error``, so neither
        the restarted loop nor a restarted daemon takes it again."""
        reason = names.text(f"{type(exc).__name__}: {exc}")
        self.queue[:] = [i for i in self.queue if i.path != item.path]
        if not Path(item.path).exists():
            log.warning("file_quarantine_gone", file=names.display(item.path), reason=reason)
            return
        final = outputs.move_to(self.config.watch[item.watch_index].failed, item.root,
                                item.path)
        outputs.write_error_json(final, "intake_error", f"could not be accepted: {reason}", 0,
                                 {"failed": time.time()})
        log.error(Event.FILE_QUARANTINED, file=names.display(item.path), code="intake_error",
                  reason=reason, moved_to=names.display(final))
