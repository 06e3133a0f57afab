"""The one deadline loop of the test suite: poll a condition until it holds or time runs out
(``wait_until``), or check that one keeps holding over a window (``holds_for``).

``wait_until`` (threads, subprocesses) and ``wait_until_async`` (inside an event loop) both
return the seconds the wait took, and on a timeout fail with what was awaited, the last
value seen and an optional ``context()`` (a daemon's log tail). ``gone`` is checked on
every poll so that a process that died fails the test at once instead of at the deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """The awaited condition did not hold in time (an ``AssertionError``: a test failure)."""


def _message(what: str, timeout: float, last: object, context: Callable[[], str] | None) -> str:
    text = f"{what}: not within {timeout:g} s (last value: {last!r})"
    return f"{text}\n{context()}" if context is not None else text


def wait_until(predicate: Callable[[], T], timeout: float, what: str, *, every: float = 0.2,
               gone: Callable[[], str | None] | None = None,
               context: Callable[[], str] | None = None) -> float:
    """Poll ``predicate`` every ``every`` s until it returns something true.

    ``gone`` returns a reason when waiting is pointless (the daemon exited): that fails at
    once. Returns the seconds waited.
    """
    t0 = time.monotonic()
    last: object = None
    while True:
        last = predicate()
        if last:
            return time.monotonic() - t0
        reason = gone() if gone is not None else None
        if reason:
            raise WaitTimeout(_message(f"{what} ({reason})", timeout, last, context))
        if time.monotonic() - t0 >= timeout:
            raise WaitTimeout(_message(what, timeout, last, context))
        time.sleep(every)


async def wait_until_async(predicate: Callable[[], T], timeout: float, what: str, *,
                           every: float = 0.05,
                           context: Callable[[], str] | None = None) -> float:
    """:func:`wait_until` for a test running inside an event loop (sleeps with asyncio)."""
    t0 = time.monotonic()
    last: object = None
    while True:
        last = predicate()
        if last:
            return time.monotonic() - t0
        if time.monotonic() - t0 >= timeout:
            raise WaitTimeout(_message(what, timeout, last, context))
        await asyncio.sleep(every)


def holds_for(check: Callable[[], object], seconds: float, what: str | None = None, *,
              every: float = 1.0, context: Callable[[], str] | None = None) -> float:
    """Check that a condition keeps holding over a window of ``seconds`` (a negative check:
    something must NOT happen), instead of one look after a fixed sleep.

    ``check`` runs at once, every ``every`` s and once more at the end of the window; the
    first violation fails the test there and then. With ``what``, ``check`` is a predicate
    and any false value (``None`` included) is a violation, named by ``what`` with
    ``context()``; without it, ``check`` asserts itself. Returns the seconds watched.
    """
    t0 = time.monotonic()
    end = t0 + seconds
    while True:
        value = check()
        now = time.monotonic()
        if what is not None and not value:
            text = (f"{what}: stopped holding after {now - t0:.1f} s of {seconds:g} s "
                    f"(value: {value!r})")
            raise AssertionError(f"{text}\n{context()}" if context is not None else text)
        if now >= end:
            return now - t0
        time.sleep(min(every, end - now))


def exited(proc: object) -> Callable[[], str | None]:
    """A ``gone`` check for a ``subprocess.Popen``: the reason once it has exited."""
    def check() -> str | None:
        code = proc.poll()  # type: ignore[attr-defined]
        return None if code is None else f"process exited {code}"
    return check
