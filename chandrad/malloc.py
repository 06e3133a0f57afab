"""glibc's allocator in this process: ``mallopt`` and ``malloc_trim``, through ctypes.

A leaf: no I/O, no chandrad imports; it only changes how this process allocates. The
daemon and the render workers tune it differently (``daemon/core.py``, ``render.py``);
where glibc is not the C library (musl, macOS) every call here does nothing and returns
False.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from typing import Any

#: ``mallopt`` parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


@functools.cache
def _libc() -> Any:
    """The C library, loaded once per process (workers call it after every page)."""
    return ctypes.CDLL(None, use_errno=True)


def set_option(parameter: int, value: int) -> bool:
    """``mallopt(parameter, value)``; whether the C library took it."""
    with contextlib.suppress(OSError, AttributeError):
        return bool(_libc().mallopt(parameter, value))
    return False


def trim() -> bool:
    """``malloc_trim(0)``: free heap memory back to the kernel; whether any was."""
    with contextlib.suppress(OSError, AttributeError):
        return bool(_libc().malloc_trim(0))
    return False
