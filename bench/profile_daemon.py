"""Where the daemon process spends its CPU per page, with the engine out of the way.

Owns one measurement: the real daemon (``python -m chandrad run``, its render workers)
processes every file of ``tests/corpus/good/`` against a stand-in engine at the HTTP
boundary (an OpenAI-compatible server in this process that answers every page at once
with the tiny model's planted page, ``tests/tiny_model.PLANTED_TEXT``: one Figure crop per
page, as in every bench run), so the engine takes no CPU from chandrad. The daemon runs
under ``py-spy record`` (``--py-spy PATH``; not a dependency: install it outside the
venv, e.g. ``pip install --target /tmp/x py-spy``); the daemon's own CPU time (``/proc``)
is split by the share of py-spy's samples in each function group and divided by the
pages done. Without ``--py-spy`` only the totals are measured.

``--hold N`` makes the stand-in behave like a full engine: it answers only once it holds
N requests (or no new one came for 1 s), so the daemon keeps about N in flight plus its
rendered pages waiting, as against a GPU; the daemon's own high-water mark
(``daemon_vmhwm_mb``) is then the figure to compare with the 200 MB target (bench/README.md).

Also writes a digest of every output file (``--digest FILE``) with the run-dependent
metadata fields blanked, so two runs (before/after a change) can be compared for
byte-identical Markdown, HTML and JSON.

Usage: ``.venv/bin/python bench/profile_daemon.py [--py-spy /tmp/x/bin/py-spy]
[--digest /tmp/out.json] [--keep DIR] [--hold 64]``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import _proc
import run as bench_run
from run import REPO, DaemonRun, drop_files, log, select_docs

sys.path.insert(0, str(REPO / "tests"))
from tiny_model import PLANTED_TEXT  # noqa: E402

#: Function groups, first match wins, tried on each sample's frames from the leaf up:
#: (group, substrings of "function (file)" frames). IDLE: a thread blocked in a wait or in
#: fsync (py-spy samples threads in system calls as active); not CPU, so left out of the
#: shares that split the measured CPU time.
IDLE = "idle (blocked in select/wait/fsync)"
DAEMON_GROUPS: list[tuple[str, tuple[str, ...]]] = [
    (IDLE, ("EpollSelector.select", "_PollLikeSelector.select", "Condition.wait",
            "fsync_dir (", "os.fsync", "Queue.get (", "wait (threading")),
    ("sqlite: finish_page (result JSON + commit)", ("finish_page (", "PageTable.finish (")),
    ("sqlite: claim/release/fail page", ("claim_page (", "release_page (", "fail_page (",
                                         "PageTable.claim (", "PageTable.release (",
                                         "PageTable.fail (")),
    ("sqlite: read pages (store.pages/page)", ("Store.pages (", "Store.page (",
                                               "PageTable.pages (", "PageTable.page (",
                                               "page_from_row (")),
    ("outputs: decode crops from store (base64)", ("_decode_images (",)),
    ("outputs: write_document", ("write_document (", "move_to (")),
    ("request body: build_chat_request", ("build_chat_request (",)),
    ("crops: base64 for store", ("_encode_images (",)),
    ("render pool IPC (pickle, pipes)", ("chandrad/render.py", "multiprocessing/",
                                         "concurrent/futures/process.py")),
    ("HTTP to engine (httpx/httpcore)", ("httpx/", "httpcore/", "h11/", "anyio/")),
    ("logging (structlog)", ("structlog/", "chandrad/logs.py")),
    ("sqlite: other", ("chandrad/store/",)),
    ("imports (start-up)", ("_find_and_load", "_call_with_frames_removed")),
    ("watch", ("chandrad/watch.py", "watchdog/")),
    ("control/status/metrics", ("chandrad/control/", "chandrad/metrics.py")),
    ("engine supervision", ("chandrad/engine/",)),
    ("pipeline glue", ("chandrad/pipeline/",)),
    ("asyncio loop", ("asyncio/",)),
]
WORKER_GROUPS: list[tuple[str, tuple[str, ...]]] = [
    (IDLE, ("_ConnectionBase.recv (", "Connection._recv", "Queue.get (", "Condition.wait")),
    ("render: MuPDF open + rasterise", ("get_pixmap (", "get_displaylist (", "_open_pdf (")),
    ("render: PNG encode", ("encode (chandrad/png.py",)),
    ("render: image decode/convert/resize", ("_render_image_page (",)),
    ("post: crop decode (page PNG)", ("_LazyPage.crop (",)),
    ("post: WebP crop encode", ("_encode_crop (",)),
    ("post: HTML parse, markdown (chandra, bs4)", ("parse_page (", "postprocess (")),
    ("start-up imports (pymupdf.layout ONNX incl.)", ("_find_and_load", "_worker_init (")),
    ("memory release (store shrink, trim)", ("_release_memory (",)),
    ("IPC (pickle, pipes)", ("multiprocessing/", "concurrent/futures/process.py")),
]
VOLATILE = ("seconds", "page_seconds", "accepted_at", "finished_at", "engine")


class _Gate:
    """Holds answers until ``size`` requests wait (a full engine), or none came for 1 s."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.cond = threading.Condition()
        self.waiting = 0
        self.batch = 0  # incremented each time a batch is let go
        self.last_arrival = time.monotonic()

    def wait(self) -> None:
        if self.size <= 0:
            return
        with self.cond:
            self.waiting += 1
            self.last_arrival = time.monotonic()
            mine = self.batch
            while self.batch == mine:
                if (self.waiting >= self.size
                        or time.monotonic() - self.last_arrival >= 1.0):
                    self.batch += 1
                    self.waiting = 0
                    self.cond.notify_all()
                    break
                self.cond.wait(0.1)


