"""Everything chandrad writes to disk for a document, and moving the input away.

Owns the output layout ``<output>/<relative dir>/<stem>/`` (``<stem>.md``,
``<stem>.html``, ``<stem>.json``, ``<stem>.pdf``, ``<stem>_metadata.json``, extracted
images), atomic
writes (temp file in the same directory, fsync, rename, fsync the directory), moving
an input to ``done/`` or ``failed/`` without ever overwriting, and ``<name>.error.json``.

Who owns an output directory: ``write_document`` first writes a small claim file,
``.chandrad-source.json``, holding the source path, its ``source_sha256`` (from the
metadata) and the files written. Writing the same source again (the daemon was killed
after writing but before moving the input) replaces the same files and removes files
of the earlier write that are no longer produced; it never makes a second directory.
A *different* source (another input path, or other content) whose output would land on
an occupied directory, or a directory chandrad did not create, gets the next free
``<stem> (1)``, ``<stem> (2)``, ... directory instead.

One name per document (:func:`document_slot`): a finished document's output directory
and its input in ``done/`` carry the same suffix, the smallest free in both, so
``output/report (2)/`` always goes with ``done/report (2).pdf``. Name clashes in
``failed/`` use the same style on their own: ``report.pdf`` becomes ``report (1).pdf``, ...

Names (``chandrad.names``): an input keeps its exact bytes name in ``done/`` and
``failed/``; everything chandrad creates from a name (output directories and files,
``<name>.error.json``, temp names) uses a safe name: valid UTF-8, no control
characters, within ``NAME_MAX`` (shortened with a hash when needed).

Errors: an ``OSError`` while writing becomes :class:`OutputError`, or
:class:`OutputUnwritable` when the output side refuses writes (full, over quota,
read-only, permission): the caller holds the job instead of failing it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chandrad import names
from chandrad.errors import OutputError, OutputUnwritable

CLAIM_FILE = ".chandrad-source.json"
_MAX_SUFFIX = 10_000
_COPY_CHUNK = 1 << 20


@dataclass
class PageOutput:
    """One source page as it goes into the outputs."""

    page: int  # 1-based
    status: str  # "ok" | "failed"
    attempts: int
    error: str | None
    width: int
    height: int
    markdown: str = ""
    html: str = ""
    blocks: list[dict[str, Any]] = field(default_factory=list)
    images: dict[str, bytes] = field(default_factory=dict)
    #: The answer hit ``max_tokens`` (finish_reason "length"): the text is kept, cut off.
    truncated: bool = False


def fsync_dir(directory: Path) -> None:
    """Make a rename or unlink in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_name(path: Path) -> Path:
    hex8 = secrets.token_hex(4)
    return path.with_name(names.fit(f".{path.name}", f".{hex8}.tmp"))


#: The end of every :func:`_temp_name`: ``.<8 hex>.tmp``.
_TEMP_TAIL = re.compile(r"\.[0-9a-f]{8}\.tmp")
_TEMP_TAIL_LEN = len(".00000000.tmp")


def _temp_heads(claimed: Iterable[str]) -> set[str]:
    """What :func:`_temp_name` puts before ``.<8 hex>.tmp`` for each file of ``claimed``
    and for the claim file (``.<name>``, shortened by ``names.fit`` as it shortens it)."""
    tail = "." + "0" * 8 + ".tmp"
    return {names.fit(f".{name}", tail)[:-_TEMP_TAIL_LEN]
            for name in (*claimed, CLAIM_FILE) if name and "/" not in name}


def _is_write_temp(name: str, heads: set[str]) -> bool:
    return (name[:-_TEMP_TAIL_LEN] in heads
            and _TEMP_TAIL.fullmatch(name[-_TEMP_TAIL_LEN:]) is not None)


def _remove_old_file(path: Path, older_than: float | None) -> bool:
    """Unlink ``path`` if it is a file (not a link or a folder) modified before
    ``older_than`` (any time when None); whether it was removed."""
    with contextlib.suppress(OSError):  # gone meanwhile, or not ours to remove
        st = path.lstat()
        if not stat.S_ISREG(st.st_mode):
            return False
        if older_than is not None and st.st_mtime >= older_than:
            return False
        path.unlink()
        return True
    return False


