"""The control socket: an asyncio Unix stream server (docs/operations.md, Control protocol).

Owns the socket node (safe replacement of a stale one, mode and group), the peer
check per connection (``SO_PEERCRED``), framing limits (line size, read timeout) and
the error replies for bad frames. Commands run through ``control.handlers``.

Access tiers, decided per connection from the peer's credentials:

* ``write`` (every command): uid 0 and the daemon's own uid;
* ``read`` (``status``, ``queue``, ``gpu``, ``version``): members of the socket's group
  (the configured ``control.group``, else the daemon's primary group), by the peer's
  primary gid or one of its supplementary gids — the groups the peer process holds
  (``SO_PEERGROUPS``), as the kernel saw them at ``connect()``, the same set that let it
  open the 0660 node; so ``SupplementaryGroups=`` of a client's unit counts. Only on a
  kernel without ``SO_PEERGROUPS`` (< 4.13) is the group database asked instead;
* nobody else may do anything, not even read: their requests are answered
  ``forbidden``. (With the default mode 0660 such users cannot even connect.)

Each connection is its own task and handles its requests in order, so a handler that
waits (``drain --wait``, ``reload --wait``) only holds up its own client.

Limits, so that no client can take the socket (or the daemon's memory or descriptors)
from the others; each refusal is answered with a reason, then the connection closes:

* a request line longer than ``MAX_LINE_BYTES`` (1 MiB) → ``too_large``; the rest of it
  is read off (at most 64 MiB, 2 s) so the client sees the reply, not a reset;
* no complete request line within ``read_timeout`` (30 s) of the last reply → ``timeout``;
* replies a client does not read: a connection reads its next request only once its
  reply is wholly in the kernel's socket buffer, so it holds at most one reply (≤ 1 MiB)
  in the daemon; it is aborted when it has not taken that reply within ``read_timeout``,
  or when the replies waiting on all such slow readers together pass
  ``max_pending_bytes`` (8 MiB; the one waiting longest goes first);
* at most ``max_per_peer`` (16) connections per client process (peer pid) and
  ``max_connections`` (64) in all. A process at its share is answered ``busy``. At the
  global limit a newcomer makes room by closing a connection that waits on its client,
  among those of the process holding the most (any if that process has none): one
  blocked on a reply its client does not read first (aborted: a ``busy`` line could not
  reach it past the unread reply), else the one that has waited longest for a request
  line (closed with ``busy``); with none waiting (all inside a command) the newcomer is
  answered ``busy``. So a process that floods the socket, leaves connections silent or
  never reads, only ever uses its own share while other clients are served.
  Refusals and evictions are logged as one ``control_connection_limit`` warning, with
  the counts since the previous one, at most every 10 s; never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import grp
import os
import pwd
import socket
import stat
import struct
import time
from collections import Counter
from pathlib import Path
from typing import Literal

import structlog

from chandrad.errors import (
    ChandradError,
    ControlError,
    ControlErrorCode,
    ControlSocketError,
    ControlSocketInUse,
    ProtocolError,
)
from chandrad.events import Event
from chandrad.protocol import (
    COMMANDS,
    MAX_LINE_BYTES,
    RequestId,
    decode_request,
    encode_error,
    encode_result,
)

from .handlers import Handlers

log = structlog.get_logger("chandrad.control")

Access = Literal["write", "read", "none"]

#: Seconds a client may take to send a complete line (or to send nothing at all), and
#: to take a reply off the socket.
DEFAULT_READ_TIMEOUT = 30.0
#: Connections open at once (the daemon also needs descriptors for the engine, the store
#: and the render pool; a handful of operators and monitors need far fewer than this).
DEFAULT_MAX_CONNECTIONS = 64
#: Connections one client process (peer pid) may hold open at once.
DEFAULT_MAX_PER_PEER = 16
#: Pending connections the kernel queues (a burst of clients waits there instead of
#: getting EAGAIN; asyncio also accepts up to this many per turn of the loop).
LISTEN_BACKLOG = 128
#: At most one ``control_connection_limit`` warning per this many seconds.
LIMIT_LOG_INTERVAL = 10.0
#: Reply bytes the daemon holds, over all connections, for clients that do not take them.
DEFAULT_MAX_PENDING_BYTES = 8 << 20
#: Seconds an evicted idle connection has to take its ``busy`` line before it is aborted.
EVICT_GRACE_S = 1.0


class _Connection:
    """One open connection and what it waits for.

    ``idle_since``: since when it waits for a request line; ``writing_since``: since when
    it waits for its client to take a reply off the socket. Both None inside a command.
    """

    __slots__ = ("idle_since", "pid", "task", "writer", "writing_since")

    def __init__(self, task: asyncio.Task[None], writer: asyncio.StreamWriter, pid: int) -> None:
        self.task = task
        self.writer = writer
        self.pid = pid
        self.idle_since: float | None = time.monotonic()
        self.writing_since: float | None = None

    def pending_bytes(self) -> int:
        """Reply bytes written but not yet taken by the kernel (0 unless writing)."""
        if self.writing_since is None:
            return 0
        return self.writer.transport.get_write_buffer_size()


def _peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the connected peer (Linux ``SO_PEERCRED``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


#: Linux ``SO_PEERGROUPS`` (asm-generic/socket.h); Python does not define the constant.
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
#: Linux ``NGROUPS_MAX``: the most supplementary groups a process can hold.
_NGROUPS_MAX = 65536
#: ``socket.getsockopt`` refuses buffers over 1024 bytes (256 gids).
_SMALL_GROUPS = 256


def _peer_groups(sock: socket.socket) -> tuple[int, ...] | None:
    """The connected peer's supplementary gids, or None where the kernel cannot say."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * _SMALL_GROUPS)
    except OSError as exc:
        if exc.errno == errno.ERANGE:
            return _peer_groups_large(sock)
        if exc.errno in (errno.ENOPROTOOPT, errno.EINVAL):
            return None
        raise
    return struct.unpack(f"={len(raw) // 4}I", raw[: len(raw) // 4 * 4])


def _peer_groups_large(sock: socket.socket) -> tuple[int, ...] | None:
    """``SO_PEERGROUPS`` for a peer with more than 256 groups, through libc directly."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = (ctypes.c_uint32 * _NGROUPS_MAX)()
    size = ctypes.c_uint32(ctypes.sizeof(buf))
    if libc.getsockopt(sock.fileno(), socket.SOL_SOCKET, SO_PEERGROUPS, buf,
                       ctypes.byref(size)) != 0:
        return None
    return tuple(buf[: size.value // 4])


def _in_group(uid: int, gid: int, groups: tuple[int, ...] | None, group_gid: int) -> bool:
    """Whether a peer with ``uid``, primary ``gid`` and supplementary ``groups`` is a member.

    ``groups`` None (no ``SO_PEERGROUPS``): fall back to the group database for ``uid``.
    """
    if gid == group_gid:
        return True
    if groups is not None:
        return group_gid in groups
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return False
    return group_gid in os.getgrouplist(entry.pw_name, entry.pw_gid)


def _resolve_group(group: str) -> int:
    if not group:
        return os.getgid()
    try:
        return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError as exc:
        raise ControlSocketError(
            f"control.group {group!r} does not exist; create it (see systemd/chandrad.sysusers) "
            "or set control.group to an existing group"
        ) from exc


def _check_stale(path: Path) -> None:
    """Remove a dead socket left at ``path``; refuse a live one or a non-socket.

    Raises:
        ControlSocketInUse: a daemon answers on ``path``.
        ControlSocketError: ``path`` is something other than a socket, or is unusable.
    """
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ControlSocketError(
            f"{path} exists and is not a socket; refusing to replace it (move it away)"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        # Nobody listens: a daemon died without unlinking its socket.
        log.info("control_socket_stale", path=str(path))
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno == errno.EAGAIN:  # backlog full: someone is alive
            raise ControlSocketInUse(f"{path}: a daemon is already listening there") from exc
        raise ControlSocketError(f"cannot probe existing socket {path}: {exc}") from exc
    finally:
        probe.close()
    raise ControlSocketInUse(
        f"another chandrad is already answering on {path}; stop it first "
        "(chandractl --socket ... status shows it) or choose another control.socket"
    )


def _request_id(line: bytes) -> RequestId:
    """The id of a request line, where it can be read (for a late error reply)."""
    try:
        return decode_request(line).id
    except ProtocolError as exc:
        return exc.request_id


async def _close(writer: asyncio.StreamWriter) -> None:
    """Close after flushing what is buffered; abort if the peer takes none of it for 5 s."""
    writer.close()
    try:
        async with asyncio.timeout(5.0):
            await writer.wait_closed()
    except TimeoutError:
        writer.transport.abort()
    except Exception:  # the peer reset: closed anyway
        pass


class ControlServer:
    """The Unix socket server. ``start()`` binds and listens; ``close()`` unlinks."""

    def __init__(
        self,
        path: Path,
        handlers: Handlers,
        *,
        mode: int = 0o660,
        group: str = "",
        owner_uid: int = os.getuid(),
        read_timeout: float = DEFAULT_READ_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_per_peer: int = DEFAULT_MAX_PER_PEER,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
    ) -> None:
        self.path = Path(path)
        self.handlers = handlers
        self.mode = mode
        self.group = group
        self.owner_uid = owner_uid
        self.read_timeout = read_timeout
        self._group_gid = -1
        self._server: asyncio.AbstractServer | None = None
        self._inode: tuple[int, int] | None = None
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self.max_pending_bytes = max_pending_bytes
        self._connections: dict[asyncio.Task[None], _Connection] = {}
        self._evicted = 0
        self._evicted_not_reading = 0
        self._refused = 0
        self._limit_logged_at = -LIMIT_LOG_INTERVAL

    async def start(self) -> None:
        """Create the socket node and start serving.

        Raises:
            ControlSocketInUse: a live daemon already answers on the path.
            ControlSocketError: bad group, path or permissions.
        """
        gid = _resolve_group(self.group)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ControlSocketError(f"cannot create {self.path.parent}: {exc}") from exc
        _check_stale(self.path)
        sock = self._bind(gid)
        self._group_gid = os.stat(self.path).st_gid
        self._server = await asyncio.start_unix_server(
            self._on_connect, sock=sock, limit=MAX_LINE_BYTES + 1, backlog=LISTEN_BACKLOG
        )
        log.info("control_listening", path=str(self.path), mode=oct(self.mode), gid=gid)

    def _bind(self, gid: int) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # The node is created as 0777 & ~umask: make it owner-only during bind, so
        # there is no moment where it is wider than the configured mode. The umask is
        # process-wide; this only ever narrows what another thread creates meanwhile.
        old_umask = os.umask(0o177)
        try:
            sock.bind(str(self.path))
        except OSError as exc:
            sock.close()
            raise ControlSocketError(f"cannot bind control socket {self.path}: {exc}") from exc
        finally:
            os.umask(old_umask)
        try:
            if os.stat(self.path).st_gid != gid:
                os.chown(self.path, -1, gid)
            os.chmod(self.path, self.mode)
            sock.listen(LISTEN_BACKLOG)
        except OSError as exc:
            sock.close()
            with contextlib.suppress(OSError):
                self.path.unlink()
            raise ControlSocketError(
                f"cannot set group/mode of {self.path}: {exc} (is the daemon user in "
                f"group {self.group!r}?)"
            ) from exc
        sock.setblocking(False)
        st = os.stat(self.path)
        self._inode = (st.st_dev, st.st_ino)
        return sock

    async def close(self) -> None:
        """Stop listening, end open connections and remove our socket node."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        # Unlink only our own node: a successor may already have replaced it.
        with contextlib.suppress(OSError):
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._inode:
                self.path.unlink()
        self._inode = None

    def _access(self, uid: int, gid: int, groups: tuple[int, ...] | None) -> Access:
        if uid == 0 or uid == self.owner_uid:
            return "write"
        if _in_group(uid, gid, groups, self._group_gid):
            return "read"
        return "none"

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        try:
            sock = writer.get_extra_info("socket")
            pid, uid, gid = _peer_credentials(sock)
            access = self._access(uid, gid, _peer_groups(sock))
        except OSError:
            await _close(writer)  # the peer is already gone
            return
        if not self._make_room(pid):
            self._refused += 1
            self._log_limit()
            writer.write(encode_error(None, ControlErrorCode.BUSY,
            self._busy_message("all are busy")))
            await _close(writer)
            return
        # drain() returns only once a reply is wholly in the kernel's buffer: a connection
        # holds at most the rest of one reply here, and "waiting on its client" is exact.
        writer.transport.set_write_buffer_limits(high=0)
        conn = self._connections[task] = _Connection(task, writer, pid)
        try:
            await self._serve(reader, writer, conn, pid, uid, access)
        except ConnectionError:
            pass  # the client went away, or was evicted (the transport aborted)
        except asyncio.CancelledError:
            # close(): the daemon stops. End normally: asyncio (3.11) logs a traceback
            # at ERROR for every client task that ends cancelled.
            task.uncancel()
        except Exception:
            log.exception("control_connection_error")
        finally:
            self._connections.pop(task, None)
            await _close(writer)

    def _make_room(self, pid: int) -> bool:
        """Whether a new connection of ``pid`` fits, closing a waiting one if needed."""
        conns = list(self._connections.values())
        if sum(1 for c in conns if c.pid == pid) >= self.max_per_peer:
            return False  # that process already has its share: it gets busy, others don't
        if len(conns) < self.max_connections:
            return True
        per_pid = Counter(c.pid for c in conns)
        heaviest = max(per_pid, key=lambda p: per_pid[p])
        return self._evict([c for c in conns if c.pid == heaviest]) or self._evict(conns)

    def _evict(self, candidates: list[_Connection]) -> bool:
        """Close a candidate that waits on its client; False if none does.

        One blocked on an unread reply goes first (the longest blocked), else the one
        that has waited longest for a request line. The transport is closed, not the
        task cancelled: the task sees EOF or a reset and ends as for any lost client.
        """
        writing = [c for c in candidates if c.writing_since is not None]
        if writing:
            self._abort_not_reading(min(writing, key=lambda c: c.writing_since or 0.0))
            return True
        idle = [c for c in candidates if c.idle_since is not None]
        if not idle:
            return False
        victim = min(idle, key=lambda c: c.idle_since or 0.0)
        del self._connections[victim.task]
        self._evicted += 1
        self._log_limit()
        transport = victim.writer.transport
        with contextlib.suppress(Exception):
            victim.writer.write(encode_error(
                None, ControlErrorCode.BUSY, self._busy_message("closing the one idle longest")))
            transport.close()  # the busy line is flushed before the close...
        # ...unless the client does not take even that.
        asyncio.get_running_loop().call_later(EVICT_GRACE_S, transport.abort)
        return True

    def _abort_not_reading(self, victim: _Connection) -> None:
        """Drop a connection blocked on a reply its client does not read (and the reply)."""
        self._connections.pop(victim.task, None)
        self._evicted_not_reading += 1
        self._log_limit()
        victim.writer.transport.abort()

    def _bound_pending(self) -> None:
        """Abort the longest-blocked slow readers while their replies pass the budget."""
        waiting = sorted((c for c in self._connections.values() if c.writing_since is not None),
                         key=lambda c: c.writing_since or 0.0)
        pending = sum(c.pending_bytes() for c in waiting)
        for victim in waiting:
            if pending <= self.max_pending_bytes:
                return
            pending -= victim.pending_bytes()
            self._abort_not_reading(victim)

    def _busy_message(self, what: str) -> str:
        return (f"too many control connections (at most {self.max_per_peer} per process, "
                f"{self.max_connections} in all); {what}")

    def _log_limit(self) -> None:
        now = time.monotonic()
        if now - self._limit_logged_at < LIMIT_LOG_INTERVAL:
            return
        self._limit_logged_at = now
        log.warning("control_connection_limit", open=len(self._connections),
                    limit=self.max_connections, per_process=self.max_per_peer,
                    evicted_idle=self._evicted,
                    evicted_not_reading=self._evicted_not_reading,
                    refused=self._refused)
        self._evicted = self._evicted_not_reading = self._refused = 0

    async def _serve(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        conn: _Connection,
        pid: int,
        uid: int,
        access: Access,
    ) -> None:
        """Answer requests on one connection until EOF or a fatal framing error."""
        while True:
            conn.idle_since = time.monotonic()
            try:
                # asyncio.timeout, not wait_for: no extra task, so one loop turn less
                # per request when the loop is busy.
                async with asyncio.timeout(self.read_timeout):
                    line = await reader.readuntil(b"\n")
            except asyncio.IncompleteReadError:
                return  # EOF, with or without a partial line
            except asyncio.LimitOverrunError:
                conn.idle_since = None
                writer.write(encode_error(
                    None, ControlErrorCode.TOO_LARGE,
                    f"request line exceeds {MAX_LINE_BYTES} bytes"))
                await self._flush(conn)
                await self._discard(reader, writer)
                return
            except TimeoutError:
                conn.idle_since = None
                writer.write(encode_error(
                    None, ControlErrorCode.TIMEOUT,
                    f"no complete request line within {self.read_timeout:g} s"))
                await self._flush(conn)
                return
            conn.idle_since = None
            try:
                reply = await self._answer(line, pid, uid, access)
            except asyncio.CancelledError:
                # The daemon stops (close()) while this command waits (drain --wait,
                # reload --wait): answer it, never leave the client with a closed socket.
                with contextlib.suppress(Exception):
                    writer.write(encode_error(
                        _request_id(line), ControlErrorCode.INVALID_STATE,
                        "daemon is stopping: the command was cut short"))
                raise
            writer.write(reply)
            del reply  # the transport holds what the client has not taken yet, once
            await self._flush(conn)

    async def _answer(self, line: bytes, pid: int, uid: int, access: Access) -> bytes:
        rid: RequestId = None
        try:
            request = decode_request(line)
            rid = request.id
            tier = COMMANDS[request.cmd].tier
            if access == "none" or (tier == "write" and access != "write"):
                log.warning("control_forbidden", cmd=request.cmd, peer_uid=uid, peer_pid=pid)
                need = ("root or the daemon's user" if tier == "write"
                        else "membership in the control socket's group")
                raise ProtocolError(ControlErrorCode.FORBIDDEN,
                                    f"{request.cmd} needs {need} (uid {uid})", rid)
            if tier == "write":
                log.info(Event.CONTROL_REQUEST, cmd=request.cmd, args=request.args,
                         peer_uid=uid, peer_pid=pid)
            result = await self.handlers.dispatch(request.cmd, request.args)
            return encode_result(rid, result)
        except ProtocolError as exc:
            return encode_error(exc.request_id if exc.request_id is not None else rid,
                                exc.error_code, exc.message)
        except ControlError as exc:
            return encode_error(rid, exc.error_code, exc.message)
        except ChandradError as exc:
            return encode_error(rid, ControlErrorCode.INTERNAL_ERROR, f"{exc.code}: {exc.message}")
        except Exception as exc:
            log.exception("control_handler_error", peer_uid=uid)
            return encode_error(rid, ControlErrorCode.INTERNAL_ERROR,
            f"{type(exc).__name__}: {exc}")

    @staticmethod
    async def _discard(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read off what the client still sends before closing.

        Closing with unread bytes in the kernel buffer makes Linux send RST, and the
        client would see ECONNRESET instead of our error reply.
        """
        with contextlib.suppress(OSError, RuntimeError):
            writer.write_eof()
        budget = 64 * MAX_LINE_BYTES
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(2.0):
                while budget > 0:
                    chunk = await reader.read(65536)
                    if not chunk:
                        return
                    budget -= len(chunk)

    async def _flush(self, conn: _Connection) -> None:
        """Wait until the kernel has all of the reply just written.

        A client that does not take it within read_timeout is dropped; so is the one
        blocked longest while the replies waiting on slow readers pass the budget.

        Raises:
            ConnectionError: the client went away, was dropped or was evicted.
        """
        writer = conn.writer
        if not writer.transport.get_write_buffer_size():
            return  # all of it in the kernel's buffer: the common case
        conn.writing_since = time.monotonic()
        self._bound_pending()
        try:
            async with asyncio.timeout(self.read_timeout):
                await writer.drain()
        except TimeoutError:
            # close() would wait for the unread replies to drain, for ever: abort.
            self._connections.pop(conn.task, None)
            writer.transport.abort()
            log.info("control_client_not_reading", timeout_s=self.read_timeout)
            raise ConnectionAbortedError("client does not read its replies") from None
        finally:
            conn.writing_since = None
