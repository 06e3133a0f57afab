"""`chandractl reload --wait` (and `drain --wait`, the same code) shows progress while it waits:
the top view in a real terminal (tmux), plain lines on stderr otherwise, the reply on stdout.

The daemon is real; its engine is the stand-in process (tests/standin_engine.py), whose
flag check takes 4 s on the reload, so the wait is long enough to be seen.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from standin_engine import write_standin
from test_daemon_service import wait_answering
from test_supervision import daemon_config, start_daemon, wait_engine
from waiting import wait_until

CHECK_S = 4


def _capture(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                          text=True, timeout=10).stdout


def _change_engine_flags(config: Path, max_num_seqs: int) -> None:
    """A change the engine's command line shows (``--max-num-seqs``), so the reload runs
    the flag check again: a stored verdict is keyed on the flags."""
    text = config.read_text()
    if "[engine.memory]" not in text:
        text = text.replace("[engine.downshift]", "[engine.memory]\nmax_num_seqs = 0\n\n"
                            "[engine.downshift]")
    old = next(line for line in text.splitlines() if line.startswith("max_num_seqs"))
    config.write_text(text.replace(old, f"max_num_seqs = {max_num_seqs}"))


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (scripts/setup.sh)")
def test_reload_wait_shows_progress_on_a_terminal_and_plain_lines_otherwise(
        tmp_path: Path, free_port: Callable[[], int]) -> None:
    python = write_standin(tmp_path / "engine",
                           {"check_flags": ["ok", f"sleep:{CHECK_S}", f"sleep:{CHECK_S}"]})
    config = daemon_config(tmp_path, python, free_port())
    sock, log = tmp_path / "ctl.sock", tmp_path / "daemon.log"
    proc = start_daemon(config, log)
    session = f"chandrad-wait-{os.getpid()}"
    try:
        wait_answering(sock, proc, log)
        wait_engine(sock, proc, log, "ready")
        # piped: progress lines on stderr, the reply alone on stdout
        _change_engine_flags(config, 3)
        piped = subprocess.run([sys.executable, "-m", "chandrad.ctl.main", "--socket",
                                str(sock), "reload", "--wait"], capture_output=True, text=True,
                               timeout=120)
        assert piped.returncode == 0, piped.stdout + piped.stderr
        waiting = [line for line in piped.stderr.splitlines()
                   if line.startswith("reload: waiting")]
        assert len(waiting) >= 2, piped.stderr
        assert any("daemon=reloading" in line for line in waiting), piped.stderr
        assert "\x1b" not in piped.stderr + piped.stdout
        assert "waiting" not in piped.stdout and "reload" in piped.stdout.lower(), piped.stdout
        wait_engine(sock, proc, log, "ready")

        # a terminal: the top view, live, until the reply
        _change_engine_flags(config, 4)
        rc_file = tmp_path / "wait.rc"
        command = shlex.join([sys.executable, "-m", "chandrad.ctl.main", "--socket", str(sock),
                              "reload", "--wait"])
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "150", "-y", "40",
                        f"{command}; echo $? > {shlex.quote(str(rc_file))}; sleep 30"],
                       check=True, timeout=10, env={**os.environ, "TERM": "xterm-256color"})
        shown = ""

        def finished() -> bool:
            nonlocal shown
            screen = _capture(session)
            if "waiting for the daemon" in screen and "reloading" in screen:
                shown = screen
            return rc_file.exists()

        wait_until(finished, 60, "reload --wait to exit", context=lambda: _capture(session))
        final = _capture(session)
        assert shown, final
        print(f"\n--- captured reload --wait screen ---\n{shown}")
        assert "engines" in shown and "running jobs" in shown, shown
        assert rc_file.read_text().strip() == "0", final
        assert "waiting for the daemon" not in final, final  # the view gave way to the reply
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True, timeout=10)
        proc.terminate()
        assert proc.wait(60) == 0, log.read_text()[-3000:]
