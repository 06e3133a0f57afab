"""Watched input folders: observers, settle tracking, ignore rules, scans.

Owns the watchdog observers (inotify, or polling on network filesystems and when
inotify runs out of watches/instances), the decision "this file has finished
arriving" and the start-up scan, periodic rescan and observer health check. It hands
each settled file to a callback on the event-loop thread and knows nothing about the
store: de-duplication here only stops flooding (an unchanged file is reported once).

Threading: watchdog threads only forward raw events to the loop with
``call_soon_threadsafe``; every piece of state lives on the loop thread. Anything that
walks or stats a folder runs in ``asyncio.to_thread`` workers that touch no shared
state: scans, settle probes, and arming and disarming observers (watchdog takes an
inotify observer's recursive watches, and a polling observer's first full snapshot, on
the thread that starts it, and stopping one joins its emitter mid-snapshot; on a large
or hung network share either would stall the event loop, and with it the control
socket and the systemd watchdog). Polling snapshots use ``lstat``: a symlink is never
followed, so a link loop below the root costs one entry, not an exponential walk.

Must not import the store, the pipeline or any other adapter.
"""

from __future__ import annotations

import asyncio
import errno
import fnmatch
import functools
import math
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from watchdog.events import (
    DirCreatedEvent,
    DirDeletedEvent,
    DirMovedEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers.api import BaseObserver
from watchdog.observers.inotify import InotifyObserver
from watchdog.observers.polling import PollingObserverVFS

from chandrad import names
from chandrad.config import WatchConfig
from chandrad.errors import ConfigProblem
from chandrad.tasks import working_on

log = structlog.get_logger(__name__)

#: Names never taken as input (research/anchors_ops.md §1.4), matched case-insensitively
#: against every path component below the root. Any dot-name covers rsync temps
#: (``.name.XXXXXX``), ``.DS_Store``, ``._*``, ``.~lock.*``, ``.syncthing.*``, vim swaps,
#: ``.stfolder``, ``.Trashes`` and friends.
DEFAULT_IGNORE: tuple[str, ...] = (
    ".*", "~$*", "*~", "~syncthing~*", "*.part", "*.partial", "*.crdownload", "*.download",
    "*.filepart", "*.tmp", "*.temp", "*.swp", "*.swx", "*.kate-swp", "*.error.json",
    "thumbs.db", "desktop.ini", "@eadir", "__macosx", "#recycle", "$recycle.bin",
)

#: Filesystems whose remote writes inotify never sees (inotify(7) NOTES); any
#: ``fuse.*`` type is treated the same way.
NETWORK_FSTYPES = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "9p", "ceph", "glusterfs", "lustre",
    "gpfs", "afs", "davfs", "virtiofs", "vboxsf", "beegfs", "ocfs2", "gfs2",
})

#: A PDF/JPEG/PNG without its end marker, or an empty file, is only handed over after
#: this many settle periods of no change (then the pipeline rejects it with a reason).
INCOMPLETE_GRACE_FACTOR = 5.0
INCOMPLETE_GRACE_MIN = 1.0

_EVENT_FILTER: list[type[FileSystemEvent]] = [
    FileCreatedEvent, FileModifiedEvent, FileMovedEvent, FileDeletedEvent, FileClosedEvent,
    DirCreatedEvent, DirMovedEvent, DirDeletedEvent,
]
_TAIL = 1024


@dataclass(frozen=True)
class SettledFile:
    """A file that has finished arriving. ``path`` is absolute, under ``root``."""

    watch_index: int
    root: Path
    path: Path
    size: int
    mtime: float


@dataclass(frozen=True)
class _Sig:
    """What must not change between two stats for a file to count as settled."""

    size: int
    mtime_ns: int
    ino: int
    dev: int


@dataclass
class _Tracked:
    """A candidate file waiting to settle (loop-thread state)."""

    watch_index: int
    last_event: float  # monotonic
    changed_at: float  # monotonic time the signature last changed
    sig: _Sig | None = None
    gen: int = 0


