"""TOML configuration files: typed sections from frozen dataclasses, one clear error each.

The agent and the controller read their files through this, so both refuse unknown
keys (a typo must not silently fall back to a default) and name the bad key. Files that
are not UTF-8, not TOML or not a config at all (a 2 GB log, /dev/zero) are one line too:
systemd restarts a daemon that crashes, and a traceback in a restart loop helps nobody.
"""

from __future__ import annotations

import base64
import binascii
import math
import os
import stat
import tomllib
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any, overload

from meshopt.errors import InputError

MAX_CONFIG_BYTES = 4 << 20  # a config with 5,000 enrolled nodes is ~500 kB
MAX_KEY_FILE_BYTES = 64 << 10  # a PEM key is ~120 bytes
MAX_BROKER_FILE_BYTES = 4 << 20  # a CA bundle; the system's is ~200 kB
PLACEHOLDER_PREFIX = b"example-"  # what the shipped examples' keys decode to


def _coerce(where: str, value: Any, default: Any) -> Any:
    """Check ``value`` against the type of the default; lists become tuples."""
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise InputError(f"{where} must be true or false, got {value!r}")
        return value
    if isinstance(default, int) and not isinstance(default, bool):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InputError(f"{where} must be a whole number >= 0, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InputError(f"{where} must be a number, got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise InputError(f"{where} must be a finite number >= 0, got {value!r}")
        return float(value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise InputError(f"{where} must be a string, got {value!r}")
        return value
    if isinstance(default, tuple):
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise InputError(f"{where} must be a list of strings, got {value!r}")
        return tuple(value)
    raise AssertionError(f"no coercion for {where}")  # pragma: no cover


def _default(f: Field[Any]) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return ""  # required strings (mesh, node)


def build(
    cls: type[Any],
    data: dict[str, Any],
    where: str = "",
    sections: dict[str, type[Any]] | None = None,
) -> Any:
    """``cls(**data)`` with every value checked against its default's type.

    ``sections`` names keys holding nested tables (each built the same way).
    """
    sections = sections or {}
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise InputError(f"unknown key {where}{unknown[0]} (known: {', '.join(sorted(known))})")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        if name in sections:
            if not isinstance(value, dict):
                raise InputError(f"[{name}] must be a table")
            kwargs[name] = build(sections[name], value, f"{name}.")
        else:
            kwargs[name] = _coerce(where + name, value, _default(known[name]))
    return cls(**kwargs)


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file's tables, or one InputError: unreadable, too large, not UTF-8, not TOML."""
    p = Path(path)
    source = printable(str(p))
    try:
        with p.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {printable(str(p)[:200])}: {_why(exc)}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise InputError(
            f"larger than {MAX_CONFIG_BYTES >> 20} MiB: not a configuration file", source=source
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise InputError("not UTF-8 text", source=source, line=line) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"not valid TOML: {_one_line(exc)}", source=source) from None
    except RecursionError:
        raise InputError("not valid TOML: nested too deeply", source=source) from None


@overload
def printable(text: str) -> str: ...
@overload
def printable(text: None) -> None: ...
def printable(text: str | None) -> str | None:
    """``text`` with line breaks and other control characters escaped: an error is one
    line even when it quotes a file name or value holding a newline."""
    if text is None or text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _why(exc: BaseException) -> str:
    return str(getattr(exc, "strerror", None) or exc)


def _one_line(exc: BaseException) -> str:
    return printable(" ".join(str(exc).split())[:300]) or type(exc).__name__


def placeholder(text: str) -> str | None:
    """What an example file's placeholder key looks like when ``text`` is one, else None.

    The shipped examples carry "<output of: ...>" and base64 of "example-...-replace-me!"
    so that a copied config fails --check instead of trusting a key nobody holds.
    """
    stripped = text.strip()
    if stripped.startswith("<") and stripped.endswith(">"):
        return f"{stripped[:70]!r} is a placeholder"
    try:
        raw = base64.b64decode(stripped, validate=True)
    except (binascii.Error, ValueError):
        return None
    if raw.startswith(PLACEHOLDER_PREFIX):
        return f"{stripped[:60]!r} is a placeholder (it decodes to {raw.decode('latin-1')!r})"
    return None


def check_key_file(
    path: str, where: str, what: str = "key file", max_bytes: int = MAX_KEY_FILE_BYTES
) -> None:
    """A key file the daemon will read whole at start: a regular file, and small.

    A path to /dev/zero or a FIFO would hang or exhaust the daemon at start instead of
    failing; a NUL in the path would raise ValueError, not a clear error.
    """
    try:
        info = os.stat(path)
    except (OSError, ValueError) as exc:
        raise InputError(f"{where}: cannot read {what} {path[:200]!r}: {_why(exc)}") from None
    if not stat.S_ISREG(info.st_mode):
        raise InputError(f"{where}: {what} {path[:200]!r} is not a regular file")
    if info.st_size > max_bytes:
        raise InputError(f"{where}: {what} {path[:200]!r} is larger than {max_bytes:,} bytes")


def check_broker_files(settings: Any, where: str = "broker.") -> None:
    """The ``[broker]`` table's files, before the broker checks read them whole:
    /dev/zero as a password file would otherwise be a MemoryError, a NUL a ValueError."""
    for f in fields(settings):
        path = getattr(settings, f.name)
        if not (f.name.endswith("_file") and isinstance(path, str) and path):
            continue
        try:
            os.stat(path)
        except OSError:
            continue  # missing or unreadable: the broker checks name it in their words
        except ValueError:
            pass  # a NUL byte: check_key_file says so
        check_key_file(path, where + f.name, "file", MAX_BROKER_FILE_BYTES)


def check_public_key(text: str, where: str, how: str) -> None:
    """``text`` read as the daemons read it: base64 of an Ed25519 public key, or a file
    holding one. ``how`` tells the operator where the real key comes from."""
    from meshopt.bus.signing import load_public_key

    why = placeholder(text)
    if why is not None:
        raise InputError(f"{where}: {why}: put the real key there ({how})")
    try:
        if not _is_key_text(text):
            check_key_file(text, where)
        load_public_key(text)
    except InputError:
        raise InputError(
            f"{where}: {text[:60]!r} is not a base64 Ed25519 public key "
            "nor a readable file holding one"
        ) from None


def _is_key_text(text: str) -> bool:
    """Base64 of 32 bytes, which load_public_key takes as the key itself, not a path."""
    stripped = text.strip()
    if len(stripped) != 44:
        return False
    try:
        return len(base64.b64decode(stripped, validate=True)) == 32
    except (binascii.Error, ValueError):
        return False
