"""The controller's pure core against forged, replayed, future-dated and wrong-key input.

A fake bus loops every message the core publishes back to it (as the broker does for a
subscriber), so the core claims its lease, becomes active and publishes signed route
sets; each test then attacks one rule and checks both the counter (an increment, not its
presence) and that the published routes did not move.
"""

from __future__ import annotations

from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshopt.bus.freshness import first_seq
from meshopt.bus.messages import (
    AgentStatus,
    ControllerStatus,
    Lease,
    PeerReport,
    Route,
    RouteSet,
    Telemetry,
    encode,
)
from meshopt.bus.signing import generate_signing_key, sign, verify_route_set
from meshopt.bus.topics import Topics
from meshopt.controller.config import ControllerConfig, Enrolment
from meshopt.controller.core import ControllerCore, Publish
from meshopt.wireguard.keys import generate_keypair

MESH = "lab"
T0 = 1_800_000_000.0
NAMES = ("a", "b", "c")
# a-c is slow direct and fast through b: a->c goes via b.
RTT = {("a", "b"): 10.0, ("b", "c"): 10.0, ("a", "c"): 100.0}
TOPICS = Topics(MESH)


def rtt(x: str, y: str) -> float:
    return RTT.get((x, y)) or RTT[(y, x)]


class Node:
    def __init__(self, name: str, index: int) -> None:
        self.name = name
        self.identity, self.public = generate_signing_key()
        self.wg = generate_keypair()[1]
        self.address = f"10.99.0.{index}/32"
        self.seq = first_seq(T0)
        self.session = self.seq

    def telemetry(self, peers: list[PeerReport], wall: float, **kw: Any) -> Telemetry:
        self.seq += 1
        base: dict[str, Any] = dict(
            mesh=MESH,
            node=self.name,
            public_key=self.wg,
            public_keys=[self.wg],
            addresses=[self.address],
            seq=self.seq,
            session=self.session,
            sent_at=wall,
            full=True,
            peers=peers,
        )
        base.update(kw)
        return Telemetry(**base)


class Rig:
    """A controller core, three honest nodes, and a loop-back bus."""

    def __init__(self, **cfg: Any) -> None:
        self.nodes = {n: Node(n, i) for i, n in enumerate(NAMES, start=1)}
        self.key, self.public = generate_signing_key()
        pin = cfg.pop("pin", False)
        enrolled = tuple(
            Enrolment(n.name, n.public, (n.wg,) if pin else ()) for n in self.nodes.values()
        )
        self.cfg = ControllerConfig(
            mesh=MESH,
            id="ctl1",
            signing_key="/unused",
            node_keys=enrolled,
            warmup_s=0.0,
            warmup_samples=1,
            **cfg,
        )
        self.core = ControllerCore(self.cfg, self.key)
        self.now = 100.0
        self.wall = T0
        self.retained: dict[str, bytes] = {}
        # What the BusClient does: the will when it connects, the online status once
        # connected, a little later.
        self.will = self.core.new_session(self.wall - 0.01)
        self.deliver_all(self.core.on_connect(self.wall))

    def deliver(self, topic: str, payload: bytes, retained: bool = False) -> None:
        self.deliver_all(self.core.on_message(topic, payload, retained, self.now, self.wall))

    def deliver_all(self, actions: list[Publish]) -> None:
        for a in actions:
            self.core.published_ok(a, True, self.now)
            if a.retain:
                self.retained[a.topic] = a.payload
            self.deliver(a.topic, a.payload, False)

    def step(self, dt: float = 0.05) -> None:
        self.now += dt
        self.wall += dt
        self.deliver_all(self.core.tick(self.now, self.wall))

    def run(self, seconds: float) -> None:
        for _ in range(int(seconds / 0.05)):
            self.step()

    def report(self, name: str, **kw: Any) -> None:
        node = self.nodes[name]
        peers = [
            PeerReport(
                public_key=self.nodes[p].wg,
                ifname="wg0",
                alive=True,
                rtt_ms=rtt(name, p),
                samples=64,
            )
            for p in NAMES
            if p != name
        ]
        t = node.telemetry(peers, self.wall, **kw)
        self.deliver(TOPICS.telemetry(name), sign("telemetry", t, node.identity))

    def report_all(self) -> None:
        for n in NAMES:
            self.report(n)

    def routes(self, node: str) -> dict[str, Route]:
        """The route set the core last published for ``node``, verified, by destination."""
        rs = verify_route_set(self.retained[TOPICS.routes(node)], [self.public], node=node)
        return {r.dst: r for r in rs.routes if r.table == "fast"}

    def settled(self) -> Rig:
        self.run(2.0)  # starting, claiming, active
        assert self.core.lease.role == "active"
        self.report_all()
        self.run(1.0)
        assert self.via("a", "c") == "b"
        return self

    def via(self, src: str, dst: str) -> str:
        wg = self.routes(src)[self.nodes[dst].address].via
        return next(n for n, node in self.nodes.items() if node.wg == wg)

    def count(self, reason: str) -> int:
        return self.core.counters[reason]


