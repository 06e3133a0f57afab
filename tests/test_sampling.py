"""Sampling as Chandra does it, through the real daemon.

The engine is the stand-in engine process (tests/standin_engine.py), speaking vLLM's OpenAI
protocol the way vLLM 0.11-0.17 does (``/health``, ``/v1/models`` with ``max_model_len``,
chat completions that answer 400 when ``max_tokens`` does not fit after the prompt,
MinerU#4868), with answers scripted per page by the page's colour: a repetition loop, a cut
by ``length``, a request error. Everything else is the real daemon (``engine.url``), real
rendering, the real store and outputs. The same contract on the real CPU engine is in
``test_sampling_engine.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import config_toml, table
from PIL import Image
from standin_engine import StandinServer, standin_server
from waiting import exited, wait_until

MAX_MODEL_LEN = 13000
#: What the real model's prompt costs (Chandra's prompt ~900 tokens, one token per
#: 32x32 px for Qwen3.5's 16 px patches merged 2x2): the stand-in's tokenizer.
PROMPT_TEXT_TOKENS = 900
GOOD = '<div data-bbox="0 0 1000 1000" data-label="Text"><p>Page {n} text.</p></div>'
LOOP = '<div data-bbox="0 0 1000 1000" data-label="Text"><p>' + "the same line. " * 80
CUT = '<div data-bbox="0 0 1000 1000" data-label="Text"><p>The answer was cut off he'

#: page colour → what the stand-in answers, request after request.
SCRIPTS: dict[tuple[int, int, int], list[tuple[str, str]]] = {
    (255, 0, 0): [(CUT, "length")],                          # cut by length: kept
    (0, 255, 0): [(LOOP, "stop"), (GOOD, "stop")],           # a loop, then a good answer
    (0, 0, 255): [("400", ""), (GOOD, "stop")],              # a request error, then good
    (255, 255, 0): [(LOOP, "stop"), (LOOP, "stop"), (LOOP, "stop"), (LOOP, "stop")],
    (255, 0, 255): [(GOOD, "stop")],                         # a prompt longer than estimated
}
NAMES = {(255, 0, 0): "cut", (0, 255, 0): "loop", (0, 0, 255): "error",
         (255, 255, 0): "loops", (255, 0, 255): "long"}
#: The "long" page's prompt, far above chandrad's estimate (an unknown processor).
LONG_PROMPT = 12000


def _reply(text: str, finish: str) -> dict[str, Any]:
    if text == "400":
        return {"status": 400, "message": "simulated: the image could not be processed"}
    return {"content": text, "finish_reason": finish}


#: The stand-in engine's scenario (tests/standin_engine.py): vLLM's length check and
#: tokenizer estimate, and the answers per page colour.
SCENARIO = {
    "max_model_len": MAX_MODEL_LEN, "prompt_text_tokens": PROMPT_TEXT_TOKENS,
    "prompt_tokens": {"colour:255,0,255": LONG_PROMPT},
    "replies": {"colour:" + ",".join(map(str, colour)): [_reply(*r) for r in script]
                for colour, script in SCRIPTS.items()},
}


def sent_requests(engine: StandinServer) -> list[dict[str, Any]]:
    """What the daemon asked the engine, in order: the sampling parameters, the page (by
    colour), the arrival time and the prompt's length."""
    return [{**e["body"], "page": NAMES.get(tuple(e["colour"]), str(e["colour"])),
             "at": e["t"], "prompt_tokens": e["prompt_tokens"]} for e in engine.chats()]


@pytest.fixture()
def engine(tmp_path: Path) -> Iterator[StandinServer]:
    with standin_server(tmp_path / "standin-engine", SCENARIO) as server:
        yield server


