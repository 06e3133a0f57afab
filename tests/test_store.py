"""Tests of chandrad.store on real SQLite files, including kill -9 of a real writer."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import CORPUS_DIR

from chandrad.errors import InternalError, StateDirInUse
from chandrad.states import JobState, PageState
from chandrad.store import DB_NAME, LOCK_NAME, MIGRATIONS, Job, Store, StoreBackend
from chandrad.store.postgres import PgStore

CORPUS = CORPUS_DIR / "good"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """The store of each backend: SQLite in a state dir, PostgreSQL in a fresh database of
    the session's real server (``pg_server``). The tests taking it are the contract."""
    s: Store | PgStore
    if request.param == "sqlite":
        s = Store.open(tmp_path / "state")
    else:
        s = PgStore.open(request.getfixturevalue("pg_server").new_database(), "host-a")
    yield s  # type: ignore[misc]  # both keep StoreBackend; the tests read it as Store
    s.close()


def _accept_corpus_file(store: Store, name: str, duplicates: str = "process") -> Job | None:
    path = CORPUS / name
    st = path.stat()
    return store.accept(0, CORPUS, path, st.st_size, st.st_mtime, _sha(path.read_bytes()),
                        duplicates=duplicates)


def test_open_creates_wal_database_with_schema_version(tmp_path: Path) -> None:
    """open() creates the state dir, a WAL-mode database and records the schema version."""
    s = Store.open(tmp_path / "a" / "b")
    try:
        assert (tmp_path / "a" / "b" / DB_NAME).is_file()
        assert s.schema_version() == len(MIGRATIONS)
        mode = s._conn.execute("PRAGMA journal_mode").fetchone()[0]
        assert mode == "wal"
    finally:
        s.close()


def test_sqlite_store_keeps_the_backend_contract(store: Store) -> None:
    """The SQLite store is a ``StoreBackend`` (mypy checks the signatures here, the
    assertion that no operation is missing): the contract a second backend implements."""
    backend: StoreBackend = store
    assert isinstance(backend, StoreBackend)
    job = backend.accept(0, CORPUS, CORPUS / "x.pdf", 1, 0.0, "a" * 64)
    assert job is not None and backend.get(job.id) == job


def test_a_step_inside_a_transaction_joins_it(store: Store) -> None:
    """A one-transaction operation called inside another transaction joins it: an error
    later in the outer one takes the inner step back too (all or nothing)."""
    job = store.accept(0, CORPUS, CORPUS / "x.pdf", 1, 0.0, "a" * 64)
    assert job is not None
    with pytest.raises(RuntimeError), store._tx():
        store.init_pages(job.id, 3)
        store.save_learned_profile("k", {"max_model_len": 1})
        raise RuntimeError("after the steps")
    assert store.pages(job.id) == [] and store.load_learned_profile("k") is None
    with store._tx():
        store.init_pages(job.id, 3)
    assert len(store.pages(job.id)) == 3


def test_refuses_database_from_newer_chandrad(tmp_path: Path) -> None:
    """A database whose schema is newer than this code is refused, not downgraded."""
    Store.open(tmp_path).close()
    with sqlite3.connect(tmp_path / DB_NAME) as conn:
        conn.execute("UPDATE schema_version SET version = 999")
    with pytest.raises(InternalError, match="newer"):
        Store.open(tmp_path)


def test_one_store_per_state_dir_until_closed(tmp_path: Path) -> None:
    """A second open of a state dir in use is refused naming the holder; close frees it."""
    first = Store.open(tmp_path)
    with pytest.raises(StateDirInUse, match=f"pid {os.getpid()}") as refused:
        Store.open(tmp_path)
    assert refused.value.details["path"] == str(tmp_path)
    first.close()
    Store.open(tmp_path).close()


