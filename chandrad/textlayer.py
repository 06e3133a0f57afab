"""The searchable PDF: every source page with an invisible text layer from Chandra's blocks.

Pure geometry and PDF objects; the caller (``render.searchable_pdf``, in a render worker)
opens the source and hands over the open document or the decoded frames.

* **Text of a block**: the block's HTML as ``chandra.output.parse_chunks`` kept it, read
  with BeautifulSoup (chandra-ocr's own parser): a line per paragraph, heading, list item,
  ``<br>`` and table row (cells separated by spaces); math by its LaTeX text; images
  have no text.
* **Lines in the box**: the block's paragraphs are wrapped into as many lines as text
  of that length would take in a box of that shape (an advance of half an em per
  character, a line pitch of 1.2 em), the lines stacked evenly over the box's height and
  each character given the advance that makes the block's longest line fill the box's
  width, at most 0.6 em (wider spaces make extractors split a line into columns; a
  shorter line starts at the box's left edge, a right-to-left one ends at its right
  edge). Search highlights then cover the block, line by line. A right-to-left line is
  stored in visual order, as extractors expect of a printed page.
* **The font**: a glyphless TrueType font (every glyph empty, 500 units wide, as
  Tesseract's and OCRmyPDF's text layers use), embedded as a Type0 font with
  ``Identity-H`` encoding: the text is written as UTF-16 code units, which a ToUnicode
  map gives back unchanged, so any script of the Basic Multilingual Plane is searchable
  and copyable. Text render mode 3 (neither fill nor stroke) keeps it invisible.
* **PDF input**: the original document is kept object for object (no re-rasterising);
  the layer is one more content stream per page, after the page's own (wrapped in
  ``q``/``Q``), in the page's own coordinates (``/Rotate`` and the crop box included).
  A page that already carries text keeps it and gets no layer, unless ``text_pages`` is
  ``"add"``.
* **Image input**: each frame becomes a page of its size at its resolution (its dpi,
  72 when it has none), the image drawn over the whole page; JPEG bytes are kept as they
  are, a 1-bit frame (a fax, a bilevel scan) is stored as CCITT G4.
"""

# PyMuPDF ships partial annotations: many of its methods are untyped.
# mypy: disable-error-code="no-untyped-call"
from __future__ import annotations

import functools
import math
import struct
import unicodedata
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pymupdf

#: The font's resource name on every page.
FONT_NAME = "ChandradGlyphLess"
_UNITS = 1000
_ADVANCE = 500  # every glyph: half an em
_ASCENT = 800
_DESCENT = -200
#: Line pitch in ems assumed when guessing how many lines a block's text takes.
_PITCH_EM = 1.2
#: The widest advance per character, in ems: wider spaces make poppler's and MuPDF's
#: text extraction split a line's words into columns.
MAX_ADVANCE_EM = 0.6
#: Tags that end a line of text.
_LINE_TAGS = frozenset({"p", "div", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6",
                        "table", "thead", "tbody", "ul", "ol", "blockquote", "pre",
                        "caption", "figcaption", "dt", "dd", "section"})
_CELL_TAGS = frozenset({"td", "th"})


@dataclass(frozen=True)
class PageLayout:
    """One source page as the OCR saw it: its pixel size (0 when it never rendered) and
    Chandra's blocks (``bbox`` in those pixels, ``html``)."""

    width: int
    height: int
    blocks: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Frame:
    """One page of an image input: its pixels' size, its resolution, the image as the
    PDF embeds it (JPEG bytes as they are, a 1-bit frame as a CCITT G4 stream, else PNG)
    and the turn that shows it upright (``rotate``: degrees, as PyMuPDF's
    ``insert_image`` takes them)."""

    width: int  # as shown (after the turn)
    height: int
    dpi: tuple[float, float]
    data: bytes
    rotate: int = 0
    #: ``data`` is a CCITT Group 4 stream (no TIFF around it); its ``BlackIs1``.
    g4_black_is_1: bool | None = None


