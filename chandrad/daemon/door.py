"""The daemon and the HTTP API: the daemon as the API's ``JobDoor`` (the pipeline's mode
says whether uploads are taken, an accepted upload wakes the dispatcher, a cancel is a
``cancel`` command on the one command queue, answered as ``chandractl cancel`` is), and
what ``status`` and ``queue`` add for it: the pending jobs' queue positions and the API's
own status."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from chandrad import names
from chandrad.daemon.queue import CommandQueue
from chandrad.errors import StoreUnreachable
from chandrad.pipeline import Pipeline
from chandrad.protocol import ApiStatus, QueuedJob
from chandrad.states import DaemonCommand
from chandrad.store import Store, StoreBackend
from chandrad.store.api import ApiTable

#: What ``status``'s ``api`` is read from (the running ``ApiServer``'s ``status``).
ApiStatusSource = Callable[[], ApiStatus]
#: Pending jobs ``status`` lists with their queue positions.
NEXT_JOBS = 5


class ApiDoor:
    """``chandrad.api.door.JobDoor`` over the pipeline and the command queue."""

    def __init__(self, pipeline: Pipeline, queue: CommandQueue) -> None:
        self._pipeline = pipeline
        self._queue = queue

    def accepting(self) -> bool:
        return self._pipeline.mode.accepts_files

    def accepted(self) -> None:
        self._pipeline.wake()

    async def cancel(self, job_id: int) -> dict[str, Any]:
        return await self._queue.ask(DaemonCommand.CANCEL, job_id=job_id)


def next_jobs(store: StoreBackend) -> list[QueuedJob]:
    """The next pending jobs to start, oldest first: the i-th has i jobs ahead of it
    (none while the store cannot be read)."""
    try:
        pending = store.next_pending(NEXT_JOBS)
    except StoreUnreachable:
        return []
    return [{"id": j.id, "file": names.display(j.path), "queue_position": i}
            for i, j in enumerate(pending)]


def with_queue_positions(store: StoreBackend,
                         jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``queue``'s jobs, each with its ``queue_position``: the pending jobs that start before
    it (None for a job not pending; read from the SQLite store's index)."""
    ahead: dict[int, int] = {}
    if isinstance(store, Store):
        ahead = ApiTable.of(store).queue_positions(
            [j["id"] for j in jobs if j["state"] == "pending"])
    return [j | {"queue_position": ahead.get(j["id"])} for j in jobs]
