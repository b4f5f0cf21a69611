"""Network namespace helpers for the lab, built on ``ip netns``.

``ip netns`` is used rather than pyroute2's ``netns`` module because its namespaces are
the ones every other tool (``ip -n``, ``ip netns exec``, ``ip netns list``) sees: it
creates the bind mount ``/var/run/netns/<name>`` and removes it again on delete.
Names are chosen by the caller and should carry the lab id, so that clean-up removes
exactly what one lab created.
"""

from __future__ import annotations

import os
import re
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

NETNS_DIR = "/var/run/netns"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


class NetnsError(RuntimeError):
    """An ``ip netns`` command failed; the message carries its stderr."""


def check_netns_name(name: str) -> None:
    """Raise ValueError unless ``name`` is a safe namespace name (no paths, no spaces)."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"bad namespace name {name!r}: use letters, digits, '_', '.', '-'")


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")


def list_netns() -> list[str]:
    """Names of the named namespaces (what ``ip netns list`` shows), sorted."""
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def netns_exists(name: str) -> bool:
    return os.path.exists(os.path.join(NETNS_DIR, name))


def create_netns(name: str) -> None:
    """Create the namespace ``name``; fails if it exists (it may belong to someone else)."""
    check_netns_name(name)
    _ip("netns", "add", name)


def delete_netns(name: str, *, missing_ok: bool = False) -> None:
    """Delete the namespace ``name`` (its bind mount and file go too).

    Processes still running inside keep the namespace alive until they exit; the lab
    ends its own processes (by PID) before calling this.
    """
    check_netns_name(name)
    if missing_ok and not netns_exists(name):
        return
    _ip("netns", "delete", name)


def netns_argv(name: str, argv: Sequence[str]) -> list[str]:
    """The command line that runs ``argv`` inside namespace ``name``."""
    check_netns_name(name)
    return ["ip", "netns", "exec", name, *argv]


def netns_exec(name: str, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
    """Start ``argv`` inside namespace ``name``; the caller keeps the Popen (and its PID).

    ``ip netns exec`` execs the command in place, so the returned PID is the command's
    own and signalling it reaches the command.
    """
    return subprocess.Popen(netns_argv(name, argv), **popen_kwargs)


def netns_run(
    name: str, argv: Sequence[str], *, timeout: float | None = 30.0, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` inside ``name`` to completion and capture its output as text."""
    return subprocess.run(
        netns_argv(name, argv), capture_output=True, text=True, timeout=timeout, check=check
    )


def unique_name(prefix: str) -> str:
    """``prefix`` plus a short random suffix, for names that must not collide."""
    return f"{prefix}{uuid.uuid4().hex[:6]}"


@contextmanager
def temporary_netns(name: str | None = None, *, prefix: str = "motmp") -> Iterator[str]:
    """A namespace that exists for the duration of the ``with`` block."""
    ns = name or unique_name(prefix)
    create_netns(ns)
    try:
        yield ns
    finally:
        delete_netns(ns, missing_ok=True)
