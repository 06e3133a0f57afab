"""The API's OpenAPI document fuzzed with schemathesis against a real daemon: no 5xx; and
that daemon's ``api.duplicates = "skip"`` answering a second upload of one content 409.

A real ``chandrad run`` (stand-in engine, ``[api]`` on) serves ``/v1/openapi.json``;
schemathesis builds a hypothesis strategy per operation from it (valid data, then invalid
data) and each request is sent with a valid token (one in five without). The check: no
answer is a server error. Examples per operation are limited to keep the run within its
CI budget (``MAX_EXAMPLES``); the requests sent and their statuses are printed. (The
schemathesis pytest plugin's ``from_fixture`` does not run under this pytest, so the
strategies are driven with hypothesis directly.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from api_harness import ALICE, BOB, api_daemon, auth, upload, wait_api
from faults.faultkit import Daemon
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.core.result import Ok

#: Examples per operation and generation mode (7 operations, positive and negative data).
MAX_EXAMPLES = 60


@pytest.fixture(scope="module")
def fuzzed_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, str]]:
    d, base = api_daemon(tmp_path_factory.mktemp("fuzz"), duplicates="skip")
    try:
        d.start()
        wait_api(base, d)
        yield d, base
    finally:
        d.cleanup()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_openapi_fuzz_finds_no_server_error(fuzzed_daemon: tuple[Daemon, str],
                                            mode: GenerationMode) -> None:
    """Every operation of the document, valid and invalid requests, with a valid token for
    four in five of them: no 5xx, and the daemon is still alive afterwards."""
    d, base = fuzzed_daemon
    schema = schemathesis.openapi.from_url(f"{base}/v1/openapi.json")
    sent: list[tuple[str, int]] = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result
        operation = result.ok()
        label = operation.label

        @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def call(case: schemathesis.Case[Any]) -> None:
            headers = auth(ALICE) if len(sent) % 5 else {}
            response = case.call(base_url=base, headers=headers, timeout=30)
            sent.append((label, response.status_code))  # noqa: B023 (called right here)
            assert response.status_code < 500, (label, response.status_code,  # noqa: B023
                                                response.text[:300])

        call()
    errors = [s for s in sent if s[1] >= 500]
    print(f"\nschemathesis ({mode.value}): {len(sent)} requests, {len(errors)} 5xx, "
          f"statuses {sorted({code for _, code in sent})}")
    assert not errors and len(sent) >= 7 * 5
    assert d.alive(), d.tail()


def test_duplicate_upload_with_skip_is_409(fuzzed_daemon: tuple[Daemon, str],
                                           corpus_dir: Path) -> None:
    """``api.duplicates = "skip"`` (this module's daemon): the same content again is 409
    ``duplicate``, naming the existing job to a token that may see it and not to another;
    the refused copy is not kept."""
    d, base = fuzzed_daemon
    doc = corpus_dir / "good" / "digital_sf424-federal-form.pdf"
    first = upload(base, doc)
    assert first.status_code == 202, first.text
    job_id = first.json()["id"]
    again = upload(base, doc, name="renamed.pdf")
    assert again.status_code == 409 and again.json()["error"]["code"] == "duplicate"
    assert again.headers["location"] == f"/v1/jobs/{job_id}"
    other = upload(base, doc, token=BOB)
    assert other.status_code == 409 and "location" not in other.headers
    assert str(job_id) not in other.json()["error"]["message"]
    kept = [p.name for p in (d.state_dir / "api" / "inbox").rglob("*.pdf")]
    assert "renamed.pdf" not in kept

