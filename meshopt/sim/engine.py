"""The simulation loop: a pure function of (topology, events, config, seed), driven by
simulated time, that runs the controller's and the agents' own code.

Time advances in ticks of ``tick_s`` (0.05 s). What happens, and whose code does it:

1. events due change the underlay (the ground truth);
2. every ``probe_interval_s`` (the agent's 0.33 s) one probe per tunnel direction is
   drawn from the underlay (normal noise with the link's jitter as standard deviation,
   as in topology files and the lab's shaper; losses from its loss) and fed, as each
   reply arrives (one RTT after its probe, in the tick it lands in), to the
   agents' estimator (:class:`meshopt.sim.estimator.LinkEstimator`, the agent's
   :mod:`meshopt.estimate` rules vectorised, robust outlier rule included) and the
   prober's window (loss and samples over the last 64 probes, the loss pooled with
   its loss memory as the prober's). With the probe budget
   (``budget``, on as in the agent: :mod:`meshopt.sim.budget`) a link that relays
   nothing, 30 s after its agent's routes last moved, is probed only every idle
   interval (2 s), on its phase (the two ends of a tunnel half an interval apart), and
   fast again while its estimator has outliers to confirm. A peer
   that has not answered for its class's dead time (0.8 s in use, 4.84 s idle) is
   declared dead at that moment, as the prober's timer does; so is one whose answer is
   on its way but comes after that (:func:`late_deaths`: an RTT that steps up by more
   than half a second), alive again when it arrives. A probe to a live peer still
   unanswered at the prober's ``retry_after`` (at most half an interval) is sent again
   once, and its reply is a sample too: on a link slower than that every probe is. A
   dead peer is probed
   within the round in which any of the prober's revival cues reaches it
   (:func:`revive_spread`: a dead peer's probe heard, another dead peer answering) and
   found alive when that answer arrives (:func:`revival_times`).
   An agent not started yet neither probes nor answers;
3. each agent checks its telemetry every second (the agent's ``check_interval_s``): the
   peers whose report moved by the agent's own rule
   (:func:`meshopt.agent.telemetry.reports_moved`) go out, all of them in a full
   snapshot every :func:`~meshopt.agent.telemetry.full_interval`; a step its estimator
   confirms, and a peer found dead or alive again, go out at once (at most every
   ``TELL_GAP_S``), as the agent tells them; a check with nothing to tell sends
   nothing (or a heartbeat, which moves nothing);
4. the controller recomputes after its debounce once a report told it something and
   its warm-up rule passes (:func:`meshopt.controller.view.warmed_up`), and while links
   are told back once none has been for ``revive_quiet_s``: the agents' last telemetry priced
   by the view's own function (:func:`meshopt.controller.view.link_matrices`), decided
   by :meth:`meshopt.controller.engine.RouteEngine.decide` (routes, the degradation
   release, the anti-flap policy) with the start-up policy
   (:func:`meshopt.controller.engine.startup_policy`); the routes reach the agents
   ``install_s`` later (with ``install_each_s``, agents that share CPUs, as the lab's
   do, one after another). Above 300 nodes recomputes are at least ``recompute_s`` apart;
5. an agent whose next hop was declared dead fails over by the agent's own rule
   (:func:`meshopt.agent.plan.next_hop_in_use`) to the backup the route set carries, or
   withdraws the route (the plain WireGuard route: the direct tunnel);
6. the routes in use are scored against the ground truth whenever they or the truth
   change, which is how convergence and outage times are measured (to the tick).

Agents start at ``boot_s`` plus up to ``boot_spread_s`` (the lab's agents take seconds
to come up); before the controller's first decision the mesh uses what WireGuard gives
without it: every pair over its own tunnel, if it has one. Route changes are counted
from the second decision on: the first install is not a change.

A pair is *converged* when the policy would have no reason to move it to the optimum
for the ground truth even with settled estimates: the gain misses the absolute or
relative margin, or is within the noise that settled estimates keep (``noise_sigmas``
times their standard deviation); ``converge_rel`` judges as the lab's readings do
instead. Convergence time is when every pair first reached that state and stayed there
until the next event (or the end); after an event, pairs that were already outside the
margin when it came are left out of that (unless the event cuts them): they are the
previous interval's, and still counted in ``suboptimal_pairs``.

WireGuard's first handshake on each tunnel is modelled as the agents meet it
(:class:`_Handshakes`): one end initiates, the other holds its first probe until it
hears the initiator's, and replies to probes sent before a peer first answered are
proof of life, not RTT samples. Until its peers' estimates were told warm an agent
checks its telemetry every ``WARM_CHECK_S`` (:func:`meshopt.agent.telemetry.check_interval`).

A probe crosses the underlay's delay plus ``tunnel_ms`` (and ``tunnel_sigma_ms`` of
spread) per tunnel: WireGuard's own work, ~0.3-0.5 ms per wireguard-go tunnel in the lab
at the agents' rate (:mod:`meshopt.bench.tunnelshare`), each tunnel's own draw with
``tunnel_spread_ms``, and a busy host's late probes (``late_p``, ``late_ms``:
:class:`LateProbes`, fitted to the lab's σ readings by :mod:`meshopt.bench.probenoise`).
Routes are scored on the underlay's figures.

Not modelled: a lost first handshake (retried after 5 s), CPU time
(the controller's recompute and the agents' work take none), the controller's batching
of routine snapshots, the relay-hop forwarding delay beyond the metric's 0.1 ms, the
controller's sticky backups in meshes that are not symmetric (the plain loop-free
alternate is the backup), bulk routes.
"""

from __future__ import annotations

import copy
import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from meshopt.agent.config import ProbeSettings, TelemetrySettings, probe_budget_config
from meshopt.agent.peers import HANDSHAKE_DEFER_S
from meshopt.agent.plan import next_hop_in_use
from meshopt.agent.telemetry import (
    TELL_GAP_S,
    check_interval,
    full_due,
    full_interval,
    reports_moved,
)
from meshopt.controller.config import ControllerConfig
from meshopt.controller.engine import RouteEngine, startup_policy
from meshopt.controller.view import Matrices, link_matrices, warmed_up
from meshopt.errors import InputError
from meshopt.estimate import (
    AGENT,
    BIRTH_SLACK,
    DEFAULT_JITTER_HALF_LIFE_S,
    WARM_SAMPLES,
    RobustConfig,
)
from meshopt.graph import topology_costs
from meshopt.metric import FloatArray, Metric
from meshopt.policy import Installed, PolicyConfig
from meshopt.probe.budget import BudgetConfig
from meshopt.probe.prober import RETRY_MIN_S
from meshopt.routing import NO_ROUTE, RouteTables, compute_routes
from meshopt.routing.backup import backup_inputs, backup_next_hops
from meshopt.routing.tables import IntArray, less_one_relay, reduce_paths, relay_weights
from meshopt.sim.budget import LinkBudget
from meshopt.sim.estimator import (
    NEVER_ANSWERED,
    BoolArray,
    LinkEstimator,
    loss_changed,
    pooled_loss,
    remember_loss,
    remembers,
)
from meshopt.sim.events import Event, check_events
from meshopt.sim.report import EventResult, GainSummary, SimPerf, SimReport, summarize_gains
from meshopt.topology.model import Topology


def _controller_defaults() -> ControllerConfig:
    return ControllerConfig(mesh="sim", id="sim", signing_key="")


def _budget_defaults() -> BudgetConfig | None:
    return probe_budget_config(ProbeSettings())


