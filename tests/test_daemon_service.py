"""The real daemon as systemd sees it: notify protocol, journal fields, exit codes,
permission tiers, and staying up with the engine fatal.

systemd cannot run as PID 1 here, so the tests bind the sockets systemd would
(``$NOTIFY_SOCKET``, the journal socket) and read what the real `chandrad run` sends.
Most daemons here use ``engine.url`` (a remote engine nobody listens for) so that no
engine has to load; the fatal test uses a supervised engine with a model that does not exist.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import TomlValue, config_toml
from waiting import exited, wait_until

from chandrad.errors import ExitCode


def write_config(root: Path, engine: str, socket_path: Path, log_format: str = "auto") -> Path:
    """``root/chandrad.toml``: folders under ``root``; ``engine`` the ``[engine]`` keys."""
    config = root / "chandrad.toml"
    watch: dict[str, TomlValue] = {
        "input": root / "inbox", "create_input": True, "output": root / "output",
        "done": root / "done", "failed": root / "failed"}
    config.write_text(config_toml(state_dir=root / "state", log_format=log_format, watch=watch,
                                  engine=f"[engine]\n{engine}", socket=socket_path))
    return config


class Datagrams:
    """A datagram socket bound where systemd would listen; collects what arrives."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.received: list[bytes] = []

    def pump(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                self.received.append(self.sock.recv(1 << 20))
            except TimeoutError:
                pass

    def wait_for(self, predicate: Callable[[bytes], bool], timeout: float) -> bytes:
        seen = 0
        found: list[bytes] = []

        def arrived() -> bool:
            nonlocal seen
            found.extend(msg for msg in self.received[seen:] if predicate(msg))
            seen = len(self.received)
            if not found:
                self.pump(0.2)
            return bool(found)

        wait_until(arrived, timeout, "datagram", every=0,
                   context=lambda: f"got {self.received[-10:]}")
        return found[0]

    def close(self) -> None:
        self.sock.close()


def journal_fields(datagram: bytes) -> dict[str, str]:
    """Parse the native journal protocol (KEY=value lines; binary-safe length form)."""
    fields: dict[str, str] = {}
    data = datagram
    while data:
        line, sep, rest = data.partition(b"\n")
        if b"=" in line:
            key, _, value = line.partition(b"=")
            fields[key.decode()] = value.decode(errors="replace")
            data = rest
        else:
            size = int.from_bytes(rest[:8], "little")
            fields[line.decode()] = rest[8:8 + size].decode(errors="replace")
            data = rest[8 + size + 1:]
        if not sep:
            break
    return fields


@pytest.fixture
def service_root(tmp_path: Path) -> Path:
    """A fresh folder per test (AF_UNIX paths must stay under 108 bytes)."""
    assert len(str(tmp_path / "notify.sock")) < 108
    return tmp_path


def start(config: Path, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:  # the daemon keeps its own copy
        return subprocess.Popen(
            [sys.executable, "-m", "chandrad", "run", "--config", str(config)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "JOURNAL_STREAM")}


def start_watched(service_root: Path, port: int,
                  watchdog_usec: str) -> tuple[subprocess.Popen[bytes], Datagrams]:
    """``chandrad run`` (a remote engine at ``port`` that is not there) under a stand-in
    systemd: ``$NOTIFY_SOCKET`` at a socket of ours and ``$WATCHDOG_USEC``."""
    notify = Datagrams(service_root / "notify.sock")
    config = write_config(service_root, f'url = "http://127.0.0.1:{port}"',
                          service_root / "ctl.sock")
    env = base_env() | {"NOTIFY_SOCKET": str(service_root / "notify.sock"),
                        "WATCHDOG_USEC": watchdog_usec}
    return start(config, env, service_root / "daemon.log"), notify


def test_notify_ready_status_watchdog_reload_stop(
    service_root: Path, free_port: Callable[[], int]
) -> None:
    """READY=1 (with STATUS=) once up; WATCHDOG=1 pings while the loop runs; SIGHUP →
    RELOADING=1 + MONOTONIC_USEC … READY=1; SIGTERM → STOPPING=1 and exit 0."""
    proc, notify = start_watched(service_root, free_port(), watchdog_usec="1000000")
    try:
        ready = notify.wait_for(lambda m: b"READY=1" in m, 60)
        assert b"STATUS=" in ready
        notify.pump(2.5)
        pings = [m for m in notify.received if m == b"WATCHDOG=1"]
        assert len(pings) >= 3, notify.received
        proc.send_signal(signal.SIGHUP)
        reloading = notify.wait_for(lambda m: b"RELOADING=1" in m, 30)
        assert b"MONOTONIC_USEC=" in reloading
        index = notify.received.index(reloading)
        notify.wait_for(lambda m: b"READY=1" in m and notify.received.index(m) > index, 30)
        proc.send_signal(signal.SIGTERM)
        notify.wait_for(lambda m: b"STOPPING=1" in m, 30)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        notify.close()
    statuses = [m for m in notify.received if m.startswith(b"STATUS=")]
    assert statuses, "no STATUS= updates"


def test_stopped_daemon_stops_watchdog_pings(
    service_root: Path, free_port: Callable[[], int]
) -> None:
    """A main loop that makes no progress (here: the process stopped) sends no WATCHDOG=1,
    so systemd's WatchdogSec fires."""
    proc, notify = start_watched(service_root, free_port(), watchdog_usec="600000")
    try:
        notify.wait_for(lambda m: b"READY=1" in m, 60)
        notify.pump(1.5)
        assert b"WATCHDOG=1" in notify.received
        os.kill(proc.pid, signal.SIGSTOP)
        notify.pump(0.5)  # a ping already in flight may still land
        mark = len(notify.received)
        notify.pump(2.0)
        assert b"WATCHDOG=1" not in notify.received[mark:]
        os.kill(proc.pid, signal.SIGCONT)
        notify.pump(2.0)
        assert b"WATCHDOG=1" in notify.received[mark:]
    finally:
        proc.terminate()
        proc.wait(60)
        notify.close()


def test_journal_native_fields_from_the_real_daemon(
    service_root: Path, free_port: Callable[[], int]
) -> None:
    """Under journald (JOURNAL_STREAM set) events go over the journal socket with
    MESSAGE, PRIORITY, SYSLOG_IDENTIFIER=chandrad, MESSAGE_ID and CHANDRA_EVENT."""
    journal = Datagrams(service_root / "journal.sock")
    config = write_config(service_root, f'url = "http://127.0.0.1:{free_port()}"',
                          service_root / "ctl.sock")
    log = service_root / "daemon.log"
    with log.open("wb") as fh:
        st = os.fstat(fh.fileno())
        env = base_env() | {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}",
                            "CHANDRAD_JOURNAL_SOCKET": str(service_root / "journal.sock")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "chandrad", "run", "--config", str(config)],
            stdout=fh, stderr=fh, stdin=subprocess.DEVNULL, env=env)
    try:
        started = journal.wait_for(lambda m: b"CHANDRA_EVENT=daemon_started" in m, 60)
    finally:
        proc.terminate()
        assert proc.wait(60) == 0
    fields = journal_fields(started)
    assert fields["SYSLOG_IDENTIFIER"] == "chandrad"
    assert fields["PRIORITY"] == "6"
    assert len(fields["MESSAGE_ID"]) == 32
    assert fields["MESSAGE"]
    assert "CODE_FILE" in fields
    journal.pump(0.5)
    events = {journal_fields(m).get("CHANDRA_EVENT") for m in journal.received}
    assert {"daemon_state", "engine_state", "daemon_stopped"} <= events
    journal.close()


