"""The GPU stand-in engine's protocol, on the CPU (tests/gpu_standin_engine.py).

The stand-in plays vLLM on the device machine (tests/fixtures/gpu/); here, without CUDA, it
holds no memory, but everything chandrad talks to is the same: the flag check it answers as
``engine.python``, the version query, the two processes (API server and
``VLLM::EngineCore``), ``/health``, ``/v1/models``, chat completions, ``/metrics``, the OOM
request file (here the core dies without OOM text: no GPU, nothing to run out of), the API
server's ``EngineDeadError`` and exit when its core dies, and a SIGTERM that takes both down.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from waiting import wait_until

STANDIN = Path(__file__).resolve().parent / "gpu_standin_engine.py"


def test_flag_check_and_version_query() -> None:
    """As engine.python: the flags chandrad passes are accepted, an unknown one refused."""
    flags = ["--model", "m", "--served-model-name", "chandra", "--host", "127.0.0.1",
             "--port", "8000", "--gpu-memory-utilization", "0.85", "--max-num-seqs", "64",
             "--max-num-batched-tokens", "8192", "--max-model-len", "18000", "--dtype",
             "bfloat16", "--no-enforce-eager", "--enable-prefix-caching",
             "--limit-mm-per-prompt", '{"image": 1}', "--mm-processor-kwargs", "{}"]
    ok = subprocess.run([str(STANDIN), "-m", "chandrad", "check-flags"], input=json.dumps(flags),
                        capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(ok.stdout) == []
    bad = subprocess.run([str(STANDIN), "-m", "chandrad", "check-flags"],
                         input=json.dumps([*flags, "--no-such-flag", "1"]),
                         capture_output=True, text=True, timeout=60, check=True)
    [problem] = json.loads(bad.stdout)
    assert problem["code"] == "engine_flag_invalid" and "--no-such-flag" in problem["message"]
    version = subprocess.run([str(STANDIN), "-c", "import vllm; print(vllm.__version__)"],
                             capture_output=True, text=True, timeout=60, check=True)
    assert version.stdout.strip() == "0.17.0+gpu-standin"


@pytest.fixture
def standin(tmp_path: Path, free_port: Callable[[], int]
            ) -> Iterator[tuple[subprocess.Popen[str], int, Path]]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(STANDIN), "--standin-dir", str(tmp_path), "--model", "m",
         "--served-model-name", "chandra", "--port", str(port), "--max-model-len", "18000",
         "--gpu-memory-utilization", "0.85", "--enforce-eager"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, start_new_session=True)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "Application startup complete." in line:
            break
    else:
        pytest.fail("".join(lines))
    try:
        yield proc, port, tmp_path
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()


def _core_pids(leader: int) -> list[int]:
    children = Path(f"/proc/{leader}/task/{leader}/children")
    return [int(p) for p in children.read_text().split()] if children.exists() else []


def test_serves_the_openai_protocol(standin: tuple[subprocess.Popen[str], int, Path]) -> None:
    proc, port, _ = standin
    base = f"http://127.0.0.1:{port}"
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    models = httpx.get(f"{base}/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [("chandra", 18000)]
    reply = httpx.post(f"{base}/v1/chat/completions", timeout=30, json={
        "model": "chandra", "messages": [{"role": "user", "content": "page"}]}).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert 'data-label="Text"' in choice["message"]["content"]
    assert httpx.post(f"{base}/v1/chat/completions", timeout=30, json={
        "model": "other", "messages": []}).status_code == 404
    metrics = httpx.get(f"{base}/metrics", timeout=10).text
    assert 'vllm:num_requests_running{model_name="chandra"} 0.0' in metrics
    [core] = _core_pids(proc.pid)
    assert Path(f"/proc/{core}/comm").read_text().strip() == "VLLM::EngineCor"


def test_core_death_takes_the_api_server_down(
        standin: tuple[subprocess.Popen[str], int, Path]) -> None:
    """An OOM request for this port: the core dies (no GPU here), the API server logs
    vLLM's EngineDeadError and exits 1, as vLLM's does."""
    proc, port, folder = standin
    (folder / f"oom-{port + 1}").touch()  # another replica's: not taken
    (folder / f"oom-{port}").touch()
    assert proc.wait(timeout=30) == 1
    assert proc.stdout is not None
    rest = proc.stdout.read()
    assert "OOM requested, but there is no CUDA device" in rest
    assert "EngineDeadError: EngineCore encountered an issue" in rest
    assert not (folder / f"oom-{port}").exists() and (folder / f"oom-{port + 1}").exists()


def test_sigterm_stops_both_processes(
        standin: tuple[subprocess.Popen[str], int, Path]) -> None:
    proc, _, _ = standin
    [core] = _core_pids(proc.pid)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)  # the leader only: it must take its core down
    assert proc.wait(timeout=15) == 0
    assert time.monotonic() - t0 < 5

    def core_gone() -> bool:
        try:
            stat = Path(f"/proc/{core}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            return True
        return stat[0] == "Z"  # reaped by init once the leader is gone

    wait_until(core_gone, 10, "the engine core gone with its API server", every=0.1)
