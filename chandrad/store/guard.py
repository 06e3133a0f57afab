"""One daemon per store, and no start on a damaged one: the lock and the start-up check.

The lock: an exclusive ``flock`` on the database file itself, taken before anything else
(released by the kernel when the process dies, even by ``kill -9``), so deleting
``chandrad.lock`` (a cleanup script, a restore) cannot let a second daemon in;
``chandrad.lock`` keeps the holder's pid for the refusal's message (and is locked too, for
tools that look there). The holder's pid is read from ``/proc/locks`` when the lock file
is gone.

The check: a damaged store is refused at open (:class:`~chandrad.errors.StoreDamaged`,
exit 78): ``PRAGMA quick_check`` (bounded by ``CHECK_BUDGET_S``), SQLite's
"malformed"/"not a database" errors, and a missing or empty database where
``chandrad.store-used`` says one held jobs (the marker is written beside it once the store
has a job). Every refusal says what to do (:func:`recovery`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import sqlite3
import time
from pathlib import Path

from chandrad.errors import StateDirInUse, StoreDamaged

DB_NAME = "chandrad.sqlite3"
LOCK_NAME = "chandrad.lock"
#: Written beside the database once it holds a job: a missing or empty database then is
#: damage (a restore gone wrong, a truncation), not a first start.
USED_MARKER = "chandrad.store-used"
#: Seconds ``PRAGMA quick_check`` may take at open; a larger store is checked that long,
#: then opened anyway (``Store.check_complete`` says so; ``chandrad store check`` has no limit).
CHECK_BUDGET_S = 20.0
#: SQLite's primary result codes that mean the file is not a sound database.
_DAMAGE_CODES = frozenset({11, 26})  # SQLITE_CORRUPT, SQLITE_NOTADB


class StateDirLock:
    """The state dir's two flocks (the database's and ``chandrad.lock``), held by open fds."""

    def __init__(self, fds: tuple[int, ...]) -> None:
        self._fds = fds

    @classmethod
    def take(cls, state_dir: Path) -> StateDirLock:
        """Lock the store in ``state_dir`` (created if needed) for this process, and refuse
        a missing or empty database that ``USED_MARKER`` says held jobs.

        Raises:
            StateDirInUse: another process holds the lock; nothing was changed.
            StoreDamaged: the database is gone or empty, but held jobs.
            OSError: ``state_dir`` cannot be created or written.
        """
        state_dir.mkdir(parents=True, exist_ok=True)
        path = state_dir / DB_NAME
        gone = not path.exists()
        existed = not gone and path.stat().st_size > 0
        fds = [lock_database(path)]
        try:
            fds.append(_lock_state_dir(state_dir / LOCK_NAME))
            if not existed and (state_dir / USED_MARKER).exists():
                raise StoreDamaged(
                    f"the store {path} is {'gone' if gone else 'empty'}, "
                    f"but {state_dir / USED_MARKER} says it held jobs (a truncation, or a "
                    "restore that left it out); " + recovery(path), path=str(path))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return cls(tuple(fds))

    def release(self) -> None:
        """Give the state dir up (idempotent)."""
        for fd in self._fds:
            os.close(fd)
        self._fds = ()


def lock_database(db_path: Path) -> int:
    """Take the exclusive flock of the database file itself (created empty if missing,
    which SQLite takes as a new database); the open fd holds it.

    The lock lives on the database's inode, so no file deleted beside it releases it;
    the path is checked to still name the locked inode (a database swapped in between).
    SQLite's own locks are POSIX record locks, which Linux keeps apart from flocks.
    """
    fd = os.open(db_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)  # as SQLite would
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = _flock_holder(fd) if exc.errno in (errno.EAGAIN, errno.EACCES) else None
        os.close(fd)
        if exc.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        raise _in_use(db_path.parent, holder or _pid_in(db_path.parent / LOCK_NAME)) from exc
    st, now = os.fstat(fd), os.stat(db_path)
    if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):
        os.close(fd)
        raise _in_use(db_path.parent, _pid_in(db_path.parent / LOCK_NAME))
    return fd


def _lock_state_dir(lock_path: Path) -> int:
    """Take ``lock_path``'s exclusive flock and write our pid in it; the open fd holds it."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        os.close(fd)
        if exc.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        raise _in_use(lock_path.parent, int(holder) if holder.isdigit() else None) from exc
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
    return fd


