"""The controller daemon: a thin asyncio shell around :class:`ControllerCore`.

Every bus message goes to the core; a tick (every 50 ms) advances the lease, expires
stale nodes and, while this controller is active, recomputes once the mesh has been
quiet for ``debounce_s`` (at once when a node died). The shell publishes what the core
returns (signed, retained route sets to the nodes whose routes changed) and reports
back whether the broker took them. The core counts and drops bad input; nothing a
message contains can stop the loop.

At 250 nodes a recompute takes seconds and a burst is 250 route sets of 84 kB (issue
15), so:

* the recompute runs in a worker thread (numpy and scipy release the GIL), and the
  loop goes on answering the broker's keepalive and renewing the lease meanwhile; bus
  messages that would change the core's state under it wait (in order) until it ends,
  all but leases and controller status, which only the lease reads;
* route sets wait in a queue, one per node (a newer set replaces one not yet sent),
  and go out ``MAX_IN_FLIGHT`` at a time without awaiting each PUBACK in turn, the most
  urgent first (a failed next hop, then a moved one, then backups and bulk routes);
  each is signed as it leaves the queue (249 sets signed up front kept the urgent ones
  waiting 2.5 s; a set of 84 kB now takes 0.7 ms of CPU to sign, as validation
  remembers the keys and prefixes it has checked), in the loop's thread, which alone
  assigns versions;
* full snapshots that only carry noise are batched (the core's ``recompute_due``):
  recomputing for each of the ~6 a second took 40 % of a core at 250 nodes;
* a set is sent only while we hold the lease; while the renewal is on its way the
  queue waits, and it is dropped (the core told) if another controller took over.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from meshopt import memtrim, sdnotify
from meshopt.bus.client import BusClient
from meshopt.bus.signing import load_private_key
from meshopt.controller.config import ControllerConfig
from meshopt.controller.core import URGENT, ControllerCore, Publish
from meshopt.controller.engine import Computed
from meshopt.controller.gate import PassGate

log = logging.getLogger("meshopt.controller")

TICK_S = 0.05
# Route sets published at once, each awaiting its own PUBACK: at 1000 nodes 8 kept a
# dead relay's 635 sets going out at ~8 ms a set for ~3 ms of signing each, bound by the
# round trip to a broker that was forwarding the sets to 1000 subscribers meanwhile.
MAX_IN_FLIGHT = 16
# Leases and controller status only touch the lease keeper: taken even mid-recompute.
LIVE_KINDS = frozenset({"lease", "controller_status"})
SUMMARY_S = 2.0  # how often a changed tally of dropped input is logged
DRAIN_SLICE_S = 0.02  # longest run of held messages taken without yielding to the loop
URGENT_FIRST_MAX_S = 5.0  # longest the held messages wait for urgent sets to be signed
# The cycle collector's thresholds while the daemon runs (Python's are 700, 10, 10). At
# 1000 nodes the controller holds ~2.1 million GC-tracked objects (row caches, bulk
# settings), and with the default a young collection came every 700 allocations and a
# full one each time the heap grew by a quarter: the first full pass spent 6.2 of its
# 31.7 s of CPU in the collector (14 full collections), with these 1.4 of 27.3 s (none).
# Reference counting frees all but cycles as before; cycles wait longer (issue 15).
GC_THRESHOLDS = (100_000, 10, 10)
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
            # Our own route sets need not come back (see BusClient): what the broker
            # retained of ours is known from its acknowledgement (published_ok).
            no_local=[topics.all_routes()],
            in_flight=MAX_IN_FLIGHT + 4,  # + the lease, our status and a margin
        )
        self.bus.on_connect = self._on_connect
        self._told_ready = False
        # /metrics and /healthz (meshopt.metrics): events counted here, state read live.
        from meshopt.metrics.controller import controller_registry, recompute_histogram

        self.publishes: dict[tuple[str, str], int] = {}
        self.metrics_registry = controller_registry(self)
        self.recompute_seconds = recompute_histogram(self.metrics_registry)
        self.loops: dict[str, asyncio.Task[Any]] = {}
        self.pending: dict[str, Publish] = {}  # route sets waiting, by node
        self.in_flight: set[str] = set()
        self.sent_order: list[str] = []  # nodes in the order their sets went out (recent)
        self._wake = asyncio.Event()
        self._computing = False
        self._deferred: list[tuple[str, bytes, bool]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._recompute_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="recompute"
        )
        self.gate = PassGate()
        # began, took, signing CPU so far, sets
        self._urgent_log: tuple[float, float, float, int] | None = None
        self.sign_cpu_s = 0.0  # CPU the loop spent signing route sets, in all
        self.core.engine.checkpoint = self.gate.checkpoint

    async def _on_connect(self) -> None:
        for a in self.core.on_connect(self.wall()):
            await self._send_one(a)
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
        thresholds = gc.get_threshold()
        gc.set_threshold(*GC_THRESHOLDS)
        try:
            await self._run()
        finally:
            gc.set_threshold(*thresholds)

    async def _run(self) -> None:
        bus = asyncio.create_task(self.bus.run(self._on_message), name="bus")
        from meshopt.metrics import parse_listen
        from meshopt.metrics.controller import controller_health
        from meshopt.metrics.server import start_metrics

        tick = asyncio.current_task()
        self.loops = {"bus": bus, **({"tick": tick} if tick is not None else {})}
        workers = [
            asyncio.create_task(self._publisher(), name=f"publisher-{i}")
            for i in range(MAX_IN_FLIGHT)
        ]
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
            compute: asyncio.Task[None] | None = None
            while True:
                await asyncio.sleep(TICK_S)
                busy = compute is not None and not compute.done()
                now, wall = self.clock(), self.wall()
                self._send(self.core.housekeeping(now, wall, expire=not busy))
                urgent = self.core.urgent_due(wall)
                # A pass in progress stops at its next checkpoint while urgent sets are
                # planned, signed and handed to the broker (see meshopt.controller.gate).
                if busy and (urgent or self._urgent_waiting()) and self.core.may_publish(wall):
                    self.gate.hold()
                else:
                    self.gate.release()
                if urgent:
                    # Beside a recompute in progress, not behind it (issue 15).
                    began = time.perf_counter()
                    planned = self.core.urgent_plan(now, wall)
                    if planned:
                        took = time.perf_counter() - began
                        self._urgent_log = (began, took, self.sign_cpu_s, len(planned))
                    self._send(planned)
                elif self._urgent_log is not None and not self._urgent_waiting():
                    began, took, signed_before, count = self._urgent_log
                    self._urgent_log = None
                    log.info(
                        "urgent: %d route sets planned in %.2f s, all signed and handed to "
                        "the broker %.2f s after the plan began (signing: %.2f s of CPU)",
                        count,
                        took,
                        time.perf_counter() - began,
                        self.sign_cpu_s - signed_before,
                    )
                # The full pass waits until the urgent sets have left the queue: it
                # would take the GIL from the loop that signs and sends them.
                if not busy and not self._urgent_waiting() and self.core.recompute_due(now, wall):
                    compute = asyncio.create_task(self._recompute(now, wall), name="recompute")
                if compute is not None and compute.done():
                    compute.result()  # a bug in the shell must surface, not hide
                if self.clock() >= next_summary:
                    next_summary = self.clock() + SUMMARY_S
                    dropped = self.core.dropped()
                    if dropped != logged:
                        logged = dropped
                        log.info("dropped so far: %s", json.dumps(dropped, sort_keys=True))
                if bus.done():
                    bus.result()
        finally:
            self.gate.release()  # a held pass must not keep the worker thread (and exit)
            for t in [bus, *workers, *self._tasks]:
                t.cancel()
            for t in [bus, *workers, *self._tasks]:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            if metrics is not None:
                await metrics.close()
            self._recompute_pool.shutdown(wait=False, cancel_futures=True)

    async def _recompute(self, now: float, wall: float) -> None:
        """One recompute in a worker thread; the loop keeps serving the broker meanwhile."""
        self._computing = True
        started = time.perf_counter()
        core = self.core
        # Clears the dirty mark and a revival's hold: a failure or a return told while
        # the pass runs marks them again.
        core.begin_recompute()
        self.gate.begin_pass()
        cpu = 0.0

        def compute() -> tuple[Computed | None, float]:
            t = time.thread_time()
            try:
                return core.compute(now), time.thread_time() - t
            except Exception as exc:  # keep the routes agents have; try the next change
                core.counters.count("recompute_failed", repr(exc), exc_info=exc)
                return None, time.thread_time() - t
            finally:
                memtrim.trim()  # the pass's temporaries back to the OS (issue 15: RSS)

        try:
            # One thread for every recompute: one malloc arena holds their temporaries,
            # not one per thread of the default executor.
            loop = asyncio.get_running_loop()
            c, cpu = await loop.run_in_executor(self._recompute_pool, compute)
            # The rest on the loop: the urgent plans it ran meanwhile are applied again
            # on top, in the loop's order (see ControllerCore.finish_recompute).
            t = time.thread_time()
            try:
                actions = core.finish_recompute(c, now)
            except Exception as exc:
                core.counters.count("recompute_failed", repr(exc), exc_info=exc)
                actions = []
            cpu += time.thread_time() - t
            if (held := self.gate.held_this_pass_s) > 0:
                log.info("full pass waited %.2f s for urgent route sets", held)
            took = time.perf_counter() - started
            self.recompute_seconds.observe(took)
            log.debug(
                "pass: %.3f s, %.3f s of CPU in its thread, %d messages held meanwhile",
                took,
                cpu,
                len(self._deferred),
            )
            self._send(actions)  # the publishers start on them while the backlog drains
        finally:
            core.abort_recompute()  # a no-op once finished
            core.recomputed_at = now
            core.recompute_cpu_s = cpu
            try:
                await self._drain_deferred()
            finally:
                self._computing = False

    async def _drain_deferred(self) -> None:
        """Take the messages held during a recompute, in order, giving the loop back every
        ``DRAIN_SLICE_S``: at 1000 nodes a recompute of a minute held ~12,000 messages,
        taken in one go they blocked the loop for seconds and mosquitto timed the
        controller out for its missing keepalive. Messages arriving meanwhile are held
        too (``_computing`` stays set) and taken after them."""
        t = time.perf_counter()
        while self._deferred:
            batch, self._deferred = self._deferred, []
            for i, (topic, payload, retained) in enumerate(batch):
                self._take(topic, payload, retained)
                if time.perf_counter() - t >= DRAIN_SLICE_S and i + 1 < len(batch):
                    # The rest of this batch goes before anything held meanwhile.
                    self._deferred = batch[i + 1 :] + self._deferred
                    await self._after_urgent()
                    t = time.perf_counter()
                    break

    async def _after_urgent(self) -> None:
        """Yield the loop, and keep it yielded while urgent route sets wait to be signed
        (up to ``URGENT_FIRST_MAX_S``): the backlog held during a pass is telemetry the
        urgent path has already read ahead, and at 1000 nodes taking it slice by slice
        beside the publishers cost them half the loop around a dead relay."""
        await asyncio.sleep(0)
        deadline = self.clock() + URGENT_FIRST_MAX_S
        while (
            self._urgent_waiting()
            and self.core.may_publish(self.wall())
            and self.clock() < deadline
        ):
            await asyncio.sleep(DRAIN_SLICE_S / 4)

    async def _on_message(self, topic: str, payload: bytes, retained: bool) -> None:
        if self._computing:
            parsed = self.core.topics.parse(topic)
            if parsed is None or parsed[0] not in LIVE_KINDS:
                self._deferred.append((topic, payload, retained))
                # A failure in it is acted on now (the next tick's urgent plan), not
                # after the recompute; the message itself is taken in turn.
                held = len(self._deferred)
                if not retained and self.core.peek(topic, payload, self.clock(), self.wall()):
                    log.info("urgent: a failure read ahead in %s (%d held)", topic, held)
                elif retained and parsed is not None and parsed[0] == "status":
                    log.info("held unread: a retained status on %s (%d held)", topic, held)
                return
        self._take(topic, payload, retained)

    def _take(self, topic: str, payload: bytes, retained: bool) -> None:
        self._send(self.core.on_message(topic, payload, retained, self.clock(), self.wall()))

    def _send(self, actions: list[Publish]) -> None:
        """Route sets to the queue (replacing a node's older one not yet sent); the rest
        (lease, status) out at once, each in its own task."""
        for a in actions:
            if a.node is not None:
                self.pending[a.node] = a
                self._wake.set()
            else:
                task = asyncio.create_task(self._send_one(a))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _send_one(self, a: Publish) -> None:
        ok = await self.bus.publish(a.topic, a.payload, qos=a.qos, retain=a.retain)
        parsed = self.core.topics.parse(a.topic)
        kind = (parsed[0] if parsed else "other", "ok" if ok else "failed")
        self.publishes[kind] = self.publishes.get(kind, 0) + 1
        self.core.published_ok(a, ok, self.clock())

    def _urgent_waiting(self) -> bool:
        """Urgent route sets queued and not yet taken by a publisher."""
        return any(a.priority == URGENT for a in self.pending.values())

    def _next(self) -> Publish | None:
        """The most urgent waiting set of a node with none in flight (order kept within
        a priority: the dict keeps insertion order)."""
        best: Publish | None = None
        for node, a in self.pending.items():
            if node not in self.in_flight and (best is None or a.priority < best.priority):
                best = a
                if a.priority == 0:
                    break
        if best is not None and best.node is not None:
            del self.pending[best.node]
        return best

    async def _publisher(self) -> None:
        """One of ``MAX_IN_FLIGHT`` workers draining the route-set queue."""
        while True:
            a = self._next()
            if a is None or a.node is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            if not self.core.may_publish(self.wall()):
                if self.core.lease.role == "active":  # the renewal is on its way: wait
                    self.pending.setdefault(a.node, a)
                    await asyncio.sleep(TICK_S)
                    continue
                # Another controller took over: this set is not ours to send.
                self.publishes[("routes", "dropped")] = (
                    self.publishes.get(("routes", "dropped"), 0) + 1
                )
                self.core.published_ok(a, False, self.clock())
                continue
            node = a.node
            t = time.thread_time()
            signed = self.core.sign_routes(a, self.wall())  # now: urgent sets do not wait
            self.sign_cpu_s += time.thread_time() - t
            if signed is None:
                continue
            self.in_flight.add(node)
            try:
                self.sent_order.append(node)
                del self.sent_order[:-1000]
                await self._send_one(signed)
            finally:
                self.in_flight.discard(node)
                self._wake.set()
