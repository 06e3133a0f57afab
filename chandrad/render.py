"""Page rendering: input files → page PNGs at Chandra's size policy, in a process pool.

Owns content sniffing (:func:`probe`), rasterising one page (:func:`render_page`:
PyMuPDF for PDFs, Pillow for images), the guards against hostile input, and
:class:`RenderPool`, which runs both in worker processes so that a slow or crashing
page never blocks or kills the daemon.

Size policy (Chandra 2, chandra-ocr 0.2.0):

* PDFs are rendered at ``max(IMAGE_DPI, min_side_px / shortest side in points * 72)``
  dpi (``chandra.input.load_pdf_images``; ``IMAGE_DPI`` is 192 in ``chandra.settings``).
* Images are upscaled so the shortest side is at least ``MIN_IMAGE_DIM`` (1536,
  ``chandra.input.load_image``); PDFs use ``MIN_PDF_IMAGE_DIM`` (1024). A configured
  ``min_side_px`` replaces both (``None``: Chandra's, per kind).
* Then ``chandra.model.util.scale_to_fit`` decides the final size: total pixels within
  ``max_pixels`` and both sides snapped to its 28-px grid. We ask it for the size up
  front, so a PDF page is rasterised directly at the final size (never at a huge zoom
  and shrunk afterwards) and an image is resampled once.

The page PNG is therefore exactly what Chandra's vLLM client would send (it calls
``scale_to_fit`` again, which is then a no-op), and block bboxes are in its pixels.
"""

# PyMuPDF ships partial annotations: many of its methods are untyped.
# mypy: disable-error-code="no-untyped-call"
from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import math
import multiprocessing
import multiprocessing.context
import os
import signal
import sys
import weakref
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import structlog
from PIL import Image, ImageOps, UnidentifiedImageError, features

if TYPE_CHECKING:
    import pymupdf

# PyMuPDF (~125 MB resident) and chandra's util/output (~30 MB) are imported inside the
# functions that run in the worker processes, never in the daemon itself.

from chandrad import malloc, ocr, png, textlayer
from chandrad.errors import (
    DecompressionBomb,
    EmptyInput,
    EncryptedInput,
    InputError,
    RenderCrashed,
    RenderTimeout,
    TooManyPages,
    UnsupportedFormat,
)

log = structlog.get_logger(__name__)

#: Image formats Chandra's CLI accepts (chandra/scripts/cli.py), by Pillow format name.
IMAGE_FORMATS = frozenset({"PNG", "JPEG", "GIF", "WEBP", "TIFF", "BMP", "MPO"})
#: Decoded by the Pillow chandrad ships, beyond Chandra's list: AVIF (Pillow >= 11.2).
EXTRA_IMAGE_FORMATS = frozenset({"AVIF"})
#: ISO-BMFF brands (the ``ftyp`` box) of HEIC/HEIF images, which chandrad refuses: their
#: decoders (libheif with libde265, as pillow-heif bundles them with x265) are LGPL/GPL.
HEIF_BRANDS = frozenset({b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"hevm",
                         b"hevs", b"mif1", b"msf1", b"heif"})
HEIC_ADVICE = ("HEIC/HEIF images are not supported; convert to JPEG, PNG or AVIF first, "
               "e.g. `heif-convert in.heic out.jpg` (libheif-examples) or "
               "`magick in.heic out.jpg` (ImageMagick)")
#: Formats whose extra frames are pages. Animated GIF/WEBP frames are not pages.
MULTIPAGE_FORMATS = frozenset({"TIFF"})
#: Greyscale modes wider than 8 bits (16-bit, 32-bit integer, float); see _wide_grey_to_l.
WIDE_GREY_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I", "F"})
#: Largest decoded size of one image embedded in a PDF (bytes at its own depth).
#: A 35000 x 35000 1-bit scan is 153 MB and renders fine; 1 GiB is ~18900^2 RGB.
MAX_PDF_IMAGE_BYTES = 1 << 30
#: Components per colour space, for the decoded-size estimate; unknown spaces count as 4.
_COMPONENTS = {"DeviceGray": 1, "CalGray": 1, "Indexed": 1, "DeviceRGB": 3, "CalRGB": 3}
_SNIFF_BYTES = 1024
#: Pillow's own decompression-bomb limit (it raises above twice MAX_IMAGE_PIXELS).
_MAX_IMAGE_PIXELS = 2 * (Image.MAX_IMAGE_PIXELS or 0) or 1 << 31
_EXIF_ORIENTATION = 0x0112
#: Times a call reruns because another call's timeout killed the pool under it.
MAX_INNOCENT_RERUNS = 3
#: How often a call waiting on a worker checks that the pool's workers are alive.
WORKER_CHECK_S = 0.5


@dataclass(frozen=True)
class DocumentInfo:
    """What :func:`probe` learned about an input file."""

    kind: str  # "pdf" | "image"
    page_count: int
    format: str  # "PDF" or the Pillow format name ("JPEG", "TIFF", ...)


class _SizeProbe:
    """Stands in for a PIL image so ``scale_to_fit`` tells us its target size.

    ``scale_to_fit`` only reads ``.size`` and calls ``.resize(size, resample=...)``;
    answering with the size lets Chandra's own rule pick the size without allocating
    pixels (the 35000 px page would otherwise need a 1.2 Gpx image).
    """

    def __init__(self, width: int, height: int) -> None:
        self.size = (width, height)

    def resize(self, size: tuple[int, int], resample: Any = None) -> tuple[int, int]:
        return (int(size[0]), int(size[1]))