@dataclass(frozen=True)
class SimConfig:
    """The simulated mesh's settings; the defaults are the agent's and the controller's."""

    duration_s: float = 120.0
    seed: int = 0
    probe_interval_s: float = ProbeSettings().interval_s
    dead_after_s: float = ProbeSettings().dead_after_s
    tick_s: float = 0.05  # resolution of fail-over, installs and scoring
    # Minimum time between two recomputes; None: none up to 300 nodes (the controller
    # recomputes on input after its debounce), 5 s above (a recompute there takes
    # seconds of CPU, and the controller spaces routine ones by their CPU time).
    recompute_s: float | None = None
    rtt_half_life_s: float = 2.0
    loss_half_life_s: float = 10.0
    jitter_half_life_s: float = DEFAULT_JITTER_HALF_LIFE_S
    loss_window: int = 64  # the prober's window (meshopt.probe.stats)
    robust: RobustConfig = AGENT  # the agent's rule, early warm-up check included
    # Agents start boot_s + uniform(0, boot_spread_s) after time 0 (the lab: ~3 s from
    # starting the agents to their first telemetry, whose first check is 1 s after start).
    boot_s: float = 2.0
    boot_spread_s: float = 1.0
    install_s: float = 0.05  # a route set from the controller's decision to the kernel
    # Agents that share CPUs install a burst of route sets one after another (the lab:
    # 16 agents on two cores took 0.1-0.6 s for the last of a burst): the agents whose
    # routes a decision changed install in a random order, each install_each_s after the
    # one before. 0: each on its own machine, all at install_s (a real mesh).
    install_each_s: float = 0.0
    # What each tunnel adds to a probe's RTT beyond the underlay, and the spread it adds
    # (σ, ms): WireGuard's work and its processes' wake-up after a quiet spell. In the
    # lab (wireguard-go, probes 0.33 s apart) ~0.5 ms and ~0.5 ms σ per link; a relayed
    # path pays it on each of its tunnels. 0: the topology's figures are what probes see.
    tunnel_ms: float = 0.0
    tunnel_sigma_ms: float = 0.0
    # How far tunnels differ from each other (σ, ms): each run draws each tunnel's share
    # from N(tunnel_ms, tunnel_spread_ms), at least 0, on its own random stream. The
    # lab's wireguard-go tunnels differ by ~0.1 ms, which decides paths that close.
    tunnel_spread_ms: float = 0.0
    # A busy host's delays: each probe, with probability ``late_p``, is late by an
    # exponential delay of mean ``late_ms`` (one-sided, a millisecond or so: a process
    # woken late). The lab's σ readings have that tail (demo, quiet: median 0.32 ms,
    # 99th percentile 0.62 ms, where normal noise of the same median gives 0.39); it
    # moves σ's estimate, and so the price of two paths whose gain is near a margin.
    late_p: float = 0.0
    late_ms: float = 0.0
    keep_routes: bool = False  # report the next hops in use at the end of each interval
    # Converged: None, the policy would not move the pair even with settled estimates
    # (its margins and noise test); a share, the pair's cost is within it of the
    # optimum's or less than the absolute margin above it (the lab's reading,
    # meshopt.lab.measure.near_optimum, as the twin benchmark compares).
    converge_rel: float | None = None
    symmetric: bool = False
    backups: bool = True
    metric: Metric = field(default_factory=Metric)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    controller: ControllerConfig = field(default_factory=_controller_defaults)
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)
    # The agents' probe budget (meshopt.sim.budget); None: every link probed fast.
    budget: BudgetConfig | None = field(default_factory=_budget_defaults)

    def tunnel(self, n: int) -> tuple[FloatArray | float, float]:
        """(what each tunnel adds, its probes' σ): one figure, or per tunnel drawn."""
        if self.tunnel_spread_ms <= 0.0:
            return (self.tunnel_ms, self.tunnel_sigma_ms)
        draw = np.random.default_rng([self.seed, 3]).normal(0.0, self.tunnel_spread_ms, (n, n))
        each = np.maximum(self.tunnel_ms + np.triu(draw, 1) + np.triu(draw, 1).T, 0.0)
        return (each, self.tunnel_sigma_ms)

    def recompute_gap(self, n: int) -> float:
        if self.recompute_s is not None:
            return self.recompute_s
        return 0.0 if n <= 300 else 5.0


@dataclass
class LateProbes:
    """SimConfig's late probes, on their own random stream (the others stay as they were)."""

    p: float
    mean_ms: float
    rng: np.random.Generator

    @classmethod
    def of(cls, cfg: SimConfig) -> LateProbes | None:
        if cfg.late_p <= 0.0 or cfg.late_ms <= 0.0:
            return None
        return cls(cfg.late_p, cfg.late_ms, np.random.default_rng([cfg.seed, 4]))

    def late(self, shape: int | tuple[int, int]) -> FloatArray:
        hit = self.rng.random(shape) < self.p
        return np.where(hit, self.rng.exponential(self.mean_ms, shape), 0.0)


@dataclass
class _Truth:
    """The underlay as it is right now, and what perfect routing would do with it."""

    topo: Topology
    node_up: BoolArray
    rtt: FloatArray
    sigma: FloatArray
    loss: FloatArray
    usable: BoolArray
    cost: FloatArray
    optimum: RouteTables
    relay: float
    var: FloatArray  # variance of each link's cost estimate once the estimator has settled
    optimum_var: FloatArray  # summed along the optimal paths
    # What a probe takes: the RTT and its spread with the tunnels' own share (SimConfig's
    # tunnel_ms, tunnel_sigma_ms); routes are scored on the underlay's.
    probe_rtt: FloatArray
    probe_sigma: FloatArray


def _truth(
    topo: Topology,
    node_up: BoolArray,
    metric: Metric,
    symmetric: bool,
    est: LinkEstimator,
    tunnel: tuple[FloatArray | float, float] = (0.0, 0.0),
) -> _Truth:
    usable = topo.tunnels & node_up[:, None] & node_up[None, :]
    cost = topology_costs(topo, metric)
    cost = np.where(usable, cost, np.inf)
    np.fill_diagonal(cost, 0.0)
    # "down" links are modelled as loss 1, which the metric already makes inf.
    opt = compute_routes(cost, topo.names, relay_hop_ms=metric.relay_hop_ms, symmetric=symmetric)
    sigma = np.sqrt(topo.jitter_ms**2 + topo.jitter_ms.T**2)
    loss = 1.0 - (1.0 - topo.loss) * (1.0 - topo.loss.T)
    probe_sigma = np.sqrt(sigma**2 + tunnel[1] ** 2)
    var = _cost_var(probe_sigma, loss, metric, est.a_rtt, est.a_loss)
    rtt = topo.rtt_ms()
    return _Truth(
        topo=topo,
        node_up=node_up,
        rtt=rtt,
        sigma=sigma,
        loss=loss,
        usable=usable,
        cost=cost,
        optimum=opt,
        relay=metric.relay_hop_ms,
        var=var,
        optimum_var=reduce_paths(opt.next_hop, var),
        probe_rtt=rtt + tunnel[0],
        probe_sigma=probe_sigma,
    )


def _cost_var(
    sigma: FloatArray, loss: FloatArray, metric: Metric, a_rtt: float, a_loss: float
) -> FloatArray:
    """Variance of a settled estimate of each link's cost: the noise the policy allows for.

    EWMAs of weight a over independent samples have variance a / (2 - a) of the
    samples'; RTT samples vary by ``sigma``, loss samples are Bernoulli(loss).
    """
    lossc = np.clip(loss, 0.0, 0.99)
    slope = metric.loss_penalty_ms / (1.0 - lossc) ** 2
    rtt_var = sigma**2 * a_rtt / (2.0 - a_rtt)
    loss_var = lossc * (1.0 - lossc) * a_loss / (2.0 - a_loss)
    var = rtt_var + slope**2 * loss_var
    np.fill_diagonal(var, 0.0)
    return np.asarray(var)


def _apply(event: Event, topo: Topology, node_up: BoolArray) -> None:
    if event.node is not None:
        node_up[topo.index(event.node)] = event.state == "up"
        return
    assert event.link is not None
    i, j = topo.index(event.link[0]), topo.index(event.link[1])
    dirs = [(i, j), (j, i)] if event.both_ways else [(i, j)]
    for a, b in dirs:
        if event.state == "down":
            topo.loss[a, b] = 1.0
        elif event.state == "up":
            topo.loss[a, b] = 0.0
        for key, value in event.changes.items():
            getattr(topo, key)[a, b] = value


def _direct(topo: Topology) -> Installed:
    """Routes before the controller's first decision: each pair over its own tunnel.

    Pairs without a tunnel have no route yet. ``since`` is -inf: nothing has
    been changed by the policy, so nothing is held.
    """
    n = topo.n
    nh = np.where(topo.tunnels, np.arange(n)[None, :], NO_ROUTE).astype(np.int64)
    np.fill_diagonal(nh, np.arange(n))
    return Installed(next_hop=nh, since=np.full((n, n), -np.inf))


