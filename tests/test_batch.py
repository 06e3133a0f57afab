"""`chandrad batch` without an engine: the plan of inputs and their output names, staging for
a resume, and the refusals (bad config 78, a daemon on the same state dir 78, a missing
input 2), each through the real command where the command is the point.

The runs with the real engine (progress, Ctrl-C, resume, exit 0/1) are in
``test_batch_engine.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from daemon_harness import config_toml, table
from test_daemon_service import base_env
from waiting import exited, wait_until

from chandrad.batch import Entry, batch_config, plan, stage
from chandrad.config import parse_config
from chandrad.daemon.wiring import open_store
from chandrad.errors import BatchInputError
from chandrad.store import DB_NAME, Store


def _batch(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "chandrad", "batch", *argv],
                          capture_output=True, text=True, timeout=timeout, env=base_env())


def _files(root: Path, *names: str) -> list[Path]:
    out = []
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(name.encode())
        out.append(path)
    return out


def test_plan_lays_out_files_like_a_watch_and_resolves_clashes(tmp_path: Path) -> None:
    """A file argument lands at the top; a folder's files keep their paths inside it (as a
    daemon watching that folder lays them out); a name an earlier argument took gets ` (1)`;
    inside folders the watcher's ignore rules apply and symlinks are not followed; a file
    named twice is one entry."""
    src = tmp_path / "src"
    _files(src, "a.pdf", "scans/a.pdf", "scans/sub/b.png", "scans/.hidden.pdf",
           "scans/c.pdf.part", "scans/~$lock.pdf")
    (src / "scans" / "link.pdf").symlink_to(src / "a.pdf")
    entries = plan([src / "a.pdf", src / "scans", src / "a.pdf"], tmp_path / "out")
    assert [(e.source, e.rel) for e in entries] == [
        (src / "a.pdf", Path("a.pdf")),
        (src / "scans" / "a.pdf", Path("a (1).pdf")),
        (src / "scans" / "sub" / "b.png", Path("sub/b.png")),
    ]


def test_plan_refuses_missing_inputs_and_inputs_inside_the_output(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "x").mkdir(parents=True)
    with pytest.raises(BatchInputError, match="no such file"):
        plan([tmp_path / "missing.pdf"], out)
    with pytest.raises(BatchInputError, match="inside the output"):
        plan([out / "x"], out)
    # an output folder inside an input folder is skipped, not taken as input
    _files(tmp_path, "in/doc.pdf", "in/out2/doc/doc.md")
    assert [e.rel for e in plan([tmp_path / "in"], tmp_path / "in" / "out2")] == [
        Path("doc.pdf")]


@pytest.mark.parametrize("store", ["postgresql://db.example/chandrad", "sqlite:queue"])
def test_a_batch_keeps_its_own_sqlite_store_whatever_daemon_store_names(
        tmp_path: Path, store: str) -> None:
    """The daemon's config on a cluster host (a PostgreSQL store, the HTTP API on) or with
    its SQLite store elsewhere: the batch opens a SQLite store in ``DIR/.chandrad/`` and
    serves no API; it never joins the shared queue nor touches the daemon's store."""
    tokens = tmp_path / "tokens"
    text = (f'[daemon]\nstore = "{store}"\nhost_id = "gpu-1"\n[api]\nenabled = true\n'
            f'tokens_file = "{tokens}"\nfolder = "/srv/spool/api"\n')
    cfg = batch_config(parse_config(text, tmp_path / "c.toml"), tmp_path / "out")
    opened = open_store(cfg)
    try:
        assert isinstance(opened, Store)
        assert opened.path == tmp_path / "out" / ".chandrad" / DB_NAME
    finally:
        opened.close()
    assert cfg.api_watch() is None


