"""The controller daemon's publishing (issue 15, limits 1, 4 and 6).

The real :class:`Controller` (its tick loop, recompute thread and publisher) runs against
a broker stand-in that takes ``delay_s`` to acknowledge each publish and echoes every
message back, as mosquitto does to a subscriber. A slow PUBACK is what a broker busy
with 250 x 84 kB route sets does; a real mosquitto on loopback acknowledges too fast to
show it here (the end-to-end figures are scripts/bench_scale.py's, through the real
broker). Nothing here is bounded by time: the tests count what got out and in what order.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from meshopt.agent.core import AgentCore, RouteState
from meshopt.bench.synthetic import CONTROLLER_ID, MESH, SyntheticMesh
from meshopt.bus.messages import AgentStatus, RouteSet
from meshopt.bus.signing import (
    generate_signing_key,
    public_key_b64,
    save_private_key,
    sign,
    verify_route_set,
)
from meshopt.bus.topics import Topics
from meshopt.controller.config import ControllerConfig, Enrolment
from meshopt.controller.core import CHANGED, REFRESH, URGENT, Publish
from meshopt.controller.daemon import GC_THRESHOLDS, MAX_IN_FLIGHT, Controller
from meshopt.controller.engine import Computed

Handler = Callable[[str, bytes, bool], Awaitable[None]]


class SlowBroker:
    """Takes ``delay_s`` per PUBACK, any number at once, and echoes what it takes."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.handler: Handler | None = None
        self.on_connect: Callable[[], Awaitable[None]] | None = None
        self.connected = asyncio.Event()
        self.log: list[tuple[str, bytes]] = []  # in the order the broker took them
        self.in_flight = 0
        self.max_in_flight = 0
        self.routes_in_flight = 0
        self.max_routes_in_flight = 0
        self.published = 0

    async def run(self, handler: Handler) -> None:
        self.handler = handler
        self.connected.set()
        if self.on_connect is not None:
            await self.on_connect()
        await asyncio.Event().wait()

    async def wait_connected(self, timeout: float | None) -> None:
        await self.connected.wait()

    async def publish(
        self, topic: str, payload: bytes, *, qos: int = 0, retain: bool = False
    ) -> bool:
        is_routes = "/routes/" in topic
        self.in_flight += 1
        self.routes_in_flight += is_routes
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.max_routes_in_flight = max(self.max_routes_in_flight, self.routes_in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
            self.routes_in_flight -= is_routes
        self.log.append((topic, payload))
        self.published += 1
        assert self.handler is not None
        await self.handler(topic, payload, False)
        return True


class Rig:
    def __init__(self, tmp: Path, n: int, delay_s: float, lease_s: float = 3.0) -> None:
        self.mesh = SyntheticMesh(n)
        key, _ = generate_signing_key()
        save_private_key(tmp / "controller.key", key)
        cfg = ControllerConfig(
            mesh=MESH,
            id=CONTROLLER_ID,
            signing_key=str(tmp / "controller.key"),
            node_keys=tuple(Enrolment(x.name, public_key_b64(x.identity)) for x in self.mesh.nodes),
            warmup_s=0.0,
            warmup_samples=1,
            lease_s=lease_s,
            settle_s=0.2,
        )
        self.ctl = Controller(cfg)
        self.broker = SlowBroker(delay_s)
        self.ctl.bus = self.broker  # type: ignore[assignment]
        self.broker.on_connect = self.ctl._on_connect
        self.topics = Topics(MESH)
        self.agents = [
            AgentCore(MESH, x.name, x.identity, [], RouteState(), time.time())
            for x in self.mesh.nodes
        ]
        self.rng = random.Random(1)

    async def telemetry(self) -> None:
        """Every node's full snapshot, delivered as the broker would."""
        assert self.broker.handler is not None
        for x, ag in zip(self.mesh.nodes, self.agents, strict=True):
            msg = ag.telemetry(
                time.time(),
                public_keys=[x.wg_key],
                addresses=[x.address],
                full=True,
                peers=self.mesh.reports(x.index, self.rng, profile="lean"),
                counters={},
            )
            await self.broker.handler(self.topics.telemetry(x.name), msg, False)

    def route_sets(self) -> list[str]:
        out = []
        for topic, _ in self.broker.log:
            parsed = self.topics.parse(topic)
            if parsed is not None and parsed[0] == "routes":
                out.append(parsed[1])
        return out

    def leases(self) -> int:
        return sum(1 for topic, _ in self.broker.log if topic == self.topics.lease())


async def _until(cond: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Wait for an event (not a timing bound: the timeout only ends a broken run)."""
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out waiting"
        await asyncio.sleep(0.05)


async def _run(rig: Rig, body: Callable[[], Awaitable[None]]) -> None:
    task = asyncio.create_task(rig.ctl.run())
    try:
        await rig.broker.connected.wait()
        await body()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_a_publish_longer_than_the_lease_reaches_every_node(tmp_path: Path) -> None:
    """100 sets at 0.6 s per PUBACK: 60 s one by one, 3.75 s MAX_IN_FLIGHT (16) at a
    time, longer than the 3 s lease. Every node gets its set, several go out at once
    (never more than MAX_IN_FLIGHT), and the lease is renewed while they do."""
    rig = Rig(tmp_path, 100, delay_s=0.6)

    async def body() -> None:
        await _until(lambda: rig.ctl.core.lease.role == "active")
        await rig.telemetry()
        await _until(lambda: len(set(rig.route_sets())) == 100)

    asyncio.run(_run(rig, body))
    log = rig.broker.log
    routes = [i for i, (t, _) in enumerate(log) if (rig.topics.parse(t) or ("",))[0] == "routes"]
    first, last = routes[0], routes[-1]
    renewals = [i for i, (t, _) in enumerate(log) if t == rig.topics.lease()]
    assert any(first < i < last for i in renewals), "no lease renewal during the burst"
    assert 1 < rig.broker.max_routes_in_flight <= MAX_IN_FLIGHT
    assert rig.ctl.publishes.get(("routes", "ok")) == len(routes)
    assert ("routes", "dropped") not in rig.ctl.publishes


def test_the_queue_sends_the_most_urgent_first_and_only_the_newest_set(tmp_path: Path) -> None:
    rig = Rig(tmp_path, 3, delay_s=0.0)
    ctl = rig.ctl

    def pub(node: str, prio: int, tag: bytes) -> Publish:
        return Publish(f"t/{node}", tag, True, node=node, priority=prio)

    async def body() -> None:
        ctl._send(
            [
                pub("a", REFRESH, b"a1"),
                pub("b", CHANGED, b"b1"),
                pub("c", REFRESH, b"c1"),
                pub("d", URGENT, b"d1"),
                pub("a", REFRESH, b"a2"),  # replaces a1, not yet sent
            ]
        )
        got = []
        while (a := ctl._next()) is not None:
            got.append(a.payload)
        assert got == [b"d1", b"b1", b"a2", b"c1"]
        # A node with a set in flight waits for it: its next set is not taken meanwhile.
        ctl._send([pub("a", URGENT, b"a3"), pub("b", REFRESH, b"b2")])
        ctl.in_flight.add("a")
        nxt = ctl._next()
        assert nxt is not None and nxt.payload == b"b2"
        assert ctl._next() is None
        ctl.in_flight.discard("a")
        nxt = ctl._next()
        assert nxt is not None and nxt.payload == b"a3"

    asyncio.run(body())


def test_the_loop_serves_the_broker_while_a_recompute_runs(tmp_path: Path) -> None:
    """A recompute held in its thread: the lease is still renewed, telemetry waits and is
    taken (in order) when the recompute ends, leases are taken at once."""
    rig = Rig(tmp_path, 5, delay_s=0.0, lease_s=1.5)
    core = rig.ctl.core
    release = threading.Event()
    entered = threading.Event()
    real = core.compute

    def held(now: float) -> Computed | None:
        entered.set()
        release.wait(30.0)
        return real(now)

    core.compute = held  # type: ignore[method-assign]

    async def body() -> None:
        await _until(lambda: core.lease.role == "active")
        await rig.telemetry()  # makes the view dirty: the recompute starts, and holds
        await _until(entered.is_set)
        leases = rig.leases()
        accepted = core.accepted
        await rig.telemetry()
        assert len(rig.ctl._deferred) == 5 and core.accepted == accepted
        await _until(lambda: rig.leases() >= leases + 2)  # 0.5 s apart: lease_s / 3
        assert core.accepted > accepted  # our own leases, echoed: taken at once
        assert core.may_publish(time.time())
        release.set()
        await _until(lambda: len(set(rig.route_sets())) == 5)
        assert rig.ctl._deferred == []
        assert core.accepted >= accepted + 5

    try:
        asyncio.run(_run(rig, body))
    finally:
        release.set()


def test_an_acknowledged_renewal_counts_as_held_but_never_over_a_newer_lease() -> None:
    from meshopt.bus.messages import Lease
    from meshopt.controller.lease import LeaseKeeper

    k = LeaseKeeper("m", "me", lease_s=3.0, settle_s=0.5)
    k.tick(0.0)
    claim = k.tick(0.6)
    assert claim is not None and k.role == "claiming"
    k.on_lease(claim)  # the broker's echo
    first = k.tick(1.2)
    assert first is not None and k.role == "active"
    renewal = k.tick(2.3)
    assert renewal is not None and not k.may_publish(3.7)  # no echo read: the claim expired
    k.own_published(renewal)  # its PUBACK
    assert k.may_publish(3.7)
    k.own_published(first)  # an older one acknowledged late changes nothing
    assert k.current == renewal
    other = Lease(mesh="m", controller="other", term=k.term + 1, expires_at=9.0, issued_at=3.6)
    k.on_lease(other)
    k.own_published(renewal)
    assert k.current == other and k.role == "standby" and not k.may_publish(3.8)


def test_messages_held_during_a_recompute_are_taken_in_order_and_the_loop_runs_between(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """At 1000 nodes a recompute held ~12,000 messages; taken in one go they blocked the
    loop for seconds (mosquitto timed the controller out). They are taken in slices,
    the loop serving other tasks between, in the order they came; what arrives while
    they drain is held too and taken after them."""
    import meshopt.controller.daemon as daemon

    monkeypatch.setattr(daemon, "DRAIN_SLICE_S", 0.0)  # yield after every message
    ctl = Rig(tmp_path, 3, delay_s=0.0).ctl
    taken: list[bytes] = []
    ctl._take = lambda topic, payload, retained: taken.append(payload)  # type: ignore[method-assign]
    topic = Topics(MESH).telemetry("n0001")
    ctl._deferred = [(topic, b"early%d" % i, False) for i in range(6)]
    ctl._computing = True
    seen_mid_drain: list[int] = []

    async def body() -> None:
        async def other() -> None:
            for k in range(3):
                seen_mid_drain.append(len(taken))
                await ctl._on_message(topic, b"late%d" % k, False)
                await asyncio.sleep(0)

        task = asyncio.create_task(other())
        await ctl._drain_deferred()
        await task

    asyncio.run(body())
    assert taken == [b"early%d" % i for i in range(6)] + [b"late%d" % k for k in range(3)]
    assert any(0 < x < 6 for x in seen_mid_drain)  # the loop ran while they drained
    assert ctl._deferred == []


def test_a_node_dying_during_a_held_recompute_is_routed_around_before_it_ends(
    tmp_path: Path,
) -> None:
    """Issue 15: the will of a relay arrives while a recompute is held in its thread. The
    nodes relaying through it get sets that avoid it before the recompute ends (the shell
    reads the held will ahead, the urgent plan runs on the loop), and the recompute's
    own sets, once it ends, do not put the relay back."""
    n = 40
    rig = Rig(tmp_path, n, delay_s=0.0)
    core = rig.ctl.core
    release = threading.Event()
    entered = threading.Event()
    hold = threading.Event()
    real = core.compute

    threads: set[str] = set()

    def maybe_held(now: float) -> Computed | None:
        threads.add(threading.current_thread().name)
        if hold.is_set():
            entered.set()
            release.wait(30.0)
        return real(now)

    core.compute = maybe_held  # type: ignore[method-assign]
    controller = [core.key.public_key()]

    def sets_since(start: int) -> dict[str, RouteSet]:
        out: dict[str, RouteSet] = {}
        for topic, payload in rig.broker.log[start:]:
            parsed = rig.topics.parse(topic)
            if parsed is not None and parsed[0] == "routes":
                out[parsed[1]] = verify_route_set(payload, controller, mesh=MESH, node=parsed[1])
        return out

    async def body() -> None:
        await _until(lambda: core.lease.role == "active")
        await rig.telemetry()
        await _until(lambda: len(set(rig.route_sets())) == n and not rig.ctl._computing)
        assert core.engine.installed is not None
        # The relay most routes (fast or bulk) go through, and the nodes that use it.
        tables = [core.engine.installed.next_hop]
        if core.engine._bulk is not None:
            tables.append(core.engine._bulk)
        idx = np.arange(n)
        relayed = [t[(t != idx[None, :]) & (t != idx[:, None]) & (t >= 0)] for t in tables]
        x = int(np.bincount(np.concatenate(relayed), minlength=n).argmax())
        dead = rig.mesh.nodes[x]
        watch = {
            rig.mesh.nodes[s].name
            for t in tables
            for s in range(n)
            for d in range(n)
            if x not in (s, d) and t[s, d] == x
        }
        assert watch, "no node relays through another here"
        hold.set()
        await rig.telemetry()  # dirty: the next recompute starts and is held
        await _until(entered.is_set)
        start = len(rig.broker.log)
        st = AgentStatus(mesh=MESH, node=dead.name, online=False, since=time.time(), seq=0)
        assert rig.broker.handler is not None
        await rig.broker.handler(
            rig.topics.status(dead.name), sign("status", st, dead.identity), False
        )
        await _until(lambda: watch <= set(sets_since(start)))
        assert rig.ctl._computing and not release.is_set()  # the recompute is still held
        for rs in sets_since(start).values():
            assert not any(r.via == dead.wg_key and r.dst != dead.address for r in rs.routes)
        release.set()
        await _until(lambda: not rig.ctl._computing and rig.ctl._deferred == [])
        await asyncio.sleep(0.3)  # its sets out
        for name in watch:
            latest = sets_since(0)[name]
            assert not any(r.via == dead.wg_key and r.dst != dead.address for r in latest.routes)

    try:
        asyncio.run(_run(rig, body))
    finally:
        release.set()
    # Every recompute on the one thread kept for them (one malloc arena, issue 15).
    assert len(threads) == 1 and next(iter(threads)).startswith("recompute"), threads


def test_a_full_pass_waits_while_urgent_sets_are_queued(tmp_path: Path) -> None:
    """The urgent sets go out before a recompute takes the GIL from the loop: the tick
    starts none while one waits in the queue; once taken by a publisher it may start."""
    rig = Rig(tmp_path, 3, delay_s=0.0)
    ctl = rig.ctl
    ctl._send([Publish("t/a", b"a", True, node="a", priority=REFRESH)])
    assert not ctl._urgent_waiting()
    ctl._send([Publish("t/b", b"b", True, node="b", priority=URGENT)])
    assert ctl._urgent_waiting()
    taken = ctl._next()
    assert taken is not None and taken.node == "b"
    assert not ctl._urgent_waiting()


def test_the_daemon_runs_with_its_gc_thresholds_and_gives_the_old_ones_back(
    tmp_path: Path,
) -> None:
    """Issue 15: young collections every GC_THRESHOLDS[0] allocations while it runs (the
    default 700 cost a fifth of a full pass at 1000 nodes); the caller's afterwards."""
    rig = Rig(tmp_path, 3, delay_s=0.0)
    before = gc.get_threshold()
    seen: list[tuple[int, ...]] = []

    async def body() -> None:
        seen.append(gc.get_threshold())
        await _until(lambda: rig.ctl.core.lease.role == "active")
        await rig.telemetry()
        await _until(lambda: len(set(rig.route_sets())) == 3)
        seen.append(gc.get_threshold())

    asyncio.run(_run(rig, body))
    assert seen == [GC_THRESHOLDS, GC_THRESHOLDS]
    assert gc.get_threshold() == before


def test_held_messages_wait_while_urgent_route_sets_wait_to_be_signed(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Issue 15: after a pass at 1000 nodes the held backlog was taken slice by slice
    beside the publishers signing a dead relay's sets, and took half the loop from them.
    The drain now waits while urgent sets are queued (the urgent path read the backlog
    ahead already), then takes everything in order."""
    import meshopt.controller.daemon as daemon
    from meshopt.controller.core import URGENT, Publish

    monkeypatch.setattr(daemon, "DRAIN_SLICE_S", 0.0)  # yield after every message
    ctl = Rig(tmp_path, 3, delay_s=0.0).ctl
    monkeypatch.setattr(ctl.core, "may_publish", lambda wall: True)
    taken: list[bytes] = []
    ctl._take = lambda topic, payload, retained: taken.append(payload)  # type: ignore[method-assign]
    topic = Topics(MESH).telemetry("n0001")
    ctl._deferred = [(topic, b"held%d" % i, False) for i in range(6)]
    ctl._computing = True
    urgent = Publish("t", b"", True, node="n0002", priority=URGENT)
    taken_while_urgent: list[int] = []

    async def body() -> None:
        async def publisher() -> None:
            await asyncio.sleep(0.3)
            taken_while_urgent.append(len(taken))
            del ctl.pending["n0002"]  # signed and handed on

        ctl.pending["n0002"] = urgent  # a dead relay's set, queued
        task = asyncio.create_task(publisher())
        await ctl._drain_deferred()
        await task

    asyncio.run(body())
    assert taken == [b"held%d" % i for i in range(6)]
    assert taken_while_urgent == [1]  # one slice, then nothing until the set was signed
