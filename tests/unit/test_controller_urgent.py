"""The controller's urgent path (issue 15): a dead node or a link gone far worse moves
only the entries whose installed path runs over it, at once and beside a recompute in
progress; the full pass then fills backups and bulk routes. Pure calls, injected clocks;
nothing here is timed (the timing is ``scripts/bench_scale.py``'s)."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from meshopt.agent.core import AgentCore, RouteState
from meshopt.agent.telemetry import Plan, signed_telemetry
from meshopt.bench.synthetic import CONTROLLER_ID, MESH, SyntheticMesh
from meshopt.bus.messages import AgentStatus, PeerReport, Route
from meshopt.bus.signing import generate_signing_key, public_key_b64, sign
from meshopt.controller import engine, urgent
from meshopt.controller.config import ControllerConfig, Enrolment
from meshopt.controller.core import URGENT, URGENT_MAX_NODES, ControllerCore
from meshopt.policy import PolicyConfig
from meshopt.routing.allpairs import compute_routes
from meshopt.routing.tables import NO_ROUTE, IntArray
from meshopt.topology.generators import generate

WALL = 1_700_000_000.0


def _walk(nh: IntArray, s: int, d: int) -> list[int]:
    path = [s]
    while path[-1] != d and len(path) <= nh.shape[0]:
        h = int(nh[path[-1], d])
        if h == NO_ROUTE:
            break
        path.append(h)
    return path


def _busiest_relay(nh: IntArray) -> int:
    n = nh.shape[0]
    relayed = (nh != np.arange(n)[None, :]) & (nh >= 0) & (nh != np.arange(n)[:, None])
    return int(np.bincount(nh[relayed], minlength=n).argmax())


def test_the_engine_and_the_urgent_path_agree_on_far_worse() -> None:
    assert (urgent.DEGRADED_ABS_MS, urgent.DEGRADED_REL) == (
        engine.DEGRADED_ABS_MS,
        engine.DEGRADED_REL,
    )


@pytest.mark.parametrize("n", [40, 150])
def test_a_dead_relay_moves_exactly_the_paths_through_it_as_a_full_recompute_would(
    n: int,
) -> None:
    cost = np.array(generate(f"gen:geo:n={n},seed=3").rtt_ms(), dtype=float)
    np.fill_diagonal(cost, 0.0)
    nh = compute_routes(cost, relay_hop_ms=2.0).next_hop
    x = _busiest_relay(nh)
    after = cost.copy()
    after[x, :] = after[:, x] = np.inf
    after[x, x] = 0.0
    bad = np.zeros((n, n), dtype=bool)
    bad[x, :] = bad[:, x] = True
    dead = np.arange(n) == x
    fix = urgent.urgent_fix(
        nh, after, np.zeros((n, n)), bad, dead, PolicyConfig(), relay_hop_ms=2.0, bulk=nh.copy()
    )
    through = {
        (s, d)
        for s in range(n)
        for d in range(n)
        if x not in (s, d) and s != d and x in _walk(nh, s, d)
    }
    assert through, "the mesh has no relay through the busiest node"
    moved = set(zip(fix.s.tolist(), fix.d.tolist(), strict=True))
    # Every entry whose next hop is the dead node moves; others only if their path ran
    # through it (a source before the relay may keep its next hop, which moved instead).
    first = {(s, d) for s, d in through if nh[s, d] == x}
    assert first <= moved <= through
    assert fix.failed.all()
    # Exactly the full recompute's next hops for them (installed = best before).
    full = compute_routes(after, relay_hop_ms=2.0).next_hop
    assert np.array_equal(full[fix.s, fix.d], fix.hop)
    # Every live pair's walk arrives without the dead node; bulk moved alike.
    table = nh.copy()
    table[fix.s, fix.d] = fix.hop
    bulk = nh.copy()
    bulk[fix.bulk_s, fix.bulk_d] = fix.bulk_hop
    for s in range(n):
        for d in range(n):
            if x in (s, d):
                continue
            for t in (table, bulk):
                p = _walk(t, s, d)
                assert p[-1] == d and x not in p, (s, d, p)


def _busiest_link(nh: np.ndarray) -> tuple[int, int]:
    """The link (a, b) that the most walks of the next-hop table ``nh`` take."""
    n = nh.shape[0]
    uses = np.zeros((n, n), dtype=int)
    for s in range(n):
        for d in range(n):
            for a, b in itertools.pairwise(_walk(nh, s, d)):
                uses[a, b] += 1
    a, b = np.unravel_index(int(uses.argmax()), uses.shape)
    return int(a), int(b)


def test_a_slightly_worse_link_moves_nothing_and_a_far_worse_one_moves_its_ends() -> None:
    n = 60
    cost = np.array(generate(f"gen:geo:n={n},seed=3").rtt_ms(), dtype=float)
    np.fill_diagonal(cost, 0.0)
    nh = compute_routes(cost, relay_hop_ms=2.0).next_hop
    a, b = _busiest_link(nh)  # the direct link the most entries take
    bad = np.zeros((n, n), dtype=bool)
    bad[a, b] = bad[b, a] = True
    none = np.zeros(n, dtype=bool)
    worse = cost.copy()
    worse[a, b] *= 1.05
    worse[b, a] *= 1.05
    fix = urgent.urgent_fix(nh, worse, np.zeros((n, n)), bad, none, PolicyConfig())
    assert fix.s.size == 0 and fix.affected > 0  # seen, and held: no flapping on a nudge
    worse[a, b] = worse[b, a] = cost[a, b] * 10 + 500.0
    fix = urgent.urgent_fix(nh, worse, np.zeros((n, n)), bad, none, PolicyConfig())
    moved = set(zip(fix.s.tolist(), fix.d.tolist(), strict=True))
    assert (a, b) in moved and (b, a) in moved
    assert not fix.failed.any()
    full = compute_routes(worse, relay_hop_ms=2.0).next_hop
    assert np.array_equal(full[fix.s, fix.d], fix.hop)


class Rig:
    """A controller core fed a generated mesh's snapshots until its routes settled."""

    def __init__(self, n: int = 60, seed: int = 2) -> None:
        self.mesh = SyntheticMesh(n, seed=seed)
        cfg = ControllerConfig(
            mesh=MESH,
            id=CONTROLLER_ID,
            signing_key="/unused",
            node_keys=tuple(Enrolment(x.name, public_key_b64(x.identity)) for x in self.mesh.nodes),
            warmup_s=0.0,
            warmup_samples=1,
            settle_s=0.1,
            lease_s=100000.0,
            startup_s=0.0,
        )
        self.core = ControllerCore(cfg, generate_signing_key()[0])
        self.agents = [
            AgentCore(MESH, x.name, x.identity, [], RouteState(), WALL) for x in self.mesh.nodes
        ]
        # A geographic mesh's RTTs rarely make a relay pay: the links among the first
        # dozen nodes are made slow (as by a bad peering), so those pairs relay.
        slow = range(1, 13)
        self.peers = [
            self.mesh.reports(
                x.index,
                random.Random(x.index),
                profile="lean",
                factor={j: 10.0 for j in slow if j != x.index} if x.index in slow else None,
            )
            for x in self.mesh.nodes
        ]
        self.now = 0.0
        for _ in range(5):
            for p in self.core.tick(self.now, self.wall):
                if p.node is None:
                    self.core.on_message(p.topic, p.payload, True, self.now, self.wall)
            self.now += 0.5
        assert self.core.lease.role == "active"
        # Settle: the same measurements until the policy has taken every gain it takes.
        for _ in range(4):
            self.now += 40.0
            for i in range(n):
                self.send(i, self.peers[i])
            self.core.recompute_now(self.now, self.wall)

    @property
    def wall(self) -> float:
        return WALL + self.now

    def telemetry(self, i: int, peers: list[PeerReport], *, full: bool = True) -> bytes:
        x = self.mesh.nodes[i]
        return signed_telemetry(
            self.agents[i],
            self.wall,
            public_keys=[x.wg_key],
            addresses=[x.address],
            plan=Plan(full, peers, 5.0),
            counters={},
        )

    def send(self, i: int, peers: list[PeerReport], *, full: bool = True) -> None:
        self.now += 0.001  # each message newer than the last (the view refuses replays)
        topic = f"meshopt/{MESH}/telemetry/{self.mesh.nodes[i].name}"
        self.core.on_message(topic, self.telemetry(i, peers, full=full), False, self.now, self.wall)

    def will(self, i: int) -> tuple[str, bytes]:
        x = self.mesh.nodes[i]
        st = AgentStatus(mesh=MESH, node=x.name, online=False, since=self.wall, seq=0)
        return f"meshopt/{MESH}/status/{x.name}", sign("status", st, x.identity)

    def nh(self) -> IntArray:
        assert self.core.engine.installed is not None
        return self.core.engine.installed.next_hop

    def key(self, i: int) -> str:
        return self.mesh.nodes[i].wg_key

    def through(self, nh: IntArray, x: int) -> set[int]:
        """Live sources with a path relayed through ``x``."""
        n = nh.shape[0]
        return {
            s
            for s in range(n)
            for d in range(n)
            if x not in (s, d) and s != d and x in _walk(nh, s, d)[1:-1]
        }

    def via(self, nh: IntArray, x: int) -> set[int]:
        """Live sources that forward to ``x`` for another destination: relaying through it
        as their route sets say (what the benchmark watches)."""
        n = nh.shape[0]
        return {s for s in range(n) for d in range(n) if x not in (s, d) and nh[s, d] == x}


