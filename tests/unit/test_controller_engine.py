"""The controller's route engine: routes, backups, anti-flap policy and take-over, on a view
fed with real telemetry messages (time passed in)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from meshopt.bus.messages import PeerReport, Route, RouteSet, decode, encode
from meshopt.controller.engine import Computed, RouteEngine
from meshopt.controller.view import MeshView
from meshopt.policy import PolicyConfig
from meshopt.routing.allpairs import compute_routes
from meshopt.routing.tables import NO_ROUTE
from tests.unit.test_controller_view import MESH, Node, new_key

Links = dict[tuple[str, str], float]


def both(links: Links) -> Links:
    """Both directions of every link, at the same RTT."""
    out = dict(links)
    out.update({(b, a): c for (a, b), c in links.items()})
    return out


class Mesh:
    """Agents reporting measured links to one view, in the single or per-peer layout."""

    def __init__(self, names: str, *, per_peer: bool = False) -> None:
        self.view = MeshView(MESH)
        self.per_peer = per_peer
        # Per-peer: node x's end of its tunnel to y has its own key, tunnel_key[x][y].
        self.tunnel_key = {x: {y: new_key() for y in names if y != x} for x in names}
        self.nodes: dict[str, Node] = {}
        for i, x in enumerate(names, start=1):
            keys = list(self.tunnel_key[x].values()) if per_peer else [new_key()]
            self.nodes[x] = Node(x, i, keys=keys)
        self.sent_at = 1000.0

    def key(self, node: str, seen_by: str) -> str:
        """The public key ``seen_by`` has for its peer ``node``."""
        return self.tunnel_key[node][seen_by] if self.per_peer else self.nodes[node].keys[0]

    def address(self, node: str) -> str:
        return self.nodes[node].address

    def report(
        self,
        links: Links,
        now: float,
        *,
        noise: Links | None = None,
        only: str | None = None,
        bandwidth: float | None = None,
    ) -> None:
        """Every node (or ``only``) sends a full snapshot of its links in ``links``."""
        self.sent_at += 1.0
        for x, node in self.nodes.items():
            if only is not None and x != only:
                continue
            peers = [
                PeerReport(
                    public_key=self.key(y, x),
                    ifname=f"wg-{y}" if self.per_peer else "wg0",
                    rtt_ms=rtt,
                    noise_ms=(noise or {}).get((x, y)),
                    samples=64,
                    bandwidth_mbit=bandwidth,
                )
                for (s, y), rtt in links.items()
                if s == x
            ]
            self.view.take(x, node.telemetry(peers, sent_at=self.sent_at), now)

    def idx(self, c: Computed, name: str) -> int:
        return c.names.index(name)

    def hop(self, c: Computed, s: str, d: str) -> str | None:
        h = int(c.decision.installed.next_hop[self.idx(c, s), self.idx(c, d)])
        return None if h == NO_ROUTE else c.names[h]

    def route(self, c: Computed, s: str, d: str, table: str = "fast") -> Route | None:
        found = [r for r in c.routes[s] if r.dst == self.address(d) and r.table == table]
        assert len(found) <= 1
        return found[0] if found else None

    def route_sets(self, c: Computed, version: int = 1) -> dict[str, RouteSet]:
        """The signed-and-retained form of ``c.routes`` (through the bus encoder's checks)."""
        out = {}
        for node, routes in c.routes.items():
            rs = RouteSet(
                mesh=MESH,
                node=node,
                version=version,
                issued_at=1.0,
                controller="ctl1",
                term=1,
                routes=routes,
            )
            out[node] = decode(encode(rs), RouteSet)
        return out


# a-b direct 80 ms; a-c-b 20 + 20 ms (+2 ms relay): the relay wins by a wide margin.
TRIANGLE = both({("a", "b"): 80.0, ("a", "c"): 20.0, ("c", "b"): 20.0})


@pytest.mark.parametrize("per_peer", [False, True], ids=["single-key", "per-peer"])
def test_first_compute_relays_a_to_b_via_c_with_a_backup(per_peer: bool) -> None:
    mesh = Mesh("abc", per_peer=per_peer)
    mesh.report(TRIANGLE, 0.0)
    c = RouteEngine(PolicyConfig()).compute(mesh.view, 0.0)
    assert mesh.hop(c, "a", "b") == "c" and mesh.hop(c, "b", "a") == "c"
    assert c.decision.improved[mesh.idx(c, "a"), mesh.idx(c, "b")]
    assert mesh.hop(c, "a", "c") == "c", "direct where it is best"
    r = mesh.route(c, "a", "b")
    assert r is not None
    assert r.via == mesh.key("c", "a"), "via names c by the key a knows it by"
    assert r.backup == mesh.key("b", "a"), "the direct tunnel is the backup"
    assert sorted(c.routes) == ["a", "b", "c"]
    assert len(c.routes["a"]) == 2  # b and c, one address each
    mesh.route_sets(c)  # the bus would take every set (no duplicate dst, backup != via)


def test_symmetric_backup_is_the_direct_tunnel() -> None:
    mesh = Mesh("abc")
    mesh.report(TRIANGLE, 0.0)
    c = RouteEngine(PolicyConfig(), symmetric=True).compute(mesh.view, 0.0)
    for s, d in (("a", "b"), ("b", "a")):
        r = mesh.route(c, s, d)
        assert r is not None
        assert (r.via, r.backup) == (mesh.key("c", s), mesh.key(d, s))
    direct = mesh.route(c, "a", "c")
    assert direct is not None and direct.via == mesh.key("c", "a") and direct.backup is None


@pytest.mark.parametrize("how", ["will", "stale"])
def test_relay_going_down_switches_at_once_and_is_not_held(how: str) -> None:
    mesh = Mesh("abc")
    engine = RouteEngine(PolicyConfig(hold_s=30.0))
    mesh.report(TRIANGLE, 0.0)
    engine.compute(mesh.view, 0.0)
    if how == "will":
        mesh.view.set_offline("c", "will")
        now = 1.0
    else:
        now = 16.0  # a and b keep reporting, c falls silent
        for t in (5.0, 10.0, 15.0):
            for x in "ab":
                mesh.report(TRIANGLE, t, only=x)
        assert mesh.view.expire(now) == ["c"]
    c = engine.compute(mesh.view, now)
    a, b = mesh.idx(c, "a"), mesh.idx(c, "b")
    assert mesh.hop(c, "a", "b") == "b" and mesh.hop(c, "b", "a") == "a"
    assert c.decision.failed[a, b] and c.decision.failed[b, a]
    assert c.decision.installed.since[a, b] == -np.inf, "a forced switch is not held"
    r = mesh.route(c, "a", "b")
    assert r is not None and (r.via, r.backup) == (mesh.key("b", "a"), None)
    assert mesh.route(c, "a", "c") is None, "no route to a dead node"
    assert "c" not in c.routes, "no route set for a dead node"
    # c is back two seconds later, well inside hold_s: the relay is taken again at once.
    mesh.report(TRIANGLE, now + 2.0)
    c = engine.compute(mesh.view, now + 2.0)
    assert mesh.hop(c, "a", "b") == "c"
    assert c.decision.improved[a, b]


def test_small_improvements_are_not_taken_and_real_ones_wait_for_the_hold() -> None:
    mesh = Mesh("abc")
    engine = RouteEngine(PolicyConfig(abs_margin_ms=5.0, rel_margin=0.10, hold_s=30.0))
    mesh.report(TRIANGLE, 0.0)
    c = engine.compute(mesh.view, 0.0)  # a-b via c: 42 ms
    a, b = mesh.idx(c, "a"), mesh.idx(c, "b")
    assert mesh.hop(c, "a", "b") == "c"
    # The direct tunnel becomes 3 ms better than the relay: inside the margins.
    links = {**TRIANGLE, ("a", "b"): 39.0, ("b", "a"): 39.0}
    mesh.report(links, 100.0)
    c = engine.compute(mesh.view, 100.0)
    assert int(c.best.next_hop[a, b]) == b, "the best path moved..."
    assert mesh.hop(c, "a", "b") == "c", "...the installed one did not"
    assert not c.decision.changed.any() and not c.decision.held.any()
    # 12 ms better (> 5 ms and > 10 %): taken at once, the relay has been in for 100 s.
    links = {**TRIANGLE, ("a", "b"): 30.0, ("b", "a"): 30.0}
    mesh.report(links, 101.0)
    c = engine.compute(mesh.view, 101.0)
    assert mesh.hop(c, "a", "b") == "b" and c.decision.improved[a, b]
    # Back to 80 ms: a real improvement again, but the entry changed 9 s ago: held.
    mesh.report(TRIANGLE, 110.0)
    c = engine.compute(mesh.view, 110.0)
    assert mesh.hop(c, "a", "b") == "b" and c.decision.held[a, b]
    mesh.report(TRIANGLE, 131.0)
    c = engine.compute(mesh.view, 131.0)
    assert mesh.hop(c, "a", "b") == "c" and c.decision.improved[a, b]


# Five nodes with several near-equal paths: ±20 % jitter moves the optimum all the time.
NEAR_TIES = both(
    {
        ("a", "b"): 40.0,
        ("a", "c"): 20.0,
        ("c", "b"): 21.0,
        ("a", "d"): 19.0,
        ("d", "b"): 20.0,
        ("a", "e"): 30.0,
        ("e", "b"): 12.0,
        ("c", "d"): 5.0,
        ("c", "e"): 25.0,
        ("d", "e"): 26.0,
    }
)


@pytest.mark.parametrize("symmetric", [False, True], ids=["directed", "symmetric"])
def test_jitter_of_20_percent_changes_no_route(symmetric: bool) -> None:
    rng = np.random.default_rng(7)
    mesh = Mesh("abcde")
    engine = RouteEngine(PolicyConfig(), symmetric=symmetric)
    # Uniform ±20 % has a standard deviation of 0.2 / sqrt(3) of the mean: the agents'
    # honest noise estimate for these samples.
    noise = {k: v * 0.2 / 3**0.5 for k, v in NEAR_TIES.items()}
    mesh.report(NEAR_TIES, 0.0, noise=noise)
    first = engine.compute(mesh.view, 0.0)
    installed = first.decision.installed.next_hop.copy()
    best_moves = changes = 0
    prev_best = first.best.next_hop
    for step in range(1, 201):
        now = step * 1.0  # 200 s: the 30 s hold is long gone, only the margins hold
        jittered = {k: v * rng.uniform(0.8, 1.2) for k, v in NEAR_TIES.items()}
        mesh.report(jittered, now, noise=noise)
        c = engine.compute(mesh.view, now)
        best_moves += int((c.best.next_hop != prev_best).sum())
        prev_best = c.best.next_hop
        changes += int(c.decision.changed.sum())
    assert best_moves > 50, "the jitter must move the optimum, or this test proves nothing"
    assert changes == 0
    assert engine.installed is not None
    np.testing.assert_array_equal(engine.installed.next_hop, installed)


@pytest.mark.parametrize("symmetric", [False, True], ids=["directed", "symmetric"])
def test_incremental_and_full_recompute_agree(symmetric: bool) -> None:
    rng = np.random.default_rng(11)
    names = "abcdef"
    mesh = Mesh(names)
    pairs = [(x, y) for x, y in itertools.permutations(names, 2) if x < y]
    base = both({p: float(rng.uniform(5, 80)) for p in pairs})
    engine = RouteEngine(PolicyConfig(), symmetric=symmetric, max_incremental=8)
    links = dict(base)
    now = 0.0
    for step in range(120):
        now += 1.0
        if step % 10 == 9:
            mesh.view.set_offline(str(rng.choice(list(names))), "will")  # many links at once
        elif step % 10 == 4:
            links = {k: v * float(rng.uniform(0.5, 1.5)) for k, v in base.items()}
            mesh.report(links, now)  # every link changes: a full recompute
        else:
            for _ in range(int(rng.integers(1, 4))):  # a few links change
                x, y = pairs[int(rng.integers(len(pairs)))]
                links[(x, y)] = float(rng.uniform(5, 80))
                if rng.random() < 0.5:
                    links[(y, x)] = float(rng.uniform(5, 80))
            mesh.report(links, now)  # also brings back a node that was offline
        c = engine.compute(mesh.view, now)
        full = compute_routes(c.matrices.cost, c.names, symmetric=symmetric)
        np.testing.assert_array_equal(c.best.next_hop, full.next_hop, err_msg=f"step {step}")
        np.testing.assert_allclose(c.best.cost, full.cost)
    assert engine.stats["incremental"] > 50
    assert engine.stats["full"] > 5


@pytest.mark.parametrize("per_peer", [False, True], ids=["single-key", "per-peer"])
def test_adopt_reproduces_the_installed_next_hops(per_peer: bool) -> None:
    mesh = Mesh("abcd", per_peer=per_peer)
    active = RouteEngine(PolicyConfig(), bulk=True)
    links = {**TRIANGLE, **both({("d", "a"): 10.0, ("d", "b"): 75.0, ("d", "c"): 15.0})}
    mesh.report(links, 0.0, bandwidth=100.0)
    active.compute(mesh.view, 0.0)
    # a-b direct becomes 3 ms better than a-c-b: the margins keep the relay. That choice
    # is what a new controller must not undo.
    links.update(both({("a", "b"): 39.0}))
    mesh.report(links, 100.0, bandwidth=100.0)
    last = active.compute(mesh.view, 100.0)
    assert active.installed is not None
    kept = active.installed.next_hop != last.best.next_hop
    assert kept.any(), "no entry off the best path: the test would prove less"
    assert any(r.table == "bulk" for r in last.routes["a"])

    standby = RouteEngine(PolicyConfig(), bulk=True)
    standby.adopt(mesh.view, mesh.route_sets(last), 101.0)
    assert standby.installed is not None
    np.testing.assert_array_equal(standby.installed.next_hop, active.installed.next_hop)
    assert standby.names == last.names
    c = standby.compute(mesh.view, 101.0)
    assert not c.decision.changed.any(), "the take-over changed routes"
    assert c.routes == last.routes


def test_a_take_over_keeps_what_the_active_controller_held() -> None:
    """A standby taking over must not undo the hold: the entry the active controller just
    moved (and would hold for hold_s) stays put for hold_s after the take-over, though a
    controller without that history would move it back; a failure still moves at once."""
    mesh = Mesh("abc")
    active = RouteEngine(PolicyConfig(hold_s=30.0))
    tri = both({("a", "b"): 30.0, ("a", "c"): 10.0, ("c", "b"): 10.0})
    mesh.report(tri, 0.0)
    last = active.compute(mesh.view, 0.0)
    assert mesh.hop(last, "a", "b") == "c"  # relayed: 20.1 ms against 30 ms
    # The relay's links get slower: the direct tunnel would now win by the margins
    # (30 ms against 40.1 ms), but the active controller changed this entry at 0 s.
    slower = {**tri, **both({("a", "c"): 20.0, ("c", "b"): 20.0})}
    mesh.report(slower, 10.0)
    held = active.compute(mesh.view, 10.0)
    assert mesh.hop(held, "a", "b") == "c" and held.decision.held.any()
    standby = RouteEngine(PolicyConfig(hold_s=30.0))
    standby.adopt(mesh.view, mesh.route_sets(held), 11.0)
    c = standby.compute(mesh.view, 12.0)
    assert mesh.hop(c, "a", "b") == "c" and not c.decision.changed.any()
    c = standby.compute(mesh.view, 41.5)  # the hold, counted from the take-over, is over
    assert mesh.hop(c, "a", "b") == "b" and c.decision.improved.any()
    # Inside the hold a dead relay still moves the route at once.
    standby = RouteEngine(PolicyConfig(hold_s=30.0))
    standby.adopt(mesh.view, mesh.route_sets(held), 11.0)
    gone = {k: v for k, v in slower.items() if "c" not in k or k == ("c", "b")}
    mesh.report({**gone}, 12.0)
    c = standby.compute(mesh.view, 12.0)
    assert mesh.hop(c, "a", "b") == "b"


def test_adopt_with_nothing_retained_starts_on_direct_tunnels() -> None:
    mesh = Mesh("abc")
    mesh.report(TRIANGLE, 0.0)
    engine = RouteEngine(PolicyConfig())
    engine.adopt(mesh.view, {}, 0.0)
    assert engine.installed is None
    c = engine.compute(mesh.view, 0.0)
    assert mesh.hop(c, "a", "b") == "c" and c.decision.improved.any()


def test_a_node_joining_later_starts_on_its_direct_tunnels() -> None:
    mesh = Mesh("abcd")
    engine = RouteEngine(PolicyConfig())
    ab = both({("a", "b"): 30.0})
    mesh.report(ab, 0.0, only="a")
    mesh.report(ab, 0.0, only="b")
    c = engine.compute(mesh.view, 0.0)
    assert c.names == ["a", "b"]
    # c joins: c-b direct 45 ms, c-a-b 10 + 30 + 2 = 42 ms (3 ms better: inside the margins).
    links = {**ab, **both({("c", "a"): 10.0, ("c", "b"): 45.0})}
    for x in "abc":
        mesh.report(links, 1.0, only=x)
    c = engine.compute(mesh.view, 1.0)
    assert c.names == ["a", "b", "c"]
    cb = (mesh.idx(c, "c"), mesh.idx(c, "b"))
    assert int(c.best.next_hop[cb]) == mesh.idx(c, "a"), "the best path is the relay..."
    assert mesh.hop(c, "c", "b") == "b" and mesh.hop(c, "b", "c") == "c", "...kept: direct"
    assert not c.decision.failed.any()
    r = mesh.route(c, "c", "b")
    assert r is not None and r.via == mesh.key("b", "c")
    # d joins where the relay is far better (d-b 90 ms, d-a-b 42 ms): taken at once.
    links = {**links, **both({("d", "a"): 10.0, ("d", "b"): 90.0})}
    for x in "abcd":
        mesh.report(links, 2.0, only=x)
    c = engine.compute(mesh.view, 2.0)
    assert mesh.hop(c, "d", "b") == "a"
    d, b = mesh.idx(c, "d"), mesh.idx(c, "b")
    assert c.decision.improved[d, b] and not c.decision.failed[d, b]


def test_a_route_kept_off_the_best_path_keeps_a_backup() -> None:
    mesh = Mesh("abc")
    engine = RouteEngine(PolicyConfig())
    mesh.report(TRIANGLE, 0.0)
    engine.compute(mesh.view, 0.0)  # a-b via c
    links = {**TRIANGLE, ("a", "b"): 39.0, ("b", "a"): 39.0}
    mesh.report(links, 100.0)
    c = engine.compute(mesh.view, 100.0)
    assert mesh.hop(c, "a", "b") == "c"  # kept by the margins: the direct tunnel is better
    r = mesh.route(c, "a", "b")
    assert r is not None and r.via == mesh.key("c", "a")
    assert r.backup == mesh.key("b", "a"), "if c dies, a must fall back to the direct tunnel"


def test_bulk_table_uses_the_widest_path() -> None:
    mesh = Mesh("abc")
    mesh.report(TRIANGLE, 0.0, bandwidth=100.0)
    # a-b direct is slow (80 ms) but the only wide link; a-c and c-b are narrow.
    for x in "abc":
        peers = []
        for (s, y), rtt in TRIANGLE.items():
            if s == x:
                wide = {s, y} == {"a", "b"}
                peers.append(
                    PeerReport(
                        public_key=mesh.key(y, x),
                        ifname="wg0",
                        rtt_ms=rtt,
                        samples=64,
                        bandwidth_mbit=1000.0 if wide else 10.0,
                    )
                )
        mesh.view.take(x, mesh.nodes[x].telemetry(peers, sent_at=5000.0), 1.0)
    c = RouteEngine(PolicyConfig(), bulk=True).compute(mesh.view, 1.0)
    fast, bulk = mesh.route(c, "a", "b"), mesh.route(c, "a", "b", table="bulk")
    assert fast is not None and fast.via == mesh.key("c", "a")
    assert bulk is not None and bulk.via == mesh.key("b", "a")
    # Symmetric meshes have one AllowedIPs set per destination: bulk follows the fast hop.
    sym = RouteEngine(PolicyConfig(), bulk=True, symmetric=True).compute(mesh.view, 1.0)
    fast, bulk = mesh.route(sym, "a", "b"), mesh.route(sym, "a", "b", table="bulk")
    assert fast is not None and bulk is not None
    assert bulk.via == fast.via == mesh.key("c", "a")
