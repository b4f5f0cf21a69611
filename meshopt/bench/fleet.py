"""The scale benchmark's synthetic agents, in this process or split over processes.

Why: at N = 1000 one asyncio loop held every agent's MQTT session, built and signed
their telemetry and verified every route set that arrived (~7 ms each). When a fan-out
or a burst of snapshots held the loop for seconds, the keepalives of all sessions
waited behind it, mosquitto timed them out, and their reconnects (each with a full
1000-peer snapshot) fed the next stall (docs/scale.md, "N = 1000: why the generator
could not connect 1000 agents").

So here:

* :class:`Fleet` holds some of the agents (any subset of the mesh's indices) and answers
  the run's questions about them with plain data (counts, lists, dicts) that
  :func:`merge` can add up over several fleets;
* :class:`LocalPool` is one fleet in this process (the old layout); :class:`ProcPool`
  starts K worker processes, each with its own event loop and fleet (agent *i* in
  worker *i* mod K, each agent still with its own MQTT session), and asks every worker
  and merges the answers;
* :class:`Verifier` checks arriving route sets in a thread, not on the event loop. The
  time of a route set's arrival is taken when its message is handed over, before it is
  checked; a set counts (``accepted``) only once it has verified as an agent verifies
  it. While a change is being timed every set that arrives is verified, in order. In
  between, a set that a newer one for the same node overtook before its turn is not
  verified (``superseded``): the node's newest set is, so has-routes stays exact.

``time.monotonic`` is the system's CLOCK_MONOTONIC, the same in every process, so
arrival times taken in the workers compare with the run's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Protocol

from meshopt.bus.client import BrokerSettings
from meshopt.bus.messages import RouteSet

if TYPE_CHECKING:
    from meshopt.bench.synthetic import (
        Arrival,
        Profile,
        SyntheticAgent,
        SyntheticMesh,
        SyntheticNode,
    )

Result = dict[str, Any]


def merge(results: Sequence[Result]) -> Result:
    """Add up the answers of several fleets: numbers are summed, lists joined, dicts
    merged key by key the same way; None counts as nothing."""
    out: Result = {}
    for res in results:
        for k, v in res.items():
            if v is None:
                out.setdefault(k, None)
                continue
            have = out.get(k)
            if have is None:
                out[k] = list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v
            elif isinstance(v, list):
                have.extend(v)
            elif isinstance(v, dict):
                out[k] = merge([have, v])
            elif isinstance(v, bool):
                out[k] = bool(have) or v
            else:
                out[k] = have + v
    return out


# --- route sets, off the loop ---------------------------------------------------------------


def check_arrival(agent: SyntheticAgent, arrival: Arrival) -> float:
    """Verify ``arrival`` as the agent does (signature, node, version, term), mark it,
    and time the agent's watch with the arrival's own time. Returns the CPU seconds."""
    t0 = time.thread_time()
    accepted = agent.core.on_route_set(arrival.payload, time.time())
    spent = time.thread_time() - t0
    arrival.payload = b""
    if accepted is None:
        arrival.accepted = False
        return spent
    arrival.version = accepted.route_set.version
    watch = agent.watch
    if watch is not None and agent.fixed_at is None:
        since, test = watch
        if arrival.at >= since and test(accepted.route_set):
            agent.fixed_at = arrival.at
    arrival.accepted = True
    return spent


class Verifier:
    """One thread that checks the fleet's arriving route sets in arrival order."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[tuple[SyntheticAgent, Arrival] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0
        # While set, every set arriving from then on is verified (a change is timed).
        self.timing_since: float | None = None
        self.verified = 0
        self.superseded = 0
        self.cpu_s = 0.0
        self._thread = threading.Thread(target=self._loop, name="verifier", daemon=True)
        self._thread.start()

    def submit(self, agent: SyntheticAgent, arrival: Arrival) -> None:
        with self._lock:
            self._pending += 1
        self._q.put((agent, arrival))

    @property
    def pending(self) -> int:
        return self._pending

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            try:
                self.check(*item)
            finally:
                with self._lock:
                    self._pending -= 1

    def check(self, agent: SyntheticAgent, arrival: Arrival) -> None:
        """Verify ``arrival`` unless it is not timed and a newer set for the agent came."""
        since = self.timing_since
        timed = agent.watch is not None or (since is not None and arrival.at >= since)
        if not timed and agent.arrivals and agent.arrivals[-1] is not arrival:
            arrival.payload = b""
            self.superseded += 1
            return
        self.cpu_s += check_arrival(agent, arrival)
        self.verified += 1

    def close(self, timeout_s: float = 5.0) -> None:
        self._q.put(None)
        self._thread.join(timeout_s)


