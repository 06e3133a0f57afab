"""The daemon's allocator setting does what its comment says, in a real process.

``chandrad.daemon.core`` sets glibc's mmap threshold at start so that page images (PNGs
of about half a megabyte; bench/README.md, "Current figures") are mapped apart and
unmapped when freed, instead of coming from the heap, which keeps freed memory. Each
check runs in a fresh interpreter (the setting lasts for the process) and reads glibc's
own account (``mallinfo2``: bytes in mapped blocks) with 150 page-sized blocks alive,
then freed. The control, glibc's default, shows the check can fail: once a block that
size has been freed, glibc's own threshold rises above page size and pages come from the
heap.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

PATTERN = """
import ctypes, sys
from chandrad import malloc
from chandrad.daemon.core import DAEMON_MMAP_THRESHOLD_BYTES

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2

def mapped_mb():
    return libc.mallinfo2().hblkhd / 2**20

if sys.argv[1] == "daemon":
    assert malloc.set_option(malloc.M_MMAP_THRESHOLD, DAEMON_MMAP_THRESHOLD_BYTES)
first = b"=" * 900_000  # freed: glibc's own threshold rises to its size
del first
base = mapped_mb()
pages = [b"Q" * (500_000 + 997 * i) for i in range(150)]
size = sum(len(p) for p in pages) / 2**20
held = mapped_mb() - base
del pages
print(round(size, 1), round(held, 1), round(mapped_mb() - base, 1))
"""


def _mapped(setting: str) -> tuple[float, float, float]:
    """(MB of page blocks, MB of them in mapped blocks while alive, MB mapped after)."""
    out = subprocess.run([sys.executable, "-c", PATTERN, setting], check=True,
                         capture_output=True, text=True, timeout=60).stdout.split()
    size, held, after = (float(x) for x in out)
    return size, held, after


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_page_images_are_mapped_apart_and_unmapped_when_freed() -> None:
    size, held, after = _mapped("glibc-default")
    assert held < 0.1 * size, f"glibc's default mapped {held} of {size} MB of pages"
    size, held, after = _mapped("daemon")
    assert held > 0.95 * size, f"the daemon's setting mapped only {held} of {size} MB"
    assert after < 1, f"{after} MB still mapped after the pages were freed"