# ---------------------------------------------------------------- the glyphless font


def _table_checksum(data: bytes) -> int:
    padded = data + b"\0" * (-len(data) % 4)
    return int(sum(struct.unpack(f">{len(padded) // 4}L", padded))) & 0xFFFFFFFF


@functools.cache
def glyphless_font() -> bytes:
    """A TrueType font of two empty glyphs, each ``_ADVANCE`` units wide: what the
    invisible text is set in (its shapes are never drawn; only widths matter). No
    ``cmap``: the PDF maps codes to glyphs itself (``CIDToGIDMap``)."""
    glyphs = 2
    head = struct.pack(">LLLLHHqqhhhhHHhhh", 0x00010000, 0x00010000, 0, 0x5F0F3CF5, 0x000B,
                       _UNITS, 0, 0, 0, _DESCENT, _ADVANCE, _ASCENT, 0, 3, 2, 0, 0)
    hhea = struct.pack(">LhhhHhhhhhhhhhhhH", 0x00010000, _ASCENT, _DESCENT, 0, _ADVANCE,
                       0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, glyphs)
    maxp = struct.pack(">LHHHHHHHHHHHHHH", 0x00010000, glyphs, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0,
                       0, 0, 0)
    hmtx = struct.pack(">hh", _ADVANCE, 0) * glyphs
    loca = struct.pack(">H", 0) * (glyphs + 1)
    glyf = b""
    post = struct.pack(">LLhhLLLLL", 0x00030000, 0, 0, 0, 1, 0, 0, 0, 0)
    name_str = "ChandradGlyphLess".encode("utf-16-be")
    name = struct.pack(">HHH", 0, 2, 6 + 24) + b"".join(
        struct.pack(">HHHHHH", 3, 1, 0x409, nid, len(name_str), 0) for nid in (1, 6)) + name_str
    tables = {b"glyf": glyf, b"head": head, b"hhea": hhea, b"hmtx": hmtx,
              b"loca": loca, b"maxp": maxp, b"name": name, b"post": post}
    count = len(tables)
    power = 2 ** int(math.log2(count))
    directory = struct.pack(">LHHHH", 0x00010000, count, power * 16, int(math.log2(power)),
                            count * 16 - power * 16)
    offset = 12 + 16 * count
    records, body = b"", b""
    for tag in sorted(tables):
        data = tables[tag]
        records += struct.pack(">4sLLL", tag, _table_checksum(data), offset + len(body),
                               len(data))
        body += data + b"\0" * (-len(data) % 4)
    font = bytearray(directory + records + body)
    adjust = (0xB1B0AFBA - _table_checksum(bytes(font))) & 0xFFFFFFFF
    head_at = 12 + 16 * count + sum(len(tables[t]) + (-len(tables[t]) % 4)
                                    for t in sorted(tables) if t < b"head")
    font[head_at + 8:head_at + 12] = struct.pack(">L", adjust)
    return bytes(font)


def _to_unicode() -> bytes:
    """The ToUnicode CMap: each 2-byte code is the UTF-16 code unit it stands for."""
    ranges = [f"<{hi:02X}00> <{hi:02X}FF> <{hi:02X}00>" for hi in range(256)
              if not 0xD8 <= hi <= 0xDF]
    chunks = [ranges[i:i + 100] for i in range(0, len(ranges), 100)]
    body = "\n".join(f"{len(c)} beginbfrange\n" + "\n".join(c) + "\nendbfrange" for c in chunks)
    return ("/CIDInit /ProcSet findresource begin\n12 dict begin\nbegincmap\n"
            "/CIDSystemInfo << /Registry (Adobe) /Ordering (UCS) /Supplement 0 >> def\n"
            "/CMapName /Adobe-Identity-UCS def\n/CMapType 2 def\n"
            "1 begincodespacerange\n<0000> <FFFF>\nendcodespacerange\n"
            f"{body}\nendcmap\nCMapName currentdict /CMap defineresource pop\nend\nend\n"
            ).encode("ascii")


