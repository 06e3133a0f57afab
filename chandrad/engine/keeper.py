"""One engine's memory profile and restart budget as its supervisor keeps them.

The profile in force and how it moves are ``engine/policy.py``'s (the ladder, the upshift
probe), the failures in the window and the backoff ``engine/budget.py``'s; this module
adds what needs the outside: the GPU's size for ``"auto"``, the learned profile (loaded
at start and at a reload, saved when the engine proves stable, in the store under
``engine/learned.py``'s key), each change logged and counted, and what a failure leads
to (give up, or back off with the next profile).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Protocol

import structlog

from chandrad.config import EngineConfig, MemoryConfig, OcrConfig
from chandrad.engine.budget import RestartBudget
from chandrad.engine.classify import Diagnosis
from chandrad.engine.learned import learned_key, vllm_version_of
from chandrad.engine.planning import plan_context
from chandrad.engine.policy import ProfileChange, ProfilePolicy
from chandrad.engine.profile import GpuFacts, MemoryProfile, initial_profile
from chandrad.engine.replan import PlanContext
from chandrad.errors import StoreFull
from chandrad.events import Event

#: A learned profile saved by ``chandrad tune`` carries this key (true): adopted as the
#: fastest, not as a step below the configured one.
TUNED_MARK = "tuned"


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


class ProfileKeeper:
    """The profile of one engine (its policy, its learned profile, its changes) and its
    restart budget."""

    def __init__(self, engine: EngineConfig, ocr: OcrConfig, *, gpu: GpuProbe,
                 store: LearnedProfiles | None, cpus: str,
                 log: structlog.typing.FilteringBoundLogger,
                 counted: Callable[[str], object] = lambda failure: None) -> None:
        self.gpu = gpu
        self.store = store
        self.cpus = cpus
        self.log = log
        #: Called with a change's failure class (or upshift reason) for the metrics.
        self.counted = counted
        #: The memory plan of the engine's start (None: its model is not here, or remote).
        self.plan: PlanContext | None = None
        #: The profile in force, the ladder's memory and the upshift probe.
        self.policy = ProfilePolicy(self.initial(engine.memory, engine, ocr), engine.downshift)
        #: Failures in the window, the backoff, restarts so far.
        self.budget = RestartBudget(engine.downshift)
        #: The vLLM version of the interpreter that runs the engine (part of the learned key).
        self.vllm_version = vllm_version_of(engine.python or None) if engine.supervised else ""
        self.load(engine, ocr)

    def initial(self, memory: MemoryConfig, engine: EngineConfig, ocr: OcrConfig | None = None
                ) -> MemoryProfile:
        """``memory`` resolved for the GPU ``engine.gpus`` sizes from (``"auto"``), the keys
        left ``"auto"`` from the memory plan (engine/planning.py) when the model is here;
        the plan is logged when ``ocr`` is given (the keeper's own start and reload)."""
        facts = self.gpu.facts(engine.gpus)
        gib = facts.total_gib if facts else None
        profile = initial_profile(memory, gib)
        if not engine.supervised:
            return profile
        context = plan_context(
            engine, profile, ocr or OcrConfig(),
            gpu_total_bytes=None if facts is None or facts.total_gib is None
            else int(facts.total_gib * 2**30),
            gpu_free_bytes=None if facts is None or facts.free_gib is None
            else int(facts.free_gib * 2**30))
        if ocr is not None:  # the engine's own plan: a memory failure corrects it
            self.plan = context
        if context is None:
            return profile
        if ocr is not None:
            self.log.info("memory_plan", **context.plan.as_dict())
        return initial_profile(memory, gib, context.plan)

    async def reconfigure(self, engine: EngineConfig, ocr: OcrConfig) -> None:
        """A reloaded ``[engine]``: start over from its profile (or the one learned for it)."""
        self.policy.reset(self.initial(engine.memory, engine, ocr), engine.downshift)
        self.budget.downshift = engine.downshift
        if engine.supervised:
            self.vllm_version = await asyncio.to_thread(vllm_version_of, engine.python or None)
        self.load(engine, ocr)

    def key(self, engine: EngineConfig, ocr: OcrConfig) -> str:
        """Every input that changes which profile works → one key (see engine/learned.py)."""
        if not engine.supervised:
            return ""
        name, count = self.gpu.identity(engine.gpus)
        return learned_key(engine, ocr, self.policy.configured, gpu_name=name,
                           gpu_count=count, vllm_version=self.vllm_version, cpus=self.cpus)

    def load(self, engine: EngineConfig, ocr: OcrConfig) -> None:
        """Adopt the profile learned for this engine, if one was saved."""
        key = self.key(engine, ocr)
        if self.store is None or not key:
            return
        data = self.store.load_learned_profile(key)
        if data:
            self.policy.adopt_learned(MemoryProfile.from_dict(data),
                                      tuned=bool(data.get(TUNED_MARK)))
            self.log.info("profile_learned_loaded", key=key, profile=data)

    def stable(self, engine: EngineConfig, ocr: OcrConfig) -> str:
        """The engine proved stable: keep an upshift, save the profile; its learned key."""
        if self.policy.stable():
            self.log.info("profile_upshift_kept", profile=self.policy.profile.to_dict())
        key = self.key(engine, ocr)
        if self.store is not None and key:
            try:
                data = self.policy.profile.to_dict()
                if self.policy.source == "tuned":  # still the tuned one: keep it marked
                    data[TUNED_MARK] = True
                self.store.save_learned_profile(key, data)
            except StoreFull as exc:  # the profile is learned again at the next stable
                self.log.warning("profile_not_saved", error=exc.message, learned_key=key)
        return key

    def after_failure(self, diagnosis: Diagnosis, engine: EngineConfig, ocr: OcrConfig, *,
                      after_ready: bool) -> str:
        """A failure: why the engine must give up (not restartable, the budget spent, the
        ladder at its end), or "" to back off and restart (the ladder stepped)."""
        if not engine.supervised:
            return ""  # a remote engine: probed again after the backoff, nothing to step
        if not diagnosis.restartable:
            return (f"{diagnosis.cls}: a restart cannot fix this "
                    f"({diagnosis.subclass or 'fatal'}): {diagnosis.action}")
        spent = self.budget.charge(time.monotonic(), after_ready=after_ready)
        if spent:
            return spent
        outcome = self.policy.after_failure(
            diagnosis, max_pixels=ocr.max_pixels, max_output_tokens=ocr.max_output_tokens,
            gpu=self.gpu.facts(engine.gpus) if self.policy.upshift_fallback is None
            and engine.downshift.enabled else None, plan=self.plan)
        if outcome.fatal:
            return outcome.fatal
        self.record(outcome.change)
        return ""

    def begin_upshift(self) -> None:
        """Stable with work waiting: the profile one step up, for the next spawn."""
        self.record(self.policy.begin_upshift())

    def record(self, change: ProfileChange | None) -> None:
        """Log a ``profile_change`` event (and count it) for a change the policy made."""
        if change is None:
            return
        self.log.warning(Event.PROFILE_CHANGE, reason=change.reason, **{"class": change.failure},
                         old={k: o for k, (o, _) in change.changes.items()},
                         new={k: n for k, (_, n) in change.changes.items()},
                         degraded=change.degraded)
        self.counted(change.failure)
