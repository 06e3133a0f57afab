"""Uploads on disk: received into the API's ``tmp/``, then placed in its inbox.

An upload is kept as a watched file is: its bytes go to a temporary file (hashed and
counted as they arrive, refused past ``api.max_upload``), which is fsynced, renamed to
``inbox/<random>/<name>`` (a folder of its own, so two uploads of one name never meet) and
the rename made durable (the folders fsynced) before the store accepts it. A client's file
name keeps its last component only (``../../x.pdf`` is ``x.pdf``), made a safe name
(``names.output_name``); an empty or hidden name becomes ``upload``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from chandrad import names
from chandrad.outputs import fsync_dir

#: A client's name with nothing left after cleaning.
DEFAULT_NAME = "upload"


class TooLarge(Exception):
    """More than ``api.max_upload`` bytes arrived."""


@dataclass(frozen=True)
class Received:
    """An upload's bytes in their temporary file."""

    temp: Path
    size: int
    sha256: str


@dataclass(frozen=True)
class Placed:
    """An upload in the inbox, as the store accepts it."""

    root: Path  # the inbox, resolved (the job's input_root)
    path: Path
    size: int
    mtime: float
    sha256: str


def safe_filename(raw: str | None) -> str:
    """The name an upload is kept under: the last path component of ``raw``, made safe."""
    name = (raw or "").replace("\\", "/").rsplit("/", 1)[-1].strip()
    name = names.output_name(name) if name else ""
    if name in ("", ".", ".."):
        return DEFAULT_NAME
    return DEFAULT_NAME + name if name.startswith(".") else name


class UploadDir:
    """The API's ``tmp/`` and ``inbox/`` folders."""

    def __init__(self, inbox: Path, tmp: Path) -> None:
        self.inbox = inbox
        self.tmp = tmp

    def prepare(self) -> None:
        """Create the folders; remove what a stopped daemon left in ``tmp/`` (uploads
        never answered 202)."""
        self.inbox.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)
        for leftover in self.tmp.iterdir():
            with contextlib.suppress(OSError):
                leftover.unlink()

    def sweep(self, accepted: Callable[[Path], bool],
              older_than: float | None = None) -> list[Path]:
        """Remove the uploads a stopped daemon renamed into the inbox but never accepted
        (``accepted(path)`` false: no open job has it); they were never answered 202.
        ``older_than`` (a shared inbox, where another host may be between its rename and
        its accept now): only upload folders last changed before that wall-clock time."""
        root = Path(os.path.realpath(self.inbox))
        gone = []
        for folder in sorted(p for p in root.iterdir() if p.is_dir()):
            if older_than is not None and _changed_at(folder) >= older_than:
                continue
            files = [f for f in folder.iterdir() if f.is_file()]
            if files and any(accepted(f) for f in files):
                continue
            for f in files:
                with contextlib.suppress(OSError):
                    f.unlink()
                gone.append(f)
            with contextlib.suppress(OSError):
                folder.rmdir()
        return gone

    async def receive(self, chunks: AsyncIterator[bytes], limit: int) -> Received:
        """Write ``chunks`` to a new temporary file, fsynced; TooLarge past ``limit``."""
        temp = self.tmp / f"{secrets.token_hex(8)}.part"
        digest = hashlib.sha256()
        size = 0
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > limit:
                        raise TooLarge(f"more than {limit} bytes")
                    digest.update(chunk)
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view):]
                await asyncio.to_thread(os.fsync, fd)
            finally:
                os.close(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                temp.unlink()
            raise
        return Received(temp, size, digest.hexdigest())

    def discard(self, received: Received) -> None:
        with contextlib.suppress(OSError):
            received.temp.unlink()

    def place(self, received: Received, name: str) -> Placed:
        """Rename the temporary file into ``inbox/<random>/<name>``, durably."""
        folder = self.inbox / secrets.token_hex(8)
        folder.mkdir()
        target = folder / name
        os.replace(received.temp, target)
        fsync_dir(folder)
        fsync_dir(self.inbox)
        fsync_dir(self.tmp)
        root = Path(os.path.realpath(self.inbox))
        st = target.stat()
        return Placed(root, root / folder.name / name, received.size, st.st_mtime,
                      received.sha256)

    def remove(self, placed: Placed) -> None:
        """Take back an upload the store did not accept."""
        with contextlib.suppress(OSError):
            placed.path.unlink()
        with contextlib.suppress(OSError):
            placed.path.parent.rmdir()


def _changed_at(path: Path) -> float:
    """``path``'s last change (its mtime); infinity when it cannot be read (gone)."""
    try:
        return path.stat().st_mtime
    except OSError:
        return float("inf")