class _Backups:
    """The controller's backup next hops, computed on first use after each recompute.

    ``add_backups`` is the O(n^3) part of a recompute (3.3 s of 4.2 at 1,000 nodes)
    and fail-over only reads it in rounds where an installed next hop is dead (none in
    a steady mesh without loss), and then only in the rows (source nodes) holding such
    an entry. So rows are computed on first use, each O(n^2); the controller's full
    tables have the same values in those rows, so results do not change
    (tests/unit/test_sim_scale.py, tests/unit/test_backup_sources.py).
    """

    def __init__(
        self,
        best: RouteTables,
        cost: FloatArray,
        relay: float,
        enabled: bool,
        symmetric: bool = False,
    ) -> None:
        self.best = best
        self.enabled = enabled
        self.symmetric = symmetric
        self.direct_ok = np.isfinite(cost)  # the route sets' backup in symmetric meshes
        self._cost: FloatArray | None = cost if enabled else None
        self._relay = relay
        self._inputs: tuple[FloatArray, FloatArray, FloatArray] | None = None  # dist, w, dist.T
        self._done = np.zeros(best.n, dtype=bool)  # rows of best.backup computed so far
        self.computed = False
        self.took_s = 0.0

    def tables(self, rows: IntArray | None = None) -> RouteTables | None:
        """The tables with backups in at least ``rows`` (None: all), or None when off.

        Rows not computed yet hold ``NO_ROUTE``; callers read only the rows they asked for.
        """
        if self._cost is None:
            return None
        want = np.arange(self.best.n) if rows is None else np.unique(rows)
        need = want[~self._done[want]]
        if need.size == 0 and self.best.backup is not None:
            return self.best
        t0 = time.perf_counter()
        if self._inputs is None:
            dist, weights = backup_inputs(self.best, self._cost, relay_hop_ms=self._relay)
            self._inputs = dist, weights, np.ascontiguousarray(dist.T)
        dist, weights, dist_t = self._inputs
        every = need.size == self.best.n
        fresh = backup_next_hops(
            dist, weights, self.best.next_hop, None if every else need, dist_t=dist_t
        )
        if self.best.backup is not None:
            fresh[self._done] = self.best.backup[self._done]  # keep the earlier rows
        self.best = replace(self.best, backup=fresh, dist=dist)
        self._done[need] = True
        self.computed = True
        self.took_s += time.perf_counter() - t0
        return self.best


def _prober(dead_row: BoolArray) -> Callable[[int], bool | None]:
    """One node's prober verdicts as the agent's fail-over rule reads them."""

    def alive(k: int) -> bool | None:
        return not bool(dead_row[k])

    return alive


class _InUse:
    """The next hops in use: the installed ones after the agents' local fail-over.

    Every entry whose next hop the agent's prober declared dead goes through the agent's
    own rule (:func:`meshopt.agent.plan.next_hop_in_use`): to the backup the route set
    carries if that is not dead, else withdrawn, so traffic takes the plain WireGuard
    route: the destination's own tunnel. The backup is the controller's: in symmetric
    meshes the direct tunnel (one AllowedIPs set per destination, see the engine's route
    sets), otherwise the loop-free alternate of the best route (where the entry is the
    best route) or the best route's next hop (where the policy kept another one). An
    entry without a route (the controller found no path) is on the plain route too, with
    nothing to fail over.

    A dead timer firing (a false alarm on a lossy link, most of them at scale) touches
    the entries of one row that use that peer: only those are evaluated again.
    """

    def __init__(self, inst: Installed, tunnel: BoolArray) -> None:
        n = inst.next_hop.shape[0]
        self.n = n
        self.tunnel = tunnel
        self.backups: _Backups | None = None
        self.unrouted = inst.next_hop == NO_ROUTE
        self.base = np.where(self.unrouted & tunnel, np.arange(n)[None, :], inst.next_hop)
        self.eff = self.base.copy()
        self.hop_changes = 0  # entries in use that changed
        self.failovers = 0  # entries moved off their installed next hop by an agent

    def install(self, inst: Installed, backups: _Backups | None, dead: BoolArray) -> IntArray:
        """A route set arrived; the destinations (columns) whose hops in use changed."""
        n = self.n
        old = self.eff
        self.backups = backups
        self.unrouted = inst.next_hop == NO_ROUTE
        self.base = np.where(self.unrouted & self.tunnel, np.arange(n)[None, :], inst.next_hop)
        rows = np.broadcast_to(np.arange(n)[:, None], (n, n))
        broken = ~self.unrouted & dead[rows, np.where(self.unrouted, rows, self.base)]
        np.fill_diagonal(broken, False)  # a node's own entry (never probed) has no backup
        eff = self.base.copy()
        ii, dd = np.nonzero(broken)
        if ii.size:
            eff[ii, dd] = self._fail_over(ii, dd, dead)
            self.failovers += int((eff[ii, dd] != self.base[ii, dd]).sum())
        changed = eff != old
        self.hop_changes += int(changed.sum())
        self.eff = eff
        return np.flatnonzero(changed.any(axis=0))

    def links_changed(self, links: IntArray, dead: BoolArray) -> IntArray:
        """Links (flat indices) declared dead or alive again; the columns that changed."""
        n = self.n
        ii_parts, dd_parts = [], []
        for i, j in zip(*(x.tolist() for x in np.divmod(links, n)), strict=True):
            dd = np.flatnonzero((self.base[i] == j) | (self.eff[i] == j))
            ii_parts.append(np.full(dd.size, i))
            dd_parts.append(dd)
        if not ii_parts:
            return np.zeros(0, dtype=np.intp)
        ii, dd = np.concatenate(ii_parts), np.concatenate(dd_parts)
        keep = ii != dd
        ii, dd = ii[keep], dd[keep]
        if ii.size == 0:
            return np.zeros(0, dtype=np.intp)
        base = self.base[ii, dd]
        routed = ~self.unrouted[ii, dd]
        hop_dead = dead[ii, np.where(base == NO_ROUTE, ii, base)] & routed & (base != NO_ROUTE)
        new = base.copy()
        if hop_dead.any():
            new[hop_dead] = self._fail_over(ii[hop_dead], dd[hop_dead], dead)
        old = self.eff[ii, dd]
        moved = new != old
        if not moved.any():
            return np.zeros(0, dtype=np.intp)
        self.hop_changes += int(moved.sum())
        self.failovers += int((moved & (old == base) & (new != base)).sum())
        self.eff = self.eff.copy()  # the tracker keeps the previous array
        self.eff[ii[moved], dd[moved]] = new[moved]
        return np.unique(dd[moved])

    def _fail_over(self, ii: IntArray, dd: IntArray, dead: BoolArray) -> IntArray:
        """The hop in use of entries (ii, dd) whose next hop is dead."""
        n, bk = self.n, self.backups
        backup = np.full(ii.size, NO_ROUTE, dtype=np.int64)
        if bk is not None and bk.enabled:
            if bk.symmetric:
                backup = np.where(bk.direct_ok[ii, dd], dd, NO_ROUTE)
            else:
                best = bk.tables(np.unique(ii))
                if best is not None and best.backup is not None:
                    nh = best.next_hop[ii, dd]
                    backup = np.where(self.base[ii, dd] == nh, best.backup[ii, dd], nh)
        out = np.empty(ii.size, dtype=np.int64)
        for k, (s, d) in enumerate(zip(ii.tolist(), dd.tolist(), strict=True)):
            b = int(backup[k])
            via = next_hop_in_use(
                int(self.base[s, d]), None if b == NO_ROUTE else b, _prober(dead[s])
            )
            if via is None:  # withdrawn: the plain WireGuard route, if there is a tunnel
                via = d if self.tunnel[s, d] else NO_ROUTE
            out[k] = via
        del n
        return out


@dataclass
class _Tracker:
    """Outage and convergence of the routes in use, since one event (or the start).

    ``leftover`` marks the pairs that were outside the margin when the event came
    (the previous interval's stragglers): they still count as suboptimal, but the
    event's convergence time is about the pairs it moved, unless it cuts them.
    """

    result: EventResult
    leftover: BoolArray | None = None
    restored_at: float | None = None
    converged_at: float | None = None
    bad: BoolArray | None = None  # outside the margin at the last round scored
    _seen: tuple[_Truth, IntArray] | None = None
    # eff's paths: cost, variance, broken, outside the margin (updated by column)
    _paths: tuple[FloatArray, FloatArray, BoolArray, BoolArray] | None = None

    def score(
        self,
        truth: _Truth,
        eff: IntArray,
        now: float,
        pol: PolicyConfig,
        rel: float | None = None,
        changed: IntArray | None = None,
    ) -> None:
        """Score the routes in use now. ``eff`` is never changed after it was handed
        in (a new array each time); ``changed``: its destinations (columns) that differ
        from the last one scored, when the caller knows them."""
        n = eff.shape[0]
        cols: IntArray | None = None
        if self._seen is not None and self._seen[0] is truth:
            if changed is not None:
                cols = changed
            else:
                cols = np.flatnonzero((self._seen[1] != eff).any(axis=0))
            if cols.size == 0:
                self._seen = (truth, eff)
                return  # same routes, same underlay: same verdict as last time
        self._seen = (truth, eff)
        if cols is not None and cols.size <= n // 4 and self._paths is not None:
            # A path towards d reads column d of the next hops only: walk just the
            # destinations whose column changed (an agent's fail-over moves a few).
            got, path_var, broken, bad = self._paths
            got[:, cols] = _true_cost_cols(truth, eff, truth.relay, cols)
            path_var[:, cols] = _sum_paths_cols(eff, truth.var, cols)
            broken[:, cols], bad[:, cols] = _verdict(
                truth, got[:, cols], path_var[:, cols], cols, pol, rel
            )
        else:
            got = _true_cost(truth, eff, truth.relay)
            path_var = reduce_paths(eff, truth.var)
            every = np.arange(n)
            broken, bad = _verdict(truth, got, path_var, every, pol, rel)
            self._paths = (got, path_var, broken, bad)
        self.bad = bad  # updated in place by later scores: copied when an event keeps it
        moved = bad if self.leftover is None else (bad & ~self.leftover) | broken
        elapsed = now - self.result.at_s
        res = self.result
        if broken.any():
            self.restored_at = None
            res.broken_pairs = max(res.broken_pairs, int(broken.sum()))
        elif self.restored_at is None:
            self.restored_at = elapsed
        res.outage_s = self.restored_at
        if moved.any():
            self.converged_at = None
        elif self.converged_at is None:
            self.converged_at = elapsed
        res.converge_s = self.converged_at
        res.suboptimal_pairs = int(bad.sum())


