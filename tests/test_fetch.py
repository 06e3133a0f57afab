"""Weights on first start: `chandrad fetch-model` against a hub-protocol server.

huggingface_hub (the real client, in the real `chandrad fetch-model` process) downloads
a model repository from tests/hub_server.py through ``HF_ENDPOINT`` set in ``[engine] env``
(the environment the engine reads the cache with). Progress, resume after kill -9, and
the offline-not-cached error; and the daemon itself (its engine the stand-in process of
tests/standin_engine.py) fetching a missing model before the engine starts, in state
``fetching`` with its progress in ``chandractl status`` and systemd's ``STATUS=``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hub_server import HubServer
from standin_engine import events, write_standin
from test_daemon_service import Datagrams, base_env, ctl, wait_answering
from test_supervision import daemon_config, start_daemon, status, wait_engine
from waiting import exited, wait_until

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
create_input = true
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
        proc.stdout.close()
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


# ------------------------------------------------------------------ the daemon fetches


def _daemon(tmp_path: Path, server: HubServer, port: int, offline: bool = False
            ) -> tuple[Path, dict[str, str]]:
    """A daemon config whose engine is the stand-in and whose model is the hub's repo."""
    python = write_standin(tmp_path / "engine", {})
    hub_env = (f'env = {{ HF_ENDPOINT = "{server.endpoint}", HF_HUB_CACHE = "{tmp_path}/hf", '
               'HF_HUB_DISABLE_XET = "1" }')
    config = daemon_config(tmp_path, python, port, model=MODEL,
                           extra=f"offline = {'true' if offline else 'false'}\n{hub_env}")
    env = {k: v for k, v in base_env().items() if not k.startswith("HF_")}
    env["PYTHONPATH"] = str(REPO)
    return config, env


def _engine_states(log: Path) -> list[str]:
    states = []
    for line in log.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == "engine_state":
            states.append(entry["new"])
    return states


