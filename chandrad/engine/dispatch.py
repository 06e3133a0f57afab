"""The dispatcher: several supervised engines seen by the pipeline as one ``EngineHandle``.

Owns which engine each request goes to and what is outstanding on each. A request goes to
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
from chandrad.protocol import EngineStatus
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
        reply = await self.engine.chat(body, timeout=timeout)
        self.dispatcher.answered_by(self.engine.engine_id)
        return reply

    def report_failure(self, reason: str, evidence: str = "") -> None:
        self.engine.report_failure(reason, evidence)


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
            engine.report_failure(reason, evidence)

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
            snap = engine.snapshot()
            snap["in_flight"] = self.outstanding[engine.engine_id]
            snap["answered"] = self.answered[engine.engine_id]
            snap["pages_per_min"] = self.pages_per_min(engine.engine_id)
            out.append(snap)
        return out

    def snapshot(self) -> EngineStatus:
        """Engine 0's snapshot (the single ``engine`` object of ``status``)."""
        return self.engine_snapshots()[0]
