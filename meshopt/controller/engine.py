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
* Backup next hops, bulk next hops and bulk TCP settings have hysteresis too (a set
  changed only by noise is re-signed and re-sent to its node for nothing: 84 kB each at
  250 nodes, issue 15). A backup that is still a loop-free alternate stays unless a new
  one is better by the policy's margins; a bulk next hop stays while its path is as wide
  and not worse by those margins (loops from mixing old and new entries are repaired);
  TCP settings stay while the path is the same and its RTT and rate moved by less than
  ``TUNING_TOLERANCE``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import logging
import math
import socket
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from meshopt.bus.messages import MAX_ROUTES, Counters, Route, RouteSet
from meshopt.controller.backups import gain_margin, sticky_backups
from meshopt.controller.bulk_memory import BulkMemory, Tuned
from meshopt.controller.deaths import DeathWatch
from meshopt.controller.view import Matrices, MeshView
from meshopt.errors import MeshoptError
from meshopt.install.tuning import MIN_MTU, TcpTuning, tcp_tuning
from meshopt.policy import (
    BoolArray,
    Decision,
    Installed,
    PolicyConfig,
    decide,
    keep_where,
    path_cost,
    reaches,
    reindex,
)
from meshopt.routing.backup import add_backups
from meshopt.routing.incremental import IncrementalRoutes
from meshopt.routing.tables import (
    NO_ROUTE,
    FloatArray,
    IntArray,
    RouteTables,
    reduce_paths,
    relay_weights,
)
from meshopt.routing.widest import bandwidth_levels, widest_routes

log = logging.getLogger("meshopt.controller")
Int32Array = npt.NDArray[np.int32]


class RouteSetError(MeshoptError):
    """One node's route set cannot be built or would not pass the bus checks."""


# What building one node's routes may raise on hostile or broken input; caught per node.
NODE_ERRORS = (MeshoptError, ValueError, ArithmeticError)
# A bulk route keeps its TCP settings while its RTT and rate stay within this factor of
# the values they were computed from (1 % noise must not re-send a route set).
TUNING_TOLERANCE = 1.25
# A path in use that got this much worse than the best one (its cost at least
# 1 / (1 - DEGRADED_REL) = 2.5 times the best's, and DEGRADED_ABS_MS more) skips the hold: a
# large degradation is not flapping, and waiting out a 30 s hold on it is what users of
# the anchors complain about. The policy's margins and noise test still apply.
DEGRADED_REL = 0.6
DEGRADED_ABS_MS = 10.0


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
    backup: IntArray | None = None  # the backup next hop each route carries (NO_ROUTE: none)
    bulk_paths: _BulkPaths | None = None
    degraded: BoolArray | None = None  # entries moved off a path gone much worse (urgent)
    errors: dict[str, str] = field(default_factory=dict)
    dropped: Counter[str] = field(default_factory=Counter)
    policy: PolicyConfig | None = None  # the policy the decision ran with
    # Node -> (its route list, the offsets of each destination's routes in it), for
    # lists laid out by destination with no prefix claimed twice (the urgent path then
    # reads only the moved destinations' routes: ``core._patched_at``).
    layouts: dict[str, tuple[list[Route], Int32Array]] = field(default_factory=dict)


def _symmetrize(cost: FloatArray) -> FloatArray:
    out: FloatArray = (cost + cost.T) / 2.0
    return out


def direct_installed(cost: FloatArray) -> Installed:
    n = cost.shape[0]
    nh = np.where(np.isfinite(cost), np.arange(n)[None, :], NO_ROUTE).astype(np.int64)
    np.fill_diagonal(nh, np.arange(n))
    return Installed(next_hop=nh, since=np.full((n, n), -np.inf))