@dataclass(frozen=True)
class _Probe:
    sig: _Sig
    mtime: float
    complete: bool


@dataclass
class _Root:
    index: int
    cfg: WatchConfig
    root: Path  # resolved
    excluded: tuple[Path, ...]  # resolved output/done/failed
    mode: str  # effective: "inotify" or "poll"
    reason: str
    observer: BaseObserver | None = None
    ident: tuple[int, int] | None = None
    next_rescan: float = 0.0
    missing_logged: bool = False
    reported: dict[Path, _Sig] = field(default_factory=dict)


_DEFAULT_IGNORE_RE = re.compile("|".join(fnmatch.translate(p) for p in DEFAULT_IGNORE))


@functools.lru_cache(maxsize=64)
def _patterns_re(patterns: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(fnmatch.translate(p) for p in patterns))


def ignored(name: str, extra_patterns: Sequence[str] = ()) -> bool:
    """Whether a file or directory name is never input (defaults + user fnmatch patterns).

    Defaults match case-insensitively; user patterns match the name as written.
    """
    if _DEFAULT_IGNORE_RE.match(name.lower()):
        return True
    return bool(extra_patterns) and bool(_patterns_re(tuple(extra_patterns)).match(name))


def mount_fstype(path: Path) -> str:
    """The filesystem type of the mount holding ``path`` (from /proc/self/mountinfo)."""
    target = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields_ = left.split()
        if not sep or len(fields_) < 5 or not right:
            continue
        point = _unescape_mount(fields_[4])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, right.split()[0]
    return fstype


