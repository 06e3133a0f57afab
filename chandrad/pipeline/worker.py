"""The page worker: one page from its render to its result in the store.

render → a slot in the render-ahead window → a request slot and an engine → the request
(built for that engine) → post-processing → the result committed to the store. What to do
after each request (retry, charge, give back, refit, give up) is decided by the page's
:class:`~chandrad.pipeline.attempts.PagePolicy`; the worker carries it out.

A page leaves the render-ahead window when its answer arrives, so rendering goes on while
the render workers post-process a burst of answers. The page image is held once, as its
PNG: each request's body is encoded around it and writes its base64 as it is sent
(``ocr.encode_chat_request``). Every page result is committed to the store before it
counts, so a restart resumes at page granularity.
"""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import dataclass
from typing import Any

import structlog

from chandrad import model_files, ocr
from chandrad.config import Config
from chandrad.engine.profile import PIXELS_PER_IMAGE_TOKEN, estimate_prompt_tokens
from chandrad.errors import (
    EngineUnavailable,
    InputError,
    PageTaken,
    RenderCrashed,
    RenderTimeout,
)
from chandrad.events import Event
from chandrad.interfaces import ChatBody, EngineHandle, EngineTarget, Observer
from chandrad.pipeline.attempts import (
    Charge,
    GiveUp,
    PagePolicy,
    Refit,
    Retry,
    Send,
    truncated,
)
from chandrad.pipeline.limits import Limits, Slot
from chandrad.render import RenderPool
from chandrad.states import PageState
from chandrad.store import Job, Page, StoreBackend

log = structlog.get_logger("chandrad.pipeline")


@dataclass
class PageOutcome:
    ok: bool
    error: str | None = None
    inference_s: float = 0.0  # engine time of the page's requests, retries included


@dataclass(frozen=True)
class _Sent:
    """One request on its way: where it went, what it asked for, when."""

    target: EngineTarget
    max_tokens: int | None
    started: float  # monotonic


class _HelpedSteps:
    """The store's page steps for pages of another host's job leased to this host
    (``helped``: fenced by the page's lease, not the job's)."""

    def __init__(self, store: StoreBackend) -> None:
        self._store = store

    def page(self, job_id: int, index: int) -> Page | None:
        return self._store.page(job_id, index)

    def claim_page(self, job_id: int, index: int) -> None:
        self._store.claim_page(job_id, index, helped=True)

    def finish_page(self, job_id: int, index: int, *, result: dict[str, Any], width: int,
                    height: int, seconds: float) -> None:
        self._store.finish_page(job_id, index, result=result, width=width, height=height,
                                seconds=seconds, helped=True)

    def fail_page(self, job_id: int, index: int, error: str) -> None:
        self._store.fail_page(job_id, index, error, helped=True)

    def release_page(self, job_id: int, index: int, *, charge: bool = False) -> None:
        self._store.release_page(job_id, index, charge=charge, helped=True)


