"""What the daemon says about itself: systemd's ``STATUS=`` line, the ``status``, ``gpu``
and ``version`` replies (``protocol.StatusReply``/``GpuReply``) and the ``chandrad_info``
labels. Read-only: each is assembled from the daemon's parts when asked.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from chandrad import PROTOCOL_VERSION, __version__
from chandrad import gpu as nvml
from chandrad.engine.dispatch import engine_status
from chandrad.engine.learned import installed_vllm_version
from chandrad.protocol import GpuReply, StatusReply
from chandrad.states import DaemonState, EngineState

if TYPE_CHECKING:
    from chandrad.daemon.core import Daemon


def queue_counts(daemon: Daemon) -> dict[str, int]:
    """Jobs per state (empty before the store is open)."""
    return daemon.store.counts() if daemon.store else {}


def engine_version(daemon: Daemon) -> str:
    """The vLLM version engine 0 reported, else the one installed for ``engine.python``."""
    engine = daemon.engine
    return engine.vllm_version if engine and engine.vllm_version else installed_vllm_version()


def status_line(daemon: Daemon) -> str:
    """One line for systemd's ``STATUS=``: state, engines, queue, and the way out of trouble."""
    first, engines = daemon.engine, daemon.engines
    engine = first.state.value if first else "-"
    if len(engines) > 1:
        ready = sum(e.state is EngineState.READY for e in engines)
        engine = f"{ready}/{len(engines)} ready"
        fatal = [e for e in engines if e.state is EngineState.FATAL]
        if fatal and len(fatal) < len(engines):
            engine += (f", FATAL {','.join(e.engine_id for e in fatal)} (chandractl "
                       f"engine restart ID): {fatal[0].fatal_reason}")
    counts = queue_counts(daemon)
    line = (f"{daemon.state.value}; engine {engine}; queue pending={counts.get('pending', 0)} "
            f"active={counts.get('active', 0)} done={counts.get('done', 0)} "
            f"failed={counts.get('failed', 0)}")
    held = daemon.pipeline.held_counts() if daemon.pipeline else {}
    if held:
        # The jobs status lists under "held", whatever keeps them: each reason's count.
        reasons = ", ".join(f"{reason} {n}" for reason, n in held.items())
        line += f" held={sum(held.values())} ({reasons})"
    degraded = daemon.tasks.degraded()
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
    if daemon.metrics_listener.error:
        line += f"; METRICS OFF: {daemon.metrics_listener.error}"
    if daemon.state is DaemonState.RELOADING and daemon.reloader.phase:
        line += f"; reload: {daemon.reloader.phase}"
    if daemon.pipeline and daemon.pipeline.store_full:  # the way out, before the line is cut
        line = f"STORE FULL: {daemon.pipeline.store_full}; {line}"
    if daemon.reloader.refused:  # first: systemd's STATUS= is cut at its end
        line = f"reload failed: {daemon.reloader.refused} (old config kept); {line}"
    return line


def status_reply(daemon: Daemon) -> StatusReply:
    store, engine, pipeline = daemon.store, daemon.engine, daemon.pipeline
    assert store is not None and engine is not None
    now = time.time()
    return {
        "v": PROTOCOL_VERSION,
        "daemon": {
            "state": daemon.state.value,
            "pid": os.getpid(),
            "uptime_s": round(time.monotonic() - daemon.started, 1),
            "version": __version__,
            "config": str(daemon.config.path),
            "accepting": bool(pipeline and pipeline.mode.accepts_files),
            "dispatching": bool(pipeline and pipeline.mode.dispatches),
            "degraded": daemon.tasks.degraded(),
            "metrics": {"listen": daemon.metrics_listener.address,
                        "error": daemon.metrics_listener.error or None},
        },
        "tasks": daemon.tasks.snapshot(),
        # "engine" is engine 0, kept for one release beside "engines".
        "engine": engine_status(engine),
        "engines": daemon.dispatcher.engine_snapshots() if daemon.dispatcher else [],
        "queue": queue_counts(daemon),
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


def gpu_reply(daemon: Daemon) -> GpuReply:
    summary = nvml.gpu_summary()
    summary["engines"] = [{"id": e.engine_id, "pid": e.pid, "state": e.state.value,
                           "gpus": engine_status(e)["gpus"], "cpus": e.cpus or None,
                           "url": e.base_url} for e in daemon.engines]
    return summary


def version_reply(daemon: Daemon) -> dict[str, Any]:
    return {"daemon": __version__, "protocol": PROTOCOL_VERSION,
            "engine": engine_version(daemon), "pid": os.getpid()}


def metrics_info(daemon: Daemon) -> dict[str, str]:
    """``chandrad_info``'s labels."""
    return {"version": __version__, "vllm_version": engine_version(daemon),
            "model": daemon.config.engine.model}
