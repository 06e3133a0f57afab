"""One spawned engine process ("a generation") and what identifies it on this host.

Owns what belongs to a single spawn: its :class:`EngineProcess`, the classifier reading
its lines, its failure verdict on the lines so far and when the first failure line came,
when it started and became ready (:class:`Generation`); the session file in the state
dir that lets the next daemon stop an engine a killed one left behind
(:class:`SessionFile`); and the port checks before a spawn and at readiness (a foreign
listener is ``port_in_use``, never our engine). The supervisor decides; this module
runs and inspects one process tree.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from chandrad.engine.classify import Diagnosis, FailureClass, LineScanner, action_for
from chandrad.engine.process import EngineProcess, kill_pids, oom_kill_count, process_name
from chandrad.engine.session import (
    EngineIdentity,
    boot_id,
    listening_inodes,
    socket_holders,
    stale_engine_pids,
)
from chandrad.events import Event

log = structlog.get_logger("chandrad.engine")

_VLLM_LEVEL = re.compile(r"\b(DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\b")


@dataclass
class Generation:
    """What belongs to one spawned engine (or one probing round of a remote one).

    ``early`` is the classifier's verdict on every line seen so far (None until a line
    proves a failure), ``early_at`` when the first failure line came: a later, more
    specific line (vLLM's KV-cache ValueError behind its "EngineCore failed to start.")
    replaces the verdict but does not restart the exit grace."""

    process: EngineProcess | None
    scanner: LineScanner = field(default_factory=LineScanner)
    early: Diagnosis | None = None
    early_at: float = 0.0
    started_at: float = field(default_factory=time.monotonic)
    ready_at: float | None = None
    oom_kills_at_start: int | None = field(default_factory=oom_kill_count)

    def line_sink(self, on_verdict: Callable[[], None],
                  logger: structlog.typing.FilteringBoundLogger | None = None,
                  ) -> Callable[[str, str], None]:
        """Log each engine line at vLLM's own level and feed it to the classifier;
        ``on_verdict`` is called once, at the first failure line; a later line that
        changes the verdict updates ``early`` (the scanner judges its whole tail)."""
        out = logger or log

        def sink(stream: str, line: str) -> None:
            level = _VLLM_LEVEL.search(line[:120])
            method = "info"
            if level and level.group(1) in ("WARNING", "WARN"):
                method = "warning"
            elif level and level.group(1) in ("ERROR", "CRITICAL"):
                method = "error"
            getattr(out, method)(Event.ENGINE_LINE, source="vllm", stream=stream, line=line)
            verdict = self.scanner.feed(line)
            if verdict is None:
                return
            first = self.early is None
            self.early = verdict
            if first:
                self.early_at = time.monotonic()
                on_verdict()
        return sink

    def verdict(self, exit_code: int | None, was_ready: bool) -> Diagnosis:
        """Why the engine ended: the classifier's verdict on its lines and exit status.
        ``exit_code`` None: on everything seen so far, for an engine that has not exited
        (given up on at the exit grace, or unresponsive); it may be asked again.

        A SIGKILL the kernel did not record as an OOM kill is an operator's or another
        program's (``killed``): restarted with the same profile, no downshift."""
        verdict = self.scanner.finish(exit_code, was_ready)
        if verdict.cls is FailureClass.NONE and self.early is not None:
            return self.early
        if verdict.cls is FailureClass.NONE and exit_code is not None:
            # Nobody asked it to stop (a requested stop never reaches here), yet its lines
            # name no failure: vLLM's API server exits 0 when its EngineCore dies
            # (vllm-project/vllm#48966). A failure all the same, counted by the budget.
            last = next((ln for ln in reversed(list(self.scanner.lines())) if ln), "")
            return Diagnosis(
                cls=FailureClass.ENGINE_EXITED,
                evidence=f"exited with status {exit_code} without being asked to stop"
                + (f"; its last line: {last[:300]}" if last else ""),
                numbers={"exit_status": float(exit_code)},
                action=action_for(FailureClass.ENGINE_EXITED),
                restartable=True, subclass=f"status_{exit_code}")
        if verdict.cls is FailureClass.HOST_OOM and verdict.subclass == "sigkill":
            now = oom_kill_count()
            if now is not None and self.oom_kills_at_start is not None \
                    and now == self.oom_kills_at_start:
                return Diagnosis(
                    cls=FailureClass.OTHER_FATAL,
                    evidence=f"{verdict.evidence} (the kernel recorded no OOM kill)",
                    numbers=verdict.numbers, action="restart with backoff, same profile",
                    restartable=True, subclass="killed")
        return verdict


class SessionFile:
    """The identity of the running engine, on disk (``<state_dir>/engine*.session``)."""

    def __init__(self, path: Path | None,
                 logger: structlog.typing.FilteringBoundLogger | None = None) -> None:
        self.path = path
        self.log = logger or log

    def record(self, identity: EngineIdentity | None) -> None:
        """Remember what identifies the engine on disk, so that after a crash of the daemon
        the next start can find and stop the engine it left behind (and nothing else)."""
        if self.path is None:
            return
        if identity is None:
            self.path.unlink(missing_ok=True)
        else:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(identity.to_json() + "\n")
            os.replace(tmp, self.path)

    async def reap(self, stop_timeout: float) -> None:
        """Stop an engine a previous daemon left behind: only processes that carry its
        token, and only in the boot it was spawned in."""
        if self.path is None or not self.path.exists():
            return
        try:
            text = self.path.read_text()
        except OSError:
            text = ""
        identity = EngineIdentity.from_json(text)
        if identity is None:
            self.log.warning("engine_stale_session_unverifiable", file=str(self.path),
                        content=text.strip()[:200],
                        reason="no engine identity recorded; nothing is killed")
        else:
            killed = await kill_pids(lambda: stale_engine_pids(identity), stop_timeout)
            if killed:
                self.log.warning("engine_stale_session_killed", sid=identity.pid,
                            pids=sorted(killed), file=str(self.path),
                            reason="left behind by a previous daemon that did not stop cleanly")
            else:
                self.log.info("engine_stale_session_gone", sid=identity.pid,
                         same_boot=identity.boot_id == boot_id())
        self.path.unlink(missing_ok=True)


def port_taken(port: int) -> Diagnosis | None:
    """Before a spawn: a failure if something already listens on the engine's port."""
    inodes = listening_inodes(port)
    if not inodes:
        return None
    who = _holders_text(inodes) or "a process chandrad cannot see"
    return _port_in_use(port, f"port {port} is already in use by {who}; not spawning the "
                        "engine")


def foreign_listener(port: int, gen: Generation) -> Diagnosis | None:
    """At readiness: a failure if the server answering on the port is not our engine."""
    if gen.process is None:
        return None
    inodes = listening_inodes(port)
    if socket_holders(inodes, gen.process.members()):
        return None
    who = _holders_text(inodes) or "holder not visible"
    return _port_in_use(port, f"a server that is not our engine answers on port {port} "
                        f"({who}); our engine does not hold the port")


def _port_in_use(port: int, evidence: str) -> Diagnosis:
    return Diagnosis(
        cls=FailureClass.OTHER_FATAL, evidence=evidence, numbers={"port": float(port)},
        action="stop the other server or change engine.port; retrying with backoff",
        restartable=True, subclass="port_in_use")


def _holders_text(inodes: set[int]) -> str:
    """The processes holding the listening sockets ``inodes``, for an evidence line."""
    return ", ".join(f"pid {p} ({process_name(p)[:80] or '?'})"
                     for p in sorted(socket_holders(inodes)))
