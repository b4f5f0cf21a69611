"""What both underlays (the user-space emulator and netem) are given: nodes and matrices.

One description and one set of checks, so the two specs cannot drift apart; each
spec adds only what is its own (the emulator's lab id and control socket, netem's
switch namespace) and turns the ValueError raised here into its own error class.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Collection, Sequence
from typing import Protocol

import msgspec

from meshopt.lab.netns import check_netns_name
from meshopt.lab.shaper import PairParams
from meshopt.lab.tun import check_ifname

MATRICES = ("delay_ms", "jitter_ms", "loss", "rate_mbit")


class UnderlayNode(msgspec.Struct, forbid_unknown_fields=True):
    """One node: its namespace, its underlay interface and address(es), with prefix."""

    name: str
    netns: str
    ifname: str
    address: str  # e.g. "172.31.0.1/16"
    address6: str | None = None  # optional second (IPv6) address for dual-stack labs


class PairMatrices(Protocol):
    """n×n, row = sender, column = receiver; None rate = unlimited; left-out = 0."""

    @property
    def delay_ms(self) -> list[list[float]]: ...
    @property
    def jitter_ms(self) -> list[list[float]] | None: ...
    @property
    def loss(self) -> list[list[float]] | None: ...
    @property
    def rate_mbit(self) -> list[list[float | None]] | None: ...


def pair_params(m: PairMatrices, i: int, j: int) -> PairParams:
    """The directed pair (i, j)'s parameters; ValueError if they are out of range."""
    rate = m.rate_mbit[i][j] if m.rate_mbit is not None else None
    return PairParams(
        delay_ms=float(m.delay_ms[i][j]),
        jitter_ms=float(m.jitter_ms[i][j]) if m.jitter_ms is not None else 0.0,
        loss=float(m.loss[i][j]) if m.loss is not None else 0.0,
        rate_mbit=math.inf if rate is None else float(rate),
    )


def check_nodes(
    nodes: Sequence[UnderlayNode],
    *,
    mtu: int,
    ipv4_address: bool = False,
    taken_netns: Collection[str] = (),
) -> None:
    """ValueError (``nodes[k].key: ...``) for a node that cannot be built.

    ``ipv4_address``: ``address`` must be IPv4 (else either family); ``address6``
    is always IPv6. ``taken_netns``: namespaces the spec uses for something else.
    """
    seen: dict[str, set[str]] = {"name": set(), "netns": set(taken_netns), "ifname": set()}
    addresses: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
    for k, node in enumerate(nodes):
        where = f"nodes[{k}]"
        for key in ("name", "netns", "ifname"):
            value = getattr(node, key)
            if value in seen[key]:
                raise ValueError(f"{where}.{key}: {value!r} is used twice")
            seen[key].add(value)
        try:
            check_ifname(node.ifname)
            check_netns_name(node.netns)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        for key, version in (("address", 4 if ipv4_address else None), ("address6", 6)):
            text = getattr(node, key)
            if text is None:
                continue
            family = f"IPv{version}" if version else "an address"
            try:
                iface = ipaddress.ip_interface(text)
            except ValueError:
                raise ValueError(f"{where}.{key}: {text!r} is not an address/prefix") from None
            if "/" not in text or version not in (None, iface.version):
                raise ValueError(
                    f"{where}.{key}: {text!r} must be {family} with a prefix length, e.g. /16"
                )
            if iface.version == 6 and mtu < 1280:
                raise ValueError(f"mtu {mtu} is below IPv6's minimum 1280")
            ip = iface.ip
            if ip.is_multicast or ip.is_unspecified or ip.is_loopback or ip.is_link_local:
                raise ValueError(f"{where}.{key}: {text!r} cannot be a node address")
            if ip in addresses:
                raise ValueError(f"{where}.{key}: address {ip} is used twice")
            addresses.add(ip)


def check_matrices(m: PairMatrices, n: int) -> None:
    """ValueError unless every matrix is n×n and every directed pair is in range."""
    for key in MATRICES:
        matrix = getattr(m, key)
        if matrix is not None and (len(matrix) != n or any(len(row) != n for row in matrix)):
            raise ValueError(f"{key} must be a {n}x{n} matrix")
    for i in range(n):
        for j in range(n):
            if i != j:
                try:
                    pair_params(m, i, j)
                except ValueError as exc:
                    raise ValueError(f"pair [{i}, {j}]: {exc}") from None
