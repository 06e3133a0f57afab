"""File names as chandrad keeps, shows and writes them.

Leaf module (stdlib only). Linux file names are bytes; Python hands them to us as
``str`` with undecodable bytes as lone surrogates (``os.fsdecode``), which SQLite,
JSON and the console cannot encode. The rules, in one place:

- **Lossless**: a path is kept as its exact bytes (``os.fsencode``) wherever it is
  stored, and the input is moved by that exact name.
- **Display form** (:func:`display`): valid UTF-8 shown as it is; every byte that is
  not valid UTF-8 and every control character (newline, tab, ESC, DEL …) is written
  ``\\xNN``. Used in logs, ``error.json``, status and queue replies. It is for people:
  a name that really contains ``\\xe9`` looks the same as one with byte 0xE9.
- **Safe output names** (:func:`output_name`): the display form, shortened so that
  every file chandrad writes under it fits ``NAME_MAX`` (255 bytes), with a short hash
  of the full name when shortened so two long names stay apart.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import PurePath
from typing import Any

#: Longest file name (bytes) on Linux filesystems (ext4, xfs, btrfs, tmpfs).
NAME_MAX = 255

_CONTROL = re.compile("[\x00-\x1f\x7f]")
_SURROGATE = re.compile("[\udc80-\udcff]")
_HASH_CHARS = 8


def _hex(match: re.Match[str]) -> str:
    return f"\\x{ord(match.group()) & 0xFF:02x}"


def text(value: str) -> str:
    """``value`` with undecodable bytes (lone surrogates) written ``\\xNN``; encodable as UTF-8.

    For free text that may quote a file name (error messages): newlines are kept.
    """
    return _SURROGATE.sub(_hex, value) if _SURROGATE.search(value) else value


def clean(value: Any) -> Any:
    """``value`` (JSON-like: dicts, lists, strings…) with :func:`text` applied to every
    string, keys included, so that ``json.dumps(..., ensure_ascii=False)`` encodes."""
    if isinstance(value, str):
        return text(value)
    if isinstance(value, dict):
        return {clean(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def display(name: str | PurePath) -> str:
    """The display form of a name or path: valid UTF-8 on one line (see module docstring)."""
    return _CONTROL.sub(_hex, text(str(name)))


def fsbytes(path: str | PurePath) -> bytes:
    """The exact bytes of a path (what is stored)."""
    return os.fsencode(path)


def from_bytes(raw: bytes | str) -> str:
    """A stored path back as Python's lossless ``str`` (older rows may be text)."""
    return os.fsdecode(raw) if isinstance(raw, bytes) else raw


def size(name: str) -> int:
    """Bytes the name takes on disk."""
    return len(os.fsencode(name))


def fit(stem: str, suffix: str = "", *, reserve: int = 0, limit: int = NAME_MAX) -> str:
    """``stem + suffix``, the stem shortened if needed so that the name plus ``reserve``
    bytes fits in ``limit`` bytes.

    A shortened stem is cut at a UTF-8 character boundary and ends with ``~`` and 8 hex
    characters of the full stem's SHA-1, so different long names stay different. A
    name that fits is returned unchanged (its bytes are preserved exactly).
    """
    budget = limit - reserve - size(suffix)
    raw = os.fsencode(stem)
    if len(raw) <= budget:
        return stem + suffix
    tag = "~" + hashlib.sha1(raw).hexdigest()[:_HASH_CHARS]
    cut = max(0, budget - len(tag))
    head = raw[:cut]
    for trim in range(4):  # do not split a multi-byte character
        try:
            head[: len(head) - trim].decode("utf-8")
        except UnicodeDecodeError:
            continue
        head = head[: len(head) - trim]
        break
    return os.fsdecode(head) + tag + suffix


#: Bytes the output writer adds to a stem in its longest file name:
#: ``.<stem>_metadata.json.<8 hex>.tmp`` (atomic write's temp name).
OUTPUT_FILE_RESERVE = len("._metadata.json.") + 8 + len(".tmp")
#: Room for a `` (9999)`` clash suffix on an output directory.
OUTPUT_DIR_RESERVE = len(" (9999)")


def output_name(name: str) -> str:
    """A safe name for something chandrad creates from an input's name (valid UTF-8,
    one line, short enough for the output files derived from it)."""
    return fit(display(name), reserve=max(OUTPUT_FILE_RESERVE, OUTPUT_DIR_RESERVE))
