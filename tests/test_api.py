"""The HTTP job API on a real daemon: upload, poll, results, cancel, tokens, webhooks, and
hostile clients.

One daemon for the module (``chandrad run`` with the stand-in engine, ``[api]`` on a free
port, tokens and a webhook key in files of mode 0600); real HTTP with httpx and raw
sockets; a real webhook receiver (``api_harness.Receiver``). The signature is checked from
its definition (HMAC-SHA256 of ``"<t>.<body>"``), not with the daemon's own code.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pymupdf
import pytest
from api_harness import (
    ALICE,
    BOB,
    MAX_UPLOAD,
    ROOT,
    SECRET,
    UPLOAD_TIMEOUT,
    api_daemon,
    auth,
    poll,
    receiving,
    upload,
    verify,
    wait_api,
    wait_final,
)
from faults.faultkit import Daemon, drop
from PIL import Image

PDF = "good/scan_two-column-brochure_linn.pdf"
IMAGE = "good/image_hi-devanagari.png"


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, str]]:
    d, base = api_daemon(tmp_path_factory.mktemp("api"))
    try:
        d.start()
        wait_api(base, d)
        d.wait_engine_ready(60)
        yield d, base
    finally:
        d.cleanup()


def _raw_http(base: str, data: bytes, *, close_after: bool = True) -> bytes:
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(data)
        if close_after:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _inbox_files(d: Daemon) -> list[Path]:
    return [p for p in (d.state_dir / "api" / "inbox").rglob("*") if p.is_file()]


# ---------------------------------------------------------------- submit, poll, result
@pytest.mark.parametrize(("doc", "raw"), [(PDF, False), (IMAGE, True)])
def test_submit_poll_result(api: tuple[Daemon, str], corpus_dir: Path, doc: str,
                            raw: bool) -> None:
    """A PDF (multipart) and an image (raw body + ?filename=) become jobs that finish done;
    their outputs are served by format, the input too; the 202 names the queue position."""
    d, base = api
    answer = upload(base, corpus_dir / doc, raw=raw)
    assert answer.status_code == 202, answer.text
    job = answer.json()
    assert job["state"] == "pending" and isinstance(job["queue_position"], int)
    assert answer.headers["location"] == f"/v1/jobs/{job['id']}"
    assert job["owner"] == "alice" and job["file"] == Path(doc).name
    final = wait_final(base, job["id"], d=d)
    assert final["state"] == "done" and final["queue_position"] is None, final
    assert final["pages_done"] == final["pages_total"] == 1
    assert set(final["results"]) == {"md", "html", "json"}
    for fmt in ("md", "html", "json", "metadata"):
        got = httpx.get(f"{base}/v1/jobs/{job['id']}/result", params={"format": fmt},
                        headers=auth(ALICE))
        assert got.status_code == 200 and got.content, (fmt, got.text)
    meta = httpx.get(f"{base}/v1/jobs/{job['id']}/result?format=metadata",
                     headers=auth(ALICE)).json()
    assert meta["pages_ok"] == 1
    original = httpx.get(f"{base}/v1/jobs/{job['id']}/result?format=input", headers=auth(ALICE))
    assert original.content == (corpus_dir / doc).read_bytes()
    bad = httpx.get(f"{base}/v1/jobs/{job['id']}/result?format=pdf", headers=auth(ALICE))
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "bad_format"


def test_a_job_that_asks_for_pdf_gets_the_searchable_pdf(api: tuple[Daemon, str],
                                                         corpus_dir: Path) -> None:
    """``outputs=md,pdf`` (the daemon's ocr.formats has pdf): the job lists those two and
    serves the searchable PDF as application/pdf, one page like its source."""
    d, base = api
    answer = upload(base, corpus_dir / IMAGE, fields={"outputs": "md,pdf"})
    assert answer.status_code == 202, answer.text
    final = wait_final(base, answer.json()["id"], d=d)
    assert final["state"] == "done" and set(final["results"]) == {"md", "pdf"}, final
    got = httpx.get(f"{base}{final['results']['pdf']}", headers=auth(ALICE))
    assert got.status_code == 200, got.text
    assert got.headers["content-type"] == "application/pdf"
    with pymupdf.open(stream=got.content, filetype="pdf") as pdf:  # type: ignore[no-untyped-call]
        assert pdf.page_count == 1
        assert pdf[0].get_text().strip(), "the text layer is empty"


def test_tokens_are_enforced(api: tuple[Daemon, str], corpus_dir: Path) -> None:
    """No token or an unknown one: 401; another token's job: 404 (as a missing job); an
    admin token sees every job; a list shows a token its own jobs only."""
    d, base = api
    job = upload(base, corpus_dir / PDF, token=BOB).json()
    for headers in ({}, auth("not-a-known-token-at-all"), {"Authorization": f"Basic {BOB}"}):
        answer = httpx.get(f"{base}/v1/jobs/{job['id']}", headers=headers)
        assert answer.status_code == 401, answer.text
        assert answer.headers["www-authenticate"] == "Bearer"
        assert httpx.post(f"{base}/v1/jobs?filename=x.pdf", content=b"%PDF-1.4",
                          headers=headers).status_code == 401
    for method, path in (("GET", ""), ("DELETE", ""), ("GET", "/result?format=md")):
        answer = httpx.request(method, f"{base}/v1/jobs/{job['id']}{path}", headers=auth(ALICE))
        assert answer.status_code == 404, (method, path, answer.text)
        assert answer.json()["error"]["code"] == "not_found"
    assert httpx.get(f"{base}/v1/jobs/{job['id']}", headers=auth(ROOT)).json()["owner"] == "bob"
    alice_ids = {j["id"] for j in httpx.get(f"{base}/v1/jobs", headers=auth(ALICE)).json()["jobs"]}
    assert job["id"] not in alice_ids
    bob_jobs = httpx.get(f"{base}/v1/jobs", headers=auth(BOB)).json()["jobs"]
    assert {j["owner"] for j in bob_jobs} == {"bob"} and job["id"] in {j["id"] for j in bob_jobs}
    assert job["id"] in {j["id"] for j in httpx.get(f"{base}/v1/jobs?limit=1000",
                                                    headers=auth(ROOT)).json()["jobs"]}
    wait_final(base, job["id"], token=BOB, d=d)


def test_cancel_goes_through_the_command_queue(api: tuple[Daemon, str],
                                               corpus_dir: Path) -> None:
    """DELETE cancels a job the daemon holds (paused: no page sent); the input goes to the
    API's failed/ with the ``cancelled`` error, as ``chandractl cancel`` does; a second
    DELETE is 409."""
    d, base = api
    assert d.ctl_json("pause")["state"] == "paused"
    try:
        job = upload(base, corpus_dir / PDF, name="to-cancel.pdf").json()
        answer = httpx.delete(f"{base}/v1/jobs/{job['id']}", headers=auth(ALICE))
        assert answer.status_code == 200, answer.text
        assert answer.json()["state"] == "cancelled"
        failed = d.state_dir / "api" / "failed"
        error = next(failed.rglob("to-cancel.pdf.error.json"))
        assert json.loads(error.read_text())["code"] == "cancelled"
        again = httpx.delete(f"{base}/v1/jobs/{job['id']}", headers=auth(ALICE))
        assert again.status_code == 409 and again.json()["error"]["code"] == "invalid_state"
    finally:
        assert d.ctl_json("resume")["state"] == "running"


def test_queue_position_in_the_api_queue_and_status(api: tuple[Daemon, str],
                                                    tmp_path: Path) -> None:
    """While paused, jobs beyond the running ones wait pending: each one's queue position
    (pending jobs ahead of it) is the same in the API, ``chandractl queue`` and ``status``."""
    d, base = api
    small = tmp_path / "small.png"
    Image.new("RGB", (96, 64), "white").save(small)
    assert d.ctl_json("pause")["state"] == "paused"
    try:
        ids = [upload(base, small, name=f"queued-{i}.png").json()["id"] for i in range(16)]
        queue = d.ctl_json("queue")["jobs"]
        pending = [j for j in queue if j["state"] == "pending"]
        assert pending, "every job started: none left to rank"
        assert [j["queue_position"] for j in pending] == list(range(len(pending)))
        assert all(j["queue_position"] is None for j in queue if j["state"] != "pending")
        status = d.ctl_json("status")
        assert [(j["id"], j["queue_position"]) for j in status["next_jobs"]] == [
            (j["id"], j["queue_position"]) for j in pending[:5]]
        for j in pending:
            got = httpx.get(f"{base}/v1/jobs/{j['id']}", headers=auth(ALICE)).json()
            assert got["queue_position"] == j["queue_position"], (got, j)
        text = d.ctl("queue").stdout
        assert "pending (0 ahead)" in text, text
        first = pending[0]
        assert f"#{first['id']} " in d.ctl("status").stdout
        for j in pending:  # leave only the running ones to finish
            assert httpx.delete(f"{base}/v1/jobs/{j['id']}", headers=auth(ALICE)).is_success
    finally:
        assert d.ctl_json("resume")["state"] == "running"
    states = {wait_final(base, job_id, d=d)["state"] for job_id in ids}
    assert states <= {"done", "cancelled"}, states


# ---------------------------------------------------------------- refusals
def test_refusals_use_failed_codes_and_limits(api: tuple[Daemon, str], corpus_dir: Path,
                                              tmp_path: Path) -> None:
    """415 with the code failed/ would carry (unsupported_format, empty_input), 413 over
    max_upload (by Content-Length, and by the bytes of a body that lies), 411 without a
    length, 422 for a bad field; no refused upload leaves a file or a job."""
    d, base = api
    before = len(_inbox_files(d))
    text = tmp_path / "notes.pdf"
    text.write_text("just text, named like a PDF")
    answer = upload(base, text)
    assert (answer.status_code, answer.json()["error"]["code"]) == (415, "unsupported_format")
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    answer = upload(base, empty, raw=True)
    assert (answer.status_code, answer.json()["error"]["code"]) == (415, "empty_input")
    big = httpx.post(f"{base}/v1/jobs?filename=big.pdf", content=b"%PDF-" * (MAX_UPLOAD // 4),
                     headers=auth(ALICE))
    assert (big.status_code, big.json()["error"]["code"]) == (413, "upload_too_large")

    def chunks() -> Iterator[bytes]:
        yield b"%PDF-1.4\n"

    chunked = httpx.post(f"{base}/v1/jobs?filename=c.pdf", content=chunks(),
                         headers=auth(ALICE))
    assert chunked.status_code == 411, chunked.text
    for fields in ({"outputs": "docx"}, {"callback_url": "file:///etc/passwd"}):
        answer = upload(base, corpus_dir / PDF, fields=fields)
        assert answer.status_code == 422, (fields, answer.text)
    assert len(_inbox_files(d)) == before
    assert not list((d.state_dir / "api" / "tmp").iterdir())


def test_a_jobs_own_callback_must_name_an_allowed_host(api: tuple[Daemon, str],
                                                       corpus_dir: Path) -> None:
    """A token holder cannot make the server POST into its own network (metadata service,
    loopback ports, a name tricked past the check): only api.callback_hosts (here the test
    receivers' 127.0.0.1), compared with the host the webhook client would connect to."""
    d, base = api
    before = len(_inbox_files(d))
    for url in ("http://169.254.169.254/latest/meta-data", "http://localhost:9/hook",
                "http://127.0.0.1@internal.example/hook", "http://127.0.0.1.nip.io/hook"):
        answer = upload(base, corpus_dir / PDF, fields={"callback_url": url})
        assert answer.status_code == 422, (url, answer.text)
        error = answer.json()["error"]
        assert error["code"] == "bad_callback", (url, error)
        assert "api.callback_hosts" in error["message"], (url, error)
    assert len(_inbox_files(d)) == before


# ---------------------------------------------------------------- webhooks
def test_webhook_signed_once_across_two_failures(api: tuple[Daemon, str],
                                                 corpus_dir: Path) -> None:
    """The receiver answers 500 twice: the third attempt is accepted; every attempt carries
    the same body and idempotency key, each correctly signed; one accepted delivery."""
    d, base = api
    with receiving([500, 500]) as receiver:
        job = upload(base, corpus_dir / PDF, name="hooked.pdf",
                     fields={"callback_url": receiver.url}).json()
        wait_final(base, job["id"], d=d)
        poll(lambda: receiver.accepted(job["id"]), 30, "the webhook accepted")
        time.sleep(1.5)  # a further (wrong) attempt would come within the backoff
        tries = receiver.for_job(job["id"])
    assert [t.status for t in tries] == [500, 500, 200]
    assert len({t.body for t in tries}) == 1
    assert len({t.headers["Idempotency-Key"] for t in tries}) == 1
    for t in tries:
        assert verify(SECRET, t.headers["Chandrad-Signature"], t.body), t.headers
        assert not verify("another-secret-0123456789", t.headers["Chandrad-Signature"], t.body)
    body = json.loads(tries[0].body)
    assert (body["id"], body["state"], body["file"]) == (job["id"], "done", "hooked.pdf")
    assert body["results"]["md"] == f"/v1/jobs/{job['id']}/result?format=md"


def test_hostile_filenames_stay_inside_the_inbox(api: tuple[Daemon, str],
                                                 corpus_dir: Path) -> None:
    """Path tricks in the file name keep their last component only, as a safe name, inside
    ``<state_dir>/api/inbox/<random>/``; the jobs finish."""
    d, base = api
    inbox = (d.state_dir / "api" / "inbox").resolve()
    ids = []
    for name in ("../../../../tmp/escape.pdf", "..\\..\\win.pdf", "/abs/path.pdf", "..",
                 ".hidden.pdf", "new\nline.pdf", "x" * 600 + ".pdf"):
        answer = upload(base, corpus_dir / PDF, name=name, raw=True)
        assert answer.status_code == 202, (name, answer.text)
        ids.append(answer.json()["id"])
    stored = {j["id"]: j for j in d.stored_jobs()}
    for job_id in ids:
        path = Path(stored[job_id]["abs_path"]).resolve()
        assert path.parent.parent == inbox and "/" not in path.name and "\n" not in path.name
        assert not path.name.startswith("."), path
    assert not Path("/tmp/escape.pdf").exists()
    for job_id in ids:
        assert wait_final(base, job_id, d=d)["state"] == "done"


def test_truncated_multipart_and_huge_headers(api: tuple[Daemon, str]) -> None:
    """A multipart body cut short (the client closes), one without its closing boundary and
    headers over the limit are refused without a 5xx; nothing is kept; the API answers."""
    d, base = api
    before = len(_inbox_files(d))
    head = (b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + ALICE.encode()
            + b"\r\nContent-Type: multipart/form-data; boundary=BOUND\r\n")
    part = (b"--BOUND\r\nContent-Disposition: form-data; name=\"file\"; filename=\"t.pdf\"\r\n"
            b"Content-Type: application/pdf\r\n\r\n%PDF-1.4 " + b"x" * 5000)
    cut = head + b"Content-Length: 100000\r\n\r\n" + part
    assert not _raw_http(base, cut).startswith(b"HTTP/1.1 5")
    unclosed = head + f"Content-Length: {len(part)}\r\nConnection: close\r\n\r\n".encode() + part
    answer = _raw_http(base, unclosed, close_after=False)
    # python-multipart drops a part that never ends: the form has no file.
    assert answer.startswith(b"HTTP/1.1 422") and b"missing_file" in answer, answer[:300]
    huge = (b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n")
    answer = _raw_http(base, huge)
    assert not answer.startswith(b"HTTP/1.1 5"), answer[:200]
    many = b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 5000 + b"\r\n"
    assert not _raw_http(base, many).startswith(b"HTTP/1.1 5")
    assert httpx.get(f"{base}/v1/jobs", headers=auth(ALICE)).status_code == 200
    poll(lambda: not list((d.state_dir / "api" / "tmp").iterdir()), 10, "tmp/ emptied")
    assert len(_inbox_files(d)) == before
    assert d.alive()


def test_stalled_upload_is_cut_with_408(api: tuple[Daemon, str]) -> None:
    """A body that stops arriving (slow-loris) ends with 408 after ``api.upload_timeout``;
    the API answers others meanwhile; the partial bytes are not kept."""
    d, base = api
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/jobs?filename=slow.pdf HTTP/1.1\r\nHost: x\r\n"
                     b"Authorization: Bearer " + ALICE.encode() + b"\r\n"
                     b"Content-Length: 100000\r\n\r\n%PDF-1.4 " + b"x" * 1000)
        t0 = time.monotonic()
        assert httpx.get(f"{base}/v1/jobs", headers=auth(ALICE)).status_code == 200
        answer = sock.recv(65536)
        waited = time.monotonic() - t0
        while chunk := sock.recv(65536):  # the server closes after its answer
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408") and b"upload_timeout" in answer, answer[:300]
    assert UPLOAD_TIMEOUT - 0.5 < waited < UPLOAD_TIMEOUT + 10, waited
    poll(lambda: not list((d.state_dir / "api" / "tmp").iterdir()), 10, "tmp/ emptied")


def test_concurrent_uploads_and_a_watched_twin(api: tuple[Daemon, str],
                                               corpus_dir: Path) -> None:
    """Eight uploads of one file at once are eight jobs (duplicates = "process"), each in
    its own folder; the same content dropped in the watched inbox meanwhile is its own job;
    every one finishes done, none lost."""
    d, base = api
    src = corpus_dir / IMAGE
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: upload(base, src, name=f"same-{i}.png"), range(8)))
        drop(src, d.inbox, "watched-twin.png")
    assert [a.status_code for a in answers] == [202] * 8, [a.text for a in answers]
    ids = [a.json()["id"] for a in answers]
    assert len(set(ids)) == 8
    for job_id in ids:
        assert wait_final(base, job_id, d=d)["state"] == "done"
    assert d.wait_jobs_final({"watched-twin.png"}, 90)["watched-twin.png"]["state"] == "done"
    assert (d.done / "watched-twin.png").exists()
    stored = [j for j in d.stored_jobs() if j["id"] in ids]
    assert len({Path(j["abs_path"]).parent for j in stored}) == 8


