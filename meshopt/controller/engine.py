"""From the mesh view to one route set per node: the core's engine, policy and backups.

Pure and clocked from outside, like the simulator's controller step (the very same
calls: ``compute_routes``/``IncrementalRoutes``, ``add_backups``, ``decide``), so what
the simulator predicts is what the controller does.

* Before the first decision every pair is taken to be on its direct tunnel, with no
  hold time: that is what agents have before any route set (the plain WireGuard routes),
  so the first relays are installed as soon as measurements justify them, and are not
  frozen for ``hold_s`` on the first, least-settled estimates.
* Link-cost changes are applied to ``IncrementalRoutes`` one link at a time while few
  links changed, with a full recompute otherwise or when nodes join or leave.
* Entries switched because their path failed are not held: the switch was forced, not
  chosen, and the next measurements may show a better path at once.
* A controller taking over from another adopts the installed routes from the retained
  route sets, so the policy's hysteresis survives the hand-over.
* One node's data never stops the others' routes: a node whose route set cannot be built
  is left out of ``Computed.routes`` (it keeps what it has, and so does the policy's
  picture of it) with its reason in ``Computed.errors``; the sets that are built pass
  the bus checks (one route per destination and table, at most ``MAX_ROUTES``), so
  signing and publishing them cannot fail on their content.
"""

from __future__ import annotations

import itertools
import logging
import math
import socket
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from meshopt.bus.messages import MAX_ROUTES, Counters, Route, RouteSet
from meshopt.controller.view import Matrices, MeshView
from meshopt.errors import MeshoptError
from meshopt.install.tuning import MIN_MTU, TcpTuning, tcp_tuning
from meshopt.policy import Decision, Installed, PolicyConfig, decide, reindex
from meshopt.routing.backup import add_backups
from meshopt.routing.incremental import IncrementalRoutes
from meshopt.routing.tables import NO_ROUTE, FloatArray, IntArray, RouteTables
from meshopt.routing.widest import widest_routes

log = logging.getLogger("meshopt.controller")


class RouteSetError(MeshoptError):
    """One node's route set cannot be built or would not pass the bus checks."""


# What building one node's routes may raise on hostile or broken input; caught per node.
NODE_ERRORS = (MeshoptError, ValueError, ArithmeticError)


@dataclass
class Computed:
    """One decision. ``routes`` holds the online nodes whose sets were built; a node in
    ``errors`` (name -> reason) was left out and keeps its previous routes. ``dropped``
    counts single routes left out of otherwise good sets, by reason."""

    names: list[str]
    matrices: Matrices
    best: RouteTables
    decision: Decision
    routes: dict[str, list[Route]] = field(default_factory=dict)
    bulk_next_hop: IntArray | None = None
    errors: dict[str, str] = field(default_factory=dict)
    dropped: Counter[str] = field(default_factory=Counter)


def _symmetrize(cost: FloatArray) -> FloatArray:
    out: FloatArray = (cost + cost.T) / 2.0
    return out


def direct_installed(cost: FloatArray) -> Installed:
    n = cost.shape[0]
    nh = np.where(np.isfinite(cost), np.arange(n)[None, :], NO_ROUTE).astype(np.int64)
    np.fill_diagonal(nh, np.arange(n))
    return Installed(next_hop=nh, since=np.full((n, n), -np.inf))


