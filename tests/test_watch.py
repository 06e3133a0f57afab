"""Tests of chandrad.watch with real directories, real inotify and real polling."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import CORPUS_DIR
from structlog.testing import capture_logs
from waiting import wait_until_async
from watchdog.observers.inotify_c import InotifyFD

from chandrad.config import WatchConfig
from chandrad.watch import (
    FolderWatcher,
    SettledFile,
    ignored,
    is_network_fstype,
    mount_fstype,
    sniff_complete,
)

CORPUS = CORPUS_DIR
PDF = CORPUS / "good" / "digital_sf424-federal-form.pdf"  # its only %%EOF is at the end
JPG = CORPUS / "good" / "image_us-senate-document-1870s.jpg"
TIF = CORPUS / "good" / "image_numeric-table-scan.tif"

MODES = ["inotify", "poll"]


def _watch(tmp: Path, **kw: Any) -> WatchConfig:
    inbox = tmp / "in"
    inbox.mkdir(parents=True, exist_ok=True)
    opts: dict[str, Any] = {"settle_seconds": 0.3, "poll_interval": 0.2}
    opts.update(kw)
    return WatchConfig(input=inbox, output=tmp / "out", done=tmp / "done", failed=tmp / "failed",
                       **opts)


@dataclass
class Seen:
    """Settled files in arrival order, with the monotonic time each arrived."""

    items: list[tuple[float, SettledFile]] = field(default_factory=list)

    def add(self, settled: SettledFile) -> None:
        self.items.append((time.monotonic(), settled))

    @property
    def names(self) -> list[str]:
        return [s.path.name for _, s in self.items]

    async def wait(self, pred: Callable[[], bool], timeout: float = 10.0) -> None:
        await wait_until_async(pred, timeout, "the watcher's files", every=0.02,
                               context=lambda: f"seen so far: {self.names}")


@asynccontextmanager
async def running(watches: list[WatchConfig], **kw: Any) -> AsyncIterator[tuple[FolderWatcher,
                                                                              Seen]]:
    seen = Seen()
    watcher = FolderWatcher(watches, seen.add, **kw)
    await watcher.start()
    task = asyncio.create_task(watcher.run())
    try:
        yield watcher, seen
    finally:
        watcher.stop()
        await asyncio.wait_for(task, 5)


class SlowCopy(threading.Thread):
    """Copies ``src`` to ``dst`` in ``chunks`` writes, ``pause`` seconds apart."""

    def __init__(self, src: Path, dst: Path, chunks: int, pause: float) -> None:
        super().__init__()
        self.src, self.dst, self.chunks, self.pause = src, dst, chunks, pause
        self.last_write = 0.0  # monotonic time of the last write

    def run(self) -> None:
        data = self.src.read_bytes()
        step = len(data) // self.chunks + 1
        with open(self.dst, "wb") as f:
            for i in range(0, len(data), step):
                f.write(data[i:i + step])
                f.flush()
                self.last_write = time.monotonic()
                time.sleep(self.pause)


def _slow_copy(src: Path, dst: Path, chunks: int, pause: float) -> SlowCopy:
    writer = SlowCopy(src, dst, chunks, pause)
    writer.start()
    return writer


def test_ignored_names() -> None:
    """Temp, partial and metadata names are ignored; user patterns add to the defaults."""
    for name in (".hidden.pdf", ".DS_Store", "._scan.pdf", "~$report.pdf", "scan.pdf.part",
                 "file.crdownload", "a.PARTIAL", "x.tmp", ".~lock.doc#", ".syncthing.a.pdf.tmp",
                 "~syncthing~a.pdf.tmp", "Thumbs.db", "desktop.ini", "x.pdf.error.json",
                 "upload.filepart", "@eaDir", "__MACOSX", "notes.pdf~"):
        assert ignored(name, ()), name
    for name in ("scan.pdf", "Scan 01.PDF", "photo.jpeg", "part.pdf", "tmp.png"):
        assert not ignored(name, ()), name
    assert ignored("draft-1.pdf", ("draft-*",))
    assert not ignored("final-1.pdf", ("draft-*",))


def test_mount_fstype_reads_mountinfo(tmp_path: Path) -> None:
    """mount_fstype() agrees with findmnt for real mounts; network types are recognised."""
    for path in (tmp_path, Path("/proc/self"), Path("/dev/shm")):
        expected = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "--target", str(path)],
                                  capture_output=True, text=True, check=True).stdout.split()[-1]
        assert mount_fstype(path) == expected  # the last of stacked mounts is visible
    assert all(is_network_fstype(t) for t in ("nfs", "nfs4", "cifs", "smb3", "fuse.sshfs",
                                               "9p", "ceph", "glusterfs"))
    assert not any(is_network_fstype(t) for t in ("ext4", "xfs", "tmpfs", "btrfs", "fuseblk"))


def test_sniff_complete_on_real_files(tmp_path: Path) -> None:
    """Whole PDFs/JPEGs look complete; truncated or empty ones do not; TIFF has no marker."""
    assert sniff_complete(PDF, PDF.stat().st_size)
    assert sniff_complete(JPG, JPG.stat().st_size)
    assert sniff_complete(TIF, TIF.stat().st_size)
    half = tmp_path / "half.pdf"
    half.write_bytes(PDF.read_bytes()[: PDF.stat().st_size // 2])
    assert not sniff_complete(half, half.stat().st_size)
    bad = CORPUS / "bad" / "broken_truncated.jpg"
    assert not sniff_complete(bad, bad.stat().st_size)
    assert not sniff_complete(CORPUS / "bad" / "broken_zero-length.pdf", 0)


def test_startup_scan_reports_existing_files_oldest_first(tmp_path: Path) -> None:
    """Files present at start are reported once each, oldest mtime first, ignoring temp names."""
    cfg = _watch(tmp_path)
    names = ["c.pdf", "a.jpg", "sub/deeper/b.tif", "d.pdf"]
    now = time.time()
    for age, name in zip((300, 200, 100, 400), names, strict=True):
        path = cfg.input / name
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(PDF if name.endswith(".pdf") else JPG if name.endswith("jpg") else TIF, path)
        os.utime(path, (now - age, now - age))
    (cfg.input / ".partial.pdf").write_bytes(PDF.read_bytes())
    (cfg.input / "x.pdf.part").write_bytes(PDF.read_bytes())

    async def main() -> None:
        async with running([cfg]) as (_, seen):
            await seen.wait(lambda: len(seen.items) >= 4)
            await asyncio.sleep(0.5)
            assert seen.names == ["d.pdf", "c.pdf", "a.jpg", "b.tif"]
            first = seen.items[0][1]
            assert first.root == cfg.input.resolve() and first.watch_index == 0
            assert first.size == PDF.stat().st_size
            assert first.path == cfg.input.resolve() / "d.pdf"

    asyncio.run(main())


@pytest.mark.parametrize("mode", MODES)
def test_slow_writer_is_not_reported_until_it_stops(tmp_path: Path, mode: str) -> None:
    """A file written in chunks by a real thread is reported once, after the last write."""
    cfg = _watch(tmp_path, mode=mode, settle_seconds=0.5)

    async def main() -> None:
        async with running([cfg]) as (_, seen):
            writer = _slow_copy(TIF, cfg.input / "slow.tif", chunks=12, pause=0.15)
            await asyncio.to_thread(writer.join)
            await seen.wait(lambda: len(seen.items) >= 1)
            await asyncio.sleep(1.0)
            assert seen.names == ["slow.tif"]
            at, settled = seen.items[0]
            assert at >= writer.last_write + 0.5  # a full quiet period after the last write
            assert settled.size == TIF.stat().st_size

    asyncio.run(main())


def test_pdf_without_trailer_waits_through_long_pauses(tmp_path: Path) -> None:
    """A PDF whose writer pauses longer than settle_seconds is not taken before %%EOF."""
    cfg = _watch(tmp_path, settle_seconds=0.3)
    data = PDF.read_bytes()

    async def main() -> None:
        async with running([cfg]) as (_, seen):
            target = cfg.input / "scan.pdf"
            with open(target, "wb") as f:
                f.write(data[: len(data) * 2 // 3])
            await asyncio.sleep(0.8)  # > settle (0.3 s), < grace (5 × settle = 1.5 s)
            assert seen.items == []
            with open(target, "ab") as f:
                f.write(data[len(data) * 2 // 3:])
            await seen.wait(lambda: len(seen.items) >= 1)
            assert seen.items[0][1].size == len(data)

    asyncio.run(main())


def test_truncated_pdf_that_stays_put_is_handed_over(tmp_path: Path) -> None:
    """A PDF that never gets its trailer is still handed over once quiet for the grace time."""
    cfg = _watch(tmp_path, settle_seconds=0.2)

    async def main() -> None:
        async with running([cfg]) as (_, seen):
            started = time.monotonic()
            shutil.copy(CORPUS / "bad" / "broken_truncated_scotus.pdf", cfg.input / "t.pdf")
            await seen.wait(lambda: len(seen.items) >= 1)
            assert seen.items[0][0] - started >= 1.0
            assert seen.names == ["t.pdf"]

    asyncio.run(main())


@pytest.mark.parametrize("mode", MODES)
def test_temp_names_ignored_and_rename_picked_up(tmp_path: Path, mode: str) -> None:
    """Dotfiles and partial names are never reported; a *.part renamed to its final name is."""
    cfg = _watch(tmp_path, mode=mode, ignore=("*.skipme",))

    async def main() -> None:
        async with running([cfg]) as (_, seen):
            for name in (".hidden.pdf", "~$doc.pdf", "x.crdownload", "Thumbs.db", "y.pdf.skipme",
                         ".~lock.report.odt#"):
                shutil.copy(PDF, cfg.input / name)
            writer = _slow_copy(PDF, cfg.input / "scan.pdf.part", chunks=5, pause=0.1)
            await asyncio.to_thread(writer.join)
            await asyncio.sleep(0.8)
            assert seen.items == []
            os.rename(cfg.input / "scan.pdf.part", cfg.input / "scan.pdf")
            await seen.wait(lambda: len(seen.items) >= 1)
            await asyncio.sleep(0.8)
            assert seen.names == ["scan.pdf"]

    asyncio.run(main())


def test_symlinks_out_of_root_are_ignored(tmp_path: Path) -> None:
    """Symlinked files and symlinked directories pointing outside the root are not input."""
    cfg = _watch(tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(PDF, outside / "secret.pdf")
    (cfg.input / "link.pdf").symlink_to(outside / "secret.pdf")
    (cfg.input / "linkdir").symlink_to(outside)
    shutil.copy(PDF, cfg.input / "real.pdf")

    async def main() -> None:
        async with running([cfg]) as (watcher, seen):
            await seen.wait(lambda: len(seen.items) >= 1)
            (cfg.input / "late-link.pdf").symlink_to(outside / "secret.pdf")
            await asyncio.sleep(1.0)
            assert seen.names == ["real.pdf"]
            assert not watcher.is_candidate(0, cfg.input.resolve() / "linkdir" / "secret.pdf")
            assert not watcher.is_candidate(0, outside / "secret.pdf")
            assert watcher.is_candidate(0, cfg.input.resolve() / "real.pdf")

    asyncio.run(main())


@pytest.mark.parametrize("mode", MODES)
def test_recursive_subdirectories(tmp_path: Path, mode: str) -> None:
    """New nested directories and files in them are found; a non-recursive root skips them."""
    deep = _watch(tmp_path / "r", mode=mode)
    flat = _watch(tmp_path / "f", mode=mode, recursive=False)

    async def main() -> None:
        async with running([deep, flat]) as (_, seen):
            for cfg in (deep, flat):
                nested = cfg.input / "a" / "b" / "c"
                nested.mkdir(parents=True)
                shutil.copy(JPG, nested / "photo.jpg")
                shutil.copy(PDF, cfg.input / "top.pdf")
            await seen.wait(lambda: len(seen.items) >= 3)
            await asyncio.sleep(1.0)
            got = sorted((s.watch_index, str(s.path.relative_to(s.root))) for _, s in seen.items)
            assert got == [(0, "a/b/c/photo.jpg"), (0, "top.pdf"), (1, "top.pdf")]

    asyncio.run(main())


def test_polling_mode_and_auto_mode_reported(tmp_path: Path) -> None:
    """describe() shows the effective mode: poll when asked, inotify for auto on a local fs."""
    polled = _watch(tmp_path / "p", mode="poll")
    auto = _watch(tmp_path / "a", mode="auto")

    async def main() -> None:
        async with running([polled, auto]) as (watcher, seen):
            modes = [(d["mode"], d["armed"]) for d in watcher.describe()]
            assert modes == [("poll", True), ("inotify", True)]
            shutil.copy(PDF, polled.input / "p.pdf")
            await seen.wait(lambda: len(seen.items) >= 1)
            assert seen.names == ["p.pdf"]

    asyncio.run(main())


def test_rescan_finds_files_the_observer_missed(tmp_path: Path) -> None:
    """rescan() finds files no event announced, and does not report unchanged files twice."""
    cfg = _watch(tmp_path, mode="poll", poll_interval=3600.0, rescan_interval=3600.0)

    async def main() -> None:
        async with running([cfg]) as (watcher, seen):
            await asyncio.sleep(0.3)
            shutil.copy(PDF, cfg.input / "missed.pdf")
            await asyncio.sleep(1.0)
            assert seen.items == []  # the observer polls once an hour
            assert await watcher.rescan() == 1
            await seen.wait(lambda: len(seen.items) >= 1)
            assert await watcher.rescan() == 0
            await asyncio.sleep(0.8)
            assert seen.names == ["missed.pdf"]
            os.utime(cfg.input / "missed.pdf")  # changed: worth reporting again
            assert await watcher.rescan() == 1
            await seen.wait(lambda: len(seen.items) >= 2)

    asyncio.run(main())


def test_files_added_while_stopped_are_found_on_start(tmp_path: Path) -> None:
    """Files dropped while no watcher runs are reported by the next watcher's start-up scan."""
    cfg = _watch(tmp_path)

    async def main() -> None:
        async with running([cfg]) as (_, seen):
            shutil.copy(PDF, cfg.input / "one.pdf")
            await seen.wait(lambda: len(seen.items) >= 1)
        shutil.copy(JPG, cfg.input / "two.jpg")
        async with running([cfg]) as (_, seen2):
            await seen2.wait(lambda: len(seen2.items) >= 2)
            assert sorted(seen2.names) == ["one.pdf", "two.jpg"]

    asyncio.run(main())


