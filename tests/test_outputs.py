"""Tests for chandrad.outputs: layout, atomic and idempotent writes, moves that never overwrite."""

from __future__ import annotations

import hashlib
import io
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import CORPUS_DIR
from faults.faultkit import Daemon, free_port, standin_engine
from PIL import Image

from chandrad import errors, names
from chandrad.ocr import parse_page
from chandrad.outputs import (
    CLAIM_FILE,
    PageOutput,
    atomic_write,
    document_slot,
    made_file,
    move_to,
    output_dir_for,
    remove_leftovers,
    write_document,
    write_error_json,
)
from chandrad.render import render_page

FORMATS = ("md", "html", "json")


RAW = (
    '<div data-bbox="100 100 900 300" data-label="Section-Header"><h2>Page {n}</h2></div>'
    '<div data-bbox="200 400 800 900" data-label="Image"><img alt="figure {n}"/>art</div>'
)


def _pages(source: Path, count: int, failed: tuple[int, ...] = ()) -> list[PageOutput]:
    """Real pages: rendered from the corpus and post-processed by chandra.output."""
    pages = []
    for n in range(1, count + 1):
        rendered = render_page(source, n - 1, 1024, 6291456)
        if n in failed:
            pages.append(PageOutput(n, "failed", 7, "repetition", rendered.width, rendered.height))
            continue
        result = parse_page(
            RAW.format(n=n), rendered.png, include_images=True, include_headers_footers=False
        )
        pages.append(
            PageOutput(
                page=n,
                status="ok",
                attempts=1,
                error=None,
                width=rendered.width,
                height=rendered.height,
                markdown=result.markdown,
                html=result.html,
                blocks=result.blocks,
                images=result.images,
            )
        )
    return pages


def _metadata(source: Path) -> dict[str, object]:
    return {
        "source": str(source),
        "source_sha256": hashlib.sha256(source.read_bytes()).hexdigest(),
        "model": "chandra",
    }


@pytest.fixture(scope="module")
def fax_pages() -> list[PageOutput]:
    return _pages(CORPUS_DIR / "good/image_multipage-fax-g3_3p.tif", 3, failed=(2,))


def test_output_dir_for_keeps_relative_dir(tmp_path: Path) -> None:
    """<output>/<relative dir>/<stem>; an input outside the watched root is refused."""
    inp, out = tmp_path / "in", tmp_path / "out"
    assert output_dir_for(out, inp, inp / "a" / "b" / "scan.v2.pdf") == out / "a" / "b" / "scan.v2"
    assert output_dir_for(out, inp, inp / "x.tif") == out / "x"
    with pytest.raises(errors.OutputError, match="not under"):
        output_dir_for(out, inp, tmp_path / "elsewhere" / "x.pdf")


def test_write_document_layout(tmp_path: Path, fax_pages: list[PageOutput]) -> None:
    """md, html, json, metadata and images are written; json has one entry per page in order."""
    source = CORPUS_DIR / "good/image_multipage-fax-g3_3p.tif"
    written = write_document(tmp_path / "fax", "fax", fax_pages, _metadata(source), FORMATS)
    names = {p.name for p in written}
    assert {"fax.md", "fax.html", "fax.json", "fax_metadata.json"} <= names
    image_names = {n for n in names if n.endswith(".webp")}
    assert len(image_names) == 2  # pages 1 and 3; page 2 failed
    assert all(p.parent == tmp_path / "fax" for p in written)

    doc = json.loads((tmp_path / "fax" / "fax.json").read_text())
    assert doc["source"] == str(source)
    assert [p["page"] for p in doc["pages"]] == [1, 2, 3]
    assert [p["status"] for p in doc["pages"]] == ["ok", "failed", "ok"]
    assert doc["pages"][1]["error"] == "repetition" and doc["pages"][1]["attempts"] == 7
    assert "error" not in doc["pages"][0]
    first = doc["pages"][0]
    assert (first["width"], first["height"]) == (fax_pages[0].width, fax_pages[0].height)
    assert first["blocks"][0]["label"] == "Section-Header"
    assert set(first["blocks"][0]) == {"label", "bbox", "html"}

    markdown = (tmp_path / "fax" / "fax.md").read_text()
    assert markdown.index("Page 1") < markdown.index("Page 3")
    html = (tmp_path / "fax" / "fax.html").read_text()
    for name in image_names:
        assert name in html
        with Image.open(tmp_path / "fax" / name) as img:
            assert img.format == "WEBP"

    meta = json.loads((tmp_path / "fax" / "fax_metadata.json").read_text())
    assert meta["model"] == "chandra"
    assert (meta["num_pages"], meta["pages_ok"], meta["pages_failed"]) == (3, 2, 1)
    assert not [p for p in (tmp_path / "fax").iterdir() if p.name.endswith(".tmp")]


