"""sd_notify(3) without libsystemd: readiness, status, reload and watchdog for systemd.

systemd passes ``$NOTIFY_SOCKET`` (a datagram unix socket; ``@name`` is an abstract
address) to services with ``Type=notify``; each message is ``KEY=VALUE`` lines. With no
``$NOTIFY_SOCKET`` (run by hand, in the lab) every call is a no-op, so the daemons call
these unconditionally.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger("meshopt.sdnotify")


def _address() -> str | None:
    path = os.environ.get("NOTIFY_SOCKET", "")
    if not path or path[0] not in ("/", "@"):
        return None  # unset, or a vsock:... address we do not speak
    return "\0" + path[1:] if path[0] == "@" else path


def notify(*lines: str) -> bool:
    """Send ``lines`` as one message; False when there is nobody to tell (or it failed)."""
    address = _address()
    if address is None:
        return False
    message = "\n".join(lines).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto(message, address)
    except OSError as exc:
        # Never fatal: a daemon must not die because its supervisor went away.
        log.debug("sd_notify to %s failed: %s", address.lstrip("\0"), exc)
        return False
    return True


def ready(status: str = "") -> bool:
    """Startup finished (or a reload did): systemd starts the units ordered after us."""
    return notify("READY=1", *([f"STATUS={status}"] if status else []))


def status(text: str) -> bool:
    """A short state shown by ``systemctl status``."""
    return notify(f"STATUS={text}")


def reloading() -> bool:
    """A reload begins; systemd >= 253 wants the monotonic time with it."""
    usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    return notify("RELOADING=1", f"MONOTONIC_USEC={usec}", "STATUS=reloading the configuration")


def stopping() -> bool:
    return notify("STOPPING=1", "STATUS=stopping")


def watchdog() -> bool:
    return notify("WATCHDOG=1")


def watchdog_interval() -> float | None:
    """Seconds between keep-alives (half of ``$WATCHDOG_USEC``), or None without a watchdog.

    ``$WATCHDOG_PID``, when set, names the process meant; a child that inherited the
    environment must not answer for its parent.
    """
    pid = os.environ.get("WATCHDOG_PID", "")
    if pid and pid != str(os.getpid()):
        return None
    try:
        usec = int(os.environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 2e6 if usec > 0 else None
