"""Faults in the folders around a running job, and hostile names and files, on the real daemon.

Read-only ``done/`` (a read-only bind mount: root ignores file modes), the output folder
deleted mid-job, the input deleted, truncated or replaced while its pages are in flight,
awkward names, symlink and hardlink tricks out of the watched root, a
PDF whose page tree claims 100,000 pages, nested decompression bombs, a file that keeps
growing. One daemon serves the module; the engine is the stand-in engine process reached
through ``engine.url`` (the engine is not the point here). Each test appends its row to
the reliability table.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from waiting import holds_for

from faults.faultkit import Daemon, audit, drop, record, serving_daemon

DOC = "digital_federal-register_15p.pdf"
DOC_PAGES = 15
#: How long the growing-file test keeps writing (the issue's "minutes", bounded for CI).
GROW_SECONDS = float(os.environ.get("CHANDRAD_FAULTS_GROW_SECONDS", "10"))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with serving_daemon(tmp_path_factory.mktemp("path-faults"), delay_s=0.5,
                        settle=1.0) as d:
        yield d


def _job(d: Daemon, name: str) -> dict[str, object] | None:
    jobs = [j for j in d.stored_jobs() if Path(j["path"]).name == name]
    return jobs[-1] if jobs else None


def _pages_done(d: Daemon, name: str) -> int:
    job = _job(d, name)
    if not job:
        return 0
    return sum(1 for (j, _i) in d.done_pages() if j == job["id"])


def _error(d: Daemon, name: str) -> dict[str, object]:
    out: dict[str, object] = json.loads((d.failed / f"{name}.error.json").read_text())
    return out


# ------------------------------------------------------------------ folders


def test_read_only_done(daemon: Daemon, corpus_dir: Path,
                        read_only_mount: Callable[[Path], AbstractContextManager[None]]
                        ) -> None:
    """done/ read-only when a job finishes → the job is held (outputs written, input kept
    in the inbox) and moved to done/ once done/ is writable again; never failed/."""
    d = daemon
    name = "ro-done.pdf"
    with read_only_mount(d.done):
        drop(corpus_dir / "good" / "scan_four-orientations_cardinal.pdf", d.inbox, name)
        d.wait_for("job no longer pending or running", lambda: (_job(d, name) or {}).get(
            "state") not in (None, "pending", "running"), 60)
        job = _job(d, name)
        state_ro = f"{job['state']} ({job['error_code']})" if job else "missing"
    t0 = time.monotonic()
    jobs = d.wait_stored_final([name], 120)
    a = audit(d, {name: 4})
    record("read-only done/", f"job {state_ro} while done/ was read-only, then "
           f"{jobs[name]['state']}; input in {_final_place(d, name)}", lost=len(a.lost),
           twice=len(a.done_twice), serving_s=time.monotonic() - t0)
    a.assert_clean()
    assert state_ro == "held (output_unwritable)", state_ro
    assert (d.done / name).exists(), f"input went to failed/: {jobs[name]}"


def test_output_dir_deleted_while_running(daemon: Daemon, corpus_dir: Path) -> None:
    d = daemon
    name = "output-deleted.pdf"
    drop(corpus_dir / "good" / DOC, d.inbox, name)
    d.wait_for("3 pages done", lambda: _pages_done(d, name) >= 3, 60)
    before = d.done_pages()
    shutil.rmtree(d.output)
    d.wait_stored_final([name], 120)
    a = audit(d, {name: DOC_PAGES}, before)
    record("output folder deleted while a job runs", "outputs written into a re-created "
           "folder at the end of the job", lost=len(a.lost) + len(a.bad_outputs),
           twice=len(a.done_twice), serving_s="0 (never stopped)")
    a.assert_clean()


# ------------------------------------------------------------------ the input in flight


def _sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_input_truncated_while_pages_in_flight(daemon: Daemon, corpus_dir: Path) -> None:
    """Truncated mid-job: the job ends (done from what was read, or failed with a reason),
    the file is not lost, no page is done twice."""
    d = daemon
    name = "in-flight-truncated.pdf"
    path = drop(corpus_dir / "good" / DOC, d.inbox, name)
    d.wait_for("2 pages done", lambda: _pages_done(d, name) >= 2, 60)
    before = d.done_pages()
    with path.open("r+b") as fh:
        fh.truncate(path.stat().st_size // 3)
    jobs = d.wait_stored_final([name], 120)
    a = audit(d, {name: None}, before)
    job = jobs[name]
    record("input truncated to 1/3 while its pages are in flight",
           f"job {job['state']} ({job['error_code'] or 'no error'}), pages "
           f"{job['pages_total']}",
           lost=len(a.lost), twice=len(a.done_twice), serving_s="0 (never stopped)")
    a.assert_clean()


def test_input_deleted_while_pages_in_flight(daemon: Daemon, corpus_dir: Path) -> None:
    d = daemon
    name = "in-flight-deleted.pdf"
    path = drop(corpus_dir / "good" / DOC, d.inbox, name)
    d.wait_for("2 pages done", lambda: _pages_done(d, name) >= 2, 60)
    path.unlink()
    jobs = d.wait_stored_final([name], 120)
    job = jobs[name]
    record("input deleted while its pages are in flight",
           f"job {job['state']} ({job['error_code']}): "
           f"{job['error_message']}",
           lost=0, twice=0, serving_s="0 (never stopped)")
    assert job["error_code"] != "internal_error", job


def test_input_replaced_while_pages_in_flight(daemon: Daemon, corpus_dir: Path) -> None:
    d = daemon
    name = "in-flight-replaced.pdf"
    drop(corpus_dir / "good" / DOC, d.inbox, name)
    d.wait_for("2 pages done", lambda: _pages_done(d, name) >= 2, 60)
    replacement = corpus_dir / "good" / "scan_four-orientations_cardinal.pdf"
    drop(replacement, d.inbox, name)
    new_sha = _sha(replacement)
    try:
        d.wait_for("the replacement processed", lambda: any(
            j["sha256"] == new_sha and j["state"] in ("done", "partial", "failed")
            and Path(j["path"]).name == name for j in d.stored_jobs()), 60)
        ok = True
    except AssertionError:
        ok = False
    jobs = [j for j in d.stored_jobs() if Path(j["path"]).name == name]
    in_done = [p for p in d.done.iterdir() if p.name.startswith("in-flight-replaced")]
    record("input replaced while its pages are in flight",
           f"jobs {[(j['state'], j['pages_total']) for j in jobs]}; "
           f"replacement OCRed: {ok}; "
           f"done/ holds {[p.name for p in in_done]}",
           lost=0 if ok else "1 (the replacement)", twice=0, serving_s="0 (never stopped)")
    assert ok
    for j in jobs:
        if j["final_path"] and Path(j["final_path"]).exists():
            assert _sha(Path(j["final_path"])) == j["sha256"], j


# ------------------------------------------------------------------ hostile names and files


def _final_place(d: Daemon, name: str) -> str:
    if (d.done / name).exists():
        return "done/"
    if (d.failed / name).exists():
        return "failed/"
    return "nowhere"


def test_hostile_names(daemon: Daemon, corpus_dir: Path) -> None:
    """Tabs, spaces, a leading dash, printf and shell metacharacters: processed, outputs
    written, nothing lost. (Non-UTF-8, newline and 255-byte names are
    ``tests/test_hostile_names.py``'s, end to end.)"""
    d = daemon
    src = corpus_dir / "good" / "image_hi-devanagari.png"
    names = ["ta\tb and  space.png", "-dash.png", "%s%n$(id)`x`;*.png", "\u202eevil.gnp.png"]
    for name in names:
        drop(src, d.inbox, name)
    jobs = d.wait_stored_final(names, 120)
    a = audit(d, {n: 1 for n in names})
    record("hostile names: tab, double space, leading dash, printf/shell metacharacters, "
           "RTL override", "; ".join(f"{n!r}: {jobs[n]['state']} → {_final_place(d, n)}"
                                     for n in names), lost=len(a.lost) + len(a.bad_outputs),
           twice=len(a.done_twice), serving_s="0 (never stopped)")
    a.assert_clean()


def test_symlink_and_hardlink_tricks(daemon: Daemon, corpus_dir: Path, tmp_path: Path) -> None:
    """Links out of the watched root are never followed; the outside is never touched."""
    d = daemon
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.pdf"
    shutil.copyfile(corpus_dir / "good" / "digital_sf424-federal-form.pdf", secret)
    (outside / "sub").mkdir()
    shutil.copyfile(secret, outside / "sub" / "deep.pdf")
    before = {p: p.stat().st_mtime_ns for p in outside.rglob("*")}
    (d.inbox / "link.pdf").symlink_to(secret)
    (d.inbox / "dirlink").symlink_to(outside / "sub", target_is_directory=True)
    os.link(secret, d.inbox / "hard.pdf")  # a second name for an outside file's inode
    d.wait_stored_final(["hard.pdf"], 60)

    def no_link_accepted() -> None:
        accepted = {Path(j["path"]).name for j in d.stored_jobs()}
        assert "link.pdf" not in accepted and "deep.pdf" not in accepted, accepted

    holds_for(no_link_accepted, 3, every=0.5)
    assert (d.inbox / "link.pdf").is_symlink(), "the symlink was moved or replaced"
    assert {p: p.stat().st_mtime_ns for p in outside.rglob("*")} == before
    assert secret.read_bytes() == (corpus_dir / "good" /
                                   "digital_sf424-federal-form.pdf").read_bytes()
    a = audit(d, {"hard.pdf": 1})
    record("symlink / symlinked dir / hardlink out of the watched root",
           "symlinks ignored (not followed, left in place); the hardlink is processed as "
           "its own name and moved to done/; the outside files untouched",
           lost=len(a.lost), twice=len(a.done_twice), serving_s="0 (never stopped)")
    a.assert_clean()
    (d.inbox / "link.pdf").unlink()
    (d.inbox / "dirlink").unlink()


def _pdf(objects: list[bytes]) -> bytes:
    """A syntactically valid PDF with a correct xref from numbered object bodies."""
    out = bytearray(b"%PDF-1.7\n")
    offsets = []
    for i, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += f"{i} 0 obj\n".encode() + body + b"\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    for off in offsets:
        out += f"{off:010d} 00000 n \n".encode()
    out += (f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n"
            "%%EOF\n").encode()
    return bytes(out)


def _claims_100k_pages() -> bytes:
    return _pdf([b"<< /Type /Catalog /Pages 2 0 R >>",
                 b"<< /Type /Pages /Kids [3 0 R] /Count 100000 >>",
                 b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] >>"])


def _nested_bomb() -> bytes:
    """A page whose image is 20000×20000 grey (400 MB raw), Flate inside Flate inside
    Flate: a few kilobytes on disk."""
    raw_len = 20000 * 20000
    data = zlib.compress(b"\0" * raw_len, 9)
    data = zlib.compress(data, 9)
    data = zlib.compress(data, 9)
    image = (f"<< /Type /XObject /Subtype /Image /Width 20000 /Height 20000 /ColorSpace "
             f"/DeviceGray /BitsPerComponent 8 /Filter [/FlateDecode /FlateDecode "
             f"/FlateDecode] /Length {len(data)} >>\nstream\n").encode() + data + \
        b"\nendstream"
    content = b"q 612 0 0 792 0 0 cm /Im0 Do Q"
    return _pdf([b"<< /Type /Catalog /Pages 2 0 R >>",
                 b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
                 b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources "
                 b"<< /XObject << /Im0 4 0 R >> >> /Contents 5 0 R >>",
                 image,
                 f"<< /Length {len(content)} >>\nstream\n".encode() + content +
                 b"\nendstream"])


def _png_bomb() -> bytes:
    """A 30000×30000 grey PNG of zeros (900 MB decoded), about 1 MB on disk."""
    import struct

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + \
            struct.pack(">I", zlib.crc32(kind + body))

    side = 30000
    row = b"\0" * (side + 1)
    comp = zlib.compressobj(9)
    idat = b"".join(comp.compress(row) for _ in range(side)) + comp.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 0,
                                                              0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def test_hostile_files(daemon: Daemon, corpus_dir: Path, tmp_path: Path) -> None:
    """Each ends in done/ or failed/ with a reason, quickly, and the daemon keeps serving."""
    d = daemon
    made = {"claims-100k-pages.pdf": _claims_100k_pages(), "nested-bomb.pdf": _nested_bomb(),
            "png-bomb.png": _png_bomb()}
    for name, data in made.items():
        (tmp_path / name).write_bytes(data)
        drop(tmp_path / name, d.inbox)
    drop(corpus_dir / "bad" / "broken_decompression-bomb.gif", d.inbox, "gif-bomb.gif")
    drop(corpus_dir / "bad" / "broken_huge-pixels-35000px_hugemono.pdf", d.inbox,
         "jbig2-35000px.pdf")
    names = [*made, "gif-bomb.gif", "jbig2-35000px.pdf"]
    t0 = time.monotonic()
    jobs = d.wait_stored_final(names, 180)
    seconds = time.monotonic() - t0
    assert d.status() is not None
    a = audit(d, {n: None for n in names})
    outcome = []
    for n in names:
        job = jobs[n]
        reason = job["error_code"] or ""
        if job["state"] == "failed":
            reason = str(_error(d, n).get("code", reason))
        outcome.append(f"{n}: {job['state']}{' (' + reason + ')' if reason else ''} "
                       f"[{job['pages_total']} p]")
    record("hostile files: 100,000-page claim, nested Flate bomb, PNG bomb, GIF bomb, "
           "35000² JBIG2", "; ".join(outcome) + f"; all settled in {seconds:.0f} s",
           lost=len(a.lost), twice=len(a.done_twice), serving_s="0 (never stopped)")
    a.assert_clean()
    assert jobs["claims-100k-pages.pdf"]["pages_total"] in (None, 0, 1), \
        jobs["claims-100k-pages.pdf"]


def test_file_that_keeps_growing(daemon: Daemon, corpus_dir: Path) -> None:
    """Written a little every 0.5 s for GROW_SECONDS: never taken half-written, taken once
    it is quiet, processed whole."""
    d = daemon
    name = "growing.pdf"
    data = (corpus_dir / "good" / DOC).read_bytes()
    path = d.inbox / name
    steps = max(2, int(GROW_SECONDS / 0.5))
    chunk = -(-len(data) // steps)
    t0 = time.monotonic()
    with path.open("wb") as fh:
        for i in range(steps):
            fh.write(data[i * chunk:(i + 1) * chunk])
            fh.flush()
            time.sleep(0.5)
            assert _job(d, name) is None, f"taken after {time.monotonic() - t0:.1f}s of writing"
    jobs = d.wait_stored_final([name], 120)
    assert sum(1 for j in d.stored_jobs() if Path(j["path"]).name == name) == 1
    assert jobs[name]["size"] == len(data)
    a = audit(d, {name: DOC_PAGES})
    record(f"file that grows for {GROW_SECONDS:.0f} s (0.5 s steps)",
           "not taken while growing; taken once quiet, processed whole, once",
           lost=len(a.lost), twice=len(a.done_twice), serving_s="0 (never stopped)")
    a.assert_clean()


def test_pdf_page_tree_lying_about_its_count_is_corrupt_input(tmp_path: Path) -> None:
    """MuPDF raises a plain RuntimeError ("Invalid number of pages") from ``page_count``
    when /Count does not match the page tree; that is bad input (corrupt_input in failed/),
    not an internal error with a traceback."""
    from chandrad.errors import InputError
    from chandrad.render import probe

    path = tmp_path / "claims-100k-pages.pdf"
    path.write_bytes(_claims_100k_pages())
    with pytest.raises(InputError) as info:
        probe(path, max_pages=5000)
    assert info.value.code == "corrupt_input"
    assert "page" in str(info.value)
