"""The dispatcher: the request gate, one or more supervised engines seen by the pipeline as
one ``EngineHandle``.

Owns which engine each request goes to, what is outstanding on each and sending it: a
request goes only to a ready engine, through that engine's ``InFlight``
(``engine/inflight.py``), which its supervisor cuts when it fails the engine and reads for
the hung-engine watch. A request goes to
the ready engine with the most free capacity: its capacity (``max_num_seqs`` plus a small
queue) minus the requests outstanding on it, minus ``vllm:num_requests_waiting`` from its
``/metrics`` when its supervisor has scraped one; ties go to the engine with fewer
outstanding, then to the one picked longest ago, so one document's pages spread over every
engine even when pages arrive one at a time (rendering slower than inference: the first
engine would otherwise be free again, and tied, at every pick). An
engine that leaves ``ready`` gets no new request; the requests it had fail with
``EngineUnavailable`` and the pipeline gives those pages back uncharged (its existing
rules) and sends them again, to whichever engine is ready then.

The pipeline builds each request for the engine :meth:`Dispatcher.pick` returns (its page
budget, its context length). Pages are rendered before the engine is known, at the
smallest ``max_pixels`` of the engines that may serve (a degraded engine's budget holds
for all while it lasts).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

from chandrad.engine.supervisor import EngineSupervisor
from chandrad.errors import EngineUnavailable
from chandrad.interfaces import ChatBody
from chandrad.protocol import EngineStatus, FailureStatus
from chandrad.states import EngineState

#: States in which an engine is expected to serve again without an operator.
_LIVE = frozenset(EngineState) - {EngineState.FATAL, EngineState.STOPPED}
RATE_WINDOW_S = 60.0


class Lease:
    """One request's hold on one engine (``interfaces.EngineTarget``): built for it, sent
    to it, counted as outstanding on it until the dispatcher's ``release``."""

    def __init__(self, dispatcher: Dispatcher, engine: EngineSupervisor) -> None:
        self.dispatcher = dispatcher
        self.engine = engine
        self.released = False

    @property
    def engine_id(self) -> str:
        return self.engine.engine_id

    @property
    def served_model_name(self) -> str:
        return self.engine.served_model_name

    @property
    def max_output_tokens(self) -> int:
        return self.engine.max_output_tokens

    @property
    def max_model_len(self) -> int | None:
        return self.engine.max_model_len

    async def chat(self, body: ChatBody, timeout: float | None = None) -> dict[str, Any]:
        return await self.dispatcher.send(self.engine, body, timeout)

    def report_failure(self, reason: str, evidence: str = "") -> None:
        report_failure(self.engine, reason, evidence)


