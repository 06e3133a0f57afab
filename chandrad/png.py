"""PNG encoding of page images: the bytes the engine decodes, made cheaply.

Owns how a page's pixels become a PNG. A page PNG travels only over the loopback to the
engine, which decodes it straight away, so what matters is the CPU it costs here, not
its size. Pillow's encoder spends most of its time choosing a row filter (about 60 ms for
a 3.5-megapixel page even at ``compress_level=0``) and then in zlib; here every row gets
filter 0 ("None") and the deflate stream comes from ISA-L (``isal``, level 1), about
three times faster than zlib level 1 at a similar size. The pixels decoded from the
PNG are exactly the pixels given (lossless; asserted in ``tests/test_render.py``); the
bytes are not always the same for the same pixels: on a busy machine ISA-L now and then
picks other, equally valid matches (about one page in a thousand under parallel load), so
compare pages by their pixels, not by their PNG's hash.
"""

from __future__ import annotations

import struct
import zlib

from isal import isal_zlib

#: ISA-L's deflate level (0..3). 1 is as fast as 0 and 10-50 % smaller.
DEFLATE_LEVEL = 1
_ROWS_PER_BLOCK = 64
_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: Pillow mode → (bytes per pixel, PNG colour type).
_MODES = {"L": (1, 0), "RGB": (3, 2)}
MODES = frozenset(_MODES)


def _chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(
        ">I", zlib.crc32(data, zlib.crc32(tag)))


def encode(pixels: bytes | memoryview, width: int, height: int, mode: str,
           stride: int = 0) -> bytes:
    """8-bit ``L`` or ``RGB`` pixels (rows ``stride`` bytes apart, default packed) → PNG."""
    if mode not in _MODES:
        raise ValueError(f"cannot encode mode {mode!r} (only {', '.join(sorted(_MODES))})")
    channels, colour_type = _MODES[mode]
    row = width * channels
    stride = stride or row
    view = memoryview(pixels).cast("B")
    if width <= 0 or height <= 0 or stride < row or len(view) < stride * (height - 1) + row:
        raise ValueError(f"{len(view)} bytes do not hold {width}x{height} {mode} "
                         f"with rows {stride} bytes apart")
    none_filter = b"\x00"
    # Deflated in blocks of rows, each row behind its filter byte: the pixels are never
    # copied whole (a 6-megapixel page is 18 MB), and it is no slower than one call.
    deflate = isal_zlib.compressobj(DEFLATE_LEVEL)
    compressed = []
    block = _ROWS_PER_BLOCK * stride
    for start in range(0, height * stride, block):
        end = min(height * stride, start + block)
        compressed.append(deflate.compress(b"".join([
            part for y in range(start, end, stride) for part in (none_filter, view[y:y + row])])))
    compressed.append(deflate.flush())
    header = struct.pack(">IIBBBBB", width, height, 8, colour_type, 0, 0, 0)
    return b"".join((_SIGNATURE, _chunk(b"IHDR", header),
                     _chunk(b"IDAT", b"".join(compressed)), _chunk(b"IEND", b"")))


class Rows:
    """The rows of a PNG that :func:`encode` wrote, inflated only as far as asked: a crop
    in the upper part of a page never inflates the rest (ISA-L, no unfiltering)."""

    def __init__(self, mode: str, width: int, height: int, idat: memoryview) -> None:
        self.mode, self.width, self.height = mode, width, height
        #: Bytes from one row's first pixel to the next row's (each row is preceded by
        #: its filter byte).
        self.stride = width * len(mode) + 1
        self._inflate = isal_zlib.decompressobj()
        self._tail: bytes | memoryview = idat
        self._raw = b""  # bytes: views of it stay valid when more rows are inflated
        self._ours = True

    @classmethod
    def open(cls, data: bytes) -> Rows | None:
        """``None`` for a PNG that :func:`encode` did not write (filters, palette, 16-bit,
        interlace, several IDAT chunks): decode that with Pillow."""
        if not data.startswith(_SIGNATURE) or data[12:16] != b"IHDR":
            return None
        width, height, depth, colour_type, _, _, interlace = struct.unpack(
            ">IIBBBBB", data[16:29])
        modes = {c: m for m, (_, c) in _MODES.items()}
        if depth != 8 or interlace or colour_type not in modes or not width or not height:
            return None
        idat_at = 8 + 25  # signature, IHDR chunk (length, tag, 13 bytes, crc)
        (length,) = struct.unpack(">I", data[idat_at:idat_at + 4])
        end = idat_at + 12 + length
        if data[idat_at + 4:idat_at + 8] != b"IDAT" or data[end + 4:end + 8] != b"IEND":
            return None
        return cls(modes[colour_type], width, height,
                   memoryview(data)[idat_at + 8:idat_at + 8 + length])

    def upto(self, rows: int) -> memoryview | None:
        """The first ``rows`` rows (at least; at most all): a view starting at the first
        pixel, rows :attr:`stride` bytes apart. ``None`` if they turn out not to be ours
        (a filtered row, a short or corrupt stream)."""
        rows = min(rows, self.height)
        want = rows * self.stride
        have = len(self._raw)
        if have < want and self._ours:
            self._ours = False  # until proven
            try:
                more = self._inflate.decompress(self._tail, want - have)
                self._tail = self._inflate.unconsumed_tail
                if rows == self.height and self._inflate.decompress(self._tail):
                    return None  # more data than the image holds
            except Exception:  # isal_zlib.error (untyped): corrupt, so not ours
                return None
            # The first call (usually the only one) keeps the inflated bytes as they are.
            self._raw = self._raw + more if self._raw else more
            if len(self._raw) < want:
                return None  # the stream ended early
            if self._raw[have:want:self.stride].count(0) != (want - have) // self.stride:
                return None  # filtered rows: not ours
            self._ours = True
        if not self._ours:
            return None
        # No copy; the last row ends the view: decode it with Pillow's "raw" decoder
        # (which takes a stride), not ``Image.frombuffer`` (which maps L and wants a
        # whole last stride).
        return memoryview(self._raw)[1:want]


def decode(data: bytes) -> tuple[str, int, int, memoryview, int] | None:
    """Pixels of a PNG that :func:`encode` wrote: ``(mode, width, height, pixels, stride)``,
    with ``pixels`` starting at the first pixel and rows ``stride`` bytes apart (each row
    is preceded by its filter byte). ``None`` for any other PNG: decode that with Pillow.
    """
    rows = Rows.open(data)
    if rows is None:
        return None
    pixels = rows.upto(rows.height)
    if pixels is None:
        return None
    return rows.mode, rows.width, rows.height, pixels, rows.stride
