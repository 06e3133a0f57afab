"""Starting and stopping one engine's generations (the supervisor decides when).

:class:`Spawner` runs what stands between a start and a running ``vllm serve``: the model
present when offline, vLLM's parser's verdict on the flags (``engine/flagcheck.py``, once
per config), the port free, then :func:`start`, which execs the engine in its own session
with a per-spawn token in its environment (every process of it carries the token, even
one that leaves the session: ``engine/session.py``) and records its identity in the
session file. :func:`stop` stops the whole session, says which processes escaped it or
survived, and waits for the GPU memory they held to be freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

import structlog

from chandrad.config import EngineConfig
from chandrad.engine.classify import Diagnosis, FailureClass
from chandrad.engine.command import EngineCommand as EngineArgv
from chandrad.engine.command import build_engine_command
from chandrad.engine.fetching import FetchChild, must_fetch, offline_not_cached
from chandrad.engine.flagcheck import FlagChecks, judge
from chandrad.engine.generation import Generation, SessionFile, port_taken
from chandrad.engine.inbox import Inbox
from chandrad.engine.process import EngineProcess, process_name
from chandrad.engine.profile import MemoryProfile
from chandrad.engine.session import TOKEN_ENV, identify, new_token, token_holders
from chandrad.errors import ConfigError, ConfigProblem
from chandrad.events import Event
from chandrad.states import EngineCommand

GPU_RELEASE_TIMEOUT = 30.0

Logger = structlog.typing.FilteringBoundLogger


class GpuMemory(Protocol):
    """Which of some processes hold GPU memory, and how much (NVML)."""

    def memory_held_by(self, pids: set[int]) -> dict[int, int]: ...


class Spawner:
    """One engine's spawns: what is checked before each, and the exec."""

    def __init__(self, *, base_env: Mapping[str, str], cpus: str, flag_checks: FlagChecks,
                 session: SessionFile, gpu: GpuMemory, inbox: Inbox, log: Logger) -> None:
        self.base_env = base_env
        self.cpus = cpus
        #: vLLM's verdict on the flags, shared by the replicas of one config.
        self.flag_checks = flag_checks
        self.session = session
        self.gpu = gpu
        self.inbox = inbox
        self.log = log
        self._flags_checked: EngineConfig | None = None

    def must_fetch(self, engine: EngineConfig) -> bool:
        """The model must be downloaded before this engine can start."""
        return not engine.offline and must_fetch(engine, self.base_env)

    async def fetch(self, child: FetchChild) -> EngineCommand | tuple[int, Diagnosis | None]:
        """Run the model's fetch child to its end: its exit status and failure (None: the
        model is here), or the ``stop``, ``restart`` or ``shutdown`` that ended it."""
        await child.start()
        ended = asyncio.ensure_future(child.wait())
        try:
            command = await self.inbox.heed(ended)
            return command if command is not None else ended.result()
        finally:
            await child.stop()
            ended.cancel()

    async def check_flags(self, engine: EngineConfig,
                          profile: MemoryProfile) -> list[ConfigProblem]:
        """Validate the engine flags with the installed vLLM's own parser, in a child
        process (the daemon never imports vLLM)."""
        t0 = time.monotonic()
        problems, cached = await self.flag_checks.run(engine, profile)
        self.log.info("engine_flags_checked", problems=[str(p) for p in problems],
                      cached=cached, seconds=round(time.monotonic() - t0, 1))
        if not problems:
            self._flags_checked = engine  # a reload's check also serves the spawn after it
        return problems

    async def start(self, gen: Generation, engine: EngineConfig, profile: MemoryProfile, *,
                    flags_profile: MemoryProfile,
                    on_command: Callable[[EngineCommand], Awaitable[bool]]) -> Diagnosis | bool:
        """Start ``gen`` with ``profile``: True once spawned, a diagnosis when it cannot
        start, False when a queued command (``on_command``) ended the start. Raises
        ``ConfigError`` when vLLM's parser refuses a flag (before the GPU is touched)."""
        if engine.offline and must_fetch(engine, self.base_env):
            return offline_not_cached(engine, self.base_env)
        if self._flags_checked != engine:
            problems = await self._check_flags_heeding(engine, flags_profile, on_command)
            if problems is None:
                return False
            verdict, check_failed = judge(problems)
            if verdict:
                raise ConfigError(verdict)
            if check_failed is not None:  # the check itself could not run: retried
                return check_failed
            self._flags_checked = engine
        busy = port_taken(engine.port)
        if busy:
            return busy
        command = build_engine_command(engine, profile, base_env=self.base_env,
                                       python=engine.python or None, cpus=self.cpus)
        failed = await start(gen, command, on_verdict=self.inbox.wake, session=self.session,
                             log=self.log)
        return True if failed is None else failed

    async def stop(self, process: EngineProcess, stop_timeout: float) -> None:
        """Stop a spawned engine (:func:`stop`); the session file no longer names it."""
        await stop(process, stop_timeout, memory_held_by=self.gpu.memory_held_by, log=self.log)
        self.session.record(None)

    async def _check_flags_heeding(
            self, engine: EngineConfig, profile: MemoryProfile,
            on_command: Callable[[EngineCommand], Awaitable[bool]]) -> list[ConfigProblem] | None:
        """The spawn's flag check (a child importing vLLM: up to a minute), while queued
        commands are still heard: a stop, restart or shutdown is handed to ``on_command``,
        the check ends (its child is killed) and None is returned."""
        check = asyncio.ensure_future(self.check_flags(engine, profile))
        try:
            command = await self.inbox.heed(check)
            if command is not None:
                await on_command(command)
                return None
            return check.result()
        finally:
            if not check.done():
                check.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await check


