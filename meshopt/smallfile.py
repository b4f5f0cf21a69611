"""Reading the small files an operator points at (keys, certificates, passwords).

A path to ``/dev/zero``, a directory, a FIFO or a huge file must be a one-line error,
not a MemoryError or a hang: only regular files up to a size limit are read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from meshopt.errors import InputError

SMALL_FILE_BYTES = 1024 * 1024  # keys, certificates and passwords are a few kB


def read_small_file(path: str | Path, what: str, limit: int = SMALL_FILE_BYTES) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit``); InputError otherwise."""
    shown = str(path)[:200]
    if "\0" in str(path):
        raise InputError(f"{what}: the path contains a NUL character")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise InputError(f"{what} {shown}: no such file") from None
    except OSError as exc:
        raise InputError(f"{what} {shown}: cannot read it ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{what} {shown}: not a regular file")
        if st.st_size > limit:
            raise InputError(f"{what} {shown}: {st.st_size} bytes, more than {limit}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise InputError(f"{what} {shown}: cannot read it ({exc.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise InputError(f"{what} {shown}: more than {limit} bytes")
    return data
