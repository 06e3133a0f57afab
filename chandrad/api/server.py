"""The API's server: uvicorn inside the daemon's own event loop, and the webhook sender.

:meth:`ApiServer.start` reads the tokens and the webhook key (a problem is a config error
naming the key: exit 78), prepares the uploads' folder (``api.folder``, else
``<state_dir>/api/``) and binds ``api.listen`` (an
address this host cannot listen on is a config error too). uvicorn's ``Server.serve``
installs its own SIGINT/SIGTERM handlers with ``signal.signal``, which would take the
signals from the daemon's command queue; so the server is driven by its parts (``startup``,
``main_loop``, ``shutdown``) as ``serve`` drives them, without the signal capture.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from pathlib import Path

import structlog
import uvicorn

from chandrad.api.app import Api
from chandrad.api.door import JobDoor
from chandrad.api.tokens import load_secret, load_tokens
from chandrad.api.uploads import UploadDir
from chandrad.api.webhooks import WebhookSender
from chandrad.config import Config, key_line
from chandrad.errors import ConfigError, ConfigProblem
from chandrad.protocol import ApiStatus
from chandrad.store import StoreBackend

log = structlog.get_logger("chandrad.api")

#: On a shared store, an upload folder in the inbox that no open job holds is removed at
#: start only when older than this (another host renames and accepts in milliseconds).
SHARED_ORPHAN_AGE_S = 3600.0

#: Connections served at once; more are answered 503 by uvicorn.
MAX_CONNECTIONS = 64
#: Seconds an idle keep-alive connection is kept.
KEEP_ALIVE_S = 5
#: Largest request line plus headers h11 buffers (larger: the connection is refused).
MAX_HEADER_BYTES = 32 << 10


def listen_address(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


class ApiServer:
    """The HTTP job API of one daemon."""

    def __init__(self, config: Config, store: StoreBackend, door: JobDoor) -> None:
        self.config = config
        self.store = store
        self.door = door
        self.server: uvicorn.Server | None = None
        self.sender: WebhookSender | None = None
        self._socket: socket.socket | None = None
        self.address = ""

    async def start(self) -> None:
        """Check the secrets, prepare the folders, bind and start serving."""
        cfg = self.config
        watch = cfg.api_watch()
        assert watch is not None, "ApiServer started with [api] off"
        tokens = load_tokens(cfg)
        secret = load_secret(cfg)
        uploads = UploadDir(watch.input, self._tmp())
        for folder in (watch.output, watch.done, watch.failed):
            folder.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(uploads.prepare)
        # A shared inbox: another host may be between its rename and its accept now.
        older = time.time() - SHARED_ORPHAN_AGE_S if cfg.daemon.store_url else None
        for orphan in uploads.sweep(lambda path: self.store.find_active(path) is not None,
                                    older):
            log.warning("api_upload_orphan_removed", file=str(orphan),
                        reason="renamed into the inbox, never accepted (no 202 was sent)")
        self.sender = WebhookSender(self.store, secret, cfg.api.webhook_deadline)
        app = Api(cfg, self.store, self.door, tokens, secret, uploads).app()
        self._socket = self._bind()
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                limit_concurrency=MAX_CONNECTIONS,
                                timeout_keep_alive=KEEP_ALIVE_S,
                                h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                                server_header=False, timeout_graceful_shutdown=5)
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[self._socket])
        self.server = server
        host, port = self._socket.getsockname()[:2]
        self.address = f"{host}:{port}"
        log.info("api_listening", listen=self.address, tokens=len(tokens),
                 webhooks=secret is not None)

    def _tmp(self) -> Path:
        """Where uploads arrive: ``<state_dir>/api/tmp``, or ``<api.folder>/tmp/<host id>``
        (the inbox's filesystem, for the rename; each host clears only its own at start)."""
        cfg = self.config
        if cfg.api.folder is None:
            return cfg.daemon.state_dir / "api" / "tmp"
        return cfg.api.folder / "tmp" / (cfg.daemon.host_id or socket.gethostname())

    def _bind(self) -> socket.socket:
        host, port = listen_address(self.config.api.listen)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, kind, proto, _, address = infos[0]
            sock = socket.socket(family, kind, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(address)
                sock.listen(128)
                sock.setblocking(False)
            except OSError:
                sock.close()
                raise
            return sock
        except OSError as exc:
            try:
                line = key_line(self.config.path.read_text(encoding="utf-8"), "api.listen")
            except OSError:
                line = None
            raise ConfigError([ConfigProblem(
                "api.listen", f"cannot listen on {self.config.api.listen}: "
                f"{exc.strerror or exc}", str(self.config.path), line,
                "api_listen_failed")]) from None

    async def serve(self) -> None:
        """The supervised task: uvicorn's main loop, until :meth:`stop`."""
        assert self.server is not None
        await self.server.main_loop()

    async def deliver(self) -> None:
        """The supervised task of the webhook sender."""
        assert self.sender is not None
        await self.sender.run()

    async def stop(self) -> None:
        """Stop accepting connections, finish the requests in progress (uvicorn's own
        deadline), close the socket."""
        server = self.server
        if server is None:
            return
        self.server = None
        server.should_exit = True
        with contextlib.suppress(Exception):
            await server.shutdown(sockets=[self._socket] if self._socket else None)
        if self._socket is not None:
            self._socket.close()

    def webhook_counts(self) -> dict[str, int]:
        """The outbox's webhooks pending, delivered and given up (``/metrics``)."""
        return self.sender.table.outbox_counts() if self.sender else {}

    def status(self) -> ApiStatus:
        """``status``'s ``api``: where it listens, the webhooks' counts."""
        return {"listen": self.address or None,
                "webhooks": self.sender.status() if self.sender else None}
