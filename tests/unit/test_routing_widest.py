"""Widest paths: maximal bucketed bottleneck, hop-by-hop consistent, latency as tie-break."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshopt.routing.allpairs import compute_routes, prepare_weights
from meshopt.routing.tables import NO_ROUTE, FloatArray
from meshopt.routing.widest import (
    LEVEL_NONE,
    LEVEL_UNKNOWN,
    LEVEL_UNLIMITED,
    WidestTables,
    _level_next_hops,
    bandwidth_levels,
    widest_routes,
)
from tests.unit.test_routing_common import INF, follow, path_cost, random_costs


@dataclass(frozen=True)
class BwMesh:
    cost: FloatArray
    bw: FloatArray
    relay_hop_ms: float
    bucket: float


@st.composite
def bw_meshes(draw: st.DrawFn, min_n: int = 2, max_n: int = 7) -> BwMesh:
    n = draw(st.integers(min_n, max_n))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    cost = random_costs(n, rng, draw(st.sampled_from(["int", "float"])), 0.6)
    style = draw(st.sampled_from(["loguniform", "few", "access"]))
    if style == "loguniform":
        bw = np.exp(rng.uniform(0.0, 7.0, (n, n)))
    elif style == "few":  # many exact ties between levels
        bw = rng.choice([10.0, 100.0, 1000.0], (n, n))
    else:
        cap = 10 ** rng.uniform(1, 4, n)
        bw = np.minimum(cap[:, None], cap[None, :]) * rng.uniform(0.3, 1.0, (n, n))
    bw[rng.random((n, n)) < 0.05] = 0.0  # unusable for bulk traffic
    relay = draw(st.sampled_from([0.0, 2.0]))
    bucket = draw(st.sampled_from([1.25, 2.0, 10.0]))
    return BwMesh(cost, bw, relay, bucket)


def edge_levels(m: BwMesh) -> np.ndarray:
    lv = bandwidth_levels(m.bw, m.bucket)
    lv[~np.isfinite(m.cost)] = LEVEL_NONE
    np.fill_diagonal(lv, LEVEL_NONE)
    return lv


def best_levels(lv: np.ndarray) -> np.ndarray:
    """Brute force: the best bottleneck level over all simple paths."""
    n = lv.shape[0]
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    g.add_edges_from((a, b) for a, b in zip(*np.nonzero(lv != LEVEL_NONE), strict=True))
    best = np.full((n, n), LEVEL_NONE, dtype=np.int64)
    for s, d in itertools.permutations(range(n), 2):
        for p in nx.all_simple_paths(g, s, d):
            best[s, d] = max(best[s, d], min(lv[a, b] for a, b in itertools.pairwise(p)))
    return best


def check(m: BwMesh, t: WidestTables) -> None:
    n = m.cost.shape[0]
    lv = edge_levels(m)
    want = best_levels(lv)
    assert np.array_equal(t.level[~np.eye(n, dtype=bool)], want[~np.eye(n, dtype=bool)])
    for s, d in itertools.permutations(range(n), 2):
        if want[s, d] == LEVEL_NONE:
            assert t.next_hop[s, d] == NO_ROUTE and t.cost[s, d] == INF
            assert t.bandwidth[s, d] == 0.0
            continue
        path = follow(t.next_hop, s, d)
        assert path is not None, (s, d)  # loop-free, complete
        hops = list(itertools.pairwise(path))
        # The forwarded path's bottleneck is the best possible one.
        assert min(lv[a, b] for a, b in hops) == want[s, d]
        assert t.bandwidth[s, d] == min(m.bw[a, b] for a, b in hops)
        assert t.cost[s, d] == pytest.approx(path_cost(m.cost, path, m.relay_hop_ms), abs=1e-9)
        # The loop-freedom argument: the level never drops along the way...
        x = path[1]
        assert t.level[x, d] >= t.level[s, d] or x == d
        assert lv[s, x] >= t.level[s, d]


@settings(max_examples=250, deadline=None)
@given(bw_meshes())
def test_bottleneck_is_maximal_and_paths_are_consistent(m: BwMesh) -> None:
    t = widest_routes(m.bw, m.cost, relay_hop_ms=m.relay_hop_ms, bucket=m.bucket)
    check(m, t)


@settings(max_examples=120, deadline=None)
@given(bw_meshes(max_n=14))
def test_first_hop_is_the_shortest_path_within_the_best_level(m: BwMesh) -> None:
    # Tie-break: within G_L (links of level >= L, L = the pair's level) the first hop
    # is the lowest-latency path's, with the same tie perturbation as compute_routes.
    n = m.cost.shape[0]
    t = widest_routes(m.bw, m.cost, relay_hop_ms=m.relay_hop_ms, bucket=m.bucket)
    lv = edge_levels(m)
    for level in set(t.level[t.level != LEVEL_NONE].tolist()):
        sub = np.where(lv >= level, m.cost, INF)
        np.fill_diagonal(sub, 0.0)
        ref = compute_routes(sub, relay_hop_ms=m.relay_hop_ms)
        pairs = (t.level == level) & ~np.eye(n, dtype=bool)
        assert np.array_equal(t.next_hop[pairs], ref.next_hop[pairs])
        # The forwarded path lies in G_L, so it is never faster than G_L's best...
        assert (t.cost[pairs] >= ref.cost[pairs] - 1e-9).all()
        # ...and where every node on it sits at level L it is exactly G_L's best.
        for s, d in zip(*np.nonzero(pairs), strict=True):
            path = follow(t.next_hop, int(s), int(d))
            assert path is not None
            if all(t.level[x, d] == level for x in path[:-1]):
                assert t.cost[s, d] == pytest.approx(ref.cost[s, d], abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 30), st.integers(0, 2**32 - 1), st.floats(0.05, 1.0))
def test_every_plan_gives_the_same_next_hops(n: int, seed: int, density: float) -> None:
    rng = np.random.default_rng(seed)
    cost = random_costs(n, rng, "int", density)
    _, w = prepare_weights(cost, 2.0, False)
    edge = np.isfinite(w) & ~np.eye(n, dtype=bool)
    pending = rng.random((n, n)) < rng.uniform(0.05, 1.0)
    np.fill_diagonal(pending, False)
    plans = {p: _level_next_hops(w, edge, pending, p) for p in ("fw", "dst", "src", "mix")}
    for p, got in plans.items():
        assert np.array_equal(got[pending], plans["fw"][pending]), p


def two_paths(direct_bw: float, relay_bw: float) -> tuple[FloatArray, FloatArray]:
    """a=0, b=1, c=2: a-b direct 10 ms, a-c-b 20 + 20 ms."""
    cost = np.array([[0.0, 10.0, 20.0], [10.0, 0.0, 20.0], [20.0, 20.0, 0.0]])
    bw = np.array(
        [
            [INF, direct_bw, relay_bw],
            [direct_bw, INF, relay_bw],
            [relay_bw, relay_bw, INF],
        ]
    )
    return bw, cost


def test_a_gigabit_relay_beats_a_slow_direct_link() -> None:
    bw, cost = two_paths(direct_bw=10.0, relay_bw=1000.0)
    t = widest_routes(bw, cost, ["a", "b", "c"])
    assert t.path_names("a", "b") == ["a", "c", "b"]
    assert t.bandwidth[0, 1] == 1000.0
    assert t.cost[0, 1] == pytest.approx(42.0)
    # Latency-first routing would go direct.
    assert compute_routes(cost).path(0, 1) == [0, 1]


def test_within_one_bucket_latency_decides() -> None:
    # 95 and 100 Mbit are in the same 1.25× bucket: the faster (direct) path wins.
    bw, cost = two_paths(direct_bw=95.0, relay_bw=100.0)
    assert bandwidth_levels(np.array([95.0]))[0] == bandwidth_levels(np.array([100.0]))[0]
    t = widest_routes(bw, cost)
    assert t.path(0, 1) == [0, 1] and t.bandwidth[0, 1] == 95.0
    # With finer buckets 100 Mbit is strictly wider.
    assert widest_routes(bw, cost, bucket=1.01).path(0, 1) == [0, 2, 1]


def test_unknown_zero_and_unlimited_bandwidth() -> None:
    bw, cost = two_paths(direct_bw=np.nan, relay_bw=1.0)
    t = widest_routes(bw, cost)
    assert t.path(0, 1) == [0, 2, 1]  # known 1 Mbit beats unknown
    bw, cost = two_paths(direct_bw=np.nan, relay_bw=0.0)
    t = widest_routes(bw, cost)
    assert t.path(0, 1) == [0, 1] and np.isnan(t.bandwidth[0, 1])  # unknown is usable
    assert t.next_hop[0, 2] == NO_ROUTE and t.bandwidth[0, 2] == 0.0  # zero is not
    bw, cost = two_paths(direct_bw=1e6, relay_bw=INF)
    assert widest_routes(bw, cost).path(0, 1) == [0, 2, 1]
    assert (np.diag(t.bandwidth) == INF).all() and (np.diag(t.cost) == 0.0).all()


def test_levels() -> None:
    lv = bandwidth_levels(np.array([1.0, 10.0, 100.0, 99.999, 0.0, -1.0, np.nan, INF]), 10.0)
    assert lv.tolist() == [0, 1, 2, 1, LEVEL_NONE, LEVEL_NONE, LEVEL_UNKNOWN, LEVEL_UNLIMITED]
    with pytest.raises(ValueError):
        bandwidth_levels(np.ones(2), 1.0)
    with pytest.raises(ValueError):
        widest_routes(np.ones((2, 3)), np.zeros((2, 2)))


def test_an_access_capacity_mesh() -> None:
    # 80 nodes, capacities 10 Mbit–10 Gbit: many levels, several plans used.
    rng = np.random.default_rng(7)
    n = 80
    cost = random_costs(n, rng, "geo", 1.0)
    cap = 10 ** rng.uniform(1, 4, n)
    bw = np.minimum(cap[:, None], cap[None, :]) * rng.uniform(0.3, 1.0, (n, n))
    t = widest_routes(bw, cost)
    assert (t.next_hop != NO_ROUTE).all()
    lv = bandwidth_levels(bw)
    np.fill_diagonal(lv, LEVEL_NONE)
    for s, d in itertools.permutations(range(n), 2):
        path = follow(t.next_hop, s, d)
        assert path is not None
        assert min(lv[a, b] for a, b in itertools.pairwise(path)) == t.level[s, d]
    # Nobody can beat their own access capacity bucket, and the bottleneck never exceeds it.
    cap_lv = bandwidth_levels(np.minimum(cap[:, None], cap[None, :]))
    off = ~np.eye(n, dtype=bool)
    assert (t.level[off] <= cap_lv[off]).all()