def fit_size(width: float, height: float, min_side_px: int, max_pixels: int) -> tuple[int, int]:
    """The final pixel size for a page of ``width`` x ``height`` at zoom 1.

    Upscales so the shortest side reaches ``min_side_px``, then applies
    ``chandra.model.util.scale_to_fit`` with a pixel budget of ``max_pixels``.
    """
    if width <= 0 or height <= 0:
        raise InputError(f"page has no area ({width:g} x {height:g})")
    scale = max(1.0, min_side_px / min(width, height))
    w = max(1, int(width * scale))
    h = max(1, int(height * scale))
    result = ocr.chandra_util().scale_to_fit(_SizeProbe(w, h), max_size=(max_pixels, 1))
    if isinstance(result, _SizeProbe):  # unchanged: already on the grid and in budget
        return result.size
    return (int(result[0]), int(result[1]))


def _sniff(path: Path) -> bytes:
    try:
        with path.open("rb") as fh:
            head = fh.read(_SNIFF_BYTES)
    except FileNotFoundError as exc:
        raise InputError(f"{path.name}: file disappeared before it could be read") from exc
    except OSError as exc:
        raise InputError(f"{path.name}: cannot read: {exc.strerror or exc}") from exc
    if not head:
        raise EmptyInput(f"{path.name}: file is empty (0 bytes)")
    return head


def _is_pdf(head: bytes) -> bool:
    # The PDF header may follow up to 1024 bytes of junk (ISO 32000-1, annex H.3).
    return b"%PDF-" in head


def is_heif(head: bytes) -> bool:
    """An ISO-BMFF image whose brands are HEIF's and not AVIF's (an AVIF file may list
    the generic ``mif1`` too)."""
    if len(head) < 16 or head[4:8] != b"ftyp":
        return False
    size = int.from_bytes(head[:4], "big")
    box = head[8:min(max(size, 16), len(head))]
    brands = {box[i:i + 4] for i in range(0, len(box) - 3, 4)} - {box[4:8]}  # no version
    return not brands & {b"avif", b"avis"} and bool(brands & HEIF_BRANDS)


def _mupdf_open(path: Path) -> pymupdf.Document:
    """``pymupdf.open`` by name; MuPDF takes names as UTF-8, so a name that is not
    (undecodable bytes) is opened through ``/proc/self/fd`` of our own descriptor."""
    import pymupdf

    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return pymupdf.open(f"/proc/self/fd/{fd}", filetype="pdf")
        finally:
            os.close(fd)  # MuPDF holds its own descriptor
    return pymupdf.open(path, filetype="pdf")


def _open_pdf(path: Path) -> pymupdf.Document:
    import pymupdf

    try:
        doc = _mupdf_open(path)
    except pymupdf.EmptyFileError as exc:
        raise EmptyInput(f"{path.name}: file is empty") from exc
    except Exception as exc:  # MuPDF raises FileDataError and plain RuntimeErrors
        raise InputError(f"{path.name}: PDF cannot be opened: {exc}") from exc
    if doc.needs_pass and not doc.authenticate(""):
        doc.close()
        raise EncryptedInput(
            f"{path.name}: PDF is encrypted with a user (open) password; "
            "remove the password and drop the file again"
        )
    try:
        pages = doc.page_count
    except Exception as exc:  # a page tree whose /Count lies: "Invalid number of pages"
        doc.close()
        raise InputError(f"{path.name}: PDF page tree is invalid: {exc}") from exc
    if pages == 0:
        repaired = doc.is_repaired
        doc.close()
        if repaired:
            raise InputError(
                f"{path.name}: PDF is damaged (truncated or still being written?): "
                "no page could be recovered"
            )
        raise EmptyInput(f"{path.name}: PDF has no pages")
    return doc


def _open_image(path: Path) -> Image.Image:
    try:
        img = Image.open(path)
    except Image.DecompressionBombError as exc:
        raise DecompressionBomb(
            f"{path.name}: image refused as a decompression bomb: {exc}"
        ) from exc
    except UnidentifiedImageError as exc:
        if is_heif(_sniff(path)):
            raise UnsupportedFormat(f"{path.name}: {HEIC_ADVICE}") from exc
        raise UnsupportedFormat(
            f"{path.name}: not a PDF or a supported image (content is not recognised)"
        ) from exc
    except OSError as exc:
        raise InputError(f"{path.name}: image header cannot be read: {exc}") from exc
    if img.format not in IMAGE_FORMATS | EXTRA_IMAGE_FORMATS:
        fmt = img.format
        img.close()
        raise UnsupportedFormat(
            f"{path.name}: image format {fmt} is not supported "
            f"(supported: PDF, {', '.join(sorted(IMAGE_FORMATS | EXTRA_IMAGE_FORMATS))})"
        )
    return img


def check_format(path: Path) -> None:
    """Raise what the pipeline would refuse ``path`` for by its kind alone (EmptyInput,
    UnsupportedFormat): a PDF header, else an image Pillow opens in a supported format.
    The HTTP API answers 415 with that code before it accepts an upload; anything else
    (a damaged PDF, a decompression bomb) is found by the job, as for a watched file."""
    if _is_pdf(_sniff(path)):
        return
    try:
        _open_image(path).close()
    except (UnsupportedFormat, EmptyInput):
        raise
    except InputError:
        return


def _image_pages(img: Image.Image) -> int:
    if img.format in MULTIPAGE_FORMATS:
        return int(getattr(img, "n_frames", 1))
    return 1


