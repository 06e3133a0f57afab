"""Signals in the first moments of ``chandrad run``: the real daemon, exec'd
as systemd does, signalled 0-200 ms after exec.

A SIGHUP there used to kill it (status 129, which systemd counts as a clean exit, so
``Restart=on-failure`` left the service dead) and a SIGTERM made it die by the signal
instead of exiting 0, until its event loop installed handlers ~0.3-0.5 s in. Now the entry
point holds both before it imports anything (``chandrad/early.py``). What no code in the
process can cover is the interpreter's own start, before any of chandrad's code runs: a
signal sent while the kernel still shows the signal at its default action (``SigCgt``,
``SigBlk`` and ``SigIgn`` of ``/proc/PID/status``) is that window, and is told apart; a
launcher that blocks the signal across exec closes it (the last test).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import pytest
from daemon_harness import MARK_ENV, SHARED_CACHE, Daemon, free_port
from waiting import holds_for

#: Milliseconds after exec at which the signal is sent (the issue's probe).
DELAYS_MS = (0, 20, 50, 100, 200)


def _daemon(root: Path) -> Daemon:
    """A daemon on a remote engine that nobody serves: no engine to load."""
    return Daemon(root, f'[engine]\nurl = "http://127.0.0.1:{free_port()}"\n')


def _default_dispositions() -> None:
    """What systemd gives a service: every signal at its default action (a test run under
    ``nohup`` would otherwise hand the daemon an ignored SIGHUP across exec)."""
    for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)


def _start(d: Daemon, preexec: Callable[[], None] | None = None) -> subprocess.Popen[bytes]:
    """``chandrad run`` as the harness starts it (its own session, marked for cleanup),
    with the signal dispositions systemd gives it."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("NOTIFY_SOCKET", "JOURNAL_STREAM", "WATCHDOG_USEC")}
    env |= {MARK_ENV: d.marker, "CACHE_DIRECTORY": SHARED_CACHE}
    with d.log_path.open("ab") as log:
        d.proc = subprocess.Popen(
            [sys.executable, "-m", "chandrad", "run", "--config", str(d.config)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True, preexec_fn=preexec or _default_dispositions)
    return d.proc


def _disposition(pid: int, sig: signal.Signals) -> str:
    """``caught``, ``blocked``, ``ignored`` or ``default``: what the kernel does with
    ``sig`` for ``pid`` now."""
    bit = 1 << (sig - 1)
    fields = dict(line.split(":\t", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
    for name, key in (("caught", "SigCgt"), ("blocked", "SigBlk"), ("ignored", "SigIgn")):
        if int(fields[key], 16) & bit:
            return name
    return "default"


def _signal_after(proc: subprocess.Popen[bytes], sig: signal.Signals, ms: int) -> str:
    """Send ``sig`` ``ms`` after exec (Popen returns once the exec is done); the
    disposition it met."""
    due = time.monotonic() + ms / 1000
    while time.monotonic() < due:
        pass
    found = _disposition(proc.pid, sig)
    proc.send_signal(sig)
    return found


def _events(d: Daemon, name: str) -> list[dict[str, object]]:
    found = []
    for line in d.log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            if entry.get("event") == name:
                found.append(entry)
    return found


def _open_fifo_writer(d: Daemon, timeout: float = 60.0) -> IO[str]:
    """The config FIFO's write end, once the daemon has opened its read end. Opened
    without blocking (ENXIO while nobody reads), so a daemon that dies before it reads
    its config fails the test with its output instead of hanging it."""
    assert d.proc is not None
    deadline = time.monotonic() + timeout
    while True:
        try:
            fd = os.open(d.config, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
        else:
            os.set_blocking(fd, True)
            return os.fdopen(fd, "w")
        if d.proc.poll() is not None:
            pytest.fail(f"chandrad exited {d.proc.returncode} before reading its config\n"
                        f"{d.tail()}")
        if time.monotonic() > deadline:
            pytest.fail(f"chandrad did not open its config in {timeout:.0f}s\n{d.tail()}")
        time.sleep(0.01)


@contextlib.contextmanager
def _reading_config(d: Daemon) -> Iterator[Callable[[], None]]:
    """``chandrad run`` frozen while it reads its config: the config is a FIFO, and this
    returns once the daemon has opened it (the open of its write end returns then), long
    after the interpreter's own start and before anything else of the daemon. Calling
    the function yielded lets the daemon read the config (a regular file takes the
    FIFO's place first, for a later reload)."""
    text = d.config.read_text()
    d.config.unlink()
    os.mkfifo(d.config)
    _start(d)
    with _open_fifo_writer(d) as writer:
        def release() -> None:
            regular = d.config.with_suffix(".regular")
            regular.write_text(text)
            os.replace(regular, d.config)
            writer.write(text)
            writer.close()
        yield release


def test_sighup_while_reading_the_config_is_not_fatal(tmp_path: Path) -> None:
    """A SIGHUP while ``chandrad run`` reads its config (before it has a loop) used to
    kill it (status 129); now it is held, and the daemon starts, reports ready and
    handles it (a reload once running)."""
    d = _daemon(tmp_path)
    try:
        with _reading_config(d) as release:
            assert d.proc is not None
            assert _disposition(d.proc.pid, signal.SIGHUP) == "caught"
            proc = d.proc
            proc.send_signal(signal.SIGHUP)
            holds_for(lambda: proc.poll() is None, 0.2, "chandrad alive after the SIGHUP",
                      every=0.05, context=d.tail)
            release()
        d.wait_answering(60)
        d.wait_for("the early SIGHUP handled", lambda: _events(d, "config_reloaded"), 30)
        status = d.status()
        assert status is not None and status["daemon"]["state"] == "running", status
        assert [e["action"] for e in _events(d, "signal_before_start")] == ["reload"]
        assert d.stop() == 0
    finally:
        d.cleanup()


def test_sigterm_while_reading_the_config_exits_zero(tmp_path: Path) -> None:
    """A SIGTERM at the same point used to end it by the signal; now ``chandrad run``
    stops cleanly before it starts anything: exit 0."""
    d = _daemon(tmp_path)
    try:
        with _reading_config(d) as release:
            assert d.proc is not None
            proc = d.proc
            proc.send_signal(signal.SIGTERM)
            holds_for(lambda: proc.poll() is None, 0.2,
                      "chandrad alive until it has read its config", every=0.05,
                      context=d.tail)
            release()
        assert d.proc.wait(60) == 0, d.tail()
        assert "stopped by a signal before the daemon started" in d.tail()
        assert not d.has_store()  # nothing was started
    finally:
        d.cleanup()


@pytest.mark.parametrize("ms", DELAYS_MS)
def test_sighup_in_the_first_200ms_never_kills_the_daemon(tmp_path: Path, ms: int) -> None:
    """The issue's probe: a SIGHUP 0-200 ms after exec. Whenever it finds the daemon's
    holder in place (``caught``), the daemon keeps running and reports ready, the signal
    in its log. One that lands during the interpreter's own start (the kernel's default
    action; how long that lasts depends on the machine's load) is that window, not judged
    here: the test above freezes the start at a known point instead."""
    d = _daemon(tmp_path)
    try:
        proc = _start(d)
        if _signal_after(proc, signal.SIGHUP, ms) == "default":
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)  # the holder may have come between the look and the kill
            if proc.poll() is not None:
                return
        d.wait_answering(60)
        status = d.status()
        assert status is not None and status["daemon"]["state"] == "running", status
        assert _events(d, "signal_before_start") or _events(d, "config_reloaded"), d.tail()
        assert d.stop() == 0
    finally:
        d.cleanup()


def test_sighup_blocked_across_exec_is_delivered_not_lost(tmp_path: Path) -> None:
    """Started with SIGHUP blocked (``env --block-signal=HUP``, or any launcher that
    blocks it), a SIGHUP at 0 ms waits in the kernel; the daemon unblocks it once its
    holder is in place, so it is handled (logged) instead of staying pending forever."""
    d = _daemon(tmp_path)
    try:
        def block_hup() -> None:  # in the child, before its exec
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})

        proc = _start(d, block_hup)
        # "caught" only if this test was held up longer than the interpreter's start
        assert _signal_after(proc, signal.SIGHUP, 0) in ("blocked", "caught")
        d.wait_answering(60)
        d.wait_for("the early SIGHUP handled",
                   lambda: _events(d, "signal_before_start") or _events(d, "config_reloaded"),
                   10)
        assert _disposition(proc.pid, signal.SIGHUP) == "caught"
        assert d.stop() == 0
    finally:
        d.cleanup()
