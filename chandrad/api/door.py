"""What the API needs of the daemon: whether it accepts files, waking the dispatcher, and
cancelling a job through the daemon's command queue (as ``chandractl cancel`` does)."""

from __future__ import annotations

from typing import Any, Protocol


class JobDoor(Protocol):
    """The daemon as the HTTP API sees it."""

    def accepting(self) -> bool:
        """Whether new files are taken now (not while draining or stopping)."""
        ...

    def accepted(self) -> None:
        """A job was accepted: wake the dispatcher."""
        ...

    async def cancel(self, job_id: int) -> dict[str, Any]:
        """Cancel ``job_id`` through the command queue; raises ControlError (``not_found``,
        ``invalid_state``, or a refusal while stopping)."""
        ...
