"""The agent's own namespace: its interfaces, their addresses, and two sysctls.

A thin pyroute2 adapter (AsyncIPRoute in the current namespace: the agent runs inside
the node it manages), kept apart so the daemon's logic stays testable without netlink.
"""

from __future__ import annotations

import asyncio
import errno
import fnmatch
import ipaddress
import logging
import socket
from collections.abc import Sequence
from pathlib import Path

from pyroute2 import AsyncIPRoute
from pyroute2.netlink.exceptions import NetlinkError

log = logging.getLogger("meshopt.agent")

IFA_F_NODAD = 0x02


class NetState:
    def __init__(self) -> None:
        self._ipr: AsyncIPRoute | None = None
        # One request at a time: pyroute2 refuses a second dump on a socket with one in
        # flight (EBUSY), and the agent's loops read links concurrently.
        self._lock = asyncio.Lock()

    async def open(self) -> None:
        self._ipr = AsyncIPRoute()
        await self._ipr.setup_endpoint()

    async def close(self) -> None:
        if self._ipr is not None:
            self._ipr.close()
            self._ipr = None

    @property
    def ipr(self) -> AsyncIPRoute:
        if self._ipr is None:
            raise RuntimeError("NetState is not open")
        return self._ipr

    async def links(self) -> dict[str, int]:
        """Interface name -> index in this namespace.

        libc's ``if_nameindex`` (a netlink dump parsed in C) rather than pyroute2's: the
        agent asks every peer poll, and decoding the dump in Python was a tenth of an
        idle agent's CPU.
        """
        return {name: index for index, name in socket.if_nameindex()}

    async def match_interfaces(self, patterns: Sequence[str]) -> list[str]:
        """Interface names matching the configured names or globs (``wg-*``)."""
        names = await self.links()
        return sorted(n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns))

    async def addresses(self) -> dict[int, list[str]]:
        """ifindex -> ``address/prefixlen`` of every address in the namespace."""
        out: dict[int, list[str]] = {}
        async with self._lock:
            async for msg in await self.ipr.addr("dump"):
                addr = msg.get("address")
                if isinstance(addr, str):
                    out.setdefault(int(msg["index"]), []).append(f"{addr}/{msg['prefixlen']}")
        return out

    async def ensure_link_local(self, ifindex: int, address: str) -> bool:
        """Add ``address``/64 (no DAD: it is unique by construction); True if added."""
        ip = ipaddress.IPv6Address(address)
        try:
            await self.ipr.addr(
                "add", index=ifindex, address=str(ip), prefixlen=64, flags=IFA_F_NODAD
            )
        except NetlinkError as exc:
            if exc.code == errno.EEXIST:
                return False
            raise
        return True


def set_sysctl(name: str, value: str) -> bool:
    """Write ``net.ipv4.ip_forward``-style keys; False (logged) where not permitted."""
    path = Path("/proc/sys") / name.replace(".", "/")
    try:
        if path.read_text().strip() == value:
            return True
        path.write_text(value)
    except OSError as exc:
        log.warning("cannot set %s=%s: %s", name, value, exc.strerror)
        return False
    return True