def test_daemon_fetches_a_missing_model_then_starts_the_engine(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """Not cached and not offline: the daemon's engine goes `fetching` (a child downloads
    the repo, status and STATUS= show bytes done/total rising), then `starting` → `ready`."""
    server = HubServer(MODEL, _files(), delay=0.03)  # ~2 MB/s: the weights take ~12 s
    total = sum(len(d) for d in _files().values())
    config, env = _daemon(tmp_path, server, free_port())
    notify = Datagrams(tmp_path / "notify.sock")
    env["NOTIFY_SOCKET"] = str(tmp_path / "notify.sock")
    sock, log = tmp_path / "ctl.sock", tmp_path / "daemon.log"
    proc = start_daemon(config, log, env)
    try:
        wait_answering(sock, proc, log)
        seen: list[dict[str, Any]] = []
        text = ""

        def fetched() -> bool:
            nonlocal text
            engine = status(sock)["engine"]
            if engine["state"] != "fetching":
                return bool(seen)
            seen.append(engine["fetch"])
            if not text and engine["fetch"]["total"]:  # the size is known once the
                text = ctl(sock, "status").stdout      # child has listed the repo
            return False

        wait_until(fetched, 120, "the fetch, seen and ended", every=0.3, gone=exited(proc),
                   context=lambda: log.read_text()[-3000:])
        ready = wait_engine(sock, proc, log, "ready", timeout=60)
        notify.pump(0.5)
    finally:
        server.stop()
        if proc.poll() is None:
            proc.terminate()
        code = proc.wait(60)
        notify.close()
    assert code == 0, log.read_text()[-3000:]
    assert all(f["model"] == MODEL and f["total"] in (0, total) for f in seen), seen
    partial = sorted({f["done"] for f in seen if 0 < f["done"] < total})
    assert len(partial) >= 2, seen  # progress observed rising while it downloads
    assert [f["done"] for f in seen] == sorted(f["done"] for f in seen), seen
    assert any(line.split()[:2] == ["fetch", f"{MODEL}:"] and line.endswith(
        "%)") and f"/{total} bytes" in line for line in text.splitlines()), text
    fetching_status = [m for m in notify.received
                       if b"engine fetching" in m and f"fetching {MODEL}: ".encode() in m]
    assert fetching_status, notify.received[-10:]
    states = _engine_states(log)
    assert states[:3] == ["fetching", "starting", "ready"], states
    assert ready["engine"]["fetch"] is None and ready["engine"]["restarts"] == 0
    assert model_files.is_available(MODEL, cache_dir=tmp_path / "hf")
    assert len([e for e in events(tmp_path / "engine") if e["what"] == "spawn"]) == 1


def _status_once_fatal(tmp_path: Path, config: Path,
                       env: dict[str, str]) -> tuple[dict[str, Any], Path]:
    """Run a daemon until its engine is ``fatal``; stop it (exit 0); that status and the log."""
    sock, log = tmp_path / "ctl.sock", tmp_path / "daemon.log"
    proc = start_daemon(config, log, env)
    try:
        wait_answering(sock, proc, log)
        fatal = wait_engine(sock, proc, log, "fatal")
    finally:
        if proc.poll() is None:
            proc.terminate()
        code = proc.wait(60)
    assert code == 0, log.read_text()[-3000:]
    return fatal, log


def test_daemon_offline_and_not_cached_is_fatal_model_not_found(
    tmp_path: Path, hub: HubServer, free_port: Callable[[], int]
) -> None:
    """`engine.offline = true` and nothing cached: the engine is `fatal` with
    `model_not_found` and the fetch command in the action; no engine, no hub request."""
    config, env = _daemon(tmp_path, hub, free_port(), offline=True)
    fatal, log = _status_once_fatal(tmp_path, config, env)
    failure = fatal["engine"]["last_failure"]
    assert failure["subclass"] == "model_not_found", failure
    assert "chandrad fetch-model" in failure["action"], failure
    assert "engine.offline = true" in failure["evidence"], failure
    assert "model_not_found" in fatal["engine"]["fatal_reason"]
    assert _engine_states(log) == ["starting", "failed", "fatal"]
    assert not hub.requests
    assert not [e for e in events(tmp_path / "engine") if e["what"] == "spawn"]


def test_daemon_fetch_of_a_repo_the_hub_does_not_have_is_fatal(
    tmp_path: Path, hub: HubServer, free_port: Callable[[], int]
) -> None:
    """The hub answers 404 RepoNotFound for ``engine.model``: `model_not_found`, fatal
    (a restart cannot fix it); a network failure would be retried instead."""
    config, env = _daemon(tmp_path, hub, free_port())
    config.write_text(config.read_text().replace(f'model = "{MODEL}"', 'model = "org/absent"'))
    fatal, log = _status_once_fatal(tmp_path, config, env)
    failure = fatal["engine"]["last_failure"]
    assert failure["subclass"] == "model_not_found", failure
    assert "RepositoryNotFoundError" in failure["evidence"], failure
    assert _engine_states(log) == ["fetching", "failed", "fatal"]
    assert hub.requests and fatal["engine"]["restarts"] == 0


def test_daemon_fetch_network_failure_is_retried_with_backoff(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """No hub answering (connection refused): `model_fetch_failed`, restartable: the
    supervisor backs off and fetches again, it does not go fatal at the first failure."""
    server = HubServer(MODEL, _files())
    server.stop()  # its port now refuses connections
    config, env = _daemon(tmp_path, server, free_port())
    sock, log = tmp_path / "ctl.sock", tmp_path / "daemon.log"
    proc = start_daemon(config, log, env)
    try:
        wait_answering(sock, proc, log)
        seen: list[dict[str, Any]] = []

        def restarted_twice() -> bool:
            seen.append(status(sock)["engine"])
            assert seen[-1]["state"] != "fatal", seen[-1]
            return bool(seen[-1]["restarts"] >= 2)

        wait_until(restarted_twice, 90, "two restarts", every=0.3, gone=exited(proc),
                   context=lambda: log.read_text()[-3000:])
        engine = seen[-1]
    finally:
        if proc.poll() is None:
            proc.terminate()
        code = proc.wait(60)
    assert code == 0, log.read_text()[-3000:]
    failure = engine["last_failure"]
    assert failure["subclass"] == "model_fetch_failed", failure
    assert "resumes" in failure["action"], failure
    assert _engine_states(log)[:4] == ["fetching", "failed", "backoff", "fetching"]
