"""compute_routes against the networkx reference, known answers, and reduce_paths."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshopt.routing.allpairs import (
    TIE_EPS_MS,
    compute_routes,
    prepare_weights,
    reference_costs,
    reference_routes,
    tie_noise,
)
from meshopt.routing.tables import NO_ROUTE, _reduce_masked, reduce_paths, walk_costs
from tests.unit.test_routing_common import (
    INF,
    Mesh,
    follow,
    meshes,
    path_cost,
    random_costs,
    to_graph,
)


def triangle(ab: float) -> np.ndarray:
    """a=0, b=1, c=2; a-c and c-b cost 20 each way, a-b costs ``ab``."""
    c = np.array([[0.0, ab, 20.0], [ab, 0.0, 20.0], [20.0, 20.0, 0.0]])
    return c


def test_relaying_wins_when_it_saves_more_than_the_relay_cost() -> None:
    t = compute_routes(triangle(80.0), ["a", "b", "c"], relay_hop_ms=2.0)
    assert t.path_names("a", "b") == ["a", "c", "b"]
    assert t.cost[0, 1] == pytest.approx(42.0, abs=1e-9)
    assert t.relayed()[0, 1]


def test_relay_cost_keeps_the_direct_tunnel() -> None:
    t = compute_routes(triangle(41.0), ["a", "b", "c"], relay_hop_ms=2.0)
    assert t.path_names("a", "b") == ["a", "b"]
    assert t.cost[0, 1] == pytest.approx(41.0, abs=1e-9)
    # Without the relay cost the same triangle relays (40 < 41).
    assert compute_routes(triangle(41.0), relay_hop_ms=0.0).path(0, 1) == [0, 2, 1]


def test_unreachable_pairs() -> None:
    c = np.array([[0.0, 5.0, INF], [INF, 0.0, INF], [INF, INF, 0.0]])
    t = compute_routes(c)
    assert t.next_hop[0, 1] == 1 and t.cost[0, 1] == 5.0
    assert t.next_hop[1, 0] == NO_ROUTE and t.cost[1, 0] == INF
    assert t.next_hop[0, 2] == NO_ROUTE and t.cost[2, 0] == INF
    assert list(np.diag(t.next_hop)) == [0, 1, 2]
    assert list(np.diag(t.cost)) == [0.0, 0.0, 0.0]


def test_exact_ties_are_broken_the_same_way_every_time() -> None:
    # A 4-cycle with equal costs: two equal paths 0→2 (via 1 or via 3).
    c = np.full((4, 4), INF)
    np.fill_diagonal(c, 0.0)
    for a, b in [(0, 1), (1, 2), (2, 3), (3, 0)]:
        c[a, b] = c[b, a] = 10.0
    first = compute_routes(c)
    assert first.next_hop[0, 2] in (1, 3)
    assert first.cost[0, 2] == pytest.approx(22.0, abs=1e-9)
    for _ in range(3):
        assert np.array_equal(compute_routes(c).next_hop, first.next_hop)


def test_bad_input_is_rejected() -> None:
    with pytest.raises(ValueError):
        compute_routes(np.array([[0.0, np.nan], [1.0, 0.0]]))
    with pytest.raises(ValueError):
        compute_routes(np.array([[0.0, -1.0], [1.0, 0.0]]))
    with pytest.raises(ValueError):
        compute_routes(np.zeros((2, 3)))
    with pytest.raises(ValueError):
        compute_routes(np.zeros((2, 2)), relay_hop_ms=-1.0)
    with pytest.raises(ValueError):
        compute_routes(np.zeros((2, 2)), ["only-one"])


def test_tie_noise_is_small_positive_and_fixed() -> None:
    r = tie_noise(30, False)
    off = ~np.eye(30, dtype=bool)
    assert (r[off] > 0).all() and (r[off] <= TIE_EPS_MS).all()
    assert np.array_equal(r, tie_noise(30, False))
    s = tie_noise(30, True)
    assert np.array_equal(s, s.T)
    assert not np.array_equal(r, r.T)


def check_against_reference(m: Mesh, symmetric: bool = False) -> None:
    n = m.n
    t = compute_routes(m.cost, relay_hop_ms=m.relay_hop_ms, symmetric=symmetric)
    eff = (m.cost + m.cost.T) / 2.0 if symmetric else m.cost
    ref = reference_costs(to_graph(eff), relay_hop_ms=m.relay_hop_ms)
    want = np.full((n, n), INF)
    for a, row in ref.items():
        for b, v in row.items():
            want[int(a), int(b)] = v
    # Same reachability, same costs (the tie perturbation is ≤ 1e-4 ms per edge).
    assert np.array_equal(np.isinf(t.cost), np.isinf(want))
    fin = np.isfinite(want)
    assert np.allclose(t.cost[fin], want[fin], rtol=0.0, atol=1e-3)
    # Every path is loop-free, over real links, and costs what the table says.
    reach = fin & ~np.eye(n, dtype=bool)
    assert np.array_equal(t.next_hop != NO_ROUTE, fin)
    for s, d in zip(*np.nonzero(reach), strict=True):
        path = follow(t.next_hop, int(s), int(d))
        assert path is not None, (s, d)
        assert all(np.isfinite(eff[a, b]) for a, b in itertools.pairwise(path))
        assert path_cost(eff, path, m.relay_hop_ms) == pytest.approx(t.cost[s, d], abs=1e-9)
    # The vectorised walk agrees.
    walked = walk_costs(t.next_hop, eff + m.relay_hop_ms) - m.relay_hop_ms
    np.fill_diagonal(walked, 0.0)
    assert np.allclose(walked[fin], t.cost[fin], rtol=0.0, atol=1e-9)
    # ``dist`` is the perturbed length the next hops minimise: Bellman's equation holds.
    _, w = prepare_weights(m.cost, m.relay_hop_ms, symmetric)
    assert t.dist is not None
    s_, d_ = np.nonzero(reach)
    p = t.next_hop[s_, d_]
    assert np.allclose(t.dist[s_, d_], w[s_, p] + t.dist[p, d_], rtol=1e-12, atol=1e-9)
    best = np.min(w[s_, :] + t.dist[:, d_].T, axis=1)
    assert np.allclose(t.dist[s_, d_], best, rtol=1e-12, atol=1e-9)


@settings(max_examples=300, deadline=None)
@given(meshes())
def test_costs_match_networkx(m: Mesh) -> None:
    check_against_reference(m)


@settings(max_examples=150, deadline=None)
@given(meshes())
def test_costs_match_networkx_symmetric(m: Mesh) -> None:
    check_against_reference(m, symmetric=True)


@settings(max_examples=40, deadline=None)
@given(meshes(max_n=12))
def test_reference_routes_agree(m: Mesh) -> None:
    t = compute_routes(m.cost, relay_hop_ms=m.relay_hop_ms)
    r = reference_routes(to_graph(m.cost), relay_hop_ms=m.relay_hop_ms)
    assert np.array_equal(np.isinf(t.cost), np.isinf(r.cost))
    fin = np.isfinite(r.cost)
    assert np.allclose(t.cost[fin], r.cost[fin], atol=1e-3)
    if m.kind != "int":  # without exact ties the shortest paths are the same
        assert np.array_equal(t.next_hop, r.next_hop)


def test_reduce_paths_sums_minima_and_failures() -> None:
    # 0→1→2→3 chain; 4 points at itself in a loop with 5; 6 has a broken route.
    nh = np.full((7, 7), NO_ROUTE, dtype=np.int64)
    np.fill_diagonal(nh, np.arange(7))
    nh[0, 3], nh[1, 3], nh[2, 3] = 1, 2, 3
    nh[0, 2], nh[1, 2] = 1, 2
    nh[4, 3], nh[5, 3] = 5, 4
    nh[6, 3] = 0
    nh[6, 2] = 5  # 5 has no route to 2
    edge = np.arange(49, dtype=np.float64).reshape(7, 7)
    s = reduce_paths(nh, edge, "sum")
    assert s[0, 3] == edge[0, 1] + edge[1, 2] + edge[2, 3]
    assert s[6, 3] == edge[6, 0] + s[0, 3]
    assert s[4, 3] == INF and s[5, 3] == INF  # loop
    assert s[6, 2] == INF  # broken on the way
    assert s[1, 0] == INF  # unreachable
    assert (np.diag(s) == 0).all()
    mn = reduce_paths(nh, edge, "min")
    assert mn[0, 3] == min(edge[0, 1], edge[1, 2], edge[2, 3])
    assert mn[4, 3] == 0.0 and mn[1, 0] == 0.0
    assert (np.diag(mn) == INF).all()
    assert np.array_equal(np.isinf(s), np.isinf(walk_costs(nh, edge)))


def test_reduce_paths_on_a_long_chain() -> None:
    # Paths of n-1 hops need every doubling round.
    n = 70
    nh = np.full((n, n), NO_ROUTE, dtype=np.int64)
    for s in range(n):
        nh[s, s:] = np.minimum(np.arange(s, n), s + 1)
        nh[s, s] = s
    edge = np.ones((n, n))
    hops = reduce_paths(nh, edge)
    assert hops[0, n - 1] == n - 1
    assert np.array_equal(hops, walk_costs(nh, edge))


@st.composite
def ragged_tables(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """Next-hop tables of any shape: loops, broken hops, NO_ROUTE diagonals, and edges."""
    n = draw(st.integers(1, 30))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    nh = rng.integers(-1, n, (n, n)).astype(np.int64)
    if draw(st.booleans()):  # mostly well-formed: real routes with a few faults
        nh = compute_routes(random_costs(n, rng, "float", 0.6)).next_hop.copy()
        faults = rng.random((n, n)) < 0.05
        nh[faults] = rng.integers(-1, n, int(faults.sum()))
    edge = rng.uniform(0.0, 100.0, (n, n))
    edge[rng.random((n, n)) < 0.1] = INF
    return nh, edge


@settings(max_examples=300, deadline=None)
@given(ragged_tables())
def test_fast_sum_is_the_masked_reduction_bit_for_bit(t: tuple[np.ndarray, np.ndarray]) -> None:
    nh, edge = t
    fast = reduce_paths(nh, edge, "sum")
    assert np.array_equal(fast, _reduce_masked(nh, edge, "sum"))
    # With a proper diagonal the hop-by-hop walk fails exactly the same pairs.
    np.fill_diagonal(nh, np.arange(nh.shape[0]))
    fast = reduce_paths(nh, edge, "sum")
    assert np.array_equal(fast, _reduce_masked(nh, edge, "sum"))
    assert np.array_equal(np.isinf(fast), np.isinf(walk_costs(nh, edge)))


def test_nan_and_minus_inf_edges_take_the_masked_path() -> None:
    # 0 cannot reach 1; 1→0 is direct. A NaN or -inf on a used link stays visible,
    # an unreachable pair is inf whatever the edges hold.
    nh = np.array([[0, NO_ROUTE], [0, 1]])
    for bad in (np.nan, -np.inf):
        edge = np.array([[0.0, 5.0], [bad, 0.0]])
        s = reduce_paths(nh, edge, "sum")
        assert s[0, 1] == INF and s[0, 0] == 0.0
        assert np.isnan(s[1, 0]) if np.isnan(bad) else s[1, 0] == -INF
