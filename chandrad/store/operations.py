"""The queue's operations over the three tables, whatever database holds them.

:class:`TableStore` hands each operation of the contract (``StoreBackend``) to the table
that owns its SQL (``jobs``, ``pages``, ``profiles``); the SQLite ``Store`` and the
PostgreSQL ``PgStore`` add their own opening, recovery and closing around it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

from chandrad.states import JobState
from chandrad.store.database import SqlDatabase
from chandrad.store.jobs import JobTable
from chandrad.store.pages import PageTable
from chandrad.store.profiles import ProfileTable
from chandrad.store.records import ClusterCounts, Job, Page, Recovered


class TableStore:
    """The contract's operations, each one transaction of one table."""

    def __init__(self, db: SqlDatabase) -> None:
        self._pages = PageTable(db)
        self._jobs = JobTable(db, self._pages)
        self._profiles = ProfileTable(db)
        self.recovered = Recovered()

    # -- jobs: chandrad.store.jobs ---------------------------------------------------

    def accept(self, watch_index: int, input_root: Path, path: Path, size: int, mtime: float,
               sha256: str, duplicates: str = "process") -> Job | None:
        """A settled file as a new pending job; ``None`` when it is not new work
        (:meth:`JobTable.accept`)."""
        return self._jobs.accept(watch_index, input_root, path, size, mtime, sha256,
                                 duplicates)

    def accept_many(self, items: Iterable[tuple[int, Path, Path, int, float, str]],
                    duplicates: str = "process") -> list[Job]:
        """:meth:`accept` for a backlog in one transaction (:meth:`JobTable.accept_many`)."""
        return self._jobs.accept_many(items, duplicates)

    def supersede(self, job_id: int, size: int, mtime: float, sha256: str,
                  duplicates: str = "process") -> Job | None:
        """End a job whose input was replaced, accept the new content
        (:meth:`JobTable.supersede`)."""
        return self._jobs.supersede(job_id, size, mtime, sha256, duplicates)

    def next_jobs(self, roots: Collection[Path], exclude: Collection[int],
                  limit: int) -> list[Job]:
        """Jobs to start, resumed ones first (:meth:`JobTable.next_jobs`)."""
        return self._jobs.next_jobs(roots, exclude, limit)

    def active_outside(self, roots: Collection[Path], limit: int = 20) -> tuple[int, list[Job]]:
        """Open jobs of watches no longer configured (:meth:`JobTable.active_outside`)."""
        return self._jobs.active_outside(roots, limit)

    def get(self, job_id: int) -> Job | None:
        """The job with this id, or ``None``."""
        return self._jobs.get(job_id)

    def find_active(self, abs_path: Path) -> Job | None:
        """The pending, running or held job for this input path, if any."""
        return self._jobs.find_active(abs_path)

    def next_pending(self, limit: int = 1) -> list[Job]:
        """The oldest pending jobs, oldest first."""
        return self._jobs.next_pending(limit)

    def list_jobs(self, state: str | None = None, limit: int = 1000) -> list[Job]:
        """Jobs, oldest first, optionally only those in ``state`` (:meth:`JobTable.list_jobs`)."""
        return self._jobs.list_jobs(state, limit)

    def set_job_state(self, job_id: int, state: JobState, *, error_code: str | None = None,
                      error_message: str | None = None, pages_total: int | None = None,
                      output_dir: Path | None = None, final_path: Path | None = None) -> None:
        """Move a job along a legal edge (:meth:`JobTable.set_job_state`)."""
        self._jobs.set_job_state(job_id, state, error_code=error_code,
                                       error_message=error_message, pages_total=pages_total,
                                       output_dir=output_dir, final_path=final_path)

    def retry(self, job_id: int) -> bool:
        """Requeue a failed, partial or cancelled job (:meth:`JobTable.retry`)."""
        return self._jobs.retry(job_id)

    def retry_all_failed(self) -> int:
        """Requeue every failed job; returns how many."""
        return self._jobs.retry_all_failed()

    def cancel(self, job_id: int) -> bool:
        """Cancel a pending, running or held job (:meth:`JobTable.cancel`)."""
        return self._jobs.cancel(job_id)

    def counts(self) -> dict[str, int]:
        """Jobs per state: pending, active (= running), held, done, failed, partial, cancelled."""
        return self._jobs.counts()

    def init_pages(self, job_id: int, count: int) -> None:
        """Create a job's pages and set ``pages_total`` (:meth:`JobTable.init_pages`)."""
        self._jobs.init_pages(job_id, count)

    # -- pages: chandrad.store.pages -------------------------------------------------

    def pages(self, job_id: int) -> list[Page]:
        """All pages of a job, in page order."""
        return self._pages.pages(job_id)

    def page(self, job_id: int, index: int) -> Page | None:
        """One page of a job, or ``None``."""
        return self._pages.page(job_id, index)

    # ``helped``: a step on a page of another host's job, leased to this host (a shared
    # store's; one host's store has none, and ignores it).

    def claim_page(self, job_id: int, index: int, *, helped: bool = False) -> None:
        """``pending -> in_flight``; charges one attempt."""
        self._pages.claim(job_id, index)

    def finish_page(self, job_id: int, index: int, *, result: dict[str, Any], width: int,
                    height: int, seconds: float, helped: bool = False) -> None:
        """``in_flight -> done``, storing the parsed result so a restart never recomputes it."""
        self._pages.finish(job_id, index, result=result, width=width, height=height,
                                 seconds=seconds)

    def fail_page(self, job_id: int, index: int, error: str, *, helped: bool = False) -> None:
        """``pending|in_flight -> failed`` with the reason."""
        self._pages.fail(job_id, index, error)

    def release_page(self, job_id: int, index: int, *, charge: bool = False,
                     helped: bool = False) -> None:
        """``in_flight -> pending``, uncharged or charged (:meth:`PageTable.release`)."""
        self._pages.release(job_id, index, charge=charge)

    def open_pages(self, job_id: int) -> list[tuple[int, str | None]]:
        """A job's pages not done or failed yet: (index, the helping host holding it;
        never one here)."""
        return [(i, None) for i in self._pages.open_pages(job_id)]

    def claim_helped_pages(self, roots: Collection[Path], limit: int) -> list[tuple[Job, int]]:
        """Pages of other hosts' jobs leased to this host (a shared store's; none here)."""
        return []

    def drop_helped_page(self, job_id: int, index: int) -> None:
        """Give up a page of another host's job (a shared store's; none here)."""

    def reclaim_pages(self, job_id: int) -> int:
        """Take back a job's pages whose helping host's lease expired (a shared store's;
        none here)."""
        return 0

    def release_all_in_flight(self) -> int:
        """Give every in-flight page back to the queue (engine died); returns how many."""
        return self._pages.release_all_in_flight()

    def pages_done_since(self, t: float) -> int:
        """Pages finished ``done`` at or after wall-clock time ``t`` (for pages/min)."""
        return self._pages.done_since(t)

    def page_counts(self) -> dict[str, int]:
        """Pages per state (pending, in_flight, done, failed), over every job."""
        return self._pages.counts()

    def cluster_counts(self) -> ClusterCounts | None:
        """The shared queue's hosts and leases (None: one host, no cluster; PostgreSQL
        overrides it)."""
        return None

    def listen_for_work(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` when another host made work this host could take: a single
        host's store has no other host, so never (PostgreSQL overrides it)."""

    # -- learned profiles: chandrad.store.profiles -----------------------------------

    def save_learned_profile(self, key: str, profile: dict[str, Any]) -> None:
        """Store the profile that proved stable for ``key`` (model, vLLM, GPU name, count)."""
        self._profiles.save(key, profile)

    def load_learned_profile(self, key: str) -> dict[str, Any] | None:
        """The learned profile for ``key``, or ``None``."""
        return self._profiles.load(key)

    def learned_profile_saved_at(self, key: str) -> float | None:
        """Wall-clock time the learned profile for ``key`` was last saved, or ``None``."""
        return self._profiles.saved_at(key)
