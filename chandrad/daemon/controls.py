"""The daemon as ``interfaces.DaemonControl``: what each control command does to it.

One method per command of the control socket (``control/handlers.py`` calls them after
checking the arguments). Reads are assembled by ``daemon/report``; ``reload`` goes through
the command queue (``daemon/reload``); the others act on the pipeline and the engine
supervisors directly, on the event loop. A command the daemon cannot honour in its state
raises ``ControlError`` (``invalid_state``, ``not_found``); a stopping daemon refuses
``reload`` and ``engine restart`` instead of starting them.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from chandrad.daemon import report
from chandrad.daemon.queue import stopping_refusal
from chandrad.errors import ControlError, ControlErrorCode
from chandrad.protocol import GpuReply, StatusReply
from chandrad.states import DaemonState, EngineCommand

if TYPE_CHECKING:
    from chandrad.daemon.core import Daemon

#: The states an operator may pause or resume in.
_PAUSABLE = (DaemonState.RUNNING, DaemonState.PAUSED)


class Controls:
    """Implements ``DaemonControl`` for one daemon; owns the ``drain --wait`` waiters."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self._drain_waiters: list[asyncio.Future[dict[str, Any]]] = []

    # ------------------------------------------------------------ reads
    def status(self) -> StatusReply:
        return report.status_reply(self.daemon)

    def queue(self, state: str | None = None, limit: int = 1000) -> list[dict[str, Any]]:
        assert self.daemon.store is not None
        return [job.to_dict() for job in self.daemon.store.list_jobs(state, limit)]

    def gpu(self) -> GpuReply:
        return report.gpu_reply(self.daemon)

    def version(self) -> dict[str, Any]:
        return report.version_reply(self.daemon)

    # ------------------------------------------------------------ the pipeline
    async def pause(self) -> dict[str, Any]:
        daemon = self.daemon
        assert daemon.pipeline is not None
        if daemon.state not in _PAUSABLE:
            raise ControlError(ControlErrorCode.INVALID_STATE,
                               f"cannot pause while {daemon.state.value}")
        daemon.pipeline.dispatching.clear()
        daemon.set_state(DaemonState.PAUSED, "operator pause")
        return {"state": daemon.state.value}

    async def resume(self) -> dict[str, Any]:
        daemon = self.daemon
        assert daemon.pipeline is not None
        if daemon.state not in _PAUSABLE:
            raise ControlError(ControlErrorCode.INVALID_STATE,
                               f"cannot resume while {daemon.state.value}")
        daemon.pipeline.dispatching.set()
        daemon.set_state(DaemonState.RUNNING, "operator resume")
        return {"state": daemon.state.value}

    async def drain(self, wait: bool = False) -> dict[str, Any]:
        daemon = self.daemon
        assert daemon.pipeline is not None
        if daemon.state in _PAUSABLE:
            daemon.pipeline.accepting = False
            daemon.pipeline.dispatching.set()
            daemon.set_state(DaemonState.DRAINING, "operator drain")
        elif daemon.state not in (DaemonState.DRAINING, DaemonState.DRAINED):
            raise ControlError(ControlErrorCode.INVALID_STATE,
                               f"cannot drain while {daemon.state.value}")
        self.check_drained()
        if wait and daemon.state is DaemonState.DRAINING:
            fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(fut)
            return await fut
        return {"state": daemon.state.value, "queue": report.queue_counts(daemon)}

    def check_drained(self) -> None:
        """A drain whose accepted work is all finished is ``drained``; answer its waiters.
        Called by each command and each tick of the main loop."""
        daemon = self.daemon
        if daemon.state is not DaemonState.DRAINING or daemon.pipeline is None:
            return
        if daemon.pipeline.idle():
            daemon.set_state(DaemonState.DRAINED, "all accepted work finished")
            for fut in self._drain_waiters:
                if not fut.done():
                    fut.set_result({"state": "drained", "queue": report.queue_counts(daemon)})
            self._drain_waiters.clear()

    async def retry(self, job_id: int | None = None, all_failed: bool = False) -> dict[str, Any]:
        store, pipeline = self.daemon.store, self.daemon.pipeline
        assert store is not None and pipeline is not None
        jobs = store.list_jobs("failed") if all_failed else []
        if job_id is not None:
            job = store.get(job_id)
            if job is None:
                raise ControlError(ControlErrorCode.NOT_FOUND, f"no job {job_id}")
            jobs = [job]
        retried = [j.id for j in jobs if pipeline.retry_job(j)]
        if job_id is not None and not retried:
            raise ControlError(ControlErrorCode.INVALID_STATE,
                               f"job {job_id} is not failed, partial or "
                               "cancelled")
        return {"retried": retried}

    async def cancel(self, job_id: int) -> dict[str, Any]:
        store, pipeline = self.daemon.store, self.daemon.pipeline
        assert store is not None and pipeline is not None
        if store.get(job_id) is None:
            raise ControlError(ControlErrorCode.NOT_FOUND, f"no job {job_id}")
        if not await pipeline.cancel_job(job_id):
            raise ControlError(ControlErrorCode.INVALID_STATE, f"job {job_id} is already finished")
        return {"cancelled": job_id}

    async def rescan(self) -> dict[str, Any]:
        daemon = self.daemon
        assert daemon.watcher is not None
        if daemon.pipeline is not None and not daemon.pipeline.accepting:
            raise ControlError(ControlErrorCode.INVALID_STATE,
                               "draining: no new files are accepted")
        found = await daemon.watcher.rescan()
        return {"candidates": found}

    # ------------------------------------------------------------ config and engines
    async def reload(self, wait: bool = False) -> dict[str, Any]:
        self._refuse_if_stopping("reload")
        return await self.daemon.reloader.requested(wait)

    async def engine_restart(self, engine_id: str | None = None) -> dict[str, Any]:
        daemon = self.daemon
        assert daemon.engine is not None
        self._refuse_if_stopping("engine restart")
        if not daemon.config.engine.supervised:
            raise ControlError(ControlErrorCode.INVALID_STATE,
                               "engine.url is set: the engine is remote and "
                               "not supervised by chandrad")
        chosen = [e for e in daemon.engines if engine_id is None or e.engine_id == engine_id]
        if not chosen:
            raise ControlError(ControlErrorCode.NOT_FOUND, f"no engine {engine_id!r} (engines: "
                               f"{', '.join(e.engine_id for e in daemon.engines)})")
        for engine in chosen:
            engine.request(EngineCommand.RESTART)
        return {"requested": "restart", "engine_state": chosen[0].state.value,
                "engines": {e.engine_id: e.state.value for e in chosen}}

    def _refuse_if_stopping(self, what: str) -> None:
        if self.daemon.state is DaemonState.STOPPING:
            raise stopping_refusal(what)
