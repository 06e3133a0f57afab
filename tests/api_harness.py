"""A real daemon with ``[api]`` on, its tokens, and a real webhook receiver, for the API tests.

The daemon is the harness's (``daemon_harness.Daemon`` with the stand-in engine); the API
is reached over real HTTP with httpx; the receiver is a threaded ``http.server`` that
records every POST (headers and body) and answers the statuses a test scripts.
"""

from __future__ import annotations

import hashlib
import hmac
import http.server
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from daemon_harness import OCR, table
from faults.faultkit import Daemon, free_port, standin_engine
from waiting import wait_until

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef00"
ROOT = "root-token-0123456789abcdef0"
SECRET = "whsec-0123456789abcdef0123456789"
MAX_UPLOAD = 8 << 20
#: Seconds an upload may stall before 408 (short, so a test waits little for it).
UPLOAD_TIMEOUT = 2.0
FINAL = ("done", "partial", "failed", "cancelled")


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def api_daemon(root: Path, *, callback_url: str = "", max_upload: int = MAX_UPLOAD,
               duplicates: str = "process",
               callback_hosts: tuple[str, ...] = ("127.0.0.1",)) -> tuple[Daemon, str]:
    """A daemon (not started) whose ``[api]`` listens on a free port; its base URL. Jobs
    may name their own callbacks on ``callback_hosts`` (the test receivers' host)."""
    root.mkdir(parents=True, exist_ok=True)
    tokens = root / "api-tokens"
    tokens.write_text(f"# test tokens\nalice {ALICE}\nbob {BOB}\nroot {ROOT} admin\n")
    tokens.chmod(0o600)
    secret = root / "webhook-secret"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    port = free_port()
    api: dict[str, Any] = {"enabled": True, "listen": f"127.0.0.1:{port}",
                           "tokens_file": tokens, "webhook_secret_file": secret,
                           "max_upload": max_upload, "upload_timeout": UPLOAD_TIMEOUT,
                           "duplicates": duplicates, "callback_hosts": list(callback_hosts),
                           "formats": ["md", "html", "json"]}
    if callback_url:
        api["callback_url"] = callback_url
    d = Daemon(root, standin_engine(root, port=free_port(), stop_timeout=3),
               ocr={**OCR, "formats": ["md", "html", "json", "pdf"]},
               tables=table("api", api)
               + table("metrics", {"listen": f"127.0.0.1:{free_port()}"}))
    d.control(mode="serve", delay_s=0)
    return d, f"http://127.0.0.1:{port}"


def wait_api(base: str, d: Daemon, timeout: float = 60) -> None:
    def up() -> bool:
        try:
            return httpx.get(f"{base}/v1/openapi.json", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, timeout, "the API answers", gone=lambda: None if d.alive() else d.tail())


def wait_final(base: str, job_id: int, token: str = ALICE, timeout: float = 90,
               d: Daemon | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def final() -> bool:
        out.update(httpx.get(f"{base}/v1/jobs/{job_id}", headers=auth(token), timeout=10).json())
        return out.get("state") in FINAL

    wait_until(final, timeout, f"job {job_id} final",
               context=lambda: json.dumps(out) + ("\n" + d.tail(20) if d else ""))
    return out


def verify(secret: str, header: str, body: bytes, tolerance: float = 300) -> bool:
    """A receiver's check of ``Chandrad-Signature``, written from its definition."""
    parts = dict(p.split("=", 1) for p in header.split(","))
    t = int(parts["t"])
    expected = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return abs(time.time() - t) < tolerance and hmac.compare_digest(expected, parts["v1"])


@dataclass
class Delivery:
    headers: dict[str, str]
    body: bytes
    status: int


@dataclass
class Receiver:
    """A webhook receiver: ``script`` is the statuses it answers in turn (then 200)."""

    script: list[int] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)
    server: http.server.ThreadingHTTPServer | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: Seconds each answer waits (a slow receiver: a delivery still in progress).
    delay_s: float = 0.0

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def accepted(self, job_id: int | None = None) -> list[Delivery]:
        with self.lock:
            return [x for x in self.deliveries if 200 <= x.status < 300
                    and (job_id is None or json.loads(x.body)["id"] == job_id)]

    def for_job(self, job_id: int) -> list[Delivery]:
        with self.lock:
            return [x for x in self.deliveries if json.loads(x.body)["id"] == job_id]

    def handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                time.sleep(receiver.delay_s)
                with receiver.lock:
                    status = receiver.script.pop(0) if receiver.script else 200
                    receiver.deliveries.append(Delivery(dict(self.headers), body, status))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


@contextmanager
def receiving(script: list[int] | None = None, port: int = 0,
              delay_s: float = 0.0) -> Iterator[Receiver]:
    receiver = Receiver(list(script or []), delay_s=delay_s)
    receiver.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), receiver.handler())
    thread = threading.Thread(target=receiver.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()


def upload(base: str, path: Path, token: str = ALICE, name: str | None = None,
           raw: bool = False, fields: dict[str, str] | None = None) -> httpx.Response:
    """POST ``path`` as a job: multipart (``file`` part), or a raw body with ?filename=;
    ``fields``: ``outputs``, ``callback_url``."""
    data = path.read_bytes()
    fields = fields or {}
    if raw:
        return httpx.post(f"{base}/v1/jobs", content=data, timeout=60, headers={
            **auth(token), "Content-Type": "application/octet-stream"},
            params={"filename": name or path.name, **fields})
    return httpx.post(f"{base}/v1/jobs", files={"file": (name or path.name, data)},
                      data=fields, headers=auth(token), timeout=60)


def poll(predicate: Callable[[], object], timeout: float, what: str) -> None:
    wait_until(predicate, timeout, what, every=0.1)
