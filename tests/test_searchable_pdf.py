"""The searchable PDF (``ocr.formats`` with ``pdf``), checked by other people's tools.

For every corpus document that chandrad processes, the PDF made from Chandra-style blocks
(parsed by chandra-ocr, as the pipeline parses an answer) must pass poppler and qpdf:
``qpdf --check`` passes; ``pdfinfo`` reports the source's page count and page sizes (an
image: its pixels at its dpi); ``pdftotext -layout`` finds each block's text; every word
``pdftotext -bbox`` reports lies inside the box of a block holding that word; a PDF page
that had text of its own keeps exactly that text. Then the same on the real daemon with
the stand-in engine, AVIF accepted and HEIC refused in ``failed/`` with how to convert.
"""

from __future__ import annotations

import functools
import html
import io
import json
import re
import shutil
import subprocess
import unicodedata
from pathlib import Path

import pymupdf
import pytest
from conftest import CORPUS_DIR, corpus_manifest
from daemon_harness import OCR, Daemon, drop
from PIL import Image
from standin_engine import StandinServer

from chandrad import ocr, render, textlayer
from chandrad.errors import InputError, UnsupportedFormat

TOOLS = ("pdftotext", "pdfinfo", "qpdf")

#: One page's answer in Chandra's HTML (boxes in its 0..1000 scale), ``{tag}`` per page.
ANSWER = (
    '<div data-bbox="60 40 940 90" data-label="Section-Header"><h1>Quarterly report '
    '{tag}</h1></div>'
    '<div data-bbox="60 110 940 330" data-label="Text"><p>The committee met on Tuesday '
    'to review the budget for printing, postage and the archive of scanned letters.</p></div>'
    '<div data-bbox="60 350 940 520" data-label="Table"><table><tr><th>Item</th>'
    '<th>Cost</th></tr><tr><td>Paper</td><td>12.50</td></tr></table></div>'
    '<div data-bbox="60 540 940 600" data-label="Equation-Block">'
    '<math display="block">E = m c^2</math></div>'
    '<div data-bbox="60 620 940 700" data-label="Text"><p>中文 文本 检索</p></div>'
    '<div data-bbox="60 720 940 790" data-label="Text"><p>مرحبا بالعالم</p></div>'
)


def _expected(tag: str) -> list[list[str]]:
    """Each block's lines of text as a reader would search for them (table rows: cells)."""
    return [[f"Quarterly report {tag}"],
            ["The committee met on Tuesday to review the budget for printing, postage "
             "and the archive of scanned letters."],
            ["Item Cost", "Paper 12.50"], ["E = m c^2"], ["中文 文本 检索"], ["مرحبا بالعالم"]]


@pytest.fixture(scope="module", autouse=True)
def tools() -> None:
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        pytest.fail(f"{missing} not installed: scripts/setup.sh installs poppler-utils and qpdf")


def _run(*argv: str | Path) -> str:
    return subprocess.run([str(a) for a in argv], check=True, capture_output=True,
                          text=True, timeout=60).stdout


def _flat(text: str) -> str:
    return " ".join(text.split())


def _page_sizes(pdf: Path) -> list[tuple[float, float, int]]:
    """(width, height, rotation) of every page, by pdfinfo."""
    info = _run("pdfinfo", "-f", "1", "-l", "100000", pdf)
    sizes = [(float(w), float(h)) for w, h in re.findall(r"size:\s+([\d.]+) x ([\d.]+) pts",
                                                           info)]
    rots = [int(r) for r in re.findall(r"rot:\s+(\d+)", info)]
    return [(w, h, r) for (w, h), r in zip(sizes, rots, strict=True)]


def _pages_text(pdf: Path, layout: bool = True) -> list[str]:
    """Each page's text by ``pdftotext -layout`` (or in reading order: ``layout=False``)."""
    return _run("pdftotext", *(["-layout"] if layout else []), pdf, "-").split("\f")[:-1]


def _rtl(text: str) -> bool:
    return any(unicodedata.bidirectional(c) in ("R", "AL") for c in text)


def _bbox_words(pdf: Path) -> list[list[tuple[str, float, float, float, float]]]:
    """Each page's words with their boxes (top-left origin, the page as shown)."""
    pages = []
    for page in _run("pdftotext", "-bbox", pdf, "-").split("<page ")[1:]:
        pages.append([(html.unescape(w), float(a), float(b), float(c), float(d)) for a, b, c, d, w
                      in re.findall(r'<word xMin="([\d.]+)" yMin="([\d.]+)" xMax="([\d.]+)" '
                                    r'yMax="([\d.]+)">([^<]*)</word>', page)])
    return pages


