"""Widest paths for bulk traffic: maximise the bottleneck bandwidth, then latency.

Bandwidth estimates are noisy, so they are compared in logarithmic buckets:
level(bw) = ⌊log(bw) / log(bucket)⌋, and two links in the same bucket are
equally wide. A pair's level ℓ*(s,d) is the highest level L at which d is
reachable from s using only links of level ≥ L (subgraph G_L). Its next hop is
the first hop of the lowest-cost path from s to d *in G_ℓ\\*(s,d)* — the same
unique perturbed shortest paths as ``compute_routes``, restricted to G_L.

Why not "shortest among the widest paths" per pair: that is not consistent
hop by hop (the best path from s may continue from x differently from x's own
best path), so packets would not follow the computed paths. Here they do reach
d, without loops, over a path of bottleneck level exactly ℓ*(s,d):

* Let x = next_hop(s,d). The rest of s's G_ℓ* path goes from x to d inside
  G_ℓ*, so ℓ*(x,d) ≥ ℓ*(s,d): the level never decreases along the way.
* If ℓ*(x,d) == ℓ*(s,d), x routes d over its own shortest path in the same
  G_ℓ*, which is the suffix of s's (unique shortest paths), so the perturbed
  G_ℓ* distance to d strictly decreases. Levels are finitely many, so the walk
  cannot return to a node: no loop.
* Every link taken from a node at level ℓ has level ≥ ℓ ≥ ℓ*(s,d), so the
  walked path's bottleneck level is ≥ ℓ*(s,d), hence = ℓ*(s,d) (the maximum).

The price of consistency: when x sits at a higher level than s, the walked
path's latency can exceed the best latency among paths of level ℓ*(s,d).
``cost`` reports the latency of the walked path, so it is always honest.

Levels are processed from the top; at each, only the pairs still unresolved
are computed, over the nodes that have a link in G_L: Floyd–Warshall on that
subgraph, or Dijkstra from just the needed sources or destinations when that
is cheaper (sparse top levels, or few new nodes joining).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from meshopt.routing.allpairs import prepare_weights, without_relay_offset
from meshopt.routing.tables import NO_ROUTE, FloatArray, IntArray, RouteTables, reduce_paths

BoolArray = npt.NDArray[np.bool_]

LEVEL_NONE = int(np.iinfo(np.int64).min)
"""Level of a link unusable for bulk traffic (no link, or bandwidth <= 0)."""
LEVEL_UNKNOWN = -(1 << 40)
"""Level of a link of unknown (NaN) bandwidth: usable, never preferred."""
LEVEL_UNLIMITED = 1 << 40
"""Level of a link of infinite bandwidth."""

# Relative cost of one Dijkstra edge relaxation vs one Floyd–Warshall update (measured).
_DIJKSTRA_FACTOR = 4.0


@dataclass
class WidestTables(RouteTables):
    """Widest-path tables: ``cost`` is the latency of the forwarded path.

    ``bandwidth[s, d]`` is the bottleneck bandwidth of the forwarded path (NaN
    if it crosses a link of unknown bandwidth, 0 if unreachable, inf on the
    diagonal); ``level[s, d]`` its bucket, ``LEVEL_NONE`` if unreachable.
    """

    bandwidth: FloatArray = field(kw_only=True)
    level: IntArray = field(kw_only=True)


def bandwidth_levels(bandwidth: FloatArray, bucket: float = 1.25) -> IntArray:
    """Log-bucket index of every bandwidth (see the ``LEVEL_*`` constants for specials)."""
    if not (math.isfinite(bucket) and bucket > 1.0):
        raise ValueError(f"bucket must be a finite factor > 1, got {bucket!r}")
    bw = np.asarray(bandwidth, dtype=np.float64)
    out = np.full(bw.shape, LEVEL_NONE, dtype=np.int64)
    ok = np.isfinite(bw) & (bw > 0)
    # The tiny offset keeps exact powers of the bucket in their own bucket despite rounding.
    out[ok] = np.floor(np.log(bw[ok]) / math.log(bucket) + 1e-9).astype(np.int64)
    out[np.isposinf(bw)] = LEVEL_UNLIMITED
    out[np.isnan(bw)] = LEVEL_UNKNOWN
    return out


def _first_hops(pred: IntArray, roots: IntArray) -> IntArray:
    """First hop from roots[r] to every node, from source-rooted predecessor rows."""
    r, k = pred.shape
    col = np.broadcast_to(np.arange(k, dtype=np.int64)[None, :], (r, k))
    stop = (pred < 0) | (pred == roots[:, None])
    f = np.where(stop, col, pred)
    for _ in range(max(1, math.ceil(math.log2(max(k, 2)))) + 1):
        g = np.take_along_axis(f, f, axis=1)
        if np.array_equal(g, f):
            break
        f = g
    out: IntArray = np.where(pred < 0, NO_ROUTE, f)
    return out


def _level_next_hops(
    w: FloatArray, edge: BoolArray, pending: BoolArray, plan: str | None = None
) -> IntArray:
    """Next hops (local indices, NO_ROUTE if unreachable) in the graph ``edge`` for pending pairs.

    Entries outside ``pending`` are unspecified. ``plan`` forces a method (tests).
    """
    k = w.shape[0]
    m = int(edge.sum())
    heap = k * max(1.0, math.log2(max(k, 2)))
    row_need = pending.sum(axis=1)
    col_need = pending.sum(axis=0)
    srcs = np.flatnonzero(row_need)
    dsts = np.flatnonzero(col_need)
    # Mixed plan: sources with many pending pairs from source-rooted runs,
    # the remaining pending columns from destination-rooted runs.
    heavy = row_need * 2 > k
    mix_src = np.flatnonzero(heavy)
    mix_dst = np.flatnonzero(pending[~heavy].any(axis=0))
    per_root = _DIJKSTRA_FACTOR * (m + heap)
    plans = {
        "fw": float(k) ** 3,
        "dst": dsts.size * per_root,
        "src": srcs.size * per_root,
        "mix": (mix_src.size + mix_dst.size) * per_root,
    }
    if plan is None:
        plan = min(plans, key=lambda p: plans[p])
    # scipy loads here, not with the module: offline ``routes`` and ``path`` never get here
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import dijkstra, floyd_warshall

    out = np.full((k, k), NO_ROUTE, dtype=np.int64)
    if plan == "fw":
        sub = np.where(edge, w, np.inf)
        np.fill_diagonal(sub, 0.0)
        _, pred_t = floyd_warshall(sub.T.copy(), directed=True, return_predecessors=True)
        out = np.ascontiguousarray(np.asarray(pred_t, dtype=np.int64).T)
        out[out < 0] = NO_ROUTE
        return out
    r, c = np.nonzero(edge)
    if plan == "dst":
        src_roots, dst_roots = np.zeros(0, dtype=np.int64), dsts
    elif plan == "src":
        src_roots, dst_roots = srcs, np.zeros(0, dtype=np.int64)
    else:
        src_roots, dst_roots = mix_src, mix_dst
    if dst_roots.size:
        gt = csr_matrix((w[r, c], (c, r)), shape=(k, k))
        _, pred_t = dijkstra(gt, directed=True, indices=dst_roots, return_predecessors=True)
        pt = np.asarray(pred_t, dtype=np.int64)
        out[:, dst_roots] = np.where(pt < 0, NO_ROUTE, pt).T
    if src_roots.size:
        graph = csr_matrix((w[r, c], (r, c)), shape=(k, k))
        _, pred = dijkstra(graph, directed=True, indices=src_roots, return_predecessors=True)
        out[src_roots, :] = _first_hops(np.asarray(pred, dtype=np.int64), src_roots)
    return out


def widest_routes(
    bandwidth: FloatArray,
    link_cost: FloatArray,
    names: Sequence[str] | None = None,
    *,
    relay_hop_ms: float = 2.0,
    bucket: float = 1.25,
) -> WidestTables:
    """Hop-by-hop consistent widest paths (bucketed bottleneck first, then latency).

    ``bandwidth[a, b]`` is the bandwidth of link a→b (Mbit/s or any unit):
    <= 0 makes the link unusable for bulk traffic, NaN means unknown (lowest
    level), inf unlimited. Links need a finite ``link_cost`` too.
    """
    exact, pert = prepare_weights(link_cost, relay_hop_ms, False)
    n = exact.shape[0]
    bw = np.asarray(bandwidth, dtype=np.float64)
    if bw.shape != (n, n):
        raise ValueError(f"bandwidth matrix {bw.shape} does not match cost matrix {(n, n)}")
    if names is not None and len(names) != n:
        raise ValueError(f"{len(names)} names for a {n}-node cost matrix")
    lv = bandwidth_levels(bw, bucket)
    off = ~np.eye(n, dtype=bool)
    lv[~(np.isfinite(exact) & off)] = LEVEL_NONE
    nh = np.full((n, n), NO_ROUTE, dtype=np.int64)
    np.fill_diagonal(nh, np.arange(n))
    level = np.full((n, n), LEVEL_NONE, dtype=np.int64)
    pending = off.copy()
    for lev in np.unique(lv[lv != LEVEL_NONE])[::-1]:
        edge = lv >= lev
        idx = np.flatnonzero(edge.any(axis=0) | edge.any(axis=1))
        ix = np.ix_(idx, idx)
        pend = pending[ix]
        if not pend.any():
            continue
        local = _level_next_hops(pert[ix], edge[ix], pend)
        got = pend & (local != NO_ROUTE)
        gr, gc = np.nonzero(got)
        s, d = idx[gr], idx[gc]
        nh[s, d] = idx[local[gr, gc]]
        level[s, d] = int(lev)
        pending[s, d] = False
        if not pending.any():
            break
    bw_edge = np.where(lv != LEVEL_NONE, bw, 0.0)
    return WidestTables(
        names=list(names) if names is not None else [str(i) for i in range(n)],
        cost=without_relay_offset(reduce_paths(nh, exact, "sum"), relay_hop_ms),
        next_hop=nh,
        bandwidth=reduce_paths(nh, bw_edge, "min"),
        level=level,
    )
