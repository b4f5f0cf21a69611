"""Incremental updates give exactly what a full recompute of the new matrix gives."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshopt.routing.allpairs import compute_routes
from meshopt.routing.incremental import IncrementalRoutes
from meshopt.routing.tables import FloatArray, RouteTables
from tests.unit.test_routing_common import INF, Mesh, meshes, random_costs


def assert_same(got: RouteTables, want: RouteTables) -> None:
    assert np.array_equal(got.next_hop, want.next_hop)
    assert np.array_equal(np.isinf(got.cost), np.isinf(want.cost))
    fin = np.isfinite(want.cost)
    assert np.allclose(got.cost[fin], want.cost[fin], rtol=0.0, atol=1e-9)
    assert got.dist is not None and want.dist is not None
    assert np.allclose(got.dist[fin], want.dist[fin], rtol=1e-12, atol=1e-9)
    assert got.symmetric == want.symmetric


def new_value(kind: str, old: float, x: float, ints: bool) -> float:
    """A change of the given kind; ``x`` in [0, 1) picks how much."""
    if kind == "down":
        return INF
    base = old if np.isfinite(old) else 10.0
    if kind == "up":
        v = base * (1.0 + 3.0 * x) + 1.0
    elif kind == "down-cost":
        v = base * x
    else:  # "set": anything, including a restore after "down"
        v = 50.0 * x
    return float(np.floor(v)) if ints else v


ops = st.lists(
    st.tuples(
        st.integers(0, 10**6),
        st.integers(0, 10**6),
        st.sampled_from(["up", "down-cost", "down", "set"]),
        st.floats(0.0, 0.999),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(meshes(max_n=14), st.booleans(), ops)
def test_every_step_matches_a_full_recompute(
    m: Mesh, symmetric: bool, steps: list[tuple[int, int, str, float]]
) -> None:
    n = m.n
    cost = m.cost.copy()
    inc = IncrementalRoutes(cost, relay_hop_ms=m.relay_hop_ms, symmetric=symmetric)
    assert_same(inc.tables, compute_routes(cost, relay_hop_ms=m.relay_hop_ms, symmetric=symmetric))
    for ra, rb, kind, x in steps:
        a = ra % n
        b = (a + 1 + rb % (n - 1)) % n
        v = new_value(kind, float(cost[a, b]), x, m.kind == "int")
        inc.update_link(a, b, v)
        cost[a, b] = v
        if symmetric:
            cost[b, a] = v
        want = compute_routes(cost, relay_hop_ms=m.relay_hop_ms, symmetric=symmetric)
        assert_same(inc.tables, want)
    assert np.array_equal(inc.link_cost, cost)


def geo_mesh(n: int, seed: int) -> FloatArray:
    return random_costs(n, np.random.default_rng(seed), "geo", 1.0)


@pytest.mark.parametrize("symmetric", [False, True])
def test_a_larger_mesh_with_essential_links(symmetric: bool) -> None:
    # Changes aimed at links that carry traffic (next_hop[a, b] == b), up and down.
    n = 90
    cost = geo_mesh(n, 5)
    inc = IncrementalRoutes(cost, symmetric=symmetric)
    rng = np.random.default_rng(1)
    for step in range(40):
        nh = inc.tables.next_hop
        a = int(rng.integers(n))
        used = np.flatnonzero((nh[a] == np.arange(n)) & (np.arange(n) != a))
        b = int(rng.choice(used))
        v = INF if step % 7 == 3 else float(cost[a, b] * rng.uniform(0.3, 3.0))
        inc.update_link(a, b, v)
        cost[a, b] = v
        if symmetric:
            cost[b, a] = v
        if step % 8 == 7:
            assert_same(inc.tables, compute_routes(cost, symmetric=symmetric))
    assert_same(inc.tables, compute_routes(cost, symmetric=symmetric))
    assert inc.stats["increase"] > 0 and inc.stats["decrease"] > 0


def test_fallback_to_a_full_run() -> None:
    cost = geo_mesh(30, 2)
    inc = IncrementalRoutes(cost, max_affected=0.0)
    assert inc.stats["full"] == 1
    nh = inc.tables.next_hop
    a, b = 0, int(nh[0, 1])  # a link that carries 0's traffic to 1
    inc.update_link(a, b, INF)
    cost[a, b] = INF
    assert inc.stats["full"] == 2
    assert_same(inc.tables, compute_routes(cost))


def test_unused_link_increase_is_free() -> None:
    # 0-1 costs 100 but 0→2→1 costs 22: raising 0→1 changes nothing.
    cost = np.array([[0.0, 100.0, 10.0], [100.0, 0.0, 10.0], [10.0, 10.0, 0.0]])
    inc = IncrementalRoutes(cost)
    before = inc.tables
    inc.update_link(0, 1, 500.0)
    assert inc.stats["noop"] == 1
    cost[0, 1] = 500.0
    assert_same(inc.tables, compute_routes(cost))
    assert np.array_equal(before.next_hop, inc.tables.next_hop)


def test_tables_are_snapshots() -> None:
    cost = geo_mesh(10, 4)
    inc = IncrementalRoutes(cost, [f"n{i}" for i in range(10)])
    t = inc.tables
    nh = t.next_hop.copy()
    inc.update_link(0, 1, 0.0)
    assert np.array_equal(t.next_hop, nh)
    assert inc.tables.next_hop[0, 1] == 1
    assert inc.tables.names[0] == "n0"
    live = inc.next_hop
    assert np.array_equal(live, inc.tables.next_hop)
    with pytest.raises(ValueError):
        live[0, 1] = 2


def test_bad_updates_are_rejected() -> None:
    inc = IncrementalRoutes(geo_mesh(4, 0))
    for a, b, v in [(0, 0, 1.0), (0, 4, 1.0), (-1, 2, 1.0), (0, 1, -1.0), (0, 1, float("nan"))]:
        with pytest.raises(ValueError):
            inc.update_link(a, b, v)
    with pytest.raises(ValueError):
        IncrementalRoutes(geo_mesh(4, 0), ["a"])
