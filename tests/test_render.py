"""Tests for chandrad.render: every corpus file, the size policy, and the process pool."""

# PyMuPDF is untyped; these tests build PDFs with it.
# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pymupdf
import pytest
from chandra.model.util import scale_to_fit
from conftest import CORPUS_DIR, corpus_manifest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from chandrad import errors, render
from chandrad.ocr import PageImage
from chandrad.render import (
    MAX_PDF_IMAGE_BYTES,
    RenderPool,
    fit_size,
    probe,
    render_page,
)

MIN_SIDE = 1024
MAX_PIXELS = 6291456
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


#: What each corpus file that must fail fails with (refused with a clear error).
EXPECTED_FAILURE = {
    "bad/broken_truncated_scotus.pdf": errors.InputError,
    "bad/broken_encrypted-user-password_skew.pdf": errors.EncryptedInput,
    "bad/broken_zero-length.pdf": errors.EmptyInput,
    "bad/broken_zero-pages.pdf": errors.EmptyInput,
    "bad/broken_not-a-pdf-text.pdf": errors.UnsupportedFormat,
    "bad/broken_decompression-bomb.gif": errors.DecompressionBomb,
    "bad/broken_truncated.jpg": errors.InputError,
}

ROWS = corpus_manifest()


def _sample(page_count: int) -> list[int]:
    if page_count <= 20:
        return list(range(page_count))
    return sorted({0, 1, page_count // 2, page_count - 1})


def _check_page(page: PageImage, index: int) -> None:
    assert page.index == index
    assert page.png.startswith(PNG_SIGNATURE)
    with Image.open(io.BytesIO(page.png)) as img:
        assert img.size == (page.width, page.height)
        assert img.mode in ("RGB", "L")
    assert page.width * page.height <= MAX_PIXELS
    assert page.width % 28 == 0 and page.height % 28 == 0
    assert min(page.width, page.height) >= MIN_SIDE


def _process(path: Path) -> tuple[int, list[PageImage]]:
    info = probe(path, max_pages=5000)
    indexes = _sample(info.page_count)
    return info.page_count, [render_page(path, i, MIN_SIDE, MAX_PIXELS) for i in indexes]


@pytest.mark.parametrize("row", ROWS, ids=[r["file"] for r in ROWS])
def test_corpus_file(row: dict[str, str]) -> None:
    """Each corpus file either renders every (sampled) page or fails with its typed InputError."""
    path = CORPUS_DIR / row["file"]
    if row["expect"] == "ok":
        page_count, pages = _process(path)
        assert page_count == int(row["pages"])
        for index, page in zip(_sample(page_count), pages, strict=True):
            _check_page(page, index)
        return
    expected = EXPECTED_FAILURE.get(row["file"], errors.InputError)
    if row["expect"] == "failed-or-ok":
        try:
            _process(path)
        except errors.InputError as exc:
            assert isinstance(exc, expected), exc
            assert path.name in exc.message
        return
    assert row["expect"] == "failed"
    with pytest.raises(expected) as caught:
        _process(path)
    assert path.name in caught.value.message
    assert caught.value.code == expected.code


def test_bad_corpus_codes_are_specific() -> None:
    """The bad corpus files fail with their specific codes, not only the generic one."""
    codes = {}
    for name in EXPECTED_FAILURE:
        try:
            _process(CORPUS_DIR / name)
        except errors.InputError as exc:
            codes[name] = exc.code
    assert codes["bad/broken_encrypted-user-password_skew.pdf"] == "encrypted_pdf"
    assert codes["bad/broken_zero-length.pdf"] == "empty_input"
    assert codes["bad/broken_not-a-pdf-text.pdf"] == "unsupported_format"
    assert codes["bad/broken_decompression-bomb.gif"] == "decompression_bomb"
    assert codes["bad/broken_truncated_scotus.pdf"] == "corrupt_input"


def test_jpeg_named_pdf_is_sniffed_as_image() -> None:
    """Content decides the kind: a JPEG with a .pdf name is an image."""
    info = probe(CORPUS_DIR / "bad/broken_jpeg-named-as.pdf", max_pages=10)
    assert (info.kind, info.format, info.page_count) == ("image", "JPEG", 1)


def test_pdf_junk_before_header_is_still_pdf(tmp_path: Path) -> None:
    """A PDF whose header follows some leading junk bytes is still sniffed as a PDF."""
    src = (CORPUS_DIR / "good/digital_sf424-federal-form.pdf").read_bytes()
    path = tmp_path / "junk.bin"
    path.write_bytes(b"\r\n" * 20 + src)
    assert probe(path, max_pages=10).kind == "pdf"


def test_too_many_pages() -> None:
    """A document above ocr.max_pages is refused with too_many_pages."""
    with pytest.raises(errors.TooManyPages, match="117 pages"):
        probe(CORPUS_DIR / "good/digital_de-math-lecture-notes_117p_geotopo.pdf", max_pages=100)


def test_owner_password_only_pdf_renders() -> None:
    """An encrypted PDF with an empty user password opens and renders."""
    path = CORPUS_DIR / "bad/broken_encrypted-owner-password-only.pdf"
    _check_page(render_page(path, 0, MIN_SIDE, MAX_PIXELS), 0)


def test_pdf_rendered_at_chandra_dpi_directly() -> None:
    """A letter page renders at Chandra's 192 dpi (snapped to the 28 px grid), not more."""
    page = render_page(CORPUS_DIR / "good/digital_sf424-federal-form.pdf", 0, 1024, MAX_PIXELS)
    assert abs(page.width - 612 * 192 / 72) <= 28
    assert abs(page.height - 792 * 192 / 72) <= 28


def test_rotated_pdf_page_is_landscape() -> None:
    """A portrait page with /Rotate 90 renders landscape."""
    page = render_page(
        CORPUS_DIR / "good/digital_senate-expenditures-table.pdf", 0, 1024, MAX_PIXELS
    )
    assert page.width > page.height


def test_lower_pixel_budget_is_respected() -> None:
    """A downshifted pixel budget gives smaller pages that still fit it."""
    path = CORPUS_DIR / "good/scan_two-column-brochure_linn.pdf"
    page = render_page(path, 0, 512, 1_000_000)
    assert page.width * page.height <= 1_000_000
    assert page.width * page.height > 800_000


def test_huge_pages_render_in_bounded_memory_and_time() -> None:
    """The /UserUnit poster and the 35000 px JBIG2 page render in < 2 GiB RSS and < 60 s."""
    code = (
        "import json, resource, sys, time; from pathlib import Path;"
        "from chandrad.render import render_page;"
        "t = time.monotonic();"
        "pages = [render_page(Path(p), 0, 1024, 6291456) for p in sys.argv[1:]];"
        "print(json.dumps({'seconds': time.monotonic() - t,"
        " 'maxrss_kib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,"
        " 'sizes': [[p.width, p.height] for p in pages]}))"
    )
    files = [
        str(CORPUS_DIR / "bad/broken_huge-mediabox_poster.pdf"),
        str(CORPUS_DIR / "bad/broken_huge-pixels-35000px_hugemono.pdf"),
    ]
    out = subprocess.run(
        [sys.executable, "-c", code, *files],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["seconds"] < 60
    # Usually ~300 MB; once (CI on a loaded machine) MuPDF expanded the 35000² 1-bit image
    # to 8 bits per pixel (1.2 GB) while scaling it: 1.34 GiB. The bound is what a
    # worker may cost, not a typical figure; a worker past it would be killed alone.
    assert result["maxrss_kib"] < 2 * 1024 * 1024
    (pw, ph), (mw, mh) = result["sizes"]
    assert ph > pw  # the 250 x 500 in poster keeps its shape
    assert pw * ph <= MAX_PIXELS and mw * mh <= MAX_PIXELS


def test_pdf_embedded_image_bomb(tmp_path: Path) -> None:
    """A PDF whose embedded image would decode to more than the cap is a decompression bomb."""
    doc = pymupdf.open()
    page = doc.new_page()
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), "white").save(buf, format="PNG")
    page.insert_image(page.rect, stream=buf.getvalue())
    xref = page.get_images()[0][0]
    side = int((MAX_PDF_IMAGE_BYTES / 3) ** 0.5) + 100
    doc.xref_set_key(xref, "Width", str(side))
    doc.xref_set_key(xref, "Height", str(side))
    path = tmp_path / "bomb.pdf"
    doc.save(path)
    doc.close()
    assert probe(path, max_pages=10).page_count == 1
    with pytest.raises(errors.DecompressionBomb, match="bomb.pdf"):
        render_page(path, 0, MIN_SIDE, MAX_PIXELS)


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    """A JPEG stored landscape with EXIF orientation 6 renders portrait."""
    img = Image.new("RGB", (1200, 800), "white")
    img.paste((0, 0, 0), (0, 0, 100, 100))  # black square at stored top-left
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW to display
    path = tmp_path / "photo.jpg"
    img.save(path, exif=exif.tobytes(), quality=95)
    page = render_page(path, 0, MIN_SIDE, MAX_PIXELS)
    assert page.height > page.width
    with Image.open(io.BytesIO(page.png)) as out:
        gray = out.convert("L")
        top_right, top_left = gray.getpixel((out.width - 10, 10)), gray.getpixel((10, 10))
    assert isinstance(top_right, int) and isinstance(top_left, int)
    assert top_right < 60 and top_left > 200  # the black square is now at the top-right


def test_transparent_png_is_composited_on_white(tmp_path: Path) -> None:
    """Transparent pixels become white, not the black hidden under them."""
    path = tmp_path / "clear.png"
    Image.new("RGBA", (1100, 1100), (0, 0, 0, 0)).save(path)
    page = render_page(path, 0, MIN_SIDE, MAX_PIXELS)
    with Image.open(io.BytesIO(page.png)) as out:
        assert out.getpixel((500, 500)) == (255, 255, 255)


def test_multipage_tiff_pages_differ_and_index_is_checked() -> None:
    """Each frame of a multi-page TIFF is its own page; a page past the end is an InputError."""
    path = CORPUS_DIR / "good/image_multipage-fax-g3_3p.tif"
    pngs = {render_page(path, i, MIN_SIDE, MAX_PIXELS).png for i in range(3)}
    assert len(pngs) == 3
    with pytest.raises(errors.InputError, match="page 4 does not exist"):
        render_page(path, 3, MIN_SIDE, MAX_PIXELS)


def _grey_page(mode: str, ink: float, paper: float) -> Image.Image:
    """A page in ``mode``: ``paper`` everywhere, an ``ink`` square at the top left."""
    img = Image.new("F", (1100, 1100), paper)
    img.paste(ink, (0, 0, 300, 300))
    if mode == "F":
        return img
    as_int = img.convert("I")
    return as_int if mode == "I" else as_int.convert(mode)


@pytest.mark.parametrize(("mode", "fmt", "ink", "paper"), [
    ("I;16", "TIFF", 1000, 60000),  # 16-bit scan using the whole range
    ("I;16", "PNG", 300, 4000),  # 12-bit sensor data in a 16-bit container
    ("I", "TIFF", 70_000, 2_000_000),  # 32-bit integer
    ("F", "TIFF", 0.05, 0.9),  # float, 0..1
])
def test_wide_greyscale_is_rescaled_not_clipped(
    tmp_path: Path, mode: str, fmt: str, ink: float, paper: float
) -> None:
    """16-bit, 32-bit and float greyscale reach the model with their ink black and their
    paper white (convert("RGB") clipped them all to one value: a blank page)."""
    img = _grey_page(mode, ink, paper)
    path = tmp_path / f"grey.{fmt.lower()}"
    img.save(path, format=fmt)
    with Image.open(path) as check:
        assert check.mode == mode  # the file really is that wide
    page = render_page(path, 0, MIN_SIDE, MAX_PIXELS)
    with Image.open(io.BytesIO(page.png)) as out:
        grey = out.convert("L")
        ink_px, paper_px = grey.getpixel((50, 50)), grey.getpixel((page.width - 50, 800))
    assert ink_px == 0 and paper_px == 255, (ink_px, paper_px)


def test_wide_greyscale_of_one_value_is_white_and_nan_is_refused(tmp_path: Path) -> None:
    """A frame of one value carries no contrast to stretch: a white page. Float pixels that
    are not numbers cannot be scaled: a clear InputError, not a silently blank page."""
    flat = tmp_path / "flat.tif"
    Image.new("I;16", (1100, 1100), 40000).save(flat)
    page = render_page(flat, 0, MIN_SIDE, MAX_PIXELS)
    with Image.open(io.BytesIO(page.png)) as out:
        assert out.convert("L").getextrema() == (255, 255)
    nan = tmp_path / "nan.tif"
    _grey_page("F", float("nan"), 0.5).save(nan)
    with pytest.raises(errors.InputError, match="non-finite"):
        render_page(nan, 0, MIN_SIDE, MAX_PIXELS)


def _read_syscalls() -> int:
    """read(2) calls this process has made so far (Linux /proc/self/io)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("syscr:"):
            return int(line.split()[1])
    raise AssertionError("no syscr in /proc/self/io")


def _many_frame_tiff(path: Path, frames: int) -> Path:
    pages = [Image.new("L", (40, 40), 255 - (i % 200)) for i in range(frames)]
    pages[0].save(path, save_all=True, append_images=pages[1:])
    return path


def test_pages_of_a_long_tiff_do_not_each_walk_its_frames(tmp_path: Path) -> None:
    """Rendering page k of an n-frame TIFF after page k-1 costs a few reads, not a walk over
    the n frame headers (a 4,000-page TIFF took ~n^2/2 header reads). Counted in read(2)
    calls, which the machine's load does not change."""
    frames = 400
    path = _many_frame_tiff(tmp_path / "long.tif", frames)
    render_page(path, 0, 56, MAX_PIXELS)
    before = _read_syscalls()
    for index in range(frames - 10, frames):
        render_page(path, index, 56, MAX_PIXELS)
    per_page = (_read_syscalls() - before) / 10
    assert per_page < frames / 10, f"{per_page:.0f} reads per page of a {frames}-frame TIFF"


def test_kept_tiff_matches_a_fresh_open_and_follows_a_replaced_file(tmp_path: Path) -> None:
    """Pages rendered from the image a worker keeps open are the pages a fresh open gives;
    a file replaced at the same path (new inode) or rewritten in place is read anew."""
    path = tmp_path / "doc.tif"
    _many_frame_tiff(path, 30)
    kept = [render_page(path, i, 56, MAX_PIXELS).png for i in (29, 3, 17)]
    fresh_dir = tmp_path / "fresh"
    fresh_dir.mkdir()
    fresh = [render_page(_many_frame_tiff(fresh_dir / f"{i}.tif", 30), i, 56, MAX_PIXELS).png
             for i in (29, 3, 17)]
    assert kept == fresh

    other = tmp_path / "other.tif"
    pages = [Image.new("L", (40, 40), 10 + i) for i in range(30)]
    pages[0].save(other, save_all=True, append_images=pages[1:])
    other.replace(path)  # new inode at the same path
    with Image.open(io.BytesIO(render_page(path, 17, 56, MAX_PIXELS).png)) as out:
        assert out.convert("L").getpixel((5, 5)) == 27
    pages = [Image.new("L", (40, 40), 100 + i) for i in range(31)]
    with path.open("r+b") as fh:  # same inode, new content and size
        fh.truncate(0)
        pages[0].save(fh, format="TIFF", save_all=True, append_images=pages[1:])
    with Image.open(io.BytesIO(render_page(path, 30, 56, MAX_PIXELS).png)) as out:
        assert out.convert("L").getpixel((5, 5)) == 130


LONG_PDF = CORPUS_DIR / "good" / "digital_federal-register_15p.pdf"
OTHER_PDF = CORPUS_DIR / "good" / "digital_us-appeals-opinion_17p.pdf"


def test_pages_of_a_pdf_do_not_each_open_it_again() -> None:
    """A worker keeps a PDF open between its pages: page k after page k-1 costs a third of
    the reads of opening it (the cross-reference table and page tree are parsed once, the
    fonts stay in MuPDF's store). 189 reads a page before, ~32 after; counted in read(2)
    calls, which the machine's load does not change."""
    render._let_go()  # nothing kept from earlier tests
    before = _read_syscalls()
    render_page(LONG_PDF, 0, 56, MAX_PIXELS)
    first = _read_syscalls() - before
    before = _read_syscalls()
    for index in range(5, 15):
        render_page(LONG_PDF, index, 56, MAX_PIXELS)
    per_page = (_read_syscalls() - before) / 10
    assert per_page < first / 3, f"{per_page:.0f} reads a page, {first} to open"


def test_a_probed_pdf_is_not_opened_again_for_its_first_page() -> None:
    """A worker's probe leaves the PDF open for the render that follows (each job probes,
    then renders page 1: a backlog of one-page files opened each file twice). Counted in
    read(2) calls; the page is byte for byte that of a fresh open. Without keep_open the
    first page cost as many reads as opening the file afresh."""
    render._let_go()
    before = _read_syscalls()
    probe(LONG_PDF, 1000)
    opening = _read_syscalls() - before
    before = _read_syscalls()
    render_page(LONG_PDF, 0, None, MAX_PIXELS)
    cold = _read_syscalls() - before
    fresh = _fresh(LONG_PDF, 0)
    render._let_go()
    assert probe(LONG_PDF, 1000, keep_open=True).page_count > 1
    before = _read_syscalls()
    page = render_page(LONG_PDF, 0, None, MAX_PIXELS)
    after_probe = _read_syscalls() - before
    render._let_go()
    assert page.png == fresh
    assert after_probe <= cold - opening * 0.8, (
        f"{after_probe} reads after the probe, {cold} cold, {opening} to open")
    probe(LONG_PDF, 1000)  # outside a worker: nothing kept
    assert not render._kept


def _fresh(path: Path, index: int) -> bytes:
    render._let_go()
    return render_page(path, index, None, MAX_PIXELS).png


def test_kept_pdf_matches_a_fresh_open_and_follows_a_replaced_file(tmp_path: Path) -> None:
    """Pages rendered from the PDFs a worker keeps open, in an interleaved order across
    more files than it keeps, are byte for byte those of a fresh open; a PDF replaced at
    the same path (new inode) or rewritten in place is read anew, and the replaced one is
    not held open (the fault tests replace inputs mid-flight)."""
    order = [(LONG_PDF, 3), (OTHER_PDF, 16), (LONG_PDF, 14), (OTHER_PDF, 0), (LONG_PDF, 4)]
    extra = []
    for n in range(render.KEEP_OPEN_FILES):
        extra.append(tmp_path / f"copy{n}.pdf")
        extra[-1].write_bytes(OTHER_PDF.read_bytes())
    render._let_go()
    kept = [render_page(path, index, None, MAX_PIXELS).png for path, index in order[:3]]
    kept += [render_page(path, 1, None, MAX_PIXELS).png for path in extra]  # evicts LONG_PDF
    kept += [render_page(path, index, None, MAX_PIXELS).png for path, index in order[3:]]
    fresh = [_fresh(path, index) for path, index in order[:3]]
    fresh += [_fresh(extra[0], 1)] * len(extra)
    fresh += [_fresh(path, index) for path, index in order[3:]]
    assert kept == fresh

    path = tmp_path / "doc.pdf"
    path.write_bytes(LONG_PDF.read_bytes())
    replacement = tmp_path / "replacement.pdf"
    replacement.write_bytes(OTHER_PDF.read_bytes())
    assert render_page(path, 2, None, MAX_PIXELS).png == _fresh(LONG_PDF, 2)
    render_page(path, 3, None, MAX_PIXELS)  # kept open now
    replacement.replace(path)  # new inode at the same path
    assert render_page(path, 2, None, MAX_PIXELS).png == _fresh(OTHER_PDF, 2)
    held = []
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone
            held.append(os.readlink(fd))
    assert f"{path} (deleted)" not in held
    render_page(path, 3, None, MAX_PIXELS)
    with path.open("r+b") as fh:  # same inode, new content and size
        fh.truncate(0)
        fh.write(LONG_PDF.read_bytes())
    assert render_page(path, 2, None, MAX_PIXELS).png == _fresh(LONG_PDF, 2)
    render._let_go()


def test_small_image_is_upscaled_to_min_side(tmp_path: Path) -> None:
    """An image smaller than min_side_px is upscaled so its shortest side reaches it."""
    path = tmp_path / "small.png"
    Image.new("L", (300, 500), 255).save(path)
    page = render_page(path, 0, MIN_SIDE, MAX_PIXELS)
    assert min(page.width, page.height) >= MIN_SIDE
    assert abs(page.height / page.width - 500 / 300) < 0.05


def test_unsupported_image_format(tmp_path: Path) -> None:
    """An image format Chandra does not take (here PCX) is unsupported_format."""
    path = tmp_path / "scan.pcx"
    Image.new("RGB", (50, 50)).save(path, format="PCX")
    with pytest.raises(errors.UnsupportedFormat, match="PCX"):
        probe(path, max_pages=10)


@settings(max_examples=25, deadline=None)
@given(
    width=st.integers(min_value=20, max_value=3500),
    height=st.integers(min_value=20, max_value=3500),
    max_pixels=st.sampled_from([1_000_000, 3_000_000, MAX_PIXELS]),
)
def test_fit_size_is_chandras_scale_to_fit(width: int, height: int, max_pixels: int) -> None:
    """Without a min-side upscale, fit_size picks exactly the size scale_to_fit resizes to."""
    expected = scale_to_fit(Image.new("L", (width, height)), max_size=(max_pixels, 1)).size
    assert fit_size(width, height, 1, max_pixels) == expected


def _worker_pids() -> list[int]:
    """Pool workers: spawned children (not multiprocessing's resource tracker)."""
    return [
        p.pid
        for p in psutil.Process().children(recursive=True)
        if any("spawn_main" in part for part in p.cmdline())
    ]


def test_pool_renders_like_direct_calls_and_keeps_error_types() -> None:
    """Pages rendered in the pool equal direct renders; typed errors cross the process boundary."""
    path = CORPUS_DIR / "good/scan_zh-customs-penalty-decision.pdf"

    async def main() -> tuple[list[PageImage], BaseException]:
        pool = RenderPool(workers=2)
        try:
            info = await pool.probe(path, 100)
            pages = await asyncio.gather(
                *(pool.render(path, i, MIN_SIDE, MAX_PIXELS) for i in range(info.page_count))
            )
            try:
                await pool.probe(CORPUS_DIR / "bad/broken_encrypted-user-password_skew.pdf", 10)
            except errors.InputError as exc:
                return list(pages), exc
            raise AssertionError("encrypted PDF was accepted")
        finally:
            pool.close()

    pages, error = asyncio.run(main())
    assert [p.png for p in pages] == [
        render_page(path, i, MIN_SIDE, MAX_PIXELS).png for i in range(3)
    ]
    assert isinstance(error, errors.EncryptedInput) and error.code == "encrypted_pdf"


def test_pool_survives_a_killed_worker() -> None:
    """A worker killed mid-render fails that page with render_crashed; the next render works."""
    slow = CORPUS_DIR / "bad/broken_huge-pixels-35000px_hugemono.pdf"
    quick = CORPUS_DIR / "good/digital_sf424-federal-form.pdf"

    async def main() -> tuple[BaseException | None, PageImage]:
        pool = RenderPool(workers=1)
        try:
            await pool.probe(quick, 10)  # start the worker
            task = asyncio.ensure_future(pool.render(slow, 0, MIN_SIDE, MAX_PIXELS))
            await asyncio.sleep(0.5)
            for pid in _worker_pids():
                psutil.Process(pid).kill()
            failure: BaseException | None = None
            try:
                await task
            except errors.RenderCrashed as exc:
                failure = exc
            return failure, await pool.render(quick, 0, MIN_SIDE, MAX_PIXELS)
        finally:
            pool.close()

    failure, page = asyncio.run(main())
    assert isinstance(failure, errors.RenderCrashed) and failure.code == "render_crashed"
    _check_page(page, 0)


def test_pool_recovers_from_a_worker_killed_while_idle() -> None:
    """A worker that dies between calls (the OOM killer, a segfault at teardown, kill -9)
    breaks the executor without failing any call of ours: the next calls must run on a
    fresh pool, not raise BrokenProcessPool at submit for ever (every later document went
    to failed/ as internal_error until the daemon was restarted)."""
    quick = CORPUS_DIR / "good/digital_sf424-federal-form.pdf"

    async def main() -> tuple[list[int], list[int], list[int]]:
        pool = RenderPool(workers=1)
        try:
            await pool.probe(quick, 10)  # start the worker, then let it idle
            first = _worker_pids()
            for pid in first:
                psutil.Process(pid).kill()
                psutil.Process(pid).wait(10)
            await asyncio.sleep(1.0)  # the executor's manager thread notices the death
            counts = [(await pool.probe(quick, 10)).page_count for _ in range(3)]
            return first, counts, _worker_pids()
        finally:
            pool.close()

    first, counts, now = asyncio.run(main())
    assert counts == [1, 1, 1]
    assert now and not set(now) & set(first)


#: The write(2) syscall number, as /proc/PID/syscall shows it, per machine.
_WRITE_SYSCALL = {"x86_64": "1", "aarch64": "64"}


@pytest.mark.skipif(platform.machine() not in _WRITE_SYSCALL, reason="write(2) number unknown")
def test_pool_fails_fast_when_a_worker_dies_sending_its_page(tmp_path: Path) -> None:
    """A worker killed while it writes its page back (a noise image: ~31 MB of base64, far
    more than a pipe holds) fails that call with render_crashed at once, not at the
    pool's timeout: CPython's executor had started reading the message and waited for
    the rest for ever. Its manager thread ends too (it was joined at exit: the process
    never exited). Before the fix: render_timeout after the full 60 s, the thread alive."""
    noise = tmp_path / "noise.png"
    Image.frombytes("RGB", (2800, 2800), os.urandom(2800 * 2800 * 3)).save(
        noise, compress_level=1)
    quick = CORPUS_DIR / "good/digital_sf424-federal-form.pdf"
    write = _WRITE_SYSCALL[platform.machine()]

    def kill_once_sending(pid: int, killed: list[float]) -> None:
        with contextlib.suppress(OSError):
            while True:
                with open(f"/proc/{pid}/syscall") as fh:
                    if fh.read().split()[0] == write:
                        os.kill(pid, signal.SIGKILL)
                        killed.append(time.monotonic())
                        return
                time.sleep(0.0005)

    async def main() -> tuple[BaseException | None, float, list[float], PageImage]:
        pool = RenderPool(workers=1, timeout=60)
        try:
            await pool.probe(quick, 10)  # start the worker
            (pid,) = _worker_pids()
            killed: list[float] = []
            killer = threading.Thread(target=kill_once_sending, args=(pid, killed))
            killer.start()
            t0 = time.monotonic()
            failure: BaseException | None = None
            try:
                await pool.render(noise, 0, None, 2800 * 2800)
            except errors.InputError as exc:
                failure = exc
            took = time.monotonic() - t0
            killer.join(10)
            return failure, took, [k - t0 for k in killed], await pool.render(
                quick, 0, MIN_SIDE, MAX_PIXELS)
        finally:
            pool.close()

    failure, took, killed, page = asyncio.run(main())
    print(f"\nkilled while sending at {killed}; the call failed after {took:.1f} s")
    assert len(killed) == 1, "the worker was not seen writing its page"
    assert isinstance(failure, errors.RenderCrashed), failure
    assert took < 30, took
    _check_page(page, 0)
    stuck = [t for t in threading.enumerate() if type(t).__name__ == "_ExecutorManagerThread"]
    for thread in stuck:
        thread.join(10)
    assert not [t for t in stuck if t.is_alive()]


def test_pool_times_out_a_slow_page_and_recovers() -> None:
    """A page slower than the timeout fails with render_timeout and its worker is stopped."""
    slow = CORPUS_DIR / "bad/broken_huge-pixels-35000px_hugemono.pdf"
    quick = CORPUS_DIR / "good/digital_sf424-federal-form.pdf"

    async def main() -> tuple[BaseException | None, list[int], PageImage]:
        pool = RenderPool(workers=1, timeout=60)
        try:
            await pool.probe(quick, 10)  # start the worker: spawning takes a while
            pool.timeout = 0.3
            failure: BaseException | None = None
            try:
                await pool.render(slow, 0, MIN_SIDE, MAX_PIXELS)
            except errors.RenderTimeout as exc:
                failure = exc
            await asyncio.sleep(0.5)
            left = _worker_pids()
            pool.timeout = 60
            return failure, left, await pool.render(quick, 0, MIN_SIDE, MAX_PIXELS)
        finally:
            pool.close()

    failure, left, page = asyncio.run(main())
    assert isinstance(failure, errors.RenderTimeout) and "hugemono" in failure.message
    assert not [
        pid for pid in left if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
    ]
    _check_page(page, 0)


def test_images_get_chandras_minimum(tmp_path: Path) -> None:
    """min_side_px "auto" (None): an image is prepared exactly as chandra.input.load_image
    + scale_to_fit prepare it (shortest side 1536)."""
    from chandra.input import load_image

    small = tmp_path / "small.png"
    Image.new("RGB", (300, 420), "white").save(small)
    ours = render_page(small, 0, None, MAX_PIXELS)
    assert (ours.width, ours.height) == scale_to_fit(load_image(str(small))).size
    assert min(ours.width, ours.height) >= 1536 - 28


def test_worker_slots_go_to_post_processing_before_renders() -> None:
    """A free worker goes to an urgent call (post-processing of an answered page) before
    renders that queued earlier; a waiter cancelled as the slot reaches it passes it on."""
    from chandrad.render import _Slots

    async def scenario() -> list[str]:
        slots = _Slots(1)
        order: list[str] = []
        await slots.acquire(urgent=False)  # the one worker is busy

        async def call(name: str, urgent: bool) -> None:
            await slots.acquire(urgent)
            order.append(name)
            slots.release()

        renders = [asyncio.create_task(call(f"render{i}", False)) for i in range(3)]
        await asyncio.sleep(0)
        doomed = asyncio.create_task(call("cancelled", True))
        await asyncio.sleep(0)
        post = asyncio.create_task(call("postprocess", True))
        await asyncio.sleep(0)
        slots.release()  # hands the slot to `doomed`, which is cancelled before it runs
        doomed.cancel()
        await asyncio.gather(*renders, post, return_exceptions=True)
        assert slots.free == 1
        return order

    assert asyncio.run(scenario()) == ["postprocess", "render0", "render1", "render2"]


#: The corpus pages that cost a worker the most memory: a 2550x3300 RGB scan
#: with a soft mask (MuPDF holds image, mask, RGBA and scaled copies at once), a 300 dpi
#: colour JPEG and a bilevel TIFF spread.
def _status_mb(pid: int, field: str) -> float:
    """A memory figure of /proc/PID/status (``VmHWM``, ``RssAnon``, ...) in MB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split(f"{field}:")[1].split()[0]) / 1024


HEAVY_PAGES = ["scan_us-supreme-court-opinion.pdf", "image_brochure-colour-300dpi_linn.jpg",
               "image_receipt-like-lottery-tickets.tif", "image_hi-devanagari.png"]
WORKER_RSS_LIMIT_MB = 200


def test_a_worker_stays_within_its_memory_on_the_heaviest_corpus_pages() -> None:
    """A real pool worker renders and post-processes (one Figure crop each) the heaviest
    pages of the corpus at the engine's full pixel budget; its high-water mark (VmHWM,
    imports included) stays within 200 MB. It was 274 MB in the issue-11 bench run:
    PyMuPDF imported pymupdf.layout (two ONNX Runtime sessions) and pymupdf4llm
    (onnxruntime, numpy), and an image page was copied three times before resizing."""
    from tiny_model import PLANTED_TEXT

    async def main() -> tuple[list[int], int]:
        pool = RenderPool(workers=1)
        try:
            crops = 0
            for name in HEAVY_PAGES:
                page = await pool.render(CORPUS_DIR / "good" / name, 0, None, MAX_PIXELS)
                result = await pool.postprocess(PLANTED_TEXT, "stop", page,
                                                include_images=True,
                                                include_headers_footers=False)
                assert not isinstance(result, str)
                crops += len(result.images)
            hwm = []
            for pid in _worker_pids():
                hwm.append(int(_status_mb(pid, "VmHWM")))
            return hwm, crops
        finally:
            pool.close()

    hwm, crops = asyncio.run(main())
    assert crops == len(HEAVY_PAGES)
    assert len(hwm) == 1
    assert hwm[0] <= WORKER_RSS_LIMIT_MB, f"worker VmHWM {hwm[0]} MB"




def test_a_worker_holds_no_pixels_of_a_one_frame_image_after_its_page() -> None:
    """An image of one frame has no next page to keep its file open for: once its page is
    rendered, the worker's anonymous memory is back where it was before (the 4123x5556
    bilevel TIFF decodes to 23 MB; kept open, that frame stayed in the worker, under the
    next heavy page's own ~90 MB). A multi-frame TIFF is still kept: its next page is a
    seek, not a walk from the first frame."""
    small = CORPUS_DIR / "good" / "image_us-senate-document-1870s.jpg"
    big = CORPUS_DIR / "good" / "image_receipt-like-lottery-tickets.tif"

    async def main() -> tuple[float, float]:
        pool = RenderPool(workers=1)
        try:
            await pool.render(small, 0, None, MAX_PIXELS)
            (pid,) = _worker_pids()
            before = _status_mb(pid, "RssAnon")
            await pool.render(big, 0, None, MAX_PIXELS)
            return before, _status_mb(pid, "RssAnon")
        finally:
            pool.close()

    before, after = asyncio.run(main())
    assert after - before < 8, f"RssAnon {before:.1f} -> {after:.1f} MB"


def test_an_image_page_does_not_import_pymupdf() -> None:
    """Rendering an image page empties MuPDF's store only where PyMuPDF is loaded: it
    never imports PyMuPDF (~125 MB) into a process that had not."""
    code = ("import sys; from pathlib import Path; from chandrad.render import render_page; "
            f"render_page(Path({str(CORPUS_DIR / 'good' / 'image_hi-devanagari.png')!r}), 0, "
            "None, 6291456); print('pymupdf' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "False"


def _thp_off() -> bool:
    try:
        return "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return True


def _minor_faults(pid: int) -> int:
    """The process's minor page faults so far (``minflt``, field 10 of /proc/PID/stat)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def _worker_faults(pool_env: str | None) -> int:
    """A fresh one-worker pool spawned with ``GLIBC_TUNABLES=pool_env`` in the daemon's
    environment renders and post-processes two of the heaviest pages: the worker's minor
    page faults over them. (Its /proc/PID/environ is no witness: glibc rewrites the
    variable in place at start.)"""
    from tiny_model import PLANTED_TEXT

    async def main() -> int:
        pool = RenderPool(workers=1)
        try:
            await pool.probe(CORPUS_DIR / "good" / HEAVY_PAGES[0], 1000)  # spawn, imports
            (pid,) = _worker_pids()
            before = _minor_faults(pid)
            for name in HEAVY_PAGES[:2]:
                page = await pool.render(CORPUS_DIR / "good" / name, 0, None, MAX_PIXELS)
                await pool.postprocess(PLANTED_TEXT, "stop", page, include_images=True,
                                       include_headers_footers=False)
            return _minor_faults(pid) - before
        finally:
            pool.close()

    old = os.environ.pop("GLIBC_TUNABLES", None)
    try:
        if pool_env is not None:
            os.environ["GLIBC_TUNABLES"] = pool_env
        faults = asyncio.run(main())
        assert os.environ.get("GLIBC_TUNABLES") == pool_env  # the daemon's own: as it was
        return faults
    finally:
        os.environ.pop("GLIBC_TUNABLES", None)
        if old is not None:
            os.environ["GLIBC_TUNABLES"] = old


