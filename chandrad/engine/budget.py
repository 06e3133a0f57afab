"""The restart budget and backoff of one supervised engine (SPEC §4.1).

Owns the failure times inside ``[engine.downshift] window`` (more than ``max_restarts``
of them: ``fatal``), the exponential backoff before the next spawn (``backoff_initial``
doubling to ``backoff_max``, by failures in the window) and the running count of
restarts shown in ``status``. Pure: the caller passes the clock.
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
        self._failures: deque[float] = deque()

    @property
    def failures_in_window(self) -> int:
        return len(self._failures)

    def charge(self, now: float) -> str:
        """Count a failure at ``now``; the reason to give up when the budget is spent,
        else ``""``."""
        self._failures.append(now)
        while self._failures and now - self._failures[0] > self.downshift.window:
            self._failures.popleft()
        if len(self._failures) > self.downshift.max_restarts:
            return (f"{len(self._failures)} failures within {self.downshift.window:g}s "
                    f"(max_restarts={self.downshift.max_restarts})")
        return ""

    def next_backoff(self) -> float:
        """One more restart: its delay, doubling with the failures in the window."""
        self.restarts += 1
        n = max(1, len(self._failures))
        ds = self.downshift
        self.delay = min(ds.backoff_initial * 2 ** (n - 1), ds.backoff_max)
        return self.delay

    def clear(self) -> None:
        """The engine proved stable, or an operator restarted it out of ``fatal``."""
        self._failures.clear()
