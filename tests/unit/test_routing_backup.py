"""Backup next hops: loop-free alternates survive the failure they protect against."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshopt.routing.allpairs import compute_routes, prepare_weights
from meshopt.routing.backup import add_backups
from meshopt.routing.tables import NO_ROUTE, FloatArray, IntArray, RouteTables
from tests.unit.test_routing_common import INF, Mesh, follow, meshes, random_costs

# Alternates whose inequality holds by less than this may be rejected (rounding margin).
ROBUST_MS = 1e-6


def forward_after_failure(
    nh: IntArray, s: int, d: int, first: int, dead_link: tuple[int, int], dead_node: int | None
) -> list[int] | None:
    """Packets from s to d: s uses ``first``, everyone else the old primaries.

    None if they loop, hit a missing route, cross the dead link or visit the dead node.
    """
    path = [s, first]
    cur = first
    while cur != d:
        if cur == dead_node or len(path) > nh.shape[0] + 1:
            return None
        nxt = int(nh[cur, d])
        if nxt == NO_ROUTE or (cur, nxt) == dead_link:
            return None
        path.append(nxt)
        cur = nxt
    if dead_node is not None and dead_node in path[:-1]:
        return None
    return path


def check_backups(t: RouteTables, link_cost: FloatArray, relay_hop_ms: float) -> None:
    n = t.n
    nh, bk = t.next_hop, t.backup
    assert bk is not None and t.dist is not None
    dist = t.dist
    _, w = prepare_weights(link_cost, relay_hop_ms, t.symmetric)
    assert (np.diag(bk) == NO_ROUTE).all()
    for s in range(n):
        for d in range(n):
            p = int(nh[s, d])
            b = int(bk[s, d])
            if s == d or p == NO_ROUTE:
                assert b == NO_ROUTE
                continue
            # What a brute force knows about every neighbour m ≠ p.
            lfa, node = [], []
            for m in range(n):
                if m in (s, p) or not np.isfinite(w[s, m]):
                    continue
                pm = follow(nh, m, d)
                if pm is None:  # m has no route to d
                    continue
                if s not in pm and dist[m, s] + dist[s, d] - dist[m, d] > ROBUST_MS:
                    lfa.append(m)
                    if p != d and p not in pm and dist[m, p] + dist[p, d] - dist[m, d] > ROBUST_MS:
                        node.append(m)
            if b == NO_ROUTE:
                assert not lfa, (s, d, lfa)
                continue
            assert b != p and b != s and np.isfinite(w[s, b])
            # Link s→p fails: s uses b, the others keep their old routes.
            path = forward_after_failure(nh, s, d, b, (s, p), None)
            assert path is not None, (s, d, b)
            assert s not in path[1:]
            key = w[s, b] + dist[b, d]
            b_protects = p != d and p not in path
            if node:
                # Node p fails: the detour must not need it.
                assert b_protects, (s, d, b)
                assert forward_after_failure(nh, s, d, b, (s, p), p) is not None, (s, d, b)
                assert key <= min(w[s, m] + dist[m, d] for m in node) + 1e-9
            elif not b_protects and lfa:
                # No node-protecting alternate at all: the cheapest loop-free one.
                assert key <= min(w[s, m] + dist[m, d] for m in lfa) + 1e-9
            # (b protects p by a margin under ROBUST_MS: preferring it is by design.)


@settings(max_examples=250, deadline=None)
@given(meshes(max_n=18), st.booleans())
def test_backups_are_loop_free_and_preferably_node_protecting(m: Mesh, symmetric: bool) -> None:
    t = compute_routes(m.cost, relay_hop_ms=m.relay_hop_ms, symmetric=symmetric)
    tb = add_backups(t, m.cost, relay_hop_ms=m.relay_hop_ms)
    assert tb.backup is not None and t.backup is None  # a copy, input untouched
    assert np.array_equal(tb.next_hop, t.next_hop)
    check_backups(tb, m.cost, m.relay_hop_ms)


def test_known_triangle() -> None:
    # a-b 10, a-c 20, c-b 20: a reaches b directly; c is a link-protecting alternate
    # (p == d, nothing else to protect), and c's own route to b does not use a.
    c = np.array([[0.0, 10.0, 20.0], [10.0, 0.0, 20.0], [20.0, 20.0, 0.0]])
    t = add_backups(compute_routes(c, ["a", "b", "c"]), c)
    assert t.backup is not None
    assert t.next_hop[0, 1] == 1 and t.backup[0, 1] == 2
    # c→b: primary direct, backup via a (a's route to b is direct, avoids c).
    assert t.backup[2, 1] == 0


def test_no_alternate_on_a_chain() -> None:
    c = np.full((3, 3), INF)
    np.fill_diagonal(c, 0.0)
    c[0, 1] = c[1, 0] = c[1, 2] = c[2, 1] = 5.0
    t = add_backups(compute_routes(c), c)
    assert t.backup is not None
    assert (t.backup == NO_ROUTE).all()


def test_node_protection_is_preferred_over_a_cheaper_link_protection() -> None:
    # s=0 → d=3 via p=1. Neighbour 2 is cheap but routes to 3 via 1;
    # neighbour 4 is dearer but reaches 3 without 1.
    c = np.full((5, 5), INF)
    np.fill_diagonal(c, 0.0)

    def link(a: int, b: int, x: float) -> None:
        c[a, b] = c[b, a] = x

    link(0, 1, 10.0)
    link(1, 3, 10.0)
    link(0, 2, 5.0)
    link(2, 1, 8.0)
    link(0, 4, 30.0)
    link(4, 3, 30.0)
    t = add_backups(compute_routes(c), c)
    assert t.backup is not None
    assert t.path(0, 3) == [0, 1, 3]
    assert t.path(2, 3) == [2, 1, 3]  # 2 is loop-free (avoids 0) but not node-protecting
    assert t.backup[0, 3] == 4
    check_backups(t, c, 2.0)


def test_tables_without_dist_and_mismatched_costs() -> None:
    rng = np.random.default_rng(3)
    c = random_costs(12, rng, "float", 0.6)
    t = compute_routes(c)
    bare = dataclasses.replace(t, dist=None)
    a, b = add_backups(t, c), add_backups(bare, c)
    assert a.backup is not None and b.backup is not None
    assert np.array_equal(a.backup, b.backup)
    other = c * 1.7
    with pytest.raises(ValueError):
        add_backups(t, other)
    with pytest.raises(ValueError):
        add_backups(bare, other)
    with pytest.raises(ValueError):
        add_backups(t, c, relay_hop_ms=9.0)
    # One link no primary uses gets much cheaper: the old distances are stale.
    s, d = np.argwhere((t.next_hop != np.arange(12)) & np.isfinite(c))[0]
    cheaper = c.copy()
    cheaper[s, d] = 0.0
    with pytest.raises(ValueError):
        add_backups(t, cheaper)


def test_a_mesh_larger_than_one_block() -> None:
    # 150 nodes: several destination blocks per source and many node-protection retries.
    rng = np.random.default_rng(11)
    c = random_costs(150, rng, "geo", 0.5)
    t = add_backups(compute_routes(c), c)
    assert t.backup is not None and t.dist is not None
    nh, bk = t.next_hop, t.backup
    s, d = np.nonzero(bk != NO_ROUTE)
    assert s.size > 0.9 * 150 * 149
    for si, di in zip(s.tolist(), d.tolist(), strict=True):
        path = forward_after_failure(nh, si, di, int(bk[si, di]), (si, int(nh[si, di])), None)
        assert path is not None and si not in path[1:]
