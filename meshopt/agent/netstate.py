"""The agent's own namespace: its interfaces, their addresses, and the sysctls it needs.

A thin pyroute2 adapter (AsyncIPRoute in the current namespace: the agent runs inside
the node it manages), kept apart so the daemon's logic stays testable without netlink.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fnmatch
import ipaddress
import json
import logging
import os
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


SYSCTL_ROOT = Path("/proc/sys")


def sysctl_path(name: str, root: Path = SYSCTL_ROOT) -> Path:
    """``net.ipv6.conf.wg0.forwarding`` -> /proc/sys/net/ipv6/conf/wg0/forwarding.

    The first three parts are fixed names; an interface name (which may hold dots,
    e.g. ``wg0.100``) is everything up to the last part.
    """
    parts = name.split(".")
    if len(parts) > 4 and parts[:3] in (["net", "ipv4", "conf"], ["net", "ipv6", "conf"]):
        parts = [*parts[:3], ".".join(parts[3:-1]), parts[-1]]
    return root.joinpath(*parts)


def read_sysctl(name: str, root: Path = SYSCTL_ROOT) -> str | None:
    try:
        return sysctl_path(name, root).read_text().strip()
    except OSError:
        return None


def set_sysctl(name: str, value: str, root: Path = SYSCTL_ROOT) -> bool:
    """Write ``net.ipv4.ip_forward``-style keys; False (logged) where not permitted."""
    path = sysctl_path(name, root)
    try:
        if path.read_text().strip() == value:
            return True
        path.write_text(value)
    except OSError as exc:
        log.warning("cannot set %s=%s: %s", name, value, exc.strerror)
        return False
    return True


class Sysctls:
    """The sysctls the agent changed and their values from before it, put back on a
    clean stop.

    The originals are written to ``record`` (in the state directory) before the first
    change, so an agent restarted after a crash still restores the host's values, not
    the ones its predecessor set. Only what relaying needs is touched: IPv4 forwarding
    (global: Linux has no per-interface switch that forwards), IPv6 forwarding on the
    WireGuard interfaces where the kernel can (``force_forwarding``, Linux 6.17+), and
    reverse-path filtering on them (relayed replies arrive on another tunnel).
    """

    def __init__(self, record: Path, root: Path = SYSCTL_ROOT) -> None:
        self.record = record
        self.root = root
        self.original: dict[str, str] = self._load()

    def _load(self) -> dict[str, str]:
        try:
            data = json.loads(self.record.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable sysctl record %s: %s", self.record, exc)
            return {}
        if not isinstance(data, dict):
            return {}
        if data:
            log.info("sysctls changed by a previous run, restored on stop: %s", ", ".join(data))
        return {str(k): str(v) for k, v in data.items()}

    def _save(self) -> None:
        self.record.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.record.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.original, sort_keys=True, indent=0))
        os.replace(tmp, self.record)

    def get(self, name: str) -> str | None:
        return read_sysctl(name, self.root)

    def set(self, name: str, value: str) -> bool:
        """Set ``name`` to ``value``, remembering its value from before the agent."""
        current = self.get(name)
        if current is None:
            log.warning("cannot set %s=%s: no such sysctl", name, value)
            return False
        if current == value:
            return True
        if name not in self.original:
            self.original[name] = current
            self._save()  # before the write: a crash right after must still know it
        if not set_sysctl(name, value, self.root):
            return False
        log.info("sysctl %s=%s (was %s; restored on stop)", name, value, self.original[name])
        return True

    def restore(self) -> list[str]:
        """Put every changed sysctl back; the names restored. Gone interfaces are skipped."""
        done: list[str] = []
        for name, value in sorted(self.original.items()):
            path = sysctl_path(name, self.root)
            if not path.exists():
                continue  # its interface is gone, and the setting with it
            if set_sysctl(name, value, self.root):
                done.append(name)
        if done:
            log.info("restored sysctls: %s", ", ".join(f"{n}={self.original[n]}" for n in done))
        self.original.clear()
        with contextlib.suppress(FileNotFoundError):
            self.record.unlink()
        return done

    def enable_forwarding(self, ipv6_mode: str, ipv6_mesh: bool) -> None:
        """The global part of forwarding: IPv4 (and IPv6 for ``all``, or for an IPv6 mesh
        on a kernel without per-interface forwarding)."""
        self.set("net.ipv4.ip_forward", "1")
        per_interface = (self.root / "net/ipv6/conf/all/force_forwarding").exists()
        if ipv6_mode == "all" or (ipv6_mode == "auto" and ipv6_mesh and not per_interface):
            log.warning(
                "setting net.ipv6.conf.all.forwarding=1: interfaces that learn their "
                "default route from router advertisements need accept_ra=2 to keep it"
            )
            self.set("net.ipv6.conf.all.forwarding", "1")
        # rp_filter's effective value is max(all, interface): 0 on the tunnels does
        # nothing while all is 1 (strict), so strict becomes loose (2), never off.
        if self.get("net.ipv4.conf.all.rp_filter") == "1":
            log.info(
                "net.ipv4.conf.all.rp_filter is 1 (strict), which drops relayed replies: "
                "setting it to 2 (loose) while the agent runs"
            )
            self.set("net.ipv4.conf.all.rp_filter", "2")

    def enable_interface(self, ifname: str, ipv6_mode: str) -> None:
        """Per WireGuard interface: no reverse-path filter, IPv6 forwarding where possible."""
        self.set(f"net.ipv4.conf.{ifname}.rp_filter", "0")
        if ipv6_mode == "off" or self.get(f"net.ipv6.conf.{ifname}.forwarding") is None:
            return
        if (self.root / f"net/ipv6/conf/{ifname}/force_forwarding").exists():
            self.set(f"net.ipv6.conf.{ifname}.forwarding", "1")
            self.set(f"net.ipv6.conf.{ifname}.force_forwarding", "1")
