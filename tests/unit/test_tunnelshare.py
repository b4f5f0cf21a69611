"""What a lab's tunnels add to the agents' readings (meshopt.bench.tunnelshare)."""

from __future__ import annotations

import math

import pytest

from meshopt.bench.tunnelshare import tunnel_share
from meshopt.topology.model import LinkProps, Node, Topology


def topo() -> Topology:
    # a-b 10 ms one way with 1 ms σ each way (round trip 20 ms, σ √2 ms), a-c and b-c 30 ms.
    links = {("a", "b"): LinkProps(10.0, 1.0), ("b", "a"): LinkProps(10.0, 1.0)}
    return Topology.from_links("t", [Node(x) for x in "abc"], LinkProps(30.0, 0.0), links)


def test_the_excess_over_the_topology_is_the_median_over_links() -> None:
    readings = []
    for node, peer, nominal, extra in [
        ("a", "b", 20.0, 0.4), ("b", "a", 20.0, 0.5), ("a", "c", 60.0, 0.6),
        ("c", "a", 60.0, 0.5), ("b", "c", 60.0, 9.0),  # a stepped link: outvoted
    ]:  # fmt: skip
        for k in range(5):
            readings.append((node, peer, nominal + extra + (k - 2) * 0.01, 0.0))
    share = tunnel_share(readings, topo())
    assert share is not None and share.links == 5
    assert share.ms == pytest.approx(0.5)
    # Per tunnel both directions' mean; how far tunnels differ, robust to the stepped one.
    assert share.per_tunnel == pytest.approx({(0, 1): 0.45, (0, 2): 0.55, (1, 2): 9.0})
    assert share.spread_ms == pytest.approx(1.4826 * 0.1)


def test_spread_is_taken_in_quadrature_and_never_below_zero() -> None:
    # a-b's round trip has σ √2 ms: reported 2 ms means √(4 - 2) more; c's links 0.5.
    share = tunnel_share(
        [("a", "b", 20.0, 2.0), ("a", "c", 60.0, 0.5), ("c", "a", 60.0, 0.5)], topo()
    )
    assert share is not None and share.sigma_ms == pytest.approx(0.5)
    quiet = tunnel_share([("a", "b", 19.0, 0.1)], topo())  # less than the topology's
    assert quiet is not None and quiet.ms == 0.0 and quiet.sigma_ms == 0.0


def test_unknown_nodes_self_links_and_non_numbers_are_left_out() -> None:
    assert tunnel_share([], topo()) is None
    bad = [("a", "zz", 1.0, 0.0), ("a", "a", 1.0, 0.0), ("a", "b", math.nan, 0.0),
           ("b", "a", 20.0, math.inf)]  # fmt: skip
    assert tunnel_share(bad, topo()) is None
