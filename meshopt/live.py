"""What a live mesh is doing, read from its broker: installed routes, paths, measured RTTs.

The broker already holds everything ``meshopt routes``/``path``/``graph`` need, retained:
every node's signed route set, its last full telemetry snapshot and its status, and the
controller's lease. :func:`read_bus` collects those with one short MQTT session;
:func:`assemble` (pure, tested without a broker) decodes them into a :class:`LiveView`,
skipping garbage with a warning line, and the view answers the questions by following the
route sets hop by hop, as the nodes forward, with the RTTs the nodes themselves measured.

Next hops in a route set are WireGuard public keys and destinations are prefixes; both are
mapped to node names through the nodes' own telemetry (``public_keys``, ``addresses``), the
same way the controller matches peer reports to nodes.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import math
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

import aiomqtt
import msgspec
import numpy as np

from meshopt.bus.client import BrokerLike, BrokerSettings, client_kwargs, parse_broker
from meshopt.bus.messages import (
    AgentStatus,
    BusMessageError,
    Lease,
    PeerReport,
    RouteSet,
    Telemetry,
    decode_lease,
    decode_route_set,
    decode_status,
    decode_telemetry,
)
from meshopt.bus.signing import PublicKeyLike, unsigned_payload, verify_route_set
from meshopt.bus.topics import ROOT, Topics, is_valid_name
from meshopt.errors import MeshoptError, UnavailableError
from meshopt.topology.model import FloatMatrix, Node, Topology

QUIET_S: Final = 0.5  # retained messages arrive at once; this much silence ends them
TIMEOUT_S: Final = 5.0
UNREACHABLE: Final = "?"  # ends a path at a loop, a dead end or an unknown next hop

BusMessage = tuple[str, bytes]  # topic, payload


class LiveError(MeshoptError):
    """The broker cannot be read, or holds nothing usable for the mesh asked for."""


class MeshUnavailable(LiveError, UnavailableError):
    """The broker cannot be reached, or no controller publishes there: exit status 3."""


# --- the assembled view ---------------------------------------------------------------


@dataclass(frozen=True)
class Hop:
    src: str
    dst: str
    rtt_ms: float | None  # as measured by src (by dst if src has no figure); None: unknown
    # How src probes the tunnel to dst (its telemetry; None: not reported): "in_use" or
    # "idle", the time between probes and after how long without a reply it is dead.
    probe_class: str | None = None
    probe_interval_s: float | None = None
    probe_dead_after_s: float | None = None


@dataclass
class LivePath:
    """How packets from ``src`` to ``dst`` travel now, as each node's route set says."""

    src: str
    dst: str
    table: str
    hops: list[Hop]
    complete: bool  # False: a hop had no route, an unknown next hop or a loop
    direct_rtt_ms: float | None  # src's measurement of its direct tunnel to dst
    since: float | None  # newest issued_at of the route sets along the path
    problem: str = ""

    @property
    def nodes(self) -> list[str]:
        return [self.src, *[h.dst for h in self.hops]]

    @property
    def relays(self) -> list[str]:
        return [h.dst for h in self.hops[:-1]] if self.complete else []

    @property
    def rtt_ms(self) -> float | None:
        """Sum of the hops' measured RTTs; None when the path is broken or a hop unmeasured."""
        if not self.complete or any(h.rtt_ms is None for h in self.hops):
            return None
        return sum(h.rtt_ms for h in self.hops if h.rtt_ms is not None)

    @property
    def gain_ms(self) -> float | None:
        rtt = self.rtt_ms
        if rtt is None or self.direct_rtt_ms is None:
            return None
        return self.direct_rtt_ms - rtt


@dataclass
class LiveRoute:
    """One installed route of a node, with names and measurements attached."""

    dst: str  # node name, or the prefix when no node announces it
    prefix: str
    table: str
    next_hop: str  # node name, or "key XXXXXXXX…" when no node announces that key
    backup: str | None
    path: list[str]  # hop by hop through the route sets; ends in "?" when broken
    rtt_ms: float | None  # sum of the measured per-hop RTTs along ``path``
    direct_rtt_ms: float | None

    @property
    def relayed(self) -> bool:
        return self.next_hop != self.dst


