"""TOML configuration files: typed sections from frozen dataclasses, one clear error each.

The agent and the controller read their files through this, so both refuse unknown
keys (a typo must not silently fall back to a default) and name the bad key.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any

from meshopt.errors import InputError


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
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise InputError(f"cannot read {p}: {exc.strerror}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"not valid TOML: {exc}", source=str(p)) from None
