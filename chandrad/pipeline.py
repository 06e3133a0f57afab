"""The job flow: settled file → accepted job → rendered pages → inference → outputs.

Owns the scheduling of work, not any resource: the store keeps state, the render
pool makes pixels, the engine (seen only as an ``EngineHandle``) answers, ``ocr``
turns answers into Markdown/HTML/blocks, ``outputs`` writes files. Stages are small
functions; :meth:`Pipeline.run_job` composes them.

Saturation: page tasks render ahead of inference inside a window of
``capacity + 2 × render workers`` live pages, and in-flight requests follow the
engine's capacity (``max_num_seqs`` and ``/metrics``), not a fixed batch.
Durability: every page result is committed to the store before it counts, so a
restart resumes at page granularity and outputs are rebuilt from the store.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from chandrad import ocr, outputs
from chandrad.config import Config, WatchConfig
from chandrad.errors import EngineUnavailable, InputError, RenderCrashed, RenderTimeout
from chandrad.interfaces import EngineHandle
from chandrad.render import RenderedPage, RenderPool
from chandrad.states import JobState, PageState
from chandrad.store import Job, Store

log = structlog.get_logger("chandrad.pipeline")

READ_CHUNK = 1 << 20
#: Settled files hashed and accepted per store transaction.
INTAKE_BATCH = 2000

_Settled = tuple[int, Path, Path, int, float]  # watch index, root, path, size, mtime


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _hash_all(items: list[_Settled]) -> list[tuple[_Settled, str | None]]:
    out: list[tuple[_Settled, str | None]] = []
    for item in items:
        try:
            out.append((item, sha256_file(item[2])))
        except OSError as exc:
            log.warning("accept_skipped", file=str(item[2]), reason=str(exc))
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
            self._cond.notify_all()

    async def poke(self) -> None:
        """Re-evaluate waiters after the limit changed."""
        async with self._cond:
            self._cond.notify_all()


@dataclass
class _PageOutcome:
    ok: bool
    error: str | None = None


class Pipeline:
    """Runs accepted jobs to completion while the daemon lets it dispatch."""

    def __init__(
        self, config: Config, store: Store, engine: EngineHandle, render: RenderPool
    ) -> None:
        self.config = config
        self.store = store
        self.engine = engine
        self.render = render
        self.workers = config.ocr.render_workers or os.cpu_count() or 1
        self.dispatching = asyncio.Event()
        self.dispatching.set()
        self.accepting = True
        self._inflight = DynamicLimiter(self._request_limit)
        self._window = DynamicLimiter(lambda: self._request_limit() + 2 * self.workers)
        self._active: dict[int, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._intake: list[_Settled] = []
        self._intake_ready = asyncio.Event()
        self._intake_busy = False  # a batch is being hashed/accepted

    def _request_limit(self) -> int:
        if self.config.ocr.max_in_flight:
            return self.config.ocr.max_in_flight
        return self.engine.capacity

    # ------------------------------------------------------------ intake
    def submit(self, watch_index: int, root: Path, path: Path, size: int, mtime: float) -> None:
        """A settled file from the watcher; accepted into the store by the intake loop."""
        if not self.accepting:
            return
        self._intake.append((watch_index, root, path, size, mtime))
        self._intake_ready.set()

    async def _intake_loop(self) -> None:
        """Hash and accept settled files in batches: one transaction (one fsync) per batch,
        so a backlog of thousands of files is queued in seconds."""
        while True:
            await self._intake_ready.wait()
            self._intake_ready.clear()
            while self._intake:
                batch = self._intake[:INTAKE_BATCH]
                del self._intake[:INTAKE_BATCH]
                self._intake_busy = True
                try:
                    fresh = [item for item in batch
                             if self.store.find_active(item[2]) is None]
                    hashed = await asyncio.to_thread(_hash_all, fresh)
                    self._accept_batch(hashed)
                finally:
                    self._intake_busy = False

    def _accept_batch(self, hashed: list[tuple[_Settled, str | None]]) -> None:
        by_policy: dict[str, list[tuple[int, Path, Path, int, float, str]]] = {}
        for (index, root, path, size, mtime), digest in hashed:
            if digest is None:
                continue  # vanished or unreadable; a later event or rescan brings it back
            policy = self.config.watch[index].duplicates
            by_policy.setdefault(policy, []).append((index, root, path, size, mtime, digest))
        for policy, items in by_policy.items():
            jobs = self.store.accept_many(items, policy)
            for job in jobs:
                log.info("job_accepted", job=job.id, file=str(job.abs_path), size=job.size,
                         sha256=job.sha256)
            skipped = len(items) - len(jobs)
            if skipped and policy == "skip":
                log.info("duplicates_skipped", count=skipped)
        self._wake.set()

    # ------------------------------------------------------------ dispatch
    async def run(self) -> None:
        """Accept settled files and start jobs oldest first (resumed RUNNING jobs before
        PENDING ones), until cancelled."""
        intake = asyncio.create_task(self._intake_loop(), name="intake")
        try:
            await self._dispatch_loop()
        finally:
            intake.cancel()

    async def _dispatch_loop(self) -> None:
        while True:
            await self.dispatching.wait()
            self._start_jobs()
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=1.0)
            await self._window.poke()
            await self._inflight.poke()

    def _job_slots(self) -> int:
        return max(2, self._request_limit() // 2)

    def _start_jobs(self) -> None:
        free = self._job_slots() - len(self._active)
        if free <= 0:
            return
        candidates = [j for j in self.store.list_jobs(JobState.RUNNING.value, limit=100)
                      if j.id not in self._active]
        candidates.sort(key=lambda j: j.id)
        if len(candidates) < free:
            candidates += [j for j in self.store.next_pending(limit=free + len(self._active))
                           if j.id not in self._active]
        for job in candidates[:free]:
            task = asyncio.create_task(self.run_job(job))
            self._active[job.id] = task
            task.add_done_callback(self._job_finished)

    def _job_finished(self, task: asyncio.Task[None]) -> None:
        for job_id, active in list(self._active.items()):
            if active is task:
                del self._active[job_id]
        self._wake.set()

    @property
    def active_jobs(self) -> int:
        return len(self._active)

    def idle(self) -> bool:
        """No accepted work left (used by drain)."""
        counts = self.store.counts()
        return (not self._active and not self._intake and not self._intake_busy
                and counts.get("pending", 0) == 0 and counts.get("active", 0) == 0)

    async def cancel_job(self, job_id: int) -> bool:
        task = self._active.get(job_id)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for page in self.store.pages(job_id):
            if page.state is PageState.IN_FLIGHT:
                self.store.release_page(job_id, page.index)
        job = self.store.get(job_id)
        if job is None or not self.store.cancel(job_id):
            return False
        if job.abs_path.exists():
            watch = self.config.watch[job.watch_index]
            final = outputs.move_to(watch.failed, job.input_root, job.abs_path)
            outputs.write_error_json(final, "cancelled", "cancelled by the operator",
                                     job.attempts, {"created": job.created_at,
                                                    "cancelled": time.time()})
            self.store.set_job_state(job_id, JobState.CANCELLED, final_path=final)
        return True

    def retry_job(self, job: Job) -> bool:
        """Move a failed input back from ``failed/`` and requeue it."""
        if job.final_path is not None and job.final_path.exists() and not job.abs_path.exists():
            job.abs_path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(job.final_path, job.abs_path)
            error_json = job.final_path.with_name(job.final_path.name + ".error.json")
            with contextlib.suppress(FileNotFoundError):
                error_json.unlink()
        ok = self.store.retry(job.id)
        self._wake.set()
        return ok

    # ------------------------------------------------------------ one job
    async def run_job(self, job: Job) -> None:
        """Probe, render, infer, write, move: the whole life of one accepted file."""
        started = time.monotonic()
        watch = self.config.watch[job.watch_index]
        try:
            if job.state is JobState.PENDING:
                self.store.set_job_state(job.id, JobState.RUNNING)
            info = await self.render.probe(job.abs_path, self.config.ocr.max_pages)
            self.store.set_job_state(job.id, JobState.RUNNING, pages_total=info.page_count)
            self.store.init_pages(job.id, info.page_count)
            todo = [p.index for p in self.store.pages(job.id)
                    if p.state in (PageState.PENDING, PageState.IN_FLIGHT)]
            await asyncio.gather(*(self._page(job, i) for i in todo))
            await self._finish(job, watch, started)
        except InputError as exc:
            self._fail_job(job, watch, exc.code, exc.message)
        except FileNotFoundError as exc:
            self._fail_job(job, watch, "input_vanished", f"the input disappeared: {exc}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one bad file must never stop the daemon
            log.exception("job_crashed", job=job.id, file=str(job.abs_path))
            self._fail_job(job, watch, "internal_error", f"{type(exc).__name__}: {exc}")

    async def _page(self, job: Job, index: int) -> None:
        await self._window.acquire()
        try:
            await self.dispatching.wait()
            page = await self._render(job, index)
            outcome = await self._infer(job, index, page.png, page.width, page.height)
            if not outcome.ok:
                self.store.fail_page(job.id, index, outcome.error or "failed")
                log.warning("page_failed", job=job.id, page=index + 1, error=outcome.error)
        except InputError as exc:
            self.store.claim_page(job.id, index)
            self.store.fail_page(job.id, index, f"{exc.code}: {exc.message}")
            log.warning("page_failed", job=job.id, page=index + 1, error=exc.message)
        finally:
            await self._window.release()

    async def _render(self, job: Job, index: int) -> RenderedPage:
        """Render one page; a crashed or hung worker takes its pool-mates down with it,
        so a page that failed that way gets one more try before it counts."""
        args = (job.abs_path, index, self.config.ocr.min_side_px, self.engine.max_pixels)
        try:
            return await self.render.render(*args)
        except (RenderCrashed, RenderTimeout) as exc:
            log.warning("page_render_retry", job=job.id, page=index + 1, error=exc.message)
            return await self.render.render(*args)

    async def _infer(self, job: Job, index: int, png: bytes, width: int,
                     height: int) -> _PageOutcome:
        """Chandra's retry loop for one page; returns once the page is done or failed."""
        cfg = self.config.ocr
        attempt = 0
        last_error = ""
        while attempt <= cfg.retries:
            await self.dispatching.wait()
            await self.engine.wait_ready()
            temperature, top_p = ocr.sampling_for_attempt(attempt)
            body = ocr.build_chat_request(
                png, model=self.engine.served_model_name, prompt_type=cfg.prompt_type,
                max_output_tokens=self.engine.max_output_tokens, temperature=temperature,
                top_p=top_p, fitted=True)
            await self._inflight.acquire()
            self.store.claim_page(job.id, index)
            t0 = time.monotonic()
            try:
                reply = await self.engine.chat(body, timeout=cfg.request_timeout)
            except EngineUnavailable as exc:
                # The engine failed under the page: give it back, uncharged, and wait.
                self.store.release_page(job.id, index)
                self.engine.report_failure("request failed", str(exc))
                await asyncio.sleep(0.5)
                continue
            except ValueError as exc:
                return _PageOutcome(False, f"engine rejected the page: {exc}")
            finally:
                await self._inflight.release()
            text, finish = _reply_text(reply)
            outcome = await self.render.postprocess(
                text, finish, png, include_images=cfg.include_images,
                include_headers_footers=cfg.include_headers_footers)
            attempt += 1
            if isinstance(outcome, ocr.PageResult):
                result = outcome
                self.store.finish_page(
                    job.id, index, width=width, height=height,
                    seconds=time.monotonic() - t0,
                    result={"markdown": result.markdown, "html": result.html,
                            "blocks": result.blocks, "images": _encode_images(result.images),
                            "attempts": attempt})
                return _PageOutcome(True)
            last_error = f"{outcome} after {attempt} attempt(s)"
            if attempt <= cfg.retries:
                self.store.release_page(job.id, index)
        return _PageOutcome(False, f"retries exhausted: {last_error}")

    def _output_dir(self, job: Job) -> Path:
        watch = self.config.watch[job.watch_index]
        return outputs.output_dir_for(watch.output, job.input_root, job.abs_path)

    async def _finish(self, job: Job, watch: WatchConfig, started: float) -> None:
        pages = self.store.pages(job.id)
        page_outputs = [_page_output(p) for p in pages]
        failed = sum(1 for p in pages if p.state is PageState.FAILED)
        out_dir = self._output_dir(job)
        stem = job.abs_path.stem
        metadata = {
            "source": str(job.path),
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
        await asyncio.to_thread(outputs.write_document, out_dir, stem, page_outputs, metadata,
                                self.config.ocr.formats)
        final = outputs.move_to(watch.done, job.input_root, job.abs_path)
        state = JobState.PARTIAL if failed else JobState.DONE
        self.store.set_job_state(job.id, state, output_dir=out_dir, final_path=final)
        log.info("job_done", job=job.id, file=str(job.path), pages=len(pages),
                 pages_failed=failed, seconds=metadata["seconds"], state=state.value,
                 output=str(out_dir))

    def _fail_job(self, job: Job, watch: WatchConfig, code: str, message: str) -> None:
        final: Path | None = None
        if job.abs_path.exists():
            final = outputs.move_to(watch.failed, job.input_root, job.abs_path)
            outputs.write_error_json(final, code, message, job.attempts + 1, {
                "accepted": job.created_at, "failed": time.time()})
        self.store.set_job_state(job.id, JobState.FAILED, error_code=code,
                                 error_message=message, final_path=final)
        log.error("job_failed", job=job.id, file=str(job.path), code=code, reason=message)


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
        error=page.error,
        width=page.width or 0,
        height=page.height or 0,
        markdown=result.get("markdown", ""),
        html=result.get("html", ""),
        blocks=result.get("blocks", []),
        images=_decode_images(result.get("images")),
    )
