"""Tests for chandrad.png and the cheaper render/post-processing paths built on it: the
pixels the engine decodes and the outputs made from the engine's answer are exactly those
of the Pillow path they replace (Pillow-encoded RGB PNGs, LANCZOS in RGB, full decode)."""

# PyMuPDF is untyped.
# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

import io
import random

import pymupdf
import pytest
from chandra.settings import settings as chandra_settings
from conftest import CORPUS_DIR
from PIL import Image
from tiny_model import PLANTED_TEXT

from chandrad import ocr, png
from chandrad.render import fit_size, render_page

MAX_PIXELS = 6291456


def _pillow_png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _rgb(data: bytes) -> Image.Image:
    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")


@pytest.mark.parametrize("mode", ["L", "RGB"])
def test_encode_is_lossless_and_decode_reads_it_back(mode: str) -> None:
    rng = random.Random(7)
    width, height = 37, 23
    channels = len(mode)
    pixels = bytes(rng.randrange(256) for _ in range(width * height * channels))
    data = png.encode(pixels, width, height, mode)
    with Image.open(io.BytesIO(data)) as img:
        assert (img.mode, img.size) == (mode, (width, height))
        assert img.tobytes() == pixels
    decoded = png.decode(data)
    assert decoded is not None
    got_mode, w, h, view, stride = decoded
    assert (got_mode, w, h) == (mode, width, height)
    rows = b"".join(bytes(view[y * stride:y * stride + width * channels]) for y in range(h))
    assert rows == pixels


def test_encode_honours_a_stride_and_refuses_short_buffers() -> None:
    rows = [bytes([y] * 6) + b"\xee\xee" for y in range(4)]  # 2 RGB pixels + 2 padding bytes
    data = png.encode(b"".join(rows), 2, 4, "RGB", stride=8)
    assert _rgb(data).tobytes() == b"".join(r[:6] for r in rows)
    with pytest.raises(ValueError):
        png.encode(b"\x00" * 10, 2, 4, "RGB")
    with pytest.raises(ValueError):
        png.encode(b"\x00" * 100, 2, 4, "RGBA")


def test_decode_leaves_other_pngs_to_pillow() -> None:
    img = Image.new("RGB", (40, 30), (10, 200, 30))
    img.putpixel((5, 5), (0, 0, 0))
    assert png.decode(_pillow_png(img)) is None  # Pillow filters its rows
    assert png.decode(b"not a png") is None


@pytest.mark.parametrize("name", [
    "digital_federal-register_15p.pdf",  # PDF: rasterised at the size, encoded from MuPDF
    "image_multipage-fax-g3_3p.tif",  # bilevel: resampled in one channel
    "image_numeric-table-scan.tif",
    "image_brochure-colour-300dpi_linn.jpg",  # colour JPEG
    "image_hi-devanagari.png",
])
def test_page_pixels_are_those_of_the_pillow_rgb_path(name: str) -> None:
    """What the engine decodes (as RGB, vLLM's image_mode) equals the former path: the
    page converted to RGB, LANCZOS-resized in RGB, encoded by Pillow."""
    path = CORPUS_DIR / "good" / name
    page = render_page(path, 0, None, MAX_PIXELS)
    if path.suffix == ".pdf":
        doc = pymupdf.open(path)
        pdf_page = doc[0]
        rect = pdf_page.rect
        scale = chandra_settings.IMAGE_DPI / 72
        width, height = fit_size(rect.width * scale, rect.height * scale,
                                 chandra_settings.MIN_PDF_IMAGE_DIM, MAX_PIXELS)
        pix = pdf_page.get_pixmap(matrix=pymupdf.Matrix(width / rect.width, height / rect.height),
                                  colorspace=pymupdf.csRGB, alpha=False)
        expected = Image.frombytes("RGB", (pix.width, pix.height), pix.samples)
        doc.close()
    else:
        with Image.open(path) as src:
            rgb = src.convert("RGB")
        width, height = fit_size(rgb.width, rgb.height, chandra_settings.MIN_IMAGE_DIM,
                                 MAX_PIXELS)
        expected = rgb.resize((width, height), Image.Resampling.LANCZOS)
    assert (page.width, page.height) == expected.size
    assert _rgb(page.png).tobytes() == _rgb(_pillow_png(expected)).tobytes()


@pytest.mark.parametrize("name", ["scan_book-page_c02-22.pdf",  # an RGB page PNG
                                  "image_multipage-fax-g3_3p.tif"])  # a greyscale one
