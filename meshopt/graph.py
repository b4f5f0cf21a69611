"""Measurements → a weighted networkx DiGraph, and the dense matrices the engine uses.

The graph is the model users and tests look at (node and edge attributes say
what was measured); the route engine works on dense cost matrices extracted
from it, in the node order of ``graph.graph["nodes"]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from meshopt.metric import FloatArray, LinkSample, Metric
from meshopt.topology.model import Topology

if TYPE_CHECKING:  # imported where a graph is built: offline commands need only matrices
    import networkx as nx


def link_state(sample: LinkSample | None, metric: Metric) -> str:
    if sample is None:
        return "missing"
    if sample.loss >= 1.0 or sample.rtt_ms == float("inf"):
        return "down"
    if sample.age_s > metric.stale_s:
        return "stale"
    if sample.age_s > metric.fresh_s:
        return "aging"
    return "fresh"


def build_graph(
    nodes: Sequence[str],
    samples: Mapping[tuple[str, str], LinkSample],
    metric: Metric | None = None,
    tunnels: Sequence[tuple[str, str]] | None = None,
) -> nx.DiGraph:
    """One edge per direction of every tunnel; full mesh when ``tunnels`` is None.

    A tunnel without a sample gets a ``missing`` edge at ``unknown_cost_ms``; a
    down link gets no edge. Samples for pairs that are not tunnels are ignored.
    """
    import networkx as nx

    metric = metric or Metric()
    g = nx.DiGraph(nodes=list(nodes), metric=metric)
    g.add_nodes_from(nodes)
    if tunnels is None:
        pairs = [(a, b) for a in nodes for b in nodes if a != b]
    else:
        pairs = [p for a, b in tunnels for p in ((a, b), (b, a))]
    for a, b in pairs:
        sample = samples.get((a, b))
        state = link_state(sample, metric)
        if state == "down":
            continue
        attrs: dict[str, object] = {"cost": metric.link_cost(sample), "state": state}
        if sample is not None:
            attrs.update(
                rtt_ms=sample.rtt_ms,
                jitter_ms=sample.jitter_ms,
                loss=sample.loss,
                noise_ms=sample.noise_ms,
                age_s=sample.age_s,
            )
            if sample.bandwidth_mbit is not None:
                attrs["bandwidth_mbit"] = sample.bandwidth_mbit
        g.add_edge(a, b, **attrs)
    return g


def topology_samples(topo: Topology) -> dict[tuple[str, str], LinkSample]:
    """What perfect probes would measure on every tunnel of a topology's underlay."""
    rtt = topo.rtt_ms()
    jit = np.sqrt(topo.jitter_ms**2 + topo.jitter_ms.T**2)
    loss = 1.0 - (1.0 - topo.loss) * (1.0 - topo.loss.T)
    names = topo.names
    out: dict[tuple[str, str], LinkSample] = {}
    ii, jj = np.nonzero(topo.tunnels)
    for i, j in zip(ii.tolist(), jj.tolist(), strict=True):
        rate = float(topo.rate_mbit[i, j])
        out[names[i], names[j]] = LinkSample(
            rtt_ms=float(rtt[i, j]),
            jitter_ms=float(jit[i, j]),
            loss=float(loss[i, j]),
            bandwidth_mbit=None if rate == float("inf") else rate,
        )
    return out


def topology_costs(topo: Topology, metric: Metric | None = None) -> FloatArray:
    """Dense link-cost matrix of a topology's ground truth (inf where no tunnel)."""
    metric = metric or Metric()
    jit = np.sqrt(topo.jitter_ms**2 + topo.jitter_ms.T**2)
    loss = 1.0 - (1.0 - topo.loss) * (1.0 - topo.loss.T)
    cost = metric.link_costs(topo.rtt_ms(), jit, loss)
    cost = np.where(topo.tunnels, cost, np.inf)
    np.fill_diagonal(cost, 0.0)
    return cost


def graph_from_topology(topo: Topology, metric: Metric | None = None) -> nx.DiGraph:
    """The graph perfect probes would give: the reference view of a topology."""
    return build_graph(topo.names, topology_samples(topo), metric, list(topo.tunnel_pairs()))


def cost_matrix(g: nx.DiGraph, attr: str = "cost", missing: float = np.inf) -> FloatArray:
    """Dense matrix of an edge attribute in ``g.graph['nodes']`` order; diagonal 0."""
    names: list[str] = list(g.graph.get("nodes") or g.nodes)
    index = {name: i for i, name in enumerate(names)}
    m = np.full((len(names), len(names)), missing)
    for a, b, value in g.edges(data=attr, default=missing):
        m[index[a], index[b]] = value
    np.fill_diagonal(m, 0.0)
    return m
