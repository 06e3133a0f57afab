"""Stopping, with deadlines (uvicorn's shape): SIGTERM's drain, then the shutdown.

SIGTERM stops intake and finishes the pages in flight while an engine can serve them, for
at most :func:`drain_timeout`, asking systemd for more stop time at each tick; a second
SIGTERM (or the engine going fatal with ``exit_on_fatal``) escalates, a reload that arrives
meanwhile is refused, the other control commands are answered as a stopping daemon
answers them (``pause``, ``drain``: ``invalid_state``). The shutdown then closes the
socket, stops the tasks, the jobs and the engines within ``engine.stop_timeout`` +
:data:`STOP_SLACK_S`, past which it logs what still ran and exits anyway; pages cut off go
back to the queue for the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

import structlog

from chandrad.config import Config
from chandrad.daemon.wiring import engine_name
from chandrad.errors import StoreFull
from chandrad.events import Event
from chandrad.states import DaemonCommand, DaemonState, EngineState

if TYPE_CHECKING:
    from chandrad.daemon.core import Daemon

log = structlog.get_logger("chandrad.daemon")

#: While draining, each tick asks systemd for this much more stop time.
DRAIN_EXTEND_S = 30.0
#: After the drain, stopping the engine and the tasks may take engine.stop_timeout + this;
#: past it the daemon logs what still ran and exits anyway (uvicorn's shutdown deadline).
STOP_SLACK_S = 30.0


def drain_timeout(cfg: Config) -> float:
    """How long a SIGTERM waits for pages in flight before it stops the engine."""
    return cfg.engine.stop_timeout + 60


async def drain_then_stop(daemon: Daemon) -> None:
    """SIGTERM: stop taking files, finish what is in flight, then return to be shut down."""
    pipeline = daemon.pipeline
    assert pipeline is not None and daemon.engine is not None
    # Before the first await: no job may start while the reload is being cancelled.
    # Finish what runs (a pause stays in force); the queue waits for the next start.
    pipeline.set_mode(pipeline.mode.stopping())
    await daemon.reloader.cancel()
    daemon.set_state(DaemonState.STOPPING, "SIGTERM")
    daemon.notifier.stopping("draining: finishing accepted pages")
    daemon.stop_watcher()
    # Jobs in flight finish their current pages only when an engine can serve them.
    limit = drain_timeout(daemon.config)
    deadline = time.monotonic() + limit
    while (pipeline.active_jobs
           and any(e.state is EngineState.READY for e in daemon.engines)
           and time.monotonic() < deadline):
        daemon.notifier.extend_timeout(DRAIN_EXTEND_S)
        daemon.pinger.progress()
        command = await daemon.queue.next(daemon.tick())
        if command is None:
            continue
        if command.name is DaemonCommand.RELOAD:
            command.refuse("reload")
        elif command.name not in (DaemonCommand.SHUTDOWN, DaemonCommand.SHUTDOWN_NOW):
            await daemon.controls.apply(command)  # a stopping daemon's own answers
        else:  # a second SIGTERM (or the engine fatal with exit_on_fatal): stop now
            log.warning("shutdown_escalated", command=command.name.value,
                        active_jobs=pipeline.active_jobs,
                        reason="stop draining: in-flight pages go back to the queue")
            daemon.notifier.stopping("stopping now: pages in flight return to the queue")
            break
    else:
        if pipeline.active_jobs and daemon.engine.state is EngineState.READY:
            log.warning("drain_timeout", seconds=limit, active_jobs=pipeline.active_jobs)


async def shutdown(daemon: Daemon) -> None:
    """Stop every part within the deadline, give unfinished pages back, close the store."""
    await daemon.reloader.cancel()
    daemon.queue.refuse_all()
    if daemon.state is not DaemonState.STOPPING:
        daemon.set_state(DaemonState.STOPPING, "shutdown")
    daemon.notifier.stopping("stopping the engine")
    limit = daemon.config.engine.stop_timeout + STOP_SLACK_S
    daemon.notifier.extend_timeout(limit + 10)
    try:
        async with asyncio.timeout(limit):
            await _stop_parts(daemon)
    except TimeoutError:
        log.error("shutdown_deadline", seconds=limit,
                  still_running=[t["name"] for t in daemon.tasks.snapshot()
                                 if t["state"] not in ("stopped", "dead")],
                  reason="exiting anyway; an engine left behind is stopped at the "
                         "next start (engine.session)")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await daemon.tasks.stop()
    if daemon.store is not None:
        # Pages cut off by the stop go back to the queue for the next start (which
        # releases them itself when a full store refuses it now).
        try:
            daemon.store.release_all_in_flight()
        except StoreFull as exc:
            log.warning("store_full_at_stop", error=exc.message,
                        reason="pages in flight are released at the next start")
        daemon.store.close()
    if daemon.render is not None:
        daemon.render.close()
    log.info(Event.DAEMON_STOPPED, exit_code=int(daemon.exit_code))


async def _stop_parts(daemon: Daemon) -> None:
    """Close the control socket (a request still inside a command is answered that the
    daemon stops), stop the jobs, the loops and the engine, in that order."""
    daemon.stop_watcher()
    if daemon.control is not None:
        await daemon.control.close()
    await daemon.metrics_listener.close()
    await daemon.tasks.stop("batch", "intake", "dispatch", "watcher", "watchdog")
    if daemon.pipeline is not None:
        # Before the store closes: a job cancelled later would find it closed.
        await daemon.pipeline.stop_jobs()
    names = [engine_name(e.engine_id) for e in daemon.engines]
    for engine, name in zip(daemon.engines, names, strict=True):
        daemon.tasks.let_finish(name)  # every engine stops at once, each its own session
        await engine.shutdown()
    runners = [t for t in map(daemon.tasks.runner, names) if t is not None]
    if runners:
        with contextlib.suppress(Exception):
            await asyncio.shield(asyncio.gather(*runners))
    await daemon.tasks.stop()
