"""The restart budget and backoff of one supervised engine (docs/operations.md, Engine states).

Owns the failure times inside ``[engine.downshift] window`` (more than ``max_restarts``
of them: ``fatal``), the exponential backoff before the next spawn (``backoff_initial``
doubling to ``backoff_max``, by failures in the window) and the running count of
restarts shown in ``status``. Pure: the caller passes the clock.

Becoming stable forgives the failures of the start-up (the ladder's downshifts), not those
of an engine that had been ready: an engine that keeps dying or exiting after minutes of
service (vLLM's API server exits 0 when its core dies) still spends the budget and ends
``fatal``, instead of being forgiven at every ``stable_seconds``.
"""

from __future__ import annotations

from collections import deque

from chandrad.config import DownshiftConfig


class RestartBudget:
    """Failures within the window, the backoff they earn, restarts since the start."""

    def __init__(self, downshift: DownshiftConfig) -> None:
        self.downshift = downshift
        self.restarts = 0  #: restarts after a failure since the daemon started
        self.delay = 0.0  #: the backoff in force (seconds)
        #: (when, whether the engine had been ready) of each failure in the window.
        self._failures: deque[tuple[float, bool]] = deque()

    @property
    def failures_in_window(self) -> int:
        return len(self._failures)

    def charge(self, now: float, *, after_ready: bool = False) -> str:
        """Count a failure at ``now`` (``after_ready``: of an engine that had been ready);
        the reason to give up when the budget is spent, else ``""``."""
        self._failures.append((now, after_ready))
        while self._failures and now - self._failures[0][0] > self.downshift.window:
            self._failures.popleft()
        if len(self._failures) > self.downshift.max_restarts:
            served = sum(1 for _, ready in self._failures if ready)
            return (f"{len(self._failures)} failures within {self.downshift.window:g}s "
                    f"(max_restarts={self.downshift.max_restarts})"
                    + (f", {served} of them after the engine was ready" if served else ""))
        return ""

    def next_backoff(self) -> float:
        """One more restart: its delay, doubling with the failures in the window."""
        self.restarts += 1
        n = max(1, len(self._failures))
        ds = self.downshift
        self.delay = min(ds.backoff_initial * 2 ** (n - 1), ds.backoff_max)
        return self.delay

    def forgive_startup(self) -> None:
        """The engine proved stable: the start-up's failures no longer count."""
        self._failures = deque(f for f in self._failures if f[1])

    def clear(self) -> None:
        """An operator restarted it out of ``fatal``, or a reload changed it."""
        self._failures.clear()