def startup_policy(
    policy: PolicyConfig,
    first_seen: float | None,
    now: float,
    startup_s: float,
    startup_hold_s: float,
) -> PolicyConfig | None:
    """The policy for the start-up phase (``startup_s`` after the first telemetry), None
    after it: the first routes rest on young estimates, so better ones replace them
    after a short hold and a short confirm time instead of the full ones."""
    if first_seen is None or now - first_seen >= startup_s:
        return None
    return dataclasses.replace(
        policy,
        hold_s=min(policy.hold_s, startup_hold_s),
        confirm_s=min(policy.confirm_s, startup_hold_s),
    )


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
        # What the last compute handed out, for hysteresis (names as in self.names).
        self._backup: IntArray | None = None
        self._bulk: IntArray | None = None
        self._tuning = BulkMemory()
        self._rows = _RowCache()
        # Called between the steps of a compute and between rows of the route sets: the
        # daemon's hook that holds a full pass while urgent route sets wait on its loop
        # (at 1000 nodes the pass's Python took half the GIL from the loop signing them).
        self.checkpoint: Callable[[], None] = _no_pause
        # Cumulative over all computes: "route_set_error" (a node left out, once per
        # compute) and Computed.dropped's reasons; the first of each reason is logged.
        self.counters = Counters("controller left routes out", log)
        # Links seen dying, for the nodes that collapse (meshopt.controller.deaths); the
        # urgent path notes the deaths it hears of too.
        self.deaths = DeathWatch()

    def _routes(self, names: list[str], cost: FloatArray, backups: bool = True) -> RouteTables:
        weights = _symmetrize(cost) if self.symmetric else cost
        if self._inc is None or names != self._inc.tables.names:
            self._inc = IncrementalRoutes(
                weights, names, relay_hop_ms=self.relay_hop_ms, symmetric=self.symmetric
            )
            self.stats["full"] += 1
        else:
            old = self._inc.link_cost
            same = (old == weights) | (np.isinf(old) & np.isinf(weights))
            ii, jj = np.nonzero(np.triu(~same, 1) if self.symmetric else ~same)
            # Counted before listed: a snapshot's noise moves ~n links (62,000 pairs
            # listed per recompute at 250 nodes, for a full recompute anyway).
            pairs: list[tuple[int, int]] = []
            if ii.size <= self.max_incremental:
                pairs = list(zip(ii.tolist(), jj.tolist(), strict=True))
            if ii.size > self.max_incremental:
                self._inc = IncrementalRoutes(
                    weights, names, relay_hop_ms=self.relay_hop_ms, symmetric=self.symmetric
                )
                self.stats["full"] += 1
            else:
                for i, j in pairs:
                    self._inc.update_link(i, j, float(weights[i, j]))
                self.stats["incremental"] += 1
                self.stats["links_updated"] += len(pairs)
        if not backups:
            return self._inc.tables
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
        # The hold the last controller kept is not in the retained sets: start one now, so
        # a take-over does not undo what it held (failures and far worse paths still move).
        inst.since = np.full_like(inst.since, float(now))
        n = len(names)
        backup = np.full((n, n), NO_ROUTE, dtype=np.int64)
        bulk = np.full((n, n), NO_ROUTE, dtype=np.int64)
        np.fill_diagonal(bulk, np.arange(n))
        tuned: list[tuple[int, int, Route]] = []
        for s_name, rs in route_sets.items():
            s = index.get(s_name)
            if s is None:
                continue
            for r in rs.routes:
                d_name = owner_of_addr.get(r.dst)
                via = owner_of_key.get(r.via)
                if d_name not in index or via not in index:
                    continue
                d = index[d_name]
                if r.table == "fast":
                    inst.next_hop[s, d] = index[via]
                    b = owner_of_key.get(r.backup) if r.backup else None
                    if b in index:
                        backup[s, d] = index[b]
                elif r.table == "bulk":
                    bulk[s, d] = index[via]
                    tuned.append((s, d, r))
        self.names = names
        self.installed = inst
        # The backups, bulk paths and TCP settings agents have are the hysteresis's
        # starting point too, so the take-over re-sends nothing that did not change.
        self._backup, self._bulk = backup, bulk
        self._tuning = BulkMemory()
        self._tuning.align(names, [_first(view, x) for x in names])
        self._rows = _RowCache()
        for s, d, r in tuned:
            walk = _walk(bulk, s, d)
            if walk[-1] != d:
                continue
            rtt, bw, pmtus = _path_values(m, walk)
            pmtu = min(pmtus) if pmtus else 0
            t: TcpTuning | None = None
            if r.mtu is not None and r.advmss is not None:
                t = TcpTuning(
                    mtu=r.mtu,
                    advmss=r.advmss,
                    window=r.window,
                    initcwnd=r.initcwnd,
                    initrwnd=r.initrwnd,
                )
            self._tuning.put(names[s], d, r.dst, Tuned(len(walk) - 1, pmtu, rtt, bw, t))

    def decide(
        self,
        m: Matrices,
        now: float,
        policy: PolicyConfig | None = None,
        *,
        backups: bool = True,
    ) -> tuple[RouteTables, Decision, BoolArray, Installed]:
        """The engine's decision on the routing matrices alone (no view, no route sets):
        (best routes, the policy's decision, entries released from their hold because
        their path got far worse, the installed routes before). :meth:`compute` builds
        the route sets from it; the simulator calls it with matrices of simulated
        telemetry (``backups=False``: it computes the rows fail-over needs itself)."""
        names = m.names
        if self.installed is None:
            self.installed = direct_installed(m.cost)
        elif names != self.names:
            self._backup = self._bulk = None  # membership changed: every set changes anyway
            # Joining nodes have no route set yet: their pairs are on the direct tunnel.
            moved = reindex(self.installed, self.names, names)
            direct = direct_installed(m.cost)
            fresh = (moved.next_hop == NO_ROUTE) & (direct.next_hop != NO_ROUTE)
            moved.next_hop = np.where(fresh, direct.next_hop, moved.next_hop)
            self.installed = moved
        self.names = names
        self.checkpoint()
        best = self._routes(names, m.cost, backups)
        self.checkpoint()
        before = self.installed
        released = degraded(before, best, m.cost, self.relay_hop_ms, self.symmetric)
        self.deaths.observe(names, m.cost, now)
        chosen = best
        held = self.deaths.collapsing(names, now)
        if held.any():
            tunnel = np.isfinite(m.cost) | self.deaths.noted(names)
            chosen = towards_collapsing(
                best, before.next_hop, held, m.cost, tunnel, self.relay_hop_ms, self.symmetric
            )
        dec = decide(
            Installed(
                next_hop=before.next_hop,
                since=np.where(released, -np.inf, before.since),
                better_since=before.better_since,
            ),
            chosen,
            m.cost,
            m.noise,
            now,
            policy or self.policy,
            relay_hop_ms=self.relay_hop_ms,
            symmetric=self.symmetric,
            link_jitter=m.jitter,  # paths' jitter as a root-sum-square, not summed
        )
        # A switch forced by a failure is not a preference: it is not held, so the
        # route can move to the best path as soon as the measurements justify it.
        dec.installed.since = np.where(dec.failed, -np.inf, dec.installed.since)
        # A released entry the policy did not move keeps its hold.
        dec.installed.since = np.where(released & ~dec.changed, before.since, dec.installed.since)
        self.installed = dec.installed
        return best, dec, released, before

    def compute(self, view: MeshView, now: float, policy: PolicyConfig | None = None) -> Computed:
        """One decision; ``policy`` overrides the engine's (e.g. a short start-up hold)."""
        m = view.matrices(now)
        names = m.names
        best, dec, released, before = self.decide(m, now, policy)
        self.checkpoint()
        pol = policy or self.policy
        out = Computed(names=names, matrices=m, best=best, decision=dec, policy=pol)
        out.degraded = released & dec.changed
        if not self.symmetric:
            out.backup = sticky_backups(
                self._backup, best, dec.installed.next_hop, m.cost, pol, self.relay_hop_ms
            )
            self._backup = out.backup
        if self.bulk and self.symmetric:
            # One AllowedIPs set per destination: bulk traffic takes the fast next hop,
            # in its own table only for the per-route TCP settings.
            out.bulk_next_hop = dec.installed.next_hop
        elif self.bulk:
            bw = np.where(m.bandwidth > 0, m.bandwidth, np.nan)
            self.checkpoint()
            fresh = widest_routes(bw, m.cost, names, relay_hop_ms=self.relay_hop_ms).next_hop
            self.checkpoint()
            out.bulk_next_hop = sticky_bulk(self._bulk, fresh, bw, m.cost, pol, self.relay_hop_ms)
            self._bulk = out.bulk_next_hop
        self.checkpoint()
        out.routes = route_sets(view, out, self._tuning, self._rows, self.checkpoint)
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


