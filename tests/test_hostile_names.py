"""Hostile file names through the real daemon, watcher, store and control socket.

A name that is not valid UTF-8 (``caf\\xe9.pdf``, common on Samba shares and in unpacked
archives) used to raise ``UnicodeEncodeError`` in the store's first query and end the
intake task for good, silently. Here the real `chandrad run` (with a remote engine nobody
serves, so no engine has to load: intake does not need one) takes such names, names
with a newline, 255-byte names and a non-UTF-8 folder, keeps every path's exact bytes,
shows their display form, and moves them by their exact bytes when cancelled.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import config_toml, table
from waiting import exited, wait_until

from chandrad import names

LONG = b"\xc3\xa9" * 125 + b"a.pdf"  # 255 bytes, the longest name Linux allows
NAMES: dict[bytes, str] = {  # relative path bytes -> display form
    b"caf\xe9.pdf": "caf\\xe9.pdf",
    b"two\nlines.pdf": "two\\x0alines.pdf",
    LONG: LONG.decode(),
    b"dir\xff/inner.pdf": "dir\\xff/inner.pdf",
}


class Daemon:
    def __init__(self, root: Path, port: int) -> None:
        self.root = root
        self.inbox, self.failed = root / "inbox", root / "failed"
        self.socket = root / "ctl.sock"
        self.log = root / "daemon.log"
        self.config = root / "chandrad.toml"
        self.config.write_text(config_toml(
            state_dir=root / "state",
            watch={"input": self.inbox, "create_input": True, "output": root / "output",
                   "done": root / "done", "failed": self.failed, "settle_seconds": 0.3},
            engine=table("engine", {"url": f"http://127.0.0.1:{port}"}), socket=self.socket))
        env = {k: v for k, v in os.environ.items()
               if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "JOURNAL_STREAM")}
        with self.log.open("wb") as out:  # the daemon keeps its own copy
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "chandrad", "run", "--config", str(self.config)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

    def ctl(self, *args: str) -> dict[str, Any]:
        result = subprocess.run(
            [sys.executable, "-m", "chandrad.ctl.main", "--socket", str(self.socket), *args,
             "--json"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, (args, result.stdout, result.stderr, self.tail())
        out: dict[str, Any] = json.loads(result.stdout)
        return out

    def wait_answering(self) -> None:
        wait_until(self.socket.exists, 60, "control socket", gone=exited(self.proc),
                   context=self.tail)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def daemon(tmp_path: Path, free_port: Callable[[], int]) -> Iterator[Daemon]:
    d = Daemon(tmp_path, free_port())
    try:
        d.wait_answering()
        yield d
    finally:
        d.stop()


def drop(inbox: Path, relative: bytes, data: bytes) -> bytes:
    """Write under a dot name, then rename into place, by bytes paths."""
    target = os.fsencode(inbox) + b"/" + relative
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = os.path.join(os.path.dirname(target), b".incoming.part")
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.rename(tmp, target)
    return target


def test_hostile_names_are_accepted_kept_and_moved_by_their_bytes(
    daemon: Daemon, corpus_dir: Path
) -> None:
    """Non-UTF-8, newline and 255-byte names (and a non-UTF-8 folder) are accepted beside
    an ordinary file; the store keeps their exact bytes; queue/status show display forms
    and no degraded task; cancel moves each input to failed/ under its exact bytes with
    an error.json naming it in display form; nothing crashes, nothing is logged as a
    traceback."""
    pdf = (corpus_dir / "good/digital_sf424-federal-form.pdf").read_bytes()
    dropped = {relative: drop(daemon.inbox, relative, pdf) for relative in NAMES}
    # The ordinary file comes last: before the fix, intake died on the first bad name
    # and never took it.
    drop(daemon.inbox, b"after.pdf", pdf)
    wanted = {*NAMES.values(), "after.pdf"}
    jobs: dict[str, dict[str, Any]] = {}

    def all_accepted() -> bool:
        jobs.clear()
        jobs.update({j["path"]: j for j in daemon.ctl("queue")["jobs"]})
        return set(jobs) == wanted

    wait_until(all_accepted, 60, f"jobs {sorted(wanted)}", every=0.3, context=daemon.tail)

    status = daemon.ctl("status")
    assert status["daemon"]["degraded"] == [], status["tasks"]
    assert {t["name"] for t in status["tasks"]} >= {"engine", "intake", "dispatch", "watcher"}
    assert all(t["state"] == "running" and t["restarts"] == 0 for t in status["tasks"])
    assert status["daemon"]["accepting"] is True

    db = sqlite3.connect(f"file:{daemon.root / 'state' / 'chandrad.sqlite3'}?mode=ro",
                         uri=True)
    stored = {row[0] for row in db.execute("SELECT abs_path FROM jobs")}
    db.close()
    assert {dropped[r] for r in NAMES} <= stored, stored

    for relative, shown in NAMES.items():
        daemon.ctl("cancel", str(jobs[shown]["id"]))
        moved = os.fsencode(daemon.failed) + b"/" + relative
        assert os.path.isfile(moved), (relative, os.listdir(os.fsencode(daemon.failed)))
        assert not os.path.exists(dropped[relative])
        parent = Path(os.fsdecode(moved)).parent
        error_json = [p for p in parent.iterdir() if p.name.endswith(".error.json")]
        err = [json.loads(p.read_text("utf-8")) for p in error_json
               if json.loads(p.read_text("utf-8"))["file"] == names.display(
                   Path(os.fsdecode(moved)).name)]
        assert len(err) == 1 and err[0]["code"] == "cancelled", (relative, error_json)
        for p in error_json:
            p.name.encode("utf-8")  # every name chandrad makes is valid UTF-8
            assert len(os.fsencode(p.name)) <= names.NAME_MAX

    assert daemon.ctl("rescan")["candidates"] == 0
    daemon.ctl("cancel", str(jobs["after.pdf"]["id"]))  # nothing left waiting for an engine
    log = daemon.log.read_text("utf-8")  # the log itself is valid UTF-8
    assert "Traceback" not in log and "task_crashed" not in log, daemon.tail()
    accepted = [json.loads(line) for line in log.splitlines()
                if '"job_accepted"' in line]
    assert {names.display(Path(e["file"]).relative_to(daemon.inbox)) for e in accepted} \
        >= set(NAMES.values())