# --- one fleet ------------------------------------------------------------------------------


def not_direct(dst: SyntheticNode) -> Callable[[RouteSet], bool]:
    """A route set whose fast route to ``dst`` no longer takes the direct tunnel."""

    def test(rs: RouteSet) -> bool:
        return not any(
            r.table == "fast" and r.dst == dst.address and r.via == dst.wg_key for r in rs.routes
        )

    return test


def avoids(dead: SyntheticNode) -> Callable[[RouteSet], bool]:
    """A route set that relays nothing through ``dead`` (its own address aside)."""

    def test(rs: RouteSet) -> bool:
        return not any(r.via == dead.wg_key and r.dst != dead.address for r in rs.routes)

    return test


STOP_TIMEOUT_S = 10.0


class Fleet:
    """Some of the mesh's agents (``indices``), in this process and event loop. Every
    method takes global node indices, acts on the ones it holds, and answers with data
    :func:`merge` can add up."""

    def __init__(
        self,
        mesh: SyntheticMesh,
        settings: dict[int, BrokerSettings],
        controller_key: str,
        *,
        profile: Profile = "agent",
        seed: int = 1,
        full_interval_s: float = 5.0,
    ) -> None:
        import random

        from meshopt.bench.synthetic import SyntheticAgent

        self.mesh = mesh
        self.verifier = Verifier()
        self.agents: dict[int, SyntheticAgent] = {
            i: SyntheticAgent(
                mesh,
                i,
                s,
                controller_key,
                profile,
                random.Random(seed * 100_003 + i),
                full_interval_s=full_interval_s,
                verifier=self.verifier,
            )
            for i, s in sorted(settings.items())
        }
        self.lags: list[tuple[float, float]] = []  # (when, how late)
        self._lag_task: asyncio.Task[None] | None = None

    async def _lag(self) -> None:
        """How late this event loop wakes (a loaded loop delays what it times)."""
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.1)
            now = time.monotonic()
            self.lags.append((now, max(0.0, now - t - 0.1)))

    def ping(self) -> Result:
        if self._lag_task is None:
            self._lag_task = asyncio.get_running_loop().create_task(self._lag())
        return {"agents": len(self.agents), "pid": [os.getpid()]}

    async def connect(self, indices: list[int], timeout_s: float = 30.0) -> Result:
        mine = [self.agents[i] for i in indices if i in self.agents]
        for a in mine:
            a.start()
        await asyncio.gather(*(a.bus.wait_connected(timeout_s) for a in mine))
        return {"connected": sum(a.bus.connected for a in mine)}

    def status(self) -> Result:
        return {
            "agents": len(self.agents),
            "connected": sum(a.bus.connected for a in self.agents.values()),
            "with_routes": sum(a.has_routes for a in self.agents.values()),
        }

    def stats(self, since: float = 0.0) -> Result:
        """Totals so far; the loop's lag samples from ``since`` (monotonic) on."""
        ags = list(self.agents.values())
        refused: dict[str, int] = {}
        for a in ags:
            for k, v in a.core.counters.snapshot().items():
                refused[k] = refused.get(k, 0) + v
        return {
            "bytes_up": sum(a.bytes_up for a in ags),
            "bytes_down": sum(a.bytes_down for a in ags),
            "messages_up": sum(a.messages_up for a in ags),
            "route_sets": sum(len(a.arrivals) for a in ags),
            "fulls": sum(a.fulls for a in ags),
            "changes": sum(a.changes for a in ags),
            "heartbeats": sum(a.heartbeats for a in ags),
            "build_s": sum(a.build_s for a in ags),
            "reconnects": sum(max(0, a.bus.connects - 1) for a in ags),
            "verified": self.verifier.verified,
            "superseded": self.verifier.superseded,
            "verify_cpu_s": self.verifier.cpu_s,
            "verify_pending": self.verifier.pending,
            "refused": refused,
            "lags": [lag for t, lag in self.lags if t >= since],
        }

    def sizes(self) -> Result:
        last = [
            a.arrivals[-1].size
            for a in self.agents.values()
            if a.arrivals and a.arrivals[-1].accepted
        ]
        routes = [len(a.core.route_set.routes) for a in self.agents.values() if a.core.route_set]
        return {"last_sizes": last, "routes": routes}

    def busiest(self, exclude: list[int]) -> Result:
        """Candidates (count, a, b): a direct link a->b that a's route set uses for b
        itself and the most other destinations (so degrading it must move routes)."""
        by_key = {x.wg_key: x.index for x in self.mesh.nodes}
        by_addr = {x.address: x.index for x in self.mesh.nodes}
        best: list[int] | None = None
        for a in self.agents.values():
            rs = a.core.route_set
            if rs is None or a.index in exclude:
                continue
            counts: dict[int, int] = {}
            direct: set[int] = set()
            for r in rs.routes:
                if r.table != "fast":
                    continue
                via = by_key.get(r.via)
                if via is None:
                    continue
                counts[via] = counts.get(via, 0) + 1
                if by_addr.get(r.dst) == via:
                    direct.add(via)
            for b in sorted(direct):
                if b not in exclude and (best is None or counts[b] > best[0]):
                    best = [counts[b], a.index, b]
        return {"candidates": [] if best is None else [best]}

    async def degrade(self, ia: int, ib: int, t0: float) -> Result:
        """Both ends of a->b see it 10x slower and report it at once; an end that routes
        to the other over it is watched until a set arrives that no longer does."""
        self.verifier.timing_since = t0
        mine = [(x, y) for x, y in ((ia, ib), (ib, ia)) if x in self.agents]
        for x, y in mine:
            ag = self.agents[x]
            ag.factor[y] = 10.0
            rs = ag.core.route_set
            # Only an end that routes to the other over this link must move: the reverse
            # direction may already take a relay (routes need not be symmetric), and an
            # unchanged route set is not re-sent, so waiting for it would time out.
            if rs is not None and not not_direct(self.mesh.nodes[y])(rs):
                ag.expect(t0, not_direct(self.mesh.nodes[y]))
        await asyncio.gather(*(self.agents[x].telemetry(full=False) for x, _ in mine))
        return {"watched": sum(self.agents[x].watch is not None for x, _ in mine)}

    def expect_avoid(self, victim: int, t0: float) -> Result:
        """Watch every live node that relays through ``victim`` until it stops."""
        self.verifier.timing_since = t0
        dead = self.mesh.nodes[victim]
        n = 0
        for ag in self.agents.values():
            rs = ag.core.route_set
            # A node stopped before (the start-up change's) keeps its last set but gets
            # no new one: watching it would count it affected and never fixed.
            if not ag.running:
                continue
            if ag.index != victim and rs is not None and not avoids(dead)(rs):
                ag.expect(t0, avoids(dead))
                n += 1
        return {"watched": n}

    async def stop_agent(self, i: int) -> Result:
        if i in self.agents:
            await self.agents[i].stop()
        return {}

    def fan_status(self, t0: float, skip: int) -> Result:
        ags = [a for a in self.agents.values() if a.index != skip]
        pending = any(a.watch is not None and a.fixed_at is None for a in ags)
        return {
            "count": sum(1 for a in ags if a.accepted_after(t0) is not None),
            "pending": int(pending or self.verifier.pending > 0),
        }

    def fan_result(self, t0: float, skip: int) -> Result:
        lat: list[float] = []
        sizes: list[int] = []
        for a in self.agents.values():
            if a.index == skip:
                continue
            got = a.accepted_after(t0)
            if got is not None:
                lat.append(got.at - t0)
                sizes.append(got.size)
        ags = [a for a in self.agents.values() if a.watch is not None and a.index != skip]
        fixed = [a.fixed_at - t0 for a in ags if a.fixed_at is not None]
        return {"lat": lat, "sizes": sizes, "fixed": fixed, "watched": len(ags)}

    def clear(self) -> Result:
        """The change is timed: stop watching, verify only the newest sets again."""
        self.verifier.timing_since = None
        for a in self.agents.values():
            a.watch = None
        return {}

    async def stop_all(self, timeout_s: float = 10.0) -> Result:
        """Stop every agent, but wait at most ``timeout_s``: the broker goes next anyway."""
        ags = self.agents.values()
        tasks = [t for a in ags for t in (a.snap_task, a.task) if t is not None and not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        if self._lag_task is not None:
            self._lag_task.cancel()
        self.verifier.close()
        return {}


# --- pools ----------------------------------------------------------------------------------


class Pool(Protocol):
    """Where the run's agents live; ``call`` asks every fleet and merges the answers."""

    async def call(self, method: str, *args: Any) -> Result: ...

    @property
    def pids(self) -> list[int]: ...

    async def close(self) -> None: ...


class LocalPool:
    """One fleet with every agent, on this process's event loop."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    async def call(self, method: str, *args: Any) -> Result:
        res = getattr(self.fleet, method)(*args)
        if inspect.isawaitable(res):
            res = await res
        assert isinstance(res, dict)
        return res

    @property
    def pids(self) -> list[int]:
        return []  # this process: the run counts its own CPU

    async def close(self) -> None:
        await self.fleet.stop_all()


@dataclass(frozen=True)
class WorkerSpec:
    nodes: int
    seed: int
    settings: dict[int, BrokerSettings]
    controller_key: str
    profile: Profile
    full_interval_s: float
    nice: int = 0


def worker_main(conn: Connection, spec: WorkerSpec) -> None:
    """A worker process: its own event loop and fleet, commands from ``conn``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the run stops us (its Ctrl-C is its own)
    from meshopt.bench.synthetic import raise_nofile

    raise_nofile()
    if spec.nice:
        os.nice(spec.nice)
    asyncio.run(_serve(conn, spec))


async def _serve(conn: Connection, spec: WorkerSpec) -> None:
    from meshopt.bench.synthetic import SyntheticMesh

    mesh = SyntheticMesh(spec.nodes, spec.seed)
    fleet = Fleet(
        mesh,
        spec.settings,
        spec.controller_key,
        profile=spec.profile,
        seed=spec.seed,
        full_interval_s=spec.full_interval_s,
    )
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    tasks: set[asyncio.Task[None]] = set()

    async def handle(rid: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            res = getattr(fleet, method)(*args)
            if inspect.isawaitable(res):
                res = await res
            reply: tuple[int, bool, Any] = (rid, True, res)
        except Exception as exc:  # the run reports it; the worker keeps serving
            reply = (rid, False, f"{method}: {exc!r}")
        with contextlib.suppress(OSError):
            conn.send(reply)

    def readable() -> None:
        try:
            while conn.poll():
                msg = conn.recv()
                if msg is None:
                    done.set()
                    return
                t = loop.create_task(handle(*msg))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
        except (EOFError, OSError):
            done.set()  # the run is gone: stop

    loop.add_reader(conn.fileno(), readable)
    try:
        await done.wait()
    finally:
        loop.remove_reader(conn.fileno())
        await fleet.stop_all()


class WorkerError(RuntimeError):
    """A worker process failed a command or went away."""


class ProcPool:
    """K worker processes, agent i in worker i mod K."""

    def __init__(
        self,
        mesh: SyntheticMesh,
        settings: Callable[[str], BrokerSettings],
        controller_key: str,
        k: int,
        *,
        profile: Profile = "agent",
        full_interval_s: float = 5.0,
        nice: int = 0,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.k = max(1, min(k, mesh.n))
        self._conns: list[Connection] = []
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._futures: dict[tuple[int, int], asyncio.Future[Any]] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        for w in range(self.k):
            spec = WorkerSpec(
                nodes=mesh.n,
                seed=mesh.seed,
                settings={x.index: settings(x.name) for x in mesh.nodes if x.index % self.k == w},
                controller_key=controller_key,
                profile=profile,
                full_interval_s=full_interval_s,
                nice=nice,
            )
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(child, spec), daemon=True)
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def _attach(self) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        for w, conn in enumerate(self._conns):
            self._loop.add_reader(conn.fileno(), self._readable, w)

    def _readable(self, w: int) -> None:
        conn = self._conns[w]
        try:
            while conn.poll():
                rid, ok, res = conn.recv()
                fut = self._futures.pop((w, rid), None)
                if fut is None or fut.done():
                    continue
                if ok:
                    fut.set_result(res)
                else:
                    fut.set_exception(WorkerError(f"worker {w}: {res}"))
        except (EOFError, OSError) as exc:
            assert self._loop is not None
            self._loop.remove_reader(conn.fileno())
            for (ww, _), fut in list(self._futures.items()):
                if ww == w and not fut.done():
                    fut.set_exception(WorkerError(f"worker {w} went away: {exc!r}"))

    async def call(self, method: str, *args: Any) -> Result:
        self._attach()
        assert self._loop is not None
        futs = []
        for w, conn in enumerate(self._conns):
            rid = next(self._ids)
            fut: asyncio.Future[Any] = self._loop.create_future()
            self._futures[(w, rid)] = fut
            try:
                conn.send((rid, method, args))
            except OSError as exc:
                raise WorkerError(f"worker {w} went away: {exc!r}") from exc
            futs.append(fut)
        return merge(await asyncio.gather(*futs))

    async def close(self, timeout_s: float = 15.0) -> None:
        """Ask every worker to stop its agents (wills go out), then end it by its PID."""
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        deadline = time.monotonic() + timeout_s
        for p in self._procs:
            while p.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        self.kill()

    def kill(self) -> None:
        for p in self._procs:
            if p.is_alive() and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
            p.join(5)
        if self._loop is not None:
            for conn in self._conns:
                with contextlib.suppress(OSError, ValueError):
                    self._loop.remove_reader(conn.fileno())
        for conn in self._conns:
            conn.close()
