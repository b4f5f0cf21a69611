"""Shared strategies and brute-force helpers for the routing tests (no tests here)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import networkx as nx
import numpy as np
from hypothesis import strategies as st

from meshopt.routing.tables import NO_ROUTE, FloatArray, IntArray

INF = np.inf


@dataclass(frozen=True)
class Mesh:
    """A random test mesh: link costs (inf = no link) and how they were drawn."""

    cost: FloatArray
    relay_hop_ms: float
    kind: str
    seed: int

    @property
    def n(self) -> int:
        return int(self.cost.shape[0])


def random_costs(n: int, rng: np.random.Generator, kind: str, density: float) -> FloatArray:
    """Asymmetric link costs; "int" gives exact ties and zero-cost links."""
    if kind == "int":
        c = rng.integers(0, 6, (n, n)).astype(np.float64)
    elif kind == "geo":
        p = rng.normal(size=(n, 3))
        p /= np.linalg.norm(p, axis=1, keepdims=True)
        c = np.arccos(np.clip(p @ p.T, -1, 1)) * 64.0 * rng.uniform(1.2, 3.0, (n, n))
    else:
        c = rng.uniform(0.0, 100.0, (n, n))
    c[rng.random((n, n)) > density] = INF
    np.fill_diagonal(c, 0.0)
    return c


@st.composite
def meshes(
    draw: st.DrawFn,
    min_n: int = 2,
    max_n: int = 25,
    kinds: tuple[str, ...] = ("int", "float", "geo"),
) -> Mesh:
    n = draw(st.integers(min_n, max_n))
    seed = draw(st.integers(0, 2**32 - 1))
    kind = draw(st.sampled_from(kinds))
    density = draw(st.sampled_from([0.15, 0.3, 0.6, 1.0]))
    relay = draw(st.sampled_from([0.0, 2.0, 7.5]))
    rng = np.random.default_rng(seed)
    return Mesh(random_costs(n, rng, kind, density), relay, kind, seed)


def to_graph(cost: FloatArray) -> nx.DiGraph:
    """networkx view of a cost matrix, nodes named "0".."n-1" in matrix order."""
    n = cost.shape[0]
    names = [str(i) for i in range(n)]
    g = nx.DiGraph(nodes=names)
    g.add_nodes_from(names)
    for a, b in zip(*np.nonzero(np.isfinite(cost) & ~np.eye(n, dtype=bool)), strict=True):
        g.add_edge(names[a], names[b], cost=float(cost[a, b]))
    return g


def follow(next_hop: IntArray, s: int, d: int) -> list[int] | None:
    """The hop-by-hop path s→d, or None if it breaks or loops."""
    path = [s]
    seen = {s}
    cur = s
    while cur != d:
        cur = int(next_hop[cur, d])
        if cur == NO_ROUTE or cur in seen:
            return None
        seen.add(cur)
        path.append(cur)
    return path


def path_cost(cost: FloatArray, path: list[int], relay_hop_ms: float) -> float:
    """Sum of link costs plus one relay cost per intermediate node."""
    hops = list(itertools.pairwise(path))
    return float(sum(cost[a, b] for a, b in hops) + relay_hop_ms * max(0, len(hops) - 1))
