"""Symmetric mode: reverse paths, and the WireGuard AllowedIPs consistency check."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshopt.routing.allpairs import compute_routes
from meshopt.routing.symmetric import allowed_ips_consistent, allowed_ips_violations
from meshopt.routing.tables import NO_ROUTE, IntArray
from tests.unit.test_routing_common import INF, Mesh, follow, meshes


def brute_violations(nh: IntArray) -> set[tuple[int, int]]:
    """The definition, one pair at a time."""
    n = nh.shape[0]
    bad: set[tuple[int, int]] = set()
    for a, d in itertools.product(range(n), range(n)):
        if a == d or nh[a, d] == NO_ROUTE:
            continue
        path = follow(nh, a, d)
        if path is None or any(nh[x, a] != p for p, x in itertools.pairwise(path)):
            bad.add((a, d))
    return bad


def as_set(v: IntArray) -> set[tuple[int, int]]:
    return {(int(a), int(d)) for a, d in v}


@settings(max_examples=200, deadline=None)
@given(meshes(kinds=("int", "int", "float")))
def test_symmetric_paths_are_exact_reverses(m: Mesh) -> None:
    t = compute_routes(m.cost, relay_hop_ms=m.relay_hop_ms, symmetric=True)
    for a, b in itertools.combinations(range(m.n), 2):
        pab, pba = t.path(a, b), t.path(b, a)
        assert pab == pba[::-1], (a, b, pab, pba)
    assert np.array_equal(np.isinf(t.cost), np.isinf(t.cost.T))
    fin = np.isfinite(t.cost)
    assert np.allclose(t.cost[fin], t.cost.T[fin], rtol=0.0, atol=1e-9)
    assert allowed_ips_consistent(t)
    assert brute_violations(t.next_hop) == set()


@settings(max_examples=80, deadline=None)
@given(meshes(max_n=14))
def test_vectorised_check_matches_the_definition_on_directed_tables(m: Mesh) -> None:
    # Directed tables on asymmetric costs usually violate the condition somewhere.
    t = compute_routes(m.cost, relay_hop_ms=m.relay_hop_ms)
    v = allowed_ips_violations(t)
    assert as_set(v) == brute_violations(t.next_hop)
    assert allowed_ips_consistent(t) == (v.shape[0] == 0)


@settings(max_examples=80, deadline=None)
@given(st.integers(2, 9), st.integers(0, 2**32 - 1))
def test_vectorised_check_matches_the_definition_on_arbitrary_tables(n: int, seed: int) -> None:
    # Random next hops: broken paths, loops and everything else the policy might produce.
    rng = np.random.default_rng(seed)
    nh = rng.integers(-1, n, (n, n)).astype(np.int64)
    np.fill_diagonal(nh, np.arange(n))
    assert as_set(allowed_ips_violations(nh)) == brute_violations(nh)


def test_asymmetric_costs_break_allowed_ips() -> None:
    # a→b is direct but b routes a via c: b drops a's packets arriving from peer a.
    a, b, c = 0, 1, 2
    m = np.full((3, 3), INF)
    np.fill_diagonal(m, 0.0)
    m[a, b], m[b, a] = 10.0, 100.0
    m[b, c], m[c, b] = 10.0, 100.0
    m[c, a], m[a, c] = 10.0, 100.0
    t = compute_routes(m)
    assert t.path(a, b) == [a, b] and t.path(b, a) == [b, c, a]
    assert not allowed_ips_consistent(t)
    assert (a, b) in as_set(allowed_ips_violations(t))
    assert allowed_ips_consistent(compute_routes(m, symmetric=True))


def test_one_changed_entry_at_a_relay_is_caught() -> None:
    # A 6-ring: 0→3 is relayed via 1, 2 (or 5, 4). Point relay 2's route to 0 elsewhere.
    n = 6
    m = np.full((n, n), INF)
    np.fill_diagonal(m, 0.0)
    for x in range(n):
        m[x, (x + 1) % n] = m[(x + 1) % n, x] = 10.0 + x
    t = compute_routes(m, symmetric=True)
    path = t.path(0, 3)
    assert len(path) == 4 and allowed_ips_consistent(t)
    relay, before = path[2], path[1]
    nh = t.next_hop.copy()
    nh[relay, 0] = path[3]  # now routes 0 away from the peer 0's packets arrive from
    assert nh[relay, 0] != before
    bad = as_set(allowed_ips_violations(nh))
    assert (0, 3) in bad
    assert bad == brute_violations(nh)


def test_a_second_routing_class_is_checked_against_the_main_tables() -> None:
    # Bulk traffic 0→1 relays via 2 (wide), the main class goes direct (fast).
    cost = np.array([[0.0, 10.0, 20.0], [10.0, 0.0, 20.0], [20.0, 20.0, 0.0]])
    main = compute_routes(cost, symmetric=True)
    bulk = main.next_hop.copy()
    bulk[0, 1], bulk[1, 0] = 2, 2
    assert allowed_ips_consistent(bulk)  # consistent on its own, but node 1 gets 0's
    # bulk packets from peer 2 while its main table (the AllowedIPs) routes 0 directly.
    assert not allowed_ips_consistent(bulk, main)
    assert as_set(allowed_ips_violations(bulk, main)) == {(0, 1), (1, 0)}
    assert allowed_ips_consistent(main, main)
    with pytest.raises(ValueError):
        allowed_ips_violations(bulk, np.zeros((2, 2), dtype=np.int64))


def test_empty_and_trivial_tables() -> None:
    assert allowed_ips_consistent(np.zeros((0, 0), dtype=np.int64))
    assert allowed_ips_consistent(np.array([[0]], dtype=np.int64))
    assert allowed_ips_violations(np.array([[0, NO_ROUTE], [NO_ROUTE, 1]])).shape == (0, 2)