def test_root_replaced_is_rearmed(tmp_path: Path) -> None:
    """If the watched folder is deleted and recreated, the health check re-arms and rescans."""
    cfg = _watch(tmp_path)

    async def main() -> None:
        async with running([cfg], health_interval=0.2) as (watcher, seen):
            shutil.rmtree(cfg.input)
            await asyncio.sleep(0.6)
            assert watcher.describe()[0]["armed"] is False
            cfg.input.mkdir()
            await asyncio.sleep(0.6)
            assert watcher.describe()[0]["armed"] is True
            shutil.copy(PDF, cfg.input / "after.pdf")
            await seen.wait(lambda: len(seen.items) >= 1)
            assert seen.names == ["after.pdf"]

    asyncio.run(main())


def test_dead_inotify_reader_is_rearmed(tmp_path: Path) -> None:
    """watchdog reads inotify on a thread of its own (``InotifyFD``); when it dies the
    observer and its emitter live on, deaf. The health check re-arms and rescans.

    CI saw the reader die of an exception in watchdog's own recursive add (a warning
    turned error); here it ends the way a thread ends, its run loop told to stop (the
    next event wakes it, it handles that and returns), leaving the emitter and the
    inotify descriptor as that death did. No rescan is due for an hour: only the re-arm
    can find the file dropped after.
    """
    cfg = _watch(tmp_path, mode="inotify", rescan_interval=3600.0)

    async def main() -> None:
        before = {t for t in threading.enumerate() if isinstance(t, InotifyFD)}
        with capture_logs() as logs:
            async with running([cfg], health_interval=0.2) as (watcher, seen):
                readers = [t for t in threading.enumerate()
                           if isinstance(t, InotifyFD) and t not in before]
                assert len(readers) == 1, readers
                reader = readers[0]
                shutil.copy(PDF, cfg.input / "first.pdf")
                await seen.wait(lambda: seen.names == ["first.pdf"])
                reader.stopped_event.set()  # watchdog's own stop flag, nothing of ours
                (cfg.input / ".wake").touch()  # an ignored name: wakes the reader's read
                await asyncio.to_thread(reader.join, 10)
                assert not reader.is_alive()
                shutil.copy(PDF, cfg.input / "after.pdf")
                await seen.wait(lambda: "after.pdf" in seen.names)
                assert seen.names == ["first.pdf", "after.pdf"]
                assert watcher.describe()[0]["armed"] is True
        rearms = [e for e in logs if e["event"] == "watch_rearm"]
        assert len(rearms) == 1 and rearms[0]["was_armed"] is True, rearms

    asyncio.run(main())


