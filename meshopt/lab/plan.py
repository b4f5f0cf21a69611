"""The lab's plan: every name and address a lab will create, computed before anything is.

Pure: from a topology, a lab id and the options it returns what ``lab up`` builds, so a
bad request (an address clash, a mesh too large for the machine, an interface name
over Linux's 15 bytes) fails here, with one line, and nothing is left half-built.

Names carry the lab id (``ml<id>``): namespaces ``ml<id>-<node>`` and ``ml<id>--mgmt``
(node names cannot contain ``-``, so neither can collide with a node's) and the
underlay TUNs ``ml<id>u<i>`` (made in the root namespace, then moved). Inside a node
the names are the ones an operator would use: ``wg0`` (one interface per node) or
``wg-<peer>`` (one per peer). wireguard-go names its control socket after the
interface in ``/var/run/wireguard``, shared by every namespace, so each node gets a
private directory mounted there, for its wireguard-go and for ``lab exec``.

Address ranges, all of them only inside the lab's namespaces:
underlay ``172.31.0.0/16``, management ``172.30.0.0/16`` (broker at ``.0.1``),
overlay from the topology or ``10.201.0.0/16``.
"""

from __future__ import annotations

import ipaddress
import re
import secrets
import string
from dataclasses import dataclass
from typing import Literal

from meshopt.errors import InputError
from meshopt.topology.model import Topology

Layout = Literal["single", "per-peer"]
LAYOUTS: tuple[Layout, ...] = ("single", "per-peer")

UNDERLAY_NET = ipaddress.IPv4Network("172.31.0.0/16")
MGMT_NET = ipaddress.IPv4Network("172.30.0.0/16")
OVERLAY_DEFAULT_NET = ipaddress.IPv4Network("10.201.0.0/16")
BROKER_PORT = 1883
WG_PORT = 51820  # single layout: every node's one interface
WG_PEER_PORT_BASE = 40000  # per-peer layout: node i's interface towards j listens on base + j
WG_MTU = 1420  # 1500 - 80: fits WireGuard over IPv4 and IPv6 underlays
MAX_NODES = 250
MAX_PER_PEER_NODES = 24  # n(n-1) wireguard-go processes: 552 at 24 nodes
LAB_ID = re.compile(r"l[0-9a-z]{4}")
LAB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}")

# Memory each part needs, measured on the development VM (RSS): wireguard-go ~9 MB
# idle, the emulator ~30 MB, mosquitto ~6 MB, a namespace itself ~0.2 MB.
WG_GO_MB = 12.0
EMULATOR_MB = 40.0
BROKER_MB = 8.0


def new_lab_id() -> str:
    """``l`` and four random base-36 characters: short enough for interface names."""
    alphabet = string.digits + string.ascii_lowercase
    return "l" + "".join(secrets.choice(alphabet) for _ in range(4))


def check_lab_name(name: str) -> None:
    if not LAB_NAME.fullmatch(name):
        raise InputError(
            f"bad lab name {name!r}: 1-32 letters, digits, '_', '.', '-', starting with a "
            "letter or digit"
        )


@dataclass(frozen=True)
class NodePlan:
    name: str
    index: int
    netns: str
    underlay_if: str
    underlay_ip: str  # no prefix
    mgmt_if: str  # inside the node's namespace
    mgmt_ip: str
    overlay_ip: str
    overlay_prefix: int  # of the interface address: covers the whole mesh


@dataclass(frozen=True)
class WgIfPlan:
    """One WireGuard interface: in ``node``'s namespace, towards ``peers``."""

    node: int
    ifname: str
    port: int
    peers: tuple[int, ...]
    peer_ports: tuple[int, ...]  # the port each peer's matching interface listens on


@dataclass(frozen=True)
class LabPlan:
    lab_id: str
    name: str
    layout: Layout
    nodes: tuple[NodePlan, ...]
    mgmt_netns: str
    mgmt_bridge: str
    broker_ip: str
    overlay_net: str
    wg_ifs: tuple[WgIfPlan, ...]

    @property
    def netns(self) -> list[str]:
        return [n.netns for n in self.nodes] + [self.mgmt_netns]

    def node(self, name: str) -> NodePlan:
        for n in self.nodes:
            if n.name == name:
                return n
        known = ", ".join(n.name for n in self.nodes[:20])
        raise InputError(f"lab {self.name}: unknown node {name!r} (nodes: {known})")


def _host(net: ipaddress.IPv4Network, k: int) -> str:
    return str(net.network_address + k)


