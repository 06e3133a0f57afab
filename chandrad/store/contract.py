"""What the daemon asks of a store, whatever database holds it (backend-neutral).

:class:`StoreBackend` is the queue's contract: the operations the pipeline, the batch
runner, the control handlers and the metrics call, with the records of ``records``. The
SQLite :class:`~chandrad.store.sqlite.Store` is one implementation (a test holds it to this
protocol); a second backend implements the same methods with the same meaning, so one
store test suite can run against both. Opening, checking and closing are each backend's
own (a file and its lock; a server and its connection).

The meaning every backend keeps: each method is one transaction (all or nothing); jobs and
pages move along ``JOB_TRANSITIONS`` and ``PAGE_TRANSITIONS`` only (anything else raises
InternalError and changes nothing); a write the storage refuses for space raises StoreFull
and changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from chandrad.states import JobState
from chandrad.store.records import ClusterCounts, Job, Page, Recovered


@runtime_checkable
class StoreBackend(Protocol):
    """The store as the daemon's services use it."""

    #: What opening repaired after an unclean stop.
    recovered: Recovered
    #: Where the store is, for messages: a file, or a server's URL without its password.
    location: str

    def close(self) -> None: ...

    def schema_version(self) -> int: ...

    # -- jobs ------------------------------------------------------------------------

    def accept(self, watch_index: int, input_root: Path, path: Path, size: int, mtime: float,
               sha256: str, duplicates: str = "process") -> Job | None: ...

    def accept_many(self, items: Iterable[tuple[int, Path, Path, int, float, str]],
                    duplicates: str = "process") -> list[Job]: ...

    def supersede(self, job_id: int, size: int, mtime: float, sha256: str,
                  duplicates: str = "process") -> Job | None: ...

    def next_jobs(self, roots: Collection[Path], exclude: Collection[int],
                  limit: int) -> list[Job]: ...

    def active_outside(self, roots: Collection[Path],
                       limit: int = 20) -> tuple[int, list[Job]]: ...

    def get(self, job_id: int) -> Job | None: ...

    def find_active(self, abs_path: Path) -> Job | None: ...

    def next_pending(self, limit: int = 1) -> list[Job]: ...

    def list_jobs(self, state: str | None = None, limit: int = 1000) -> list[Job]: ...

    def set_job_state(self, job_id: int, state: JobState, *, error_code: str | None = None,
                      error_message: str | None = None, pages_total: int | None = None,
                      output_dir: Path | None = None, final_path: Path | None = None) -> None:
        ...

    def retry(self, job_id: int) -> bool: ...

    def retry_all_failed(self) -> int: ...

    def cancel(self, job_id: int) -> bool: ...

    def counts(self) -> dict[str, int]: ...

    def init_pages(self, job_id: int, count: int) -> None: ...

    # -- pages -----------------------------------------------------------------------

    def pages(self, job_id: int) -> list[Page]: ...

    def page(self, job_id: int, index: int) -> Page | None: ...

    # ``helped``: the page belongs to another host's job and is leased to this host
    # (``claim_helped_pages``); the step is fenced by that page lease, not the job's.
    # A single host's store has no such pages.

    def claim_page(self, job_id: int, index: int, *, helped: bool = False) -> None: ...

    def finish_page(self, job_id: int, index: int, *, result: dict[str, Any], width: int,
                    height: int, seconds: float, helped: bool = False) -> None: ...

    def fail_page(self, job_id: int, index: int, error: str, *,
                  helped: bool = False) -> None: ...

    def release_page(self, job_id: int, index: int, *, charge: bool = False,
                     helped: bool = False) -> None: ...

    def open_pages(self, job_id: int) -> list[tuple[int, str | None]]:
        """A job's pending and in-flight pages, in page order: (index, the helping host
        that holds it or None), without their results (the owner polls it)."""
        ...

    def claim_helped_pages(self, roots: Collection[Path],
                           limit: int) -> list[tuple[Job, int]]:
        """Lease up to ``limit`` pending pages of running jobs other live hosts own to
        this host (a shared store; ``[]`` on a single host's)."""
        ...

    def drop_helped_page(self, job_id: int, index: int) -> None:
        """Give up a page :meth:`claim_helped_pages` leased that was not finished."""
        ...

    def reclaim_pages(self, job_id: int) -> int:
        """The job's owner takes back its open pages whose helping host's lease expired
        (0 on a single host's store)."""
        ...

    def release_all_in_flight(self) -> int: ...

    def pages_done_since(self, t: float) -> int: ...

    def page_counts(self) -> dict[str, int]: ...

    def cluster_counts(self) -> ClusterCounts | None:
        """Hosts and leases of a shared store, in one read (None: a single host's)."""
        ...

    def listen_for_work(self, wake: Callable[[], None]) -> None:
        """Call ``wake``, from a thread of the store's own, whenever a host (this one
        too) commits work this host could take (a shared store; a single host's store
        never calls it)."""
        ...

    # -- learned profiles (per host: they are per GPU) --------------------------------

    def save_learned_profile(self, key: str, profile: dict[str, Any]) -> None: ...

    def load_learned_profile(self, key: str) -> dict[str, Any] | None: ...

    def learned_profile_saved_at(self, key: str) -> float | None: ...
