"""A/B of chandrad's request limit (``ocr.max_in_flight``) on the GPU shape, one engine.

Fed by chandrad, the engine has spent 6-20 % more CPU per page than fed by the
direct client at ``max_num_seqs`` in flight, and chandrad's default limit is the engine's
capacity (``max_num_seqs`` + headroom, 80 for 64 seqs). This runs, on one engine, rounds
of: chandrad with each limit in ``--limits`` (0 = the default) and the direct client at
``max_num_seqs``, the order rotated each round so that the host's drift falls on every arm.
Each chandrad arm is a fresh daemon (own state dir): a one-page file first (spawns the
render pool), then every corpus file dropped at once (``run.measure_e2e``, no idle window).
Optional arms: ``--sampled``, the direct client with ``bench/inflight.py``'s sampler
reading ``/load`` and ``/metrics`` every 0.25 s (as it does during chandrad's arm);
``--client``, the direct client's bodies sent by chandrad's own ``EngineClient``;
``--spin 1.0,0.6``, the direct client with a loop on chandrad's CPUs busy that share of
every 5 ms; ``--copies N``, the corpus N times over in every arm (a longer burst);
``--daemon-env KEY=VALUE``, set in chandrad's environment only (e.g. glibc's
``MALLOC_MMAP_THRESHOLD_``). Each arm records the engine's request and token counters
over it (``engine_counters``) and when its pages came back (``completions``).

Usage: ``.venv/bin/python bench/ab_in_flight.py --limits 0,64 --rounds 3 --out F.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _proc
import httpx
import inflight
import run as bench

from chandrad.config import OcrConfig
from chandrad.engine.client import EngineClient
from chandrad.interfaces import EncodedJson

#: A loop busy ``duty`` of every ``period`` seconds, sleeping the rest.
SPIN = """import time
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < {duty} * {period}:
        pass
    if {duty} < 1:
        time.sleep((1 - {duty}) * {period})
"""
SPIN_PERIOD = 0.005
#: Environment variables for chandrad's arms only (``--daemon-env KEY=VALUE``).
DAEMON_ENV: dict[str, str] = {}

COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
            "vllm:request_success_total", "http_requests_total")


def engine_counters(base: str) -> dict[str, float]:
    """The engine's request and token counters, by series (labels kept), summed over
    engines: what it was asked to do, whoever asked."""
    out: dict[str, float] = {}
    text = httpx.get(f"{base}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(COUNTERS):
            series, _, value = line.rpartition(" ")
            series = series.replace('engine="0",', "").replace(',engine="0"', "")
            out[series] = out.get(series, 0.0) + float(value)
    return out


async def client_arm(base: str, engine_sid: int, bodies: list[bytes],
                     concurrency: int) -> dict[str, Any]:
    """The direct client's pages and concurrency, sent by chandrad's own engine client
    (``EngineClient.chat``, the body in three parts as the pipeline sends it)."""
    encoded = []
    for body in bodies:
        start = body.index(b"base64,") + len(b"base64,")
        end = body.index(b'"', start)
        encoded.append(EncodedJson(body[:start], base64.b64decode(body[start:end]),
                                   body[end:]))
    client = EngineClient(base, timeout=300)
    pending = iter(encoded)
    try:
        engine0 = _proc.session_cpu_seconds(engine_sid)
        t0 = time.perf_counter()

        async def worker() -> None:
            for one in pending:
                await client.chat(one)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - t0
        engine_cpu = _proc.session_cpu_seconds(engine_sid) - engine0
    finally:
        await client.close()
    return {"arm": f"chandrad's EngineClient at {concurrency}",
            "pages_per_s": bench.rate(len(bodies), seconds),
            "engine_cpu_s_per_page": round(engine_cpu / len(bodies), 3)}


def direct_arm(arm: str, base: str, engine_sid: int, bodies: list[bytes],
               concurrency: int) -> dict[str, Any]:
    """The direct client at ``concurrency``: alone (``direct``), with the bench's sampler
    on (``sampled``) or beside a loop on chandrad's CPUs (``spin<duty>``)."""
    label = f"direct client at {concurrency}"
    with contextlib.ExitStack() as beside:
        if arm == "sampled":
            beside.enter_context(inflight.Sampler(base))
            label += ", /load and /metrics read every 0.25 s"
        elif arm.startswith("spin"):
            duty = float(arm[4:])
            spinner = subprocess.Popen(  # inherits chandrad's CPUs
                [sys.executable, "-c", SPIN.format(duty=duty, period=SPIN_PERIOD)])
            beside.callback(spinner.wait)
            beside.callback(spinner.kill)
            label += f", chandrad's CPUs kept {duty:.0%} busy"
        one = asyncio.run(bench.measure_engine_after(base, engine_sid, bodies, concurrency))
    one["arm"] = label
    return one


