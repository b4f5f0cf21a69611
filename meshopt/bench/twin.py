"""The twin benchmark: the same topologies and events in ``meshopt sim`` and in the lab.

Issue 14 item 5, "the simulator predicts the lab". For each topology, one timeline,
in seconds from the moment the agents are started (the lab's ``LiveMesh.start``, the
simulator's time 0):

* ``degrade_at``: a directly routed link gets five times its one-way delay, chosen so a
  relay then wins (:func:`meshopt.demo.pick_degradation`);
* ``fail_at``: the node relaying the most optimal paths (with the degradation, which
  stays) goes down (``node=R down``), and comes back ``restore_after`` later (its own
  window, ``relay_restore``: the routes moving back through it);
* ``jitter_at``: every link's delay jitters with a standard deviation of 11.5 % of its
  delay (the convergence benchmark's +/- 20 %) until the end (``jitter_s``). It comes
  40 s after the relay's return: the policy's confirm time (30 s) and 10 s more, so the
  small gains of the return are taken in its own window. At 15 s after it (sessions
  before 36) they spilled into the jitter period, whose "within 5 %" then measured
  whether a 5.8 % gain left from the return passed the noise test under jitter: a coin
  (the 16-node mesh's par2<->tyo2, docs/twin.md).

The events are chosen from the topology file, not from the live mesh, so both sides
get the same ones, as the same ``lab set`` / ``--event`` text. Per event, both sides
report: the outage (the simulator over every pair; the lab from 50 pings a second of
one pair the relay carried, as ``bench convergence``), the convergence time (every
pair within the policy's large margins of the new optimum, 3 ms or 10 %, and beside it
within 3 ms or 5 %; from readings of every node's next hops every ``READ_EVERY_S`` in
the lab), the next-hop changes in the event's window
(the lab's readings see what was installed at each reading; the simulator counts every
entry in use that changed, fail-overs included) and the next hops in use when the
window ends, compared pair by pair. Goals: final routes identical for >= 95 % of pairs,
times within max(0.5 s, 30 %), changes within +/- 1 per 10 pairs.

The simulator's prediction is its seeds, not one run: where they differ (a pair whose two
paths are a few tenths of a millisecond apart ends on either, a time is reached only when
the estimates' noise clears a margin), it predicts a range. A time or a count is met
when the lab's median is within the tolerance of the seeds' median or of their range
(seeds 3-8 of 10); a pair's final next hop when at least 2 seeds of 10 ended on it. The
JSON keeps the median-only verdict beside it (``ok_median``), and the table says which
verdict came from the range. A time not reached within its window is "never", later than
any time: "never" predicted and measured is met. Each lab run has its own emulator seed.
"""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshopt.analysis import Plan, plan
from meshopt.bench.probenoise import NoiseFit
from meshopt.bench.probenoise import fit as fit_noise
from meshopt.bench.tunnelshare import tunnel_share
from meshopt.demo import pick_degradation, with_delay
from meshopt.errors import InputError
from meshopt.metric import FloatArray, Metric
from meshopt.policy import PolicyConfig
from meshopt.sim.engine import SimConfig, simulate
from meshopt.sim.events import Event, parse_event
from meshopt.topology.load import load_topology
from meshopt.topology.model import Topology

if TYPE_CHECKING:
    from meshopt.lab.tap import Heard

Progress = Callable[[str], None]
# Converged: every pair within the policy's large margins of the optimum (3 ms or 10 %,
# what the controller moves a pair for at once; issue 14 item 3's "within the large
# margins"); and, stricter, within 3 ms or 5 % (``*_5pct_s``), which a pair whose gain
# is a small one (5-10 %) reaches only after the policy's confirm time, or never.
STRICT_REL = 0.05
TOPOLOGIES = ("topologies/bench8.yaml", "topologies/demo.yaml", "gen:geo:n=16,seed=1")
JITTER_SHARE = 0.115  # sigma of +/- 20 % uniform, as bench convergence's stability run


@dataclass(frozen=True)
class Timeline:
    degrade_at: float = 40.0
    fail_at: float = 60.0
    restore_after: float = 15.0
    jitter_at: float = 115.0  # the return's window outlasts the confirm time (above)
    jitter_s: float = 60.0

    @property
    def end(self) -> float:
        return self.jitter_at + self.jitter_s


@dataclass
class Scenario:
    """The events of one topology, as text both sides take."""

    topology: str
    topo: Topology
    degrade: str | None  # "a-b delay=Xms"
    degrade_pair: tuple[str, str] | None
    relay: str | None
    relay_pair: tuple[str, str] | None  # a pair the relay carries in the optimum
    jitter: list[str] = field(default_factory=list)  # "a-b jitter=Xms" per link

    def sim_events(self, tl: Timeline) -> list[Event]:
        out = []
        if self.degrade:
            out.append(parse_event(f"at={tl.degrade_at}s link={self.degrade}"))
        if self.relay:
            out.append(parse_event(f"at={tl.fail_at}s node={self.relay} down"))
            out.append(parse_event(f"at={tl.fail_at + tl.restore_after}s node={self.relay} up"))
        for j in self.jitter:
            out.append(parse_event(f"at={tl.jitter_at}s link={j}"))
        return out


def _relayed(p: Plan) -> dict[str, list[tuple[str, str]]]:
    names = p.topo.names
    through: dict[str, list[tuple[str, str]]] = {}
    for i, a in enumerate(names):
        for j, b in enumerate(names):
            if i < j:
                for k in p.tables.path(i, j)[1:-1]:
                    through.setdefault(names[k], []).append((a, b))
    return through


