"""What a reload (SIGHUP) may change: the new config with the fixed settings kept.

Some settings cannot change under a running daemon (its mesh and name, the broker
session, the interfaces and ports it has open); a reload keeps their running values and
says which of them need a restart, while keys and thresholds take effect at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, TypeVar

C = TypeVar("C")


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted names of a nested dataclass's leaves: ``probe.port`` -> 51899."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        name = prefix + f.name
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out.update(_flat(value, name + "."))
        else:
            out[name] = value
    return out


def _covered(name: str, fixed: Iterable[str]) -> bool:
    return any(name == f or name.startswith(f + ".") for f in fixed)


def _set(obj: Any, dotted: str, value: Any) -> Any:
    head, _, rest = dotted.partition(".")
    if not rest:
        return dataclasses.replace(obj, **{head: value})
    return dataclasses.replace(obj, **{head: _set(getattr(obj, head), rest, value)})


def merge_reload(old: C, new: C, fixed: Iterable[str]) -> tuple[C, list[str], list[str]]:
    """(``new`` with every ``fixed`` setting as in ``old``, the settings that change now,
    the changed ones kept until a restart); names are dotted (``telemetry.rtt_change_ms``)."""
    fixed = list(fixed)
    before, after = _flat(old), _flat(new)
    changed = sorted(k for k in after if before.get(k) != after[k])
    now = [k for k in changed if not _covered(k, fixed)]
    later = [k for k in changed if _covered(k, fixed)]
    merged = new
    for k in later:
        merged = _set(merged, k, before[k])
    return merged, now, later


def describe(old: Any, new: Any, names: Iterable[str]) -> str:
    """``a 1 -> 2, b x -> y`` for a log line (key material abbreviated)."""
    before, after = _flat(old), _flat(new)
    parts = []
    for k in names:
        a, b = before.get(k), after.get(k)
        if "key" in k:
            parts.append(f"{k} changed")
        else:
            parts.append(f"{k} {a!r} -> {b!r}")
    return ", ".join(parts)
