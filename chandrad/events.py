"""Event names and their journal ``MESSAGE_ID`` values: one place for the emitters (every
``log.info(Event.X, ...)``), ``chandrad.logs`` (which stamps the id) and the journal
analysis (``chandrad.ctl.journal``).

Leaf module: stdlib only, so that leaf modules such as ``tasks`` can name their events too.
"""

from __future__ import annotations

from enum import StrEnum


class Event(StrEnum):
    """The name of every event that carries a ``MESSAGE_ID``: emitters, :data:`MESSAGE_IDS`
    and the journal analysis (``chandrad.ctl.journal``) all spell it from here."""

    DAEMON_STATE = "daemon_state"
    ENGINE_STATE = "engine_state"
    ENGINE_LINE = "engine_line"
    ENGINE_FAILURE = "engine_failure"
    PROFILE_CHANGE = "profile_change"
    ENGINE_RESTART = "engine_restart"
    ENGINE_READY = "engine_ready"
    JOB_ACCEPTED = "job_accepted"
    JOB_DONE = "job_done"
    JOB_FAILED = "job_failed"
    PAGE_FAILED = "page_failed"
    CONFIG_RELOADED = "config_reloaded"
    CONTROL_REQUEST = "control_request"
    DAEMON_STARTED = "daemon_started"
    DAEMON_STOPPED = "daemon_stopped"
    ENGINE_SPAWNED = "engine_spawned"
    ENGINE_STABLE = "engine_stable"
    ENGINE_ORPHANS = "engine_orphans"
    ENGINE_GPU_MEMORY_HELD = "engine_gpu_memory_held"
    CONFIG_RELOAD_REFUSED = "config_reload_refused"
    JOB_CRASHED = "job_crashed"
    ENGINE_FATAL = "engine_fatal"
    TASK_CRASHED = "task_crashed"
    JOB_HELD = "job_held"
    FILE_QUARANTINED = "file_quarantined"


#: One fixed 128-bit id per event (``journalctl MESSAGE_ID=…``); docs/systemd.md's table is
#: checked against it (tests/test_docs.py). Generated once with uuid4; never change a
#: published id.
MESSAGE_IDS: dict[Event, str] = {
    Event.DAEMON_STATE: "df9ad874d619487987c9e8daebba71cd",
    Event.ENGINE_STATE: "8dbd9f6794ee422a8d6ef1c48537db3f",
    Event.ENGINE_LINE: "a4d56d5b777f404ca4d49ad1a3ac85a1",
    Event.ENGINE_FAILURE: "b687e9e3669b41af92644a3b6920ea3e",
    Event.PROFILE_CHANGE: "ea9b6a12aaf6443f8625b375db71eb61",
    Event.ENGINE_RESTART: "9456121b54e04492ab4796ea1b39ad4a",
    Event.ENGINE_READY: "83eb47f4c5544c7da572d28b4309c70e",
    Event.JOB_ACCEPTED: "b7dfcf5327be4d20aea1766796aa84c1",
    Event.JOB_DONE: "67592c22ab6e45d0ac403a85164909d3",
    Event.JOB_FAILED: "1adbc297b6ad4e178edc11948753201f",
    Event.PAGE_FAILED: "44f39e903fe747b38f45b7dbb9dc2757",
    Event.CONFIG_RELOADED: "43350eda2eb44fea87ff141768ae76ed",
    Event.CONTROL_REQUEST: "dc62fc0e273c4ef2945240efab104123",
    # Further events the daemon emits (worth filtering on too).
    Event.DAEMON_STARTED: "cdba0b4a869f4b1a835c6d887c5fec1c",
    Event.DAEMON_STOPPED: "8dd71c6216bc4a0298623c8e9b56ace0",
    Event.ENGINE_SPAWNED: "f47cc2ced58e42638241461eab7c8859",
    Event.ENGINE_STABLE: "d452699136fd4e3fb01cd4026a9f9311",
    Event.ENGINE_ORPHANS: "f627226426f74d928110119d5b7d9817",
    Event.ENGINE_GPU_MEMORY_HELD: "a5da8ab6f05a439b9f83083e55dd7597",
    Event.CONFIG_RELOAD_REFUSED: "c6169f124ade47a89d4a4f2d52dde5bb",
    Event.JOB_CRASHED: "544a9b308fa04f22980b4ccd38e6f9a3",
    Event.ENGINE_FATAL: "0d89ab15d1054f90bab0aa0c780bf13c",
    Event.TASK_CRASHED: "e6102e2a9ac14c43b132a453b3f8f774",
    Event.JOB_HELD: "5ab98aa6b1f14341a950822e80f2d5b7",
    Event.FILE_QUARANTINED: "b28f3e87a020478b949d42dec33881a0",
}
