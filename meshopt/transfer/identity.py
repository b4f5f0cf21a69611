"""Who a connection comes from: the mesh identity behind a source address.

WireGuard accepts a packet from a peer only when its source address lies in that peer's
AllowedIPs, so inside the overlay a source address names a peer. The receiver keys its
chunk cache, partial files and file ownership by this identity, so one sender can
neither learn nor reuse what another sent.

Limits: a relay forwards other nodes' packets with their source addresses, so a relay
could speak for the nodes it relays; in the per-peer layout (each peer takes a default
route) the address is all there is, and the identity is the address.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def normalise(address: str) -> IPAddress | None:
    """The address without a zone; IPv4-mapped IPv6 as IPv4; None if it is not one."""
    try:
        addr = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def address_identity(address: str) -> str | None:
    """The standalone receiver's identity of a sender: its (normalised) address."""
    addr = normalise(address)
    return None if addr is None else f"addr:{addr}"


def peer_identity(
    address: str,
    peers: Mapping[str, Sequence[str]],
    routed: Mapping[str, Sequence[str]] | None = None,
) -> str | None:
    """``peer:<public key>`` of the peer whose AllowedIPs hold ``address`` most specifically.

    ``peers``: public key -> the peer's own AllowedIPs (before the agent moved relayed
    prefixes onto other peers); ``routed``: their AllowedIPs now. A node that is no
    direct peer reaches us through a relay whose current AllowedIPs hold its address;
    it, and a sender matched only by default routes, is known by its address
    (``addr:...``). None: no peer could have sent it, or two peers claim it equally (a
    misconfiguration, not a sender to trust).
    """
    addr = normalise(address)
    if addr is None:
        return None
    # Reached through a relay, or a default route: WireGuard let it in, but no peer is it.
    by_address = any(
        addr in net for nets in (routed or {}).values() for net in _networks(nets, addr.version)
    )
    best: list[str] = []
    best_len = -1
    for key, prefixes in peers.items():
        for net in _networks(prefixes, addr.version):
            if addr not in net:
                continue
            if net.prefixlen == 0:
                by_address = True
            elif net.prefixlen > best_len:
                best, best_len = [key], net.prefixlen
            elif net.prefixlen == best_len and key not in best:
                best.append(key)
    if len(best) == 1:
        return f"peer:{best[0]}"
    if not best and by_address:
        return f"addr:{addr}"
    return None


IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def _networks(prefixes: Sequence[str], version: int) -> list[IPNetwork]:
    out = []
    for p in prefixes:
        try:
            net = ipaddress.ip_network(p, strict=False)
        except ValueError:
            continue
        if net.version == version:
            out.append(net)
    return out
