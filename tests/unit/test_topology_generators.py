"""Generators: deterministic per seed, the right sizes, and the shapes they promise."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from meshopt.errors import TopologyError
from meshopt.topology import generators
from meshopt.topology.generators import geo_mesh, hub_and_spoke, ring, two_regions
from meshopt.topology.load import load_topology
from meshopt.topology.model import FloatMatrix, Topology


def best_two_hop(cost: FloatMatrix) -> FloatMatrix:
    """Cheapest path through exactly one relay, for every pair."""
    return np.asarray(np.min(cost[:, :, None] + cost[None, :, :], axis=1))


def tunnel_rtt(topo: Topology) -> FloatMatrix:
    cost = np.where(topo.tunnels, topo.rtt_ms(), np.inf)
    np.fill_diagonal(cost, 0.0)
    return cost


def relay_wins(topo: Topology) -> int:
    """Pairs whose best one-relay path is strictly faster than their direct tunnel."""
    cost = tunnel_rtt(topo)
    off = ~np.eye(topo.n, dtype=bool)
    return int(np.sum((best_two_hop(cost) < cost - 1e-9) & off))


def same(a: Topology, b: Topology) -> bool:
    return a.nodes == b.nodes and all(
        np.array_equal(getattr(a, m), getattr(b, m))
        for m in ("delay_ms", "jitter_ms", "loss", "rate_mbit", "tunnels")
    )


def test_geo_mesh_is_deterministic_per_seed() -> None:
    assert same(geo_mesh(50, seed=3), geo_mesh(50, seed=3))
    assert not same(geo_mesh(50, seed=3), geo_mesh(50, seed=4))


def test_geo_mesh_shape() -> None:
    topo = geo_mesh(300, seed=1)
    assert topo.n == 300 and len(set(topo.names)) == 300
    assert topo.tunnels.sum() == 300 * 299
    off = ~np.eye(300, dtype=bool)
    assert np.all(topo.delay_ms[off] > 0) and np.all(np.isfinite(topo.delay_ms))
    assert np.all(topo.jitter_ms[off] > 0)
    assert np.all(topo.jitter_ms[off] <= 0.06 * topo.delay_ms[off])
    lossy = np.mean(topo.loss[off] > 0)
    assert 0.05 < lossy < 0.15 and topo.loss.max() <= 0.02
    assert len({node.address for node in topo.nodes}) == 300
    rtt = topo.rtt_ms()[off]
    assert 5 < np.median(rtt) < 400 and rtt.max() < 2000


def test_geo_mesh_breaks_the_triangle_inequality() -> None:
    topo = geo_mesh(300, seed=2)
    wins = relay_wins(topo) / (300 * 299)
    assert 0.2 < wins < 0.9  # like measured Internet RTTs, relaying often helps


def test_geo_mesh_thousand_nodes() -> None:
    # Its speed is a benchmark's business (scripts/bench_sim_scale.py), not a timed test's.
    topo = geo_mesh(1000, seed=5)
    assert topo.delay_ms.shape == (1000, 1000)
    assert np.all(np.isfinite(topo.delay_ms)) and np.all(np.diag(topo.delay_ms) == 0)


def test_ring_never_needs_a_relay() -> None:
    for topo in (ring(8, 10.0), ring(9, 4.0, spread=0.5, seed=3)):
        assert relay_wins(topo) == 0
    topo = ring(8, 10.0)
    assert topo.link("r1", "r2").delay_ms == 10.0
    assert topo.link("r1", "r5").delay_ms == 40.0  # opposite side
    assert topo.link("r1", "r8").delay_ms == 10.0  # the short way round


def test_ring_with_neighbour_tunnels_only() -> None:
    topo = ring(6, tunnels="ring")
    assert sorted(topo.tunnel_pairs()) == [
        ("r1", "r2"), ("r1", "r6"), ("r2", "r3"), ("r3", "r4"), ("r4", "r5"), ("r5", "r6"),
    ]  # fmt: skip


def test_hub_and_spoke() -> None:
    topo = hub_and_spoke(6, 20.0)
    assert topo.names == ["hub", "s1", "s2", "s3", "s4", "s5"]
    assert sorted(topo.tunnel_pairs()) == [("hub", f"s{k}") for k in range(1, 6)]
    assert topo.link("hub", "s3").delay_ms == 20.0
    assert topo.link("s1", "s2").delay_ms == 40.0
    assert hub_and_spoke(4, 20.0, spoke_delay_ms=5.0).link("s1", "s3").delay_ms == 5.0


def test_two_regions_relay_via_gateways() -> None:
    topo = two_regions(10, intra_ms=5.0, inter_ms=80.0)
    assert topo.names == [f"a{k}" for k in range(1, 6)] + [f"b{k}" for k in range(1, 6)]
    assert topo.link("a1", "b1").delay_ms == 20.0  # gateways
    assert topo.link("a1", "b3").delay_ms == 25.0
    assert topo.link("a2", "b3").delay_ms == 80.0
    assert topo.link("a2", "a3").delay_ms == 5.0
    cost = tunnel_rtt(topo)
    i, j = topo.index("a2"), topo.index("b3")
    assert best_two_hop(best_two_hop(cost))[i, j] == pytest.approx(2 * (5 + 20 + 5))
    assert relay_wins(topo) > 0


def test_spread_is_seeded() -> None:
    a = two_regions(8, spread=0.2, seed=1)
    assert same(a, two_regions(8, spread=0.2, seed=1))
    assert not same(a, two_regions(8, spread=0.2, seed=2))
    assert np.allclose(a.delay_ms, a.delay_ms.T)


@pytest.mark.parametrize(
    ("spec", "n", "first"),
    [
        ("gen:geo:n=200,seed=3", 200, None),
        ("gen:ring:n=8,delay=10ms", 8, "r1"),
        ("gen:hub:n=6", 6, "hub"),
        ("gen:two-regions:n=10", 10, "a1"),
        ("gen:two_regions:n=6,intra=2ms,inter=0.1s,gateways=2,gateway=30ms", 6, "a1"),
        ("gen:ring: n=5 , tunnels=ring, spread=10%, seed=2", 5, "r1"),
    ],
)
def test_specs(spec: str, n: int, first: str | None) -> None:
    topo = load_topology(spec)
    assert topo.n == n and topo.source == spec
    if first is not None:
        assert topo.names[0] == first


def test_spec_values_reach_the_generator() -> None:
    topo = load_topology("gen:two-regions:n=6,intra=2ms,inter=0.1s,gateway=30ms")
    assert topo.link("a2", "b2").delay_ms == 100.0
    assert topo.link("a1", "b1").delay_ms == 30.0
    assert topo.link("a1", "a2").delay_ms == 2.0


def test_seed_argument_and_spec_seed() -> None:
    assert same(load_topology("gen:geo:n=30", seed=9), geo_mesh(30, seed=9))
    assert same(load_topology("gen:geo:n=30,seed=2", seed=9), geo_mesh(30, seed=2))
    assert same(load_topology("gen:geo:n=30"), geo_mesh(30, seed=0))


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("gen:", "unknown generator"),
        ("gen:star:n=5", "unknown generator 'star'"),
        ("gen:geo", "needs n="),
        ("gen:geo:n=abc", "bad integer"),
        ("gen:geo:n=1", "n must be"),
        ("gen:geo:n=100000", "n must be"),
        ("gen:geo:n=10,seed=-1", "seed"),
        ("gen:geo:n=10,bad=2", "fraction"),
        ("gen:geo:n=10,colour=red", "unknown parameter 'colour'"),
        ("gen:geo:n=10,x", "bad parameter 'x': write key=value"),
        ("gen:geo:n=10,n=11", "given twice"),
        ("gen:ring:n=5,delay=fast", "bad delay"),
        ("gen:ring:n=5,tunnels=star", "tunnels must be"),
        ("gen:ring:n=5,spread=100%", "spread"),
        ("gen:hub:n=1", "n must be"),
        ("gen:two-regions:n=3", "n must be"),
        ("gen:two-regions:n=6,gateways=4", "gateways must be"),
        ("gen:geo:n=10,spread_km=nan", "bad number"),
    ],
)
def test_bad_specs(spec: str, fragment: str) -> None:
    with pytest.raises(TopologyError, match=fragment) as info:
        load_topology(spec)
    assert str(info.value).startswith(spec + ": ")


def test_every_generator_is_documented() -> None:
    text = (Path(__file__).parents[2] / "topologies" / "README.md").read_text(encoding="utf-8")
    for kind, (_, params) in generators.GENERATORS.items():
        assert f"`{kind}`" in text
        for key in params:
            assert f"`{key}`" in text, (kind, key)
