"""Supervision of the daemon's long-lived asyncio tasks (one owner: :class:`TaskSupervisor`).

A loop that must live (engine supervision, intake, dispatch, the folder watcher, the
watchdog pinger) never dies silently. When one raises — or returns, which for these
loops is the same defect — the supervisor:

1. logs ``task_crashed`` with the task, the exception and the item the loop was
   working on (declared by the loop with :func:`working_on`);
2. quarantines that item through the task's ``quarantine`` callback (the pipeline
   moves a file to ``failed/`` with an ``error.json`` reason), so the restarted loop
   and a restarted daemon do not hit it again;
3. restarts the loop after a backoff (``BACKOFF_FIRST`` doubling to ``BACKOFF_MAX``;
   reset after ``STABLE_AFTER`` seconds without a crash).

A task that crashes ``GIVE_UP_AFTER`` times within ``GIVE_UP_WINDOW`` is ``dead``:
it is not restarted, :meth:`TaskSupervisor.healthy` turns false, the daemon stops
feeding the systemd watchdog and systemd restarts the service. ``chandractl status``
shows every task (state, restarts, last error, last item) via :meth:`snapshot`.

Depends on the standard library and structlog only; used by the daemon (which wires
the tasks) and by loops that declare their current item.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import structlog

from chandrad.events import Event
from chandrad.protocol import TaskStatus

log = structlog.get_logger("chandrad.tasks")

BACKOFF_FIRST = 0.5
BACKOFF_MAX = 30.0
STABLE_AFTER = 60.0
GIVE_UP_AFTER = 8
GIVE_UP_WINDOW = 600.0

Quarantine = Callable[[Any, BaseException], Awaitable[None] | None]
Describe = Callable[[Any], str]


@dataclass
class _Slot:
    """The item a supervised loop is working on (set by :func:`working_on`)."""

    item: Any = None


_current: contextvars.ContextVar[_Slot | None] = contextvars.ContextVar(
    "chandrad_task_slot", default=None)


#: How long :func:`cancel_and_wait` waits before cancelling a task again, and in all.
RECANCEL_AFTER = 1.0
GIVE_UP_STOPPING_AFTER = 30.0


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], *,
                          patience: float = RECANCEL_AFTER,
                          give_up_after: float = GIVE_UP_STOPPING_AFTER) -> list[str]:
    """Cancel ``tasks`` and wait until they are done; returns the names of any still
    running after ``give_up_after`` seconds (logged as ``tasks_not_stopping``).

    A task still running after ``patience`` seconds is cancelled again: on Python 3.11
    ``asyncio.wait_for`` swallows a cancellation that arrives as its awaitable completes,
    and a loop around it then runs on for ever (seen: the dispatch loop kept the daemon
    from exiting after SIGTERM).
    """
    pending = {t for t in tasks if not t.done()}
    for task in pending:
        task.cancel()
    deadline = time.monotonic() + give_up_after
    while pending:
        done, pending = await asyncio.wait(pending, timeout=patience)
        for task in done:
            if not task.cancelled():
                task.exception()  # retrieved: a task that raised while stopping is over
        if pending and time.monotonic() >= deadline:
            left = sorted(t.get_name() for t in pending)
            log.error("tasks_not_stopping", tasks=left, waited_s=give_up_after)
            return left
        for task in pending:
            task.cancel()
    return []


@contextlib.contextmanager
def working_on(item: Any) -> Iterator[None]:
    """Declare the item the current supervised loop is processing.

    If the block raises, the item stays recorded, so the supervisor can name and
    quarantine it; on normal exit the previous item is restored. Outside a supervised
    task this does nothing.
    """
    slot = _current.get()
    if slot is None:
        yield
        return
    previous, slot.item = slot.item, item
    yield
    slot.item = previous


@dataclass
class _Task:
    name: str
    factory: Callable[[], Awaitable[None]]
    quarantine: Quarantine | None
    describe: Describe
    state: str = "running"  # running | restarting | dead | stopped
    restarts: int = 0
    last_error: str | None = None
    last_error_at: float | None = None
    last_item: str | None = None
    crashes: list[float] = field(default_factory=list)  # monotonic times
    finishing: bool = False  # let_finish(): a return now ends supervision
    stop_on: tuple[type[BaseException], ...] = ()
    runner: asyncio.Task[None] | None = None

    def snapshot(self) -> TaskStatus:
        return {"name": self.name, "state": self.state, "restarts": self.restarts,
                "last_error": self.last_error, "last_error_at": self.last_error_at,
                "last_item": self.last_item}


class TaskSupervisor:
    """Starts, restarts, reports and stops the daemon's long-lived tasks."""

    def __init__(self, on_change: Callable[[], None] | None = None, *,
                 backoff_first: float = BACKOFF_FIRST, backoff_max: float = BACKOFF_MAX,
                 give_up_after: int = GIVE_UP_AFTER,
                 give_up_window: float = GIVE_UP_WINDOW) -> None:
        self._tasks: dict[str, _Task] = {}
        self._on_change = on_change
        self._backoff_first = backoff_first
        self._backoff_max = backoff_max
        self._give_up_after = give_up_after
        self._give_up_window = give_up_window
        #: An exception of a task's ``stop_on`` types: the daemon must stop with it.
        self.fatal: BaseException | None = None

    def start(self, name: str, factory: Callable[[], Awaitable[None]], *,
              quarantine: Quarantine | None = None, describe: Describe = repr,
              stop_on: tuple[type[BaseException], ...] = ()) -> None:
        """Run ``factory()`` as the supervised task ``name`` (replacing one of that name).

        ``quarantine(item, exc)`` is called after a crash with the item the loop
        declared; ``describe(item)`` gives the item's text for logs and status. An
        exception of a ``stop_on`` type is not a crash but the task's verdict that the
        daemon must stop (a config error): it is kept in :attr:`fatal`, not restarted.
        """
        old = self._tasks.get(name)
        if old is not None and old.runner is not None:
            old.runner.cancel()
        task = _Task(name, factory, quarantine, describe, stop_on=stop_on)
        self._tasks[name] = task
        task.runner = asyncio.create_task(self._supervise(task), name=name)

    def let_finish(self, name: str) -> None:
        """The task ``name`` was told to end (its owner is stopping it): when its loop
        returns, supervision ends instead of restarting it."""
        task = self._tasks.get(name)
        if task is not None:
            task.finishing = True

    def runner(self, name: str) -> asyncio.Task[None] | None:
        """The asyncio task that runs ``name`` (to await it at shutdown)."""
        task = self._tasks.get(name)
        return task.runner if task else None

    async def stop(self, *names: str) -> None:
        """Cancel the named tasks (all when none named) and wait for them."""
        chosen = [t for t in self._tasks.values() if not names or t.name in names]
        for task in chosen:
            task.state = "stopped"
        await cancel_and_wait([t.runner for t in chosen if t.runner is not None])

    def healthy(self) -> bool:
        """False while any task is dead (then the systemd watchdog is no longer fed)."""
        return not any(t.state == "dead" for t in self._tasks.values())

    def degraded(self) -> list[str]:
        """Tasks that are not running as they should, or have crashed since the start."""
        return [t.name for t in self._tasks.values()
                if t.state in ("restarting", "dead") or t.restarts]

    def snapshot(self) -> list[TaskStatus]:
        """Every task for ``status``: name, state, restarts, last error and item."""
        return [t.snapshot() for t in self._tasks.values()]

    # ------------------------------------------------------------------ internals

    async def _supervise(self, task: _Task) -> None:
        backoff = self._backoff_first
        while True:
            slot = _Slot()
            started = time.monotonic()
            task.state = "running"
            try:
                await self._run_in(slot, task.factory)
                if task.finishing:
                    task.state = "stopped"
                    return
                error: BaseException = RuntimeError("the loop returned; it must run until "
                                                    "the daemon stops")
            except asyncio.CancelledError:
                raise
            except task.stop_on as exc:
                task.state, task.last_error = "stopped", f"{type(exc).__name__}: {exc}"
                self.fatal = exc
                if self._on_change is not None:
                    self._on_change()
                return
            except Exception as exc:
                error = exc
            if time.monotonic() - started >= STABLE_AFTER:
                backoff = self._backoff_first
            await self._crashed(task, error, slot.item)
            if task.state == "dead" or task.finishing:
                return
            await asyncio.sleep(backoff)
            backoff = min(self._backoff_max, backoff * 2)

    @staticmethod
    async def _run_in(slot: _Slot, factory: Callable[[], Awaitable[None]]) -> None:
        _current.set(slot)  # the supervising task's own context: its loop sees the slot
        await factory()

    async def _crashed(self, task: _Task, error: BaseException, item: Any) -> None:
        now = time.monotonic()
        task.crashes = [t for t in task.crashes if now - t < self._give_up_window] + [now]
        task.restarts += 1
        task.last_error = f"{type(error).__name__}: {error}"
        task.last_error_at = time.time()
        task.last_item = None if item is None else _describe(task.describe, item)
        give_up = len(task.crashes) >= self._give_up_after
        task.state = "dead" if give_up else "restarting"
        log.error(Event.TASK_CRASHED, task=task.name, error=task.last_error, item=task.last_item,
                  restarts=task.restarts, giving_up=give_up, exc_info=error)
        if item is not None and task.quarantine is not None:
            try:
                result = task.quarantine(item, error)
                if result is not None:
                    await result
            except Exception as exc:
                log.error("task_quarantine_failed", task=task.name, item=task.last_item,
                          error=f"{type(exc).__name__}: {exc}")
        if self._on_change is not None:
            self._on_change()


def _describe(describe: Describe, item: Any) -> str:
    try:
        return describe(item)
    except Exception:
        return object.__repr__(item)
