"""Offline answers from a topology: which routes each node would install, and why.

Pure: a topology and a metric in, plain data out. The CLI's ``path``,
``routes`` and ``gains`` render what this returns.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from meshopt.graph import topology_costs
from meshopt.metric import FloatArray, Metric
from meshopt.routing import NO_ROUTE, RouteTables, compute_routes
from meshopt.routing.backup import add_backups
from meshopt.routing.tables import reduce_paths
from meshopt.sim.report import GainSummary, summarize_gains
from meshopt.topology.model import Topology


@dataclass
class Plan:
    topo: Topology
    metric: Metric
    link_cost: FloatArray  # metric cost per tunnel direction (inf: no tunnel)
    rtt: FloatArray  # underlay RTT per tunnel (inf: no tunnel)
    tables: RouteTables  # with backups


def plan(topo: Topology, metric: Metric | None = None, *, symmetric: bool = False) -> Plan:
    metric = metric or Metric()
    cost = topology_costs(topo, metric)
    tables = compute_routes(cost, topo.names, relay_hop_ms=metric.relay_hop_ms, symmetric=symmetric)
    tables = add_backups(tables, cost, relay_hop_ms=metric.relay_hop_ms)
    rtt = np.where(topo.tunnels, topo.rtt_ms(), np.inf)
    np.fill_diagonal(rtt, 0.0)
    return Plan(topo, metric, cost, rtt, tables)


@dataclass
class Hop:
    src: str
    dst: str
    rtt_ms: float
    cost_ms: float


@dataclass
class PathInfo:
    src: str
    dst: str
    hops: list[Hop]
    rtt_ms: float  # sum of the hops' underlay RTTs
    cost_ms: float  # metric cost, relay hops included
    direct_rtt_ms: float  # inf when the pair has no tunnel
    direct_cost_ms: float

    @property
    def relays(self) -> list[str]:
        return [h.dst for h in self.hops[:-1]]

    @property
    def gain_ms(self) -> float:
        return self.direct_rtt_ms - self.rtt_ms


class _Rows:
    """A plan's matrices as Python lists: a pair's path is walked entry by entry, and
    numpy's per-element indexing costs more than the walk (2,652 pairs at 52 nodes)."""

    def __init__(self, p: Plan) -> None:
        self.names = p.topo.names
        self.next_hop: list[list[int]] = p.tables.next_hop.tolist()
        self.rtt: list[list[float]] = p.rtt.tolist()
        self.link_cost: list[list[float]] = p.link_cost.tolist()
        self.cost: list[list[float]] = p.tables.cost.tolist()

    def path(self, s: int, d: int) -> list[int]:
        """``RouteTables.path``: node indices from s to d, [] if unreachable."""
        if s == d:
            return [s]
        out = [s]
        cur = s
        n = len(self.names)
        while cur != d:
            cur = self.next_hop[cur][d]
            if cur == NO_ROUTE or len(out) > n:
                return []
            out.append(cur)
        return out

    def path_info(self, i: int, j: int) -> PathInfo:
        idx = self.path(i, j)
        names = self.names
        hops = [
            Hop(names[x], names[y], self.rtt[x][y], self.link_cost[x][y])
            for x, y in itertools.pairwise(idx)
        ]
        return PathInfo(
            src=names[i],
            dst=names[j],
            hops=hops,
            rtt_ms=sum(h.rtt_ms for h in hops) if idx else float("inf"),
            cost_ms=self.cost[i][j],
            direct_rtt_ms=self.rtt[i][j],
            direct_cost_ms=self.link_cost[i][j],
        )


def path_info(p: Plan, a: str, b: str) -> PathInfo:
    return _Rows(p).path_info(p.topo.index(a), p.topo.index(b))


@dataclass
class RouteEntry:
    dst: str
    next_hop: str | None
    backup: str | None
    path: list[str]
    rtt_ms: float
    cost_ms: float
    direct_rtt_ms: float


def node_routes(p: Plan, node: str) -> list[RouteEntry]:
    """The next-hop table ``node`` would install, one entry per destination."""
    s = p.topo.index(node)
    rows = _Rows(p)
    names = rows.names
    backup = p.tables.backup.tolist() if p.tables.backup is not None else None
    out: list[RouteEntry] = []
    for d in range(p.topo.n):
        if d == s:
            continue
        nh = rows.next_hop[s][d]
        bk = backup[s][d] if backup is not None else NO_ROUTE
        info = rows.path_info(s, d)
        out.append(
            RouteEntry(
                dst=names[d],
                next_hop=None if nh == NO_ROUTE else names[nh],
                backup=None if bk == NO_ROUTE else names[bk],
                path=[info.src, *[h.dst for h in info.hops]],
                rtt_ms=info.rtt_ms,
                cost_ms=info.cost_ms,
                direct_rtt_ms=info.direct_rtt_ms,
            )
        )
    return out


def relay_gains(p: Plan, top: int = 10) -> GainSummary:
    """Pairs whose best route relays, and the RTT it saves over the direct tunnel."""
    n = p.topo.n
    routed = reduce_paths(p.tables.next_hop, p.rtt)
    relayed = (p.tables.next_hop != np.arange(n)[None, :]) & (p.tables.next_hop != NO_ROUTE)
    return summarize_gains(p.topo.names, p.rtt, routed, routed, relayed, p.tables.path, top)


def relay_paths(p: Plan) -> list[list[str]]:
    """Every relayed route (three or more nodes) as names; a path whose way back is the
    same nodes reversed is listed once, from its first node in topology order."""
    names = p.topo.names
    seen: set[tuple[int, ...]] = set()
    out: list[list[str]] = []
    for i, j in itertools.permutations(range(p.topo.n), 2):
        idx = tuple(p.tables.path(i, j))
        if len(idx) < 3 or idx[::-1] in seen:
            continue
        seen.add(idx)
        out.append([names[k] for k in idx])
    return out
