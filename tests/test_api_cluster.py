"""The HTTP job API on a shared PostgreSQL store: two real daemons, one database, one
uploads folder (``api.folder``, the shared spool's), one stand-in engine (``engine.url``).

A job posted to host A's API is run by host B (A is paused), and its state and outputs
are served by both hosts' APIs; its webhook is delivered once, although both hosts run a
sender on the one outbox and the receiver answers slowly (the other host polls while the
first host's POST is in progress).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg
import pytest
from api_harness import ALICE, BOB, ROOT, SECRET, auth, receiving, upload, verify, wait_final
from daemon_harness import TomlValue, free_port, table
from faults.faultkit import Daemon
from pg_server import PgServer
from standin_engine import StandinServer
from waiting import wait_until

DOC = "digital_sf424-federal-form.pdf"


@dataclass
class ApiHost(Daemon):
    """A harness daemon on the shared folders under ``shared`` and a PostgreSQL store."""

    shared: Path = Path()
    store: str = ""
    host_id: str = ""

    def config_text(self) -> str:
        text = super().config_text()
        keys = f'store = "{self.store}"\nhost_id = "{self.host_id}"\nlease_s = 3\n'
        return text.replace("[daemon]\n", "[daemon]\n" + keys, 1)

    @property
    def folders(self) -> Path:
        return self.shared


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[StandinServer]:
    server = StandinServer(tmp_path / "engine", {"delay_s": 0.05}).start()
    try:
        yield server
    finally:
        server.stop()


def _host(tmp_path: Path, name: str, url: str, engine: StandinServer,
          callback: str) -> tuple[ApiHost, str]:
    """A host with ``[api]`` on, the same tokens, key and uploads folder as the others."""
    root = tmp_path / name
    root.mkdir()
    tokens, secret = root / "api-tokens", root / "webhook-secret"
    tokens.write_text(f"alice {ALICE}\nbob {BOB}\nroot {ROOT} admin\n")
    secret.write_text(SECRET + "\n")
    for f in (tokens, secret):
        f.chmod(0o600)
    port = free_port()
    api: dict[str, TomlValue] = {
        "enabled": True, "listen": f"127.0.0.1:{port}", "tokens_file": tokens,
        "webhook_secret_file": secret, "callback_url": callback,
        "folder": tmp_path / "spool" / "api", "formats": ["md", "html"]}
    d = ApiHost(root, f'[engine]\nurl = "{engine.url}"\n', settle=0.3, poll_interval=0.3,
                tables=table("api", api) + '[metrics]\nlisten = ""\n',
                shared=tmp_path / "spool", store=url, host_id=name)
    return d, f"http://127.0.0.1:{port}"


def test_a_job_posted_on_one_host_runs_on_another_and_is_served_by_both(
        tmp_path: Path, pg_server: PgServer, engine: StandinServer, corpus_dir: Path) -> None:
    url = pg_server.new_database()
    with receiving(delay_s=1.5) as receiver:  # both senders poll while one is sending
        (a, base_a), (b, base_b) = (_host(tmp_path, n, url, engine, receiver.url)
                                    for n in ("host-a", "host-b"))
        try:
            for d in (a, b):
                d.start()
            for d in (a, b):
                d.wait_answering(60)
            a.ctl("pause")  # host a starts no job: the one posted to it must run on b
            posted = upload(base_a, corpus_dir / "good" / DOC)
            assert posted.status_code == 202, posted.text
            job_id = posted.json()["id"]
            on_b = wait_final(base_b, job_id, d=b)
            assert on_b["state"] == "done" and on_b["owner"] == "alice", on_b
            with psycopg.connect(url) as conn:
                owner = conn.execute("SELECT owner FROM jobs WHERE id = %s",
                                     (job_id,)).fetchone()
            assert owner == ("host-b",)
            results = [httpx.get(f"{base}/v1/jobs/{job_id}/result", params={"format": "md"},
                                 headers=auth(ALICE), timeout=10) for base in (base_a, base_b)]
            assert [r.status_code for r in results] == [200, 200]
            assert results[0].text == results[1].text and "stand-in" in results[0].text
            other = httpx.get(f"{base_a}/v1/jobs/{job_id}", headers=auth(BOB), timeout=10)
            assert other.status_code == 404  # the owner travels with the job
            wait_until(lambda: receiver.accepted(job_id), 30, "the webhook",
                       context=lambda: a.tail(20) + b.tail(20))
            time.sleep(2.0)  # both senders poll every 0.5 s: a second POST would be in
            [delivery] = receiver.for_job(job_id)
            assert verify(SECRET, delivery.headers["Chandrad-Signature"], delivery.body)
        finally:
            for d in (a, b):
                d.cleanup()
