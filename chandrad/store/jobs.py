"""The ``jobs`` table (and its per-state counts): every SQL statement on jobs.

A job moves along ``JOB_TRANSITIONS`` only (:meth:`JobTable.set_job_state` checks it in the
same transaction). The steps of a job that touch its pages (new content discards them, a
retry requeues the failed ones, :meth:`JobTable.init_pages` creates them) call
:class:`~chandrad.store.pages.PageTable` inside the job's transaction. A job row read back
carries its done and failed page counts (``_JOB_COLUMNS``).

Paths (``input_root``, ``path``, ``abs_path``, ``output_dir``, ``final_path``) are stored
as their exact bytes (BLOB), so a name that is not valid UTF-8 is kept losslessly; free
text (error messages) is stored with undecodable bytes escaped.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

from chandrad import names
from chandrad.errors import CANCELLED_CODE, CANCELLED_MESSAGE, InternalError
from chandrad.states import JOB_FINISHED, JOB_OPEN, JOB_TRANSITIONS, JobState, is_legal
from chandrad.store.database import SqlDatabase
from chandrad.store.pages import PageTable
from chandrad.store.records import DUPLICATE_POLICIES, Job

_JOB_COLUMNS = """
    j.id, j.watch_index, j.input_root, j.path, j.abs_path, j.size, j.mtime, j.sha256,
    j.state, j.pages_total, j.attempts, j.error_code, j.error_message, j.created_at,
    j.updated_at, j.started_at, j.finished_at, j.output_dir, j.final_path,
    (SELECT COUNT(*) FROM pages p WHERE p.job_id = j.id AND p.state = 'done'),
    (SELECT COUNT(*) FROM pages p WHERE p.job_id = j.id AND p.state = 'failed')
