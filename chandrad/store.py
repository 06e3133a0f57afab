"""The durable queue: jobs, pages and learned profiles in SQLite (SPEC §5).

Owns ``<state_dir>/chandrad.sqlite3``, the source of truth for what was accepted,
what is done and what failed. Every public method is one short transaction, so a
``kill -9`` at any instant leaves either the old or the new state, never a mix.
One daemon per store: :meth:`Store.open` takes an exclusive ``flock`` on the database
file itself (released by the kernel when the process dies, even by ``kill -9``) before
anything else, so deleting ``chandrad.lock`` (a cleanup script, a restore) cannot let a
second daemon in; ``chandrad.lock`` keeps the holder's pid for the refusal's message (and
is locked too, for tools that look there). The holder's pid is read from ``/proc/locks``
when the lock file is gone.

A damaged store is refused at open (:class:`~chandrad.errors.StoreDamaged`, exit 78):
``PRAGMA quick_check`` (bounded by ``CHECK_BUDGET_S``), SQLite's "malformed"/"not a
database" errors, and a missing or empty database where ``chandrad.store-used`` says one
held jobs (the marker is written beside it once the store has a job). A write the
filesystem refuses (disk full, quota) raises :class:`~chandrad.errors.StoreFull`: the
transaction is rolled back and the caller waits for space.
Recovery happens in :meth:`Store.open`: pages left ``in_flight`` go back to
``pending`` (their result never reached the store, so they must be recomputed);
``running`` jobs stay ``running`` and are resumed at page granularity.

Threading: one :class:`Store` holds one connection and must be used from one
thread, the daemon's event-loop thread (sqlite3 enforces it). Calls are short
(sub-millisecond plus one fsync), so they run inline on the loop.

Paths (``input_root``, ``path``, ``abs_path``, ``output_dir``, ``final_path``) are
stored as their exact bytes (BLOB), so a name that is not valid UTF-8 is kept
losslessly; ``Job.to_dict`` gives their display form (``chandrad.names``). Free text
(error messages) is stored with undecodable bytes escaped.

Must not import any other chandrad adapter or service (only the leaves ``errors``,
``names``, ``states``).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import sqlite3
import time
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chandrad import names
from chandrad.errors import (
    CANCELLED_CODE,
    CANCELLED_MESSAGE,
    InternalError,
    StateDirInUse,
    StoreDamaged,
    StoreFull,
)
from chandrad.states import (
    JOB_FINISHED,
    JOB_OPEN,
    JOB_TRANSITIONS,
    PAGE_TRANSITIONS,
    JobState,
    PageState,
    is_legal,
)

DB_NAME = "chandrad.sqlite3"
LOCK_NAME = "chandrad.lock"
#: Written beside the database once it holds a job: a missing or empty database then is
#: damage (a restore gone wrong, a truncation), not a first start.
USED_MARKER = "chandrad.store-used"
#: Seconds ``PRAGMA quick_check`` may take at open; a larger store is checked that long,
#: then opened anyway (``Store.check`` says so; ``chandrad store check`` has no limit).
CHECK_BUDGET_S = 20.0
#: SQLite's primary result codes that mean the file is not a sound database.
_DAMAGE_CODES = frozenset({11, 26})  # SQLITE_CORRUPT, SQLITE_NOTADB
_FULL_CODES = frozenset({13})  # SQLITE_FULL
DUPLICATE_POLICIES = ("process", "skip")

#: Schema migrations by version; version N is reached by running MIGRATIONS[N - 1].
#: Append only: never edit a released step, add a new one.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE jobs (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        watch_index INTEGER NOT NULL,
        input_root TEXT NOT NULL,
        path TEXT NOT NULL,
        abs_path TEXT NOT NULL,
        size INTEGER NOT NULL,
        mtime REAL NOT NULL,
        sha256 TEXT NOT NULL,
        state TEXT NOT NULL,
        pages_total INTEGER,
        attempts INTEGER NOT NULL DEFAULT 0,
        error_code TEXT,
        error_message TEXT,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        started_at REAL,
        finished_at REAL,
        output_dir TEXT,
        final_path TEXT
    );
    CREATE INDEX jobs_by_state ON jobs (state, id);
    CREATE INDEX jobs_by_path ON jobs (abs_path, state);
    CREATE INDEX jobs_by_hash ON jobs (sha256, state);
    CREATE TABLE pages (
        job_id INTEGER NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
        page_index INTEGER NOT NULL,
        state TEXT NOT NULL,
        attempts INTEGER NOT NULL DEFAULT 0,
        releases INTEGER NOT NULL DEFAULT 0,
        width INTEGER,
        height INTEGER,
        result_json TEXT,
        error TEXT,
        seconds REAL,
        started_at REAL,
        finished_at REAL,
        PRIMARY KEY (job_id, page_index)
    ) WITHOUT ROWID;
    CREATE INDEX pages_by_state ON pages (state);
    CREATE INDEX pages_done_at ON pages (finished_at) WHERE state = 'done';
    CREATE TABLE learned_profiles (
        key TEXT PRIMARY KEY,
        profile_json TEXT NOT NULL,
        saved_at REAL NOT NULL
    );
    """,
    # 2: jobs find their watch by input folder; list the folders with work quickly.
    """
    CREATE INDEX jobs_by_root ON jobs (input_root, state);
    """,
    # 3: paths as exact bytes (BLOB), so names that are not valid UTF-8 fit (issue 8).
    """
    UPDATE jobs SET input_root = CAST(input_root AS BLOB), path = CAST(path AS BLOB),
        abs_path = CAST(abs_path AS BLOB), output_dir = CAST(output_dir AS BLOB),
        final_path = CAST(final_path AS BLOB)
    """,
    # 4: jobs and pages per state kept by triggers, so counts() (the status line, every
    # main-loop tick) and page_counts() (every metrics scrape) read a handful of rows
    # instead of an index scan over every job and page ever accepted (issue 8 backlog).
    """
    CREATE TABLE job_counts (state TEXT PRIMARY KEY, n INTEGER NOT NULL) WITHOUT ROWID;
    INSERT INTO job_counts (state, n) SELECT state, COUNT(*) FROM jobs GROUP BY state;
    CREATE TRIGGER job_counts_insert AFTER INSERT ON jobs BEGIN
        INSERT INTO job_counts (state, n) VALUES (NEW.state, 1)
            ON CONFLICT (state) DO UPDATE SET n = n + 1;
    END;
    CREATE TRIGGER job_counts_delete AFTER DELETE ON jobs BEGIN
        UPDATE job_counts SET n = n - 1 WHERE state = OLD.state;
    END;
    CREATE TRIGGER job_counts_update AFTER UPDATE OF state ON jobs
    WHEN OLD.state IS NOT NEW.state BEGIN
        UPDATE job_counts SET n = n - 1 WHERE state = OLD.state;
        INSERT INTO job_counts (state, n) VALUES (NEW.state, 1)
            ON CONFLICT (state) DO UPDATE SET n = n + 1;
    END;
    CREATE TABLE page_counts (state TEXT PRIMARY KEY, n INTEGER NOT NULL) WITHOUT ROWID;
    INSERT INTO page_counts (state, n) SELECT state, COUNT(*) FROM pages GROUP BY state;
    CREATE TRIGGER page_counts_insert AFTER INSERT ON pages BEGIN
        INSERT INTO page_counts (state, n) VALUES (NEW.state, 1)
            ON CONFLICT (state) DO UPDATE SET n = n + 1;
    END;
    CREATE TRIGGER page_counts_delete AFTER DELETE ON pages BEGIN
        UPDATE page_counts SET n = n - 1 WHERE state = OLD.state;
    END;
    CREATE TRIGGER page_counts_update AFTER UPDATE OF state ON pages
    WHEN OLD.state IS NOT NEW.state BEGIN
        UPDATE page_counts SET n = n - 1 WHERE state = OLD.state;
        INSERT INTO page_counts (state, n) VALUES (NEW.state, 1)
            ON CONFLICT (state) DO UPDATE SET n = n + 1;
    END;
    """,
    # 5: pages by state and finish time in one index, so pages_done_since() (the pages/min
    # of every status call and metrics scrape) is answered from the index alone. With the
    # partial index on finished_at SQLite still read each done page's row to check its
    # state, and a row holds the page's result (its crops too) in overflow pages: 26 ms
    # of daemon CPU per status call after 182 pages, growing with history (issue 11).
    """
    DROP INDEX IF EXISTS pages_by_state;
    DROP INDEX IF EXISTS pages_done_at;
    CREATE INDEX pages_by_state ON pages (state, finished_at);
    """,
)