def _shown_sizes(path: Path) -> list[tuple[float, float]]:
    """The source's pages as shown, in points (a PDF's after /Rotate; an image's frames
    at their dpi, turned upright)."""
    if render.probe(path, 5000).kind == "pdf":
        with pymupdf.open(path) as doc:  # type: ignore[no-untyped-call]
            return [(p.rect.width, p.rect.height) for p in doc]
    sizes = []
    with Image.open(path) as img:
        for i in range(getattr(img, "n_frames", 1) if img.format == "TIFF" else 1):
            img.seek(i)
            dpi = render._dpi(img)
            w, h = img.size
            if img.getexif().get(0x0112, 1) in (5, 6, 7, 8):
                w, h, dpi = h, w, (dpi[1], dpi[0])
            sizes.append((w * 72 / dpi[0], h * 72 / dpi[1]))
    return sizes


def _layouts(path: Path) -> list[textlayer.PageLayout]:
    """Each page's blocks as the pipeline gets them: the answer parsed by chandra-ocr
    (``ocr.parse_page``) for a page image of the page's shape."""
    layouts = []
    for i, (w, h) in enumerate(_shown_sizes(path)):
        width, height = 1000, max(1, round(1000 * h / w))
        result = ocr.parse_page(ANSWER.format(tag=f"p{i + 1}"),
                                ocr.PageImage(i, width, height, b""),
                                include_images=True, include_headers_footers=True)
        layouts.append(textlayer.PageLayout(width, height, result.blocks))
    return layouts


def _ok_documents() -> list[str]:
    """Every corpus document chandrad processes (``good/`` and the ``bad/`` ones a careful
    reader still handles)."""
    return [row["file"] for row in corpus_manifest() if row["expect"] == "ok"]


def check_searchable(source: Path, out: Path, layouts: list[textlayer.PageLayout]) -> int:
    """Every check of the module docstring on one PDF; the number of pages layered."""
    _run("qpdf", "--check", out)
    shown = _shown_sizes(source)
    if render.probe(source, 5000).kind == "pdf":
        assert _page_sizes(out) == _page_sizes(source)
        source_text = _pages_text(source)
    else:
        got = _page_sizes(out)
        assert len(got) == len(shown)
        for (w, h, rot), (sw, sh) in zip(got, shown, strict=True):
            assert rot == 0 and abs(w - sw) < 0.01 and abs(h - sh) < 0.01, (got, shown)
        source_text = [""] * len(shown)
    texts, words, out_sizes = _pages_text(out), _bbox_words(out), _page_sizes(out)
    # -layout prints a right-to-left line's far-apart words as columns, left to right
    reading = _pages_text(out, layout=False)
    assert len(texts) == len(words) == len(shown)
    layered = 0
    for i, layout in enumerate(layouts):
        if source_text[i].strip():  # text of its own: left as it was
            assert texts[i] == source_text[i]
            continue
        layered += 1
        flat, flat_reading = _flat(texts[i]), _flat(reading[i])
        expected = _expected(f"p{i + 1}")
        for lines in expected:
            for line in lines:
                assert line in (flat_reading if _rtl(line) else flat), (source.name, i + 1,
                                                                          line, flat)
        # poppler's page as shown, in its units (a /UserUnit page: PDF user units)
        w, h, rot = out_sizes[i]
        w, h = (h, w) if rot in (90, 270) else (w, h)
        sx, sy = w / layout.width, h / layout.height
        boxes = [([v * s for v, s in zip(b["bbox"], (sx, sy, sx, sy), strict=True)],
                  " ".join(" ".join(lines) for lines in [e]))
                 for b, e in zip(layout.blocks, expected, strict=True)]
        assert words[i], (source.name, i + 1)
        for word, x0, y0, x1, y1 in words[i]:
            inside = [text for (bx0, by0, bx1, by1), text in boxes
                      if bx0 - 0.5 <= x0 and x1 <= bx1 + 0.5 and by0 - 0.5 <= y0
                      and y1 <= by1 + 0.5]
            # -bbox gives a right-to-left word as it is placed: its letters reversed
            assert any(word in text.split() or word[::-1] in text.split() for text in inside), (
                source.name, i + 1, word, x0, y0, x1, y1)
    return layered


@pytest.mark.parametrize("name", _ok_documents())
def test_corpus_document_becomes_a_searchable_pdf_that_poppler_and_qpdf_accept(
        name: str, tmp_path: Path) -> None:
    source = CORPUS_DIR / name
    layouts = _layouts(source)
    out = tmp_path / "out.pdf"
    out.write_bytes(render.searchable_pdf(source, layouts, "skip"))
    layered = check_searchable(source, out, layouts)
    had_text = sum(bool(t.strip()) for t in _pages_text(source)) if source.suffix == ".pdf" \
        and render.probe(source, 5000).kind == "pdf" else 0
    assert layered == len(layouts) - had_text