def probe(path: Path, max_pages: int, *, keep_open: bool = False) -> DocumentInfo:
    """Identify ``path`` by content and count its pages; raise an ``InputError`` if unusable.

    ``keep_open`` (in a render worker): leave a PDF or a multi-frame image open among the
    worker's kept files, as rendering does, so that its first page, which usually follows
    at once, does not open and parse the file again."""
    head = _sniff(path)
    if _is_pdf(head):
        with _kept_open(path, _open_pdf, lambda doc: keep_open) as doc:
            info = DocumentInfo(kind="pdf", page_count=doc.page_count, format="PDF")
    else:
        with _kept_open(path, _open_image,
                        lambda img: keep_open and _image_pages(img) > 1) as img:
            try:
                info = DocumentInfo(kind="image", page_count=_image_pages(img),
                                    format=str(img.format))
            except Exception as exc:
                raise InputError(f"{path.name}: cannot count the image's pages: {exc}") from exc
    if info.page_count > max_pages:
        raise TooManyPages(
            f"{path.name}: {info.page_count} pages exceeds the limit of {max_pages} (ocr.max_pages)"
        )
    return info


def _check_pdf_images(path: Path, page: pymupdf.Page) -> int:
    """Refuse a page embedding an image too large to decode; the decoded bytes of all its
    images otherwise."""
    total = 0
    for item in page.get_images(full=True):
        width, height, bpc, colorspace = item[2], item[3], item[4], item[5]
        components = _COMPONENTS.get(str(colorspace), 4)
        decoded = width * height * max(1, bpc) * components // 8
        if decoded > MAX_PDF_IMAGE_BYTES:
            raise DecompressionBomb(
                f"{path.name}: page {page.number + 1} embeds a {width}x{height} image "
                f"({decoded / 2**30:.1f} GiB decoded, limit {MAX_PDF_IMAGE_BYTES / 2**30:.0f} GiB)"
            )
        total += decoded
    return total


def _encode_png(img: Image.Image) -> bytes:
    if img.mode not in png.MODES:
        img = img.convert("RGB")
    return png.encode(img.tobytes(), img.width, img.height, img.mode)


def _final(index: int, img: Image.Image, max_pixels: int) -> ocr.PageImage:
    # A no-op when the size is already what scale_to_fit wants (the normal case).
    img = ocr.chandra_util().scale_to_fit(img, max_size=(max_pixels, 1))
    return ocr.PageImage(index=index, width=img.width, height=img.height, png=_encode_png(img))


def _render_pdf_page(
    path: Path, index: int, min_side_px: int | None, max_pixels: int
) -> ocr.PageImage:
    import pymupdf
    from chandra.settings import settings as chandra_settings

    if min_side_px is None:
        min_side_px = int(chandra_settings.MIN_PDF_IMAGE_DIM)

    with _kept_open(path, _open_pdf, lambda doc: True) as doc:
        if not 0 <= index < doc.page_count:
            raise InputError(
                f"{path.name}: page {index + 1} does not exist ({doc.page_count} pages)"
            )
        page = doc[index]
        if _check_pdf_images(path, page) > _BIG_PAGE_IMAGES_BYTES:
            _heavy_call()  # room for this page's decoded images
        rect = page.rect  # rotation and /UserUnit already applied by MuPDF
        min_side_pt = min(rect.width, rect.height)
        if min_side_pt <= 0:
            raise InputError(f"{path.name}: page {index + 1} has an empty page box")
        dpi_scale = chandra_settings.IMAGE_DPI / 72
        width, height = fit_size(
            rect.width * dpi_scale, rect.height * dpi_scale, min_side_px, max_pixels
        )
        matrix = pymupdf.Matrix(width / rect.width, height / rect.height)
        try:
            pix = page.get_pixmap(matrix=matrix, colorspace=pymupdf.csRGB, alpha=False)
        except Exception as exc:
            raise InputError(f"{path.name}: page {index + 1} cannot be rendered: {exc}") from exc
        if (pix.width, pix.height) == (width, height):  # the normal case: no copy
            return ocr.PageImage(index=index, width=width, height=height, png=png.encode(
                pix.samples_mv, width, height, "RGB", stride=pix.stride))
        # MuPDF rounds the pixmap box outward by a pixel.
        img = Image.frombuffer("RGB", (pix.width, pix.height), pix.samples_mv, "raw", "RGB",
                               pix.stride, 1)
        img = img.resize((width, height), Image.Resampling.LANCZOS)
        return _final(index, img, max_pixels)


def _wide_grey_to_l(img: Image.Image) -> Image.Image:
    """16-bit, 32-bit integer or float greyscale → 8-bit ``L``, stretched from the frame's own
    darkest to its lightest value (``convert("RGB")`` would clip them to 0..255: a blank page).

    Min/max rather than bit depth: the depth a file declares is often not the range it
    uses (12-bit sensors in 16-bit containers, float data in arbitrary units), and OCR
    needs the contrast. A frame of one value is white.
    """
    grey = img.convert("F")
    lo, hi = cast(tuple[float, float], grey.getextrema())  # one band: (min, max)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise InputError(f"{img.mode} image has non-finite pixel values (NaN or infinity)")
    if hi <= lo:
        return Image.new("L", img.size, 255)
    scale = 255.0 / (hi - lo)
    return grey.point(lambda v: v * scale - lo * scale).convert("L")


def _to_page_mode(img: Image.Image) -> Image.Image:
    """The frame as 8-bit ``L`` (greyscale sources: bilevel, 8-bit and wider grey) or
    ``RGB`` (everything else; transparency over white); the frame itself, not a copy,
    when it already is one of those.

    A grey page stays one channel: resampling and PNG-encoding one channel costs a third
    of three, and the engine converts it to RGB on load (vLLM's ``image_mode``), which
    gives exactly the pixels of converting first (each channel is resampled alike).
    """
    if img.mode in WIDE_GREY_MODES:
        img = _wide_grey_to_l(img)
    if img.mode == "L":
        return img  # no copy: the caller resizes or encodes it while it is open
    if img.mode == "1":
        return img.convert("L")  # bilevel: 0/255, as its RGB conversion; LANCZOS, not NEAREST
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")


