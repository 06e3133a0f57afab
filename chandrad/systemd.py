"""systemd integration: the sd_notify protocol and the progress-gated watchdog.

Owns everything chandrad says to the service manager over ``$NOTIFY_SOCKET`` (docs/systemd.md):
``READY=1``, ``STATUS=``, ``RELOADING=1`` + ``MONOTONIC_USEC``, ``STOPPING=1``,
``EXTEND_TIMEOUT_USEC=``, ``WATCHDOG=1``/``WATCHDOG=trigger``. The wire format is one
``AF_UNIX``/``SOCK_DGRAM`` datagram per message (``@`` = abstract namespace), encoded as
UTF-8 here; PyPI ``sdnotify`` encodes Latin-1 and silently drops a ``STATUS=`` naming a
file such as ``東京.pdf`` (bb4242/sdnotify#9), so it is not used. Without ``NOTIFY_SOCKET``
every call is a no-op, so the daemon runs the same in a terminal. Keeping the unit's
variables out of children's environments is the child's builder's job
(:func:`chandrad.engine.command.scrub_systemd_env`, pure, below this adapter).

It also reads the installed unit file (:func:`read_unit`) so that ``chandrad check-config
--unit`` finds what the unit's sandbox will refuse before systemd does
(:func:`unit_problems`): a folder outside ``ReadWritePaths=``, a ``[control] group``
the service user is not in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import grp
import logging
import os
import pwd
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from chandrad.config import Config
from chandrad.errors import ConfigProblem

_log = logging.getLogger(__name__)

#: One ``STATUS=`` line: systemctl shows a single line; keep the datagram small.
_MAX_STATUS_CHARS = 400


def _one_line(text: str) -> str:
    flat = " ".join(text.split())
    if len(flat) > _MAX_STATUS_CHARS:
        flat = flat[: _MAX_STATUS_CHARS - 1] + "…"
    return flat


class Notifier:
    """Sends sd_notify messages; a no-op when the process is not a notify service."""

    def __init__(
        self,
        address: str | None,
        *,
        watchdog_usec: int | None = None,
        watchdog_pid: int | None = None,
    ) -> None:
        self._address: str | None = None
        if address:
            # "@name" is the abstract namespace: a leading NUL byte on the wire.
            self._address = "\0" + address[1:] if address.startswith("@") else address
        self._watchdog_usec = watchdog_usec
        self._watchdog_pid = watchdog_pid
        self._sock: socket.socket | None = None
        self._failed_once = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Notifier:
        """Read ``NOTIFY_SOCKET``, ``WATCHDOG_USEC``, ``WATCHDOG_PID`` (default: ``os.environ``)."""
        env = os.environ if env is None else env

        def _int(name: str) -> int | None:
            raw = env.get(name, "").strip()
            return int(raw) if raw.isdigit() else None

        return cls(
            env.get("NOTIFY_SOCKET") or None,
            watchdog_usec=_int("WATCHDOG_USEC"),
            watchdog_pid=_int("WATCHDOG_PID"),
        )

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, *assignments: str) -> bool:
        """Send ``KEY=value`` lines as one datagram. False when disabled or on failure."""
        if self._address is None:
            return False
        payload = "\n".join(assignments).encode("utf-8")
        for attempt in (1, 2):
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    # systemd reads its queue promptly; never stall the event loop for long.
                    self._sock.settimeout(2.0)
                self._sock.sendto(payload, self._address)
                return True
            except OSError as exc:
                self._close()
                if attempt == 2:
                    if not self._failed_once:
                        self._failed_once = True
                        _log.warning("sd_notify to %r failed: %s", self._address, exc)
                    return False
        return False  # pragma: no cover - the loop always returns

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        self._close()

    def ready(self, status: str | None = None) -> None:
        """Start-up (or a reload) is complete."""
        lines = ["READY=1"]
        if status is not None:
            lines.append(f"STATUS={_one_line(status)}")
        self.notify(*lines)

    def status(self, text: str) -> None:
        """The one-line state shown by ``systemctl status``."""
        self.notify(f"STATUS={_one_line(text)}")

    def reloading(self) -> None:
        """A reload began. ``MONOTONIC_USEC`` is required by ``Type=notify-reload`` (v253+)."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.notify("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def stopping(self, status: str | None = None) -> None:
        """Shutdown began (drain follows)."""
        lines = ["STOPPING=1"]
        if status is not None:
            lines.append(f"STATUS={_one_line(status)}")
        self.notify(*lines)

    def extend_timeout(self, seconds: float) -> None:
        """Ask for ``seconds`` more before the current start/stop timeout fires."""
        self.notify(f"EXTEND_TIMEOUT_USEC={max(1, int(seconds * 1_000_000))}")

    def watchdog(self) -> None:
        """One keep-alive ping."""
        self.notify("WATCHDOG=1")

    def watchdog_interval(self) -> float | None:
        """Seconds between pings (half of ``WATCHDOG_USEC``), or None when no watchdog is ours."""
        if not self.enabled or not self._watchdog_usec:
            return None
        if self._watchdog_pid is not None and self._watchdog_pid != os.getpid():
            return None
        return self._watchdog_usec / 2 / 1_000_000