def test_callback_errors_do_not_stop_the_watcher(tmp_path: Path) -> None:
    """An exception in on_settled is logged and the next file is still reported."""
    cfg = _watch(tmp_path)
    seen: list[str] = []

    def flaky(settled: SettledFile) -> None:
        seen.append(settled.path.name)
        if len(seen) == 1:
            raise RuntimeError("boom")

    async def main() -> None:
        watcher = FolderWatcher([cfg], flaky)
        await watcher.start()
        task = asyncio.create_task(watcher.run())
        shutil.copy(PDF, cfg.input / "a.pdf")
        await wait_until_async(lambda: seen, 5, "a.pdf seen", every=0.05)
        shutil.copy(PDF, cfg.input / "b.pdf")
        await wait_until_async(lambda: len(seen) == 2, 5, "b.pdf seen", every=0.05)
        watcher.stop()
        await asyncio.wait_for(task, 5)
        assert seen == ["a.pdf", "b.pdf"]

    asyncio.run(main())


_FD_STARVED = textwrap.dedent("""
    import asyncio, resource, shutil, sys, time
    from pathlib import Path
    from chandrad.config import WatchConfig
    from chandrad.watch import FolderWatcher

    tmp = Path(sys.argv[1])
    cfg = WatchConfig(input=tmp / "in", output=tmp / "out", done=tmp / "done",
                      failed=tmp / "failed", mode="inotify", settle_seconds=0.2,
                      poll_interval=0.2)

    async def main():
        seen = []
        watcher = FolderWatcher([cfg], seen.append, health_interval=0.2)
        await asyncio.to_thread(int)  # the worker pool exists before the fds run out
        # Use up every file descriptor: inotify_init() then fails with EMFILE.
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        hoard = []
        try:
            while True:
                hoard.append(open("/dev/null"))
        except OSError:
            pass
        await watcher.start()
        for f in hoard:
            f.close()
        print("mode", watcher.describe()[0]["mode"], flush=True)
        task = asyncio.create_task(watcher.run())
        shutil.copy(sys.argv[2], cfg.input / "x.pdf")
        for _ in range(200):
            if seen:
                break
            await asyncio.sleep(0.05)
        print("armed", watcher.describe()[0]["armed"], flush=True)
        print("seen", [s.path.name for s in seen], flush=True)
        watcher.stop()
        await task

    asyncio.run(main())
""")