def towards_collapsing(
    best: RouteTables,
    installed: IntArray,
    held: BoolArray,
    cost: FloatArray,
    tunnel: BoolArray,
    relay_hop_ms: float,
    symmetric: bool = False,
) -> RouteTables:
    """``best`` with the entries towards collapsing nodes (``held``) replaced: an
    installed path that still works stays, a broken one falls back to the plain tunnel
    where there is one (``tunnel``: alive, or noted dead), as the agent's fail-over does;
    without a tunnel it takes ``best`` (see :mod:`meshopt.controller.deaths`). In
    symmetric mode a pair is decided as one, so both directions of every pair with a
    collapsing end are treated alike and the table stays symmetric. A copy: ``best`` is
    the engine's own."""
    n = installed.shape[0]
    if symmetric:
        cost = _symmetrize(cost)
    with np.errstate(invalid="ignore"):
        works = np.isfinite(path_cost(installed, cost, relay_hop_ms))
    pairs = np.broadcast_to(held[None, :], (n, n))
    if symmetric:
        pairs = pairs | pairs.T
        works = works & works.T
        tunnel = tunnel | tunnel.T
    direct = np.broadcast_to(np.arange(n)[None, :], (n, n))
    fallback = np.where(tunnel, direct, best.next_hop)
    hop = np.where(pairs, np.where(works, installed, fallback), best.next_hop)
    np.fill_diagonal(hop, np.arange(n))
    return dataclasses.replace(best, next_hop=hop.astype(best.next_hop.dtype, copy=False))


