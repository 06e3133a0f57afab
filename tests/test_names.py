"""Names that are not valid UTF-8, contain newlines or take 255 bytes, through the real
store (SQLite), the real output writer and mover on real filesystems, and a full tmpfs."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import fill_until_full

from chandrad import names
from chandrad.errors import OutputUnwritable
from chandrad.outputs import (
    PageOutput,
    error_json_path,
    move_to,
    output_dir_for,
    output_stem,
    write_document,
    write_error_json,
)
from chandrad.store import DB_NAME, MIGRATIONS, Store

LATIN1 = os.fsdecode(b"caf\xe9.pdf")
NEWLINE = "two\nlines.pdf"
LONG = (b"\xc3\xa9" * 125 + b"a.pdf").decode()  # 255 bytes
PAGES = [PageOutput(1, "ok", 1, None, 10, 10, markdown="# hi", html="<h1>hi</h1>")]


def test_display_escapes_undecodable_bytes_and_control_characters() -> None:
    assert names.display(LATIN1) == "caf\\xe9.pdf"
    assert names.display(NEWLINE) == "two\\x0alines.pdf"
    assert names.display("東京\t.pdf") == "東京\\x09.pdf"
    assert names.display(Path("/in") / LATIN1) == "/in/caf\\xe9.pdf"
    assert names.text("line1\nline " + LATIN1) == "line1\nline caf\\xe9.pdf"
    assert names.fsbytes(LATIN1) == b"caf\xe9.pdf"


def test_fit_keeps_short_names_and_shortens_long_ones_apart() -> None:
    assert names.fit(LATIN1, ".error.json") == LATIN1 + ".error.json"
    a = names.fit("é" * 200 + "x", ".error.json")
    b = names.fit("é" * 200 + "y", ".error.json")
    assert a != b
    for name in (a, b):
        assert names.size(name) <= names.NAME_MAX and name.endswith(".error.json")
        name.encode("utf-8")  # cut at a character boundary
    stem = names.output_name(Path(LONG).stem)
    assert names.size(stem) + names.OUTPUT_FILE_RESERVE <= names.NAME_MAX


def _claim(source: str) -> dict[str, object]:
    return {"source": names.display(source),
            "source_sha256": hashlib.sha256(source.encode("utf-8", "surrogateescape"))
            .hexdigest()}


@pytest.mark.parametrize("name", [LATIN1, NEWLINE, LONG])
def test_outputs_for_hostile_names_are_safe_and_inputs_keep_their_bytes(
    tmp_path: Path, name: str
) -> None:
    """Output dir and files: valid UTF-8, one line, within NAME_MAX; the input moves to
    done/ and, on a clash, to a shortened ' (1)' name; error.json fits beside it."""
    inbox, out, done = tmp_path / "in", tmp_path / "out", tmp_path / "done"
    (inbox / "sub").mkdir(parents=True)
    source = inbox / "sub" / name
    source.write_bytes(b"%PDF-1.4 one")
    out_dir = output_dir_for(out, inbox, source)
    written = write_document(out_dir, output_stem(source), PAGES, _claim(name), ("md", "json"))
    for path in [out_dir, *written]:
        path.name.encode("utf-8")
        assert "\n" not in path.name and names.size(path.name) <= names.NAME_MAX
    assert {p.name for p in written} >= {f"{output_stem(source)}.md"}
    final = move_to(done, inbox, source)
    assert os.fsencode(final) == os.fsencode(done / "sub" / name) and final.is_file()
    source.write_bytes(b"%PDF-1.4 two")
    second = move_to(done, inbox, source)
    assert second != final and second.read_bytes() == b"%PDF-1.4 two"
    assert names.size(second.name) <= names.NAME_MAX
    err = write_error_json(second, "cancelled", f"cannot read {second}", 1, {})
    assert err == error_json_path(second) and names.size(err.name) <= names.NAME_MAX
    body = json.loads(err.read_text("utf-8"))
    assert body["file"] == names.display(second.name)
    assert body["message"] == names.display(f"cannot read {second}").replace("\\x0a", "\n")


def test_store_keeps_exact_bytes_and_migrates_text_rows(tmp_path: Path) -> None:
    """Paths go in and come out with their exact bytes (BLOB); the queue shows display
    forms; a v1 database's text paths are converted and still found."""
    state = tmp_path / "state"
    state.mkdir()
    root = tmp_path / "in"
    old = sqlite3.connect(state / DB_NAME)
    old.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    old.execute("INSERT INTO schema_version VALUES (1)")
    old.executescript(MIGRATIONS[0])
    old.execute("INSERT INTO jobs (watch_index, input_root, path, abs_path, size, mtime, "
                "sha256, state, created_at, updated_at) VALUES (0, ?, 'old.pdf', ?, 1, 0, "
                "'aa', 'pending', 0, 0)", (str(root), str(root / "old.pdf")))
    old.commit()
    old.close()

    store = Store.open(state)
    try:
        assert store.schema_version() == len(MIGRATIONS)
        found = store.find_active(root / "old.pdf")
        assert found is not None and found.abs_path == root / "old.pdf"
        for i, name in enumerate((LATIN1, NEWLINE, LONG)):
            job = store.accept(0, root, root / name, 1, 0.0, f"{i:064x}")
            assert job is not None and os.fsencode(job.abs_path) == os.fsencode(root / name)
            assert store.find_active(root / name) == job
            assert job.to_dict()["path"] == names.display(name)
            store.set_job_state(job.id, job.state.RUNNING)
            store.set_job_state(job.id, job.state.FAILED, error_code="x",
                                error_message=f"cannot open {root / name}",
                                final_path=tmp_path / "failed" / name)
            failed = store.get(job.id)
            assert failed is not None and failed.final_path == tmp_path / "failed" / name
            assert failed.error_message == f"cannot open {names.text(str(root / name))}"
    finally:
        store.close()


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 256 KiB tmpfs (tests run as root), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "full"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                   check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_output_disk_is_output_unwritable_and_leaves_nothing_half_written(
    tiny_tmpfs: Path
) -> None:
    """ENOSPC while writing a document: OutputUnwritable with errno and path, and no
    output directory or temp file left; once space is back the same call succeeds."""
    filler = tiny_tmpfs / "filler"
    fill_until_full(filler)
    out_dir = tiny_tmpfs / "out" / "report"
    big = [PageOutput(1, "ok", 1, None, 10, 10, markdown="x" * 20000, html="y" * 20000)]
    with pytest.raises(OutputUnwritable) as caught:
        write_document(out_dir, "report", big, _claim("report.pdf"), ("md", "html", "json"))
    assert caught.value.code == "output_unwritable"
    assert caught.value.details["errno"] == errno.ENOSPC
    assert not out_dir.exists(), list(out_dir.iterdir())
    assert sorted(p.name for p in tiny_tmpfs.rglob("*")) in (["filler"], ["filler", "out"])
    filler.unlink()
    written = write_document(out_dir, "report", big, _claim("report.pdf"), ("md", "html"))
    assert (out_dir / "report_metadata.json") in written