def scenario(topology: str) -> Scenario:
    topo = load_topology(topology)
    best = plan(topo, Metric(), symmetric=True)
    deg = pick_degradation(topo, best, symmetric=True)
    degrade = pair = None
    at_failure = best  # the relay is picked as routed when it fails: degraded, if it was
    if deg is not None:
        a, b = deg.link
        slow = topo.link(a, b).delay_ms * 5
        degrade, pair = f"{a}-{b} delay={slow:g}ms", (a, b)
        at_failure = plan(with_delay(topo, a, b, 5.0), best.metric, symmetric=True)
    through = _relayed(at_failure)
    relay = relay_pair = None
    if through:
        relay = max(sorted(through), key=lambda n: len(through[n]))
        # The pair it carries with the largest gain over the direct tunnel: a near tie
        # may sit on its direct tunnel, within the margins, and see no outage (the
        # 16-node mesh's first pair: 107.5 ms via par3 against 105.5 ms direct).
        ix = topo.index
        cost, direct = at_failure.tables.cost, at_failure.link_cost

        def gain(pair: tuple[str, str]) -> float:
            i, j = ix(pair[0]), ix(pair[1])
            return float((direct[i, j] - cost[i, j]) / direct[i, j])

        relay_pair = max(through[relay], key=gain)
    jitter = []
    names = topo.names
    for i, a in enumerate(names):
        for j, b in enumerate(names):
            if i < j and topo.tunnels[i, j]:
                d = topo.link(a, b).delay_ms
                jitter.append(f"{a}-{b} jitter={d * JITTER_SHARE:.3f}ms")
    return Scenario(topology, topo, degrade, pair, relay, relay_pair, jitter)


def _windows(sc: Scenario, tl: Timeline) -> list[tuple[str, float, float]]:
    """(event, start, end) of each measured window."""
    out = []
    if sc.degrade:
        out.append(("degradation", tl.degrade_at, tl.fail_at if sc.relay else tl.jitter_at))
    if sc.relay:
        back = tl.fail_at + tl.restore_after
        out.append(("relay_failure", tl.fail_at, back))
        out.append(("relay_restore", back, tl.jitter_at))
    out.append(("jitter", tl.jitter_at, tl.end))
    return out


# --- the simulator's side ----------------------------------------------------------------