class Dispatcher:
    """``EngineHandle`` over one or more :class:`EngineSupervisor`."""

    def __init__(self, engines: list[EngineSupervisor]) -> None:
        if not engines:
            raise ValueError("the dispatcher needs at least one engine")
        self.engines = engines
        self.outstanding: dict[str, int] = {e.engine_id: 0 for e in engines}
        self.answered: dict[str, int] = {e.engine_id: 0 for e in engines}
        self._recent: dict[str, deque[float]] = {e.engine_id: deque() for e in engines}
        self._picks = 0
        self._last_pick: dict[str, int] = {e.engine_id: -1 for e in engines}

    # ------------------------------------------------------------ EngineHandle
    @property
    def first(self) -> EngineSupervisor:
        return self.engines[0]

    @property
    def state(self) -> EngineState:
        """``ready`` while any engine is; else engine 0's state."""
        if any(e.state is EngineState.READY for e in self.engines):
            return EngineState.READY
        return self.first.state

    @property
    def base_url(self) -> str:
        return self.first.base_url

    @property
    def served_model_name(self) -> str:
        return self.first.served_model_name

    def _live(self) -> list[EngineSupervisor]:
        return [e for e in self.engines if e.state in _LIVE] or self.engines

    @property
    def capacity(self) -> int:
        """The sum of the capacities of the engines that are up or coming back."""
        return max(1, sum(e.capacity for e in self._live()))

    @property
    def max_pixels(self) -> int:
        return min(e.max_pixels for e in self._live())

    @property
    def max_output_tokens(self) -> int:
        return min(e.max_output_tokens for e in self._live())

    @property
    def max_model_len(self) -> int | None:
        known = [e.max_model_len for e in self._live() if e.max_model_len is not None]
        return min(known) if known else None

    async def wait_ready(self) -> None:
        """Return once any engine is ready."""
        while not any(e.state is EngineState.READY for e in self.engines):
            waiters = [asyncio.ensure_future(e.wait_ready()) for e in self.engines]
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()

    def free(self, engine: EngineSupervisor) -> float:
        """Requests ``engine`` could take now (negative: over its capacity)."""
        waiting = engine.metrics.get("vllm:num_requests_waiting", 0.0)
        return engine.capacity - self.outstanding[engine.engine_id] - waiting

    def pick(self) -> Lease | None:
        ready = [e for e in self.engines if e.state is EngineState.READY]
        if not ready:
            return None
        best = max(ready, key=lambda e: (self.free(e), -self.outstanding[e.engine_id],
                                         -self._last_pick[e.engine_id]))
        self.outstanding[best.engine_id] += 1
        self._picks += 1
        self._last_pick[best.engine_id] = self._picks
        return Lease(self, best)

    def release(self, target: object) -> None:
        if isinstance(target, Lease) and not target.released:
            target.released = True
            eid = target.engine_id
            self.outstanding[eid] = max(0, self.outstanding[eid] - 1)

    async def send(self, engine: EngineSupervisor, body: ChatBody,
                   timeout: float | None = None) -> dict[str, Any]:
        """One request to ``engine``, while it is ready. Raises ``EngineUnavailable`` when
        it is not, when it cannot be reached, and when its supervisor fails it meanwhile
        (the request is cut at once)."""
        if engine.state is not EngineState.READY:
            raise EngineUnavailable(f"engine is {engine.state.value}")
        reply = await engine.requests.run(engine.probes.client.chat(body, timeout=timeout))
        self.answered_by(engine.engine_id)
        return reply

    def answered_by(self, engine_id: str) -> None:
        """``engine_id`` answered a request (for pages per minute and the balance)."""
        self.answered[engine_id] += 1
        self._recent[engine_id].append(time.monotonic())

    async def chat(self, body: ChatBody, timeout: float | None = None) -> dict[str, Any]:
        """One request to the engine :meth:`pick` chooses (callers that do not build the
        request per engine)."""
        target = self.pick()
        if target is None:
            raise EngineUnavailable(f"no engine is ready ({self.first.state.value})")
        try:
            return await target.chat(body, timeout=timeout)
        finally:
            self.release(target)

    def report_failure(self, reason: str, evidence: str = "") -> None:
        for engine in self.engines:
            report_failure(engine, reason, evidence)

    # ------------------------------------------------------------ status
    def pages_per_min(self, engine_id: str) -> float:
        recent = self._recent[engine_id]
        cutoff = time.monotonic() - RATE_WINDOW_S
        while recent and recent[0] < cutoff:
            recent.popleft()
        return float(len(recent))

    def engine_snapshots(self) -> list[EngineStatus]:
        """``status``'s ``engines``: each engine's own snapshot plus its dispatch figures."""
        out = []
        for engine in self.engines:
            snap = engine_status(engine)
            snap["in_flight"] = self.outstanding[engine.engine_id]
            snap["answered"] = self.answered[engine.engine_id]
            snap["pages_per_min"] = self.pages_per_min(engine.engine_id)
            out.append(snap)
        return out

    def snapshot(self) -> EngineStatus:
        """Engine 0's snapshot (the single ``engine`` object of ``status``)."""
        return self.engine_snapshots()[0]


def report_failure(engine: EngineSupervisor, reason: str, evidence: str = "") -> None:
    """A request to ``engine`` failed in a way that suggests it is sick: its supervisor
    probes it now."""
    engine.log.warning("engine_request_failed", reason=reason, evidence=evidence[:300])
    engine.inbox.wake()


def engine_status(engine: EngineSupervisor) -> EngineStatus:
    """One engine in ``status``: its supervisor's state, profile, last failure, fetch."""
    cfg, fetch = engine.engine, engine.fetch_child
    failure: FailureStatus | None = None
    if engine.last_failure is not None:
        failure = {
            "class": str(engine.last_failure.cls),
            "evidence": engine.last_failure.evidence,
            "action": engine.last_failure.action,
            "subclass": engine.last_failure.subclass or None,
            "numbers": engine.last_failure.numbers,
            "at_wall": engine.last_failure_at,
        }
    return {
        "id": engine.engine_id,
        "state": engine.state.value,
        "pid": engine.pid,
        "restarts": engine.restarts,
        "supervised": cfg.supervised,
        "url": cfg.base_url,
        "gpus": [g for g in cfg.gpus.split(",") if g and g.lower() != "all"],
        "cpus": engine.cpus or None,
        "model": cfg.model,
        "served_model_name": cfg.served_model_name,
        "state_for_s": round(time.monotonic() - engine.state_since, 1),
        "profile": engine.profile.to_dict(),
        "profile_source": engine.profile_source,
        "profile_changes": [c.to_dict() for c in engine.profile_changes[-5:]],
        "last_failure": failure,
        "fatal_reason": engine.fatal_reason or None,
        "backoff_s": round(engine.budget.delay, 1) if engine.state is EngineState.BACKOFF
        else None,
        "capacity": engine.capacity,
        "fetch": None if fetch is None else {
            "model": fetch.model, "pid": fetch.pid, "done": fetch.progress.done,
            "total": fetch.progress.total},
        "metrics": {k.removeprefix("vllm:"): v for k, v in engine.metrics.items()
                    if k in ("vllm:num_requests_running", "vllm:num_requests_waiting")},
    }

