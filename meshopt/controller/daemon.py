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

from meshopt.bus.client import BusClient
from meshopt.bus.signing import load_private_key
from meshopt.controller.config import ControllerConfig
from meshopt.controller.core import ControllerCore, Publish

log = logging.getLogger("meshopt.controller")

TICK_S = 0.05
SUMMARY_S = 2.0  # how often a changed tally of dropped input is logged


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

    async def _on_connect(self) -> None:
        await self._publish(self.core.on_connect(self.wall()))

    async def run(self) -> None:
        bus = asyncio.create_task(self.bus.run(self._on_message), name="bus")
        try:
            await self.bus.wait_connected(None)
            logged: dict[str, int] = {}
            next_summary = self.clock() + SUMMARY_S
            while True:
                await asyncio.sleep(TICK_S)
                await self._publish(self.core.tick(self.clock(), self.wall()))
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

    async def _on_message(self, topic: str, payload: bytes, retained: bool) -> None:
        actions = self.core.on_message(topic, payload, retained, self.clock(), self.wall())
        await self._publish(actions)

    async def _publish(self, actions: list[Publish]) -> None:
        for a in actions:
            if a.node is not None and not self.core.may_publish(self.wall()):
                return  # lost the lease meanwhile: publish nothing more
            ok = await self.bus.publish(a.topic, a.payload, qos=a.qos, retain=a.retain)
            self.core.published_ok(a, ok, self.clock())
