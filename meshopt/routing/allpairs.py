"""All-pairs lowest-cost routes: a compiled backend and a networkx reference.

The backend runs Floyd–Warshall on a dense matrix (a mesh VPN is a full mesh or
close to it, so dense is the right shape): from ``compiled.COMPILED_MIN_N`` (256)
nodes a cache-blocked one compiled with numba (``compiled``, ~2× as fast as scipy's, the
same next hops), else scipy's, or for meshes of up to ``dense.SMALL_N`` nodes a
numpy one with bit-identical results that spares the offline commands scipy's
import. Three tricks:

* **Relay-hop cost.** Every edge carries ``relay_hop_ms`` extra and a path's
  cost is the sum minus one ``relay_hop_ms``: a path of k hops pays for k-1 relays.
* **Deterministic tie-breaking.** Each edge gets a tiny fixed perturbation
  (in (0, ``TIE_EPS_MS``], drawn from a seeded generator, symmetric in
  symmetric mode) so that shortest paths are unique. Unique paths make next
  hops reproducible (full and incremental runs agree), and in symmetric mode
  they make the route from b to a exactly the reverse of the route from a to b.
  Reported costs are exact sums of the unperturbed link costs.
* **Next hops without a walk.** scipy's Floyd–Warshall runs on the *transposed*
  graph: there the predecessor of s on the path from d is the node after s
  on the path from s to d, i.e. s's next hop (the numba kernel tracks next
  hops directly). Exact costs then come from
  pointer doubling over the next-hop table (``reduce_paths``).

Why Floyd–Warshall and not Dijkstra: measured here on the 1,000-node geographic
mesh of ``scripts/bench_routes.py`` (CPU time, one core), scipy's Floyd–Warshall
with predecessors takes ~0.6 s. scipy's Dijkstra from every node takes ~1.7 s on
the full mesh and still 0.43 s on the ideal sparse graph (only the 13 % of links
that are themselves shortest paths, which cannot be known before the run);
pruning links by two-hop certificates through each node's K nearest relays
keeps 18–24 % of them and Dijkstra then takes 0.53–0.66 s, no gain. numpy
min-plus steps run at ~1 ns per element against Floyd–Warshall's ~0.6 ns, so
they lose too. About 90 % of ``compute_routes`` is the Floyd–Warshall call.
(Those figures are from a quieter day; on 2026-11-27 scipy's call took 1.1-1.4 s
and the ideal sparse Dijkstra 0.88 s, hence the numba kernel: see ``compiled``.)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from meshopt.routing import compiled as compiled_fw
from meshopt.routing import dense
from meshopt.routing.tables import (
    NO_ROUTE,
    FloatArray,
    IntArray,
    RouteTables,
    reduce_paths,
    relay_weights,
)

if TYPE_CHECKING:  # the reference is for tests: offline commands must not import networkx
    import networkx as nx

TIE_EPS_MS = 1e-4
_TIE_SEED = 0x6D657368


@functools.lru_cache(maxsize=4)
def _tie_noise(n: int, symmetric: bool) -> FloatArray:
    # 1 - U[0, 1) is in (0, 1]: no edge is ever perturbed to exactly zero weight,
    # which scipy's dense input would read as "no edge".
    r = (1.0 - np.random.default_rng(_TIE_SEED).random((n, n))) * TIE_EPS_MS
    if symmetric:
        r = np.triu(r, 1)
        r = r + r.T
    np.fill_diagonal(r, 0.0)
    r.setflags(write=False)
    return r


def tie_noise(n: int, symmetric: bool) -> FloatArray:
    """The fixed per-edge perturbation for an n-node mesh, in (0, TIE_EPS_MS].

    Cached and read-only: the same n always gets the same perturbation.
    """
    return _tie_noise(n, symmetric)


def prepare_weights(
    link_cost: FloatArray, relay_hop_ms: float, symmetric: bool
) -> tuple[FloatArray, FloatArray]:
    """(exact, perturbed) edge weights with the relay-hop cost folded in."""
    if not (math.isfinite(relay_hop_ms) and relay_hop_ms >= 0):
        raise ValueError(f"relay_hop_ms must be finite and >= 0, got {relay_hop_ms!r}")
    w = np.array(link_cost, dtype=np.float64, copy=True)
    if w.ndim != 2 or w.shape[0] != w.shape[1]:
        raise ValueError(f"cost matrix must be square, got {w.shape}")
    if np.isnan(w).any() or (w < 0).any():
        raise ValueError("link costs must be >= 0 (inf for no link), never NaN")
    if symmetric:
        w = (w + w.T) / 2.0
    w = relay_weights(w, relay_hop_ms)
    return w, w + tie_noise(w.shape[0], symmetric)


def shortest_paths(
    exact: FloatArray, perturbed: FloatArray, *, compiled: bool | None = None
) -> tuple[FloatArray, IntArray, FloatArray]:
    """(dist, next_hop, exact path cost) for the unique perturbed shortest paths.

    ``dist`` is over the perturbed weights, the cost is the exact sum of
    ``exact`` along the same paths; both include every edge's relay-hop cost.
    ``compiled``: True/False forces the numba kernel on or off (it still falls
    back to scipy without numba); None uses it from ``COMPILED_MIN_N`` nodes.
    """
    n = perturbed.shape[0]
    if n == 0:
        empty = np.zeros((0, 0))
        return empty, np.zeros((0, 0), dtype=np.int64), empty
    if compiled_fw.use_compiled(n, compiled):
        fast = compiled_fw.floyd_warshall(perturbed)
        if fast is not None:
            dist, nh = fast
            return dist, nh, compiled_fw.path_sums(nh, exact)
    if dense.small(n):
        dist_t, pred_t = dense.floyd_warshall(perturbed.T)
    else:
        from scipy.sparse.csgraph import floyd_warshall

        dist_t, pred_t = floyd_warshall(
            np.ascontiguousarray(perturbed.T),
            directed=True,
            return_predecessors=True,
            overwrite=True,
        )
    # scipy marks "no predecessor" with a large negative number: clamp it to NO_ROUTE.
    nh = np.asarray(pred_t).T.astype(np.int64, order="C")
    np.maximum(nh, NO_ROUTE, out=nh)
    np.fill_diagonal(nh, np.arange(n))
    dist = np.ascontiguousarray(np.asarray(dist_t, dtype=np.float64).T)
    return dist, nh, reduce_paths(nh, exact, "sum")


def without_relay_offset(cost: FloatArray, relay_hop_ms: float) -> FloatArray:
    """Take one relay-hop cost off every path: k hops pay for k-1 relays."""
    out = cost.copy()
    off = ~np.eye(cost.shape[0], dtype=bool) & np.isfinite(cost)
    out[off] -= relay_hop_ms
    return out


def compute_routes(
    link_cost: FloatArray,
    names: Sequence[str] | None = None,
    *,
    relay_hop_ms: float = 2.0,
    symmetric: bool = False,
    compiled: bool | None = None,
) -> RouteTables:
    """All-pairs next hops and costs from a dense link-cost matrix (inf = no link).

    In symmetric mode each link costs the mean of its two directions and the
    route from b to a is the reverse of the route from a to b. ``compiled``
    forces the numba kernel on or off (default: from ``COMPILED_MIN_N`` nodes).
    """
    exact, perturbed = prepare_weights(link_cost, relay_hop_ms, symmetric)
    n = exact.shape[0]
    if names is not None and len(names) != n:
        raise ValueError(f"{len(names)} names for a {n}-node cost matrix")
    dist, nh, cost = shortest_paths(exact, perturbed, compiled=compiled)
    return RouteTables(
        names=list(names) if names is not None else [str(i) for i in range(n)],
        cost=without_relay_offset(cost, relay_hop_ms),
        next_hop=nh,
        dist=dist,
        symmetric=symmetric,
    )


def reference_costs(
    g: nx.DiGraph, weight: str = "cost", *, relay_hop_ms: float = 2.0
) -> dict[str, dict[str, float]]:
    """Plain networkx Dijkstra from every node: the reference the backend is checked against."""
    import networkx as nx

    def w(_u: str, _v: str, data: dict[str, float]) -> float:
        return float(data[weight]) + relay_hop_ms

    out: dict[str, dict[str, float]] = {}
    for src in g.nodes:
        dist = nx.single_source_dijkstra_path_length(g, src, weight=w)
        out[src] = {dst: (0.0 if dst == src else d - relay_hop_ms) for dst, d in dist.items()}
    return out


def reference_routes(
    g: nx.DiGraph, weight: str = "cost", *, relay_hop_ms: float = 2.0
) -> RouteTables:
    """Reference next hops and costs with networkx only (slow; for tests and benchmarks)."""
    import networkx as nx

    names: list[str] = list(g.graph.get("nodes") or g.nodes)
    index = {name: i for i, name in enumerate(names)}
    n = len(names)
    cost = np.full((n, n), np.inf)
    nh = np.full((n, n), NO_ROUTE, dtype=np.int64)

    def w(_u: str, _v: str, data: dict[str, float]) -> float:
        return float(data[weight]) + relay_hop_ms

    for src in names:
        dist, paths = nx.single_source_dijkstra(g, src, weight=w)
        s = index[src]
        for dst, d in dist.items():
            t = index[dst]
            cost[s, t] = 0.0 if s == t else d - relay_hop_ms
            nh[s, t] = index[paths[dst][1]] if s != t else s
    return RouteTables(names=names, cost=cost, next_hop=nh)
