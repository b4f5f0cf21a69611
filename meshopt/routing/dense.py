"""Shortest paths on small dense graphs in plain numpy, bit-identical to scipy's.

Why: importing ``scipy.sparse.csgraph`` costs more CPU (0.13-0.19 s) than the whole
offline ``meshopt routes`` on a 52-node mesh needs for everything else, and a
mesh VPN is small. Up to ``SMALL_N`` nodes these functions stand in for
scipy's, with the same results to the last bit, so scipy is never imported:

* ``floyd_warshall`` runs scipy's own update rule (``d_ik + d_kj < d_ij``,
  strict, k in order) one k at a time over whole matrices. That is exactly the
  scalar loop: during step k row and column k cannot change (``d_kk = 0`` and
  weights are >= 0), so the order of the (i, j) updates within a step is moot.
* ``undirected_distances`` gives what scipy's Dijkstra gives: with weights
  >= 0, ``fl(a + w)`` is monotone and never below ``a``, so Dijkstra's
  distances are the least left-to-right float sums over all paths, and
  relaxing ``d_sv = min(d_sv, d_su + w_uv)`` until nothing changes reaches
  the same least sums (Floyd–Warshall would add the same numbers in another
  order and could round differently).
* ``components`` labels connected parts in order of their lowest node, as
  scipy's ``connected_components`` does.

The property tests in ``tests/unit/test_routing_dense.py`` hold each against scipy.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from meshopt.routing.tables import NO_ROUTE, FloatArray, IntArray

# Up to this many nodes numpy is used: there the whole numpy run costs less CPU than
# importing scipy (0.13-0.19 s). Measured on the 2-core VM (CPU s, numpy vs scipy without
# its import): Floyd–Warshall 0.001/0.0005 at 52 nodes, 0.023/0.009 at 200,
# 0.074/0.026 at 300; undirected distances 0.002/0.002 at 52, 0.06/0.03 at 200,
# 0.26/0.08 at 300.
# 100, not 200: at 200 nodes the controller recomputes often enough that scipy's
# 2.5x faster Floyd–Warshall pays for its import (bench_routes: >= 100x networkx).
SMALL_N = 100


def small(n: int) -> bool:
    """Whether an n-node graph goes to these numpy functions rather than to scipy."""
    return n <= SMALL_N


def floyd_warshall(weights: FloatArray) -> tuple[FloatArray, IntArray]:
    """(dist, pred) of ``scipy.sparse.csgraph.floyd_warshall(weights, directed=True,
    return_predecessors=True)``, but with ``NO_ROUTE`` for "no predecessor".

    As in scipy's dense input, 0, inf and NaN off the diagonal mean "no edge".
    Weights must be >= 0 (the caller checks; negative cycles are not detected).
    """
    d = np.array(weights, dtype=np.float64, order="C", copy=True)
    if d.ndim != 2 or d.shape[0] != d.shape[1]:
        raise ValueError(f"weight matrix must be square, got {d.shape}")
    n = d.shape[0]
    d[(d == 0) | np.isnan(d)] = np.inf
    np.fill_diagonal(d, 0.0)
    pred = np.full((n, n), NO_ROUTE, dtype=np.int64)
    rows, cols = np.nonzero(np.isfinite(d))
    pred[rows, cols] = rows
    np.fill_diagonal(pred, NO_ROUTE)
    cand = np.empty_like(d)
    better = np.empty((n, n), dtype=bool)
    for k in range(n):
        np.add(d[:, k, None], d[None, k, :], out=cand)
        np.less(cand, d, out=better)
        np.copyto(d, cand, where=better)
        np.copyto(pred, pred[k].copy()[None, :], where=better)
    return d, pred


def undirected_distances(weights: FloatArray) -> FloatArray:
    """Distances of ``scipy.sparse.csgraph.shortest_path(w, method="D", directed=False)``
    for a symmetric dense ``w`` with inf for "no edge" and finite weights > 0."""
    w = np.asarray(weights, dtype=np.float64)
    n = w.shape[0]
    d = w.copy()  # one-edge paths: fl(0 + w) == w
    np.fill_diagonal(d, 0.0)
    cand = np.empty_like(d)
    better = np.empty((n, n), dtype=bool)
    dirty = np.ones(n, dtype=bool)  # nodes whose column fell since they last relayed
    while dirty.any():
        for u in np.flatnonzero(dirty).tolist():
            dirty[u] = False
            # every source s at once: d[s, v] <- min(d[s, v], d[s, u] + w[u, v])
            np.add(d[:, u, None], w[None, u, :], out=cand)
            np.less(cand, d, out=better)
            if better.any():
                np.copyto(d, cand, where=better)
                dirty |= better.any(axis=0)
    return d


def components(reach: npt.NDArray[np.bool_]) -> tuple[int, IntArray]:
    """(count, labels) of the connected parts of a symmetric reachability matrix
    (``reach[i, j]``: i and j are connected, diagonal True), numbered in order of
    each part's lowest node, as ``scipy.sparse.csgraph.connected_components``."""
    n = reach.shape[0]
    labels = np.full(n, -1, dtype=np.int64)
    count = 0
    for v in range(n):
        if labels[v] < 0:
            labels[reach[v]] = count
            count += 1
    return count, labels


def pair_distances(
    n: int, rows: IntArray, cols: IntArray, weights: FloatArray
) -> tuple[int, IntArray, FloatArray]:
    """(count, labels, dist) of scipy's ``connected_components(directed=False)`` and
    ``shortest_path(method="D", directed=False)`` on the undirected n-node graph with
    an edge of weight ``weights[e] > 0`` between ``rows[e]`` and ``cols[e]``.

    Each unordered pair at most once (scipy would add up repeats). Small graphs run in
    numpy, larger ones in scipy.
    """
    if small(n):
        w = np.full((n, n), np.inf)
        w[rows, cols] = weights
        w[cols, rows] = weights
        dist = undirected_distances(w)
        count, labels = components(np.isfinite(dist))
        return count, labels, dist
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components, shortest_path

    adj = coo_matrix((weights, (rows, cols)), shape=(n, n)).tocsr()
    count, labels = connected_components(adj, directed=False)
    dist = shortest_path(adj, method="D", directed=False)
    return int(count), np.asarray(labels, dtype=np.int64), np.asarray(dist, dtype=np.float64)
