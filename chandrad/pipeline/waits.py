"""Why an accepted job is not started now, and until when (monotonic clock).

Three waits, each a job's own: a *back-off* after a run raised past its own error handling
(``BACKOFF_FIRST_S`` doubling to ``BACKOFF_MAX_S``), a *hold* while its outputs cannot be
written (``HOLD_RETRY_FIRST`` doubling to ``HOLD_RETRY_MAX``), and a *store wait* while the
store takes no writes (every ``STORE_FULL_RETRY_S``). :class:`JobWaits` keeps them and
answers which jobs are not due; the scheduler decides when a job enters or leaves a wait,
logs it and moves the job's state in the store.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from chandrad.pipeline.intake import STORE_FULL_RETRY_S

#: Back-off of a job whose run raised past its own error handling (e.g. its input could
#: not be moved to ``failed/``): first delay, doubled each time, up to the cap.
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 300.0
#: Seconds before a held job (outputs unwritable) is tried again; doubles up to the max.
HOLD_RETRY_FIRST = 5.0
HOLD_RETRY_MAX = 60.0


@dataclass(frozen=True)
class Backoff:
    """A job whose last run raised past its own error handling, and when to retry it."""

    until: float  # monotonic
    failures: int
    reason: str
    file: str
    input_root: Path | None  # the job's watch, by its input folder; None: job not found


class JobWaits:
    """The jobs waiting, by kind; every time is ``time.monotonic()``."""

    def __init__(self) -> None:
        self.backoff: dict[int, Backoff] = {}
        self._held_retry: dict[int, tuple[float, float]] = {}  # job -> (due, delay)
        self.store_wait: dict[int, float] = {}  # job -> retry due

    def not_due(self, now: float, held: Iterable[int]) -> set[int]:
        """Jobs backing off, waiting for the store, or ``held`` ones not due yet."""
        return ({i for i, b in self.backoff.items() if b.until > now}
                | {i for i, due in self.store_wait.items() if due > now}
                | {i for i in held if self._held_retry.get(i, (0.0, 0.0))[0] > now})

    def hold(self, job_id: int, now: float) -> float:
        """The job is held again: its next try's delay (doubled from the last one)."""
        _, delay = self._held_retry.get(job_id, (0.0, HOLD_RETRY_FIRST / 2))
        delay = min(HOLD_RETRY_MAX, delay * 2)
        self._held_retry[job_id] = (now + delay, delay)
        return delay

    def held_retry_in(self, job_id: int, now: float) -> float:
        """Seconds until a held job is tried again (0: due now, e.g. held at start)."""
        return max(0.0, self._held_retry.get(job_id, (now, 0.0))[0] - now)

    def back_off(self, job_id: int, now: float, reason: str, file: str,
                 input_root: Path | None) -> Backoff:
        """The job's run raised past its own error handling: its next back-off."""
        previous = self.backoff.get(job_id)
        failures = previous.failures + 1 if previous else 1
        delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (failures - 1))
        self.backoff[job_id] = Backoff(now + delay, failures, reason, file, input_root)
        return self.backoff[job_id]

    def backing_off(self, roots: Mapping[Path, object]) -> dict[int, Backoff]:
        """Jobs backing off whose watch is configured; one whose watch was removed is
        counted as ``watch_removed`` instead (once, not under both reasons)."""
        return {i: b for i, b in self.backoff.items()
                if b.input_root is None or b.input_root in roots}

    def wait_for_store(self, job_id: int, now: float) -> None:
        self.store_wait[job_id] = now + STORE_FULL_RETRY_S

    def ran(self, job_id: int) -> bool:
        """The job's run ended and recorded its outcome: no back-off or store wait left;
        True when it had been waiting for the store (which takes writes again)."""
        self.backoff.pop(job_id, None)
        return self.store_wait.pop(job_id, None) is not None

    def unhold(self, job_id: int) -> None:
        """The job is no longer held (it finished, failed, or is retried)."""
        self._held_retry.pop(job_id, None)

    def forget(self, job_id: int) -> None:
        """The job was cancelled: no wait of its own left."""
        self.backoff.pop(job_id, None)
        self._held_retry.pop(job_id, None)
