"""Shutdown with deadlines, the uvicorn way, on a real ``chandrad run`` process.

The engine is the stand-in engine process (``tests/standin_engine.py``): what matters here is
the daemon's own shutdown, not vLLM. Each test checks one promise:

* SIGTERM ends the daemon promptly even when a job waits for an engine that never becomes
  ready (it used to take ~60 s: the drain waited for pages no engine could serve);
* SIGTERM while paused ends the drain once the pages at the engine are answered (the pause
  stays in force, so nothing else can progress; it used to wait the whole drain deadline);
* a second SIGTERM during the drain escalates: stop draining, stop the engine, exit;
* requests that arrive during the drain are answered (``status``) or refused with a clear
  error (``reload``), never dropped or left without a reply;
* ``reload --wait`` returns by its deadline even when the new engine never becomes ready.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from faults.faultkit import Daemon, drop, free_port, standin_engine
from waiting import holds_for

from chandrad.config import load_config
from chandrad.daemon import Daemon as RealDaemon
from chandrad.errors import InternalError
from chandrad.states import DaemonState

DOC = "good/digital_federal-register_15p.pdf"


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path, standin_engine(tmp_path, port=free_port(), startup_timeout=300,
                                        stop_timeout=3))
    try:
        yield d
    finally:
        d.cleanup()


def _job_running(d: Daemon) -> bool:
    return any(j["state"] == "running" for j in d.stored_jobs())


def _sigterm_and_time(d: Daemon, timeout: float = 120) -> tuple[int, float]:
    assert d.proc is not None
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    code = d.proc.wait(timeout)
    return code, time.monotonic() - t0


def test_sigterm_with_a_job_waiting_for_a_never_ready_engine_exits_promptly(
        tmp_path: Path, corpus_dir: Path) -> None:
    """The engine is starting: its flag check (a child that imports vLLM; here one that
    takes 5 minutes) runs while a job waits for the engine. SIGTERM must not wait for it
    (it took up to the check's 120 s timeout: the check ran in a thread)."""
    d = Daemon(tmp_path, standin_engine(tmp_path, port=free_port(), startup_timeout=300,
                                        stop_timeout=3, check_flags=["sleep:300"]))
    try:
        d.start()
        d.wait_for("engine starting", lambda: d.engine_state() == "starting", 60)
        drop(corpus_dir / DOC, d.inbox, "waits.pdf")
        d.wait_for("job running", lambda: _job_running(d), 60)
        time.sleep(1.0)  # its pages are rendered and wait for the engine
        code, seconds = _sigterm_and_time(d, timeout=200)
        assert code == 0, d.tail()
        # stop_timeout is 3 s: stopping the starting engine and the daemon takes seconds.
        assert seconds < 15, f"SIGTERM to exit took {seconds:.1f} s\n{d.tail()}"
        # Its job was stopped before the store closed: no crash on a closed database,
        # and the job is still open for the next start.
        assert "job_crashed" not in d.log_path.read_text(), d.tail()
        states = [j["state"] for j in d.stored_jobs()]
        assert states in (["running"], ["pending"]), states
    finally:
        d.cleanup()


def test_second_sigterm_escalates_the_drain(daemon: Daemon, corpus_dir: Path) -> None:
    d = daemon
    d.control(mode="serve", delay_s=60)  # pages in flight would hold the drain for a minute
    d.start()
    d.wait_engine_ready(60)
    drop(corpus_dir / DOC, d.inbox, "slow.pdf")
    d.wait_for("pages in flight", lambda: (d.root / "requests.log").exists() or any(
        j["state"] == "running" for j in d.stored_jobs()), 60)
    time.sleep(2.0)  # the first requests are at the engine
    assert d.proc is not None
    d.proc.send_signal(signal.SIGTERM)
    d.wait_for("draining", lambda: (d.status() or {}).get("daemon", {}).get("state")
               == "stopping", 30, every=0.2)
    proc = d.proc
    holds_for(lambda: proc.poll() is None, 1.0,
              "chandrad alive: the first SIGTERM drains, pages are in flight", every=0.1,
              context=d.tail)
    code, seconds = _sigterm_and_time(d)
    assert code == 0, d.tail()
    assert seconds < 15, f"second SIGTERM to exit took {seconds:.1f} s\n{d.tail()}"
    assert "shutdown_escalated" in d.log_path.read_text()


def test_requests_during_the_drain_are_answered_or_refused(
        daemon: Daemon, corpus_dir: Path) -> None:
    d = daemon
    d.control(mode="serve", delay_s=8)
    d.start()
    d.wait_engine_ready(60)
    drop(corpus_dir / DOC, d.inbox, "drain.pdf")
    d.wait_for("job running", lambda: _job_running(d), 60)
    time.sleep(2.0)
    assert d.proc is not None
    d.proc.send_signal(signal.SIGTERM)
    d.wait_for("stopping", lambda: (d.status() or {}).get("daemon", {}).get("state")
               == "stopping", 30, every=0.2)
    status = d.status()
    assert status is not None and status["daemon"]["state"] == "stopping"
    for args in (("reload",), ("reload", "--wait")):
        got = d.ctl(*args, check=False, timeout=30)
        assert got.returncode != 0, f"{args} during the drain must be refused: {got.stdout}"
        assert "invalid_state: " in got.stderr and "stopping" in got.stderr, got.stderr
    code = d.proc.wait(120)
    assert code == 0, d.tail()


def test_drain_wait_in_progress_is_answered_when_the_daemon_stops(
        daemon: Daemon, corpus_dir: Path) -> None:
    """A ``drain --wait`` still waiting when SIGTERM stops the daemon gets an error reply,
    not a closed connection."""
    d = daemon
    d.control(mode="serve", delay_s=60)
    d.start()
    d.wait_engine_ready(60)
    drop(corpus_dir / DOC, d.inbox, "drain-wait.pdf")
    d.wait_for("job running", lambda: _job_running(d), 60)
    waiter = subprocess.Popen(
        [sys.executable, "-m", "chandrad.ctl.main", "--socket", str(d.socket), "drain",
         "--wait", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        d.wait_for("draining", lambda: (d.status() or {}).get("daemon", {}).get("state")
                   == "draining", 30, every=0.2)
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        d.proc.send_signal(signal.SIGTERM)  # do not wait a minute for the slow pages
        out, err = waiter.communicate(timeout=60)
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.wait()
    assert waiter.returncode != 0
    assert "invalid_state: " in err and "stopping" in err, (out, err)
    assert d.proc.wait(60) == 0, d.tail()


def test_reload_wait_has_a_deadline(daemon: Daemon) -> None:
    d = daemon
    d.control(mode="serve")
    d.start()
    d.wait_engine_ready(60)
    d.control(mode="never_ready")  # the engine the reload starts never becomes ready
    text = d.config.read_text().replace("startup_timeout = 300", "startup_timeout = 4")
    d.config.write_text(text.replace("stop_timeout = 3", "stop_timeout = 1"))
    t0 = time.monotonic()
    got = d.ctl("reload", "--wait", check=False, timeout=120)
    seconds = time.monotonic() - t0
    assert got.returncode != 0, got.stdout
    assert "timeout: " in got.stderr and "not ready" in got.stderr, got.stderr
    # the deadline is engine.stop_timeout + engine.startup_timeout + 10 s = 15 s
    assert 10 < seconds < 30, seconds


def test_reload_during_a_drain_keeps_draining(daemon: Daemon, corpus_dir: Path) -> None:
    """draining has no edge to reloading: a reload then runs without it, and the drain
    goes on (an illegal edge now raises, so this path must not take one)."""
    d = daemon
    d.control(mode="serve", delay_s=3)
    d.start()
    d.wait_engine_ready(60)
    drop(corpus_dir / DOC, d.inbox, "reload-drain.pdf")
    d.wait_for("job running", lambda: _job_running(d), 60)
    assert d.ctl("drain").returncode == 0
    got = d.ctl("reload", "--wait", timeout=60)
    assert got.returncode == 0, got.stderr
    status = d.status()
    assert status is not None and status["daemon"]["state"] in ("draining", "drained")
    assert d.proc is not None and d.proc.poll() is None, d.tail()
    assert d.stop(120) == 0, d.tail()


def test_illegal_daemon_state_edge_raises(tmp_path: Path) -> None:
    """A state change that states.DAEMON_TRANSITIONS forbids is a bug: it raises."""
    d = Daemon(tmp_path, standin_engine(tmp_path, port=free_port()))
    daemon = RealDaemon(load_config(d.config))
    with pytest.raises(InternalError, match="starting -> drained"):
        daemon.lifecycle.set_state(DaemonState.DRAINED, "test")
    assert daemon.lifecycle.state is DaemonState.STARTING


def test_sigterm_while_paused_ends_the_drain_once_requests_in_flight_are_answered(
        daemon: Daemon, corpus_dir: Path) -> None:
    """A pause stays in force through the stop, so no further page is sent: the drain ends
    as soon as the requests already at the engine are answered (nothing else can progress)
    instead of waiting its whole deadline (engine.stop_timeout + 60 s). The job is left
    open and resumes at the next start."""
    d = daemon
    d.control(mode="serve", delay_s=2)  # the pages at the engine are answered in 2 s
    d.start()
    d.wait_engine_ready(60)
    drop(corpus_dir / DOC, d.inbox, "paused.pdf")
    d.wait_for("job running", lambda: _job_running(d), 60)
    d.wait_for("a request at the engine", lambda: (d.status() or {}).get(
        "throughput", {}).get("requests_in_flight", 0) > 0, 60, every=0.1)
    assert d.ctl("pause").returncode == 0
    code, seconds = _sigterm_and_time(d)
    assert code == 0, d.tail()
    print(f"SIGTERM while paused: exited in {seconds:.1f} s")
    assert seconds < 15, f"SIGTERM while paused to exit took {seconds:.1f} s\n{d.tail()}"
    assert "drain_timeout" not in d.log_path.read_text(), d.tail()
    assert d.done_pages(), f"the pages at the engine were answered and stored\n{d.tail()}"
    jobs = d.stored_jobs()
    assert [j["state"] for j in jobs] in (["running"], ["pending"]), jobs
