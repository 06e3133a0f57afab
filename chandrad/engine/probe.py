"""What the supervisor asks a running engine, and when: one look at a time, a verdict back.

During start-up: is it ready (``/health`` 200 and the model listed in ``/v1/models``), is
the server on the port ours, has the start-up deadline passed, has the exit grace after a
failure line run out. Once ready: ``/health`` every :data:`HEALTH_INTERVAL` (or at once
when asked), the engine's ``/metrics`` every :data:`METRICS_INTERVAL` while requests are
in flight and every :data:`METRICS_IDLE_INTERVAL` while none are, and progress while
requests are in flight (``engine/progress.py``). Each look returns a failure verdict or
nothing; the supervisor acts on it (its state machine is the only writer of engine state).
"""

from __future__ import annotations

import math
import time

from chandrad.config import EngineConfig, OcrConfig
from chandrad.engine.classify import Diagnosis, FailureClass, action_for
from chandrad.engine.client import EngineClient
from chandrad.engine.generation import Generation, foreign_listener
from chandrad.engine.inflight import InFlight
from chandrad.engine.progress import ProgressWatch

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


def _client(engine: EngineConfig, ocr: OcrConfig) -> EngineClient:
    return EngineClient(engine.base_url, api_key=engine.api_key, timeout=ocr.request_timeout,
                        health_path=engine.health_path)


class Probes:
    """The probing of one engine (local or remote) across its generations; owns its
    :class:`EngineClient` and its last ``/metrics`` scrape."""

    def __init__(self, engine: EngineConfig, ocr: OcrConfig, requests: InFlight) -> None:
        self.engine = engine
        self.client = _client(engine, ocr)
        self.requests = requests
        #: The engine's scheduler series at the last scrape (empty before the first).
        self.metrics: dict[str, float] = {}
        #: Requests in flight and no progress for engine.progress_timeout: hung.
        self.progress = ProgressWatch(engine.progress_timeout)
        self._failed_probes = 0
        self._next_health = 0.0
        self._last_metrics = -math.inf

    async def reconfigure(self, engine: EngineConfig, ocr: OcrConfig) -> None:
        """A reloaded ``[engine]``: a new client where the engine's URL changed."""
        old = (self.engine.base_url, self.engine.health_path)
        self.engine = engine
        if (engine.base_url, engine.health_path) != old:
            await self.client.close()
            self.client = _client(engine, ocr)

    async def startup(self, gen: Generation) -> Diagnosis | bool:
        """One look at a starting engine: True once ready (``gen`` marked ready), False
        while not yet, a diagnosis when it failed to start."""
        if await self.client.is_ready(self.engine.served_model_name):
            foreign = foreign_listener(self.engine.port, gen)
            if foreign is not None:
                return foreign
            gen.ready_at = time.monotonic()
            gen.scanner.mark_ready()
            self.progress = ProgressWatch(self.engine.progress_timeout)
            self._failed_probes = 0
            self._next_health = gen.ready_at + HEALTH_INTERVAL
            self._last_metrics = -math.inf
            return True
        now = time.monotonic()
        if gen.early is not None and now - gen.early_at > EXIT_GRACE_AFTER_FATAL_LINE:
            # Decided on every line so far, not the first failure line: on a loaded box
            # vLLM's ValueError can arrive seconds after "EngineCore failed to start." and
            # the engine still not have exited.
            return gen.verdict(None, was_ready=False)
        if now > gen.started_at + self.engine.startup_timeout:
            return Diagnosis(
                cls=FailureClass.OTHER_FATAL,
                evidence=f"not ready after engine.startup_timeout="
                f"{self.engine.startup_timeout:g}s",
                numbers={}, action="restart with backoff; raise engine.startup_timeout "
                "if the model is large", restartable=True, subclass="startup_timeout")
        return False

    async def ready(self, gen: Generation, now: float, *, health_now: bool) -> Diagnosis | None:
        """One look at a ready engine: its ``/metrics`` when due, its progress, its
        ``/health`` when due or ``health_now``. A diagnosis when it hangs or stopped
        answering."""
        every = METRICS_INTERVAL if self.requests.count else METRICS_IDLE_INTERVAL
        if now >= self._last_metrics + every:
            self.metrics = await self.client.metrics()
            self._last_metrics = now
        stall = self.progress.observe(time.monotonic(), in_flight=self.requests.count,
                                      answered=self.requests.answered, metrics=self.metrics)
        if stall is not None:
            return Diagnosis(
                cls=FailureClass.ENGINE_HUNG, evidence=stall.evidence(),
                numbers=stall.numbers(),
                action=f"{action_for(FailureClass.ENGINE_HUNG)} (engine.progress_timeout="
                f"{self.engine.progress_timeout:g}s)", restartable=True)
        if now >= self._next_health or health_now:
            healthy = await self.client.health()
            self._failed_probes = 0 if healthy else self._failed_probes + 1
            self._next_health = now + HEALTH_INTERVAL
            if self._failed_probes >= HEALTH_FAILURES_TO_FAIL:
                return gen.verdict(None, was_ready=True) if gen.early else Diagnosis(
                    cls=FailureClass.OTHER_FATAL,
                    evidence=f"/health failed {self._failed_probes} times in a row",
                    numbers={}, action="restart the engine", restartable=True,
                    subclass="unresponsive")
        return None

    @property
    def pause(self) -> float:
        """Seconds to the next look at a ready engine (sooner while its health fails)."""
        return 1.0 if self._failed_probes == 0 else 0.5
