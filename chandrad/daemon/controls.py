"""The daemon as ``interfaces.DaemonControl``: what each control command does to it.

One method per command of the control socket (``control/handlers.py`` calls them after
checking the arguments). Reads (``status``, ``queue``, ``gpu``, ``version``) and ``rescan``
run in the request's task, assembled by ``daemon/report``. Every command that changes state
(``pause``, ``resume``, ``drain``, ``cancel``, ``retry``, ``engine restart``) is queued on
the daemon's one command queue and awaited; the main loop hands it back to :meth:`apply`,
the only place those changes are made (``reload`` goes through the queue to
``daemon/reload``). A command the daemon cannot honour in its state answers
``ControlError`` (``invalid_state``, ``not_found``); a stopping daemon refuses ``reload``
and ``engine restart`` instead of starting them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from chandrad.daemon import report
from chandrad.daemon.queue import Command, stopping_refusal
from chandrad.errors import ControlError, ControlErrorCode, InternalError
from chandrad.protocol import GpuReply, StatusReply
from chandrad.states import DaemonCommand, DaemonState, EngineCommand, PipelineMode

if TYPE_CHECKING:
    from chandrad.daemon.core import Daemon
    from chandrad.pipeline import Pipeline

#: The states an operator may pause or resume in.
_PAUSABLE = (DaemonState.RUNNING, DaemonState.PAUSED)


class Controls:
    """Implements ``DaemonControl`` for one daemon; owns the ``drain --wait`` waiters."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self._drain_waiters: list[Command] = []

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

    # ------------------------------------------------------------ through the queue
    # Each state change is a command the main loop applies (``apply``); the request
    # waits for its answer, so replies are the same as if it ran here.
    async def pause(self) -> dict[str, Any]:
        return await self.daemon.queue.ask(DaemonCommand.PAUSE)

    async def resume(self) -> dict[str, Any]:
        return await self.daemon.queue.ask(DaemonCommand.RESUME)

    async def drain(self, wait: bool = False) -> dict[str, Any]:
        return await self.daemon.queue.ask(DaemonCommand.DRAIN, wait=wait)

    async def retry(self, job_id: int | None = None, all_failed: bool = False) -> dict[str, Any]:
        return await self.daemon.queue.ask(DaemonCommand.RETRY, job_id=job_id,
                                           all_failed=all_failed)

    async def cancel(self, job_id: int) -> dict[str, Any]:
        return await self.daemon.queue.ask(DaemonCommand.CANCEL, job_id=job_id)

    async def engine_restart(self, engine_id: str | None = None) -> dict[str, Any]:
        return await self.daemon.queue.ask(DaemonCommand.ENGINE_RESTART, engine_id=engine_id)

    async def apply(self, command: Command) -> None:
        """Carry out a control command the main loop (or the SIGTERM drain) took off the
        queue and answer it: its result, or the ``ControlError`` a command the daemon
        cannot honour in its state gets. Any other exception is the request's, not the
        loop's: the control socket answers it ``internal_error`` as before."""
        args = command.args
        try:
            match command.name:
                case DaemonCommand.PAUSE:
                    result = self._pause()
                case DaemonCommand.RESUME:
                    result = self._resume()
                case DaemonCommand.DRAIN:
                    if self._drain(command):
                        return  # ``drain --wait``: answered by ``check_drained``
                    result = {"state": self.daemon.state.value,
                              "queue": report.queue_counts(self.daemon)}
                case DaemonCommand.RETRY:
                    result = self._retry(args["job_id"], args["all_failed"])
                case DaemonCommand.CANCEL:
                    result = await self._cancel(args["job_id"])
                case DaemonCommand.ENGINE_RESTART:
                    result = self._engine_restart(args["engine_id"])
                case _:
                    raise InternalError(f"{command.name.value} is not a control command")
        except Exception as exc:
            command.fail(exc)
            return
        command.answer(result)

    def _pause(self) -> dict[str, Any]:
        daemon, pipeline = self.daemon, self._pipeline()
        if daemon.state not in _PAUSABLE:
            raise ControlError(ControlErrorCode.INVALID_STATE,
                               f"cannot pause while {daemon.state.value}")
        pipeline.set_mode(PipelineMode.PAUSED)
        daemon.set_state(DaemonState.PAUSED, "operator pause")
        return {"state": daemon.state.value}

    def _resume(self) -> dict[str, Any]:
        daemon, pipeline = self.daemon, self._pipeline()
        if daemon.state not in _PAUSABLE:
            raise ControlError(ControlErrorCode.INVALID_STATE,
                               f"cannot resume while {daemon.state.value}")
        pipeline.set_mode(PipelineMode.RUNNING)
        daemon.set_state(DaemonState.RUNNING, "operator resume")
        return {"state": daemon.state.value}

    def _drain(self, command: Command) -> bool:
        """Start (or join) a drain; True when ``command`` waits for it to finish."""
        daemon, pipeline = self.daemon, self._pipeline()
        if daemon.state in _PAUSABLE:
            pipeline.set_mode(PipelineMode.DRAINING)
            daemon.set_state(DaemonState.DRAINING, "operator drain")
        elif daemon.state not in (DaemonState.DRAINING, DaemonState.DRAINED):
            raise ControlError(ControlErrorCode.INVALID_STATE,
                               f"cannot drain while {daemon.state.value}")
        self.check_drained()
        if command.args.get("wait") and daemon.state is DaemonState.DRAINING:
            self._drain_waiters.append(command)
            return True
        return False

    def check_drained(self) -> None:
        """A drain whose accepted work is all finished is ``drained``; answer its waiters.
        Called by each command and each tick of the main loop."""
        daemon = self.daemon
        if daemon.state is not DaemonState.DRAINING or daemon.pipeline is None:
            return
        if daemon.pipeline.idle():
            daemon.set_state(DaemonState.DRAINED, "all accepted work finished")
            for waiter in self._drain_waiters:
                waiter.answer({"state": "drained", "queue": report.queue_counts(daemon)})
            self._drain_waiters.clear()

    def _retry(self, job_id: int | None, all_failed: bool) -> dict[str, Any]:
        store, pipeline = self.daemon.store, self._pipeline()
        assert store is not None
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

    async def _cancel(self, job_id: int) -> dict[str, Any]:
        store, pipeline = self.daemon.store, self._pipeline()
        assert store is not None
        if store.get(job_id) is None:
            raise ControlError(ControlErrorCode.NOT_FOUND, f"no job {job_id}")
        if not await pipeline.cancel_job(job_id):
            raise ControlError(ControlErrorCode.INVALID_STATE, f"job {job_id} is already finished")
        return {"cancelled": job_id}

    def _engine_restart(self, engine_id: str | None) -> dict[str, Any]:
        daemon = self.daemon
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

    def _pipeline(self) -> Pipeline:
        assert self.daemon.pipeline is not None
        return self.daemon.pipeline

    async def rescan(self) -> dict[str, Any]:
        daemon = self.daemon
        assert daemon.watcher is not None
        if daemon.pipeline is not None and not daemon.pipeline.mode.accepts_files:
            raise ControlError(ControlErrorCode.INVALID_STATE,
                               "draining: no new files are accepted")
        found = await daemon.watcher.rescan()
        return {"candidates": found}

    # ------------------------------------------------------------ config and engines
    async def reload(self, wait: bool = False) -> dict[str, Any]:
        self._refuse_if_stopping("reload")
        return await self.daemon.reloader.requested(wait)

    def _refuse_if_stopping(self, what: str) -> None:
        if self.daemon.state is DaemonState.STOPPING:
            raise stopping_refusal(what)
