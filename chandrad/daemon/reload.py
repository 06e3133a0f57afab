"""Reload: re-read the config and apply it to the running daemon, or refuse it.

One reload at a time, as a task beside the main loop (its flag check can take minutes; the
loop keeps ticking and feeding systemd's watchdog meanwhile); requests that
arrive during one wait in order. An invalid config is refused and the old one stays.
``reload --wait`` returns once every engine restarted with new settings is ready, or fails
after one engine stop + one start + :data:`RELOAD_WAIT_SLACK_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from chandrad.config import Config, engine_settings_changed, load_config
from chandrad.daemon.lifecycle import Lifecycle
from chandrad.daemon.queue import Command, CommandQueue
from chandrad.daemon.watching import Watching
from chandrad.daemon.wiring import plan_engines, watch_folder_problems
from chandrad.engine.supervisor import EngineSupervisor
from chandrad.errors import ConfigError, ConfigProblem, ControlError, ControlErrorCode
from chandrad.events import Event
from chandrad.logs import configure_logging
from chandrad.pipeline import Pipeline
from chandrad.states import DAEMON_TRANSITIONS, DaemonCommand, DaemonState, EngineState
from chandrad.systemd import Notifier

log = structlog.get_logger("chandrad.daemon")

#: ``reload --wait`` waits one engine stop + one start + this for the new engine.
RELOAD_WAIT_SLACK_S = 10.0

#: The states a waiting reload may start in; starting or stopping, it waits (and is
#: refused by the shutdown).
_CAN_RELOAD = (DaemonState.RUNNING, DaemonState.PAUSED, DaemonState.DRAINING,
               DaemonState.DRAINED)


class Reloader:
    """Owns the reload task, the reloads waiting for it and the phase shown in ``status``.

    A reload that applies hands the new config to ``lifecycle`` (its owner), the engines,
    the pipeline and the watcher; ``status_line`` is what it tells systemd afterwards.
    """

    def __init__(self, lifecycle: Lifecycle, queue: CommandQueue,
                 engines: Sequence[EngineSupervisor], pipeline: Pipeline, watching: Watching,
                 notifier: Notifier, status_line: Callable[[], str]) -> None:
        self._lifecycle = lifecycle
        self._queue = queue
        self._engines = engines
        self._pipeline = pipeline
        self._watching = watching
        self._notifier = notifier
        self._status_line = status_line
        self._task: asyncio.Task[None] | None = None
        self._waiting: list[Command] = []
        #: What the running reload waits for, for the status line ("" when none does).
        self.phase = ""
        #: Why the last reload was refused, until one applies: the status line leads with
        #: it (``STATUS=reload failed: …``), so ``systemctl status`` shows the old config
        #: still runs. "" after a reload that applied.
        self.refused = ""

    def request(self, command: Command) -> None:
        """Queue a reload the main loop took off the command queue."""
        self._waiting.append(command)
        self.next()

    def next(self) -> None:
        """Start the next waiting reload as a task unless one is running.

        Not awaited by the main loop, so the loop keeps ticking (and pinging systemd's
        watchdog) while the reload waits for vLLM's flag check.
        """
        if not self._waiting or (self._task is not None and not self._task.done()):
            return
        if self._lifecycle.state not in _CAN_RELOAD:
            return
        command = self._waiting.pop(0)
        self._task = asyncio.create_task(self._run(command), name="reload")

    def raise_if_crashed(self) -> None:
        """The reload task is one-shot, not supervised: its crash is a bug and ends the
        daemon (exit 70)."""
        task = self._task
        if task is not None and task.done() and not task.cancelled():
            exc = task.exception()
            if exc is not None:
                raise exc

    async def cancel(self) -> None:
        """The daemon stops: refuse the waiting reloads and cancel the running one."""
        task, self._task = self._task, None
        for waiting in self._waiting:
            waiting.refuse("reload")
        self._waiting.clear()
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def wait_timeout(self) -> float:
        """How long ``reload --wait`` waits for the restarted engine to become ready."""
        engine = self._lifecycle.config.engine
        return engine.stop_timeout + engine.startup_timeout + RELOAD_WAIT_SLACK_S

    async def requested(self, wait: bool) -> dict[str, Any]:
        """``chandractl reload [--wait]``: queue a reload; with ``wait``, its result once
        the engines it restarted are ready (or gave up)."""
        engines = self._engines
        if not wait:
            self._queue.put(DaemonCommand.RELOAD)
            return {"queued": True}
        generations = {e.engine_id: e.generation for e in engines}
        result = await self._queue.ask(DaemonCommand.RELOAD)
        if result.get("engine_restart"):
            restarted = set(result.get("engines_restarted") or ())

            def settled(e: EngineSupervisor) -> bool:
                return e.generation != generations[e.engine_id] and e.state in (
                    EngineState.READY, EngineState.FATAL)
            limit = self.wait_timeout()
            try:
                async with asyncio.timeout(limit):
                    while not all(settled(e) for e in engines if e.engine_id in restarted):
                        await asyncio.sleep(0.5)
            except TimeoutError:
                raise ControlError(
                    ControlErrorCode.TIMEOUT,
                    f"config reloaded, but the new engine is not ready after "
                    f"{limit:g} s (engine.stop_timeout + engine.startup_timeout + "
                    f"{RELOAD_WAIT_SLACK_S:g} s); it is {engines[0].state.value}: see "
                    "chandractl status") from None
            result["engine_state"] = engines[0].state.value
        return result

    async def _run(self, command: Command) -> None:
        """Run a reload; a refused one leaves the daemon running on the old config."""
        try:
            result = await self._apply()
        except ControlError as exc:
            command.fail(exc)
            return
        except BaseException as exc:
            command.fail(ControlError(ControlErrorCode.INTERNAL_ERROR, f"reload failed: {exc!r}"))
            raise
        finally:
            self.phase = ""
        command.answer(result)

    def _end(self, previous: DaemonState, reason: str) -> None:
        """Back to the state the reload came from (a drain kept its own state meanwhile)."""
        if self._lifecycle.state is DaemonState.RELOADING:
            self._lifecycle.set_state(previous, reason)

    def _refuse(self, previous: DaemonState, problems: list[str], message: str) -> ControlError:
        """Log the refusal, go back to the previous state; the error to answer with."""
        log.error(Event.CONFIG_RELOAD_REFUSED, problems=problems)
        # Cut so the line still shows the daemon's state after it (STATUS= holds 400).
        self.refused = " ".join(("; ".join(problems) or message).split())[:200]
        self._end(previous, "reload refused")
        self._notifier.ready(self._status_line())
        return ControlError(ControlErrorCode.INVALID_STATE,
                            "new config refused, old one kept:\n" + message)

    async def _apply(self) -> dict[str, Any]:
        """Re-read the config; an invalid one is refused and the old one stays."""
        lifecycle, engines = self._lifecycle, self._engines
        running = lifecycle.config
        previous = lifecycle.state
        # A drain is not interrupted by a reload: the state stays draining/drained.
        shown = DaemonState.RELOADING if DaemonState.RELOADING in DAEMON_TRANSITIONS[previous] \
            else previous
        lifecycle.set_state(shown, "reload requested")
        self._notifier.reloading()
        try:
            new = load_config(running.path)
        except ConfigError as exc:
            raise self._refuse(previous, [str(p) for p in exc.problems],
                               exc.message) from exc
        problems: list[ConfigProblem] = []
        try:
            specs = plan_engines(new)
        except ConfigError as exc:
            problems = list(exc.problems)
            specs = []
        if new.watch != running.watch:  # a missing input, a read-only folder: refused
            problems += await asyncio.to_thread(watch_folder_problems, new, create=True)
        if not problems and engine_settings_changed(running, new) and new.engine.supervised:
            self.phase = "checking the new engine flags with vLLM's parser"
            self._notifier.status(self._status_line())
            problems = await engines[0].check_flags(specs[0].engine)
            self.phase = ""
        if problems:
            raise self._refuse(previous, [str(p) for p in problems],
                               "\n".join(str(p) for p in problems))
        new, restart_needed = keep_start_only_settings(running, new)
        if len(specs) != len(engines):
            # Engines are added or removed only at start: each has its own task, session
            # file and port, and the pipeline holds pages on them.
            restart_needed.append("engine.replicas")
        if restart_needed:
            log.warning("config_reload_partial", restart_needed=restart_needed)
        if new.daemon != running.daemon:
            configure_logging(new.daemon.log_format, new.daemon.log_level)
        restarted = [engine.engine_id
                     for engine, spec in zip(engines, specs, strict=False)
                     if await engine.reconfigure(spec.engine, new.ocr)]
        restart = bool(restarted)
        watches_changed = new.watch != running.watch
        lifecycle.set_config(new)
        self._pipeline.config = new
        if watches_changed:
            await self._watching.restart(new)
        self.refused = ""
        self._end(previous, "reloaded")
        self._notifier.ready(self._status_line())
        log.info(Event.CONFIG_RELOADED, engine_restart=restart, watches_changed=watches_changed)
        return {"reloaded": True, "engine_restart": restart, "watches_changed": watches_changed,
                "restart_needed": restart_needed, "engines_restarted": restarted}


def keep_start_only_settings(running: Config, new: Config) -> tuple[Config, list[str]]:
    """``new`` with the settings a reload cannot apply kept as they run, and their keys.

    The store (``daemon.state_dir``) and the control socket are opened once, at start;
    changing them under a running daemon would orphan its queue or its clients.
    """
    changed = [key for key, old, now in (
        ("daemon.state_dir", running.daemon.state_dir, new.daemon.state_dir),
        ("daemon.store", running.daemon.store, new.daemon.store),
        ("daemon.host_id", running.daemon.host_id, new.daemon.host_id),
        ("daemon.lease_s", running.daemon.lease_s, new.daemon.lease_s),
        ("control.socket", running.control_socket(), new.control_socket()),
        ("control.group", running.control.group, new.control.group),
        ("control.mode", running.control.mode, new.control.mode),
        ("metrics.listen", running.metrics.listen, new.metrics.listen),
        *((f"api.{f.name}", getattr(running.api, f.name), getattr(new.api, f.name))
          for f in dataclasses.fields(running.api)),
    ) if old != now]
    kept = dataclasses.replace(
        new, control=running.control, metrics=running.metrics, api=running.api,
        daemon=dataclasses.replace(
            new.daemon, state_dir=running.daemon.state_dir, store=running.daemon.store,
            store_url=running.daemon.store_url, sqlite_dir=running.daemon.sqlite_dir,
            host_id=running.daemon.host_id, lease_s=running.daemon.lease_s))
    return kept, changed