def _no_pause() -> None:
    """The engine's checkpoint where nothing waits for the thread that runs it."""


def degraded(
    installed: Installed, best: RouteTables, cost: FloatArray, relay_hop_ms: float, symmetric: bool
) -> BoolArray:
    """Entries whose installed path costs ``DEGRADED_*`` more than the best one now."""
    if symmetric:
        cost = _symmetrize(cost)
    with np.errstate(invalid="ignore"):
        cur = path_cost(installed.next_hop, cost, relay_hop_ms)
        new = path_cost(best.next_hop, cost, relay_hop_ms)
        gain = cur - new
        out: BoolArray = (
            np.isfinite(cur)
            & np.isfinite(new)
            & (gain >= DEGRADED_ABS_MS)
            & (gain >= DEGRADED_REL * cur)
        )
    if symmetric:
        out = out | out.T
    return out


def sticky_bulk(
    prev: IntArray | None,
    fresh: IntArray,
    bandwidth: FloatArray,
    cost: FloatArray,
    policy: PolicyConfig,
    relay_hop_ms: float = 2.0,
) -> IntArray:
    """Bulk next hops with hysteresis: an entry keeps its previous next hop while that
    path still arrives over live links, is at least as wide (bandwidth buckets, as
    ``widest_routes`` compares them) and the fresh path is not cheaper by the policy's
    margins. Entries whose walk a mix of old and new would break take the fresh one."""
    n = fresh.shape[0]
    if prev is None or prev.shape != (n, n):
        return fresh
    w = relay_weights(cost, relay_hop_ms)
    old_cost = reduce_paths(prev, w)
    new_cost = reduce_paths(fresh, w)
    levels = bandwidth_levels(bandwidth).astype(np.float64)
    np.fill_diagonal(levels, np.inf)
    old_level = reduce_paths(prev, levels, "min")
    new_level = reduce_paths(fresh, levels, "min")
    with np.errstate(invalid="ignore"):
        keep = (
            reaches(prev)
            & np.isfinite(old_cost)
            & (old_level >= new_level)
            & ~(new_cost < old_cost - gain_margin(old_cost, policy))
        )
    return keep_where(prev, fresh, keep)


@dataclass
class _RowCache:
    """Each node's last routes and what they were built from: at 250 nodes building
    every set from scratch cost a second or more per recompute, and most rows do not
    change from one recompute to the next."""

    sig: object = None  # names, addresses, keys: any change rebuilds every row
    rows: dict[str, _Row] = field(default_factory=dict)


@dataclass(frozen=True)
class _Chunks:
    """A row's routes in destination order, destination ``d``'s at
    ``flat[off[d]:off[d + 1]]``: one list and an array per row where a list per
    destination cost a million lists (140 MB) at 1000 nodes."""

    flat: list[Route]
    off: Int32Array  # n + 1 offsets

    def of(self, d: int) -> list[Route]:
        return self.flat[int(self.off[d]) : int(self.off[d + 1])]


@dataclass
class _Row:
    """One node's routes per destination and what they were built from."""

    inputs: Int32Array  # _row_inputs: per destination, a change rebuilds its routes
    peers: bytes  # _peers_digest of the node's peer keys
    chunks: _Chunks  # the routes by destination, before duplicates are left out
    routes: list[Route]
    base: FloatArray
    dropped: Counter[str]


