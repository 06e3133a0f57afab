"""Latency: a one-page file dropped into an idle daemon reaches the engine
within ``settle_seconds + 0.3`` s.

The real daemon (``python -m chandrad run``: watcher, intake, dispatch, render pool,
SQLite) against the stand-in engine process (``tests/standin_engine.py``, as
``engine.url``), which records when each request arrives (the system's monotonic clock);
the drop is a rename into the inbox, as a copy tool finishing would do.

Margin on a loaded box: the budget is for chandrad's own path (watcher, hash, accept,
probe, render of a 1120x1400 page, request). Measured on the shared 2-core box (1-min
load 14-17), warm drops, seconds over settle: 0.09-0.34 with the watcher's fix, 0.41-0.61
before it (a new file was confirmed settled one tick, settle/4, after its settle time,
and the watcher only looked every settle/4). The test takes the best of three warm
drops, so one drop delayed by another process's burst does not fail it, while a path
that cannot make the budget fails every drop.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemon_harness import config_toml, table
from standin_engine import StandinServer, standin_server
from test_pipeline import MODEL, Reply, make_image

from chandrad.ctl.client import call

SETTLE = 1.0
BUDGET = 0.3
DROPS = 3


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[StandinServer]:
    with standin_server(tmp_path / "standin-engine", {"default": Reply().scenario()},
                        served=MODEL) as server:
        yield server


def _wait(what: str, predicate: Callable[[], bool], timeout: float, proc: subprocess.Popen[bytes],
          log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout} s; daemon log:\n"
                                 f"{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.02)


def _more_than(standin: StandinServer, seen: int) -> bool:
    return len(standin.chats()) > seen


def _ready(sock: Path) -> bool:
    try:
        return bool(call(sock, "status", timeout=5)["engine"]["state"] == "ready")
    except Exception:
        return False


def test_one_page_reaches_the_engine_within_settle_plus_300_ms(
        tmp_path: Path, standin: StandinServer) -> None:
    inbox, done = tmp_path / "in", tmp_path / "done"
    inbox.mkdir()
    sock = tmp_path / "control.sock"
    config = tmp_path / "chandrad.toml"
    config.write_text(config_toml(
        state_dir=tmp_path / "state", log_format=None,
        watch={"input": inbox, "create_input": True, "output": tmp_path / "out", "done": done,
               "failed": tmp_path / "failed", "settle_seconds": SETTLE},
        engine=table("engine", {"url": standin.url, "served_model_name": MODEL,
                                "model": MODEL}),
        ocr={"render_workers": 1, "min_side_px": 1024}, socket=sock))
    src = make_image(tmp_path / "src" / "page.png", 1120, 1400, "latency")
    log = tmp_path / "daemon.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "chandrad", "run", "--config", str(config)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET",
                                                                   "JOURNAL_STREAM")})
    try:
        _wait("engine ready", lambda: _ready(sock), 60, proc, log)
        latencies = []
        for i in range(DROPS + 1):  # the first spawns the render pool: cold, not counted
            staged = tmp_path / "src" / f".p{i}.png"
            staged.write_bytes(src.read_bytes())
            seen = len(standin.chats())
            t_drop = time.monotonic()
            os.replace(staged, inbox / f"p{i}.png")
            _wait(f"request of p{i}", functools.partial(_more_than, standin, seen), 60, proc,
                  log)
            arrived = float(standin.chats()[seen]["t"])
            if i:
                latencies.append(arrived - t_drop)
            _wait(f"p{i} done", (done / f"p{i}.png").exists, 60, proc, log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    over = [round(t - SETTLE, 3) for t in latencies]
    assert min(over) <= BUDGET, f"drop -> request minus settle, each warm drop: {over} s"
