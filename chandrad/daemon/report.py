"""What the daemon says about itself: systemd's ``STATUS=`` line, the ``status``, ``gpu``
and ``version`` replies (``protocol.StatusReply``/``GpuReply``) and the ``chandrad_info``
labels. Read-only: each is assembled from the parts when asked.

Nothing here raises for a store that cannot be reached (PostgreSQL down): each store read
goes through :meth:`Reporter.read`, which answers what the daemon last read (the queue's
counts, the page rates) and tells the pipeline, so the line and ``status`` say
``STORE UNREACHABLE`` with the reason instead of ending the daemon.

:class:`Reporter` is given the parts it reads; before start-up has built the store, the
engines and the pipeline, the daemon's reporter has none of them (the line then says so).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from chandrad import PROTOCOL_VERSION, __version__
from chandrad import gpu as nvml
from chandrad.config import Config
from chandrad.daemon.lifecycle import Lifecycle
from chandrad.daemon.wiring import MetricsListener
from chandrad.engine.dispatch import Dispatcher, engine_status
from chandrad.engine.learned import installed_vllm_version
from chandrad.engine.supervisor import EngineSupervisor
from chandrad.errors import StoreFull, StoreUnreachable
from chandrad.pipeline import Pipeline
from chandrad.protocol import GpuReply, HeldStatus, StatusReply
from chandrad.states import DaemonState, EngineState
from chandrad.store import StoreBackend
from chandrad.tasks import TaskSupervisor

T = TypeVar("T")


class ReloadStatus(Protocol):
    """What the line says of reloads (``daemon/reload``'s ``Reloader``)."""

    @property
    def phase(self) -> str:
        """What the running reload waits for ("" when none does)."""
        ...

    @property
    def refused(self) -> str:
        """Why the last reload was refused, until one applies ("" otherwise)."""
        ...


def engine_version(engine: EngineSupervisor | None) -> str:
    """The vLLM version engine 0 reported, else the one installed for ``engine.python``."""
    return engine.vllm_version if engine and engine.vllm_version else installed_vllm_version()


def metrics_info(config: Config, engine: EngineSupervisor | None) -> dict[str, str]:
    """``chandrad_info``'s labels."""
    return {"version": __version__, "vllm_version": engine_version(engine),
            "model": config.engine.model}


def version_reply(engine: EngineSupervisor | None) -> dict[str, Any]:
    return {"daemon": __version__, "protocol": PROTOCOL_VERSION,
            "engine": engine_version(engine), "pid": os.getpid()}


def gpu_reply(engines: Sequence[EngineSupervisor]) -> GpuReply:
    summary = nvml.gpu_summary()
    summary["engines"] = [{"id": e.engine_id, "pid": e.pid, "state": e.state.value,
                           "gpus": engine_status(e)["gpus"], "cpus": e.cpus or None,
                           "url": e.base_url} for e in engines]
    return summary


class Reporter:
    """The status line and the ``status`` reply, from the parts it is given."""

    def __init__(self, lifecycle: Lifecycle, tasks: TaskSupervisor,
                 metrics_listener: MetricsListener, reload: ReloadStatus | None = None, *,
                 store: StoreBackend | None = None, engines: Sequence[EngineSupervisor] = (),
                 dispatcher: Dispatcher | None = None, pipeline: Pipeline | None = None
                 ) -> None:
        self._lifecycle = lifecycle
        self._tasks = tasks
        self._metrics_listener = metrics_listener
        self._reload = reload
        self._store = store
        self._engines = engines
        self._dispatcher = dispatcher
        self._pipeline = pipeline
        #: What the last successful reads said, answered while the store cannot be read.
        self._counts: dict[str, int] = {}
        self._rates = (0.0, 0.0)
        #: Why the last store read failed (None: it succeeded); the pipeline's own
        #: refusal (``Pipeline.store_error``) is the one shown when there is a pipeline.
        self._unreachable: StoreUnreachable | None = None

    def read(self, read: Callable[[], T], fallback: T) -> T:
        """``read()`` from the store, or ``fallback`` while the store cannot be reached
        (noted for the line and ``status``; never raised)."""
        try:
            value = read()
        except StoreUnreachable as exc:
            self._unreachable = exc
            if self._pipeline:
                self._pipeline.store_read(exc)
            return fallback
        self._unreachable = None
        if self._pipeline:
            self._pipeline.store_read(None)
        return value

    @property
    def store_error(self) -> StoreFull | None:
        """Why the store refuses writes or reads now (None while it takes them)."""
        return self._pipeline.store_error if self._pipeline else self._unreachable

    def status_line(self) -> str:
        """One line for systemd's ``STATUS=``: state, engines, queue, and the way out of
        trouble."""
        engines, pipeline, reload = self._engines, self._pipeline, self._reload
        state = self._lifecycle.state
        first = engines[0] if engines else None
        engine = first.state.value if first else "-"
        if len(engines) > 1:
            ready = sum(e.state is EngineState.READY for e in engines)
            engine = f"{ready}/{len(engines)} ready"
            fatal = [e for e in engines if e.state is EngineState.FATAL]
            if fatal and len(fatal) < len(engines):
                engine += (f", FATAL {','.join(e.engine_id for e in fatal)} (chandractl "
                           f"engine restart ID): {fatal[0].fatal_reason}")
        counts = self.queue_counts()
        line = (f"{state.value}; engine {engine}; queue pending={counts.get('pending', 0)} "
                f"active={counts.get('active', 0)} done={counts.get('done', 0)} "
                f"failed={counts.get('failed', 0)}")
        held: dict[str, int] = self.read(pipeline.held_counts, {}) if pipeline else {}
        if held:
            # The jobs status lists under "held", whatever keeps them: each reason's count.
            reasons = ", ".join(f"{reason} {n}" for reason, n in held.items())
            line += f" held={sum(held.values())} ({reasons})"
        degraded = self._tasks.degraded()
        if degraded:
            line += f"; DEGRADED: {', '.join(degraded)} (chandractl status)"
        if first and first.state is EngineState.FATAL:
            # The way out goes first: a long reason is cut at systemd's STATUS= length.
            line += f"; ENGINE FATAL (chandractl engine restart): {first.fatal_reason}"
        elif first and first.state is EngineState.STARTING:
            line += " (engine loading)"
        elif first and first.fetch_child is not None:
            got = first.fetch_child.progress
            line += (f" (fetching {first.fetch_child.model}: "
                     f"{got.done / 1e6:.0f}/{got.total / 1e6:.0f} MB)")
        if self._metrics_listener.error:
            line += f"; METRICS OFF: {self._metrics_listener.error}"
        if state is DaemonState.RELOADING and reload and reload.phase:
            line += f"; reload: {reload.phase}"
        error = self.store_error
        if error is not None:  # the way out, before the line is cut
            line = f"{error.title.upper()}: {error.message}; {line}"
        if reload and reload.refused:  # first: systemd's STATUS= is cut at its end
            line = f"reload failed: {reload.refused} (old config kept); {line}"
        return line

    def queue_counts(self) -> dict[str, int]:
        """Jobs per state (empty before the store is open; the last known while it cannot
        be read)."""
        store = self._store
        if store is None:
            return {}
        self._counts = self.read(store.counts, self._counts)
        return self._counts

    def _page_rates(self, now: float) -> tuple[float, float]:
        """Pages done in the last minute, and per minute over the last 15 minutes."""
        store = self._store
        assert store is not None
        self._rates = self.read(lambda: (float(store.pages_done_since(now - 60)),
                                         round(store.pages_done_since(now - 900) / 15, 2)),
                                self._rates)
        return self._rates

    def _held(self) -> HeldStatus:
        pipeline = self._pipeline
        if pipeline is None:
            return {"count": 0, "jobs": []}
        held: HeldStatus | None = self.read(pipeline.held, None)
        if held is not None:
            return held
        error = self.store_error
        assert self._store is not None
        return {"count": 0, "jobs": [{"file": self._store.location,
                                      "reason": error.code if error else None,
                                      "message": error.message if error else None}]}

    def status_reply(self) -> StatusReply:
        store, pipeline, lifecycle = self._store, self._pipeline, self._lifecycle
        assert store is not None and self._engines
        now = time.time()
        queue = self.queue_counts()
        per_min_1m, per_min_15m = self._page_rates(now)
        held = self._held()
        error = self.store_error
        return {
            "v": PROTOCOL_VERSION,
            "daemon": {
                "state": lifecycle.state.value,
                "pid": os.getpid(),
                "uptime_s": round(time.monotonic() - lifecycle.started, 1),
                "version": __version__,
                "config": str(lifecycle.config.path),
                "accepting": bool(pipeline and pipeline.mode.accepts_files),
                "dispatching": bool(pipeline and pipeline.mode.dispatches),
                "degraded": self._tasks.degraded(),
                "metrics": {"listen": self._metrics_listener.address,
                            "error": self._metrics_listener.error or None},
                "store": {"location": store.location, "problem": error.code if error else None,
                          "error": f"{error.title}: {error.message}" if error else None},
            },
            "tasks": self._tasks.snapshot(),
            # "engine" is engine 0, kept for one release beside "engines".
            "engine": engine_status(self._engines[0]),
            "engines": self._dispatcher.engine_snapshots() if self._dispatcher else [],
            "queue": queue,
            "held": held,
            "throughput": {
                "pages_per_min_1m": per_min_1m,
                "pages_per_min_15m": per_min_15m,
                "active_jobs": pipeline.active_jobs if pipeline else 0,
                "requests_in_flight": pipeline.requests_in_flight if pipeline else 0,
                "request_limit": pipeline.request_limit if pipeline else 0,
                "pages_waiting": pipeline.pages_waiting if pipeline else 0,
            },
            "gpus": nvml.gpu_summary().get("gpus", []),
        }
