"""The job flow: settled file → accepted job → rendered pages → inference → outputs.

Owns the scheduling of work, not any resource: the store keeps state, the render
pool makes pixels, the engine (seen only as an ``EngineHandle``) answers, ``ocr``
turns answers into Markdown/HTML/blocks, ``outputs`` writes files. Stages are small
functions; :meth:`Pipeline.run_job` composes them.

Saturation (issue 11): in-flight requests follow the engine's capacity (``max_num_seqs``
plus headroom, and ``/metrics``), not a fixed batch, and page tasks render ahead of
inference inside a window of ``capacity + render-ahead`` pages (rendering, rendered and
waiting for a request slot, in flight), the render-ahead being half the capacity (at least
3 pages per render worker). A page leaves the window when its answer arrives; answers
waiting for or in post-processing have a bound of their own (the capacity). So while the
engine is full, half a batch of rendered pages waits behind it, and when vLLM finishes
requests in a burst their slots are refilled at once while the workers post-process the
answers; post-processing never holds up rendering. As many jobs run as the window has
pages, so a backlog of one-page files fills the engine as well as one long PDF does.
Durability: every page result is committed to the store before it counts, so a
restart resumes at page granularity and outputs are rebuilt from the store.

A job finds its watch by the watch's input folder (``Job.input_root``), never by
position, so a reload that reorders ``[[watch]]`` entries changes nothing; a job
whose watch was removed is *held* (not started, listed in ``status``) until the
watch is back or the job is cancelled. A job is bound to the content it was
accepted with: the input is re-hashed when the job starts or resumes and before it
is moved, and a replaced file is queued as new content (the old job ends
``cancelled``/``input_replaced``). A job that cannot even be failed (say ``failed/``
is not writable) is retried with exponential back-off, visible in ``status``.

Outputs that cannot be written for an OS condition (disk full, read-only, quota,
permission) put the job in the ``held`` state (``output_unwritable``) instead of
failing it; it is retried on its own (``HOLD_RETRY_FIRST`` doubling to
``HOLD_RETRY_MAX``) and its pages are not recomputed.

A store whose filesystem is full (``StoreFull``) is held the same way, for the whole
pipeline: nothing is failed for it; settled files wait in the inbox (their batch is
accepted once a write succeeds, tried every ``STORE_FULL_RETRY_S``), a job that could not
record its progress waits where the store has it, and :attr:`Pipeline.store_full` says
why (``status``, ``STATUS=``) until a write goes through again.

The intake and dispatch loops run under ``chandrad.tasks`` supervision (wired by the
daemon); they declare the item they work on, and :meth:`Pipeline.quarantine` moves
an item that crashed a loop out of the way.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import glob
import hashlib
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from chandrad import model_files, names, ocr, outputs
from chandrad.config import Config, WatchConfig
from chandrad.engine.profile import PIXELS_PER_IMAGE_TOKEN, estimate_prompt_tokens
from chandrad.errors import (
    CANCELLED_CODE,
    CANCELLED_MESSAGE,
    ChandradError,
    EngineUnavailable,
    InputError,
    OutputUnwritable,
    RenderCrashed,
    RenderTimeout,
    StoreFull,
)
from chandrad.events import Event
from chandrad.interfaces import EngineHandle, Observer
from chandrad.protocol import HeldJob, HeldStatus
from chandrad.render import RenderPool
from chandrad.states import JobState, PageState
from chandrad.store import Job, Store
from chandrad.tasks import cancel_and_wait, working_on

log = structlog.get_logger("chandrad.pipeline")

READ_CHUNK = 1 << 20
#: Settled files hashed and accepted per store transaction.
INTAKE_BATCH = 2000
#: Requests of one page that may fail with the engine "unavailable" without counting
#: against its ``ocr.retries``; past this, a request that timed out or got a 5xx is
#: charged, so one poison page cannot keep a job (and a drain) alive forever. A refused or
#: dropped connection (the engine died under the page) is never charged.
MAX_FREE_RELEASES = 3
#: Back-off of a job whose run raised past its own error handling (e.g. its input could
#: not be moved to ``failed/``): first delay, doubled each time, up to the cap.
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 300.0
#: Seconds before a held job (outputs unwritable) is tried again; doubles up to the max.
HOLD_RETRY_FIRST = 5.0
HOLD_RETRY_MAX = 60.0
#: Seconds between two tries to write to a store whose filesystem is full.
STORE_FULL_RETRY_S = 2.0
#: Pages rendered ahead of a full engine: its request limit divided by this (issue 11).
RENDER_AHEAD_DIVISOR = 2

_Settled = tuple[int, Path, Path, int, float]  # watch index, root, path, size, mtime


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _fingerprint(path: Path) -> tuple[str, int, float]:
    """sha256, size and mtime of ``path`` (raises FileNotFoundError when it is gone)."""
    st = path.stat()
    return sha256_file(path), st.st_size, st.st_mtime


def _find_moved(job: Job, intended: Path) -> Path | None:
    """Where the input went when a move to ``intended`` completed but its outcome was
    never recorded: that path or a `` (n)`` variant of it, holding the job's content."""
    if not intended.parent.is_dir():
        return None
    pattern = f"{glob.escape(intended.stem)} (*){glob.escape(intended.suffix)}"
    for candidate in [intended, *sorted(intended.parent.glob(pattern))]:
        try:
            if (candidate.is_file() and not candidate.is_symlink()
                    and candidate.stat().st_size == job.size
                    and sha256_file(candidate) == job.sha256):
                return candidate
        except OSError:
            continue
    return None


