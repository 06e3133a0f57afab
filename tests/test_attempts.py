"""chandrad.pipeline.attempts: one page's retry, charge and refit rules, as decisions.

Pure: no engine, no store, no clock. The daemon-level behaviour (the same rules carried out
by the page worker against the stand-in engine) is in tests/test_pipeline.py.
"""

from __future__ import annotations

import pytest

from chandrad import ocr
from chandrad.pipeline.attempts import (
    ENGINE_FAILED_PAUSE_S,
    MAX_FREE_RELEASES,
    Charge,
    GiveBack,
    GiveUp,
    PagePolicy,
    Refit,
    Retry,
    Send,
    truncated,
)

#: vLLM 0.17's 400 when max_tokens does not fit after the real prompt.
OVERFLOW = ("This model's maximum context length is 8192 tokens. However, you requested "
            "9000 tokens (3000 in the messages, 6000 in the completion). Please reduce the "
            "length of the messages or completion.")


def test_first_request_and_retries_follow_chandras_temperature_schedule() -> None:
    """Attempt n is sent with ocr.sampling_for_attempt(n); a retry names the next one."""
    policy = PagePolicy(retries=2)
    assert policy.next_request() == Send(*ocr.sampling_for_attempt(0))
    policy.answered()
    retry = policy.answer_failed("repetition loop")
    assert isinstance(retry, Retry)
    assert (retry.temperature, retry.top_p) == ocr.sampling_for_attempt(1)
    assert retry.pause_s == 0.0  # an answer is retried at once
    assert retry.reason == "repetition loop after 1 attempt(s)"
    assert policy.next_request() == Send(*ocr.sampling_for_attempt(1))
    assert ocr.sampling_for_attempt(1)[0] > ocr.sampling_for_attempt(0)[0]


def test_answers_are_retried_up_to_retries_then_given_up() -> None:
    policy = PagePolicy(retries=2)
    decisions = []
    for _ in range(3):
        assert isinstance(policy.next_request(), Send)
        policy.answered()
        decisions.append(policy.answer_failed("repetition loop"))
    assert [type(d) for d in decisions] == [Retry, Retry, GiveUp]
    assert decisions[-1] == GiveUp("retries exhausted: repetition loop after 3 attempt(s)")
    assert policy.next_request() == GiveUp("retries exhausted: repetition loop after 3 attempt(s)")


def test_zero_retries_gives_up_after_one_bad_answer() -> None:
    policy = PagePolicy(retries=0)
    policy.answered()
    assert isinstance(policy.answer_failed("post-processing failed: x"), GiveUp)


def test_a_request_error_waits_chandras_pause_before_the_retry() -> None:
    """A rejected request (not a context overflow) is charged and retried after
    2 * attempts seconds, with the next attempt's sampling."""
    policy = PagePolicy(retries=3)
    first = policy.rejected("400: bad image", 4096, 8192)
    assert first == Retry(*ocr.sampling_for_attempt(1), ocr.error_retry_delay(1),
                          "engine rejected the page: 400: bad image")
    second = policy.rejected("400: bad image", 4096, 8192)
    assert isinstance(second, Retry) and second.pause_s == ocr.error_retry_delay(2) == 4.0


def test_engine_failures_are_free_until_the_page_is_suspect() -> None:
    """Given back uncharged while the engine failed under the page (a refused connection:
    never the page's fault) or it was given back fewer than MAX_FREE_RELEASES times."""
    policy = PagePolicy(retries=1)
    for releases in range(MAX_FREE_RELEASES + 5):
        assert policy.engine_failed("refused", False, releases) == GiveBack(ENGINE_FAILED_PAUSE_S)
    for releases in range(MAX_FREE_RELEASES):
        assert policy.engine_failed("timed out", True, releases) == GiveBack(ENGINE_FAILED_PAUSE_S)
    assert policy.attempt == 0
    assert policy.next_request() == Send(*ocr.sampling_for_attempt(0))


def test_a_suspect_page_is_charged_then_given_up() -> None:
    policy = PagePolicy(retries=1)
    assert policy.engine_failed("timed out", True, MAX_FREE_RELEASES) == Charge(
        ENGINE_FAILED_PAUSE_S, "timed out")
    assert policy.next_request() == Send(*ocr.sampling_for_attempt(1))
    assert isinstance(policy.engine_failed("timed out", True, MAX_FREE_RELEASES + 1), Charge)
    assert policy.next_request() == GiveUp("retries exhausted: request failed: timed out")


def test_context_overflow_is_refitted_once_uncharged() -> None:
    """vLLM's 400 naming the real prompt: ask again with what the context leaves, without
    charging; a second overflow is an ordinary rejection."""
    policy = PagePolicy(retries=1)
    assert policy.max_tokens(6000) == 6000
    refit = policy.rejected(OVERFLOW, 6000, 8192)
    assert refit == Refit(8192 - 3000, 3000)
    assert policy.attempt == 0
    assert policy.max_tokens(6000) == 5192  # the estimate no longer counts
    again = policy.rejected(OVERFLOW, 6000, 8192)
    assert isinstance(again, Retry) and policy.attempt == 1


def test_refit_is_capped_by_the_output_budget_or_left_to_the_engine() -> None:
    assert PagePolicy(1).rejected(OVERFLOW, 1000, 8192) == Refit(1000, 3000)
    # No prompt count (vLLM's other wording): let the engine decide.
    unnamed = PagePolicy(1)
    assert unnamed.rejected("'max_tokens' cannot be greater than max_model_len", 6000,
                            8192) == Refit(None, None)
    assert unnamed.max_tokens(6000) is None
    # The prompt alone fills the context: nothing left to ask for.
    assert PagePolicy(1).rejected(OVERFLOW, 6000, 2000) == Refit(None, 3000)


@pytest.mark.parametrize(("finish", "cut"), [("length", True), ("stop", False), (None, False)])
def test_an_answer_cut_by_length_is_kept_as_truncated(finish: str | None, cut: bool) -> None:
    assert truncated(finish) is cut