def _new_stream(doc: pymupdf.Document, data: bytes, dictionary: str = "<<>>") -> int:
    xref = int(doc.get_new_xref())
    doc.update_object(xref, dictionary)
    doc.update_stream(xref, data)  # Flate-compressed by PyMuPDF
    return xref


def _new_object(doc: pymupdf.Document, dictionary: str) -> int:
    xref = int(doc.get_new_xref())
    doc.update_object(xref, dictionary)
    return xref


def _font_objects(doc: pymupdf.Document, font_xref: int) -> None:
    """Make ``font_xref`` the glyphless Type0 font (its descendant, descriptor, font file,
    CID-to-glyph map and ToUnicode as new objects)."""
    ttf = glyphless_font()
    file_xref = _new_stream(doc, ttf, f"<</Length1 {len(ttf)}>>")
    gid_map = _new_stream(doc, b"\x00\x01" * 65536)  # every code → glyph 1
    descriptor = _new_object(doc, (
        f"<</Type/FontDescriptor/FontName/{FONT_NAME}/Flags 5/FontBBox[0 {_DESCENT} "
        f"{_ADVANCE} {_ASCENT}]/ItalicAngle 0/Ascent {_ASCENT}/Descent {_DESCENT}"
        f"/CapHeight {_ASCENT}/StemV 80/FontFile2 {file_xref} 0 R>>"))
    cid = _new_object(doc, (
        f"<</Type/Font/Subtype/CIDFontType2/BaseFont/{FONT_NAME}"
        "/CIDSystemInfo<</Registry(Adobe)/Ordering(Identity)/Supplement 0>>"
        f"/FontDescriptor {descriptor} 0 R/DW {_ADVANCE}/CIDToGIDMap {gid_map} 0 R>>"))
    to_unicode = _new_stream(doc, _to_unicode())
    doc.update_object(font_xref, (
        f"<</Type/Font/Subtype/Type0/BaseFont/{FONT_NAME}/Encoding/Identity-H"
        f"/DescendantFonts[{cid} 0 R]/ToUnicode {to_unicode} 0 R>>"))


class _Fonts:
    """The one glyphless font of a document, put in each page's resources."""

    def __init__(self, doc: pymupdf.Document) -> None:
        self.doc = doc
        self.xref = 0

    def add_to(self, page: pymupdf.Page) -> None:
        # insert_font finds or makes the page's /Resources (inherited, shared, direct);
        # the font it makes is then replaced by the glyphless one (once per document).
        xref = int(page.insert_font(fontname=FONT_NAME, fontbuffer=glyphless_font()))
        if xref != self.xref:
            if self.xref:  # another font object: point the page at the first one
                self.doc.xref_set_key(page.xref, f"Resources/Font/{FONT_NAME}",
                                      f"{self.xref} 0 R")
            else:
                self.xref = xref
                _font_objects(self.doc, xref)


# ---------------------------------------------------------------- text of a block


def block_paragraphs(html: str) -> list[str]:
    """The lines of text of one block's HTML, in order, whitespace collapsed."""
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(html, "html.parser")
    for img in soup.find_all("img"):
        img.decompose()
    for br in soup.find_all("br"):
        br.replace_with("\n")
    for tag in soup.find_all(True):
        if tag.name in _LINE_TAGS or (tag.name == "math" and tag.get("display") == "block"):
            tag.insert_before("\n")
            tag.insert_after("\n")
        elif tag.name in _CELL_TAGS:
            tag.insert_after(" ")
    lines = (" ".join(line.split()) for line in soup.get_text().split("\n"))
    return [line for line in lines if line]


def _wrap(text: str, width: int) -> list[str]:
    """``text`` in lines of about ``width`` characters, broken at spaces (a text without
    spaces, such as Chinese, at any character)."""
    words = text.split(" ")
    if len(words) == 1:
        return [text[i:i + width] for i in range(0, len(text), width)] or [text]
    lines: list[str] = []
    line = ""
    for word in words:
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    lines.append(line)
    return lines


