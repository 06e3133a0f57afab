"""Progress, not HTTP 200, is an engine's health: the hung-engine watch (pure, no clock).

vLLM's most reported production failure is an EngineCore that deadlocks or dies while the
API server goes on answering ``/health`` with 200 (vllm-project/vllm#39863, #7633, #21728):
requests are accepted and never answered, the scheduler log says "Running: 0 reqs,
Waiting: 3 reqs" and throughput 0. So an engine with requests in flight must show that it
moves. Progress is any of:

* a request of ours answered (any answer, an error included: the engine is alive);
* vLLM's ``vllm:generation_tokens_total`` or ``vllm:prompt_tokens_total`` counter rose
  (one long page decoding for minutes still generates tokens every step; both are
  Counters ``vllm:prompt_tokens``/``vllm:generation_tokens`` in ``vllm/v1/metrics/
  loggers.py`` of 0.17.1, 0.32 and 0.34, exposed with Prometheus' ``_total``);
* nothing in flight (an idle engine owes nothing).

A counter that goes backwards (another engine process behind the same URL, a restart we
did not see) counts as progress: it proves something is running. The watch says the
engine hangs when requests have been in flight for ``timeout`` seconds with none of these.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

#: vLLM's counters that rise while the engine works (Prometheus names).
PROGRESS_SERIES = ("vllm:generation_tokens_total", "vllm:prompt_tokens_total")


@dataclass(frozen=True)
class Stall:
    """An engine that made no progress for ``seconds`` with ``in_flight`` requests at it."""

    seconds: float
    in_flight: int
    counters: dict[str, float]
    running: float | None
    waiting: float | None

    def evidence(self) -> str:
        """One line for status and the journal: how long, how many, what stood still."""
        parts = [f"no progress for {self.seconds:.0f}s with {self.in_flight} request(s) in "
                 "flight: none answered"]
        for name in PROGRESS_SERIES:
            if name in self.counters:
                parts.append(f"{name.removeprefix('vllm:')} stuck at {self.counters[name]:g}")
        if self.running is not None or self.waiting is not None:
            parts.append(f"engine reports running {_count(self.running)}, "
                         f"waiting {_count(self.waiting)}")
        return "; ".join(parts) + " (its /health may still answer 200)"

    def numbers(self) -> dict[str, float]:
        out = {"stalled_s": round(self.seconds, 1), "in_flight": float(self.in_flight)}
        out.update({k.removeprefix("vllm:"): v for k, v in self.counters.items()})
        if self.running is not None:
            out["num_requests_running"] = self.running
        if self.waiting is not None:
            out["num_requests_waiting"] = self.waiting
        return out


def _count(value: float | None) -> str:
    return "?" if value is None else f"{value:g}"


@dataclass
class ProgressWatch:
    """Feed it what the supervisor sees; it answers whether the engine hangs. One per
    engine generation (made when it becomes ready)."""

    #: Seconds without progress that make a hang; 0 turns the judgement off (the stall is
    #: still measured, for ``stalled_for``).
    timeout: float
    #: Since when the engine owes progress (None: nothing in flight).
    since: float | None = None
    _answered: int = 0
    _counters: dict[str, float] = field(default_factory=dict)

    def stalled_for(self, now: float) -> float:
        """Seconds without progress while requests were in flight (0 when none are)."""
        return 0.0 if self.since is None else max(0.0, now - self.since)

    def observe(self, now: float, *, in_flight: int, answered: int,
                metrics: Mapping[str, float]) -> Stall | None:
        """One look: ``answered`` is the count of requests answered so far (monotonic),
        ``metrics`` the engine's last scrape (empty when it has none)."""
        counters = {k: metrics[k] for k in PROGRESS_SERIES if k in metrics}
        moved = answered != self._answered or any(
            counters[k] != self._counters.get(k) for k in counters)
        self._answered = answered
        self._counters = counters
        if in_flight <= 0:
            self.since = None
            return None
        if moved or self.since is None:
            self.since = now
            return None
        if self.timeout <= 0 or now - self.since < self.timeout:
            return None
        return Stall(seconds=now - self.since, in_flight=in_flight, counters=counters,
                     running=metrics.get("vllm:num_requests_running"),
                     waiting=metrics.get("vllm:num_requests_waiting"))
