"""The HTTP job API as a Starlette application: routes, tokens, the job's JSON.

Every route but ``/v1/openapi.json`` needs ``Authorization: Bearer <token>`` (401
``unauthorized`` without a known one). A token sees the jobs it submitted; an admin token
sees every job. Someone else's job is answered 404, as a job that does not exist. Errors
are ``{"error": {"code", "message"}}`` with the codes of docs/operations.md (HTTP job API);
an upload refused for its kind carries the code ``failed/`` would (``unsupported_format``,
``empty_input``).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import structlog
from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chandrad import names, render
from chandrad.api.door import JobDoor
from chandrad.api.openapi import document
from chandrad.api.tokens import Caller, Tokens
from chandrad.api.uploads import Placed, Received, TooLarge, UploadDir, safe_filename
from chandrad.config import Config
from chandrad.errors import ControlError, ControlErrorCode, EmptyInput, StoreFull, UnsupportedFormat
from chandrad.events import Event
from chandrad.states import JobState
from chandrad.store import StoreBackend
from chandrad.store.api import ApiTable
from chandrad.store.records import Job

log = structlog.get_logger("chandrad.api")

#: Result formats: the outputs the pipeline writes, its metadata and the input itself.
RESULT_FORMATS = ("md", "html", "json", "pdf", "metadata", "input")
#: A multipart body may exceed ``max_upload`` by this much (boundaries, part headers).
MULTIPART_SLACK = 64 << 10
#: Seconds a client is told to wait while the daemon accepts no upload.
RETRY_AFTER_S = 30
CALLBACK = re.compile(r"https?://[^\s/]+(/\S*)?")
LIST_LIMIT = 1000
#: The largest job id (SQLite's INTEGER); a larger one in a path is no job (404).
MAX_JOB_ID = (1 << 63) - 1


class ApiError(Exception):
    """An error answer: HTTP status, code, message."""

    def __init__(self, status: int, code: str, message: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.headers = headers or {}


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse({"error": {"code": exc.code, "message": exc.message}},
                        status_code=exc.status, headers=exc.headers)


class Api:
    """The routes over the store, the uploads folder and the daemon's door."""

    def __init__(self, config: Config, store: StoreBackend, door: JobDoor, tokens: Tokens,
                 secret: bytes | None, uploads: UploadDir) -> None:
        self.config = config
        self.store = store
        self.table = ApiTable.of(store)
        self.door = door
        self.tokens = tokens
        self.secret = secret
        self.uploads = uploads

    def app(self) -> Starlette:
        routes = [
            Route("/v1/openapi.json", self.openapi, methods=["GET"]),
            Route("/v1/jobs", self.submit, methods=["POST"]),
            Route("/v1/jobs", self.list_jobs, methods=["GET"]),
            Route("/v1/jobs/{job_id:int}", self.get_job, methods=["GET"]),
            Route("/v1/jobs/{job_id:int}", self.cancel, methods=["DELETE"]),
            Route("/v1/jobs/{job_id:int}/result", self.result, methods=["GET"]),
            Route("/v1/jobs/{job_id:int}/files/{name}", self.file, methods=["GET"]),
        ]
        return Starlette(routes=routes, exception_handlers={
            ApiError: lambda _r, e: _error(e),  # type: ignore[arg-type,return-value]
            HTTPException: self._http_error,  # type: ignore[dict-item]
        }, middleware=[Middleware(BodyIdleTimeout, idle_s=self.config.api.upload_timeout)])

    @staticmethod
    async def _http_error(_request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "bad_request")
        return _error(ApiError(exc.status_code, code, str(exc.detail)))

    # ------------------------------------------------------------ who asks
    def _caller(self, request: Request) -> Caller:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        caller = self.tokens.caller(token.strip()) if scheme.lower() == "bearer" else None
        if caller is None:
            raise ApiError(401, "unauthorized", "a valid `Authorization: Bearer <token>` "
                           "is needed", {"WWW-Authenticate": "Bearer"})
        return caller

    def _visible_job(self, caller: Caller, job_id: int) -> Job:
        """The job, when ``caller`` may see it; 404 otherwise (someone else's job too)."""
        if job_id > MAX_JOB_ID:
            raise ApiError(404, "not_found", f"no job {job_id}")
        job = self.store.get(job_id)
        owner = self.table.get(job_id)
        if job is None or not (caller.admin or (owner is not None
                                                and owner.owner == caller.name)):
            raise ApiError(404, "not_found", f"no job {job_id}")
        return job

    # ------------------------------------------------------------ the job's JSON
    def job_json(self, job: Job) -> dict[str, Any]:
        api = self.table.get(job.id)
        outputs = api.outputs if api else self.config.api.formats
        finished = job.state in (JobState.DONE, JobState.PARTIAL)
        return {
            "id": job.id,
            "state": job.state.value,
            "file": names.display(job.path.name),
            "size": job.size,
            "sha256": job.sha256,
            "owner": api.owner if api else None,
            "queue_position": (self.table.queue_position(job.id)
                               if job.state is JobState.PENDING else None),
            "pages_total": job.pages_total,
            "pages_done": job.pages_done,
            "pages_failed": job.pages_failed,
            "error": ({"code": job.error_code, "message": job.error_message}
                      if job.error_code else None),
            "created_at": job.created_at,
            "finished_at": job.finished_at,
            "outputs": list(outputs),
            "results": ({f: f"/v1/jobs/{job.id}/result?format={f}" for f in outputs}
                        if finished else {}),
            "callback_url": api.callback_url if api else None,
        }

    # ------------------------------------------------------------ routes
    async def openapi(self, _request: Request) -> Response:
        return JSONResponse(document(self.config))

    async def list_jobs(self, request: Request) -> Response:
        caller = self._caller(request)
        state = request.query_params.get("state")
        if state is not None and state not in {s.value for s in JobState}:
            raise ApiError(422, "bad_request", f"state {state!r} is not one of "
                           f"{sorted(s.value for s in JobState)}")
        limit = _int_param(request, "limit", 100, 1, LIST_LIMIT)
        ids = self.table.job_ids(None if caller.admin else caller.name, state, limit)
        jobs = [j for j in (self.store.get(i) for i in ids) if j is not None]
        return JSONResponse({"jobs": [self.job_json(j) for j in jobs]})

    async def get_job(self, request: Request) -> Response:
        caller = self._caller(request)
        return JSONResponse(self.job_json(self._visible_job(caller,
                                                            request.path_params["job_id"])))

    async def cancel(self, request: Request) -> Response:
        caller = self._caller(request)
        job = self._visible_job(caller, request.path_params["job_id"])
        try:
            await self.door.cancel(job.id)
        except ControlError as exc:
            if exc.error_code is ControlErrorCode.NOT_FOUND:
                raise ApiError(404, "not_found", exc.message) from None
            if exc.error_code is ControlErrorCode.INVALID_STATE:
                raise ApiError(409, "invalid_state", exc.message) from None
            raise ApiError(503, "not_accepting", exc.message,
                           {"Retry-After": str(RETRY_AFTER_S)}) from None
        done = self.store.get(job.id)
        return JSONResponse(self.job_json(done or job))

    async def result(self, request: Request) -> Response:
        caller = self._caller(request)
        job = self._visible_job(caller, request.path_params["job_id"])
        fmt = request.query_params.get("format", "md")
        api = self.table.get(job.id)
        allowed = (*(api.outputs if api else self.config.api.formats), "metadata", "input")
        if fmt not in RESULT_FORMATS or fmt not in allowed:
            raise ApiError(422, "bad_format", f"format {fmt!r}: this job serves "
                           f"{list(allowed)}")
        if job.state not in (JobState.DONE, JobState.PARTIAL):
            raise ApiError(409, "not_finished", f"job {job.id} is {job.state.value}")
        path = self._result_path(job, fmt)
        if path is None or not path.is_file():
            raise ApiError(404, "not_found", f"job {job.id} has no {fmt} output")
        return FileResponse(path, filename=path.name, media_type=_media_type(fmt))

    async def file(self, request: Request) -> Response:
        """A file of the job's output folder by its name (the image crops)."""
        caller = self._caller(request)
        job = self._visible_job(caller, request.path_params["job_id"])
        name = request.path_params["name"]
        if (job.output_dir is None or not name or "/" in name or "\\" in name
                or name.startswith(".")):
            raise ApiError(404, "not_found", f"job {job.id} has no file {name!r}")
        path = job.output_dir / name
        if not path.is_file():
            raise ApiError(404, "not_found", f"job {job.id} has no file {name!r}")
        return FileResponse(path)

    def _result_path(self, job: Job, fmt: str) -> Path | None:
        if fmt == "input":
            return job.final_path
        if job.output_dir is None or not job.output_dir.is_dir():
            return None
        meta = next((p for p in job.output_dir.iterdir()
                     if p.name.endswith("_metadata.json")), None)
        if meta is None:
            return None
        if fmt == "metadata":
            return meta
        return meta.with_name(meta.name[: -len("_metadata.json")] + f".{fmt}")

    # ------------------------------------------------------------ upload
    async def submit(self, request: Request) -> Response:
        caller = self._caller(request)
        if not self.door.accepting():
            raise ApiError(503, "not_accepting", "the daemon accepts no new file now "
                           "(draining or stopping)", {"Retry-After": str(RETRY_AFTER_S)})
        limit = self.config.api.max_upload
        length = request.headers.get("content-length")
        if length is None:
            raise ApiError(411, "length_required", "send the upload with a Content-Length")
        if not length.isdigit():
            raise ApiError(400, "bad_request", "Content-Length is not a number")
        ctype = request.headers.get("content-type", "")
        multipart = ctype.startswith("multipart/form-data")
        if int(length) > limit + (MULTIPART_SLACK if multipart else 0):
            raise ApiError(413, "upload_too_large", f"the upload is over api.max_upload "
                           f"({limit} bytes)")
        if multipart:
            received, filename, fields = await self._multipart(request, limit)
        else:
            fields = dict(request.query_params)
            filename = fields.get("filename")
            if not filename:
                raise ApiError(422, "missing_filename", "a raw upload needs ?filename=")
            received = await self._receive(request.stream(), limit)
        try:
            outputs, callback = self._options(fields)
            await self._check_kind(received)
            placed = await asyncio.to_thread(self.uploads.place, received,
                                             safe_filename(filename))
        except BaseException:
            self.uploads.discard(received)
            raise
        job = self._accept(caller, placed, outputs, callback)
        self.door.accepted()
        log.info(Event.JOB_ACCEPTED, job=job.id, file=names.display(placed.path),
                 size=placed.size, sha256=placed.sha256, owner=caller.name, via="api")
        return JSONResponse(self.job_json(job), status_code=202,
                            headers={"Location": f"/v1/jobs/{job.id}"})

    async def _multipart(self, request: Request,
                         limit: int) -> tuple[Received, str | None, dict[str, str]]:
        try:
            form = await request.form(max_files=1, max_fields=8, max_part_size=64 << 10)
        except HTTPException as exc:
            raise ApiError(400, "bad_multipart", str(exc.detail)) from None
        except Exception as exc:  # python-multipart on a truncated or malformed body
            raise ApiError(400, "bad_multipart", f"{type(exc).__name__}: {exc}") from None
        try:
            upload = form.get("file")
            if not isinstance(upload, UploadFile):
                raise ApiError(422, "missing_file", "the form needs a `file` part")
            fields = {k: v for k, v in form.items() if isinstance(v, str)}

            async def chunks() -> AsyncIterator[bytes]:
                while chunk := await upload.read(1 << 20):
                    yield chunk

            received = await self._receive(chunks(), limit)
            return received, upload.filename, fields
        finally:
            await form.close()

    async def _receive(self, chunks: AsyncIterator[bytes], limit: int) -> Received:
        try:
            return await self.uploads.receive(chunks, limit)
        except TooLarge:
            raise ApiError(413, "upload_too_large", f"the upload is over api.max_upload "
                           f"({limit} bytes)") from None

    def _options(self, fields: dict[str, str]) -> tuple[tuple[str, ...], str | None]:
        raw = fields.get("outputs")
        outputs = self.config.api.formats
        if raw:
            outputs = tuple(dict.fromkeys(f.strip() for f in raw.split(",") if f.strip()))
            bad = [f for f in outputs if f not in self.config.ocr.formats]
            if bad or not outputs:
                raise ApiError(422, "bad_format", f"outputs {bad or raw!r}: choose among "
                               f"{list(self.config.ocr.formats)}")
        own = fields.get("callback_url")
        callback = own or self.config.api.callback_url or None
        if callback is not None:
            if not CALLBACK.fullmatch(callback) or len(callback) > 2048:
                raise ApiError(422, "bad_callback", "callback_url is not an http(s) URL")
            if own:
                self._check_callback_host(own)
            if self.secret is None:
                raise ApiError(422, "bad_callback", "webhooks need api.webhook_secret_file")
        return outputs, callback

    def _check_callback_host(self, url: str) -> None:
        """A job's own callback URL must name a host of ``api.callback_hosts`` (parsed as
        the webhook client parses it, so that no URL trick reaches another host)."""
        try:
            host = httpx.URL(url).raw_host.decode("ascii").lower()
        except (httpx.InvalidURL, ValueError):
            raise ApiError(422, "bad_callback", "callback_url is not an http(s) URL") from None
        allowed = self.config.api.callback_hosts
        if not any(host == h or (h.startswith("*.") and host.endswith(h[1:]))
                   for h in allowed):
            raise ApiError(422, "bad_callback", f"callback_url's host {host!r} is not in "
                           f"api.callback_hosts {list(allowed)}")

    async def _check_kind(self, received: Received) -> None:
        try:
            await asyncio.to_thread(render.check_format, received.temp)
        except (UnsupportedFormat, EmptyInput) as exc:
            raise ApiError(415, exc.code, exc.message.replace(received.temp.name,
                                                              "the upload")) from None

    def _accept(self, caller: Caller, placed: Placed, outputs: tuple[str, ...],
                callback: str | None) -> Job:
        policy = self.config.api.duplicates
        try:
            job = self.table.accept(
                lambda: self.store.accept(-1, placed.root, placed.path, placed.size,
                                          placed.mtime, placed.sha256, policy),
                caller.name, outputs, callback)
        except StoreFull as exc:
            self.uploads.remove(placed)
            raise ApiError(507, "store_full", exc.message,
                           {"Retry-After": str(RETRY_AFTER_S)}) from None
        except BaseException:
            self.uploads.remove(placed)
            raise
        if job is None:
            self.uploads.remove(placed)
            same = self.table.same_content(placed.sha256)
            owner = self.table.get(same) if same is not None else None
            seen = same is not None and (caller.admin or (owner is not None
                                                          and owner.owner == caller.name))
            raise ApiError(409, "duplicate", "this content is already queued or done "
                           "(api.duplicates = \"skip\")"
                           + (f": job {same}" if seen else ""),
                           {"Location": f"/v1/jobs/{same}"} if seen else None)
        return job


class BodyIdleTimeout:
    """ASGI middleware: a request body that sends nothing for ``idle_s`` seconds (a stalled
    or slow-loris upload) ends its request with 408 ``upload_timeout``; once the body is
    complete, ``receive`` is the server's own again (a response waiting for a disconnect
    is never cut)."""

    def __init__(self, app: ASGIApp, idle_s: float) -> None:
        self.app = app
        self.idle_s = idle_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        complete = False

        async def timed() -> Message:
            nonlocal complete
            if complete:
                return await receive()
            try:
                async with asyncio.timeout(self.idle_s):
                    message = await receive()
            except TimeoutError:
                raise ApiError(408, "upload_timeout", f"no byte of the body arrived for "
                               f"{self.idle_s:g} s", {"Connection": "close"}) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                complete = True
            return message

        await self.app(scope, timed, send)


def _int_param(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or not lo <= int(raw) <= hi:
        raise ApiError(422, "bad_request", f"{name} must be an integer in [{lo}, {hi}]")
    return int(raw)


def _media_type(fmt: str) -> str | None:
    return {"md": "text/markdown; charset=utf-8", "html": "text/html; charset=utf-8",
            "json": "application/json", "pdf": "application/pdf",
            "metadata": "application/json"}.get(fmt)
