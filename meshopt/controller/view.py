"""The controller's picture of the mesh, built from telemetry alone (pure, time injected).

Nodes are known by name; each reports the public keys of its interfaces, and its peers
by their keys, so a peer report is matched to a node through the other node's own
telemetry (this also works in the per-peer layout, where every tunnel end has its own
key). A node is down when its agent says so (the will message) or when its telemetry is
older than ``stale_after_s``; all its links are then down in both directions, so the
policy moves every route through it at once.

Telemetry comes from the broker, which is not a trust boundary (DESIGN "Trust nothing
that arrives"), so the view is where one node's data is kept from hurting the others:

* Every key and every address prefix belongs to exactly one node. A message claiming a
  key (``key_conflict``) or an address equal to or overlapping a prefix of another node
  in the view (``address_conflict``) is refused whole; the current owner keeps it until
  it stops claiming it or is removed (:meth:`MeshView.remove`). Two routes to one
  prefix would make every route set of the mesh unpublishable, and a more specific
  prefix would steal another node's traffic.
* Values the decoder lets through (they are possible) but routing cannot use are
  cleared field by field, as "not measured", and counted in :attr:`MeshView.dropped`;
  the rest of the report still counts. See :func:`usable_peer`.
"""

from __future__ import annotations

import bisect
import ipaddress
import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np

from meshopt.bus.messages import Counters, PeerReport, Telemetry
from meshopt.metric import FloatArray, LinkSample, Metric

log = logging.getLogger("meshopt.controller")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# Possible (the decoder takes them) but unusable for routing: such fields are dropped.
MIN_PMTU = 576  # the IPv4 minimum (RFC 791); a smaller path MTU cannot carry a route
MAX_DELAY_MS = 60_000.0  # RTT, jitter, noise: a link a minute away is no link to route on
MAX_BANDWIDTH_MBIT = 1e7  # 10 Tbit/s through one WireGuard tunnel
MAX_RATE_BPS = 1.25e12  # rx_bps/tx_bps: over 1 Tbit/s whether bits or bytes are counted
_DELAY_FIELDS = ("rtt_ms", "rtt_min_ms", "rtt_median_ms", "rtt_p95_ms", "jitter_ms", "noise_ms")


def usable_peer(p: PeerReport) -> tuple[PeerReport, list[str]]:
    """``p`` with every unusable field reset to "not measured", and those fields' names.

    Dropping one field keeps the rest of the report: a node with a broken PMTU probe
    still has its RTTs routed on. A delay beyond ``MAX_DELAY_MS`` reads as no RTT (the
    link costs ``unknown_cost_ms``), a PMTU below ``MIN_PMTU`` as not probed (bulk routes
    then take the default MTU), an absurd bandwidth as unknown (0 in the matrices).
    """
    changes: dict[str, object] = {}
    for name in _DELAY_FIELDS:
        v = getattr(p, name)
        if v is not None and not (math.isfinite(v) and 0.0 <= v <= MAX_DELAY_MS):
            changes[name] = None
    if p.loss is not None and not (math.isfinite(p.loss) and 0.0 <= p.loss <= 1.0):
        changes["loss"] = None
    bw = p.bandwidth_mbit
    if bw is not None and not (math.isfinite(bw) and 0.0 <= bw <= MAX_BANDWIDTH_MBIT):
        changes["bandwidth_mbit"] = None
    if p.pmtu is not None and not MIN_PMTU <= p.pmtu <= 65535:
        changes["pmtu"] = None
    for name in ("rx_bps", "tx_bps"):
        v = getattr(p, name)
        if not (math.isfinite(v) and 0.0 <= v <= MAX_RATE_BPS):
            changes[name] = 0.0  # the field's "no rate" value
    if not changes:
        return p, []
    return msgspec.structs.replace(p, **changes), sorted(changes)


