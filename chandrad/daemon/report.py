"""What the daemon says about itself: systemd's ``STATUS=`` line, the ``status``, ``gpu``
and ``version`` replies (``protocol.StatusReply``/``GpuReply``) and the ``chandrad_info``
labels. Read-only: each is assembled from the parts when asked.

:class:`Reporter` is given the parts it reads; before start-up has built the store, the
engines and the pipeline, the daemon's reporter has none of them (the line then says so).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any, Protocol

from chandrad import PROTOCOL_VERSION, __version__
from chandrad import gpu as nvml
from chandrad.config import Config
from chandrad.daemon.lifecycle import Lifecycle
from chandrad.daemon.wiring import MetricsListener
from chandrad.engine.dispatch import Dispatcher, engine_status
from chandrad.engine.learned import installed_vllm_version
from chandrad.engine.supervisor import EngineSupervisor
from chandrad.pipeline import Pipeline
from chandrad.protocol import GpuReply, StatusReply
from chandrad.states import DaemonState, EngineState
from chandrad.store import StoreBackend
from chandrad.tasks import TaskSupervisor


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


def queue_counts(store: StoreBackend | None) -> dict[str, int]:
    """Jobs per state (empty before the store is open)."""
    return store.counts() if store else {}


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
        counts = queue_counts(self._store)
        line = (f"{state.value}; engine {engine}; queue pending={counts.get('pending', 0)} "
                f"active={counts.get('active', 0)} done={counts.get('done', 0)} "
                f"failed={counts.get('failed', 0)}")
        held = pipeline.held_counts() if pipeline else {}
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
        if pipeline and pipeline.store_full:  # the way out, before the line is cut
            line = f"STORE FULL: {pipeline.store_full}; {line}"
        if reload and reload.refused:  # first: systemd's STATUS= is cut at its end
            line = f"reload failed: {reload.refused} (old config kept); {line}"
        return line

    def queue_counts(self) -> dict[str, int]:
        return queue_counts(self._store)

    def status_reply(self) -> StatusReply:
        store, pipeline, lifecycle = self._store, self._pipeline, self._lifecycle
        assert store is not None and self._engines
        now = time.time()
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
            },
            "tasks": self._tasks.snapshot(),
            # "engine" is engine 0, kept for one release beside "engines".
            "engine": engine_status(self._engines[0]),
            "engines": self._dispatcher.engine_snapshots() if self._dispatcher else [],
            "queue": queue_counts(store),
            "held": pipeline.held() if pipeline else {"count": 0, "jobs": []},
            "throughput": {
                "pages_per_min_1m": float(store.pages_done_since(now - 60)),
                "pages_per_min_15m": round(store.pages_done_since(now - 900) / 15, 2),
                "active_jobs": pipeline.active_jobs if pipeline else 0,
                "requests_in_flight": pipeline.requests_in_flight if pipeline else 0,
                "request_limit": pipeline.request_limit if pipeline else 0,
                "pages_waiting": pipeline.pages_waiting if pipeline else 0,
            },
            "gpus": nvml.gpu_summary().get("gpus", []),
        }
