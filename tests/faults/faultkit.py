"""The fault suite's toolkit: the stand-in engine's tables, the audit, the results rows.

The daemon itself, its config, start, stop and cleanup are ``tests/daemon_harness.py``'s
(re-exported here for the fault tests and ``bench/soak.py``). This module owns the
``[engine]`` table that supervises the stand-in engine process (``tests/standin_engine.py``,
where vLLM itself is not the point) and the stand-in reached through ``engine.url``; how
it proves after the fault that **no file was lost and no page was done twice** from the
SQLite store, the folders and the outputs; and how each fault appends one row of
``docs/reliability.md``'s table (``$CHANDRAD_FAULTS_RESULTS``, JSON lines, read by
``bench/reliability_table.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import daemon_harness
from daemon_harness import FINAL, OCR, drop, free_port, real_engine

from chandrad import names

__all__ = ["FINAL", "OCR", "Audit", "Daemon", "RemoteEngine", "audit", "drop", "free_port",
           "real_engine", "record", "serving_daemon", "standin_engine"]

HERE = Path(__file__).resolve().parent
STANDIN = HERE.parent / "standin_engine.py"


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


class Daemon(daemon_harness.Daemon):
    """The harness's daemon (``tests/daemon_harness.py``) with the stand-in engine's
    control file."""

    def control(self, **settings: Any) -> None:
        """What the stand-in engine does at its next start."""
        (self.root / "standin.json").write_text(json.dumps(settings))


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
    jobs = d.stored_jobs()
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
        d.wait_answering(60)
        yield d
    finally:
        d.cleanup()
        engine.close()