def _relays_via(routes: tuple[Route, ...] | list[Route], key: str, own: str) -> bool:
    return any(r.via == key and r.dst != own for r in routes)


def _fresh() -> Rig:
    return Rig()


def test_a_dead_relay_node_gets_exactly_its_relaying_nodes_new_sets_at_once() -> None:
    rig = _fresh()
    core = rig.core
    before = rig.nh().copy()
    assert core.engine._bulk is not None
    bulk_before = core.engine._bulk.copy()
    x = _busiest_relay(before)
    relaying = rig.via(before, x)
    assert relaying, "no node relays through the busiest relay"
    sets_before = {n: list(r) for n, r in core.intended.items()}
    assert not core.urgent_due(rig.wall)
    topic, will = rig.will(x)
    core.on_message(topic, will, False, rig.now, rig.wall)
    assert core.urgent_due(rig.wall)
    out = core.urgent_plan(rig.now, rig.wall)
    names = [rig.mesh.nodes[i].name for i in range(rig.mesh.n)]
    # Sets for exactly the nodes whose next hops moved (fast or bulk): every node
    # relaying through x, and no node whose paths did not run through it.
    after = rig.nh()
    fast_rows = {int(s) for s in np.flatnonzero((after != before).any(axis=1))}
    bulk_rows = {int(s) for s in np.flatnonzero((core.engine._bulk != bulk_before).any(axis=1))}
    assert {p.node for p in out} == {names[s] for s in fast_rows | bulk_rows}
    assert relaying <= fast_rows <= rig.through(before, x)
    assert bulk_rows <= rig.through(bulk_before, x)
    assert all(p.priority == URGENT for p in out)
    # Nodes whose fast paths broke go first (sent in this order), then bulk-only moves.
    broken = [p.node in {names[s] for s in fast_rows} for p in out]
    assert broken == sorted(broken, reverse=True)
    assert not all(broken), "no node with only bulk moves: the order is not tested"
    dead = rig.mesh.nodes[x]
    for p in out:
        assert p.node is not None
        assert not _relays_via(p.routes, dead.wg_key, dead.address)
        # Only routes that went over the dead node changed.
        old = {(r.table, r.dst): r for r in sets_before[p.node]}
        new = {(r.table, r.dst): r for r in p.routes}
        assert old.keys() == new.keys()
        for k, r in new.items():
            if r != old[k]:
                assert k[1] != dead.address
    # The engine starts its next pass from what agents have now: no walk through x.
    nh = rig.nh()
    assert not rig.through(nh, x)
    moved = np.argwhere(nh != before)
    assert moved.size
    # A later full pass keeps those next hops (they are the best table's) and fills in
    # backups, bulk routes and TCP settings.
    rig.now += 0.3
    core.recompute_now(rig.now, rig.wall)
    c = core.last
    assert c is not None
    for s, d in moved.tolist():
        assert c.decision.installed.next_hop[s, d] == nh[s, d] == c.best.next_hop[s, d]
    for s in relaying:
        assert core.intended[names[s]] == c.routes[names[s]]
        routes = c.routes[names[s]]
        assert any(r.table == "bulk" and r.mtu is not None for r in routes)
        assert not _relays_via(routes, dead.wg_key, dead.address)


