"""Engine, daemon, job and page states and their legal transitions; engine and daemon
commands.

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
