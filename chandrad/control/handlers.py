"""Control commands: one typed method per command, talking only to ``DaemonControl``.

Owns argument checking beyond the wire schema (``retry`` needs a job or ``--failed``)
and the shape of each result (always a dict carrying ``"v"``). Knows nothing about
sockets or permissions: ``control.server`` decides who may call what.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from chandrad import PROTOCOL_VERSION, __version__
from chandrad.errors import ControlError, ControlErrorCode, ProtocolError, StoreUnreachable
from chandrad.interfaces import DaemonControl
from chandrad.protocol import validate_args, versioned

Result = dict[str, Any]


def _as_result(cmd: str, value: Any) -> Result:
    if not isinstance(value, dict):
        raise ControlError(
            ControlErrorCode.INTERNAL_ERROR,
            f"{cmd}: the daemon returned {type(value).__name__}, not a dict"
        )
    return versioned(value)


class Handlers:
    """Dispatches validated commands to the daemon."""

    def __init__(self, daemon: DaemonControl) -> None:
        self.daemon = daemon
        self._table: dict[str, Callable[..., Awaitable[Result]]] = {
            "status": self.status,
            "queue": self.queue,
            "gpu": self.gpu,
            "version": self.version,
            "pause": self.pause,
            "resume": self.resume,
            "drain": self.drain,
            "retry": self.retry,
            "cancel": self.cancel,
            "reload": self.reload,
            "engine_restart": self.engine_restart,
            "rescan": self.rescan,
        }

    async def dispatch(self, cmd: str, args: dict[str, Any]) -> Result:
        """Validate ``args`` for ``cmd`` and run it.

        Raises:
            ControlError: ``unknown_command``/``bad_request`` from validation, whatever
                the daemon raises (``invalid_state``, ``not_found``), or
                ``store_unreachable`` when the command needed the store and its server
                cannot be reached.
        """
        validate_args(cmd, args)
        handler = self._table[cmd]
        kwargs = {k: v for k, v in args.items() if v is not None}
        try:
            return await handler(**kwargs)
        except StoreUnreachable as exc:  # the daemon carries on; the request cannot
            raise ControlError(ControlErrorCode.STORE_UNREACHABLE, exc.message) from None

    async def status(self) -> Result:
        return _as_result("status", self.daemon.status())

    async def queue(self, state: str | None = None, limit: int = 1000) -> Result:
        if limit < 1:
            raise ProtocolError(ControlErrorCode.BAD_REQUEST, "queue: limit must be at least 1")
        jobs = self.daemon.queue(state=state, limit=limit)
        return versioned({"state": state, "limit": limit, "jobs": list(jobs)})

    async def gpu(self) -> Result:
        return _as_result("gpu", self.daemon.gpu())

    async def version(self) -> Result:
        info = _as_result("version", self.daemon.version())
        info.setdefault("daemon", __version__)
        info["protocol"] = PROTOCOL_VERSION
        return info

    async def pause(self) -> Result:
        return _as_result("pause", await self.daemon.pause())

    async def resume(self) -> Result:
        return _as_result("resume", await self.daemon.resume())

    async def drain(self, wait: bool = False) -> Result:
        return _as_result("drain", await self.daemon.drain(wait=wait))

    async def retry(self, job: int | None = None, failed: bool = False) -> Result:
        if (job is None) == (not failed):
            raise ProtocolError(ControlErrorCode.BAD_REQUEST,
                                "retry: give either a job id or failed=true")
        return _as_result("retry", await self.daemon.retry(job_id=job, all_failed=failed))

    async def cancel(self, job: int) -> Result:
        return _as_result("cancel", await self.daemon.cancel(job))

    async def reload(self, wait: bool = False) -> Result:
        return _as_result("reload", await self.daemon.reload(wait=wait))

    async def engine_restart(self, engine: str | None = None) -> Result:
        return _as_result("engine_restart", await self.daemon.engine_restart(engine))

    async def rescan(self) -> Result:
        return _as_result("rescan", await self.daemon.rescan())