def _peers_digest(keys: list[str]) -> bytes:
    """What a row's routes depend on of its node's peer keys, in 16 bytes (a frozenset
    of 999 keys per row cost ~40 MB at 1000 nodes). Order counts: a reordered list only
    rebuilds the row."""
    return hashlib.blake2b("\n".join(keys).encode(), digest_size=16).digest()


def _row_inputs(c: Computed, s: int, online: IntArray) -> Int32Array:
    """Everything per destination that row ``s``'s routes are made of (but the keys and
    the bulk settings, checked apart). Node indices fit 32 bits: half the memory of
    the row cache's copies (1000 rows at 1000 nodes)."""
    parts = [
        c.decision.installed.next_hop[s],
        np.isfinite(c.matrices.cost[s]).astype(np.int64),
        online,
    ]
    if c.backup is not None:
        parts.append(c.backup[s])
    elif c.best.backup is not None:
        parts += [c.best.backup[s], c.best.next_hop[s]]
    if c.bulk_next_hop is not None:
        parts.append(c.bulk_next_hop[s])
    out: Int32Array = np.stack([np.asarray(p, dtype=np.int32) for p in parts])
    return out


def _first(view: MeshView, name: str) -> str | None:
    """A node's first prefix (the one whose bulk settings :class:`BulkMemory` keeps in
    its arrays)."""
    addrs = view.nodes[name].addresses
    return addrs[0] if addrs else None


def _row_tuning_holds(paths: _BulkPaths | None, s: int, base: FloatArray) -> BoolArray:
    """Per destination: every bulk setting of row ``s`` would be kept (``_sticky_tuning``)."""
    n = base.shape[1]
    if paths is None:
        return np.ones(n, dtype=bool)
    off = np.isnan(base[0])
    rtt = np.where(np.isfinite(paths.rtt[s]), paths.rtt[s], np.nan)
    bw = np.where(paths.bw[s] > 0, paths.bw[s], np.nan)

    def close(a: FloatArray, b: FloatArray) -> BoolArray:
        with np.errstate(invalid="ignore", divide="ignore"):
            r = a / b
            ok: BoolArray = (
                (np.isnan(a) & np.isnan(b))
                | (a == b)
                | ((a > 0) & (b > 0) & (r >= 1 / TUNING_TOLERANCE) & (r <= TUNING_TOLERANCE))
            )
        return ok

    with np.errstate(invalid="ignore"):
        pmtu = np.where(np.isfinite(paths.pmtu[s]), paths.pmtu[s], -1.0).astype(np.int64)
        same = (paths.hops[s] == base[0]) & (pmtu == base[1])
    out: BoolArray = off | (same & close(rtt, base[2]) & close(bw, base[3]))
    return out


