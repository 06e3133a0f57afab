"""The pipeline's three limits on pages at once, each following the engine's capacity.

- ``inflight``: requests sent and not answered, the engine's capacity (``max_num_seqs``
  plus headroom, and ``/metrics``) or ``ocr.max_in_flight``;
- ``window``: pages rendering, rendered and waiting for a request slot, or in flight: the
  requests plus a render-ahead of half of them (at least 3 pages per render worker), so a
  burst of answers is refilled from rendered pages at once;
- ``post``: answers waiting for or in post-processing (the request limit again), so
  post-processing never holds up rendering.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

#: Pages rendered ahead of a full engine: its request limit divided by this.
RENDER_AHEAD_DIVISOR = 2


class DynamicLimiter:
    """A semaphore whose limit is read from a callable each time (engine capacity)."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self.limit = limit
        self.in_use = 0
        self._cond = asyncio.Condition()

    async def acquire(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.in_use < max(1, self.limit()))
            self.in_use += 1

    async def release(self) -> None:
        async with self._cond:
            self.in_use -= 1
            # One slot came free: wake one waiter, not all (a 1,000-page job has ~1,000
            # page tasks waiting here). If the limit shrank it waits again, as would all.
            self._cond.notify(1)

    async def poke(self) -> None:
        """Re-evaluate waiters after the limit changed."""
        async with self._cond:
            self._cond.notify_all()


class Slot:
    """One page's slot in a :class:`DynamicLimiter`, given back at most once (a page
    leaves the render-ahead window when its answer arrives, or when it ends otherwise)."""

    def __init__(self, limiter: DynamicLimiter) -> None:
        self.limiter = limiter
        self.held = False

    async def acquire(self) -> None:
        await self.limiter.acquire()
        self.held = True

    async def release(self) -> None:
        if self.held:
            self.held = False
            await self.limiter.release()


class Limits:
    """The three limiters, read from ``request_limit`` (called each time it is needed)."""

    def __init__(self, request_limit: Callable[[], int], workers: int) -> None:
        self.request_limit = request_limit
        self.workers = workers
        self.inflight = DynamicLimiter(request_limit)
        self.window = DynamicLimiter(self.window_limit)
        self.post = DynamicLimiter(request_limit)

    def window_limit(self) -> int:
        """The requests plus the render-ahead, half of them (at least 3 pages per render
        worker), so that a burst of answers is refilled from rendered pages."""
        limit = self.request_limit()
        return limit + max(3 * self.workers, limit // RENDER_AHEAD_DIVISOR)

    async def poke(self) -> None:
        """Re-evaluate every waiter (the engine's capacity may have changed)."""
        await self.window.poke()
        await self.inflight.poke()
        await self.post.poke()