def test_state_dir_lock_dies_with_its_process(tmp_path: Path) -> None:
    """A daemon killed with -9 leaves the lock file, not the lock: the next open works."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from chandrad.store import Store; Store.open(Path(sys.argv[1])); "
         "print('held', flush=True); time.sleep(600)", str(tmp_path)],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(StateDirInUse, match=f"pid {holder.pid}"):
            Store.open(tmp_path)
    finally:
        holder.kill()
        holder.wait(30)
        if holder.stdout is not None:
            holder.stdout.close()
    assert (tmp_path / LOCK_NAME).exists()
    Store.open(tmp_path).close()


def test_accept_records_relative_and_absolute_path(store: Store) -> None:
    """accept() stores the path relative to the input root and the absolute path."""
    job = _accept_corpus_file(store, "digital_sf424-federal-form.pdf")
    assert job is not None
    got = store.get(job.id)
    assert got is not None
    assert got.path == Path("digital_sf424-federal-form.pdf")
    assert got.abs_path == CORPUS / "digital_sf424-federal-form.pdf"
    assert got.state is JobState.PENDING
    assert got.size == (CORPUS / "digital_sf424-federal-form.pdf").stat().st_size
    assert json.loads(json.dumps(got.to_dict()))["state"] == "pending"


def test_accept_is_idempotent_for_same_file(store: Store) -> None:
    """Accepting the same path with the same hash twice while active yields one job."""
    first = _accept_corpus_file(store, "image_hi-devanagari.png")
    second = _accept_corpus_file(store, "image_hi-devanagari.png")
    assert first is not None
    assert second is None
    assert store.counts()["pending"] == 1


def test_accept_updates_pending_job_when_content_changed(store: Store) -> None:
    """A pending job for a path whose content changed is updated, not duplicated."""
    root = Path("/in")
    first = store.accept(0, root, root / "a.pdf", 10, 1.0, "aa" * 32)
    assert first is not None
    assert store.accept(0, root, root / "a.pdf", 20, 2.0, "bb" * 32) is None
    job = store.get(first.id)
    assert job is not None and job.sha256 == "bb" * 32 and job.size == 20
    assert store.counts()["pending"] == 1


def test_accept_new_job_when_running_job_content_changed(store: Store) -> None:
    """A path changed while its job runs becomes a second job (the new content is work)."""
    root = Path("/in")
    first = store.accept(0, root, root / "a.pdf", 10, 1.0, "aa" * 32)
    assert first is not None
    store.set_job_state(first.id, JobState.RUNNING)
    second = store.accept(0, root, root / "a.pdf", 20, 2.0, "bb" * 32)
    assert second is not None and second.id != first.id


def test_duplicates_policy(store: Store) -> None:
    """After a job is done, the same content is skipped with 'skip' and queued with 'process'."""
    job = _accept_corpus_file(store, "image_numeric-table-scan.tif")
    assert job is not None
    store.set_job_state(job.id, JobState.RUNNING)
    store.set_job_state(job.id, JobState.DONE)
    assert _accept_corpus_file(store, "image_numeric-table-scan.tif", "skip") is None
    again = _accept_corpus_file(store, "image_numeric-table-scan.tif", "process")
    assert again is not None
    with pytest.raises(InternalError):
        _accept_corpus_file(store, "image_numeric-table-scan.tif", "sometimes")


def test_skip_duplicates_dropped_together_or_while_queued(store: Store,
                                                          tmp_path: Path) -> None:
    """'skip' compares with jobs not yet done too: copies accepted in one batch, and a
    copy arriving while the first is pending or running, are skipped."""
    root = tmp_path / "in"
    same, other = "cc" * 32, "dd" * 32
    batch = [(0, root, root / f"copy{i}.pdf", 10, 1.0, same) for i in range(3)]
    batch.append((0, root, root / "other.pdf", 10, 1.0, other))
    jobs = store.accept_many(batch, "skip")
    assert sorted(j.path.name for j in jobs) == ["copy0.pdf", "other.pdf"]
    assert store.accept(0, root, root / "copy9.pdf", 10, 1.0, same, "skip") is None
    first = next(j for j in jobs if j.sha256 == same)
    store.set_job_state(first.id, JobState.RUNNING)
    assert store.accept(0, root, root / "copy8.pdf", 10, 1.0, same, "skip") is None
    # A copy of content whose job failed is processed: nothing was made of it.
    store.set_job_state(first.id, JobState.FAILED)
    assert store.accept(0, root, root / "copy7.pdf", 10, 1.0, same, "skip") is not None


def test_next_pending_is_oldest_first(store: Store) -> None:
    """next_pending() returns pending jobs in acceptance order and skips running ones."""
    root = Path("/in")
    ids = []
    for i in range(5):
        job = store.accept(0, root, Path(f"sub/{i}.pdf"), i, 0.0, f"{i:064x}")
        assert job is not None
        ids.append(job.id)
    store.set_job_state(ids[0], JobState.RUNNING)
    assert [j.id for j in store.next_pending(3)] == ids[1:4]
    assert store.find_active(root / "sub/0.pdf") is not None
    assert store.find_active(root / "sub/9.pdf") is None


def test_job_transitions_are_checked(store: Store) -> None:
    """Illegal job edges raise InternalError and leave the stored state unchanged."""
    job = store.accept(0, Path("/in"), Path("x.pdf"), 1, 0.0, "cc" * 32)
    assert job is not None
    with pytest.raises(InternalError, match="illegal"):
        store.set_job_state(job.id, JobState.DONE)
    assert store.get(job.id).state is JobState.PENDING  # type: ignore[union-attr]
    store.set_job_state(job.id, JobState.RUNNING)
    store.set_job_state(job.id, JobState.RUNNING, pages_total=3, output_dir=Path("/out/x"))
    same = store.get(job.id)
    assert same is not None and same.attempts == 1 and same.pages_total == 3
    store.set_job_state(job.id, JobState.FAILED, error_code="corrupt_input",
                        error_message="bad xref", final_path=Path("/failed/x.pdf"))
    got = store.get(job.id)
    assert got is not None
    assert got.state is JobState.FAILED and got.attempts == 1
    assert got.error_code == "corrupt_input" and got.final_path == Path("/failed/x.pdf")
    assert got.finished_at is not None and got.started_at is not None
    with pytest.raises(InternalError):
        store.set_job_state(job.id, JobState.RUNNING)
    with pytest.raises(InternalError, match="does not exist"):
        store.set_job_state(12345, JobState.RUNNING)


def test_page_lifecycle_and_transitions(store: Store) -> None:
    """Pages go pending -> in_flight -> done with their result; illegal edges raise."""
    job = store.accept(0, Path("/in"), Path("x.pdf"), 1, 0.0, "dd" * 32)
    assert job is not None
    store.set_job_state(job.id, JobState.RUNNING)
    store.init_pages(job.id, 3)
    store.init_pages(job.id, 3)  # idempotent
    assert [p.state for p in store.pages(job.id)] == [PageState.PENDING] * 3
    with pytest.raises(InternalError):
        store.init_pages(job.id, 4)
    with pytest.raises(InternalError, match="illegal"):
        store.finish_page(job.id, 0, result={}, width=1, height=1, seconds=0.1)
    store.claim_page(job.id, 0)
    result = {"blocks": [{"label": "Text", "bbox": [0, 0, 10, 10], "html": "<p>ü</p>"}]}
    store.finish_page(job.id, 0, result=result, width=1024, height=1400, seconds=0.25)
    with pytest.raises(InternalError):
        store.claim_page(job.id, 0)
    store.claim_page(job.id, 1)
    store.fail_page(job.id, 1, "repetition loop")
    with pytest.raises(InternalError, match="no page"):
        store.claim_page(job.id, 7)
    pages = store.pages(job.id)
    assert pages[0].state is PageState.DONE and pages[0].result == result
    assert (pages[0].width, pages[0].height, pages[0].attempts) == (1024, 1400, 1)
    assert pages[1].state is PageState.FAILED and pages[1].error == "repetition loop"
    got = store.get(job.id)
    assert got is not None and (got.pages_total, got.pages_done, got.pages_failed) == (3, 1, 1)


def test_release_does_not_charge_attempts(store: Store) -> None:
    """release_page()/release_all_in_flight() return pages to pending without charging them."""
    job = store.accept(0, Path("/in"), Path("x.pdf"), 1, 0.0, "ee" * 32)
    assert job is not None
    store.set_job_state(job.id, JobState.RUNNING)
    store.init_pages(job.id, 2)
    store.claim_page(job.id, 0)
    store.release_page(job.id, 0)
    store.claim_page(job.id, 0)
    store.claim_page(job.id, 1)
    assert store.release_all_in_flight() == 2
    pages = store.pages(job.id)
    assert [(p.state, p.attempts, p.releases) for p in pages] == [
        (PageState.PENDING, 0, 2), (PageState.PENDING, 0, 1)]
    with pytest.raises(InternalError):
        store.release_page(job.id, 0)


def test_retry_keeps_done_pages_and_requeues_failed(store: Store) -> None:
    """retry() requeues a failed job; done pages stay done, failed pages become pending."""
    job = store.accept(0, Path("/in"), Path("x.pdf"), 1, 0.0, "ff" * 32)
    assert job is not None
    store.set_job_state(job.id, JobState.RUNNING)
    store.init_pages(job.id, 2)
    store.claim_page(job.id, 0)
    store.finish_page(job.id, 0, result={"n": 0}, width=1, height=1, seconds=0.1)
    store.claim_page(job.id, 1)
    store.fail_page(job.id, 1, "timeout")
    store.set_job_state(job.id, JobState.FAILED, error_code="pages_failed")
    assert store.retry(job.id) is True
    assert store.retry(job.id) is False  # already pending
    assert store.retry(999) is False
    got = store.get(job.id)
    assert got is not None and got.state is JobState.PENDING and got.error_code is None
    assert [p.state for p in store.pages(job.id)] == [PageState.DONE, PageState.PENDING]


def test_retry_all_failed_and_cancel(store: Store) -> None:
    """retry_all_failed() counts requeued jobs; cancel() works only on active jobs."""
    root = Path("/in")
    jobs = [store.accept(0, root, Path(f"{i}.pdf"), 1, 0.0, f"{i:064x}") for i in range(4)]
    assert all(j is not None for j in jobs)
    ids = [j.id for j in jobs if j is not None]
    store.set_job_state(ids[0], JobState.FAILED)
    store.set_job_state(ids[1], JobState.FAILED)
    assert store.cancel(ids[2]) is True
    assert store.cancel(ids[2]) is False
    assert store.counts() == {"pending": 1, "active": 0, "held": 0, "done": 0, "failed": 2,
                              "partial": 0, "cancelled": 1}
    assert store.retry_all_failed() == 2
    assert store.counts()["pending"] == 3
    assert [j.id for j in store.list_jobs("cancelled")] == [ids[2]]
    assert len(store.list_jobs()) == 4
    with pytest.raises(ValueError):
        store.list_jobs("finished")


def test_held_job_stays_open_and_resumes(store: Store) -> None:
    """A held job (outputs unwritable) still owns its input: the same file is not queued
    again; running again clears the hold's error; it can be cancelled."""
    root = Path("/in")
    job = store.accept(0, root, Path("held.pdf"), 1, 0.0, "a" * 64)
    assert job is not None
    store.set_job_state(job.id, JobState.RUNNING)
    store.set_job_state(job.id, JobState.HELD, error_code="output_unwritable",
                        error_message="disk full")
    assert store.counts()["held"] == 1
    assert store.find_active(root / "held.pdf") is not None
    assert store.accept(0, root, Path("held.pdf"), 1, 0.0, "a" * 64) is None
    store.set_job_state(job.id, JobState.RUNNING)
    again = store.get(job.id)
    assert again is not None and again.error_code is None and again.attempts == 2
    store.set_job_state(job.id, JobState.HELD, error_code="output_unwritable")
    assert store.cancel(job.id) is True
    cancelled = store.get(job.id)
    assert cancelled is not None
    assert (cancelled.error_code, cancelled.error_message) == ("cancelled",
                                                               "cancelled by the operator")