# ---------------------------------------------------------------- durability
def test_webhook_survives_kill9_between_end_and_delivery(api: tuple[Daemon, str],
                                                         corpus_dir: Path) -> None:
    """The job ends while its receiver is down; the daemon is killed -9 before any delivery
    succeeded; the next daemon delivers it: exactly one accepted, correctly signed."""
    d, base = api
    with receiving([503] * 1000) as down:
        url = down.url
        job = upload(base, corpus_dir / PDF, name="kill9.pdf",
                     fields={"callback_url": url}).json()
        wait_final(base, job["id"], d=d)
        poll(lambda: down.for_job(job["id"]), 20, "a first (refused) attempt")
        d.kill9()
        assert not down.accepted()
    port = int(url.split(":")[2].split("/")[0])
    # The next daemon gives a webhook up after 1 s (for the undeliverable check below).
    d.tables = d.tables.replace("[api]\n", "[api]\nwebhook_deadline = 1.0\n", 1)
    d.config.write_text(d.config_text())
    with receiving([], port=port) as up:
        d.start()
        wait_api(base, d)
        poll(lambda: up.accepted(job["id"]), 60, "the webhook delivered after the restart")
        time.sleep(1.0)
        accepted = up.accepted(job["id"])
    assert len(accepted) == 1
    assert verify(SECRET, accepted[0].headers["Chandrad-Signature"], accepted[0].body)
    assert json.loads(accepted[0].body)["state"] == "done"


    with receiving([500] * 1000) as refusing:
        job = upload(base, corpus_dir / PDF, name="never.pdf",
                     fields={"callback_url": refusing.url}).json()
        wait_final(base, job["id"], d=d)

        def given_up() -> list[dict[str, object]]:
            hooks = d.ctl_json("status")["api"]["webhooks"]
            return [g for g in hooks["given_up"] if g["job"] == job["id"]]

        poll(given_up, 30, "the webhook given up")
    assert given_up()[0]["error"] == "HTTP 500"
    assert d.ctl_json("status")["api"]["webhooks"]["undeliverable"] >= 1
    listen = d.ctl_json("status")["daemon"]["metrics"]["listen"]
    exposition = httpx.get(f"http://{listen}/metrics").text
    assert 'chandrad_webhooks{state="undeliverable"} 1.0' in exposition, exposition[-2000:]
    assert 'chandrad_webhooks{state="delivered"}' in exposition
    assert "webhook_undeliverable" in d.log_path.read_text()


def test_draining_daemon_refuses_uploads_with_503(api: tuple[Daemon, str],
                                                  corpus_dir: Path) -> None:
    """Once draining, an upload is 503 with Retry-After; reads still answer. (Last: the
    drain lasts until the daemon stops.)"""
    d, base = api
    d.ctl_json("drain", "--wait", timeout=60)
    answer = upload(base, corpus_dir / PDF)
    assert answer.status_code == 503 and answer.headers["retry-after"], answer.text
    assert answer.json()["error"]["code"] == "not_accepting"
    assert httpx.get(f"{base}/v1/jobs", headers=auth(ALICE)).status_code == 200
    assert d.stop(60) == 0, d.tail()