async def start(gen: Generation, command: EngineArgv, *, on_verdict: Callable[[], None],
                session: SessionFile, log: Logger) -> Diagnosis | None:
    """Exec ``command`` as ``gen``'s process; a diagnosis (``gen.early``) when it cannot
    be executed."""
    token = new_token()
    process = EngineProcess(command.argv, {**command.env, TOKEN_ENV: token},
                            gen.line_sink(on_verdict, log),
                            also_members=lambda: token_holders(token))
    gen.process = process
    gen.started_at = time.monotonic()
    log.info("engine_command", argv=" ".join(command.argv))
    try:
        await process.start()
    except OSError as exc:
        gen.early = Diagnosis(
            cls=FailureClass.OTHER_FATAL, evidence=f"cannot execute {command.argv[0]}: "
            f"{exc.strerror}", numbers={}, action="fix engine.python / engine.command",
            restartable=False, subclass="exec_failed")
        gen.process = None
        return gen.early
    log.info(Event.ENGINE_SPAWNED, pid=process.pid)
    if process.pid is not None:
        session.record(identify(process.pid, token))
    return None


async def stop(process: EngineProcess, stop_timeout: float, *,
               memory_held_by: Callable[[set[int]], dict[int, int]], log: Logger) -> None:
    """Stop the engine's session, log what escaped it or survived, wait for its GPU memory."""
    escaped = process.escaped()
    if escaped:
        log.warning("engine_escaped_session", pids=sorted(escaped),
                    names=[process_name(p) for p in sorted(escaped)],
                    reason="descendants that called setsid; found by the engine's token")
    survivors = await process.stop(stop_timeout)
    if survivors:
        log.error(Event.ENGINE_ORPHANS, pids=sorted(survivors),
                  names=[process_name(p) for p in sorted(survivors)])
    pids = process.known_pids
    deadline = time.monotonic() + GPU_RELEASE_TIMEOUT
    held = memory_held_by(pids)
    while held and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        held = memory_held_by(pids)
    if held:
        log.error(Event.ENGINE_GPU_MEMORY_HELD, pids=sorted(held), bytes=sum(held.values()))