def route_sets(
    view: MeshView,
    c: Computed,
    tuned: BulkMemory | None = None,
    cache: _RowCache | None = None,
    checkpoint: Callable[[], None] | None = None,
) -> dict[str, list[Route]]:
    """The routes of every online node, by name; next hops named by the keys it knows.

    A node whose set fails to build is left out and named in ``c.errors``; routes left
    out of a set are counted in ``c.dropped``. ``tuned`` remembers each bulk route's TCP
    settings between calls (hysteresis, see ``TUNING_TOLERANCE``).
    """
    tuned = BulkMemory() if tuned is None else tuned
    tuned.align(c.names, [_first(view, x) for x in c.names])
    if c.bulk_next_hop is not None:
        c.bulk_paths = _BulkPaths.of(c.bulk_next_hop, c.matrices)
    owner = view.node_of_key()
    index = {n: i for i, n in enumerate(c.names)}
    out: dict[str, list[Route]] = {}
    online = np.array([view.nodes[n].online for n in c.names], dtype=np.int64)
    # Each destination's prefixes once per table: a set can only hold a duplicate route
    # where two online nodes claim one prefix (checked per row then, 0.4 s at 1000 nodes).
    claimed = [a for n in c.names if view.nodes[n].online for a in view.nodes[n].addresses]
    unique = len(set(claimed)) == len(claimed)
    if cache is not None:
        sig = (
            tuple(c.names),
            tuple(tuple(view.nodes[n].addresses) for n in c.names),
            frozenset(owner.items()),
        )
        if sig != cache.sig:
            cache.sig = sig
            cache.rows.clear()
    for s, s_name in enumerate(c.names):
        if not view.nodes[s_name].online:
            continue
        if checkpoint is not None:
            checkpoint()
        row = cache.rows.get(s_name) if cache is not None else None
        inputs = _row_inputs(c, s, online)
        peers = _peers_digest(view.nodes[s_name].peer_keys())
        redo: BoolArray | None = None
        prev: _Chunks | None = None
        if row is not None and row.peers == peers:
            redo = (inputs != row.inputs).any(axis=0) | ~_row_tuning_holds(
                c.bulk_paths, s, row.base
            )
            if not redo.any():
                out[s_name] = row.routes
                if unique and row.routes is row.chunks.flat:
                    c.layouts[s_name] = (row.routes, row.chunks.off)
                c.dropped.update(row.dropped)
                continue
            prev = row.chunks
        before = Counter(c.dropped)
        try:
            routes, chunks = _node_routes(
                view, c, s, owner, index, tuned, prev, redo, unique=unique
            )
        except NODE_ERRORS as exc:
            c.errors[s_name] = f"{type(exc).__name__}: {exc}"
            if cache is not None:
                cache.rows.pop(s_name, None)
            continue
        if row is not None and routes == row.routes:
            routes = row.routes  # one list for the cache, the plan and what is intended
            if unique:
                chunks = row.chunks  # the same routes cut the same way
        out[s_name] = routes
        if unique and routes is chunks.flat:
            c.layouts[s_name] = (routes, chunks.off)
        if cache is not None:
            base = tuned.base(s_name)
            cache.rows[s_name] = _Row(inputs, peers, chunks, routes, base, c.dropped - before)
    return out


def _node_routes(
    view: MeshView,
    c: Computed,
    s: int,
    owner: Mapping[str, str],
    index: Mapping[str, int],
    tuned: BulkMemory,
    prev: _Chunks | None = None,
    redo: BoolArray | None = None,
    *,
    unique: bool = False,
) -> tuple[list[Route], _Chunks]:
    """Row ``s``'s routes, and the same by destination; with ``prev``, destinations not
    marked in ``redo`` take their routes from it. ``unique``: no two online nodes share
    a prefix (no duplicate to look for).

    Only the destinations to build are visited, and the others are copied a run of
    destinations at a time: a noise pass at 1000 nodes rebuilds ~100 of a row's 999,
    and a Python step per destination and row cost 1.6 s a pass."""
    names = c.names
    nh = c.decision.installed.next_hop[s].tolist()
    backup = c.best.backup
    info = view.nodes[names[s]]
    key_for = {index[o]: k for k in info.peer_keys() if (o := owner.get(k)) is not None}
    n = len(names)
    if prev is not None and redo is not None and prev.off.shape[0] == n + 1:
        todo = np.flatnonzero(redo).tolist()
        prev_off = prev.off.tolist()
    else:
        prev = None
        todo = list(range(n))
        prev_off = []
    built: dict[int, list[Route]] = {}
    paths_row = c.bulk_paths.row(s) if c.bulk_paths is not None else None
    bulk_nh = c.bulk_next_hop[s].tolist() if c.bulk_next_hop is not None else None
    backup_row = c.backup[s].tolist() if c.backup is not None else None
    nodes = view.nodes
    for d in todo:
        d_name = names[d]
        built[d] = []
        if d == s or not nodes[d_name].online:
            continue
        hop = nh[d]
        if hop == NO_ROUTE or hop not in key_for:
            continue
        out = built[d]
        add = out.append
        if c.best.symmetric:
            # Single-interface meshes: AllowedIPs are also the inbound filter, so both
            # ends must fall back the same way. Both see the shared relay die and both
            # take the direct tunnel; a loop-free alternate of one end need not be
            # the other's.
            b = d if np.isfinite(c.matrices.cost[s, d]) else NO_ROUTE
        elif backup_row is not None:
            b = backup_row[d]
        else:
            b = int(backup[s, d]) if backup is not None else NO_ROUTE
            if b == hop:
                # The policy kept another next hop than the best one, and the best's
                # alternate is that kept hop: the best next hop is the alternate then.
                b = int(c.best.next_hop[s, d])
        b_key = key_for.get(b) if b not in (NO_ROUTE, hop) else None
        addresses = nodes[d_name].addresses
        for addr in addresses:
            add(Route(dst=addr, via=key_for[hop], backup=b_key))
        if bulk_nh is not None and c.bulk_paths is not None:
            bh = bulk_nh[d]
            if bh != NO_ROUTE and bh in key_for:
                for addr in addresses:
                    t = _sticky_tuning(tuned, names[s], d, addr, c.bulk_paths, s, paths_row)
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
        # A destination rebuilt to the routes it had keeps the old objects: the sets
        # agents hold, the sets intended and the row cache then share their Routes
        # instead of holding a copy each (at 1000 nodes two million per copy), and the
        # new ones are freed at once rather than scattered among long-lived objects.
        if prev is not None and out:
            a, b = prev_off[d], prev_off[d + 1]
            if b - a == len(out) and (old := prev.flat[a:b]) == out:
                built[d] = old
    lengths: IntArray
    if prev is None:
        flat = list(itertools.chain.from_iterable(built.get(d, ()) for d in range(n)))
        lengths = np.array([len(built.get(d, ())) for d in range(n)], dtype=np.int64)
    else:
        flat = []
        lengths = np.diff(prev.off).astype(np.int64)
        last = 0  # the first destination whose old routes are not copied yet
        for d in todo:
            flat += prev.flat[prev_off[last] : prev_off[d]]
            flat += built[d]
            lengths[d] = len(built[d])
            last = d + 1
        flat += prev.flat[prev_off[last] :]
    off: Int32Array = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=off[1:])
    chunks = _Chunks(flat, off)
    routes = flat
    if not unique:
        fast = [r.dst for r in routes if r.table == "fast"]
        bulk = [r.dst for r in routes if r.table != "fast"]
        if len(set(fast)) != len(fast) or len(set(bulk)) != len(bulk):
            # The view gives every prefix one owner; should two destinations still
            # share one, the first keeps it: a second route to it makes the set invalid.
            seen: set[tuple[str, str]] = set()
            kept = []
            for r in routes:
                if (r.dst, r.table) in seen:
                    c.dropped["duplicate_route"] += 1
                    continue
                seen.add((r.dst, r.table))
                kept.append(r)
            routes = kept
    if len(routes) > MAX_ROUTES:
        raise RouteSetError(f"{len(routes)} routes, more than a route set holds ({MAX_ROUTES})")
    return routes, chunks


