"""Engine, daemon, pipeline, job and page states and their legal transitions; engine and
daemon commands.

Leaf module: stdlib only (Supervisor's rule for ``states.py``). String values,
because they travel to the control socket and the journal in lower case.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar

S = TypeVar("S", bound=StrEnum)


class EngineState(StrEnum):
    """Engine states (docs/operations.md, Engine states)."""

    STOPPED = "stopped"
    FETCHING = "fetching"  # the model's weights are downloaded before the engine starts
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    BACKOFF = "backoff"
    STOPPING = "stopping"
    FATAL = "fatal"


ENGINE_TRANSITIONS: dict[EngineState, frozenset[EngineState]] = {
    EngineState.STOPPED: frozenset({EngineState.FETCHING, EngineState.STARTING}),
    EngineState.FETCHING: frozenset(
        {EngineState.STARTING, EngineState.FAILED, EngineState.STOPPING}
    ),
    EngineState.STARTING: frozenset(
        {EngineState.READY, EngineState.FAILED, EngineState.STOPPING, EngineState.FATAL}
    ),
    EngineState.READY: frozenset({EngineState.FAILED, EngineState.STOPPING}),
    EngineState.FAILED: frozenset({EngineState.BACKOFF, EngineState.FATAL, EngineState.STOPPED}),
    EngineState.BACKOFF: frozenset(
        {EngineState.FETCHING, EngineState.STARTING, EngineState.STOPPED}
    ),
    EngineState.STOPPING: frozenset({EngineState.STOPPED}),
    EngineState.FATAL: frozenset(
        {EngineState.FETCHING, EngineState.STARTING, EngineState.STOPPED}
    ),
}

#: What takes an engine out of ``fatal``: nothing but an operator (the journal's hint and
#: ``chandractl status`` say the same).
ENGINE_FATAL_HINT = "fix the cause, then `chandractl engine restart` or `chandractl reload`"
#: States in which an engine process may exist.
ENGINE_HAS_PROCESS = frozenset({EngineState.STARTING, EngineState.READY, EngineState.STOPPING})
#: States in which nothing runs and nothing will until a timer or an operator acts.
ENGINE_AT_REST = frozenset({EngineState.STOPPED, EngineState.BACKOFF, EngineState.FATAL})


class EngineCommand(StrEnum):
    """What the daemon may ask of an engine supervisor (queued, run by its run loop)."""

    START = "start"
    RESTART = "restart"
    STOP = "stop"
    SHUTDOWN = "shutdown"


class DaemonState(StrEnum):
    """The daemon's own mood, separate from the engine's state."""

    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    RELOADING = "reloading"
    DRAINING = "draining"
    DRAINED = "drained"
    STOPPING = "stopping"


DAEMON_TRANSITIONS: dict[DaemonState, frozenset[DaemonState]] = {
    DaemonState.STARTING: frozenset({DaemonState.RUNNING, DaemonState.STOPPING}),
    DaemonState.RUNNING: frozenset(
        {DaemonState.PAUSED, DaemonState.RELOADING, DaemonState.DRAINING, DaemonState.STOPPING}
    ),
    DaemonState.PAUSED: frozenset(
        {DaemonState.RUNNING, DaemonState.RELOADING, DaemonState.DRAINING, DaemonState.STOPPING}
    ),
    DaemonState.RELOADING: frozenset(
        {DaemonState.RUNNING, DaemonState.PAUSED, DaemonState.DRAINING, DaemonState.STOPPING}
    ),
    DaemonState.DRAINING: frozenset({DaemonState.DRAINED, DaemonState.STOPPING}),
    DaemonState.DRAINED: frozenset({DaemonState.STOPPING}),
    DaemonState.STOPPING: frozenset(),
}


class DaemonCommand(StrEnum):
    """What signals and control requests put on the daemon's one command queue."""

    #: SIGTERM/SIGINT: drain what is in flight, then stop; a second one escalates.
    SHUTDOWN = "shutdown"
    #: Stop at once (the engine is fatal and ``engine.exit_on_fatal`` is set).
    SHUTDOWN_NOW = "shutdown_now"
    #: SIGHUP or ``chandractl reload``: re-read the config.
    RELOAD = "reload"
    #: ``chandractl pause``: send no new page to the engine (in-flight pages finish).
    PAUSE = "pause"
    #: ``chandractl resume``: dispatch again.
    RESUME = "resume"
    #: ``chandractl drain``: accept no new file, finish the accepted ones.
    DRAIN = "drain"
    #: ``chandractl cancel JOB``.
    CANCEL = "cancel"
    #: ``chandractl retry JOB|--failed``.
    RETRY = "retry"
    #: ``chandractl engine restart [ENGINE]``: handed to the engine supervisors' own queues.
    ENGINE_RESTART = "engine_restart"