class RouteEngine:
    def __init__(
        self,
        policy: PolicyConfig,
        *,
        relay_hop_ms: float = 2.0,
        symmetric: bool = False,
        bulk: bool = False,
        max_incremental: int = 8,
    ) -> None:
        self.policy = policy
        self.relay_hop_ms = relay_hop_ms
        self.symmetric = symmetric
        self.bulk = bulk
        self.max_incremental = max_incremental
        self.names: list[str] = []
        self.installed: Installed | None = None
        self._inc: IncrementalRoutes | None = None
        self.stats = {"full": 0, "incremental": 0, "links_updated": 0}
        # Cumulative over all computes: "route_set_error" (a node left out, once per
        # compute) and Computed.dropped's reasons; the first of each reason is logged.
        self.counters = Counters("controller left routes out", log)

    def _routes(self, names: list[str], cost: FloatArray) -> RouteTables:
        weights = _symmetrize(cost) if self.symmetric else cost
        if self._inc is None or names != self._inc.tables.names:
            self._inc = IncrementalRoutes(
                weights, names, relay_hop_ms=self.relay_hop_ms, symmetric=self.symmetric
            )
            self.stats["full"] += 1
        else:
            old = self._inc.link_cost
            same = (old == weights) | (np.isinf(old) & np.isinf(weights))
            ii, jj = np.nonzero(~same)
            pairs = [(i, j) for i, j in zip(ii.tolist(), jj.tolist(), strict=True)]
            if self.symmetric:
                pairs = [(i, j) for i, j in pairs if i < j]
            if len(pairs) > self.max_incremental:
                self._inc = IncrementalRoutes(
                    weights, names, relay_hop_ms=self.relay_hop_ms, symmetric=self.symmetric
                )
                self.stats["full"] += 1
            else:
                for i, j in pairs:
                    self._inc.update_link(i, j, float(weights[i, j]))
                self.stats["incremental"] += 1
                self.stats["links_updated"] += len(pairs)
        return add_backups(self._inc.tables, cost, relay_hop_ms=self.relay_hop_ms)

    def adopt(self, view: MeshView, route_sets: Mapping[str, RouteSet], now: float) -> None:
        """Take the routes other controllers installed as ours (on taking over)."""
        m = view.matrices(now)
        names = m.names
        index = {n: i for i, n in enumerate(names)}
        owner_of_addr = {a: n.name for n in view.nodes.values() for a in n.addresses}
        owner_of_key = view.node_of_key()
        if not route_sets:
            return  # nothing installed anywhere yet: agents are on their direct tunnels
        inst = direct_installed(m.cost)
        for s_name, rs in route_sets.items():
            s = index.get(s_name)
            if s is None:
                continue
            for r in rs.routes:
                d_name = owner_of_addr.get(r.dst)
                via = owner_of_key.get(r.via)
                if r.table == "fast" and d_name in index and via in index:
                    inst.next_hop[s, index[d_name]] = index[via]
        self.names = names
        self.installed = inst

    def compute(self, view: MeshView, now: float, policy: PolicyConfig | None = None) -> Computed:
        """One decision; ``policy`` overrides the engine's (e.g. a short start-up hold)."""
        m = view.matrices(now)
        names = m.names
        if self.installed is None:
            self.installed = direct_installed(m.cost)
        elif names != self.names:
            # Joining nodes have no route set yet: their pairs are on the direct tunnel.
            moved = reindex(self.installed, self.names, names)
            direct = direct_installed(m.cost)
            fresh = (moved.next_hop == NO_ROUTE) & (direct.next_hop != NO_ROUTE)
            moved.next_hop = np.where(fresh, direct.next_hop, moved.next_hop)
            self.installed = moved
        self.names = names
        best = self._routes(names, m.cost)
        before = self.installed
        dec = decide(
            self.installed,
            best,
            m.cost,
            m.noise,
            now,
            policy or self.policy,
            relay_hop_ms=self.relay_hop_ms,
            symmetric=self.symmetric,
        )
        # A switch forced by a failure is not a preference: it is not held, so the
        # route can move to the best path as soon as the measurements justify it.
        dec.installed.since = np.where(dec.failed, -np.inf, dec.installed.since)
        self.installed = dec.installed
        out = Computed(names=names, matrices=m, best=best, decision=dec)
        if self.bulk and self.symmetric:
            # One AllowedIPs set per destination: bulk traffic takes the fast next hop,
            # in its own table only for the per-route TCP settings.
            out.bulk_next_hop = dec.installed.next_hop
        elif self.bulk:
            bw = np.where(m.bandwidth > 0, m.bandwidth, np.nan)
            out.bulk_next_hop = widest_routes(
                bw, m.cost, names, relay_hop_ms=self.relay_hop_ms
            ).next_hop
        out.routes = route_sets(view, out)
        for name, why in out.errors.items():
            # Its agent keeps the routes it has: so must the policy's picture of them.
            s = names.index(name)
            dec.installed.next_hop[s] = before.next_hop[s]
            dec.installed.since[s] = before.since[s]
            if dec.installed.better_since is not None and before.better_since is not None:
                dec.installed.better_since[s] = before.better_since[s]
            self.counters.count("route_set_error", f"{name}: {why}")
        for reason, n in out.dropped.items():
            self.counters.count(reason, n=n)
        return out


def route_sets(view: MeshView, c: Computed) -> dict[str, list[Route]]:
    """The routes of every online node, by name; next hops named by the keys it knows.

    A node whose set fails to build is left out and named in ``c.errors``; routes left
    out of a set are counted in ``c.dropped``.
    """
    owner = view.node_of_key()
    index = {n: i for i, n in enumerate(c.names)}
    out: dict[str, list[Route]] = {}
    for s, s_name in enumerate(c.names):
        if not view.nodes[s_name].online:
            continue
        try:
            out[s_name] = _node_routes(view, c, s, owner, index)
        except NODE_ERRORS as exc:
            c.errors[s_name] = f"{type(exc).__name__}: {exc}"
    return out