class _Prefixes:
    """Which node owns which address prefix; finds the owner of an overlapping prefix with
    a dict lookup per prefix length in use and a bisect, not a scan of the whole mesh."""

    def __init__(self) -> None:
        self._exact: dict[tuple[int, int, int], str] = {}  # (version, length, first) -> node
        self._lengths: dict[int, Counter[int]] = {4: Counter(), 6: Counter()}
        self._sorted: dict[int, list[tuple[int, int, str, str]]] = {4: [], 6: []}
        self._of: dict[str, list[Network]] = {}

    def conflict(self, net: Network, node: str) -> tuple[str, str] | None:
        """(owner, its prefix) of a prefix of another node equal to or overlapping ``net``."""
        v, bits = net.version, net.max_prefixlen
        first, last = int(net.network_address), int(net.broadcast_address)
        # Prefixes nest or are disjoint: an overlap either contains ``net``...
        for length, n in self._lengths[v].items():
            if n and length <= net.prefixlen:
                shift = bits - length
                owner = self._exact.get((v, length, first >> shift << shift))
                if owner is not None and owner != node:
                    return owner, self._text(owner, v, length, first >> shift << shift)
        # ... or starts inside it.
        entries = self._sorted[v]
        i = bisect.bisect_left(entries, (first,))
        while i < len(entries) and entries[i][0] <= last:
            if entries[i][2] != node:
                return entries[i][2], entries[i][3]
            i += 1
        return None

    def _text(self, owner: str, v: int, length: int, first: int) -> str:
        for net in self._of.get(owner, []):
            if (net.version, net.prefixlen, int(net.network_address)) == (v, length, first):
                return str(net)
        return "?"  # pragma: no cover - the index and _of agree

    def set(self, node: str, nets: Sequence[Network]) -> None:
        """``node`` owns exactly ``nets`` now (checked by :meth:`conflict` beforehand)."""
        if self._of.get(node) == list(nets):
            return
        self.remove(node)
        for net in nets:
            first = int(net.network_address)
            self._exact[(net.version, net.prefixlen, first)] = node
            self._lengths[net.version][net.prefixlen] += 1
            bisect.insort(
                self._sorted[net.version], (first, int(net.broadcast_address), node, str(net))
            )
        self._of[node] = list(nets)

    def remove(self, node: str) -> None:
        for net in self._of.pop(node, []):
            first = int(net.network_address)
            del self._exact[(net.version, net.prefixlen, first)]
            self._lengths[net.version][net.prefixlen] -= 1
            entries = self._sorted[net.version]
            entry = (first, int(net.broadcast_address), node, str(net))
            i = bisect.bisect_left(entries, entry)
            if i < len(entries) and entries[i] == entry:
                del entries[i]


