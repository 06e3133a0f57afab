"""Process helpers for the benchmark: sessions, /proc readings, free ports.

Owns how ``bench/run.py`` starts a child in its own session, stops the whole session
and proves that nothing of it is left, and how it reads a process's RSS and CPU time
from ``/proc`` (Linux only; no psutil so the figures mean exactly what they say).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")
#: This checkout's root and the temporary directory, as result files must not name them.
_ROOT = str(Path(__file__).resolve().parents[1]) + "/"
_TMP = tempfile.gettempdir().rstrip("/") + "/"


def portable(value: Any) -> Any:
    """``value`` (JSON-like) with no path of this machine in it: this checkout's root is
    left out (paths become relative to the repository) and the temporary directory is
    written ``$TMPDIR/``, so a committed result reads the same from any checkout."""
    if isinstance(value, str):
        return value.replace(_ROOT, "").replace(_TMP, "$TMPDIR/")
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [portable(v) for v in value]
    return value


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_session(argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None,
                  cwd: Path | None = None) -> subprocess.Popen[bytes]:
    """Start ``argv`` as the leader of a new session, stdout+stderr appended to ``log``."""
    with log.open("ab") as fh:
        return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=fh,
                                stderr=subprocess.STDOUT, env=dict(env) if env else None,
                                cwd=cwd, start_new_session=True)


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # Field 2 (comm) may contain spaces and parentheses: split after the last ')'.
    return raw[raw.rfind(")") + 2:].split()


def session_members(sid: int) -> list[int]:
    """Live (non-zombie) pids whose session id is ``sid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(int(entry))
        # fields[0] is state (field 3), fields[3] is session (field 6).
        if fields is not None and fields[0] != "Z" and int(fields[3]) == sid:
            found.append(int(entry))
    return found


def stop_session(proc: subprocess.Popen[bytes], term_timeout: float = 30.0) -> list[int]:
    """Stop ``proc`` and its whole session; return the pids still left (should be none).

    SIGTERM goes to the leader first so it can shut down in order (a daemon drains,
    the API server stops its EngineCore); then the session gets SIGTERM, then SIGKILL.
    """
    sid = proc.pid
    with contextlib.suppress(ProcessLookupError):
        os.kill(sid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=term_timeout)
    if session_members(sid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(sid, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        while session_members(sid) and time.monotonic() < deadline:
            time.sleep(0.2)
    for pid in session_members(sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    deadline = time.monotonic() + 5.0
    while session_members(sid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return session_members(sid)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of ``pid`` itself (not its children), in seconds."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    # utime and stime are fields 14 and 15 of /proc/PID/stat.
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def status_kib(pid: int, key: str) -> int | None:
    """A ``kB`` line of ``/proc/PID/status`` (``VmRSS``, ``VmHWM``), or None."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def children(pid: int) -> list[int]:
    """Direct and indirect child pids of ``pid``."""
    parent_of: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None:
                parent_of[int(entry)] = int(fields[1])
    found: list[int] = []
    frontier = [pid]
    while frontier:
        current = frontier.pop()
        kids = [p for p, pp in parent_of.items() if pp == current]
        found.extend(kids)
        frontier.extend(kids)
    return found


def tree_cpu_seconds(pids: list[int]) -> float:
    """CPU seconds of the live processes ``pids`` (each its own, not their children)."""
    return sum(cpu_seconds(p) or 0.0 for p in pids)


def session_cpu_seconds(sid: int) -> float:
    """CPU seconds of every live process in session ``sid`` (engine: server, core, worker)."""
    return tree_cpu_seconds(session_members(sid))


def cpu_by_pid(pids: list[int]) -> dict[int, float]:
    """CPU seconds of each live process of ``pids`` (each its own), by pid."""
    found: dict[int, float] = {}
    for pid in pids:
        cpu = cpu_seconds(pid)
        if cpu is not None:
            found[pid] = cpu
    return found


def cmdline(pid: int) -> str | None:
    """``/proc/PID/cmdline`` with spaces for its NULs, or None once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")


def environ(pid: int) -> dict[str, str] | None:
    """The environment ``pid`` was started with (``/proc/PID/environ``), or None."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {key: value for key, _, value in pairs}
