"""The controller daemon: a thin asyncio shell around the view, the engine and the lease.

Every bus message updates the view; a tick (every 50 ms) advances the lease, expires
stale nodes and, while this controller is active, recomputes once the mesh has been
quiet for ``debounce_s`` (at once when a node died) and publishes a signed, retained
route set to every node whose routes changed. Bad input is dropped with a counted
reason; nothing a message contains can stop the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Literal

from meshopt.bus.client import BusClient
from meshopt.bus.messages import (
    BusMessageError,
    ControllerStatus,
    Counters,
    Route,
    RouteSet,
    decode_controller_status,
    decode_lease,
    decode_status,
    decode_telemetry,
    encode,
)
from meshopt.bus.signing import load_private_key, sign_route_set, verify_route_set
from meshopt.bus.topics import Topics
from meshopt.controller.config import ControllerConfig
from meshopt.controller.engine import Computed, RouteEngine
from meshopt.controller.lease import LeaseKeeper
from meshopt.controller.view import MeshView, TelemetryRefused

log = logging.getLogger("meshopt.controller")

TICK_S = 0.05


class Controller:
    def __init__(
        self,
        cfg: ControllerConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.wall = wall
        self.topics = Topics(cfg.mesh)
        self.key = load_private_key(cfg.signing_key)
        self.public = self.key.public_key()
        self.counters = Counters("controller dropped", log)
        self.view = MeshView(
            cfg.mesh,
            metric=cfg.metric.metric(),
            stale_after_s=cfg.stale_after_s,
            allowed=cfg.nodes,
        )
        self.engine = RouteEngine(
            cfg.policy.policy(),
            relay_hop_ms=cfg.metric.relay_hop_ms,
            symmetric=cfg.symmetric,
            bulk=cfg.bulk,
        )
        self.lease = LeaseKeeper(cfg.mesh, cfg.id, lease_s=cfg.lease_s, settle_s=cfg.settle_s)
        self.retained_sets: dict[str, RouteSet] = {}
        self.published: dict[str, list[Route]] = {}
        self.version = 0
        self.dirty_since: float | None = None
        self.urgent = False
        self.last: Computed | None = None
        self.recomputes = 0
        self.bus = BusClient(
            cfg.broker,
            client_id=f"meshopt-controller-{cfg.mesh}-{cfg.id}",
            will=(self.topics.controller_status(cfg.id), self._status(False), True),
            subscriptions=[
                self.topics.all_telemetry(),
                self.topics.all_status(),
                self.topics.all_routes(),
                self.topics.lease(),
                self.topics.all_controller_status(),
            ],
        )
        self.bus.on_connect = self._on_connect

    def _status(self, online: bool) -> bytes:
        role: Literal["active", "standby"] = "active" if self.lease.role == "active" else "standby"
        return encode(
            ControllerStatus(controller=self.cfg.id, online=online, role=role, since=self.wall())
        )

    async def _on_connect(self) -> None:
        await self.bus.publish(
            self.topics.controller_status(self.cfg.id), self._status(True), qos=1, retain=True
        )

    async def run(self) -> None:
        bus = asyncio.create_task(self.bus.run(self._on_message), name="bus")
        try:
            await self.bus.wait_connected(None)
            while True:
                await asyncio.sleep(TICK_S)
                await self.tick()
                if bus.done():
                    bus.result()
        finally:
            bus.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await bus

    # --- input ------------------------------------------------------------------------

    def _mark_dirty(self, urgent: bool = False) -> None:
        if self.dirty_since is None:
            self.dirty_since = self.clock()
        self.urgent = self.urgent or urgent

    async def _on_message(self, topic: str, payload: bytes, retained: bool) -> None:
        parsed = self.topics.parse(topic)
        if parsed is None:
            return
        kind, name = parsed
        try:
            if kind == "telemetry":
                t = decode_telemetry(payload)
                # A retained snapshot may be old: its age counts (fresh ones are timed by
                # arrival, which needs no clock agreement between hosts).
                self.view.take(name, t, self.clock(), self.wall() if retained else None)
                self._mark_dirty()
            elif kind == "status":
                if not payload:
                    return
                st = decode_status(payload)
                if st.node != name:
                    raise TelemetryRefused("node_mismatch", f"status of {st.node} on {name}")
                if not st.online and self.view.set_offline(name, st.reason or "offline"):
                    log.warning("node %s offline (%s): routing around it", name, st.reason)
                    self._mark_dirty(urgent=True)
            elif kind == "routes":
                if payload:
                    rs = verify_route_set(payload, [self.public], mesh=self.cfg.mesh, node=name)
                    self.retained_sets[name] = rs
                    self.version = max(self.version, rs.version)
            elif kind == "lease":
                if payload:
                    self.lease.on_lease(decode_lease(payload))
            elif kind == "controller_status" and payload:
                cs = decode_controller_status(payload)
                if not cs.online:
                    self.lease.on_controller_offline(cs.controller)
        except BusMessageError as exc:
            self.counters.count(f"{kind}_{exc.reason}", str(exc))
        except TelemetryRefused as exc:
            self.counters.count(f"{kind}_{exc.reason}", str(exc))

    # --- the loop ---------------------------------------------------------------------

    async def tick(self) -> None:
        now, wall = self.clock(), self.wall()
        was_active = self.lease.role == "active"
        lease = self.lease.tick(wall)
        if lease is not None:
            await self.bus.publish(self.topics.lease(), encode(lease), qos=1, retain=True)
        active = self.lease.role == "active"
        if active and not was_active:
            log.info("controller %s active (term %d)", self.cfg.id, self.lease.term)
            self.engine.adopt(self.view, self.retained_sets, now)
            self.published = {n: list(rs.routes) for n, rs in self.retained_sets.items()}
            await self._on_connect()
            self._mark_dirty(urgent=True)
        elif was_active and not active:
            log.warning("controller %s is standby now (another holds a newer lease)", self.cfg.id)
            await self._on_connect()
        for name in self.view.expire(now):
            log.warning("node %s: telemetry stale, routing around it", name)
            self._mark_dirty(urgent=True)
        if self.dirty_since is None or not self.lease.may_publish(wall):
            return
        if not self.view.ready(now, self.cfg.warmup_s, self.cfg.warmup_samples):
            return
        if not self.urgent and now - self.dirty_since < self.cfg.debounce_s:
            return
        self.dirty_since = None
        self.urgent = False
        await self.recompute(now, wall)

    async def recompute(self, now: float, wall: float) -> None:
        if not self.view.nodes:
            return
        policy = None
        first = self.view.first_seen
        if first is not None and now - first < self.cfg.startup_s:
            # The first routes rest on young estimates: let better ones replace them
            # after a short hold instead of the full one.
            policy = dataclasses.replace(
                self.engine.policy, hold_s=min(self.engine.policy.hold_s, self.cfg.startup_hold_s)
            )
        c = self.engine.compute(self.view, now, policy)
        self.last = c
        self.recomputes += 1
        changed = int(c.decision.changed.sum())
        if changed:
            log.info(
                "routes: %d entries changed (%d failed, %d improved)",
                changed,
                int(c.decision.failed.sum()),
                int(c.decision.improved.sum()),
            )
        for node, routes in c.routes.items():
            if self.published.get(node) == routes:
                continue
            if not self.lease.may_publish(self.wall()):
                return  # lost the lease meanwhile: publish nothing more
            self.version = max(self.version + 1, time.time_ns() // 1000)
            rs = RouteSet(
                mesh=self.cfg.mesh,
                node=node,
                version=self.version,
                issued_at=wall,
                controller=self.cfg.id,
                term=self.lease.term,
                routes=routes,
            )
            ok = await self.bus.publish(
                self.topics.routes(node), sign_route_set(rs, self.key), qos=1, retain=True
            )
            if ok:
                self.published[node] = routes
            else:
                self._mark_dirty()  # retry once the bus is back
