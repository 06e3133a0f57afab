"""The daemon's one command queue (gunicorn's arbiter: signal handlers only enqueue).

Signals, every control command that changes state (``pause``, ``resume``, ``drain``,
``cancel``, ``retry``, ``reload``, ``engine restart``) and an engine gone fatal with
``engine.exit_on_fatal`` put a ``DaemonCommand`` here; only the main loop (and, while it
drains, the SIGTERM drain) takes them. A command may carry a future that the one who
asked waits on: it is always answered, with the result or with the refusal of a stopping
daemon, never dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from chandrad.errors import ControlError, ControlErrorCode
from chandrad.states import DaemonCommand

#: The longest the main loop (or the SIGTERM drain) waits for the next command.
TICK = 1.0


def tick(watchdog_interval: float | None) -> float:
    """How long the loop waits for a command: at most one watchdog interval, so an idle
    but healthy loop has progressed before every ping is due."""
    return TICK if watchdog_interval is None else min(TICK, watchdog_interval)


@dataclass
class Command:
    """One queued command and, when somebody waits for its result, the future to answer."""

    name: DaemonCommand
    done: asyncio.Future[dict[str, Any]] | None = None
    #: The control request's arguments (``job_id``, ``wait``…), already checked.
    args: Mapping[str, Any] = field(default_factory=dict)

    def answer(self, result: dict[str, Any]) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(result)

    def fail(self, exc: BaseException) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(exc)

    def refuse(self, what: str) -> None:
        """Answer a command that arrives while the daemon stops: refused, never dropped."""
        self.fail(stopping_refusal(what))


def stopping_refusal(what: str) -> ControlError:
    """The one answer to a request a stopping daemon no longer carries out."""
    return ControlError(ControlErrorCode.INVALID_STATE, f"daemon is stopping: {what} refused")


class CommandQueue:
    """FIFO of :class:`Command`; safe to feed from a signal handler (``put`` never blocks)."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Command] = asyncio.Queue()

    def put(self, name: DaemonCommand,
            done: asyncio.Future[dict[str, Any]] | None = None,
            **args: Any) -> None:
        self._queue.put_nowait(Command(name, done, args))

    async def ask(self, name: DaemonCommand, **args: Any) -> dict[str, Any]:
        """Queue a command and wait for its result (or its ``ControlError``)."""
        done: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.put(name, done, **args)
        return await done

    def refuse_all(self) -> None:
        """The daemon stops: answer every command still queued with the refusal."""
        while not self._queue.empty():
            command = self._queue.get_nowait()
            command.refuse(command.name.value.replace("_", " "))

    async def next(self, tick: float) -> Command | None:
        """The next queued command, or None after ``tick`` seconds."""
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancel.
            async with asyncio.timeout(tick):
                return await self._queue.get()
        except TimeoutError:
            return None
