"""The daemon as the HTTP API's ``JobDoor``: the pipeline's mode says whether uploads are
taken, an accepted upload wakes the dispatcher, and a cancel is a ``cancel`` command on
the one command queue (answered as ``chandractl cancel`` is)."""

from __future__ import annotations

from typing import Any

from chandrad.daemon.queue import CommandQueue
from chandrad.pipeline import Pipeline
from chandrad.states import DaemonCommand


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
