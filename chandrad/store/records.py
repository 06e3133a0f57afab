"""What the store hands out: a job, a page, what opening recovered (backend-neutral).

These records are the store's contract with its callers, whatever database holds the rows;
a backend maps its rows to them (``jobs.job_from_row``, ``pages.page_from_row`` for SQLite).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chandrad import names
from chandrad.states import JobState, PageState

#: What ``accept`` does with a file whose content is already queued or done.
DUPLICATE_POLICIES = ("process", "skip")


@dataclass(frozen=True)
class Job:
    """One accepted input file, as stored."""

    id: int
    watch_index: int  # position of the watch when accepted; informational only
    input_root: Path  # the watch's input folder (resolved): how the job finds its watch
    path: Path  # relative to input_root
    abs_path: Path
    size: int
    mtime: float
    sha256: str
    state: JobState
    pages_total: int | None
    attempts: int  # times the job entered RUNNING
    error_code: str | None
    error_message: str | None
    created_at: float  # wall clock (time.time())
    updated_at: float
    started_at: float | None
    finished_at: float | None
    output_dir: Path | None
    final_path: Path | None
    pages_done: int = 0
    pages_failed: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form for ``chandractl queue``."""
        return {
            "id": self.id,
            "watch_index": self.watch_index,
            "input_root": names.display(self.input_root),
            "path": names.display(self.path),
            "abs_path": names.display(self.abs_path),
            "size": self.size,
            "mtime": self.mtime,
            "sha256": self.sha256,
            "state": self.state.value,
            "pages_total": self.pages_total,
            "pages_done": self.pages_done,
            "pages_failed": self.pages_failed,
            "attempts": self.attempts,
            "error_code": self.error_code,
            "error_message": self.error_message,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "output_dir": names.display(self.output_dir) if self.output_dir else None,
            "final_path": names.display(self.final_path) if self.final_path else None,
        }


@dataclass(frozen=True)
class Page:
    """One page of one job, as stored.

    ``attempts`` counts inference attempts charged to the page (claims that ended in
    ``finish_page``/``fail_page``, or are still in flight). ``releases`` counts claims
    given back without an answer (engine died, daemon restarted); they are not charged,
    but a page with many releases is a suspect for killing the engine.
    """

    job_id: int
    index: int
    state: PageState
    attempts: int
    releases: int
    width: int | None
    height: int | None
    result: dict[str, Any] | None
    error: str | None
    seconds: float | None
    started_at: float | None
    finished_at: float | None
    #: The helping host that holds the page (a shared store: not the job's owner, which
    #: leaves the page to it) or stored it; None on a single host's store.
    holder: str | None = None


@dataclass(frozen=True)
class Recovered:
    """What :meth:`Store.open` repaired after an unclean stop."""

    pages_released: int = 0
    jobs_running: int = 0


@dataclass(frozen=True)
class ClusterCounts:
    """Where the shared queue stands, for metrics (``PgStore.cluster_counts``)."""

    hosts: dict[str, int]  #: hosts by state (``HOST_STATES``)
    jobs: dict[tuple[str, str], int]  #: open jobs by (owner host, "" for none; state)
    leases_expired: int  #: open jobs whose owner's lease expired (a takeover is due)
    takeovers: int = 0  #: jobs this host claimed from another whose lease had expired
    pages_helped: int = 0  #: pages of other hosts' jobs this host stored