def test_a_failure_during_a_long_recompute_does_not_wait_for_it_and_is_not_undone() -> None:
    rig = _fresh()
    core = rig.core
    before = rig.nh().copy()
    x = _busiest_relay(before)
    relaying = rig.via(before, x)
    names = [rig.mesh.nodes[i].name for i in range(rig.mesh.n)]
    dead = rig.mesh.nodes[x]
    # A full pass starts (as the daemon's thread would) on the view before the failure.
    rig.send(0, rig.peers[0])
    core.begin_recompute()
    stale = core.compute(rig.now)
    # The will arrives meanwhile: the shell holds it for the view and reads it ahead.
    rig.now += 0.1
    topic, will = rig.will(x)
    assert core.peek(topic, will, rig.now, rig.wall)
    assert core.view.nodes[dead.name].online  # the view is the running pass's
    assert core.urgent_due(rig.wall)
    out = core.urgent_plan(rig.now, rig.wall)
    assert {names[s] for s in relaying} <= {p.node for p in out}
    # The stale pass ends: it must not put the dead relay back.
    rest = core.finish_recompute(stale, rig.now)
    for p in rest:
        assert p.node is not None
        assert not _relays_via(p.routes, dead.wg_key, dead.address)
    for s in relaying:
        assert not _relays_via(core.intended[names[s]], dead.wg_key, dead.address)
    assert not rig.through(rig.nh(), x)
    # The held will is taken in turn; the next pass covers it and the failure is let go.
    core.on_message(topic, will, False, rig.now, rig.wall)
    rig.now += 0.3
    core.recompute_now(rig.now, rig.wall)
    assert not core._events
    assert not rig.through(rig.nh(), x)