@dataclass
class NodeRoutes:
    node: str
    online: bool | None  # the agent's retained status; None: no status seen
    version: int
    issued_at: float
    controller: str
    term: int
    verified: bool | None  # None: not checked (no --controller-key)
    routes: list[LiveRoute]


@dataclass
class LiveView:
    """Everything read for one mesh; the methods answer from it (pure)."""

    mesh: str
    broker: str = ""
    telemetry: dict[str, Telemetry] = field(default_factory=dict)
    status: dict[str, AgentStatus] = field(default_factory=dict)
    route_sets: dict[str, RouteSet] = field(default_factory=dict)
    verified: dict[str, bool | None] = field(default_factory=dict)
    lease: Lease | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def nodes(self) -> list[str]:
        return sorted(set(self.telemetry) | set(self.status) | set(self.route_sets))

    def node_of_key(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for name, t in self.telemetry.items():
            for key in [t.public_key, *t.public_keys]:
                out.setdefault(key, name)
        return out

    def node_of_prefix(self) -> dict[str, str]:
        return {str(_net(a)): name for name, t in self.telemetry.items() for a in t.addresses}

    def _peer(self, src: str, dst: str) -> PeerReport | None:
        t, d = self.telemetry.get(src), self.telemetry.get(dst)
        if t is None or d is None:
            return None
        keys = {d.public_key, *d.public_keys}
        return next((p for p in t.reports() if p.public_key in keys), None)

    def measured_rtt(self, src: str, dst: str) -> float | None:
        """RTT of the tunnel src-dst as src measured it (smoothed), None if not measured."""
        p = self._peer(src, dst)
        if p is None or p.alive is False:
            return None
        return p.rtt_ms if p.rtt_ms is not None else p.rtt_median_ms

    def hop(self, src: str, dst: str) -> Hop:
        """The tunnel src -> dst: its RTT and how src probes it."""
        p = self._peer(src, dst)
        return Hop(
            src,
            dst,
            self.hop_rtt(src, dst),
            probe_class=None if p is None else p.probe_class,
            probe_interval_s=None if p is None else p.probe_interval_s,
            probe_dead_after_s=None if p is None else p.probe_dead_after_s,
        )

    def hop_rtt(self, src: str, dst: str) -> float | None:
        rtt = self.measured_rtt(src, dst)
        return rtt if rtt is not None else self.measured_rtt(dst, src)

    def next_hop(self, node: str, dst: str, table: str = "fast") -> str | None:
        """The node ``node`` forwards ``dst``'s traffic to (by its route set), or None."""
        rs = self.route_sets.get(node)
        t = self.telemetry.get(dst)
        if rs is None or t is None:
            return None
        wanted = {str(_net(a)) for a in t.addresses}
        owner = self.node_of_key()
        for r in rs.routes:
            if r.table == table and str(_net(r.dst)) in wanted:
                return owner.get(r.via, _key_label(r.via))
        return None

    def path(self, src: str, dst: str, table: str = "fast") -> LivePath:
        nodes = [src]
        problem = ""
        while nodes[-1] != dst:
            here = nodes[-1]
            nxt = self.next_hop(here, dst, table)
            if nxt is None and table != "fast":
                nxt = self.next_hop(here, dst, "fast")
            if nxt is None:
                problem = (
                    f"{here} has no route set"
                    if here not in self.route_sets
                    else f"{here} has no route to {dst}"
                )
            elif nxt not in self.telemetry and nxt != dst:
                problem = f"{here} forwards to {nxt}, which is not a known node"
            elif nxt in nodes:
                problem = f"loop: {here} forwards back to {nxt}"
            if problem:
                break
            assert nxt is not None
            nodes.append(nxt)
        hops = [self.hop(a, b) for a, b in itertools.pairwise(nodes)]
        if problem:
            hops.append(Hop(nodes[-1], UNREACHABLE, None))
        issued = [self.route_sets[n].issued_at for n in nodes[:-1] if n in self.route_sets]
        if problem and nodes[-1] in self.route_sets:
            issued.append(self.route_sets[nodes[-1]].issued_at)
        return LivePath(
            src=src,
            dst=dst,
            table=table,
            hops=hops,
            complete=not problem,
            direct_rtt_ms=self.measured_rtt(src, dst),
            since=max(issued) if issued else None,
            problem=problem,
        )

    def routes(self, node: str) -> NodeRoutes | None:
        """``node``'s installed route set with names and RTTs; None if it has none."""
        rs = self.route_sets.get(node)
        if rs is None:
            return None
        owner = self.node_of_key()
        by_prefix = self.node_of_prefix()
        out: list[LiveRoute] = []
        for r in rs.routes:
            prefix = str(_net(r.dst))
            dst = by_prefix.get(prefix)
            if dst is not None:
                p = self.path(node, dst, r.table)
                path, rtt = p.nodes, p.rtt_ms
            else:
                path, rtt = [], None
            out.append(
                LiveRoute(
                    dst=dst or prefix,
                    prefix=r.dst,
                    table=r.table,
                    next_hop=owner.get(r.via, _key_label(r.via)),
                    backup=None if r.backup is None else owner.get(r.backup, _key_label(r.backup)),
                    path=path,
                    rtt_ms=rtt,
                    direct_rtt_ms=None if dst is None else self.measured_rtt(node, dst),
                )
            )
        out.sort(key=lambda e: (e.table != "fast", _natural(e.dst), e.prefix))
        st = self.status.get(node)
        return NodeRoutes(
            node=node,
            online=None if st is None else st.online,
            version=rs.version,
            issued_at=rs.issued_at,
            controller=rs.controller,
            term=rs.term,
            verified=self.verified.get(node),
            routes=out,
        )

    def relay_paths(self) -> list[list[str]]:
        """Every relayed path (fast table) of the mesh; a path whose way back is the same
        nodes reversed is listed once, from the node that sorts first."""
        names = sorted(self.telemetry, key=_natural)
        seen: set[tuple[str, ...]] = set()
        out: list[list[str]] = []
        for a, b in itertools.permutations(names, 2):
            p = self.path(a, b)
            if not p.complete or len(p.nodes) < 3:
                continue
            key = tuple(p.nodes)
            if tuple(reversed(key)) in seen:
                continue
            seen.add(key)
            out.append(p.nodes)
        return out

    def picture_inputs(self) -> tuple[Topology, FloatMatrix]:
        """A Topology of the nodes that report telemetry (tunnels where either end measured
        the other; delay = half the measured RTT) and the RTT labels as each end measured."""
        names = sorted(self.telemetry, key=_natural)
        n = len(names)
        labels = np.full((n, n), np.nan)
        tunnels = np.zeros((n, n), dtype=bool)
        for i, a in enumerate(names):
            for j, b in enumerate(names):
                if i == j:
                    continue
                if self._peer(a, b) is not None:
                    tunnels[i, j] = tunnels[j, i] = True
                measured = self.measured_rtt(a, b)
                if measured is not None:
                    labels[i, j] = measured
        both = np.where(np.isnan(labels), labels.T, labels)
        rtt = np.where(np.isnan(both.T), both, (both + both.T) / 2)
        delay = np.where(np.isnan(rtt), np.inf, rtt / 2)
        nodes = [Node(name, address=_host(self.telemetry[name].addresses)) for name in names]
        topo = Topology.from_matrices(
            self.mesh, nodes, delay, source=f"{self.broker or 'broker'} (measured)", tunnels=tunnels
        )
        return topo, labels


def _net(prefix: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    return ipaddress.ip_network(prefix, strict=False)


def _host(addresses: Sequence[str]) -> str | None:
    for a in addresses:
        net = _net(a)
        if net.num_addresses == 1:
            return str(net.network_address)
    return None


def _key_label(key: str) -> str:
    return f"key {key[:8]}…"


def _natural(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that puts n2 before n10."""
    parts = [p for p in re.split(r"(\d+)", name) if p]
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in parts)


# --- decoding what was read -----------------------------------------------------------


def meshes_seen(messages: Iterable[BusMessage]) -> list[str]:
    """Names of the meshes that have any topic on the broker."""
    found = set()
    for topic, _ in messages:
        parts = topic.split("/")
        if len(parts) >= 3 and parts[0] == ROOT and is_valid_name(parts[1]):
            found.add(parts[1])
    return sorted(found)


def assemble(
    mesh: str,
    messages: Iterable[BusMessage],
    *,
    trusted_keys: Sequence[PublicKeyLike] = (),
    broker: str = "",
) -> LiveView:
    """Decode the messages of ``mesh`` (others are ignored) into a LiveView.

    Later messages win over earlier ones, except that a route set never replaces a newer
    version and a telemetry snapshot never an newer one; change reports (not full) update
    the peers of the snapshot they follow. A message that does not decode, or a route set
    whose signature does not verify against ``trusted_keys`` (when given), is left out with
    one line in ``warnings``. Route sets are marked verified (True), or unchecked (None)
    when no key is given.
    """
    topics = Topics(mesh)
    view = LiveView(mesh=mesh, broker=broker)
    partial: list[Telemetry] = []
    for topic, payload in messages:
        parsed = topics.parse(topic)
        if parsed is None:
            continue
        kind, name = parsed
        try:
            if kind == "telemetry":
                t = decode_telemetry(unsigned_payload(payload, "telemetry"))
                _check_sender(t.mesh, t.node, mesh, name)
                if not t.full:
                    partial.append(t)
                    continue
                old = view.telemetry.get(name)
                if old is None or (t.sent_at, t.seq) >= (old.sent_at, old.seq):
                    view.telemetry[name] = t
            elif kind == "status":
                s = decode_status(unsigned_payload(payload, "status"))
                _check_sender(s.mesh, s.node, mesh, name)
                view.status[name] = s
            elif kind == "routes":
                if trusted_keys:
                    rs = verify_route_set(payload, trusted_keys, mesh=mesh, node=name)
                    verified: bool | None = True
                else:
                    rs = decode_route_set(unsigned_payload(payload, "routes"))
                    _check_sender(rs.mesh, rs.node, mesh, name)
                    verified = None
                old_rs = view.route_sets.get(name)
                if old_rs is None or rs.version >= old_rs.version:
                    view.route_sets[name] = rs
                    view.verified[name] = verified
            elif kind == "lease":
                lease = decode_lease(unsigned_payload(payload, "lease"))
                if view.lease is None or lease.term >= view.lease.term:
                    view.lease = lease
        except BusMessageError as exc:
            view.warnings.append(f"skipped {topic}: {exc}")
    for t in sorted(partial, key=lambda t: (t.sent_at, t.seq)):
        base = view.telemetry.get(t.node)
        if base is None or t.sent_at < base.sent_at:
            continue
        peers = {p.public_key: p for p in base.peers}
        peers.update({p.public_key: p for p in t.peers})
        view.telemetry[t.node] = _with_peers(base, list(peers.values()), t)
    return view


def _with_peers(base: Telemetry, peers: list[PeerReport], newer: Telemetry) -> Telemetry:
    return msgspec.structs.replace(base, peers=peers, sent_at=newer.sent_at, seq=newer.seq)


def _check_sender(msg_mesh: str, msg_node: str, mesh: str, node: str) -> None:
    if msg_mesh != mesh or msg_node != node:
        raise BusMessageError("wrong_node", f"message is for {msg_mesh}/{msg_node}")


# --- reading the broker ---------------------------------------------------------------


async def read_bus(
    broker: BrokerLike,
    topic_filter: str,
    *,
    quiet_s: float = QUIET_S,
    timeout_s: float = TIMEOUT_S,
) -> list[BusMessage]:
    """The messages under ``topic_filter``: the retained ones, and whatever else arrives
    until ``quiet_s`` pass without a retained message (or ``timeout_s`` in all).

    ``broker``: a url, an address or BrokerSettings (TLS, user name and password file).
    Raises LiveError when the broker cannot be reached.
    """
    client = aiomqtt.Client(
        **client_kwargs(broker),
        identifier=f"meshopt-inspect-{os.getpid()}-{os.urandom(3).hex()}",
        timeout=timeout_s,
    )
    out: list[BusMessage] = []
    try:
        async with client:
            await client.subscribe(topic_filter, qos=1)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            last_retained = loop.time()
            messages = aiter(client.messages)
            while True:
                wait = min(last_retained + quiet_s, deadline) - loop.time()
                if wait <= 0:
                    break
                try:
                    msg = await asyncio.wait_for(anext(messages), wait)
                except TimeoutError:
                    break
                payload = msg.payload
                data = payload if isinstance(payload, bytes) else str(payload).encode()
                out.append((msg.topic.value, data))
                if msg.retain:
                    last_retained = loop.time()
    except (aiomqtt.MqttError, OSError) as exc:
        raise MeshUnavailable(f"cannot read the broker {_shown(broker)}: {exc}") from None
    return out


def _shown(broker: BrokerLike) -> str:
    """The broker's address for messages, never its credentials."""
    return str(parse_broker(broker.url if isinstance(broker, BrokerSettings) else str(broker)))


def read_view(
    broker: BrokerLike,
    mesh: str | None,
    *,
    trusted_keys: Sequence[PublicKeyLike] = (),
    quiet_s: float = QUIET_S,
    timeout_s: float = TIMEOUT_S,
    warn: Callable[[str], None] | None = None,
) -> LiveView:
    """Read the broker and assemble mesh ``mesh`` (None: the only mesh on the broker).

    LiveError when no mesh or several are seen and none was named, or when the mesh has
    no route sets (nothing to inspect: no controller has published). ``warn`` gets each
    skipped message's line first, so the reason for an empty view is visible.
    """
    topic_filter = f"{ROOT}/+/#" if mesh is None else f"{Topics(mesh).prefix}/#"
    shown = _shown(broker)
    messages = asyncio.run(read_bus(broker, topic_filter, quiet_s=quiet_s, timeout_s=timeout_s))
    if mesh is None:
        seen = meshes_seen(messages)
        if not seen:
            hint = ""
            if isinstance(broker, BrokerSettings) and (broker.username or broker.password_file):
                hint = " (an ACL may hide other meshes' topics: name the mesh with --mesh)"
            raise MeshUnavailable(
                f"no meshopt mesh seen on {shown} — is a controller running?{hint}"
            )
        if len(seen) > 1:
            raise LiveError(f"several meshes on {shown} ({', '.join(seen)}): pick one with --mesh")
        mesh = seen[0]
    view = assemble(mesh, messages, trusted_keys=trusted_keys, broker=shown)
    if warn is not None:
        for line in view.warnings:
            warn(line)
    if not view.route_sets:
        message = f"no route sets for mesh {mesh} on {shown} — is a controller running?"
        if any("/routes/" in topic for topic, _ in messages):
            raise LiveError(message)  # there were some, refused (a wrong key): bad input
        raise MeshUnavailable(message)
    return view


def age_text(since: float | None, now: float) -> str:
    """'12 s ago', '3 min ago', '2.1 h ago' (for tables)."""
    if since is None or not math.isfinite(since):
        return "-"
    age = max(0.0, now - since)
    if age < 120:
        return f"{age:.0f} s ago"
    if age < 7200:
        return f"{age / 60:.0f} min ago"
    return f"{age / 3600:.1f} h ago"
