"""One job's life once dispatched: probe, its pages (each a page worker's), the outputs,
the input moved to ``done/`` or ``failed/``.

A job is bound to the content it was accepted with: the input is re-hashed when the job
starts or resumes and before it is moved, and a replaced file is queued as new content
(the old job ends ``cancelled``/``input_replaced``). The destination of each move is
recorded before the move, so a crash between the move and its outcome is completed at
resume. Outputs are written from the store, so a restart rebuilds them.

On a shared store other hosts may help with the job's pages
(``chandrad.pipeline.helping``): the owner leaves those pages to them, waits until they
are stored (taking back any whose helper's lease expired), and writes the outputs once, as
a single host does.

Errors that end the job's run are the scheduler's to judge (``chandrad.pipeline.scheduler``):
failed, held, waiting for the store, or backing off.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from chandrad import names, outputs, textlayer
from chandrad.config import Config, WatchConfig
from chandrad.errors import InputError
from chandrad.events import Event
from chandrad.interfaces import EngineHandle
from chandrad.pipeline.content import find_moved, fingerprint, is_under
from chandrad.pipeline.worker import PageWorker
from chandrad.render import RenderPool
from chandrad.states import JobState, PageState
from chandrad.store import Job, StoreBackend

log = structlog.get_logger("chandrad.pipeline")

#: Seconds between looks at the pages helping hosts hold, once this host's own are done.
HELPED_POLL_S = 0.5
_OPEN = (PageState.PENDING, PageState.IN_FLIGHT)


class JobRunner:
    """Runs one dispatched job to its outcome; raises what it cannot record."""

    def __init__(self, config: Config, store: StoreBackend, engine: EngineHandle,
                 render: RenderPool, worker: PageWorker, new_work: Callable[[], None]) -> None:
        self.config = config
        self.store = store
        self.engine = engine
        self.render = render
        self.worker = worker
        self._new_work = new_work  # a replaced input queued a new job: wake the dispatcher

    async def run(self, job: Job, watch: WatchConfig, started: float) -> None:
        """Probe, render, infer, write, move."""
        if not job.abs_path.exists() and await self._complete_moved(job, watch, started):
            return
        if not await self.same_content(job, watch):
            return
        info = await self.render.probe(job.abs_path, self.config.ocr.max_pages)
        # One transaction sets ``pages_total`` and creates the pages (each write
        # transaction is an fsync on the event loop's thread, paid per one-page file).
        self.store.init_pages(job.id, info.page_count)
        self.store.reclaim_pages(job.id)
        pages = self.store.pages(job.id)
        for p in pages:
            # A claim a full store kept from release (not a helping host's page).
            if p.state is PageState.IN_FLIGHT and p.holder is None:
                self.store.release_page(job.id, p.index)
        todo = [p.index for p in pages if p.state in _OPEN and p.holder is None]
        try:
            while True:
                left = await self._run_pages(job, todo)
                # Pages helping hosts hold (a shared store): wait until they are stored,
                # taking back (and running) any whose helper's lease expired.
                if reclaimed := self.store.reclaim_pages(job.id):
                    log.warning("pages_reclaimed", job=job.id, pages=reclaimed,
                                reason="the lease of the host helping with them expired")
                still = self.store.open_pages(job.id)
                held = [i for i, holder in still if holder is not None]
                todo = [i for i, holder in still if holder is None]
                # Done once no helper holds a page and none was left to or taken back
                # from one (a single host's store: always after the first pass).
                if not held and (not todo or not (left or reclaimed)):
                    break
                if not todo:
                    await asyncio.sleep(HELPED_POLL_S)
        finally:
            # A cancelled page leaves its claim behind; give it back so the page can
            # be claimed again (a retry, a resume) instead of being stuck in flight.
            for page in self.store.pages(job.id):
                if page.state is PageState.IN_FLIGHT and page.holder is None:
                    self.store.release_page(job.id, page.index)
        await self._finish(job, watch, started)

    async def _run_pages(self, job: Job, todo: list[int]) -> int:
        """Run pages of the job at once; returns how many were left to a helping host."""
        if not todo:
            return 0
        try:
            # A TaskGroup, not gather: when one page raises, its siblings are cancelled
            # instead of running on for a job that has failed.
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self.worker.run(job, i)) for i in todo]
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None
        return sum(1 for t in tasks if not t.result())

    async def same_content(self, job: Job, watch: WatchConfig) -> bool:
        """Whether the input still holds the content the job was accepted with; when it
        does not, end the job and queue the new content as a new job."""
        digest, size, mtime = await asyncio.to_thread(fingerprint, job.abs_path)
        if digest == job.sha256:
            return True
        new = self.store.supersede(job.id, size, mtime, digest, watch.duplicates)
        log.warning("input_replaced", job=job.id, file=names.display(job.abs_path),
                    old_sha256=job.sha256, sha256=digest, new_job=new.id if new else None)
        self._new_work()
        return False

    async def _complete_moved(self, job: Job, watch: WatchConfig, started: float) -> bool:
        """The input is gone from the inbox: if a move recorded before a crash completed
        (``final_path`` holds the job's content), record the outcome it was moving for."""
        # The destination is recorded before each move; a job from before that record
        # existed can only have been moving to done/.
        intended = job.final_path or watch.done / job.abs_path.relative_to(job.input_root)
        moved = await asyncio.to_thread(find_moved, job, intended)
        if moved is None:
            return False
        log.info("job_move_recovered", job=job.id, file=names.display(job.abs_path),
                 final=names.display(moved))
        if is_under(moved, watch.failed):
            outputs.write_error_json(moved, job.error_code or "internal_error",
                                     job.error_message or "", job.attempts,
                                     {"accepted": job.created_at, "failed": time.time()})
            self.store.set_job_state(job.id, JobState.FAILED, final_path=moved)
            return True
        await self._finish(job, watch, started, moved=moved)
        return True

    async def _finish(self, job: Job, watch: WatchConfig, started: float,
                      moved: Path | None = None) -> None:
        """Write the outputs from the store, then move the input to ``done/``.

        The intended destination is recorded before the move, so a crash between the
        move and the final record is completed at resume (``moved``: where the input was
        found then) instead of failing a job whose outputs are complete.
        """
        if moved is None and not await self.same_content(job, watch):
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
        made = await self._searchable_pdf(job, moved or job.abs_path, slot.output_dir, stem,
                                          page_outputs, metadata)
        try:
            written = await asyncio.to_thread(outputs.write_document, slot.output_dir, stem,
                                              page_outputs, metadata,
                                              self.config.ocr.formats, made)
        finally:
            for path in made.values():  # gone once written; left where the write failed
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
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

    async def _searchable_pdf(self, job: Job, source: Path, out_dir: Path, stem: str,
                              pages: list[outputs.PageOutput],
                              metadata: dict[str, Any]) -> dict[str, Path]:
        """``<stem>.pdf`` when ``ocr.formats`` asks for it, made from the input (where it
        is now: the inbox, or ``done/`` after a move a crash cut short) by a render
        worker, which writes it beside ``out_dir`` for ``write_document`` to rename. A PDF
        that cannot be made leaves the other outputs alone: the job is done, the reason
        is logged and kept in the metadata as ``pdf_error``."""
        if "pdf" not in self.config.ocr.formats:
            return {}
        name = f"{stem}.pdf"
        layouts = [textlayer.PageLayout(p.width, p.height, p.blocks if p.status == "ok" else [])
                   for p in pages]
        path = await asyncio.to_thread(outputs.made_file, out_dir, name)
        try:
            await self.render.searchable_pdf(source, layouts, self.config.ocr.pdf_text_pages,
                                             path)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)  # a worker killed while it wrote
            if not isinstance(exc, InputError):  # RenderCrashed and RenderTimeout are
                raise
            metadata["pdf_error"] = f"{exc.code}: {exc.message}"
            log.warning("pdf_output_failed", job=job.id, file=names.display(job.path),
                        code=exc.code, reason=exc.message)
            return {}
        return {name: path}

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

    async def fail(self, job: Job, watch: WatchConfig, code: str, message: str) -> None:
        """Move the input to ``failed/`` with its ``.error.json`` and record the failure
        (not when the input was replaced: the new content is queued, not failed)."""
        final: Path | None = None
        message = names.text(message)
        if job.abs_path.exists():
            with contextlib.suppress(OSError):  # unreadable: fail what is there
                if not await self.same_content(job, watch):
                    return  # replaced: the new content is queued, not failed for the old
            final = self._move_input(job, watch.failed, error_code=code, error_message=message)
            outputs.write_error_json(final, code, message, job.attempts + 1, {
                "accepted": job.created_at, "failed": time.time()})
        self.store.set_job_state(job.id, JobState.FAILED, error_code=code,
                                 error_message=message, final_path=final)
        log.error(Event.JOB_FAILED, job=job.id, file=names.display(job.path), code=code,
                  reason=message)


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
