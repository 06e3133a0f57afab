"""The watched folders at start, on the real ``chandrad run`` and
``chandrad check-config``: a misspelled input is a config error naming its key (it used
to be created empty and watched forever) unless ``create_input = true``; a read-only
output, done or failed folder is refused whether it existed or not (an existing one used
to start the daemon and hold every job). Both commands say the same, exit 78.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from daemon_harness import Daemon, free_port

from chandrad.errors import ExitCode

ReadOnly = Callable[[Path], contextlib.AbstractContextManager[None]]


def _daemon(root: Path) -> Daemon:
    """A daemon config on a remote engine nobody serves (no engine to start)."""
    return Daemon(root, f'[engine]\nurl = "http://127.0.0.1:{free_port()}"\n')


def _chandrad(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``chandrad ARGS`` until it exits; one still running after ``timeout`` s (a daemon
    that started) is stopped and fails the test."""
    proc = subprocess.Popen([sys.executable, "-m", "chandrad", *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"chandrad {' '.join(args)} still running after {timeout:g} s "
                    f"(it started):\n{err[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _both_refuse(d: Daemon, key: str, words: str) -> None:
    """``run`` and ``check-config`` both exit 78 naming ``key`` (with its line) and
    ``words``."""
    for command in ("run", "check-config"):
        result = _chandrad(command, "--config", str(d.config))
        assert result.returncode == ExitCode.CONFIG, (command, result.stderr)
        line = next((ln for ln in result.stderr.splitlines() if f": {key}: " in ln), "")
        assert line.startswith(f"{d.config}:"), (command, result.stderr)
        assert words in line, (command, line)


def test_missing_input_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    d = _daemon(tmp_path)
    typo = tmp_path / "inbx"
    d.config.write_text(d.config_text().replace(str(d.inbox), str(typo)))
    _both_refuse(d, "watch[0].input", "does not exist")
    assert not typo.exists()  # nothing created by either command


def test_create_input_true_creates_a_missing_input(tmp_path: Path) -> None:
    d = _daemon(tmp_path)
    d.inbox.rmdir()
    d.config.write_text(d.config_text().replace(
        f'input = "{d.inbox}"\n', f'input = "{d.inbox}"\ncreate_input = true\n'))
    assert _chandrad("check-config", "--config", str(d.config)).returncode == 0
    assert not d.inbox.exists()  # check-config creates nothing
    d.start()
    try:
        d.wait_answering(60)
        assert d.inbox.is_dir()
        assert d.stop() == 0
    finally:
        d.cleanup()


@pytest.mark.parametrize("name", ["output", "done", "failed"])
def test_existing_read_only_folder_is_refused(tmp_path: Path, name: str,
                                              read_only_mount: ReadOnly) -> None:
    d = _daemon(tmp_path)
    folder: Path = getattr(d, name)
    with read_only_mount(folder):
        _both_refuse(d, f"watch[0].{name}", "read-only filesystem")


def test_new_output_folder_under_a_read_only_mount_is_refused(
        tmp_path: Path, read_only_mount: ReadOnly) -> None:
    d = _daemon(tmp_path)
    d.config.write_text(d.config_text().replace(
        f'output = "{d.output}"', f'output = "{d.output / "new"}"'))
    with read_only_mount(d.output):
        _both_refuse(d, "watch[0].output", "read-only filesystem")


def test_reload_naming_a_missing_input_is_refused(tmp_path: Path) -> None:
    """A reload whose [[watch]] names a missing input is refused like a bad config: the
    old watch keeps running, and the typo is not created."""
    d = _daemon(tmp_path)
    d.start()
    try:
        d.wait_answering(60)
        typo = tmp_path / "inbx"
        d.config.write_text(d.config_text().replace(str(d.inbox), str(typo)))
        result = d.ctl("reload", "--wait", check=False)
        assert result.returncode == 1, result.stdout
        assert "watch[0].input" in result.stdout + result.stderr
        assert not typo.exists()
        status = d.status()
        assert status is not None and status["daemon"]["state"] == "running", status
        assert d.stop() == 0
    finally:
        d.cleanup()
