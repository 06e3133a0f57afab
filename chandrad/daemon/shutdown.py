"""Stopping, with deadlines (uvicorn's shape): SIGTERM's drain, then the shutdown.

SIGTERM stops intake and finishes the pages in flight while an engine can serve them, for
at most :func:`drain_timeout` (while paused, as a pause stays in force through the stop,
only until the pages already at the engine are answered), asking systemd for more stop
time at each tick; a second SIGTERM (or the engine going fatal with ``exit_on_fatal``)
escalates, a reload that arrives meanwhile is refused, the other control commands are
answered as a stopping daemon answers them (``pause``, ``drain``: ``invalid_state``). The
shutdown then closes the socket, stops the tasks, the jobs and the engines within
``engine.stop_timeout`` + :data:`STOP_SLACK_S`, past which it logs what still ran and
exits anyway; pages cut off go back to the queue for the next start.

:class:`Drain` and :class:`Shutdown` are given the parts they stop; a part start-up did
not get to build is ``None`` (or no engine), and is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

import structlog

from chandrad.config import Config
from chandrad.control.server import ControlServer
from chandrad.daemon.controls import Controls
from chandrad.daemon.lifecycle import Lifecycle
from chandrad.daemon.queue import CommandQueue, tick
from chandrad.daemon.reload import Reloader
from chandrad.daemon.watching import Watching
from chandrad.daemon.wiring import MetricsListener, engine_name
from chandrad.engine.supervisor import EngineSupervisor
from chandrad.errors import StoreFull
from chandrad.events import Event
from chandrad.pipeline import Pipeline
from chandrad.render import RenderPool
from chandrad.states import DaemonCommand, DaemonState, EngineState
from chandrad.store import StoreBackend
from chandrad.systemd import Notifier, WatchdogPinger
from chandrad.tasks import TaskSupervisor

log = structlog.get_logger("chandrad.daemon")

#: While draining, each tick asks systemd for this much more stop time.
DRAIN_EXTEND_S = 30.0
#: After the drain, stopping the engine and the tasks may take engine.stop_timeout + this;
#: past it the daemon logs what still ran and exits anyway (uvicorn's shutdown deadline).
STOP_SLACK_S = 30.0


def drain_timeout(cfg: Config) -> float:
    """How long a SIGTERM waits for pages in flight before it stops the engine."""
    return cfg.engine.stop_timeout + 60


class Drain:
    """SIGTERM: stop taking files, finish what is in flight, then return to be shut down.

    Answers the commands that arrive meanwhile (``controls``: a stopping daemon's own
    answers) and keeps systemd's watchdog fed (``pinger``).
    """

    def __init__(self, lifecycle: Lifecycle, queue: CommandQueue, notifier: Notifier,
                 pinger: WatchdogPinger, pipeline: Pipeline,
                 engines: Sequence[EngineSupervisor], reloader: Reloader, watching: Watching,
                 controls: Controls) -> None:
        self._lifecycle = lifecycle
        self._queue = queue
        self._notifier = notifier
        self._pinger = pinger
        self._pipeline = pipeline
        self._engines = engines
        self._reloader = reloader
        self._watching = watching
        self._controls = controls

    async def run(self) -> None:
        pipeline, notifier, engines = self._pipeline, self._notifier, self._engines
        # Before the first await: no job may start while the reload is being cancelled.
        # Finish what runs (a pause stays in force); the queue waits for the next start.
        pipeline.set_mode(pipeline.mode.stopping())
        await self._reloader.cancel()
        self._lifecycle.set_state(DaemonState.STOPPING, "SIGTERM")
        notifier.stopping("draining: finishing accepted pages")
        self._watching.stop()
        # Jobs in flight finish their current pages only when an engine can serve them.
        limit = drain_timeout(self._lifecycle.config)
        deadline = time.monotonic() + limit
        while (pipeline.active_jobs
               and any(e.state is EngineState.READY for e in engines)
               and not _paused_and_answered(pipeline)
               and time.monotonic() < deadline):
            notifier.extend_timeout(DRAIN_EXTEND_S)
            self._pinger.progress()
            command = await self._queue.next(tick(self._pinger.interval))
            if command is None:
                continue
            if command.name is DaemonCommand.RELOAD:
                command.refuse("reload")
            elif command.name not in (DaemonCommand.SHUTDOWN, DaemonCommand.SHUTDOWN_NOW):
                await self._controls.apply(command)  # a stopping daemon's own answers
            else:  # a second SIGTERM (or the engine fatal with exit_on_fatal): stop now
                log.warning("shutdown_escalated", command=command.name.value,
                            active_jobs=pipeline.active_jobs,
                            reason="stop draining: in-flight pages go back to the queue")
                notifier.stopping("stopping now: pages in flight return to the queue")
                break
        else:
            if _paused_and_answered(pipeline):
                log.info("drain_paused", active_jobs=pipeline.active_jobs,
                         reason="paused: no page is sent; the rest resumes at the next start")
            elif pipeline.active_jobs and engines[0].state is EngineState.READY:
                log.warning("drain_timeout", seconds=limit, active_jobs=pipeline.active_jobs)


def _paused_and_answered(pipeline: Pipeline) -> bool:
    """Stopped while paused (no further page is sent) and every page already at the
    engine answered and stored: nothing the drain waits for can progress any more."""
    return (pipeline.active_jobs > 0 and not pipeline.mode.dispatches
            and pipeline.pages_answering == 0)


class Shutdown:
    """Stop every part within the deadline, give unfinished pages back, close the store."""

    def __init__(self, lifecycle: Lifecycle, queue: CommandQueue, notifier: Notifier,
                 tasks: TaskSupervisor, metrics_listener: MetricsListener, *,
                 reloader: Reloader | None, watching: Watching | None,
                 control: ControlServer | None, pipeline: Pipeline | None,
                 engines: Sequence[EngineSupervisor], store: StoreBackend | None,
                 render: RenderPool | None) -> None:
        self._lifecycle = lifecycle
        self._queue = queue
        self._notifier = notifier
        self._tasks = tasks
        self._metrics_listener = metrics_listener
        self._reloader = reloader
        self._watching = watching
        self._control = control
        self._pipeline = pipeline
        self._engines = engines
        self._store = store
        self._render = render

    async def run(self) -> None:
        lifecycle, notifier, tasks, store = (self._lifecycle, self._notifier, self._tasks,
                                             self._store)
        if self._reloader is not None:
            await self._reloader.cancel()
        self._queue.refuse_all()
        if lifecycle.state is not DaemonState.STOPPING:
            lifecycle.set_state(DaemonState.STOPPING, "shutdown")
        notifier.stopping("stopping the engine")
        limit = lifecycle.config.engine.stop_timeout + STOP_SLACK_S
        notifier.extend_timeout(limit + 10)
        try:
            async with asyncio.timeout(limit):
                await self._stop_parts()
        except TimeoutError:
            log.error("shutdown_deadline", seconds=limit,
                      still_running=[t["name"] for t in tasks.snapshot()
                                     if t["state"] not in ("stopped", "dead")],
                      reason="exiting anyway; an engine left behind is stopped at the "
                             "next start (engine.session)")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await tasks.stop()
        if store is not None:
            # Pages cut off by the stop go back to the queue for the next start (which
            # releases them itself when a full store refuses it now).
            try:
                store.release_all_in_flight()
            except StoreFull as exc:
                log.warning("store_full_at_stop", error=exc.message,
                            reason="pages in flight are released at the next start")
            store.close()
        if self._render is not None:
            self._render.close()
        log.info(Event.DAEMON_STOPPED, exit_code=int(lifecycle.exit_code))

    async def _stop_parts(self) -> None:
        """Close the control socket (a request still inside a command is answered that the
        daemon stops), stop the jobs, the loops and the engine, in that order."""
        tasks = self._tasks
        if self._watching is not None:
            self._watching.stop()
        if self._control is not None:
            await self._control.close()
        await self._metrics_listener.close()
        await tasks.stop("batch", "intake", "dispatch", "watcher", "watchdog")
        if self._pipeline is not None:
            # Before the store closes: a job cancelled later would find it closed.
            await self._pipeline.stop_jobs()
        names = [engine_name(e.engine_id) for e in self._engines]
        for engine, name in zip(self._engines, names, strict=True):
            tasks.let_finish(name)  # every engine stops at once, each its own session
            await engine.shutdown()
        runners = [t for t in map(tasks.runner, names) if t is not None]
        if runners:
            with contextlib.suppress(Exception):
                await asyncio.shield(asyncio.gather(*runners))
        await tasks.stop()