"""


class JobTable:
    """Every accepted input file and where it stands."""

    def __init__(self, db: SqlDatabase, pages: PageTable) -> None:
        self._db = db
        self._pages = pages

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
        with self._db.tx():
            job_id = self._accept_one(watch_index, input_root, path, size, mtime, sha256,
                                      duplicates)
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
        with self._db.tx():
            for item in items:
                job_id = self._accept_one(*item, duplicates)
                if job_id is not None:
                    ids.append(job_id)
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
        c = self._db.conn
        now = time.time()
        active = c.execute(
            "SELECT id, state, sha256 FROM jobs WHERE abs_path = ? AND state IN "
            "('pending', 'running', 'held') ORDER BY id" + self._db.lock_rows,
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
                self._pages.discard(job_id)
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
        # ON CONFLICT: on PostgreSQL a unique index on the active (path, content) pairs
        # makes two hosts that saw the same file at once accept it once (no row back).
        row = c.execute(
            "INSERT INTO jobs (watch_index, input_root, path, abs_path, size, mtime, sha256, "
            "state, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, 'pending', ?, ?) "
            "ON CONFLICT DO NOTHING RETURNING id",
            (watch_index, names.fsbytes(input_root), names.fsbytes(rel),
             names.fsbytes(abs_path), size, mtime, sha256, now, now),
        ).fetchone()
        return None if row is None else int(row[0])

    def supersede(self, job_id: int, size: int, mtime: float, sha256: str,
                  duplicates: str = "process") -> Job | None:
        """The input of an active job was replaced by other content: end the job as
        ``cancelled`` with ``input_replaced`` (its pages came from content that no longer
        exists; the input is left where it is) and accept the new content as a new job,
        in one transaction. Returns the new job (``None`` when the new content is not
        new work, e.g. already queued or skipped as a duplicate)."""
        with self._db.tx() as c:
            row = c.execute(
                "SELECT watch_index, input_root, abs_path, state FROM jobs WHERE id = ?"
                + self._db.lock_rows, (job_id,)).fetchone()
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
                self._pages.requeue_in_flight(job_id)
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
        not_ids = f"AND j.id NOT IN ({', '.join('?' * len(exclude))}) " if exclude else ""
        out: list[Job] = []
        for state in (JobState.RUNNING, JobState.HELD, JobState.PENDING):
            rows = self._db.conn.execute(
                f"SELECT {_JOB_COLUMNS} FROM jobs j WHERE j.state = ? "
                f"AND j.input_root IN ({root_marks}) {not_ids}"
                "ORDER BY j.id LIMIT ?",
                (state.value, *(names.fsbytes(r) for r in roots), *exclude, limit - len(out)),
            ).fetchall()
            out += [job_from_row(r) for r in rows]
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
        count = self._db.conn.execute(f"SELECT COUNT(*) FROM jobs j WHERE {where}",
                                   gone).fetchone()[0]
        rows = self._db.conn.execute(
            f"SELECT {_JOB_COLUMNS} FROM jobs j WHERE {where} ORDER BY j.id LIMIT ?",
            (*gone, limit)).fetchall()
        return int(count), [job_from_row(r) for r in rows]

    def _roots_with_active_jobs(self) -> list[bytes]:
        """Distinct ``input_root`` (bytes) of pending/running/held jobs: one index probe
        per input folder ever used (a handful), not a scan of the backlog."""
        out: list[bytes] = []
        root = b""
        index = " INDEXED BY jobs_by_root" if self._db.dialect == "sqlite" else ""
        while True:
            row = self._db.conn.execute(
                f"SELECT input_root FROM jobs{index} WHERE input_root > ? "
                "ORDER BY input_root LIMIT 1", (root,)).fetchone()
            if row is None:
                return out
            root = bytes(row[0])
            if self._db.conn.execute(
                    f"SELECT 1 FROM jobs{index} WHERE input_root = ? "
                    "AND state IN ('pending', 'running', 'held') LIMIT 1",
                    (root,)).fetchone():
                out.append(root)

    def get(self, job_id: int) -> Job | None:
        """The job with this id, or ``None``."""
        row = self._db.conn.execute(
            f"SELECT {_JOB_COLUMNS} FROM jobs j WHERE j.id = ?", (job_id,)
        ).fetchone()
        return None if row is None else job_from_row(row)

    def find_active(self, abs_path: Path) -> Job | None:
        """The pending, running or held job for this input path, if any."""
        row = self._db.conn.execute(
            f"SELECT {_JOB_COLUMNS} FROM jobs j WHERE j.abs_path = ? "
            "AND j.state IN ('pending', 'running', 'held') ORDER BY j.id LIMIT 1",
            (names.fsbytes(abs_path),),
        ).fetchone()
        return None if row is None else job_from_row(row)

    def next_pending(self, limit: int = 1) -> list[Job]:
        """The oldest pending jobs, oldest first."""
        rows = self._db.conn.execute(
            f"SELECT {_JOB_COLUMNS} FROM jobs j WHERE j.state = 'pending' "
            "ORDER BY j.id LIMIT ?",
            (limit,),
        ).fetchall()
        return [job_from_row(r) for r in rows]

    def list_jobs(self, state: str | None = None, limit: int = 1000) -> list[Job]:
        """Jobs, oldest first, optionally only those in ``state``.

        Raises ValueError when ``state`` is not a ``JobState`` value.
        """
        if state is None:
            rows = self._db.conn.execute(
                f"SELECT {_JOB_COLUMNS} FROM jobs j ORDER BY j.id LIMIT ?", (limit,)
            ).fetchall()
        else:
            rows = self._db.conn.execute(
                f"SELECT {_JOB_COLUMNS} FROM jobs j WHERE j.state = ? ORDER BY j.id LIMIT ?",
                (JobState(state).value, limit),
            ).fetchall()
        return [job_from_row(r) for r in rows]

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
        with self._db.tx() as c:
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
                    args.append(_stored(value))
            c.execute(f"UPDATE jobs SET {', '.join(sets)} WHERE id = ?", (*args, job_id))

    def _job_state(self, job_id: int) -> JobState:
        row = self._db.conn.execute("SELECT state FROM jobs WHERE id = ?" + self._db.lock_rows,
                                    (job_id,)).fetchone()
        if row is None:
            raise InternalError(f"job {job_id} does not exist", job=job_id)
        return JobState(row[0])

    def retry(self, job_id: int) -> bool:
        """Requeue a failed, partial or cancelled job; its failed pages go back to pending.

        Pages already done are kept (not recomputed): a partial job's retry sends only
        the pages that failed. Returns False when the job does
        not exist or is not in a state that can be retried.
        """
        with self._db.tx():
            return self._retry_one(job_id)

    def retry_all_failed(self) -> int:
        """Requeue every failed job; returns how many."""
        with self._db.tx() as c:
            ids = [r[0] for r in c.execute("SELECT id FROM jobs WHERE state = 'failed'")]
            return sum(self._retry_one(i) for i in ids)

    def _retry_one(self, job_id: int) -> bool:
        c = self._db.conn
        row = c.execute("SELECT state FROM jobs WHERE id = ?" + self._db.lock_rows,
                        (job_id,)).fetchone()
        if row is None or not is_legal(JOB_TRANSITIONS, JobState(row[0]), JobState.PENDING):
            return False
        c.execute(
            "UPDATE jobs SET state = 'pending', error_code = NULL, error_message = NULL, "
            "finished_at = NULL, updated_at = ? WHERE id = ?",
            (time.time(), job_id),
        )
        self._pages.requeue_failed(job_id)
        return True

    def cancel(self, job_id: int) -> bool:
        """Cancel a pending, running or held job, with error ``cancelled`` (what its
        ``error.json`` says); False when it does not exist or already ended."""
        with self._db.tx() as c:
            row = c.execute("SELECT state FROM jobs WHERE id = ?" + self._db.lock_rows,
                            (job_id,)).fetchone()
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
        for state, n in self._db.conn.execute("SELECT state, n FROM job_counts WHERE n > 0"):
            out["active" if state == JobState.RUNNING else state] = n
        return out

    def any_job(self) -> bool:
        """Whether the store holds a job at all."""
        return self._db.conn.execute("SELECT 1 FROM jobs LIMIT 1").fetchone() is not None

    def count_running(self) -> int:
        """How many jobs are ``running`` (resumed at page granularity after a restart)."""
        row = self._db.conn.execute("SELECT COUNT(*) FROM jobs WHERE state = 'running'")
        return int(row.fetchone()[0])

    def init_pages(self, job_id: int, count: int) -> None:
        """Create pages ``0..count-1`` as pending and set ``pages_total``; idempotent.

        Raises InternalError if the job already has a different page count (the input
        changed under the job).
        """
        with self._db.tx() as c:
            self._job_state(job_id)
            row = c.execute("SELECT pages_total FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row[0] is not None and row[0] != count:
                raise InternalError(f"job {job_id} has {row[0]} pages, not {count}",
                                    job=job_id)
            self._pages.create(job_id, count)
            c.execute("UPDATE jobs SET pages_total = ?, updated_at = ? WHERE id = ?",
                      (count, time.time(), job_id))


def job_from_row(row: tuple[Any, ...]) -> Job:
    """A ``Job`` from a row of ``_JOB_COLUMNS``."""
    return Job(
        id=row[0], watch_index=row[1], input_root=Path(names.from_bytes(row[2])),
        path=Path(names.from_bytes(row[3])), abs_path=Path(names.from_bytes(row[4])),
        size=row[5], mtime=row[6], sha256=row[7],
        state=JobState(row[8]), pages_total=row[9], attempts=row[10], error_code=row[11],
        error_message=row[12], created_at=row[13], updated_at=row[14], started_at=row[15],
        finished_at=row[16], output_dir=_path(row[17]), final_path=_path(row[18]),
        pages_done=row[19], pages_failed=row[20],
    )


def _stored(value: Any) -> Any:
    """A value as stored: paths as their exact bytes, text with undecodable bytes escaped."""
    if isinstance(value, Path):
        return names.fsbytes(value)
    if isinstance(value, str):
        return names.text(value)
    return value


def _path(raw: bytes | str | None) -> Path | None:
    return Path(names.from_bytes(raw)) if raw else None
