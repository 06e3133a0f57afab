"""How soon the supervisor sees its engine's API server die, on the real daemon with the
stand-in engine process as ``engine.python``.

vLLM's engine core outlives a killed API server and holds the API server's output pipes
open: the stand-in's ``setsid_grandchild`` is such a survivor (it inherits the pipes and
writes nothing). ``kill -9`` of the API server must take the engine out of ``ready`` at
the supervisor's next look (1 s) plus the output's quiet period
(``process.OUTPUT_QUIET_S``), not after the pipes' 5 s read limit.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from standin_engine import events, write_standin
from test_daemon_service import wait_answering
from test_supervision import daemon_config, start_daemon, wait_engine

#: Seconds from the kill to ``ready -> failed``: the 1 s look and the 0.5 s quiet period,
#: with room for a loaded two-core box; below the 5 s read limit it used to wait out.
SEEN_WITHIN_S = 4.0


def _state_changes(log: Path, since: float) -> list[tuple[float, str, str]]:
    """(seconds after ``since``, old, new) of every ``engine_state`` logged after it."""
    out = []
    for line in log.read_text().splitlines():
        if '"engine_state"' not in line or not line.startswith("{"):
            continue
        event = json.loads(line)
        at = datetime.datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00"))
        if at.timestamp() >= since:
            out.append((at.timestamp() - since, event["old"], event["new"]))
    return out


def test_kill9_of_the_api_server_leaves_ready_at_once_though_a_survivor_holds_its_pipes(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    folder = tmp_path / "engine"
    python = write_standin(folder, {"setsid_grandchild": True})
    config = daemon_config(tmp_path, python, free_port())
    sock, log = tmp_path / "ctl.sock", tmp_path / "daemon.log"
    proc = start_daemon(config, log)
    survivors: list[int] = []
    try:
        wait_answering(sock, proc, log)
        pid = wait_engine(sock, proc, log, "ready")["engine"]["pid"]
        survivors = [e["pid"] for e in events(folder) if e["what"] == "grandchild"]
        assert survivors, "the stand-in left no child holding its pipes"
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        after = wait_engine(sock, proc, log, "ready", replacing=pid)
        assert after["engine"]["restarts"] == 1, after
        changes = _state_changes(log, killed_at)
        seen = next(t for t, old, new in changes if (old, new) == ("ready", "failed"))
        print(f"\nready -> failed {seen:.2f}s after kill -9 of the API server; {changes}")
        assert seen < SEEN_WITHIN_S, changes
        assert after["engine"]["last_failure"]["subclass"] == "killed", after
    finally:
        proc.terminate()
        proc.wait(60)
        for pid_ in survivors:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid_, signal.SIGKILL)