def _is_under(path: Path, folder: Path) -> bool:
    try:
        path.relative_to(folder)
    except ValueError:
        return False
    return True


def _hash_all(items: list[_Settled]) -> list[tuple[_Settled, str | None]]:
    out: list[tuple[_Settled, str | None]] = []
    for item in items:
        try:
            out.append((item, sha256_file(item[2])))
        except OSError as exc:
            log.warning("accept_skipped", file=names.display(item[2]),
                        reason=names.text(str(exc)))
            out.append((item, None))
    return out


class DynamicLimiter:
    """A semaphore whose limit is read from a callable each time (engine capacity)."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self.limit = limit
        self.in_use = 0
        self._cond = asyncio.Condition()

    async def acquire(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.in_use < max(1, self.limit()))
            self.in_use += 1

    async def release(self) -> None:
        async with self._cond:
            self.in_use -= 1
            # One slot came free: wake one waiter, not all (a 1,000-page job has ~1,000
            # page tasks waiting here). If the limit shrank it waits again, as would all.
            self._cond.notify(1)

    async def poke(self) -> None:
        """Re-evaluate waiters after the limit changed."""
        async with self._cond:
            self._cond.notify_all()


class _Hold:
    """One page's slot in a :class:`DynamicLimiter`, given back at most once (a page
    leaves the render-ahead window when its answer arrives, or when it ends otherwise)."""

    def __init__(self, limiter: DynamicLimiter) -> None:
        self.limiter = limiter
        self.held = False

    async def acquire(self) -> None:
        await self.limiter.acquire()
        self.held = True

    async def release(self) -> None:
        if self.held:
            self.held = False
            await self.limiter.release()


@dataclass
class _PageOutcome:
    ok: bool
    error: str | None = None
    inference_s: float = 0.0  # engine time of the page's requests, retries included


@dataclass(frozen=True)
class _Backoff:
    """A job whose last run raised past its own error handling, and when to retry it."""

    until: float  # monotonic
    failures: int
    reason: str
    file: str
    input_root: Path | None  # the job's watch, by its input folder; None: job not found


class Pipeline:
    """Runs accepted jobs to completion while the daemon lets it dispatch."""

    def __init__(
        self, config: Config, store: Store, engine: EngineHandle, render: RenderPool
    ) -> None:
        self.config = config
        self.store = store
        self.engine = engine
        self.render = render
        self.workers = render.workers
        self.dispatching = asyncio.Event()
        self.dispatching.set()
        #: False once the daemon is stopping: no queued job is started any more.
        self.starting_jobs = True
        self.accepting = True
        self._inflight = DynamicLimiter(self._request_limit)
        self._window = DynamicLimiter(self._window_limit)
        self._post = DynamicLimiter(self._request_limit)  # answers post-processing
        #: Rendered pages waiting for a request slot (``status``; issue 11: while any wait,
        #: the requests in flight should be at the limit).
        self.pages_waiting = 0
        self._active: dict[int, asyncio.Task[None]] = {}
        self._active_paths: dict[int, Path] = {}
        self._backoff: dict[int, _Backoff] = {}
        self._patch_pixels: tuple[str, int] | None = None  # (model, pixels per image token)
        self._held_retry: dict[int, tuple[float, float]] = {}  # job -> (due, delay), monotonic
        self._wake = asyncio.Event()
        self._intake: list[_Settled] = []
        self._intake_ready = asyncio.Event()
        self._intake_busy = False  # a batch is being hashed/accepted
        #: Why the store refuses writes ("" while it takes them): ``status``, ``STATUS=``.
        self.store_full = ""
        self._store_wait: dict[int, float] = {}  # job -> retry due (monotonic): store full
        self.observer: Observer | None = None  # metrics: page outcomes and latencies

    def _request_limit(self) -> int:
        if self.config.ocr.max_in_flight:
            return self.config.ocr.max_in_flight
        return self.engine.capacity

    def _window_limit(self) -> int:
        """Pages rendering, rendered and waiting for a request slot, or in flight: the
        requests plus the render-ahead, half of them (at least 3 pages per render worker),
        so that a burst of answers is refilled from rendered pages (issue 11)."""
        limit = self._request_limit()
        return limit + max(3 * self.workers, limit // RENDER_AHEAD_DIVISOR)

    # ------------------------------------------------------------ intake
    def submit(self, watch_index: int, root: Path, path: Path, size: int, mtime: float) -> None:
        """A settled file from the watcher; accepted into the store by the intake loop."""
        if not self.accepting:
            return
        self._intake.append((watch_index, root, path, size, mtime))
        self._intake_ready.set()

    async def intake_loop(self) -> None:
        """Hash and accept settled files in batches: one transaction (one fsync) per batch,
        so a backlog of thousands of files is queued in seconds.

        A batch leaves the queue only once accepted; an item that makes the loop raise
        is named to the task supervisor, which quarantines it and restarts the loop.
        """
        while True:
            if not self._intake:
                await self._intake_ready.wait()
                self._intake_ready.clear()
            while self._intake:
                batch = self._intake[:INTAKE_BATCH]
                self._intake_busy = True
                try:
                    # Hash what is new or changed; a file whose active job recorded the
                    # same size and mtime is that job's content (it re-hashes at start).
                    fresh = []
                    for item in batch:
                        with working_on(item):
                            if not self._known(item):
                                fresh.append(item)
                    hashed = await asyncio.to_thread(_hash_all, fresh)
                    await self._accept_when_room(hashed)
                finally:
                    self._intake_busy = False
                del self._intake[:len(batch)]

    async def _accept_when_room(self, hashed: list[tuple[_Settled, str | None]]) -> None:
        """Accept a hashed batch, waiting while the store's filesystem is full: the files
        stay in the inbox, nothing goes to ``failed/``."""
        while True:
            try:
                self._accept_batch(hashed)
            except StoreFull as exc:
                self._store_is_full(exc)
                await asyncio.sleep(STORE_FULL_RETRY_S)
                continue
            self._store_has_room()
            return

    def _store_is_full(self, exc: StoreFull) -> None:
        """A write was refused for space: say so once (a warning, no traceback)."""
        if not self.store_full:
            log.warning("store_full", path=exc.details.get("path"), reason=exc.message,
                        retry_every_s=STORE_FULL_RETRY_S)
        self.store_full = exc.message

    def _store_has_room(self) -> None:
        if self.store_full:
            self.store_full = ""
            log.info("store_has_room")

    def _known(self, item: _Settled) -> bool:
        job = self.store.find_active(item[2])
        return job is not None and job.size == item[3] and job.mtime == item[4]

    def _accept_batch(self, hashed: list[tuple[_Settled, str | None]]) -> None:
        by_policy: dict[str, list[tuple[int, Path, Path, int, float, str]]] = {}
        settled: dict[Path, _Settled] = {}
        for item, digest in hashed:
            index, root, path, size, mtime = item
            if digest is None:
                continue  # vanished or unreadable; a later event or rescan brings it back
            settled[path] = item
            policy = self.config.watch[index].duplicates
            by_policy.setdefault(policy, []).append((index, root, path, size, mtime, digest))
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
        self._wake.set()

    # ------------------------------------------------------------ quarantine
    def quarantine(self, item: Any, exc: BaseException) -> None:
        """Move an item that crashed a supervised loop out of the way (``chandrad.tasks``):
        a settled file (``(watch index, root, path, …)``) not yet a job goes to
        ``failed/`` with ``intake_error``, so neither the restarted loop nor a restarted
        daemon takes it again."""
        reason = names.text(f"{type(exc).__name__}: {exc}")
        index, root, path = item[0], item[1], item[2]
        self._intake[:] = [i for i in self._intake if i[2] != path]
        if not Path(path).exists():
            log.warning("file_quarantine_gone", file=names.display(path), reason=reason)
            return
        final = outputs.move_to(self.config.watch[index].failed, root, path)
        outputs.write_error_json(final, "intake_error", f"could not be accepted: {reason}", 0,
                                 {"failed": time.time()})
        log.error(Event.FILE_QUARANTINED, file=names.display(path), code="intake_error",
                  reason=reason, moved_to=names.display(final))

    # ------------------------------------------------------------ dispatch
    async def dispatch_loop(self) -> None:
        """Start jobs oldest first (resumed running jobs, then held jobs whose retry is
        due, then pending ones), until cancelled."""
        while True:
            await self.dispatching.wait()
            try:
                self._start_jobs()
            except StoreFull as exc:  # the job was not marked running: it waits pending
                self._store_is_full(exc)
            self._wake.clear()
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancel.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._wake.wait()
            await self._window.poke()
            await self._inflight.poke()
            await self._post.poke()

    def _job_slots(self) -> int:
        """Jobs running at once: as many as the window has pages (one-page files fill
        it as well as a long document), at least 2."""
        return max(2, self._window_limit())

    def _watches_by_root(self) -> dict[Path, WatchConfig]:
        """Configured watches by their input folder as the watcher resolves it (the
        ``input_root`` recorded with each job): a job's watch is found by identity."""
        out: dict[Path, WatchConfig] = {}
        for watch in self.config.watch:
            out.setdefault(Path(os.path.realpath(watch.input)), watch)
        return out

    def _watch_for(self, job: Job) -> WatchConfig | None:
        return self._watches_by_root().get(job.input_root)

    def _start_jobs(self) -> None:
        if not self.starting_jobs:
            return  # stopping (SIGTERM): the jobs running finish, queued ones wait
        free = self._job_slots() - len(self._active)
        if free <= 0:
            return
        now = time.monotonic()
        exclude = (set(self._active) | {i for i, b in self._backoff.items() if b.until > now}
                   | {i for i, due in self._store_wait.items() if due > now}
                   | {j.id for j in self._held_jobs()
                      if self._held_retry.get(j.id, (0.0, 0.0))[0] > now})
        busy = set(self._active_paths.values())
        roots = list(self._watches_by_root())
        for job in self.store.next_jobs(roots, exclude, free):
            if job.abs_path in busy:
                continue  # a superseded job still finishing on the same file
            busy.add(job.abs_path)
            if job.state in (JobState.PENDING, JobState.HELD):
                # Marked running in the same loop step as the decision, not when its task
                # first runs: a SIGTERM that stops dispatch then finds every job it lets
                # finish already started, and none stamped started after it.
                self.store.set_job_state(job.id, JobState.RUNNING)
                self._store_has_room()
            task = asyncio.create_task(self.run_job(job))
            self._active[job.id] = task
            self._active_paths[job.id] = job.abs_path
            task.add_done_callback(self._job_finished)

    def _job_finished(self, task: asyncio.Task[None]) -> None:
        for job_id, active in list(self._active.items()):
            if active is task:
                del self._active[job_id]
                self._active_paths.pop(job_id, None)
                if not task.cancelled() and task.exception() is not None:
                    self._back_off(job_id, task.exception())
        self._wake.set()

    def _held_jobs(self) -> list[Job]:
        """Jobs in the ``held`` state (outputs unwritable); a held job found at start has
        no retry time yet and is due at once."""
        return self.store.list_jobs(JobState.HELD.value, limit=1000)

    def _back_off(self, job_id: int, exc: BaseException | None) -> None:
        """The job's run raised past its own error handling: retry it later, not now.

        Without this the job, still ``running``, would be dispatched again at once.
        """
        previous = self._backoff.get(job_id)
        failures = previous.failures + 1 if previous else 1
        delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (failures - 1))
        reason = exc.message if isinstance(exc, ChandradError) else f"{type(exc).__name__}: {exc}"
        job = self.store.get(job_id)
        self._backoff[job_id] = _Backoff(time.monotonic() + delay, failures, names.text(reason),
                                         names.display(job.abs_path) if job else "",
                                         job.input_root if job else None)
        # Our own errors carry their reason; anything else is a bug: keep its traceback.
        log.error("job_stuck", job=job_id, failures=failures, retry_in_s=delay, error=reason,
                  exc_info=None if isinstance(exc, ChandradError) else exc)

    def held(self) -> HeldStatus:
        """Accepted jobs that are not being worked on, and why (for ``status``): their
        watch is no longer configured (``watch_removed``), they are backing off after an
        error that left them unfinished (``backoff``), or their outputs cannot be written
        (``output_unwritable``)."""
        roots = self._watches_by_root()
        count, orphans = self.store.active_outside(list(roots))
        backoff = self._backing_off(roots)
        now = time.monotonic()
        jobs: list[HeldJob] = [{
            "id": j.id, "file": names.display(j.abs_path), "reason": "watch_removed",
            "message": f"no configured watch has input {j.input_root} any more; put it "
                       "back in the config and reload, or cancel the job"} for j in orphans]
        jobs += [{"id": job_id, "file": b.file, "reason": "backoff", "message": b.reason,
                  "failures": b.failures, "retry_in_s": round(max(0.0, b.until - now), 1)}
                 for job_id, b in sorted(backoff.items())]
        held = self._held_waiting(roots)
        jobs += [{"id": j.id, "file": names.display(j.abs_path), "reason": j.error_code,
                  "message": j.error_message,
                  "retry_in_s": round(max(0.0, self._held_retry.get(j.id, (now, 0.0))[0]
                                          - now), 1)} for j in held]
        waiting = self._store_waiting()
        if self.store_full:
            jobs += [{"id": job_id, "file": file, "reason": StoreFull.code,
                      "message": self.store_full} for job_id, file in waiting.items()]
            if self._intake:  # not jobs yet: one line for the files waiting in the inbox
                jobs.append({"file": str(self.store.path), "reason": StoreFull.code,
                             "message": f"{len(self._intake)} settled file(s) wait in the "
                                        f"inbox: {self.store_full}"})
        return {"count": count + len(backoff) + len(held) + len(waiting), "jobs": jobs}

    def _store_waiting(self) -> dict[int, str]:
        """Jobs waiting for the store to take writes (not running now), by id: their file."""
        if not self.store_full:
            return {}
        out = {}
        for job_id in self._store_wait:
            job = None if job_id in self._active else self.store.get(job_id)
            if job is not None:
                out[job_id] = names.display(job.abs_path)
        return out

    def held_counts(self) -> dict[str, int]:
        """How many jobs :meth:`held` lists, by reason (those with none left out), without
        listing them: for systemd's ``STATUS=``, built at every turn of the main loop."""
        roots = self._watches_by_root()
        removed, _ = self.store.active_outside(list(roots), limit=0)
        out = {"watch_removed": removed, "backoff": len(self._backing_off(roots))}
        for j in self._held_waiting(roots):
            reason = j.error_code or JobState.HELD.value
            out[reason] = out.get(reason, 0) + 1
        out[StoreFull.code] = len(self._store_waiting())
        return {reason: n for reason, n in out.items() if n}

    def _backing_off(self, roots: Mapping[Path, WatchConfig]) -> dict[int, _Backoff]:
        """Jobs backing off whose watch is configured; one whose watch was removed is
        counted as ``watch_removed`` instead (once, not under both reasons)."""
        return {i: b for i, b in self._backoff.items()
                if b.input_root is None or b.input_root in roots}

    def _held_waiting(self, roots: Mapping[Path, WatchConfig]) -> list[Job]:
        """Jobs in the ``held`` state waiting for their retry (not being retried now);
        one whose watch was removed is counted as ``watch_removed`` instead."""
        if not self.store.counts().get(JobState.HELD.value):
            return []
        return [j for j in self._held_jobs()
                if j.id not in self._active and j.input_root in roots]

    @property
    def active_jobs(self) -> int:
        return len(self._active)

    @property
    def requests_in_flight(self) -> int:
        """Requests sent to the engine(s) and not answered yet."""
        return self._inflight.in_use

    @property
    def request_limit(self) -> int:
        """Requests in flight the pipeline aims for now (engine capacity or the config)."""
        return self._request_limit()

    def idle(self) -> bool:
        """No accepted work left that can run (used by drain). Jobs held because their
        watch was removed, or because their outputs cannot be written, do not count:
        they may wait for the operator."""
        held = {j.id for j in self._held_jobs()}
        return (not self._active and not self._intake and not self._intake_busy
                and not self.store.next_jobs(list(self._watches_by_root()), held, 1))

    async def stop_jobs(self) -> None:
        """Cancel the jobs in progress and wait for them (the daemon stops); their pages in
        flight go back to the queue when the daemon releases them. A job that swallowed its
        cancellation is cancelled again (``chandrad.tasks.cancel_and_wait``)."""
        self.starting_jobs = False
        await cancel_and_wait(list(self._active.values()))

    async def cancel_job(self, job_id: int) -> bool:
        task = self._active.get(job_id)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for page in self.store.pages(job_id):
            if page.state is PageState.IN_FLIGHT:
                self.store.release_page(job_id, page.index)
        self._backoff.pop(job_id, None)
        self._held_retry.pop(job_id, None)
        job = self.store.get(job_id)
        if job is None or not self.store.cancel(job_id):
            return False
        watch = self._watch_for(job)
        if watch is None:
            log.warning("job_cancelled_in_place", job=job.id, file=names.display(job.abs_path),
                        reason="its watch is no longer configured; the input is left there")
        elif job.abs_path.exists():
            final = outputs.move_to(watch.failed, job.input_root, job.abs_path)
            outputs.write_error_json(final, CANCELLED_CODE, CANCELLED_MESSAGE,
                                     job.attempts, {"created": job.created_at,
                                                    "cancelled": time.time()})
            self.store.set_job_state(job_id, JobState.CANCELLED, final_path=final)
        return True

    def retry_job(self, job: Job) -> bool:
        """Move a failed, partial or cancelled job's input back (from ``failed/``, or
        ``done/`` for a partial job) and requeue it: its failed pages run again."""
        if job.final_path is not None and job.final_path.exists() and not job.abs_path.exists():
            job.abs_path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(job.final_path, job.abs_path)
            error_json = outputs.error_json_path(job.final_path)
            with contextlib.suppress(FileNotFoundError):
                error_json.unlink()
        ok = self.store.retry(job.id)
        self._held_retry.pop(job.id, None)
        self._wake.set()
        return ok

    # ------------------------------------------------------------ one job
    async def run_job(self, job: Job) -> None:
        """Probe, render, infer, write, move: the whole life of one accepted file.

        Raises only what its own failure handling raised (the input could not be moved
        to ``failed/``); the dispatcher then backs the job off.
        """
        started = time.monotonic()
        watch = self._watch_for(job)
        if watch is None:
            # A reload removed its watch between dispatch and now: back to pending, as
            # every job of a removed watch is (listed as held, ``watch_removed``).
            self.store.set_job_state(job.id, JobState.PENDING)
            return
        try:
            try:
                await self._run(job, watch, started)
                self._held_retry.pop(job.id, None)
            except (StoreFull, asyncio.CancelledError):
                raise
            except OutputUnwritable as exc:
                self._hold(job, exc)
            except InputError as exc:
                await self._fail_job(job, watch, exc.code, exc.message)
            except FileNotFoundError as exc:
                await self._fail_job(job, watch, "input_vanished",
                                     f"the input disappeared: {exc}")
            except Exception as exc:  # one bad file must never stop the daemon
                log.exception(Event.JOB_CRASHED, job=job.id, file=names.display(job.abs_path))
                await self._fail_job(job, watch, "internal_error",
                                     f"{type(exc).__name__}: {exc}")
        except StoreFull as exc:
            # Its progress could not be recorded: the job waits as the store has it (its
            # pages done are kept) and runs again once the store takes writes.
            self._store_is_full(exc)
            self._store_wait[job.id] = time.monotonic() + STORE_FULL_RETRY_S
            return
        if self._store_wait.pop(job.id, None) is not None:
            self._store_has_room()  # it recorded its outcome: the store takes writes again
        self._backoff.pop(job.id, None)

    def _hold(self, job: Job, exc: OutputUnwritable) -> None:
        """Outputs cannot be written for now: keep the job (and its input) and retry later.

        An expected OS condition: one warning line (errno, path), no traceback.
        """
        _, delay = self._held_retry.get(job.id, (0.0, HOLD_RETRY_FIRST / 2))
        delay = min(HOLD_RETRY_MAX, delay * 2)
        self._held_retry[job.id] = (time.monotonic() + delay, delay)
        self.store.set_job_state(job.id, JobState.HELD, error_code=exc.code,
                                 error_message=exc.message)
        code = exc.details.get("errno")
        log.warning(Event.JOB_HELD, job=job.id, file=names.display(job.path), code=exc.code,
                    errno=errno.errorcode.get(code, code) if isinstance(code, int) else None,
                    path=exc.details.get("path"), reason=exc.message, retry_in_s=delay)

    async def _run(self, job: Job, watch: WatchConfig, started: float) -> None:
        if not job.abs_path.exists() and await self._complete_moved(job, watch, started):
            return
        if not await self._same_content(job, watch):
            return
        info = await self.render.probe(job.abs_path, self.config.ocr.max_pages)
        # One transaction sets ``pages_total`` and creates the pages (issue 8: each write
        # transaction is an fsync on the event loop's thread, paid per one-page file).
        self.store.init_pages(job.id, info.page_count)
        pages = self.store.pages(job.id)
        for p in pages:
            if p.state is PageState.IN_FLIGHT:  # a claim a full store kept from release
                self.store.release_page(job.id, p.index)
        todo = [p.index for p in pages if p.state in (PageState.PENDING, PageState.IN_FLIGHT)]
        try:
            # A TaskGroup, not gather: when one page raises, its siblings are cancelled
            # instead of running on for a job that has failed.
            async with asyncio.TaskGroup() as group:
                for i in todo:
                    group.create_task(self._page(job, i))
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None
        finally:
            # A cancelled page leaves its claim behind; give it back so the page can
            # be claimed again (a retry, a resume) instead of being stuck in flight.
            for page in self.store.pages(job.id):
                if page.state is PageState.IN_FLIGHT:
                    self.store.release_page(job.id, page.index)
        await self._finish(job, watch, started)

    async def _same_content(self, job: Job, watch: WatchConfig) -> bool:
        """Whether the input still holds the content the job was accepted with; when it
        does not, end the job and queue the new content as a new job."""
        digest, size, mtime = await asyncio.to_thread(_fingerprint, job.abs_path)
        if digest == job.sha256:
            return True
        new = self.store.supersede(job.id, size, mtime, digest, watch.duplicates)
        log.warning("input_replaced", job=job.id, file=names.display(job.abs_path),
                    old_sha256=job.sha256, sha256=digest, new_job=new.id if new else None)
        self._wake.set()
        return False

    async def _complete_moved(self, job: Job, watch: WatchConfig, started: float) -> bool:
        """The input is gone from the inbox: if a move recorded before a crash completed
        (``final_path`` holds the job's content), record the outcome it was moving for."""
        # The destination is recorded before each move; a job from before that record
        # existed can only have been moving to done/.
        intended = job.final_path or watch.done / job.abs_path.relative_to(job.input_root)
        moved = await asyncio.to_thread(_find_moved, job, intended)
        if moved is None:
            return False
        log.info("job_move_recovered", job=job.id, file=names.display(job.abs_path),
                 final=names.display(moved))
        if _is_under(moved, watch.failed):
            outputs.write_error_json(moved, job.error_code or "internal_error",
                                     job.error_message or "", job.attempts,
                                     {"accepted": job.created_at, "failed": time.time()})
            self.store.set_job_state(job.id, JobState.FAILED, final_path=moved)
            return True
        await self._finish(job, watch, started, moved=moved)
        return True

    async def _page(self, job: Job, index: int) -> None:
        window = _Hold(self._window)
        await window.acquire()
        t0 = time.monotonic()
        try:
            await self.dispatching.wait()
            t0 = time.monotonic()
            page = await self._render(job, index)
            render_s = time.monotonic() - t0
            outcome = await self._infer(job, index, page, window)
            if self.observer is not None:
                self.observer.page_finished(outcome.ok, render_s, outcome.inference_s,
                                            time.monotonic() - t0)
            if not outcome.ok:
                self.store.fail_page(job.id, index, outcome.error or "failed")
                log.warning(Event.PAGE_FAILED, job=job.id, page=index + 1, error=outcome.error)
        except InputError as exc:
            stored = self.store.page(job.id, index)
            if stored is not None and stored.state is PageState.PENDING:
                self.store.claim_page(job.id, index)  # charge the attempt it cost
            self.store.fail_page(job.id, index, f"{exc.code}: {exc.message}")
            if self.observer is not None:  # the page could not be rendered
                elapsed = time.monotonic() - t0
                self.observer.page_finished(False, elapsed, 0.0, elapsed)
            log.warning(Event.PAGE_FAILED, job=job.id, page=index + 1, error=exc.message)
        finally:
            await window.release()

    async def _render(self, job: Job, index: int) -> ocr.PageImage:
        """Render one page; a crashed or hung worker takes its pool-mates down with it,
        so a page that failed that way gets one more try before it counts."""
        args = (job.abs_path, index, self.config.ocr.render_min_side, self.engine.max_pixels)
        try:
            return await self.render.render(*args)
        except (RenderCrashed, RenderTimeout) as exc:
            log.warning("page_render_retry", job=job.id, page=index + 1, error=exc.message)
            return await self.render.render(*args)

    async def _infer(self, job: Job, index: int, page: ocr.PageImage,
                     window: _Hold) -> _PageOutcome:
        """Chandra's retry loop for one page; returns once the page is done or failed.

        As ``chandra.model.vllm.generate_vllm``: retried (up to ``ocr.retries`` times,
        with Chandra's temperature schedule) only on a detected repetition loop or a
        request error, the latter after Chandra's ``2 * (retries + 1)`` s pause. An
        answer cut by ``length`` is kept and marked truncated. Every answered request is
        one attempt; a request the engine failed under (it left ``ready``) is given back
        uncharged, and so is one that only needs ``max_tokens`` refitted.

        The page image is held once, as its PNG: each request's body is encoded around
        it and writes its base64 as it is sent (``ocr.encode_chat_request``).
        """
        cfg = self.config.ocr
        width, height = page.width, page.height
        attempt = 0
        last_error = ""
        prompt_estimate = estimate_prompt_tokens(width, height, self._pixels_per_token())
        refit: tuple[int | None] | None = None  # max_tokens from the engine's own count
        engine_s = 0.0
        while attempt <= cfg.retries:
            await self.dispatching.wait()
            await self.engine.wait_ready()
            temperature, top_p = ocr.sampling_for_attempt(attempt)
            self.pages_waiting += 1
            try:
                await self._inflight.acquire()
            finally:
                self.pages_waiting -= 1
            if not self.dispatching.is_set():  # paused while it waited for a slot
                await self._inflight.release()
                continue
            # The engine this request goes to (several: the one with most free capacity);
            # the request is built for it. None: every engine left ready meanwhile.
            target = self.engine.pick()
            if target is None:
                await self._inflight.release()
                continue
            max_tokens: int | None = ocr.request_max_tokens(
                target.max_output_tokens, target.max_model_len, prompt_estimate)
            if refit is not None:
                max_tokens = refit[0]
            body = ocr.encode_chat_request(
                page, model=target.served_model_name, prompt_type=cfg.prompt_type,
                max_output_tokens=max_tokens, temperature=temperature, top_p=top_p)
            self.store.claim_page(job.id, index)
            t0 = time.monotonic()
            reply: dict[str, Any] | None = None
            try:
                reply = await target.chat(body, timeout=cfg.request_timeout)
            except EngineUnavailable as exc:
                target.report_failure("request failed", str(exc))
                stored = self.store.page(job.id, index)
                if (exc.page_may_be_at_fault and stored is not None
                        and stored.releases >= MAX_FREE_RELEASES):
                    # This page's requests keep failing: from now on they count.
                    self.store.release_page(job.id, index, charge=True)
                    attempt += 1
                    last_error = f"request failed: {exc.message}"
                    log.warning("page_request_failed", job=job.id, page=index + 1,
                                attempt=attempt, error=exc.message)
                else:
                    # The engine failed under the page: give it back, uncharged, and wait.
                    self.store.release_page(job.id, index)
                await asyncio.sleep(0.5)
                continue
            except ValueError as exc:
                overflow, prompt = ocr.context_overflow(str(exc))
                if overflow and refit is None:
                    # vLLM <= 0.17: max_tokens did not fit after the real prompt. Ask again
                    # (uncharged) with exactly what is left, or let the engine decide.
                    limit = target.max_model_len
                    refit = (min(target.max_output_tokens, limit - prompt)
                             if prompt is not None and limit and limit > prompt else None,)
                    self.store.release_page(job.id, index)
                    log.info("page_max_tokens_refit", job=job.id, page=index + 1,
                             prompt_tokens=prompt, max_tokens=refit[0])
                    continue
                last_error = f"engine rejected the page: {exc}"
            finally:
                engine_s += time.monotonic() - t0
                self.engine.release(target)
                await self._inflight.release()
            attempt += 1
            if reply is not None:
                text, finish = _reply_text(reply)
                # Answered: the page's render-ahead slot goes to the next page now, so
                # rendering goes on while the workers post-process a burst of answers.
                await self._post.acquire()
                try:
                    await window.release()
                    outcome: ocr.PageResult | str = await self.render.postprocess(
                        text, finish, page, include_images=cfg.include_images,
                        include_headers_footers=cfg.include_headers_footers)
                except (RenderCrashed, RenderTimeout) as exc:
                    outcome = f"post-processing failed: {exc.message}"
                finally:
                    await self._post.release()
                if isinstance(outcome, ocr.PageResult):
                    truncated = finish == "length"
                    charged = self.store.page(job.id, index)
                    attempts = charged.attempts if charged is not None else attempt
                    self.store.finish_page(
                        job.id, index, width=width, height=height,
                        seconds=time.monotonic() - t0,
                        result={"markdown": outcome.markdown, "html": outcome.html,
                                "blocks": outcome.blocks,
                                "images": _encode_images(outcome.images),
                                "attempts": attempts, "truncated": truncated})
                    if truncated:
                        log.warning("page_truncated", job=job.id, page=index + 1,
                                    attempts=attempts, max_tokens=max_tokens,
                                    max_model_len=target.max_model_len)
                    return _PageOutcome(True, inference_s=engine_s)
                last_error = f"{outcome} after {attempt} attempt(s)"
            if attempt <= cfg.retries:
                self.store.release_page(job.id, index, charge=True)
                log.info("page_retry", job=job.id, page=index + 1, attempt=attempt,
                         reason=last_error)
                if reply is None:
                    await asyncio.sleep(ocr.error_retry_delay(attempt))
        return _PageOutcome(False, f"retries exhausted: {last_error}", engine_s)

    def _pixels_per_token(self) -> int:
        """The served model's pixels per image token (its processor config), read once."""
        model = self.config.engine.model
        if self._patch_pixels is None or self._patch_pixels[0] != model:
            found = model_files.pixels_per_image_token(model)
            self._patch_pixels = (model, found or PIXELS_PER_IMAGE_TOKEN)
        return self._patch_pixels[1]

    async def _finish(self, job: Job, watch: WatchConfig, started: float,
                      moved: Path | None = None) -> None:
        """Write the outputs from the store, then move the input to ``done/``.

        The intended destination is recorded before the move, so a crash between the
        move and the final record is completed at resume (``moved``: where the input was
        found then) instead of failing a job whose outputs are complete.
        """
        if moved is None and not await self._same_content(job, watch):
            return  # replaced while the job ran: its pages may mix two versions
        pages = self.store.pages(job.id)
        page_outputs = [_page_output(p) for p in pages]
        failed = sum(1 for p in pages if p.state is PageState.FAILED)
        truncated = sum(1 for p in page_outputs if p.truncated)
        stem = outputs.output_stem(job.abs_path)
        metadata = {
            "source": names.display(job.path),
            "source_sha256": job.sha256,
            "model": self.engine.served_model_name,
            "engine": self.engine.snapshot().get("profile"),
            "pages": len(pages),
            "pages_failed": failed,
            "seconds": round(time.monotonic() - started, 3),
            "page_seconds": [p.seconds for p in pages],
            "accepted_at": job.created_at,
            "finished_at": time.time(),
        }
        # One name for the document in output/ and done/ (the same `` (n)``).
        slot = await asyncio.to_thread(outputs.document_slot, watch.output, watch.done,
                                       job.input_root, job.abs_path, metadata, moved)
        written = await asyncio.to_thread(outputs.write_document, slot.output_dir, stem,
                                          page_outputs, metadata, self.config.ocr.formats)
        out_dir = written[-1].parent  # another ``(n)`` only if taken since the slot was chosen
        final = moved or self._move_input(job, watch.done, start=slot.suffix)
        if out_dir != slot.output_dir or final != slot.done_path:
            log.warning("document_names_differ", job=job.id, output=names.display(out_dir),
                        final=names.display(final))
        state = JobState.PARTIAL if failed else JobState.DONE
        self.store.set_job_state(job.id, state, output_dir=out_dir, final_path=final)
        log.info(Event.JOB_DONE, job=job.id, file=names.display(job.path), pages=len(pages),
                 pages_failed=failed, pages_truncated=truncated, seconds=metadata["seconds"],
                 state=state.value, output=names.display(out_dir))

    def _move_input(self, job: Job, folder: Path, error_code: str | None = None,
                    error_message: str | None = None, start: int = 0) -> Path:
        """Record where the input is going (with the error it fails for, if any), then
        move it there (``start``: the first `` (n)`` suffix to try)."""
        current = self.store.get(job.id)
        state = current.state if current else JobState.RUNNING
        intended = outputs.numbered_file(folder / job.abs_path.relative_to(job.input_root), start)
        self.store.set_job_state(job.id, state, final_path=intended, error_code=error_code,
                                 error_message=error_message)
        return outputs.move_to(folder, job.input_root, job.abs_path, start)

    async def _fail_job(self, job: Job, watch: WatchConfig, code: str, message: str) -> None:
        final: Path | None = None
        message = names.text(message)
        if job.abs_path.exists():
            with contextlib.suppress(OSError):  # unreadable: fail what is there
                if not await self._same_content(job, watch):
                    return  # replaced: the new content is queued, not failed for the old
            final = self._move_input(job, watch.failed, error_code=code, error_message=message)
            outputs.write_error_json(final, code, message, job.attempts + 1, {
                "accepted": job.created_at, "failed": time.time()})
        self.store.set_job_state(job.id, JobState.FAILED, error_code=code,
                                 error_message=message, final_path=final)
        self._held_retry.pop(job.id, None)
        log.error(Event.JOB_FAILED, job=job.id, file=names.display(job.path), code=code,
                  reason=message)


