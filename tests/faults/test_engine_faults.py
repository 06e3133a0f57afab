"""Engine faults on the real daemon: SIGKILL mid-batch, SIGSTOP (hung, port open), an engine
that never becomes ready, an engine that dies or hangs during shutdown.

vLLM's own code is not the point here, its behaviour at the process boundary is: the engine
is the stand-in process (``tests/standin_engine.py``), started by chandrad through
``engine.command`` in its own session, printing vLLM's lines and serving its endpoints.
One daemon serves the module's tests in order; the shutdown tests end it. Every test
proves 0 files lost and 0 pages done twice from the store and the outputs, and appends
its row to the reliability table.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from faults.faultkit import Daemon, audit, drop, free_port, record, standin_engine

DOC = "digital_federal-register_15p.pdf"  # 15 pages
DOC_PAGES = 15


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("engine-faults")
    d = Daemon(root, standin_engine(root, port=free_port(),
                                    startup_timeout=8))
    d.control(mode="serve", delay_s=0.4)
    d.start()
    try:
        d.wait_engine_ready(180)
        yield d
    finally:
        d.cleanup()


def _drop_copy(d: Daemon, corpus_dir: Path, name: str) -> str:
    drop(corpus_dir / "good" / DOC, d.inbox, name)
    return name


def _wait_pages_done(d: Daemon, at_least: int, timeout: float = 60) -> None:
    d.wait_for(f"{at_least} pages done", lambda: len(d.done_pages()) >= at_least, timeout)


def test_engine_sigkill_mid_batch(daemon: Daemon, corpus_dir: Path) -> None:
    """kill -9 of the engine while pages are in flight → restart, the job resumes."""
    d = daemon
    name = _drop_copy(d, corpus_dir, "sigkill.pdf")
    _wait_pages_done(d, 3)
    pid = d.engine_pid()
    assert pid
    before = d.done_pages()
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    d.wait_for("engine restarted", lambda: d.engine_state() == "ready"
               and d.engine_pid() not in (None, pid), 60)
    serving = time.monotonic() - t0
    d.wait_stored_final([name], 120)
    a = audit(d, {name: DOC_PAGES}, before)
    record("engine SIGKILL mid-batch", "engine failed (signal 9) → backoff → restarted; "
           "in-flight pages released and re-sent; job done",
           lost=len(a.lost), twice=len(a.done_twice), serving_s=serving)
    a.assert_clean()


def test_engine_sigstop_health_timeout(daemon: Daemon, corpus_dir: Path) -> None:
    """SIGSTOP: the port stays open, nothing answers → /health fails 3× → restart."""
    d = daemon
    name = _drop_copy(d, corpus_dir, "sigstop.pdf")
    first = len(d.done_pages())
    _wait_pages_done(d, first + 2)
    pid = d.engine_pid()
    assert pid
    before = d.done_pages()
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        d.wait_for("hung engine replaced", lambda: d.engine_state() == "ready"
                   and d.engine_pid() not in (None, pid), 120)
    finally:
        try:  # if chandrad did not, let the stopped process go
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    serving = time.monotonic() - t0
    assert not Path(f"/proc/{pid}").exists() or \
        Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z", "hung engine left running"
    d.wait_stored_final([name], 120)
    a = audit(d, {name: DOC_PAGES}, before)
    status = d.status()
    assert status is not None and "health" in str(status["engine"].get("last_failure")), status
    record("engine SIGSTOP (hung, port open)", "/health failed 3× (5 s apart) → engine failed "
           "→ SIGTERM + SIGCONT, exits → restarted; job done",
           lost=len(a.lost), twice=len(a.done_twice), serving_s=serving)
    a.assert_clean()


def test_engine_never_ready(daemon: Daemon, corpus_dir: Path) -> None:
    """An engine that loads forever → startup_timeout → backoff → next start; files wait."""
    d = daemon
    d.control(mode="never_ready")
    assert d.ctl("engine", "restart").returncode == 0
    d.wait_for("startup_timeout reported",
               lambda: "startup_timeout" in str((d.status() or {}).get("engine")), 60)
    name = _drop_copy(d, corpus_dir, "never-ready.pdf")
    d.wait_for("job accepted while engine is down",
               lambda: any(Path(j["path"]).name == name for j in d.stored_jobs()), 30)
    # Two start-up timeouts in a row: it keeps trying, with backoff, and says why.
    status = d.status()
    assert status is not None and status["engine"]["state"] in ("starting", "backoff",
                                                                "failed"), status
    d.control(mode="serve", delay_s=0.2)
    t0 = time.monotonic()
    d.wait_engine_ready(60)
    serving = time.monotonic() - t0
    d.wait_stored_final([name], 120)
    a = audit(d, {name: DOC_PAGES})
    record("engine never becomes ready", "startup_timeout (8 s here) → failed → backoff → "
           "restart, repeated; files accepted and queued meanwhile; done once it serves",
           lost=len(a.lost), twice=len(a.done_twice),
           serving_s=f"{serving:.1f} after the engine could start")
    a.assert_clean()


@pytest.mark.parametrize("mode", ["term_crash", "term_ignore"])
def test_engine_dies_or_hangs_during_shutdown(daemon: Daemon, corpus_dir: Path,
                                              mode: str) -> None:
    """SIGTERM to the daemon mid-job while the engine crashes (or ignores SIGTERM) on its own
    SIGTERM → the daemon still exits 0, leaves no engine process, and the next start
    finishes the job without redoing committed pages."""
    d = daemon
    d.control(mode=mode, delay_s=1.0)
    old = d.engine_pid()
    assert d.ctl("engine", "restart").returncode == 0
    d.wait_for("engine with the new behaviour", lambda: d.engine_state() == "ready"
               and d.engine_pid() != old, 60)
    pid = d.engine_pid()
    name = _drop_copy(d, corpus_dir, f"shutdown-{mode}.pdf")
    first = len(d.done_pages())
    _wait_pages_done(d, first + 2)
    before = d.done_pages()
    t0 = time.monotonic()
    code = d.stop(timeout=60)
    stop_s = time.monotonic() - t0
    assert code == 0, d.tail()
    assert pid and not Path(f"/proc/{pid}").exists(), "engine left running after shutdown"
    d.control(mode="serve", delay_s=0.2)
    d.start()
    t1 = time.monotonic()
    d.wait_engine_ready(120)
    serving = time.monotonic() - t1
    d.wait_stored_final([name], 120)
    a = audit(d, {name: DOC_PAGES}, before)
    what = ("crashes (exit 139)" if mode == "term_crash" else "ignores SIGTERM")
    record(f"engine {what} during daemon shutdown",
           f"daemon exited 0 in {stop_s:.1f} s, no engine process left; next start resumed "
           "the job from the store", lost=len(a.lost), twice=len(a.done_twice),
           serving_s=f"{serving:.1f} (daemon start incl. engine)")
    a.assert_clean()


def _entered_stopping(d: Daemon) -> float:
    """When (wall clock) the daemon last logged its state change to ``stopping``."""
    at = None
    for line in d.log_path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == "daemon_state" and rec.get("new") == "stopping":
            at = datetime.fromisoformat(rec["timestamp"]).timestamp()
    assert at is not None, f"no daemon_state -> stopping record\n{d.tail()}"
    return at


def test_sigterm_with_a_backlog_finishes_in_flight_work_only_and_exits(
        daemon: Daemon, corpus_dir: Path) -> None:
    """SIGTERM with 30 files queued: the daemon finishes the jobs already running, starts
    no new one, and exits 0 promptly; the next start takes the rest, nothing lost or done
    twice. Before the fix the drain kept dispatching queued jobs until its deadline, and
    the dispatch loop could swallow its cancellation (Python 3.11's wait_for), so the
    daemon never exited at all."""
    d = daemon
    d.control(mode="serve", delay_s=0.5)
    old = d.engine_pid()
    assert d.ctl("engine", "restart").returncode == 0
    d.wait_for("engine restarted", lambda: d.engine_state() == "ready"
               and d.engine_pid() != old, 60)
    names = [f"term-backlog-{i:02d}.png" for i in range(30)]
    for n in names:
        drop(corpus_dir / "good" / "image_hi-devanagari.png", d.inbox, n)

    def states() -> dict[str, str]:
        return {Path(j["path"]).name: str(j["state"]) for j in d.stored_jobs()
                if Path(j["path"]).name in names}

    d.wait_for("3 of the backlog done", lambda: list(states().values()).count("done") >= 3,
               120)
    before = d.done_pages()
    at_term = states()
    t0 = time.monotonic()
    code = d.stop(timeout=90)
    stop_s = time.monotonic() - t0
    # "After SIGTERM" is after the daemon began its drain (its daemon_state -> stopping
    # record), not after the snapshot above: a job may start between the two.
    stopping_at = _entered_stopping(d)
    started_after = sorted(
        Path(j["path"]).name for j in d.stored_jobs()
        if Path(j["path"]).name in names and j["started_at"] is not None
        and float(j["started_at"]) > stopping_at)
    assert code == 0, d.tail()
    d.control(mode="serve", delay_s=0.05)
    d.start()
    d.wait_engine_ready(120)
    d.wait_stored_final(names, 300)
    a = audit(d, {n: 1 for n in names}, before)
    running = list(at_term.values()).count("running")
    record("SIGTERM with a 30-file backlog (pages in flight)",
           f"daemon exited 0 in {stop_s:.1f} s: finished the {running} running job(s), "
           f"started {len(started_after)} queued job(s) after SIGTERM; next start did the "
           "rest", lost=len(a.lost), twice=len(a.done_twice), serving_s="-")
    a.assert_clean()
    assert not started_after, f"jobs started after SIGTERM: {started_after}"
    assert stop_s < 45, f"SIGTERM to exit took {stop_s:.1f} s"
