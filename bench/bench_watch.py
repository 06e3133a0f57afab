"""Benchmark: a 10,000-file backlog through the folder watcher (bench/README.md).

Two figures per watch mode (inotify, poll), on real files in a temporary folder:
- start-up backlog: files already there (older than settle_seconds) → time from
  ``start()`` until every one has been reported settled;
- live burst: files created while the watcher runs → time from the last write until
  every one has been reported (settle_seconds included).
The store's share (accept + sha256) is measured by ``bench_store.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from chandrad.config import WatchConfig
from chandrad.watch import FolderWatcher, SettledFile

BODY = b"%PDF-1.4\n1 0 obj<<>>endobj\ntrailer<<>>\n%%EOF\n"


def make_files(folder: Path, n: int, age: float) -> None:
    then = time.time() - age
    for i in range(n):
        sub = folder / f"batch{i // 1000:02d}"
        sub.mkdir(exist_ok=True)
        path = sub / f"{i:05d}.pdf"
        path.write_bytes(BODY)
        if age:
            os.utime(path, (then, then))


async def run_mode(mode: str, n: int, settle: float, base: Path) -> tuple[float, float]:
    tmp = Path(tempfile.mkdtemp(dir=base))
    seen: list[SettledFile] = []

    def cfg(name: str) -> WatchConfig:
        inbox = tmp / name / "in"
        inbox.mkdir(parents=True)
        return WatchConfig(input=inbox, output=tmp / name / "out", done=tmp / name / "done",
                           failed=tmp / name / "failed", mode=mode, settle_seconds=settle)

    backlog = cfg("backlog")
    make_files(backlog.input, n, age=3600)
    watcher = FolderWatcher([backlog], seen.append)
    t0 = time.perf_counter()
    await watcher.start()
    task = asyncio.create_task(watcher.run())
    while len(seen) < n:
        await asyncio.sleep(0.01)
    startup = time.perf_counter() - t0
    watcher.stop()
    await task

    seen.clear()
    live = cfg("live")
    watcher = FolderWatcher([live], seen.append)
    await watcher.start()
    task = asyncio.create_task(watcher.run())
    await asyncio.to_thread(make_files, live.input, n, 0)
    t0 = time.perf_counter()
    while len(seen) < n:
        await asyncio.sleep(0.01)
    burst = time.perf_counter() - t0
    watcher.stop()
    await task
    assert len({s.path for s in seen}) == n
    return startup, burst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", type=int, default=10_000)
    parser.add_argument("--settle", type=float, default=2.0)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    for mode in ("inotify", "poll"):
        startup, burst = asyncio.run(run_mode(mode, args.n, args.settle, args.dir))
        print(f"{mode:8s} start-up backlog of {args.n}: {startup:.2f} s; "
              f"live burst of {args.n}: {burst:.2f} s after the last write "
              f"(settle_seconds={args.settle})")


if __name__ == "__main__":
    main()
