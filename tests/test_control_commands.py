"""The state-changing control commands end to end, through the daemon's command queue.

The real daemon (``tests/daemon_harness.py``) with the stand-in engine and the real
``chandractl``: ``pause``, ``cancel``, ``retry``, ``resume`` and ``drain --wait`` are queued
by the control handler and applied by the main loop; their replies and refusals are the
ones ``chandractl`` has always shown.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from faults.faultkit import Daemon, drop, free_port, standin_engine
from waiting import holds_for

DOC = "good/scan_two-column-brochure_linn.pdf"


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path, standin_engine(tmp_path, port=free_port(), stop_timeout=3))
    try:
        yield d
    finally:
        d.cleanup()


def test_pause_cancel_retry_resume_drain(daemon: Daemon, corpus_dir: Path) -> None:
    d = daemon
    d.control(mode="serve")
    d.start()
    d.wait_engine_ready(60)
    assert d.ctl_json("pause")["state"] == "paused"
    status = d.ctl_json("status")["daemon"]
    assert (status["state"], status["accepting"], status["dispatching"]) == (
        "paused", True, False)
    name = "paused.pdf"
    drop(corpus_dir / DOC, d.inbox, name)
    job = d.wait_job(name, "accepted while paused", 60)

    def nothing_dispatched() -> None:
        assert d.job(name) is not None and d.job(name)["pages_done"] == 0  # type: ignore[index]

    holds_for(nothing_dispatched, 2, every=0.5)
    assert d.ctl_json("cancel", str(job["id"]))["cancelled"] == job["id"]
    assert json.loads((d.failed / f"{name}.error.json").read_text())["code"] == "cancelled"
    assert d.ctl("cancel", "999999", check=False).returncode == 4  # not_found
    assert d.ctl_json("retry", str(job["id"]))["retried"] == [job["id"]]
    assert (d.inbox / name).exists() and not (d.failed / name).exists()
    assert d.ctl_json("resume")["state"] == "running"
    assert d.wait_jobs_final({name}, 120)[name]["state"] == "done"

    t0 = time.monotonic()
    drained = d.ctl_json("drain", "--wait", timeout=60)
    assert drained["state"] == "drained" and time.monotonic() - t0 < 30, drained
    refused = d.ctl("pause", check=False)
    assert refused.returncode != 0 and "invalid_state: cannot pause while drained" in (
        refused.stderr), refused.stderr
    status = d.ctl_json("status")["daemon"]
    assert (status["accepting"], status["dispatching"]) == (False, True)
    assert d.stop(60) == 0, d.tail()