def block_lines(paragraphs: list[str], width: float, height: float) -> list[str]:
    """The paragraphs wrapped into the lines they would take in a ``width`` x ``height``
    box (see the module docstring)."""
    total = sum(len(p) for p in paragraphs)
    if total == 0 or width <= 0 or height <= 0:
        return []
    # n lines of total/n characters: em = width / (0.5 * total / n); n * 1.2 em = height
    guess = math.sqrt(height * total * (_ADVANCE / _UNITS) / (_PITCH_EM * width))
    lines_wanted = max(len(paragraphs), round(guess))
    lines: list[str] = []
    for paragraph in paragraphs:
        share = max(1, round(lines_wanted * len(paragraph) / total))
        lines.extend(_wrap(paragraph, max(1, math.ceil(len(paragraph) / share))))
    return lines


def right_to_left(line: str) -> bool:
    """Arabic or Hebrew letters and no left-to-right letters or European digits."""
    classes = {unicodedata.bidirectional(c) for c in line}
    return bool(classes & {"R", "AL"}) and not classes & {"L", "EN"}


def visual_order(line: str) -> str:
    """A right-to-left line reversed: text extractors read characters by their place on
    the line and reverse right-to-left runs back into reading order, as they do for a
    printed page. A line mixing directions is left in reading order (no bidi algorithm
    here: its right-to-left words come out reversed)."""
    return line[::-1] if right_to_left(line) else line


def _utf16_hex(text: str) -> str:
    """The text's UTF-16 code units in hex; characters beyond the BMP (no ToUnicode
    entry) as U+FFFD."""
    units = "".join(c if ord(c) <= 0xFFFF and not 0xD800 <= ord(c) <= 0xDFFF else "\ufffd"
                    for c in text)
    return units.encode("utf-16-be").hex().upper()


def _num(value: float) -> str:
    text = f"{value:.3f}".rstrip("0").rstrip(".")
    return "0" if text in ("", "-0") else text


def layer_stream(layout: PageLayout, shown_width: float, shown_height: float,
                 to_pdf: pymupdf.Matrix) -> bytes:
    """The content stream of one page's invisible text: ``shown_*`` is the page as shown
    (points, after ``/Rotate``), ``to_pdf`` maps that top-left space to the page's own
    PDF space."""
    import pymupdf

    if layout.width <= 0 or layout.height <= 0:
        return b""
    sx, sy = shown_width / layout.width, shown_height / layout.height
    ops: list[str] = []
    for block in layout.blocks:
        try:
            x0, y0, x1, y1 = (float(v) for v in block["bbox"])
        except (KeyError, TypeError, ValueError):
            continue
        x0, x1, y0, y1 = x0 * sx, x1 * sx, y0 * sy, y1 * sy
        box_w, box_h = x1 - x0, y1 - y0
        lines = block_lines(block_paragraphs(str(block.get("html", ""))), box_w, box_h)
        if not lines:
            continue
        pitch = box_h / len(lines)
        size = pitch * _UNITS / (_ASCENT - _DESCENT)  # the em: ascent to descent fills a line
        # points per character: the longest line fills the box, unless its spaces would
        # then be wide enough for extractors to take the words for columns
        advance = min(box_w / max(len(line) for line in lines), MAX_ADVANCE_EM * size)
        for i, line in enumerate(lines):
            baseline = y0 + i * pitch + size * _ASCENT / _UNITS
            # a right-to-left line that does not fill the box ends at its right edge
            start = x1 - len(line) * advance if right_to_left(line) else x0
            # glyph space → shown space (y down) → PDF space
            m = pymupdf.Matrix(advance * _UNITS / _ADVANCE, 0, 0, -size, start, baseline) * to_pdf
            ops.append(f"{' '.join(_num(v) for v in (m.a, m.b, m.c, m.d, m.e, m.f))} Tm "
                       f"<{_utf16_hex(visual_order(line))}> Tj")
    if not ops:
        return b""
    return (f"BT 3 Tr /{FONT_NAME} 1 Tf\n" + "\n".join(ops) + "\nET\n").encode("ascii")


