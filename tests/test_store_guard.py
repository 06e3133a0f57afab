"""The store's guards on the real daemon (``chandrad run``, tests/daemon_harness.py) with
the stand-in engine: one daemon per store even when ``chandrad.lock`` was
deleted, a damaged store refused with exit 78 and the way out (and ``chandrad store
check``/``repair``), and a full filesystem under the store held, not failed, until space
comes back (a real tmpfs; needs root).
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemon_harness import Daemon, drop, fill_until_full, pid_alive
from PIL import Image
from standin_engine import StandinServer, write_standin
from test_job_errors import Notify
from waiting import holds_for

from chandrad.store import DB_NAME, LOCK_NAME, USED_MARKER, Store

#: An engine nobody listens on: a daemon refused at start never reaches it.
NO_ENGINE = '[engine]\nurl = "http://127.0.0.1:9"\n'


def _supervised(python: Path, port: int) -> str:
    """``[engine]`` for the stand-in as a supervised process (a session file, a pid)."""
    return (f'[engine]\nmodel = "{python.parent}"\npython = "{python}"\nport = {port}\n'
            "startup_timeout = 30\nstop_timeout = 5\nstable_seconds = 0.5\n"
            "[engine.downshift]\nbackoff = [0.2, 1.0]\n")


def _page(folder: Path, name: str, colour: tuple[int, int, int]) -> Path:
    """A one-page PNG of its own content (the colour)."""
    path = folder / f".src-{name}"
    Image.new("RGB", (320, 240), colour).save(path, format="PNG")
    return path


def _exit(d: Daemon, timeout: float = 60) -> tuple[int, str]:
    """The daemon's exit status (it must stop by itself) and its log."""
    assert d.proc is not None
    try:
        code = d.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running after {timeout:g} s\n{d.tail()}") from None
    return code, d.log_path.read_text("utf-8", "replace")


def _chandrad(d: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "chandrad", *args, "--config", str(d.config)],
                          capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------ one daemon per store
def test_second_daemon_on_one_state_dir_refuses_before_touching_the_first(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """``chandrad.lock`` deleted under a running daemon, a second one started on the same
    state dir and inbox (another socket): it exits 78 naming the state dir and the first's
    pid, and leaves everything of the first's alone (engine alive and unchanged, session
    file, no new lock file); the first goes on serving."""
    python = write_standin(tmp_path / "engine", {})
    first = Daemon(tmp_path / "a", _supervised(python, free_port()))
    second = Daemon(tmp_path / "b", _supervised(python, free_port()))
    second.config.write_text(second.config_text()
                             .replace(str(second.state_dir), str(first.state_dir))
                             .replace(str(second.inbox), str(first.inbox)))
    try:
        first.start()
        first.wait_engine_ready(60)
        engine_pid = first.engine_pid()
        assert engine_pid is not None
        session = first.state_dir / "engine.session"
        recorded = session.read_bytes()
        (first.state_dir / LOCK_NAME).unlink()

        second.start()
        code, log = _exit(second)
        assert code == 78, log
        assert first.proc is not None
        assert str(first.state_dir) in log and f"pid {first.proc.pid}" in log, log
        assert "Traceback" not in log
        assert pid_alive(engine_pid), "the second daemon killed the first's engine"
        assert session.read_bytes() == recorded
        assert not (first.state_dir / LOCK_NAME).exists(), "the second wrote a lock file"
        assert first.engine_state() == "ready" and first.engine_pid() == engine_pid

        drop(_page(tmp_path, "one.png", (200, 30, 30)), first.inbox, "one.png")
        jobs = first.wait_jobs_final(["one.png"], 60)
        assert jobs["one.png"]["state"] == "done", jobs
    finally:
        second.cleanup()
        first.cleanup()


# ------------------------------------------------------------ a damaged store
def _store_with_jobs(d: Daemon, count: int = 40) -> None:
    """A store as a daemon leaves it: ``count`` jobs accepted, closed (checkpointed)."""
    store = Store.open(d.state_dir)
    for i in range(count):
        store.accept(0, d.inbox, d.inbox / f"f{i}.png", 10, 1.0, f"{i:064x}")
    store.close()


def _damage(db: Path, how: str) -> None:
    if how == "half":
        os.truncate(db, db.stat().st_size // 2)
    elif how == "index_page":
        with sqlite3.connect(db) as conn:
            (root,) = conn.execute("SELECT rootpage FROM sqlite_master "
                                   "WHERE name = 'jobs_by_state'").fetchone()
        conn.close()
        with db.open("r+b") as fh:
            fh.seek((root - 1) * 4096)
            fh.write(bytes(range(256)) * 16)
    elif how == "empty":
        os.truncate(db, 0)
    else:  # gone, its marker left
        db.unlink()


@pytest.mark.parametrize("how", ["half", "index_page", "empty", "gone"])
def test_damaged_store_exits_78_naming_the_file_and_the_way_out(tmp_path: Path,
                                                                 how: str) -> None:
    """Truncated to half (was exit 70 and a bare traceback, restarted every 10 s), one
    index page overwritten (was: started, then every new file failed), empty or gone
    where it held jobs (was: started empty, history silently gone): exit 78, one message
    naming the file and the recovery, no traceback."""
    d = Daemon(tmp_path / "d", NO_ENGINE)
    _store_with_jobs(d)
    assert (d.state_dir / USED_MARKER).exists()
    _damage(d.db_path, how)
    try:
        d.start()
        code, log = _exit(d)
    finally:
        d.cleanup()
    assert code == 78, log
    assert "store_damaged" in log and str(d.db_path) in log, log
    assert "Keep a copy" in log and "chandrad store repair" in log and "start fresh" in log
    assert "Traceback" not in log
    if how in ("empty", "gone"):
        assert f"is {how}" in log and USED_MARKER in log, log


def test_store_check_and_repair_bring_a_damaged_store_back(tmp_path: Path) -> None:
    """``chandrad store check`` finds the overwritten index page (78), ``repair`` rebuilds
    the store keeping every job and the damaged file, and the daemon starts on it."""
    d = Daemon(tmp_path / "d", NO_ENGINE)
    _store_with_jobs(d, 40)
    _damage(d.db_path, "index_page")
    checked = _chandrad(d, "store", "check")
    assert checked.returncode == 78, checked
    assert str(d.db_path) in checked.stdout and "repair" in checked.stderr
    repaired = _chandrad(d, "store", "repair")
    assert repaired.returncode == 0, repaired
    assert "40 jobs kept" in repaired.stdout, repaired.stdout
    assert [p.name for p in d.state_dir.glob(f"{DB_NAME}.damaged-*")], "damaged copy kept"
    assert _chandrad(d, "store", "check").returncode == 0
    try:
        d.start()
        d.wait_answering(60)
        assert sum(d.ctl_json("status")["queue"].values()) == 40
    finally:
        d.cleanup()


def test_store_repair_refuses_while_a_daemon_holds_the_store(tmp_path: Path) -> None:
    d = Daemon(tmp_path / "d", NO_ENGINE)
    try:
        d.start()
        d.wait_answering(60)
        refused = _chandrad(d, "store", "repair")
        assert refused.returncode == 78 and "state_dir_in_use" in refused.stderr, refused
        assert d.alive()
    finally:
        d.cleanup()


# ------------------------------------------------------------ the store's disk full
@pytest.fixture()
def store_on_tmpfs(tmp_path: Path) -> Iterator[tuple[Daemon, Notify]]:
    """A daemon (stand-in engine by URL) whose state dir is a real 2 MiB tmpfs."""
    if os.geteuid() != 0:
        pytest.skip("the state dir is a real tmpfs: mounting it needs root")
    engine = StandinServer(tmp_path / "engine").start()
    notify = Notify(tmp_path / "notify.sock")
    d = Daemon(tmp_path / "d", f'[engine]\nurl = "{engine.url}"\n', settle=0.3,
               tables='[metrics]\nlisten = ""\n', env={"NOTIFY_SOCKET": str(notify.path)})
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(d.state_dir)],
                   check=True)
    try:
        d.start()
        d.wait_answering(60)
        yield d, notify
    finally:
        d.cleanup()
        subprocess.run(["umount", "-l", str(d.state_dir)], check=False)
        engine.stop()
        notify.close()


