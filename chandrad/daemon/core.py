"""The daemon: wires every part from the config, runs the one command queue's main loop.

Start-up → serve → drain → shutdown (uvicorn's shape). Signals and every control command
that changes state feed the command queue (``daemon/queue``; gunicorn's arbiter: signal
handlers only enqueue); the main loop takes each command, ticks the watchdog, re-raises a
dead task.
The parts around it are objects with their own state, each given only the collaborators
it uses: ``daemon/lifecycle`` (the ``DaemonState`` machine, the config in force, the exit
code), ``daemon/wiring`` (config → parts, config errors naming the key),
``daemon/report`` (status line and replies), ``daemon/watching`` (the watcher in force),
``daemon/controls`` (``interfaces.DaemonControl`` for the control socket),
``daemon/reload`` and ``daemon/shutdown``. Every long-lived task runs under the one
``chandrad.tasks.TaskSupervisor`` (logged, quarantined, restarted, shown in ``status``);
while one is dead the systemd watchdog is no longer fed.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import TYPE_CHECKING, assert_never

import structlog

from chandrad import __version__, early, malloc
from chandrad.batch import BatchRun
from chandrad.config import Config
from chandrad.control.handlers import Handlers
from chandrad.control.server import ControlServer
from chandrad.daemon import report
from chandrad.daemon.controls import Controls
from chandrad.daemon.door import ApiDoor
from chandrad.daemon.lifecycle import Lifecycle
from chandrad.daemon.queue import CommandQueue, tick
from chandrad.daemon.reload import Reloader
from chandrad.daemon.report import Reporter
from chandrad.daemon.shutdown import Drain, Shutdown
from chandrad.daemon.watching import Watching
from chandrad.daemon.wiring import (
    MetricsListener,
    NvmlProbe,
    describe_item,
    engine_name,
    from_thread,
    make_watch_folders,
    open_store_waiting,
    plan_engines,
    remove_output_leftovers,
)
from chandrad.engine.dispatch import Dispatcher, engine_status
from chandrad.engine.flagcache import FlagVerdictCache, flag_cache_dir
from chandrad.engine.replicas import ReplicaSpec
from chandrad.engine.supervisor import EngineSupervisor, FlagChecks
from chandrad.errors import ChandradError, ConfigError, ExitCode
from chandrad.events import Event
from chandrad.logs import configure_logging
from chandrad.metrics import Metrics
from chandrad.pipeline import Pipeline
from chandrad.render import RenderPool
from chandrad.states import DaemonCommand, DaemonState, EngineState
from chandrad.store import StoreBackend
from chandrad.systemd import Notifier, WatchdogPinger
from chandrad.tasks import TaskSupervisor
from chandrad.watch import FolderWatcher

if TYPE_CHECKING:
    from chandrad.api import ApiServer

log = structlog.get_logger("chandrad.daemon")

#: glibc's malloc maps every block of at least this size apart and unmaps it when freed.
#: The daemon holds page images as PNG (about half a megabyte each, ~120 at a time for a
#: 64-seq engine); with glibc's default, whose threshold rises to the size of the first
#: such block freed, they come from the heap, which keeps the memory after a burst. The
#: figures (page size, peak and idle RSS with and without this, its CPU per page):
#: bench/README.md, "Current figures".
DAEMON_MMAP_THRESHOLD_BYTES = 256 << 10


class Daemon:
    """One running chandrad: builds the parts, gives each the collaborators it uses, runs
    the main loop over the command queue. ``lifecycle`` owns the daemon's mutable state."""

    def __init__(self, config: Config, batch: BatchRun | None = None) -> None:
        #: ``chandrad batch``: no control socket, metrics or watcher; the batch feeds the
        #: pipeline and stops the daemon when its files are finished (``chandrad/batch.py``).
        self.batch = batch
        self.lifecycle = Lifecycle(config, on_change=self.notify_status)
        self.notifier = Notifier.from_env()
        self.queue = CommandQueue()
        self.tasks = TaskSupervisor(on_change=self.notify_status)
        # A task that stays dead starves systemd's watchdog: the service restarts.
        self.pinger = WatchdogPinger(self.notifier, healthy=self.tasks.healthy)
        # The parts, built by start-up (the ones below the services, once these exist).
        self.store: StoreBackend | None = None
        #: One supervisor per engine (engine/replicas.py plans them), engine 0 first; the
        #: pipeline sees them through the dispatcher.
        self.engines: list[EngineSupervisor] = []
        self.dispatcher: Dispatcher | None = None
        # One vLLM flag check for every replica; a clean verdict also serves the next start.
        self.flag_checks = FlagChecks(FlagVerdictCache(
            flag_cache_dir(config.daemon.state_dir, os.environ)))
        self.pipeline: Pipeline | None = None
        self.render: RenderPool | None = None
        self.control: ControlServer | None = None
        self.watching: Watching | None = None
        self.reloader: Reloader | None = None
        self.controls: Controls | None = None
        self.metrics = Metrics(self, lambda: report.metrics_info(self.lifecycle.config,
                                                                 self.engine))
        self.metrics_listener = MetricsListener(self.metrics)
        #: The HTTP job API (``[api]``), started with the control socket.
        self.api: ApiServer | None = None
        #: Replaced by one over the store, engines and pipeline once start-up built them.
        self.reporter = Reporter(self.lifecycle, self.tasks, self.metrics_listener)

    # ------------------------------------------------------------ what metrics reads
    @property
    def state(self) -> DaemonState:
        return self.lifecycle.state

    @property
    def watcher(self) -> FolderWatcher | None:
        return self.watching.watcher if self.watching else None

    @property
    def engine(self) -> EngineSupervisor | None:
        """Engine 0 (the only one unless ``engine.replicas``/``cpu_affinity``/GPUs say more)."""
        return self.engines[0] if self.engines else None

    # ------------------------------------------------------------ systemd
    def status_line(self) -> str:
        return self.reporter.status_line()

    def notify_status(self) -> None:
        self.notifier.status(self.status_line())

    # ------------------------------------------------------------ serve
    async def serve(self) -> int:
        """Run until stopped. Returns the exit code. A start-up that fails part-way is
        stopped by the same shutdown (each part it had started, in order; a part it did not
        get to is skipped), then its exception is raised for ``cli.py`` to map."""
        try:
            await self._startup()
            await self._main_loop()
        except ChandradError as exc:
            # cli.py maps the exception to the process status; daemon_stopped must say the same.
            self.lifecycle.set_exit_code(exc.exit_code)
            self._log_startup_failure(exc.code)  # its message: cli.py's last line
            raise
        except Exception as exc:
            self.lifecycle.set_exit_code(ExitCode.SOFTWARE)
            self._log_startup_failure("internal_error", repr(exc))
            raise
        finally:
            if self.api is not None:  # no new request; those in progress are answered
                self.tasks.let_finish("api")
                await self.api.stop()
            await Shutdown(self.lifecycle, self.queue, self.notifier, self.tasks,
                           self.metrics_listener, reloader=self.reloader,
                           watching=self.watching, control=self.control,
                           pipeline=self.pipeline, engines=self.engines, store=self.store,
                           render=self.render).run()
        return int(self.lifecycle.exit_code)

    def _log_startup_failure(self, code: str, error: str | None = None) -> None:
        """A start that failed part-way; a typed error's message is not repeated here: the
        entry point prints it as the process's one last line."""
        if self.lifecycle.state is DaemonState.STARTING:
            details = {} if error is None else {"error": error}
            log.error("startup_failed", code=code,
                      reason="stopping what start-up started, then exiting", **details)

    async def _main_loop(self) -> None:
        reloader, controls = self.reloader, self.controls
        assert reloader is not None and controls is not None
        last_status = ""
        while True:
            self.pinger.progress()
            command = await self.queue.next(tick(self.pinger.interval))
            if self.tasks.fatal is not None:
                raise self.tasks.fatal
            reloader.raise_if_crashed()
            reloader.next()
            if command is not None:
                match command.name:
                    case DaemonCommand.SHUTDOWN_NOW:
                        return
                    case DaemonCommand.SHUTDOWN:
                        assert self.pipeline is not None and self.watching is not None
                        await Drain(self.lifecycle, self.queue, self.notifier, self.pinger,
                                    self.pipeline, self.engines, reloader, self.watching,
                                    controls).run()
                        return
                    case DaemonCommand.RELOAD:
                        reloader.request(command)
                    case (DaemonCommand.PAUSE | DaemonCommand.RESUME | DaemonCommand.DRAIN
                          | DaemonCommand.CANCEL | DaemonCommand.RETRY
                          | DaemonCommand.ENGINE_RESTART):
                        await controls.apply(command)
                    case _:
                        assert_never(command.name)
            controls.check_drained()
            line = self.status_line()
            if line != last_status:
                last_status = line
                self.notifier.status(line)

    # ------------------------------------------------------------ wiring
    async def _startup(self) -> None:
        cfg = self.lifecycle.config
        malloc.set_option(malloc.M_MMAP_THRESHOLD, DAEMON_MMAP_THRESHOLD_BYTES)
        loop = asyncio.get_running_loop()
        signals: tuple[tuple[signal.Signals, DaemonCommand], ...] = (
            (signal.SIGTERM, DaemonCommand.SHUTDOWN), (signal.SIGINT, DaemonCommand.SHUTDOWN),
            (signal.SIGHUP, DaemonCommand.RELOAD))
        if self.batch is not None:  # Ctrl-C stops a batch at once; a rerun resumes it
            signals = tuple((sig, DaemonCommand.SHUTDOWN_NOW) for sig, _ in signals)
        for sig, name in signals:
            loop.add_signal_handler(sig, self.queue.put, name)
        self._take_early_signals(dict(signals))
        self.store = await open_store_waiting(cfg, self.notifier)
        make_watch_folders(cfg)
        await asyncio.to_thread(remove_output_leftovers, cfg)
        if self.batch is None:  # before any process is spawned: an address it never gets is 78
            await self.metrics_listener.start(cfg)
        self.engines = [self._supervisor(cfg, spec) for spec in plan_engines(cfg)]
        self.dispatcher = Dispatcher(self.engines)
        self.render = RenderPool(cfg.ocr.render_workers)
        self.pipeline = pipeline = Pipeline(cfg, self.store, self.dispatcher, self.render)
        pipeline.observer = self.metrics
        # Work another host committed wakes the dispatcher at once (a shared store's
        # NOTIFY, heard on its listener's thread): a wake-up, not a state change, so it
        # goes to the loop directly rather than through the command queue.
        self.store.listen_for_work(from_thread(loop, pipeline.wake))
        for engine in self.engines:
            engine.observer = self.metrics
        self._build_parts(pipeline)
        if self.batch is None:
            assert self.controls is not None and self.watching is not None
            self.control = ControlServer(cfg.control_socket(), Handlers(self.controls),
                                         mode=cfg.control.mode, group=cfg.control.group)
            await self.control.start()
            if cfg.api.enabled:
                await self._start_api(cfg, pipeline)
            await self.watching.start(cfg)
        # A flag verdict (a config error) from an engine task ends the daemon (exit 78).
        for engine in self.engines:
            self.tasks.start(engine_name(engine.engine_id), engine.run, stop_on=(ConfigError,))
        self.tasks.start("intake", pipeline.intake_loop, quarantine=pipeline.quarantine,
                         describe=describe_item)
        self.tasks.start("dispatch", pipeline.dispatch_loop, quarantine=pipeline.quarantine,
                         describe=describe_item)
        if cfg.daemon.store_url:  # a shared store: help with other hosts' jobs
            self.tasks.start("helping", pipeline.helper.loop)
        if self.batch is not None:
            self.tasks.start("batch", self._run_batch)
        else:
            assert self.watching is not None
            self.watching.supervise()
        if self.pinger.interval is not None:
            self.tasks.start("watchdog", self.pinger.run)
        if self.metrics_listener.waiting:
            self.tasks.start("metrics", self._wait_for_metrics_port)
        self.lifecycle.set_state(DaemonState.RUNNING, "started")
        self.notifier.ready(self.status_line())
        log.info(Event.DAEMON_STARTED, version=__version__, pid=os.getpid(),
                 socket=str(cfg.control_socket()), watches=len(cfg.watch))

    async def _start_api(self, cfg: Config, pipeline: Pipeline) -> None:
        """The HTTP job API and its webhook sender (imported only when ``[api]`` is on)."""
        from chandrad.api import ApiServer

        assert self.store is not None and self.controls is not None
        self.api = ApiServer(cfg, self.store, ApiDoor(pipeline, self.queue))
        await self.api.start()
        self.tasks.start("api", self.api.serve)
        self.tasks.start("webhooks", self.api.deliver)
        self.controls.api_status = self.api.status
        self.metrics.count_webhooks(self.api.webhook_counts)

    def _build_parts(self, pipeline: Pipeline) -> None:
        """The parts over the services start-up built, each given what it uses."""
        assert self.store is not None
        lifecycle, queue = self.lifecycle, self.queue
        self.watching = watching = Watching(lifecycle, self.tasks, pipeline)
        self.reloader = reloader = Reloader(lifecycle, queue, self.engines, pipeline, watching,
                                            self.notifier, self.status_line)
        self.reporter = reporter = Reporter(
            lifecycle, self.tasks, self.metrics_listener, reloader, store=self.store,
            engines=self.engines, dispatcher=self.dispatcher, pipeline=pipeline)
        self.controls = Controls(lifecycle, queue, self.store, pipeline, self.engines,
                                 reporter, reloader, watching)

    def _take_early_signals(self, commands: dict[signal.Signals, DaemonCommand]) -> None:
        """Queue what arrived before the loop's handlers (``chandrad/early.py``): a stop
        stops, a SIGHUP is a reload once running; SIGHUPs before the config was read are
        dropped (the start read the current file)."""
        held, dropped = early.HELD.take()
        if dropped:
            log.info("signal_before_start", signal="SIGHUP", count=dropped,
                     action="ignored: before the config was read")
        for sig in held:
            log.info("signal_before_start", signal=sig.name, count=1,
                     action=commands[sig].value)
            self.queue.put(commands[sig])

    def _supervisor(self, cfg: Config, spec: ReplicaSpec) -> EngineSupervisor:
        """The supervisor of one planned engine, with its own port, session file (so that
        each replica's stale-engine reaper is its own) and CPU list."""
        return EngineSupervisor(
            spec.engine, cfg.ocr, gpu=NvmlProbe(), profiles=self.store,
            on_change=lambda new, reason: self._on_engine_change(spec.id, new, reason),
            session_file=cfg.daemon.state_dir / f"{engine_name(spec.id)}.session",
            backlog=self._has_backlog, engine_id=spec.id, cpus=spec.cpus,
            flag_checks=self.flag_checks)

    def _on_engine_change(self, engine_id: str, new: EngineState, reason: str) -> None:
        self.notify_status()
        if new is EngineState.FAILED:  # the supervisor names the failure class as the reason
            self.metrics.engine_failed(reason, engine_id)
        # exit_on_fatal: only once no engine is left to serve (one fatal replica among
        # healthy ones must not take the healthy ones down).
        if (new is EngineState.FATAL and self.lifecycle.config.engine.exit_on_fatal
                and all(e.state is EngineState.FATAL for e in self.engines)):
            self.lifecycle.set_exit_code(ExitCode.UNAVAILABLE)
            self.queue.put(DaemonCommand.SHUTDOWN_NOW)

    def _has_backlog(self) -> bool:
        counts = self.reporter.queue_counts()
        return counts.get("pending", 0) + counts.get("active", 0) > 0

    async def _run_batch(self) -> None:
        """The batch's task: feed the pipeline, then stop the daemon once all is finished."""
        assert self.batch is not None and self.pipeline is not None and self.store is not None
        assert self.engine is not None
        engine = self.engine
        await self.batch.run(self.pipeline, self.store, lambda: engine_status(engine),
                             lambda: self.queue.put(DaemonCommand.SHUTDOWN_NOW))
        self.tasks.let_finish("batch")

    async def _wait_for_metrics_port(self) -> None:
        """The task while another process holds ``metrics.listen``'s port: it ends once
        the listener is bound."""
        await self.metrics_listener.wait_for_port()
        self.tasks.let_finish("metrics")
        self.notify_status()


def run(config: Config) -> int:
    """Entry for ``chandrad run``; ``cli.py`` maps exceptions to exit codes."""
    configure_logging(config.daemon.log_format, config.daemon.log_level)
    return asyncio.run(Daemon(config).serve())