#: EXIF orientations that turn or flip the image (1: as stored).
_TURNS = frozenset(range(2, 9))

_FileKey = tuple[str, int, int, int, int, int]
#: Files a worker process rendered pages of lately, kept open with the identity of the
#: file (path, device, inode, size, mtime, ctime), most recently used last:
#: * a PDF: MuPDF parses the cross-reference table and page tree once, and the fonts it
#:   loaded for one page (in its resource store, which :func:`_release_memory` then keeps
#:   while it is small) serve the next: ~16 instead of ~27 ms of CPU per PDF page;
#: * an image of several frames: Pillow remembers the offset of every frame it has walked
#:   past, so the next page of the same TIFF is one seek instead of a walk from frame 1 (a
#:   4,000-page TIFF took ~n^2/2 frame-header reads otherwise). It also holds the frame it
#:   decoded last, which is why an image of one frame is never kept: it has no next page,
#:   and its pixels (a 4123x5556 bilevel scan: 23 MB) stayed in the worker under the next
#:   heavy page's.
#: Pages of a file mostly come in order, but several jobs render at once, so a few files
#: are kept. A file replaced or rewritten at the same path has a new identity (a new inode;
#: a write moves mtime and ctime) and is opened anew; the old one is closed then. An open
#: file holds its inode: a deleted input's space is freed when the worker lets go of it
#: (at most KEEP_OPEN_FILES later files).
KEEP_OPEN_FILES = 4
_kept: dict[_FileKey, Any] = {}  # Image.Image | pymupdf.Document, insertion = use order


