"""Accepted jobs that are not being worked on, and why: ``held`` in ``chandractl status``
and the held counts of systemd's ``STATUS=``.

A job is listed when its watch is no longer configured (``watch_removed``), it is backing
off after an error that left it unfinished (``backoff``), its outputs cannot be written
(``output_unwritable``, the ``held`` state), or the store takes no writes (``store_full``,
``store_unreachable``). The scheduler decides those waits (``chandrad.pipeline.waits``);
:class:`HeldReport` only reads them, built afresh for each report.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from chandrad import names
from chandrad.config import WatchConfig
from chandrad.errors import StoreFull
from chandrad.pipeline.intake import StoreRoom
from chandrad.pipeline.waits import JobWaits
from chandrad.protocol import HeldJob, HeldStatus
from chandrad.states import JobState
from chandrad.store import Job, StoreBackend


class HeldReport:
    """The held jobs as the scheduler sees them now."""

    def __init__(self, store: StoreBackend, waits: JobWaits, room: StoreRoom,
                 files_waiting: int, roots: Mapping[Path, WatchConfig],
                 running: Collection[int], held_jobs: Callable[[], list[Job]]) -> None:
        self.store = store
        self.waits = waits
        self.room = room
        self.files_waiting = files_waiting  # settled files in the inbox, not jobs yet
        self.roots = roots  # the configured watches, by input folder
        self.running = running  # ids of the jobs running now
        self.held_jobs = held_jobs

    def held(self) -> HeldStatus:
        """Every held job with its reason and message (for ``status``)."""
        roots = self.roots
        count, orphans = self.store.active_outside(list(roots))
        backoff = self.waits.backing_off(roots)
        now = time.monotonic()
        jobs: list[HeldJob] = [{
            "id": j.id, "file": names.display(j.abs_path), "reason": "watch_removed",
            "message": f"no configured watch has input {j.input_root} any more; put it "
                       "back in the config and reload, or cancel the job"} for j in orphans]
        jobs += [{"id": job_id, "file": b.file, "reason": "backoff", "message": b.reason,
                  "failures": b.failures, "retry_in_s": round(max(0.0, b.until - now), 1)}
                 for job_id, b in sorted(backoff.items())]
        held = self._held_waiting()
        jobs += [{"id": j.id, "file": names.display(j.abs_path), "reason": j.error_code,
                  "message": j.error_message,
                  "retry_in_s": round(self.waits.held_retry_in(j.id, now), 1)} for j in held]
        waiting = self._store_waiting()
        error = self.room.error
        if error is not None:
            jobs += [{"id": job_id, "file": file, "reason": error.code,
                      "message": self.room.message} for job_id, file in waiting.items()]
            if self.files_waiting:  # not jobs yet: one line for the files in the inbox
                jobs.append({"file": self.store.location, "reason": error.code,
                             "message": f"{self.files_waiting} settled file(s) wait in "
                                        f"the inbox: {self.room.message}"})
        return {"count": count + len(backoff) + len(held) + len(waiting), "jobs": jobs}

    def counts(self) -> dict[str, int]:
        """How many jobs :meth:`held` lists, by reason (those with none left out), without
        listing them: for systemd's ``STATUS=``, built at every turn of the main loop."""
        removed, _ = self.store.active_outside(list(self.roots), limit=0)
        out = {"watch_removed": removed, "backoff": len(self.waits.backing_off(self.roots))}
        for j in self._held_waiting():
            reason = j.error_code or JobState.HELD.value
            out[reason] = out.get(reason, 0) + 1
        out[self.room.error.code if self.room.error else StoreFull.code] = len(
            self._store_waiting())
        return {reason: n for reason, n in out.items() if n}

    def _store_waiting(self) -> dict[int, str]:
        """Jobs waiting for the store to take writes (not running now), by id: their file."""
        if not self.room.message:
            return {}
        out = {}
        for job_id in self.waits.store_wait:
            job = None if job_id in self.running else self.store.get(job_id)
            if job is not None:
                out[job_id] = names.display(job.abs_path)
        return out

    def _held_waiting(self) -> list[Job]:
        """Jobs in the ``held`` state waiting for their retry (not being retried now);
        one whose watch was removed is counted as ``watch_removed`` instead."""
        if not self.store.counts().get(JobState.HELD.value):
            return []
        return [j for j in self.held_jobs()
                if j.id not in self.running and j.input_root in self.roots]
