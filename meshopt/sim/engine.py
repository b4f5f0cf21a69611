"""The simulation loop: a pure function of (topology, events, config, seed).

Time advances in probe rounds of ``probe_interval_s``. In the round at time t:

1. events due at t change the underlay (the ground truth);
2. every ``recompute_s`` the controller turns the agents' estimates into link
   costs, computes best routes (with backups) and lets the anti-flap policy
   decide what to install;
3. an agent whose next hop has stopped answering fails over to its backup next
   hop at once (local fail-over, between recomputes);
4. the routes in use are scored against the ground truth, which is how
   convergence and outage times are measured;
5. one probe per tunnel direction is drawn from the underlay as it is at t
   (normal noise with the link's jitter as standard deviation, as in topology
   files and the lab's shaper; losses from its loss) and fed to the per-link
   estimator the agents run (:mod:`meshopt.sim.estimator`).

So a decision at t only knows probes sent before t: a change at t is seen
one round later at the earliest, never in the round it happens (a probe takes
its RTT to come back). Before the controller's first decision the mesh uses
what WireGuard gives without it: every pair over its own tunnel, if it has one;
those routes were not chosen by the policy, so they are not held.

A pair is *converged* when the policy would have no reason to move it to the
optimum for the ground truth even with settled estimates: the gain misses the
absolute or relative margin, or is within the noise that settled estimates keep
(``noise_sigmas`` times their standard deviation). Convergence time is when every
pair first reached that state and stayed there until the next event (or the end);
after an event, pairs that were already outside the margin when it came are left
out of that (unless the event cuts them): they are the previous interval's, and
still counted in ``suboptimal_pairs``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from meshopt.errors import InputError
from meshopt.graph import topology_costs
from meshopt.metric import FloatArray, Metric
from meshopt.policy import Installed, PolicyConfig, decide
from meshopt.routing import NO_ROUTE, RouteTables, compute_routes
from meshopt.routing.backup import backup_inputs, backup_next_hops
from meshopt.routing.tables import IntArray, reduce_paths
from meshopt.sim.estimator import BoolArray, LinkEstimator
from meshopt.sim.events import Event, check_events
from meshopt.sim.report import EventResult, GainSummary, SimPerf, SimReport, summarize_gains
from meshopt.topology.model import Topology


@dataclass(frozen=True)
class SimConfig:
    duration_s: float = 120.0
    seed: int = 0
    probe_interval_s: float = 0.25
    dead_after: int = 4  # missed probes: 4 x 0.25 s declares a peer dead within 1 s
    recompute_s: float | None = None  # None: 1 s, or 5 s above 300 nodes
    rtt_half_life_s: float = 2.0
    loss_half_life_s: float = 10.0
    symmetric: bool = False
    backups: bool = True
    metric: Metric = field(default_factory=Metric)
    policy: PolicyConfig = field(default_factory=PolicyConfig)

    def recompute_interval(self, n: int) -> float:
        if self.recompute_s is not None:
            return self.recompute_s
        return 1.0 if n <= 300 else 5.0


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


def _truth(
    topo: Topology, node_up: BoolArray, metric: Metric, symmetric: bool, est: LinkEstimator
) -> _Truth:
    usable = topo.tunnels & node_up[:, None] & node_up[None, :]
    cost = topology_costs(topo, metric)
    cost = np.where(usable, cost, np.inf)
    np.fill_diagonal(cost, 0.0)
    # "down" links are modelled as loss 1, which the metric already makes inf.
    opt = compute_routes(cost, topo.names, relay_hop_ms=metric.relay_hop_ms, symmetric=symmetric)
    sigma = np.sqrt(topo.jitter_ms**2 + topo.jitter_ms.T**2)
    loss = 1.0 - (1.0 - topo.loss) * (1.0 - topo.loss.T)
    var = _cost_var(sigma, loss, metric, est.a_rtt, est.a_loss)
    return _Truth(
        topo=topo,
        node_up=node_up,
        rtt=topo.rtt_ms(),
        sigma=sigma,
        loss=loss,
        usable=usable,
        cost=cost,
        optimum=opt,
        relay=metric.relay_hop_ms,
        var=var,
        optimum_var=reduce_paths(opt.next_hop, var),
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


def _cost_noise(est: LinkEstimator, metric: Metric) -> FloatArray:
    """Standard deviation of each link's estimated metric cost: RTT and loss terms.

    The policy must not switch on what estimation noise alone can produce; on a
    lossy link the loss estimate is the noisier part (the penalty's slope is
    ``loss_penalty_ms / (1 - loss)^2``).
    """
    loss = np.clip(est.loss, 0.0, 0.99)
    slope = metric.loss_penalty_ms / (1.0 - loss) ** 2
    noise = np.sqrt(est.noise() ** 2 + (slope * est.loss_noise()) ** 2)
    return np.asarray(np.where(np.isfinite(noise), noise, 0.0))


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

    def __init__(self, best: RouteTables, cost: FloatArray, relay: float, enabled: bool) -> None:
        self.best = best
        self._cost: FloatArray | None = cost if enabled else None
        self._relay = relay
        self._inputs: tuple[FloatArray, FloatArray] | None = None  # dist, weights
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
            self._inputs = backup_inputs(self.best, self._cost, relay_hop_ms=self._relay)
        dist, weights = self._inputs
        every = need.size == self.best.n
        fresh = backup_next_hops(dist, weights, self.best.next_hop, None if every else need)
        if self.best.backup is not None:
            fresh[self._done] = self.best.backup[self._done]  # keep the earlier rows
        self.best = replace(self.best, backup=fresh, dist=dist)
        self._done[need] = True
        self.computed = True
        self.took_s += time.perf_counter() - t0
        return self.best


def _effective(
    inst: Installed, backups: _Backups | None, dead: BoolArray
) -> tuple[IntArray, BoolArray]:
    """Installed next hops, with local fail-over to the backup where the next hop is dead.

    The controller ships a backup with every entry it installs: the loop-free
    alternate of the best route where the entry is the best route, and the best
    route's own next hop where the policy kept another one. An agent switches to
    it when the installed next hop stops answering and the backup still does.
    Also returns the mask of entries running on their backup.
    """
    nh = inst.next_hop
    n = nh.shape[0]
    none = np.zeros((n, n), dtype=bool)
    if backups is None:
        return nh, none
    rows = np.broadcast_to(np.arange(n)[:, None], (n, n))
    broken = (nh != NO_ROUTE) & dead[rows, np.where(nh == NO_ROUTE, rows, nh)]
    np.fill_diagonal(broken, False)  # a node's own entry (it is never probed) has no backup
    if not broken.any():
        return nh, none  # nothing to fail over: the backups are not needed this round
    best = backups.tables(np.flatnonzero(broken.any(axis=1)))
    if best is None or best.backup is None:
        return nh, none
    backup = np.where(nh == best.next_hop, best.backup, best.next_hop)
    alive = (backup != NO_ROUTE) & ~dead[rows, np.where(backup == NO_ROUTE, rows, backup)]
    swap: BoolArray = broken & alive & (backup != nh)
    if not swap.any():
        return nh, swap
    return np.where(swap, backup, nh), swap


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

    def score(self, truth: _Truth, eff: IntArray, now: float, pol: PolicyConfig) -> None:
        if self._seen is not None and self._seen[0] is truth and np.array_equal(self._seen[1], eff):
            return  # same routes, same underlay: same verdict as last round (saves a full walk)
        self._seen = (truth, eff.copy())
        got = _true_cost(truth, eff, truth.relay)
        opt = truth.optimum.cost
        want = np.isfinite(opt) & ~np.eye(opt.shape[0], dtype=bool)
        broken = want & ~np.isfinite(got)
        # Converged: the policy would not move the pair to the optimum even with
        # settled estimates of the truth: the gain misses the absolute margin, or
        # the relative one (of the route in use, as the policy takes it), or is
        # within the noise such estimates still have.
        with np.errstate(invalid="ignore"):  # inf - inf where a pair is unreachable anyway
            gain = got - opt
            noise = np.sqrt(reduce_paths(eff, truth.var) + truth.optimum_var)
            close = (
                (gain < pol.abs_margin_ms + 1e-6)
                | (gain < pol.rel_margin * got + 1e-6)
                | (gain <= pol.noise_sigmas * noise + 1e-6)
            )
        bad = want & (broken | ~close)
        self.bad = bad
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
    live = topo.copy()
    node_up = np.ones(n, dtype=bool)
    est = LinkEstimator(
        cfg.probe_interval_s, cfg.rtt_half_life_s, cfg.loss_half_life_s, cfg.dead_after
    )
    est.reset(n)
    clock = time.perf_counter
    phase = dict.fromkeys(
        ("truth", "routes", "backups", "policy", "failover", "score", "probes"), 0.0
    )
    recomputes = backup_computations = 0
    t0 = clock()
    truth = _truth(live, node_up, metric, cfg.symmetric, est)
    phase["truth"] += clock() - t0
    pending = sorted(events, key=lambda e: e.at_s)
    steps = max(1, round(cfg.duration_s / cfg.probe_interval_s))
    every = max(1, round(cfg.recompute_interval(n) / cfg.probe_interval_s))
    off = ~np.eye(n, dtype=bool)
    installed = _direct(topo)
    backups: _Backups | None = None
    was_swapped = np.zeros((n, n), dtype=bool)
    changes = np.zeros((n, n), dtype=np.int64)
    failovers = 0
    gains: GainSummary | None = None
    start = _Tracker(EventResult(event="start", at_s=0.0))
    tracker = start
    results: list[EventResult] = []
    for step in range(steps):
        now = step * cfg.probe_interval_s
        while pending and pending[0].at_s <= now:
            ev = pending.pop(0)
            if gains is None:
                gains = _gains(truth, installed)
            _apply(ev, live, node_up)
            t0 = clock()
            truth = _truth(live, node_up, metric, cfg.symmetric, est)
            phase["truth"] += clock() - t0
            tracker = _Tracker(EventResult(event=ev.text, at_s=ev.at_s), leftover=tracker.bad)
            results.append(tracker.result)

        if step > 0 and step % every == 0:  # the controller; at step 0 nothing is measured yet
            if backups is not None and backups.computed:  # the last interval's, if it was needed
                backup_computations += 1
                phase["backups"] += backups.took_s
                phase["failover"] -= backups.took_s  # it ran inside the fail-over check
            recomputes += 1
            t0 = clock()
            cost = metric.link_costs(est.srtt, est.jitter, est.loss)
            cost = np.where((est.dead() | ~topo.tunnels) & off, np.inf, cost)
            np.fill_diagonal(cost, 0.0)
            best = compute_routes(cost, topo.names, relay_hop_ms=relay, symmetric=cfg.symmetric)
            backups = _Backups(best, cost, relay, cfg.backups)
            t1 = clock()
            phase["routes"] += t1 - t0
            dec = decide(
                installed, best, cost, _cost_noise(est, metric), now, cfg.policy,
                relay_hop_ms=relay, symmetric=cfg.symmetric,
            )  # fmt: skip
            changes += dec.changed
            tracker.result.route_changes += int(dec.changed.sum())
            installed = dec.installed
            phase["policy"] += clock() - t1

        t0 = clock()
        eff, swapped = _effective(installed, backups, est.dead())
        failovers += int((swapped & ~was_swapped).sum())
        was_swapped = swapped
        t1 = clock()
        tracker.score(truth, eff, now, cfg.policy)
        t2 = clock()

        # jitter is the standard deviation of the delay (as in topology files and the
        # lab's shaper): normal noise around the configured RTT, never below zero.
        noise = rng.standard_normal((n, n)) * truth.sigma
        lost = (rng.random((n, n)) < truth.loss) | ~truth.usable
        est.update(np.maximum(truth.rtt + noise, 0.0), lost)
        phase["failover"] += t1 - t0
        phase["score"] += t2 - t1
        phase["probes"] += clock() - t2
        if progress is not None:
            progress(step / steps)

    if backups is not None and backups.computed:
        backup_computations += 1
        phase["backups"] += backups.took_s
        phase["failover"] -= backups.took_s  # it ran inside the fail-over check
    if gains is None:
        gains = _gains(truth, installed)
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
        failovers=failovers,
        runtime_s=runtime,
        initial_converge_s=start.converged_at,
        initial_suboptimal_pairs=start.result.suboptimal_pairs,
        perf=perf,
    )


def _true_cost(truth: _Truth, nh: IntArray, relay: float) -> FloatArray:
    """Metric cost of the given routes under the ground truth (inf where they are broken)."""
    w = truth.cost + relay
    np.fill_diagonal(w, 0.0)
    c = reduce_paths(nh, w)
    c[~np.eye(nh.shape[0], dtype=bool) & np.isfinite(c)] -= relay
    return c


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