def remove_write_temps(directory: Path, claimed: Iterable[str], *,
                       older_than: float | None = None) -> list[Path]:
    """Remove from ``directory`` the temp files of atomic writes a kill cut short: only
    the names :func:`atomic_write` gives the files of ``claimed`` (a claim's ``files``)
    and the claim file itself, ``.<name>.<8 hex>.tmp``; any other file stays.
    ``older_than`` (a time): only those modified before it. The paths removed."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    heads = _temp_heads(claimed)
    return [directory / name for name in entries
            if _is_write_temp(name, heads) and _remove_old_file(directory / name, older_than)]


def output_error(message: str, exc: OSError, path: Path) -> OutputError:
    """The typed error for an ``OSError`` on the output side (see module docstring)."""
    cls = OutputUnwritable if exc.errno in OutputUnwritable.ERRNOS else OutputError
    return cls(f"{message}: {exc.strerror or exc}", path=names.display(path), errno=exc.errno)


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that readers see the old or the new file, never a part."""
    tmp = _temp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise output_error(f"cannot write {names.display(path)}", exc, path) from exc


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(names.clean(obj), indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def output_stem(input_path: Path) -> str:
    """The safe stem of an input's output files (``report.pdf`` → ``report``)."""
    return names.output_name(input_path.stem)


def output_dir_for(output_root: Path, input_root: Path, input_path: Path) -> Path:
    """``<output>/<relative dir>/<stem>`` for an input found under ``input_root``,
    every component a safe name."""
    try:
        relative = input_path.relative_to(input_root)
    except ValueError as exc:
        raise OutputError(f"{names.display(input_path)} is not under the watched folder "
                          f"{names.display(input_root)}") from exc
    parents = [names.fit(names.display(part)) for part in relative.parent.parts]
    return output_root.joinpath(*parents) / output_stem(input_path)


def _suffixed(path: Path, n: int) -> Path:
    """``name (n).ext`` (``name (n)`` for a directory or a name without a suffix),
    the name shortened to fit ``NAME_MAX``."""
    return path.with_name(names.fit(path.stem, f" ({n}){path.suffix}"))


def _read_claim(directory: Path) -> dict[str, Any] | None:
    try:
        claim = json.loads((directory / CLAIM_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return claim if isinstance(claim, dict) else None


def _identity(metadata: dict[str, Any]) -> tuple[str, str]:
    return str(metadata.get("source", "")), str(metadata.get("source_sha256", ""))


def _claims_same_source(claim: dict[str, Any], metadata: dict[str, Any]) -> bool:
    """The same document: the same input path and, when known, the same content (identical
    bytes under two names are two documents, each with its own name)."""
    source, sha = _identity(metadata)
    if claim.get("source") != source:
        return False
    return not sha or bool(claim.get("source_sha256") == sha)


def _only_dead_attempt(directory: Path) -> bool:
    """Empty but for the claim's temp files: a write killed before its claim landed
    (the temp files are removed here; nothing else is there to keep)."""
    entries = list(directory.iterdir())
    if any(not (e.name.startswith(f".{CLAIM_FILE}.") and e.name.endswith(".tmp")
                and e.is_file()) for e in entries):
        return False
    for entry in entries:
        with contextlib.suppress(FileNotFoundError):
            entry.unlink()
    return True


def _numbered_dir(out_dir: Path, n: int) -> Path:
    return out_dir if n == 0 else out_dir.with_name(f"{out_dir.name} ({n})")


def numbered_file(path: Path, n: int) -> Path:
    """``path`` with the `` (n)`` suffix (itself for 0)."""
    return path if n == 0 else _suffixed(path, n)


def _dir_available(candidate: Path, metadata: dict[str, Any]) -> bool:
    """Free, a dead attempt of ours, or already this document's."""
    if not candidate.exists():
        return True
    if candidate.is_dir() and _only_dead_attempt(candidate):
        return True
    claim = _read_claim(candidate)
    return claim is not None and _claims_same_source(claim, metadata)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


@dataclass(frozen=True)
class DocumentSlot:
    """Where one finished document goes: its output directory and its input's place in
    ``done/``, both with the same `` (n)`` suffix (none when ``n`` is 0)."""

    suffix: int
    output_dir: Path
    done_path: Path


def document_slot(output_root: Path, done_root: Path, input_root: Path, input_path: Path,
                  metadata: dict[str, Any], placed: Path | None = None) -> DocumentSlot:
    """The one name of a document across ``output/`` and ``done/``.

    ``<stem> (n)/`` in the output folder and ``<stem> (n)<ext>`` in ``done/`` for the
    smallest ``n`` (0: no suffix) where both are free: the directory is free, a dead
    attempt, or already this document's (same input path and sha256: a rewrite after a
    crash); the done name is free, or is already the input (a move cut short). So
    ``report.pdf`` then ``report.png`` are ``report/`` + ``report.pdf`` and
    ``report (1)/`` + ``report (1).png``, and a second ``report.pdf`` is
    ``report (2)/`` + ``report (2).pdf`` if ``report (1)`` is taken in either folder.

    ``placed``: the input is already in ``done/`` there (a move completed before a
    crash): its suffix decides.
    """
    out_dir = output_dir_for(output_root, input_root, input_path)
    done_path = done_root / input_path.relative_to(input_root)
    for n in range(_MAX_SUFFIX):
        done_n = numbered_file(done_path, n)
        if placed is not None:
            if done_n == placed:
                return DocumentSlot(n, _numbered_dir(out_dir, n), done_n)
            continue
        free = not os.path.lexists(done_n) or _same_file(done_n, input_path)
        if free and _dir_available(_numbered_dir(out_dir, n), metadata):
            return DocumentSlot(n, _numbered_dir(out_dir, n), done_n)
    if placed is not None:  # not a name chandrad gives: its directory is the plain one
        return DocumentSlot(0, out_dir, placed)
    raise OutputError(f"no free name for {names.display(input_path.name)} in "
                      f"{names.display(out_dir.parent)} and {names.display(done_path.parent)}")


def _choose_dir(out_dir: Path, metadata: dict[str, Any]) -> tuple[Path, dict[str, Any] | None]:
    """The directory this document owns (or may take), and its previous claim if any."""
    for n in range(_MAX_SUFFIX):
        candidate = out_dir if n == 0 else out_dir.with_name(f"{out_dir.name} ({n})")
        if not candidate.exists():
            return candidate, None
        if candidate.is_dir() and _only_dead_attempt(candidate):
            return candidate, None  # an earlier attempt died before its claim was in place
        claim = _read_claim(candidate)
        if claim is not None and _claims_same_source(claim, metadata):
            return candidate, claim
    raise OutputError(f"no free output directory next to {out_dir}")


def _document_json(source: str, pages: list[PageOutput]) -> dict[str, Any]:
    entries = []
    for p in pages:
        entry: dict[str, Any] = {"page": p.page, "status": p.status, "attempts": p.attempts,
                                 "truncated": p.truncated}
        if p.error:
            entry["error"] = p.error
        entry.update(width=p.width, height=p.height, blocks=p.blocks)
        entries.append(entry)
    return {"source": source, "pages": entries}


def _page_images(pages: list[PageOutput]) -> tuple[dict[str, bytes], list[PageOutput]]:
    """All image crops by file name; a name reused by another page with other bytes is
    renamed ``p<page>_<name>`` and that page's HTML and Markdown follow the new name."""
    images: dict[str, bytes] = {}
    fixed: list[PageOutput] = []
    for page in pages:
        renames: dict[str, str] = {}
        for name, data in page.images.items():
            if name in images and images[name] != data:
                renames[name] = f"p{page.page}_{name}"
            images[renames.get(name, name)] = data
        if renames:
            html, markdown = page.html, page.markdown
            for old, new in renames.items():
                html, markdown = html.replace(old, new), markdown.replace(old, new)
            page = PageOutput(**{**page.__dict__, "html": html, "markdown": markdown})
        fixed.append(page)
    return images, fixed


def write_document(
    out_dir: Path,
    stem: str,
    pages: list[PageOutput],
    metadata: dict[str, Any],
    formats: tuple[str, ...],
    made: dict[str, Path] | None = None,
) -> list[Path]:
    """Write every output of one document atomically; return the paths written.

    ``metadata`` should carry ``source`` and ``source_sha256`` (they decide who owns
    ``out_dir``, see the module docstring) plus model, engine profile and timings; page
    counts and per-page summaries are added here. The metadata file is written last,
    so its presence means the document is complete. ``formats`` picks among
    ``md``, ``html`` and ``json``; ``made`` holds outputs made elsewhere, by file name:
    complete files from :func:`made_file` (``<stem>.pdf``, written by a render worker),
    renamed into place and claimed like the others.
    """
    pages = sorted(pages, key=lambda p: p.page)
    images, pages = _page_images(pages)
    target, previous = _choose_dir(out_dir, metadata)
    source, sha = _identity(metadata)
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise output_error(f"cannot create {names.display(target)}", exc, target) from exc

    files: dict[str, bytes | Path] = {}
    metadata_name = f"{stem}_metadata.json"
    if "md" in formats:
        files[f"{stem}.md"] = ("\n\n".join(p.markdown for p in pages if p.markdown) + "\n").encode()
    if "html" in formats:
        files[f"{stem}.html"] = ("\n\n".join(p.html for p in pages if p.html) + "\n").encode()
    if "json" in formats:
        files[f"{stem}.json"] = _json_bytes(_document_json(source or stem, pages))
    files.update(made or {})
    for name in images:
        if not name or "/" in name or name.startswith(".") or name in (*files, metadata_name):
            raise OutputError(f"refusing image file name {name!r} for {target}")
    files.update(images)
    full_metadata = {
        **metadata,
        "num_pages": len(pages),
        "pages_ok": sum(p.status == "ok" for p in pages),
        "pages_failed": sum(p.status != "ok" for p in pages),
        "pages_truncated": sum(p.truncated for p in pages),
        "total_images": len(images),
        "pages": [
            {
                "page": p.page,
                "status": p.status,
                "attempts": p.attempts,
                "truncated": p.truncated,
                "width": p.width,
                "height": p.height,
                "num_blocks": len(p.blocks),
                "num_images": len(p.images),
            }
            for p in pages
        ],
    }
    all_names = [*files, metadata_name]
    claim = {"source": source, "source_sha256": sha, "files": all_names}
    if previous is not None:  # a rewrite: what a killed write of this document left
        remove_write_temps(target, [*all_names, *map(str, previous.get("files", []))])
    written: list[Path] = []
    try:
        atomic_write(target / CLAIM_FILE, _json_bytes(claim))
        for name, data in files.items():
            if isinstance(data, Path):
                _place_made(data, target / name)
            else:
                atomic_write(target / name, data)
            written.append(target / name)
        atomic_write(target / metadata_name, _json_bytes(full_metadata))
        written.append(target / metadata_name)
    except OutputError:
        if previous is None:
            _remove_partial(target, written)
        raise

    stale = set(previous.get("files", []) if previous else []) - set(all_names)
    for name in stale:
        if "/" in str(name) or str(name).startswith("."):
            continue  # only plain names we wrote ourselves
        with contextlib.suppress(FileNotFoundError):
            (target / str(name)).unlink()
    if stale:
        fsync_dir(target)
    return written


def made_file(out_dir: Path, name: str) -> Path:
    """A temporary path for output ``name`` of the document going to ``out_dir``, made
    by another process (the searchable PDF, in a render worker): beside ``out_dir`` (its
    parent is created), so that :func:`write_document` renames it into the directory it
    chooses. The maker writes and fsyncs it; the caller removes it if it is not used."""
    parent = out_dir.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise output_error(f"cannot create {names.display(parent)}", exc, parent) from exc
    return _temp_name(parent / name)


#: :func:`made_file`'s names: ``.<stem>.pdf.<8 hex>.tmp``, or, shortened by
#: ``names.fit``, ``.<start of the stem>~<8 hex>.<8 hex>.tmp``.
_MADE_TEMP = re.compile(r"\..*(\.pdf|~[0-9a-f]{8})\.[0-9a-f]{8}\.tmp", re.DOTALL)


def remove_leftovers(output_root: Path, *, older_than: float | None = None) -> list[Path]:
    """Remove the temp files a killed daemon left under ``output_root``, run at start
    before any job writes: :func:`made_file`'s beside the document folders (a render
    worker was writing ``<stem>.pdf``), and in each document folder those of an atomic
    write cut short (:func:`remove_write_temps`: the files its claim lists, and the
    claim's own). Only files of those namings go; ``older_than`` (a time): only those
    modified before it (on a shared store another host may be writing one now). The
    paths removed."""
    removed: list[Path] = []
    for directory, _dirs, files in os.walk(output_root):
        folder = Path(directory)
        claim = _read_claim(folder) if CLAIM_FILE in files else None
        heads = _temp_heads(map(str, claim.get("files", [])) if claim else ())
        for name in files:
            if ((_MADE_TEMP.fullmatch(name) or _is_write_temp(name, heads))
                    and _remove_old_file(folder / name, older_than)):
                removed.append(folder / name)
    return removed


def _place_made(made: Path, path: Path) -> None:
    try:
        os.replace(made, path)
        fsync_dir(path.parent)
    except OSError as exc:
        raise output_error(f"cannot write {names.display(path)}", exc, path) from exc


def _remove_partial(target: Path, written: list[Path]) -> None:
    """A first write that failed part way: take away what it wrote, so no half
    document is left (a rewrite keeps the earlier complete files instead)."""
    with contextlib.suppress(OSError):
        for path in (*written, target / CLAIM_FILE):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        target.rmdir()


def _copy_durably(src: Path, dst: Path) -> None:
    with src.open("rb") as fin, dst.open("xb") as fout:
        shutil.copyfileobj(fin, fout, _COPY_CHUNK)
        fout.flush()
        os.fsync(fout.fileno())
    shutil.copystat(src, dst)


def _place(src: Path, dst: Path) -> bool:
    """Put ``src`` at ``dst`` unless ``dst`` exists; False if it does. Same filesystem."""
    try:
        os.link(src, dst)  # fails with EEXIST instead of overwriting, unlike rename
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        if dst.exists():  # no hard links on this filesystem: check, then rename
            return False
        os.rename(src, dst)
        return True
    os.unlink(src)
    return True


def move_to(dest_dir: Path, input_root: Path, input_path: Path, start: int = 0) -> Path:
    """Move ``input_path`` to ``dest_dir/<relative dir>/<name>``; return where it went.

    Never overwrites: on a clash the name gets `` (1)``, `` (2)``, ... before the
    extension; ``start`` is the first suffix tried (a :class:`DocumentSlot`'s). Works
    across filesystems (copy, fsync, then unlink the original).
    If a previous move was interrupted after linking (both names are the same file),
    the move is completed instead of making a second copy.
    """
    try:
        relative = input_path.relative_to(input_root)
    except ValueError as exc:
        raise OutputError(f"{names.display(input_path)} is not under the watched folder "
                          f"{names.display(input_root)}") from exc
    final_dir = dest_dir / relative.parent
    try:
        final_dir.mkdir(parents=True, exist_ok=True)
        for n in range(start, _MAX_SUFFIX):
            dst = numbered_file(final_dir / input_path.name, n)
            if dst.exists() and os.path.samefile(dst, input_path):
                input_path.unlink()
                break
            try:
                if _place(input_path, dst):
                    break
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                if _move_across(input_path, dst):
                    break
        else:
            raise OutputError(f"no free name for {names.display(input_path.name)} in "
                              f"{names.display(final_dir)}")
        fsync_dir(final_dir)
        fsync_dir(input_path.parent)
    except OSError as exc:
        raise output_error(f"cannot move {names.display(input_path)} to "
                           f"{names.display(final_dir)}", exc, final_dir) from exc
    return dst


def _move_across(src: Path, dst: Path) -> bool:
    """Copy to a temp name beside ``dst``, then claim ``dst`` without overwriting."""
    tmp = _temp_name(dst)
    try:
        _copy_durably(src, tmp)
        placed = _place(tmp, dst)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    if placed:
        src.unlink()
    return placed


def error_json_path(failed_path: Path) -> Path:
    """``<name>.error.json`` beside a failed input: the safe form of its name, shortened
    to fit ``NAME_MAX``."""
    return failed_path.with_name(names.fit(names.display(failed_path.name), ".error.json"))


def write_error_json(
    failed_path: Path, code: str, message: str, attempts: int, timestamps: dict[str, Any]
) -> Path:
    """Write ``<name>.error.json`` beside a failed input (reason code, message, attempts).

    ``file`` is the display form of the input's name (``chandrad.names``).
    """
    path = error_json_path(failed_path)
    body = {
        "file": names.display(failed_path.name),
        "code": code,
        "message": message,
        "attempts": attempts,
        "timestamps": timestamps,
    }
    atomic_write(path, _json_bytes(body))
    return path
