"""A job's input by its content: hashing, and finding where a recorded move put it."""

from __future__ import annotations

import glob
import hashlib
from pathlib import Path

from chandrad.store import Job

READ_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fingerprint(path: Path) -> tuple[str, int, float]:
    """sha256, size and mtime of ``path`` (raises FileNotFoundError when it is gone)."""
    st = path.stat()
    return sha256_file(path), st.st_size, st.st_mtime


def find_moved(job: Job, intended: Path) -> Path | None:
    """Where the input went when a move to ``intended`` completed but its outcome was
    never recorded: that path or a `` (n)`` variant of it, holding the job's content."""
    if not intended.parent.is_dir():
        return None
    pattern = f"{glob.escape(intended.stem)} (*){glob.escape(intended.suffix)}"
    for candidate in [intended, *sorted(intended.parent.glob(pattern))]:
        try:
            if (candidate.is_file() and not candidate.is_symlink()
                    and candidate.stat().st_size == job.size
                    and sha256_file(candidate) == job.sha256):
                return candidate
        except OSError:
            continue
    return None


def is_under(path: Path, folder: Path) -> bool:
    try:
        path.relative_to(folder)
    except ValueError:
        return False
    return True
