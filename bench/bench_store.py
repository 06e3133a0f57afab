"""Benchmark: how fast the store accepts a 10,000-file backlog (bench/README.md).

Runs on a real SQLite file in a temporary state dir (or ``--state-dir``), with the
store's real durability settings (WAL, synchronous=FULL). Reports accepts/s one
transaction per file (``Store.accept``) and one transaction for all (``accept_many``),
plus the idempotent re-accept of the same backlog (a rescan).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from chandrad.store import Store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", type=int, default=10_000)
    parser.add_argument("--state-dir", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.state_dir) as tmp:
        root = Path("/srv/inbox")
        items = [(0, root, root / f"batch/{i:05d}.pdf", 1000 + i, 1.7e9 + i, f"{i:064x}")
                 for i in range(args.n)]
        store = Store.open(Path(tmp) / "one")
        t0 = time.perf_counter()
        for item in items:
            store.accept(*item)
        one = time.perf_counter() - t0
        t0 = time.perf_counter()
        again = sum(store.accept(*item) is not None for item in items)
        rescan = time.perf_counter() - t0
        store.close()

        store = Store.open(Path(tmp) / "many")
        t0 = time.perf_counter()
        jobs = store.accept_many(items)
        many = time.perf_counter() - t0
        t0 = time.perf_counter()
        counts = store.counts()
        listed = len(store.list_jobs(limit=args.n))
        query = time.perf_counter() - t0
        store.close()
    assert len(jobs) == args.n and again == 0 and counts["pending"] == args.n == listed
    print(f"accept, one transaction each : {args.n} in {one:.2f} s = {args.n / one:,.0f}/s")
    print(f"re-accept (rescan, no-ops)   : {args.n} in {rescan:.2f} s = {args.n / rescan:,.0f}/s")
    print(f"accept_many, one transaction : {args.n} in {many:.2f} s = {args.n / many:,.0f}/s")
    print(f"counts() + list_jobs({args.n}) : {query * 1000:.0f} ms")


if __name__ == "__main__":
    main()
