"""The engine supervisor: the engine state machine and the only writer of engine state.

Owns one engine's processes and profile: spawns and stops its generations
(``engine/spawn.py``), feeds their output to the failure classifier, probes it
(``engine/probe.py``), applies the downshift ladder (``engine/policy.py``), enforces the
restart budget (``engine/budget.py``), and keeps the profile that proved stable
(``engine/learned.py``). Everything else talks to it through :meth:`request` (operator
commands, queued) and the read-only properties. Requests do not go through it: the
dispatcher (``engine/dispatch.py``) sends them through the engine's :class:`InFlight`,
which the supervisor cuts when it fails the engine and reads for the hung-engine watch.

One ``run()`` task drives the machine; every change goes through :meth:`_transition`,
which refuses an edge that ``states.ENGINE_TRANSITIONS`` does not allow.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import structlog

from chandrad.config import EngineConfig, OcrConfig
from chandrad.engine.classify import Diagnosis
from chandrad.engine.fetching import FetchChild
from chandrad.engine.flagcheck import FlagChecks
from chandrad.engine.generation import Generation, SessionFile
from chandrad.engine.inbox import Inbox
from chandrad.engine.inflight import InFlight
from chandrad.engine.keeper import GpuProbe, LearnedProfiles, ProfileKeeper
from chandrad.engine.policy import ProfileChange
from chandrad.engine.probe import Probes
from chandrad.engine.profile import MemoryProfile
from chandrad.engine.spawn import Spawner
from chandrad.errors import ConfigProblem, InternalError
from chandrad.events import Event
from chandrad.interfaces import Observer
from chandrad.states import ENGINE_FATAL_HINT, ENGINE_TRANSITIONS, EngineCommand, EngineState

log = structlog.get_logger("chandrad.engine")

DEFAULT_REMOTE_CAPACITY = 64

__all__ = ["EngineSupervisor", "FlagChecks", "GpuProbe", "LearnedProfiles", "ProfileChange"]


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
        self.session = SessionFile(session_file, self.log)
        self.ocr = ocr
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.on_change = on_change
        self._state = EngineState.STOPPED
        self.state_since = time.monotonic()
        self.observer: Observer | None = None  # metrics: profile changes by reason
        #: The profile in force and its ladder (engine/policy.py), the learned profile, the
        #: restart budget (engine/budget.py): engine/keeper.py.
        self.keeper = ProfileKeeper(engine, ocr, gpu=gpu, store=profiles, cpus=cpus, log=self.log,
                                    counted=self._count_profile_change)
        self.policy, self.budget = self.keeper.policy, self.keeper.budget
        self.last_failure: Diagnosis | None = None
        self.last_failure_at: float | None = None
        self._failed_after_ready = False
        self._gen: Generation | None = None
        self.fetch_child: FetchChild | None = None  # while FETCHING
        #: The requests at the engine now (sent by the dispatcher), cut when it fails.
        self.requests = InFlight()
        #: Readiness, /health, /metrics and progress (engine/probe.py); owns the client.
        self.probes = Probes(engine, ocr, self.requests)
        self.inbox = Inbox()  # queued commands, requests to probe now
        #: The checks before a spawn and the exec (engine/spawn.py).
        self.spawner = Spawner(base_env=self.base_env, cpus=cpus, session=self.session,
                               flag_checks=flag_checks or FlagChecks(), gpu=gpu,
                               inbox=self.inbox, log=self.log)
        self._ready_event = asyncio.Event()
        self._stable = False
        self.fatal_reason = ""
        self.generation = 0  # bumped at every spawn: lets a waiter see "a new engine"
        self.backlog = backlog or (lambda: False)

    def _count_profile_change(self, failure: str) -> None:
        if self.observer is not None:
            self.observer.profile_changed(failure, self.engine_id)

    # ------------------------------------------------------------ read side
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
    def vllm_version(self) -> str:
        """The vLLM version of the interpreter that runs the engine."""
        return self.keeper.vllm_version

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
    def metrics(self) -> dict[str, float]:
        """The engine's scheduler series at the last scrape."""
        return self.probes.metrics

    @property
    def max_model_len(self) -> int | None:
        """Context length the engine reported in ``/v1/models`` at its last readiness probe."""
        return self.probes.client.max_model_len.get(self.engine.served_model_name)

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
        return self.probes.progress.stalled_for(time.monotonic())

    async def wait_ready(self) -> None:
        await self._ready_event.wait()

    # ------------------------------------------------------------ commands
    def request(self, command: EngineCommand) -> None:
        """Queue ``start``, ``restart``, ``stop`` or ``shutdown`` for the run loop."""
        self.inbox.put(command)

    async def reconfigure(self, engine: EngineConfig, ocr: OcrConfig) -> bool:
        """Take a reloaded config; restart the engine only if engine settings changed."""
        self.ocr = ocr
        if engine == self.engine:
            return False
        self.engine = engine
        await self.keeper.reconfigure(engine, ocr)
        await self.probes.reconfigure(engine, ocr)
        self.request(EngineCommand.RESTART)
        return True

    async def check_flags(self, engine: EngineConfig) -> list[ConfigProblem]:
        """Validate the engine flags with the installed vLLM's own parser, in a child
        process (the daemon never imports vLLM)."""
        return await self.spawner.check_flags(
            engine, self.keeper.initial(engine.memory, self.engine))

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
            await self.probes.client.close()

    async def _idle(self) -> bool:
        """STOPPED or FATAL: wait for an operator. Returns False on shutdown."""
        command = await self.inbox.next(None)
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
        if self.spawner.must_fetch(self.engine) and not await self._fetch(reason):
            return
        gen = self._gen = Generation(process=None)
        self._transition(EngineState.STARTING, reason, profile=self.profile.to_dict())
        started = await self.spawner.start(
            gen, self.engine, self.profile, on_command=self._handle_command,
            flags_profile=self.keeper.initial(self.engine.memory, self.engine))
        if isinstance(started, Diagnosis):
            self._fail(started, exit_code=None)

    async def _fetch(self, reason: str) -> bool:
        """FETCHING: the weights into the HF cache in a child (engine/fetching.py). True
        when the engine may start; otherwise the state says why (failed or stopped)."""
        child = self.fetch_child = FetchChild(self.engine, self.base_env)
        self._transition(EngineState.FETCHING, reason, model=self.engine.model)
        try:
            ended = await self.spawner.fetch(child)
        finally:
            self.fetch_child = None
        if isinstance(ended, EngineCommand):
            self._transition(EngineState.STOPPING, f"{ended} requested")
            self._transition(EngineState.STOPPED, f"{ended} requested")
            if ended is not EngineCommand.STOP:  # idle loop: exit, or start afresh
                self.request(EngineCommand.SHUTDOWN if ended is EngineCommand.SHUTDOWN
                             else EngineCommand.START)
            return False
        code, failure = ended
        if failure is not None:
            self._fail(failure, exit_code=code)
            return False
        self.log.info("engine_model_fetched", model=self.engine.model, bytes=child.progress.total)
        return True

    def _fail(self, diagnosis: Diagnosis, exit_code: int | None) -> None:
        # Its requests end now; their pages go back to the queue, uncharged (pipeline).
        self.requests.cut(f"engine failed under the request: {EngineState.FAILED.value}")
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
            self.inbox.put(EngineCommand.SHUTDOWN)  # let the idle loop exit
        return True

    async def _generation_ended(self, gen: Generation, *, was_ready: bool) -> bool:
        """Handle a queued command or the engine's exit; True if this generation is over."""
        command = self.inbox.take()
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
        while not await self._generation_ended(gen, was_ready=False):
            look = await self.probes.startup(gen)
            if isinstance(look, Diagnosis):
                self._fail(look, exit_code=None)
                return
            if look:
                assert gen.ready_at is not None
                seconds = round(gen.ready_at - gen.started_at, 1)
                self._transition(EngineState.READY, "health 200 and model listed",
                                 seconds=seconds)
                self.log.info(Event.ENGINE_READY, seconds=seconds, pid=self.pid,
                              profile=self.profile.to_dict())
                return
            await self.inbox.pause(1.0)

    async def _ready(self) -> None:
        gen = self._gen
        assert gen is not None and gen.ready_at is not None
        while not await self._generation_ended(gen, was_ready=True):
            now = time.monotonic()
            if not self._stable and now - gen.ready_at >= self.engine.stable_seconds:
                self._become_stable()
            if self._stable and self.policy.wants_upshift(now - gen.ready_at, self.backlog()):
                await self._upshift()
                return
            failed = await self.probes.ready(gen, now, health_now=self.inbox.probe_now.is_set())
            if failed is not None:
                self._fail(failed, exit_code=None)
                return
            await self.inbox.pause(self.probes.pause)

    async def _upshift(self) -> None:
        """Stable for upshift_after with work waiting: try the profile one step up."""
        self.keeper.begin_upshift()
        await self._stop_generation("upshift probe")
        await self._spawn("upshift probe")

    def _become_stable(self) -> None:
        key = self.keeper.stable(self.engine, self.ocr)
        self._stable = True
        self.budget.forgive_startup()
        self.log.info(Event.ENGINE_STABLE, stable_seconds=self.engine.stable_seconds,
                      learned_key=key, profile=self.profile.to_dict())

    async def _failed(self) -> None:
        diag = self.last_failure
        assert diag is not None
        await self._stop_generation("engine failed")
        fatal = self.keeper.after_failure(diag, self.engine, self.ocr,
                                          after_ready=self._failed_after_ready)
        if fatal:
            self._give_up(fatal)
            return
        self._enter_backoff()

    def _give_up(self, reason: str) -> None:
        self.fatal_reason = reason
        self._transition(EngineState.FATAL, reason)
        self.log.critical(Event.ENGINE_FATAL, reason=reason,
                     hint=ENGINE_FATAL_HINT)

    def _enter_backoff(self) -> None:
        delay = self.budget.next_backoff()
        self._transition(EngineState.BACKOFF, "waiting before restart",
                         delay_s=delay, restarts=self.restarts)

    async def _backoff(self) -> bool:
        command = await self.inbox.next(self.budget.delay)
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
        gen, self._gen = self._gen, None
        if self._state in (EngineState.STARTING, EngineState.READY):
            self._transition(EngineState.STOPPING, reason)
        if gen is not None and gen.process is not None:
            await self.spawner.stop(gen.process, self.engine.stop_timeout)
        if self._state is EngineState.STOPPING:
            self._transition(EngineState.STOPPED, reason)

    async def shutdown(self) -> None:
        """Stop the engine and end :meth:`run` (the caller awaits the run task)."""
        self.request(EngineCommand.SHUTDOWN)

    def learned_key(self) -> str:
        """Every input that changes which profile works → one key (see engine/learned.py)."""
        return self.keeper.key(self.engine, self.ocr)
