"""The rules of one page's requests, as decisions: no I/O, no clock, no engine.

:class:`PagePolicy` follows ``chandra.model.vllm.generate_vllm``: a page is retried (up to
``ocr.retries`` times, with Chandra's temperature schedule) only on a detected repetition
loop or a request error, the latter after Chandra's ``2 * (retries + 1)`` s pause. An
answer cut by ``length`` is kept and marked truncated. Every answered request is one
attempt; a request the engine failed under is given back uncharged (until the page has
been given back :data:`MAX_FREE_RELEASES` times while it may be at fault), and so is one
that only needs ``max_tokens`` refitted after vLLM's 400 (once).

The page worker (``chandrad.pipeline.worker``) asks the policy what to do after each
request and carries the decision out: release or charge the page in the store, pause,
send again.
"""

from __future__ import annotations

from dataclasses import dataclass

from chandrad import ocr

#: Requests of one page that may fail with the engine "unavailable" without counting
#: against its ``ocr.retries``; past this, a request that timed out or got a 5xx is
#: charged, so one poison page cannot keep a job (and a drain) alive forever. A refused or
#: dropped connection (the engine died under the page) is never charged.
MAX_FREE_RELEASES = 3
#: Seconds a page waits after the engine failed under its request.
ENGINE_FAILED_PAUSE_S = 0.5


@dataclass(frozen=True)
class Send:
    """Send the page (again) with this sampling."""

    temperature: float
    top_p: float


@dataclass(frozen=True)
class GiveBack:
    """The engine failed under the page: give it back uncharged, pause, ask again."""

    pause_s: float


@dataclass(frozen=True)
class Charge:
    """The engine failed under the page once too often: charge the attempt, pause."""

    pause_s: float
    error: str


@dataclass(frozen=True)
class Refit:
    """vLLM refused ``max_tokens`` after the real prompt: give the page back uncharged and
    ask again at once with ``max_tokens`` (None: let the engine decide)."""

    max_tokens: int | None
    prompt_tokens: int | None


@dataclass(frozen=True)
class Retry:
    """The attempt failed and is charged: retry after ``pause_s`` with this sampling."""

    temperature: float
    top_p: float
    pause_s: float
    reason: str


@dataclass(frozen=True)
class GiveUp:
    """No retries left: the page fails with ``error``."""

    error: str


Decision = GiveBack | Charge | Refit | Retry | GiveUp


def truncated(finish_reason: str | None) -> bool:
    """An answer cut by the output limit is kept, marked truncated (not retried)."""
    return finish_reason == "length"


class PagePolicy:
    """One page's attempts: how many were charged, the last error, the refit."""

    def __init__(self, retries: int) -> None:
        self.retries = retries
        #: Attempts charged so far (answered requests and charged failures).
        self.attempt = 0
        self.last_error = ""
        self._refit: tuple[int | None] | None = None  # max_tokens from the engine's own count

    def next_request(self) -> Send | GiveUp:
        """What to do before a request: send it with the attempt's sampling, or give up."""
        if self.attempt > self.retries:
            return GiveUp(f"retries exhausted: {self.last_error}")
        temperature, top_p = ocr.sampling_for_attempt(self.attempt)
        return Send(temperature, top_p)

    def max_tokens(self, estimated: int) -> int | None:
        """``max_tokens`` for the next request: the estimate, or the refit once there is one."""
        return estimated if self._refit is None else self._refit[0]

    def engine_failed(self, message: str, page_may_be_at_fault: bool,
                      releases: int) -> GiveBack | Charge:
        """The engine failed under the request (``EngineUnavailable``); ``releases``: how
        often the page was given back so far."""
        if page_may_be_at_fault and releases >= MAX_FREE_RELEASES:
            self.attempt += 1
            self.last_error = f"request failed: {message}"
            return Charge(ENGINE_FAILED_PAUSE_S, message)
        return GiveBack(ENGINE_FAILED_PAUSE_S)

    def rejected(self, message: str, max_output_tokens: int,
                 max_model_len: int | None) -> Refit | Retry | GiveUp:
        """The engine answered the request with an error (vLLM's 400)."""
        overflow, prompt = ocr.context_overflow(message)
        if overflow and self._refit is None:
            # vLLM <= 0.17: max_tokens did not fit after the real prompt. Ask again
            # (uncharged) with exactly what is left, or let the engine decide.
            limit = max_model_len
            tokens = (min(max_output_tokens, limit - prompt)
                      if prompt is not None and limit and limit > prompt else None)
            self._refit = (tokens,)
            return Refit(tokens, prompt)
        self.attempt += 1
        self.last_error = f"engine rejected the page: {message}"
        return self._retry(ocr.error_retry_delay(self.attempt))

    def answered(self) -> None:
        """An answer came: the attempt counts, whatever post-processing makes of it."""
        self.attempt += 1

    def answer_failed(self, reason: str) -> Retry | GiveUp:
        """The answer was unusable (a repetition loop, post-processing failed)."""
        self.last_error = f"{reason} after {self.attempt} attempt(s)"
        return self._retry(0.0)

    def _retry(self, pause_s: float) -> Retry | GiveUp:
        if self.attempt > self.retries:
            return GiveUp(f"retries exhausted: {self.last_error}")
        temperature, top_p = ocr.sampling_for_attempt(self.attempt)
        return Retry(temperature, top_p, pause_s, self.last_error)
