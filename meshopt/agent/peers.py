"""Peers as WireGuard reports them, followed over time: who they are, and current use.

The agent has no peer list of its own: every poll reads its interfaces and this module
turns consecutive readings into peers (added, removed, kept), handshake ages and
rx/tx rates from the counter deltas. Pure: readings and times come in as arguments.
"""

from __future__ import annotations

import ipaddress
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from meshopt.agent.probeaddr import probe_address
from meshopt.wireguard.model import InterfaceState

DEFAULT_ROUTES = frozenset({"0.0.0.0/0", "::/0"})

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class PeerInfo:
    """One peer of one of our interfaces, at the last poll."""

    public_key: str
    ifname: str
    own_key: str  # our interface's public key (what the peer knows us by)
    layout: str  # "single" or "per-peer": how this interface routes
    allowed_ips: tuple[str, ...]
    endpoint: str | None
    handshake_age_s: float | None
    rx_bytes: int
    tx_bytes: int
    rx_bps: float = 0.0
    tx_bps: float = 0.0

    @property
    def probe_address(self) -> str:
        return probe_address(self.public_key)


def interface_layout(state: InterfaceState, forced: str = "auto") -> str:
    """``per-peer`` for an interface whose only peer takes a default route, else ``single``."""
    if forced != "auto":
        return forced
    if len(state.peers) == 1 and DEFAULT_ROUTES & set(state.peers[0].allowed_ips):
        return "per-peer"
    return "single"


@dataclass
class PeerTracker:
    """Feeds on interface readings; keeps the peers and their counter rates."""

    layout: str = "auto"
    peers: dict[str, PeerInfo] = field(default_factory=dict)
    own_keys: dict[str, str] = field(default_factory=dict)  # ifname -> our public key
    _last: dict[str, tuple[float, int, int]] = field(default_factory=dict)

    def update(
        self, readings: Mapping[str, InterfaceState], now: float, wall: float
    ) -> tuple[set[str], set[str]]:
        """Take one poll (ifname -> state at monotonic ``now``); return (added, removed) keys.

        A key seen on two interfaces keeps the first (sorted by name): WireGuard itself
        would route by whichever AllowedIPs match, and the agent must not report one peer
        twice.
        """
        seen: dict[str, PeerInfo] = {}
        self.own_keys = {}
        for ifname in sorted(readings):
            state = readings[ifname]
            if state.public_key:
                self.own_keys[ifname] = state.public_key
            layout = interface_layout(state, self.layout)
            for p in state.peers:
                if p.public_key in seen:
                    continue
                rx_bps = tx_bps = 0.0
                last = self._last.get(p.public_key)
                if last is not None and now > last[0]:
                    dt = now - last[0]
                    # A counter that went down means the peer was re-created: no rate.
                    rx_bps = max(0, p.rx_bytes - last[1]) * 8 / dt
                    tx_bps = max(0, p.tx_bytes - last[2]) * 8 / dt
                self._last[p.public_key] = (now, p.rx_bytes, p.tx_bytes)
                seen[p.public_key] = PeerInfo(
                    public_key=p.public_key,
                    ifname=ifname,
                    own_key=state.public_key or "",
                    layout=layout,
                    allowed_ips=p.allowed_ips,
                    endpoint=p.endpoint,
                    handshake_age_s=p.handshake_age(wall),
                    rx_bytes=p.rx_bytes,
                    tx_bytes=p.tx_bytes,
                    rx_bps=rx_bps,
                    tx_bps=tx_bps,
                )
        added = set(seen) - set(self.peers)
        removed = set(self.peers) - set(seen)
        for key in removed:
            self._last.pop(key, None)
        self.peers = seen
        return added, removed


# How long, at most, the end with the larger public key holds its first probe of a
# tunnel that has had no handshake yet: until the other end's first probe reaches our
# responder (``Prober.release``: its tunnel then has a session and our probe starts no
# handshake), or this long if it does not come (no agent there, or it starts later).
# Both ends initiating WireGuard's first handshake at once lose it for REKEY_TIMEOUT
# (5 s): each answers the other's initiation, which replaces its own, and then drops the
# answer to its own. Measured in the lab (docs/twin.md): every agent of a mesh starting
# together lost one or two tunnels that way, and the controller's first routes with them.
# A fixed 0.5 s hold did not stop it (three tunnels of bench8 in one run): the agents
# start up to ~0.5 s apart and probe at phases spread over 0.33 s, so a fixed offset
# only moves the two initiations, while waiting to be heard orders them.
HANDSHAKE_DEFER_S = 2.0


def first_probe_delay(peer: PeerInfo) -> float:
    """Seconds to hold this peer's first probe unless it is heard from first: 0 unless the
    tunnel never handshook and our key is the larger (the other end initiates alone)."""
    if peer.handshake_age_s is not None or peer.own_key <= peer.public_key:
        return 0.0
    return HANDSHAKE_DEFER_S


def idle_phase(peer: PeerInfo) -> float:
    """Where in each idle interval we probe this peer, in [0, 1) of it on the wall clock:
    the tunnel's own phase (spread over the mesh), and its two ends half an interval
    apart. Both ends were demoted by the same route set and probed the idle link within
    a fast interval of each other, so a change waited for the next pair of probes, up to
    a whole interval (2 s); half an interval apart, one end sees it within 1 s, at the
    same probe rate."""
    low, high = sorted((peer.own_key, peer.public_key))
    base = zlib.crc32(f"{low} {high}".encode()) / 2**32
    return (base + (0.5 if peer.own_key == high else 0.0)) % 1.0


def peers_by_probe_address(peers: Iterable[PeerInfo]) -> dict[IPAddress, str]:
    """Each peer's probe address (without a scope) -> its key: who a probe came from."""
    return {ipaddress.ip_address(p.probe_address): p.public_key for p in peers}


def heard_from(by_address: Mapping[IPAddress, str], source: IPAddress) -> str | None:
    """The peer whose probe address ``source`` is (a link-local one's scope ignored)."""
    if isinstance(source, ipaddress.IPv6Address) and source.scope_id is not None:
        source = ipaddress.IPv6Address(str(source).partition("%")[0])
    return by_address.get(source)
