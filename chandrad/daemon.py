"""The daemon: wires every part from the config and owns the lifecycle.

Start-up → serve → drain → shutdown (uvicorn's shape). Owns the one command queue
that signals and control requests both feed (gunicorn's arbiter: signal handlers
only enqueue), the ``DaemonState`` machine, reload, and the systemd notifications.
Implements ``interfaces.DaemonControl`` for the control socket. The only place
that imports concrete services and adapters together. Every long-lived task runs
under the one ``chandrad.tasks.TaskSupervisor`` (logged, quarantined, restarted,
shown in ``status``); while one is dead the systemd watchdog is no longer fed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import structlog

from chandrad import PROTOCOL_VERSION, __version__, names
from chandrad import gpu as nvml
from chandrad.batch import BatchRun
from chandrad.config import Config, engine_settings_changed, key_line, load_config
from chandrad.control.handlers import Handlers
from chandrad.control.server import ControlServer
from chandrad.engine.dispatch import Dispatcher
from chandrad.engine.learned import installed_vllm_version
from chandrad.engine.profile import GpuFacts
from chandrad.engine.replicas import GpuSlot, ReplicaSpec, plan_replicas
from chandrad.engine.supervisor import EngineSupervisor, FlagChecks
from chandrad.errors import (
    ChandradError,
    ConfigError,
    ConfigProblem,
    ControlError,
    ExitCode,
    InternalError,
    StateDirInUse,
)
from chandrad.events import Event
from chandrad.logs import configure_logging
from chandrad.metrics import Metrics, MetricsServer, parse_listen
from chandrad.pipeline import Pipeline
from chandrad.protocol import GpuReply, StatusReply
from chandrad.render import RenderPool
from chandrad.states import (
    DAEMON_TRANSITIONS,
    DaemonCommand,
    DaemonState,
    EngineCommand,
    EngineState,
)
from chandrad.store import Store
from chandrad.systemd import Notifier, WatchdogPinger
from chandrad.tasks import TaskSupervisor
from chandrad.watch import FolderWatcher, SettledFile

log = structlog.get_logger("chandrad.daemon")

TICK = 1.0
#: While draining, each tick asks systemd for this much more stop time.
DRAIN_EXTEND_S = 30.0
#: ``reload --wait`` waits one engine stop + one start + this for the new engine.
RELOAD_WAIT_SLACK_S = 10.0
#: After the drain, stopping the engine and the tasks may take engine.stop_timeout + this;
#: past it the daemon logs what still ran and exits anyway (uvicorn's shutdown deadline).
STOP_SLACK_S = 30.0


def key_line_of(cfg: Config, dotted: str) -> int | None:
    try:
        return key_line(cfg.path.read_text(encoding="utf-8"), dotted)
    except OSError:
        return None


class NvmlProbe:
    """``chandrad.gpu`` shaped as the supervisor's ``GpuProbe``."""

    def facts(self, gpus: str) -> GpuFacts | None:
        smallest = nvml.sizing_gpu(nvml.read_gpus(), gpus)
        if smallest is None:
            return None
        return GpuFacts(total_gib=smallest.memory_total / 2**30,
                        free_gib=smallest.memory_free / 2**30)

    def identity(self, gpus: str) -> tuple[str, int]:
        chosen = nvml.select(nvml.read_gpus(), gpus)
        return (chosen[0].name if chosen else "cpu"), len(chosen)

    def memory_held_by(self, pids: set[int]) -> dict[int, int]:
        return nvml.pids_holding_memory(pids)


@dataclass
class _Command:
    name: DaemonCommand
    done: asyncio.Future[dict[str, Any]] | None = None


