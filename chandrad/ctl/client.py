"""The blocking control-socket client of ``chandractl``.

Owns finding the socket path, connecting (with the errors an operator can act on:
not running, permission denied), and one request/reply exchange with a timeout.
Stdlib only plus ``protocol`` and ``config``: it must start fast.
"""

from __future__ import annotations

import errno
import itertools
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from chandrad.errors import (
    ConfigError,
    ControlAccessDenied,
    ControlError,
    ControlErrorCode,
    ControlTransportError,
    DaemonNotRunning,
    ProtocolError,
)
from chandrad.protocol import MAX_LINE_BYTES, decode_reply, encode_request

DEFAULT_SOCKET = Path("/run/chandrad/control.sock")
DEFAULT_CONFIG = Path("/etc/chandrad/chandrad.toml")  # as config.DEFAULT_CONFIG_PATH
START_HINT = (
    "is chandrad running? start it with `systemctl start chandrad` "
    "or `chandrad run --config ...`"
)


def resolve_socket(option: str | None, environ: Mapping[str, str] = os.environ) -> Path:
    """The socket to talk to.

    ``--socket``, else ``$CHANDRAD_SOCKET``, else ``$RUNTIME_DIRECTORY/control.sock``
    (set when systemd runs us, e.g. as ``ExecReload=``), else the config's
    ``control.socket`` when the config is readable, else ``/run/chandrad/control.sock``.
    """
    if option:
        return Path(option)
    if environ.get("CHANDRAD_SOCKET"):
        return Path(environ["CHANDRAD_SOCKET"])
    if environ.get("RUNTIME_DIRECTORY"):
        return Path(environ["RUNTIME_DIRECTORY"].split(":")[0]) / "control.sock"
    config = Path(environ.get("CHANDRAD_CONFIG") or DEFAULT_CONFIG)
    if os.access(config, os.R_OK):
        from chandrad.config import load_config  # only here: it costs a third of start-up

        try:
            return load_config(config).control.socket
        except ConfigError:
            pass  # a broken config is the daemon's problem; try the default
    return DEFAULT_SOCKET


class ControlClient:
    """One connection to the daemon; ``request()`` may be called repeatedly."""

    _ids = itertools.count(1)

    def __init__(self, path: Path, timeout: float | None = 30.0) -> None:
        self.path = Path(path)
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._buffer = b""

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self) -> None:
        """Raises: DaemonNotRunning, ControlAccessDenied, ControlTransportError."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        limit = min(self.timeout or 5.0, 5.0)
        sock.settimeout(limit)
        try:
            _connect(sock, self.path, time.monotonic() + limit)
        except OSError as exc:
            sock.close()
            if exc.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTDIR):
                raise DaemonNotRunning(
                    f"cannot connect to {self.path}: {exc.strerror}; {START_HINT}"
                ) from exc
            if exc.errno in (errno.EACCES, errno.EPERM):
                raise ControlAccessDenied(
                    f"permission denied on {self.path}: {_access_hint(self.path)}"
                ) from exc
            raise ControlTransportError(f"cannot connect to {self.path}: {exc}") from exc
        sock.settimeout(self.timeout)
        self._sock = sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def request(self, cmd: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send one command and return its ``result`` object.

        Raises:
            ControlError: the daemon refused (``code`` from ``CONTROL_ERROR_CODES``).
            DaemonNotRunning, ControlAccessDenied, ControlTransportError.
        """
        if self._sock is None:
            self.connect()
        assert self._sock is not None
        rid = next(self._ids)
        try:
            self._sock.sendall(encode_request(cmd, args, rid))
            line = self._read_line()
        except TimeoutError as exc:
            raise ControlTransportError(
                f"no reply to {cmd!r} from {self.path} within {self.timeout:g} s"
            ) from exc
        except OSError as exc:
            raise ControlTransportError(f"connection to {self.path} failed: {exc}") from exc
        try:
            reply = decode_reply(line)
        except ProtocolError as exc:
            raise ControlTransportError(f"unreadable reply from daemon: {exc.message}") from exc
        if not reply.ok:
            raise ControlError(reply.error_code or ControlErrorCode.INTERNAL_ERROR,
                               reply.error_message)
        return reply.result

    def _read_line(self) -> bytes:
        assert self._sock is not None
        while b"\n" not in self._buffer:
            if len(self._buffer) > MAX_LINE_BYTES:
                raise ControlTransportError(f"reply exceeds {MAX_LINE_BYTES} bytes")
            chunk = self._sock.recv(65536)
            if not chunk:
                raise ControlTransportError(
                    f"the daemon closed the connection on {self.path} without a reply"
                )
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line


def _connect(sock: socket.socket, path: Path, deadline: float) -> None:
    """connect(), waiting while the daemon's listen backlog is full.

    A Unix socket answers a full backlog with EAGAIN at once (a socket with a timeout
    is non-blocking underneath); the daemon drains its backlog quickly, so try again.
    """
    delay = 0.005
    while True:
        try:
            sock.connect(str(path))
            return
        except BlockingIOError:
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.1)


def _access_hint(path: Path) -> str:
    try:
        import grp

        group = grp.getgrgid(os.stat(path).st_gid).gr_name
    except (OSError, KeyError):
        return "run as root or as a member of the socket's group"
    return f"run as root or add your user to group {group!r} (then log in again)"


def call(path: Path, cmd: str, args: dict[str, Any] | None = None,
         timeout: float | None = 30.0) -> dict[str, Any]:
    """Connect, send one command, return its result, close."""
    with ControlClient(path, timeout) as client:
        return client.request(cmd, args)