def test_full_store_filesystem_holds_files_in_the_inbox_and_heals(
    store_on_tmpfs: tuple[Daemon, Notify], tmp_path: Path
) -> None:
    """The state dir's filesystem full: good files stay in the inbox (none to failed/ as
    intake_error, no task crash), status and STATUS= say the store is full; space freed:
    every file is done, by itself."""
    d, notify = store_on_tmpfs
    filler = d.state_dir / "filler"
    fill_until_full(filler)
    names = [f"page{i}.png" for i in range(6)]
    for i, name in enumerate(names):
        drop(_page(tmp_path, name, (40 * i, 90, 200 - 30 * i)), d.inbox, name)

    d.wait_for("status says the store is full",
               lambda: any(j.get("reason") == "store_full"
                           for j in (d.ctl_json("status")["held"]["jobs"])), 30)

    def held_whole() -> None:
        """Nothing failed or taken from the inbox, no task restarted, never degraded."""
        status = d.ctl_json("status")
        assert not list(d.failed.iterdir()), list(d.failed.iterdir())
        assert all((d.inbox / n).exists() for n in names)
        assert all(t["restarts"] == 0 for t in status["tasks"]), status["tasks"]
        assert not status["daemon"]["degraded"], status["daemon"]

    holds_for(held_whole, 3, every=0.5)  # several retries of intake and dispatch
    assert "STORE FULL" in d.ctl("status").stdout or any(
        "STORE FULL" in s for s in notify.statuses())
    assert any(s.startswith("STORE FULL: ") for s in notify.statuses()), notify.statuses()[-3:]

    t0 = time.monotonic()
    filler.unlink()
    jobs = d.wait_jobs_final(names, 60)
    print(f"\n{len(names)} files done {time.monotonic() - t0:.1f}s after space came back")
    assert {j["state"] for j in jobs.values()} == {"done"}, jobs
    assert sorted(p.name for p in d.done.iterdir()) == sorted(names)
    assert not list(d.failed.iterdir())
    d.wait_for("STATUS= no longer says the store is full",
               lambda: not notify.statuses()[-1].startswith("STORE FULL"), 10)
    log = d.log_path.read_text("utf-8", "replace")
    assert "Traceback" not in log and "file_quarantined" not in log
    assert '"store_full"' in log and '"store_has_room"' in log
