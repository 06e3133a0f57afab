"""The memory-profile policy of one engine: which profile is in force and how it moves.

Owns the downshift ladder's bookkeeping (the profiles stepped away from and why, never
gone back to), the upshift probe (one step back up after ``upshift_after`` stable seconds
with a backlog; a failed probe reverts and pins), and the adoption of a learned profile
(docs/operations.md, The downshift ladder). Pure: it decides and records; the supervisor logs,
spawns and saves. :func:`engine.profile.next_profile` is the ladder itself.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chandrad.config import DownshiftConfig
from chandrad.engine import replan
from chandrad.engine.classify import Diagnosis
from chandrad.engine.profile import GpuFacts, MemoryProfile, next_profile
from chandrad.protocol import ProfileChangeStatus

if TYPE_CHECKING:
    from chandrad.engine.replan import PlanContext


@dataclass
class ProfileChange:
    """One ``profile_change`` event: when, why, and every knob that moved."""

    at: float
    reason: str
    failure: str
    changes: dict[str, tuple[Any, Any]]
    degraded: bool = False

    def to_dict(self) -> ProfileChangeStatus:
        return {
            "at": self.at,
            "reason": self.reason,
            "class": self.failure,
            "changes": {k: {"old": o, "new": n} for k, (o, n) in self.changes.items()},
            "degraded": self.degraded,
        }


@dataclass(frozen=True)
class FailureOutcome:
    """What a failure does to the profile: a change (or none), or give up (``fatal``)."""

    change: ProfileChange | None = None
    fatal: str = ""  #: non-empty: the ladder cannot help; the reason


class ProfilePolicy:
    """The profile in force for one engine, the ladder's memory and the upshift probe."""

    def __init__(self, configured: MemoryProfile, downshift: DownshiftConfig) -> None:
        self.changes: deque[ProfileChange] = deque(maxlen=50)
        self.reset(configured, downshift)

    def reset(self, configured: MemoryProfile, downshift: DownshiftConfig) -> None:
        """Start over from ``configured`` (a start, or a reload that changed the engine)."""
        self.downshift = downshift
        self.configured = configured
        self.profile = configured
        self.source = "config"
        #: The profiles before each downshift step, newest last (where an upshift goes).
        self.steps_down: list[MemoryProfile] = []
        #: While probing one step up: the profile to fall back to.
        self.upshift_fallback: MemoryProfile | None = None
        #: A probe failed: no more upshifts until the engine settings change.
        self.upshift_pinned = False
        #: Profiles the ladder moved away from, with their failure: never gone back to.
        self.failed: dict[MemoryProfile, tuple[str, dict[str, float]]] = {}

    def adopt_learned(self, learned: MemoryProfile, *, tuned: bool = False) -> None:
        """Start from a profile that proved stable before (one step above it: the config),
        or that ``chandrad tune`` measured fastest (``tuned``: the config is no step up)."""
        self.profile = learned
        self.source = "tuned" if tuned else "learned"
        if learned != self.configured and not tuned:
            self.steps_down = [self.configured]

    def change(self, new: MemoryProfile, failure: str, reason: str, *,
               degraded: bool = False, source: str = "downshift") -> ProfileChange | None:
        """Switch to ``new``; the recorded change, or ``None`` when nothing differs."""
        diff = new.changes_from(self.profile)
        if not diff:
            return None
        change = ProfileChange(time.time(), reason, failure, diff, degraded)
        self.changes.append(change)
        self.profile = new
        self.source = source
        return change

    def wants_upshift(self, stable_for: float, backlog: bool) -> bool:
        """Stable for ``upshift_after`` below a profile that once failed, with work waiting."""
        return (bool(self.steps_down) and not self.upshift_pinned and self.downshift.enabled
                and stable_for >= self.downshift.upshift_after and backlog)

    def begin_upshift(self) -> ProfileChange | None:
        """Probe the profile one step up, keeping the current one to fall back to."""
        self.upshift_fallback = self.profile
        return self.change(
            self.steps_down.pop(), "upshift",
            f"stable for {self.downshift.upshift_after:g}s with a backlog: probing "
            "one step back up", source="upshift")

    def stable(self) -> bool:
        """The engine proved stable; True if that ends an upshift probe (kept)."""
        kept = self.upshift_fallback is not None
        self.upshift_fallback = None
        return kept

    def after_failure(self, diag: Diagnosis, *, max_pixels: int, max_output_tokens: int,
                      gpu: GpuFacts | None, plan: PlanContext | None = None) -> FailureOutcome:
        """A restartable failure: revert a failed upshift probe (and pin), else one step
        down the ladder (when downshifting is enabled), sized by ``plan`` corrected with
        the failure's numbers (``engine/replan.py``) where there is one."""
        if self.upshift_fallback is not None:
            fallback, self.upshift_fallback = self.upshift_fallback, None
            self.upshift_pinned = True
            return FailureOutcome(self.change(
                fallback, str(diag.cls), f"upshift probe failed ({diag.cls}): reverted and "
                "pinned"))
        if not self.downshift.enabled:
            return FailureOutcome()
        decision = next_profile(
            self.profile, str(diag.cls), diag.numbers, self.downshift,
            max_pixels=max_pixels, max_output_tokens=max_output_tokens, gpu=gpu,
            failed=self.failed)
        if decision.profile is None:
            return FailureOutcome(fatal=decision.reason)
        refined = replan.refine(decision, self.profile, str(diag.cls), diag.numbers, plan)
        if refined.profile is not None and refined.profile not in self.failed:
            decision = refined
        new = decision.profile
        if new is None or new == self.profile:
            return FailureOutcome()
        self.failed[self.profile] = (str(diag.cls), dict(diag.numbers))
        self.steps_down.append(self.profile)
        return FailureOutcome(self.change(new, str(diag.cls), decision.reason,
                                          degraded=decision.degraded))
