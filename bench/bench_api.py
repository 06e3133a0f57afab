"""Benchmark: the HTTP job API's upload throughput and its upload → first page latency.

A real ``chandrad run`` with ``[api]`` on and the stand-in engine (answers at once,
``delay_s`` 0), driven over real HTTP (httpx) from this process:

* throughput: ``--size`` MB uploads (a PDF header, then random bytes: accepted by kind,
  failed later by the job as corrupt), as a raw body and as multipart, each timed from the
  first byte sent to the 202 (received, hashed, fsynced, renamed, accepted), MB/s;
* latency: a one-page PDF uploaded ``--runs`` times, one at a time: from the upload's start
  to the stand-in engine's record of that page's request (its ``requests.log``; the
  stand-in answers in under a millisecond), median and max.

    .venv/bin/python bench/bench_api.py [--size 64] [--runs 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from api_harness import ALICE, api_daemon, auth, wait_api, wait_final  # noqa: E402

PAGE = REPO / "tests" / "corpus" / "good" / "scan_two-column-brochure_linn.pdf"


def _requests(log: Path) -> list[float]:
    if not log.exists():
        return []
    return [float(line.split()[0]) for line in log.read_text().splitlines() if line.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=64, help="MB per throughput upload")
    ap.add_argument("--runs", type=int, default=10, help="uploads timed for the latency")
    args = ap.parse_args()
    size = args.size << 20
    with tempfile.TemporaryDirectory(prefix="bench-api-") as tmp:
        root = Path(tmp)
        d, base = api_daemon(root / "d", max_upload=size + (1 << 20))
        try:
            d.start()
            wait_api(base, d)
            d.wait_engine_ready(60)
            log = root / "d" / "requests.log"
            lat = []
            for i in range(args.runs):
                seen = len(_requests(log))
                t0 = time.time()
                r = httpx.post(f"{base}/v1/jobs", files={"file": (f"p{i}.pdf", PAGE.read_bytes())},
                               headers=auth(ALICE), timeout=60)
                assert r.status_code == 202, r.text
                wait_final(base, r.json()["id"], d=d)
                first = _requests(log)[seen]
                lat.append(first - t0)
            print(f"upload -> first page request (1-page PDF, {args.runs} runs): median "
                  f"{statistics.median(lat) * 1000:.0f} ms, max {max(lat) * 1000:.0f} ms")
            blob = b"%PDF-1.4\n" + os.urandom(size - 9)
            for kind in ("raw", "multipart"):
                times = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    if kind == "raw":
                        r = httpx.post(f"{base}/v1/jobs", params={"filename": "big.pdf"},
                                       content=blob, headers=auth(ALICE), timeout=300)
                    else:
                        r = httpx.post(f"{base}/v1/jobs", files={"file": ("big.pdf", blob)},
                                       headers=auth(ALICE), timeout=300)
                    times.append(time.perf_counter() - t0)
                    assert r.status_code == 202, r.text
                best = min(times)
                print(f"upload {kind:9s} {args.size} MB: best {best:.2f} s = "
                      f"{args.size / best:.0f} MB/s (median {statistics.median(times):.2f} s)")
        finally:
            d.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