def _node_routes(
    view: MeshView, c: Computed, s: int, owner: Mapping[str, str], index: Mapping[str, int]
) -> list[Route]:
    names = c.names
    nh = c.decision.installed.next_hop
    backup = c.best.backup
    info = view.nodes[names[s]]
    key_for: dict[int, str] = {}
    for key in info.peers:
        o = owner.get(key)
        if o is not None:
            key_for[index[o]] = key
    routes: list[Route] = []
    seen: set[tuple[str, str]] = set()

    def add(route: Route) -> None:
        # The view gives every prefix one owner; should two destinations still share
        # one, the first keeps it: a second route to it makes the whole set invalid.
        if (route.dst, route.table) in seen:
            c.dropped["duplicate_route"] += 1
            return
        seen.add((route.dst, route.table))
        routes.append(route)

    for d, d_name in enumerate(names):
        if d == s or not view.nodes[d_name].online:
            continue
        hop = int(nh[s, d])
        if hop == NO_ROUTE or hop not in key_for:
            continue
        if c.best.symmetric:
            # Single-interface meshes: AllowedIPs are also the inbound filter, so both
            # ends must fall back the same way. Both see the shared relay die and both
            # take the direct tunnel; a loop-free alternate of one end need not be
            # the other's.
            b = d if np.isfinite(c.matrices.cost[s, d]) else NO_ROUTE
        else:
            b = int(backup[s, d]) if backup is not None else NO_ROUTE
            if b == hop:
                # The policy kept another next hop than the best one, and the best's
                # alternate is that kept hop: the best next hop is the alternate then.
                b = int(c.best.next_hop[s, d])
        b_key = key_for.get(b) if b not in (NO_ROUTE, hop) else None
        for addr in view.nodes[d_name].addresses:
            add(Route(dst=addr, via=key_for[hop], backup=b_key))
        if c.bulk_next_hop is not None:
            bh = int(c.bulk_next_hop[s, d])
            if bh != NO_ROUTE and bh in key_for:
                walk = _walk(c.bulk_next_hop, s, d)
                for addr in view.nodes[d_name].addresses:
                    t = bulk_tuning(c.matrices, walk, addr)
                    add(
                        Route(
                            dst=addr,
                            via=key_for[bh],
                            table="bulk",
                            mtu=t["mtu"] if t else None,
                            advmss=t["advmss"] if t else None,
                            window=t["window"] if t else None,
                            initcwnd=t["initcwnd"] if t else None,
                            initrwnd=t["initrwnd"] if t else None,
                        )
                    )
    if len(routes) > MAX_ROUTES:
        raise RouteSetError(f"{len(routes)} routes, more than a route set holds ({MAX_ROUTES})")
    return routes


def _walk(next_hop: IntArray, s: int, d: int) -> list[int]:
    path = [s]
    while path[-1] != d and len(path) <= next_hop.shape[0]:
        nxt = int(next_hop[path[-1], d])
        if nxt == NO_ROUTE or nxt in path:
            break
        path.append(nxt)
    return path


def bulk_tuning(m: Matrices, path: list[int], dst: str) -> TcpTuning | None:
    """Route attributes for the bulk route along ``path`` (measured RTT, bottleneck rate).

    Each hop is its own WireGuard tunnel (the relay re-encrypts), so the MTU is the
    narrowest hop's, minus the overhead, not the sum of overheads.
    """
    hops = list(itertools.pairwise(path))
    if not hops:
        return None
    rtts = [m.rtt[a, b] for a, b in hops]
    rtt = float(sum(rtts)) if all(np.isfinite(rtts)) else None
    bws = [m.bandwidth[a, b] for a, b in hops]
    bw = float(min(bws)) if all(x > 0 for x in bws) else None
    # Coarse steps (RTT to a power of two, rate to a power of 1.25): the windows change
    # when the path does, not with every measurement (each change is a new route set).
    # A zero RTT (a rounded loopback) or a rate that rounds to nothing tunes nothing.
    rtt = float(2 ** math.ceil(math.log2(rtt))) if rtt is not None and rtt > 0 else None
    if bw is not None:
        bw = float(1.25 ** math.floor(math.log(bw, 1.25)))
        bw = bw if bw > 0 else None
    pmtus = [int(m.pmtu[a, b]) for a, b in hops]
    family = socket.AF_INET6 if ":" in dst else socket.AF_INET
    # A path narrower than the family's minimum MTU (an IPv6 route over a 1000-byte
    # path) cannot be tuned to fit: such a measurement counts as none (the default MTU).
    measured = all(pmtus) and min(pmtus) >= MIN_MTU[family]
    return tcp_tuning(
        # A measured PMTU through a tunnel is its underlay MTU minus the overhead.
        [p + 80 for p in pmtus] if measured else None,
        family,
        bw,
        rtt,
        relay_hops=len(hops) - 1,
    )
