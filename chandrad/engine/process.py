"""The OS side of one engine child: spawn, read its output, stop it, prove it is gone.

Owns one ``vllm serve`` process *session*: the API server is started with
``start_new_session=True``, so it and everything it forks (``VLLM::EngineCore``,
``VLLM::Worker``) share its session id. vLLM leaves EngineCore and workers running
(holding GPU memory) when only the API server dies, so stopping signals the whole
process group and then hunts every process of the session through ``/proc`` — plus
whatever ``also_members`` finds (the supervisor passes the per-spawn token look-up of
:mod:`chandrad.engine.session`, which catches descendants that left the session with
``setsid``). Knows nothing about states or failure classes; the supervisor owns those.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path

#: Longest engine output line kept whole; longer lines are cut (tracebacks of tensors).
MAX_LINE_BYTES = 64 * 1024
#: After the API server exits, its output is read until the pipes close, or until no line
#: came for OUTPUT_QUIET_S, and at most OUTPUT_DRAIN_S: a survivor of its session (vLLM's
#: engine core outlives a killed API server) holds the pipes open without writing.
OUTPUT_QUIET_S = 0.5
OUTPUT_DRAIN_S = 5.0

LineSink = Callable[[str, str], None]  # (stream name, line)


def session_members(sid: int, proc: Path = Path("/proc")) -> set[int]:
    """Every live pid whose session id is ``sid`` (zombies excluded)."""
    members: set[int] = set()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may contain spaces and parentheses: split after the last ')'.
        fields = stat.rpartition(")")[2].split()
        if len(fields) < 4:
            continue
        state, session = fields[0], fields[3]
        if state != "Z" and int(session) == sid:
            members.add(int(entry.name))
    return members


def oom_kill_count(vmstat: Path = Path("/proc/vmstat")) -> int | None:
    """The kernel's count of OOM-killer kills since boot (``oom_kill`` in /proc/vmstat,
    Linux ≥ 4.13), or ``None`` where it cannot be read. A SIGKILL of the engine with this
    counter unchanged was somebody's ``kill -9``, not the host running out of RAM."""
    try:
        for line in vmstat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def process_name(pid: int) -> str:
    """The process title (``VLLM::EngineCore`` etc.) or ``""`` if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


async def kill_pids(find: Callable[[], set[int]], timeout: float) -> set[int]:
    """SIGTERM, then SIGKILL, every process ``find()`` returns (never ourselves).

    For an engine left behind by a daemon that died without stopping it: ``find`` is
    what proves a process is still that engine. Returns the pids that were found.
    """
    def alive() -> set[int]:
        return find() - {os.getpid()}

    found = alive()
    if not found:
        return set()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (timeout if sig == signal.SIGTERM else 5.0)
        while alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
    return found


class EngineProcess:
    """One spawned engine session. Create, :meth:`start`, then :meth:`stop` exactly once."""

    def __init__(
        self,
        argv: Sequence[str],
        env: dict[str, str],
        on_line: LineSink,
        cwd: Path | None = None,
        also_members: Callable[[], set[int]] | None = None,
    ) -> None:
        self.argv = list(argv)
        self.env = env
        self._also_members = also_members or set
        self.on_line = on_line
        self.cwd = cwd
        self._proc: asyncio.subprocess.Process | None = None
        self._readers: list[asyncio.Task[None]] = []
        self.started_at = 0.0
        self.known_pids: set[int] = set()
        self._lines = 0  # lines read so far, both streams

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc else None

    async def start(self) -> None:
        """Spawn the child in a new session and start the line readers.

        Raises:
            OSError: the program could not be executed.
        """
        self._proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self.env,
            cwd=self.cwd,
            start_new_session=True,
            limit=MAX_LINE_BYTES,
        )
        self.started_at = time.monotonic()
        self.known_pids = {self._proc.pid}
        assert self._proc.stdout is not None and self._proc.stderr is not None
        self._readers = [
            asyncio.create_task(self._read(self._proc.stdout, "stdout")),
            asyncio.create_task(self._read(self._proc.stderr, "stderr")),
        ]

    async def _read(self, stream: asyncio.StreamReader, name: str) -> None:
        while True:
            try:
                raw = await stream.readline()
            except ValueError:
                # Line longer than the limit: take what is buffered and go on.
                raw = await stream.read(MAX_LINE_BYTES)
            except (asyncio.LimitOverrunError, ConnectionError):
                raw = await stream.read(MAX_LINE_BYTES)
            if not raw:
                return
            self._lines += 1
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            if line:
                self.on_line(name, line)

    async def wait(self) -> int:
        """Wait for the API server to exit and its output to be read: to the end, or until
        it has gone quiet (``OUTPUT_QUIET_S``; at most ``OUTPUT_DRAIN_S``)."""
        assert self._proc is not None
        code = await self._proc.wait()
        deadline = time.monotonic() + OUTPUT_DRAIN_S
        while self._readers and not all(r.done() for r in self._readers):
            before = self._lines
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await asyncio.wait(self._readers, timeout=min(OUTPUT_QUIET_S, left))
            if self._lines == before:
                break
        return code

    def members(self) -> set[int]:
        """Every live process of this engine: its session, plus what ``also_members``
        finds (descendants that left the session)."""
        if self._proc is None:
            return set()
        alive = session_members(self._proc.pid) | self._also_members()
        self.known_pids |= alive
        return alive

    def escaped(self) -> set[int]:
        """Live processes of this engine outside its session (they called ``setsid``)."""
        if self._proc is None:
            return set()
        return self._also_members() - session_members(self._proc.pid)

    def survivors(self) -> set[int]:
        """Processes of this engine that are still alive (see :meth:`members`)."""
        return self.members()

    def _signal_all(self, sig: int) -> None:
        assert self._proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)
        # Members that moved to another process group but kept the session.
        for pid in self.survivors():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    async def stop(self, timeout: float) -> set[int]:
        """SIGTERM the whole session (with SIGCONT), SIGKILL what is left after ``timeout``.

        Returns:
            The pids that were still alive after SIGKILL and a grace period (should be
            empty; a process stuck in the kernel can survive SIGKILL).
        """
        if self._proc is None:
            return set()
        self.survivors()  # remember every member before they start dying
        self._signal_all(signal.SIGTERM)
        # As systemd does at a stop: a stopped member (SIGSTOP, a debugger, a hung-engine
        # drill) keeps the SIGTERM pending and would wait out the whole timeout for the
        # SIGKILL; resumed, it handles the SIGTERM and cleans up at once.
        self._signal_all(signal.SIGCONT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.returncode is None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._proc.wait(), timeout=0.2)
            elif not self.survivors():
                break
            else:
                await asyncio.sleep(0.2)
        if self._proc.returncode is None or self.survivors():
            self._signal_all(signal.SIGKILL)
        for _ in range(50):
            if self._proc.returncode is not None and not self.survivors():
                break
            if self._proc.returncode is None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._proc.wait(), timeout=0.1)
            else:
                await asyncio.sleep(0.1)
        for task in self._readers:
            task.cancel()
        return self.survivors()