def _unescape_mount(text: str) -> str:
    r"""mountinfo escapes space, tab, newline and backslash as ``\040``-style octal."""
    if "\\" not in text:
        return text
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 3 < len(text) and text[i + 1:i + 4].isdigit():
            out.append(chr(int(text[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def is_network_fstype(fstype: str) -> bool:
    """Whether inotify cannot be trusted on this filesystem type."""
    return fstype in NETWORK_FSTYPES or fstype.startswith("fuse.")


#: The folders of a watch, in the order their problems are reported.
WATCH_FOLDERS = ("input", "output", "done", "failed")
_WHY_WRITABLE = {"input": "each input is moved out of it", "output": "outputs are written to it",
                 "done": "finished inputs are moved into it",
                 "failed": "failed inputs and their .error.json go into it"}


def unwritable(folder: Path) -> str | None:
    """Why chandrad cannot create files in the existing ``folder`` (a read-only mount,
    no write permission), or None when it can."""
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return "it is on a read-only filesystem"
    except OSError as exc:
        return f"cannot stat it: {exc.strerror or exc}"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"uid {os.geteuid()} may not create files in it"
    return None


def _nearest_existing(folder: Path) -> Path:
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    return folder


def folder_problems(watches: Sequence[WatchConfig], *, create: bool) -> list[ConfigProblem]:
    """Check every watched folder before the daemon uses it; with ``create``, create
    what may be created. Each problem names its key (``watch[i].output``; file and line
    are the caller's to add).

    * ``input`` must exist, unless ``create_input`` says to create it: a misspelled input
      would otherwise be created empty and watched forever;
    * ``output``, ``done`` and ``failed`` are created when missing;
    * every folder must be a directory chandrad can create files in (a read-only mount
      is refused whether the folder existed or not: every job would be held).

    Without ``create`` (``chandrad check-config``) nothing is created: a folder that
    would be is judged by its nearest existing parent.
    """
    problems: list[ConfigProblem] = []
    for i, w in enumerate(watches):
        for name in WATCH_FOLDERS:
            folder: Path = getattr(w, name)
            key = f"watch[{i}].{name}"
            why = _folder_problem(folder, name, create=create,
                                  may_create=name != "input" or w.create_input)
            if why is not None:
                problems.append(ConfigProblem(key, why, code="config_watch_folder"))
    return problems


def _folder_problem(folder: Path, name: str, *, create: bool, may_create: bool) -> str | None:
    shown = names.display(folder)
    if not folder.exists():
        if not may_create:
            return (f"{shown} does not exist (a typo?); create it, or set "
                    "create_input = true in this [[watch]] to have chandrad create it")
        if create:
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                why = unwritable(_nearest_existing(folder.parent)) or exc.strerror or str(exc)
                return f"cannot create {shown}: {why}"
        else:
            parent = _nearest_existing(folder.parent)
            reason = unwritable(parent) if parent.is_dir() else "it is not a directory"
            return None if reason is None else (
                f"{shown} does not exist and cannot be created in {names.display(parent)}: "
                f"{reason}")
    if not folder.is_dir():
        return f"{shown} is not a directory"
    reason = unwritable(folder)
    return None if reason is None else f"{shown}: {reason}, and {_WHY_WRITABLE[name]}"


def sniff_complete(path: Path, size: int) -> bool:
    """Whether the file looks fully written: not empty, and PDF/JPEG/PNG end markers present.

    Files that sniff as neither PDF nor image count as complete (the pipeline rejects
    them with a reason); TIFF, GIF, BMP and WebP have no cheap end marker.
    """
    if size == 0:
        return False
    with open(path, "rb") as f:
        head = f.read(16)
        f.seek(max(0, size - _TAIL))
        tail = f.read(_TAIL)
    if head.startswith(b"%PDF-"):
        return b"%%EOF" in tail
    if head.startswith(b"\xff\xd8\xff"):
        return b"\xff\xd9" in tail
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return b"IEND" in tail
    return True


class _Handler(FileSystemEventHandler):
    """Runs in watchdog's thread: forwards events to the loop, and never raises."""

    def __init__(self, watcher: FolderWatcher, index: int) -> None:
        self._watcher = watcher
        self._index = index

    def on_any_event(self, event: FileSystemEvent) -> None:
        # An exception here would kill watchdog's dispatcher thread silently.
        try:
            if event.event_type not in ("created", "modified", "moved", "deleted", "closed"):
                return
            dest = os.fsdecode(event.dest_path) if event.dest_path else ""
            self._watcher._post(self._index, event.event_type, os.fsdecode(event.src_path),
                                dest, event.is_directory)
        except Exception:
            log.exception("watch_handler_error", watch=self._index)


class FolderWatcher:
    """Watches every configured input root and reports settled files.

    ``on_settled`` is called on the event-loop thread, oldest files first at start-up,
    and at most once per unchanged file.
    """

    def __init__(
        self,
        watches: Sequence[WatchConfig],
        on_settled: Callable[[SettledFile], None],
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        health_interval: float = 5.0,
    ) -> None:
        self._on_settled = on_settled
        self._loop = loop
        self._health_interval = health_interval
        self._roots = [_make_root(i, w) for i, w in enumerate(watches)]
        self._tracked: dict[Path, _Tracked] = {}
        self._dir_scans: dict[Path, int] = {}
        self._stopped = True
        self._next_health = 0.0
        settles = [w.settle_seconds for w in watches] or [1.0]
        self._tick = min(0.5, max(0.05, min(settles) / 4))

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Arm the observers and run the start-up scan, in worker threads.

        Call on the event-loop thread; the loop keeps serving other tasks meanwhile.
        """
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        self._stopped = False
        for r in self._roots:
            await self._arm(r)
        await self.rescan()
        self._next_health = time.monotonic() + self._health_interval

    async def run(self) -> None:
        """Settle loop, periodic rescan and observer health; runs until cancelled or stopped."""
        while not self._stopped:
            next_due = await self._settle()
            await self._scan_new_dirs()
            now = time.monotonic()
            for r in self._roots:
                if now >= r.next_rescan and not self._stopped:
                    await self._rescan_async(r)
            if now >= self._next_health:
                await self._check_health()
                self._next_health = time.monotonic() + self._health_interval
            await asyncio.sleep(min(self._tick, max(0.005, next_due - time.monotonic())))

    def stop(self) -> None:
        """Stop the observers; ``run()`` returns at its next tick.

        Does not block: the observers are stopped and joined by a background thread
        (a polling observer finishes its current snapshot first). Events they still
        deliver are ignored.
        """
        self._stopped = True
        observers = [r.observer for r in self._roots if r.observer is not None]
        for r in self._roots:
            r.observer = None
        if observers:
            threading.Thread(target=_stop_observers, args=(observers,), name="watch-disarm",
                             daemon=True).start()

    def describe(self) -> list[dict[str, Any]]:
        """Per root: path, effective mode and why, whether an observer is alive, backlog."""
        return [{
            "index": r.index,
            "input": str(r.root),
            "mode": r.mode,
            "reason": r.reason,
            "armed": _alive(r.observer),
            "tracking": sum(1 for t in self._tracked.values() if t.watch_index == r.index),
        } for r in self._roots]

    # -- candidates and scans --------------------------------------------------------

    def is_candidate(self, watch_index: int, path: Path) -> bool:
        """A regular, non-ignored file under the root (no symlink escaping it), not output."""
        return self._candidate_stat(watch_index, path, {}) is not None

    def _candidate_stat(self, watch_index: int, path: Path,
                        real_dirs: dict[Path, Path]) -> os.stat_result | None:
        """is_candidate() that returns the lstat; ``real_dirs`` caches resolved parents."""
        r = self._roots[watch_index]
        if not self._plausible(r, path):
            return None
        rel = _relative(r, path)
        if rel is None:
            return None
        full = r.root / rel
        try:
            st = os.lstat(full)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        # A symlinked parent directory would lead outside the root.
        parent = real_dirs.get(full.parent)
        if parent is None:
            parent = real_dirs[full.parent] = Path(os.path.realpath(full.parent))
        if parent != full.parent or any(_within(parent, x) for x in r.excluded):
            return None
        return st

    async def rescan(self) -> int:
        """Scan every root now (in a worker thread); returns how many files were newly taken up."""
        new = 0
        for r in self._roots:
            found = await asyncio.to_thread(_collect, r, r.root)
            new += self._merge(r, found, full=True)
            r.next_rescan = time.monotonic() + r.cfg.rescan_interval
        return new

    async def _rescan_async(self, r: _Root) -> None:
        found = await asyncio.to_thread(_collect, r, r.root)
        self._merge(r, found, full=True)
        r.next_rescan = time.monotonic() + r.cfg.rescan_interval

    async def _scan_new_dirs(self) -> None:
        while self._dir_scans and not self._stopped:
            path, index = self._dir_scans.popitem()
            r = self._roots[index]
            found = await asyncio.to_thread(_collect, r, path)
            self._merge(r, found, full=False)

    def _merge(self, r: _Root, found: list[tuple[Path, _Sig, float]], *, full: bool) -> int:
        """Take up scanned files, oldest mtime first; a full scan also forgets vanished ones."""
        now, wall, settle = time.monotonic(), time.time(), r.cfg.settle_seconds
        new = 0
        for path, sig, mtime in sorted(found, key=lambda item: item[2]):
            if path in self._tracked or r.reported.get(path) == sig:
                continue
            age = max(0.0, wall - mtime)
            # Unchanged for longer than the settle time already: one more stat settles it.
            last_event = now - settle if age >= settle else now
            self._tracked[path] = _Tracked(r.index, last_event, now - age, sig)
            new += 1
        if full:
            present = {p for p, _, _ in found}
            for gone in [p for p in r.reported if p not in present]:
                del r.reported[gone]
        return new

    # -- events (loop thread) --------------------------------------------------------

    def _post(self, index: int, kind: str, src: str, dest: str, is_dir: bool) -> None:
        """Called from watchdog threads."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._on_event, index, kind, src, dest, is_dir)

    def _on_event(self, index: int, kind: str, src: str, dest: str, is_dir: bool) -> None:
        if self._stopped:
            return
        r = self._roots[index]
        if kind in ("deleted", "moved"):
            self._forget(r, Path(src), is_dir)
        target = Path(dest) if kind == "moved" else Path(src)
        if kind == "deleted" or (kind == "moved" and _relative(r, target) is None):
            return
        if is_dir:
            if kind in ("created", "moved") and self._plausible(r, target):
                self._dir_scans[target] = index
            return
        if self._plausible(r, target):
            self._touch(index, target)

    def _plausible(self, r: _Root, path: Path) -> bool:
        """The name-only part of is_candidate (no I/O, safe for every event)."""
        rel = _relative(r, path)
        if rel is None or not rel.parts:
            return False
        if not r.cfg.recursive and len(rel.parts) > 1:
            return False
        return not any(ignored(part, r.cfg.ignore) for part in rel.parts)

    def _touch(self, index: int, path: Path) -> None:
        now = time.monotonic()
        t = self._tracked.get(path)
        if t is None:
            self._tracked[path] = _Tracked(index, now, now)
        else:
            t.last_event = now
            t.gen += 1

    def _forget(self, r: _Root, path: Path, is_dir: bool) -> None:
        if not is_dir:
            self._tracked.pop(path, None)
            r.reported.pop(path, None)
            return
        for p in [p for p in self._tracked if _within(p, path)]:
            del self._tracked[p]
        for p in [p for p in r.reported if _within(p, path)]:
            del r.reported[p]

    # -- settling --------------------------------------------------------------------

    async def _settle(self) -> float:
        """Probe the candidates that are due; returns when the next one is due (monotonic).

        A new candidate is stat'ed once halfway through its settle time, so that the stat
        confirming it unchanged comes at the settle time itself, not a tick later; the
        loop sleeps until then (a file reaches the engine within settle + 0.3 s).
        """
        now = time.monotonic()
        due: list[tuple[Path, int, int]] = []
        next_due = math.inf
        for path, t in self._tracked.items():
            settle = self._roots[t.watch_index].cfg.settle_seconds
            at = t.last_event + (settle / 2 if t.sig is None else settle)
            if now >= at:
                due.append((path, t.watch_index, t.gen))
            else:
                next_due = min(next_due, at)
        if not due:
            return next_due
        probes = await asyncio.to_thread(self._probe_many, [(i, p) for p, i, _ in due])
        now = time.monotonic()
        for (path, index, gen), probe in zip(due, probes, strict=True):
            with working_on((index, self._roots[index].root, path)):
                self._settled_probe(path, index, gen, probe, now)
        return next_due

    def _settled_probe(self, path: Path, index: int, gen: int, probe: _Probe | None,
                       now: float) -> None:
        """One probed candidate: still changing, still incomplete, or settled (emitted)."""
        t = self._tracked.get(path)
        if t is None or t.gen != gen or self._stopped:
            return  # an event arrived while probing: wait for quiet again
        if probe is None:
            del self._tracked[path]  # gone, or not a candidate after all
            return
        if probe.sig != t.sig:
            if t.sig is not None:
                t.last_event = now  # changed without an event (polling lag)
            t.sig, t.changed_at = probe.sig, now
            return
        r = self._roots[index]
        grace = max(INCOMPLETE_GRACE_MIN, INCOMPLETE_GRACE_FACTOR * r.cfg.settle_seconds)
        if not probe.complete and now - t.changed_at < grace:
            return
        del self._tracked[path]
        if r.reported.get(path) == probe.sig:
            return
        r.reported[path] = probe.sig
        self._emit(SettledFile(index, r.root, path, probe.sig.size, probe.mtime))

    def _probe_many(self, items: Iterable[tuple[int, Path]]) -> list[_Probe | None]:
        """Worker thread: stat and sniff each file; touches no shared state."""
        real_dirs: dict[Path, Path] = {}
        return [self._probe(index, path, real_dirs) for index, path in items]

    def _probe(self, index: int, path: Path, real_dirs: dict[Path, Path]) -> _Probe | None:
        st = self._candidate_stat(index, path, real_dirs)
        if st is None:
            return None
        try:
            complete = sniff_complete(path, st.st_size)
        except OSError:
            return None
        return _Probe(_sig(st), st.st_mtime, complete)

    def _emit(self, settled: SettledFile) -> None:
        try:
            self._on_settled(settled)
        except Exception:
            log.exception("watch_callback_error", file=names.display(settled.path))

    # -- observers -------------------------------------------------------------------

    async def _arm(self, r: _Root) -> None:
        """Start an observer for the root off the loop; inotify limits fall back to polling."""
        r.ident = await asyncio.to_thread(_ident, r.root)
        if r.ident is None:
            if not r.missing_logged:
                log.warning("watch_root_missing", watch=r.index, input=str(r.root))
                r.missing_logged = True
            return
        r.missing_logged = False
        if r.mode == "inotify":
            try:
                r.observer = await self._start_observer(InotifyObserver(), r)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EMFILE):
                    log.warning("watch_arm_failed", watch=r.index, input=str(r.root),
                                mode=r.mode, error=str(exc))
                    return
                r.mode, r.reason = "poll", f"inotify unavailable: {exc.strerror}"
                log.warning("watch_fallback_poll", watch=r.index, input=str(r.root),
                            reason=r.reason)
        if r.mode == "poll":
            try:
                r.observer = await self._start_observer(_polling_observer(r.cfg.poll_interval), r)
            except OSError as exc:
                log.warning("watch_arm_failed", watch=r.index, input=str(r.root),
                            mode=r.mode, error=str(exc))
                return
        if r.observer is None:
            return  # stopped while arming
        log.info("watch_armed", watch=r.index, input=str(r.root), mode=r.mode, reason=r.reason,
                 recursive=r.cfg.recursive)

    async def _start_observer(self, observer: BaseObserver, r: _Root) -> BaseObserver | None:
        """Schedule and start ``observer`` in a worker thread (its first walk runs there).

        Returns None, with the observer stopped again, if the watcher was stopped meanwhile.
        Raises the ``OSError`` of watchdog's start (inotify limits, missing root).
        """
        started = await asyncio.to_thread(_start_observer, observer, r, self)
        if self._stopped:
            await asyncio.to_thread(_stop_observers, [started])
            return None
        return started

    async def _disarm(self, r: _Root) -> None:
        observer, r.observer = r.observer, None
        if observer is not None:
            await asyncio.to_thread(_stop_observers, [observer])

    async def _check_health(self) -> None:
        """Re-arm a root whose observer died or whose directory was replaced, then rescan."""
        for r in self._roots:
            if self._stopped:
                return
            if _alive(r.observer) and await asyncio.to_thread(_ident, r.root) == r.ident:
                continue
            if self._stopped:
                return
            was_armed = r.observer is not None
            await self._disarm(r)
            await self._arm(r)
            if r.observer is not None:
                log.warning("watch_rearm", watch=r.index, input=str(r.root), mode=r.mode,
                            was_armed=was_armed)
                r.next_rescan = 0.0  # files may have arrived while deaf


def _make_root(index: int, cfg: WatchConfig) -> _Root:
    root = Path(os.path.realpath(cfg.input))
    excluded = tuple(Path(os.path.realpath(p)) for p in (cfg.output, cfg.done, cfg.failed))
    if cfg.mode != "auto":
        mode, reason = cfg.mode, "configured"
    else:
        fstype = mount_fstype(root)
        if is_network_fstype(fstype):
            mode, reason = "poll", f"network filesystem {fstype}"
        else:
            mode, reason = "inotify", f"local filesystem {fstype or 'unknown'}"
    return _Root(index, cfg, root, excluded, mode, reason)


def _polling_observer(interval: float) -> BaseObserver:
    """A polling observer whose snapshots never follow symlinks.

    watchdog's ``PollingObserver`` snapshots with ``os.stat``: a symlink to a directory is
    walked, so a link loop (``in/a -> .``, ``in/b -> .``) makes every snapshot a walk of
    2**40 paths. With ``os.lstat`` a link is one entry (and never a candidate anyway).
    """
    return PollingObserverVFS(os.lstat, os.scandir, polling_interval=interval)


def _start_observer(observer: BaseObserver, r: _Root, watcher: FolderWatcher) -> BaseObserver:
    """Worker thread: schedule the root and start. The first walk of the tree happens here."""
    observer.daemon = True
    observer.schedule(_Handler(watcher, r.index), str(r.root), recursive=r.cfg.recursive,
                      event_filter=_EVENT_FILTER)
    observer.start()
    return observer


def _stop_observers(observers: Iterable[BaseObserver]) -> None:
    """Worker thread: stop and join observers (joining waits for a snapshot in progress)."""
    for observer in observers:
        try:
            observer.stop()
            if observer.is_alive():
                observer.join(timeout=30.0)
        except Exception:
            log.exception("watch_disarm_error")


def _alive(observer: BaseObserver | None) -> bool:
    """The observer thread runs, its emitter (one per root) has not stopped, and for
    inotify, the thread that reads the inotify descriptor still runs.

    That reader (watchdog's ``InotifyFD``) is a thread of its own: when it dies (an
    exception in watchdog's own event handling ends it) the observer and the emitter
    stay alive, blocked waiting for events that never come, and the root goes deaf.
    ``_inotify_fd`` is watchdog's private attribute (7.x), hence the guarded look-up:
    without it only the observer and emitters are judged, as before.
    """
    if observer is None or not observer.is_alive():
        return False
    reader = getattr(observer, "_inotify_fd", None)
    if isinstance(reader, threading.Thread) and not reader.is_alive():
        return False
    emitters = list(observer.emitters)
    return bool(emitters) and all(e.is_alive() for e in emitters)


def _collect(r: _Root, top: Path) -> list[tuple[Path, _Sig, float]]:
    """Worker-safe scan below ``top``: candidate files with their stat. Never follows links."""
    out: list[tuple[Path, _Sig, float]] = []
    stack = [top]
    while stack:
        directory = stack.pop()
        try:
            with os.scandir(directory) as it:
                entries = list(it)
        except OSError as exc:
            log.warning("watch_scan_error", watch=r.index, dir=names.display(directory),
                        error=names.text(str(exc)))
            continue
        for entry in entries:
            if ignored(entry.name, r.cfg.ignore):
                continue
            try:
                if entry.is_dir(follow_symlinks=False):
                    sub = Path(entry.path)
                    if r.cfg.recursive and not any(_within(sub, x) for x in r.excluded):
                        stack.append(sub)
                elif entry.is_file(follow_symlinks=False):
                    if directory != r.root and not r.cfg.recursive:
                        continue
                    st = entry.stat(follow_symlinks=False)
                    out.append((Path(entry.path), _sig(st), st.st_mtime))
            except OSError:
                continue  # vanished between listing and stat
    return out


def _sig(st: os.stat_result) -> _Sig:
    return _Sig(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


def _ident(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


def _within(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def _relative(r: _Root, path: Path) -> Path | None:
    """``path`` relative to the root, accepting the configured or the resolved spelling."""
    for base in (r.root, r.cfg.input):
        try:
            return path.relative_to(base)
        except ValueError:
            continue
    return None
