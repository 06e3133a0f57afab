"""The PostgreSQL store shared by several hosts, on a real server (tests/pg_server.py):
a file accepted once however many hosts see it, jobs claimed by one host, leases that
expire and are taken over, a host that lost its lease fenced off, a server restart."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from pg_server import PgServer

from chandrad.errors import HostIdInUse, LeaseLost, PageTaken, StoreUnreachable
from chandrad.states import JobState, PageState
from chandrad.store.pg_database import PgDatabase, session_params
from chandrad.store.postgres import PgStore

ROOT = Path("/in")


def _accept(store: PgStore, name: str, sha: str = "a" * 64) -> int | None:
    job = store.accept(0, ROOT, ROOT / name, 1, 0.0, sha)
    return None if job is None else job.id


def test_hosts_accepting_the_same_files_at_once_make_one_job_each(
        hosts: Callable[..., PgStore]) -> None:
    """Two hosts watching one inbox accept the same 150 files at the same moment: each
    file becomes one job (the open jobs' unique (path, content) index, ON CONFLICT)."""
    a, b = hosts("host-a"), hosts("host-b")
    names = [f"f{i:03d}.pdf" for i in range(150)]
    start = threading.Barrier(2)
    made: dict[str, list[int]] = {"host-a": [], "host-b": []}

    def accept_all(store: PgStore) -> None:
        start.wait()
        for name in names:
            job_id = _accept(store, name, (name.encode().hex() * 8)[:64])
            if job_id is not None:
                made[store.host].append(job_id)

    threads = [threading.Thread(target=accept_all, args=(s,)) for s in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    jobs = a.list_jobs(limit=1000)
    assert len(jobs) == len(names) == len(made["host-a"]) + len(made["host-b"])
    assert sorted(j.path.name for j in jobs) == names


def test_hosts_claim_disjoint_jobs(hosts: Callable[..., PgStore]) -> None:
    """``next_jobs`` leases what it returns: a second host gets the others, never the same."""
    a, b = hosts("host-a"), hosts("host-b")
    ids = [_accept(a, f"f{i}.pdf", f"{i:064d}") for i in range(5)]
    first = [j.id for j in a.next_jobs([ROOT], (), 3)]
    second = [j.id for j in b.next_jobs([ROOT], (), 10)]
    assert first == ids[:3] and second == ids[3:]
    assert [j.id for j in b.next_jobs([ROOT], (), 10)] == ids[3:]  # its own; a's hold
    assert [j.id for j in a.next_jobs([ROOT], (), 10)] == ids[:3]  # its own, again
    assert a.owner(first[0])[0] == "host-a"


def test_a_silent_hosts_job_is_taken_over_and_the_old_host_is_fenced(
        hosts: Callable[..., PgStore]) -> None:
    """A host that stops renewing loses its job after ``lease_s``; another host takes it
    over with its done pages kept, and the first host's later steps change nothing."""
    a, b = hosts("host-a", lease_s=1.0), hosts("host-b", lease_s=1.0)
    job_id = _accept(a, "doc.pdf")
    assert job_id is not None and [j.id for j in a.next_jobs([ROOT], (), 5)] == [job_id]
    a.set_job_state(job_id, JobState.RUNNING)
    a.init_pages(job_id, 3)
    a.claim_page(job_id, 0)
    a.finish_page(job_id, 0, result={"markdown": "p1"}, width=1, height=1, seconds=0.1)
    a.claim_page(job_id, 1)
    a._keeper.stop()  # host a goes silent (its process would be gone)
    assert b.next_jobs([ROOT], (), 5) == []  # not yet expired
    time.sleep(1.2)
    taken = b.next_jobs([ROOT], (), 5)
    assert [j.id for j in taken] == [job_id] and taken[0].state is JobState.RUNNING
    assert b.owner(job_id)[0] == "host-b"
    assert (a.takeovers, b.takeovers) == (0, 1)  # chandrad_lease_takeovers_total
    assert b.next_jobs([ROOT], (), 5) and b.takeovers == 1  # its own job again: none
    b.release_page(job_id, 1)  # what JobRunner.run does with in-flight pages it finds
    with pytest.raises(LeaseLost):
        a.finish_page(job_id, 1, result={"markdown": "late"}, width=1, height=1, seconds=1)
    with pytest.raises(LeaseLost):
        a.set_job_state(job_id, JobState.DONE)
    pages = b.pages(job_id)
    assert [p.state for p in pages] == [PageState.DONE, PageState.PENDING, PageState.PENDING]
    assert pages[0].result == {"markdown": "p1"} and pages[1].releases == 1
    assert pages[1].attempts == 0


def test_heartbeat_keeps_a_live_hosts_lease(hosts: Callable[..., PgStore]) -> None:
    """A live host renews its leases every third of ``lease_s``: no other host gets its
    job, however long it runs."""
    a, b = hosts("host-a", lease_s=1.0), hosts("host-b", lease_s=1.0)
    job_id = _accept(a, "doc.pdf")
    assert [j.id for j in a.next_jobs([ROOT], (), 5)] == [job_id]
    time.sleep(2.5)
    assert b.next_jobs([ROOT], (), 5) == [] and a._keeper.beats >= 4


def test_release_and_recovery_touch_only_this_hosts_pages(
        hosts: Callable[..., PgStore], pg_server: PgServer) -> None:
    """An engine that died gives back its own host's in-flight pages, never another's;
    so does a host opening the store again after a crash."""
    a, b = hosts("host-a", lease_s=1.0), hosts("host-b")
    ja, jb = _accept(a, "a.pdf", "1" * 64), _accept(b, "b.pdf", "2" * 64)
    assert ja is not None and jb is not None
    for store, job_id in ((a, ja), (b, jb)):
        store.set_job_state(job_id, JobState.RUNNING)
        store.init_pages(job_id, 2)
        store.claim_page(job_id, 0)
    assert a.release_all_in_flight() == 1
    assert b.page(jb, 0).state is PageState.IN_FLIGHT  # type: ignore[union-attr]
    a.claim_page(ja, 0)
    a._keeper.stop()  # host a crashed (no clean close) ...
    again = hosts("host-a")  # ... and started again: its own in-flight pages go back
    assert again.recovered.pages_released == 1 and again.recovered.jobs_running == 1
    assert b.page(jb, 0).state is PageState.IN_FLIGHT  # type: ignore[union-attr]


def test_learned_profiles_are_per_host(hosts: Callable[..., PgStore]) -> None:
    """A profile learned on one host's GPUs is not another host's."""
    a, b = hosts("host-a"), hosts("host-b")
    a.save_learned_profile("model|gpu", {"max_num_seqs": 8})
    assert a.load_learned_profile("model|gpu") == {"max_num_seqs": 8}
    assert b.load_learned_profile("model|gpu") is None


def test_unreachable_server_is_store_unreachable(tmp_path: Path) -> None:
    """No server behind the URL: a typed StoreUnreachable naming the store, at once."""
    url = f"postgresql://chandrad@/x?host={tmp_path}&port=5432"
    with pytest.raises(StoreUnreachable) as err:
        PgStore.open(url, "host-a")
    assert str(tmp_path) in err.value.message and "cannot be reached" in err.value.message


def test_server_restart_costs_one_refused_call_and_loses_nothing(
        hosts: Callable[..., PgStore], pg_server: PgServer) -> None:
    """``pg_ctl restart`` under an open store: the next call says StoreUnreachable (the
    caller waits as for a full store), the one after reconnects; every row is there."""
    a = hosts("host-a")
    job_id = _accept(a, "doc.pdf")
    assert job_id is not None
    a.init_pages(job_id, 2)
    pg_server.restart()
    t0 = time.monotonic()
    try:
        a.claim_page(job_id, 0)
    except StoreUnreachable:
        a.claim_page(job_id, 0)
    reconnect_s = time.monotonic() - t0
    assert a.page(job_id, 0).state is PageState.IN_FLIGHT  # type: ignore[union-attr]
    assert [j.id for j in a.list_jobs()] == [job_id] and reconnect_s < 5


def test_a_second_live_host_with_the_same_id_is_refused(
        hosts: Callable[..., PgStore]) -> None:
    """Two live hosts with one ``daemon.host_id`` would run each other's jobs twice: the
    second is refused once it has seen the first's heartbeat; a host that stopped cleanly
    frees its id at once."""
    first = hosts("host-a", lease_s=1.0)
    with pytest.raises(HostIdInUse) as refused:
        hosts("host-a", lease_s=1.0)
    assert "host-a" in refused.value.message and refused.value.exit_code == 78
    first.close()
    t0 = time.monotonic()
    hosts("host-a", lease_s=1.0)
    assert time.monotonic() - t0 < 0.5


def test_a_down_server_costs_later_calls_one_attempt_not_the_reconnect_wait(
        hosts: Callable[..., PgStore], pg_server: PgServer) -> None:
    """A server that stays down: the first call waits out the reconnect window (a restart
    would be back by then), later calls try once and say StoreUnreachable at once, so a
    reader (status, a scrape) never stalls the daemon's loop; the server back, the next
    call reads again."""
    a = hosts("host-a")
    job_id = _accept(a, "doc.pdf")
    pg_server.stop()
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreUnreachable):
            a.counts()
        first_s = time.monotonic() - t0
        t1 = time.monotonic()
        with pytest.raises(StoreUnreachable):
            a.counts()
        later_s = time.monotonic() - t1
    finally:
        pg_server.start()
    assert first_s >= 3.0 and later_s < 0.5, (first_s, later_s)
    assert a.counts().get("pending") == 1 and a.get(job_id) is not None  # type: ignore[arg-type]
    print(f"down server: first call {first_s:.2f} s, later calls {later_s * 1000:.0f} ms")


def test_a_hosts_sessions_bound_a_silent_peer_by_its_lease(pg_server: PgServer) -> None:
    """A host's connections give a silent server a third of the lease (TCP user timeout,
    keepalives, both ends) and end a transaction left idle for the lease, so that a host
    cut off mid-transaction does not hold its row locks; the URL's own settings win."""
    url = pg_server.new_database()

    def idle_tx_timeout(url: str) -> str:
        db = PgDatabase.connect(url, lease_s=6.0)
        try:
            return str(db.conn.execute("SHOW idle_in_transaction_session_timeout"
                                       ).fetchone()[0])
        finally:
            db.close()

    assert idle_tx_timeout(url) == "6s"
    assert idle_tx_timeout(url + "&options=-c%20idle_in_transaction_session_timeout%3D9s"
                           ) == "9s"
    params = session_params(url, 6.0)
    assert params["tcp_user_timeout"] == 2000 and params["keepalives"] == 1
    assert "-c tcp_user_timeout=2000 " in params["options"]
    assert "tcp_user_timeout" not in session_params(url + "&tcp_user_timeout=500", 6.0)


def test_pages_of_a_running_job_are_leased_to_a_helper_and_fenced_by_page(
        hosts: Callable[..., PgStore]) -> None:
    """A helper leases pending pages of another live host's running job, last first;
    the owner's steps on them raise PageTaken; the helper's heartbeat renews them; a
    silent helper's pages expire, the owner takes them back, and the helper's late
    answer is refused (PageTaken) while the page it stored before is kept."""
    a, b = hosts("host-a", lease_s=1.0), hosts("host-b", lease_s=1.0)
    job_id = _accept(a, "doc.pdf")
    assert job_id is not None and [j.id for j in a.next_jobs([ROOT], (), 5)] == [job_id]
    assert b.claim_helped_pages([ROOT], 2) == []  # pending, not running: nothing to help
    a.set_job_state(job_id, JobState.RUNNING)
    a.init_pages(job_id, 5)
    assert a.claim_helped_pages([ROOT], 5) == []  # its own job: not helping
    claimed = b.claim_helped_pages([ROOT], 2)
    assert [(j.id, i) for j, i in claimed] == [(job_id, 3), (job_id, 4)]
    assert [p.holder for p in a.pages(job_id)] == [None, None, None, "host-b", "host-b"]
    with pytest.raises(PageTaken):
        a.claim_page(job_id, 4)  # the owner leaves it to the helper
    b.claim_page(job_id, 4, helped=True)
    b.finish_page(job_id, 4, result={"markdown": "p5"}, width=1, height=1, seconds=0.1,
                  helped=True)
    b.claim_page(job_id, 3, helped=True)
    with pytest.raises(PageTaken):
        b.claim_page(job_id, 2, helped=True)  # not leased to it
    time.sleep(1.2)  # longer than the lease: the heartbeat (every lease_s / 3) kept it
    assert a.reclaim_pages(job_id) == 0
    b._keeper.stop()  # host b goes silent
    time.sleep(1.2)
    assert a.reclaim_pages(job_id) == 1
    with pytest.raises(PageTaken):
        b.finish_page(job_id, 3, result={"markdown": "late"}, width=1, height=1, seconds=1,
                      helped=True)
    pages = a.pages(job_id)
    assert [(p.state, p.holder) for p in pages[3:]] == [
        (PageState.PENDING, None), (PageState.DONE, "host-b")]
    assert pages[3].attempts == 0 and pages[3].releases == 1
    assert pages[4].result == {"markdown": "p5"} and b.pages_helped == 1
    a.claim_page(job_id, 3)  # the owner's again
