"""How an engine session is stopped (``EngineProcess.stop``), on a real child process.

A stopped engine (SIGSTOP: the fault suite's hung engine, a debugger) gets SIGCONT with
its SIGTERM, as systemd sends at a stop, so it handles the SIGTERM at once instead of
holding it pending until the SIGKILL after ``engine.stop_timeout``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

from waiting import wait_until_async

from chandrad.engine.process import EngineProcess

# Exits 0 on SIGTERM, as vLLM's API server does once it has shut down.
CHILD = ("import signal, sys, time\n"
         "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
         "print('up', flush=True)\n"
         "time.sleep(600)\n")


def test_stop_resumes_a_stopped_engine_so_it_exits_on_sigterm() -> None:
    lines: list[str] = []

    async def body() -> tuple[set[int], int | None, float]:
        proc = EngineProcess([sys.executable, "-c", CHILD], dict(os.environ),
                             lambda _stream, line: lines.append(line))
        await proc.start()
        await wait_until_async(lambda: "up" in lines, 30, "the child is up")
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        survivors = await proc.stop(30)
        return survivors, proc.returncode, time.monotonic() - t0

    survivors, code, seconds = asyncio.run(body())
    assert not survivors
    assert code == 0, code  # its SIGTERM handler ran: not SIGKILLed (-9)
    assert seconds < 10, seconds  # not the 30 s stop timeout