def test_pdf_text_pages_add_lays_text_over_a_page_that_has_its_own(tmp_path: Path) -> None:
    source = CORPUS_DIR / "good" / "scan_already-ocred_graph.pdf"
    assert _flat(_pages_text(source)[0])  # it carries an OCR text layer of its own
    layouts = _layouts(source)
    out = tmp_path / "out.pdf"
    out.write_bytes(render.searchable_pdf(source, layouts, "add"))
    _run("qpdf", "--check", out)
    words = {w[0] for w in _bbox_words(out)[0]}
    assert {w[0] for w in _bbox_words(source)[0]} < words  # its own text is still there
    assert {"Quarterly", "report", "p1", "committee", "12.50", "检索"} <= words


def test_owner_password_pdf_is_written_without_its_encryption(tmp_path: Path) -> None:
    source = CORPUS_DIR / "bad" / "broken_encrypted-owner-password-only.pdf"
    assert "not encrypted" not in _run("qpdf", "--show-encryption", source)
    out = tmp_path / "out.pdf"
    out.write_bytes(render.searchable_pdf(source, _layouts(source), "skip"))
    assert "File is not encrypted" in _run("qpdf", "--show-encryption", out)


def test_text_layer_is_invisible(tmp_path: Path) -> None:
    """Render mode 3 (qpdf's uncompressed view of the content streams), and the page
    looks exactly as the source's does."""
    source = CORPUS_DIR / "good" / "scan_book-page_c02-22.pdf"
    out = tmp_path / "out.pdf"
    out.write_bytes(render.searchable_pdf(source, _layouts(source), "skip"))
    qdf = subprocess.run(["qpdf", "--qdf", "--object-streams=disable", str(out), "-"],
                         check=True, capture_output=True, timeout=60).stdout
    font = f"/{textlayer.FONT_NAME} 1 Tf".encode()
    assert qdf.count(font) == qdf.count(b"BT 3 Tr " + font) == 1
    for pdf, prefix in ((source, "a"), (out, "b")):
        subprocess.run(["pdftoppm", "-r", "20", "-png", str(pdf), str(tmp_path / prefix)],
                       check=True, timeout=60)
    assert (tmp_path / "a-1.png").read_bytes() == (tmp_path / "b-1.png").read_bytes()


@pytest.mark.parametrize("name", ["image_multipage-fax-g3_3p.tif",
                                  "image_receipt-like-lottery-tickets.tif"])
def test_bilevel_tiff_pages_stay_g4_and_look_like_the_source(name: str, tmp_path: Path) -> None:
    """A 1-bit scan is stored as CCITT G4 (not re-compressed with Flate, about twice the
    size), and poppler draws each page as the source frame (not inverted)."""
    source = CORPUS_DIR / "good" / name
    out = tmp_path / "out.pdf"
    out.write_bytes(render.searchable_pdf(source, _layouts(source), "skip"))
    assert out.stat().st_size < 1.1 * source.stat().st_size
    qdf = subprocess.run(["qpdf", "--qdf", "--object-streams=disable", str(out), "-"],
                         check=True, capture_output=True, timeout=60).stdout
    assert qdf.count(b"/CCITTFaxDecode") == len(_shown_sizes(source))
    subprocess.run(["pdftoppm", "-r", "20", "-gray", str(out), str(tmp_path / "p")],
                   check=True, timeout=60)
    with Image.open(source) as img:
        for i, page in enumerate(sorted(tmp_path.glob("p-*.pgm"))):
            img.seek(i)
            with Image.open(page) as drawn:
                want = img.convert("L").resize(drawn.size, Image.Resampling.BOX)
                diff = sum(abs(a - b) for a, b in zip(drawn.tobytes(), want.tobytes(),
                                                      strict=True)) / len(want.tobytes())
            assert diff < 12, (name, i + 1, diff)


def test_jpeg_turned_by_exif_gets_the_upright_page(tmp_path: Path) -> None:
    """A JPEG kept byte for byte but stored on its side (EXIF orientation 6) is a
    portrait page, its layer on the upright page, as it was rendered for OCR."""
    path = tmp_path / "turned.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6
    img = Image.new("RGB", (400, 300), "white")
    img.paste((0, 0, 0), (0, 0, 40, 300))  # a black band on the stored image's left
    img.save(path, format="JPEG", exif=exif, dpi=(100, 100))
    layouts = _layouts(path)
    out = tmp_path / "out.pdf"
    out.write_bytes(render.searchable_pdf(path, layouts, "skip"))
    check_searchable(path, out, layouts)
    with pymupdf.open(out) as doc:  # type: ignore[no-untyped-call]
        assert (doc[0].rect.width, doc[0].rect.height) == (216, 288)
        pix = doc[0].get_pixmap(dpi=72)
        # turned clockwise: the band is at the top now
        assert pix.pixel(100, 5)[0] < 60 and pix.pixel(100, 280)[0] > 200


