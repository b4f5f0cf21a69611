"""The agent's metrics, read from the live daemon at scrape time.

Nothing is updated per probe: the collector walks the agent's own state (prober stats,
peers, counters, the route set) when Prometheus asks, so an idle agent pays nothing
between scrapes and a scrape costs about a millisecond for 15 peers.

Units are Prometheus base units: seconds, bytes, ratios 0..1; counters end in
``_total``. Peers are labelled by WireGuard public key (``peer``) and interface.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from meshopt import __version__

if TYPE_CHECKING:
    from meshopt.agent.daemon import Agent

PEER_LABELS = ["peer", "interface"]


def _seconds(ms: float | None) -> float | None:
    return ms / 1000.0 if ms is not None and math.isfinite(ms) else None


def counter_family(name: str, doc: str, label: str, counts: Mapping[str, int]) -> Metric:
    """One counter family with a sample per reason (sorted, so scrapes are stable)."""
    fam = CounterMetricFamily(name, doc, labels=[label])
    for key in sorted(counts):
        fam.add_metric([key], float(counts[key]))
    return fam


class AgentCollector(Collector):
    """Everything ``/metrics`` shows for one agent."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def collect(self) -> Iterable[Metric]:
        a = self.agent
        info = GaugeMetricFamily(
            "meshopt_agent_info",
            "This agent: mesh, node and version.",
            labels=["mesh", "node", "version"],
        )
        info.add_metric([a.cfg.mesh, a.cfg.node, __version__], 1.0)
        yield info
        yield from self._peers()
        yield from self._routes()
        yield from self._counters()
        connected = GaugeMetricFamily(
            "meshopt_broker_connected", "1 while connected to the MQTT broker."
        )
        connected.add_metric([], 1.0 if a.bus.connected else 0.0)
        yield connected
        yield CounterMetricFamily(
            "meshopt_broker_connects", "Successful broker connections.", value=a.bus.connects
        )

    def _peers(self) -> Iterable[Metric]:
        a = self.agent
        fams: dict[str, GaugeMetricFamily] = {}

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            fams[name] = GaugeMetricFamily(name, doc, labels=PEER_LABELS)
            return fams[name]

        up = gauge("meshopt_peer_up", "1 while the peer answers probes, 0 when dead.")
        rtt = gauge("meshopt_peer_rtt_seconds", "Smoothed round-trip time through the tunnel.")
        rtt_min = gauge("meshopt_peer_rtt_min_seconds", "Lowest RTT in the probe window.")
        rtt_med = gauge("meshopt_peer_rtt_median_seconds", "Median RTT in the probe window.")
        jitter = gauge("meshopt_peer_jitter_seconds", "Interarrival jitter of RTTs (RFC 3550).")
        loss = gauge(
            "meshopt_peer_loss_ratio",
            "Lost probes over the window, pooled with the loss memory, 0..1.",
        )
        cap = gauge(
            "meshopt_peer_capacity_bytes_per_second", "Last packet-train capacity estimate."
        )
        hs = gauge("meshopt_peer_handshake_age_seconds", "Time since the last WireGuard handshake.")
        in_use = gauge(
            "meshopt_peer_probe_in_use",
            "1: probed fast (a relay, traffic, or their backup), 0: idle.",
        )
        every = gauge("meshopt_peer_probe_interval_seconds", "Time between probes to the peer.")
        dead_after = gauge(
            "meshopt_peer_probe_dead_after_seconds", "Silence after which the peer is dead."
        )
        rx = CounterMetricFamily(
            "meshopt_peer_receive_bytes",
            "Bytes received from the peer (WireGuard).",
            labels=PEER_LABELS,
        )
        tx = CounterMetricFamily(
            "meshopt_peer_transmit_bytes", "Bytes sent to the peer (WireGuard).", labels=PEER_LABELS
        )
        for key, peer in a.tracker.peers.items():
            labels = [key, peer.ifname]
            alive = a.prober.alive(key)
            if alive is not None:
                up.add_metric(labels, 1.0 if alive else 0.0)
            stats = a.prober.stats(key)
            if stats is not None:
                for fam, value in (
                    (rtt, _seconds(stats.srtt_ms)),
                    (rtt_min, _seconds(stats.rtt_min_ms)),
                    (rtt_med, _seconds(stats.rtt_median_ms)),
                    (jitter, _seconds(stats.jitter_ms)),
                ):
                    if value is not None:
                        fam.add_metric(labels, value)
                if stats.sent:
                    loss.add_metric(labels, stats.loss)
            capacity = a.capacity.get(key)
            if capacity is not None:
                cap.add_metric(labels, capacity.mbit * 1e6 / 8)
            if peer.handshake_age_s is not None:
                hs.add_metric(labels, peer.handshake_age_s)
            rate = a.prober.rate(key)
            if rate is not None:
                in_use.add_metric(labels, 1.0 if rate.cls == "in_use" else 0.0)
                every.add_metric(labels, rate.interval_s)
                dead_after.add_metric(labels, rate.dead_after_s)
            rx.add_metric(labels, float(peer.rx_bytes))
            tx.add_metric(labels, float(peer.tx_bytes))
        peers = GaugeMetricFamily("meshopt_peers", "WireGuard peers of this node.")
        peers.add_metric([], float(len(a.tracker.peers)))
        yield peers
        probes = GaugeMetricFamily(
            "meshopt_probes_per_second", "Probes per second at the current rates, all peers."
        )
        probes.add_metric([], a.prober.probes_per_s())
        yield probes
        yield from fams.values()
        yield rx
        yield tx

    def _routes(self) -> Iterable[Metric]:
        a = self.agent
        names = {a.cfg.routes.fast_table: "fast", a.cfg.routes.bulk_table: "bulk"}
        by_table = Counter(names.get(r.table, str(r.table)) for r in a.installed)
        routes = GaugeMetricFamily(
            "meshopt_installed_routes", "Routes installed by the last apply.", labels=["table"]
        )
        for table in ("fast", "bulk"):
            routes.add_metric([table], float(by_table.pop(table, 0)))
        for table, n in sorted(by_table.items()):
            routes.add_metric([table], float(n))
        yield routes
        failed = GaugeMetricFamily(
            "meshopt_failed_over_routes", "Routes on their backup next hop (primary dead) now."
        )
        failed.add_metric([], float(len(a.failed_over)))
        yield failed
        yield CounterMetricFamily(
            "meshopt_failovers",
            "Local fail-overs to a backup next hop.",
            value=a.counters["failovers"],
        )
        # Declared always, sampled only once a route set is installed: no made-up zero.
        rs = a.route_set
        values = (
            (rs.version, rs.term, len(rs.routes), max(0.0, a.wall() - rs.issued_at))
            if rs is not None
            else None
        )
        for i, (name, doc) in enumerate(
            (
                ("meshopt_route_set_version", "Version of the installed route set."),
                ("meshopt_route_set_term", "Controller term of the installed route set."),
                ("meshopt_route_set_routes", "Routes in the installed route set."),
                (
                    "meshopt_route_set_age_seconds",
                    "Time since the controller issued the installed route set.",
                ),
            )
        ):
            g = GaugeMetricFamily(name, doc)
            if values is not None:
                g.add_metric([], float(values[i]))
            yield g

    def _counters(self) -> Iterable[Metric]:
        a = self.agent
        dropped = {k: v for k, v in a.counters.snapshot().items() if k != "failovers"}
        yield counter_family(
            "meshopt_agent_dropped",
            "Input refused or work failed, by reason (route sets, peers, applies).",
            "reason",
            dropped,
        )
        yield counter_family(
            "meshopt_prober_events", "The prober's packet counters.", "event", a.prober.counters
        )
        yield counter_family(
            "meshopt_responder_events",
            "The probe responder's packet counters.",
            "event",
            a.responder.counters,
        )
        yield CounterMetricFamily(
            "meshopt_bandwidth_probe_bytes",
            "Bytes sent in packet trains for capacity estimates.",
            value=a.bandwidth_bytes,
        )


def agent_health(
    agent: Agent, tasks: Mapping[str, asyncio.Task[Any]]
) -> tuple[bool, dict[str, Any]]:
    """Healthy while every loop of the agent runs (the loop answering proves it turns)."""
    loops = {name: "running" if not t.done() else "stopped" for name, t in tasks.items()}
    alive = sum(1 for k in agent.tracker.peers if agent.prober.alive(k))
    rs = agent.route_set
    detail: dict[str, Any] = {
        "daemon": "agent",
        "mesh": agent.cfg.mesh,
        "node": agent.cfg.node,
        "broker_connected": agent.bus.connected,
        "loops": loops,
        "peers": len(agent.tracker.peers),
        "peers_alive": alive,
        "route_set_version": rs.version if rs is not None else None,
    }
    return bool(loops) and all(v == "running" for v in loops.values()), detail


def agent_registry(agent: Agent) -> CollectorRegistry:
    """A registry of its own (not the process-wide default) with the agent's collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(agent))
    return registry