def attack(rig: Rig, counter: str, fn: Any) -> None:
    """``fn`` must be refused: ``counter`` rises by one, every route stays as it was."""
    before = {n: rig.routes(n) for n in NAMES}
    n0 = rig.count(counter)
    fn()
    rig.run(1.0)
    rig.report_all()  # honest nodes keep reporting
    rig.run(1.0)
    assert rig.count(counter) == n0 + 1, rig.core.counters
    assert {n: rig.routes(n) for n in NAMES} == before
    assert all(rig.core.view.nodes[n].online for n in NAMES)


@pytest.fixture
def rig() -> Rig:
    return Rig().settled()


def poisoned_peers(rig: Rig) -> list[PeerReport]:
    """a->c looks 1 ms and a->b dead: enough to move a's route to c if it were believed."""
    n = rig.nodes
    return [
        PeerReport(public_key=n["b"].wg, ifname="wg0", alive=False, samples=64),
        PeerReport(public_key=n["c"].wg, ifname="wg0", alive=True, rtt_ms=1.0, samples=64),
    ]


def test_honest_mesh_relays_through_b(rig: Rig) -> None:
    assert rig.via("a", "c") == "b" and rig.via("c", "a") == "b"
    assert rig.via("a", "b") == "b"


def test_unsigned_telemetry_is_refused(rig: Rig) -> None:
    t = rig.nodes["a"].telemetry(poisoned_peers(rig), rig.wall)
    attack(rig, "telemetry_bad_schema", lambda: rig.deliver(TOPICS.telemetry("a"), encode(t)))


def test_telemetry_signed_by_another_key_is_refused(rig: Rig) -> None:
    t = rig.nodes["a"].telemetry(poisoned_peers(rig), rig.wall)
    forger = Ed25519PrivateKey.generate()
    data = sign("telemetry", t, forger)
    attack(rig, "telemetry_unknown_key", lambda: rig.deliver(TOPICS.telemetry("a"), data))
    # An enrolled node's own key does not speak for another node either.
    data = sign("telemetry", t, rig.nodes["b"].identity)
    attack(rig, "telemetry_unknown_key", lambda: rig.deliver(TOPICS.telemetry("a"), data))


def test_telemetry_for_another_node_is_refused(rig: Rig) -> None:
    # a's own key, a's own topic, but the message claims to be b.
    t = rig.nodes["a"].telemetry(poisoned_peers(rig), rig.wall, node="b")
    data = sign("telemetry", t, rig.nodes["a"].identity)
    attack(rig, "telemetry_wrong_node", lambda: rig.deliver(TOPICS.telemetry("a"), data))


def test_unknown_node_is_refused(rig: Rig) -> None:
    stranger = Node("x", 9)
    t = stranger.telemetry([], rig.wall)
    data = sign("telemetry", t, stranger.identity)
    attack(rig, "telemetry_unknown_node", lambda: rig.deliver(TOPICS.telemetry("x"), data))
    assert "x" not in rig.core.view.nodes


def test_future_telemetry_is_refused_and_locks_nobody_out(rig: Rig) -> None:
    node = rig.nodes["a"]
    t = node.telemetry(poisoned_peers(rig), rig.wall + 10 * 365 * 86400)
    data = sign("telemetry", t, node.identity)
    attack(rig, "telemetry_future", lambda: rig.deliver(TOPICS.telemetry("a"), data))
    seen = rig.core.view.nodes["a"].sent_at
    rig.report("a")
    assert rig.core.view.nodes["a"].sent_at > seen  # the real agent's next report is taken


