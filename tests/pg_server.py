"""A real PostgreSQL server for tests: Debian's ``postgresql`` binaries, a private cluster.

:class:`PgServer` runs ``initdb`` and ``pg_ctl`` in a temporary directory, listening on a
Unix socket there only (no TCP port to collide with), trust authentication; with ``listen``
it also listens on those TCP addresses (and trusts the subnets they are on: hosts in
network namespaces, tests/netns.py), on a free ``port``. PostgreSQL
refuses to run as root: as root the cluster is run by ``nobody`` (``runuser``). Each test
gets a database of its own (:meth:`PgServer.new_database`).
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import psycopg

PG_BIN = Path(os.environ.get("CHANDRAD_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))
SUPERUSER = "chandrad"
PORT = 5432  # without listen, the Unix socket's name only: no TCP port


class PgServer:
    """One PostgreSQL cluster in a temporary directory."""

    def __init__(self, listen: Sequence[str] = (), port: int = PORT) -> None:
        if not (PG_BIN / "initdb").exists():
            raise RuntimeError(f"{PG_BIN}/initdb not found: install Debian's postgresql "
                               "(scripts/setup.sh does) or set CHANDRAD_TEST_PG_BIN")
        # Not under pytest's tmp dir: it is private to root, and the server runs as nobody.
        self.root = Path(tempfile.mkdtemp(prefix="chandrad-pg-"))
        self.data = self.root / "data"
        self.socket_dir = self.root
        self._names = itertools.count()
        self.listen = tuple(listen)
        self.port = port
        self._as_user: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.root, "nobody")
            self._as_user = ["runuser", "-u", "nobody", "--"]

    def _run(self, *args: str) -> None:
        subprocess.run([*self._as_user, *args], check=True, capture_output=True, timeout=60)

    def start(self) -> PgServer:
        if not self.data.exists():
            self._run(str(PG_BIN / "initdb"), "-D", str(self.data), "-U", SUPERUSER,
                      "--auth=trust", "--no-sync", "-E", "UTF8")
            if self.listen:
                with (self.data / "pg_hba.conf").open("a") as hba:
                    hba.write("host all all samenet trust\n")
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-w", "-l",
                  str(self.root / "log"), "-o", self._options(), "start")
        return self

    def _options(self) -> str:
        return (f"-k {self.socket_dir} -c listen_addresses='{','.join(self.listen)}' "
                f"-p {self.port} -c fsync=off -c full_page_writes=off")

    def stop(self) -> None:
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-w", "-m", "fast", "stop")

    def restart(self) -> None:
        """``pg_ctl restart``: every connection is cut."""
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-w", "-m", "fast", "-l",
                  str(self.root / "log"), "-o", self._options(), "restart")

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@/{dbname}?host={self.socket_dir}&port={self.port}"

    def tcp_url(self, address: str, dbname: str) -> str:
        """The URL of ``dbname`` over TCP at ``address`` (one of ``listen``)."""
        return f"postgresql://{SUPERUSER}@{address}:{self.port}/{dbname}"

    def new_database(self) -> str:
        """A fresh, empty database; returns its URL."""
        name = f"t{os.getpid()}_{next(self._names)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def close(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
