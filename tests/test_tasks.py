"""chandrad.tasks: long-lived tasks are logged, quarantined, restarted, reported, and a task
that stays dead stops the systemd watchdog (real asyncio tasks, a real notify socket)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs
from test_systemd import reading
from waiting import WaitTimeout, wait_until_async

from chandrad.protocol import TaskStatus
from chandrad.systemd import Notifier, WatchdogPinger
from chandrad.tasks import TaskSupervisor, working_on


def test_crash_is_logged_with_its_item_quarantined_and_the_loop_restarts() -> None:
    """A loop that raises on one item: task_crashed names the item, quarantine gets it,
    the loop restarts and processes the rest; status shows the restart and the error."""
    queue = ["a", "poison", "b", "c"]
    done: list[str] = []
    quarantined: list[tuple[Any, str]] = []
    changes: list[int] = []

    async def loop() -> None:
        while True:
            while queue:
                item = queue[0]
                with working_on(item):
                    if item == "poison":
                        raise ValueError("cannot take this one")
                    done.append(item)
                queue.pop(0)
            await asyncio.sleep(0.01)

    def quarantine(item: Any, exc: BaseException) -> None:
        quarantined.append((item, str(exc)))
        queue.remove(item)

    async def scenario() -> TaskSupervisor:
        tasks = TaskSupervisor(on_change=lambda: changes.append(1), backoff_first=0.01)
        tasks.start("intake", loop, quarantine=quarantine, describe=lambda i: f"file {i}")
        with contextlib.suppress(WaitTimeout):  # the assertions below say what went wrong
            await wait_until_async(lambda: done == ["a", "b", "c"], 5, "three items",
                                   every=0.01)
        await tasks.stop()
        return tasks

    with capture_logs() as logs:
        tasks = asyncio.run(scenario())
    assert done == ["a", "b", "c"]
    assert quarantined == [("poison", "cannot take this one")]
    crashed = [e for e in logs if e["event"] == "task_crashed"]
    assert len(crashed) == 1 and crashed[0]["task"] == "intake"
    assert crashed[0]["item"] == "file poison"
    assert crashed[0]["error"] == "ValueError: cannot take this one"
    (snap,) = tasks.snapshot()
    assert snap["restarts"] == 1 and snap["last_item"] == "file poison"
    assert snap["last_error"] == "ValueError: cannot take this one"
    assert tasks.degraded() == ["intake"] and tasks.healthy() and changes


def test_a_loop_that_returns_is_restarted_unless_told_to_finish() -> None:
    """Returning is a defect for a loop that must live; after let_finish it is the end."""
    runs: list[int] = []

    async def loop() -> None:
        runs.append(1)

    async def scenario() -> tuple[list[TaskStatus], int]:
        tasks = TaskSupervisor(backoff_first=0.01)
        tasks.start("watcher", loop)
        while len(runs) < 3:
            await asyncio.sleep(0.01)
        tasks.let_finish("watcher")
        await asyncio.sleep(0.1)
        seen = len(runs)
        await asyncio.sleep(0.1)
        assert len(runs) == seen
        return tasks.snapshot(), seen

    with capture_logs() as logs:
        snapshot, runs_seen = asyncio.run(scenario())
    assert snapshot[0]["state"] == "stopped"
    assert "the loop returned" in str(snapshot[0]["last_error"])
    assert sum(e["event"] == "task_crashed" for e in logs) == runs_seen - 1


@pytest.fixture
def notify_sock(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    yield sock, path
    sock.close()


def test_a_task_that_stays_dead_stops_the_watchdog(
    notify_sock: tuple[socket.socket, str]
) -> None:
    """Crashing again and again, the task is given up as dead: healthy() turns false and
    WATCHDOG=1 stops although the main loop keeps reporting progress."""
    sock, path = notify_sock

    async def always_fails() -> None:
        await asyncio.sleep(0.3)
        raise OSError("the disk went away")

    async def scenario() -> tuple[float, TaskSupervisor]:
        tasks = TaskSupervisor(backoff_first=0.05, give_up_after=3)
        notifier = Notifier.from_env({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000"})
        pinger = WatchdogPinger(notifier, healthy=tasks.healthy)
        tasks.start("watchdog", pinger.run)
        tasks.start("dispatch", always_fails)
        dead_at = 0.0

        def dead_a_while() -> bool:
            nonlocal dead_at
            pinger.progress()  # the main loop is fine
            if not dead_at and not tasks.healthy():
                dead_at = time.monotonic()
            return bool(dead_at) and time.monotonic() - dead_at > 0.6

        try:
            await wait_until_async(dead_a_while, 5,
                                   "the failing task given up, and 0.6 s more", every=0.01)
            await tasks.stop()
        finally:
            notifier.close()
        return dead_at, tasks

    with reading(sock) as received, capture_logs():
        dead_at, tasks = asyncio.run(scenario())
    assert dead_at, "the task was never given up"
    snap = {t["name"]: t for t in tasks.snapshot()}
    assert snap["dispatch"]["restarts"] == 3
    assert snap["dispatch"]["last_error"] == "OSError: the disk went away"
    before = [m for t, m in received if t < dead_at]
    after = [m for t, m in received if t > dead_at + 0.1]
    assert len(before) >= 5 and set(before) == {"WATCHDOG=1"}
    assert after == []


def test_stop_cancels_again_a_loop_that_swallowed_its_cancellation() -> None:
    """Python 3.11's asyncio.wait_for can swallow a cancellation that arrives as its
    awaitable completes; a loop around it then runs on. stop() must cancel it again
    instead of waiting for ever (the daemon hung after SIGTERM on its dispatch loop)."""
    swallowed: list[int] = []

    async def loop() -> None:
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if not swallowed:
                    swallowed.append(1)  # as wait_for does when its future is done
                    continue
                raise

    async def scenario() -> float:
        tasks = TaskSupervisor(backoff_first=0.01)
        tasks.start("dispatch", loop)
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        async with asyncio.timeout(10):
            await tasks.stop()
        return time.monotonic() - t0

    took = asyncio.run(scenario())
    assert swallowed == [1]
    assert took < 5, took
