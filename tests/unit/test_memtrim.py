"""memtrim: the controller hands a recompute's freed temporaries back to the OS (issue 15,
RSS at 1000 nodes). On glibc it must really call malloc_trim; elsewhere it says it could not."""

from __future__ import annotations

import platform

import numpy as np

from meshopt import memtrim


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_trim_returns_freed_heap_pages_on_glibc() -> None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        assert memtrim.trim() in (True, False)
        return
    # Heap blocks (96 KB: under glibc's mmap threshold) with small ones pinned between
    # them: freed, they stay in the process (nothing at the heap's top to cut) until
    # trimmed. The controller's temporaries are of this kind once the threshold grew.
    keep = []
    arrays = []
    for _ in range(1000):
        arrays.append(np.ones(12000))
        keep.append(np.ones(1000))
    before = _rss_kib()
    del arrays
    assert memtrim.trim()
    after = _rss_kib()
    assert before - after > 48 * 1024, (before, after)  # most of the ~94 MiB went back
    del keep
