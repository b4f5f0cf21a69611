"""Key, certificate and password files: only regular files of a sane size are read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from meshopt.bus.client import read_password
from meshopt.bus.signing import load_private_key, load_public_key
from meshopt.errors import InputError
from meshopt.smallfile import read_small_file


def test_a_regular_file_is_read(tmp_path: Path) -> None:
    f = tmp_path / "pw"
    f.write_text("secret\n")
    assert read_small_file(f, "password") == b"secret\n"
    assert read_password(str(f)) == "secret"


@pytest.mark.parametrize("kind", ["dev_zero", "directory", "fifo", "huge", "nul", "missing"])
def test_anything_else_is_one_line_error(tmp_path: Path, kind: str) -> None:
    path: str = {
        "dev_zero": "/dev/zero",
        "directory": str(tmp_path),
        "fifo": str(tmp_path / "fifo"),
        "huge": str(tmp_path / "huge"),
        "nul": str(tmp_path / "a\0b"),
        "missing": str(tmp_path / "nope"),
    }[kind]
    if kind == "fifo":
        os.mkfifo(path)  # nobody writes: a blocking read would hang for ever
    if kind == "huge":
        with open(path, "wb") as f:
            f.truncate(64 * 1024 * 1024)
    for read in (
        lambda: read_small_file(path, "key file"),
        lambda: load_private_key(path),
        lambda: load_public_key(path),
        lambda: read_password(path),
    ):
        with pytest.raises(InputError) as info:
            read()
        assert "\n" not in str(info.value)