def _file_key(path: Path) -> _FileKey:
    st = os.stat(path)
    return (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _let_go(keep: int = 0) -> None:
    """Close kept files, the least recently used first, until ``keep`` are left."""
    while len(_kept) > keep:
        _kept.pop(next(iter(_kept))).close()


atexit.register(_let_go)  # closed, not left to the garbage collector's ResourceWarning


@contextlib.contextmanager
def _kept_open(path: Path, opener: Any, keep: Any) -> Iterator[Any]:
    """``opener(path)``, or this worker's open copy of the same file (same path, inode,
    size, mtime and ctime); kept open afterwards if ``keep(opened)`` says so and using it
    did not fail (a failure may have left it in any state)."""
    try:
        key = _file_key(path)
    except OSError as exc:
        raise InputError(f"{path.name}: cannot read: {exc.strerror or exc}") from exc
    opened = _kept.pop(key, None)
    if opened is None:
        for stale in [k for k in _kept if k[0] == key[0]]:  # replaced at the same path
            _kept.pop(stale).close()
        opened = opener(path)
    try:
        yield opened
    except BaseException:
        opened.close()
        raise
    if keep(opened):
        _kept[key] = opened
        _let_go(KEEP_OPEN_FILES)
    else:
        opened.close()


def _render_image_page(
    path: Path, index: int, min_side_px: int | None, max_pixels: int
) -> ocr.PageImage:
    if min_side_px is None:
        from chandra.settings import settings as chandra_settings

        min_side_px = int(chandra_settings.MIN_IMAGE_DIM)
    with _kept_open(path, _open_image, lambda img: _image_pages(img) > 1) as img:
        pages = _image_pages(img)
        if not 0 <= index < pages:
            raise InputError(f"{path.name}: page {index + 1} does not exist ({pages} pages)")
        try:
            img.seek(index)
            if img.width * img.height > _MAX_IMAGE_PIXELS:  # Pillow checks frame 1 only
                raise DecompressionBomb(
                    f"{path.name}: page {index + 1} is {img.width}x{img.height} pixels, "
                    f"more than the limit of {_MAX_IMAGE_PIXELS}"
                )
            orientation = img.getexif().get(_EXIF_ORIENTATION, 1)
            turned = orientation in (5, 6, 7, 8)
            shown = (img.height, img.width) if turned else img.size
            width, height = fit_size(shown[0], shown[1], min_side_px, max_pixels)
            if img.format == "JPEG":  # let libjpeg decode at 1/2, 1/4 or 1/8 when that suffices
                img.draft("RGB", (height, width) if turned else (width, height))
            # exif_transpose copies the whole frame even when nothing turns (2..8 do).
            oriented = ImageOps.exif_transpose(img) if orientation in _TURNS else img
            pixels = _to_page_mode(oriented)
            del oriented
            pixels.load()  # decode errors surface here, not in resize or encode
        except Image.DecompressionBombError as exc:
            raise DecompressionBomb(f"{path.name}: refused as a decompression bomb: {exc}") from exc
        except (OSError, ValueError, SyntaxError, EOFError) as exc:
            raise InputError(
                f"{path.name}: page {index + 1} image data cannot be decoded "
                f"(truncated or corrupt): {exc}"
            ) from exc
        if pixels.size != (width, height):
            pixels = pixels.resize((width, height), Image.Resampling.LANCZOS)
        elif pixels is img:  # the file's own frame: encode it before it is closed
            return _final(index, pixels, max_pixels)
    # The decoded source is closed (freed) before the PNG encoder's copy is made.
    return _final(index, pixels, max_pixels)


def render_page(
    path: Path, index: int, min_side_px: int | None, max_pixels: int
) -> ocr.PageImage:
    """Render page ``index`` (0-based) of ``path`` to a PNG at Chandra's size policy.

    ``min_side_px=None``: Chandra's minimum for the kind of input (PDF 1024, image 1536).
    """
    head = _sniff(path)
    if _is_pdf(head):
        return _render_pdf_page(path, index, min_side_px, max_pixels)
    _heavy_call()  # MuPDF's fonts are no use to Pillow
    return _render_image_page(path, index, min_side_px, max_pixels)


#: An image's resolution outside this range is taken as missing (72 dpi: a pixel a point).
_DPI_RANGE = (10.0, 10000.0)
#: EXIF orientation → degrees PyMuPDF's ``insert_image`` turns the stored JPEG by.
_JPEG_TURNS = {1: 0, 3: 180, 6: 270, 8: 90}
#: TIFF tags read back from a G4 encoding (TIFF 6.0).
_PHOTOMETRIC, _STRIP_OFFSETS, _ROWS_PER_STRIP, _STRIP_BYTE_COUNTS = 262, 273, 278, 279
#: Pillow built with libtiff, which writes G4 (else 1-bit frames go in as PNG).
_LIBTIFF = bool(features.check("libtiff"))


def _dpi(img: Image.Image) -> tuple[float, float]:
    try:
        x, y = (float(v) for v in img.info.get("dpi", (72.0, 72.0)))
    except (TypeError, ValueError):
        return (72.0, 72.0)
    lo, hi = _DPI_RANGE
    return (x, y) if lo <= x <= hi and lo <= y <= hi else (72.0, 72.0)


def _frame(path: Path, img: Image.Image, index: int) -> textlayer.Frame:
    """Page ``index`` of an image input as the searchable PDF embeds it: a JPEG's own
    bytes (turned by its EXIF orientation), anything else decoded (upright, as rendered
    for OCR) and stored as PNG (1-bit frames stay 1-bit)."""
    import io

    img.seek(index)
    orientation = img.getexif().get(_EXIF_ORIENTATION, 1)
    dpi = _dpi(img)
    if img.format == "JPEG" and orientation in _JPEG_TURNS and _image_pages(img) == 1:
        turned = orientation in (6, 8)
        width, height = (img.height, img.width) if turned else img.size
        if turned:
            dpi = (dpi[1], dpi[0])
        return textlayer.Frame(width, height, dpi, path.read_bytes(), _JPEG_TURNS[orientation])
    oriented = ImageOps.exif_transpose(img) if orientation in _TURNS else img
    if oriented.mode == "1" and _LIBTIFF:
        return _g4_frame(oriented, dpi)
    pixels = oriented if oriented.mode == "1" else _to_page_mode(oriented)
    buf = io.BytesIO()
    pixels.save(buf, format="PNG", compress_level=1)  # MuPDF inflates and deflates it again
    return textlayer.Frame(pixels.width, pixels.height, dpi, buf.getvalue())


def _g4_frame(img: Image.Image, dpi: tuple[float, float]) -> textlayer.Frame:
    """A 1-bit frame as a CCITT G4 stream: libtiff encodes it as a one-strip TIFF, whose
    strip is the stream (its photometric interpretation gives ``BlackIs1``)."""
    import io

    buf = io.BytesIO()
    img.save(buf, format="TIFF", compression="group4", tiffinfo={_ROWS_PER_STRIP: img.height})
    data = buf.getvalue()
    with Image.open(io.BytesIO(data)) as tiff:
        tags = tiff.tag_v2  # type: ignore[attr-defined]
        offsets, counts = tags[_STRIP_OFFSETS], tags[_STRIP_BYTE_COUNTS]
        min_is_black = tags.get(_PHOTOMETRIC, 0) == 1
    if len(offsets) != 1:
        raise InputError(f"G4 encoding gave {len(offsets)} strips, not one")
    return textlayer.Frame(img.width, img.height, dpi, data[offsets[0]:offsets[0] + counts[0]],
                           g4_black_is_1=min_is_black)


def searchable_pdf(path: Path, layouts: list[textlayer.PageLayout], text_pages: str) -> bytes:
    """The searchable PDF of ``path`` (see :mod:`chandrad.textlayer`): a PDF input with
    its own pages kept, an image input as one page per frame."""
    head = _sniff(path)
    _heavy_call()  # a whole document at once
    if _is_pdf(head):
        doc = _open_pdf(path)  # a copy of our own: it is changed
        try:
            return textlayer.pdf_with_layer(doc, layouts, text_pages)
        except InputError:
            raise
        except Exception as exc:  # MuPDF on a damaged file
            raise InputError(f"{path.name}: searchable PDF cannot be made: {exc}") from exc
        finally:
            doc.close()
    img = _open_image(path)
    try:
        frames = [_frame(path, img, i) for i in range(min(_image_pages(img), len(layouts)))]
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise InputError(f"{path.name}: image cannot be decoded for the PDF: {exc}") from exc
    finally:
        img.close()
    return textlayer.image_pdf(frames, layouts)


def write_searchable_pdf(path: Path, layouts: list[textlayer.PageLayout], text_pages: str,
                         out: Path) -> int:
    """:func:`searchable_pdf` written to the new file ``out`` and fsynced; its size. A
    failed write leaves no file."""
    data = searchable_pdf(path, layouts, text_pages)
    try:
        fh = out.open("xb")  # never over a file that is there
    except OSError as exc:
        raise InputError(f"{path.name}: searchable PDF cannot be written: "
                         f"{exc.strerror or exc}") from exc
    try:
        with fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        with contextlib.suppress(OSError):
            out.unlink()  # ours, half written
        raise InputError(f"{path.name}: searchable PDF cannot be written: "
                         f"{exc.strerror or exc}") from exc
    return len(data)


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this worker when the daemon dies (Linux
    PR_SET_PDEATHSIG), so a daemon killed with -9 leaves no render workers behind."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


#: A light call (a PDF page without big images, a post-processing) takes its buffers (the
#: pixmap, the PNG, the rows inflated for a crop: ~30 MB a page) from the heap, which keeps
#: them for the next call: no fresh memory for the kernel to fault in and zero on every
#: call (what it saves per page: bench/README.md, "Current figures").
_MMAP_THRESHOLD_LIGHT = 32 << 20
#: A heavy call (an image page, a PDF page whose images decode to more than
#: _BIG_PAGE_IMAGES_BYTES) starts from a trimmed heap and maps every buffer over this
#: size, so the memory goes back to the kernel as soon as it is freed.
_MMAP_THRESHOLD_HEAVY = 1 << 20
#: The heap keeps up to this much free memory at its top between calls ...
_TRIM_THRESHOLD_BYTES = 64 << 20
#: ... unless the worker holds more than this after a call: then it is trimmed.
TRIM_ABOVE_RSS_BYTES = 140 << 20


#: Modules PyMuPDF imports when installed, none of which rendering uses.
_PYMUPDF_EXTRAS = ("pymupdf.layout", "pymupdf4llm")


#: A worker keeps MuPDF's resource store (the fonts and images it decoded, up to 256 MB)
#: between calls while its resident memory stays below this (~84 MB after its imports,
#: plus the heap it keeps for the next page's buffers):
#: the fonts of a kept PDF then serve its next page. Above it, before an image page and
#: before a PDF page whose images decode to more than _BIG_PAGE_IMAGES_BYTES, the store is
#: emptied, so a heavy page (~115 MB for a 2550x3300 RGB scan with a soft mask) starts
#: from the imports alone and a worker's high-water mark stays within 200 MB.
STORE_KEEP_RSS_BYTES = 140 << 20
_BIG_PAGE_IMAGES_BYTES = 8 << 20


def _resident_bytes() -> int:
    with open("/proc/self/statm", "rb") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _release_memory(keep_store: bool = True) -> None:
    """After each call in a worker: empty MuPDF's resource store unless it is worth keeping
    (``keep_store`` and the worker below STORE_KEEP_RSS_BYTES) and hand freed heap back to
    the kernel when the worker holds more than TRIM_ABOVE_RSS_BYTES (always when not
    ``keep_store``), so a worker's RSS stays within its budget (bench/README.md)."""
    resident = _resident_bytes() if keep_store else 0
    pymupdf = sys.modules.get("pymupdf")  # not imported (yet) here: no store to empty
    if pymupdf is not None and (not keep_store or resident > STORE_KEEP_RSS_BYTES):
        pymupdf.TOOLS.store_shrink(100)
    if not keep_store or resident > TRIM_ABOVE_RSS_BYTES:
        malloc.trim()


#: Whether this process is a render worker (set by :func:`_worker_init`): only then does
#: a call change how glibc allocates.
_is_worker = False
#: Whether the call running in this worker is heavy (:func:`_heavy_call`).
_heavy = False


def _malloc_for(heavy: bool) -> None:
    """Set glibc's mmap threshold for a light or a heavy call (the constants above)."""
    global _heavy
    if not _is_worker:
        return
    _heavy = heavy
    malloc.set_option(malloc.M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)
    malloc.set_option(malloc.M_MMAP_THRESHOLD,
                      _MMAP_THRESHOLD_HEAVY if heavy else _MMAP_THRESHOLD_LIGHT)


def _heavy_call() -> None:
    """Before a page whose decoding takes far more memory than a text page's: the store
    emptied, the heap trimmed and its large buffers mapped apart, so the page starts from
    the imports alone and gives its memory back when done."""
    _release_memory(keep_store=False)
    _malloc_for(heavy=True)


def _in_worker(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    finally:
        if _heavy:
            _malloc_for(heavy=False)
            _release_memory(keep_store=False)
        else:
            _release_memory()


def _worker_init(parent: int) -> None:
    # Ctrl-C on a terminal reaches the whole foreground process group: the daemon (or a
    # `chandrad batch`) decides how to stop; a worker killed by it mid-page would be taken
    # for a crash and fail the page.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    global _is_worker
    _is_worker = True
    _malloc_for(heavy=False)
    if os.getppid() != parent:
        # The daemon died before the signal was armed (the spawn bootstrap can take
        # seconds): nothing will ever be asked of this worker, so leave now.
        os._exit(0)
    # PyMuPDF imports its optional companions when they are installed (chandra-ocr brings
    # them): ``pymupdf.layout`` builds two ONNX Runtime sessions and ``pymupdf4llm``
    # imports onnxruntime and numpy: RSS and start-up CPU in every worker (bench/README.md,
    # "Current figures") for features rendering never uses.
    # ``None`` in ``sys.modules`` makes those imports raise ImportError, which PyMuPDF
    # takes as "not installed".
    for optional in _PYMUPDF_EXTRAS:
        sys.modules.setdefault(optional, None)  # type: ignore[arg-type]
    import pymupdf

    # Quiet MuPDF's stderr chatter about repaired xrefs; errors still raise.
    pymupdf.TOOLS.mupdf_display_errors(False)
    pymupdf.TOOLS.mupdf_display_warnings(False)


#: glibc tunable a render worker starts with: malloc asks the kernel for transparent huge
#: pages (``madvise``) on the memory it maps. A heavy page's large buffers are mapped and
#: unmapped on every call (``_MMAP_THRESHOLD_HEAVY``, for the RSS target); without huge
#: pages each 4 KiB of them is a page fault. The high-water mark is the same either way; the
#: faults and system time saved: bench/README.md, "Current figures".
#: glibc reads tunables only when a process starts.
WORKER_GLIBC_TUNABLE = "glibc.malloc.hugetlb=1"


@contextlib.contextmanager
def _worker_environment() -> Iterator[None]:
    """``GLIBC_TUNABLES`` with :data:`WORKER_GLIBC_TUNABLE` added (unless it already sets
    that tunable) while a worker is spawned; the daemon's own environment is left as it was
    (its other children, the engine among them, never see it)."""
    before = os.environ.get("GLIBC_TUNABLES")
    name = WORKER_GLIBC_TUNABLE.split("=", 1)[0]
    if before is not None and name in before:
        yield
        return
    os.environ["GLIBC_TUNABLES"] = (f"{before}:{WORKER_GLIBC_TUNABLE}" if before
                                    else WORKER_GLIBC_TUNABLE)
    try:
        yield
    finally:
        if before is None:
            del os.environ["GLIBC_TUNABLES"]
        else:
            os.environ["GLIBC_TUNABLES"] = before


class _WorkerProcess(multiprocessing.context.SpawnProcess):
    """A spawned render worker, started with :data:`WORKER_GLIBC_TUNABLE`."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:  # noqa: N802 - multiprocessing's name
        with _worker_environment():
            return multiprocessing.context.SpawnProcess._Popen(process_obj)


class _WorkerContext(multiprocessing.context.SpawnContext):
    Process = _WorkerProcess


class _Slots:
    """One slot per worker, handed out first to urgent calls, then in arrival order.

    Post-processing is urgent: it finishes a page the engine has already answered (and
    gives back the page's place in the pipeline's window), so it must not queue behind
    renders of pages that are not needed yet.
    """

    def __init__(self, slots: int) -> None:
        self.free = slots
        self._waiting: tuple[deque[asyncio.Future[None]], deque[asyncio.Future[None]]] = (
            deque(), deque())  # (urgent, others)

    async def acquire(self, urgent: bool) -> None:
        if self.free > 0 and not any(self._waiting):
            self.free -= 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting[0 if urgent else 1].append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # the slot was handed over just as we were cancelled
            raise

    def release(self) -> None:
        """Hand the slot to the next waiter (urgent first), or free it."""
        for queue in self._waiting:
            while queue:
                future = queue.popleft()
                if not future.done():
                    future.set_result(None)
                    return
        self.free += 1


#: Every pool of this process, to know whether another one still runs.
_POOLS: weakref.WeakSet[RenderPool] = weakref.WeakSet()


def _worker_processes(executor: ProcessPoolExecutor) -> list[multiprocessing.Process]:
    """The executor's worker processes: ProcessPoolExecutor has no public way to reach
    them (to stop a busy one, or to see that one died) before Python 3.14."""
    return list((getattr(executor, "_processes", None) or {}).values())


def _stop_resource_tracker() -> None:
    """Stop and reap multiprocessing's resource tracker.

    The first pool starts it as this process's child; it outlives the pool and, left
    alone, is still alive when the daemon exits, so systemd SIGKILLs it ("Killing
    process … with signal SIGKILL") at every stop. Closing its pipe ends it; the next
    pool starts a new one. Only when no other pool is running: their workers hold the
    pipe too, and the tracker would not see its end.
    """
    from multiprocessing import resource_tracker

    tracker: Any = resource_tracker._resource_tracker  # no public stop before Python 3.14
    with contextlib.suppress(Exception):
        tracker._stop()


class RenderPool:
    """Runs :func:`probe` and :func:`render_page` in a pool of spawned worker processes.

    A worker that dies (segfault in a decoder, killed for memory) or overruns
    ``timeout`` is taken down with the whole pool, which is rebuilt for the next call;
    the affected call raises :class:`RenderCrashed` or :class:`RenderTimeout`. A worker
    that dies while idle breaks the executor without failing any call: the next call
    finds it refusing work, replaces it and runs on the fresh pool (logged as
    ``render_pool_replaced``).

    A call is handed to the pool only when a worker is free, so ``timeout`` times the
    work, never the wait for a worker; a free worker goes to post-processing before
    rendering (:class:`_Slots`). Calls that were running on a pool killed because
    *another* call overran its timeout are innocent: they run again on the new pool
    (up to :data:`MAX_INNOCENT_RERUNS` times) instead of failing.
    """

    def __init__(self, workers: int = 0, timeout: float = 300.0) -> None:
        # 0: one per CPU this process may run on (its affinity: systemd CPUAffinity=,
        # taskset), not every CPU of the host.
        self.workers = workers if workers > 0 else max(1, len(os.sched_getaffinity(0)))
        self.timeout = timeout
        self._context = _WorkerContext()
        self._executor: ProcessPoolExecutor | None = None
        self._free: _Slots | None = None
        self._free_loop: asyncio.AbstractEventLoop | None = None
        #: Pools killed on purpose (a call overran its timeout), not broken by a crash.
        self._killed: weakref.WeakSet[ProcessPoolExecutor] = weakref.WeakSet()
        _POOLS.add(self)

    def _pool(self) -> ProcessPoolExecutor:
        if self._executor is None:
            self._executor = ProcessPoolExecutor(
                max_workers=self.workers, mp_context=self._context, initializer=_worker_init,
                initargs=(os.getpid(),),
            )
        return self._executor

    def _recycle(self, executor: ProcessPoolExecutor, *, killed: bool = False) -> None:
        if killed:
            self._killed.add(executor)
        if self._executor is not executor:
            return  # another call already replaced it
        self._executor = None
        processes = _worker_processes(executor)
        results = getattr(executor, "_result_queue", None)
        executor.shutdown(wait=False, cancel_futures=True)
        for proc in processes:
            if proc.is_alive():
                proc.kill()
        if results is not None:
            # A worker killed while sending its result left the executor's manager thread
            # reading the rest of the message, which only end-of-file on the result pipe
            # ends: this process holds the last write end once its workers are gone. Left
            # blocked, that thread is joined at interpreter exit, which never returns.
            results._writer.close()

    @staticmethod
    def _dead_worker(executor: ProcessPoolExecutor) -> bool:
        return any(not proc.is_alive() for proc in _worker_processes(executor))

    async def _outcome(self, executor: ProcessPoolExecutor, future: asyncio.Future[Any]) -> Any:
        """``future``'s result within ``timeout``; BrokenProcessPool once a worker of
        ``executor`` is dead.

        CPython's executor notices a dead worker itself, except when the worker died while
        sending a result (a page's PNG is hundreds of KB, more than a pipe holds):
        its manager thread has started reading that message and waits for the rest for
        ever, so the future would only end at ``timeout`` (300 s by default)."""
        try:
            async with asyncio.timeout(self.timeout):
                while True:
                    done, _ = await asyncio.wait({future}, timeout=WORKER_CHECK_S)
                    if done:
                        return future.result()
                    if self._dead_worker(executor):
                        raise BrokenProcessPool("a render worker died during the call")
        finally:
            future.cancel()  # a no-op once done, as asyncio.wait_for did on a timeout

    def _slots(self, loop: asyncio.AbstractEventLoop) -> _Slots:
        """One slot per worker (futures belong to one event loop; tests use several)."""
        if self._free is None or self._free_loop is not loop:
            self._free, self._free_loop = _Slots(self.workers), loop
        return self._free

    async def _run(self, what: str, fn: Any, *args: Any, urgent: bool = False) -> Any:
        loop = asyncio.get_running_loop()
        reruns = 0
        fresh_pools = 0
        while True:
            slots = self._slots(loop)
            await slots.acquire(urgent)
            try:
                executor = self._pool()
                try:
                    if self._dead_worker(executor):  # the executor may not know it yet
                        raise BrokenProcessPool("a render worker died while idle")
                    future = loop.run_in_executor(executor, _in_worker, fn, *args)
                except BrokenProcessPool as exc:
                    # A worker died while no call of ours ran on it (killed while idle,
                    # a crash at teardown): the executor refuses every submit from now
                    # on. This call is innocent: replace the pool and submit again.
                    self._recycle(executor)
                    if fresh_pools < 1:
                        fresh_pools += 1
                        log.warning("render_pool_replaced", call=what,
                                    reason="a render worker died while idle")
                        continue
                    raise RenderCrashed(
                        f"{what}: render worker died (crash or out of memory)") from exc
                try:
                    return await self._outcome(executor, future)
                except TimeoutError as exc:
                    self._recycle(executor, killed=True)
                    raise RenderTimeout(
                        f"{what}: rendering took longer than {self.timeout:g} s") from exc
                except (BrokenProcessPool, asyncio.CancelledError) as exc:
                    task = asyncio.current_task()
                    if isinstance(exc, asyncio.CancelledError) and (
                            task is None or task.cancelling()):
                        raise  # our caller was cancelled, not the pool's doing
                    if executor in self._killed and reruns < MAX_INNOCENT_RERUNS:
                        reruns += 1  # another call's timeout killed this pool
                        continue
                    self._recycle(executor)
                    raise RenderCrashed(
                        f"{what}: render worker died (crash or out of memory)") from exc
            finally:
                slots.release()

    async def render(
        self, path: Path, index: int, min_side_px: int | None, max_pixels: int
    ) -> ocr.PageImage:
        """Render one page in a worker process."""
        what = f"{path.name} page {index + 1}"
        page: ocr.PageImage = await self._run(
            what, render_page, path, index, min_side_px, max_pixels
        )
        return page

    async def postprocess(
        self, text: str, finish_reason: str | None, page: ocr.PageImage, *,
        include_images: bool, include_headers_footers: bool,
    ) -> ocr.PageResult | str:
        """``ocr.postprocess`` in a worker: chandra.output stays out of the daemon. Only
        what the answer needs of the page goes to the worker (``PageImage.for_answer``):
        its size alone unless it may have an image crop."""
        result: ocr.PageResult | str = await self._run(
            "post-processing", functools.partial(
                ocr.postprocess, include_images=include_images,
                include_headers_footers=include_headers_footers),
            text, finish_reason, page.for_answer(text, include_images=include_images),
            urgent=True)
        return result

    async def searchable_pdf(self, path: Path, layouts: list[textlayer.PageLayout],
                             text_pages: str, out: Path) -> int:
        """:func:`searchable_pdf` in a worker process, written by the worker to ``out``
        (the document never passes through the daemon); its size."""
        size: int = await self._run(f"{path.name} (pdf output)", write_searchable_pdf, path,
                                    layouts, text_pages, out)
        return size

    async def probe(self, path: Path, max_pages: int) -> DocumentInfo:
        """Probe a file in a worker process."""
        info: DocumentInfo = await self._run(
            path.name, functools.partial(probe, keep_open=True), path, max_pages)
        return info

    def close(self) -> None:
        """Stop the workers (and the resource tracker, when no other pool runs); a later
        call starts a fresh pool."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
            del executor  # its queues' semaphores unregister before the tracker stops
            if not any(pool._executor is not None for pool in _POOLS):
                _stop_resource_tracker()