def _run_daemon(root: Path, port: int, free_port: Callable[[], int]) -> subprocess.Popen[bytes]:
    config = root / "chandrad.toml"
    config.write_text(config_toml(
        state_dir=root / "state",
        watch={"input": root / "inbox", "create_input": True, "settle_seconds": 0.5,
               "poll_interval": 0.2},
        ocr={"retries": 3, "min_side_px": 64, "formats": ["md", "json"], "render_workers": 1},
        engine=table("engine", {"url": f"http://127.0.0.1:{port}"}),
        socket=root / "control.sock"), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "JOURNAL_STREAM")}
    with (root / "daemon.log").open("ab") as log:  # the child keeps its own copy
        return subprocess.Popen([sys.executable, "-m", "chandrad", "run", "--config",
                                 str(config)], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env)


def _wait_outputs(root: Path, stems: list[str], proc: subprocess.Popen[bytes],
                  timeout: float = 240) -> None:
    wait_until(lambda: all((root / "output" / s / f"{s}_metadata.json").exists()
                           for s in stems), timeout, f"outputs of {stems}", every=0.5,
               gone=exited(proc),
               context=lambda: (root / "daemon.log").read_text(errors="replace")[-3000:])


def test_pages_are_sampled_and_retried_as_chandra_does(
    tmp_path: Path, engine: StandinServer, free_port: Callable[[], int]
) -> None:
    """length → kept + truncated, 1 attempt; loop → retried at Chandra's temperatures;
    request error → retried after Chandra's pause; loops to the end → failed with the real
    attempt count; no request is rejected for max_tokens."""
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    proc = _run_daemon(tmp_path, engine.port, free_port)
    try:
        for colour, name in NAMES.items():
            Image.new("RGB", (640, 800), colour).save(tmp_path / f"{name}.png")
            os.rename(tmp_path / f"{name}.png", inbox / f"{name}.png")
        _wait_outputs(tmp_path, list(NAMES.values()), proc)
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    def page(stem: str) -> dict[str, Any]:
        doc = json.loads((tmp_path / "output" / stem / f"{stem}.json").read_text())
        entry: dict[str, Any] = doc["pages"][0]
        return entry

    def meta(stem: str) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(
            (tmp_path / "output" / stem / f"{stem}_metadata.json").read_text())
        return out

    def sent(stem: str) -> list[dict[str, Any]]:
        return [r for r in requests if r["page"] == stem]

    # Every request fits, but one: the "long" page's prompt is far above the estimate; the
    # engine's 400 names its length and the second request asks for exactly what is left.
    requests = sent_requests(engine)
    rejected = [r for r in requests
                if r["max_tokens"] + r["prompt_tokens"] > MAX_MODEL_LEN]
    assert [r["page"] for r in rejected] == ["long"], rejected
    assert [r["max_tokens"] for r in sent("long")][1:] == [MAX_MODEL_LEN - LONG_PROMPT]
    long = page("long")
    assert (long["status"], long["attempts"], long["truncated"]) == ("ok", 1, False)

    cut = page("cut")
    assert (cut["status"], cut["attempts"], cut["truncated"]) == ("ok", 1, True)
    assert "cut off" in (tmp_path / "output" / "cut" / "cut.md").read_text()
    assert meta("cut")["pages_truncated"] == 1 and meta("cut")["pages"][0]["truncated"]
    assert len(sent("cut")) == 1

    loop = page("loop")
    assert (loop["status"], loop["attempts"], loop["truncated"]) == ("ok", 2, False)
    assert [(r["temperature"], r["top_p"]) for r in sent("loop")] == [(0.0, 0.1), (0.2, 0.95)]

    error = page("error")
    assert (error["status"], error["attempts"]) == ("ok", 2)
    first, second = sent("error")
    assert second["at"] - first["at"] >= 2.0  # Chandra sleeps 2 * (retries + 1) s
    assert (second["temperature"], second["top_p"]) == (0.2, 0.95)

    loops = page("loops")
    assert loops["status"] == "failed" and loops["attempts"] == 4 == len(sent("loops"))
    assert "repetition after 4 attempt(s)" in loops["error"]
    assert [r["temperature"] for r in sent("loops")] == [0.0, 0.2, 0.4, 0.6]
