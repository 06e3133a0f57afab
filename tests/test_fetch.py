"""Weights on first start: `chandrad fetch-model` against a hub-protocol server (issue 10).

huggingface_hub (the real client, in the real `chandrad fetch-model` process) downloads
a model repository from tests/hub_server.py through ``HF_ENDPOINT`` set in ``[engine] env``
(the environment the engine reads the cache with). Progress, resume after kill -9, and
the offline-not-cached error.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hub_server import HubServer

from chandrad import model_files

REPO = Path(__file__).resolve().parents[1]
MODEL = "org/tiny-ocr"
PROGRESS = re.compile(r"^fetching org/tiny-ocr: (\d+)/(\d+) bytes")


def _files() -> dict[str, bytes]:
    # 24 MiB: more than one of huggingface_hub's 10 MiB write chunks, deterministic.
    weights = hashlib.sha256(b"seed").digest() * (24 * 2**20 // 32)
    return {"config.json": b'{"architectures": ["Tiny"]}',
            "preprocessor_config.json": b'{"patch_size": 16, "merge_size": 2}',
            "model.safetensors": weights}


@pytest.fixture()
def hub() -> Iterator[HubServer]:
    server = HubServer(MODEL, _files())
    yield server
    server.stop()


def _config(tmp_path: Path, hub: HubServer, offline: bool = False) -> Path:
    path = tmp_path / "chandrad.toml"
    path.write_text(f'''[daemon]
state_dir = "{tmp_path}/state"
[[watch]]
input = "{tmp_path}/in"
[engine]
model = "{MODEL}"
offline = {"true" if offline else "false"}
env = {{ HF_ENDPOINT = "{hub.endpoint}", HF_HUB_CACHE = "{tmp_path}/hf", HF_HUB_DISABLE_XET = "1" }}
''', encoding="utf-8")
    return path


def _fetch(config: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.Popen([sys.executable, "-m", "chandrad", "fetch-model", "--config",
                             str(config)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)


def _snapshot(tmp_path: Path) -> Path:
    return tmp_path / "hf" / "models--org--tiny-ocr" / "snapshots"


def test_fetch_model_reports_bytes_and_fills_the_cache(tmp_path: Path, hub: HubServer) -> None:
    proc = _fetch(_config(tmp_path, hub))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    progress = [(int(m.group(1)), int(m.group(2))) for m in map(PROGRESS.match,
                                                                 out.splitlines()) if m]
    total = sum(len(d) for d in _files().values())
    assert progress and progress[-1] == (total, total), out
    assert all(t == total for _, t in progress)
    assert [d for d, _ in progress] == sorted(d for d, _ in progress)
    [snapshot] = _snapshot(tmp_path).iterdir()
    for name, data in _files().items():
        assert (snapshot / name).read_bytes() == data
    cache = tmp_path / "hf"
    assert model_files.is_available(MODEL, cache_dir=cache)
    assert model_files.model_file(MODEL, "preprocessor_config.json", cache_dir=cache)


def test_fetch_resumes_after_kill_9(tmp_path: Path) -> None:
    server = HubServer(MODEL, _files(), delay=0.02)  # 3.2 MB/s: the weights take ~8 s
    try:
        config = _config(tmp_path, server)
        proc = _fetch(config)
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        for line in proc.stdout:
            match = PROGRESS.match(line)
            if match and 2**20 < int(match.group(1)) < int(match.group(2)) // 2:
                break
            assert time.monotonic() < deadline, "no partial progress seen"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        partial = list((tmp_path / "hf" / "models--org--tiny-ocr" / "blobs").glob(
            "*.chandrad-part"))
        assert partial and partial[0].stat().st_size > 0
        kept = partial[0].stat().st_size
        server.delay = 0.0
        again = _fetch(config)
        out, _ = again.communicate(timeout=120)
        assert again.returncode == 0, out
    finally:
        server.stop()
    resumed = [r for r in server.requests if r[0] == "GET" and r[2]]
    assert resumed and int(resumed[-1][2].split("=")[1].rstrip("-")) >= kept  # type: ignore[union-attr]
    [snapshot] = _snapshot(tmp_path).iterdir()
    assert (snapshot / "model.safetensors").read_bytes() == _files()["model.safetensors"]


def test_offline_and_not_cached_is_model_not_found_with_the_fetch_command(
    tmp_path: Path, hub: HubServer
) -> None:
    config = _config(tmp_path, hub, offline=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, "-m", "chandrad", "check-config", "--config",
                           str(config)], capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert done.returncode == 78, done.stdout + done.stderr
    assert "model_not_found" in done.stderr
    assert f"chandrad fetch-model --config {config}" in done.stderr
    assert not hub.requests  # offline: the hub was never asked