def test_postprocessing_of_our_png_equals_that_of_a_pillow_png(name: str) -> None:
    """Same answer, same pixels → same Markdown, HTML, blocks and image crops, whether the
    page PNG is ours (decoded lazily, by chandrad.png) or one Pillow wrote."""
    page = render_page(CORPUS_DIR / "good" / name, 0, None, MAX_PIXELS)
    pillow = _pillow_png(_rgb(page.png))
    ours = ocr.parse_page(PLANTED_TEXT, page.png, include_images=True,
                          include_headers_footers=False)
    theirs = ocr.parse_page(PLANTED_TEXT, pillow, include_images=True,
                            include_headers_footers=False)
    assert ours.images, "the planted answer has a Figure: a crop is expected"
    assert (ours.markdown, ours.html, ours.blocks, ours.notes) == (
        theirs.markdown, theirs.html, theirs.blocks, theirs.notes)
    assert ours.images == theirs.images


@pytest.mark.parametrize("mode", ["L", "RGB"])
def test_crops_from_our_png_equal_pillow_crops_of_the_rgb_page(mode: str) -> None:
    """``ocr._LazyPage.crop`` copies only the crop's rows out of the inflated PNG: the
    pixels (and the errors) are those of ``Image.crop`` on the whole page in RGB, for
    boxes inside, on the edges, outside the page, with fractions, and reversed."""
    rng = random.Random(11)
    width, height = 61, 47
    pixels = bytes(rng.randrange(256) for _ in range(width * height * len(mode)))
    data = png.encode(pixels, width, height, mode)
    whole = Image.frombytes(mode, (width, height), pixels).convert("RGB")
    boxes: list[tuple[float, float, float, float]] = [
        (0, 0, width, height), (3, 4, 20, 30), (0, 0, 1, 1), (width - 1, height - 1, width,
                                                              height),
        (10.4, 5.6, 30.5, 40.49), (-5, -5, 10, 10), (50, 40, 80, 60), (7, 7, 7, 9),
        (2, 3, 4, 3)]
    boxes += [(x, y, x + rng.randrange(0, 30), y + rng.randrange(0, 30))
              for x, y in ((rng.randrange(-5, width), rng.randrange(-5, height))
                           for _ in range(40))]
    for box in boxes:
        crop = ocr._LazyPage(data).crop(box)
        assert crop.mode == "RGB"
        assert (crop.size, crop.tobytes()) == (whole.crop(box).size, whole.crop(box).tobytes()), box
    lazy = ocr._LazyPage(data)
    for bad in [(10, 0, 5, 5), (0, 10, 5, 5)]:
        with pytest.raises(ValueError) as ours:
            lazy.crop(bad)
        with pytest.raises(ValueError) as theirs:
            whole.crop(bad)
        assert str(ours.value) == str(theirs.value)
    # Several crops of one page, after a box that took the whole-page path.
    assert lazy.crop((-1, -1, 3, 3)).tobytes() == whole.crop((-1, -1, 3, 3)).tobytes()
    assert lazy.crop((1, 2, 9, 8)).tobytes() == whole.crop((1, 2, 9, 8)).tobytes()
    # Crops of one page going down, then up again: rows are inflated further as needed.
    lazy = ocr._LazyPage(data)
    for box in [(1, 0, 9, 5), (2, 30, 9, 40), (0, 1, 4, 2), (5, 40, 60, 47), (3, 3, 5, 5)]:
        assert lazy.crop(box).tobytes() == whole.crop(box).tobytes(), box


def test_a_crop_inflates_the_page_only_down_to_its_last_row() -> None:
    """A crop near the top of a page never inflates the rows below it: here the page's
    deflate stream stops half way and the crops above that still come out (before, the
    whole page was inflated: not ours, so Pillow read it and refused the truncated PNG)."""
    rng = random.Random(5)
    width, height = 200, 400
    pixels = rng.randbytes(width * height * 3)  # incompressible: rows map onto bytes
    data = png.encode(pixels, width, height, "RGB")
    idat = data[41:-16]  # signature, IHDR chunk, IDAT length and tag | crc, IEND
    assert png.decode(data) is not None and data[37:41] == b"IDAT"
    cut = data[:33] + png._chunk(b"IDAT", idat[:len(idat) // 2]) + data[-12:]
    whole = Image.frombytes("RGB", (width, height), pixels)
    lazy = ocr._LazyPage(cut)
    for box in [(10, 20, 150, 60), (0, 0, 200, 100)]:
        assert lazy.crop(box).tobytes() == whole.crop(box).tobytes(), box
    with pytest.raises(OSError):  # Pillow's error, as before, for rows that are not there
        lazy.crop((0, 300, 10, 310))