def chandrad_arm(root: Path, base: str, engine_sid: int, model: Path, limit: int,
                 docs: list[bench.Doc], max_tokens: int) -> dict[str, Any]:
    daemon = bench.DaemonRun.prepare(root, base, model, max_tokens, 1.0, max_in_flight=limit)
    daemon.start(DAEMON_ENV)  # the daemon's environment only (and its workers')
    try:
        daemon.wait_status(lambda s: s["engine"]["state"] == "ready", timeout=120)
        src = bench.corpus_dir() / "good" / bench.LATENCY_FILE
        cold = bench.measure_latency(daemon, src, f"warm_up{src.suffix}")
        e2e = bench.measure_e2e(daemon, docs, idle_window=0.0, timeout=600,
                                after_job=int(cold.get("job", 0)), engine_sid=engine_sid,
                                engine_base=base)
    finally:
        daemon.stop()
    flight = e2e["in_flight"]
    return {"arm": f"chandrad max_in_flight={limit or 'default'}",
            "pages_per_s": e2e["pages_per_s"], "complete": e2e["complete"],
            "engine_cpu_s_per_page": e2e["engine_cpu_s_per_page"],
            "daemon_cpu_s_per_page": e2e["daemon_cpu_s_per_page"],
            "drop_to_first_request_s": e2e["drop_to_first_request_s"],
            "rss_peak_mb": e2e["rss_peak_mb"], "rss_mb_by_tenth": e2e["rss_mb_by_tenth"],
            "completions": e2e["completions"],
            "http_mean": flight.get("http_mean"), "http_max": flight.get("http_max"),
            "scheduler_mean": flight.get("scheduler_mean"),
            "scheduler_max": flight.get("scheduler_max")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limits", default="0,64", help="ocr.max_in_flight values; 0 = default")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--spin", type=lambda text: [float(x) for x in text.split(",")],
                        default=[], help="also the direct client with a loop on chandrad's "
                        "CPUs busy this share of each 5 ms (e.g. 1.0,0.6)")
    parser.add_argument("--client", action="store_true",
                        help="also the direct client's pages sent by chandrad's EngineClient")
    parser.add_argument("--sampled", action="store_true",
                        help="also the direct client with bench/inflight.py's sampler on")
    parser.add_argument("--copies", type=int, default=1,
                        help="every arm gets the corpus this many times over (a bigger burst)")
    parser.add_argument("--daemon-env", action="append", default=[],
                        help="KEY=VALUE in chandrad's environment (its arms only)")
    parser.add_argument("--engine-cpus", default="1")
    parser.add_argument("--chandrad-cpus", default="0")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-output-tokens", type=int, default=128)
    parser.add_argument("--model-dir", type=Path,
                        default=bench.REPO / ".tiny-model" / "idefics3")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    bench.MAX_NUM_SEQS = args.max_num_seqs
    DAEMON_ENV.update(item.split("=", 1) for item in args.daemon_env)
    bench.ENGINE_CPUS = bench._cpus(args.engine_cpus)
    os.sched_setaffinity(0, bench._cpus(args.chandrad_cpus))
    limits = [int(x) for x in args.limits.split(",")]
    arms: list[str | int] = [*limits, "direct", *(["sampled"] if args.sampled else []),
                             *(["client"] if args.client else []),
                             *(f"spin{duty}" for duty in args.spin)]
    docs = bench.select_docs(False) * args.copies
    ocr_cfg = OcrConfig(max_output_tokens=args.max_output_tokens)
    bench.build_model(args.model_dir)
    res: dict[str, Any] = {"settings": vars(args) | {"model_dir": str(args.model_dir),
                                                     "out": str(args.out)},
                           "pages": sum(d.pages for d in docs), "runs": []}
    with tempfile.TemporaryDirectory(prefix="chandrad-ab-") as tmp:
        root = Path(tmp)
        _, pngs = asyncio.run(bench.measure_render(docs[:len(docs) // args.copies], ocr_cfg))
        bodies = bench.request_bodies(pngs, args.max_output_tokens) * args.copies
        del pngs
        with bench.engine_session(args.model_dir, root) as (base, engine):
            bench.wait_engine(engine, base, timeout=480)
            warm = asyncio.run(bench.measure_engine(base, engine.pid, bodies,
                                                    [args.max_num_seqs]))
            bench.log(f"warm-up direct: {warm['pages_per_s']} pages/s")
            for rnd in range(args.rounds):
                order = arms[rnd % len(arms):] + arms[:rnd % len(arms)]
                for arm in order:
                    t0 = time.monotonic()
                    counters0 = engine_counters(base)
                    if arm == "client":
                        one = asyncio.run(client_arm(base, engine.pid, bodies,
                                                     args.max_num_seqs))
                    elif isinstance(arm, str):
                        one = direct_arm(arm, base, engine.pid, bodies, args.max_num_seqs)
                    else:
                        one = chandrad_arm(root / f"r{rnd}-{arm}", base, engine.pid,
                                           args.model_dir, int(arm), docs,
                                           args.max_output_tokens)
                    counters1 = engine_counters(base)
                    one["engine_counters"] = {k: round(v - counters0.get(k, 0.0), 3)
                                              for k, v in counters1.items()}
                    one["round"] = rnd
                    one["wall_s"] = round(time.monotonic() - t0, 1)
                    res["runs"].append(one)
                    bench.log(f"round {rnd} {one['arm']}: {one['pages_per_s']} pages/s, "
                              f"engine {one['engine_cpu_s_per_page']} CPU s/page, "
                              f"completions {one.get('completions')}, daemon RSS "
                              f"{one.get('rss_peak_mb')} {one.get('rss_mb_by_tenth')}")
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for one in res["runs"]:
        by_arm.setdefault(one["arm"], []).append(one)
    res["summary"] = {arm: {key: round(statistics.mean(r[key] for r in runs), 3)
                            for key in ("pages_per_s", "engine_cpu_s_per_page")}
                      for arm, runs in by_arm.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(_proc.portable(res), indent=2) + "\n")
    print(json.dumps(res["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