class PipelineMode(StrEnum):
    """What the pipeline may do now: accept files, start queued jobs, send pages.

    The daemon's main loop is its only writer (``Pipeline.set_mode``), from the commands
    ``pause``, ``resume``, ``drain`` and ``shutdown``.
    """

    RUNNING = "running"
    #: No page is sent (requests at the engine finish); files are still accepted.
    PAUSED = "paused"
    #: No file is accepted; accepted jobs run to the end.
    DRAINING = "draining"
    #: No file is accepted and no queued job starts; the running jobs finish their pages.
    STOPPING = "stopping"
    #: Stopped while paused: nothing is accepted, started or sent.
    STOPPING_PAUSED = "stopping_paused"

    @property
    def accepts_files(self) -> bool:
        return self in (PipelineMode.RUNNING, PipelineMode.PAUSED)

    @property
    def starts_jobs(self) -> bool:
        return self in (PipelineMode.RUNNING, PipelineMode.PAUSED, PipelineMode.DRAINING)

    @property
    def dispatches(self) -> bool:
        return self in (PipelineMode.RUNNING, PipelineMode.DRAINING, PipelineMode.STOPPING)

    def stopping(self) -> PipelineMode:
        """The mode a stop moves to from this one (a pause stays in force)."""
        paused = self in (PipelineMode.PAUSED, PipelineMode.STOPPING_PAUSED)
        return PipelineMode.STOPPING_PAUSED if paused else PipelineMode.STOPPING


PIPELINE_TRANSITIONS: dict[PipelineMode, frozenset[PipelineMode]] = {
    PipelineMode.RUNNING: frozenset(
        {PipelineMode.PAUSED, PipelineMode.DRAINING, PipelineMode.STOPPING}),
    PipelineMode.PAUSED: frozenset(
        {PipelineMode.RUNNING, PipelineMode.DRAINING, PipelineMode.STOPPING_PAUSED}),
    PipelineMode.DRAINING: frozenset({PipelineMode.STOPPING}),
    PipelineMode.STOPPING: frozenset(),
    PipelineMode.STOPPING_PAUSED: frozenset(),
}


class JobState(StrEnum):
    """One accepted input file."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    PARTIAL = "partial"  # finished, some pages failed
    FAILED = "failed"
    CANCELLED = "cancelled"
    #: Its outputs could not be written for an OS condition (disk full, read-only…):
    #: the input stays accepted and the job is retried on its own (``output_unwritable``).
    HELD = "held"


JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.RUNNING, JobState.FAILED, JobState.CANCELLED}),
    JobState.RUNNING: frozenset(
        {JobState.DONE, JobState.PARTIAL, JobState.FAILED, JobState.CANCELLED, JobState.PENDING,
         JobState.HELD}
    ),
    JobState.HELD: frozenset(
        {JobState.RUNNING, JobState.PENDING, JobState.FAILED, JobState.CANCELLED}
    ),
    JobState.DONE: frozenset(),
    # chandractl retry: a partial job's failed pages are sent again, its done pages kept.
    JobState.PARTIAL: frozenset({JobState.PENDING}),
    JobState.FAILED: frozenset({JobState.PENDING}),  # chandractl retry
    JobState.CANCELLED: frozenset({JobState.PENDING}),
}
JOB_FINISHED = frozenset({JobState.DONE, JobState.PARTIAL, JobState.FAILED, JobState.CANCELLED})
JOB_ACTIVE = frozenset({JobState.PENDING, JobState.RUNNING})
#: Accepted and not finished: the input is still in the watched folder.
JOB_OPEN = frozenset({JobState.PENDING, JobState.RUNNING, JobState.HELD})


class PageState(StrEnum):
    """One page of one job."""

    PENDING = "pending"
    IN_FLIGHT = "in_flight"
    DONE = "done"
    FAILED = "failed"


PAGE_TRANSITIONS: dict[PageState, frozenset[PageState]] = {
    PageState.PENDING: frozenset({PageState.IN_FLIGHT, PageState.FAILED}),
    # IN_FLIGHT -> PENDING: the engine failed under the page, or the daemon restarted.
    PageState.IN_FLIGHT: frozenset({PageState.DONE, PageState.FAILED, PageState.PENDING}),
    PageState.DONE: frozenset(),
    PageState.FAILED: frozenset({PageState.PENDING}),
}


def is_legal(table: dict[S, frozenset[S]], old: S, new: S) -> bool:
    """Return whether ``old -> new`` is an edge of ``table``."""
    return new in table.get(old, frozenset())