class Daemon:
    """One running chandrad."""

    def __init__(self, config: Config, batch: BatchRun | None = None) -> None:
        self.config = config
        #: ``chandrad batch``: no control socket, metrics or watcher; the batch feeds the
        #: pipeline and stops the daemon when its files are finished (``chandrad/batch.py``).
        self.batch = batch
        self.state = DaemonState.STARTING
        self.started = time.monotonic()
        self.notifier = Notifier.from_env()
        self._commands: asyncio.Queue[_Command] = asyncio.Queue()
        self.tasks = TaskSupervisor(on_change=self._notify_status)
        # A task that stays dead starves systemd's watchdog: the service restarts.
        self.pinger = WatchdogPinger(self.notifier, healthy=self.tasks.healthy)
        self._drain_waiters: list[asyncio.Future[dict[str, Any]]] = []
        self.exit_code = ExitCode.OK
        self.store: Store | None = None
        #: One supervisor per engine (engine/replicas.py plans them), engine 0 first; the
        #: pipeline sees them through the dispatcher.
        self.engines: list[EngineSupervisor] = []
        self.dispatcher: Dispatcher | None = None
        self.flag_checks = FlagChecks()  # one vLLM flag check for every replica
        self.pipeline: Pipeline | None = None
        self.watcher: FolderWatcher | None = None
        self.render: RenderPool | None = None
        self.control: ControlServer | None = None
        self.metrics = Metrics(self, self._metrics_info)
        self.metrics_server: MetricsServer | None = None
        self.metrics_error = ""
        self._paused_before_drain = False
        # A reload runs as a task beside the main loop (its flag check can take minutes),
        # one at a time; requests that arrive meanwhile wait here in order.
        self._reload_task: asyncio.Task[None] | None = None
        self._reloads_waiting: list[_Command] = []
        self.reload_phase = ""

    @property
    def engine(self) -> EngineSupervisor | None:
        """Engine 0 (the only one unless ``engine.replicas``/``cpu_affinity``/GPUs say more)."""
        return self.engines[0] if self.engines else None

    # ------------------------------------------------------------ lifecycle
    def _set_state(self, new: DaemonState, reason: str = "") -> None:
        old = self.state
        if new is old:
            return
        if new not in DAEMON_TRANSITIONS[old]:
            raise InternalError(f"illegal daemon transition {old.value} -> {new.value} "
                                f"({reason})")
        self.state = new
        log.info(Event.DAEMON_STATE, old=old.value, new=new.value, reason=reason)
        self._notify_status()

    def status_line(self) -> str:
        engine = self.engine.state.value if self.engine else "-"
        if len(self.engines) > 1:
            ready = sum(e.state is EngineState.READY for e in self.engines)
            engine = f"{ready}/{len(self.engines)} ready"
            fatal = [e for e in self.engines if e.state is EngineState.FATAL]
            if fatal and len(fatal) < len(self.engines):
                engine += (f", FATAL {','.join(e.engine_id for e in fatal)} (chandractl "
                           f"engine restart ID): {fatal[0].fatal_reason}")
        counts = self.store.counts() if self.store else {}
        line = (f"{self.state.value}; engine {engine}; queue pending={counts.get('pending', 0)} "
                f"active={counts.get('active', 0)} done={counts.get('done', 0)} "
                f"failed={counts.get('failed', 0)}")
        if counts.get("held"):
            line += f" held={counts['held']} (outputs unwritable)"
        degraded = self.tasks.degraded()
        if degraded:
            line += f"; DEGRADED: {', '.join(degraded)} (chandractl status)"
        if self.engine and self.engine.state is EngineState.FATAL:
            # The way out goes first: a long reason is cut at systemd's STATUS= length.
            line += f"; ENGINE FATAL (chandractl engine restart): {self.engine.fatal_reason}"
        elif self.engine and self.engine.state is EngineState.STARTING:
            line += " (engine loading)"
        elif self.engine and self.engine.fetch_child is not None:
            got = self.engine.fetch_child.progress
            line += (f" (fetching {self.engine.fetch_child.model}: "
                     f"{got.done / 1e6:.0f}/{got.total / 1e6:.0f} MB)")
        if self.state is DaemonState.RELOADING and self.reload_phase:
            line += f"; reload: {self.reload_phase}"
        return line

    def _notify_status(self) -> None:
        self.notifier.status(self.status_line())

    def _on_engine_change(self, engine_id: str, new: EngineState, reason: str) -> None:
        self._notify_status()
        if new is EngineState.FAILED:  # the supervisor names the failure class as the reason
            self.metrics.engine_failed(reason, engine_id)
        # exit_on_fatal: only once no engine is left to serve (one fatal replica among
        # healthy ones must not take the healthy ones down).
        if (new is EngineState.FATAL and self.config.engine.exit_on_fatal
                and all(e.state is EngineState.FATAL for e in self.engines)):
            self.exit_code = ExitCode.UNAVAILABLE
            self._commands.put_nowait(_Command(DaemonCommand.SHUTDOWN_NOW))

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
            await self._shutdown()
        return int(self.exit_code)

    async def _startup(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        signals: tuple[tuple[signal.Signals, DaemonCommand], ...] = (
            (signal.SIGTERM, DaemonCommand.SHUTDOWN), (signal.SIGINT, DaemonCommand.SHUTDOWN),
            (signal.SIGHUP, DaemonCommand.RELOAD))
        if self.batch is not None:  # Ctrl-C stops a batch at once; a rerun resumes it
            signals = tuple((sig, DaemonCommand.SHUTDOWN_NOW) for sig, _ in signals)
        for sig, name in signals:
            loop.add_signal_handler(sig, self._commands.put_nowait, _Command(name))
        self.store = self._open_store(cfg)
        self._make_watch_folders(cfg)
        self.engines = [self._supervisor(cfg, spec) for spec in plan_engines(cfg)]
        self.dispatcher = Dispatcher(self.engines)
        self.render = RenderPool(cfg.ocr.render_workers)
        self.pipeline = Pipeline(cfg, self.store, self.dispatcher, self.render)
        self.pipeline.observer = self.metrics
        for engine in self.engines:
            engine.observer = self.metrics
        if self.batch is None:
            await self._start_metrics(cfg)
            self.control = ControlServer(cfg.control_socket(), Handlers(self),
                                         mode=cfg.control.mode, group=cfg.control.group)
            await self.control.start()
            self.watcher = FolderWatcher(cfg.watch, self._on_settled, loop=loop)
            await self.watcher.start()
        pipeline = self.pipeline
        # A flag verdict (a config error) from an engine task ends the daemon (exit 78).
        for engine in self.engines:
            self.tasks.start(_task_name(engine), engine.run, stop_on=(ConfigError,))
        self.tasks.start("intake", pipeline.intake_loop, quarantine=pipeline.quarantine,
                         describe=_describe_item)
        self.tasks.start("dispatch", pipeline.dispatch_loop, quarantine=pipeline.quarantine,
                         describe=_describe_item)
        if self.batch is not None:
            self.tasks.start("batch", self._run_batch)
        else:
            self._start_watcher_task()
        if self.pinger.interval is not None:
            self.tasks.start("watchdog", self.pinger.run)
        self._set_state(DaemonState.RUNNING, "started")
        self.notifier.ready(self.status_line())
        log.info(Event.DAEMON_STARTED, version=__version__, pid=os.getpid(),
                 socket=str(cfg.control_socket()), watches=len(cfg.watch))

    def _supervisor(self, cfg: Config, spec: ReplicaSpec) -> EngineSupervisor:
        """The supervisor of one planned engine, with its own port, session file (so that
        each replica's stale-engine reaper is its own) and CPU list."""
        session = "engine.session" if spec.id == "0" else f"engine-{spec.id}.session"
        return EngineSupervisor(
            spec.engine, cfg.ocr, gpu=NvmlProbe(), profiles=self.store,
            on_change=lambda new, reason: self._on_engine_change(spec.id, new, reason),
            session_file=cfg.daemon.state_dir / session, backlog=self._has_backlog,
            engine_id=spec.id, cpus=spec.cpus, flag_checks=self.flag_checks)

    async def _run_batch(self) -> None:
        """The batch's task: feed the pipeline, then stop the daemon once all is finished."""
        assert self.batch is not None and self.pipeline is not None and self.store is not None
        assert self.engine is not None
        stop = _Command(DaemonCommand.SHUTDOWN_NOW)
        await self.batch.run(self.pipeline, self.store, self.engine.snapshot,
                             lambda: self._commands.put_nowait(stop))
        self.tasks.let_finish("batch")

    def _metrics_info(self) -> dict[str, str]:
        vllm = (self.engine.vllm_version if self.engine and self.engine.vllm_version
                else installed_vllm_version())
        return {"version": __version__, "vllm_version": vllm, "model": self.config.engine.model}

    async def _start_metrics(self, cfg: Config) -> None:
        """Serve /metrics. An address that cannot be bound is logged and shown in
        ``status`` but does not stop the daemon: OCR matters more than its dashboard,
        and Prometheus' own ``up`` alert reports the missing target."""
        if not cfg.metrics.listen:
            return
        host, port = parse_listen(cfg.metrics.listen)
        server = MetricsServer(self.metrics, host, port)
        try:
            await server.start()
        except OSError as exc:
            self.metrics_error = f"cannot listen on {cfg.metrics.listen}: {exc.strerror or exc}"
            log.error("metrics_listen_failed", listen=cfg.metrics.listen,
                      error=exc.strerror or str(exc))
            return
        self.metrics_server = server

    @staticmethod
    def _open_store(cfg: Config) -> Store:
        try:
            return Store.open(cfg.daemon.state_dir)
        except StateDirInUse as exc:
            message, code = exc.message, exc.code
        except OSError as exc:
            message = f"cannot open the store in {cfg.daemon.state_dir}: {exc.strerror or exc}"
            code = "config_state_dir"
        raise ConfigError([ConfigProblem("daemon.state_dir", message, str(cfg.path),
                                         key_line_of(cfg, "daemon.state_dir"), code)])

    @staticmethod
    def _make_watch_folders(cfg: Config) -> None:
        problems = []
        for i, w in enumerate(cfg.watch):
            for name in ("input", "output", "done", "failed"):
                folder = getattr(w, name)
                try:
                    folder.mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    key = f"watch[{i}].{name}"
                    problems.append(ConfigProblem(
                        key, f"cannot create {folder}: {exc.strerror or exc}", str(cfg.path),
                        key_line_of(cfg, key), "config_watch_folder"))
        if problems:
            raise ConfigError(problems)

    def _start_watcher_task(self) -> None:
        assert self.watcher is not None and self.pipeline is not None
        self.tasks.start("watcher", self.watcher.run, quarantine=self.pipeline.quarantine,
                         describe=_describe_item)

    def _has_backlog(self) -> bool:
        counts = self.store.counts() if self.store else {}
        return counts.get("pending", 0) + counts.get("active", 0) > 0

    def _on_settled(self, settled: SettledFile) -> None:
        if self.pipeline is not None and self.state in (DaemonState.RUNNING, DaemonState.PAUSED,
                                                         DaemonState.RELOADING):
            self.pipeline.submit(settled.watch_index, settled.root, settled.path, settled.size,
                                 settled.mtime)

    def _tick(self) -> float:
        """How long the main loop waits for a command: at most one watchdog interval, so
        an idle but healthy loop has progressed before every ping is due."""
        interval = self.pinger.interval
        return TICK if interval is None else min(TICK, interval)

    async def _main_loop(self) -> None:
        last_status = ""
        while True:
            self.pinger.progress()
            command = await self._next_command()
            if self.tasks.fatal is not None:
                raise self.tasks.fatal
            task = self._reload_task  # one-shot, not supervised: its crash is a bug
            if task is not None and task.done() and not task.cancelled() \
                    and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
            self._next_reload()
            if command is not None:
                if command.name is DaemonCommand.SHUTDOWN_NOW:
                    return
                if command.name is DaemonCommand.SHUTDOWN:
                    if await self._drain_then_stop():
                        return
                    continue
                if command.name is DaemonCommand.RELOAD:
                    self._reloads_waiting.append(command)
                    self._next_reload()
            self._check_drained()
            line = self.status_line()
            if line != last_status:
                last_status = line
                self.notifier.status(line)

    async def _next_command(self) -> _Command | None:
        """The next queued command, or None after one tick."""
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancel.
            async with asyncio.timeout(self._tick()):
                return await self._commands.get()
        except TimeoutError:
            return None

    def _next_reload(self) -> None:
        """Start the next waiting reload as a task unless one is running.

        Not awaited by the main loop, so the loop keeps ticking (and pinging systemd's
        watchdog) while the reload waits for vLLM's flag check (issue 16 #5).
        """
        if not self._reloads_waiting or (self._reload_task is not None
                                         and not self._reload_task.done()):
            return
        if self.state not in (DaemonState.RUNNING, DaemonState.PAUSED, DaemonState.DRAINING,
                              DaemonState.DRAINED):
            return  # starting or stopping: it waits (and is dropped by shutdown)
        command = self._reloads_waiting.pop(0)
        self._reload_task = asyncio.create_task(self._reload_command(command), name="reload")

    async def _reload_command(self, command: _Command) -> None:
        """Run a reload; a refused one leaves the daemon running on the old config."""
        try:
            result = await self._reload()
        except ControlError as exc:
            if command.done is not None and not command.done.done():
                command.done.set_exception(exc)
            return
        except BaseException as exc:
            if command.done is not None and not command.done.done():
                command.done.set_exception(
                    ControlError("internal_error", f"reload failed: {exc!r}"))
            raise
        finally:
            self.reload_phase = ""
        if command.done is not None and not command.done.done():
            command.done.set_result(result)

    async def _cancel_reload(self) -> None:
        task, self._reload_task = self._reload_task, None
        for waiting in self._reloads_waiting:
            if waiting.done is not None and not waiting.done.done():
                waiting.done.set_exception(ControlError("invalid_state", "daemon stopping"))
        self._reloads_waiting.clear()
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _drain_then_stop(self) -> bool:
        """SIGTERM: stop taking files, finish what is in flight, then stop (SPEC §7)."""
        assert self.pipeline is not None and self.engine is not None
        await self._cancel_reload()
        self._set_state(DaemonState.STOPPING, "SIGTERM")
        self.notifier.stopping("draining: finishing accepted pages")
        self.pipeline.accepting = False
        self.pipeline.starting_jobs = False  # finish what runs; the queue waits for the next start
        if self.watcher is not None:
            self.tasks.let_finish("watcher")
            self.watcher.stop()
        # Jobs in flight finish their current pages only when an engine can serve them.
        deadline = time.monotonic() + self.drain_timeout()
        while (self.pipeline.active_jobs
               and any(e.state is EngineState.READY for e in self.engines)
               and time.monotonic() < deadline):
            self.notifier.extend_timeout(DRAIN_EXTEND_S)
            self.pinger.progress()
            command = await self._next_command()
            if command is None:
                continue
            if command.name is DaemonCommand.RELOAD:
                self._refuse(command, "reload")
            else:  # a second SIGTERM (or the engine fatal with exit_on_fatal): stop now
                log.warning("shutdown_escalated", command=command.name.value,
                            active_jobs=self.pipeline.active_jobs,
                            reason="stop draining: in-flight pages go back to the queue")
                self.notifier.stopping("stopping now: pages in flight return to the queue")
                break
        else:
            if self.pipeline.active_jobs and self.engine.state is EngineState.READY:
                log.warning("drain_timeout", seconds=self.drain_timeout(),
                            active_jobs=self.pipeline.active_jobs)
        return True

    def drain_timeout(self) -> float:
        """How long a SIGTERM waits for pages in flight before it stops the engine."""
        return self.config.engine.stop_timeout + 60

    def _refuse(self, command: _Command, what: str) -> None:
        """Answer a command that arrives while the daemon stops: refused, never dropped."""
        if command.done is not None and not command.done.done():
            command.done.set_exception(ControlError(
                "invalid_state", f"daemon is stopping: {what} refused"))

    def _check_drained(self) -> None:
        if self.state is not DaemonState.DRAINING or self.pipeline is None:
            return
        if self.pipeline.idle():
            self._set_state(DaemonState.DRAINED, "all accepted work finished")
            for fut in self._drain_waiters:
                if not fut.done():
                    fut.set_result({"state": "drained", "queue": self._counts()})
            self._drain_waiters.clear()

    async def _shutdown(self) -> None:
        await self._cancel_reload()
        if self.state is not DaemonState.STOPPING:
            self._set_state(DaemonState.STOPPING, "shutdown")
        self.notifier.stopping("stopping the engine")
        limit = self.config.engine.stop_timeout + STOP_SLACK_S
        self.notifier.extend_timeout(limit + 10)
        try:
            async with asyncio.timeout(limit):
                await self._stop_parts()
        except TimeoutError:
            log.error("shutdown_deadline", seconds=limit,
                      still_running=[t["name"] for t in self.tasks.snapshot()
                                     if t["state"] not in ("stopped", "dead")],
                      reason="exiting anyway; an engine left behind is stopped at the "
                             "next start (engine.session)")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await self.tasks.stop()
        if self.store is not None:
            # Pages cut off by the stop go back to the queue for the next start.
            self.store.release_all_in_flight()
            self.store.close()
        if self.render is not None:
            self.render.close()
        log.info(Event.DAEMON_STOPPED, exit_code=int(self.exit_code))

    async def _stop_parts(self) -> None:
        """Close the control socket (a request still inside a command is answered that the
        daemon stops), stop the jobs, the loops and the engine, in that order."""
        if self.watcher is not None:
            self.tasks.let_finish("watcher")
            self.watcher.stop()
        if self.control is not None:
            await self.control.close()
        if self.metrics_server is not None:
            await self.metrics_server.close()
        await self.tasks.stop("batch", "intake", "dispatch", "watcher", "watchdog")
        if self.pipeline is not None:
            # Before the store closes: a job cancelled later would find it closed.
            await self.pipeline.stop_jobs()
        if self.engines:
            for engine in self.engines:  # every engine stops at once, each its own session
                self.tasks.let_finish(_task_name(engine))
                await engine.shutdown()
            runners = [t for t in (self.tasks.runner(_task_name(e)) for e in self.engines)
                       if t is not None]
            if runners:
                with contextlib.suppress(Exception):
                    await asyncio.shield(asyncio.gather(*runners))
        await self.tasks.stop()

    def _end_reload(self, previous: DaemonState, reason: str) -> None:
        """Back to the state the reload came from (a drain kept its own state meanwhile)."""
        if self.state is DaemonState.RELOADING:
            self._set_state(previous, reason)

    async def _reload(self) -> dict[str, Any]:
        """Re-read the config; an invalid one is refused and the old one stays."""
        assert self.engine is not None and self.pipeline is not None
        previous = self.state
        # A drain is not interrupted by a reload: the state stays draining/drained.
        shown = DaemonState.RELOADING if DaemonState.RELOADING in DAEMON_TRANSITIONS[previous] \
            else previous
        self._set_state(shown, "reload requested")
        self.notifier.reloading()
        try:
            new = load_config(self.config.path)
        except ConfigError as exc:
            log.error(Event.CONFIG_RELOAD_REFUSED, problems=[str(p) for p in exc.problems])
            self._end_reload(previous, "reload refused")
            self.notifier.ready(self.status_line())
            raise ControlError("invalid_state", "new config refused, old one kept:\n"
                               + exc.message) from exc
        problems: list[ConfigProblem] = []
        try:
            specs = plan_engines(new)
        except ConfigError as exc:
            problems = list(exc.problems)
            specs = []
        if not problems and engine_settings_changed(self.config, new) and new.engine.supervised:
            self.reload_phase = "checking the new engine flags with vLLM's parser"
            self._notify_status()
            problems = await self.engine.check_flags(specs[0].engine)
            self.reload_phase = ""
        if problems:
            log.error(Event.CONFIG_RELOAD_REFUSED, problems=[str(p) for p in problems])
            self._end_reload(previous, "reload refused")
            self.notifier.ready(self.status_line())
            raise ControlError("invalid_state", "new config refused, old one kept:\n"
                               + "\n".join(str(p) for p in problems))
        new, restart_needed = _keep_start_only_settings(self.config, new)
        if len(specs) != len(self.engines):
            # Engines are added or removed only at start: each has its own task, session
            # file and port, and the pipeline holds pages on them.
            restart_needed.append("engine.replicas")
        if restart_needed:
            log.warning("config_reload_partial", restart_needed=restart_needed)
        if new.daemon != self.config.daemon:
            configure_logging(new.daemon.log_format, new.daemon.log_level)
        restarted = [engine.engine_id for engine, spec in zip(self.engines, specs, strict=False)
                     if await engine.reconfigure(spec.engine, new.ocr)]
        restart = bool(restarted)
        watches_changed = new.watch != self.config.watch
        self.config = new
        self.pipeline.config = new
        if watches_changed and self.watcher is not None:
            self.tasks.let_finish("watcher")
            self.watcher.stop()
            self.watcher = FolderWatcher(new.watch, self._on_settled,
                                         loop=asyncio.get_running_loop())
            await self.watcher.start()
            self._start_watcher_task()
        self._end_reload(previous, "reloaded")
        self.notifier.ready(self.status_line())
        log.info(Event.CONFIG_RELOADED, engine_restart=restart, watches_changed=watches_changed)
        return {"reloaded": True, "engine_restart": restart, "watches_changed": watches_changed,
                "restart_needed": restart_needed, "engines_restarted": restarted}

    # ------------------------------------------------------------ DaemonControl
    def _counts(self) -> dict[str, int]:
        return self.store.counts() if self.store else {}

    def status(self) -> StatusReply:
        assert self.store is not None and self.engine is not None
        now = time.time()
        return {
            "v": PROTOCOL_VERSION,
            "daemon": {
                "state": self.state.value,
                "pid": os.getpid(),
                "uptime_s": round(time.monotonic() - self.started, 1),
                "version": __version__,
                "config": str(self.config.path),
                "accepting": bool(self.pipeline and self.pipeline.accepting),
                "dispatching": bool(self.pipeline and self.pipeline.dispatching.is_set()),
                "degraded": self.tasks.degraded(),
                "metrics": {"listen": (f"{self.metrics_server.host}:{self.metrics_server.port}"
                                       if self.metrics_server else None),
                            "error": self.metrics_error or None},
            },
            "tasks": self.tasks.snapshot(),
            # "engine" is engine 0, kept for one release beside "engines" (issue 12).
            "engine": self.engine.snapshot(),
            "engines": self.dispatcher.engine_snapshots() if self.dispatcher else [],
            "queue": self._counts(),
            "held": self.pipeline.held() if self.pipeline else {"count": 0, "jobs": []},
            "throughput": {
                "pages_per_min_1m": float(self.store.pages_done_since(now - 60)),
                "pages_per_min_15m": round(self.store.pages_done_since(now - 900) / 15, 2),
                "active_jobs": self.pipeline.active_jobs if self.pipeline else 0,
            },
            "gpus": nvml.gpu_summary().get("gpus", []),
        }

    def queue(self, state: str | None = None, limit: int = 1000) -> list[dict[str, Any]]:
        assert self.store is not None
        return [job.to_dict() for job in self.store.list_jobs(state, limit)]

    def gpu(self) -> GpuReply:
        summary = nvml.gpu_summary()
        summary["engines"] = [{"id": e.engine_id, "pid": e.pid, "state": e.state.value,
                               "gpus": e.snapshot()["gpus"], "cpus": e.cpus or None,
                               "url": e.base_url} for e in self.engines]
        return summary

    def version(self) -> dict[str, Any]:
        return {"daemon": __version__, "protocol": PROTOCOL_VERSION,
                "engine": (self.engine.vllm_version if self.engine and self.engine.vllm_version
                           else installed_vllm_version()), "pid": os.getpid()}

    async def pause(self) -> dict[str, Any]:
        assert self.pipeline is not None
        if self.state not in (DaemonState.RUNNING, DaemonState.PAUSED):
            raise ControlError("invalid_state", f"cannot pause while {self.state.value}")
        self.pipeline.dispatching.clear()
        self._set_state(DaemonState.PAUSED, "operator pause")
        return {"state": self.state.value}

    async def resume(self) -> dict[str, Any]:
        assert self.pipeline is not None
        if self.state not in (DaemonState.RUNNING, DaemonState.PAUSED):
            raise ControlError("invalid_state", f"cannot resume while {self.state.value}")
        self.pipeline.dispatching.set()
        self._set_state(DaemonState.RUNNING, "operator resume")
        return {"state": self.state.value}

    async def drain(self, wait: bool = False) -> dict[str, Any]:
        assert self.pipeline is not None
        if self.state in (DaemonState.RUNNING, DaemonState.PAUSED):
            self.pipeline.accepting = False
            self.pipeline.dispatching.set()
            self._set_state(DaemonState.DRAINING, "operator drain")
        elif self.state not in (DaemonState.DRAINING, DaemonState.DRAINED):
            raise ControlError("invalid_state", f"cannot drain while {self.state.value}")
        self._check_drained()
        if wait and self.state is DaemonState.DRAINING:
            fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(fut)
            return await fut
        return {"state": self.state.value, "queue": self._counts()}

    async def retry(self, job_id: int | None = None, all_failed: bool = False) -> dict[str, Any]:
        assert self.store is not None and self.pipeline is not None
        jobs = self.store.list_jobs("failed") if all_failed else []
        if job_id is not None:
            job = self.store.get(job_id)
            if job is None:
                raise ControlError("not_found", f"no job {job_id}")
            jobs = [job]
        retried = [j.id for j in jobs if self.pipeline.retry_job(j)]
        if job_id is not None and not retried:
            raise ControlError("invalid_state", f"job {job_id} is not failed or cancelled")
        return {"retried": retried}

    async def cancel(self, job_id: int) -> dict[str, Any]:
        assert self.store is not None and self.pipeline is not None
        if self.store.get(job_id) is None:
            raise ControlError("not_found", f"no job {job_id}")
        if not await self.pipeline.cancel_job(job_id):
            raise ControlError("invalid_state", f"job {job_id} is already finished")
        return {"cancelled": job_id}

    def _refuse_if_stopping(self, what: str) -> None:
        if self.state is DaemonState.STOPPING:
            raise ControlError("invalid_state", f"daemon is stopping: {what} refused")

    async def reload(self, wait: bool = False) -> dict[str, Any]:
        self._refuse_if_stopping("reload")
        if not wait:
            self._commands.put_nowait(_Command(DaemonCommand.RELOAD))
            return {"queued": True}
        assert self.engine is not None
        generations = {e.engine_id: e.generation for e in self.engines}
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._commands.put_nowait(_Command(DaemonCommand.RELOAD, fut))
        result = await fut
        if result.get("engine_restart"):
            # --wait: return once every engine restarted with the new settings is ready
            # (or gave up), within the time one stop and one start may take.
            restarted = set(result.get("engines_restarted") or ())

            def settled(e: EngineSupervisor) -> bool:
                return e.generation != generations[e.engine_id] and e.state in (
                    EngineState.READY, EngineState.FATAL)
            limit = self.reload_wait_timeout()
            try:
                async with asyncio.timeout(limit):
                    while not all(settled(e) for e in self.engines if e.engine_id in restarted):
                        await asyncio.sleep(0.5)
            except TimeoutError:
                raise ControlError(
                    "timeout", f"config reloaded, but the new engine is not ready after "
                    f"{limit:g} s (engine.stop_timeout + engine.startup_timeout + "
                    f"{RELOAD_WAIT_SLACK_S:g} s); it is {self.engine.state.value}: see "
                    "chandractl status") from None
            result["engine_state"] = self.engine.state.value
        return result

    def reload_wait_timeout(self) -> float:
        """How long ``reload --wait`` waits for the restarted engine to become ready."""
        engine = self.config.engine
        return engine.stop_timeout + engine.startup_timeout + RELOAD_WAIT_SLACK_S

    async def engine_restart(self, engine_id: str | None = None) -> dict[str, Any]:
        assert self.engine is not None
        self._refuse_if_stopping("engine restart")
        if not self.config.engine.supervised:
            raise ControlError("invalid_state", "engine.url is set: the engine is remote and "
                               "not supervised by chandrad")
        chosen = [e for e in self.engines if engine_id is None or e.engine_id == engine_id]
        if not chosen:
            raise ControlError("not_found", f"no engine {engine_id!r} (engines: "
                               f"{', '.join(e.engine_id for e in self.engines)})")
        for engine in chosen:
            engine.request(EngineCommand.RESTART)
        return {"requested": "restart", "engine_state": chosen[0].state.value,
                "engines": {e.engine_id: e.state.value for e in chosen}}

    async def rescan(self) -> dict[str, Any]:
        assert self.watcher is not None
        if self.pipeline is not None and not self.pipeline.accepting:
            raise ControlError("invalid_state", "draining: no new files are accepted")
        found = await self.watcher.rescan()
        return {"candidates": found}


def plan_engines(cfg: Config) -> list[ReplicaSpec]:
    """The engines ``cfg`` asks for on this host's GPUs (NVML); a plan the GPUs cannot
    carry is a config error naming the key, file and line."""
    selected = nvml.select(nvml.read_gpus(), cfg.engine.gpus) if cfg.engine.supervised else []
    slots = [GpuSlot(g.index, g.uuid, g.memory_total) for g in selected]
    try:
        return plan_replicas(cfg.engine, slots)
    except ConfigError as exc:
        raise ConfigError([dataclasses.replace(p, file=str(cfg.path),
                                               line=key_line_of(cfg, p.key))
                           for p in exc.problems]) from None


def _task_name(engine: EngineSupervisor) -> str:
    """The task that runs an engine's supervisor: ``engine`` (engine 0), ``engine-1``, …"""
    return "engine" if engine.engine_id == "0" else f"engine-{engine.engine_id}"


def _describe_item(item: Any) -> str:
    """A task's item for logs and status: a job, or a settled file ``(index, root, path…)``."""
    if isinstance(item, tuple) and len(item) >= 3:
        return names.display(item[2])
    job_id, path = getattr(item, "id", None), getattr(item, "abs_path", None)
    if job_id is not None and path is not None:
        return f"job {job_id} ({names.display(path)})"
    return names.text(repr(item))


def _keep_start_only_settings(running: Config, new: Config) -> tuple[Config, list[str]]:
    """``new`` with the settings a reload cannot apply kept as they run, and their keys.

    The store (``daemon.state_dir``) and the control socket are opened once, at start;
    changing them under a running daemon would orphan its queue or its clients.
    """
    changed = [key for key, old, now in (
        ("daemon.state_dir", running.daemon.state_dir, new.daemon.state_dir),
        ("control.socket", running.control_socket(), new.control_socket()),
        ("control.group", running.control.group, new.control.group),
        ("control.mode", running.control.mode, new.control.mode),
        ("metrics.listen", running.metrics.listen, new.metrics.listen),
    ) if old != now]
    kept = dataclasses.replace(
        new, control=running.control, metrics=running.metrics,
        daemon=dataclasses.replace(new.daemon, state_dir=running.daemon.state_dir))
    return kept, changed


async def _serve(config: Config) -> int:
    daemon = Daemon(config)
    return await daemon.serve()


def run(config: Config) -> int:
    """Entry for ``chandrad run``; ``cli.py`` maps exceptions to exit codes."""
    configure_logging(config.daemon.log_format, config.daemon.log_level)
    return asyncio.run(_serve(config))
