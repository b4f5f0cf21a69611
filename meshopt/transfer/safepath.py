"""Where an offered file may go: only inside the receiver's directory.

Refuses ``..``, absolute paths outside the directory, symlinks that lead out of it,
names that are not plain file names, the receiver's own hidden files, and names with
control or Unicode format characters (a right-to-left override makes ``evil\u202etxt.exe``
look like ``evilexe.txt`` in a listing; an escape sequence rewrites the terminal).
"""

from __future__ import annotations

import unicodedata
from pathlib import Path, PurePosixPath

from meshopt.transfer.errors import TransferError

RESERVED_PREFIX = ".meshopt"  # partial files, state files and the default cache
PART_SUFFIX = ".meshopt-part"
STATE_SUFFIX = ".meshopt-state"


def _refuse(msg: str) -> TransferError:
    return TransferError(msg, code="bad-path")


# C0/C1 controls (Cc), format characters (Cf: bidi overrides and isolates, zero-width
# characters, BOM), line/paragraph separators and lone surrogates.
_REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})


def check_chars(text: str, what: str) -> None:
    """Refuse control and format characters: they make a name lie about itself."""
    for ch in text:
        cat = unicodedata.category(ch)
        if cat in _REFUSED_CATEGORIES:
            kind = "control" if cat == "Cc" else "invisible or direction-changing"
            raise _refuse(
                f"{what} {text!r} contains a {kind} character (U+{ord(ch):04X}, category {cat})"
            )


def check_name(name: str) -> None:
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise _refuse(f"bad file name {name!r}: must be a plain file name")
    check_chars(name, "file name")
    if len(name.encode()) > 200:
        raise _refuse("file name is longer than 200 bytes")
    if name.startswith(RESERVED_PREFIX) or name.endswith((PART_SUFFIX, STATE_SUFFIX)):
        raise _refuse(f"file name {name!r} is reserved for the receiver's own files")


MAX_DEST = 1024  # bytes of the destination directory


def resolve_target(root: Path, dest: str, name: str, *, create: bool = True) -> Path:
    """The final path for ``name`` in ``dest`` under ``root``; creates missing directories
    unless ``create`` is false (checks that must come before any write).

    Symlinks are resolved before the check, so a link inside the directory that points
    outside it is refused like ``..``; the final name itself must not be a symlink.
    """
    check_name(name)
    if "\0" in dest:
        raise _refuse("directory contains a NUL byte")
    if len(dest.encode()) > MAX_DEST:
        raise _refuse(f"destination is longer than {MAX_DEST} bytes")
    check_chars(dest, "destination")
    real_root = root.resolve(strict=True)
    d = PurePosixPath(dest)
    if d.is_absolute():
        inside = [r for r in (root.absolute(), real_root) if PurePosixPath(d).is_relative_to(r)]
        if not inside:
            raise _refuse(f"absolute path {dest} is outside the receive directory")
        d = d.relative_to(inside[0])
    if ".." in d.parts:
        raise _refuse(f"'..' is not allowed in the destination ({dest})")
    if any(p.startswith(RESERVED_PREFIX) for p in d.parts):
        raise _refuse(f"destination {dest} names the receiver's own files")
    target_dir = real_root.joinpath(*d.parts)
    if not target_dir.resolve().is_relative_to(real_root):
        raise _refuse(f"destination {dest} leaves the receive directory through a symlink")
    if not create:
        if target_dir.exists() and not target_dir.is_dir():
            raise _refuse(f"destination {dest} is not a directory")
        return _final(target_dir.resolve(), name)
    try:
        target_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError as exc:
        raise _refuse(f"destination {dest} is not a directory") from exc
    except NotADirectoryError as exc:
        raise _refuse(f"destination {dest} is not a directory") from exc
    real_dir = target_dir.resolve(strict=True)
    if not real_dir.is_relative_to(real_root):  # a link swapped in meanwhile
        raise _refuse(f"destination {dest} leaves the receive directory through a symlink")
    return _final(real_dir, name)


def _final(real_dir: Path, name: str) -> Path:
    target = real_dir / name
    if target.is_symlink():
        raise _refuse(f"{name} is a symlink on the receiver; not writing through it")
    if target.exists() and not target.is_file():
        raise _refuse(f"{name} exists on the receiver and is not a regular file")
    return target
