"""The example topologies, shipped inside the package so an installed meshopt has them.

A checkout keeps a ``topologies -> meshopt/topologies`` symlink at its root, so paths
such as ``topologies/lab4.yaml`` work there too; installed, use :func:`packaged`.
"""

from __future__ import annotations

from pathlib import Path

from meshopt.errors import InputError

DIR = Path(__file__).resolve().parent


def names() -> list[str]:
    """The shipped topology files, e.g. ``["bench8.yaml", "demo.yaml", ...]``."""
    return sorted(p.name for p in DIR.glob("*.yaml"))


def packaged(name: str) -> Path:
    """The shipped topology ``name`` (``demo``, ``demo.yaml`` or ``topologies/demo.yaml``).

    Raises InputError naming the shipped ones when there is no such file, so a typo is
    one line, not a traceback.
    """
    base = name.removeprefix("topologies/")
    if not base.endswith(".yaml"):
        base += ".yaml"
    if "/" in base or base.startswith(".") or base not in names():
        raise InputError(f"no shipped topology {name!r}; shipped: {', '.join(names())}")
    return DIR / base


def resolve(arg: str) -> str:
    """``arg`` unchanged if it names an existing file (or is not a plain name), else the
    shipped topology of that name when there is one: ``meshopt demo demo.yaml`` works
    outside a checkout, and a file in the working directory always wins.
    """
    try:
        if ":" in arg or "?" in arg or Path(arg).exists():
            return arg
    except (OSError, ValueError):  # a NUL byte, a name too long: the loader says so
        return arg
    try:
        return str(packaged(arg))
    except InputError:
        return arg