def _reply_text(reply: dict[str, Any]) -> tuple[str, str | None]:
    choices = reply.get("choices") or [{}]
    choice = choices[0]
    message = choice.get("message") or {}
    return str(message.get("content") or ""), choice.get("finish_reason")


def _encode_images(images: dict[str, bytes]) -> dict[str, str]:
    """Image crops as they are kept in the page result: file name → base64.

    The crops stay with their page in the store until ``outputs.write_document`` writes
    the document, so they land in the directory it claims (beside the Markdown that links
    to them), name clashes between pages are resolved in one place, and a restart
    rebuilds them from the store like the text.
    """
    return {name: base64.b64encode(data).decode("ascii") for name, data in images.items()}


def _decode_images(stored: Any) -> dict[str, bytes]:
    if not isinstance(stored, dict):  # a result written before crops were stored
        return {}
    return {str(name): base64.b64decode(data) for name, data in stored.items()}


def _page_output(page: Any) -> outputs.PageOutput:
    result = page.result or {}
    return outputs.PageOutput(
        page=page.index + 1,
        status="ok" if page.state is PageState.DONE else "failed",
        attempts=int(result.get("attempts", page.attempts)),
        truncated=bool(result.get("truncated", False)),
        error=page.error,
        width=page.width or 0,
        height=page.height or 0,
        markdown=result.get("markdown", ""),
        html=result.get("html", ""),
        blocks=result.get("blocks", []),
        images=_decode_images(result.get("images")),
    )
