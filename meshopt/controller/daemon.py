"""The controller daemon: a thin asyncio shell around :class:`ControllerCore`.

Every bus message goes to the core; a tick (every 50 ms) advances the lease, expires
stale nodes and, while this controller is active, recomputes once the mesh has been
quiet for ``debounce_s`` (at once when a node died). The shell publishes what the core
returns (signed, retained route sets to the nodes whose routes changed) and reports
back whether the broker took them. The core counts and drops bad input; nothing a
message contains can stop the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from meshopt import sdnotify
from meshopt.bus.client import BusClient
from meshopt.bus.signing import load_private_key
from meshopt.controller.config import ControllerConfig
from meshopt.controller.core import ControllerCore, Publish

log = logging.getLogger("meshopt.controller")

TICK_S = 0.05
SUMMARY_S = 2.0  # how often a changed tally of dropped input is logged
# What a reload cannot change under a running controller (identity, broker session,
# lease timing, the graph's shape); node_keys, controller_keys and [policy] can.
CONTROLLER_RESTART_ONLY = (
    "mesh",
    "id",
    "signing_key",
    "broker",
    "symmetric",
    "bulk",
    "metric",
    "lease_s",
    "settle_s",
    "stale_after_s",
    "max_skew_s",
    "metrics",  # the endpoint is bound at start
)


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
        self.core = ControllerCore(cfg, load_private_key(cfg.signing_key))
        topics = self.core.topics
        self.bus = BusClient(
            cfg.broker,
            client_id=f"meshopt-controller-{cfg.mesh}-{cfg.id}",
            will=lambda: self.core.new_session(self.wall()),
            subscriptions=[
                topics.all_telemetry(),
                topics.all_status(),
                topics.all_routes(),
                topics.lease(),
                topics.all_controller_status(),
            ],
        )
        self.bus.on_connect = self._on_connect
        self._told_ready = False
        # /metrics and /healthz (meshopt.metrics): events counted here, state read live.
        from meshopt.metrics.controller import controller_registry, recompute_histogram

        self.publishes: dict[tuple[str, str], int] = {}
        self.metrics_registry = controller_registry(self)
        self.recompute_seconds = recompute_histogram(self.metrics_registry)
        self.loops: dict[str, asyncio.Task[Any]] = {}

    async def _on_connect(self) -> None:
        await self._publish(self.core.on_connect(self.wall()))
        if not self._told_ready:  # the first connection: systemd may start what follows us
            self._told_ready = True
            sdnotify.ready(f"running: connected to the broker, mesh {self.cfg.mesh}")

    async def reload(self, path: str) -> str:
        """SIGHUP: node_keys, controller_keys, policy and timing change now; settings that
        need a restart are logged and kept. A bad file raises InputError (config kept)."""
        from meshopt.controller.config import load_controller_config
        from meshopt.reload import describe, merge_reload

        new = load_controller_config(path)
        cfg, now, later = merge_reload(self.cfg, new, CONTROLLER_RESTART_ONLY)
        if later:
            log.warning("reload: %s changed: needs a restart (kept as running)", ", ".join(later))
        old, self.cfg = self.cfg, cfg
        self.core.reconfigure(cfg, self.clock())
        log.info("reloaded %s: %s", path, describe(old, cfg, now) or "nothing changed")
        return f"running: {len(self.core.enrolled)} nodes enrolled, configuration reloaded"

    async def run(self) -> None:
        bus = asyncio.create_task(self.bus.run(self._on_message), name="bus")
        from meshopt.metrics import parse_listen
        from meshopt.metrics.controller import controller_health
        from meshopt.metrics.server import start_metrics

        tick = asyncio.current_task()
        self.loops = {"bus": bus, **({"tick": tick} if tick is not None else {})}
        metrics = await start_metrics(
            parse_listen(self.cfg.metrics.listen),
            self.metrics_registry,
            lambda: controller_health(self, self.loops),
            "controller",
        )
        try:
            await self.bus.wait_connected(None)
            logged: dict[str, int] = {}
            next_summary = self.clock() + SUMMARY_S
            while True:
                await asyncio.sleep(TICK_S)
                runs, started = self.core.recomputes, time.perf_counter()
                actions = self.core.tick(self.clock(), self.wall())
                if self.core.recomputes != runs:
                    self.recompute_seconds.observe(time.perf_counter() - started)
                await self._publish(actions)
                if self.clock() >= next_summary:
                    next_summary = self.clock() + SUMMARY_S
                    dropped = self.core.dropped()
                    if dropped != logged:
                        logged = dropped
                        log.info("dropped so far: %s", json.dumps(dropped, sort_keys=True))
                if bus.done():
                    bus.result()
        finally:
            bus.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await bus
            if metrics is not None:
                await metrics.close()

    async def _on_message(self, topic: str, payload: bytes, retained: bool) -> None:
        actions = self.core.on_message(topic, payload, retained, self.clock(), self.wall())
        await self._publish(actions)

    async def _publish(self, actions: list[Publish]) -> None:
        for a in actions:
            if a.node is not None and not self.core.may_publish(self.wall()):
                return  # lost the lease meanwhile: publish nothing more
            ok = await self.bus.publish(a.topic, a.payload, qos=a.qos, retain=a.retain)
            parsed = self.core.topics.parse(a.topic)
            kind = (parsed[0] if parsed else "other", "ok" if ok else "failed")
            self.publishes[kind] = self.publishes.get(kind, 0) + 1
            self.core.published_ok(a, ok, self.clock())