def test_a_far_worse_link_moves_its_ends_and_noise_moves_nothing() -> None:
    rig = _fresh()
    core = rig.core
    nh = rig.nh()
    a, b = _busiest_link(nh)  # the direct link the most routes take
    sets_before = {n: list(r) for n, r in core.intended.items()}
    # 5 % worse (a change report's worth, not a failure): nothing urgent.
    nudged = rig.mesh.reports(a, random.Random(a), profile="lean", factor=None)
    nudged = [
        p if p.public_key != rig.key(b) or p.rtt_ms is None else _scaled(p, 1.05) for p in nudged
    ]
    rig.send(a, [p for p in nudged if p.public_key == rig.key(b)], full=False)
    assert not core.urgent_due(rig.wall)
    # Far worse, both ends report it: their direct routes to each other move at once.
    for i, j in ((a, b), (b, a)):
        worse = rig.mesh.reports(i, random.Random(i), profile="lean", factor={j: 10.0})
        rig.send(i, [p for p in worse if p.public_key == rig.key(j)], full=False)
    assert core.urgent_due(rig.wall)
    out = {p.node: p for p in core.urgent_plan(rig.now, rig.wall)}
    na, nb = rig.mesh.nodes[a], rig.mesh.nodes[b]
    assert na.name in out and nb.name in out
    direct = [r for r in out[na.name].routes if r.table == "fast" and r.dst == nb.address]
    assert direct and direct[0].via != nb.wg_key
    direct = [r for r in out[nb.name].routes if r.table == "fast" and r.dst == na.address]
    assert direct and direct[0].via != na.wg_key
    # Every moved set still has a route to every destination it had one to.
    for p in out.values():
        assert p.node is not None
        assert {(r.table, r.dst) for r in p.routes} == {
            (r.table, r.dst) for r in sets_before[p.node]
        }


def _scaled(p: PeerReport, f: float) -> PeerReport:
    import msgspec

    assert p.rtt_ms is not None
    return msgspec.structs.replace(p, rtt_ms=p.rtt_ms * f)


def test_no_urgent_path_before_a_full_pass_gave_it_a_picture() -> None:
    rig = _fresh()
    core = rig.core
    core._base = None
    topic, will = rig.will(1)
    core.on_message(topic, will, False, rig.now, rig.wall)
    assert not core.urgent_due(rig.wall)
    assert core.urgent_plan(rig.now, rig.wall) == []


def test_a_mass_failure_is_left_to_the_full_pass() -> None:
    """Many nodes gone at once (a lagging controller finding a fifth of the mesh stale)
    would cost the loop seconds: the urgent path stands aside until a full pass ends."""
    rig = _fresh()
    core = rig.core
    for i in range(URGENT_MAX_NODES + 1):
        topic, will = rig.will(20 + i)
        core.on_message(topic, will, False, rig.now, rig.wall)
    assert core.urgent_due(rig.wall)
    assert core.urgent_plan(rig.now, rig.wall) == []
    assert not core.urgent_due(rig.wall)  # no picture until the full pass
    rig.now += 0.3
    out = core.recompute_now(rig.now, rig.wall)
    assert out and core._base is not None and not core._events
    topic, will = rig.will(5)
    core.on_message(topic, will, False, rig.now, rig.wall)
    assert core.urgent_due(rig.wall)  # one more is urgent again


def test_a_change_report_read_ahead_tells_a_dead_link_and_a_heartbeat_nothing() -> None:
    rig = _fresh()
    core = rig.core
    nh = rig.nh()
    n = rig.mesh.n
    a = 1
    b = next(d for d in range(n) if d != a and nh[a, d] == d)  # a direct route of a's
    topic = f"meshopt/{MESH}/telemetry/{rig.mesh.nodes[a].name}"
    core.begin_recompute()
    rig.now += 0.01
    assert not core.peek(topic, rig.telemetry(a, [], full=False), rig.now, rig.wall)
    dead = [_dead(p) for p in rig.peers[a] if p.public_key == rig.key(b)]
    rig.now += 0.01
    assert core.peek(topic, rig.telemetry(a, dead, full=False), rig.now, rig.wall)
    assert core.urgent_due(rig.wall)
    out = core.urgent_plan(rig.now, rig.wall)
    mine = [p for p in out if p.node == rig.mesh.nodes[a].name]
    assert mine
    to_b = [r for r in mine[0].routes if r.table == "fast" and r.dst == rig.mesh.nodes[b].address]
    assert to_b and to_b[0].via != rig.key(b)
    core.abort_recompute()


def _dead(p: PeerReport) -> PeerReport:
    import msgspec

    return msgspec.structs.replace(p, alive=False)