def test_bad_config_exits_78_naming_the_key(service_root: Path) -> None:
    """`chandrad run` with an invalid config exits 78 and names key and line."""
    config = service_root / "bad.toml"
    config.write_text('[[watch]]\ninput = "in"\n\n[engine.memory]\nswap_space = 4\n')
    result = subprocess.run([sys.executable, "-m", "chandrad", "run", "--config", str(config)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == ExitCode.CONFIG
    assert f"{config}:5: engine.memory.swap_space" in result.stderr
    assert "preemption" in result.stderr or "recompute" in result.stderr


def test_unusable_state_dir_exits_78(service_root: Path, free_port: Callable[[], int]) -> None:
    """A state_dir that cannot be created is a config error naming daemon.state_dir."""
    (service_root / "file").write_text("not a directory")
    config = write_config(service_root, f'url = "http://127.0.0.1:{free_port()}"',
                          service_root / "ctl.sock")
    text = config.read_text().replace(str(service_root / "state"),
                                      str(service_root / "file" / "state"))
    config.write_text(text)
    result = subprocess.run([sys.executable, "-m", "chandrad", "run", "--config", str(config)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == ExitCode.CONFIG, result.stderr
    assert "daemon.state_dir" in result.stderr


def test_second_daemon_on_the_same_state_dir_exits_78(
    service_root: Path, free_port: Callable[[], int]
) -> None:
    """A second `chandrad run` on the state dir of a running one (say, by hand beside the
    service) is refused with 78 naming daemon.state_dir and the holder's pid, before it
    touches the store; the first keeps serving."""
    config = write_config(service_root, f'url = "http://127.0.0.1:{free_port()}"',
                          service_root / "ctl.sock")
    first = start(config, base_env(), service_root / "first.log")
    try:
        wait_answering(service_root / "ctl.sock", first, service_root / "first.log")
        other = config.with_name("other.toml")
        other.write_text(config.read_text().replace(str(service_root / "ctl.sock"),
                                                    str(service_root / "other.sock")))
        second = subprocess.run([sys.executable, "-m", "chandrad", "run", "--config",
                                 str(other)], capture_output=True, text=True, timeout=60)
        assert second.returncode == ExitCode.CONFIG, second.stderr
        line = other.read_text().splitlines().index(f'state_dir = "{service_root / "state"}"')
        assert f"{other}:{line + 1}: daemon.state_dir" in second.stderr
        assert f"pid {first.pid}" in second.stderr
        assert not (service_root / "other.sock").exists()
        assert ctl(service_root / "ctl.sock", "status", "--json").returncode == 0
    finally:
        first.terminate()
        assert first.wait(60) == 0


def test_reload_names_settings_that_need_a_restart(
    service_root: Path, free_port: Callable[[], int]
) -> None:
    """A reload that moves the state dir or changes the socket's mode applies the rest,
    keeps those two as they run, and says which keys wait for a restart."""
    sock = service_root / "ctl.sock"
    config = write_config(service_root, f'url = "http://127.0.0.1:{free_port()}"', sock)
    proc = start(config, base_env(), service_root / "daemon.log")
    try:
        wait_answering(sock, proc, service_root / "daemon.log")
        config.write_text(config.read_text()
                          .replace(str(service_root / "state"), str(service_root / "moved"))
                          .replace(f'socket = "{sock}"', f'socket = "{sock}"\nmode = "0600"')
                          .replace("[daemon]", '[daemon]\nlog_level = "debug"'))
        reply = ctl(sock, "reload", "--wait", "--json")
        assert reply.returncode == 0, reply.stdout + reply.stderr
        result = json.loads(reply.stdout)
        assert result["reloaded"] is True
        assert sorted(result["restart_needed"]) == ["control.mode", "daemon.state_dir"]
        assert oct(sock.stat().st_mode & 0o777) == oct(0o660)
        assert not (service_root / "moved").exists()
        assert (service_root / "state" / "chandrad.sqlite3").exists()
        assert ctl(sock, "status", "--json").returncode == 0
    finally:
        proc.terminate()
        assert proc.wait(60) == 0


def ctl(sock: Path, *args: str, user: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    """``chandractl`` on ``sock``; as another uid with ``user`` (the ``as_nobody`` prefix)."""
    return subprocess.run([*(user or []), sys.executable, "-m", "chandrad.ctl.main", "--socket",
                           str(sock), *args], capture_output=True, text=True, timeout=60)


def wait_answering(sock: Path, proc: subprocess.Popen[bytes], log: Path,
                   timeout: float = 60) -> None:
    """Until the daemon answers `status` on ``sock``; fails with its log if it exits first."""
    wait_until(lambda: ctl(sock, "status", "--json").returncode == 0, timeout,
               "status answers", every=0.3, gone=exited(proc), context=log.read_text)


def test_second_uid_is_forbidden_and_stale_socket_is_replaced(
    free_port: Callable[[], int], as_nobody: list[str]
) -> None:
    """A user outside the socket's group gets 'forbidden' (exit 4); a stale socket file
    left by a crashed daemon is replaced at the next start."""
    root = Path("/tmp") / f"chandrad-perm-{os.getpid()}"
    root.mkdir(mode=0o755)
    sock_dir = root / "run"
    sock_dir.mkdir(mode=0o755)
    sock_path = sock_dir / "ctl.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock_path))
    stale.close()  # a socket file with no listener: what a kill -9 leaves
    config = write_config(root, f'url = "http://127.0.0.1:{free_port()}"', sock_path)
    proc = start(config, base_env(), root / "daemon.log")
    try:
        wait_answering(sock_path, proc, root / "daemon.log")
        as_root = ctl(sock_path, "pause", "--json")
        assert as_root.returncode == 0, as_root.stderr
        denied = ctl(sock_path, "resume", user=as_nobody)
        assert denied.returncode == 4, denied.stdout + denied.stderr
        assert "forbidden" in (denied.stdout + denied.stderr).lower() \
            or "permission" in (denied.stdout + denied.stderr).lower()
        status: dict[str, Any] = json.loads(ctl(sock_path, "status", "--json").stdout)
        assert status["daemon"]["state"] == "paused"
    finally:
        proc.terminate()
        proc.wait(60)
        subprocess.run(["rm", "-rf", str(root)], check=False)


@pytest.mark.engine
def test_engine_fatal_daemon_stays_up_and_says_so(
    service_root: Path, free_port: Callable[[], int]
) -> None:
    """A model that does not exist: the engine goes fatal, the daemon stays up, keeps
    accepting files, status answers, and STATUS= tells the operator what to do."""
    notify = Datagrams(service_root / "notify.sock")
    engine = (f'model = "{service_root / "no-such-model"}"\nport = {free_port()}\n'
              'env = { VLLM_CPU_KVCACHE_SPACE = "1" }\nstartup_timeout = 300')
    config = write_config(service_root, engine, service_root / "ctl.sock")
    env = base_env() | {"NOTIFY_SOCKET": str(service_root / "notify.sock")}
    proc = start(config, env, service_root / "daemon.log")
    try:
        fatal_status = notify.wait_for(lambda m: b"ENGINE FATAL" in m, 240)
        assert b"engine restart" in fatal_status
        status = json.loads(ctl(service_root / "ctl.sock", "status", "--json").stdout)
        assert status["engine"]["state"] == "fatal"
        assert status["engine"]["last_failure"]["class"] == "other_fatal"
        assert status["engine"]["restarts"] == 0
        (service_root / "inbox" / "queued.png").write_bytes(_png())
        wait_until(lambda: any(
            j["path"].endswith("queued.png") for j in json.loads(
                ctl(service_root / "ctl.sock", "queue", "--json").stdout)["jobs"]),
            30, "file accepted while the engine is fatal", every=0.5)
        assert proc.poll() is None
    finally:
        proc.terminate()
        assert proc.wait(120) == 0
        notify.close()


def _png() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), "white").save(buf, format="PNG")
    return buf.getvalue()
