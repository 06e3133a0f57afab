"""The daemon's mutable state and its one owner: the ``DaemonState``, the config in force,
the exit code, the start time.

Every part that changes one of them asks :class:`Lifecycle`. Apart from start-up's
``running`` and the stop after a crash, each state change is made while a command of the
one command queue (``daemon/queue``) is carried out: an operator's ``pause``/``resume``/
``drain`` (``daemon/controls``), a reload (``daemon/reload``), SIGTERM's drain
(``daemon/shutdown``). The exit code is recorded at once by the failure that sets it (an
exception, an engine gone fatal with ``engine.exit_on_fatal``), so that it holds however
the daemon then stops.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from chandrad.config import Config
from chandrad.errors import ExitCode, InternalError
from chandrad.events import Event
from chandrad.states import DAEMON_TRANSITIONS, DaemonState

log = structlog.get_logger("chandrad.daemon")


class Lifecycle:
    """Owns ``state`` (``set_state`` is its only writer), ``config`` (replaced only by a
    reload that applies), ``exit_code`` and ``started``; ``on_change`` is called after
    each state change (the daemon refreshes systemd's ``STATUS=``)."""

    def __init__(self, config: Config, on_change: Callable[[], None]) -> None:
        self._state = DaemonState.STARTING
        self._config = config
        self._exit_code = ExitCode.OK
        self._on_change = on_change
        #: ``time.monotonic()`` when the daemon was built (``status``'s uptime).
        self.started = time.monotonic()

    @property
    def state(self) -> DaemonState:
        return self._state

    @property
    def config(self) -> Config:
        return self._config

    @property
    def exit_code(self) -> ExitCode:
        return self._exit_code

    def set_state(self, new: DaemonState, reason: str = "") -> None:
        """The only writer of ``state``; an edge ``DAEMON_TRANSITIONS`` forbids is a bug."""
        old = self._state
        if new is old:
            return
        if new not in DAEMON_TRANSITIONS[old]:
            raise InternalError(f"illegal daemon transition {old.value} -> {new.value} "
                                f"({reason})")
        self._state = new
        log.info(Event.DAEMON_STATE, old=old.value, new=new.value, reason=reason)
        self._on_change()

    def set_config(self, new: Config) -> None:
        """A reload applied ``new`` (``daemon/reload``, its only caller)."""
        self._config = new

    def set_exit_code(self, code: ExitCode) -> None:
        """What the process exits with: a failure, or an engine gone fatal with
        ``engine.exit_on_fatal``."""
        self._exit_code = code