def _flock_holder(fd: int) -> int | None:
    """The pid that holds an flock on ``fd``'s file, from ``/proc/locks`` (None: unknown)."""
    st = os.fstat(fd)
    try:
        lines = Path("/proc/locks").read_text("ascii", "replace").splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK" or fields[3] != "WRITE":
            continue  # "->" lines are waiters, not holders
        dev_ino = fields[5].split(":")
        if len(dev_ino) == 3 and dev_ino[2] == str(st.st_ino) and fields[4].isdigit():
            return int(fields[4]) or None
    return None


def _pid_in(lock_path: Path) -> int | None:
    try:
        text = lock_path.read_text("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _in_use(state_dir: Path, pid: int | None) -> StateDirInUse:
    who = "chandrad" if pid is None else f"chandrad (pid {pid})"
    return StateDirInUse(
        f"another {who} is using {state_dir}; stop it first, or give this "
        "daemon its own daemon.state_dir", path=str(state_dir), pid=pid)


def quick_check(conn: sqlite3.Connection, path: Path) -> tuple[float, bool]:
    """``PRAGMA quick_check`` within ``CHECK_BUDGET_S``: the seconds it took, and whether it
    covered the whole store; damage raises StoreDamaged."""
    t0 = time.monotonic()
    deadline = t0 + CHECK_BUDGET_S
    complete = True
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 100_000)
    try:
        rows = [r[0] for r in conn.execute("PRAGMA quick_check(5)")]
    except sqlite3.OperationalError as exc:
        if "interrupt" not in str(exc):
            raise
        rows, complete = ["ok"], False
    finally:
        conn.set_progress_handler(None, 0)
        seconds = time.monotonic() - t0
    if rows != ["ok"]:
        raise StoreDamaged(f"the store {path} is damaged (PRAGMA quick_check: "
                           f"{' '.join(' '.join(str(r).split()) for r in rows)}); "
                           + recovery(path),
                           path=str(path), problems=rows)
    return seconds, complete


class UsedMarker:
    """``USED_MARKER`` beside the database: written once the store holds a job."""

    def __init__(self, db_path: Path) -> None:
        self.path = db_path.parent / USED_MARKER
        self._marked = self.path.exists()

    def mark(self, has_jobs: bool = True) -> None:
        """Write the marker once the store holds a job (best effort: a full disk leaves it
        for the next accept)."""
        if self._marked or not has_jobs:
            return
        try:
            self.path.write_text(f"{DB_NAME} beside this file held jobs. chandrad refuses to "
                                 "start on a missing or empty one while this file exists; "
                                 "delete it to start with an empty store on purpose.\n",
                                 encoding="ascii")
        except OSError:
            return
        self._marked = True


def damaged(exc: sqlite3.DatabaseError) -> bool:
    """Whether SQLite's error says the file is not a sound database."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in _DAMAGE_CODES
    text = str(exc)
    return "malformed" in text or "not a database" in text


def recovery(path: Path) -> str:
    """What to do about a damaged store (one message, for the log and the console)."""
    state_dir = path.parent
    return (f"chandrad does not start on it. Keep a copy first (cp -a {state_dir} "
            f"{state_dir}.damaged); then either `chandrad store repair` (rebuilds {path.name} "
            "from what SQLite can still read; the damaged file is kept beside it), or start "
            f"fresh: move {path.name}, {path.name}-wal, {path.name}-shm and {USED_MARKER} "
            "out of the state dir. A fresh store keeps done/, failed/ and output/ as they "
            "are and accepts the files still in the inbox again; only the job history "
            "(chandractl queue) starts empty. `chandrad store check` reports the damage.")
