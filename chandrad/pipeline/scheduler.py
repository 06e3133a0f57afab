"""The job scheduler: intake in, jobs dispatched, held and backing-off jobs, cancel and
retry, and the judgement of how a job's run ended.

As many jobs run as the render-ahead window has pages (``chandrad.pipeline.limits``), so a
backlog of one-page files fills the engine as well as one long PDF does. A job finds its
watch by the watch's input folder (``Job.input_root``), never by position, so a reload
that reorders ``[[watch]]`` entries changes nothing; a job whose watch was removed is
*held* (not started, listed in ``status``) until the watch is back or the job is cancelled.

How a run ends, and what the scheduler does about it (the waits and their delays are
``chandrad.pipeline.waits``):

- outputs that cannot be written for an OS condition (disk full, read-only, quota,
  permission): the job is ``held`` (``output_unwritable``), retried on its own
  (``HOLD_RETRY_FIRST`` doubling to ``HOLD_RETRY_MAX``), its pages not recomputed;
- the store's filesystem is full (``StoreFull``): the job waits where the store has it and
  runs again once a write goes through (every ``STORE_FULL_RETRY_S``); nothing is failed;
- a bad input, a vanished input, a bug: the job fails (input to ``failed/``);
- a job that cannot even be failed (say ``failed/`` is not writable): it backs off
  exponentially (``BACKOFF_FIRST_S`` doubling to ``BACKOFF_MAX_S``), visible in ``status``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import time
from pathlib import Path

import structlog

from chandrad import names, outputs
from chandrad.config import Config, WatchConfig
from chandrad.errors import (
    CANCELLED_CODE,
    CANCELLED_MESSAGE,
    ChandradError,
    InputError,
    InternalError,
    LeaseLost,
    OutputUnwritable,
    StoreFull,
)
from chandrad.events import Event
from chandrad.interfaces import EngineHandle, Observer
from chandrad.pipeline.held import HeldReport
from chandrad.pipeline.helping import Helper
from chandrad.pipeline.intake import Intake, Settled, StoreRoom
from chandrad.pipeline.jobs import JobRunner
from chandrad.pipeline.limits import Limits
from chandrad.pipeline.waits import JobWaits
from chandrad.pipeline.worker import PageWorker
from chandrad.protocol import HeldStatus
from chandrad.render import RenderPool
from chandrad.states import PIPELINE_TRANSITIONS, EngineState, JobState, PageState, PipelineMode
from chandrad.store import Job, StoreBackend
from chandrad.tasks import cancel_and_wait

log = structlog.get_logger("chandrad.pipeline")

#: Seconds the dispatcher waits for a wake-up before it looks anyway: what no wake-up
#: announces (back-off and hold retries falling due, another host's lease expiring, a
#: shared store's notification lost while its listener reconnected).
POLL_S = 1.0


class Pipeline:
    """Runs accepted jobs to completion while the daemon lets it dispatch."""

    def __init__(
        self, config: Config, store: StoreBackend, engine: EngineHandle, render: RenderPool
    ) -> None:
        self.store = store
        self.engine = engine
        self.render = render
        self._mode = PipelineMode.RUNNING
        #: Set while the mode dispatches: what the dispatch loop and the page worker wait on.
        self._dispatching = asyncio.Event()
        self._dispatching.set()
        self._config = config
        self.limits = Limits(self._request_limit, render.workers)
        self._room = StoreRoom()
        self._wake = asyncio.Event()
        self.intake = Intake(config, store, self._room, self._wake.set)
        self.worker = PageWorker(config, store, engine, render, self.limits, self._dispatching)
        self.jobs = JobRunner(config, store, engine, render, self.worker, self._wake.set)
        # Pages of other hosts' jobs (a shared store), on the same request slots.
        self.helper = Helper(store, PageWorker(config, store, engine, render, self.limits,
                                               self._dispatching, helping=True),
                             self.worker, lambda: list(self._watches_by_root()),
                             self._own_work)
        self._active: dict[int, asyncio.Task[None]] = {}
        self._active_paths: dict[int, Path] = {}
        self.waits = JobWaits()
        #: The dispatcher's fallback poll (``POLL_S``).
        self.poll_s = POLL_S

    @property
    def mode(self) -> PipelineMode:
        """What the pipeline may do now (accept, start jobs, send pages)."""
        return self._mode

    def set_mode(self, new: PipelineMode) -> None:
        """The only writer of ``mode`` (the daemon's main loop calls it); an edge
        ``PIPELINE_TRANSITIONS`` forbids is a bug."""
        old = self._mode
        if new is old:
            return
        if new not in PIPELINE_TRANSITIONS[old]:
            raise InternalError(f"illegal pipeline mode {old.value} -> {new.value}")
        self._mode = new
        if new.dispatches:
            self._dispatching.set()
        else:
            self._dispatching.clear()
        self._wake.set()

    @property
    def config(self) -> Config:
        return self._config

    @config.setter
    def config(self, config: Config) -> None:
        """A reload: every part reads the new config from its next use on."""
        self._config = config
        self.intake.config = self.worker.config = self.jobs.config = config
        self.helper.worker.config = config

    @property
    def observer(self) -> Observer | None:
        """Metrics: page outcomes and latencies (the page worker reports them)."""
        return self.worker.observer

    @observer.setter
    def observer(self, observer: Observer | None) -> None:
        self.worker.observer = self.helper.worker.observer = observer

    @property
    def store_full(self) -> str:
        """Why the store refuses writes ("" while it takes them): ``status``, ``STATUS=``."""
        return self._room.message

    @property
    def store_error(self) -> StoreFull | None:
        """The store's refusal in force (full or unreachable), None while it takes writes."""
        return self._room.error

    def store_read(self, exc: StoreFull | None) -> None:
        """A reader (status, a scrape) could read the store (None), or could not (``exc``)."""
        if exc is None:
            self._room.reached()
        else:
            self._room.full(exc)

    @property
    def pages_waiting(self) -> int:
        """Rendered pages waiting for a request slot."""
        return self.worker.pages_waiting + self.helper.worker.pages_waiting

    def _request_limit(self) -> int:
        if self._config.ocr.max_in_flight:
            return self._config.ocr.max_in_flight
        return self.engine.capacity

    # ------------------------------------------------------------ intake
    def submit(self, watch_index: int, root: Path, path: Path, size: int, mtime: float) -> None:
        """A settled file from the watcher; accepted into the store by the intake loop."""
        if self._mode.accepts_files:
            self.intake.submit(Settled(watch_index, root, path, size, mtime))

    async def intake_loop(self) -> None:
        """Hash and accept settled files in batches (``chandrad.pipeline.intake``)."""
        await self.intake.loop()

    def quarantine(self, item: Settled, exc: BaseException) -> None:
        """Move a settled file that crashed a supervised loop to ``failed/``."""
        self.intake.quarantine(item, exc)

    # ------------------------------------------------------------ dispatch
    async def dispatch_loop(self) -> None:
        """Start jobs oldest first (resumed running jobs, then held jobs whose retry is
        due, then pending ones), until cancelled."""
        while True:
            await self._dispatching.wait()
            try:
                self._start_jobs()
            except StoreFull as exc:  # the job was not marked running: it waits pending
                self._room.full(exc)
            self._wake.clear()
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancel.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_s):
                    await self._wake.wait()
            await self.limits.poke()

    def _own_work(self) -> bool:
        """Whether this host is not to help now: it has work of its own first (pages
        waiting for a request slot, room for a job while jobs wait to start), its engines
        are not ready, or it starts no work (stopping)."""
        return (not self._mode.starts_jobs or self.engine.state is not EngineState.READY
                or self.worker.pages_waiting > 0
                or (len(self._active) < self._job_slots()
                    and self.store.counts().get(JobState.PENDING.value, 0) > 0))

    def _job_slots(self) -> int:
        """Jobs running at once: as many as the window has pages (one-page files fill
        it as well as a long document), at least 2."""
        return max(2, self.limits.window_limit())

    def _watches_by_root(self) -> dict[Path, WatchConfig]:
        """Configured watches by their input folder as the watcher resolves it (the
        ``input_root`` recorded with each job): a job's watch is found by identity. The
        HTTP API's uploads folder is one of them while ``[api]`` is on."""
        out: dict[Path, WatchConfig] = {}
        api = self._config.api_watch()
        for watch in (*self._config.watch, *((api,) if api else ())):
            out.setdefault(Path(os.path.realpath(watch.input)), watch)
        return out

    def wake(self) -> None:
        """New jobs may be waiting (the HTTP API accepted one, another host on the shared
        store made some): look now. On the loop's thread only."""
        self._wake.set()

    def _watch_for(self, job: Job) -> WatchConfig | None:
        return self._watches_by_root().get(job.input_root)

    def _not_due(self) -> set[int]:
        """Jobs not to start now: running, backing off, waiting for the store or held."""
        held = (j.id for j in self._held_jobs())
        return set(self._active) | self.waits.not_due(time.monotonic(), held)

    def _start_jobs(self) -> None:
        if not self._mode.starts_jobs:
            return  # stopping (SIGTERM): the jobs running finish, queued ones wait
        free = self._job_slots() - len(self._active)
        if free <= 0:
            return
        busy = set(self._active_paths.values())
        roots = list(self._watches_by_root())
        for job in self.store.next_jobs(roots, self._not_due(), free):
            if job.abs_path in busy:
                continue  # a superseded job still finishing on the same file
            busy.add(job.abs_path)
            if job.state in (JobState.PENDING, JobState.HELD):
                # Marked running in the same loop step as the decision, not when its task
                # first runs: a SIGTERM that stops dispatch then finds every job it lets
                # finish already started, and none stamped started after it.
                self.store.set_job_state(job.id, JobState.RUNNING)
                self._room.room()
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

    # ------------------------------------------------------------ one job's run
    async def run_job(self, job: Job) -> None:
        """Run the job (``JobRunner``) and act on how it ended.

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
                await self.jobs.run(job, watch, started)
                self.waits.unhold(job.id)
            except (StoreFull, LeaseLost, asyncio.CancelledError):
                raise
            except OutputUnwritable as exc:
                self._hold(job, exc)
            except InputError as exc:
                await self._fail(job, watch, exc.code, exc.message)
            except FileNotFoundError as exc:
                await self._fail(job, watch, "input_vanished", f"the input disappeared: {exc}")
            except Exception as exc:  # one bad file must never stop the daemon
                log.exception(Event.JOB_CRASHED, job=job.id, file=names.display(job.abs_path))
                await self._fail(job, watch, "internal_error", f"{type(exc).__name__}: {exc}")
        except LeaseLost as exc:
            # Another host owns the job now, or cancelled it (a shared store), even while
            # this host was failing it: leave it, touch none of its files.
            log.warning("job_lease_lost", job=job.id, file=names.display(job.abs_path),
                        owner=exc.details.get("owner"), reason=exc.message)
            return
        except StoreFull as exc:
            # Its progress could not be recorded: the job waits as the store has it (its
            # pages done are kept) and runs again once the store takes writes.
            self._room.full(exc)
            self.waits.wait_for_store(job.id, time.monotonic())
            return
        if self.waits.ran(job.id):
            self._room.room()  # it recorded its outcome: the store takes writes again

    async def _fail(self, job: Job, watch: WatchConfig, code: str, message: str) -> None:
        await self.jobs.fail(job, watch, code, message)
        self.waits.unhold(job.id)

    def _hold(self, job: Job, exc: OutputUnwritable) -> None:
        """Outputs cannot be written for now: keep the job (and its input) and retry later.

        An expected OS condition: one warning line (errno, path), no traceback.
        """
        delay = self.waits.hold(job.id, time.monotonic())
        self.store.set_job_state(job.id, JobState.HELD, error_code=exc.code,
                                 error_message=exc.message)
        code = exc.details.get("errno")
        log.warning(Event.JOB_HELD, job=job.id, file=names.display(job.path), code=exc.code,
                    errno=errno.errorcode.get(code, code) if isinstance(code, int) else None,
                    path=exc.details.get("path"), reason=exc.message, retry_in_s=delay)

    def _back_off(self, job_id: int, exc: BaseException | None) -> None:
        """The job's run raised past its own error handling: retry it later, not now.

        Without this the job, still ``running``, would be dispatched again at once.
        """
        reason = exc.message if isinstance(exc, ChandradError) else f"{type(exc).__name__}: {exc}"
        job = self.store.get(job_id)
        now = time.monotonic()
        b = self.waits.back_off(job_id, now, names.text(reason),
                                names.display(job.abs_path) if job else "",
                                job.input_root if job else None)
        # Our own errors carry their reason; anything else is a bug: keep its traceback.
        log.error("job_stuck", job=job_id, failures=b.failures, retry_in_s=b.until - now,
                  error=reason, exc_info=None if isinstance(exc, ChandradError) else exc)

    # ------------------------------------------------------------ held jobs (status)
    def _held_jobs(self) -> list[Job]:
        """Jobs in the ``held`` state (outputs unwritable); a held job found at start has
        no retry time yet and is due at once."""
        return self.store.list_jobs(JobState.HELD.value, limit=1000)

    def held(self) -> HeldStatus:
        """Accepted jobs that are not being worked on, and why (``chandrad.pipeline.held``)."""
        return self._held_report().held()

    def held_counts(self) -> dict[str, int]:
        """How many jobs :meth:`held` lists, by reason, without listing them."""
        return self._held_report().counts()

    def _held_report(self) -> HeldReport:
        return HeldReport(self.store, self.waits, self._room, len(self.intake.queue),
                          self._watches_by_root(), set(self._active), self._held_jobs)

    # ------------------------------------------------------------ gauges
    @property
    def active_jobs(self) -> int:
        return len(self._active)

    @property
    def requests_in_flight(self) -> int:
        """Requests sent to the engine(s) and not answered yet."""
        return self.limits.inflight.in_use

    @property
    def pages_answering(self) -> int:
        """Pages sent to an engine whose answer is not stored yet."""
        return self.worker.pages_answering + self.helper.worker.pages_answering

    @property
    def request_limit(self) -> int:
        """Requests in flight the pipeline aims for now (engine capacity or the config)."""
        return self._request_limit()

    def idle(self) -> bool:
        """No accepted work left that can run (used by drain). Jobs held because their
        watch was removed, or because their outputs cannot be written, do not count:
        they may wait for the operator."""
        held = {j.id for j in self._held_jobs()}
        return (not self._active and not self.intake.queue and not self.intake.busy
                and not self.store.next_jobs(list(self._watches_by_root()), held, 1))

    # ------------------------------------------------------------ stop, cancel, retry
    async def stop_jobs(self) -> None:
        """Cancel the jobs in progress and wait for them (the daemon stops); their pages in
        flight go back to the queue when the daemon releases them. A job that swallowed its
        cancellation is cancelled again (``chandrad.tasks.cancel_and_wait``)."""
        self.set_mode(self._mode.stopping())
        await cancel_and_wait(list(self._active.values()))

    async def cancel_job(self, job_id: int) -> bool:
        task = self._active.get(job_id)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(LeaseLost):  # another host's job (a shared store): its
            for page in self.store.pages(job_id):  # pages are that host's to release
                if page.state is PageState.IN_FLIGHT and page.holder is None:
                    self.store.release_page(job_id, page.index)
        self.waits.forget(job_id)
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
        self.waits.unhold(job.id)
        self._wake.set()
        return ok
