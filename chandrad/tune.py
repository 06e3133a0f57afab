"""``chandrad tune``'s decisions: which engine to start next, which concurrency to measure on
it, when to stop, which result is kept. Pure (no engine, no clock): ``tune_run.py`` runs them.

The search (docs/gpu.md, Tuning for speed) starts from the profile the daemon would start
with (the memory plan's) and raises in two phases, each until throughput stops rising (a
gain under :data:`MIN_GAIN` over the best so far) or memory runs out (a start that fails
with a memory class: that value is over the edge):

1. **Pages at once.** One engine start serves several levels: it is started with
   ``max_num_seqs`` = the top of its levels (up to :data:`SEQS_RAISE` × the lowest), and each
   level sends that many pages at once, which is what an engine with ``max_num_seqs`` = that
   level runs. All its levels are measured (cheap: no restart; one level's dip within the
   host's noise ends nothing); if the top one is the best, the next start goes on above it.
   A start that fails for memory is retried below it.
2. **Batched tokens.** At the best level, ``max_num_batched_tokens`` doubles, one start each.

The kept profile is the starting one with the best stable measure's ``max_num_seqs`` and
``max_num_batched_tokens``: measured on an engine that stayed up, whose memory held at
least that much.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chandrad.engine.classify import FailureClass
from chandrad.engine.profile import MemoryProfile

#: Throughput that rises less than this over the best so far has stopped rising.
MIN_GAIN = 0.05
#: One engine start measures levels up to this many times its lowest.
SEQS_RAISE = 4
MAX_SEQS = 1024
MAX_BATCHED_TOKENS = 65536
#: vLLM's default when a profile leaves ``max_num_batched_tokens`` unset (the CPU's).
DEFAULT_BATCHED_TOKENS = 2048
#: Failures that mean "this much does not fit": the step is over the edge.
MEMORY_CLASSES = frozenset({
    FailureClass.KV_CACHE_INSUFFICIENT, FailureClass.MAMBA_CACHE_INSUFFICIENT,
    FailureClass.CUDA_OOM_LOAD, FailureClass.CUDA_OOM_RUNTIME, FailureClass.FRAGMENTATION,
    FailureClass.GPU_MEMORY_UTILIZATION_TOO_HIGH, FailureClass.HOST_OOM})


@dataclass(frozen=True)
class EngineStep:
    """One engine start: its profile and the pages-at-once levels to measure on it."""

    profile: MemoryProfile
    levels: tuple[int, ...]


@dataclass(frozen=True)
class Measure:
    """One level measured (or one start that failed: ``failure``, no pages)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    pages: int = 0
    seconds: float = 0.0
    memory_bytes: int | None = None
    failure: str = ""

    @property
    def pages_per_s(self) -> float:
        return self.pages / self.seconds if self.seconds > 0 and not self.failure else 0.0


