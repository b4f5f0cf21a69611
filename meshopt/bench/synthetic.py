"""A load generator for the scale benchmark: N synthetic agents against the real parts.

Why: meshopt is measured at 6-16 nodes in the lab; what a 250- or 1000-node mesh costs
the controller and the broker is not. This runs a real mosquitto (the files ``meshopt
broker init`` writes: TLS listener, password file, ACL, and its plain unix socket), the
real controller process (``meshopt controller --config``, every synthetic node enrolled
in ``[node_keys]``), and N synthetic agents in this process (asyncio), each with its own
MQTT session (:class:`meshopt.bus.client.BusClient`, its will included), speaking the
real protocol through the agent's own code: :class:`meshopt.agent.core.AgentCore` signs
the telemetry and status (built by meshopt.agent.telemetry) and verifies the route sets
exactly as an agent does before installing them.

Values come from a generated geographic mesh (``gen:geo:n=N,seed=S``): every agent
reports every other node as a peer with that pair's RTT, jitter and loss plus noise.
What goes out when is the agent's own :class:`meshopt.agent.telemetry.Cadence`: full
snapshots (retained) at the interval that stretches with the peer count, change reports
of only the peers that moved (an injected change), an empty change report as heartbeat
every ``full_interval_s``. A real agent checks every second; a synthetic one checks when
the cadence says a snapshot or heartbeat falls due (its values move only by noise below
the change thresholds) and at once when a change is injected. Each agent's snapshot
phase is random, as for agents started at different times. Only the probing itself is
left out: the values it would measure are synthesised.

Injected changes, timed end to end (from the publish of the change's telemetry to the
signed route sets arriving at the subscribers of the nodes whose routes changed):

* ``degrade``: the direct link that carries the most routes gets a much higher RTT,
  reported by both ends;
* ``death``: a node stops (its offline status, the will, is published on the way out).
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import contextlib
import hashlib
import math
import os
import random
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from meshopt.agent.config import TelemetrySettings
from meshopt.agent.core import AgentCore, RouteState
from meshopt.agent.daemon import AGENT_KEEPALIVE_S
from meshopt.agent.telemetry import Cadence, Plan, full_due, full_interval, signed_telemetry
from meshopt.bench.fleet import (
    Fleet,
    LocalPool,
    Pool,
    ProcPool,
    Verifier,
    avoids,
    check_arrival,
    not_direct,
)
from meshopt.bus.client import BrokerSettings, BusClient
from meshopt.bus.messages import MAX_PAYLOAD_BYTES, PeerReport, RouteSet
from meshopt.bus.signing import SigningKey, public_key_b64
from meshopt.bus.topics import Topics
from meshopt.errors import MeshoptError

MESH: Final = "bench"
CONTROLLER_ID: Final = "ctl1"
FULL_INTERVAL_S: Final = 5.0  # the agent's default telemetry.full_interval_s
# Snapshots sent so far by an agent that has run a while: sizes are measured with its
# counters (probes sent, bytes) filled, as they are in steady state.
RUNNING_SENT: Final = 1000
Profile = Literal["agent", "lean"]
Transport = Literal["unix", "tls"]


class BenchError(MeshoptError):
    """The benchmark could not run (a part did not start, bad arguments)."""


# --- the mesh ------------------------------------------------------------------------------


def _seed(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


@dataclass(frozen=True)
class SyntheticNode:
    name: str
    index: int
    identity_seed: bytes  # Ed25519 seed of the node's identity (signs telemetry)
    wg_key: str  # its WireGuard public key (base64; random bytes, never used for WireGuard)
    address: str  # overlay prefix it claims

    @property
    def identity(self) -> SigningKey:
        return SigningKey(self.identity_seed)


class SyntheticMesh:
    """N nodes with a geographic RTT/jitter/loss matrix and deterministic keys."""

    def __init__(self, n: int, seed: int = 1) -> None:
        from meshopt.topology.generators import generate

        if not 2 <= n <= 5000:
            raise BenchError(f"nodes: want 2..5000, got {n}")
        topo = generate(f"gen:geo:n={n},seed={seed}")
        self.n = n
        self.seed = seed
        self.rtt_ms = topo.rtt_ms()
        self.longest_ms = max(
            (float(x) for row in self.rtt_ms for x in row if math.isfinite(float(x))),
            default=0.0,
        )
        self.jitter_ms = topo.jitter_ms
        self.loss = topo.loss
        self.nodes = [
            SyntheticNode(
                name=f"n{i:04d}",
                index=i,
                identity_seed=_seed(f"meshopt-bench-identity-{seed}-{i}"),
                wg_key=base64.b64encode(_seed(f"meshopt-bench-wg-{seed}-{i}")).decode(),
                address=f"10.{64 + (i >> 16)}.{(i >> 8) & 255}.{i & 255}/32",
            )
            for i in range(n)
        ]

    @property
    def names(self) -> list[str]:
        return [x.name for x in self.nodes]

    def node_keys_toml(self) -> str:
        """The controller's ``[node_keys]``: every node's identity key, pinned to its
        WireGuard key and address (as an operator enrols them)."""
        lines = ["[node_keys]"]
        for x in self.nodes:
            pub = public_key_b64(x.identity)
            lines.append(
                f'{x.name} = {{ key = "{pub}", wireguard = ["{x.wg_key}"],'
                f' addresses = ["{x.address}"] }}'
            )
        return "\n".join(lines) + "\n"

    def reports(
        self,
        i: int,
        rng: random.Random,
        *,
        profile: Profile = "agent",
        factor: dict[int, float] | None = None,
        sent: int = 0,
    ) -> list[PeerReport]:
        """Node ``i``'s report of every peer: the mesh's values plus noise (about 1 % on
        the smoothed RTT). ``factor`` multiplies the RTT towards some peers and adds
        100 ms plus five times the mesh's longest link, for a degraded link: then every
        two-hop path is at least 2.5 times better, whatever the geography. With only
        +100 ms a pair whose detours were long kept its degraded link for a near-tie's
        confirm time (11 % better through a relay), and the end-to-end test timed out.
        ``profile="agent"`` fills what a real agent fills;
        ``"lean"`` only what routing reads (RTT, jitter, noise, loss, samples, alive)."""
        out: list[PeerReport] = []
        factor = factor or {}
        row_rtt = self.rtt_ms[i]
        row_jit = self.jitter_ms[i]
        row_loss = self.loss[i]
        for j, peer in enumerate(self.nodes):
            if j == i:
                continue
            base = float(row_rtt[j])
            f = factor.get(j)
            if f is not None:
                base = base * f + 100.0 + 5.0 * self.longest_ms
            jit = float(row_jit[j])
            rtt = round(base * rng.gauss(1.0, 0.01) + jit * 0.5, 3)
            loss = float(row_loss[j])
            if profile == "lean":
                out.append(
                    PeerReport(
                        public_key=peer.wg_key,
                        ifname="wg0",
                        alive=True,
                        rtt_ms=rtt,
                        jitter_ms=round(jit, 3),
                        noise_ms=round(0.01 * base + 0.05, 3),
                        loss=round(loss, 4),
                        samples=64,
                    )
                )
                continue
            out.append(
                PeerReport(
                    public_key=peer.wg_key,
                    ifname="wg0",
                    endpoint=f"198.18.{(j >> 8) & 255}.{j & 255}:51820",
                    alive=True,
                    rtt_ms=rtt,
                    rtt_min_ms=round(base, 3),
                    rtt_median_ms=round(base + jit * 0.5, 3),
                    rtt_p95_ms=round(base + jit * 2.0, 3),
                    jitter_ms=round(jit, 3),
                    noise_ms=round(0.01 * base + 0.05, 3),
                    loss=round(loss, 4),
                    samples=64,
                    probes_sent=sent,
                    handshake_age_s=float(rng.randint(1, 120)),
                    rx_bytes=sent * 64,
                    tx_bytes=sent * 64,
                    rx_bps=round(rng.uniform(100.0, 400.0), 1),
                    tx_bps=round(rng.uniform(100.0, 400.0), 1),
                    # The probe budget's classes: about a tenth of the links in use.
                    probe_class="in_use" if j % 10 == 0 else "idle",
                    probe_interval_s=0.33 if j % 10 == 0 else 2.0,
                    probe_dead_after_s=0.8 if j % 10 == 0 else 4.848,
                )
            )
        return out


# --- processes -----------------------------------------------------------------------------


def raise_nofile(want: int = 65536) -> int:
    """Raise the soft RLIMIT_NOFILE (children inherit it): 1000 sessions need 1000+ fds
    here and in mosquitto. Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process ``pid`` has used, from /proc/<pid>/stat."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime, stime