class WatchdogPinger:
    """Pings ``WATCHDOG=1`` each interval, but only if :meth:`progress` was called since the
    last and ``healthy()`` holds.

    The daemon's main loop calls ``progress()`` each time round; a loop that is stuck
    (or blocked) stops calling it, the pings stop, and systemd's ``WatchdogSec=`` fires.
    ``healthy`` is the task supervisor's verdict: a long-lived task that stays dead
    stops the pings too, so systemd restarts the service.
    """

    def __init__(self, notifier: Notifier, *, interval: float | None = None,
                 healthy: Callable[[], bool] | None = None) -> None:
        self._notifier = notifier
        self._interval = interval if interval is not None else notifier.watchdog_interval()
        self._healthy = healthy
        self._progressed = False
        self.pings = 0

    @property
    def interval(self) -> float | None:
        return self._interval

    def progress(self) -> None:
        """Record that the main loop completed a round."""
        self._progressed = True

    async def run(self) -> None:
        """Ping until cancelled; returns at once when there is no watchdog."""
        if self._interval is None:
            return
        while True:
            await asyncio.sleep(self._interval)
            if self._healthy is not None and not self._healthy():
                continue
            if self._progressed:
                self._progressed = False
                self._notifier.watchdog()
                self.pings += 1


# ---------------------------------------------------------------- the installed unit

#: Where ``check-config`` looks for the installed unit (scripts/install.sh writes the second).
UNIT_PATHS = (Path("/etc/systemd/system/chandrad.service"),
              Path("/usr/local/lib/systemd/system/chandrad.service"),
              Path("/usr/lib/systemd/system/chandrad.service"),
              Path("/lib/systemd/system/chandrad.service"))

#: ``ProtectHome=`` hides or freezes these (yes, read-only, tmpfs).
_HOME_TREES = (Path("/home"), Path("/root"), Path("/run/user"))
#: Where systemd puts ``StateDirectory=`` and friends for a system service.
_DIRECTORY_ROOTS = {"StateDirectory": Path("/var/lib"), "RuntimeDirectory": Path("/run"),
                    "CacheDirectory": Path("/var/cache"), "LogsDirectory": Path("/var/log")}


@dataclasses.dataclass(frozen=True)
class UnitSandbox:
    """What of a unit's ``[Service]`` decides whether chandrad's config can work under it."""

    path: Path
    user: str = ""
    group: str = ""
    supplementary: tuple[str, ...] = ()
    #: ``ProtectSystem=strict``: everything but ``writable`` is read-only.
    strict: bool = False
    protect_home: bool = False
    writable: tuple[Path, ...] = ()
    #: Whether the ``SystemCallFilter=`` lines, in order, leave ``chown`` allowed.
    chown_allowed: bool = True