def _overlay(topo: Topology) -> tuple[list[str], ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """Every node's overlay address and the smallest network covering them all."""
    given = [n.address for n in topo.nodes]
    if all(a is None for a in given):
        return [_host(OVERLAY_DEFAULT_NET, i + 1) for i in range(topo.n)], OVERLAY_DEFAULT_NET
    ips = [ipaddress.ip_address(a) for a in given if a is not None]
    versions = {ip.version for ip in ips}
    if len(versions) > 1:
        raise InputError(f"{topo.source}: overlay addresses mix IPv4 and IPv6; use one family")
    taken = set(ips)
    addrs: list[str] = []
    base = ips[0]
    for a in given:
        if a is not None:
            addrs.append(a)
            continue
        cand = base + 1  # next free address after the first given one
        while cand in taken:
            cand += 1
        taken.add(cand)
        addrs.append(str(cand))
    lo, hi = min(taken), max(taken)
    width = lo.max_prefixlen
    prefix = width - (int(lo) ^ int(hi)).bit_length()
    if lo.version == 4:
        prefix = min(prefix, 30)  # leave room: a /32 or /31 has no network to route
        net: ipaddress.IPv4Network | ipaddress.IPv6Network = ipaddress.IPv4Network(
            (int(lo), prefix), strict=False
        )
        # A node must not be the network's broadcast (or network) address: 10.98.0.1-3
        # span 10.98.0.0/30, whose .3 the kernel takes for broadcast (ping refuses it).
        while prefix > 0 and (net.broadcast_address in taken or net.network_address in taken):
            prefix -= 1
            net = ipaddress.IPv4Network((int(lo), prefix), strict=False)
    else:
        prefix = min(prefix, 120)
        net = ipaddress.IPv6Network((int(lo), prefix), strict=False)
    for other, what in ((UNDERLAY_NET, "underlay"), (MGMT_NET, "management network")):
        if net.version == 4 and net.overlaps(other):
            raise InputError(
                f"{topo.source}: overlay addresses span {net}, which overlaps the lab's "
                f"{what} {other}; pick overlay addresses outside it"
            )
    return addrs, net


def make_plan(
    topo: Topology,
    lab_id: str,
    name: str,
    *,
    layout: Layout = "single",
) -> LabPlan:
    """Names and addresses for ``topo``; InputError if the lab cannot be built."""
    check_lab_name(name)
    if not LAB_ID.fullmatch(lab_id):
        raise ValueError(f"bad lab id {lab_id!r}")
    if layout not in LAYOUTS:
        raise InputError(f"bad layout {layout!r}: use single or per-peer")
    n = topo.n
    if n < 2:
        raise InputError(f"{topo.source}: a lab needs at least 2 nodes, this has {n}")
    if n > MAX_NODES:
        raise InputError(
            f"{topo.source}: {n} nodes is too many for a namespace lab (at most {MAX_NODES}); "
            "use `meshopt sim` for large meshes"
        )
    if layout == "per-peer" and n > MAX_PER_PEER_NODES:
        raise InputError(
            f"{topo.source}: the per-peer layout runs n(n-1) = {n * (n - 1)} wireguard-go "
            f"processes; at most {MAX_PER_PEER_NODES} nodes (use --layout single)"
        )
    overlay, overlay_net = _overlay(topo)
    nodes = tuple(
        NodePlan(
            name=node.name,
            index=i,
            netns=f"ml{lab_id}-{node.name}",
            underlay_if=f"ml{lab_id}u{i}",
            underlay_ip=_host(UNDERLAY_NET, i + 1),
            mgmt_if="mgmt0",
            mgmt_ip=_host(MGMT_NET, i + 2),
            overlay_ip=overlay[i],
            overlay_prefix=overlay_net.prefixlen,
        )
        for i, node in enumerate(topo.nodes)
    )
    peers = [[j for j in range(n) if j != i and topo.tunnels[i][j]] for i in range(n)]
    if layout == "single":
        wg = tuple(
            WgIfPlan(i, "wg0", WG_PORT, tuple(peers[i]), (WG_PORT,) * len(peers[i]))
            for i in range(n)
        )
    else:
        wg = tuple(
            WgIfPlan(
                i,
                peer_ifname(topo.nodes[j].name, j),
                WG_PEER_PORT_BASE + j,
                (j,),
                (WG_PEER_PORT_BASE + i,),
            )
            for i in range(n)
            for j in peers[i]
        )
    return LabPlan(
        lab_id=lab_id,
        name=name,
        layout=layout,
        nodes=nodes,
        mgmt_netns=f"ml{lab_id}--mgmt",
        mgmt_bridge="br0",
        broker_ip=_host(MGMT_NET, 1),
        overlay_net=str(overlay_net),
        wg_ifs=wg,
    )


def peer_ifname(peer: str, index: int) -> str:
    """``wg-<peer>`` where it fits Linux's 15 bytes, else ``wgp<index>``."""
    name = f"wg-{peer}"
    return name if len(name.encode()) <= 15 else f"wgp{index}"


def memory_estimate_mb(plan: LabPlan) -> float:
    """What the lab's processes will hold in memory, for the 'too large' check."""
    return EMULATOR_MB + BROKER_MB + WG_GO_MB * len(plan.wg_ifs) + 0.2 * len(plan.nodes)
