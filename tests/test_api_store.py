"""The HTTP API's tables and secrets, on real stores (SQLite, and PostgreSQL on the
session's real server, tests/pg_server.py) and real files.

``store/api.py``: a job and its owner are one transaction; the outbox row is written by
the trigger in the transaction that ends an API job with a callback (done, partial,
failed; not cancelled, not a watched file's job); queue positions; attempts and giving up;
on a shared store, each due webhook claimed by one host's sender only.
``api/tokens.py``: a tokens or key file others may read, or a malformed one, is a config
error naming the key (exit 78).
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from pg_server import PgServer

from chandrad.api.tokens import load_secret, load_tokens
from chandrad.api.uploads import UploadDir, safe_filename
from chandrad.api.webhooks import backoff, sign
from chandrad.config import parse_config
from chandrad.errors import ConfigError, ExitCode, InternalError
from chandrad.states import JobState
from chandrad.store import Store, StoreBackend, repair
from chandrad.store.api import ApiTable
from chandrad.store.postgres import PgStore


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """The store of each backend: SQLite in a state dir, PostgreSQL in a fresh database."""
    s: Store | PgStore
    if request.param == "sqlite":
        s = Store.open(tmp_path / "state")
    else:
        s = PgStore.open(request.getfixturevalue("pg_server").new_database(), "host-a")
    try:
        yield s  # type: ignore[misc]  # both keep StoreBackend; the tests read it as Store
    finally:
        s.close()


def _accept(store: StoreBackend, table: ApiTable, root: Path, name: str, sha: str,
            callback: str | None = "http://127.0.0.1:9/hook", owner: str = "alice") -> int:
    job = table.accept(lambda: store.accept(-1, root, root / name, 1, 1.0, sha),
                       owner, ("md",), callback)
    assert job is not None
    return job.id


def _finish(store: StoreBackend, job_id: int, state: JobState) -> None:
    store.set_job_state(job_id, JobState.RUNNING)
    store.set_job_state(job_id, state)


def test_outbox_row_written_with_the_outcome(store: Store, tmp_path: Path) -> None:
    table = ApiTable.of(store)
    root = tmp_path / "inbox"
    done = _accept(store, table, root, "a.pdf", "a")
    failed = _accept(store, table, root, "b.pdf", "b")
    cancelled = _accept(store, table, root, "c.pdf", "c")
    silent = _accept(store, table, root, "d.pdf", "d", callback=None)
    watched = store.accept(0, tmp_path / "watch", tmp_path / "watch" / "e.pdf", 1, 1.0, "e")
    assert watched is not None
    _finish(store, done, JobState.DONE)
    _finish(store, failed, JobState.FAILED)
    store.cancel(cancelled)
    _finish(store, silent, JobState.DONE)
    _finish(store, watched.id, JobState.DONE)
    due = table.due(now=2e9)
    assert [(i.job_id, i.state) for i in due] == [(done, "done"), (failed, "failed")]
    assert due[0].url == "http://127.0.0.1:9/hook" and due[0].attempts == 0
    # A retried job that ends again is a second outcome: a second webhook.
    assert store.retry(failed)
    _finish(store, failed, JobState.DONE)
    assert [(i.job_id, i.state) for i in table.due(now=2e9)][-1] == (failed, "done")


def test_owner_is_recorded_with_the_job_or_not_at_all(store: Store, tmp_path: Path) -> None:
    """A failure inside the accept transaction leaves neither the job nor its owner."""
    table = ApiTable.of(store)
    root = tmp_path / "inbox"

    def accept_then_fail() -> None:
        store.accept(-1, root, root / "x.pdf", 1, 1.0, "x")
        raise InternalError("the owner's row could not be written")

    with pytest.raises(InternalError):
        table.accept(accept_then_fail, "alice", ("md",), None)  # type: ignore[arg-type]
    assert store.list_jobs() == []
    job_id = _accept(store, table, root, "y.pdf", "y", owner="bob")
    api = table.get(job_id)
    assert api is not None and (api.owner, api.outputs) == ("bob", ("md",))
    assert table.job_ids("bob", None, 10) == [job_id] and table.job_ids("alice", None, 10) == []


def test_repair_keeps_api_owners_and_owed_webhooks(tmp_path: Path) -> None:
    """``chandrad store repair`` rebuilds the SQLite store from its rows: an API job keeps
    its owner (its token still sees it) and a webhook not yet delivered is still owed."""
    state = tmp_path / "state"
    store = Store.open(state)
    try:
        table = ApiTable.of(store)
        job_id = _accept(store, table, tmp_path / "inbox", "a.pdf", "a")
        _finish(store, job_id, JobState.DONE)
    finally:
        store.close()
    assert repair(state).jobs == 1
    store = Store.open(state)
    try:
        table = ApiTable.of(store)
        assert table.job_ids("alice", None, 10) == [job_id]
        assert [(i.job_id, i.state) for i in table.due(now=2e9)] == [(job_id, "done")]
    finally:
        store.close()


def test_queue_position_counts_pending_jobs_ahead(store: Store, tmp_path: Path) -> None:
    table = ApiTable.of(store)
    root = tmp_path / "inbox"
    ids = [_accept(store, table, root, f"{i}.pdf", str(i)) for i in range(4)]
    assert [table.queue_position(i) for i in ids] == [0, 1, 2, 3]
    store.set_job_state(ids[0], JobState.RUNNING)
    assert [table.queue_position(i) for i in ids[1:]] == [0, 1, 2]
    assert table.queue_positions(ids) == {ids[1]: 0, ids[2]: 1, ids[3]: 2}
    assert table.queue_positions([ids[2]]) == {ids[2]: 1} and table.queue_positions([]) == {}


def test_attempts_backoff_and_giving_up(store: Store, tmp_path: Path) -> None:
    table = ApiTable.of(store)
    job = _accept(store, table, tmp_path / "inbox", "a.pdf", "a")
    _finish(store, job, JobState.DONE)
    item = table.due(now=2e9)[0]
    assert table.freeze_body(item.id, '{"first": 1}') == '{"first": 1}'
    assert table.freeze_body(item.id, '{"second": 2}') == '{"first": 1}'
    table.failed(item.id, "HTTP 500", next_at=1e10)
    assert table.due(now=2e9) == [] and [i.id for i in table.due(now=1e10)] == [item.id]
    table.failed(item.id, "HTTP 500", next_at=None)
    assert table.outbox_counts() == {"pending": 0, "delivered": 0, "undeliverable": 1}
    assert table.undeliverable()[0]["attempts"] == 2
    assert [backoff(n) for n in (1, 2, 3, 20)] == [1.0, 2.0, 4.0, 300.0]
    mac = hmac.new(b"k", b"5.{}", hashlib.sha256).hexdigest()
    assert sign(b"k", b"{}", 5) == f"t=5,v1={mac}"


def test_hosts_sharing_the_outbox_each_claim_other_webhooks(pg_server: PgServer,
                                                            tmp_path: Path) -> None:
    """Two hosts' senders on one PostgreSQL outbox, polling at the same moment: every due
    webhook goes to exactly one of them (FOR UPDATE SKIP LOCKED, then held); one claimed by
    a host that never reports an outcome (it died mid-attempt) is due again after the
    hold, with its frozen body, so it is still delivered."""
    url = pg_server.new_database()
    a, b = PgStore.open(url, "host-a"), PgStore.open(url, "host-b")
    try:
        ta, tb = ApiTable.of(a), ApiTable.of(b)
        root = tmp_path / "inbox"
        ids = [_accept(a, ta, root, f"{i}.pdf", f"{i:064d}") for i in range(24)]
        for job_id in ids:
            _finish(a, job_id, JobState.DONE)
        start = threading.Barrier(2)
        got: dict[str, list[int]] = {"a": [], "b": []}

        def claim(name: str, table: ApiTable) -> None:
            start.wait()
            while items := table.due(now=2e9, limit=3, hold_s=100.0):
                got[name] += [i.job_id for i in items]
                for item in items:
                    table.delivered(item.id)

        threads = [threading.Thread(target=claim, args=x) for x in (("a", ta), ("b", tb))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(got["a"] + got["b"]) == ids and got["a"] and got["b"], got
        assert ta.outbox_counts() == {"pending": 0, "delivered": 24, "undeliverable": 0}
        # A claim whose host died: held for hold_s, then due again for any host.
        _finish(a, _accept(a, ta, root, "late.pdf", "f" * 64), JobState.DONE)
        [item] = ta.due(now=2e9, hold_s=100.0)
        ta.freeze_body(item.id, '{"n": 1}')
        assert tb.due(now=2e9 + 99) == []
        [again] = tb.due(now=2e9 + 101)
        assert (again.id, again.body) == (item.id, '{"n": 1}')
    finally:
        a.close()
        b.close()


def _config(tmp_path: Path, tokens: str, mode: int, secret: str | None = None) -> Path:
    (tmp_path / "tokens").write_text(tokens)
    (tmp_path / "tokens").chmod(mode)
    extra = ""
    if secret is not None:
        (tmp_path / "secret").write_text(secret)
        (tmp_path / "secret").chmod(mode)
        extra = 'webhook_secret_file = "secret"\n'
    path = tmp_path / "c.toml"
    path.write_text(f'[[watch]]\ninput = "in"\n\n[api]\nenabled = true\n'
                    f'tokens_file = "tokens"\n{extra}')
    return path


@pytest.mark.parametrize(("tokens", "mode", "says"), [
    ("alice 0123456789abcdef0123\n", 0o644, "readable by others"),
    ("alice short\n", 0o600, "line 1"),
    ("# only a comment\n", 0o600, "no token"),
    ("alice 0123456789abcdef0123\nalice fedcba9876543210fedc\n", 0o600, "already given"),
    ("al/ice 0123456789abcdef0123\n", 0o600, "line 1"),
    ("alice 0123456789abcdef0123 root\n", 0o600, "line 1"),
])
def test_bad_tokens_file_is_a_config_error(tmp_path: Path, tokens: str, mode: int,
                                           says: str) -> None:
    path = _config(tmp_path, tokens, mode)
    cfg = parse_config(path.read_text(), path)
    with pytest.raises(ConfigError) as info:
        load_tokens(cfg)
    problem = info.value.problems[0]
    assert info.value.exit_code == ExitCode.CONFIG
    assert problem.key == "api.tokens_file" and says in problem.message and problem.line == 6


def test_tokens_and_secret_read(tmp_path: Path) -> None:
    path = _config(tmp_path, "# ops\nalice 0123456789abcdef0123  # laptop\n"
                   "root fedcba9876543210fedc admin\n", 0o600, secret="s" * 32 + "\n")
    cfg = parse_config(path.read_text(), path)
    tokens = load_tokens(cfg)
    alice, root = tokens.caller("0123456789abcdef0123"), tokens.caller("fedcba9876543210fedc")
    assert alice is not None and (alice.name, alice.admin) == ("alice", False)
    assert root is not None and root.admin and tokens.caller("0123456789abcdef012") is None
    assert load_secret(cfg) == b"s" * 32
    (tmp_path / "secret").chmod(0o604)
    with pytest.raises(ConfigError) as info:
        load_secret(cfg)
    assert info.value.problems[0].key == "api.webhook_secret_file"


@pytest.mark.parametrize(("raw", "kept"), [
    ("../../etc/passwd", "passwd"), ("..\\..\\x.pdf", "x.pdf"), ("/abs/p.pdf", "p.pdf"),
    ("..", "upload"), ("", "upload"), (None, "upload"), (".bashrc", "upload.bashrc"),
    ("a/", "upload"), ("ok name.pdf", "ok name.pdf"),
])
def test_safe_filename(raw: str | None, kept: str) -> None:
    assert safe_filename(raw) == kept


def test_safe_filename_has_no_control_characters_and_fits() -> None:
    name = safe_filename("new\nline\x00" + "é" * 300 + ".pdf")
    assert "\n" not in name and "\x00" not in name and len(name.encode()) <= 255


def test_sweep_removes_uploads_never_accepted(store: Store, tmp_path: Path) -> None:
    """At start, an upload renamed into the inbox whose accept never happened (the daemon
    died in between: no 202 was sent) and empty upload folders are removed; accepted ones
    stay."""
    uploads = UploadDir(tmp_path / "inbox", tmp_path / "tmp")
    uploads.prepare()
    root = (tmp_path / "inbox").resolve()
    for folder, name in (("a", "kept.pdf"), ("b", "orphan.pdf")):
        (root / folder).mkdir()
        (root / folder / name).write_bytes(b"%PDF-1.4")
    (root / "c").mkdir()
    (tmp_path / "tmp" / "half.part").write_bytes(b"%PDF")
    assert store.accept(-1, root, root / "a" / "kept.pdf", 8, 1.0, "k") is not None
    gone = uploads.sweep(lambda p: store.find_active(p) is not None)
    assert gone == [root / "b" / "orphan.pdf"]
    assert sorted(p.name for p in root.iterdir()) == ["a"]
    uploads.prepare()
    assert list((tmp_path / "tmp").iterdir()) == []