def read_unit(path: Path) -> UnitSandbox:
    """Parse the ``[Service]`` settings :func:`unit_problems` needs (later lines win,
    list settings accumulate, an empty assignment resets, as systemd reads them)."""
    user = group = ""
    supplementary: list[str] = []
    writable: list[Path] = []  # ReadWritePaths=
    directories: dict[str, list[Path]] = {}  # StateDirectory= and friends
    strict = protect_home = False
    chown_allowed = True
    section = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
            continue
        if section != "[Service]" or "=" not in line:
            continue
        key, _, value = (part.strip() for part in line.partition("="))
        words = value.split()
        if key == "User":
            user = value
        elif key == "Group":
            group = value
        elif key == "SupplementaryGroups":
            supplementary = supplementary + words if words else []
        elif key == "ProtectSystem":
            strict = value == "strict"
        elif key == "ProtectHome":
            protect_home = value in ("yes", "true", "read-only", "tmpfs")
        elif key == "ReadWritePaths":
            writable = writable + [Path(w.lstrip("-+")) for w in words] if words else []
        elif key in _DIRECTORY_ROOTS:
            directories[key] = directories.get(key, []) + [
                _DIRECTORY_ROOTS[key] / w.split(":")[0] for w in words] if words else []
        elif key == "SystemCallFilter":
            deny = value.startswith("~")
            names = set(value.lstrip("~").split())
            if deny and names & {"@privileged", "@chown"}:
                chown_allowed = False
            elif not deny and names & {"@chown", "@system-service"}:
                chown_allowed = True
    return UnitSandbox(path, user, group, tuple(supplementary), strict, protect_home,
                       tuple(writable + sum(directories.values(), [])), chown_allowed)


def _within(path: Path, roots: tuple[Path, ...]) -> bool:
    return any(path == root or root in path.parents for root in roots)


def _member(user: str, group: str, unit: UnitSandbox) -> str | None:
    """None when ``user`` (as the unit runs it) holds ``group``, else why not."""
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        return f"group {group!r} does not exist (systemd-sysusers creates chandrad-ctl)"
    if group == unit.group or group in unit.supplementary:
        return None
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        return f"the unit's User={user} does not exist (run systemd-sysusers)"
    if gid in os.getgrouplist(entry.pw_name, entry.pw_gid):
        return None
    return (f"the unit's User={user} is not a member of {group!r}, so the socket cannot "
            f"be given that group (exit 78 under {unit.path}): `m {user} {group}` in "
            "sysusers.d, or SupplementaryGroups=")


def unit_problems(cfg: Config, unit: UnitSandbox) -> list[ConfigProblem]:
    """What ``unit``'s sandbox would refuse in ``cfg``: a folder chandrad writes that is
    read-only or hidden in the unit's mount namespace, a control group it cannot set."""
    problems: list[ConfigProblem] = []
    folders: list[tuple[str, Path]] = [("daemon.state_dir", cfg.daemon.state_dir)]
    for i, watch in enumerate(cfg.watch):
        folders += [(f"watch[{i}].{name}", getattr(watch, name))
                    for name in ("input", "output", "done", "failed")]
    for key, folder in folders:
        if unit.protect_home and _within(folder, _HOME_TREES):
            problems.append(ConfigProblem(
                key, f"{folder} is under a tree ProtectHome= hides from the service "
                f"({unit.path}); move it, or override ProtectHome= in a drop-in",
                code="config_sandbox"))
        elif unit.strict and not _within(folder, unit.writable):
            allowed = " ".join(map(str, unit.writable)) or "nothing"
            problems.append(ConfigProblem(
                key, f"{folder} is read-only for the service: ProtectSystem=strict and "
                f"it is outside ReadWritePaths=/StateDirectory= of {unit.path} ({allowed}); "
                "use a folder there, or add it with a drop-in "
                "(systemctl edit chandrad: ReadWritePaths=...)", code="config_sandbox"))
    group = cfg.control.group
    if group and unit.user:
        why = _member(unit.user, group, unit)
        if why is not None:
            problems.append(ConfigProblem("control.group", why, code="config_sandbox"))
        elif not unit.chown_allowed:
            problems.append(ConfigProblem(
                "control.group", f"{unit.path}'s SystemCallFilter= forbids chown, so the "
                "socket cannot be given that group; add SystemCallFilter=@chown after the "
                "~@privileged line", code="config_sandbox"))
    return problems