@dataclass
class TunePolicy:
    """The search over one starting profile (see the module docstring)."""

    start: MemoryProfile
    measures: list[Measure] = field(default_factory=list)
    phase: str = "seqs"  #: "seqs", "tokens", "done"
    #: Why the search ended ("" while it goes on).
    ended: str = ""
    _next_low: int = 0
    _seqs_edge: int | None = None
    _tokens_edge: int | None = None
    _step: EngineStep | None = None

    def __post_init__(self) -> None:
        self._next_low = self.start.max_num_seqs or 1

    @property
    def start_tokens(self) -> int:
        return self.start.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS

    @property
    def best(self) -> Measure | None:
        """The fastest stable measure, in order measured: a later one takes over only by
        gaining at least :data:`MIN_GAIN` (a gain within the noise keeps the smaller
        profile)."""
        best: Measure | None = None
        for m in self.measures:
            if not m.failure and m.pages and (
                    best is None or m.pages_per_s >= best.pages_per_s * (1 + MIN_GAIN)):
                best = m
        return best

    def best_profile(self) -> MemoryProfile | None:
        best = self.best
        if best is None:
            return None
        return self.start.with_changes(max_num_seqs=best.max_num_seqs,
                                       max_num_batched_tokens=best.max_num_batched_tokens)

    def next_step(self) -> EngineStep | None:
        """The next engine start, or ``None``: the search is over."""
        if self.phase == "seqs":
            low = self._next_low
            top = min(low * SEQS_RAISE, MAX_SEQS)
            if self._seqs_edge is not None:
                top = min(top, self._seqs_edge - 1)
            if top < low or low > MAX_SEQS:
                self._to_tokens("pages at once: no higher level left to try")
                return self.next_step()
            levels = [low]
            while levels[-1] * 2 <= top:
                levels.append(levels[-1] * 2)
            self._step = EngineStep(self.start.with_changes(
                max_num_seqs=levels[-1], max_num_batched_tokens=self.start_tokens),
                tuple(levels))
            return self._step
        if self.phase == "tokens":
            best = self.best
            assert best is not None
            tokens = best.max_num_batched_tokens * 2
            if tokens > MAX_BATCHED_TOKENS or (self._tokens_edge is not None
                                              and tokens >= self._tokens_edge):
                self._end("batched tokens: no higher value left to try")
                return None
            return EngineStep(self.start.with_changes(
                max_num_seqs=best.max_num_seqs, max_num_batched_tokens=tokens),
                (best.max_num_seqs,))
        return None

    def record(self, measure: Measure) -> bool:
        """A level measured on the running engine; False: its last. Every level of an
        engine start is measured (a dip at one level within the noise ends nothing); at
        the top one, pages at once go on above it only if it is the best so far."""
        self.measures.append(measure)
        best = self.best
        if self.phase == "seqs":
            if self._step is not None and measure.max_num_seqs < self._step.levels[-1]:
                return True
            if best is measure:
                self._next_low = measure.max_num_seqs * 2
            else:
                self._to_tokens(f"pages at once: {measure.max_num_seqs} gained under "
                                f"{MIN_GAIN:.0%} over the best "
                                f"({best.max_num_seqs if best else '-'})")
            return False
        if best is not measure:
            self._end(f"batched tokens: {measure.max_num_batched_tokens} gained under "
                      f"{MIN_GAIN:.0%}")
        return False

    def failed(self, step: EngineStep, failure: str,
               numbers: dict[str, float] | None = None) -> None:
        """The start of ``step`` failed with ``failure`` (a ``FailureClass`` value) and the
        ``numbers`` its message gave: where vLLM names the most sequences its Mamba cache
        holds, that is the edge itself (no halving towards it)."""
        profile = step.profile
        self.measures.append(Measure(profile.max_num_seqs or 0,
                                     profile.max_num_batched_tokens or self.start_tokens,
                                     failure=failure))
        if failure not in MEMORY_CLASSES:
            self._end(f"the engine failed ({failure}), not for memory: see its log")
        elif self.phase == "seqs":
            self._seqs_edge = profile.max_num_seqs
            blocks = (numbers or {}).get("mamba_cache_blocks")
            if blocks is not None and self._seqs_edge is not None:
                self._seqs_edge = min(self._seqs_edge, int(blocks) + 1)
            if self.best is None and len(step.levels) == 1:
                self._end(f"the starting profile does not start ({failure})")
        else:
            self._tokens_edge = profile.max_num_batched_tokens
            self._end(f"batched tokens: {profile.max_num_batched_tokens} over the edge "
                      f"({failure})")

    def stop(self, why: str) -> None:
        """End the search from outside (the time budget, the starts allowed)."""
        self._end(why)

    def _to_tokens(self, why: str) -> None:
        self.ended = why
        self.phase = "tokens" if self.best is not None else "done"

    def _end(self, why: str) -> None:
        self.ended = why
        self.phase = "done"


def table_rows(policy: TunePolicy) -> list[dict[str, str]]:
    """One row per measure, for the before/after table: the first is the start ("before"),
    the best is marked ("after")."""
    best = policy.best
    rows = []
    for i, m in enumerate(policy.measures):
        note = m.failure and f"over the edge: {m.failure}"
        if m is best:
            note = "best (kept)" if i else "best (the start)"
        elif i == 0:
            note = note or "start"
        rows.append({
            "max_num_seqs": str(m.max_num_seqs),
            "max_num_batched_tokens": str(m.max_num_batched_tokens),
            "memory used": "-" if m.memory_bytes is None else f"{m.memory_bytes / 2**30:.2f} GiB",
            "pages": str(m.pages) if not m.failure else "-",
            "pages/s": f"{m.pages_per_s:.3f}" if not m.failure else "-",
            "pages/min": f"{m.pages_per_s * 60:.1f}" if not m.failure else "-",
            "note": note})
    return rows
