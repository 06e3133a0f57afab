"""The daemon as ``interfaces.DaemonControl``: what each control command does to it.

One method per command of the control socket (``control/handlers.py`` calls them after
checking the arguments). Reads (``status``, ``queue``, ``gpu``, ``version``) and ``rescan``
run in the request's task, assembled by ``daemon/report``. Every command that changes state
(``pause``, ``resume``, ``drain``, ``cancel``, ``retry``, ``engine restart``) is queued on
the daemon's one command queue and awaited; the main loop hands it back to :meth:`apply`,
the only place those changes are made (``reload`` goes through the queue to
``daemon/reload``). A command the daemon cannot honour in its state answers
``ControlError`` (``invalid_state``, ``not_found``; ``store_unreachable`` for one that
needs a store whose server is down, ``control/handlers``); a stopping daemon refuses
``reload`` and ``engine restart`` instead of starting them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from chandrad.daemon import report
from chandrad.daemon.door import ApiStatusSource, next_jobs, with_queue_positions
from chandrad.daemon.lifecycle import Lifecycle
from chandrad.daemon.queue import Command, CommandQueue, stopping_refusal
from chandrad.daemon.reload import Reloader
from chandrad.daemon.report import Reporter
from chandrad.daemon.watching import Watching
from chandrad.engine.supervisor import EngineSupervisor
from chandrad.errors import ControlError, ControlErrorCode, InternalError, StoreUnreachable
from chandrad.pipeline import Pipeline
from chandrad.protocol import GpuReply, StatusReply
from chandrad.states import DaemonCommand, DaemonState, EngineCommand, PipelineMode
from chandrad.store import StoreBackend

#: The states an operator may pause or resume in.
_PAUSABLE = (DaemonState.RUNNING, DaemonState.PAUSED)


class Controls:
    """Implements ``DaemonControl`` for one daemon; owns the ``drain --wait`` waiters.

    The daemon's state changes through ``lifecycle`` (its owner), the pipeline's mode
    through the pipeline, each only in :meth:`apply`.
    """

    def __init__(self, lifecycle: Lifecycle, queue: CommandQueue, store: StoreBackend,
                 pipeline: Pipeline, engines: Sequence[EngineSupervisor], reporter: Reporter,
                 reloader: Reloader, watching: Watching) -> None:
        self._lifecycle = lifecycle
        self._queue = queue
        self._store = store
        self._pipeline = pipeline
        self._engines = engines
        self._reporter = reporter
        self._reloader = reloader
        self._watching = watching
        self._drain_waiters: list[Command] = []
        #: The HTTP job API's status, once it listens (``[api]``).
        self.api_status: ApiStatusSource | None = None

    # ------------------------------------------------------------ reads
    def status(self) -> StatusReply:
        reply = self._reporter.status_reply()
        reply["next_jobs"] = next_jobs(self._store)
        if self.api_status is not None:  # its webhooks' counts come from the store
            api = self._reporter.read(self.api_status, None)
            if api is not None:
                reply["api"] = api
        return reply

    def queue(self, state: str | None = None, limit: int = 1000) -> list[dict[str, Any]]:
        return with_queue_positions(
            self._store, [job.to_dict() for job in self._store.list_jobs(state, limit)])

    def gpu(self) -> GpuReply:
        return report.gpu_reply(self._engines)

    def version(self) -> dict[str, Any]:
        return report.version_reply(self._engines[0] if self._engines else None)

    # ------------------------------------------------------------ through the queue
    # Each state change is a command the main loop applies (``apply``); the request
    # waits for its answer, so replies are the same as if it ran here.
    async def pause(self) -> dict[str, Any]:
        return await self._queue.ask(DaemonCommand.PAUSE)

    async def resume(self) -> dict[str, Any]:
        return await self._queue.ask(DaemonCommand.RESUME)

    async def drain(self, wait: bool = False) -> dict[str, Any]:
        return await self._queue.ask(DaemonCommand.DRAIN, wait=wait)

    async def retry(self, job_id: int | None = None, all_failed: bool = False) -> dict[str, Any]:
        return await self._queue.ask(DaemonCommand.RETRY, job_id=job_id,
                                           all_failed=all_failed)

    async def cancel(self, job_id: int) -> dict[str, Any]:
        return await self._queue.ask(DaemonCommand.CANCEL, job_id=job_id)

    async def engine_restart(self, engine_id: str | None = None) -> dict[str, Any]:
        return await self._queue.ask(DaemonCommand.ENGINE_RESTART, engine_id=engine_id)

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
                    result = {"state": self._lifecycle.state.value,
                              "queue": self._reporter.queue_counts()}
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
        lifecycle = self._lifecycle
        if lifecycle.state not in _PAUSABLE:
            raise ControlError(ControlErrorCode.INVALID_STATE,
                               f"cannot pause while {lifecycle.state.value}")
        self._pipeline.set_mode(PipelineMode.PAUSED)
        lifecycle.set_state(DaemonState.PAUSED, "operator pause")
        return {"state": lifecycle.state.value}

    def _resume(self) -> dict[str, Any]:
        lifecycle = self._lifecycle
        if lifecycle.state not in _PAUSABLE:
            raise ControlError(ControlErrorCode.INVALID_STATE,
                               f"cannot resume while {lifecycle.state.value}")
        self._pipeline.set_mode(PipelineMode.RUNNING)
        lifecycle.set_state(DaemonState.RUNNING, "operator resume")
        return {"state": lifecycle.state.value}

    def _drain(self, command: Command) -> bool:
        """Start (or join) a drain; True when ``command`` waits for it to finish."""
        lifecycle = self._lifecycle
        if lifecycle.state in _PAUSABLE:
            self._pipeline.set_mode(PipelineMode.DRAINING)
            lifecycle.set_state(DaemonState.DRAINING, "operator drain")
        elif lifecycle.state not in (DaemonState.DRAINING, DaemonState.DRAINED):
            raise ControlError(ControlErrorCode.INVALID_STATE,
                               f"cannot drain while {lifecycle.state.value}")
        self.check_drained()
        if command.args.get("wait") and lifecycle.state is DaemonState.DRAINING:
            self._drain_waiters.append(command)
            return True
        return False

    def check_drained(self) -> None:
        """A drain whose accepted work is all finished is ``drained``; answer its waiters.
        Called by each command and each tick of the main loop."""
        if self._lifecycle.state is not DaemonState.DRAINING:
            return
        try:
            idle = self._pipeline.idle()
        except StoreUnreachable:
            return  # not known while the store's server is down: a later tick checks
        if idle:
            self._lifecycle.set_state(DaemonState.DRAINED, "all accepted work finished")
            for waiter in self._drain_waiters:
                waiter.answer({"state": "drained", "queue": self._reporter.queue_counts()})
            self._drain_waiters.clear()

    def _retry(self, job_id: int | None, all_failed: bool) -> dict[str, Any]:
        store, pipeline = self._store, self._pipeline
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
        store, pipeline = self._store, self._pipeline
        if store.get(job_id) is None:
            raise ControlError(ControlErrorCode.NOT_FOUND, f"no job {job_id}")
        if not await pipeline.cancel_job(job_id):
            raise ControlError(ControlErrorCode.INVALID_STATE, f"job {job_id} is already finished")
        return {"cancelled": job_id}

    def _engine_restart(self, engine_id: str | None) -> dict[str, Any]:
        engines = self._engines
        self._refuse_if_stopping("engine restart")
        if not self._lifecycle.config.engine.supervised:
            raise ControlError(ControlErrorCode.INVALID_STATE,
                               "engine.url is set: the engine is remote and "
                               "not supervised by chandrad")
        chosen = [e for e in engines if engine_id is None or e.engine_id == engine_id]
        if not chosen:
            raise ControlError(ControlErrorCode.NOT_FOUND, f"no engine {engine_id!r} (engines: "
                               f"{', '.join(e.engine_id for e in engines)})")
        for engine in chosen:
            engine.request(EngineCommand.RESTART)
        return {"requested": "restart", "engine_state": chosen[0].state.value,
                "engines": {e.engine_id: e.state.value for e in chosen}}

    async def rescan(self) -> dict[str, Any]:
        if not self._pipeline.mode.accepts_files:
            raise ControlError(ControlErrorCode.INVALID_STATE,
                               "draining: no new files are accepted")
        found = await self._watching.rescan()
        return {"candidates": found}

    # ------------------------------------------------------------ config and engines
    async def reload(self, wait: bool = False) -> dict[str, Any]:
        self._refuse_if_stopping("reload")
        return await self._reloader.requested(wait)

    def _refuse_if_stopping(self, what: str) -> None:
        if self._lifecycle.state is DaemonState.STOPPING:
            raise stopping_refusal(what)
