"""tests/waiting.py's ``holds_for``: a negative check watches its whole window and fails at
the first violation, not only at the end (a fixed sleep then one look misses a violation
that comes and goes, and lets a slow start pass unseen)."""

from __future__ import annotations

import time

import pytest
from waiting import holds_for


def test_holds_for_watches_the_whole_window() -> None:
    calls: list[float] = []

    def check() -> bool:
        calls.append(time.monotonic())
        return True

    watched = holds_for(check, 0.3, "always true", every=0.05)
    assert watched >= 0.3
    assert len(calls) >= 4  # at once, every 0.05 s, and at the end of the window
    assert calls[-1] - calls[0] >= 0.3


def test_holds_for_fails_at_the_first_violation() -> None:
    """A condition broken mid-window and restored before its end still fails, there."""
    t0 = time.monotonic()

    def flickers() -> bool:
        return not 0.1 <= time.monotonic() - t0 < 0.2

    with pytest.raises(AssertionError, match="flickers: stopped holding after") as err:
        holds_for(flickers, 2.0, "flickers", every=0.02, context=lambda: "the log tail")
    assert time.monotonic() - t0 < 1.0, "failed at the window's end instead of at once"
    assert "the log tail" in str(err.value)


def test_holds_for_predicate_none_is_a_violation_and_asserting_checks_fail_themselves() -> None:
    with pytest.raises(AssertionError, match="answers"):
        holds_for(lambda: None, 0.1, "answers", every=0.05)

    def asserting() -> None:
        assert False, "broken"  # noqa: B011 - the check's own assertion is what must fail

    with pytest.raises(AssertionError, match="broken"):
        holds_for(asserting, 0.1, every=0.05)
    holds_for(lambda: None, 0.1, every=0.05)  # an asserting check that returns None holds
