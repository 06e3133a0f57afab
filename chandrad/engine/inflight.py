"""The requests at one engine now: each its own task, cut all at once when the engine fails.

The dispatcher sends every request of an engine through its :class:`InFlight`; the
supervisor cuts them when it fails the engine (hung, dead, unreachable), so their callers
get ``EngineUnavailable`` at once and the pipeline gives those pages back uncharged,
and it reads :attr:`InFlight.count` and :attr:`InFlight.answered` for the hung-engine
watch (``engine/progress.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from chandrad.errors import EngineUnavailable

T = TypeVar("T")


class InFlight:
    """The requests one engine has been sent and not yet answered."""

    def __init__(self) -> None:
        self._calls: set[asyncio.Future[Any]] = set()
        self._cut_reason = ""
        #: Requests the engine answered (any answer, an error too), since the daemon started.
        self.answered = 0

    @property
    def count(self) -> int:
        """Requests at the engine now."""
        return len(self._calls)

    async def run(self, request: Coroutine[Any, Any, T]) -> T:
        """Await ``request`` as its own task. An answer (an error answer too: the engine is
        alive) counts in :attr:`answered`; a request :meth:`cut` raises
        ``EngineUnavailable``, one whose caller was cancelled is cancelled as usual."""
        call = asyncio.ensure_future(request)
        self._calls.add(call)
        try:
            reply = await call
        except EngineUnavailable:
            raise
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if call.cancelled() and task is not None and not task.cancelling():
                # Cut (the engine hung or died under it), not cancelled by our caller.
                raise EngineUnavailable(self._cut_reason) from None
            raise
        except Exception:
            self.answered += 1
            raise
        finally:
            self._calls.discard(call)
        self.answered += 1
        return reply

    def cut(self, reason: str) -> None:
        """The engine failed: end every request at it now, each with ``reason``."""
        self._cut_reason = reason
        for call in self._calls:
            call.cancel()
