"""The engine supervisor: the SPEC §4.1 state machine and the only writer of engine state.

Owns the single :class:`EngineProcess` and :class:`EngineClient`, feeds the engine's
output to the failure classifier, applies the downshift ladder, enforces the restart
budget, and persists the profile that proved stable. Everything else talks to it
through :meth:`request` (operator commands, queued) and the read-only properties
(the ``EngineHandle`` protocol the pipeline uses).

One ``run()`` task drives the machine; every change goes through :meth:`_transition`,
which refuses an edge that ``states.ENGINE_TRANSITIONS`` does not allow.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import structlog

from chandrad.config import EngineConfig, OcrConfig
from chandrad.engine.budget import RestartBudget
from chandrad.engine.classify import Diagnosis, FailureClass, action_for
from chandrad.engine.client import EngineClient
from chandrad.engine.command import (
    build_engine_command,
    engine_flags,
    engine_python,
    validate_in_child,
)
from chandrad.engine.fetching import FetchChild, must_fetch, offline_not_cached
from chandrad.engine.flagcache import FlagVerdictCache, verdict_key
from chandrad.engine.generation import Generation, SessionFile, foreign_listener, port_taken
from chandrad.engine.learned import learned_key, vllm_version_of
from chandrad.engine.policy import ProfileChange, ProfilePolicy
from chandrad.engine.process import EngineProcess, process_name
from chandrad.engine.profile import GpuFacts, MemoryProfile, initial_profile
from chandrad.engine.progress import ProgressWatch
from chandrad.engine.session import TOKEN_ENV, identify, new_token, token_holders
from chandrad.errors import (
    ConfigError,
    ConfigProblem,
    EngineUnavailable,
    InternalError,
    StoreFull,
)
from chandrad.events import Event
from chandrad.interfaces import ChatBody, Observer
from chandrad.protocol import EngineStatus, FailureStatus
from chandrad.states import ENGINE_TRANSITIONS, EngineCommand, EngineState

log = structlog.get_logger("chandrad.engine")

#: Consecutive failed health probes after which a ready engine is declared failed.
HEALTH_FAILURES_TO_FAIL = 3
HEALTH_INTERVAL = 5.0
#: How often the engine's scheduler series are scraped while chandrad has requests at it,
#: and while it has none: a scrape costs the daemon ~4 ms of CPU (httpx and vLLM's 50 KB
#: page), so every 2 s it was ~0.2 % of a CPU on an idle daemon.
METRICS_INTERVAL = 2.0
METRICS_IDLE_INTERVAL = 10.0
#: After a failure line is seen during start-up, how long the engine may take to exit.
EXIT_GRACE_AFTER_FATAL_LINE = 20.0
GPU_RELEASE_TIMEOUT = 30.0
DEFAULT_REMOTE_CAPACITY = 64
#: Problem code of a flag check that could not run (child timed out, was killed, could not
#: import vLLM, or answered garbage). Only a verdict of vLLM's parser is a config error;
#: this is an engine start failure, retried with backoff (issue 16 #3).
FLAG_CHECK_FAILED_CODES = frozenset({"engine_vllm_missing"})

__all__ = ["EngineSupervisor", "GpuProbe", "LearnedProfiles", "ProfileChange"]


class LearnedProfiles(Protocol):
    """Where profiles that proved stable are kept (the store)."""

    def load_learned_profile(self, key: str) -> dict[str, Any] | None: ...

    def save_learned_profile(self, key: str, profile: dict[str, Any]) -> None: ...


class GpuProbe(Protocol):
    """NVML as the supervisor needs it (``chandrad.gpu`` behind it)."""

    def facts(self, gpus: str) -> GpuFacts | None:
        """NVML facts of the GPU ``engine.gpus`` sizes from (``gpu.sizing_gpu``)."""
        ...

    def identity(self, gpus: str) -> tuple[str, int]: ...

    def memory_held_by(self, pids: set[int]) -> dict[int, int]: ...


class FlagChecks:
    """vLLM's parser's verdict on the engine flags, one check per config for every replica.

    Replicas differ only in port, GPUs and CPU list, which the parser does not judge: N
    replicas starting at once share one child (on a small host N children importing vLLM
    at once could each exceed the check's deadline). Only a clean verdict is kept, here
    and, with ``cache``, on disk for the next daemon (``engine/flagcache.py``); a check
    with problems runs again next time."""

    def __init__(self, cache: FlagVerdictCache | None = None) -> None:
        self.cache = cache
        self._checks: dict[str, asyncio.Future[tuple[list[ConfigProblem], bool]]] = {}
        self._waiters: dict[str, int] = {}

    async def run(self, engine: EngineConfig,
                  profile: MemoryProfile) -> tuple[list[ConfigProblem], bool]:
        """The problems vLLM's parser finds, and whether a stored clean verdict answered."""
        judged = replace(engine, port=0, gpus="", cpu_affinity=())  # what the parser sees
        key = repr(judged)
        check = self._checks.get(key)
        if check is None:
            check = self._checks[key] = asyncio.ensure_future(
                self._check(key, judged, engine, profile))
        self._waiters[key] = self._waiters.get(key, 0) + 1
        try:
            problems, cached = await asyncio.shield(check)
        except BaseException:
            if self._waiters[key] == 1 and not check.done():
                check.cancel()  # the last one waiting was stopped: kill the child
            if self._waiters[key] == 1 or check.done():
                self._checks.pop(key, None)
            raise
        finally:
            self._waiters[key] -= 1
        if problems:
            self._checks.pop(key, None)
        return problems, cached

    async def _check(self, key: str, judged: EngineConfig, engine: EngineConfig,
                     profile: MemoryProfile) -> tuple[list[ConfigProblem], bool]:
        python = engine_python(engine)
        stored = None
        if self.cache is not None:
            flags = engine_flags(judged, profile)
            stored = await asyncio.to_thread(verdict_key, python, flags)
            if stored is not None and await asyncio.to_thread(self.cache.is_clean, stored):
                return [], True
        problems = await validate_in_child(engine, profile, engine.python or None)
        if not problems and self.cache is not None and stored is not None:
            await asyncio.to_thread(self.cache.remember_clean, stored)
        return problems, False


class EngineSupervisor:
    """Supervises one engine: local ``vllm serve`` or, with ``engine.url``, a remote one."""

    def __init__(
        self,
        engine: EngineConfig,
        ocr: OcrConfig,
        *,
        gpu: GpuProbe,
        profiles: LearnedProfiles | None = None,
        base_env: Mapping[str, str] | None = None,
        on_change: Callable[[EngineState, str], None] | None = None,
        session_file: Path | None = None,
        backlog: Callable[[], bool] | None = None,
        engine_id: str = "0",
        cpus: str = "",
        flag_checks: FlagChecks | None = None,
    ) -> None:
        self.engine = engine
        #: Which engine this is ("0", "1", …): the ``engine`` field of its journal entries
        #: and the ``engine`` label of its metrics (engine/replicas.py).
        self.engine_id = engine_id
        #: The CPU list it runs pinned to (``engine.cpu_affinity``), "" = not pinned.
        self.cpus = cpus
        self.log = log.bind(engine=engine_id)
        #: vLLM's verdict on the flags, shared by the replicas of one config.
        self.flag_checks = flag_checks or FlagChecks()
        self.session = SessionFile(session_file, self.log)
        self.ocr = ocr
        self.gpu = gpu
        self.profiles = profiles
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.on_change = on_change
        self._state = EngineState.STOPPED
        self.state_since = time.monotonic()
        #: The profile in force, the ladder's memory and the upshift probe (engine/policy.py).
        self.policy = ProfilePolicy(initial_profile(engine.memory, self._gpu_total()),
                                    engine.downshift)
        #: Failures in the window, the backoff, restarts so far (engine/budget.py).
        self.budget = RestartBudget(engine.downshift)
        self.last_failure: Diagnosis | None = None
        self.last_failure_at: float | None = None
        self._failed_after_ready = False
        self._gen: Generation | None = None
        self.fetch_child: FetchChild | None = None  # while FETCHING
        self._client = EngineClient(engine.base_url, api_key=engine.api_key,
                                    timeout=ocr.request_timeout,
                                    health_path=engine.health_path)
        self._commands: asyncio.Queue[EngineCommand] = asyncio.Queue()
        self._ready_event = asyncio.Event()
        self._probe_now = asyncio.Event()
        self._stable = False
        self.fatal_reason = ""
        self.metrics: dict[str, float] = {}
        self._chats_in_flight = 0
        #: Requests the engine answered (any answer), since the daemon started.
        self._chats_answered = 0
        #: The requests at the engine now, each its own task: a failure cuts them at once.
        self._chat_calls: set[asyncio.Future[dict[str, Any]]] = set()
        #: Requests in flight and no progress for engine.progress_timeout: hung.
        self.progress = ProgressWatch(engine.progress_timeout)
        self._flags_checked: EngineConfig | None = None
        self.generation = 0  # bumped at every spawn: lets a waiter see "a new engine"
        self.backlog = backlog or (lambda: False)
        self.observer: Observer | None = None  # metrics: profile changes by reason
        #: The vLLM version of the interpreter that runs the engine (part of the learned key).
        self.vllm_version = vllm_version_of(engine.python or None) if engine.supervised else ""
        self._load_learned()

    # ------------------------------------------------------------ read side (EngineHandle)
    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def profile(self) -> MemoryProfile:
        return self.policy.profile

    @property
    def configured_profile(self) -> MemoryProfile:
        return self.policy.configured

    @property
    def profile_source(self) -> str:
        return self.policy.source

    @property
    def profile_changes(self) -> list[ProfileChange]:
        return list(self.policy.changes)

    @property
    def upshift_pinned(self) -> bool:
        return self.policy.upshift_pinned

    @property
    def restarts(self) -> int:
        return self.budget.restarts

    @property
    def base_url(self) -> str:
        return self.engine.base_url

    @property
    def served_model_name(self) -> str:
        return self.engine.served_model_name

    @property
    def pid(self) -> int | None:
        return self._gen.process.pid if self._gen and self._gen.process else None

    @property
    def max_pixels(self) -> int:
        return self.profile.max_pixels or self.ocr.max_pixels

    @property
    def max_output_tokens(self) -> int:
        return self.profile.max_output_tokens or self.ocr.max_output_tokens

    @property
    def max_model_len(self) -> int | None:
        """Context length the engine reported in ``/v1/models`` at its last readiness probe."""
        return self._client.max_model_len.get(self.engine.served_model_name)

    @property
    def capacity(self) -> int:
        """In-flight requests to aim for: the engine's sequence slots plus a small
        waiting queue so it never idles between requests; no extra while vLLM
        already reports requests waiting."""
        seqs = self.profile.max_num_seqs or (
            DEFAULT_REMOTE_CAPACITY if not self.engine.supervised else 256)
        waiting = self.metrics.get("vllm:num_requests_waiting", 0.0)
        headroom = 0 if waiting > 0 else max(2, seqs // 4)
        return max(1, seqs + headroom)

    @property
    def stalled_seconds(self) -> float:
        """How long requests in flight have waited without progress (0 unless ready)."""
        if self._state is not EngineState.READY:
            return 0.0
        return self.progress.stalled_for(time.monotonic())

    async def wait_ready(self) -> None:
        await self._ready_event.wait()

    def report_failure(self, reason: str, evidence: str = "") -> None:
        self.log.warning("engine_request_failed", reason=reason, evidence=evidence[:300])
        self._probe_now.set()

    async def chat(self, body: ChatBody, timeout: float | None = None) -> dict[str, Any]:
        if self._state is not EngineState.READY:
            raise EngineUnavailable(f"engine is {self._state.value}")
        self._chats_in_flight += 1
        call = asyncio.ensure_future(self._client.chat(body, timeout=timeout))
        self._chat_calls.add(call)
        try:
            reply = await call
        except EngineUnavailable:
            raise
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if call.cancelled() and task is not None and not task.cancelling():
                # Cut by _fail (the engine hung or died under it), not by our caller.
                raise EngineUnavailable(f"engine failed under the request: "
                                        f"{self._state.value}") from None
            raise
        except Exception:
            self._chats_answered += 1  # an error answer: the engine is alive
            raise
        finally:
            self._chat_calls.discard(call)
            self._chats_in_flight -= 1
        self._chats_answered += 1
        return reply

    def pick(self) -> EngineSupervisor | None:
        """One engine: itself while ready (``EngineHandle``; the dispatcher picks among
        several)."""
        return self if self._state is EngineState.READY else None

    def release(self, target: object) -> None:
        """Nothing to count for a single engine (``EngineHandle``)."""

    def snapshot(self) -> EngineStatus:
        """The engine part of ``chandractl status``."""
        failure: FailureStatus | None = None
        if self.last_failure is not None:
            failure = {
                "class": str(self.last_failure.cls),
                "evidence": self.last_failure.evidence,
                "action": self.last_failure.action,
                "subclass": self.last_failure.subclass or None,
                "numbers": self.last_failure.numbers,
                "at_wall": self.last_failure_at,
            }
        return {
            "id": self.engine_id,
            "state": self._state.value,
            "pid": self.pid,
            "restarts": self.restarts,
            "supervised": self.engine.supervised,
            "url": self.engine.base_url,
            "gpus": [g for g in self.engine.gpus.split(",") if g and g.lower() != "all"],
            "cpus": self.cpus or None,
            "model": self.engine.model,
            "served_model_name": self.engine.served_model_name,
            "state_for_s": round(time.monotonic() - self.state_since, 1),
            "profile": self.profile.to_dict(),
            "profile_source": self.profile_source,
            "profile_changes": [c.to_dict() for c in self.profile_changes[-5:]],
            "last_failure": failure,
            "fatal_reason": self.fatal_reason or None,
            "backoff_s": round(self.budget.delay, 1) if self._state is EngineState.BACKOFF
            else None,
            "capacity": self.capacity,
            "fetch": None if self.fetch_child is None else {
                "model": self.fetch_child.model, "pid": self.fetch_child.pid,
                "done": self.fetch_child.progress.done,
                "total": self.fetch_child.progress.total},
            "metrics": {k.removeprefix("vllm:"): v for k, v in self.metrics.items()
                        if k in ("vllm:num_requests_running", "vllm:num_requests_waiting")},
        }

    # ------------------------------------------------------------ commands
    def request(self, command: EngineCommand) -> None:
        """Queue ``start``, ``restart``, ``stop`` or ``shutdown`` for the run loop."""
        self._commands.put_nowait(EngineCommand(command))

    async def reconfigure(self, engine: EngineConfig, ocr: OcrConfig) -> bool:
        """Take a reloaded config; restart the engine only if engine settings changed."""
        self.ocr = ocr
        if engine == self.engine:
            return False
        old_url = (self.engine.base_url, self.engine.health_path)
        self.engine = engine
        self.policy.reset(initial_profile(engine.memory, self._gpu_total()), engine.downshift)
        self.budget.downshift = engine.downshift
        if engine.supervised:
            self.vllm_version = await asyncio.to_thread(vllm_version_of, engine.python or None)
        self._load_learned()
        if (engine.base_url, engine.health_path) != old_url:
            await self._client.close()
            self._client = EngineClient(engine.base_url, api_key=engine.api_key,
                                        timeout=ocr.request_timeout,
                                        health_path=engine.health_path)
        self.request(EngineCommand.RESTART)
        return True

    async def _check_flags_unless_told_otherwise(self) -> list[ConfigProblem] | None:
        """The spawn's flag check (a child importing vLLM: up to a minute), while queued
        commands are still heard: a stop, restart or shutdown ends the check at once
        (its child is killed) and returns None."""
        check = asyncio.ensure_future(self.check_flags(self.engine))
        try:
            while not check.done():
                command = await self._next_command(0.5)
                if command is not None and await self._handle_command(command):
                    return None
            return check.result()
        finally:
            if not check.done():
                check.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await check

    async def check_flags(self, engine: EngineConfig) -> list[ConfigProblem]:
        """Validate the engine flags with the installed vLLM's own parser, in a child
        process (the daemon never imports vLLM)."""
        profile = initial_profile(engine.memory, self._gpu_total())
        t0 = time.monotonic()
        problems, cached = await self.flag_checks.run(engine, profile)
        self.log.info("engine_flags_checked", problems=[str(p) for p in problems],
                      cached=cached, seconds=round(time.monotonic() - t0, 1))
        if not problems:
            self._flags_checked = engine  # a reload's check also serves the spawn after it
        return problems

    # ------------------------------------------------------------ the machine
    def _transition(self, new: EngineState, reason: str, **evidence: Any) -> None:
        old = self._state
        if new not in ENGINE_TRANSITIONS[old]:
            raise InternalError(f"illegal engine transition {old.value} -> {new.value} ({reason})")
        self._state = new
        self.state_since = time.monotonic()
        if new is EngineState.READY:
            self._ready_event.set()
        else:
            self._ready_event.clear()
        self.log.info(Event.ENGINE_STATE, old=old.value, new=new.value, reason=reason, **evidence)
        if self.on_change is not None:
            self.on_change(new, reason)

    async def run(self, autostart: bool = True) -> None:
        """Drive the state machine until a ``shutdown`` command has been handled."""
        await self.session.reap(self.engine.stop_timeout)
        if autostart:
            self.request(EngineCommand.START)
        try:
            while True:
                state = self._state
                if state in (EngineState.STOPPED, EngineState.FATAL):
                    if not await self._idle():
                        return
                elif state is EngineState.STARTING:
                    await self._starting()
                elif state is EngineState.READY:
                    await self._ready()
                elif state is EngineState.FAILED:
                    await self._failed()
                elif state is EngineState.BACKOFF:
                    if not await self._backoff():
                        return
                else:  # STOPPING and FETCHING are handled inline (_stop_generation, _fetch)
                    raise InternalError(f"run loop found engine in {state.value}")
        finally:
            if self._gen is not None and self._gen.process is not None:
                await self._stop_generation("daemon exiting")
            await self._client.close()

    async def _next_command(self, timeout: float | None) -> EngineCommand | None:
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancel.
            async with asyncio.timeout(timeout):
                return await self._commands.get()
        except TimeoutError:
            return None

    async def _idle(self) -> bool:
        """STOPPED or FATAL: wait for an operator. Returns False on shutdown."""
        command = await self._next_command(None)
        if command is EngineCommand.SHUTDOWN:
            return False
        if command in (EngineCommand.START, EngineCommand.RESTART):
            if self._state is EngineState.FATAL:
                self.budget.clear()
                self.fatal_reason = ""
            await self._spawn("operator request" if command is EngineCommand.RESTART else "start")
        return True

    async def _spawn(self, reason: str) -> None:
        self._stable = False
        self.generation += 1
        if not self.engine.supervised:
            self._gen = Generation(process=None)
            self._transition(EngineState.STARTING, reason, url=self.engine.base_url)
            return
        fetch = not self.engine.offline and must_fetch(self.engine, self.base_env)
        if fetch and not await self._fetch(reason):
            return
        gen = Generation(process=None)
        self._gen = gen
        self._transition(EngineState.STARTING, reason, profile=self.profile.to_dict())
        if self.engine.offline and must_fetch(self.engine, self.base_env):
            self._fail(offline_not_cached(self.engine, self.base_env), exit_code=None)
            return
        if self._flags_checked != self.engine:
            problems = await self._check_flags_unless_told_otherwise()
            if problems is None:
                return  # a queued command (stop, restart, shutdown) ended this start
            verdict = [p for p in problems if p.code not in FLAG_CHECK_FAILED_CODES]
            if verdict:
                # SPEC §3.3: vLLM's parser refused a flag, before the GPU is touched; the
                # daemon exits 78.
                raise ConfigError(verdict)
            if problems:
                # The check itself failed (timeout, killed, import error): not a verdict on
                # the config. An engine start failure: retried with backoff, in status.
                self._fail(Diagnosis(
                    cls=FailureClass.OTHER_FATAL,
                    evidence="; ".join(p.message for p in problems),
                    numbers={}, action="retry with backoff; if it persists, check "
                    "engine.python (`chandrad check-config`)", restartable=True,
                    subclass="flag_check_failed"), exit_code=None)
                return
            self._flags_checked = self.engine
        busy = port_taken(self.engine.port)
        if busy:
            self._fail(busy, exit_code=None)
            return
        command = build_engine_command(self.engine, self.profile, base_env=self.base_env,
                                       python=self.engine.python or None, cpus=self.cpus)
        # A per-spawn token in the environment marks every process of this engine, even
        # one that leaves its session (engine/session.py).
        token = new_token()
        process = EngineProcess(command.argv, {**command.env, TOKEN_ENV: token},
                                gen.line_sink(self._probe_now.set, self.log),
                                also_members=lambda: token_holders(token))
        gen.process = process
        gen.started_at = time.monotonic()
        self.log.info("engine_command", argv=" ".join(command.argv))
        try:
            await process.start()
        except OSError as exc:
            gen.early = Diagnosis(
                cls=FailureClass.OTHER_FATAL, evidence=f"cannot execute {command.argv[0]}: "
                f"{exc.strerror}", numbers={}, action="fix engine.python / engine.command",
                restartable=False, subclass="exec_failed")
            gen.process = None
            self._fail(gen.early, exit_code=None)
            return
        self.log.info(Event.ENGINE_SPAWNED, pid=process.pid)
        if process.pid is not None:
            self.session.record(identify(process.pid, token))

    async def _fetch(self, reason: str) -> bool:
        """FETCHING: the weights into the HF cache in a child (engine/fetching.py). True
        when the engine may start; otherwise the state says why (failed or stopped)."""
        child = self.fetch_child = FetchChild(self.engine, self.base_env)
        self._transition(EngineState.FETCHING, reason, model=self.engine.model)
        await child.start()
        ended = asyncio.ensure_future(child.wait())
        try:
            while not ended.done():
                command = await self._next_command(0.5)
                if command in (EngineCommand.STOP, EngineCommand.RESTART,
                               EngineCommand.SHUTDOWN):
                    await child.stop()
                    self._transition(EngineState.STOPPING, f"{command} requested")
                    self._transition(EngineState.STOPPED, f"{command} requested")
                    if command is not EngineCommand.STOP:  # idle loop: exit, or start afresh
                        self._commands.put_nowait(EngineCommand.SHUTDOWN
                                                  if command is EngineCommand.SHUTDOWN
                                                  else EngineCommand.START)
                    return False
            code, failure = ended.result()
        finally:
            await child.stop()
            ended.cancel()
            self.fetch_child = None
        if failure is not None:
            self._fail(failure, exit_code=code)
            return False
        self.log.info("engine_model_fetched", model=self.engine.model, bytes=child.progress.total)
        return True

    def _fail(self, diagnosis: Diagnosis, exit_code: int | None) -> None:
        for call in self._chat_calls:
            call.cancel()  # their pages go back to the queue, uncharged (pipeline)
        self._failed_after_ready = self._state is EngineState.READY
        self.last_failure = diagnosis
        self.last_failure_at = time.time()
        self._transition(EngineState.FAILED, f"{diagnosis.cls}", exit_code=exit_code,
                         evidence=diagnosis.evidence[:500])
        self.log.error(Event.ENGINE_FAILURE, **{"class": str(diagnosis.cls)},
                  evidence=diagnosis.evidence[:2000], numbers=diagnosis.numbers,
                  action=diagnosis.action, exit_code=exit_code, subclass=diagnosis.subclass)

    async def _handle_command(self, command: EngineCommand) -> bool:
        """A command arriving while an engine runs. Returns True if it ended the generation."""
        if command is EngineCommand.START:
            return False
        await self._stop_generation(f"{command} requested")
        if command is EngineCommand.RESTART:
            await self._spawn("operator restart")
        elif command is EngineCommand.SHUTDOWN:
            self._commands.put_nowait(EngineCommand.SHUTDOWN)  # let the idle loop exit
        return True

    async def _generation_ended(self, gen: Generation, *, was_ready: bool) -> bool:
        """Handle a queued command or the engine's exit; True if this generation is over."""
        command = self._drain_command()
        if command and await self._handle_command(command):
            return True
        process = gen.process
        if process is not None and process.returncode is not None:
            code = await process.wait()
            self._fail(gen.verdict(code, was_ready=was_ready), exit_code=code)
            return True
        return False

    async def _starting(self) -> None:
        gen = self._gen
        assert gen is not None
        deadline = gen.started_at + self.engine.startup_timeout
        while True:
            if await self._generation_ended(gen, was_ready=False):
                return
            if await self._client.is_ready(self.engine.served_model_name):
                foreign = foreign_listener(self.engine.port, gen)
                if foreign is not None:
                    self._fail(foreign, exit_code=None)
                    return
                gen.ready_at = time.monotonic()
                gen.scanner.mark_ready()
                self.progress = ProgressWatch(self.engine.progress_timeout)
                seconds = round(gen.ready_at - gen.started_at, 1)
                self._transition(EngineState.READY, "health 200 and model listed",
                                 seconds=seconds)
                self.log.info(Event.ENGINE_READY, seconds=seconds, pid=self.pid,
                         profile=self.profile.to_dict())
                return
            now = time.monotonic()
            if gen.early is not None and now - gen.early_at > EXIT_GRACE_AFTER_FATAL_LINE:
                # Decided on every line so far, not the first failure line: on a loaded
                # box vLLM's ValueError can arrive seconds after "EngineCore failed to
                # start." and the engine still not have exited.
                self._fail(gen.verdict(None, was_ready=False), exit_code=None)
                return
            if now > deadline:
                self._fail(Diagnosis(
                    cls=FailureClass.OTHER_FATAL,
                    evidence=f"not ready after engine.startup_timeout="
                    f"{self.engine.startup_timeout:g}s",
                    numbers={}, action="restart with backoff; raise engine.startup_timeout "
                    "if the model is large", restartable=True, subclass="startup_timeout"),
                    exit_code=None)
                return
            await self._pause(1.0)

    def _drain_command(self) -> EngineCommand | None:
        try:
            return self._commands.get_nowait()
        except asyncio.QueueEmpty:
            return None

    async def _pause(self, seconds: float) -> None:
        """Sleep, but wake early for a probe request or a queued command."""
        self._probe_now.clear()
        waiter = asyncio.ensure_future(self._probe_now.wait())
        try:
            await asyncio.wait({waiter}, timeout=seconds)
        finally:
            waiter.cancel()

    async def _ready(self) -> None:
        gen = self._gen
        assert gen is not None and gen.ready_at is not None
        failed_probes = 0
        next_health = time.monotonic() + HEALTH_INTERVAL
        last_metrics = -math.inf
        while True:
            if await self._generation_ended(gen, was_ready=True):
                return
            now = time.monotonic()
            if not self._stable and now - gen.ready_at >= self.engine.stable_seconds:
                self._become_stable()
            if self._should_upshift(gen, now):
                await self._upshift()
                return
            every = METRICS_INTERVAL if self._chats_in_flight else METRICS_IDLE_INTERVAL
            if now >= last_metrics + every:
                self.metrics = await self._client.metrics()
                last_metrics = now
            stall = self.progress.observe(time.monotonic(), in_flight=self._chats_in_flight,
                                          answered=self._chats_answered, metrics=self.metrics)
            if stall is not None and self.engine.progress_timeout > 0:
                self._fail(Diagnosis(
                    cls=FailureClass.ENGINE_HUNG, evidence=stall.evidence(),
                    numbers=stall.numbers(),
                    action=f"{action_for(FailureClass.ENGINE_HUNG)} (engine.progress_timeout="
                    f"{self.engine.progress_timeout:g}s)", restartable=True), exit_code=None)
                return
            if now >= next_health or self._probe_now.is_set():
                healthy = await self._client.health()
                failed_probes = 0 if healthy else failed_probes + 1
                next_health = now + HEALTH_INTERVAL
                if failed_probes >= HEALTH_FAILURES_TO_FAIL:
                    diag = gen.verdict(None, was_ready=True) if gen.early else Diagnosis(
                        cls=FailureClass.OTHER_FATAL,
                        evidence=f"/health failed {failed_probes} times in a row",
                        numbers={}, action="restart the engine", restartable=True,
                        subclass="unresponsive")
                    self._fail(diag, exit_code=None)
                    return
            await self._pause(1.0 if failed_probes == 0 else 0.5)

    def _should_upshift(self, gen: Generation, now: float) -> bool:
        assert gen.ready_at is not None
        return self._stable and self.policy.wants_upshift(now - gen.ready_at, self.backlog())

    async def _upshift(self) -> None:
        """Stable for upshift_after with work waiting: try the profile one step up."""
        self._record_change(self.policy.begin_upshift())
        await self._stop_generation("upshift probe")
        await self._spawn("upshift probe")

    def _record_change(self, change: ProfileChange | None) -> None:
        """Log a ``profile_change`` event (and count it) for a change the policy made."""
        if change is None:
            return
        self.log.warning(Event.PROFILE_CHANGE, reason=change.reason, **{"class": change.failure},
                    old={k: o for k, (o, _) in change.changes.items()},
                    new={k: n for k, (_, n) in change.changes.items()},
                    degraded=change.degraded)
        if self.observer is not None:
            self.observer.profile_changed(change.failure, self.engine_id)

    def _become_stable(self) -> None:
        if self.policy.stable():
            self.log.info("profile_upshift_kept", profile=self.profile.to_dict())
        self._stable = True
        self.budget.forgive_startup()
        key = self.learned_key()
        if self.profiles is not None and key:
            try:
                self.profiles.save_learned_profile(key, self.profile.to_dict())
            except StoreFull as exc:  # the profile is learned again at the next stable
                self.log.warning("profile_not_saved", error=exc.message, learned_key=key)
        self.log.info(Event.ENGINE_STABLE, stable_seconds=self.engine.stable_seconds,
                      learned_key=key, profile=self.profile.to_dict())

    async def _failed(self) -> None:
        diag = self.last_failure
        assert diag is not None
        await self._stop_generation("engine failed")
        if not self.engine.supervised:
            self._enter_backoff()
            return
        if not diag.restartable:
            self._give_up(f"{diag.cls}: a restart cannot fix this ({diag.subclass or 'fatal'}): "
                          f"{diag.action}")
            return
        spent = self.budget.charge(time.monotonic(), after_ready=self._failed_after_ready)
        if spent:
            self._give_up(spent)
            return
        outcome = self.policy.after_failure(
            diag, max_pixels=self.ocr.max_pixels, max_output_tokens=self.ocr.max_output_tokens,
            gpu=self.gpu.facts(self.engine.gpus) if self.policy.upshift_fallback is None
            and self.engine.downshift.enabled else None)
        if outcome.fatal:
            self._give_up(outcome.fatal)
            return
        self._record_change(outcome.change)
        self._enter_backoff()

    def _give_up(self, reason: str) -> None:
        self.fatal_reason = reason
        self._transition(EngineState.FATAL, reason)
        self.log.critical(Event.ENGINE_FATAL, reason=reason,
                     hint="fix the cause, then `chandractl engine restart` or `chandractl reload`")

    def _enter_backoff(self) -> None:
        delay = self.budget.next_backoff()
        self._transition(EngineState.BACKOFF, "waiting before restart",
                         delay_s=delay, restarts=self.restarts)

    async def _backoff(self) -> bool:
        command = await self._next_command(self.budget.delay)
        if command is EngineCommand.SHUTDOWN:
            self._transition(EngineState.STOPPED, "shutdown during backoff")
            return False
        if command is EngineCommand.STOP:
            self._transition(EngineState.STOPPED, "stop during backoff")
            return True
        self.log.info(Event.ENGINE_RESTART, restarts=self.restarts, profile=self.profile.to_dict())
        await self._spawn("restart after failure" if command is None else "operator restart")
        return True

    async def _stop_generation(self, reason: str) -> None:
        """Stop the current engine session, verify nothing of it survives, free the GPU."""
        gen = self._gen
        self._gen = None
        if self._state in (EngineState.STARTING, EngineState.READY):
            self._transition(EngineState.STOPPING, reason)
        if gen is None or gen.process is None:
            if self._state is EngineState.STOPPING:
                self._transition(EngineState.STOPPED, reason)
            return
        process = gen.process
        escaped = process.escaped()
        if escaped:
            self.log.warning("engine_escaped_session", pids=sorted(escaped),
                        names=[process_name(p) for p in sorted(escaped)],
                        reason="descendants that called setsid; found by the engine's token")
        survivors = await process.stop(self.engine.stop_timeout)
        if survivors:
            self.log.error(Event.ENGINE_ORPHANS, pids=sorted(survivors),
                      names=[process_name(p) for p in sorted(survivors)])
        await self._wait_gpu_release(process.known_pids)
        self.session.record(None)
        if self._state is EngineState.STOPPING:
            self._transition(EngineState.STOPPED, reason)

    async def _wait_gpu_release(self, pids: set[int]) -> None:
        deadline = time.monotonic() + GPU_RELEASE_TIMEOUT
        held = self.gpu.memory_held_by(pids)
        while held and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            held = self.gpu.memory_held_by(pids)
        if held:
            self.log.error(Event.ENGINE_GPU_MEMORY_HELD, pids=sorted(held),
                           bytes=sum(held.values()))

    async def shutdown(self) -> None:
        """Stop the engine and end :meth:`run` (the caller awaits the run task)."""
        self.request(EngineCommand.SHUTDOWN)

    # ------------------------------------------------------------ learned profiles
    def _gpu_total(self) -> float | None:
        facts = self.gpu.facts(self.engine.gpus)
        return facts.total_gib if facts else None

    def learned_key(self) -> str:
        """Every input that changes which profile works → one key (see engine/learned.py)."""
        if not self.engine.supervised:
            return ""
        name, count = self.gpu.identity(self.engine.gpus)
        return learned_key(self.engine, self.ocr, self.policy.configured, gpu_name=name,
                           gpu_count=count, vllm_version=self.vllm_version, cpus=self.cpus)

    def _load_learned(self) -> None:
        key = self.learned_key()
        if self.profiles is None or not key:
            return
        data = self.profiles.load_learned_profile(key)
        if data:
            self.policy.adopt_learned(MemoryProfile.from_dict(data))
            self.log.info("profile_learned_loaded", key=key, profile=data)

