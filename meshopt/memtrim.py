"""Give the heap's free memory back to the operating system (glibc's ``malloc_trim``).

Why: a recompute at 1000 nodes allocates and frees hundreds of 8 MB numpy temporaries.
glibc serves arrays of that size from its heap once its mmap threshold has grown past
them (it grows on every free of a mapped chunk, up to 32 MB), and the freed memory
stays in the process (issue 15: the controller's RSS at 1000 nodes). ``malloc_trim(0)``
returns the free pages of every arena. Elsewhere (musl, macOS) it is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    out: Callable[[int], int] = fn
    return out


def trim() -> bool:
    """Release free heap memory; True if the C library did (glibc), False if it cannot."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True
