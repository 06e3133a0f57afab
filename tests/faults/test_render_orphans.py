"""A daemon killed with -9 while its render workers are still starting leaves none behind.

PR_SET_PDEATHSIG only takes effect once the worker has set it; a worker whose parent died
before that (the spawn bootstrap imports for seconds on a busy machine) blocked forever on
the pool's call queue, holding its memory and the resource tracker. The daemon-kill fault
test left one such pair per kill. Here the parent kills itself right after the pool
spawned its worker, before the worker could run its initializer.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from waiting import wait_until

CHILD = """
import asyncio, os, signal, sys
from pathlib import Path
from chandrad.render import RenderPool

async def main() -> None:
    pool = RenderPool(1)
    task = asyncio.ensure_future(pool.probe(Path(sys.argv[1]), 10))
    await asyncio.sleep(0)  # submit: the worker process is spawned now
    print(*list(pool._pool()._processes), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    await task

if __name__ == "__main__":
    asyncio.run(main())
"""


def test_workers_spawned_just_before_the_daemon_dies_exit(tmp_path: Path,
                                                          corpus_dir: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    result = subprocess.run([sys.executable, str(script),
                             str(corpus_dir / "good" / "image_hi-devanagari.png")],
                            capture_output=True, text=True, timeout=120)
    pids = [int(p) for p in result.stdout.split()]
    assert pids, result.stderr
    alive = list(pids)

    def all_gone() -> bool:
        alive[:] = [p for p in pids if Path(f"/proc/{p}").exists()
                    and Path(f"/proc/{p}/stat").read_text().split()[2] != "Z"]
        return not alive

    try:
        wait_until(all_gone, 60, "render workers gone with their killed parent", every=0.5)
    finally:
        for pid in alive:  # never leave them behind, whatever the verdict
            os.kill(pid, 9)