@pytest.mark.skipif(_thp_off(), reason="transparent huge pages are off on this kernel")
def test_workers_take_huge_pages_for_their_page_buffers() -> None:
    """Render workers start with glibc's hugetlb tunable (their page-sized buffers are mapped
    and unmapped each call, and each 4 KiB was a page fault): well under 0.6x the minor
    faults of a worker without it on the heaviest pages (~0.4x; counts, not times: load
    does not change them), also added to tunables an operator set. The daemon's own
    environment is untouched, and the operator's setting of that tunable wins (here
    hugetlb=0: the worker without)."""
    with_thp = _worker_faults(None)
    added = _worker_faults("glibc.malloc.arena_max=2")
    without = _worker_faults("glibc.malloc.hugetlb=0")
    assert with_thp < 0.6 * without, f"{with_thp} faults with huge pages, {without} without"
    assert added < 0.6 * without, f"{added} faults with arena_max=2 added, {without} without"


def test_text_pages_reuse_the_workers_heap_instead_of_fresh_memory() -> None:
    """A worker's buffers for a PDF page without big images (pixmap, PNG, the rows inflated
    for a crop: ~30 MB a page) come from a heap that it keeps between calls, so a page
    after the first few makes the kernel fault in almost no fresh memory: 6 minor faults
    per page here, against 2,048 when every such buffer was mapped and unmapped per call
    and the heap trimmed after each (over the corpus: bench/README.md, "Current
    figures"). The heaviest pages keep their own test
    (``test_a_worker_stays_within_its_memory_on_the_heaviest_corpus_pages``)."""
    from tiny_model import PLANTED_TEXT

    notes = CORPUS_DIR / "good" / "digital_de-math-lecture-notes_117p_geotopo.pdf"

    async def main() -> tuple[int, int]:
        pool = RenderPool(workers=1)
        try:
            async def page(index: int) -> None:
                rendered = await pool.render(notes, index, None, MAX_PIXELS)
                result = await pool.postprocess(PLANTED_TEXT, "stop", rendered,
                                                include_images=True,
                                                include_headers_footers=False)
                assert not isinstance(result, str) and len(result.images) == 1

            for index in range(3):  # spawn, imports, the heap grown to a page's size
                await page(index)
            (pid,) = _worker_pids()
            before = _minor_faults(pid)
            pages = 12
            for index in range(3, 3 + pages):
                await page(index)
            return _minor_faults(pid) - before, pages
        finally:
            pool.close()

    faults, pages = asyncio.run(main())
    assert faults / pages < 1000, f"{faults / pages:.0f} minor faults per text page"