def _walk(next_hop: IntArray, s: int, d: int) -> list[int]:
    path = [s]
    while path[-1] != d and len(path) <= next_hop.shape[0]:
        nxt = int(next_hop[path[-1], d])
        if nxt == NO_ROUTE or nxt in path:
            break
        path.append(nxt)
    return path


@dataclass(frozen=True)
class _BulkPaths:
    """What tuning reads of every bulk path, for all pairs at once (a Python walk per
    pair cost seconds at 250 nodes): hop count, RTT sum and smallest rate and PMTU."""

    hops: FloatArray
    rtt: FloatArray  # inf: a hop unmeasured
    bw: FloatArray  # 0: a hop without a rate
    pmtu: FloatArray

    def row(self, s: int) -> tuple[list[float], list[float], list[float], list[float]]:
        """Row ``s`` of hops, RTT, rate and PMTU as Python lists."""
        return (
            self.hops[s].tolist(),
            self.rtt[s].tolist(),
            self.bw[s].tolist(),
            self.pmtu[s].tolist(),
        )

    @classmethod
    def of(cls, next_hop: IntArray, m: Matrices) -> _BulkPaths:
        n = next_hop.shape[0]
        diag = np.eye(n, dtype=bool)
        ones = np.where(diag, 0.0, 1.0)
        rtt = np.where(diag, 0.0, np.where(np.isfinite(m.rtt), m.rtt, np.inf))
        with np.errstate(invalid="ignore"):
            bw = np.where(diag, np.inf, np.where(m.bandwidth > 0, m.bandwidth, 0.0))
        pmtu = np.where(diag, np.inf, np.asarray(m.pmtu, dtype=np.float64))
        return cls(
            hops=reduce_paths(next_hop, ones),
            rtt=reduce_paths(next_hop, rtt),
            bw=reduce_paths(next_hop, bw, "min"),
            pmtu=reduce_paths(next_hop, pmtu, "min"),
        )


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    if a <= 0 or b <= 0:
        return a == b
    return 1 / TUNING_TOLERANCE <= a / b <= TUNING_TOLERANCE