_JOB_COLUMNS = """
    j.id, j.watch_index, j.input_root, j.path, j.abs_path, j.size, j.mtime, j.sha256,
    j.state, j.pages_total, j.attempts, j.error_code, j.error_message, j.created_at,
    j.updated_at, j.started_at, j.finished_at, j.output_dir, j.final_path,
    (SELECT COUNT(*) FROM pages p WHERE p.job_id = j.id AND p.state = 'done'),
    (SELECT COUNT(*) FROM pages p WHERE p.job_id = j.id AND p.state = 'failed')
"""

_PAGE_COLUMNS = """
    job_id, page_index, state, attempts, releases, width, height, result_json, error,
    seconds, started_at, finished_at
"""


@dataclass(frozen=True)
class Job:
    """One accepted input file, as stored."""

    id: int
    watch_index: int  # position of the watch when accepted; informational only
    input_root: Path  # the watch's input folder (resolved): how the job finds its watch
    path: Path  # relative to input_root
    abs_path: Path
    size: int
    mtime: float
    sha256: str
    state: JobState
    pages_total: int | None
    attempts: int  # times the job entered RUNNING
    error_code: str | None
    error_message: str | None
    created_at: float  # wall clock (time.time())
    updated_at: float
    started_at: float | None
    finished_at: float | None
    output_dir: Path | None
    final_path: Path | None
    pages_done: int = 0
    pages_failed: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form for ``chandractl queue``."""
        return {
            "id": self.id,
            "watch_index": self.watch_index,
            "input_root": names.display(self.input_root),
            "path": names.display(self.path),
            "abs_path": names.display(self.abs_path),
            "size": self.size,
            "mtime": self.mtime,
            "sha256": self.sha256,
            "state": self.state.value,
            "pages_total": self.pages_total,
            "pages_done": self.pages_done,
            "pages_failed": self.pages_failed,
            "attempts": self.attempts,
            "error_code": self.error_code,
            "error_message": self.error_message,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "output_dir": names.display(self.output_dir) if self.output_dir else None,
            "final_path": names.display(self.final_path) if self.final_path else None,
        }


@dataclass(frozen=True)
class Page:
    """One page of one job, as stored.

    ``attempts`` counts inference attempts charged to the page (claims that ended in
    ``finish_page``/``fail_page``, or are still in flight). ``releases`` counts claims
    given back without an answer (engine died, daemon restarted); they are not charged,
    but a page with many releases is a suspect for killing the engine.
    """

    job_id: int
    index: int
    state: PageState
    attempts: int
    releases: int
    width: int | None
    height: int | None
    result: dict[str, Any] | None
    error: str | None
    seconds: float | None
    started_at: float | None
    finished_at: float | None


@dataclass(frozen=True)
class Recovered:
    """What :meth:`Store.open` repaired after an unclean stop."""

    pages_released: int = 0
    jobs_running: int = 0


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


def _lock_database(db_path: Path) -> int:
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


class Store:
    """The SQLite store. Build with :meth:`open`; use from one thread."""

    def __init__(self, conn: sqlite3.Connection, path: Path,
                 lock_fds: tuple[int, ...] = ()) -> None:
        self._conn = conn
        self._lock_fds = lock_fds
        self.path = path
        self.recovered = Recovered()
        #: ``PRAGMA quick_check`` at open: seconds it took, and whether it covered the
        #: whole store within ``CHECK_BUDGET_S``.
        self.check_s = 0.0
        self.check_complete = True
        self._marked = (path.parent / USED_MARKER).exists()

    # -- lifecycle -------------------------------------------------------------------

    @classmethod
    def open(cls, state_dir: Path) -> Store:
        """Open (creating if needed) the store in ``state_dir`` and recover from a crash.

        Raises:
            StateDirInUse: another process holds the store's lock; nothing was changed.
            StoreDamaged: the database is damaged, or empty where it held jobs.
            StoreFull: the filesystem refused the writes of opening (migration, recovery).
            OSError: ``state_dir`` cannot be created or written.
        """
        state_dir.mkdir(parents=True, exist_ok=True)
        path = state_dir / DB_NAME
        gone = not path.exists()
        existed = not gone and path.stat().st_size > 0
        fds = [_lock_database(path)]
        try:
            fds.append(_lock_state_dir(state_dir / LOCK_NAME))
            if not existed and (state_dir / USED_MARKER).exists():
                raise StoreDamaged(
                    f"the store {path} is {'gone' if gone else 'empty'}, "
                    f"but {state_dir / USED_MARKER} says it held jobs (a truncation, or a "
                    "restore that left it out); " + _recovery(path), path=str(path))
            return cls._open_locked(path, tuple(fds))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    @classmethod
    def _open_locked(cls, path: Path, lock_fds: tuple[int, ...]) -> Store:
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, one per method.
        conn = sqlite3.connect(path, isolation_level=None, timeout=10.0)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            # FULL, not NORMAL: in WAL mode NORMAL survives kill -9 but a power cut may
            # roll back the last commits. Ours record facts with side effects outside the
            # database (an input moved to done/, outputs written), so a lost commit would
            # disagree with the filesystem after a reboot. The cost is one fsync per state
            # change, which is small next to a page of OCR; bulk intake uses accept_many.
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA foreign_keys=ON")
            store = cls(conn, path, lock_fds)
            store._quick_check()
            store._migrate()
            store.recovered = store._recover()
            store._mark_used(conn.execute("SELECT 1 FROM jobs LIMIT 1").fetchone() is not None)
            return store
        except sqlite3.DatabaseError as exc:
            conn.close()
            if _damaged(exc):
                raise StoreDamaged(f"the store {path} is damaged ({exc}); " + _recovery(path),
                                   path=str(path)) from None
            raise
        except BaseException:
            conn.close()
            raise

    def _quick_check(self) -> None:
        """``PRAGMA quick_check`` within ``CHECK_BUDGET_S``; damage raises StoreDamaged."""
        t0 = time.monotonic()
        deadline = t0 + CHECK_BUDGET_S
        self._conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 100_000)
        try:
            rows = [r[0] for r in self._conn.execute("PRAGMA quick_check(5)")]
        except sqlite3.OperationalError as exc:
            if "interrupt" not in str(exc):
                raise
            rows, self.check_complete = ["ok"], False
        finally:
            self._conn.set_progress_handler(None, 0)
            self.check_s = time.monotonic() - t0
        if rows != ["ok"]:
            raise StoreDamaged(f"the store {self.path} is damaged (PRAGMA quick_check: "
                               f"{' '.join(' '.join(str(r).split()) for r in rows)}); "
                               + _recovery(self.path),
                               path=str(self.path), problems=rows)

    def _mark_used(self, has_jobs: bool = True) -> None:
        """Write ``USED_MARKER`` once the store holds a job (best effort: a full disk
        leaves it for the next accept)."""
        if self._marked or not has_jobs:
            return
        marker = self.path.parent / USED_MARKER
        try:
            marker.write_text(f"{DB_NAME} beside this file held jobs. chandrad refuses to start "
                              "on a missing or empty one while this file exists; delete it to "
                              "start with an empty store on purpose.\n", encoding="ascii")
        except OSError:
            return
        self._marked = True

    def close(self) -> None:
        """Close the connection (checkpoints the WAL), then release the state dir."""
        self._conn.close()
        for fd in self._lock_fds:
            os.close(fd)
        self._lock_fds = ()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; IMMEDIATE so the read-check-write inside is atomic.

        A write the filesystem refuses (SQLITE_FULL) rolls back and raises StoreFull.
        """
        try:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
                self._conn.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorcode", 0) & 0xFF in _FULL_CODES:
                raise StoreFull(f"the store's filesystem is full: {self.path} cannot grow "
                                f"({exc}); free space there and chandrad goes on by itself",
                                path=str(self.path)) from None
            raise

    def _migrate(self) -> None:
        with self._tx() as c:
            c.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = c.execute("SELECT version FROM schema_version").fetchone()
            if row is None:
                c.execute("INSERT INTO schema_version (version) VALUES (0)")
        version = self.schema_version()
        if version > len(MIGRATIONS):
            raise InternalError(
                f"{self.path} has schema version {version}, newer than this chandrad "
                f"understands ({len(MIGRATIONS)}); refusing to downgrade it",
                path=str(self.path),
            )
        for target in range(version + 1, len(MIGRATIONS) + 1):
            with self._tx() as c:
                for statement in _statements(MIGRATIONS[target - 1]):
                    c.execute(statement)
                c.execute("UPDATE schema_version SET version = ?", (target,))

    def schema_version(self) -> int:
        """The schema version stored in the database."""
        row = self._conn.execute("SELECT version FROM schema_version").fetchone()
        return int(row[0])

    def _recover(self) -> Recovered:
        with self._tx() as c:
            released = c.execute(
                "UPDATE pages SET state = 'pending', attempts = MAX(attempts - 1, 0), "
                "releases = releases + 1, started_at = NULL WHERE state = 'in_flight'"
            ).rowcount
            running = c.execute("SELECT COUNT(*) FROM jobs WHERE state = 'running'").fetchone()
        return Recovered(pages_released=released, jobs_running=int(running[0]))

    # -- jobs ------------------------------------------------------------------------

    def accept(
        self,
        watch_index: int,
        input_root: Path,
        path: Path,
        size: int,
        mtime: float,
        sha256: str,
        duplicates: str = "process",
    ) -> Job | None:
        """Record a settled file as a new pending job; ``None`` when it is not new work.

        ``path`` may be absolute (under ``input_root``) or relative to it. Not new work:
        the same file (same absolute path and content hash) is already pending or
        running; or ``duplicates == "skip"`` and a job with the same content hash is
        pending, running or finished ``done`` (content duplicates, whatever their name,
        including copies in the same batch). A pending
        job for the same path whose content changed is updated in place (its pages, if
        a retry left any, are discarded) instead of queueing the path twice.
        """
        with self._tx():
            job_id = self._accept_one(watch_index, input_root, path, size, mtime, sha256,
                                      duplicates)
        self._mark_used(job_id is not None)
        return None if job_id is None else self.get(job_id)

    def accept_many(
        self,
        items: Iterable[tuple[int, Path, Path, int, float, str]],
        duplicates: str = "process",
    ) -> list[Job]:
        """:meth:`accept` for a backlog in one transaction (one fsync for all).

        Each item is ``(watch_index, input_root, path, size, mtime, sha256)``.
        """
        ids: list[int] = []
        with self._tx():
            for item in items:
                job_id = self._accept_one(*item, duplicates)
                if job_id is not None:
                    ids.append(job_id)
        self._mark_used(bool(ids))
        return [job for job in (self.get(i) for i in ids) if job is not None]

    def _accept_one(
        self,
        watch_index: int,
        input_root: Path,
        path: Path,
        size: int,
        mtime: float,
        sha256: str,
        duplicates: str,
    ) -> int | None:
        if duplicates not in DUPLICATE_POLICIES:
            raise InternalError(f"duplicates={duplicates!r}: expected one of "
                                f"{DUPLICATE_POLICIES}")
        abs_path = path if path.is_absolute() else input_root / path
        rel = abs_path.relative_to(input_root)
        c = self._conn
        now = time.time()
        active = c.execute(
            "SELECT id, state, sha256 FROM jobs WHERE abs_path = ? AND state IN "
            "('pending', 'running', 'held') ORDER BY id",
            (names.fsbytes(abs_path),),
        ).fetchall()
        for job_id, state, known_hash in active:
            if known_hash == sha256:
                return None
            if state == JobState.PENDING:
                # New content for a job not started (or retried): pages computed from
                # the old content must not be mixed into it.
                c.execute(
                    "UPDATE jobs SET size = ?, mtime = ?, sha256 = ?, pages_total = NULL, "
                    "updated_at = ? WHERE id = ?",
                    (size, mtime, sha256, now, job_id),
                )
                c.execute("DELETE FROM pages WHERE job_id = ?", (job_id,))
                return None
        if duplicates == "skip":
            # Pending and running count too: copies dropped together (one batch, one
            # transaction) or while the first is queued are the same work.
            seen = c.execute(
                "SELECT 1 FROM jobs WHERE sha256 = ? AND state IN ('pending', 'running', "
                "'held', 'done') LIMIT 1", (sha256,)
            ).fetchone()
            if seen is not None:
                return None
        cur = c.execute(
            "INSERT INTO jobs (watch_index, input_root, path, abs_path, size, mtime, sha256, "
            "state, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, 'pending', ?, ?)",
            (watch_index, names.fsbytes(input_root), names.fsbytes(rel),
             names.fsbytes(abs_path), size, mtime, sha256, now, now),
        )
        return cur.lastrowid

    def supersede(self, job_id: int, size: int, mtime: float, sha256: str,
                  duplicates: str = "process") -> Job | None:
        """The input of an active job was replaced by other content: end the job as
        ``cancelled`` with ``input_replaced`` (its pages came from content that no longer
        exists; the input is left where it is) and accept the new content as a new job,
        in one transaction. Returns the new job (``None`` when the new content is not
        new work, e.g. already queued or skipped as a duplicate)."""
        with self._tx() as c:
            row = c.execute(
                "SELECT watch_index, input_root, abs_path, state FROM jobs WHERE id = ?",
                (job_id,)).fetchone()
            if row is None:
                raise InternalError(f"job {job_id} does not exist", job=job_id)
            watch_index, input_root, abs_path, state = row
            if JobState(state) in JOB_OPEN:
                now = time.time()
                c.execute(
                    "UPDATE jobs SET state = 'cancelled', error_code = 'input_replaced', "
                    "error_message = ?, finished_at = ?, updated_at = ? WHERE id = ?",
                    (f"the input was replaced by other content (sha256 {sha256[:12]}…) "
                     "before the job finished; the new content is queued as a new job",
                     now, now, job_id))
                c.execute("UPDATE pages SET state = 'pending', started_at = NULL "
                          "WHERE job_id = ? AND state = 'in_flight'", (job_id,))
            new_id = self._accept_one(watch_index, Path(names.from_bytes(input_root)),
                                      Path(names.from_bytes(abs_path)), size, mtime, sha256,
                                      duplicates)
        return None if new_id is None else self.get(new_id)

    def next_jobs(self, roots: Collection[Path], exclude: Collection[int],
                  limit: int) -> list[Job]:
        """Jobs to start, at most ``limit``: resumed ``running`` ones first, then ``held``
        ones (the caller excludes those not due), then ``pending``, each oldest first; only
        those whose ``input_root`` is in ``roots`` (a configured watch) and whose id is
        not in ``exclude``."""
        if limit <= 0 or not roots:
            return []
        root_marks = ", ".join("?" * len(roots))
        id_marks = ", ".join("?" * len(exclude))
        out: list[Job] = []
        for state in (JobState.RUNNING, JobState.HELD, JobState.PENDING):
            rows = self._conn.execute(
                f"SELECT {_JOB_COLUMNS} FROM jobs j WHERE j.state = ? "
                f"AND j.input_root IN ({root_marks}) AND j.id NOT IN ({id_marks}) "
                "ORDER BY j.id LIMIT ?",
                (state.value, *(names.fsbytes(r) for r in roots), *exclude, limit - len(out)),
            ).fetchall()
            out += [_job(r) for r in rows]
            if len(out) >= limit:
                break
        return out

    def active_outside(self, roots: Collection[Path], limit: int = 20) -> tuple[int, list[Job]]:
        """Pending, running and held jobs whose ``input_root`` is not in ``roots`` (their
        watch is no longer configured): how many, and the oldest ``limit`` of them."""
        known = {names.fsbytes(r) for r in roots}
        gone = [r for r in self._roots_with_active_jobs() if r not in known]
        if not gone:
            return 0, []
        where = (f"j.input_root IN ({', '.join('?' * len(gone))}) "
                 "AND j.state IN ('pending', 'running', 'held')")
        count = self._conn.execute(f"SELECT COUNT(*) FROM jobs j WHERE {where}",
                                   gone).fetchone()[0]
        rows = self._conn.execute(
            f"SELECT {_JOB_COLUMNS} FROM jobs j WHERE {where} ORDER BY j.id LIMIT ?",
            (*gone, limit)).fetchall()
        return int(count), [_job(r) for r in rows]

    def _roots_with_active_jobs(self) -> list[bytes]:
        """Distinct ``input_root`` (bytes) of pending/running/held jobs: one index probe
        per input folder ever used (a handful), not a scan of the backlog."""
        out: list[bytes] = []
        root = b""
        while True:
            row = self._conn.execute(
                "SELECT input_root FROM jobs INDEXED BY jobs_by_root WHERE input_root > ? "
                "ORDER BY input_root LIMIT 1", (root,)).fetchone()
            if row is None:
                return out
            root = row[0]
            if self._conn.execute(
                    "SELECT 1 FROM jobs INDEXED BY jobs_by_root WHERE input_root = ? "
                    "AND state IN ('pending', 'running', 'held') LIMIT 1",
                    (root,)).fetchone():
                out.append(root)

    def get(self, job_id: int) -> Job | None:
        """The job with this id, or ``None``."""
        row = self._conn.execute(
            f"SELECT {_JOB_COLUMNS} FROM jobs j WHERE j.id = ?", (job_id,)
        ).fetchone()
        return None if row is None else _job(row)

    def find_active(self, abs_path: Path) -> Job | None:
        """The pending, running or held job for this input path, if any."""
        row = self._conn.execute(
            f"SELECT {_JOB_COLUMNS} FROM jobs j WHERE j.abs_path = ? "
            "AND j.state IN ('pending', 'running', 'held') ORDER BY j.id LIMIT 1",
            (names.fsbytes(abs_path),),
        ).fetchone()
        return None if row is None else _job(row)

    def next_pending(self, limit: int = 1) -> list[Job]:
        """The oldest pending jobs, oldest first."""
        rows = self._conn.execute(
            f"SELECT {_JOB_COLUMNS} FROM jobs j WHERE j.state = 'pending' "
            "ORDER BY j.id LIMIT ?",
            (limit,),
        ).fetchall()
        return [_job(r) for r in rows]

    def list_jobs(self, state: str | None = None, limit: int = 1000) -> list[Job]:
        """Jobs, oldest first, optionally only those in ``state``.

        Raises ValueError when ``state`` is not a ``JobState`` value.
        """
        if state is None:
            rows = self._conn.execute(
                f"SELECT {_JOB_COLUMNS} FROM jobs j ORDER BY j.id LIMIT ?", (limit,)
            ).fetchall()
        else:
            rows = self._conn.execute(
                f"SELECT {_JOB_COLUMNS} FROM jobs j WHERE j.state = ? ORDER BY j.id LIMIT ?",
                (JobState(state).value, limit),
            ).fetchall()
        return [_job(r) for r in rows]

    def set_job_state(
        self,
        job_id: int,
        state: JobState,
        *,
        error_code: str | None = None,
        error_message: str | None = None,
        pages_total: int | None = None,
        output_dir: Path | None = None,
        final_path: Path | None = None,
    ) -> None:
        """Move a job along a legal edge of ``JOB_TRANSITIONS``; others raise InternalError.

        Entering ``running`` counts an attempt, stamps ``started_at`` and clears the
        error (left by a hold); entering a finished state stamps ``finished_at``; going
        back to ``pending`` clears the error.
        ``state`` equal to the current state is no transition: only the keyword fields
        are updated. Keyword values that are ``None`` leave the stored value as it is.
        """
        now = time.time()
        with self._tx() as c:
            old = self._job_state(job_id)
            if old is not state and not is_legal(JOB_TRANSITIONS, old, state):
                raise InternalError(f"job {job_id}: illegal transition {old} -> {state}",
                                    job=job_id, old=old.value, new=state.value)
            sets = ["state = ?", "updated_at = ?"]
            args: list[Any] = [state.value, now]
            if old is state:
                pass
            elif state is JobState.RUNNING:
                sets += ["attempts = attempts + 1", "started_at = ?", "finished_at = NULL",
                         "error_code = NULL", "error_message = NULL"]
                args.append(now)
            elif state in JOB_FINISHED:
                sets.append("finished_at = ?")
                args.append(now)
            elif state is JobState.PENDING:
                sets += ["error_code = NULL", "error_message = NULL", "finished_at = NULL"]
            for column, value in (("error_code", error_code), ("error_message", error_message),
                                  ("pages_total", pages_total), ("output_dir", output_dir),
                                  ("final_path", final_path)):
                if value is not None:
                    sets.append(f"{column} = ?")
                    args.append(_param(value))
            c.execute(f"UPDATE jobs SET {', '.join(sets)} WHERE id = ?", (*args, job_id))

    def _job_state(self, job_id: int) -> JobState:
        row = self._conn.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise InternalError(f"job {job_id} does not exist", job=job_id)
        return JobState(row[0])

    def retry(self, job_id: int) -> bool:
        """Requeue a failed, partial or cancelled job; its failed pages go back to pending.

        Pages already done are kept (not recomputed): a partial job's retry sends only
        the pages that failed. Returns False when the job does
        not exist or is not in a state that can be retried.
        """
        with self._tx():
            return self._retry_one(job_id)

    def retry_all_failed(self) -> int:
        """Requeue every failed job; returns how many."""
        with self._tx() as c:
            ids = [r[0] for r in c.execute("SELECT id FROM jobs WHERE state = 'failed'")]
            return sum(self._retry_one(i) for i in ids)

    def _retry_one(self, job_id: int) -> bool:
        c = self._conn
        row = c.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None or not is_legal(JOB_TRANSITIONS, JobState(row[0]), JobState.PENDING):
            return False
        c.execute(
            "UPDATE jobs SET state = 'pending', error_code = NULL, error_message = NULL, "
            "finished_at = NULL, updated_at = ? WHERE id = ?",
            (time.time(), job_id),
        )
        # A retry is the operator's call: failed pages get a fresh attempt budget.
        c.execute(
            "UPDATE pages SET state = 'pending', attempts = 0, error = NULL, "
            "finished_at = NULL WHERE job_id = ? AND state = 'failed'",
            (job_id,),
        )
        return True

    def cancel(self, job_id: int) -> bool:
        """Cancel a pending, running or held job, with error ``cancelled`` (what its
        ``error.json`` says); False when it does not exist or already ended."""
        with self._tx() as c:
            row = c.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None or JobState(row[0]) not in JOB_OPEN:
                return False
            now = time.time()
            c.execute(
                "UPDATE jobs SET state = 'cancelled', error_code = ?, error_message = ?, "
                "finished_at = ?, updated_at = ? WHERE id = ?",
                (CANCELLED_CODE, CANCELLED_MESSAGE, now, now, job_id),
            )
            return True

    def counts(self) -> dict[str, int]:
        """Jobs per state: pending, active (= running), held, done, failed, partial, cancelled."""
        out = {"pending": 0, "active": 0, "held": 0, "done": 0, "failed": 0, "partial": 0,
               "cancelled": 0}
        # Kept by triggers (migration 4): a few rows, however many jobs the store holds.
        for state, n in self._conn.execute("SELECT state, n FROM job_counts WHERE n > 0"):
            out["active" if state == JobState.RUNNING else state] = n
        return out

    # -- pages -----------------------------------------------------------------------

    def init_pages(self, job_id: int, count: int) -> None:
        """Create pages ``0..count-1`` as pending and set ``pages_total``; idempotent.

        Raises InternalError if the job already has a different page count (the input
        changed under the job).
        """
        with self._tx() as c:
            self._job_state(job_id)
            row = c.execute("SELECT pages_total FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row[0] is not None and row[0] != count:
                raise InternalError(f"job {job_id} has {row[0]} pages, not {count}",
                                    job=job_id)
            c.executemany(
                "INSERT OR IGNORE INTO pages (job_id, page_index, state) "
                "VALUES (?, ?, 'pending')",
                ((job_id, i) for i in range(count)),
            )
            c.execute("UPDATE jobs SET pages_total = ?, updated_at = ? WHERE id = ?",
                      (count, time.time(), job_id))

    def pages(self, job_id: int) -> list[Page]:
        """All pages of a job, in page order."""
        rows = self._conn.execute(
            f"SELECT {_PAGE_COLUMNS} FROM pages WHERE job_id = ? ORDER BY page_index",
            (job_id,),
        ).fetchall()
        return [_page(r) for r in rows]

    def page(self, job_id: int, index: int) -> Page | None:
        """One page of a job, or ``None``."""
        row = self._conn.execute(
            f"SELECT {_PAGE_COLUMNS} FROM pages WHERE job_id = ? AND page_index = ?",
            (job_id, index),
        ).fetchone()
        return None if row is None else _page(row)

    def claim_page(self, job_id: int, index: int) -> None:
        """``pending -> in_flight``; charges one attempt."""
        with self._tx() as c:
            self._check_page(job_id, index, PageState.IN_FLIGHT)
            c.execute(
                "UPDATE pages SET state = 'in_flight', attempts = attempts + 1, "
                "started_at = ? WHERE job_id = ? AND page_index = ?",
                (time.time(), job_id, index),
            )

    def finish_page(
        self, job_id: int, index: int, *, result: dict[str, Any], width: int, height: int,
        seconds: float,
    ) -> None:
        """``in_flight -> done``, storing the parsed result so a restart never recomputes it."""
        payload = json.dumps(names.clean(result), ensure_ascii=False, separators=(",", ":"))
        with self._tx() as c:
            self._check_page(job_id, index, PageState.DONE)
            c.execute(
                "UPDATE pages SET state = 'done', result_json = ?, width = ?, height = ?, "
                "seconds = ?, error = NULL, finished_at = ? WHERE job_id = ? AND page_index = ?",
                (payload, width, height, seconds, time.time(), job_id, index),
            )

    def fail_page(self, job_id: int, index: int, error: str) -> None:
        """``pending|in_flight -> failed`` with the reason."""
        with self._tx() as c:
            self._check_page(job_id, index, PageState.FAILED)
            c.execute(
                "UPDATE pages SET state = 'failed', error = ?, finished_at = ? "
                "WHERE job_id = ? AND page_index = ?",
                (names.text(error), time.time(), job_id, index),
            )

    def release_page(self, job_id: int, index: int, *, charge: bool = False) -> None:
        """``in_flight -> pending``. Uncharged (the default: the engine failed under the
        page) gives the attempt back and counts a release; charged keeps the attempt
        (the answer was unusable and the page will be tried again)."""
        with self._tx() as c:
            self._check_page(job_id, index, PageState.PENDING)
            if charge:
                sql = "UPDATE pages SET state = 'pending', started_at = NULL "
            else:
                sql = ("UPDATE pages SET state = 'pending', attempts = MAX(attempts - 1, 0), "
                       "releases = releases + 1, started_at = NULL ")
            c.execute(sql + "WHERE job_id = ? AND page_index = ?", (job_id, index))

    def release_all_in_flight(self) -> int:
        """Give every in-flight page back to the queue (engine died); returns how many."""
        with self._tx() as c:
            return c.execute(
                "UPDATE pages SET state = 'pending', attempts = MAX(attempts - 1, 0), "
                "releases = releases + 1, started_at = NULL WHERE state = 'in_flight'"
            ).rowcount

    def _check_page(self, job_id: int, index: int, new: PageState) -> None:
        row = self._conn.execute(
            "SELECT state FROM pages WHERE job_id = ? AND page_index = ?", (job_id, index)
        ).fetchone()
        if row is None:
            raise InternalError(f"job {job_id} has no page {index}", job=job_id, page=index)
        old = PageState(row[0])
        if not is_legal(PAGE_TRANSITIONS, old, new):
            raise InternalError(f"job {job_id} page {index}: illegal transition {old} -> {new}",
                                job=job_id, page=index, old=old.value, new=new.value)

    def pages_done_since(self, t: float) -> int:
        """Pages finished ``done`` at or after wall-clock time ``t`` (for pages/min)."""
        row = self._conn.execute(
            "SELECT COUNT(*) FROM pages WHERE state = 'done' AND finished_at >= ?", (t,)
        ).fetchone()
        return int(row[0])

    def page_counts(self) -> dict[str, int]:
        """Pages per state (pending, in_flight, done, failed), over every job."""
        return {str(state): int(n) for state, n in self._conn.execute(
            "SELECT state, n FROM page_counts WHERE n > 0")}

    # -- learned profiles ------------------------------------------------------------

    def save_learned_profile(self, key: str, profile: dict[str, Any]) -> None:
        """Store the profile that proved stable for ``key`` (model, vLLM, GPU name, count)."""
        with self._tx() as c:
            c.execute(
                "INSERT INTO learned_profiles (key, profile_json, saved_at) VALUES (?, ?, ?) "
                "ON CONFLICT (key) DO UPDATE SET profile_json = excluded.profile_json, "
                "saved_at = excluded.saved_at",
                (key, json.dumps(profile, sort_keys=True), time.time()),
            )

    def load_learned_profile(self, key: str) -> dict[str, Any] | None:
        """The learned profile for ``key``, or ``None``."""
        row = self._conn.execute(
            "SELECT profile_json FROM learned_profiles WHERE key = ?", (key,)
        ).fetchone()
        if row is None:
            return None
        data = json.loads(row[0])
        return data if isinstance(data, dict) else None

    def learned_profile_saved_at(self, key: str) -> float | None:
        """Wall-clock time the learned profile for ``key`` was last saved, or ``None``."""
        row = self._conn.execute(
            "SELECT saved_at FROM learned_profiles WHERE key = ?", (key,)).fetchone()
        return None if row is None else float(row[0])


def check(state_dir: Path) -> list[str]:
    """``chandrad store check``: SQLite's full ``integrity_check`` of the store, read only
    (safe while the daemon runs); what is wrong, [] when it is sound or not made yet."""
    path = state_dir / DB_NAME
    if not path.exists() or path.stat().st_size == 0:
        if (state_dir / USED_MARKER).exists():
            return [f"{path} is missing or empty, but {state_dir / USED_MARKER} says it "
                    "held jobs"]
        return []
    try:
        conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, timeout=10.0)
    except sqlite3.Error as exc:
        return [f"cannot open {path}: {exc}"]
    try:
        rows = [str(r[0]) for r in conn.execute("PRAGMA integrity_check(20)")]
    except sqlite3.DatabaseError as exc:
        return [str(exc)]
    finally:
        conn.close()
    return [] if rows == ["ok"] else rows