def test_pages_done_since(store: Store) -> None:
    """pages_done_since() counts only pages finished at or after the given time."""
    job = store.accept(0, Path("/in"), Path("x.pdf"), 1, 0.0, "ab" * 32)
    assert job is not None
    store.set_job_state(job.id, JobState.RUNNING)
    store.init_pages(job.id, 3)
    store.claim_page(job.id, 0)
    store.finish_page(job.id, 0, result={}, width=1, height=1, seconds=0.1)
    mark = time.time()
    time.sleep(0.01)
    for i in (1, 2):
        store.claim_page(job.id, i)
        store.finish_page(job.id, i, result={}, width=1, height=1, seconds=0.1)
    assert store.pages_done_since(mark) == 2
    assert store.pages_done_since(0) == 3


def test_learned_profile_round_trip(tmp_path: Path) -> None:
    """A saved learned profile survives reopening and is replaced on a second save."""
    key = "datalab-to/chandra-ocr-2|0.32.0|NVIDIA H200|1"
    s = Store.open(tmp_path)
    assert s.load_learned_profile(key) is None
    s.save_learned_profile(key, {"max_num_seqs": 64, "gpu_memory_utilization": 0.9})
    s.save_learned_profile(key, {"max_num_seqs": 32, "gpu_memory_utilization": 0.85})
    s.close()
    s = Store.open(tmp_path)
    try:
        assert s.load_learned_profile(key) == {"max_num_seqs": 32,
                                               "gpu_memory_utilization": 0.85}
    finally:
        s.close()


_WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from chandrad.states import JobState, PageState
    from chandrad.store import Store

    def say(*words):
        # One write per line: print() writes each word separately when stdout is
        # unbuffered (PYTHONUNBUFFERED), and SIGKILL could then cut a line in two.
        sys.stdout.write(" ".join(map(str, words)) + "\\n")
        sys.stdout.flush()

    store = Store.open(Path(sys.argv[1]))
    say("recovered", store.recovered.pages_released, store.recovered.jobs_running)
    root = Path("/in")
    n = len(store.list_jobs())
    while True:
        waiting = store.list_jobs("running") or store.next_pending()
        if waiting:
            job = waiting[0]
        else:
            job = store.accept(0, root, root / f"f{n}.pdf", 100, 1.0, f"{n:064x}")
            n += 1
        if job.state is JobState.PENDING:
            store.set_job_state(job.id, JobState.RUNNING)
        if job.pages_total is None:
            store.init_pages(job.id, 5)
        for page in store.pages(job.id):
            if page.state is not PageState.PENDING:
                continue
            store.claim_page(job.id, page.index)
            say("claimed", job.id, page.index)
            store.finish_page(job.id, page.index, result={"job": job.id, "page": page.index},
                              width=10, height=20, seconds=0.01)
            say("done", job.id, page.index)
        store.set_job_state(job.id, JobState.DONE)
        say("jobdone", job.id)
