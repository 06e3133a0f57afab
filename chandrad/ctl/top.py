"""``chandractl top``: a live view of a running chandrad, refreshed from the control socket.

On a terminal: a full-screen rich view (engine state and profile, one progress bar per
running job with pages done/total and ETA, pages/min, recent failures) that exits on
``q`` or Ctrl-C. Otherwise (a pipe, a log): one plain line per refresh. Each refresh is
one connection asking ``status`` and ``queue`` (read tier); the view is built from the
replies only, as :class:`Snapshot`, so both outputs show the same facts.

``drain --wait`` and ``reload --wait`` show the same view while they wait
(:func:`wait_showing_progress`): live on a terminal (cleared when the reply comes),
otherwise a plain line on stderr when what it says changes (at least one every
``WAIT_PLAIN_INTERVAL`` seconds), so that stdout keeps only the reply for scripts.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import termios
import threading
import time
import tty
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from chandrad.ctl.client import ControlClient
from chandrad.ctl.render import _profile, duration

#: Failed or partial jobs shown, newest first.
RECENT_FAILURES = 5
#: Running jobs shown (the rest are counted).
MAX_JOBS = 20
#: ``drain --wait`` / ``reload --wait``: seconds between refreshes, on a terminal / not.
WAIT_TTY_INTERVAL = 1.0
WAIT_PLAIN_INTERVAL = 30.0


@dataclass
class JobLine:
    id: int
    name: str
    done: int
    failed: int
    total: int | None
    eta_s: float | None


@dataclass
class Snapshot:
    """What one refresh shows, built from one ``status`` and ``queue`` reply."""

    daemon_state: str
    uptime_s: float
    engines: list[dict[str, Any]]
    pages_per_min: float
    queue: dict[str, int]
    jobs: list[JobLine]
    more_jobs: int
    failures: list[dict[str, Any]]
    eta_s: float | None
    taken_at: float


def fetch(socket_path: Path) -> Snapshot:
    """One refresh: status, running jobs and recent failures, over one connection (a new
    one each time, so a refresh never outlives the daemon's idle limit)."""
    with ControlClient(socket_path, timeout=30.0) as client:
        status = client.request("status")
        running = client.request("queue", {"state": "running"})["jobs"]
        failed = (client.request("queue", {"state": "failed"})["jobs"]
                  + client.request("queue", {"state": "partial"})["jobs"])
    return build(status, running, failed, time.time())


def build(status: dict[str, Any], running: list[dict[str, Any]],
          failed: list[dict[str, Any]], now: float) -> Snapshot:
    rate = float((status.get("throughput") or {}).get("pages_per_min_1m") or 0.0)
    jobs = []
    for job in running[:MAX_JOBS]:
        done, total = int(job.get("pages_done") or 0), job.get("pages_total")
        started = job.get("started_at")
        eta = None
        if total and done and isinstance(started, (int, float)) and now > started:
            eta = (int(total) - done - int(job.get("pages_failed") or 0)) * (now - started) / done
        jobs.append(JobLine(int(job["id"]), Path(str(job["path"])).name, done,
                            int(job.get("pages_failed") or 0),
                            int(total) if total is not None else None, eta))
    remaining = sum((j.total or 0) - j.done - j.failed for j in jobs)
    failures = sorted(failed, key=lambda j: float(j.get("finished_at") or j.get("updated_at")
                                                   or 0.0), reverse=True)[:RECENT_FAILURES]
    daemon = status.get("daemon") or {}
    return Snapshot(
        daemon_state=str(daemon.get("state", "?")), uptime_s=float(daemon.get("uptime_s") or 0),
        engines=[status.get("engine") or {}], pages_per_min=rate,
        queue=dict(status.get("queue") or {}), jobs=jobs,
        more_jobs=max(0, len(running) - MAX_JOBS), failures=failures,
        eta_s=remaining / rate * 60 if rate > 0 and remaining else None, taken_at=now)


def _eta(seconds: float | None) -> str:
    return duration(seconds) if seconds is not None else "-"


def _failure_reason(job: dict[str, Any]) -> str:
    if job.get("state") == "partial":
        return f"{job.get('pages_failed')} page(s) failed"
    return f"{job.get('error_code') or 'failed'}: {job.get('error_message') or ''}"[:100]


# ------------------------------------------------------------------ plain lines

def plain_line(s: Snapshot) -> str:
    """One line per refresh, for pipes and logs."""
    engine = s.engines[0] if s.engines else {}
    q = s.queue
    parts = [time.strftime("%H:%M:%S", time.localtime(s.taken_at)),
             f"daemon={s.daemon_state}", f"engine={engine.get('state', '?')}",
             f"pages/min={s.pages_per_min:g}",
             f"pending={q.get('pending', 0)} running={q.get('active', 0)} "
             f"done={q.get('done', 0)} failed={q.get('failed', 0)}"]
    for job in s.jobs:
        total = "?" if job.total is None else str(job.total)
        parts.append(f"job {job.id} {job.name} {job.done}/{total} eta={_eta(job.eta_s)}")
    return "  ".join(parts)


# ------------------------------------------------------------------ full screen

def screen(s: Snapshot, footer: str = "q or Ctrl-C to quit") -> Any:
    """The rich renderable of one refresh."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    q = s.queue
    head = Text.assemble(
        ("chandrad ", "bold"), (s.daemon_state, "bold cyan"),
        f"  up {duration(s.uptime_s)}  ", ("pages/min ", "bold"), f"{s.pages_per_min:g}",
        f"  queue: pending {q.get('pending', 0)}  running {q.get('active', 0)}  "
        f"done {q.get('done', 0)}  partial {q.get('partial', 0)}  failed {q.get('failed', 0)}",
        f"  ETA {_eta(s.eta_s)}")
    engines = Table(title="engines", title_justify="left", expand=True)
    for col in ("engine", "state", "for", "pid", "restarts", "profile"):
        engines.add_column(col, overflow="fold")
    colours = {"ready": "green", "starting": "yellow", "backoff": "yellow", "failed": "red",
               "fatal": "bold red"}
    for i, e in enumerate(s.engines):
        state = str(e.get("state", "?"))
        profile = f"{e.get('profile_source', '')}: {_profile(e.get('profile'))}"
        if e.get("fatal_reason"):
            profile = f"FATAL: {e['fatal_reason']}"
        engines.add_row(str(i), Text(state, colours.get(state, "")),
                        duration(e.get("state_for_s")), str(e.get("pid") or "-"),
                        str(e.get("restarts", 0)), profile)
    jobs = Table(title="running jobs", title_justify="left", expand=True)
    jobs.add_column("job", justify="right")
    jobs.add_column("file", overflow="ellipsis", no_wrap=True, max_width=40)
    jobs.add_column("progress", ratio=1)
    jobs.add_column("pages", justify="right")
    jobs.add_column("ETA", justify="right")
    for job in s.jobs:
        total = job.total or 0
        bar = ProgressBar(total=float(max(total, 1)), completed=float(job.done + job.failed))
        jobs.add_row(str(job.id), job.name, bar,
                     f"{job.done}/{total if job.total is not None else '?'}"
                     + (f" ({job.failed} failed)" if job.failed else ""), _eta(job.eta_s))
    if not s.jobs:
        jobs.add_row("", "(none)", "", "", "")
    if s.more_jobs:
        jobs.add_row("", f"… {s.more_jobs} more", "", "", "")
    fails = Table(title="recent failures", title_justify="left", expand=True)
    for col in ("job", "file", "state", "reason"):
        fails.add_column(col, overflow="fold")
    for failure in s.failures:
        fails.add_row(str(failure.get("id")), Path(str(failure.get("path"))).name,
                      str(failure.get("state")), _failure_reason(failure))
    return Group(head, engines, jobs, fails, Text(footer, style="dim"))


@contextlib.contextmanager
def _cbreak(fd: int) -> Iterator[None]:
    old = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, old)


def _quit_pressed(fd: int, timeout: float) -> bool:
    """Wait up to ``timeout`` for a key; True on ``q``/``Q``."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return False
        key = os.read(fd, 1)
        if key in (b"q", b"Q", b"\x03") or not key:
            return True
    return False


def run_top(socket_path: Path, interval: float, iterations: int | None, out: TextIO,
            tty_out: bool | None = None) -> int:
    """The ``top`` loop; returns 0 on ``q``, Ctrl-C or after ``iterations`` refreshes.
    Errors reaching the daemon propagate (ctl/main.py maps them to exit codes)."""
    if tty_out is None:
        tty_out = out.isatty() and sys.stdin.isatty()
    count = 0
    if not tty_out:
        try:
            while iterations is None or count < iterations:
                if count:
                    time.sleep(interval)
                out.write(plain_line(fetch(socket_path)) + "\n")
                out.flush()
                count += 1
        except KeyboardInterrupt:
            pass
        return 0
    from rich.console import Console
    from rich.live import Live

    console = Console(file=out)
    fd = sys.stdin.fileno()
    try:
        with _cbreak(fd), Live(screen(fetch(socket_path)), console=console, screen=True,
                               auto_refresh=False) as live:
            count = 1
            while iterations is None or count < iterations:
                if _quit_pressed(fd, interval):
                    break
                live.update(screen(fetch(socket_path)), refresh=True)
                count += 1
    except KeyboardInterrupt:
        pass
    return 0


def wait_showing_progress(socket_path: Path, command: str, args: dict[str, Any],
                          timeout: float | None, out: TextIO,
                          tty_out: bool | None = None) -> dict[str, Any]:
    """Send a waiting command (``drain``/``reload`` with ``wait``) and show the top view
    until its reply comes; returns the reply (errors propagate, as from ``call``).

    The command waits in a thread on its own connection; each refresh is a new read-tier
    connection, so the view never delays the reply. A refresh that fails (the daemon is
    busy restarting its engine, say) is skipped.
    """
    from chandrad.ctl.client import call

    if tty_out is None:
        tty_out = out.isatty()
    box: dict[str, Any] = {}

    def send() -> None:
        try:
            box["result"] = call(socket_path, command, args, timeout=timeout)
        except BaseException as exc:  # handed to the caller's thread below
            box["error"] = exc

    worker = threading.Thread(target=send, name=f"{command}-wait", daemon=True)
    worker.start()
    title = f"chandractl {command} --wait: waiting for the daemon"

    def refresh() -> Snapshot | None:
        try:
            return fetch(socket_path)
        except Exception:
            return None

    if tty_out:
        from rich.console import Console, Group
        from rich.live import Live
        from rich.text import Text

        with Live(Text(title), console=Console(file=out), auto_refresh=False,
                  transient=True) as live:
            while worker.is_alive():
                snap = refresh()
                if snap is not None:
                    live.update(Group(Text(title, style="bold"), screen(
                        snap, "Ctrl-C stops waiting (the daemon carries on)")), refresh=True)
                worker.join(WAIT_TTY_INTERVAL)
    else:
        err = sys.stderr
        last, last_at = "", 0.0
        while worker.is_alive():
            worker.join(WAIT_TTY_INTERVAL)
            if not worker.is_alive() or (snap := refresh()) is None:
                continue
            line = plain_line(snap)
            facts = line.split("  ", 1)[-1]  # without the time of day
            if facts != last or time.monotonic() - last_at >= WAIT_PLAIN_INTERVAL:
                err.write(f"{command}: waiting  {line}\n")
                err.flush()
                last, last_at = facts, time.monotonic()
    if "error" in box:
        raise box["error"]
    result: dict[str, Any] = box["result"]
    return result
