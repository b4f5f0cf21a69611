"""TUN devices for the underlay emulator.

The emulator opens one non-persistent L3 TUN per node (``IFF_TUN | IFF_NO_PI``: no
link layer, so no ARP and no MAC addresses to manage), moves it into the node's
namespace and keeps the file descriptor. Because the device is not persistent, the
kernel deletes it when the descriptor is closed, including when the process dies:
a crash cannot leave devices behind.
"""

from __future__ import annotations

import fcntl
import importlib
import ipaddress
import os
import struct
from collections.abc import Sequence
from typing import Any

TUN_PATH = "/dev/net/tun"
TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
IFNAMSIZ = 16  # including the terminating NUL: names are at most 15 characters


def check_ifname(name: str) -> None:
    """Raise ValueError unless ``name`` is a usable Linux interface name."""
    if not 1 <= len(name.encode()) < IFNAMSIZ:
        raise ValueError(f"interface name {name!r} must be 1..{IFNAMSIZ - 1} bytes")
    if name in (".", "..") or any(c in name for c in "/: \t\n") or not name.isprintable():
        raise ValueError(f"interface name {name!r} contains a character Linux refuses")


def open_tun(name: str) -> int:
    """Create the TUN device ``name`` and return its non-blocking descriptor.

    Raises OSError (EBUSY) if a device with that name exists already.
    """
    check_ifname(name)
    fd = os.open(TUN_PATH, os.O_RDWR | os.O_CLOEXEC)
    try:
        ifr = struct.pack("16sH22x", name.encode(), IFF_TUN | IFF_NO_PI)
        fcntl.ioctl(fd, TUNSETIFF, ifr)
        os.set_blocking(fd, False)
    except BaseException:
        os.close(fd)
        raise
    return fd


def iproute(**kwargs: Any) -> Any:
    """A pyroute2 ``IPRoute`` (imported on demand: ~0.4 s; pyroute2 ships no types)."""
    return importlib.import_module("pyroute2").IPRoute(**kwargs)


def move_to_netns(ipr: Any, ifname: str, netns: str) -> None:
    """Move the interface ``ifname`` (in the current namespace) into ``netns``.

    The emulator's descriptor keeps working after the move: the device's queues
    belong to the file, not to the namespace.
    """
    found = ipr.link_lookup(ifname=ifname)
    if not found:
        raise OSError(f"interface {ifname} not found")
    ipr.link("set", index=found[0], net_ns_fd=netns)


def configure_in_netns(
    netns: str,
    ifname: str,
    addresses: Sequence[str],
    *,
    mtu: int = 1500,
    txqueuelen: int = 1000,
) -> None:
    """Inside ``netns``: address, MTU and queue length of ``ifname``; it and ``lo`` up.

    IPv6 link-local autoconfiguration is switched off on the device unless an IPv6
    address is given, so an IPv4-only lab does not leak router solicitations into
    the underlay's "unknown destination" counters.
    """
    nets = [ipaddress.ip_interface(a) for a in addresses]
    with iproute(netns=netns) as ipr:
        found = ipr.link_lookup(ifname=ifname)
        if not found:
            raise OSError(f"interface {ifname} not found in namespace {netns}")
        idx = found[0]
        if not any(n.version == 6 for n in nets):
            # IN6_ADDR_GEN_MODE_NONE: no automatic link-local address.
            ipr.link(
                "set",
                index=idx,
                IFLA_AF_SPEC={
                    "attrs": [["AF_INET6", {"attrs": [["IFLA_INET6_ADDR_GEN_MODE", 1]]}]]
                },
            )
        ipr.link("set", index=idx, mtu=mtu, txqlen=txqueuelen)
        for net in nets:
            ipr.addr(
                "add",
                index=idx,
                address=str(net.ip),
                prefixlen=net.network.prefixlen,
                # IFA_F_NODAD: usable at once, no duplicate-address detection delay.
                **({"flags": 0x02} if net.version == 6 else {}),
            )
        ipr.link("set", index=idx, state="up")
        lo = ipr.link_lookup(ifname="lo")
        if lo:
            ipr.link("set", index=lo[0], state="up")
