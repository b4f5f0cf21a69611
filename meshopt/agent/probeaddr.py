"""Probe addresses: an IPv6 link-local address per WireGuard key, never relayed.

In the single-interface layout a relayed route moves the destination's address into the
relay's AllowedIPs, so probing that address would measure the relayed path, not the
direct tunnel. Each interface therefore also gets ``fe80::<64 bits of a hash of its
public key>``, and every agent puts each peer's probe address into that peer's
AllowedIPs and never moves it. Both ends derive the addresses from keys they already
know: nothing to configure, nothing to distribute. The same scheme serves the
per-peer layout (one interface per tunnel, scoped by interface name).
"""

from __future__ import annotations

import hashlib
import ipaddress

from meshopt.wireguard.keys import check_key

_TAG = b"meshopt-probe-v1"


def probe_address(public_key: str) -> str:
    """The link-local probe address of the interface with this (base64) public key."""
    check_key(public_key)
    digest = hashlib.sha256(_TAG + public_key.encode()).digest()
    iid = int.from_bytes(digest[:8], "big")
    return str(ipaddress.IPv6Address((0xFE80 << 112) | iid))


def probe_prefix(public_key: str) -> str:
    """The /128 that goes into AllowedIPs."""
    return f"{probe_address(public_key)}/128"
