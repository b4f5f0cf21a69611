"""Peers followed from WireGuard readings: added, removed, rates, layouts, probe addresses."""

from __future__ import annotations

import ipaddress

from meshopt.agent.peers import PeerTracker, interface_layout
from meshopt.agent.probeaddr import probe_address
from meshopt.wireguard.keys import generate_keypair
from meshopt.wireguard.model import InterfaceState, PeerState


def _key() -> str:
    return generate_keypair()[1]


def test_peers_added_removed_and_rates() -> None:
    a, b, me = _key(), _key(), _key()
    t = PeerTracker()
    s1 = InterfaceState(
        public_key=me,
        peers=(
            PeerState(public_key=a, allowed_ips=("10.0.0.2/32",), rx_bytes=1000, tx_bytes=0),
            PeerState(public_key=b, allowed_ips=("10.0.0.3/32",), last_handshake_ns=95 * 10**9),
        ),
    )
    added, removed = t.update({"wg0": s1}, now=10.0, wall=100.0)
    assert added == {a, b} and not removed
    assert t.peers[b].handshake_age_s == 5.0
    assert t.peers[a].layout == "single" and t.own_keys == {"wg0": me}
    s2 = InterfaceState(
        public_key=me,
        peers=(PeerState(public_key=a, rx_bytes=126_000, tx_bytes=12_500),),
    )
    added, removed = t.update({"wg0": s2}, now=12.0, wall=102.0)
    assert removed == {b} and not added
    assert t.peers[a].rx_bps == 125_000 * 8 / 2 and t.peers[a].tx_bps == 12_500 * 8 / 2


def test_per_peer_layout_detected() -> None:
    k = _key()
    one = InterfaceState(peers=(PeerState(public_key=k, allowed_ips=("0.0.0.0/0", "::/0")),))
    assert interface_layout(one) == "per-peer"
    assert interface_layout(one, "single") == "single"
    two = InterfaceState(peers=(PeerState(public_key=k), PeerState(public_key=_key())))
    assert interface_layout(two) == "single"


def test_probe_address_is_link_local_stable_and_distinct() -> None:
    a, b = _key(), _key()
    pa = ipaddress.IPv6Address(probe_address(a))
    assert pa.is_link_local
    assert probe_address(a) == str(pa)
    assert probe_address(a) != probe_address(b)