GATE = _Gate(0)


class _Standin(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        return

    def _send(self, body: bytes, kind: str = "application/json") -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/v1/models":
            self._send(json.dumps({"object": "list", "data": [{"id": "chandra"}]}).encode())
        elif self.path == "/metrics":
            self._send(b"", "text/plain")
        else:
            self._send(b"")

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        GATE.wait()
        self._send(json.dumps({"id": "x", "object": "chat.completion", "model": "chandra",
                               "choices": [{"index": 0, "finish_reason": "stop",
                                            "message": {"role": "assistant",
                                                        "content": PLANTED_TEXT}}]}).encode())


def group_of(stack: str, groups: list[tuple[str, tuple[str, ...]]]) -> str:
    frames = stack.split(";")
    for frame in reversed(frames):
        for name, needles in groups:
            if any(n in frame for n in needles):
                return name
    return "other"


def read_raw(path: Path, pid: int, workers: bool) -> collections.Counter[str]:
    """py-spy's raw (collapsed) samples by group: of the daemon ``pid`` itself, or
    (``workers``) of its render workers together."""
    groups: collections.Counter[str] = collections.Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        # --subprocesses: a worker's stack starts with the daemon's "process" frame, then
        # its own; keep the stacks whose innermost "process" frame is the daemon's.
        procs = [f for f in stack.split(";") if f.startswith("process ")]
        if workers != (len(procs) > 1 and not procs[-1].startswith(f"process {pid}:")):
            continue
        if workers and "resource_tracker" in procs[-1]:
            continue
        groups[group_of(stack, WORKER_GROUPS if workers else DAEMON_GROUPS)] += int(count)
    return groups


def digest(output: Path) -> dict[str, str]:
    """sha256 of every output file; ``*_metadata.json`` with run-dependent fields blanked."""
    out: dict[str, str] = {}
    for path in sorted(output.rglob("*")):
        if not path.is_file() or path.name.startswith("."):
            continue
        data = path.read_bytes()
        if path.name.endswith("_metadata.json"):
            meta = json.loads(data)
            data = json.dumps({k: v for k, v in meta.items() if k not in VOLATILE},
                              sort_keys=True).encode()
        out[str(path.relative_to(output))] = hashlib.sha256(data).hexdigest()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--py-spy", type=Path, default=None)
    parser.add_argument("--rate", type=int, default=200)
    parser.add_argument("--digest", type=Path, default=None)
    parser.add_argument("--keep", type=Path, default=None, help="copy the outputs here")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--hold", type=int, default=0,
                        help="answer only once this many requests wait (0: at once)")
    args = parser.parse_args()
    GATE.size = args.hold
    if args.hold:  # the engine's max_num_seqs: the daemon's request limit follows it
        bench_run.MAX_NUM_SEQS = args.hold

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Standin)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    docs = select_docs(False)
    pages = sum(d.pages for d in docs)
    with tempfile.TemporaryDirectory(prefix="chandrad-profile-") as tmp:
        root = Path(tmp)
        model = Path(os.environ.get("CHANDRAD_TEST_CACHE", REPO / ".tiny-model")) / "idefics3"
        run = DaemonRun.prepare(root / "d", url, model, 128, 0.5)
        text = run.config.read_text()
        run.config.write_text(text.replace("render_workers = ", f"render_workers = {args.workers}"
                                           " #", 1))
        raw = root / "pyspy.txt"
        argv = [sys.executable, "-m", "chandrad", "run", "--config", str(run.config)]
        if args.py_spy:
            argv = [str(args.py_spy), "record", "--format", "raw", "--rate", str(args.rate),
                    "--subprocesses", "--nonblocking", "-o", str(raw), "--", *argv]
        run.proc = _proc.start_session(argv, run.log)
        try:
            daemon = run.proc.pid
            if args.py_spy:
                deadline = time.monotonic() + 30
                while not (kids := _proc.children(run.proc.pid)):
                    if time.monotonic() > deadline:
                        raise RuntimeError(run.tail())
                    time.sleep(0.1)
                daemon = kids[0]
            run.wait_status(lambda s: s["engine"]["state"] == "ready", timeout=120)
            cpu0 = _proc.cpu_seconds(daemon) or 0.0
            t0 = drop_files([d.path for d in docs], run.inbox, [d.path.name for d in docs])
            deadline = time.monotonic() + 900
            while time.monotonic() < deadline:
                done = run.query("SELECT count(*) FROM jobs WHERE state IN "
                                 "('done','partial','failed','cancelled')")
                if done and done[0][0] >= len(docs):
                    break
                time.sleep(0.5)
            wall = time.time() - t0
            cpu = (_proc.cpu_seconds(daemon) or 0.0) - cpu0
            workers_cpu = sum(_proc.cpu_seconds(p) or 0.0 for p in _proc.children(daemon))
            hwm = {p: _proc.status_kib(p, "VmHWM") for p in _proc.children(daemon)}
            daemon_hwm = _proc.status_kib(daemon, "VmHWM") or 0
        finally:
            if args.py_spy and run.proc.poll() is None:
                # py-spy writes its samples when the daemon exits: stop the daemon alone.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(daemon, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    run.proc.wait(timeout=60)
            shutil.copy(run.log, Path(tempfile.gettempdir()) / "chandrad-profile-daemon.log")
            leftover = run.stop()
        states = dict(run.query("SELECT state, count(*) FROM jobs GROUP BY state"))
        res: dict[str, Any] = {
            "pages": pages, "files": len(docs), "job_states": states, "wall_s": round(wall, 1),
            "daemon_cpu_ms_per_page": round(1000 * cpu / pages, 1),
            "workers_cpu_ms_per_page": round(1000 * workers_cpu / pages, 1),
            "daemon_vmhwm_mb": round(daemon_hwm / 1024, 1),
            "worker_vmhwm_mb": [round((v or 0) / 1024, 1) for v in hwm.values()],
            "leftover_pids": leftover,
        }
        if args.py_spy and raw.exists():
            for key, workers, seconds in (("daemon", False, cpu),
                                          ("workers", True, workers_cpu)):
                groups = read_raw(raw, daemon, workers)
                busy = sum(n for name, n in groups.items() if name != IDLE) or 1
                res[f"{key}_samples"] = {"busy": busy, "idle": groups.get(IDLE, 0)}
                res[f"{key}_ms_per_page"] = {
                    name: round(1000 * seconds * n / busy / pages, 1)
                    for name, n in groups.most_common() if name != IDLE}
            shutil.copy(raw, Path(tempfile.gettempdir()) / "chandrad-profile-pyspy.txt")
        if args.digest:
            args.digest.write_text(json.dumps(digest(root / "d" / "output"), indent=1))
        if args.keep:
            shutil.copytree(root / "d" / "output", args.keep, dirs_exist_ok=True)
    server.shutdown()
    log(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