# ---------------------------------------------------------------- documents


def _has_text(page: pymupdf.Page) -> bool:
    return bool(page.get_text("text").strip())


def _add_layer(doc: pymupdf.Document, page: pymupdf.Page, layout: PageLayout,
               fonts: _Fonts) -> bool:
    """Append the layer's content stream to ``page``; False if it has no text."""
    to_pdf = page.derotation_matrix * ~page.transformation_matrix
    stream = layer_stream(layout, page.rect.width, page.rect.height, to_pdf)
    if not stream:
        return False
    fonts.add_to(page)
    page.wrap_contents()  # the page's own content in q/Q: ours starts from the default state
    contents = [*page.get_contents(), _new_stream(doc, b"q\n" + stream + b"Q\n")]
    doc.xref_set_key(page.xref, "Contents", "[" + " ".join(f"{x} 0 R" for x in contents) + "]")
    return True


def pdf_with_layer(doc: pymupdf.Document, layouts: list[PageLayout],
                   text_pages: str = "skip") -> bytes:
    """``doc`` (a PDF, changed in place) with a text layer on each page that has blocks
    (and, with ``text_pages="skip"``, no text of its own), saved as one file, unused
    objects dropped. Saved even when no page got a layer: MuPDF's writing repairs what
    the source's own xref got wrong (two born-digital corpus PDFs fail ``qpdf --check``
    as they are). Not in object streams, which MuPDF 1.28 writes with xref entries qpdf
    warns about."""
    fonts = _Fonts(doc)
    for index, layout in enumerate(layouts[:doc.page_count]):
        page = doc[index]
        if text_pages == "skip" and _has_text(page):
            continue
        _add_layer(doc, page, layout, fonts)
    return bytes(doc.tobytes(garbage=1, deflate=True))


def _insert_g4(doc: pymupdf.Document, page: pymupdf.Page, frame: Frame) -> None:
    """Draw a 1-bit frame over the page as its own G4 stream (MuPDF would decode it and
    store it Flate-compressed, about twice the size): a small image placed by PyMuPDF
    (resources, placement), then made this frame. The placeholder's pixels are the
    page number: PyMuPDF gives an image of the same pixels the same object."""
    import pymupdf

    marker = pymupdf.Pixmap(pymupdf.csGRAY, 8, 1, page.number.to_bytes(8, "big"), False)
    xref = int(page.insert_image(page.rect, keep_proportion=False, pixmap=marker))
    doc.update_object(xref, f"<</Type/XObject/Subtype/Image/Width {frame.width}"
                            f"/Height {frame.height}/ColorSpace/DeviceGray/BitsPerComponent 1>>")
    doc.update_stream(xref, frame.data, compress=False)
    doc.xref_set_key(xref, "Filter", "/CCITTFaxDecode")
    black_is_1 = "true" if frame.g4_black_is_1 else "false"
    doc.xref_set_key(xref, "DecodeParms", f"<</K -1/Columns {frame.width}/Rows {frame.height}"
                                          f"/BlackIs1 {black_is_1}>>")


def image_pdf(frames: list[Frame], layouts: list[PageLayout]) -> bytes:
    """A PDF of one page per image frame, each with its text layer."""
    import pymupdf

    doc = pymupdf.open()
    try:
        fonts = _Fonts(doc)
        for frame, layout in zip(frames, layouts, strict=False):
            width = frame.width * 72.0 / frame.dpi[0]
            height = frame.height * 72.0 / frame.dpi[1]
            page = doc.new_page(width=width, height=height)
            if frame.g4_black_is_1 is None:
                page.insert_image(page.rect, stream=frame.data, rotate=frame.rotate,
                                  keep_proportion=False)
            else:
                _insert_g4(doc, page, frame)
            _add_layer(doc, page, layout, fonts)
        return bytes(doc.tobytes(garbage=1, deflate=True))
    finally:
        doc.close()
