"""What wakes an engine supervisor's run loop: queued commands and requests to look now.

Operator commands (``start``, ``restart``, ``stop``, ``shutdown``) are queued and taken one
at a time by the run loop; a failure line from the engine or a request that failed at it
asks the loop to probe the engine now instead of at its next tick.
"""

from __future__ import annotations

import asyncio
from typing import Any

from chandrad.states import EngineCommand


class Inbox:
    """The supervisor's command queue and its probe-now flag."""

    def __init__(self) -> None:
        self._commands: asyncio.Queue[EngineCommand] = asyncio.Queue()
        #: Set when the engine should be probed at once (cleared at each pause).
        self.probe_now = asyncio.Event()

    def put(self, command: EngineCommand | str) -> None:
        """Queue a command for the run loop."""
        self._commands.put_nowait(EngineCommand(command))

    def take(self) -> EngineCommand | None:
        """The next queued command, without waiting."""
        try:
            return self._commands.get_nowait()
        except asyncio.QueueEmpty:
            return None

    async def next(self, timeout: float | None) -> EngineCommand | None:
        """The next command, waiting at most ``timeout`` seconds (None: forever)."""
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancel.
            async with asyncio.timeout(timeout):
                return await self._commands.get()
        except TimeoutError:
            return None

    async def heed(self, work: asyncio.Future[Any]) -> EngineCommand | None:
        """Wait for ``work`` while hearing queued commands: the first ``stop``, ``restart``
        or ``shutdown`` is returned before ``work`` is done (``start`` is dropped)."""
        while not work.done():
            command = await self.next(0.5)
            if command is not None and command is not EngineCommand.START:
                return command
        return None

    def wake(self) -> None:
        """Ask for a probe now (wakes :meth:`pause`)."""
        self.probe_now.set()

    async def pause(self, seconds: float) -> None:
        """Sleep, but wake early for a probe request."""
        self.probe_now.clear()
        waiter = asyncio.ensure_future(self.probe_now.wait())
        try:
            await asyncio.wait({waiter}, timeout=seconds)
        finally:
            waiter.cancel()
