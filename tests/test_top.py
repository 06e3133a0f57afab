"""``chandractl top`` views built from status/queue replies (the live terminal test, with the
real daemon in tmux, is in ``test_metrics_engine.py``)."""

from __future__ import annotations

import io

from rich.console import Console

from chandrad.ctl.top import build, plain_line, screen

NOW = 1_800_000_000.0
STATUS = {
    "daemon": {"state": "running", "uptime_s": 75.0},
    "engine": {"state": "ready", "pid": 4242, "restarts": 1, "state_for_s": 12.0,
               "profile": {"max_num_seqs": 16, "max_model_len": 4096},
               "profile_source": "downshift"},
    "queue": {"pending": 2, "active": 1, "done": 7, "failed": 1, "partial": 0},
    "throughput": {"pages_per_min_1m": 30.0},
}
RUNNING = [{"id": 9, "path": "sub/contract.pdf", "pages_done": 5, "pages_failed": 0,
            "pages_total": 15, "started_at": NOW - 10.0}]
FAILED = [
    {"id": 3, "path": "old.pdf", "state": "failed", "error_code": "encrypted",
     "error_message": "needs a password", "finished_at": NOW - 100},
    {"id": 4, "path": "new.pdf", "state": "failed", "error_code": "truncated",
     "error_message": "no %%EOF", "finished_at": NOW - 5},
]


def test_eta_and_rate_come_from_the_replies() -> None:
    """A job 5/15 done after 10 s has 20 s left; the queue's 10 pages at 30 pages/min, 20 s;
    recent failures are newest first."""
    snap = build(STATUS, RUNNING, FAILED, NOW)
    assert snap.jobs[0].eta_s == 20.0 and snap.eta_s == 20.0
    assert [f["id"] for f in snap.failures] == [4, 3]
    line = plain_line(snap)
    assert "engine=ready" in line and "job 9 contract.pdf 5/15 eta=20s" in line
    assert "pages/min=30" in line


def test_screen_shows_engine_progress_and_failures() -> None:
    out = io.StringIO()
    Console(file=out, width=140, force_terminal=False).print(
        screen(build(STATUS, RUNNING, FAILED, NOW)))
    text = out.getvalue()
    assert "ready" in text and "4242" in text and "downshift: max_num_seqs=16" in text
    assert "contract.pdf" in text and "5/15" in text and "━" in text
    assert "new.pdf" in text and "truncated: no %%EOF" in text