def proc_rss_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of ``pid`` in MB."""
    rss = hwm = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
        elif line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) / 1024
    return rss, hwm


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_LIVE: set[Stack] = set()


def close_all() -> None:
    """Stop every stack still running (atexit, SIGTERM): nothing outlives the benchmark."""
    for stack in list(_LIVE):
        stack.close()


atexit.register(close_all)


UNIT = Path(__file__).resolve().parents[2] / "packaging/systemd/meshopt-controller.service"


def unit_nice(unit: Path = UNIT) -> int:
    """The ``Nice=`` the shipped controller unit runs it at (0 if none, or no unit: an
    installed package has no packaging directory), so the benchmark's controller gets
    the share of a busy machine a deployed one gets."""
    try:
        text = unit.read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        key, _, value = line.strip().partition("=")
        if key == "Nice":
            return int(value)
    return 0


class Stack:
    """A secured mosquitto and the real controller, in a temporary directory; both are
    stopped by their PIDs and the directory removed on :meth:`close` (also on error)."""

    def __init__(
        self,
        mesh: SyntheticMesh,
        *,
        python: str = sys.executable,
        extra: str = "",
        controller_nice: int = 0,
    ) -> None:
        """``extra``: more ``[controller]`` lines (e.g. ``lease_s = 30.0``);
        ``controller_nice``: the controller's niceness (:func:`unit_nice`)."""
        self.mesh = mesh
        self.extra = extra
        self.controller_nice = controller_nice
        self.python = python
        self.dir = Path(tempfile.mkdtemp(prefix="meshopt-scale-"))
        self.port = free_port()
        self.sock = self.dir / "mqtt.sock"
        self.pki = self.dir / "pki"
        self.broker: subprocess.Popen[bytes] | None = None
        self.controller: subprocess.Popen[bytes] | None = None
        self.controller_key = ""
        self._closed = False

    def __enter__(self) -> Stack:
        _LIVE.add(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, timeout_s: float = 30.0) -> None:
        from meshopt.broker.mosquitto import BrokerRequest, make_identities, write_broker_dir
        from meshopt.bus.signing import generate_signing_key, save_private_key

        if shutil.which("mosquitto") is None:
            raise BenchError("mosquitto is not installed (scripts/bootstrap.sh installs it)")
        req = BrokerRequest(
            mesh=MESH,
            identities=tuple(make_identities(self.mesh.names, [CONTROLLER_ID])),
            hosts=("127.0.0.1",),
            port=self.port,
            install_dir="",
            client_dir="",
            bind_address="127.0.0.1",
            unix_socket=str(self.sock),
            persistence_dir="",
            run_as=os.environ.get("USER") or "root",
            log_dest="stderr",
        )
        write_broker_dir(req, self.pki)
        log = (self.dir / "mosquitto.log").open("ab")
        self.broker = subprocess.Popen(
            ["mosquitto", "-c", str(self.pki / "broker" / "mosquitto.conf")],
            stdout=log,
            stderr=log,
        )
        log.close()
        self._wait_broker(timeout_s)
        key, self.controller_key = generate_signing_key()
        save_private_key(self.dir / "controller.key", key)
        conf = self.dir / "controller.toml"
        broker_toml = (self.pki / "clients" / CONTROLLER_ID / "broker.toml").read_text()
        conf.write_text(
            "[controller]\n"
            f'mesh = "{MESH}"\nid = "{CONTROLLER_ID}"\n'
            f'signing_key = "{self.dir / "controller.key"}"\n'
            + self.extra
            + "\n"
            + broker_toml
            + '\n[metrics]\nlisten = ""\n\n'
            + self.mesh.node_keys_toml()
        )
        clog = (self.dir / "controller.log").open("ab")
        self.controller = subprocess.Popen(
            [
                self.python,
                "-c",
                "from meshopt.cli.main import main; main()",
                *("controller", "--config", str(conf)),
            ],
            stdout=clog,
            stderr=clog,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        clog.close()
        if self.controller_nice:
            os.setpriority(os.PRIO_PROCESS, self.controller.pid, self.controller_nice)

    def _wait_broker(self, timeout_s: float) -> None:
        assert self.broker is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.broker.poll() is not None:
                raise BenchError(f"mosquitto exited: {self.log_tail('mosquitto.log')}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                if self.sock.exists():
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise BenchError(f"mosquitto not listening on 127.0.0.1:{self.port} after {timeout_s} s")

    def log_tail(self, name: str, n: int = 400) -> str:
        try:
            return (self.dir / name).read_text(errors="replace")[-n:].replace("\n", " | ")
        except OSError:
            return ""

    def check_alive(self) -> None:
        for what, p, log in (
            ("controller", self.controller, "controller.log"),
            ("mosquitto", self.broker, "mosquitto.log"),
        ):
            if p is not None and p.poll() is not None:
                raise BenchError(f"{what} exited ({p.returncode}): {self.log_tail(log)}")

    def settings(self, node: str, transport: Transport) -> BrokerSettings:
        d = self.pki / "clients" / node
        if transport == "unix":
            return BrokerSettings(
                url=f"unix://{self.sock}", username=node, password_file=str(d / "password")
            )
        return BrokerSettings(
            url=f"mqtts://127.0.0.1:{self.port}",
            ca_file=str(d / "ca.crt"),
            cert_file=str(d / "client.crt"),
            key_file=str(d / "client.key"),
            username=node,
            password_file=str(d / "password"),
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        for p in (self.controller, self.broker):
            if p is None or p.poll() is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
                p.wait(5)
        if os.environ.get("MESHOPT_BENCH_KEEP"):
            print(f"kept {self.dir}", file=sys.stderr)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)


# --- agents --------------------------------------------------------------------------------


@dataclass
class Arrival:
    at: float  # monotonic, when the handler got it (before it is verified)
    size: int
    # True once verified as an agent verifies it, False if refused; None while not
    # verified (waiting, or a newer set came first outside a timed change).
    accepted: bool | None = None
    version: int = -1
    payload: bytes = b""  # kept until verified


@dataclass
class SyntheticAgent:
    """One node: its own MQTT session, signed telemetry and status, verified route sets."""

    mesh: SyntheticMesh
    index: int
    settings: BrokerSettings
    controller_key: str
    profile: Profile = "agent"
    rng: random.Random = field(default_factory=random.Random)
    factor: dict[int, float] = field(default_factory=dict)
    bytes_up: int = 0
    messages_up: int = 0
    bytes_down: int = 0
    snapshots: int = 0
    arrivals: list[Arrival] = field(default_factory=list)
    # An injected change's test: (since, predicate on the route set); ``fixed_at`` is
    # when the first route set arriving after ``since`` passed it.
    watch: tuple[float, Callable[[RouteSet], bool]] | None = None
    fixed_at: float | None = None
    build_s: float = 0.0  # CPU time building and signing telemetry
    full_interval_s: float = FULL_INTERVAL_S  # the base interval (telemetry.full_interval_s)
    fulls: int = 0
    changes: int = 0  # change reports with peers in them
    heartbeats: int = 0  # empty change reports
    # Checks arriving route sets off the event loop (meshopt.bench.fleet); None: at once.
    verifier: Verifier | None = None

    def __post_init__(self) -> None:
        node = self.mesh.nodes[self.index]
        self.node = node
        self.tcfg = TelemetrySettings(full_interval_s=self.full_interval_s)
        self.cadence = Cadence()
        self._sent_factor: dict[int, float] = {}  # ``factor`` as of the last report sent
        self._phased = False
        self.topics = Topics(MESH)
        self.core = AgentCore(
            MESH, node.name, node.identity, [self.controller_key], RouteState(), time.time()
        )
        self.bus = BusClient(
            self.settings,
            client_id=f"meshopt-bench-{node.name}",
            will=lambda: self.core.new_session(time.time()),
            subscriptions=[self.topics.routes(node.name)],
            on_connect=self._on_connect,
            backoff_min_s=0.5,
            backoff_max_s=5.0,
            keepalive_s=AGENT_KEEPALIVE_S,  # the agent daemon's, not the bus default
        )
        self.task: asyncio.Task[None] | None = None
        self.snap_task: asyncio.Task[None] | None = None

    async def _publish(self, topic: str, payload: bytes, *, qos: int, retain: bool) -> bool:
        ok = await self.bus.publish(topic, payload, qos=qos, retain=retain)
        if ok:
            self.bytes_up += len(payload) + len(topic)
            self.messages_up += 1
        return ok

    async def _on_connect(self) -> None:
        status = self.core.online(time.time())
        await self._publish(self.topics.status(self.node.name), status, qos=1, retain=True)
        self.cadence.reset()
        await self.telemetry(full=True)

    async def _on_message(self, topic: str, payload: bytes, retained: bool) -> None:
        at = time.monotonic()
        self.bytes_down += len(payload) + len(topic)
        arrival = Arrival(at, len(payload), payload=payload)
        self.arrivals.append(arrival)
        if self.verifier is not None:
            self.verifier.submit(self, arrival)
        else:
            check_arrival(self, arrival)

    def expect(self, since: float, test: Callable[[RouteSet], bool]) -> None:
        """Time the first route set from ``since`` on that passes ``test``."""
        self.watch, self.fixed_at = (since, test), None

    def plan(self, *, full: bool = False) -> Plan | None:
        """What the agent's cadence sends now (``full``: a snapshot whatever is due).

        Values move only when a change is injected (``factor``); the 1 % noise never
        crosses the change thresholds. So while no snapshot is due and nothing was
        injected since the last send, the cadence can only answer a heartbeat or nothing,
        and that answer is given without building the 999 peer reports it would compare:
        at N = 1000 building them for every heartbeat took the whole generator.
        """
        now = time.monotonic()
        interval = full_interval(self.mesh.n - 1, self.tcfg)
        if (
            not full
            and self.factor == self._sent_factor
            and self.cadence.last_published
            and not full_due(now, self.cadence.last_full, interval, self.tcfg)
        ):
            beat = self.tcfg.full_interval_s - self.tcfg.check_interval_s / 2
            return Plan(False, [], interval) if now - self.cadence.last_sent >= beat else None
        self.snapshots += 1
        peers = self.mesh.reports(
            self.index, self.rng, profile=self.profile, factor=self.factor, sent=self.snapshots
        )
        if full:
            self.cadence.reset()
        return self.cadence.plan({p.public_key: p for p in peers}, time.monotonic(), self.tcfg)

    async def telemetry(self, *, full: bool = False) -> bool:
        """One check of the agent's cadence: build, sign and publish what is due (full
        snapshots retained, as the agent does); False when nothing was due or sent."""
        t0 = time.process_time()
        plan = self.plan(full=full)
        if plan is None:
            self.build_s += time.process_time() - t0
            return False
        msg = signed_telemetry(
            self.core,
            time.time(),
            public_keys=[self.node.wg_key],
            addresses=[self.node.address],
            plan=plan,
            counters={},
        )
        self.build_s += time.process_time() - t0
        now = time.monotonic()
        ok = await self._publish(
            self.topics.telemetry(self.node.name), msg, qos=0, retain=plan.full
        )
        if ok:
            self.cadence.sent(plan, now)
            if plan.full or plan.peers:
                self._sent_factor = dict(self.factor)
            if plan.full:
                self.fulls += 1
                if not self._phased:
                    # Agents start at different times: a random snapshot phase.
                    self._phased = True
                    self.cadence.last_full -= self.rng.uniform(0.0, plan.interval_s)
            elif plan.peers:
                self.changes += 1
            else:
                self.heartbeats += 1
        return ok

    async def _snapshots(self) -> None:
        await asyncio.sleep(self.rng.uniform(0.0, self.full_interval_s))
        peers = self.mesh.n - 1
        while True:
            if self.bus.connected:
                await self.telemetry()
            # Values move only when a change is injected (which checks at once), so the
            # next check is when the cadence says something falls due; a real agent gets
            # there by checking every second.
            due = self.cadence.next_due(peers, self.tcfg) - time.monotonic()
            if due <= 0.0:
                # Still due right after a check: the publish failed (or the session is
                # down). Retry at the next check, as the agent does. Retrying at once
                # had each agent rebuild a 1000-peer snapshot every 50 ms, and at
                # N = 1000 the generator collapsed (every session timed out).
                due = self.tcfg.check_interval_s
            await asyncio.sleep(min(max(due, 0.05), self.full_interval_s))

    def start(self) -> None:
        self.task = asyncio.create_task(self.bus.run(self._on_message))
        self.snap_task = asyncio.create_task(self._snapshots())

    async def stop(self) -> None:
        """A clean stop: BusClient publishes the will (offline status) and disconnects."""
        for t in (self.snap_task, self.task):
            if t is not None and not t.done():
                t.cancel()
                # Bounded: a stop stuck in the MQTT client's teardown (seen twice in ten
                # 250-node runs) must not hang the benchmark; its fan-out is still timed.
                done, _ = await asyncio.wait([t], timeout=STOP_TIMEOUT_S)
                if not done:
                    progress(
                        f"agent {self.node.name}: stop still pending after "
                        f"{STOP_TIMEOUT_S:g} s; going on"
                    )
                    continue
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t

    @property
    def running(self) -> bool:
        """Started and not stopped: its session can still receive route sets."""
        return self.task is not None and not self.task.done()

    @property
    def has_routes(self) -> bool:
        return self.core.route_set is not None

    def accepted_after(self, t0: float) -> Arrival | None:
        for a in self.arrivals:
            if a.at >= t0 and a.accepted:
                return a
        return None


# --- one run -------------------------------------------------------------------------------

STOP_TIMEOUT_S: Final = 10.0


@dataclass(frozen=True)
class RunSettings:
    nodes: int
    seed: int = 1
    profile: Profile = "agent"
    transport: Transport = "unix"
    steady_s: float = 20.0
    routes_timeout_s: float = 120.0
    change_window_s: float = 20.0  # longest wait for route sets after a change
    quiet_s: float = 3.0  # a change's fan-out is over after this long without a route set
    connect_batch: int = 50
    lease_s: float | None = None  # the controller's lease_s; None: its default (3 s)
    # The agents' base telemetry interval (full_interval_s: heartbeats, and snapshots up
    # to 30 peers); anything but 5 s also sets the controller's stale_after_s to 3x it.
    full_interval_s: float = FULL_INTERVAL_S
    # Worker processes for the agents (each its own event loop and a share of the
    # agents); 0: every agent on this process's loop.
    generator_procs: int = 0
    # The worker processes' niceness: they stand for a thousand machines of their own,
    # and on the benchmark's two cores their route-set checks (3.8 ms a 1000-node set)
    # took a core from the controller while it signed the sets after a dead relay.
    generator_nice: int = 10
    # The controller's niceness; None: what the shipped systemd unit gives it.
    controller_nice: int | None = None
    # Also degrade a link and kill a node right after the first routes, inside the
    # controller's start-up minute (``startup_degrade``/``startup_death``), before the
    # steady window; the changes after it are timed as always.
    startup_changes: bool = False


def progress(text: str) -> None:
    """One line on stderr per phase (runs take minutes; stdout is the JSON)."""
    print(f"#   {time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))
    return s[k]


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


class _Sampler:
    """CPU of the controller, the broker and the load generator (this process and its
    worker processes) over a window."""

    def __init__(self, stack: Stack, workers: Sequence[int] = ()) -> None:
        assert stack.controller is not None and stack.broker is not None
        self.pids = {"controller": stack.controller.pid, "broker": stack.broker.pid}
        self.workers = list(workers)
        self.start()

    def _workers_cpu(self) -> float:
        total = 0.0
        for pid in self.workers:
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += proc_cpu_s(pid)
        return total

    def start(self) -> None:
        self.t = time.monotonic()
        self.cpu = {k: proc_cpu_s(p) for k, p in self.pids.items()}
        self.own = time.process_time() + self._workers_cpu()

    def shares(self) -> dict[str, float]:
        dt = max(time.monotonic() - self.t, 1e-9)
        out = {
            f"{k}_cpu_pct": 100 * (proc_cpu_s(p) - self.cpu[k]) / dt for k, p in self.pids.items()
        }
        out["generator_cpu_pct"] = 100 * (time.process_time() + self._workers_cpu() - self.own) / dt
        return {k: round(v, 2) for k, v in out.items()}


async def _fan_out(pool: Pool, t0: float, s: RunSettings, skip: int = -1) -> dict[str, Any]:
    """Wait until route sets stop arriving after ``t0``; latency per node that got one."""
    deadline = t0 + s.change_window_s
    last_count = -1
    last_change = time.monotonic()
    while time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        st = await pool.call("fan_status", t0, skip)
        count, pending = int(st["count"]), bool(st["pending"])
        if count != last_count:
            last_count, last_change = count, time.monotonic()
        elif count and not pending and time.monotonic() - last_change >= s.quiet_s:
            break
    res = await pool.call("fan_result", t0, skip)
    lat: list[float] = res["lat"]
    sizes: list[int] = res["sizes"]
    fixed: list[float] = res["fixed"]
    return {
        "affected_nodes": int(res["watched"]),
        "affected_fixed": len(fixed),
        "affected_latency_median_s": _r(statistics.median(fixed) if fixed else None),
        "affected_latency_p95_s": _r(_pct(fixed, 0.95)),
        "affected_latency_max_s": _r(max(fixed) if fixed else None),
        "nodes_updated": len(lat),
        "latency_median_s": _r(statistics.median(lat) if lat else None),
        "latency_p95_s": _r(_pct(lat, 0.95)),
        "latency_max_s": _r(max(lat) if lat else None),
        "latency_first_s": _r(min(lat) if lat else None),
        "route_set_bytes_median": int(statistics.median(sizes)) if sizes else None,
    }


# The route-set tests, kept under their old names for callers.
_not_direct = not_direct
_avoids = avoids


async def _busiest_direct_link(pool: Pool, exclude: Sequence[int] = ()) -> tuple[int, int] | None:
    """(a, b): a direct link a->b that a's route set uses for b itself and the most
    other destinations (so degrading it must move routes); none touching ``exclude``."""
    cands: list[list[int]] = (await pool.call("busiest", list(exclude)))["candidates"]
    if not cands:
        return None
    best = max(cands, key=lambda c: (c[0], -c[1]))
    return best[1], best[2]


async def _changes(
    pool: Pool, s: RunSettings, mesh: SyntheticMesh, exclude: Sequence[int] = ()
) -> tuple[dict[str, Any], dict[str, Any], int | None]:
    """A link degrades (both ends report it at once), then a node dies (its offline
    status, the will, goes out as it leaves): each timed from its publish to the signed
    route sets at the subscribers. Returns both results and the dead node's index."""
    link = await _busiest_direct_link(pool, exclude)
    if link is None:
        skipped = {"skipped": "no node has a route set to pick a link from"}
        return skipped, {"skipped": "no routes"}, None
    ia, ib = link
    t0 = time.monotonic()
    await pool.call("degrade", ia, ib, t0)
    res = await _fan_out(pool, t0, s)
    degrade = {"link": [mesh.nodes[ia].name, mesh.nodes[ib].name], **res}
    await pool.call("clear")
    progress("killing a node")
    victim = ib
    await asyncio.sleep(1.0)
    t0 = time.monotonic()
    await pool.call("expect_avoid", victim, t0)
    await pool.call("stop_agent", victim)
    res = await _fan_out(pool, t0, s, skip=victim)
    await pool.call("clear")
    return degrade, {"node": mesh.nodes[victim].name, **res}, victim


async def run_once(s: RunSettings) -> dict[str, Any]:
    """One full run: start the stack and the agents, wait for routes, a steady window,
    a degraded link, a dead node; the figures as a JSON-able dict."""
    nofile = raise_nofile()
    mesh = SyntheticMesh(s.nodes, s.seed)
    t_setup = time.monotonic()
    extra = f"lease_s = {s.lease_s}\n" if s.lease_s is not None else ""
    if s.full_interval_s != FULL_INTERVAL_S:
        extra += f"stale_after_s = {3 * s.full_interval_s}\n"
    cnice = unit_nice() if s.controller_nice is None else s.controller_nice
    with Stack(mesh, extra=extra, controller_nice=cnice) as stack:
        stack.start()
        pool: Pool
        if s.generator_procs > 0:
            procs = ProcPool(
                mesh,
                lambda name: stack.settings(name, s.transport),
                stack.controller_key,
                s.generator_procs,
                profile=s.profile,
                full_interval_s=s.full_interval_s,
                nice=s.generator_nice,
            )
            _POOLS.add(procs)
            pool = procs
        else:
            pool = LocalPool(
                Fleet(
                    mesh,
                    {x.index: stack.settings(x.name, s.transport) for x in mesh.nodes},
                    stack.controller_key,
                    profile=s.profile,
                    seed=s.seed,
                    full_interval_s=s.full_interval_s,
                )
            )
        try:
            await pool.call("ping")
            setup_s = time.monotonic() - t_setup
            return await _run(stack, mesh, pool, s, setup_s, nofile)
        finally:
            await pool.close()
            if isinstance(pool, ProcPool):
                _POOLS.discard(pool)


_POOLS: set[ProcPool] = set()


def _kill_pools() -> None:
    """Worker processes left by an interrupted run: ended by their PIDs."""
    for p in list(_POOLS):
        p.kill()


atexit.register(_kill_pools)


async def _run(
    stack: Stack,
    mesh: SyntheticMesh,
    pool: Pool,
    s: RunSettings,
    setup_s: float,
    nofile: int,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "nodes": s.nodes,
        "profile": s.profile,
        "agent_transport": s.transport,
        "controller_lease_s": s.lease_s,
        "full_interval_s": s.full_interval_s,
        "generator_procs": s.generator_procs,
        "generator_nice": s.generator_nice if s.generator_procs else None,
        "controller_nice": stack.controller_nice,
        "setup_s": round(setup_s, 2),
        "rlimit_nofile": nofile,
        "pids": {
            "controller": stack.controller.pid if stack.controller else None,
            "broker": stack.broker.pid if stack.broker else None,
        },
    }
    n = mesh.n
    t_start = time.monotonic()
    for k in range(0, n, s.connect_batch):
        await pool.call("connect", list(range(k, min(n, k + s.connect_batch))))
        stack.check_alive()
    out["connected"] = int((await pool.call("status"))["connected"])
    progress(f"{out['connected']}/{n} agents connected")
    out["connect_s"] = round(time.monotonic() - t_start, 2)

    # First routes: every node has a verified route set (or the time runs out).
    deadline = time.monotonic() + s.routes_timeout_s
    with_routes = 0
    last_report = time.monotonic()
    while time.monotonic() < deadline:
        with_routes = int((await pool.call("status"))["with_routes"])
        if with_routes == n:
            break
        if time.monotonic() - last_report >= 30.0:
            last_report = time.monotonic()
            progress(f"{with_routes}/{n} nodes hold route sets")
        await asyncio.sleep(0.2)
        stack.check_alive()
    out["nodes_with_routes"] = with_routes
    out["first_routes_s"] = round(time.monotonic() - t_start, 2) if with_routes else None
    progress(f"{with_routes}/{n} nodes hold route sets")

    dead: list[int] = []
    if s.startup_changes:
        # The same two changes inside the controller's start-up minute.
        await asyncio.sleep(2.0)
        progress("start-up changes: degrading a link")
        deg, death, victim = await _changes(pool, s, mesh)
        out["startup_degrade"], out["startup_death"] = deg, death
        out["startup_changes_at_s"] = round(time.monotonic() - t_start, 2)
        if victim is not None:
            dead.append(victim)
        stack.check_alive()

    # Steady window: no injected change.
    await asyncio.sleep(2.0)
    sampler = _Sampler(stack, pool.pids)
    t_window = time.monotonic()
    st0 = await pool.call("stats", t_window)
    await asyncio.sleep(s.steady_s)
    stack.check_alive()
    st1 = await pool.call("stats", t_window)
    dt = s.steady_s
    steady: dict[str, Any] = dict(sampler.shares())
    live = n - len(dead)
    steady["agent_up_bytes_per_s"] = round((st1["bytes_up"] - st0["bytes_up"]) / dt / live, 1)
    steady["agent_down_bytes_per_s"] = round((st1["bytes_down"] - st0["bytes_down"]) / dt / live, 1)
    steady["route_sets_per_s"] = round((st1["route_sets"] - st0["route_sets"]) / dt, 2)
    steady["telemetry_msgs_per_s"] = round((st1["messages_up"] - st0["messages_up"]) / dt, 1)
    steady["agent_full_interval_s"] = round(
        full_interval(n - 1, TelemetrySettings(full_interval_s=s.full_interval_s)), 1
    )
    steady["telemetry_kinds"] = {
        "full": st1["fulls"] - st0["fulls"],
        "change": st1["changes"] - st0["changes"],
        "heartbeat": st1["heartbeats"] - st0["heartbeats"],
    }
    steady["agent_reconnects"] = st1["reconnects"] - st0["reconnects"]
    ctl_pid = stack.controller.pid if stack.controller else 0
    rss, hwm = proc_rss_mb(ctl_pid)
    steady["controller_rss_mb"] = round(rss, 1)
    steady["controller_rss_peak_mb"] = round(hwm, 1)
    b_rss, _ = proc_rss_mb(stack.broker.pid if stack.broker else 0)
    steady["broker_rss_mb"] = round(b_rss, 1)
    steady["generator_loop_lag_p95_s"] = _r(_pct(st1["lags"], 0.95))
    out["steady"] = steady
    sz = await pool.call("sizes")
    last_sizes: list[int] = sz["last_sizes"]
    routes: list[int] = sz["routes"]
    out["route_set_bytes_median"] = int(statistics.median(last_sizes)) if last_sizes else None
    out["route_set_bytes_max"] = max(last_sizes) if last_sizes else None
    out["routes_per_set_median"] = int(statistics.median(routes)) if routes else None
    probe = SyntheticAgent(mesh, 0, BrokerSettings(), stack.controller_key, s.profile)
    out["telemetry_snapshot_bytes"] = _snapshot_bytes(probe)
    out["telemetry_heartbeat_bytes"] = _snapshot_bytes(probe, full=False)
    out["max_payload_bytes"] = MAX_PAYLOAD_BYTES

    progress("steady window done; degrading a link")
    deg, death, _ = await _changes(pool, s, mesh, exclude=dead)
    out["degrade"], out["death"] = deg, death
    out["changes_at_s"] = round(time.monotonic() - t_start, 2)
    stack.check_alive()
    st = await pool.call("stats")
    out["generator_loop_lag_p95_s"] = _r(_pct(st["lags"], 0.95))
    out["generator_loop_lag_max_s"] = _r(max(st["lags"]) if st["lags"] else None)
    out["agent_reconnects"] = st["reconnects"]
    out["route_sets_verified"] = st["verified"]
    out["route_sets_superseded"] = st["superseded"]
    out["verify_ms_per_set"] = _r(1e3 * st["verify_cpu_s"] / max(st["verified"], 1))
    out["agent_refused"] = st["refused"]
    out["controller_log_tail"] = _controller_problems(stack)
    out["broker_keepalive_timeouts"] = _timeouts(stack)
    progress("run done; stopping")
    return out


def _timeouts(stack: Stack) -> dict[str, int]:
    """Clients the broker disconnected for silence longer than 1.5 x keepalive (a
    blocked event loop): the controller's and the agents'; and how often the broker
    began dropping messages to a client that read too slowly (its queue full; mosquitto
    logs each start of a run of drops): ``controller_dropping``, ``agents_dropping``."""
    out = {"controller": 0, "agents": 0, "controller_dropping": 0, "agents_dropping": 0}
    try:
        text = (stack.dir / "mosquitto.log").read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        who = "controller" if "meshopt-controller" in line else "agents"
        if "exceeded timeout" in line:
            out[who] += 1
        elif "messages are being dropped" in line:
            out[f"{who}_dropping"] += 1
    return out


def _snapshot_bytes(agent: SyntheticAgent, full: bool = True) -> int:
    """Size of one full snapshot (or an empty change report) as published, signed."""
    peers = agent.mesh.reports(
        agent.index, random.Random(0), profile=agent.profile, sent=RUNNING_SENT
    )
    plan = Plan(full, peers if full else [], full_interval(len(peers), agent.tcfg))
    msg = signed_telemetry(
        AgentCore(MESH, agent.node.name, agent.node.identity, [], RouteState(), time.time()),
        time.time(),
        public_keys=[agent.node.wg_key],
        addresses=[agent.node.address],
        plan=plan,
        counters={},
    )
    return len(msg)


def _merge(counts: Sequence[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return out


def _controller_problems(stack: Stack) -> list[str]:
    """The controller's warnings about dropped input (e.g. too_large telemetry)."""
    try:
        lines = (stack.dir / "controller.log").read_text(errors="replace").splitlines()
    except OSError:
        return []
    keep = [x for x in lines if "WARNING" in x or "Traceback" in x or "ERROR" in x]
    return [x[-300:] for x in keep[-8:]]


def generator_check_cost(mesh: SyntheticMesh, rounds: int = 20) -> dict[str, Any]:
    """CPU of one synthetic agent's cadence check when only a heartbeat is due (what
    the load generator spends per agent every ``full_interval_s``): as it runs now
    (no reports built while nothing was injected), and building every peer's report as
    the generator did before (``built_ms``), medians of ``rounds``; and the share of a
    core that is for all N agents."""
    from meshopt.bus.signing import generate_signing_key

    ctl = public_key_b64(generate_signing_key()[0])
    ag = SyntheticAgent(mesh, 0, BrokerSettings(), ctl, rng=random.Random(mesh.seed))
    first = ag.plan(full=True)
    assert first is not None
    ag.cadence.sent(first, time.monotonic())
    ag._sent_factor = dict(ag.factor)
    ag.cadence.last_full = time.monotonic() + 3600.0  # a snapshot is not due

    def check(build: bool) -> float:
        ag.cadence.last_sent = -math.inf  # the heartbeat is due
        ag._sent_factor = {-1: 0.0} if build else dict(ag.factor)
        t0 = time.process_time()
        plan = ag.plan()
        spent = time.process_time() - t0
        assert plan is not None and not plan.full and not plan.peers
        return spent

    now_s = statistics.median(check(False) for _ in range(rounds))
    built_s = statistics.median(check(True) for _ in range(rounds))
    per_s = mesh.n / FULL_INTERVAL_S  # heartbeat checks per second, all agents
    return {
        "check_ms": round(1e3 * now_s, 4),
        "built_ms": round(1e3 * built_s, 3),
        "core_share_pct": round(100 * now_s * per_s, 3),
        "core_share_pct_built": round(100 * built_s * per_s, 1),
    }


def ingest_cost(mesh: SyntheticMesh, profile: Profile = "agent", rounds: int = 2) -> dict[str, Any]:
    """CPU of the controller's own code (ControllerCore.on_message) per message, in this
    process, signatures checked: full snapshots (every node's, ``rounds`` times), change
    reports of one peer and empty ones (heartbeats). Also what reading a node's peer rows
    costs once per snapshot (the view builds them on first read, for the recompute), and
    one ``matrices`` of the whole view. The share of a core is at the agents' cadence:
    a snapshot per :func:`full_interval`, a heartbeat per ``full_interval_s``."""
    from meshopt.bus.signing import generate_signing_key
    from meshopt.controller.config import ControllerConfig, Enrolment
    from meshopt.controller.core import ControllerCore

    key, _ = generate_signing_key()
    cfg = ControllerConfig(
        mesh=MESH,
        id=CONTROLLER_ID,
        signing_key="/unused",
        node_keys=tuple(Enrolment(x.name, public_key_b64(x.identity)) for x in mesh.nodes),
    )
    core = ControllerCore(cfg, key)
    topics = Topics(MESH)
    agents = [
        AgentCore(MESH, x.name, x.identity, [], RouteState(), time.time()) for x in mesh.nodes
    ]
    tcfg = TelemetrySettings()
    interval = full_interval(mesh.n - 1, tcfg)
    rng = random.Random(mesh.seed)
    spent = {"full": 0.0, "change": 0.0, "heartbeat": 0.0, "rows": 0.0}
    count = {"full": 0, "change": 0, "heartbeat": 0}
    sizes: dict[str, int] = {}
    view = core.view
    for _ in range(rounds):
        for x, ag in zip(mesh.nodes, agents, strict=True):
            peers = mesh.reports(x.index, rng, profile=profile, sent=RUNNING_SENT)
            for kind, plan in (
                ("full", Plan(True, peers, interval)),
                ("change", Plan(False, peers[:1], interval)),
                ("heartbeat", Plan(False, [], interval)),
            ):
                msg = signed_telemetry(
                    ag,
                    time.time(),
                    public_keys=[x.wg_key],
                    addresses=[x.address],
                    plan=plan,
                    counters={},
                )
                sizes[kind] = max(sizes.get(kind, 0), len(msg))
                t0 = time.process_time()
                core.on_message(topics.telemetry(x.name), msg, False, time.monotonic(), time.time())
                spent[kind] += time.process_time() - t0
                count[kind] += 1
                if kind == "full":
                    t0 = time.process_time()
                    info = view.nodes.get(x.name)
                    if info is not None:
                        info.peers  # noqa: B018 - build the rows, as the recompute does
                    spent["rows"] += time.process_time() - t0
    t0 = time.process_time()
    view.matrices(time.monotonic())
    matrices_ms = 1000 * (time.process_time() - t0)
    per = {k: 1000 * spent[k] / max(count.get(k, count["full"]), 1) for k in spent}
    per["rows"] = 1000 * spent["rows"] / max(count["full"], 1)
    share = mesh.n * (per["full"] / interval + per["heartbeat"] / tcfg.full_interval_s) / 10
    return {
        "ingest_ms_per_snapshot": round(per["full"], 3),
        "ingest_ms_per_change": round(per["change"], 3),
        "ingest_ms_per_heartbeat": round(per["heartbeat"], 3),
        "rows_ms_per_snapshot": round(per["rows"], 3),
        "matrices_ms": round(matrices_ms, 1),
        "full_interval_s": round(interval, 1),
        "ingest_cpu_pct": round(share, 2),
        "snapshot_bytes": sizes["full"],
        "change_bytes": sizes["change"],
        "heartbeat_bytes": sizes["heartbeat"],
        "refused": core.dropped(),
    }