def test_replayed_telemetry_is_refused(rig: Rig) -> None:
    node = rig.nodes["a"]
    old = sign("telemetry", node.telemetry(poisoned_peers(rig), rig.wall), node.identity)
    rig.report("a")  # newer
    attack(rig, "telemetry_replay", lambda: rig.deliver(TOPICS.telemetry("a"), old))
    newest = sign("telemetry", node.telemetry(poisoned_peers(rig), rig.wall), node.identity)
    node.seq -= 1
    same = sign("telemetry", node.telemetry(poisoned_peers(rig), rig.wall), node.identity)
    rig.deliver(TOPICS.telemetry("a"), newest)
    n0 = rig.count("telemetry_duplicate")
    rig.deliver(TOPICS.telemetry("a"), same)
    assert rig.count("telemetry_duplicate") == n0 + 1


def test_seq_beyond_the_clock_is_refused(rig: Rig) -> None:
    node = rig.nodes["a"]
    t = node.telemetry(poisoned_peers(rig), rig.wall, seq=2**63)
    data = sign("telemetry", t, node.identity)
    attack(rig, "telemetry_bad_seq", lambda: rig.deliver(TOPICS.telemetry("a"), data))


def test_another_nodes_address_is_refused(rig: Rig) -> None:
    node = rig.nodes["a"]
    t = node.telemetry([], rig.wall, addresses=[node.address, rig.nodes["c"].address])
    data = sign("telemetry", t, node.identity)
    attack(rig, "telemetry_address_conflict", lambda: rig.deliver(TOPICS.telemetry("a"), data))


def test_another_nodes_wireguard_key_is_refused(rig: Rig) -> None:
    node = rig.nodes["a"]
    t = node.telemetry([], rig.wall, public_keys=[node.wg, rig.nodes["c"].wg])
    data = sign("telemetry", t, node.identity)
    attack(rig, "telemetry_key_conflict", lambda: rig.deliver(TOPICS.telemetry("a"), data))


def test_pinned_wireguard_key_and_address() -> None:
    rig = Rig(pin=True).settled()
    node = rig.nodes["a"]
    t = node.telemetry([], rig.wall, public_keys=[generate_keypair()[1]])
    data = sign("telemetry", t, node.identity)
    attack(rig, "telemetry_unpinned_key", lambda: rig.deliver(TOPICS.telemetry("a"), data))


def status(node: Node, online: bool, seq: int, wall: float) -> bytes:
    st = AgentStatus(mesh=MESH, node=node.name, online=online, since=wall, seq=seq)
    return sign("status", st, node.identity)


def test_forged_offline_status_is_refused(rig: Rig) -> None:
    a = rig.nodes["a"]
    unsigned = encode(AgentStatus(mesh=MESH, node="a", online=False, since=rig.wall))
    attack(rig, "status_bad_schema", lambda: rig.deliver(TOPICS.status("a"), unsigned))
    forged = sign(
        "status",
        AgentStatus(mesh=MESH, node="a", online=False, since=rig.wall, seq=a.session + 9),
        rig.nodes["b"].identity,
    )
    attack(rig, "status_unknown_key", lambda: rig.deliver(TOPICS.status("a"), forged))


def test_old_will_replayed_is_refused_but_the_current_one_counts(rig: Rig) -> None:
    a = rig.nodes["a"]
    old_will = status(a, False, a.session, rig.wall)
    # a reconnects: a new session, its online status, telemetry naming the session.
    a.session = a.seq = a.seq + 1
    rig.deliver(TOPICS.status("a"), status(a, True, a.session, rig.wall), True)
    rig.report("a")
    attack(rig, "status_replay", lambda: rig.deliver(TOPICS.status("a"), old_will))
    # The will of the current session takes a out of routing at once.
    rig.deliver(TOPICS.status("a"), status(a, False, a.session, rig.wall))
    assert not rig.core.view.nodes["a"].online
    rig.run(0.5)
    assert rig.nodes["a"].address not in rig.routes("c")  # no route to a dead node


def lease(controller: str, term: int, issued: float, life: float) -> Lease:
    return Lease(
        mesh=MESH, controller=controller, term=term, issued_at=issued, expires_at=issued + life
    )


def test_unsigned_or_foreign_lease_is_refused(rig: Rig) -> None:
    forever = lease("evil", int(rig.wall) + 1, rig.wall, 9.0)
    attack(rig, "lease_bad_schema", lambda: rig.deliver(TOPICS.lease(), encode(forever)))
    foreign = sign("lease", forever, Ed25519PrivateKey.generate())
    attack(rig, "lease_unknown_key", lambda: rig.deliver(TOPICS.lease(), foreign))
    assert rig.core.lease.role == "active"


