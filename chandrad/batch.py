"""``chandrad batch``: the daemon's pipeline run once over given files and folders.

Owns what turns the daemon into a one-shot batch, nothing else: the batch's config
(one watch whose inbox, ``done/`` and ``failed/`` live in the state directory
``<output>/.chandrad``), the plan (which files, under which names), staging them into
that inbox (a hard link, or a copy where a link is impossible: the operator's files are
never moved or written), the progress of the run and when it is finished, and the
summary read back from the store afterwards. The daemon (``daemon.Daemon(batch=…)``)
runs the same store, supervised engine, render pool and pipeline as ``chandrad run``;
the entry point (``batch_view``) draws the progress and maps the summary to an exit code.

Resuming: the state directory holds the store, so a second run into the same output
finds the jobs of the first. A staged file that is still in the inbox is the same job
(its finished pages are kept); a file whose staged copy is in ``done/`` with the same
size and mtime is already done and is not staged again; one that failed is tried again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import structlog

from chandrad import names, outputs
from chandrad.config import Config, MetricsConfig, WatchConfig
from chandrad.errors import BatchInputError, InputError
from chandrad.protocol import EngineStatus
from chandrad.render import RenderPool
from chandrad.states import JOB_FINISHED, JobState
from chandrad.store import Job, StoreBackend
from chandrad.watch import ignored

log = structlog.get_logger("chandrad.batch")

#: The state directory under ``--output``: store, lock, inbox, done/, failed/, log.
STATE_DIRNAME = ".chandrad"
LOG_NAME = "batch.log"
#: Seconds between progress snapshots.
TICK_S = 0.5
#: pages/s is measured over this many seconds of recent progress.
RATE_WINDOW_S = 60.0


class Feed(Protocol):
    """What a batch needs of the pipeline (``pipeline.Pipeline``; services meet through
    the daemon, which hands it over)."""

    config: Config
    render: RenderPool

    def submit(self, watch_index: int, root: Path, path: Path, size: int,
               mtime: float) -> None: ...

    def idle(self) -> bool: ...


def state_dir(output: Path) -> Path:
    return output / STATE_DIRNAME


def batch_config(cfg: Config, output: Path) -> Config:
    """``cfg`` as a batch runs it: one watch (inbox, done/ and failed/ in the state dir,
    outputs in ``output``), the state dir under ``output`` holding its own SQLite store
    (whatever ``daemon.store`` names: a one-shot run on one machine never joins a shared
    queue nor uses the daemon's store), no metrics endpoint, no HTTP API, and an engine
    that gives up ends the run (``exit_on_fatal``) instead of waiting for an operator's
    ``chandractl engine restart`` that has no socket to arrive on."""
    state = state_dir(output)
    watch = WatchConfig(input=state / "inbox", output=output, done=state / "done",
                        failed=state / "failed", recursive=True, mode="poll",
                        settle_seconds=0.0, duplicates="process", create_input=True)
    daemon = dataclasses.replace(cfg.daemon, state_dir=state, store="", store_url="",
                                 sqlite_dir=None)
    return dataclasses.replace(
        cfg, daemon=daemon, watch=(watch,),
        engine=dataclasses.replace(cfg.engine, exit_on_fatal=True),
        metrics=MetricsConfig(listen=""), api=dataclasses.replace(cfg.api, enabled=False))


@dataclass
class Entry:
    """One file of the batch: where it comes from and its name in the inbox."""

    source: Path | None  # None: left unfinished by an earlier run, not named this time
    rel: Path  # relative to the inbox (and, as a folder, to the output)
    already_done: bool = False
    pages: int | None = None  # from the batch's own probe, before the pipeline's
    error: str = ""  # it could not be staged (unreadable): never a job


def plan(inputs: Iterable[Path], output: Path) -> list[Entry]:
    """The files of ``inputs`` and their inbox names, in command-line order.

    A file argument keeps its name at the top of the output; a folder's files keep their
    paths relative to that folder (the layout of a daemon watching it). Inside folders,
    the daemon's ignore rules apply (dotfiles, partial downloads, lock files) and
    symlinks are not followed; a file named on the command line is taken as given. A
    name taken by an earlier argument gets `` (1)``, `` (2)``… (the outputs' rule).
    """
    output = Path(os.path.realpath(output))
    entries: list[Entry] = []
    taken: set[Path] = set()
    sources: set[Path] = set()

    def add(source: Path, rel: Path) -> None:
        if source in sources:
            return  # named twice (a file and its folder, say): one job
        sources.add(source)
        n, candidate = 0, rel
        while candidate in taken:
            n += 1
            candidate = rel.with_name(f"{rel.stem} ({n}){rel.suffix}")
        taken.add(candidate)
        entries.append(Entry(source, candidate))

    for given in inputs:
        real = Path(os.path.realpath(given))
        if not real.exists():
            raise BatchInputError(f"{names.display(given)}: no such file or folder")
        if real == output or output in real.parents:
            raise BatchInputError(f"{names.display(given)} is inside the output folder "
                                  f"{names.display(output)}")
        if real.is_file():
            add(real, Path(real.name))
            continue
        if not real.is_dir():
            raise BatchInputError(f"{names.display(given)} is neither a file nor a folder")
        for folder, dirs, files in os.walk(real):
            here = Path(folder)
            dirs[:] = sorted(d for d in dirs if not ignored(d) and not (here / d).is_symlink()
                             and here / d != output)
            for name in sorted(files):
                path = here / name
                if not ignored(name) and not path.is_symlink() and path.is_file():
                    add(path, path.relative_to(real))
    return entries


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return a.st_size == b.st_size and a.st_mtime_ns == b.st_mtime_ns


def _place(source: Path, target: Path) -> None:
    """Put ``source`` at ``target``: a hard link (no copy, the source is never touched: the
    pipeline only renames its name), else an atomic copy that keeps the mtime."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        target.unlink()
    try:
        os.link(source, target)
        return
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EACCES, errno.EMLINK,
                             errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    temp = target.with_name(names.fit(f".{target.name}", ".staging"))
    shutil.copy2(source, temp)
    os.replace(temp, target)


def stage(entries: list[Entry], cfg: WatchConfig) -> None:
    """Put every entry's file in the inbox unless the earlier run already finished it."""
    for entry in entries:
        if entry.source is None:
            continue
        target, done, failed = cfg.input / entry.rel, cfg.done / entry.rel, cfg.failed / entry.rel
        try:
            src = entry.source.stat()
        except OSError as exc:
            entry.error = f"cannot be read: {exc.strerror or exc}"
            continue
        with contextlib.suppress(FileNotFoundError):
            if _same_file(target.stat(), src):
                continue  # staged by an earlier run: its job resumes
        with contextlib.suppress(FileNotFoundError):
            if not target.exists() and _same_file(done.stat(), src):
                entry.already_done = True
                continue
        for stale in (failed, outputs.error_json_path(failed)):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()  # failed last time: tried again
        try:
            _place(entry.source, target)
        except OSError as exc:
            entry.error = f"cannot be read: {exc.strerror or exc}"
            log.error("batch_input_unreadable", file=names.display(entry.source),
                      error=entry.error)


@dataclass(frozen=True)
class Progress:
    """One snapshot of a running batch, for the progress bar or a plain line."""

    files: int
    files_finished: int
    files_failed: int
    pages_total: int
    pages_done: int
    pages_failed: int
    pages_per_s: float | None
    eta_s: float | None
    elapsed_s: float
    engine: str
    engine_detail: str
    phase: str  # "staging", "running", "finished"


@dataclass
class BatchRun:
    """The batch's part of the daemon's run: stage, submit, watch progress, stop when done.

    ``entries`` come from :func:`plan`; ``on_progress`` receives a :class:`Progress` every
    ``TICK_S`` seconds (from the event loop: it must not block).
    """

    entries: list[Entry]
    on_progress: Callable[[Progress], None] = lambda _p: None
    finished: bool = False
    started: float = field(default_factory=time.monotonic)
    _samples: deque[tuple[float, int]] = field(default_factory=deque)
    _phase: str = "staging"

    async def run(self, pipeline: Feed, store: StoreBackend, engine: Callable[[], EngineStatus],
                  stop: Callable[[], None]) -> None:
        """Supervised like the daemon's other tasks; ``stop`` ends the daemon's run."""
        watch = pipeline.config.watch[0]
        self._progress(store, engine)
        await asyncio.to_thread(stage, self.entries, watch)
        named = {watch.input / e.rel for e in self.entries}
        for job in store.list_jobs(limit=1_000_000):  # an earlier run's unfinished work
            if job.state not in JOB_FINISHED and job.abs_path not in named:
                self.entries.append(Entry(None, job.path))
                named.add(job.abs_path)
        root = Path(os.path.realpath(watch.input))
        for entry in self.entries:
            if entry.source is not None and not entry.already_done and not entry.error:
                path = root / entry.rel
                st = path.stat()
                pipeline.submit(0, root, path, st.st_size, st.st_mtime)
        self._phase = "running"
        for entry in self.entries:
            if not entry.already_done and not entry.error:
                with contextlib.suppress(InputError, OSError):
                    entry.pages = (await pipeline.render.probe(
                        watch.input / entry.rel, pipeline.config.ocr.max_pages)).page_count
            self._progress(store, engine)
        while not pipeline.idle():
            self._progress(store, engine)
            await asyncio.sleep(TICK_S)
        self.finished = True
        self._phase = "finished"
        self._progress(store, engine)
        log.info("batch_finished", files=len(self.entries))
        stop()

    def _progress(self, store: StoreBackend, engine: Callable[[], EngineStatus]) -> None:
        self.on_progress(self.snapshot(store, engine()))

    def snapshot(self, store: StoreBackend, engine: EngineStatus) -> Progress:
        jobs = latest_jobs(store)
        total = done = failed = finished = files_failed = 0
        for entry in self.entries:
            job = jobs.get(entry.rel)
            if entry.error:
                finished += 1
                files_failed += 1
                continue
            pages = (job.pages_total if job is not None and job.pages_total is not None
                     else entry.pages) or 0
            total += pages
            if job is None:
                continue
            done += job.pages_done
            failed += job.pages_failed
            if job.state in JOB_FINISHED or job.state is JobState.HELD:
                finished += 1
                files_failed += job.state is not JobState.DONE
        now = time.monotonic()
        self._samples.append((now, done + failed))
        while len(self._samples) > 2 and self._samples[0][0] < now - RATE_WINDOW_S:
            self._samples.popleft()
        # Measure from the last moment before pages started coming (not the engine's load).
        while len(self._samples) > 1 and self._samples[0][1] == self._samples[1][1]:
            self._samples.popleft()
        first_t, first_n = self._samples[0]
        rate = (done + failed - first_n) / (now - first_t) if now - first_t >= 0.5 else None
        if rate is not None and rate <= 0:
            rate = None
        left = max(0, total - done - failed)
        state = engine["state"]
        detail = ""
        fetch = engine["fetch"]
        if engine["fatal_reason"]:
            detail = engine["fatal_reason"]
        elif fetch is not None:
            detail = f"fetching {fetch['done'] / 1e6:.0f}/{fetch['total'] / 1e6:.0f} MB"
        elif engine["restarts"]:
            detail = f"{engine['restarts']} restart(s)"
        return Progress(
            files=len(self.entries), files_finished=finished, files_failed=files_failed,
            pages_total=total, pages_done=done, pages_failed=failed, pages_per_s=rate,
            eta_s=left / rate if rate else None, elapsed_s=now - self.started,
            engine=state, engine_detail=detail, phase=self._phase)


def latest_jobs(store: StoreBackend) -> dict[Path, Job]:
    """The newest job of every inbox name (relative path): a file retried or replaced has
    several jobs, and the newest says how it stands."""
    out: dict[Path, Job] = {}
    for job in store.list_jobs(limit=1_000_000):
        out[job.path] = job
    return out


@dataclass(frozen=True)
class FileResult:
    file: str  # as given (or its inbox name, for an earlier run's leftover)
    state: str  # a job state, "already_done", or "not_started"
    pages_done: int
    pages_failed: int
    pages_total: int | None
    output: str | None
    reason: str

    @property
    def ok(self) -> bool:
        return self.state in (JobState.DONE.value, "already_done")


def summarize(store: StoreBackend, entries: list[Entry]) -> list[FileResult]:
    """How every file of the batch stands, from the store (after the daemon stopped)."""
    jobs = latest_jobs(store)
    results = []
    for entry in entries:
        job = jobs.get(entry.rel)
        file = names.display(entry.source) if entry.source is not None else names.display(
            entry.rel)
        if entry.error:
            results.append(FileResult(file, "failed", 0, 0, None, None, entry.error))
            continue
        if job is None:
            results.append(FileResult(file, "not_started", 0, 0, entry.pages, None, ""))
            continue
        state = job.state.value
        if entry.already_done and job.state is JobState.DONE:
            state = "already_done"
        reason = ""
        if job.state is JobState.PARTIAL:
            failed_pages = [p for p in store.pages(job.id) if p.error]
            first = failed_pages[0].error if failed_pages else ""
            reason = f"{job.pages_failed} page(s) failed" + (f": {first}" if first else "")
        elif job.state in (JobState.FAILED, JobState.HELD, JobState.CANCELLED):
            reason = f"{job.error_code or job.state.value}: {job.error_message or ''}".strip()
        results.append(FileResult(
            file, state, job.pages_done, job.pages_failed,
            job.pages_total if job.pages_total is not None else entry.pages,
            names.display(job.output_dir) if job.output_dir else None, names.text(reason)))
    return results
