"""Shared pytest fixtures: the tiny engine model, free TCP ports, the corpus, the vLLM interpreter.

Owns only fixtures that many test modules need; module-specific helpers live with their tests.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import daemon_harness
import loop_model
import pytest
import tiny_chandra2
from pg_server import PgServer
from tiny_model import build_tiny_model, cache_dir

REPO_ROOT = Path(__file__).resolve().parents[1]


def _cache_root() -> Path:
    """Return where built test artefacts are kept between sessions."""
    env = os.environ.get("CHANDRAD_TEST_CACHE")
    return Path(env) if env else REPO_ROOT / ".tiny-model"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny Idefics3 model directory, built once and reused across sessions."""
    return build_tiny_model(cache_dir(_cache_root()))


@pytest.fixture(scope="session")
def tiny_chandra2_dir() -> Path:
    """The tiny model of chandra-ocr-2's architecture (tests/tiny_chandra2.py: Qwen3.5,
    hybrid Gated DeltaNet + full attention), built once and reused across sessions."""
    return tiny_chandra2.build_tiny_chandra2(tiny_chandra2.cache_dir(_cache_root()))


@pytest.fixture(scope="session")
def loop_model_dir() -> Path:
    """The tiny model's variant whose greedy answer is a repetition loop (tests/loop_model.py),
    built once and reused across sessions like the tiny model."""
    return loop_model.build_loop_model(loop_model.cache_dir(_cache_root()))


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """A real PostgreSQL cluster for the session (tests/pg_server.py); tests take a fresh
    database each with ``pg_server.new_database()``."""
    server = PgServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def hosts(pg_server: PgServer) -> Iterator[Callable[..., Any]]:
    """``hosts(host_id, lease_s=30.0)`` opens a PostgreSQL store (``PgStore``) as that host
    on one fresh database per test; all are closed at the end."""
    from chandrad.store.postgres import PgStore

    url = pg_server.new_database()
    opened: list[PgStore] = []

    def open_host(host: str, lease_s: float = 30.0) -> PgStore:
        store = PgStore.open(url, host, lease_s)
        opened.append(store)
        return store

    yield open_host
    for store in opened:
        store.close()


@pytest.fixture(scope="session")
def free_port() -> Callable[[], int]:
    """A function returning a currently free localhost TCP port."""
    return daemon_harness.free_port


@pytest.fixture
def read_only_mount() -> Callable[[Path], contextlib.AbstractContextManager[None]]:
    """``with read_only_mount(folder):`` makes ``folder`` read-only for the block: a
    read-only bind mount of itself (the tests run as root, which ignores file modes),
    unmounted on leaving. Skips the test where ``mount --bind`` is refused."""

    @contextlib.contextmanager
    def read_only(folder: Path) -> Iterator[None]:
        if subprocess.run(["mount", "--bind", str(folder), str(folder)],
                          capture_output=True).returncode != 0:
            pytest.skip(f"needs mount --bind (root with CAP_SYS_ADMIN) for a read-only "
                        f"{folder.name}/")
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)
            yield
        finally:
            subprocess.run(["umount", str(folder)], check=True)

    return read_only


#: The test documents, kept in the repository (``tests/corpus/README.md``). The one place
#: that names them: tests take the ``corpus_dir`` fixture, or ``CORPUS_DIR`` where a path is
#: needed at collection time (parametrize lists, module constants).
CORPUS_DIR = REPO_ROOT / "tests" / "corpus"


def corpus_manifest() -> list[dict[str, str]]:
    """The rows of ``tests/corpus/MANIFEST.tsv``; a missing manifest raises, never yields []."""
    with (CORPUS_DIR / "MANIFEST.tsv").open(encoding="utf-8", newline="") as fh:
        return list(csv.DictReader(fh, delimiter="\t"))


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    """The test corpus in the checkout (``tests/corpus``); fails loudly when it is missing."""
    if not (CORPUS_DIR / "MANIFEST.tsv").is_file():
        pytest.fail(f"test corpus not found: {CORPUS_DIR}/MANIFEST.tsv is missing")
    return CORPUS_DIR


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The interpreter that can run `-m vllm.entrypoints.openai.api_server`."""
    if importlib.util.find_spec("vllm") is None:
        message = f"vllm is not installed for {sys.executable}; run scripts/setup.sh"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return Path(sys.executable)


@pytest.fixture(scope="session")
def as_nobody() -> list[str]:
    """The command prefix that runs a client as user ``nobody`` (a second uid, for the
    control socket's permission tiers); skips where that cannot run chandrad: not root,
    no such user, or a checkout (or interpreter) ``nobody`` cannot read, such as a clone
    inside a ``mktemp -d`` directory (mode 0700)."""
    if os.geteuid() != 0:
        pytest.skip("permission tiers need root to run a client as another uid")
    prefix = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    probe = subprocess.run([*prefix, sys.executable, "-c", "import chandrad.ctl.main"],
                           capture_output=True, text=True, cwd="/", check=False)
    if probe.returncode != 0:
        pytest.skip(f"user nobody cannot run {sys.executable}: {probe.stderr.strip()[-200:]}")
    return prefix
