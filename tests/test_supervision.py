"""The supervisor on the real daemon: which processes it kills, its flag check, whose port
answers, and the profile ladder across restarts.

vLLM itself is not the point here, so the engine is a stand-in *process*
(``tests/standin_engine.py``, used as ``engine.python``): it prints vLLM's real log
lines, fails the way vLLM fails on a GPU that is too small, or serves ``/health`` and
``/v1/models`` on its port. The GPU is the one thing faked in-process (``GpuStandIn``,
the ``GpuProbe`` protocol NVML sits behind), since there is none here.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from daemon_harness import pid_alive
from standin_engine import events, write_standin
from test_daemon_service import base_env, ctl, wait_answering, write_config
from waiting import exited, holds_for, wait_until, wait_until_async

from chandrad.config import DownshiftConfig, EngineConfig, MemoryConfig, OcrConfig
from chandrad.engine.profile import GpuFacts, MemoryProfile
from chandrad.engine.supervisor import EngineSupervisor
from chandrad.errors import ExitCode
from chandrad.states import EngineCommand, EngineState
from chandrad.store import Store

OCR = OcrConfig()


class GpuStandIn:
    """The GPU as NVML would report it (there is no GPU on this machine)."""

    def __init__(self, total_gib: float | None = None, free_gib: float | None = None,
                 name: str = "cpu", count: int = 0) -> None:
        self._facts = None if total_gib is None else GpuFacts(total_gib, free_gib)
        self._identity = (name, count)

    def facts(self, gpus: str) -> GpuFacts | None:
        return self._facts

    def identity(self, gpus: str) -> tuple[str, int]:
        return self._identity

    def memory_held_by(self, pids: set[int]) -> dict[int, int]:
        return {}


def engine_config(python: Path, port: int, **memory: Any) -> EngineConfig:
    return EngineConfig(
        model=str(python.parent), python=str(python), port=port, startup_timeout=30,
        stop_timeout=5, stable_seconds=0.5,
        memory=MemoryConfig(gpu_memory_utilization=None, max_num_seqs=None,
                            max_num_batched_tokens=None, **memory),
        downshift=DownshiftConfig(backoff_initial=0.1, backoff_max=0.5, max_restarts=6))


async def supervised(sup: EngineSupervisor, body: Callable[[EngineSupervisor], Awaitable[None]],
                     autostart: bool = True) -> None:
    """Run ``sup`` while ``body`` runs, then shut it down (its run ends within 60 s)."""
    task = asyncio.create_task(sup.run(autostart=autostart))
    try:
        await body(sup)
    finally:
        await sup.shutdown()
        await asyncio.wait_for(task, 60)


def supervise(sup: EngineSupervisor, body: Callable[[EngineSupervisor], Awaitable[None]],
              autostart: bool = True) -> None:
    """:func:`supervised` in an event loop of its own."""
    asyncio.run(supervised(sup, body, autostart))


def kill_quietly(*pids: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def spawns(folder: Path) -> list[dict[str, Any]]:
    return [e for e in events(folder) if e["what"] == "spawn"]


# ------------------------------------------------------------------ #1 stale session file


def test_stale_session_file_never_kills_an_unrelated_process(tmp_path: Path) -> None:
    """A session file left from before (a bare session id, as older daemons
    wrote, or an identity whose token the process does not carry — the number was reused
    after a reboot) does not get an unrelated `setsid sleep` killed."""
    python = write_standin(tmp_path / "engine", {})
    stranger = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        session = tmp_path / "engine.session"
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        for content in (f"{stranger.pid}\n",
                        json.dumps({"pid": stranger.pid, "token": "0" * 32, "boot_id": boot,
                                    "start_ticks": 1})):
            session.write_text(content)
            sup = EngineSupervisor(engine_config(python, 1), OCR, gpu=GpuStandIn(),
                                   session_file=session)

            async def body(sup: EngineSupervisor) -> None:
                await wait_until_async(lambda: not session.exists(), 10, "session file handled")

            supervise(sup, body, autostart=False)
            holds_for(lambda: stranger.poll() is None, 0.3,
                      f"the unrelated process alive for {content!r}", every=0.05)
    finally:
        stranger.kill()
        stranger.wait()


# ------------------------------------------------------------------ #8 setsid descendants


def test_stop_also_kills_descendants_that_left_the_session(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """An engine child that called setsid() is stopped with the engine
    (found through the engine's token), and the stop says so in the log."""
    folder = tmp_path / "engine"
    python = write_standin(folder, {"setsid_grandchild": True})
    sup = EngineSupervisor(engine_config(python, free_port()), OCR, gpu=GpuStandIn())
    grandchild: list[int] = []

    async def body(sup: EngineSupervisor) -> None:
        await wait_until_async(lambda: sup.state is EngineState.READY, 30, "ready")
        grandchild.extend(e["pid"] for e in events(folder) if e["what"] == "grandchild")
        assert grandchild and pid_alive(grandchild[0])
        assert os.getsid(grandchild[0]) != os.getsid(sup.pid or 0)  # it did leave
        sup.request(EngineCommand.STOP)
        await wait_until_async(lambda: sup.state is EngineState.STOPPED, 30, "stopped")

    try:
        supervise(sup, body)
        assert not pid_alive(grandchild[0]), "a setsid descendant of the engine survived the stop"
    finally:
        kill_quietly(*grandchild)


def daemon_config(root: Path, python: Path, port: int, extra: str = "",
                  model: str | None = None) -> Path:
    """A daemon whose engine is the stand-in; ``model`` a local folder (nothing to fetch)
    unless given."""
    engine = (f'model = "{model or python.parent}"\npython = "{python}"\nport = {port}\n'
              f'startup_timeout = 30\nstop_timeout = 5\nstable_seconds = 0.5\n{extra}\n'
              "[engine.downshift]\nbackoff = [0.2, 1.0]\n")
    return write_config(root, engine, root / "ctl.sock", log_format="json")


def start_daemon(config: Path, log: Path, env: dict[str, str] | None = None
                 ) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:  # the daemon keeps its own copy
        return subprocess.Popen(
            [sys.executable, "-m", "chandrad", "run", "--config", str(config)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env or base_env())


def status(sock: Path) -> dict[str, Any]:
    reply = ctl(sock, "status", "--json")
    assert reply.returncode == 0, reply.stdout + reply.stderr
    result: dict[str, Any] = json.loads(reply.stdout)
    return result


def wait_engine(sock: Path, proc: subprocess.Popen[bytes], log: Path, state: str,
                timeout: float = 60, replacing: int | None = None) -> dict[str, Any]:
    """Poll ``status`` until engine 0 is in ``state`` (with ``replacing``: an engine whose
    pid is not that one, i.e. restarted); the status that showed it. Fails at once with
    the log's tail if the daemon exits."""
    seen: list[dict[str, Any]] = []

    def reached() -> bool:
        seen.append(status(sock))
        engine = seen[-1]["engine"]
        return bool(engine["state"] == state
                    and (replacing is None or engine["pid"] != replacing))

    what = f"engine {state}" if replacing is None else f"engine {state}, not pid {replacing}"
    wait_until(reached, timeout, what, every=0.3, gone=exited(proc),
               context=lambda: log.read_text()[-3000:])
    return seen[-1]


def test_kill9_daemon_next_start_stops_its_engine_and_setsid_children(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """`kill -9` of the daemon leaves its engine and the engine's setsid
    child running; the next daemon finds both through the recorded identity and stops
    them before it spawns its own engine."""
    folder = tmp_path / "engine"
    python = write_standin(folder, {"setsid_grandchild": True})
    config = daemon_config(tmp_path, python, free_port())
    sock, log = tmp_path / "ctl.sock", tmp_path / "daemon.log"
    first = start_daemon(config, log)
    left: list[int] = []
    second: subprocess.Popen[bytes] | None = None
    try:
        wait_answering(sock, first, log)
        old_engine = wait_engine(sock, first, log, "ready")["engine"]["pid"]
        left = [old_engine, *(e["pid"] for e in events(folder) if e["what"] == "grandchild")]
        assert len(left) == 2
        first.kill()
        first.wait()
        holds_for(lambda: all(pid_alive(p) for p in left), 0.5,
                  "the engine and its child outlive a kill -9'd daemon", every=0.1)
        second = start_daemon(config, log)
        wait_answering(sock, second, log)
        new_engine = wait_engine(sock, second, log, "ready")["engine"]["pid"]
        assert new_engine != old_engine
        leftovers = [p for p in left if pid_alive(p)]
        assert not leftovers, f"left behind by the killed daemon and still alive: {leftovers}"
        assert "engine_stale_session_killed" in log.read_text()
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(60)
        kill_quietly(*left, *(e["pid"] for e in events(folder) if e["what"] == "grandchild"))


# ------------------------------------------------------------------ #3 flag-check child


def test_flag_check_child_failures_are_retried_not_exit_78(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """The flag-check child failing to import vLLM, then being killed, is
    no verdict on the config: the daemon stays up, shows it in status and retries with
    backoff until the check answers and the engine is ready."""
    folder = tmp_path / "engine"
    python = write_standin(folder, {"check_flags": ["import_error", "killed", "ok"]})
    config = daemon_config(tmp_path, python, free_port())
    sock, log = tmp_path / "ctl.sock", tmp_path / "daemon.log"
    proc = start_daemon(config, log)
    try:
        wait_answering(sock, proc, log)
        ready = wait_engine(sock, proc, log, "ready")
        assert ready["engine"]["restarts"] == 2
        failure = ready["engine"]["last_failure"]
        assert failure["subclass"] == "flag_check_failed", failure
        assert "exit -9" in failure["evidence"] or "-9" in failure["evidence"], failure
        checks = [e["behaviour"] for e in events(folder) if e["what"] == "check_flags"]
        assert checks == ["import_error", "killed", "ok"]
    finally:
        if proc.poll() is None:
            proc.terminate()
        assert proc.wait(60) == 0, log.read_text()[-3000:]


def test_flag_verdict_exits_78_and_daemon_stopped_says_78(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """vLLM's parser refusing a flag is a config error: exit 78, and the
    daemon_stopped event logs exit_code=78 (it said 0)."""
    python = write_standin(tmp_path / "engine", {"check_flags": ["bad_flag"]})
    config = daemon_config(tmp_path, python, free_port(), 'extra_args = ["--no-such-flag"]')
    log = tmp_path / "daemon.log"
    proc = start_daemon(config, log)
    assert proc.wait(60) == ExitCode.CONFIG, log.read_text()[-3000:]
    stopped = [json.loads(line) for line in log.read_text().splitlines()
               if '"daemon_stopped"' in line]
    assert stopped and stopped[-1]["exit_code"] == ExitCode.CONFIG, stopped
    assert "--no-such-flag" in log.read_text()


# ------------------------------------------------------------------ #5 reload vs watchdog


def test_reload_with_engine_change_keeps_the_watchdog_fed(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """While a reload waits for vLLM's flag check (6 s here), the main loop
    keeps pinging WATCHDOG=1 (WatchdogSec=1 s: a ping every 0.5 s) and STATUS= says
    what the reload is doing; the new engine then comes up."""
    folder = tmp_path / "engine"
    python = write_standin(folder, {"check_flags": ["ok", "sleep:6", "ok"]})
    config = daemon_config(tmp_path, python, free_port())
    sock, log = tmp_path / "ctl.sock", tmp_path / "daemon.log"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.settimeout(0.1)
    env = base_env() | {"NOTIFY_SOCKET": str(tmp_path / "notify.sock"),
                        "WATCHDOG_USEC": "1000000"}
    proc = start_daemon(config, log, env)
    received: list[tuple[float, bytes]] = []
    done = threading.Event()

    def read() -> None:
        """Read all the time, as systemd does: on a queue nobody reads, each of the daemon's
        sends stalls its loop (2 s x 2, chandrad.systemd), which made this test's daemon
        slow to answer `chandractl status` and to stop (~20 s of the test's ~45 s)."""
        while not done.is_set():
            try:  # the socket's timeout paces the loop
                received.append((time.monotonic(), notify.recv(1 << 16)))
            except TimeoutError:
                pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def pump(until: Callable[[], bool], timeout: float) -> None:
        wait_until(until, timeout, "the notify messages", every=0.05, gone=exited(proc),
                   context=lambda: f"{received[-10:]}\n{log.read_text()[-3000:]}")

    try:
        pump(lambda: any(b"READY=1" in m for _, m in received), 60)
        wait_engine(sock, proc, log, "ready")
        # a change of the engine's flags (--max-num-seqs), so the reload checks them again
        config.write_text(config.read_text().replace(
            "[engine.downshift]", "[engine.memory]\nmax_num_seqs = 3\n\n[engine.downshift]"))
        mark = len(received)
        proc.send_signal(signal.SIGHUP)
        pump(lambda: any(b"RELOADING=1" in m for _, m in received[mark:]), 10)
        pump(lambda: any(b"READY=1" in m and b"RELOADING" not in m for _, m in received[mark:])
             and sum(1 for e in events(folder) if e["what"] == "check_flags") >= 2, 30)
        during = [t for t, m in received[mark:] if m == b"WATCHDOG=1"]
        gaps = [b - a for a, b in zip(during, during[1:], strict=False)]
        assert len(during) >= 8 and max(gaps) < 2.0, (len(during), gaps)
        statuses = b"".join(m for _, m in received[mark:])
        assert b"reload: checking the new engine flags" in statuses
        wait_until(lambda: len(spawns(folder)) >= 2, 30, "second spawn", gone=exited(proc),
                   context=lambda: log.read_text()[-3000:])
        wait_engine(sock, proc, log, "ready")
        checks = [e["behaviour"] for e in events(folder) if e["what"] == "check_flags"]
        assert checks == ["ok", "sleep:6"], checks  # the reload's check serves the spawn
    finally:
        proc.terminate()
        try:
            assert proc.wait(60) == 0, log.read_text()[-3000:]
        finally:
            done.set()
            reader.join(5)
            notify.close()


# ------------------------------------------------------------------ #6 foreign server


def foreign_server(tmp_path: Path, port: int) -> subprocess.Popen[bytes]:
    """Somebody else's server on the port, answering as the served model."""
    other = write_standin(tmp_path / "foreign", {})
    proc = subprocess.Popen([str(other), "-m", "vllm.entrypoints.openai.api_server",
                             "--port", str(port), "--served-model-name", "chandra"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    def listening() -> bool:
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", port)) == 0

    wait_until(listening, 20, "foreign server listening", every=0.1, gone=exited(proc))
    return proc


def test_port_held_by_a_foreign_server_is_a_failure_not_ready(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """A foreign server already answering on the engine's port as the
    served model does not make the engine ready: the supervisor does not spawn, fails
    with port_in_use naming the holder, and saves no learned profile."""
    port = free_port()
    other = foreign_server(tmp_path, port)
    folder = tmp_path / "engine"
    python = write_standin(folder, {})
    store = Store.open(tmp_path / "state")
    sup = EngineSupervisor(engine_config(python, port), OCR, gpu=GpuStandIn(), profiles=store)
    seen: set[EngineState] = set()

    async def body(sup: EngineSupervisor) -> None:
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            seen.add(sup.state)
            await asyncio.sleep(0.02)

    try:
        supervise(sup, body)
    finally:
        other.kill()
        other.wait()
    assert EngineState.READY not in seen, seen
    assert sup.last_failure is not None and sup.last_failure.subclass == "port_in_use"
    assert f"pid {other.pid}" in sup.last_failure.evidence
    assert spawns(folder) == []
    assert store.load_learned_profile(sup.learned_key()) is None
    store.close()


def test_server_that_takes_the_port_after_the_spawn_is_not_our_engine(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """A foreign server that binds the port while our engine is still
    loading answers /health first; readiness checks that the listener belongs to our
    engine's processes, so this is port_in_use, not ready."""
    port = free_port()
    folder = tmp_path / "engine"
    python = write_standin(folder, {"startup_s": 3})
    sup = EngineSupervisor(engine_config(python, port), OCR, gpu=GpuStandIn())
    seen: set[EngineState] = set()
    others: list[subprocess.Popen[bytes]] = []

    async def body(sup: EngineSupervisor) -> None:
        await wait_until_async(lambda: bool(spawns(folder)), 20, "spawn")
        others.append(await asyncio.to_thread(foreign_server, tmp_path, port))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            seen.add(sup.state)
            await asyncio.sleep(0.02)

    try:
        supervise(sup, body)
    finally:
        for other in others:
            other.kill()
            other.wait()
    assert EngineState.READY not in seen, seen
    assert sup.last_failure is not None and sup.last_failure.subclass == "port_in_use", \
        sup.last_failure


# ------------------------------------------------------------------ #4 ladder bounce


def test_ladder_does_not_bounce_between_two_profiles(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """89 % of an 80 GB GPU free; 0.9 does not fit ("utilization too
    high") and the KV cache needs enforce_eager. The ladder goes 0.9 → 0.86 → 0.86 +
    eager → ready, instead of 0.9 → 0.86 → 0.91 → 0.86 → … → fatal."""
    folder = tmp_path / "engine"
    python = write_standin(folder, {"free_fraction": 0.89, "kv_needs_eager": True})
    cfg = engine_config(python, free_port())
    cfg = replace(cfg, memory=replace(cfg.memory, gpu_memory_utilization=0.9))
    gpu = GpuStandIn(total_gib=79.19, free_gib=70.48, name="NVIDIA H100 80GB HBM3", count=1)
    sup = EngineSupervisor(cfg, OCR, gpu=gpu)

    async def body(sup: EngineSupervisor) -> None:
        await wait_until_async(lambda: sup.state in (EngineState.READY, EngineState.FATAL), 60,
                       "ready or fatal")

    supervise(sup, body)
    tried = [(s["util"], s["eager"]) for s in spawns(folder)]
    assert tried == [(0.9, False), (0.86, False), (0.86, True)], (tried, sup.fatal_reason)
    assert sup.profile == replace(sup.configured_profile, gpu_memory_utilization=0.86,
                                  enforce_eager=True)


def test_kv_cache_verdict_that_arrives_after_engine_died_still_downshifts(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """On a loaded box vLLM's "EngineCore failed to start." (engine_died) reached us
    seconds before the KV-cache ValueError behind it, and the engine had not exited when
    EXIT_GRACE_AFTER_FATAL_LINE ran out. The failure is the KV cache (everything seen by
    then), not the first line's engine_died: the next start is downshifted (enforce_eager,
    as vLLM's estimate of 768 tokens cannot hold a page), not the same profile again."""
    folder = tmp_path / "engine"
    python = write_standin(folder, {"kv_late_s": 3.0})
    sup = EngineSupervisor(engine_config(python, free_port()), OCR, gpu=GpuStandIn())

    async def body(sup: EngineSupervisor) -> None:
        await wait_until_async(lambda: len(spawns(folder)) >= 2, 60, "a second spawn")
        failure = sup.last_failure
        assert failure is not None and str(failure.cls) == "kv_cache_insufficient", failure
        assert [s["eager"] for s in spawns(folder)] == [False, True]
        await wait_until_async(lambda: sup.state in (EngineState.READY, EngineState.FATAL), 30,
                               "ready or fatal")
        assert sup.state is EngineState.READY, sup.fatal_reason
        assert sup.profile == replace(sup.configured_profile, enforce_eager=True)
        assert [c.failure for c in sup.profile_changes] == ["kv_cache_insufficient"]

    supervise(sup, body)


# ------------------------------------------------------------------ #7 learned key


def test_learned_profile_key_covers_what_changes_the_answer(tmp_path: Path) -> None:
    """A profile learned for one setup is not reused after a change of the
    [ocr] page budget, extra_args (tensor parallel size), engine.gpus, or the vLLM
    version of engine.python (here another interpreter whose vLLM is 0.0.1)."""
    store = Store.open(tmp_path / "state")
    gpu = GpuStandIn(total_gib=79.19, free_gib=78.0, name="NVIDIA H100 80GB HBM3", count=2)
    base = EngineConfig(model="standin/model", memory=MemoryConfig(gpu_memory_utilization=0.9))
    learned = MemoryProfile(gpu_memory_utilization=0.8, enforce_eager=True)
    first = EngineSupervisor(base, OCR, gpu=gpu, profiles=store)
    store.save_learned_profile(first.learned_key(), learned.to_dict())
    again = EngineSupervisor(base, OCR, gpu=gpu, profiles=store)
    assert (again.profile_source, again.profile) == ("learned", learned)

    site = tmp_path / "other-site"
    (site / "vllm-0.0.1.dist-info").mkdir(parents=True)
    (site / "vllm-0.0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm\nVersion: 0.0.1\n")
    other_python = tmp_path / "python"
    other_python.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    other_python.chmod(0o755)
    changes: dict[str, tuple[EngineConfig, OcrConfig]] = {
        "ocr page budget": (base, replace(OCR, max_pixels=OCR.max_pixels // 2)),
        "extra_args": (replace(base, extra_args=("--tensor-parallel-size", "2")), OCR),
        "engine.gpus": (replace(base, gpus="0"), OCR),
        "engine.python's vLLM": (replace(base, python=str(other_python)), OCR),
    }
    reused = []
    for what, (engine, ocr) in changes.items():
        sup = EngineSupervisor(engine, ocr, gpu=gpu, profiles=store)
        if sup.profile_source == "learned":
            reused.append(what)
    store.close()
    assert not reused, f"learned profile reused after a change of {reused}"
