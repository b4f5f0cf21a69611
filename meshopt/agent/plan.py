"""From a route set to what the node should have: kernel routes and AllowedIPs.

Pure: the route set, the peers, their liveness and the baseline AllowedIPs come in;
the routes to install, the AllowedIPs per peer and the reasons for every refused route
come out. The daemon applies the result (pyroute2, UAPI/netlink) and calls this again
whenever any input changes, so local fail-over is just another evaluation: a route whose
next hop the prober declares dead moves to its backup next hop, or, without a live
backup, is withdrawn so traffic falls back to the plain WireGuard route in ``main``.

Single-interface layout: WireGuard chooses the peer by destination, so a relayed route
only takes effect when the destination's prefix moves into the relay's AllowedIPs. The
same AllowedIPs are also WireGuard's inbound filter, which is why the controller routes
this layout symmetrically (the relay's return traffic must be accepted). Per-peer
layout: the route's interface chooses the tunnel; AllowedIPs stay 0.0.0.0/0.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from meshopt.agent.peers import PeerInfo
from meshopt.agent.probeaddr import probe_prefix
from meshopt.bus.messages import Route
from meshopt.install.model import DesiredRoute
from meshopt.wireguard.model import DeviceUpdate, PeerUpdate, normalize_allowed_ips

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
K = TypeVar("K")


@dataclass(frozen=True)
class Rejected:
    route: Route
    reason: str  # short stable key, also the counter name


@dataclass(frozen=True)
class FailOver:
    dst: str
    table: str
    primary: str  # public key
    now_via: str | None  # backup key, or None: withdrawn to the plain tunnel


@dataclass
class NodePlan:
    routes: list[DesiredRoute] = field(default_factory=list)
    allowed_ips: dict[str, dict[str, tuple[str, ...]]] = field(default_factory=dict)
    rejected: list[Rejected] = field(default_factory=list)
    failovers: list[FailOver] = field(default_factory=list)


def _net(text: str) -> Network | None:
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        return None


def _inside(net: Network, prefixes: Sequence[Network]) -> bool:
    return any(net.version == p.version and net.subnet_of(p) for p in prefixes)  # type: ignore[arg-type]


def _overlaps(net: Network, prefixes: Sequence[Network]) -> bool:
    return any(net.version == p.version and net.overlaps(p) for p in prefixes)


def _attrs(r: Route) -> dict[str, object]:
    return {
        "mtu": r.mtu,
        "advmss": r.advmss,
        "initcwnd": r.initcwnd,
        "initrwnd": r.initrwnd,
        "window": r.window,
        "congctl": r.congctl,
    }


def next_hop_in_use(via: K, backup: K | None, alive: Callable[[K], bool | None]) -> K | None:
    """Local fail-over, the rule for one route: its next hop ``via`` while the prober has
    not declared it dead; then its ``backup`` if there is one (another peer) not declared
    dead either; else None: the route is withdrawn and traffic takes the plain WireGuard
    route to the destination. (The simulator calls this for every entry whose next hop
    died, with node indices for keys.)"""
    if alive(via) is not False:
        return via
    if backup is not None and backup != via and alive(backup) is not False:
        return backup
    return None


def plan_node(
    routes: Sequence[Route],
    peers: Mapping[str, PeerInfo],
    alive: Callable[[str], bool | None],
    *,
    mesh_prefixes: Sequence[str],
    own_prefixes: Sequence[str],
    baseline: Mapping[str, Sequence[str]],
    fast_table: int,
    bulk_table: int,
    keep_current: bool = False,
) -> NodePlan:
    """What to install for ``routes``; ``baseline`` is each peer's AllowedIPs before us.

    ``keep_current``: no route set is known (an agent just restarted, or never got one):
    AllowedIPs stay as they are, plus the probe addresses (fail-static).
    """
    out = NodePlan()
    mesh = [n for n in (_net(p) for p in mesh_prefixes) if n is not None]
    own = [n for n in (_net(p) for p in own_prefixes) if n is not None]
    seen: set[tuple[str, str]] = set()
    fast_via: dict[str, str] = {}  # dst -> effective next hop of the fast table
    wanted: list[tuple[Route, Network, str]] = []
    for r in routes:
        net = _net(r.dst)
        reason = None
        if net is None:
            reason = "bad_prefix"
        elif not _inside(net, mesh):
            reason = "outside_mesh"
        elif _overlaps(net, own):
            reason = "own_prefix"
        elif r.via not in peers:
            reason = "unknown_peer"
        elif (r.table, str(net)) in seen:
            reason = "duplicate"
        if reason is not None:
            out.rejected.append(Rejected(r, reason))
            continue
        assert net is not None
        seen.add((r.table, str(net)))
        via = next_hop_in_use(r.via, r.backup if r.backup in peers else None, alive)
        if via != r.via:
            out.failovers.append(FailOver(str(net), r.table, r.via, via))
        if via is None:
            continue
        if r.table == "fast":
            fast_via[str(net)] = via
        wanted.append((r, net, via))

    for r, net, via in wanted:
        peer = peers[via]
        if r.table == "bulk" and peer.layout == "single" and fast_via.get(str(net)) != via:
            # One AllowedIPs set per destination: a single interface cannot send bulk
            # traffic for a destination through another peer than interactive traffic.
            out.rejected.append(Rejected(r, "bulk_needs_per_peer_layout"))
            continue
        out.routes.append(
            DesiredRoute(
                dst=str(net),
                oif=peer.ifname,
                table=fast_table if r.table == "fast" else bulk_table,
                **_attrs(r),  # type: ignore[arg-type]
            )
        )
    out.allowed_ips = _allowed_ips(
        peers, fast_via, {k: p.allowed_ips for k, p in peers.items()} if keep_current else baseline
    )
    return out


def _allowed_ips(
    peers: Mapping[str, PeerInfo],
    fast_via: Mapping[str, str],
    baseline: Mapping[str, Sequence[str]],
) -> dict[str, dict[str, tuple[str, ...]]]:
    """ifname -> peer -> AllowedIPs: baseline minus moved prefixes, plus routed ones."""
    out: dict[str, dict[str, tuple[str, ...]]] = {}
    moved: dict[str, set[str]] = {}
    for dst, via in fast_via.items():
        moved.setdefault(peers[via].ifname, set()).add(dst)
    for key, p in peers.items():
        if p.layout == "single":
            base = [a for a in baseline.get(key, p.allowed_ips) if a not in moved.get(p.ifname, ())]
            mine = [dst for dst, via in fast_via.items() if via == key]
            want = [*base, *mine, probe_prefix(key)]
        else:
            base = list(baseline.get(key, p.allowed_ips))
            want = base if "::/0" in base else [*base, probe_prefix(key)]
        out.setdefault(p.ifname, {})[key] = normalize_allowed_ips(want)
    return out


def allowed_ips_updates(
    current: Mapping[str, PeerInfo], want: Mapping[str, Mapping[str, Sequence[str]]]
) -> dict[str, DeviceUpdate]:
    """The smallest UAPI/netlink updates, per interface, that give every peer ``want``.

    Prefixes move between peers without a gap: first every peer gains its new prefixes
    (adding a prefix to one peer takes it from the other atomically), then peers whose
    lists still differ get their exact list.
    """
    out: dict[str, DeviceUpdate] = {}
    for ifname, peers in want.items():
        gains: list[PeerUpdate] = []
        exact: list[PeerUpdate] = []
        for key, prefixes in sorted(peers.items()):
            p = current.get(key)
            if p is None:
                continue
            now = set(p.allowed_ips)
            new = set(prefixes)
            if new - now:
                gains.append(
                    PeerUpdate(
                        public_key=key, update_only=True, allowed_ips=tuple(sorted(new - now))
                    )
                )
            if now - new:
                exact.append(
                    PeerUpdate(
                        public_key=key,
                        update_only=True,
                        replace_allowed_ips=True,
                        allowed_ips=tuple(sorted(new)),
                    )
                )
        if gains or exact:
            out[ifname] = DeviceUpdate(peers=(*gains, *exact))
    return out


def prefix_owner(baseline: Mapping[str, Sequence[str]]) -> Callable[[str], str | None]:
    """Whose a destination prefix is: the peer whose AllowedIPs from before us (its
    ``baseline``) hold it most specifically. Default routes (/0) and link-local prefixes
    (probe addresses) name nobody; nor does a prefix two peers hold alike, or one
    outside every baseline (None). The probe budget tells a direct route (to the next
    hop's own prefix) from a relayed one with it."""
    held: dict[tuple[int, int, int], str | None] = {}
    for key, prefixes in baseline.items():
        for text in prefixes:
            net = _net(text)
            if net is None or net.prefixlen == 0 or net.is_link_local:
                continue
            at = (net.version, net.prefixlen, int(net.network_address))
            held[at] = key if held.get(at, key) == key else None
    lengths = sorted({(v, n) for v, n, _ in held}, key=lambda x: -x[1])

    def owner(dst: str) -> str | None:
        net = _net(dst)
        if net is None:
            return None
        bits = net.max_prefixlen
        address = int(net.network_address)
        for version, length in lengths:
            if version != net.version or length > net.prefixlen:
                continue
            mask = ((1 << length) - 1) << (bits - length)
            at = (version, length, address & mask)
            if at in held:
                return held[at]
        return None

    return owner


def own_prefixes_from(addresses: Iterable[str]) -> list[str]:
    """Host prefixes of our overlay addresses (link-local probe addresses left out)."""
    out = []
    for a in addresses:
        iface = ipaddress.ip_interface(a)
        if iface.ip.is_link_local:
            continue
        out.append(f"{iface.ip}/{iface.ip.max_prefixlen}")
    return sorted(set(out))