def sim_side(
    sc: Scenario,
    tl: Timeline,
    seeds: int = 3,
    boot: tuple[float, float] | None = None,
    install_each_s: float | None = None,
    tunnel: tuple[float, float, float] | None = None,
    late: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """The simulated figures per event, medians over ``seeds`` runs (and each run's).

    ``boot``: (earliest, latest) time the agents came up, as measured in the lab; None:
    the simulator's default (2-3 s). ``install_each_s``: what each agent added to a
    burst of route sets in the lab (:func:`install_each`); None: 0, every agent on its
    own machine. ``tunnel``: what the lab's tunnels added to the agents' RTT, its σ and
    how far tunnels differed (:func:`~meshopt.bench.tunnelshare.tunnel_share`); each seed
    draws its own tunnels from that. None: nothing."""
    runs = []
    events = sc.sim_events(tl)
    extra: dict[str, float] = {}
    if boot is not None:
        extra = {"boot_s": boot[0], "boot_spread_s": max(boot[1] - boot[0], 0.0)}
    if install_each_s is not None:
        extra["install_each_s"] = install_each_s
    if tunnel is not None:
        extra["tunnel_ms"], extra["tunnel_sigma_ms"], extra["tunnel_spread_ms"] = tunnel
    if late is not None:
        extra["late_p"], extra["late_ms"] = late
    large = PolicyConfig().rel_margin
    for seed in range(seeds):
        cfg = SimConfig(
            duration_s=tl.end,
            seed=seed,
            symmetric=True,
            keep_routes=True,
            converge_rel=large,
            **extra,  # type: ignore[arg-type]
        )
        rep = simulate(sc.topo, events, cfg)
        # The same run scored by the stricter reading (the scoring changes nothing else).
        strict = simulate(sc.topo, events, replace(cfg, converge_rel=STRICT_REL))
        one: dict[str, Any] = {
            "initial_converge_s": rep.initial_converge_s,
            "initial_converge_5pct_s": strict.initial_converge_s,
        }
        for name, start, end in _windows(sc, tl):
            # The window's events (the jitter period is one event per link): the first
            # has the outage, the last the convergence.
            at = [e for e in rep.events if abs(e.at_s - start) < 1e-6]
            last5 = [e for e in strict.events if abs(e.at_s - start) < 1e-6][-1]
            inside = [e for e in rep.events if start - 1e-6 <= e.at_s < end]
            one[name] = {
                "outage_s": at[0].outage_s if at[0].broken_pairs else 0.0,
                "converge_s": at[-1].converge_s,
                "converge_5pct_s": last5.converge_s,
                "decided_changes": sum(e.route_changes for e in inside),
                "hop_changes": sum(e.hop_changes for e in inside),
                "routes": _window_routes(rep.events, end),
            }
        runs.append(one)
    return {"runs": runs, **_medians(runs, sc, tl)}


def _window_routes(events: list[Any], end: float) -> dict[str, dict[str, str]] | None:
    """Routes in use at ``end``: those of the last interval that started before it."""
    before = [e for e in events if e.at_s < end - 1e-6]
    return before[-1].routes if before else None


def _medians(runs: list[dict[str, Any]], sc: Scenario, tl: Timeline) -> dict[str, Any]:
    out: dict[str, Any] = {k: _med_time([r.get(k) for r in runs]) for k in FIRST}
    for name, _, _ in _windows(sc, tl):
        rs = [r[name] for r in runs if name in r]
        out[name] = {
            k: (_med_time if k in WINDOW_TIMES else _med)([r.get(k) for r in rs])
            for k in ("outage_s", *WINDOW_TIMES, "decided_changes", "hop_changes")
        }
        out[name]["routes"] = mode_routes([r.get("routes") for r in rs])
    return out


def mode_routes(
    runs: list[dict[str, dict[str, str]] | None],
) -> dict[str, dict[str, str]] | None:
    """Per ordered pair, the next hop most runs ended on (ties: the earliest run's): the
    median's analogue for a next hop. Two paths within a fraction of a millisecond of
    each other (demo's lon->waw after its relay failed: direct 81.10 ms, via par
    80.86 ms) end on either from run to run, on both sides; one run against one run
    judged that coin."""
    tables = [t for t in runs if t is not None]
    if not tables:
        return None
    out: dict[str, dict[str, str]] = {}
    for src in dict.fromkeys(s for t in tables for s in t):
        row: dict[str, str] = {}
        for dst in dict.fromkeys(d for t in tables for d in t.get(src, {})):
            hops = [t[src][dst] for t in tables if dst in t.get(src, {})]
            row[dst] = max(dict.fromkeys(hops), key=hops.count)  # first among equals
        out[src] = row
    return out


FIRST = ("initial_converge_s", "initial_converge_5pct_s")
WINDOW_TIMES = ("converge_s", "converge_5pct_s")


def _med(values: list[Any]) -> float | None:
    v = [x for x in values if x is not None]
    return statistics.median(v) if v else None


def _med_time(values: list[Any]) -> float | None:
    """The median of convergence times where None is "never within the window": it
    counts as later than any time (dropped, one run of three that got there once gave
    the median of all three; half the seeds never did and the median said 19 s)."""
    if not values:
        return None
    m = statistics.median(math.inf if x is None else x for x in values)
    return None if math.isinf(m) else m


# --- the lab's side ----------------------------------------------------------------------


# A reading of every node's next hops takes ~5 ms (wireguard-go's UAPI sockets), so
# the lab's times carry at most this much lag (it was 0.5 s and ~0.1 s per reading
# with ``wg show``: up to 0.6 s added to every lab time the simulator was judged by).
READ_EVERY_S = 0.1


class _Reader(threading.Thread):
    """Every node's next hops, read again and again; (time from t0, hops) per reading."""

    def __init__(self, mesh: Any, t0: float) -> None:
        super().__init__(daemon=True)
        self.mesh, self.t0 = mesh, t0
        self.log: list[tuple[float, dict[str, dict[str, str]]]] = []
        self.stop = threading.Event()
        self.slowest = 0.0

    def run(self) -> None:
        from meshopt.bench.convergence import snapshot

        while not self.stop.is_set():
            began = time.monotonic()
            try:
                hops = snapshot(self.mesh)
            except Exception:  # a reading during a node's stall: the next one counts
                continue
            done = time.monotonic()
            self.slowest = max(self.slowest, done - began)
            self.log.append((done - self.t0, hops))
            self.stop.wait(max(0.0, READ_EVERY_S - (time.monotonic() - began)))


def _outside(
    best: Plan, hops: dict[str, dict[str, str]], policy: PolicyConfig, rel: float
) -> dict[tuple[str, str], list[str]]:
    """The ordered pairs of one reading outside ``policy.abs_margin_ms`` or ``rel`` of
    the optimum, with their paths."""
    from meshopt.bench.convergence import outside

    return {(a, b): path for a, b, path in outside(best, hops, policy.abs_margin_ms, rel)}


def _broken(best: Plan, path: list[str]) -> bool:
    """The path does not deliver on the topology ``best`` was planned on (a loop, a dead
    end, a link or node that is down)."""
    from meshopt.lab.measure import path_cost

    return len(path) < 2 or path[-1] == "?" or not math.isfinite(path_cost(best, path))


def _converged(
    log: list[tuple[float, dict[str, dict[str, str]]]],
    best: Plan,
    start: float,
    end: float,
    policy: PolicyConfig,
    rel: float,
    before: Plan | None = None,
) -> float | None:
    """Seconds from ``start`` to the first reading from which every reading in the window
    had every pair within ``policy.abs_margin_ms`` or ``rel`` of the optimum (None: never).

    ``before``: the optimum the window before had. Pairs outside its margin at the last
    reading before ``start`` are left out unless the event broke their path: the window
    before's stragglers, not this event's doing, as the simulator leaves them out
    (:class:`meshopt.sim.engine._Tracker`). A pair whose small gain waited on its loss
    estimate across an event made the event "never" converge in the lab alone."""
    leftover: dict[tuple[str, str], list[str]] = {}
    if before is not None:
        last = next((h for t, h in reversed(log) if t < start), None)
        if last is not None:
            leftover = _outside(before, last, policy, rel)
    at: float | None = None
    for t, hops in log:
        if t < start or t >= end:
            continue
        bad = _outside(best, hops, policy, rel)
        ok = all(p in leftover and not _broken(best, path) for p, path in bad.items())
        at = None if not ok else (t if at is None else at)
    return None if at is None else at - start


def _changes(log: list[tuple[float, dict[str, dict[str, str]]]], start: float, end: float) -> int:
    prev: dict[str, dict[str, str]] | None = None
    n = 0
    for t, hops in log:
        if t < start - 1.0 or t >= end:
            continue
        if prev is not None and t >= start:
            for src, table in hops.items():
                old = prev.get(src, {})
                n += sum(1 for d in set(table) | set(old) if table.get(d) != old.get(d))
        prev = hops
    return n


def _at(
    log: list[tuple[float, dict[str, dict[str, str]]]], end: float
) -> dict[str, dict[str, str]] | None:
    before = [h for t, h in log if t < end]
    return before[-1] if before else None


def lab_side(
    sc: Scenario,
    tl: Timeline,
    index: int,
    progress: Progress,
    keep: Path | None = None,
    seed: int = 1,
) -> dict[str, Any]:
    """One lab run of the scenario's timeline (root; minutes). ``keep``: keep the lab's
    logs and every next-hop reading there, one directory per run. ``seed``: the
    emulator's (each run its own, or the runs repeat one draw of every link's loss and
    jitter and are not samples of it)."""
    from meshopt.bench.cpuload import lag_window
    from meshopt.lab.agents import BootWatch, agent_installs, agent_logs, agent_stalls, keep_logs
    from meshopt.lab.lab import Lab
    from meshopt.lab.measure import outage_time
    from meshopt.lab.mesh import LiveMesh
    from meshopt.lab.tap import TelemetryTap

    lab = Lab.up(sc.topo, name=f"twin{index}", layout="single", seed=seed)
    mesh = LiveMesh(lab)
    tap = TelemetryTap(lab)
    policy = PolicyConfig()
    out: dict[str, Any] = {"lab_seed": seed}
    try:
        timing = lab.emulator.stats()
        logs = agent_logs(lab, mesh.nodes)
        # The control plane first (the simulator's is there from time 0), then the agents.
        out["controllers_ready_s"] = mesh.start_controllers()
        tap.start()
        t0 = time.monotonic()
        watch = BootWatch(logs, t0)
        watch.start()
        mesh.start_agents()
        started = time.monotonic() - t0
        t0 = time.monotonic()
        watch.t0 = t0
        wall0 = time.time() - (time.monotonic() - t0)
        reader = _Reader(mesh, t0)
        reader.start()
        topo = sc.topo.copy()
        best_start = plan(topo, Metric(), symmetric=True)

        def until(at: float) -> None:
            time.sleep(max(0.0, at - (time.monotonic() - t0)))

        windows = _windows(sc, tl)
        first_end = windows[0][1] if windows else tl.end
        bests: dict[str, Plan] = {}
        outages: dict[str, float | None] = {}
        # When each event took effect (``lab set`` returned), from t0: the times are
        # measured from there, as the simulator's from the event's own time. The relay
        # failure is cut 0.5 s after its nominal time (the outage's ping starts first).
        at: dict[str, float] = {}

        def apply(name: str, text: str) -> None:
            lab.set(text)
            at[name] = time.monotonic() - t0

        if sc.degrade:
            until(tl.degrade_at)
            apply("degradation", sc.degrade)
            ev = parse_event(f"at=0s link={sc.degrade}")
            _apply_text(topo, ev)
            bests["degradation"] = plan(topo, Metric(), symmetric=True)
            outages["degradation"] = 0.0
            progress(f"{sc.topology}: {sc.degrade} at {time.monotonic() - t0:.1f} s")
        if sc.relay and sc.relay_pair:
            until(tl.fail_at)
            a, b = sc.relay_pair
            down = window_topology(sc, tl, "relay_failure")
            bests["relay_failure"] = plan(down, Metric(), symmetric=True)
            outages["relay_failure"] = outage_time(
                mesh,
                a,
                b,
                lambda: apply("relay_failure", f"node={sc.relay} down"),
                timeout=tl.restore_after - 2,
            )
            progress(
                f"{sc.topology}: {sc.relay} down, {a}->{b} back after {outages['relay_failure']}"
            )
            until(tl.fail_at + tl.restore_after)
            apply("relay_restore", f"node={sc.relay} up")
            bests["relay_restore"] = plan(topo, Metric(), symmetric=True)
            outages["relay_restore"] = 0.0
        until(tl.jitter_at)
        for j in sc.jitter:
            apply("jitter", j)  # in effect once the last link's is
            _apply_text(topo, parse_event(f"at=0s link={j}"))
        bests["jitter"] = plan(topo, Metric(), symmetric=True)
        outages["jitter"] = 0.0
        progress(f"{sc.topology}: jitter on every link from {time.monotonic() - t0:.1f} s")
        until(tl.end + 0.6)
        reader.stop.set()
        reader.join(timeout=30)
        tap.stop()
        spell = (wall0 + first_end - TUNNEL_WINDOW_S, wall0 + first_end)
        steady = tap.heard(mesh.key_owner(), *spell)
        out["tunnel"] = _tunnel(steady, sc)
        out["sigma_readings"] = sigma_readings(steady)
        log = reader.log
        large = policy.rel_margin
        out["initial_converge_s"] = _converged(log, best_start, 0.0, first_end, policy, large)
        out["initial_converge_5pct_s"] = _converged(
            log, best_start, 0.0, first_end, policy, STRICT_REL
        )
        before = best_start
        for name, start, end in windows:
            began = at.get(name, start)
            best = bests[name]
            out[name] = {
                "event_at_s": began,
                "outage_s": outages.get(name),
                "converge_s": _converged(log, best, began, end, policy, large, before),
                "converge_5pct_s": _converged(log, best, began, end, policy, STRICT_REL, before),
                "hop_changes": _changes(log, start, end),
                "routes": _at(log, end),
            }
            before = best
        # When the agents' probers logged a stall (woke at w, late by `late`), from t0.
        stalls = [(n, w - wall0, late) for n, w, late in agent_stalls(logs)]
        out["stalls"] = [
            {"node": n, "at_s": round(at, 3), "late_s": late} for n, at, late in stalls
        ]

        def touched(lo: float, hi: float) -> bool:
            return any(lo < at and at - late < hi for _, at, late in stalls)

        out["disturbed"] = touched(0.0, first_end)  # the first routes' window
        for name, lo, hi in windows:
            out[name]["disturbed"] = touched(lo, hi)
        out["slowest_reading_s"] = reader.slowest
        # How long a burst of route sets takes the agents that share the lab's CPUs
        # (after the first routes, whose burst meets the agents' own start-up).
        installs = [(at - wall0, took) for _, at, took in agent_installs(logs)]
        out["install_each_s"] = install_each([x for x in installs if x[0] >= first_end])
        watch.join(timeout=1)
        ups = sorted(watch.up.values())
        out["agents_up_s"] = {"first": ups[0], "last": ups[-1], "count": len(ups)} if ups else None
        out["start_call_s"] = started
        out["lab_fidelity"] = lag_window(timing, lab.emulator.stats())
        if keep is not None:
            run = keep / f"twin{index}"
            keep_logs(lab, run)
            (run / "readings.json").write_text(json.dumps(log))
            heard = heard_rows(tap.heard(mesh.key_owner()), wall0)
            (run / "telemetry.json").write_text(json.dumps(heard))
        return out
    finally:
        tap.stop()
        mesh.stop()
        lab.down()


# The probe interval says how fast a link's estimate can follow a change (an idle link
# is probed every 2 s or more, one in use every 0.33 s).
HEARD_FIELDS = (
    "rtt_ms", "jitter_ms", "noise_ms", "loss", "samples", "alive", "probe_interval_s",
)  # fmt: skip


def heard_rows(heard: list[Heard], wall0: float) -> dict[str, Any]:
    """Every peer report the controller was told, for a run's logs: what it priced each
    link from, when (seconds from the agents' start). Which of two near-tied paths a
    run ended on is then one look at these, not a debug build."""
    rows = [
        [round(h.at - wall0, 3), h.node, h.peer, *(getattr(h.report, f) for f in HEARD_FIELDS)]
        for h in heard
    ]
    return {"fields": ["at_s", "node", "peer", *HEARD_FIELDS], "rows": rows}


# The steady spell before the first event whose telemetry tells what the tunnels add
# (the agents are ~15 s past their warm-up by then on every topology here).
TUNNEL_WINDOW_S = 20.0


def _tunnel(heard: list[Heard], sc: Scenario) -> dict[str, Any] | None:
    """What the lab's tunnels added to the agents' readings (:func:`tunnel_share`)."""
    readings = [
        (h.node, h.peer, h.report.rtt_ms, h.report.jitter_ms)
        for h in heard
        if h.report.alive and h.report.rtt_ms is not None and h.report.jitter_ms is not None
    ]
    share = tunnel_share(readings, sc.topo)
    if share is None:
        return None
    names = sc.topo.names
    return {
        "ms": share.ms,
        "sigma_ms": share.sigma_ms,
        "spread_ms": share.spread_ms,
        "links": share.links,
        "per_tunnel": {
            f"{names[i]}-{names[j]}": x for (i, j), x in sorted(share.per_tunnel.items())
        },
    }


def sigma_readings(heard: list[Heard]) -> list[tuple[str, str, float]]:
    """(node, peer, σ) of every live report: what :func:`meshopt.bench.probenoise.fit`
    reads the shape of the lab's probe noise from."""
    return [
        (h.node, h.peer, h.report.jitter_ms)
        for h in heard
        if h.report.alive and h.report.jitter_ms is not None
    ]


def _noise_of(labs: list[dict[str, Any]], sc: Scenario) -> NoiseFit | None:
    """The lab's probe noise (:func:`~meshopt.bench.probenoise.fit`), every run's
    steady-spell readings pooled."""
    pooled = [(a, b, float(x)) for lab in labs for a, b, x in lab.get("sigma_readings") or []]
    return fit_noise(pooled, sc.topo)


def _apply_text(topo: Topology, ev: Event) -> None:
    import numpy as np

    from meshopt.sim.engine import _apply

    _apply(ev, topo, np.ones(topo.n, dtype=bool))


# --- comparison ----------------------------------------------------------------------------


def same_routes(
    a: dict[str, dict[str, str]] | None, b: dict[str, dict[str, str]] | None
) -> float | None:
    """Share of ordered pairs with the same next hop in both."""
    if a is None or b is None:
        return None
    keys = [(s, d) for s in a for d in a[s]] + [(s, d) for s in b for d in b[s]]
    pairs_ = set(keys)
    if not pairs_:
        return None
    same = sum(1 for s, d in pairs_ if a.get(s, {}).get(d) == b.get(s, {}).get(d))
    return same / len(pairs_)


def self_agreement(runs: list[dict[str, dict[str, str]] | None]) -> float | None:
    """The median, over every two runs, of :func:`same_routes`: how far the side agrees
    with itself. The 16-node lab's runs agreed with each other at 0.93-0.98: paths a
    fraction of a percent apart (ash2-par2 via nyc1 121.24 ms, via nyc2 121.29 ms)
    end on either, so no simulator could match every run at 0.95."""
    shares = [
        x for i, a in enumerate(runs) for b in runs[i + 1 :] if (x := same_routes(a, b)) is not None
    ]
    return statistics.median(shares) if shares else None


def _diff(a: dict[str, dict[str, str]] | None, b: dict[str, dict[str, str]] | None) -> list[str]:
    """The ordered pairs whose next hop differs: "src->dst sim:X lab:Y"."""
    if a is None or b is None:
        return []
    keys = sorted({(s, d) for t in (a, b) for s in t for d in t[s]})
    return [
        f"{s}->{d} sim:{a.get(s, {}).get(d)} lab:{b.get(s, {}).get(d)}"
        for s, d in keys
        if a.get(s, {}).get(d) != b.get(s, {}).get(d)
    ]


# Two paths this close in the topology (RTT over the underlay) are an exact tie: which one
# a side ends on rests on its measurement noise, not on the topology.
TIE_MS = 0.1


def _walk_rtt(
    topo: Topology,
    rtt: FloatArray,
    routes: dict[str, dict[str, str]],
    src: str,
    dst: str,
) -> float:
    """RTT (ms) of the path ``routes`` walk from src to dst over ``topo`` (``rtt``: its
    ``rtt_ms()``); inf on a gap, a loop or a link that is down."""
    total, at, seen = 0.0, src, {src}
    while at != dst:
        hop = routes.get(at, {}).get(dst)
        if hop is None or hop in seen or not topo.tunnels[topo.index(at), topo.index(hop)]:
            return float("inf")
        total += float(rtt[topo.index(at), topo.index(hop)])
        seen.add(hop)
        at = hop
    return total


def window_topology(sc: Scenario, tl: Timeline, name: str) -> Topology:
    """The topology in effect at the end of the window ``name`` (delays and links)."""
    topo = sc.topo.copy()
    if sc.degrade:
        _apply_text(topo, parse_event(f"at=0s link={sc.degrade}"))
    if name == "relay_failure" and sc.relay:
        i = topo.index(sc.relay)
        topo.tunnels[i, :] = False
        topo.tunnels[:, i] = False
    return topo


def exact_ties(
    topo: Topology, a: dict[str, dict[str, str]] | None, b: dict[str, dict[str, str]] | None
) -> list[str]:
    """The ordered pairs whose next hops differ between ``a`` and ``b`` while both
    paths have the same RTT in ``topo`` (within TIE_MS): "src->dst X=Y ms"."""
    if a is None or b is None:
        return []
    out = []
    rtt = topo.rtt_ms()
    for s in sorted(a):
        for d in sorted(a[s]):
            if a[s][d] == b.get(s, {}).get(d):
                continue
            ra, rb = _walk_rtt(topo, rtt, a, s, d), _walk_rtt(topo, rtt, b, s, d)
            if math.isfinite(ra) and abs(ra - rb) <= TIE_MS:
                out.append(f"{s}->{d} {ra:g}={rb:g} ms")
    return out


def _time_ok(sim: float | None, lab: float | None) -> bool:
    """None is "never within the window", later than any time as in the medians and the
    seeds' range: a simulator that says never, where the lab never did either, predicted
    it."""
    if sim is None or lab is None:
        return sim is None and lab is None
    return abs(sim - lab) <= max(0.5, 0.3 * lab)


# Where the outcome rests on noise (a pair between two paths a few tenths of a
# millisecond apart, a time a pair reaches only when its estimates happen to clear the
# margins) the seeds differ, and the simulator's prediction is a range, not its median.
# The range: the middle of the seeds, all but a fifth at either end (seeds 3-8 of 10).
BAND_CUT = 5
# A next hop the lab ended on was predicted if at least this share of the seeds ended
# on it too (2 of 10).
PREDICTED_SHARE = 0.2


def seed_band(values: list[Any]) -> tuple[float, float] | None:
    """The seeds' range (None, "never", is later than any time: ``math.inf``)."""
    v = sorted(math.inf if x is None else float(x) for x in values)
    if not v:
        return None
    k = len(v) // BAND_CUT
    return v[k], v[-1 - k]


def _in_band(band: tuple[float, float] | None, lab: float | None, tol: float) -> bool | None:
    """The lab's figure within ``tol`` of the seeds' range ("never" inside a range
    that reaches it)."""
    if band is None:
        return None
    if lab is None:
        return math.isinf(band[1])
    return band[0] - tol <= lab <= band[1] + tol


def _judged(seeds: list[Any], median: bool | None, lab: float | None, tol: float) -> dict[str, Any]:
    """A figure judged both ways: the seeds' median against the lab's (``median``,
    kept as ``ok_median``), and the lab's within ``tol`` of the seeds' range (``ok``,
    which the median passing implies)."""
    band = seed_band(seeds)
    ok = median if median is not False else _in_band(band, lab, tol)
    return {"sim_range": band, "ok": ok, "ok_median": median}


def _time_row(seeds: list[Any], sim: float | None, lab: float | None) -> dict[str, Any]:
    tol = 0.5 if lab is None else max(0.5, 0.3 * lab)
    return {"sim": sim, "lab": lab, **_judged(seeds, _time_ok(sim, lab), lab, tol)}


def predicted_routes(
    seeds: list[dict[str, dict[str, str]] | None], lab: dict[str, dict[str, str]] | None
) -> float | None:
    """Share of ordered pairs whose next hop in ``lab`` at least PREDICTED_SHARE of the
    seeds ended on (a pair the seeds split on is predicted either way)."""
    tables = [t for t in seeds if t is not None]
    if not tables or lab is None:
        return None
    keys = {(s, d) for t in (*tables, lab) for s in t for d in t[s]}
    if not keys:
        return None
    need = PREDICTED_SHARE * len(tables) - 1e-9
    hit = sum(
        1
        for s, d in keys
        if sum(1 for t in tables if t.get(s, {}).get(d) == lab.get(s, {}).get(d)) >= need
    )
    return hit / len(keys)


def compare(sc: Scenario, tl: Timeline, sim: dict[str, Any], lab: dict[str, Any]) -> dict[str, Any]:
    n = sc.topo.n
    pairs_ = n * (n - 1) // 2
    seeds = sim.get("runs", [])
    rows: dict[str, Any] = {
        k: _time_row([r.get(k) for r in seeds], sim.get(k), lab.get(k)) for k in FIRST
    }
    rows["left_out"], rows["stalled"] = lab.get("left_out", 0), lab.get("stalled", False)
    for name, _, _ in _windows(sc, tl):
        s, m = sim.get(name, {}), lab.get(name, {})
        each = [r.get(name, {}) for r in seeds]
        share = same_routes(s.get("routes"), m.get("routes"))
        predicted = predicted_routes([r.get("routes") for r in each], m.get("routes"))
        if predicted is None:  # no seeds' tables (a report read back): the modes
            predicted = share
        tol = max(1.0, pairs_ / 10.0)
        sc_, mc = s.get("hop_changes"), m.get("hop_changes")
        median = None if sc_ is None or mc is None else abs(sc_ - mc) <= tol
        diff = _diff(s.get("routes"), m.get("routes"))
        ties = exact_ties(window_topology(sc, tl, name), s.get("routes"), m.get("routes"))
        pairs_ordered = 2 * pairs_
        rows[name] = {
            **{k: _time_row([r.get(k) for r in each], s.get(k), m.get(k))
               for k in ("outage_s", *WINDOW_TIMES)},
            "changes": {"sim": sc_, "sim_decided": s.get("decided_changes"), "lab": mc,
                        "tolerance": tol,
                        **_judged([r.get("hop_changes") for r in each], median, mc, tol)},
            "left_out": m.get("left_out", 0),
            "stalled": m.get("stalled", False),
            "final_routes_same": {"share": share, "predicted": predicted,
                                  "ok": None if predicted is None else predicted >= 0.95,
                                  "ok_median": None if share is None else share >= 0.95,
                                  "differ": diff, "exact_ties": ties,
                                  "share_but_ties": None if share is None
                                  else share + len(ties) / pairs_ordered},
        }  # fmt: skip
    return rows


def bench(
    topologies: tuple[str, ...] = TOPOLOGIES,
    *,
    sim_only: bool = False,
    seeds: int = 10,
    lab_runs: int = 1,
    timeline: Timeline | None = None,
    progress: Progress = lambda _: None,
    logs: Path | None = None,
    cpu_load_n: int = 0,
    recorded: dict[str, list[dict[str, Any]]] | None = None,
    record: Callable[[dict[str, list[dict[str, Any]]]], None] | None = None,
) -> dict[str, Any]:
    """``cpu_load_n`` busy processes run beside each lab run (the shared VM a real mesh
    runs on); the simulator is told only what the lab measured (boot, installs).

    ``recorded``: lab runs per topology from an earlier bench (what ``record`` was
    given), judged again instead of running the lab: a change to the simulator is then
    measured against the same lab runs, in seconds."""
    from meshopt.bench.cpuload import cpu_load

    tl = timeline or Timeline()
    out: dict[str, Any] = {"timeline": tl.__dict__, "sim_seeds": seeds, "lab_runs": lab_runs}
    out["cpu_load"] = 0 if sim_only else cpu_load_n
    results = []
    kept: dict[str, list[dict[str, Any]]] = {}
    for k, topology in enumerate(topologies):
        sc = scenario(topology)
        labs: list[dict[str, Any]] = []
        if recorded is not None:
            labs = recorded.get(topology, [])
            if not labs:
                raise InputError(f"no recorded lab runs of {topology}")
        for r in range(0 if sim_only or recorded is not None else lab_runs):
            with cpu_load(cpu_load_n) as busy:
                if busy:
                    progress(f"{len(busy)} busy processes beside the lab: pids {busy}")
                labs.append(lab_side(sc, tl, k * 10 + r, progress, logs, seed=r + 1))
        kept[topology] = labs
        if record is not None and labs and recorded is None:
            record(kept)
        boot = _boot(labs)
        each = _med([x.get("install_each_s") for x in labs])
        tunnel = _tunnel_of(labs)
        noise = _noise_of(labs, sc)
        late = None
        if tunnel is not None and noise is not None:
            # The fit's normal σ in place of the median excess, and the late probes'
            # mean out of the tunnels' share (the lab's readings held both).
            tunnel = (max(tunnel[0] - noise.late_mean_ms, 0.0), noise.sigma_ms, tunnel[2])
            late = (noise.late_p, noise.late_ms)
        started = time.monotonic()
        sim = sim_side(sc, tl, seeds, boot, each, tunnel, late)
        entry: dict[str, Any] = {
            "topology": topology,
            "nodes": sc.topo.n,
            "events": {"degradation": sc.degrade, "relay_failure": sc.relay,
                       "relay_pair": sc.relay_pair, "jitter_links": len(sc.jitter)},
            "sim_wall_s": time.monotonic() - started,
            "sim_boot_from_lab": boot,
            "sim_install_each_from_lab": each,
            "sim_tunnel_from_lab": tunnel,
            "sim_noise_from_lab": None if noise is None else noise.__dict__,
            "sim": _strip(sim),
        }  # fmt: skip
        progress(f"{topology}: simulated in {entry['sim_wall_s']:.1f} s")
        if labs:
            lab = _lab_medians(labs, sc, tl)
            entry["lab"] = _strip(lab)
            entry["lab_runs"] = [_strip(x) for x in labs]
            entry["compare"] = compare(sc, tl, sim, lab)
            for name, _, _ in _windows(sc, tl):
                fr = entry["compare"][name]["final_routes_same"]
                fr["lab_runs_agree"] = self_agreement([x.get(name, {}).get("routes") for x in labs])
                fr["sim_seeds_agree"] = self_agreement(
                    [r.get(name, {}).get("routes") for r in sim["runs"]]
                )
        results.append(entry)
    out["topologies"] = results
    return out


def install_each(installs: list[tuple[float, float]], gap_s: float = 0.1) -> float | None:
    """Seconds each agent adds to a burst of route sets (arrivals less than ``gap_s``
    apart): per burst of three or more, the spread of the install times over the number
    of agents after the first; the median over bursts. A lab's agents share two cores,
    so the last of 16 installs 0.1-0.6 s after the first: the simulator's
    ``install_each_s``. None without such bursts. ``installs``: (arrived, took) pairs."""
    bursts: list[list[float]] = []
    last = -math.inf
    for arrived, took in sorted(installs):
        if arrived - last > gap_s:
            bursts.append([])
        bursts[-1].append(took)
        last = arrived
    each = [(max(b) - min(b)) / (len(b) - 1) for b in bursts if len(b) >= 3]
    return statistics.median(each) if each else None


def _boot(labs: list[dict[str, Any]]) -> tuple[float, float] | None:
    """(earliest, latest) agent start measured in the lab runs, medians over runs."""
    ups = [x["agents_up_s"] for x in labs if x.get("agents_up_s")]
    if not ups:
        return None
    return statistics.median(u["first"] for u in ups), statistics.median(u["last"] for u in ups)


def _tunnel_of(labs: list[dict[str, Any]]) -> tuple[float, float, float] | None:
    """(ms, σ ms, spread between tunnels ms) the lab's tunnels added, medians over runs."""
    got = [x["tunnel"] for x in labs if x.get("tunnel")]
    if not got:
        return None
    return (
        statistics.median(t["ms"] for t in got),
        statistics.median(t["sigma_ms"] for t in got),
        statistics.median(t.get("spread_ms", 0.0) for t in got),
    )


def _calm(runs: list[Any], disturbed: list[bool]) -> tuple[list[Any], int, bool]:
    """The runs whose window no agent stall touched, if any is left (else all of them),
    how many were left out, and whether every run's window was touched."""
    calm = [r for r, d in zip(runs, disturbed, strict=True) if not d]
    return (calm, len(runs) - len(calm), False) if calm else (runs, 0, bool(runs))


def _lab_medians(labs: list[dict[str, Any]], sc: Scenario, tl: Timeline) -> dict[str, Any]:
    """Medians over the lab runs; a window in which the agents' probers logged a stall
    (the machine did not run them for 0.5 s or more: the lab failing to keep time, which
    fails over routes in the lab and never in the simulator) is left out while another
    run has the window calm (``left_out`` says how many). ``stalled``: every run's
    window was touched, so the lab did not keep time there and its figures say nothing
    about the controller (the benchmark's fidelity check, as in issue 14 item 4)."""
    first, skipped, stalled = _calm(labs, [bool(x.get("disturbed")) for x in labs])
    out: dict[str, Any] = {k: _med_time([x.get(k) for x in first]) for k in FIRST}
    out["left_out"], out["stalled"] = skipped, stalled
    for name, _, _ in _windows(sc, tl):
        every = [x[name] for x in labs if name in x]
        rs, skipped, stalled = _calm(every, [bool(r.get("disturbed")) for r in every])
        out[name] = {
            k: (_med_time if k in WINDOW_TIMES else _med)([r.get(k) for r in rs])
            for k in ("outage_s", *WINDOW_TIMES, "hop_changes")
        }
        out[name]["routes"] = mode_routes([r.get("routes") for r in rs])
        out[name]["left_out"], out[name]["stalled"] = skipped, stalled
    return out


def _strip(d: Any) -> Any:
    """The report without route tables (they are compared, not printed)."""
    if isinstance(d, dict):
        return {k: _strip(v) for k, v in d.items() if k != "routes"}
    if isinstance(d, list):
        return [_strip(v) for v in d]
    return d


def table(out: dict[str, Any]) -> str:
    """The comparison as a Markdown table (simulated / measured, goal met or not)."""

    def f(x: Any) -> str:
        if x is None:
            return "-"
        return f"{x:.2f}" if isinstance(x, float) else str(x)

    def tm(x: Any) -> str:  # a time: None is "never within the window"
        return "never" if x is None else f(x)

    stalled = False  # the verdict of the row being written

    def ok(x: Any) -> str:
        # A goal the lab did not keep time for is neither met nor missed.
        return (
            "lab stalled"
            if stalled and x is not None
            else {True: "yes", False: "**no**", None: "-"}[x]
        )

    def rng(x: float) -> str:
        return "never" if math.isinf(x) else f"{x:.2f}"

    def judged(row: dict[str, Any]) -> str:
        # Met only within the seeds' range: the range says how far the seeds differ.
        band = row.get("sim_range")
        if row.get("ok") is True and row.get("ok_median") is False and band and not stalled:
            return f"yes, in the seeds' {rng(band[0])}-{rng(band[1])}"
        return ok(row.get("ok"))

    def out_(r: dict[str, Any]) -> str:
        if r.get("stalled"):
            return " (every lab run's agents stalled)"
        n = r.get("left_out")
        return f" ({n} lab run{'s' if n > 1 else ''} left out: agents stalled)" if n else ""

    def ties(fr: dict[str, Any]) -> str:
        n = len(fr.get("exact_ties") or [])
        out = f" ({f(fr['share_but_ties'])} but {n} exact ties)" if n else ""
        if fr.get("predicted") is not None and fr["predicted"] != fr.get("share"):
            out += f"; {f(fr['predicted'])} among the seeds' ends"
        agree = fr.get("lab_runs_agree")
        return out + (f"; lab runs agree {f(agree)}" if agree is not None else "")

    lines = [
        "| topology | event | outage s sim / lab | ok | convergence s sim / lab | ok "
        "| within 5 %, s sim / lab | ok | changes sim / lab (tol) | ok | final routes same | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in out["topologies"]:
        c = t.get("compare")
        if c is None:
            continue
        ini, ini5 = c["initial_converge_s"], c["initial_converge_5pct_s"]
        stalled = bool(c.get("stalled"))
        lines.append(
            f"| {t['topology']}{out_(c)} | first routes | | "
            f"| {tm(ini['sim'])} / {tm(ini['lab'])} "
            f"| {judged(ini)} | {tm(ini5['sim'])} / {tm(ini5['lab'])} | {judged(ini5)} "
            "| | | | |"
        )
        for name in ("degradation", "relay_failure", "relay_restore", "jitter"):
            r = c.get(name)
            if r is None:
                continue
            o, v, ch, fr = r["outage_s"], r["converge_s"], r["changes"], r["final_routes_same"]
            v5 = r["converge_5pct_s"]
            stalled = bool(r.get("stalled"))
            lines.append(
                f"| {t['topology']} | {name}{out_(r)} "
                f"| {tm(o['sim'])} / {tm(o['lab'])} | {judged(o)} "
                f"| {tm(v['sim'])} / {tm(v['lab'])} | {judged(v)} "
                f"| {tm(v5['sim'])} / {tm(v5['lab'])} | {judged(v5)} "
                f"| {f(ch['sim'])} / {f(ch['lab'])} ({f(ch['tolerance'])}) | {judged(ch)} "
                f"| {f(fr['share'])}{ties(fr)} | {ok(fr['ok'])} |"
            )
    return "\n".join(lines)