def test_inotify_instance_limit_falls_back_to_polling(tmp_path: Path) -> None:
    """A real EMFILE from inotify_init() makes the root fall back to polling, and it works."""
    (tmp_path / "in").mkdir()
    proc = subprocess.run([sys.executable, "-c", _FD_STARVED, str(tmp_path), str(PDF)],
                          capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0, proc.stderr
    lines = [x for x in proc.stdout.splitlines() if x.startswith(("mode ", "armed ", "seen "))]
    assert lines == ["mode poll", "armed True", "seen ['x.pdf']"], proc.stdout + proc.stderr
    assert "watch_fallback_poll" in proc.stdout + proc.stderr


# ---------------------------------------------------------------- the loop is never wedged

_TINY_PDF = b"%PDF-1.4\n1 0 obj <<>> endobj\ntrailer <<>>\n%%EOF\n"


def _many_files(root: Path, dirs: int, per_dir: int) -> None:
    for d in range(dirs):
        sub = root / f"d{d:03d}"
        sub.mkdir(parents=True)
        for i in range(per_dir):
            (sub / f"f{i:04d}.txt.part").touch()  # ignored names: only the walks cost


class Ticker:
    """A coroutine that ticks every 10 ms and records when, and the longest gap between.

    ``max_gap`` is wall time; ``max_busy`` is the CPU time the loop's thread spent between
    two ticks. Work done on the loop shows in both; a loop thread that the kernel left off
    the CPU, or that waited for the GIL, on a loaded machine shows only in the first.
    """

    def __init__(self) -> None:
        self.max_gap = 0.0
        self.max_busy = 0.0
        self.ticks: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        last, last_cpu = time.monotonic(), time.thread_time()
        while True:
            await asyncio.sleep(0.01)
            now, cpu = time.monotonic(), time.thread_time()
            self.ticks.append(now)
            self.max_gap = max(self.max_gap, now - last)
            self.max_busy = max(self.max_busy, cpu - last_cpu)
            last, last_cpu = now, cpu

    def between(self, start: float, end: float) -> int:
        return sum(1 for t in self.ticks if start < t < end)

    async def __aenter__(self) -> Ticker:
        self._task = asyncio.get_running_loop().create_task(self._run())
        await asyncio.sleep(0.02)  # ticking before the code under test runs
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


def test_arming_a_large_poll_root_keeps_the_loop_responsive(tmp_path: Path) -> None:
    """60,000 entries in poll mode: start-up and a health re-arm never stall the loop.

    watchdog's polling observer takes its first full snapshot on the thread that
    starts it; done on the event loop that was seconds of silence (control socket,
    systemd watchdog). The root is then replaced by another large one, which the
    health check re-arms: that must not stall the loop either.
    """
    cfg = _watch(tmp_path, mode="poll", poll_interval=3600.0, rescan_interval=3600.0)
    _many_files(cfg.input, 100, 600)
    spare = tmp_path / "in.next"
    _many_files(spare, 100, 600)
    (spare / "late.pdf").write_bytes(_TINY_PDF)
    (cfg.input / "early.pdf").write_bytes(_TINY_PDF)

    async def main() -> tuple[float, float, float, int, list[str]]:
        seen = Seen()
        watcher = FolderWatcher([cfg], seen.add, health_interval=0.2)
        async with Ticker() as ticker:
            started = time.monotonic()
            await watcher.start()
            arm_s = time.monotonic() - started
            ticks_while_arming = ticker.between(started, started + arm_s)
            task = asyncio.create_task(watcher.run())
            await seen.wait(lambda: len(seen.items) >= 1)
            old_ident = watcher._roots[0].ident
            cfg.input.rename(tmp_path / "in.old")
            spare.rename(cfg.input)  # a new directory at the root's path: re-armed
            await seen.wait(lambda: len(seen.items) >= 2, timeout=60)
            assert watcher._roots[0].ident != old_ident
            assert watcher.describe()[0]["armed"] is True
            watcher.stop()
            await asyncio.wait_for(task, 5)
        return ticker.max_gap, ticker.max_busy, arm_s, ticks_while_arming, seen.names

    max_gap, max_busy, arm_s, ticks, names = asyncio.run(main())
    print(f"arming 60,000 entries: {arm_s:.2f} s, the loop ticked {ticks} times meanwhile, "
          f"longest loop gap {max_gap * 1000:.0f} ms, of which on the CPU "
          f"{max_busy * 1000:.0f} ms")
    assert names == ["early.pdf", "late.pdf"]
    # On the loop, the whole arming was one gap, no tick happened during it, and the loop's
    # thread spent it on the CPU walking the tree. Wall gaps alone also grow when other
    # tests load the machine (the loop thread waits for a core or the GIL): the bound is
    # on the loop thread's own CPU time between two ticks.
    assert ticks >= 5, f"the loop did not run while arming ({arm_s:.2f} s)"
    assert max_busy < max(0.1, arm_s / 4), (
        f"event loop busy {max_busy:.2f} s without a turn (arming took {arm_s:.2f} s)")


_SYMLINK_LOOP = textwrap.dedent("""
    import asyncio, json, resource, sys, time
    from pathlib import Path
    from chandrad.config import WatchConfig
    from chandrad.watch import FolderWatcher

    # Bounded even when the snapshot explodes: 1.5 GiB of address space at most.
    resource.setrlimit(resource.RLIMIT_AS, (3 << 29, 3 << 29))
    tmp = Path(sys.argv[1])
    cfg = WatchConfig(input=tmp / "in", output=tmp / "out", done=tmp / "done",
                      failed=tmp / "failed", mode="poll", settle_seconds=0.2,
                      poll_interval=0.2, rescan_interval=0.5)

    async def main():
        seen = []
        watcher = FolderWatcher([cfg], seen.append, health_interval=0.2)
        started = time.monotonic()
        await watcher.start()
        armed_s = time.monotonic() - started
        task = asyncio.create_task(watcher.run())
        (cfg.input / "x.pdf").write_bytes(sys.argv[2].encode())
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # a few polls and rescans through the loops
        print(json.dumps({"armed_s": armed_s, "armed": watcher.describe()[0]["armed"],
                          "seen": [s.path.name for s in seen]}), flush=True)
        watcher.stop()
        await task

    asyncio.run(main())
""")


def test_poll_snapshots_never_follow_symlink_loops(tmp_path: Path) -> None:
    """Two links to ``.`` in a polled root: arming takes a moment, the file is seen once.

    Following links, each snapshot walks 2**40 paths (ELOOP stops each chain only at
    40 links): the daemon blocked, then ran out of memory. A child process with a memory
    cap and a time limit keeps this test bounded either way.
    """
    inbox = tmp_path / "in"
    inbox.mkdir()
    for name in ("a", "b"):
        (inbox / name).symlink_to(".")
    for i in range(20):
        (inbox / f"note{i}.txt.part").touch()
    try:
        proc = subprocess.run([sys.executable, "-c", _SYMLINK_LOOP, str(tmp_path),
                               _TINY_PDF.decode()],
                              capture_output=True, text=True, timeout=60,
                              cwd=Path(__file__).parent.parent)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the watcher did not arm within 60 s: {exc.stderr!r}") from exc
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["seen"] == ["x.pdf"] and report["armed"] is True, report
    assert report["armed_s"] < 5.0, report
