"""The controller's picture of the mesh, built from telemetry alone (pure, time injected).

Nodes are known by name; each reports the public keys of its interfaces, and its peers
by their keys, so a peer report is matched to a node through the other node's own
telemetry (this also works in the per-peer layout, where every tunnel end has its own
key). A node is down when its agent says so (the will message) or when its telemetry is
older than ``stale_after_s``; all its links are then down in both directions, so the
policy moves every route through it at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from meshopt.bus.messages import PeerReport, Telemetry
from meshopt.metric import FloatArray, LinkSample, Metric


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

    def node_of_key(self) -> dict[str, str]:
        return {k: n.name for n in self.nodes.values() for k in n.public_keys}

    def take(self, topic_node: str, t: Telemetry, now: float, wall: float | None = None) -> bool:
        """Take one telemetry message; True if the graph may have changed.

        With ``wall`` (the receiver's clock, like ``sent_at``), a message's age counts: a
        retained snapshot of an agent that died long ago is stale at once, not live for
        another ``stale_after_s``.
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
        peers = {p.public_key: p for p in t.peers}
        if self.first_seen is None:
            self.first_seen = now
        if info is None:
            info = NodeInfo(t.node, list(keys), list(t.addresses), now)
            self.nodes[t.node] = info
        info.public_keys = list(keys)
        info.addresses = list(t.addresses)
        info.last_seen = now
        info.online = True
        info.seq = t.seq
        info.sent_at = t.sent_at
        if t.full:
            info.peers = peers
        else:
            info.peers.update(peers)
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
