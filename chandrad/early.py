"""Signals that reach ``chandrad run`` before its event loop can take them.

Leaf module (stdlib only). The entry point (``chandrad/__main__.py``) calls
:meth:`EarlySignals.hold` before it imports anything else: importing the CLI and the
daemon, reading the config and opening the store take a few hundred milliseconds, during
which SIGHUP, SIGTERM and SIGINT would otherwise have their default action and kill the
daemon (systemd counts a death by SIGHUP as a clean exit, so ``Restart=on-failure`` would
not bring it back). Until ``Daemon`` start-up replaces these handlers with the loop's own,
a signal is only recorded (the one command queue does not exist yet; handlers only
enqueue). Then:

* SIGTERM or SIGINT: ``chandrad run`` stops cleanly, exit 0 (before the daemon is built,
  nothing is started; after, the daemon's usual shutdown);
* SIGHUP after the config was read: a reload once the daemon runs;
* SIGHUP before the config was read: nothing to do (the start reads the current file);
  dropped, and logged once logging is up.

A launcher that blocks these signals across ``exec`` (``env --block-signal=HUP``) has them
delivered here: :meth:`hold` unblocks them. One that does not leaves the interpreter's own
start (before any of chandrad's code runs; ~40 ms here) with the kernel's default action:
no code in the process can cover that.
"""

from __future__ import annotations

import signal
from types import FrameType

#: The signals held until the daemon's loop takes them.
HELD_SIGNALS = (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)
_STOP = (signal.SIGTERM, signal.SIGINT)


class EarlySignals:
    """The signals recorded between the process's start and the daemon's own handlers."""

    def __init__(self) -> None:
        self.holding = False
        #: Signal numbers in the order they arrived.
        self.held: list[int] = []
        #: SIGHUPs that arrived before the config was read (dropped: nothing to reload).
        self.dropped_hups = 0

    def hold(self) -> None:
        """Record SIGHUP, SIGTERM and SIGINT from now on, and unblock them."""
        for sig in HELD_SIGNALS:
            signal.signal(sig, self._record)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_SIGNALS)
        self.holding = True

    def _record(self, signum: int, frame: FrameType | None) -> None:
        del frame
        self.held.append(signum)

    def reading_config(self) -> None:
        """The config is about to be read: a SIGHUP held so far asks for nothing more."""
        self.dropped_hups += self.held.count(signal.SIGHUP)
        self.held = [s for s in self.held if s != signal.SIGHUP]

    def stop_requested(self) -> bool:
        """Whether a SIGTERM or SIGINT is held."""
        return any(s in _STOP for s in self.held)

    def take(self) -> tuple[list[signal.Signals], int]:
        """Hand over (the caller has installed its own handlers): the signals held, in
        order, and the count of SIGHUPs dropped before the config was read."""
        held, dropped = [signal.Signals(s) for s in self.held], self.dropped_hups
        self.held, self.dropped_hups, self.holding = [], 0, False
        return held, dropped


#: The process's one holder (signal dispositions are per process).
HELD = EarlySignals()
