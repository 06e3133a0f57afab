"""A start-up that fails part-way stops what it had started, in order, and exits with the
failure's mapped code.

The real daemon (``tests/daemon_harness.py``, the stand-in engine) with a failure caused
from outside: the HTTP API's port held by another socket (the control socket is bound by
then, the metrics listener too), or a regular file where the control socket goes. Each
daemon exits 78 without reaching ``running``; its log says the start failed, then the
shutdown's ``daemon_stopped`` with the same exit code; the control socket it bound is gone,
the store was closed (no WAL left beside it) and no process of it is left.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from api_harness import api_daemon
from daemon_harness import table
from faults.faultkit import Daemon, free_port, standin_engine

from chandrad.errors import ExitCode


@pytest.fixture
def held_port() -> Iterator[socket.socket]:
    """A TCP port on 127.0.0.1 another process listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock


def events(d: Daemon) -> list[dict[str, Any]]:
    """The daemon's JSON log lines, in order."""
    out = []
    for line in d.log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def run_to_exit(d: Daemon) -> int:
    d.start()
    assert d.proc is not None
    try:
        return d.proc.wait(60)
    finally:
        d.cleanup()


def assert_stopped_in_order(d: Daemon, code: str, says: str) -> list[str]:
    """The log says the start failed (``code``), then the shutdown ran and said 78, then
    the entry point's one plain line names ``says`` (the event does not repeat it); no
    process is left, the store was closed. The event names, in order."""
    logged = events(d)
    names = [e.get("event") for e in logged]
    assert "daemon_started" not in names, d.tail()
    failed = next((e for e in logged if e.get("event") == "startup_failed"), None)
    assert failed is not None and failed["code"] == code and "error" not in failed, d.tail()
    plain = [line for line in d.log_path.read_text(errors="replace").splitlines()
             if says in line]
    assert len(plain) == 1 and not plain[0].startswith("{"), d.tail()
    stopped = [e for e in logged if e.get("event") == "daemon_stopped"]
    assert len(stopped) == 1 and stopped[0]["exit_code"] == ExitCode.CONFIG, d.tail()
    assert names.index("startup_failed") < names.index("daemon_stopped")
    assert not d.leftovers()
    # Closed: SQLite checkpoints and removes the WAL when the last connection closes.
    assert d.db_path.exists() and not d.db_path.with_name(d.db_path.name + "-wal").exists()
    return [str(n) for n in names]


def test_api_port_taken_stops_the_control_socket_and_the_store(
        tmp_path: Path, held_port: socket.socket) -> None:
    """The API's bind fails after the control socket and /metrics are listening: both
    are closed again (the socket node removed) and the store closed before exit 78."""
    d, _ = api_daemon(tmp_path)
    host, port = held_port.getsockname()
    d.config.write_text(re.sub(r'listen = "127\.0\.0\.1:\d+"', f'listen = "{host}:{port}"',
                               d.config.read_text(), count=1))  # [api]'s, before [metrics]
    assert f'listen = "{host}:{port}"' in d.config.read_text()
    assert run_to_exit(d) == ExitCode.CONFIG, d.tail()
    names = assert_stopped_in_order(d, "config_invalid", "api.listen")
    assert names.index("control_listening") < names.index("startup_failed")
    assert not d.socket.exists(), "the control socket the failed start bound is left behind"


def test_control_socket_path_taken_by_a_file_exits_78_after_the_shutdown(
        tmp_path: Path) -> None:
    """A regular file where the control socket goes: the store (opened before) is closed
    by the shutdown, and the operator's file is left as it was."""
    d = Daemon(tmp_path, standin_engine(tmp_path, port=free_port(), stop_timeout=3),
               tables=table("metrics", {"listen": f"127.0.0.1:{free_port()}"}))
    d.socket.write_text("an operator's file\n")
    assert run_to_exit(d) == ExitCode.CONFIG, d.tail()
    assert_stopped_in_order(d, "control_socket_error", "not a socket")
    assert d.socket.read_text() == "an operator's file\n"