class TelemetryRefused(Exception):
    """Telemetry the view will not take; ``reason`` is a short counter key."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class NodeInfo:
    name: str
    public_keys: list[str]
    addresses: list[str]
    last_seen: float  # monotonic time of the last telemetry
    online: bool = True
    seq: int = -1
    sent_at: float = -math.inf
    peers: dict[str, PeerReport] = field(default_factory=dict)  # by peer public key
    offline_reason: str = ""


@dataclass
class Matrices:
    names: list[str]
    cost: FloatArray  # metric cost per link, inf where down or absent, 0 on the diagonal
    noise: FloatArray  # standard deviation of each link's cost estimate (ms)
    bandwidth: FloatArray  # Mbit/s per link, 0 where unknown or down
    up: np.ndarray  # bool per node
    rtt: FloatArray  # measured (smoothed) RTT per link in ms, nan where unknown
    pmtu: FloatArray  # path MTU through each tunnel, 0 where not measured


class MeshView:
    def __init__(
        self,
        mesh: str,
        *,
        metric: Metric | None = None,
        stale_after_s: float = 15.0,
        allowed: Sequence[str] = (),
    ) -> None:
        self.mesh = mesh
        self.metric = metric or Metric()
        self.stale_after_s = stale_after_s
        self.allowed = set(allowed)
        self.nodes: dict[str, NodeInfo] = {}
        self.first_seen: float | None = None
        # Fields cleared as unusable and addresses given twice in one message, by reason
        # ("<field>_unusable", "duplicate_address"); the first of each reason is logged.
        # Cumulative: a caller counts what one ``take`` dropped as the difference.
        self.dropped = Counters("controller ignored telemetry values", log)
        self._prefixes = _Prefixes()

    def node_of_key(self) -> dict[str, str]:
        return {k: n.name for n in self.nodes.values() for k in n.public_keys}

    def take(self, topic_node: str, t: Telemetry, now: float, wall: float | None = None) -> bool:
        """Take one telemetry message; True if the graph may have changed.

        With ``wall`` (the receiver's clock, like ``sent_at``), a message's age counts: a
        retained snapshot of an agent that died long ago is stale at once, not live for
        another ``stale_after_s``.

        Raises TelemetryRefused (nothing changed) for a message that cannot be taken,
        e.g. ``key_conflict`` or ``address_conflict``; unusable fields and repeated
        addresses are left out and counted in :attr:`dropped` instead.
        """
        if wall is not None:
            now -= min(max(0.0, wall - t.sent_at), self.stale_after_s * 10)
        if t.mesh != self.mesh:
            raise TelemetryRefused("wrong_mesh", f"{t.mesh!r}")
        if t.node != topic_node:
            raise TelemetryRefused("node_mismatch", f"{t.node!r} on the topic of {topic_node!r}")
        if self.allowed and t.node not in self.allowed:
            raise TelemetryRefused("unknown_node", t.node)
        keys = t.public_keys or [t.public_key]
        owner = self.node_of_key()
        for k in keys:
            if owner.get(k, t.node) != t.node:
                raise TelemetryRefused("key_conflict", f"{t.node} claims a key of {owner[k]}")
        info = self.nodes.get(t.node)
        if info is not None and t.sent_at <= info.sent_at:
            # An old message delivered late, or replayed: newer data is already in.
            raise TelemetryRefused("out_of_order", f"{t.node} seq {t.seq}")
        addresses, nets, duplicates = self._claim(t.node, t.addresses)
        # Nothing is refused past this point: what follows changes the view.
        if duplicates:
            self.dropped.count("duplicate_address", f"{t.node}: {duplicates[0]}", len(duplicates))
        peers: dict[str, PeerReport] = {}
        for p in t.peers:
            usable, dropped = usable_peer(p)
            for name in dropped:
                self.dropped.count(f"{name}_unusable", f"{t.node}: {name}={getattr(p, name)!r}")
            peers[p.public_key] = usable
        self._prefixes.set(t.node, nets)
        if self.first_seen is None:
            self.first_seen = now
        if info is None:
            info = NodeInfo(t.node, list(keys), addresses, now)
            self.nodes[t.node] = info
        info.public_keys = list(keys)
        info.addresses = addresses
        info.last_seen = now
        info.online = True
        info.seq = t.seq
        info.sent_at = t.sent_at
        if t.full:
            info.peers = peers
        else:
            info.peers.update(peers)
        return True

    def _claim(
        self, node: str, claimed: Sequence[str]
    ) -> tuple[list[str], list[Network], list[str]]:
        """(addresses, their prefixes, duplicates left out) of ``node``'s claim, or
        TelemetryRefused("address_conflict") if a prefix overlaps another node's."""
        addresses: list[str] = []
        nets: list[Network] = []
        duplicates: list[str] = []
        seen: set[Network] = set()
        for text in claimed:
            try:
                net = ipaddress.ip_network(text, strict=True)
            except ValueError:
                # The decoder passes only prefixes; a caller that skipped it gets a refusal.
                raise TelemetryRefused("bad_address", f"{node}: {text[:60]!r}") from None
            if net in seen:
                duplicates.append(text)
                continue
            hit = self._prefixes.conflict(net, node)
            if hit is not None:
                raise TelemetryRefused(
                    "address_conflict", f"{node} claims {text}, overlapping {hit[1]} of {hit[0]}"
                )
            seen.add(net)
            addresses.append(text)
            nets.append(net)
        return addresses, nets, duplicates

    def remove(self, node: str) -> bool:
        """Forget ``node`` (decommissioned): its keys and addresses are free to claim again."""
        if self.nodes.pop(node, None) is None:
            return False
        self._prefixes.remove(node)
        return True

    def measured(self, min_samples: int = 1) -> bool:
        """Every online node reports ``min_samples`` RTT samples for each of its peers."""
        return all(
            info.peers
            and all(p.rtt_ms is not None and p.samples >= min_samples for p in info.peers.values())
            for info in self.nodes.values()
            if info.online
        )

    def ready(self, now: float, warmup_s: float, min_samples: int = 8) -> bool:
        """Enough is known to route: all links measured, or ``warmup_s`` since the first report.

        Routing on half a picture would install routes around links nobody has measured
        yet (they cost ``unknown_cost_ms``), or on one or two samples, and the policy
        would then hold those choices for ``hold_s``.
        """
        if self.first_seen is None:
            return False
        return self.measured(min_samples) or now - self.first_seen >= warmup_s

    def set_offline(self, node: str, reason: str) -> bool:
        info = self.nodes.get(node)
        if info is None or not info.online:
            return False
        info.online = False
        info.offline_reason = reason
        return True

    def expire(self, now: float) -> list[str]:
        """Nodes whose telemetry went stale now; they are marked offline."""
        out = []
        for info in self.nodes.values():
            if info.online and now - info.last_seen > self.stale_after_s:
                info.online = False
                info.offline_reason = "telemetry stale"
                out.append(info.name)
        return out

    def names(self) -> list[str]:
        return sorted(self.nodes)

    def matrices(self, now: float) -> Matrices:
        names = self.names()
        index = {n: i for i, n in enumerate(names)}
        n = len(names)
        cost = np.full((n, n), np.inf)
        noise = np.zeros((n, n))
        bw = np.zeros((n, n))
        rtt = np.full((n, n), np.nan)
        pmtu = np.zeros((n, n))
        up = np.array([self.nodes[x].online for x in names], dtype=bool)
        owner = self.node_of_key()
        for s_name, info in self.nodes.items():
            s = index[s_name]
            if not info.online:
                continue
            age = max(0.0, now - info.last_seen)
            for key, rep in info.peers.items():
                d_name = owner.get(key)
                if d_name is None or d_name == s_name:
                    continue
                d = index[d_name]
                if not up[d]:
                    continue
                c, sd = link_cost(rep, self.metric, age)
                cost[s, d] = c
                noise[s, d] = sd
                if rep.bandwidth_mbit is not None and math.isfinite(c):
                    bw[s, d] = rep.bandwidth_mbit
                if rep.rtt_ms is not None and math.isfinite(c):
                    rtt[s, d] = rep.rtt_ms
                if rep.pmtu is not None:
                    pmtu[s, d] = rep.pmtu
        np.fill_diagonal(cost, 0.0)
        return Matrices(names, cost, noise, bw, up, rtt, pmtu)


def link_cost(rep: PeerReport, metric: Metric, age_s: float) -> tuple[float, float]:
    """(cost, its standard deviation) of one reported link; inf when it is dead."""
    if rep.alive is False:
        return math.inf, 0.0
    if rep.rtt_ms is None:
        return metric.unknown_cost_ms, 0.0
    sample = LinkSample(
        rtt_ms=rep.rtt_ms,
        jitter_ms=rep.jitter_ms or 0.0,
        loss=min(rep.loss or 0.0, 1.0),
        noise_ms=rep.noise_ms or 0.0,
        age_s=age_s,
    )
    # The loss estimate is noisy too (a window of n probes), and through the loss
    # penalty its noise can outweigh the RTT's: the policy must see both.
    p = sample.loss
    n = max(rep.samples, 1) / max(1.0 - p, 1e-3)
    loss_sd = math.sqrt(p * (1.0 - p) / n)
    slope = metric.loss_penalty_ms / max(1.0 - p, 1e-3) ** 2
    # The jitter term is an estimate too, and a skittish one: a few delayed probes (a
    # busy host, a burst of cross traffic) move RFC 3550 jitter by tens of percent within
    # seconds. A quarter of the term as its noise keeps such swings from looking like
    # gains without hiding real ones (a half blocked 8 ms relay gains on a busy host).
    jitter_sd = 0.25 * metric.jitter_weight * sample.jitter_ms
    return metric.link_cost(sample), math.hypot(sample.noise_ms, slope * loss_sd, jitter_sd)