class PageWorker:
    """Runs pages: :meth:`run` is one page, start to end (many run at once).

    ``helping``: the pages are other hosts' (``chandrad.pipeline.helping``), each leased
    to this host; otherwise they are of this host's own jobs, and a page a helping host
    holds is left to it (PageTaken: the page is dropped, nothing stored).
    """

    def __init__(self, config: Config, store: StoreBackend, engine: EngineHandle,
                 render: RenderPool, limits: Limits, dispatching: asyncio.Event,
                 helping: bool = False) -> None:
        self.config = config
        self.helping = helping
        self.store: StoreBackend | _HelpedSteps = _HelpedSteps(store) if helping else store
        self.engine = engine
        self.render = render
        self.limits = limits
        self.dispatching = dispatching  # cleared while paused: no request is sent
        #: Rendered pages waiting for a request slot (``status``: while any wait, the
        #: requests in flight should be at the limit).
        self.pages_waiting = 0
        #: Pages sent to an engine whose answer is not stored (or given up, given back)
        #: yet: the request slot is free once answered, the page's work is not.
        self.pages_answering = 0
        self.observer: Observer | None = None  # metrics: page outcomes and latencies
        self._patch_pixels: tuple[str, int] | None = None  # (model, pixels per image token)

    async def run(self, job: Job, index: int) -> bool:
        """Render, infer and commit page ``index``; a page that fails is recorded failed.
        False: the page is not this host's (any more): nothing was stored for it."""
        try:
            await self._run(job, index)
        except PageTaken as exc:
            log.info("page_left", job=job.id, page=index + 1, holder=exc.details.get("owner"),
                     reason=exc.message)
            return False
        return True

    async def _run(self, job: Job, index: int) -> None:
        window = Slot(self.limits.window)
        await window.acquire()
        t0 = time.monotonic()
        try:
            await self.dispatching.wait()
            if not self.helping and _held(self.store.page(job.id, index)):
                return  # a helping host took (or did) it meanwhile: not rendered here
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
                     window: Slot) -> PageOutcome:
        """The page's requests until it is done or its policy gives up."""
        policy = PagePolicy(self.config.ocr.retries)
        prompt_estimate = estimate_prompt_tokens(page.width, page.height,
                                                 self._pixels_per_token())
        engine_s = 0.0
        while isinstance(send := policy.next_request(), Send):
            target = await self._slot()
            if target is None:
                continue
            max_tokens = policy.max_tokens(ocr.request_max_tokens(
                target.max_output_tokens, target.max_model_len, prompt_estimate))
            body = ocr.encode_chat_request(
                page, model=target.served_model_name, prompt_type=self.config.ocr.prompt_type,
                max_output_tokens=max_tokens, temperature=send.temperature, top_p=send.top_p)
            try:
                self.store.claim_page(job.id, index)
            except BaseException:  # not ours any more, or no store: the slot goes back
                self.engine.release(target)
                await self.limits.inflight.release()
                raise
            sent = _Sent(target, max_tokens, time.monotonic())
            self.pages_answering += 1
            try:
                try:
                    answer = await self._ask(job, index, sent, body, policy)
                finally:
                    engine_s += time.monotonic() - sent.started
                    self.engine.release(target)
                    await self.limits.inflight.release()
                if answer is None:
                    continue  # given back (uncharged or charged): ask again
                if isinstance(answer, dict):
                    policy.answered()
                    result = await self._postprocess(answer, page, window)
                    if isinstance(result, ocr.PageResult):
                        self._commit(job, index, page, result, answer, sent, policy.attempt)
                        return PageOutcome(True, inference_s=engine_s)
                    decision = policy.answer_failed(result)
                else:
                    decision = answer
            finally:
                self.pages_answering -= 1
            if isinstance(decision, GiveUp):
                return PageOutcome(False, decision.error, engine_s)
            await self._retry(job, index, decision, policy.attempt)
        return PageOutcome(False, send.error, engine_s)

    async def _slot(self) -> EngineTarget | None:
        """Wait until dispatching, an engine is ready and a request slot is free; the
        engine the request goes to (several: the one with most free capacity). None: paused
        while it waited, or every engine left ready meanwhile (the slot is given back)."""
        await self.dispatching.wait()
        await self.engine.wait_ready()
        self.pages_waiting += 1
        try:
            await self.limits.inflight.acquire()
        finally:
            self.pages_waiting -= 1
        if not self.dispatching.is_set():  # paused while it waited for a slot
            await self.limits.inflight.release()
            return None
        target = self.engine.pick()
        if target is None:
            await self.limits.inflight.release()
        return target

    async def _ask(self, job: Job, index: int, sent: _Sent, body: ChatBody,
                   policy: PagePolicy) -> dict[str, Any] | Retry | GiveUp | None:
        """Send the request: the engine's answer, or what to do about its error. A page
        given back or refitted (None) is released here, holding its request slot."""
        target = sent.target
        try:
            return await target.chat(body, timeout=self.config.ocr.request_timeout)
        except EngineUnavailable as exc:
            target.report_failure("request failed", str(exc))
            stored = self.store.page(job.id, index)
            failed = policy.engine_failed(exc.message, exc.page_may_be_at_fault,
                                          stored.releases if stored is not None else 0)
            if isinstance(failed, Charge):
                # This page's requests keep failing: from now on they count.
                self.store.release_page(job.id, index, charge=True)
                log.warning("page_request_failed", job=job.id, page=index + 1,
                            attempt=policy.attempt, error=failed.error)
            else:
                # The engine failed under the page: give it back, uncharged, and wait.
                self.store.release_page(job.id, index)
            if self.helping:  # another host's page: not held while this engine recovers
                raise PageTaken(f"the engine failed under page {index + 1} of job {job.id}, "
                                "another host's; this host gives it back", job=job.id,
                                page=index) from exc
            await asyncio.sleep(failed.pause_s)
            return None
        except ValueError as exc:
            rejected = policy.rejected(str(exc), target.max_output_tokens, target.max_model_len)
            if isinstance(rejected, Refit):
                self.store.release_page(job.id, index)
                log.info("page_max_tokens_refit", job=job.id, page=index + 1,
                         prompt_tokens=rejected.prompt_tokens, max_tokens=rejected.max_tokens)
                return None
            return rejected

    async def _postprocess(self, reply: dict[str, Any], page: ocr.PageImage,
                           window: Slot) -> ocr.PageResult | str:
        """The answer as Markdown/HTML/blocks, or why it is unusable (a repetition loop,
        post-processing failed). The page's render-ahead slot goes to the next page now."""
        text, finish = _reply_text(reply)
        await self.limits.post.acquire()
        try:
            await window.release()
            return await self.render.postprocess(
                text, finish, page, include_images=self.config.ocr.include_images,
                include_headers_footers=self.config.ocr.include_headers_footers)
        except (RenderCrashed, RenderTimeout) as exc:
            return f"post-processing failed: {exc.message}"
        finally:
            await self.limits.post.release()

    def _commit(self, job: Job, index: int, page: ocr.PageImage, result: ocr.PageResult,
                reply: dict[str, Any], sent: _Sent, attempt: int) -> None:
        """The page's result into the store; an answer cut by ``length`` is kept, marked."""
        cut = truncated(_reply_text(reply)[1])
        charged = self.store.page(job.id, index)
        attempts = charged.attempts if charged is not None else attempt
        self.store.finish_page(
            job.id, index, width=page.width, height=page.height,
            seconds=time.monotonic() - sent.started,
            result={"markdown": result.markdown, "html": result.html, "blocks": result.blocks,
                    "images": _encode_images(result.images), "attempts": attempts,
                    "truncated": cut})
        if cut:
            log.warning("page_truncated", job=job.id, page=index + 1, attempts=attempts,
                        max_tokens=sent.max_tokens, max_model_len=sent.target.max_model_len)

    async def _retry(self, job: Job, index: int, retry: Retry, attempt: int) -> None:
        """The attempt is charged; the page waits ``pause_s`` before its next request."""
        self.store.release_page(job.id, index, charge=True)
        log.info("page_retry", job=job.id, page=index + 1, attempt=attempt,
                 reason=retry.reason)
        if retry.pause_s:
            await asyncio.sleep(retry.pause_s)

    def _pixels_per_token(self) -> int:
        """The served model's pixels per image token (its processor config), read once."""
        model = self.config.engine.model
        if self._patch_pixels is None or self._patch_pixels[0] != model:
            found = model_files.pixels_per_image_token(model)
            self._patch_pixels = (model, found or PIXELS_PER_IMAGE_TOKEN)
        return self._patch_pixels[1]


def _held(page: Page | None) -> bool:
    """Whether a helping host holds the page, or did it."""
    return page is not None and page.holder is not None


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
