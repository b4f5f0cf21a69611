"""What the agent tells the controller, and when a change is worth telling at once.

A full snapshot goes out every ``full_interval_s`` (so a controller that starts late, or
missed messages, catches up); in between, a report goes out as soon as a peer appears or
disappears, flips between alive and dead, or its RTT or loss moves by more than the
configured thresholds. Pure: the daemon supplies readings and times.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from meshopt.agent.config import TelemetrySettings
from meshopt.agent.peers import PeerInfo
from meshopt.bus.messages import PeerReport, Telemetry
from meshopt.probe.stats import ProbeStats


@dataclass(frozen=True)
class Capacity:
    """The last active bandwidth estimate of one peer."""

    mbit: float
    confidence: float
    measured_at: float  # monotonic


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def peer_report(
    peer: PeerInfo,
    stats: ProbeStats | None,
    alive: bool | None,
    capacity: Capacity | None,
    now: float,
    pmtu: int | None = None,
) -> PeerReport:
    return PeerReport(
        public_key=peer.public_key,
        ifname=peer.ifname,
        endpoint=peer.endpoint,
        alive=alive,
        rtt_ms=_finite(stats.srtt_ms) if stats else None,
        rtt_min_ms=_finite(stats.rtt_min_ms) if stats else None,
        rtt_median_ms=_finite(stats.rtt_median_ms) if stats else None,
        rtt_p95_ms=_finite(stats.rtt_p95_ms) if stats else None,
        jitter_ms=_finite(stats.jitter_ms) if stats else None,
        noise_ms=_finite(stats.noise_ms) if stats else None,
        loss=stats.loss if stats and stats.sent else None,
        samples=stats.samples if stats else 0,
        probes_sent=stats.sent if stats else 0,
        handshake_age_s=peer.handshake_age_s,
        rx_bytes=peer.rx_bytes,
        tx_bytes=peer.tx_bytes,
        rx_bps=peer.rx_bps,
        tx_bps=peer.tx_bps,
        bandwidth_mbit=capacity.mbit if capacity else None,
        bandwidth_confidence=capacity.confidence if capacity else None,
        bandwidth_age_s=max(0.0, now - capacity.measured_at) if capacity else None,
        pmtu=pmtu,
    )


def significant(
    old: Mapping[str, PeerReport], new: Mapping[str, PeerReport], cfg: TelemetrySettings
) -> bool:
    """True when ``new`` differs from what was last published enough to publish now."""
    if set(old) != set(new):
        return True
    for key, n in new.items():
        o = old[key]
        if o.alive != n.alive:
            return True
        if (o.rtt_ms is None) != (n.rtt_ms is None):
            return True
        if o.rtt_ms is not None and n.rtt_ms is not None:
            step = abs(n.rtt_ms - o.rtt_ms)
            if step >= cfg.rtt_change_ms and step >= cfg.rtt_change_rel * o.rtt_ms:
                return True
        if (o.loss or 0.0) != (n.loss or 0.0) and abs(
            (n.loss or 0.0) - (o.loss or 0.0)
        ) >= cfg.loss_change:
            return True
    return False


def telemetry(
    *,
    mesh: str,
    node: str,
    public_keys: Sequence[str],
    addresses: Sequence[str],
    seq: int,
    sent_at: float,
    full: bool,
    peers: Sequence[PeerReport],
    counters: Mapping[str, int],
    session: int = 0,
) -> Telemetry:
    return Telemetry(
        mesh=mesh,
        node=node,
        public_key=public_keys[0] if public_keys else "",
        public_keys=list(public_keys),
        addresses=list(addresses),
        seq=seq,
        session=session,
        sent_at=sent_at,
        full=full,
        peers=list(peers),
        counters=dict(counters),
    )