# ------------------------------------------------------------------ the daemon


def _finished(daemon: Daemon, count: int) -> bool:
    return sum(j["state"] in ("done", "partial", "failed") for j in daemon.jobs()) == count


def _heic(path: Path) -> Path:
    """The start of a HEIC file from a phone: its ``ftyp`` box (brands heic, mif1)."""
    ftyp = b"ftypheic" + b"\0\0\0\0" + b"mif1heic"
    path.write_bytes(len(ftyp + b"1234").to_bytes(4, "big") + ftyp + b"\0" * 200)
    return path


def test_daemon_writes_a_searchable_pdf_accepts_avif_and_refuses_heic(tmp_path: Path) -> None:
    """Each watched document gets its PDF, claimed with the other outputs; HEIC goes to
    failed/ saying how to convert."""
    engine = StandinServer(tmp_path / "engine", {"default": {"content": ANSWER.format(
        tag="daemon")}}).start()
    daemon = Daemon(tmp_path / "d", f'[engine]\nurl = "{engine.url}"\n'
                    'served_model_name = "chandra"\n',
                    ocr={**OCR, "formats": ["md", "html", "json", "pdf"]})
    avif = tmp_path / "photo.avif"
    Image.new("RGB", (600, 800), "white").save(avif, format="AVIF")
    sources = [CORPUS_DIR / "good" / "scan_rotate90-and-skewed_linn.pdf",
               CORPUS_DIR / "good" / "image_multipage-fax-g3_3p.tif", avif]
    try:
        daemon.start()
        daemon.wait_answering(60)
        for source in sources:
            drop(source, daemon.inbox)
        drop(_heic(tmp_path / "IMG_0001.HEIC"), daemon.inbox)
        daemon.wait_for("four jobs final", functools.partial(_finished, daemon, 4), 120)
        jobs = {Path(j["path"]).name: j for j in daemon.jobs()}
        heic = jobs["IMG_0001.HEIC"]
        assert heic["state"] == "failed", heic
        error = json.loads((daemon.failed / "IMG_0001.HEIC.error.json").read_text())
        assert error["code"] == "unsupported_format"
        assert "HEIC" in error["message"] and "heif-convert" in error["message"], error
        for source in sources:
            job = jobs[source.name]
            assert job["state"] == "done", job
            out_dir = Path(job["output_dir"])
            pdf = out_dir / f"{source.stem}.pdf"
            claim = json.loads((out_dir / ".chandrad-source.json").read_text())
            assert pdf.name in claim["files"]
            _run("qpdf", "--check", pdf)
            texts = _pages_text(pdf)
            assert len(texts) == len(_shown_sizes(Path(job["final_path"])))
            for text in texts:
                for lines in _expected("daemon"):
                    assert all(line in _flat(text) for line in lines), (source.name, text)
        # the worker's file was renamed into place: no temporary file is left
        assert [p.name for p in daemon.output.rglob("*") if p.name.endswith(".tmp")] == []
    finally:
        daemon.cleanup(grace=30)
        engine.stop()


def test_worker_writes_the_pdf_to_a_new_file_or_leaves_none(tmp_path: Path) -> None:
    source = CORPUS_DIR / "good" / "scan_skewed_linn.pdf"
    layouts = _layouts(source)
    out = tmp_path / "made.pdf"
    size = render.write_searchable_pdf(source, layouts, "skip", out)
    assert size == out.stat().st_size and out.read_bytes()[:5] == b"%PDF-"
    with pytest.raises(InputError, match="cannot be written"):
        render.write_searchable_pdf(source, layouts, "skip", out)  # exists: never replaced
    assert out.stat().st_size == size
    missing = tmp_path / "no such folder" / "made.pdf"
    with pytest.raises(InputError, match="cannot be written"):
        render.write_searchable_pdf(source, layouts, "skip", missing)
    assert not missing.exists()


def test_heic_is_refused_naming_heic_and_how_to_convert(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedFormat, match="HEIC.*heif-convert.*magick"):
        render.probe(_heic(tmp_path / "x.heic"), 10)


def test_avif_is_accepted_and_rendered(tmp_path: Path) -> None:
    path = tmp_path / "x.avif"
    Image.new("RGB", (300, 200), (200, 10, 10)).save(path, format="AVIF")
    assert render.probe(path, 10) == render.DocumentInfo("image", 1, "AVIF")
    page = render.render_page(path, 0, None, 6291456)
    with Image.open(io.BytesIO(page.png)) as img:
        pixel = img.getpixel((page.width // 2, page.height // 2))
        assert isinstance(pixel, tuple) and pixel[0] > 150  # still red
