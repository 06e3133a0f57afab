"""The control server on a real Unix socket: node set-up, framing errors, concurrency.

The daemon behind it is ``control_harness.RecordingDaemon`` (the DaemonControl
boundary); everything from the socket to the handlers is the real code.
Permission tiers with a second uid are in ``test_ctl.py`` (they need real users).
"""

from __future__ import annotations

import asyncio
import grp
import json
import os
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from control_harness import RecordingDaemon, ServerThread
from waiting import wait_until

from chandrad.control.handlers import Handlers
from chandrad.control.server import ControlServer
from chandrad.errors import ControlSocketError, ControlSocketInUse
from chandrad.protocol import MAX_LINE_BYTES, encode_request


def connect(path: Path, timeout: float = 5.0) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        raise
    return sock


def read_reply(sock: socket.socket) -> dict[str, Any]:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            raise EOFError(f"closed after {data!r}")
        data += chunk
    reply: dict[str, Any] = json.loads(data)
    return reply


def ask(sock: socket.socket, cmd: str, args: dict[str, Any] | None = None,
        rid: int = 1) -> dict[str, Any]:
    sock.sendall(encode_request(cmd, args, id=rid))
    return read_reply(sock)


def at_eof(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    with ServerThread(tmp_path / "control.sock", read_timeout=2.0) as st:
        yield st


def test_socket_node_has_configured_mode_and_group(tmp_path: Path) -> None:
    """The node gets the configured mode and group, never wider at any time we can see."""
    group = grp.getgrnam("daemon") if os.geteuid() == 0 else grp.getgrgid(os.getgid())
    path = tmp_path / "run" / "control.sock"
    with ServerThread(path, mode=0o640, group=group.gr_name):
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o640
        assert st.st_gid == group.gr_gid
    assert not path.exists(), "close() removes the node"


def test_default_mode_is_0660(tmp_path: Path) -> None:
    """Without a mode the socket is 0660."""
    path = tmp_path / "control.sock"
    with ServerThread(path):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660


def test_unknown_group_is_a_clear_error(tmp_path: Path) -> None:
    """A control.group that does not exist fails start() with a typed error naming it."""
    with pytest.raises(ControlSocketError, match="no-such-group-xyz"):
        ServerThread(tmp_path / "c.sock", group="no-such-group-xyz").start()


def test_stale_socket_is_replaced(tmp_path: Path) -> None:
    """A socket left by a crashed daemon (nobody listening) is unlinked and rebound."""
    path = tmp_path / "control.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # the node stays, as after kill -9
    with pytest.raises(ConnectionRefusedError):
        connect(path)
    with ServerThread(path) as st, connect(path) as sock:
        assert ask(sock, "status")["ok"] is True
        assert st.daemon.calls == [("status", {})]


def test_live_socket_is_not_stolen(tmp_path: Path) -> None:
    """A second server on a path where a daemon answers refuses to start; the first serves on."""
    path = tmp_path / "control.sock"
    with ServerThread(path):
        with pytest.raises(ControlSocketInUse, match="already answering"):
            ServerThread(path).start()
        with connect(path) as sock:
            assert ask(sock, "version")["result"]["protocol"] == 1


def test_non_socket_at_path_is_left_alone(tmp_path: Path) -> None:
    """A regular file where the socket should be is refused, not deleted."""
    path = tmp_path / "control.sock"
    path.write_text("precious")
    with pytest.raises(ControlSocketError, match="not a socket"):
        ServerThread(path).start()
    assert path.read_text() == "precious"


def test_close_does_not_unlink_a_successors_socket(tmp_path: Path) -> None:
    """close() removes only the node it created, not one that replaced it."""
    path = tmp_path / "control.sock"
    first = ServerThread(path).start()
    path.unlink()
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(str(path))
    try:
        first.stop()
        assert path.exists()
    finally:
        other.close()


def test_malformed_line_is_answered_and_connection_stays_usable(server: ServerThread) -> None:
    """Garbage gets a bad_request reply; the same connection then serves a real request."""
    with connect(server.path) as sock:
        sock.sendall(b"this is not json\n")
        reply = read_reply(sock)
        assert reply["ok"] is False and reply["error"]["code"] == "bad_request"
        assert ask(sock, "status", rid=2)["result"]["daemon"]["state"] == "running"


@pytest.mark.parametrize("line", [
    b'{"v":1,"id":1,"cmd":"status","cmd":"drain"}\n',
    b'{"v":1,"id":NaN,"cmd":"status"}\n',
], ids=["cmd-twice", "id-nan"])
def test_ambiguous_request_reaches_no_command(server: ServerThread, line: bytes) -> None:
    """``{"cmd":"status","cmd":"drain"}`` used to drain the daemon (the last key won) while
    it reads as ``status``; an id of NaN was taken. Both are bad_request: no command
    runs, and the connection stays usable."""
    with connect(server.path) as sock:
        sock.sendall(line)
        reply = read_reply(sock)
        assert reply["ok"] is False and reply["error"]["code"] == "bad_request", reply
        assert ask(sock, "gpu", rid=2)["ok"] is True
    assert [c[0] for c in server.daemon.calls] == ["gpu"]
    assert server.daemon.state == "running"


def test_unknown_command_and_wrong_version(server: ServerThread) -> None:
    """Unknown command and wrong version get structured errors with the request's id."""
    with connect(server.path) as sock:
        reply = ask(sock, "self_destruct", rid=11)
        assert (reply["id"], reply["error"]["code"]) == (11, "unknown_command")
        sock.sendall(b'{"v": 2, "id": 12, "cmd": "status", "args": {}}\n')
        reply = read_reply(sock)
        assert (reply["v"], reply["id"], reply["error"]["code"]) == (
            1, 12, "unsupported_version")
        assert ask(sock, "gpu", rid=13)["ok"] is True
    assert [c[0] for c in server.daemon.calls] == ["gpu"]


def test_bad_arguments_are_rejected_before_the_daemon(server: ServerThread) -> None:
    """A bad argument is a bad_request and the daemon method is never called."""
    with connect(server.path) as sock:
        reply = ask(sock, "cancel", {"job": "seven"})
        assert reply["error"]["code"] == "bad_request"
        assert "job" in reply["error"]["message"]
        reply = ask(sock, "retry", {})
        assert reply["error"]["code"] == "bad_request"
    assert server.daemon.calls == []


def test_oversized_line_gets_too_large_then_clean_close(server: ServerThread) -> None:
    """A 2 MiB line is answered too_large (not a reset) and the server keeps serving others."""
    with connect(server.path) as sock:
        payload = b'{"v":1,"id":1,"cmd":"status","args":{"x":"' + b"a" * (2 << 20) + b'"}}\n'
        sender = threading.Thread(target=lambda: _send_ignoring_reset(sock, payload))
        sender.start()
        reply = read_reply(sock)
        sender.join(10)
        assert reply["error"]["code"] == "too_large"
        assert str(MAX_LINE_BYTES) in reply["error"]["message"]
        assert at_eof(sock)
    with connect(server.path) as sock:
        assert ask(sock, "status")["ok"] is True


def _send_ignoring_reset(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        pass


def test_slow_client_gets_timeout_and_is_closed(server: ServerThread) -> None:
    """A client that sends no newline within the read timeout gets ``timeout`` and EOF."""
    with connect(server.path) as sock:
        sock.sendall(b'{"v":1,"id":1,"cmd":"sta')
        started = time.monotonic()
        reply = read_reply(sock)
        assert reply["error"]["code"] == "timeout"
        assert 1.5 <= time.monotonic() - started < 5
        assert at_eof(sock)


def test_slow_handler_does_not_block_other_clients(server: ServerThread) -> None:
    """While one client waits on ``drain --wait``, others get status answers promptly."""
    waiter = connect(server.path, timeout=10)
    waiter.sendall(encode_request("drain", {"wait": True}, id=1))
    wait_until(lambda: ("drain", {"wait": True}) in server.daemon.calls, 5, "drain called",
               every=0.01)
    latencies = []
    for _ in range(5):
        with connect(server.path) as sock:
            started = time.monotonic()
            assert ask(sock, "status")["result"]["daemon"]["state"] == "draining"
            latencies.append(time.monotonic() - started)
    assert max(latencies) < 1.0
    server.release()
    assert read_reply(waiter)["result"]["state"] == "drained"
    waiter.close()


def test_daemon_errors_become_structured_replies(server: ServerThread) -> None:
    """ControlError from the daemon keeps its code; an unexpected exception is internal_error."""
    server.daemon.crash_on.add("rescan")
    with connect(server.path) as sock:
        assert ask(sock, "cancel", {"job": 404})["error"] == {
            "code": "not_found", "message": "no job 404"}
        assert ask(sock, "resume")["error"]["code"] == "invalid_state"
        reply = ask(sock, "rescan")
        assert reply["error"]["code"] == "internal_error"
        assert "rescan blew up" in reply["error"]["message"]
        assert ask(sock, "pause")["result"] == {
            "v": 1, "state": "paused", "message": "paused: in-flight pages will finish"}


def test_several_requests_on_one_connection_in_order(server: ServerThread) -> None:
    """Pipelined requests on one connection are answered in order with their ids."""
    with connect(server.path) as sock:
        sock.sendall(b"".join(encode_request(c, id=i) for i, c in
                              enumerate(["status", "gpu", "version"], start=1)))
        lines = sock.makefile("rb")
        ids = [json.loads(lines.readline())["id"] for _ in range(3)]
    assert ids == [1, 2, 3]


def test_handlers_wrap_queue_and_version() -> None:
    """Handlers return versioned dicts: queue wraps the job list, version adds the protocol."""
    daemon = RecordingDaemon()
    handlers = Handlers(daemon)

    async def run() -> tuple[dict[str, Any], dict[str, Any]]:
        return (await handlers.dispatch("queue", {"state": "failed"}),
                await handlers.dispatch("version", {}))

    queue, version = asyncio.run(run())
    assert queue["v"] == 1 and [j["id"] for j in queue["jobs"]] == [2]
    assert version == {"v": 1, "daemon": "0.1.0", "vllm": "0.32.0", "model": "tiny-idefics3",
                       "protocol": 1}


def test_close_ends_open_connections(tmp_path: Path) -> None:
    """close() with a client blocked in drain --wait answers it (the daemon stops), ends
    that connection and returns."""
    path = tmp_path / "control.sock"
    st = ServerThread(path, RecordingDaemon()).start()
    waiter = connect(path)
    waiter.sendall(encode_request("drain", {"wait": True}, id=9))
    time.sleep(0.2)
    started = time.monotonic()
    st.stop()
    assert time.monotonic() - started < 5
    reply = read_reply(waiter)
    assert (reply["id"], reply["ok"], reply["error"]["code"]) == (9, False, "invalid_state")
    assert "stopping" in reply["error"]["message"]
    assert at_eof(waiter)
    waiter.close()
    assert not path.exists()


def test_owner_uid_argument_defaults_to_current_uid() -> None:
    """The daemon's own uid gets the write tier by default (the API of the brief)."""
    server = ControlServer(Path("/nonexistent/x.sock"), Handlers(RecordingDaemon()))
    assert server.owner_uid == os.getuid()


@pytest.mark.parametrize("line", [
    b'{"v": 1, "id": 1, "cmd": "cancel", "args": {"job": ' + b"9" * 5000 + b"}}\n",
    b'{"v": 1, "id": 1, "cmd": "cancel", "args": {"job": ' + b"9" * 30 + b"}}\n",
    b'{"v": 1, "id": 1, "cmd": "queue", "args": {"limit": -' + b"9" * 20 + b"}}\n",
    b'{"v": 1, "id": 1, "cmd": "status", "args": {"x": ' + b"[" * 200_000
    + b"]" * 200_000 + b"}}\n",
    b"[" * 200_000 + b"]" * 200_000 + b"\n",
], ids=["int-5000-digits", "int-beyond-int64", "negative-beyond-int64", "deep-args",
        "deep-frame"])
def test_huge_numbers_and_deep_nesting_are_bad_requests(server: ServerThread,
                                                        line: bytes) -> None:
    """Numbers Python cannot parse or SQLite cannot hold, and JSON nested deeper than the
    parser's recursion limit, are the client's mistake (bad_request), never an
    internal_error; the daemon is not called and the connection stays usable."""
    with connect(server.path) as sock:
        sock.sendall(line)
        reply = read_reply(sock)
        assert reply["ok"] is False
        assert reply["error"]["code"] == "bad_request", reply
        assert ask(sock, "gpu", rid=2)["ok"] is True
    assert [c[0] for c in server.daemon.calls] == ["gpu"]