def _popcount(bits: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
    return np.asarray(np.bitwise_count(bits), dtype=np.int64)


@dataclass
class _Agents:
    """What the agents measured and what they last told the controller, every link at once.

    The prober's window (``loss``, ``samples`` over the last ``window`` probes, as
    :class:`meshopt.probe.stats.ProbeStats`) is kept as two bit registers per link and
    its loss memory (:func:`meshopt.estimate.pooled_loss`) as two decayed counts; the
    RTT estimate is :class:`~meshopt.sim.estimator.LinkEstimator`. ``pub_*`` are the
    values of the last telemetry each agent sent (the controller's view of the mesh).
    """

    n: int
    window: int
    sent: npt.NDArray[np.int64]
    got_bits: npt.NDArray[np.uint64]
    lost_bits: npt.NDArray[np.uint64]
    # The loss memory (the prober's PeerWindow): outcomes counted, the last one that may
    # not enter the memory, the decayed lost and outcome counts it holds.
    counted: npt.NDArray[np.int64]
    forget_until: npt.NDArray[np.int64]
    old_lost: FloatArray
    old_outcomes: FloatArray
    last_reply: FloatArray  # -inf: never answered (the prober's alive is None)
    pub_alive: npt.NDArray[np.int64]
    pub_rtt: FloatArray
    pub_jitter: FloatArray
    pub_noise: FloatArray
    pub_loss: FloatArray
    pub_samples: FloatArray
    pub_sent: FloatArray
    pub_loss_n: FloatArray
    last_seen: FloatArray  # per node: its last telemetry (-inf: none yet)
    last_full: FloatArray
    next_check: FloatArray
    boot: FloatArray  # when each agent started

    @classmethod
    def start(cls, n: int, window: int, boot: FloatArray, tel: TelemetrySettings) -> _Agents:
        z = np.zeros((n, n))
        return cls(
            n=n,
            window=window,
            sent=np.zeros((n, n), dtype=np.int64),
            got_bits=np.zeros((n, n), dtype=np.uint64),
            lost_bits=np.zeros((n, n), dtype=np.uint64),
            counted=np.zeros((n, n), dtype=np.int64),
            forget_until=np.full((n, n), NEVER_ANSWERED, dtype=np.int64),
            old_lost=z.copy(),
            old_outcomes=z.copy(),
            last_reply=np.full((n, n), -np.inf),
            pub_alive=np.full((n, n), -1, dtype=np.int64),
            pub_rtt=np.full((n, n), np.nan),
            pub_jitter=z.copy(),
            pub_noise=z.copy(),
            pub_loss=z.copy(),
            pub_samples=z.copy(),
            pub_sent=z.copy(),
            pub_loss_n=z.copy(),
            last_seen=np.full(n, -np.inf),
            last_full=np.full(n, -np.inf),
            next_check=boot + check_interval(False, 0.0, tel),
            boot=boot.copy(),
        )

    def tell_soon(self, rows: IntArray, now: float) -> None:
        """The agents ``rows`` tell at once what they found (at most every TELL_GAP_S)."""
        soon = np.maximum(now, self.last_seen[rows] + TELL_GAP_S)
        self.next_check[rows] = np.minimum(self.next_check[rows], soon)

    def probe(self, probed: BoolArray | None, got: BoolArray, reply_at: FloatArray) -> None:
        """One probe round: ``probed`` links sent one (None: all), ``got`` answered."""
        mask = np.uint64((1 << self.window) - 1) if self.window < 64 else np.uint64(2**64 - 1)
        one = np.uint64(1)
        evicted, evicted_lost = self._leaving(probed)
        g = (self.got_bits << one) & mask | got.astype(np.uint64)
        if probed is None:
            self.sent += 1
            lo = (self.lost_bits << one) & mask | (~got).astype(np.uint64)
            self.got_bits, self.lost_bits = g, lo
        else:
            self.sent += probed
            lo = (self.lost_bits << one) & mask | (probed & ~got).astype(np.uint64)
            self.got_bits = np.where(probed, g, self.got_bits)
            self.lost_bits = np.where(probed, lo, self.lost_bits)
        np.copyto(self.last_reply, reply_at, where=got)
        born = got & (self.forget_until == NEVER_ANSWERED)
        np.copyto(self.forget_until, self.sent + BIRTH_SLACK, where=born)
        if evicted.size:  # into the loss memory, as the prober's PeerWindow._record
            ol, oo = self.old_lost.ravel(), self.old_outcomes.ravel()
            window_lost = _popcount(self.lost_bits.ravel()[evicted]).astype(np.float64)
            outcomes = np.full(evicted.size, float(self.window))
            changed = loss_changed(window_lost, outcomes, ol[evicted], oo[evicted])
            ol[evicted], oo[evicted] = remember_loss(ol[evicted], oo[evicted], evicted_lost)
            forget = evicted[changed]
            ol[forget] = oo[forget] = 0.0
            self.forget_until.ravel()[forget] = self.counted.ravel()[forget]

    def _leaving(self, probed: BoolArray | None) -> tuple[IntArray, BoolArray]:
        """Count a probe round's outcomes. The links (flat indices) whose full window it
        pushes an outcome out of that may enter the loss memory (not a birth outcome,
        nor one in the window when the memory was last forgotten), and whether that
        outcome was a loss."""
        top = np.uint64(1 << (self.window - 1))
        full = ((self.got_bits | self.lost_bits) & top) != 0
        if probed is None:
            self.counted += 1
        else:
            self.counted += probed
            full &= probed
        idx = np.flatnonzero(full)
        if idx.size:
            ordinal = self.counted.ravel()[idx] - self.window
            idx = idx[remembers(ordinal, self.forget_until.ravel()[idx])]
        return idx, (self.lost_bits.ravel()[idx] & top) != 0

    def forget_outage(self, back: BoolArray) -> None:
        """Links answering again after being dead drop the losses since their last reply
        (the prober's ``PeerWindow.forget_outage``): the trailing run of lost bits."""
        lost = self.lost_bits[back]
        one = np.uint64(1)
        run = np.bitwise_count((lost ^ (lost + one)) >> one).astype(np.uint64)
        self.lost_bits[back] = lost >> run
        self.got_bits[back] = self.got_bits[back] >> run
        self.counted[back] -= run.astype(np.int64)


@dataclass
class _InFlight:
    """Probe rounds whose outcome the agents do not know yet. A reply reaches the
    prober's estimator one RTT after its probe left, and a lost probe is counted then
    too. Fed at once, the 16-node twin's 650 ms link had its step confirmed 0.65 s
    before the lab could see it (degradation 0.95-1.15 s simulated, 1.57-1.67 s in
    the lab)."""

    # (flat indices of the links, when each outcome is known, its sample, lost)
    rounds: list[tuple[IntArray, FloatArray, FloatArray, BoolArray]] = field(default_factory=list)

    def add(
        self, known_at: FloatArray, sample: FloatArray, lost: BoolArray, probed: BoolArray
    ) -> None:
        """A round of probes on the links ``probed``."""
        idx = np.flatnonzero(probed)
        if idx.size:
            self.add_links(idx, known_at.ravel()[idx], sample.ravel()[idx], lost.ravel()[idx])

    def add_links(
        self, idx: IntArray, known_at: FloatArray, sample: FloatArray, lost: BoolArray
    ) -> None:
        """Probes on some links (flat indices ``idx``; the other arguments per link)."""
        self.rounds.append((idx, known_at, sample, lost))

    def deliver(self, est: LinkEstimator, now: float) -> list[tuple[int, int]]:
        """Feed ``est`` the outcomes known by ``now``, oldest round first; the links
        whose step that confirmed."""
        stepped: list[tuple[int, int]] = []
        left = []
        for idx, known_at, sample, lost in self.rounds:
            ready = known_at <= now + 1e-9
            if ready.any():
                est.update_links(idx[ready], sample[ready], lost[ready])
                stepped += est.stepped
                if ready.all():
                    continue
                wait = ~ready
                idx, known_at, sample, lost = idx[wait], known_at[wait], sample[wait], lost[wait]
            left.append((idx, known_at, sample, lost))
        self.rounds = left
        return stepped


def _merged(installed: Installed, new: Installed, rows: IntArray) -> Installed:
    """``installed`` with ``rows`` (the agents that installed their route set now) as in
    ``new``."""
    next_hop, since = installed.next_hop.copy(), installed.since.copy()
    next_hop[rows], since[rows] = new.next_hop[rows], new.since[rows]
    return Installed(next_hop=next_hop, since=since)


def _lost(
    rng: np.random.Generator, truth: _Truth, up: BoolArray, links: IntArray | None = None
) -> BoolArray:
    """One probe per link: which are lost (on the way or back, or to a node not up);
    ``links``: only those (flat indices), in their order."""
    n = truth.rtt.shape[0]
    if links is None:
        lost: BoolArray = (rng.random((n, n)) < truth.loss) | ~truth.usable | ~up[None, :]
        return lost
    ok = truth.usable.ravel()[links] & up[links % n]
    some: BoolArray = (rng.random(links.size) < truth.loss.ravel()[links]) | ~ok
    return some


def revive_spread(
    dead: BoolArray, back: BoolArray, got: BoolArray, draw_lost: Callable[[], BoolArray]
) -> BoolArray:
    """Dead links found alive within the round by the prober's revival rules: an agent
    whose dead peer answered again probes its other dead peers at once, and one whose
    responder got a dead peer's probe probes that peer at once (``Prober.release``).
    A returning node comes back on all its links together, as in the lab."""
    found = np.zeros_like(dead)
    asked = back.copy()  # each dead link is probed early once in a round
    reached = got.copy()  # probes (i, j) that reached j this round: j heard from i
    while True:
        swept: BoolArray = np.any(back | found, axis=1)
        ask = dead & ~asked & (swept[:, None] | reached.T)
        if not ask.any():
            return found
        asked |= ask
        answered = ask & ~draw_lost()
        reached |= answered
        found |= answered


def revival_times(
    back: BoolArray, found: BoolArray, got: BoolArray, reply_at: FloatArray, sent_at: float
) -> FloatArray:
    """When each revived link's answer reaches its prober (inf elsewhere): a dead peer
    that answered the round's probe, at its reply; one probed early by
    :func:`revive_spread`, its own RTT after the cue (another dead peer's reply, or
    this peer's probe heard half its RTT after it left); one found through another
    early answer, two RTTs after the round. The agent tells a return when it knows it."""
    rtt_s = reply_at - sent_at
    t = np.where(back, reply_at, np.inf)
    heard = np.where(got.T, sent_at + rtt_s.T / 2.0, np.inf)  # [i, j]: i heard j's probe
    cue = np.minimum(t.min(axis=1)[:, None], heard)
    early = np.where(np.isfinite(cue), cue + rtt_s, sent_at + 2.0 * rtt_s)
    out: FloatArray = np.where(found & ~back, early, t)
    return out


def late_deaths(
    last_reply: FloatArray,
    sent_at: float,
    reply_at: FloatArray,
    dead_s: FloatArray | float,
    interval_s: FloatArray | float,
) -> FloatArray:
    """When the prober declares a peer dead whose answer is on its way but comes after
    the dead timer (inf where it comes in time): an RTT that steps up by more than the
    dead time less an interval (the 16-node lab's jnb1-sao1, 130 to 650 ms: both ends
    declared the other dead, and alive 0.1 s later, in two runs of three). The prober
    waits ``dead_s`` after the last reply and for two unanswered probes, the first
    (this round's) unanswered for ``dead_s - interval_s``. Arguments are per link."""
    at = np.maximum(last_reply + dead_s, sent_at + np.maximum(interval_s, dead_s - interval_s))
    out: FloatArray = np.where(reply_at > at, at, np.inf)
    return out


@dataclass
class _Handshakes:
    """WireGuard's first handshake on every tunnel, as the lab's agents start.

    One end of each tunnel initiates (the smaller public key: here a coin per tunnel);
    the other holds its first probe until the initiator's probe reaches it, a handshake
    and a one-way trip (1.5 RTT) after it was sent, or ``HANDSHAKE_DEFER_S`` (the agent's
    :func:`~meshopt.agent.peers.first_probe_delay` and ``Prober.release``), and that
    probe counts. The initiator's probes count from the one after its first answered
    probe: replies to probes sent before a peer first answered are proof of life, not
    RTT samples (the prober's ``early_reply``), as the first waited for the handshake.
    """

    held_until: FloatArray  # no probe on the link before this
    counted_from: FloatArray  # probes sent before this are early
    done: float  # after this, nothing is held or early

    @classmethod
    def at_start(
        cls,
        topo: Topology,
        boot: FloatArray,
        phase: float,
        interval: float,
        rng: np.random.Generator,
    ) -> _Handshakes | None:
        n = topo.n
        if n < 2:
            return None

        def round_at(t: FloatArray) -> FloatArray:  # the first probe round at or after t
            k = np.maximum(np.ceil((t - phase) / interval - 1e-9), 0.0)
            return np.asarray(phase + k * interval)

        coin = np.triu(rng.random((n, n)) < 0.5, 1)
        initiates = coin | np.tril(~coin.T, -1)  # [i, j]: i starts the handshake with j
        rtt_s = topo.rtt_ms() / 1000.0
        bi, bj = boot[:, None], boot[None, :]
        # The initiator: the round that reaches a started peer is answered first (early).
        answered = round_at(np.maximum(bi, bj))
        # The other end (row i, initiator j): hears j's first probe that finds it up.
        first_in = round_at(np.maximum(bj, bi - 1.5 * rtt_s))
        heard = np.minimum(first_in + 1.5 * rtt_s, bi + HANDSHAKE_DEFER_S)
        # Held until heard; if the defer ran out instead, that first probe is early too.
        held = np.where(initiates, -np.inf, heard)
        defer_out = first_in + 1.5 * rtt_s > bi + HANDSHAKE_DEFER_S
        counted = np.where(
            initiates, answered + interval, np.where(defer_out, heard + interval, heard)
        )
        tunnel = topo.tunnels & ~np.eye(n, dtype=bool)
        held = np.where(tunnel, held, -np.inf)
        counted = np.where(tunnel, counted, -np.inf)
        return cls(held, counted, float(max(held.max(), counted.max())))

    def probes(self, probed: BoolArray, sent_at: float) -> tuple[BoolArray, BoolArray]:
        """(the links probed in the round at ``sent_at``, those of them early)."""
        sent = probed & (self.held_until <= sent_at + 1e-9)
        return sent, sent & (sent_at < self.counted_from - 1e-9)


def simulate(
    topo: Topology,
    events: Sequence[Event] = (),
    config: SimConfig | None = None,
    progress: Callable[[float], None] | None = None,
) -> SimReport:
    """Run the simulation and return its report (no I/O; ``progress`` gets 0..1)."""
    cfg = config or SimConfig()
    started = time.perf_counter()
    check_events(list(events), topo)
    for ev in events:
        if ev.at_s >= cfg.duration_s:
            raise InputError(
                f"event {ev.text!r} is at {ev.at_s:g} s, not before the end of the "
                f"simulation ({cfg.duration_s:g} s)"
            )
    rng = np.random.default_rng(cfg.seed)
    n = topo.n
    metric, relay = cfg.metric, cfg.metric.relay_hop_ms
    ctl, tel = cfg.controller, cfg.telemetry
    live = topo.copy()
    node_up = np.ones(n, dtype=bool)
    interval = cfg.probe_interval_s
    fast_dead_s = cfg.dead_after_s  # no class's dead time is shorter
    est = LinkEstimator(
        interval,
        cfg.rtt_half_life_s,
        cfg.loss_half_life_s,
        max(1, math.ceil(cfg.dead_after_s / interval)),
        jitter_half_life_s=cfg.jitter_half_life_s,
        robust=cfg.robust,
    )
    est.reset(n)
    # When each agent starts (probing and answering), its probes' phase and its checks.
    boot = cfg.boot_s + rng.uniform(0.0, cfg.boot_spread_s, n)
    probe_phase = float(rng.uniform(0.0, interval))
    agents = _Agents.start(n, cfg.loss_window, boot, tel)
    start_hs = _Handshakes.at_start(topo, boot, probe_phase, interval, rng)
    engine = RouteEngine(cfg.policy, relay_hop_ms=relay, symmetric=cfg.symmetric, max_incremental=8)
    clock = time.perf_counter
    phase = dict.fromkeys(
        ("truth", "routes", "backups", "policy", "failover", "score", "probes"), 0.0
    )
    recomputes = backup_computations = 0
    t0 = clock()
    tunnels_add = cfg.tunnel(n)
    truth = _truth(live, node_up, metric, cfg.symmetric, est, tunnels_add)
    phase["truth"] += clock() - t0
    pending = sorted(events, key=lambda e: e.at_s)
    tick = cfg.tick_s
    steps = max(1, round(cfg.duration_s / tick))
    gap = cfg.recompute_gap(n)
    off = ~np.eye(n, dtype=bool)
    tunnel = topo.tunnels & off
    budget = (
        None
        if cfg.budget is None
        else LinkBudget.start(
            replace(cfg.budget, fast_interval_s=interval, fast_dead_after_s=cfg.dead_after_s),
            tunnel,
            np.random.default_rng([cfg.seed, 1]),  # its own stream: the probes' stay as they were
        )
    )
    installed = _direct(topo)
    backups: _Backups | None = None
    # (when, the decision, its backups, the rows it reaches then; None: every row)
    to_install: list[tuple[float, Installed, _Backups | None, IntArray | None]] = []
    decided = installed.next_hop  # the last decision's next hops (what agents will have)
    install_rng = np.random.default_rng([cfg.seed, 2])  # its own stream: others unchanged
    late_probes = LateProbes.of(cfg)
    changes = np.zeros((n, n), dtype=np.int64)
    decisions = 0
    first_seen: float | None = None
    dirty_since: float | None = None
    revived_at: float | None = None  # links told back since the last recompute: the first
    revive_until = -np.inf
    told_back = np.zeros((n, n), dtype=bool)  # links told back since then (the controller's)
    last_recompute = -np.inf
    next_round = probe_phase
    dead = np.zeros((n, n), dtype=bool)
    waiting = np.zeros(0, dtype=np.intp)  # links whose dead timer runs (flat indices)
    inflight = _InFlight()
    reviving_at = np.full((n, n), np.inf)  # a dead link's answer, on its way
    late_idx = np.zeros(0, dtype=np.intp)  # links whose answer comes after their dead time
    late_dead_at = np.zeros(0)
    late_back_at = np.zeros(0)
    dead_at = np.zeros(0)
    use = _InUse(installed, tunnel)
    hop_changes = 0
    flips: list[IntArray] = []  # links declared dead or alive again since the last look
    fresh_routes = False
    eff = use.eff
    scored: IntArray | None = None
    gains: GainSummary | None = None
    start = _Tracker(EventResult(event="start", at_s=0.0))
    tracker = start
    results: list[EventResult] = []
    for step in range(steps):
        now = step * tick
        truth_moved = False
        while pending and pending[0].at_s <= now + 1e-9:
            ev = pending.pop(0)
            if gains is None:
                gains = _gains(truth, installed)
            if cfg.keep_routes:
                tracker.result.routes = _named(topo.names, eff)
            _apply(ev, live, node_up)
            t0 = clock()
            truth = _truth(live, node_up, metric, cfg.symmetric, est, tunnels_add)
            phase["truth"] += clock() - t0
            # Events at one instant (a jitter period, one per link) share the stragglers
            # of before them: the tracker of the one before has scored nothing yet.
            left = tracker.bad if tracker.bad is not None else tracker.leftover
            tracker = _Tracker(
                EventResult(event=ev.text, at_s=ev.at_s),
                leftover=None if left is None else left.copy(),
            )
            results.append(tracker.result)
            truth_moved = True

        t0 = clock()
        if next_round <= now + 1e-9:  # a probe round: one probe per tunnel direction
            sent_at = next_round
            next_round += interval
            up = boot <= sent_at
            probed = tunnel & up[:, None]
            some = False  # the budget left some links out of this round
            if budget is not None:
                budget.classify(sent_at)
                due = budget.due(sent_at, interval, est.confirming())
                some = bool((tunnel & ~due).any())
                probed &= due
            # jitter is the standard deviation of the delay (as in topology files and the
            # lab's shaper): normal noise around the configured RTT, never below zero.
            noise = rng.standard_normal((n, n)) * truth.probe_sigma
            if late_probes is not None:
                noise += late_probes.late((n, n))
            draw_lost = functools.partial(_lost, rng, truth, up)
            lost = draw_lost()
            sample = np.maximum(truth.probe_rtt + noise, 0.0)
            early: BoolArray | None = None
            if start_hs is not None:  # the first handshakes: held probes, early replies
                probed, early = start_hs.probes(probed, sent_at)
                some = True
                if sent_at >= start_hs.done:
                    start_hs = None
            every = bool(up.all()) and not some  # every link probed: no mask to apply
            got = probed & ~lost
            reply_at = sent_at + sample / 1000.0
            if early is not None:  # proof of life, no RTT sample (the prober's early_reply)
                np.copyto(agents.last_reply, reply_at, where=got & early)
                probed, got = probed & ~early, got & ~early
            # Probes to a dead peer measure the outage, not the path (the prober's early
            # replies again): no loss, no RTT; an answer brings the peer back with the
            # outage's losses forgotten and its estimate as it was.
            back = got & dead
            if back.any() or (dead & got.T).any():
                found = revive_spread(dead, back, got, draw_lost)
                back_at = revival_times(back, found, got, reply_at, sent_at)
                back |= found
            if dead.any():
                probed, got, every = probed & ~dead, got & ~dead, False
            if back.any():
                np.copyto(agents.last_reply, reply_at, where=back)
                agents.forget_outage(back)
                est.revive(back)
            inflight.add(reply_at, sample, lost, probed)
            # An answer that comes after the dead timer: dead until it arrives.
            slow = np.flatnonzero((got & (reply_at > agents.last_reply + fast_dead_s)).ravel())
            if slow.size:
                d_s = cfg.dead_after_s if budget is None else budget.dead_after(slow)
                iv = interval if budget is None else budget.interval_of(slow)
                when = late_deaths(
                    agents.last_reply.ravel()[slow], sent_at, reply_at.ravel()[slow], d_s, iv
                )
                late = np.isfinite(when)
                late_idx = np.concatenate([late_idx, slow[late]])
                late_dead_at = np.concatenate([late_dead_at, when[late]])
                late_back_at = np.concatenate([late_back_at, reply_at.ravel()[slow[late]]])
            agents.probe(None if every else probed, got, reply_at)
            # A probe to a live peer still unanswered retry_after it left is sent again
            # once (the prober's rule): a lost one, and every one on a link whose RTT is
            # over the cap of half an interval (165 ms at the default rate: the lab's
            # long links carry twice the probes, and a step above it twice the samples).
            # The retry is a probe of its own: a sample when answered, a loss when not;
            # a lost probe's answered retry proves the peer alive.
            ci = np.flatnonzero(
                probed & ~dead & np.isfinite(agents.last_reply) & np.isfinite(est.srtt)
            )
            if ci.size:
                iv = interval if budget is None else budget.interval_of(ci)
                after = np.minimum(
                    np.maximum(2.0 * est.srtt.ravel()[ci] / 1000.0 + 0.01, RETRY_MIN_S), iv / 2.0
                )
                lost1 = lost.ravel()[ci]
                again = lost1 | (sample.ravel()[ci] / 1000.0 > after)
                ri, after, lost1 = ci[again], after[again], lost1[again]
                if ri.size:
                    lost2 = _lost(rng, truth, up, ri)
                    noise2 = rng.standard_normal(ri.size) * truth.probe_sigma.ravel()[ri]
                    if late_probes is not None:
                        noise2 += late_probes.late(ri.size)
                    sample2 = np.maximum(truth.probe_rtt.ravel()[ri] + noise2, 0.0)
                    known = sent_at + after + sample2 / 1000.0
                    inflight.add_links(ri, known, sample2, lost2)
                    saved = ri[lost1 & ~lost2]
                    agents.last_reply.ravel()[saved] = known[lost1 & ~lost2]
                    got = got.copy()
                    got.ravel()[saved] = True
            if budget is not None:
                budget.sent(probed, sent_at)
            if back.any():  # alive again when the answer arrives (below)
                np.minimum(reviving_at, np.where(back, back_at, np.inf), out=reviving_at)
            # Only a link that did not answer this round can be declared dead before the
            # next one (dead_after_s exceeds the probe interval): its timer is watched.
            waiting = np.flatnonzero((np.isfinite(agents.last_reply) & ~dead & ~got).ravel())
            dead_at = agents.last_reply.ravel()[waiting] + (
                cfg.dead_after_s if budget is None else budget.dead_after(waiting)
            )
        if np.isfinite(reviving_at).any():
            back = dead & (reviving_at <= now + 1e-9)
            if back.any():  # a dead peer answered: alive again, and told at once
                reviving_at[back] = np.inf
                flips.append(np.flatnonzero(back.ravel()))
                dead = dead & ~back
                rows = np.flatnonzero(back.any(axis=1))
                agents.tell_soon(rows, now)
            reviving_at[~dead] = np.inf
        if inflight.rounds:
            stepped = inflight.deliver(est, now)
            if stepped:  # a confirmed step: the agent tells at once (TELL_GAP_S apart)
                rows = np.unique([i for i, _ in stepped])
                agents.tell_soon(rows, now)
        if late_idx.size:
            due = late_dead_at <= now + 1e-9
            if due.any():
                fire = late_idx[due]
                fire_ok = ~dead.ravel()[fire]
                fire, back_at = fire[fire_ok], late_back_at[due][fire_ok]
                if fire.size:
                    dead = dead.copy()
                    dead.ravel()[fire] = True
                    flips.append(fire)
                    flat = reviving_at.ravel()
                    flat[fire] = np.minimum(flat[fire], back_at)
                    rows = np.unique(fire // n)
                    agents.tell_soon(rows, now)
                late_idx, late_dead_at = late_idx[~due], late_dead_at[~due]
                late_back_at = late_back_at[~due]
        if waiting.size:
            due = dead_at <= now + 1e-9
            if due.any():
                dead = dead.copy()
                dead.ravel()[waiting[due]] = True
                flips.append(waiting[due])
                # A peer found dead is told at once, as the agent tells it.
                rows = np.unique(waiting[due] // n)
                agents.tell_soon(rows, now)
                waiting, dead_at = waiting[~due], dead_at[~due]

        # The agents' telemetry checks: what moved goes out (a full snapshot when due).
        rows = np.flatnonzero(agents.next_check <= now + 1e-9)
        if rows.size:
            revived, told = _report(agents, est, dead, rows, now, tel, tunnel)
            if revived.size:
                revived_at = now if revived_at is None else revived_at
                told_back.ravel()[revived] = True
                quiet = (
                    ctl.revive_max_s if _awaiting(told_back, agents, now) else ctl.revive_quiet_s
                )
                revive_until = min(revived_at + ctl.revive_max_s, now + quiet)
            if told:
                if first_seen is None:
                    first_seen = now
                dirty_since = now if dirty_since is None else dirty_since
        phase["probes"] += clock() - t0

        # The controller: a recompute after the debounce, once warm.
        if (
            dirty_since is not None
            and now - dirty_since >= ctl.debounce_s - 1e-9
            and now - last_recompute >= gap - 1e-9
            and now >= revive_until - 1e-9
            and warmed_up(
                first_seen,
                now,
                ctl.warmup_s,
                lambda: _measured(agents, tunnel, ctl.warmup_samples),
            )
        ):
            if backups is not None and backups.computed:
                backup_computations += 1
                phase["backups"] += backups.took_s
                phase["failover"] -= backups.took_s  # it ran inside the fail-over check
                backups.took_s = 0.0
                backups.computed = False
            dirty_since = None
            revived_at = None
            told_back[:] = False
            last_recompute = now
            recomputes += 1
            t0 = clock()
            m = _matrices(agents, topo.names, tunnel, metric, now)
            pol = startup_policy(cfg.policy, first_seen, now, ctl.startup_s, ctl.startup_hold_s)
            best, dec, _, _ = engine.decide(m, now, pol, backups=False)
            t1 = clock()
            phase["routes"] += t1 - t0
            if decisions > 0:  # the first install is not a change of routes
                changes += dec.changed
                tracker.result.route_changes += int(dec.changed.sum())
            decisions += 1
            new = Installed(next_hop=dec.installed.next_hop.copy(), since=dec.installed.since)
            if not cfg.symmetric:  # the engine updates its tables in place next time
                best = copy.deepcopy(best)
            bk = _Backups(best, m.cost, relay, cfg.backups, cfg.symmetric)
            if cfg.install_each_s > 0:
                moved = np.flatnonzero((new.next_hop != decided).any(axis=1))
                for k, row in enumerate(install_rng.permutation(moved)):
                    at = now + cfg.install_s + k * cfg.install_each_s
                    to_install.append((at, new, bk, np.array([row])))
                to_install.sort(key=lambda e: e[0])  # stable: earlier decisions first
            else:
                to_install.append((now + cfg.install_s, new, bk, None))
            decided = new.next_hop
            phase["policy"] += clock() - t1

        while to_install and to_install[0][0] <= now + 1e-9:
            _, new, backups, reach = to_install.pop(0)
            installed = new if reach is None else _merged(installed, new, reach)
            fresh_routes = True
            if budget is not None:
                budget.routes(installed.next_hop, now)

        t0 = clock()
        cols: IntArray | None = None
        if fresh_routes:
            cols = use.install(installed, backups, dead)
            fresh_routes = False
            flips = []
        elif flips:
            cols = use.links_changed(np.concatenate(flips), dead)
            flips = []
        eff = use.eff
        tracker.result.hop_changes += use.hop_changes - hop_changes
        hop_changes = use.hop_changes
        t1 = clock()
        if truth_moved or scored is not eff:
            tracker.score(
                truth, eff, now, cfg.policy, cfg.converge_rel, None if truth_moved else cols
            )
            scored = eff
        phase["failover"] += t1 - t0
        phase["score"] += clock() - t1
        if progress is not None and step % 64 == 0:
            progress(step / steps)

    if backups is not None and backups.computed:
        backup_computations += 1
        phase["backups"] += backups.took_s
        phase["failover"] -= backups.took_s  # it ran inside the fail-over check
    if gains is None:
        gains = _gains(truth, installed)
    if cfg.keep_routes:
        tracker.result.routes = _named(topo.names, eff)
    if progress is not None:
        progress(1.0)
    routes = n * (n - 1)
    pair_changes = np.triu(changes + changes.T, 1)
    ii, jj = np.nonzero(pair_changes)
    flappers = sorted(
        zip(pair_changes[ii, jj].tolist(), ii.tolist(), jj.tolist(), strict=True), reverse=True
    )[:10]
    runtime = time.perf_counter() - started
    perf = SimPerf(
        rounds=steps,
        recomputes=recomputes,
        backup_computations=backup_computations,
        probes_sent=int(agents.sent[tunnel].sum()),
        wall_per_simulated_s=runtime / cfg.duration_s,
        phase_s=phase,
    )
    return SimReport(
        topology=topo.name,
        nodes=n,
        pairs=n * (n - 1) // 2,
        duration_s=cfg.duration_s,
        seed=cfg.seed,
        symmetric=cfg.symmetric,
        gains=gains or GainSummary(),
        events=results,
        route_changes=int(changes.sum()),
        changes_per_route_hour=float(changes.sum()) / max(routes, 1) / (cfg.duration_s / 3600),
        max_changes_pair=[(topo.names[i], topo.names[j], c) for c, i, j in flappers],
        failovers=use.failovers,
        runtime_s=runtime,
        initial_converge_s=start.converged_at,
        initial_suboptimal_pairs=start.result.suboptimal_pairs,
        perf=perf,
    )


def _named(names: list[str], nh: IntArray) -> dict[str, dict[str, str]]:
    return {
        names[s]: {names[d]: names[h] for d, h in enumerate(nh[s].tolist()) if d != s and h >= 0}
        for s in range(len(names))
    }


def _report(
    agents: _Agents,
    est: LinkEstimator,
    dead: BoolArray,
    rows: IntArray,
    now: float,
    tel: TelemetrySettings,
    tunnel: BoolArray,
) -> tuple[IntArray, bool]:
    """The telemetry of the agents in ``rows`` at ``now``: every peer whose report moved
    (the agent's rule, :func:`~meshopt.agent.telemetry.reports_moved`), every peer in a
    full snapshot when one is due (:func:`~meshopt.agent.telemetry.full_interval`).
    A check with neither sends nothing, or a heartbeat when one is due (the agent's
    ``Cadence``), which keeps the node fresh and moves nothing (the controller's
    ``on_telemetry``). Returns the links (flat indices) a report told alive that the
    controller had dead (the controller's ``revive_*`` wait), and whether any report
    told a peer (the controller then has something to recompute)."""
    a = agents
    got = _popcount(a.got_bits[rows]).astype(np.float64)
    lost = _popcount(a.lost_bits[rows]).astype(np.float64)
    outcomes = got + lost
    loss, loss_n = pooled_loss(lost, outcomes, a.old_lost[rows], a.old_outcomes[rows])
    answered = np.isfinite(a.last_reply[rows])
    alive = np.where(dead[rows], 0, np.where(answered, 1, -1)).astype(np.int64)
    rtt = np.where(answered, est.srtt[rows], np.nan)
    moved = reports_moved(
        a.pub_alive[rows], alive, a.pub_rtt[rows], rtt,
        a.pub_samples[rows], got, a.pub_loss[rows], loss, tel,
    )  # fmt: skip
    every = np.array([full_interval(int(k), tel) for k in tunnel[rows].sum(axis=1)])
    full = full_due(now, a.last_full[rows], every, tel)[:, None]
    take = (moved | full) & tunnel[rows]
    told = take.any(axis=1) | full[:, 0]
    beat = full_due(now, a.last_seen[rows], tel.full_interval_s, tel)  # the heartbeat
    r = rows[:, None]
    cols = np.broadcast_to(np.arange(a.n)[None, :], take.shape)
    ri, ci = np.broadcast_to(r, take.shape)[take], cols[take]
    back = (a.pub_alive[rows] == 0) & (alive == 1) & moved
    revived: IntArray = (rows[:, None] * a.n + np.arange(a.n)[None, :])[back]
    a.pub_alive[ri, ci] = alive[take]
    a.pub_rtt[ri, ci] = rtt[take]
    a.pub_jitter[ri, ci] = est.jitter_rows(rows)[take]
    a.pub_noise[ri, ci] = est.noise_rows(rows)[take]
    a.pub_loss[ri, ci] = loss[take]
    a.pub_samples[ri, ci] = got[take]
    a.pub_sent[ri, ci] = a.sent[rows][take]
    a.pub_loss_n[ri, ci] = np.rint(loss_n[take])
    # Until session 36 every check counted as a message: the controller recomputed about
    # every second where the lab's, told nothing between its agents' snapshots, waited
    # for the next, and a small gain's confirm time ran out up to a snapshot later.
    a.last_seen[rows[told | beat]] = now
    # The agent's Cadence: on schedule, a snapshot counts from when it was due.
    due = a.last_full[rows] + every
    anchor = np.where(np.abs(now - due) <= tel.check_interval_s, due, now)
    a.last_full[rows] = np.where(full[:, 0], anchor, a.last_full[rows])
    # Fast checks until the row was told warm (the agent's Cadence.warm), for at most
    # WARM_WINDOW_S after its start.
    warm = (a.pub_alive[rows] == 0) | (a.pub_samples[rows] >= WARM_SAMPLES) | ~tunnel[rows]
    a.next_check[rows] += check_interval(warm.all(axis=1), now - a.boot[rows], tel)
    return revived, bool(told.any())


def _awaiting(told_back: BoolArray, agents: _Agents, now: float) -> bool:
    """Whether a link told back has an other end still to tell: its own last report has
    the link dead and its agent runs (the controller's ``awaiting``)."""
    n = agents.n
    flat = np.flatnonzero(told_back)
    a, b = flat // n, flat % n
    other = b * n + a
    runs = agents.boot[b] <= now  # a node cut off still reports over management
    wait = ~told_back.ravel()[other] & (agents.pub_alive.ravel()[other] == 0) & runs
    return bool(wait.any())


def _measured(agents: _Agents, tunnel: BoolArray, min_samples: int) -> bool:
    """Every tunnel reported with ``min_samples`` RTT samples (``MeshView.measured``)."""
    ok = ~np.isnan(agents.pub_rtt) & (agents.pub_samples >= min_samples)
    return bool(np.all(ok | ~tunnel))


def _matrices(
    agents: _Agents, names: list[str], tunnel: BoolArray, metric: Metric, now: float
) -> Matrices:
    """The controller's matrices from the agents' last telemetry, priced by the view's
    own function (:func:`~meshopt.controller.view.link_matrices`). A node not heard
    from yet is not in the picture (its links are down)."""
    a = agents
    n = len(names)
    heard = np.isfinite(a.last_seen)
    age = np.broadcast_to(np.maximum(now - a.last_seen, 0.0)[:, None], (n, n))
    age = np.where(np.isfinite(age), age, 0.0)
    cost, sd, term = link_matrices(
        metric, a.pub_rtt, a.pub_jitter, a.pub_loss, a.pub_noise,
        a.pub_samples, a.pub_sent, a.pub_loss_n, a.pub_alive == 0, age,
    )  # fmt: skip
    known = tunnel & heard[:, None] & heard[None, :]
    cost = np.where(known, cost, np.inf)
    sd = np.where(known, sd, 0.0)
    term = np.where(known & np.isfinite(cost), term, 0.0)
    np.fill_diagonal(cost, 0.0)
    rtt = np.where(known & np.isfinite(cost), a.pub_rtt, np.nan)
    z = np.zeros((n, n))
    return Matrices(names, cost, sd, z, heard, rtt, z, term)


def _true_cost(truth: _Truth, nh: IntArray, relay: float) -> FloatArray:
    """Metric cost of the given routes under the ground truth (inf where they are broken)."""
    return less_one_relay(reduce_paths(nh, relay_weights(truth.cost, relay)), relay)


def _verdict(
    truth: _Truth,
    got: FloatArray,
    path_var: FloatArray,
    cols: IntArray,
    pol: PolicyConfig,
    rel: float | None,
) -> tuple[BoolArray, BoolArray]:
    """(broken, outside the margin) of the paths in use towards ``cols``, given their
    cost ``got`` and variance ``path_var`` (columns ``cols`` of the full matrices).

    Converged: the policy would not move the pair to the optimum even with settled
    estimates of the truth: the gain misses the absolute margin, or the relative one (of
    the route in use, as the policy takes it), or is within the noise such estimates
    still have; with ``rel``, the lab's reading instead (within ``rel`` of the optimum
    or less than the absolute margin above it)."""
    opt = truth.optimum.cost[:, cols]
    want = np.isfinite(opt) & (np.arange(got.shape[0])[:, None] != cols[None, :])
    broken = want & ~np.isfinite(got)
    with np.errstate(invalid="ignore"):  # inf - inf where a pair is unreachable anyway
        gain = got - opt
        if rel is not None:
            close = (gain < pol.abs_margin_ms) | (got <= opt * (1.0 + rel) + 1e-6)
        else:
            noise = np.sqrt(path_var + truth.optimum_var[:, cols])
            close = (
                (gain < pol.abs_margin_ms + 1e-6)
                | (gain < pol.rel_margin * got + 1e-6)
                | (gain <= pol.noise_sigmas * noise + 1e-6)
            )
    bad: BoolArray = want & (broken | ~close)
    return np.asarray(broken), bad


def _sum_paths_cols(next_hop: IntArray, edge: FloatArray, cols: IntArray) -> FloatArray:
    """``reduce_paths(next_hop, edge)[:, cols]`` (edges without NaN or -inf), walking only
    those destinations: a path towards d follows column d of the next hops alone.
    Pointer doubling as in :func:`meshopt.routing.tables.reduce_paths`."""
    n, k = next_hop.shape[0], cols.size
    target = np.broadcast_to(cols[None, :], (n, k))
    rows = np.arange(n)[:, None]
    sub = next_hop[:, cols]
    reach = sub >= 0
    jump = np.where(reach, sub, target)
    val = np.asarray(edge[rows, jump], dtype=np.float64).copy()
    val[rows == target] = 0.0
    val[~reach] = math.inf
    kk = np.arange(k)[None, :]
    for _ in range(max(1, math.ceil(math.log2(max(n, 2)))) + 1):
        if (jump == target).all():
            break
        val = val + val[jump, kk]
        jump = jump[jump, kk]
    val[jump != target] = math.inf
    return val


def _true_cost_cols(truth: _Truth, nh: IntArray, relay: float, cols: IntArray) -> FloatArray:
    """``_true_cost(truth, nh, relay)[:, cols]``, walking only those destinations."""
    return less_one_relay(_sum_paths_cols(nh, relay_weights(truth.cost, relay), cols), relay, cols)


def _gains(truth: _Truth, inst: Installed) -> GainSummary:
    """Direct RTT, RTT over the installed routes and over the optimum, for every pair."""
    rtt = np.where(truth.usable, truth.rtt, np.inf)
    np.fill_diagonal(rtt, 0.0)
    n = rtt.shape[0]
    relayed = (inst.next_hop != np.arange(n)[None, :]) & (inst.next_hop != NO_ROUTE)
    tables = RouteTables(truth.topo.names, rtt, inst.next_hop)
    return summarize_gains(
        truth.topo.names,
        rtt,
        reduce_paths(inst.next_hop, rtt),
        reduce_paths(truth.optimum.next_hop, rtt),
        relayed,
        tables.path,
    )