""")


def _run_writer_and_kill(state: Path, min_done: int, rng: random.Random) -> list[str]:
    """Start a real writer process, SIGKILL it mid-stream, return the lines it printed."""
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(state)], stdout=subprocess.PIPE,
                            text=True, cwd=Path(__file__).parent.parent)
    assert proc.stdout is not None
    lines: list[str] = []
    done = 0
    while done < min_done:
        line = proc.stdout.readline()
        assert line, "writer exited early"
        lines.append(line.strip())
        done += line.startswith("done ")
    time.sleep(rng.uniform(0.0, 0.05))
    os.kill(proc.pid, signal.SIGKILL)
    rest, _ = proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    lines.extend(x for x in rest.splitlines() if x)
    return lines


def test_kill_9_loses_nothing_and_recovers_in_flight(tmp_path: Path) -> None:
    """SIGKILL of a real writer loses no committed page; reopening requeues in-flight ones."""
    rng = random.Random(1234)
    state = tmp_path / "state"
    reported_done: set[tuple[int, int]] = set()
    for _round in range(4):
        lines = _run_writer_and_kill(state, rng.randint(10, 40), rng)
        for line in lines:
            word, *nums = line.split()
            if word == "done":
                key = (int(nums[0]), int(nums[1]))
                assert key not in reported_done, f"page {key} finished twice"
                reported_done.add(key)
        with sqlite3.connect(state / DB_NAME) as conn:
            assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        s = Store.open(state)
        try:
            assert s.recovered.pages_released <= 1
            in_flight = s._conn.execute(
                "SELECT COUNT(*) FROM pages WHERE state = 'in_flight'").fetchone()[0]
            assert in_flight == 0
            for job in s.list_jobs():
                pages = s.pages(job.id)
                if job.pages_total is None:  # killed between accept and init_pages
                    assert pages == [] and job.state is not JobState.DONE
                    continue
                assert [p.index for p in pages] == list(range(5)), f"job {job.id} lost pages"
                for p in pages:
                    if (job.id, p.index) in reported_done:
                        assert p.state is PageState.DONE
                        assert p.result == {"job": job.id, "page": p.index}
                    assert p.releases <= 4 and p.attempts <= 1
                if job.state is JobState.DONE:
                    assert job.pages_done == 5
            assert len(s.list_jobs("running")) + len(s.next_pending(10)) <= 1
        finally:
            s.close()
    assert len(reported_done) >= 40


def test_version_1_database_is_migrated_and_jobs_keep_their_watch(tmp_path: Path) -> None:
    """A store written by the first schema opens: it gains the index jobs find their
    watch's folder by, and its jobs are untouched."""
    with sqlite3.connect(tmp_path / DB_NAME) as conn:
        conn.executescript(MIGRATIONS[0])
        conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        conn.execute("INSERT INTO schema_version (version) VALUES (1)")
        conn.execute(
            "INSERT INTO jobs (watch_index, input_root, path, abs_path, size, mtime, sha256, "
            "state, created_at, updated_at) VALUES (3, '/srv/gone', 'a.pdf', "
            "'/srv/gone/a.pdf', 1, 1.0, ?, 'pending', 1.0, 1.0)", ("ab" * 32,))
    s = Store.open(tmp_path)
    try:
        assert s.schema_version() == len(MIGRATIONS) >= 2
        indexes = {r[0] for r in s._conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'index'")}
        assert "jobs_by_root" in indexes
        count, jobs = s.active_outside([Path("/srv/in")])
        assert count == 1 and jobs[0].input_root == Path("/srv/gone")
        assert s.next_jobs([Path("/srv/gone")], (), 5)[0].path == Path("a.pdf")
    finally:
        s.close()