def test_lease_for_thirty_years_is_refused(rig: Rig) -> None:
    # Signed by a trusted controller key (a compromised standby, say), still refused.
    long = sign("lease", lease("ctl2", int(rig.wall) + 5, rig.wall, 30 * 365 * 86400.0), rig.key)
    attack(rig, "lease_lease_too_long", lambda: rig.deliver(TOPICS.lease(), long))
    assert rig.core.lease.role == "active"


def test_lease_term_beyond_the_clock_is_refused(rig: Rig) -> None:
    high = sign("lease", lease("ctl2", 2**62, rig.wall - 10, 3.0), rig.key)
    attack(rig, "lease_term_jump", lambda: rig.deliver(TOPICS.lease(), high))
    assert rig.core.lease.term < 2**40


def test_future_and_replayed_leases_are_refused(rig: Rig) -> None:
    ahead = sign("lease", lease("ctl2", int(rig.wall) + 5, rig.wall + 3600, 3.0), rig.key)
    attack(rig, "lease_future", lambda: rig.deliver(TOPICS.lease(), ahead))
    old = sign("lease", lease("ctl2", 5, rig.wall - 100, 3.0), rig.key)
    attack(rig, "lease_replay", lambda: rig.deliver(TOPICS.lease(), old))


def test_forged_controller_will_does_not_hand_over(rig: Rig) -> None:
    cs = ControllerStatus(controller="ctl1", online=False, role="active", since=rig.wall - 50)
    old = sign("controller_status", cs, rig.key)  # an older session's will
    attack(
        rig, "controller_status_replay", lambda: rig.deliver(TOPICS.controller_status("ctl1"), old)
    )


def test_route_sets_are_signed_versions_rise_and_terms_are_bounded(rig: Rig) -> None:
    rs = verify_route_set(rig.retained[TOPICS.routes("a")], [rig.public], mesh=MESH, node="a")
    assert rs.term == rig.core.lease.term and rs.version >= first_seq(T0)
    # A retained set with a version the clock cannot explain is not adopted.
    big = RouteSet(mesh=MESH, node="a", version=2**62, issued_at=rig.wall, controller="x", term=1)
    attack(
        rig,
        "routes_bad_version",
        lambda: rig.deliver(TOPICS.routes("a"), sign("routes", big, rig.key), True),
    )
    assert rig.core.version < 2**61


def test_a_message_that_breaks_the_core_costs_one_message(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    take = rig.core.view.take

    def boom(node: str, t: Telemetry, *args: Any) -> bool:
        if node == "a":
            raise RuntimeError("a bug")
        return take(node, t, *args)

    monkeypatch.setattr(rig.core.view, "take", boom)
    n0 = rig.count("telemetry_internal_error")
    rig.report("a")
    assert rig.count("telemetry_internal_error") == n0 + 1
    rig.report("b")  # the next message is handled as usual
    assert rig.count("telemetry_internal_error") == n0 + 1
    assert rig.via("a", "c") == "b"


def test_an_older_route_set_played_back_is_not_adopted(rig: Rig) -> None:
    current = rig.core.retained_sets["a"]
    old = RouteSet(
        mesh=MESH, node="a", version=current.version - 1, issued_at=rig.wall, controller="x", term=1
    )
    attack(
        rig,
        "routes_replay",
        lambda: rig.deliver(TOPICS.routes("a"), sign("routes", old, rig.key), True),
    )
    assert rig.core.retained_sets["a"] == current


def test_the_active_controllers_will_hands_over_at_once(rig: Rig) -> None:
    """A standby takes the will of the active controller's current session (the same
    ``since`` as its online status) as the signal to claim the lease now."""
    cfg = ControllerConfig(**{**rig.cfg.__dict__, "id": "ctl2"})
    standby = ControllerCore(cfg, rig.key)
    for topic, payload in rig.retained.items():
        standby.on_message(topic, payload, True, rig.now, rig.wall)
    assert standby.lease.current is not None and standby.lease.current.controller == "ctl1"
    assert not standby.lease.holder_gone
    topic, will, _ = rig.will
    n0 = standby.counters.total()
    standby.on_message(topic, will, False, rig.now + 1, rig.wall + 1)
    assert standby.counters.total() == n0, standby.counters
    assert standby.lease.holder_gone