def _sticky_tuning(
    tuned: BulkMemory,
    s_name: str,
    d: int,
    addr: str,
    paths: _BulkPaths,
    s: int,
    row: tuple[list[float], list[float], list[float], list[float]] | None = None,
) -> TcpTuning | None:
    """``bulk_tuning``, unless the path's RTT and rate are still close to the values its
    last settings came from (same hop count and PMTU): then those settings (no new route
    set for noise). ``row``: row ``s`` of the paths' hops, RTT, rate and PMTU as lists
    (:meth:`_BulkPaths.row`; a numpy scalar read per pair cost seconds at 1000 nodes)."""
    if row is None:
        row = paths.row(s)
    hops, r, b, pm = row[0][d], row[1][d], row[2][d], row[3][d]
    if not math.isfinite(hops) or hops < 1:
        return None
    rtt = r if math.isfinite(r) else None
    bw = b if b > 0 else None
    pmtu = int(pm)
    old = tuned.get(s_name, d, addr)
    if (
        old is not None
        and old.hops == int(hops)
        and old.pmtu == pmtu
        and _close(old.rtt, rtt)
        and _close(old.bw, bw)
    ):
        return old.tuning
    t = _tuning(rtt, bw, (pmtu,) * int(hops), addr, int(hops))
    tuned.put(s_name, d, addr, Tuned(int(hops), pmtu, rtt, bw, t))
    return t


def _path_values(
    m: Matrices, path: list[int]
) -> tuple[float | None, float | None, tuple[int, ...]]:
    """Measured RTT (sum), bottleneck rate and per-hop PMTUs along ``path``."""
    hops = list(itertools.pairwise(path))
    rtts = [m.rtt[a, b] for a, b in hops]
    rtt = float(sum(rtts)) if all(np.isfinite(rtts)) else None
    bws = [m.bandwidth[a, b] for a, b in hops]
    bw = float(min(bws)) if all(x > 0 for x in bws) else None
    return rtt, bw, tuple(int(m.pmtu[a, b]) for a, b in hops)


def bulk_tuning(m: Matrices, path: list[int], dst: str) -> TcpTuning | None:
    """Route attributes for the bulk route along ``path`` (measured RTT, bottleneck rate).

    Each hop is its own WireGuard tunnel (the relay re-encrypts), so the MTU is the
    narrowest hop's, minus the overhead, not the sum of overheads.
    """
    if len(path) < 2:
        return None
    rtt, bw, pmtus = _path_values(m, path)
    return _tuning(rtt, bw, pmtus, dst, len(path) - 1)


def _tuning(
    rtt: float | None, bw: float | None, pmtus: tuple[int, ...], dst: str, n_hops: int
) -> TcpTuning | None:
    if n_hops < 1:
        return None
    # Coarse steps (RTT to a power of two, rate to a power of 1.25): the windows change
    # when the path does, not with every measurement (each change is a new route set).
    # A zero RTT (a rounded loopback) or a rate that rounds to nothing tunes nothing.
    rtt = float(2 ** math.ceil(math.log2(rtt))) if rtt is not None and rtt > 0 else None
    if bw is not None:
        bw = float(1.25 ** math.floor(math.log(bw, 1.25)))
        bw = bw if bw > 0 else None
    family = socket.AF_INET6 if ":" in dst else socket.AF_INET
    return _quantised_tuning(rtt, bw, pmtus, family, n_hops)


@functools.lru_cache(maxsize=65536)
def _quantised_tuning(
    rtt: float | None, bw: float | None, pmtus: tuple[int, ...], family: int, n_hops: int
) -> TcpTuning:
    """:func:`tcp_tuning` of quantised path values, remembered: the steps are coarse, so
    a 1000-node mesh's million bulk routes take a few hundred distinct values (computing
    each pair's cost 15 s of a recompute there). Every route with the same values shares
    one dict (a million of them cost ~300 MB): read it, never change it."""
    # A path narrower than the family's minimum MTU (an IPv6 route over a 1000-byte
    # path) cannot be tuned to fit: such a measurement counts as none (the default MTU).
    measured = all(pmtus) and min(pmtus) >= MIN_MTU[family]
    return tcp_tuning(
        # A measured PMTU through a tunnel is its underlay MTU minus the overhead.
        [p + 80 for p in pmtus] if measured else None,
        family,
        bw,
        rtt,
        relay_hops=n_hops - 1,
    )