@dataclass(frozen=True)
class Repaired:
    """What :func:`repair` did: where the damaged file went, how many jobs were saved."""

    damaged: Path
    jobs: int
    how: str


def repair(state_dir: Path) -> Repaired:
    """``chandrad store repair`` (the daemon stopped): rebuild the store from the rows
    SQLite can still read, keep the damaged file beside it as
    ``chandrad.sqlite3.damaged-<time>`` (and its ``-wal``).

    Raises:
        StateDirInUse: a daemon holds the store.
        StoreDamaged: nothing usable could be rebuilt (the message says how to start fresh).
    """
    path = state_dir / DB_NAME
    if not path.exists():
        raise StoreDamaged(f"there is no store at {path} to repair", path=str(path))
    fd = _lock_database(path)
    try:
        fresh = path.with_name(f"{DB_NAME}.recovered")
        for leftover in (fresh, Path(f"{fresh}-wal"), Path(f"{fresh}-shm")):
            leftover.unlink(missing_ok=True)
        try:
            how = _rebuild(path, fresh)
            conn = sqlite3.connect(fresh)
            try:
                jobs = int(conn.execute("SELECT COUNT(*) FROM jobs").fetchone()[0])
            finally:
                conn.close()
        except sqlite3.DatabaseError as exc:
            fresh.unlink(missing_ok=True)
            raise StoreDamaged(f"{path} could not be rebuilt ({exc}); " + _recovery(path),
                               path=str(path)) from None
        damaged = path.with_name(f"{DB_NAME}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
        for suffix in ("", "-wal", "-shm"):
            if Path(f"{path}{suffix}").exists():
                os.rename(f"{path}{suffix}", f"{damaged}{suffix}")
        os.rename(fresh, path)
    finally:
        os.close(fd)
    return Repaired(damaged=damaged, jobs=jobs, how=how)


def _rebuild(path: Path, fresh: Path) -> str:
    """Copy every row SQLite can still read from ``path``'s tables (by their own b-trees,
    no index used: indexes are rebuilt) into ``fresh``, made with this version's schema;
    the per-state counts follow from the triggers. What was lost, in words."""
    conn = sqlite3.connect(fresh.as_uri(), uri=True, isolation_level=None)  # uri: ATTACH's
    try:
        Store(conn, fresh)._migrate()
        conn.execute("ATTACH DATABASE ? AS old", (f"{path.as_uri()}?mode=ro",))
        try:
            version = int(conn.execute("SELECT version FROM old.schema_version").fetchone()[0])
        except (sqlite3.DatabaseError, TypeError) as exc:
            raise sqlite3.DatabaseError(f"its schema version cannot be read: {exc}") from None
        if version != len(MIGRATIONS):
            raise sqlite3.DatabaseError(f"it has schema version {version}; this chandrad "
                                        f"repairs version {len(MIGRATIONS)} only")
        lost: list[str] = []
        conn.execute("BEGIN")
        jobs = _copy_rows(conn, "jobs", lambda row: True, lost)
        _copy_rows(conn, "pages", lambda row: row[0] in jobs, lost)
        _copy_rows(conn, "learned_profiles", lambda row: True, lost)
        conn.execute("COMMIT")
        conn.execute("DETACH DATABASE old")
    finally:
        conn.close()
    return "every row read" if not lost else "rows lost after damage in " + ", ".join(lost)


def _copy_rows(conn: sqlite3.Connection, table: str, keep: Any, lost: list[str]) -> set[Any]:
    """Copy ``old.table``'s readable rows into ``main.table``, up to the first damaged
    page; the first column of each copied row (for jobs: the ids)."""
    firsts: set[Any] = set()
    try:
        for row in conn.execute(f"SELECT * FROM old.{table} NOT INDEXED").fetchall():
            if keep(row):
                conn.execute(f"INSERT INTO main.{table} VALUES "
                             f"({', '.join('?' * len(row))})", row)
                firsts.add(row[0])
    except sqlite3.DatabaseError:
        lost.append(table)
    return firsts


def _damaged(exc: sqlite3.DatabaseError) -> bool:
    """Whether SQLite's error says the file is not a sound database."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in _DAMAGE_CODES
    text = str(exc)
    return "malformed" in text or "not a database" in text


def _recovery(path: Path) -> str:
    """What to do about a damaged store (one message, for the log and the console)."""
    state_dir = path.parent
    return (f"chandrad does not start on it. Keep a copy first (cp -a {state_dir} "
            f"{state_dir}.damaged); then either `chandrad store repair` (rebuilds {path.name} "
            "from what SQLite can still read; the damaged file is kept beside it), or start "
            f"fresh: move {path.name}, {path.name}-wal, {path.name}-shm and {USED_MARKER} "
            "out of the state dir. A fresh store keeps done/, failed/ and output/ as they "
            "are and accepts the files still in the inbox again; only the job history "
            "(chandractl queue) starts empty. `chandrad store check` reports the damage.")


def _statements(script: str) -> list[str]:
    """Split a migration script into statements (ours contain no ``;`` in literals); a
    trigger's ``BEGIN … END;`` body is kept whole (``sqlite3.complete_statement``)."""
    out: list[str] = []
    pending = ""
    for piece in script.split(";"):
        pending += piece + ";"
        if sqlite3.complete_statement(pending):
            if pending.strip(" \n;"):
                out.append(pending.strip())
            pending = ""
    if pending.strip(" \n;"):
        out.append(pending.strip())
    return out


def _param(value: Any) -> Any:
    """A value as stored: paths as their exact bytes, text with undecodable bytes escaped."""
    if isinstance(value, Path):
        return names.fsbytes(value)
    if isinstance(value, str):
        return names.text(value)
    return value


def _path(raw: bytes | str | None) -> Path | None:
    return Path(names.from_bytes(raw)) if raw else None


def _job(row: tuple[Any, ...]) -> Job:
    return Job(
        id=row[0], watch_index=row[1], input_root=Path(names.from_bytes(row[2])),
        path=Path(names.from_bytes(row[3])), abs_path=Path(names.from_bytes(row[4])),
        size=row[5], mtime=row[6], sha256=row[7],
        state=JobState(row[8]), pages_total=row[9], attempts=row[10], error_code=row[11],
        error_message=row[12], created_at=row[13], updated_at=row[14], started_at=row[15],
        finished_at=row[16], output_dir=_path(row[17]), final_path=_path(row[18]),
        pages_done=row[19], pages_failed=row[20],
    )


def _page(row: tuple[Any, ...]) -> Page:
    return Page(
        job_id=row[0], index=row[1], state=PageState(row[2]), attempts=row[3],
        releases=row[4], width=row[5], height=row[6],
        result=json.loads(row[7]) if row[7] is not None else None, error=row[8],
        seconds=row[9], started_at=row[10], finished_at=row[11],
    )
