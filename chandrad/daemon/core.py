"""The daemon: wires every part from the config, owns the ``DaemonState`` machine, the
one command queue and the main loop.

Start-up → serve → drain → shutdown (uvicorn's shape). Signals and every control command
that changes state feed the command queue (``daemon/queue``; gunicorn's arbiter: signal
handlers only enqueue); the main loop takes each command, ticks the watchdog, re-raises a
dead task.
The pieces around it, each with one owner: ``daemon/wiring`` (config → parts, config
errors naming the key), ``daemon/report`` (status line and replies), ``daemon/controls``
(``interfaces.DaemonControl`` for the control socket), ``daemon/reload`` and
``daemon/shutdown``. Every long-lived task runs under the one
``chandrad.tasks.TaskSupervisor`` (logged, quarantined, restarted, shown in ``status``);
while one is dead the systemd watchdog is no longer fed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import assert_never

import structlog

from chandrad import __version__, early, malloc
from chandrad.batch import BatchRun
from chandrad.config import Config
from chandrad.control.handlers import Handlers
from chandrad.control.server import ControlServer
from chandrad.daemon import report, shutdown
from chandrad.daemon.controls import Controls
from chandrad.daemon.queue import CommandQueue
from chandrad.daemon.reload import Reloader
from chandrad.daemon.wiring import (
    MetricsListener,
    NvmlProbe,
    describe_item,
    engine_name,
    make_watch_folders,
    open_store_waiting,
    plan_engines,
)
from chandrad.engine.dispatch import Dispatcher, engine_status
from chandrad.engine.flagcache import FlagVerdictCache, flag_cache_dir
from chandrad.engine.replicas import ReplicaSpec
from chandrad.engine.supervisor import EngineSupervisor, FlagChecks
from chandrad.errors import ChandradError, ConfigError, ExitCode, InternalError
from chandrad.events import Event
from chandrad.logs import configure_logging
from chandrad.metrics import Metrics
from chandrad.pipeline import Pipeline
from chandrad.render import RenderPool
from chandrad.states import DAEMON_TRANSITIONS, DaemonCommand, DaemonState, EngineState
from chandrad.store import StoreBackend
from chandrad.systemd import Notifier, WatchdogPinger
from chandrad.tasks import TaskSupervisor
from chandrad.watch import FolderWatcher, SettledFile

log = structlog.get_logger("chandrad.daemon")

TICK = 1.0
#: glibc's malloc maps every block of at least this size apart and unmaps it when freed.
#: The daemon holds page images as PNG (about half a megabyte each, ~120 at a time for a
#: 64-seq engine); with glibc's default, whose threshold rises to the size of the first
#: such block freed, they come from the heap, which keeps the memory after a burst. The
#: figures (page size, peak and idle RSS with and without this, its CPU per page):
#: bench/README.md, "Current figures".
DAEMON_MMAP_THRESHOLD_BYTES = 256 << 10
#: The states in which a settled file is handed to the pipeline.
_ACCEPTING = (DaemonState.RUNNING, DaemonState.PAUSED, DaemonState.RELOADING)


class Daemon:
    """One running chandrad."""

    def __init__(self, config: Config, batch: BatchRun | None = None) -> None:
        self.config = config
        #: ``chandrad batch``: no control socket, metrics or watcher; the batch feeds the
        #: pipeline and stops the daemon when its files are finished (``chandrad/batch.py``).
        self.batch = batch
        self.state = DaemonState.STARTING
        self.started = time.monotonic()
        self.exit_code = ExitCode.OK
        self.notifier = Notifier.from_env()
        self.queue = CommandQueue()
        self.tasks = TaskSupervisor(on_change=self.notify_status)
        # A task that stays dead starves systemd's watchdog: the service restarts.
        self.pinger = WatchdogPinger(self.notifier, healthy=self.tasks.healthy)
        self.reloader = Reloader(self)
        self.controls = Controls(self)
        # The parts, built by start-up.
        self.store: StoreBackend | None = None
        #: One supervisor per engine (engine/replicas.py plans them), engine 0 first; the
        #: pipeline sees them through the dispatcher.
        self.engines: list[EngineSupervisor] = []
        self.dispatcher: Dispatcher | None = None
        # One vLLM flag check for every replica; a clean verdict also serves the next start.
        self.flag_checks = FlagChecks(FlagVerdictCache(
            flag_cache_dir(config.daemon.state_dir, os.environ)))
        self.pipeline: Pipeline | None = None
        self.watcher: FolderWatcher | None = None
        self.render: RenderPool | None = None
        self.control: ControlServer | None = None
        self.metrics = Metrics(self, lambda: report.metrics_info(self))
        self.metrics_listener = MetricsListener(self.metrics)

    @property
    def engine(self) -> EngineSupervisor | None:
        """Engine 0 (the only one unless ``engine.replicas``/``cpu_affinity``/GPUs say more)."""
        return self.engines[0] if self.engines else None

    # ------------------------------------------------------------ state and systemd
    def set_state(self, new: DaemonState, reason: str = "") -> None:
        """The only writer of ``state``; an edge ``DAEMON_TRANSITIONS`` forbids is a bug."""
        old = self.state
        if new is old:
            return
        if new not in DAEMON_TRANSITIONS[old]:
            raise InternalError(f"illegal daemon transition {old.value} -> {new.value} "
                                f"({reason})")
        self.state = new
        log.info(Event.DAEMON_STATE, old=old.value, new=new.value, reason=reason)
        self.notify_status()

    def status_line(self) -> str:
        return report.status_line(self)

    def notify_status(self) -> None:
        self.notifier.status(self.status_line())

    def tick(self) -> float:
        """How long the main loop waits for a command: at most one watchdog interval, so
        an idle but healthy loop has progressed before every ping is due."""
        interval = self.pinger.interval
        return TICK if interval is None else min(TICK, interval)

    # ------------------------------------------------------------ serve
    async def serve(self) -> int:
        """Run until stopped. Returns the exit code."""
        await self._startup()
        try:
            await self._main_loop()
        except ChandradError as exc:
            # cli.py maps the exception to the process status; daemon_stopped must say the same.
            self.exit_code = exc.exit_code
            raise
        except Exception:
            self.exit_code = ExitCode.SOFTWARE
            raise
        finally:
            await shutdown.shutdown(self)
        return int(self.exit_code)

    async def _main_loop(self) -> None:
        last_status = ""
        while True:
            self.pinger.progress()
            command = await self.queue.next(self.tick())
            if self.tasks.fatal is not None:
                raise self.tasks.fatal
            self.reloader.raise_if_crashed()
            self.reloader.next()
            if command is not None:
                match command.name:
                    case DaemonCommand.SHUTDOWN_NOW:
                        return
                    case DaemonCommand.SHUTDOWN:
                        await shutdown.drain_then_stop(self)
                        return
                    case DaemonCommand.RELOAD:
                        self.reloader.request(command)
                    case (DaemonCommand.PAUSE | DaemonCommand.RESUME | DaemonCommand.DRAIN
                          | DaemonCommand.CANCEL | DaemonCommand.RETRY
                          | DaemonCommand.ENGINE_RESTART):
                        await self.controls.apply(command)
                    case _:
                        assert_never(command.name)
            self.controls.check_drained()
            line = self.status_line()
            if line != last_status:
                last_status = line
                self.notifier.status(line)

    # ------------------------------------------------------------ wiring
    async def _startup(self) -> None:
        cfg = self.config
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
        if self.batch is None:  # before any process is spawned: an address it never gets is 78
            await self.metrics_listener.start(cfg)
        self.engines = [self._supervisor(cfg, spec) for spec in plan_engines(cfg)]
        self.dispatcher = Dispatcher(self.engines)
        self.render = RenderPool(cfg.ocr.render_workers)
        self.pipeline = pipeline = Pipeline(cfg, self.store, self.dispatcher, self.render)
        pipeline.observer = self.metrics
        for engine in self.engines:
            engine.observer = self.metrics
        if self.batch is None:
            self.control = ControlServer(cfg.control_socket(), Handlers(self.controls),
                                         mode=cfg.control.mode, group=cfg.control.group)
            await self.control.start()
            self.watcher = FolderWatcher(cfg.watch, self._on_settled, loop=loop)
            await self.watcher.start()
        # A flag verdict (a config error) from an engine task ends the daemon (exit 78).
        for engine in self.engines:
            self.tasks.start(engine_name(engine.engine_id), engine.run, stop_on=(ConfigError,))
        self.tasks.start("intake", pipeline.intake_loop, quarantine=pipeline.quarantine,
                         describe=describe_item)
        self.tasks.start("dispatch", pipeline.dispatch_loop, quarantine=pipeline.quarantine,
                         describe=describe_item)
        if self.batch is not None:
            self.tasks.start("batch", self._run_batch)
        else:
            self._start_watcher_task()
        if self.pinger.interval is not None:
            self.tasks.start("watchdog", self.pinger.run)
        if self.metrics_listener.waiting:
            self.tasks.start("metrics", self._wait_for_metrics_port)
        self.set_state(DaemonState.RUNNING, "started")
        self.notifier.ready(self.status_line())
        log.info(Event.DAEMON_STARTED, version=__version__, pid=os.getpid(),
                 socket=str(cfg.control_socket()), watches=len(cfg.watch))

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
        if (new is EngineState.FATAL and self.config.engine.exit_on_fatal
                and all(e.state is EngineState.FATAL for e in self.engines)):
            self.exit_code = ExitCode.UNAVAILABLE
            self.queue.put(DaemonCommand.SHUTDOWN_NOW)

    def _has_backlog(self) -> bool:
        counts = report.queue_counts(self)
        return counts.get("pending", 0) + counts.get("active", 0) > 0

    def _on_settled(self, settled: SettledFile) -> None:
        if self.pipeline is not None and self.state in _ACCEPTING:
            self.pipeline.submit(settled.watch_index, settled.root, settled.path, settled.size,
                                 settled.mtime)

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

    # ------------------------------------------------------------ the watcher
    def _start_watcher_task(self) -> None:
        assert self.watcher is not None and self.pipeline is not None
        self.tasks.start("watcher", self.watcher.run, quarantine=self.pipeline.quarantine,
                         describe=describe_item)

    def stop_watcher(self) -> None:
        """Stop watching (drain, shutdown, or before a reload replaces the watcher)."""
        if self.watcher is not None:
            self.tasks.let_finish("watcher")
            self.watcher.stop()

    async def restart_watcher(self) -> None:
        """A reload changed ``[[watch]]``: a new watcher over the new folders."""
        if self.watcher is None:
            return
        self.stop_watcher()
        self.watcher = FolderWatcher(self.config.watch, self._on_settled,
                                     loop=asyncio.get_running_loop())
        await self.watcher.start()
        self._start_watcher_task()


def run(config: Config) -> int:
    """Entry for ``chandrad run``; ``cli.py`` maps exceptions to exit codes."""
    configure_logging(config.daemon.log_format, config.daemon.log_level)
    return asyncio.run(Daemon(config).serve())
