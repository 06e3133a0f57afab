"""A model repository served over the Hugging Face Hub's HTTP protocol, for huggingface_hub.

What ``snapshot_download`` asks (huggingface_hub 2.x, ``HF_ENDPOINT`` pointed here):
``GET /api/models/<repo>/revision/<rev>`` (the commit), ``GET /api/models/<repo>/tree/
<commit>`` (the files and sizes), then per file ``HEAD`` and ``GET /<repo>/resolve/<commit>/
<file>`` with ``X-Repo-Commit``/``ETag``, honouring ``Range`` (how a download resumes).
The hub is faked at this protocol boundary only; huggingface_hub is the real client.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class HubServer(ThreadingHTTPServer):
    """``repo`` → ``files``; ``delay`` seconds after each 64 KiB chunk (a slow link)."""

    daemon_threads = True

    def __init__(self, repo: str, files: dict[str, bytes], delay: float = 0.0) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.repo = repo
        self.files = files
        self.delay = delay
        self.requests: list[tuple[str, str, str | None]] = []
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        del format, args

    def _send(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self._handle()

    def do_GET(self) -> None:
        self._handle()

    def _handle(self) -> None:
        path = self.path.split("?", 1)[0]
        self.server.requests.append((self.command, path, self.headers.get("Range")))
        repo, files = self.server.repo, self.server.files
        if path.startswith(f"/api/models/{repo}/revision/"):
            info = {"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                    "siblings": [{"rfilename": name} for name in files]}
            self._send(200, json.dumps(info).encode())
            return
        if path.startswith(f"/api/models/{repo}/tree/"):
            tree = [{"type": "file", "path": name, "size": len(data),
                     "oid": hashlib.sha1(data).hexdigest()} for name, data in files.items()]
            self._send(200, json.dumps(tree).encode())
            return
        match = re.match(rf"^/{re.escape(repo)}/resolve/[^/]+/(.+)$", path)
        if match is None or match.group(1) not in files:
            self._send(404, b'{"error": "Repository not found"}',
                       {"X-Error-Code": "RepoNotFound"})
            return
        self._file(files[match.group(1)])

    def _file(self, data: bytes) -> None:
        wanted = self.headers.get("Range")
        start = int(re.match(r"bytes=(\d+)-", wanted).group(1)) if wanted else 0  # type: ignore[union-attr]
        part = data[start:]
        self.send_response(206 if wanted else 200)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
        self.send_header("Accept-Ranges", "bytes")
        if wanted:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(part)))
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        if self.command == "HEAD":
            return
        chunk = 64 * 1024
        try:
            for i in range(0, len(part), chunk):
                self.wfile.write(part[i:i + chunk])
                self.wfile.flush()
                if self.server.delay:
                    time.sleep(self.server.delay)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client was killed mid-file: what the resume test does