def test_stage_links_resumes_skips_done_and_retries_failed(tmp_path: Path) -> None:
    """Staging hard-links (the source stays where it is), leaves a file staged by an earlier
    run alone (its job resumes), does not stage again what that run finished (same size and
    mtime in done/), and clears an earlier failure (the file is tried again)."""
    cfg = batch_config(parse_config("", tmp_path / "c.toml"), tmp_path / "out").watch[0]
    for folder in (cfg.input, cfg.done, cfg.failed):
        folder.mkdir(parents=True)
    new, staged, done, failed = _files(tmp_path / "src", "new.pdf", "staged.pdf", "done.pdf",
                                       "failed.pdf")
    os.link(staged, cfg.input / "staged.pdf")
    os.link(done, cfg.done / "done.pdf")
    os.link(failed, cfg.failed / "failed.pdf")
    (cfg.failed / "failed.pdf.error.json").write_text("{}")
    entries = [Entry(p, Path(p.name)) for p in (new, staged, done, failed)]
    stage(entries, cfg)
    assert [e.already_done for e in entries] == [False, False, True, False]
    assert (cfg.input / "new.pdf").stat().st_ino == new.stat().st_ino
    assert (cfg.input / "failed.pdf").exists() and not (cfg.failed / "failed.pdf").exists()
    assert not (cfg.failed / "failed.pdf.error.json").exists()
    assert not (cfg.input / "done.pdf").exists()
    assert all(p.exists() for p in (new, staged, done, failed))
    # a source changed since it was staged is staged again (the pipeline sees new content)
    staged.write_bytes(b"changed, and longer than before")
    stage(entries[1:2], cfg)
    assert (cfg.input / "staged.pdf").read_bytes() == b"changed, and longer than before"


def test_bad_config_exits_78_naming_the_key(tmp_path: Path) -> None:
    (tmp_path / "doc.pdf").write_bytes(b"%PDF-1.4\n%%EOF\n")
    config = tmp_path / "chandrad.toml"
    config.write_text("[ocr]\nretries = -1\n")
    result = _batch("--config", str(config), str(tmp_path / "doc.pdf"), "--output",
                    str(tmp_path / "out"))
    assert result.returncode == 78, result.stdout + result.stderr
    assert "ocr.retries" in result.stderr


def test_missing_input_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "chandrad.toml"
    config.write_text("")
    result = _batch("--config", str(config), str(tmp_path / "nope.pdf"), "--output",
                    str(tmp_path / "out"))
    assert result.returncode == 2 and "nope.pdf: no such file" in result.stderr, result


def test_refuses_to_run_beside_a_daemon_on_the_same_state_dir(
        tmp_path: Path, free_port: Callable[[], int]) -> None:
    """A real `chandrad run` whose daemon.state_dir is the batch's (<output>/.chandrad) holds
    the lock: the batch exits 78 naming --output and the daemon's pid, and touches nothing."""
    out = tmp_path / "out"
    config = tmp_path / "daemon.toml"
    config.write_text(config_toml(
        state_dir=out / ".chandrad", watch={"input": tmp_path / "inbox", "create_input": True},
        engine=table("engine", {"url": f"http://127.0.0.1:{free_port()}"}),
        socket=tmp_path / "ctl.sock", tables=table("metrics", {"listen": ""})))
    log = tmp_path / "daemon.log"
    with log.open("ab") as daemon_log:  # the daemon keeps its own copy
        daemon = subprocess.Popen([sys.executable, "-m", "chandrad", "run", "--config",
                                   str(config)], stdout=daemon_log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, env=base_env())
    try:
        wait_until(lambda: (tmp_path / "ctl.sock").exists(), 60, "the control socket",
                   gone=exited(daemon), context=log.read_text)
        (tmp_path / "doc.pdf").write_bytes(b"%PDF-1.4\n%%EOF\n")
        empty = tmp_path / "batch.toml"
        empty.write_text("")
        result = _batch("--config", str(empty), str(tmp_path / "doc.pdf"), "--output", str(out))
        assert result.returncode == 78, result.stdout + result.stderr
        assert "--output" in result.stderr and str(daemon.pid) in result.stderr, result.stderr
        assert not (out / ".chandrad" / "inbox").exists()
        assert daemon.poll() is None
    finally:
        daemon.terminate()
        assert daemon.wait(60) == 0, log.read_text()[-3000:]