def test_formats_subset(tmp_path: Path, fax_pages: list[PageOutput]) -> None:
    """Only the configured formats are written; metadata always is."""
    source = CORPUS_DIR / "good/image_multipage-fax-g3_3p.tif"
    written = write_document(tmp_path / "fax", "fax", fax_pages, _metadata(source), ("md",))
    names = {p.name for p in written}
    assert "fax.md" in names and "fax_metadata.json" in names
    assert "fax.html" not in names and "fax.json" not in names
    assert not (tmp_path / "fax" / "fax.html").exists()


def test_rewrite_same_source_is_idempotent(tmp_path: Path, fax_pages: list[PageOutput]) -> None:
    """Writing the same document again replaces its files and drops ones no longer produced."""
    source = CORPUS_DIR / "good/image_multipage-fax-g3_3p.tif"
    meta = _metadata(source)
    first = write_document(tmp_path / "fax", "fax", fax_pages, meta, FORMATS)
    before = sorted(p.name for p in (tmp_path / "fax").iterdir())
    again = write_document(tmp_path / "fax", "fax", fax_pages, meta, FORMATS)
    assert again == first
    assert sorted(p.name for p in (tmp_path / "fax").iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["fax"]

    fewer = [fax_pages[0], PageOutput(3, "failed", 7, "length", 10, 10)]
    write_document(tmp_path / "fax", "fax", fewer, meta, FORMATS)
    webps = [p for p in (tmp_path / "fax").iterdir() if p.suffix == ".webp"]
    assert [p.name for p in webps] == list(fax_pages[0].images)


def test_different_source_gets_suffixed_dir(tmp_path: Path, fax_pages: list[PageOutput]) -> None:
    """Another file landing on an occupied output dir gets ``<stem> (1)``; the first is kept."""
    source = CORPUS_DIR / "good/image_multipage-fax-g3_3p.tif"
    write_document(tmp_path / "doc", "doc", fax_pages, _metadata(source), FORMATS)
    original = (tmp_path / "doc" / "doc.md").read_bytes()
    other = CORPUS_DIR / "good/scan_book-page_c02-22.pdf"
    written = write_document(tmp_path / "doc", "doc", _pages(other, 1), _metadata(other), FORMATS)
    assert {p.parent for p in written} == {tmp_path / "doc (1)"}
    assert (tmp_path / "doc" / "doc.md").read_bytes() == original
    claim = json.loads((tmp_path / "doc (1)" / CLAIM_FILE).read_text())
    assert claim["source_sha256"] == _metadata(other)["source_sha256"]
    # and the second file written again still goes to its own directory
    again = write_document(tmp_path / "doc", "doc", _pages(other, 1), _metadata(other), FORMATS)
    assert {p.parent for p in again} == {tmp_path / "doc (1)"}


def test_dir_left_by_a_write_killed_before_its_claim_is_taken_back(
        tmp_path: Path, fax_pages: list[PageOutput]) -> None:
    """A kill -9 inside the claim's atomic write leaves the directory holding only the
    claim's temp file: that is chandrad's own dead attempt, so the next write takes the
    directory (and drops the temp file) instead of moving on to ``<stem> (1)``."""
    (tmp_path / "fax").mkdir()
    leftover = tmp_path / "fax" / f".{CLAIM_FILE}.0a1b2c3d.tmp"
    leftover.write_bytes(b'{"source": ')  # cut short by the kill
    source = CORPUS_DIR / "good/image_multipage-fax-g3_3p.tif"
    written = write_document(tmp_path / "fax", "fax", fax_pages, _metadata(source), FORMATS)
    assert {p.parent for p in written} == {tmp_path / "fax"}
    assert not (tmp_path / "fax (1)").exists()
    assert not leftover.exists()


def _plant_write_leftovers(folder: Path,
                           names_cut_short: list[str]) -> tuple[list[Path], list[Path]]:
    """A kill inside :func:`write_document` after its claim landed: the files in
    ``names_cut_short`` are gone and their atomic writes' temp files are left (the names
    ``atomic_write`` gives them, a long one shortened as ``names.fit`` shortens it), with a
    claim's own; beside them an operator's files of other names. (ours, others)"""
    ours = [folder / names.fit(f".{name}", f".{secrets.token_hex(4)}.tmp")
            for name in [*names_cut_short, CLAIM_FILE]]
    for name in names_cut_short:
        (folder / name).unlink()
    others = [folder / "notes.txt", folder / ".fax.md.tmp", folder / ".fax.md.0A1B2C3D.tmp",
              folder / ".other.md.0a1b2c3d.tmp", folder / "fax.md.0a1b2c3d.tmp",
              folder / ".fax.md.0a1b2c3d.tmp.bak"]
    for path in ours + others:
        path.write_bytes(b"cut short by the kill")
    return ours, others


def test_rewrite_removes_the_temp_files_of_a_write_a_kill_cut_short(
        tmp_path: Path, fax_pages: list[PageOutput]) -> None:
    """The rewrite after the kill removes exactly its own temp files and the document is
    complete again; the operator's files of other names stay."""
    source = CORPUS_DIR / "good/image_multipage-fax-g3_3p.tif"
    folder = tmp_path / "fax"
    written = write_document(folder, "fax", fax_pages, _metadata(source), FORMATS)
    image = next(p.name for p in written if p.suffix == ".webp")
    ours, others = _plant_write_leftovers(
        folder, ["fax.html", "fax.json", image, "fax_metadata.json"])
    assert write_document(folder, "fax", fax_pages, _metadata(source), FORMATS) == written
    assert [p.name for p in ours if p.exists()] == []
    assert all(p.exists() for p in others)
    claim = json.loads((folder / CLAIM_FILE).read_text())
    assert all((folder / name).is_file() for name in claim["files"])


def test_start_sweep_removes_write_temps_only_in_document_folders(
        tmp_path: Path, fax_pages: list[PageOutput]) -> None:
    """The start's sweep (:func:`remove_leftovers`): in a document's folder the temp files
    of the names its claim lists (a long stem's shortened ones too); in a folder chandrad
    did not claim nothing of those names, only a claim's own temp file."""
    source = CORPUS_DIR / "good/image_multipage-fax-g3_3p.tif"
    stem = "é" * 120
    folder = tmp_path / "sub" / stem
    write_document(folder, stem, fax_pages, _metadata(source), FORMATS)
    ours, others = _plant_write_leftovers(folder, [f"{stem}.md", f"{stem}_metadata.json"])
    assert any("~" in p.name for p in ours)  # shortened to fit NAME_MAX
    foreign = tmp_path / "mine"
    foreign.mkdir()
    kept = [foreign / ".fax.md.0a1b2c3d.tmp", foreign / ".fax_metadata.json.0a1b2c3d.tmp"]
    dead_claim = foreign / f".{CLAIM_FILE}.0a1b2c3d.tmp"
    for path in (*kept, dead_claim):
        path.write_bytes(b"x")
    assert sorted(remove_leftovers(tmp_path)) == sorted([*ours, dead_claim])
    assert all(p.exists() for p in (*others, *kept))


def test_foreign_dir_is_not_touched(tmp_path: Path, fax_pages: list[PageOutput]) -> None:
    """A non-empty directory chandrad did not create is left alone; outputs go beside it."""
    (tmp_path / "fax").mkdir()
    (tmp_path / "fax" / "fax.md").write_text("operator notes")
    source = CORPUS_DIR / "good/image_multipage-fax-g3_3p.tif"
    written = write_document(tmp_path / "fax", "fax", fax_pages, _metadata(source), FORMATS)
    assert written[0].parent == tmp_path / "fax (1)"
    assert (tmp_path / "fax" / "fax.md").read_text() == "operator notes"


def test_clashing_image_names_across_pages(tmp_path: Path) -> None:
    """Two pages with the same crop name but other pixels keep both images and links."""
    red, blue = io.BytesIO(), io.BytesIO()
    Image.new("RGB", (4, 4), "red").save(red, format="WEBP")
    Image.new("RGB", (4, 4), "blue").save(blue, format="WEBP")
    pages = [
        PageOutput(
            1,
            "ok",
            1,
            None,
            4,
            4,
            "![](x_img.webp)",
            '<img src="x_img.webp"/>',
            [],
            {"x_img.webp": red.getvalue()},
        ),
        PageOutput(
            2,
            "ok",
            1,
            None,
            4,
            4,
            "![](x_img.webp)",
            '<img src="x_img.webp"/>',
            [],
            {"x_img.webp": blue.getvalue()},
        ),
    ]
    write_document(tmp_path / "d", "d", pages, {"source": "d.pdf", "source_sha256": "1"}, FORMATS)
    assert (tmp_path / "d" / "x_img.webp").read_bytes() == red.getvalue()
    assert (tmp_path / "d" / "p2_x_img.webp").read_bytes() == blue.getvalue()
    assert "p2_x_img.webp" in (tmp_path / "d" / "d.html").read_text()


def test_atomic_write_replaces_and_reports_errors(tmp_path: Path) -> None:
    """atomic_write replaces content, leaves no temp file, and raises OutputError on failure."""
    target = tmp_path / "a.json"
    atomic_write(target, b"one")
    atomic_write(target, b"two")
    assert target.read_bytes() == b"two"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(errors.OutputError, match="cannot write"):
        atomic_write(tmp_path / "file" / "b.json", b"x")


def test_atomic_write_never_shows_a_partial_file(tmp_path: Path) -> None:
    """A reader polling while another process rewrites the file sees only complete versions."""
    target = tmp_path / "big.bin"
    versions = [bytes([i]) * 2_000_000 for i in range(1, 6)]
    atomic_write(target, versions[0])
    code = (
        "import sys; from pathlib import Path; from chandrad.outputs import atomic_write\n"
        "for i in range(2, 6): atomic_write(Path(sys.argv[1]), bytes([i]) * 2_000_000)\n"
    )
    writer = subprocess.Popen([sys.executable, "-c", code, str(target)])
    while writer.poll() is None:
        data = target.read_bytes()
        assert data in versions
    assert writer.returncode == 0
    assert target.read_bytes() == versions[-1]


def test_move_keeps_name_and_suffixes_on_clash(tmp_path: Path) -> None:
    """The input keeps its name and relative dir in done/; a clash gets " (1)", never overwrites."""
    inp, done = tmp_path / "in", tmp_path / "done"
    (inp / "sub").mkdir(parents=True)
    for content in (b"first", b"second", b"third"):
        (inp / "sub" / "scan.pdf").write_bytes(content)
        move_to(done, inp, inp / "sub" / "scan.pdf")
    assert (done / "sub" / "scan.pdf").read_bytes() == b"first"
    assert (done / "sub" / "scan (1).pdf").read_bytes() == b"second"
    assert (done / "sub" / "scan (2).pdf").read_bytes() == b"third"
    assert not (inp / "sub" / "scan.pdf").exists()


def test_move_completes_an_interrupted_move(tmp_path: Path) -> None:
    """If a crash left the input hard-linked into done/, the move finishes without a copy."""
    inp, done = tmp_path / "in", tmp_path / "done"
    inp.mkdir()
    done.mkdir()
    (inp / "a.pdf").write_bytes(b"data")
    os.link(inp / "a.pdf", done / "a.pdf")
    assert move_to(done, inp, inp / "a.pdf") == done / "a.pdf"
    assert sorted(p.name for p in done.iterdir()) == ["a.pdf"]
    assert not (inp / "a.pdf").exists()


def test_move_across_filesystems(tmp_path: Path) -> None:
    """Moving from another filesystem copies, keeps the bytes, removes the original."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on a different filesystem")
    inp = Path(tempfile.mkdtemp(dir=shm))
    try:
        data = (CORPUS_DIR / "good/scan_skewed_linn.pdf").read_bytes()
        (inp / "x.pdf").write_bytes(data)
        (tmp_path / "x.pdf").write_bytes(b"already here")
        dest = move_to(tmp_path, inp, inp / "x.pdf")
        assert dest == tmp_path / "x (1).pdf"
        assert dest.read_bytes() == data
        assert (tmp_path / "x.pdf").read_bytes() == b"already here"
        assert not (inp / "x.pdf").exists()
        assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    finally:
        shutil.rmtree(inp)


def test_move_missing_input_is_output_error(tmp_path: Path) -> None:
    """Moving a file that vanished raises OutputError naming it."""
    with pytest.raises(errors.OutputError, match="gone.pdf"):
        move_to(tmp_path / "done", tmp_path, tmp_path / "gone.pdf")


def test_error_json_beside_failed_input(tmp_path: Path) -> None:
    """<name>.error.json holds code, message, attempts and timestamps."""
    failed = tmp_path / "bad.pdf"
    failed.write_bytes(b"x")
    path = write_error_json(
        failed, "encrypted_pdf", "needs a password", 1, {"accepted": "2026-01-01T00:00:00Z"}
    )
    assert path == tmp_path / "bad.pdf.error.json"
    body = json.loads(path.read_text())
    assert body == {
        "file": "bad.pdf",
        "code": "encrypted_pdf",
        "message": "needs a password",
        "attempts": 1,
        "timestamps": {"accepted": "2026-01-01T00:00:00Z"},
    }


def _finish(tmp_path: Path, name: str, data: bytes) -> tuple[str, str]:
    """Drop ``name`` with ``data`` in ``in/``, write its outputs and move it as the
    pipeline does; (output folder name, done name)."""
    inbox, out, done = tmp_path / "in", tmp_path / "out", tmp_path / "done"
    inbox.mkdir(exist_ok=True)
    path = inbox / name
    path.write_bytes(data)
    meta = {"source": name, "source_sha256": hashlib.sha256(data).hexdigest()}
    slot = document_slot(out, done, inbox, path, meta)
    written = write_document(slot.output_dir, Path(name).stem,
                             [PageOutput(1, "ok", 1, None, 10, 10, markdown="x")], meta, ("md",))
    final = move_to(done, inbox, path, slot.suffix)
    assert (written[0].parent, final) == (slot.output_dir, slot.done_path)
    return slot.output_dir.name, final.name


def test_document_slot_gives_one_name_in_output_and_done(tmp_path: Path) -> None:
    """The smallest `` (n)`` free in both folders: a new stem with another extension, the
    same name with other bytes, and identical bytes under two names each get their own."""
    assert _finish(tmp_path, "report.pdf", b"a") == ("report", "report.pdf")
    assert _finish(tmp_path, "report.png", b"b") == ("report (1)", "report (1).png")
    assert _finish(tmp_path, "report.pdf", b"c") == ("report (2)", "report (2).pdf")
    assert _finish(tmp_path, "memo.jpg", b"m") == ("memo", "memo.jpg")
    assert _finish(tmp_path, "memo.jpeg", b"m") == ("memo (1)", "memo (1).jpeg")


def test_document_slot_after_a_crash_keeps_the_name_it_had(tmp_path: Path) -> None:
    """Outputs written but the input not yet moved: the same folder and done name again;
    the input already moved (``placed``): the folder that goes with its done name."""
    inbox, out, done = tmp_path / "in", tmp_path / "out", tmp_path / "done"
    (out / "doc").mkdir(parents=True)
    (out / "doc" / "notes.txt").write_text("not chandrad's")
    inbox.mkdir()
    path = inbox / "doc.pdf"
    path.write_bytes(b"pdf")
    meta = {"source": "doc.pdf", "source_sha256": hashlib.sha256(b"pdf").hexdigest()}
    slot = document_slot(out, done, inbox, path, meta)
    assert (slot.suffix, slot.output_dir.name, slot.done_path.name) == (1, "doc (1)", "doc (1).pdf")
    write_document(slot.output_dir, "doc", [PageOutput(1, "ok", 1, None, 1, 1)], meta, ("md",))
    assert document_slot(out, done, inbox, path, meta) == slot  # killed before the move
    moved = move_to(done, inbox, path, slot.suffix)
    placed = document_slot(out, done, inbox, path, meta, placed=moved)
    assert placed == slot


def _plant_searchable_pdf_leftovers(output: Path) -> tuple[list[Path], list[Path]]:
    """Temp files as a daemon killed while a render worker wrote ``<stem>.pdf`` leaves
    them (:func:`made_file`'s own names, a long stem shortened too), and files of other
    names beside them: (ours, others)."""
    ours = [made_file(output / "sub" / "report", "report.pdf"),
            made_file(output / "sub" / ("é" * 120), f"{'é' * 120}.pdf")]
    others = [output / "sub" / ".report.pdf.tmp", output / "sub" / "report.pdf.0a1b2c3d.tmp",
              output / "sub" / "report" / "report.md", output / "notes.pdf"]
    for path in ours + others:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"%PDF-1.7 cut short by the kill")
    return ours, others


def test_searchable_pdf_leftovers_of_a_killed_daemon_are_removed(tmp_path: Path) -> None:
    """Only :func:`made_file`'s names go; on a shared store only those old enough."""
    ours, others = _plant_searchable_pdf_leftovers(tmp_path)
    assert len(ours[1].name.encode()) <= 255 and "~" in ours[1].name  # shortened
    os.utime(ours[0], (0, 0))
    assert remove_leftovers(tmp_path, older_than=1.0) == [ours[0]]
    assert sorted(remove_leftovers(tmp_path)) == sorted(ours[1:])
    assert not any(p.exists() for p in ours)
    assert all(p.exists() for p in others)


def test_daemon_start_removes_searchable_pdf_leftovers(tmp_path: Path) -> None:
    """A real daemon start clears them before any job writes (stand-in engine)."""
    d = Daemon(tmp_path, standin_engine(tmp_path, port=free_port()))
    try:
        ours, others = _plant_searchable_pdf_leftovers(d.output)
        d.start()
        d.wait_for("control socket", lambda: d.status() is not None, 60, every=0.2)
        assert not any(p.exists() for p in ours), d.tail()
        assert all(p.exists() for p in others)
        assert d.log_path.read_text().count("output_leftover_removed") == len(ours)
        assert d.stop(60) == 0, d.tail()
    finally:
        d.cleanup()


def test_daemon_start_after_a_kill_mid_write_removes_its_temps_and_completes(
        tmp_path: Path) -> None:
    """A daemon killed while writing a document's outputs (claim landed, the rest temp
    files), its input still in the inbox: the next start removes those temp files, the
    job writes the document complete into the same folder, the operator's files stay."""
    d = Daemon(tmp_path, standin_engine(tmp_path, port=free_port()))
    try:
        source = CORPUS_DIR / "good/image_numeric-table-scan.tif"
        shutil.copyfile(source, d.inbox / "scan.tif")
        folder = d.output / "scan"
        meta = {"source": "scan.tif", "source_sha256": hashlib.sha256(
            source.read_bytes()).hexdigest()}
        write_document(folder, "scan", [PageOutput(1, "ok", 1, None, 10, 10, "before")], meta,
                       FORMATS)
        ours, others = _plant_write_leftovers(folder, ["scan.json", "scan_metadata.json"])
        d.start()
        d.wait_answering(60)
        assert d.wait_jobs_final({"scan.tif"}, 120)["scan.tif"]["state"] == "done", d.tail()
        assert [p.name for p in ours if p.exists()] == [], d.tail()
        assert all(p.exists() for p in others)
        assert d.log_path.read_text().count("output_leftover_removed") == len(ours)
        claim = json.loads((folder / CLAIM_FILE).read_text())
        assert all((folder / name).is_file() for name in claim["files"])
        assert json.loads((folder / "scan_metadata.json").read_text())["num_pages"] == 1
        assert (d.done / "scan.tif").exists() and not (d.output / "scan (1)").exists()
        assert d.stop(60) == 0, d.tail()
    finally:
        d.cleanup()
