"""Who an engine is, and how to find every process and socket that is still its own.

Owns the identity chandrad records for each spawned engine and the ``/proc`` look-ups
built on it. Each spawn gets a random token, put into the engine's environment as
``CHANDRAD_ENGINE_TOKEN``; every descendant inherits it, including one that called
``setsid()`` or double-forked out of the engine's session. vLLM's EngineCore and workers
rename themselves with setproctitle, which overwrites their environment: they are found
through the engine's session instead (and, after a daemon's death, through the recorded
session, its leader's start time and their ``VLLM::`` names). So:

* **stopping** an engine kills its session *and* every process that carries its token
  (a descendant that left the session does not escape);
* **a session file left by a daemon that died** (``kill -9``, power loss) is trusted only
  as far as the token goes: after a reboot (another boot id), or for a pid that now
  belongs to some other program, nothing carries the token and nothing is killed;
* **readiness** counts only if the socket listening on the engine's port belongs to one
  of the engine's own processes (``/proc/net/tcp`` inode → ``/proc/PID/fd``), never to a
  foreign server that happens to answer on that port.

Why not a cgroup per engine or ``PR_SET_CHILD_SUBREAPER``: a cgroup needs a delegated,
writable cgroup v2 subtree (systemd ``Delegate=yes``), which neither this test machine
(hybrid v1) nor an unprivileged ``chandrad run`` has; a subreaper would make the daemon
the parent of every orphan, and reaping those with ``waitpid(-1)`` would steal the exit
statuses that asyncio's child watchers and the render pool wait for. A process that
wipes its environment (``env -i``) would still escape; vLLM does not.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path

#: The environment variable that marks every process of one engine spawn.
TOKEN_ENV = "CHANDRAD_ENGINE_TOKEN"
PROC = Path("/proc")
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


@dataclass(frozen=True)
class EngineIdentity:
    """What proves that a process is the engine chandrad spawned (saved in the state dir)."""

    pid: int  #: the leader (the API server); also its session and process-group id
    token: str  #: the per-spawn value of ``CHANDRAD_ENGINE_TOKEN``
    boot_id: str  #: ``/proc/sys/kernel/random/boot_id`` when it was spawned
    start_ticks: int | None  #: the leader's start time (``/proc/PID/stat`` field 22)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> EngineIdentity | None:
        """The identity in ``text``, or ``None`` for anything else (an old bare pid too)."""
        try:
            data = json.loads(text)
            return cls(pid=int(data["pid"]), token=str(data["token"]),
                       boot_id=str(data["boot_id"]),
                       start_ticks=None if data.get("start_ticks") is None
                       else int(data["start_ticks"]))
        except (ValueError, KeyError, TypeError):
            return None


def new_token() -> str:
    return secrets.token_hex(16)


def boot_id(proc: Path = PROC) -> str:
    try:
        return (proc / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _stat_fields(pid: int, proc: Path = PROC) -> list[str] | None:
    """``/proc/PID/stat`` after the command name (field 3 onwards), or ``None``."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: split after the last ')'.
    return stat.rpartition(")")[2].split()


def start_ticks(pid: int, proc: Path = PROC) -> int | None:
    """When ``pid`` started, in clock ticks since boot; ``None`` if it is gone."""
    fields = _stat_fields(pid, proc)
    return int(fields[19]) if fields and len(fields) > 19 else None


def identify(pid: int, token: str) -> EngineIdentity:
    """The identity of the engine just spawned as ``pid`` with ``token``."""
    return EngineIdentity(pid=pid, token=token, boot_id=boot_id(), start_ticks=start_ticks(pid))


def _pids(proc: Path = PROC) -> list[int]:
    return [int(e.name) for e in proc.iterdir() if e.name.isdigit()]


def carries(pid: int, name: str, value: str, proc: Path = PROC) -> bool:
    """Whether ``pid``'s environment has ``name=value`` (and it is alive)."""
    try:
        environ = (proc / str(pid) / "environ").read_bytes()
    except OSError:
        return False
    return f"\0{name}={value}\0".encode() in b"\0" + environ + b"\0"


def environment_holders(name: str, value: str, proc: Path = PROC) -> set[int]:
    """Every live process (zombies excluded, ours excluded) whose environment has
    ``name=value``."""
    own = os.getpid()
    found: set[int] = set()
    for pid in _pids(proc):
        if pid != own and carries(pid, name, value, proc):
            fields = _stat_fields(pid, proc)
            if fields and fields[0] != "Z":
                found.add(pid)
    return found


def token_holders(token: str, proc: Path = PROC) -> set[int]:
    """Every live process (zombies excluded, ours excluded) that carries ``token``."""
    return environment_holders(TOKEN_ENV, token, proc)


def stale_engine_pids(identity: EngineIdentity, proc: Path = PROC) -> set[int]:
    """The processes of a recorded engine that are provably still that engine.

    Nothing from another boot; otherwise exactly the processes carrying its token.
    """
    if identity.boot_id != boot_id(proc):
        return set()
    return token_holders(identity.token, proc) | _renamed_session_members(identity, proc)


def _renamed_session_members(identity: EngineIdentity, proc: Path = PROC) -> set[int]:
    """vLLM renames its EngineCore and workers (``VLLM::…``) with setproctitle, which
    overwrites their environment, token included; once the API server has died, nothing
    else names them. Take the processes so renamed in the recorded session that started
    no earlier than its leader — unless the leader's pid now belongs to another process."""
    if identity.start_ticks is None:
        return set()
    leader = start_ticks(identity.pid, proc)
    if leader is not None and leader != identity.start_ticks:
        return set()  # the pid was reused: that session is somebody else's
    found: set[int] = set()
    for pid in _pids(proc):
        fields = _stat_fields(pid, proc)
        if (fields is None or len(fields) <= 19 or fields[0] == "Z"
                or int(fields[3]) != identity.pid or int(fields[19]) < identity.start_ticks):
            continue
        try:
            cmdline = (proc / str(pid) / "cmdline").read_bytes()
        except OSError:
            continue
        if cmdline.startswith(b"VLLM::"):
            found.add(pid)
    return found


def listening_inodes(port: int, proc: Path = PROC) -> set[int]:
    """Inodes of the TCP sockets (v4 and v6) listening on ``port``, any address."""
    inodes: set[int] = set()
    suffix = f":{port:04X}"
    for table in ("net/tcp", "net/tcp6"):
        try:
            lines = (proc / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[1].endswith(suffix) and cols[3] == _LISTEN:
                inodes.add(int(cols[9]))
    return inodes


def socket_holders(inodes: set[int], pids: set[int] | None = None,
                   proc: Path = PROC) -> set[int]:
    """Which of ``pids`` (default: every process) hold one of the socket ``inodes``."""
    if not inodes:
        return set()
    links = {f"socket:[{inode}]" for inode in inodes}
    holders: set[int] = set()
    for pid in sorted(pids) if pids is not None else _pids(proc):
        fd_dir = proc / str(pid) / "fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd_dir / fd) in links:
                    holders.add(pid)
                    break
            except OSError:
                continue
    return holders
