"""``chandrad store check`` and ``repair`` on the store ``daemon.store`` names: a real
PostgreSQL server (tests/pg_server.py) with real hosts' rows, and a SQLite store outside
the state dir. Run through ``cli.main``, as the command runs."""

from __future__ import annotations

import time
from pathlib import Path

import psycopg
import pytest
from pg_server import PgServer

from chandrad import cli
from chandrad.errors import ExitCode
from chandrad.states import JobState
from chandrad.store import DB_NAME, Store
from chandrad.store.pg_schema import PG_MIGRATIONS
from chandrad.store.postgres import PgStore

ROOT = Path("/in")


def _config(tmp_path: Path, store: str) -> Path:
    path = tmp_path / "chandrad.toml"
    path.write_text(f'[daemon]\nstate_dir = "{tmp_path / "state"}"\nstore = "{store}"\n\n'
                    f'[[watch]]\ninput = "{tmp_path / "in"}"\n', encoding="utf-8")
    return path


def _run(config: Path, action: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    status = cli.main(["store", action, "--config", str(config)])
    out = capsys.readouterr()
    return status, out.out + out.err


def test_check_finds_wrong_counts_and_what_waits_on_silent_hosts_and_repair_recounts(
        tmp_path: Path, pg_server: PgServer, capsys: pytest.CaptureFixture[str]) -> None:
    """A sound shared store with a silent host: ok (exit 0), noting its pages in flight and
    its expired lease. A count row that disagrees with the rows: exit 78 naming it; repair
    recounts while a host is open on the store, and the check is ok again. A schema newer
    than this chandrad: 78, and repair refuses it."""
    url = pg_server.new_database()
    config = _config(tmp_path, url)
    a, b = PgStore.open(url, "host-a", lease_s=1.0), PgStore.open(url, "host-b")
    try:
        for i, store in enumerate((a, b, b)):
            job = store.accept(0, ROOT, ROOT / f"{i}.pdf", 1, 0.0, f"{i:064d}")
            assert job is not None
            if i < 2:
                store.set_job_state(job.id, JobState.RUNNING)
                store.init_pages(job.id, 2)
                store.claim_page(job.id, 0)
        a._keeper.stop()  # host a goes silent: its lease expires, its page stays in flight
        time.sleep(1.2)
        status, out = _run(config, "check", capsys)
        assert status == ExitCode.OK, out
        assert f"ok (schema version {len(PG_MIGRATIONS)})" in out, out
        assert "note: 1 pages in flight on 1 jobs of host host-a (silent)" in out, out
        assert "note: 1 open jobs of host host-a whose lease expired" in out, out
        assert "host-b" not in out, out  # up, beating: nothing waits on it
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("UPDATE job_counts SET n = n + 5 WHERE state = 'pending'")
            conn.execute("DELETE FROM page_counts WHERE state = 'in_flight'")
        status, out = _run(config, "check", capsys)
        assert status == ExitCode.CONFIG, out
        assert "job_counts says 6 pending, jobs holds 1" in out, out
        assert "page_counts says 0 in_flight, pages holds 2" in out, out
        status, out = _run(config, "repair", capsys)
        assert status == ExitCode.OK, out
        assert "job_counts pending: 6 -> 1" in out and "page_counts in_flight: 0 -> 2" in out
        assert b.counts()["pending"] == 1 and b.page_counts()["in_flight"] == 2
        assert _run(config, "check", capsys)[0] == ExitCode.OK
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("UPDATE schema_version SET version = 99")
        status, out = _run(config, "check", capsys)
        assert status == ExitCode.CONFIG and "schema version 99 is newer" in out, out
        status, out = _run(config, "repair", capsys)
        assert status == ExitCode.CONFIG and "store_damaged" in out, out
    finally:
        a.close()
        b.close()


def test_check_of_a_server_not_reached_exits_69_and_names_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path, f"postgresql://chandrad@/x?host={tmp_path}&port=5432")
    status, out = _run(config, "check", capsys)
    assert status == ExitCode.UNAVAILABLE and "store_unreachable" in out, out
    assert str(tmp_path) in out, out


def test_check_reads_the_sqlite_store_daemon_store_names(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``daemon.store = "sqlite:<dir>"``: the store checked is the one there, not the
    state dir's."""
    Store.open(tmp_path / "queue").close()
    status, out = _run(_config(tmp_path, "sqlite:queue"), "check", capsys)
    assert status == ExitCode.OK and f"{tmp_path / 'queue' / DB_NAME}: ok" in out, out
