"""The controller's metrics: the mesh it sees, its recomputes, publishes and lease.

Read from the live core at scrape time, except the recompute duration histogram and
the publish counts, which the daemon records as they happen (they are events, not
state).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from meshopt import __version__
from meshopt.metrics.agent import counter_family

if TYPE_CHECKING:
    from meshopt.controller.daemon import Controller

# 1 ms .. 10 s: a 4-node mesh recomputes in ~1 ms, 1,000 nodes in about a second.
RECOMPUTE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ControllerCollector(Collector):
    """Everything ``/metrics`` shows for one controller, besides its histogram."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    def collect(self) -> Iterable[Metric]:
        c = self.controller
        core = c.core
        info = GaugeMetricFamily(
            "meshopt_controller_info",
            "This controller: mesh, id and version.",
            labels=["mesh", "controller", "version"],
        )
        info.add_metric([c.cfg.mesh, c.cfg.id, __version__], 1.0)
        yield info
        nodes = GaugeMetricFamily(
            "meshopt_controller_nodes", "Nodes in the controller's view.", labels=["state"]
        )
        online = [n for n in core.view.nodes.values() if n.online]
        nodes.add_metric(["online"], float(len(online)))
        nodes.add_metric(["offline"], float(len(core.view.nodes) - len(online)))
        yield nodes
        owner = core.view.node_of_key()
        up = {n.name for n in online}
        links = 0
        for n in online:
            for key, rep in n.peers.items():
                other = owner.get(key)
                if other is not None and other != n.name and other in up and rep.alive is not False:
                    links += 1
        g = GaugeMetricFamily(
            "meshopt_controller_links", "Directed links reported alive between online nodes."
        )
        g.add_metric([], float(links))
        yield g
        active = GaugeMetricFamily(
            "meshopt_controller_lease_active", "1 while this controller holds the lease."
        )
        active.add_metric([], 1.0 if core.lease.role == "active" else 0.0)
        yield active
        role = GaugeMetricFamily(
            "meshopt_controller_lease_role",
            "The lease role (1 for the current one).",
            labels=["role"],
        )
        for name in ("starting", "standby", "claiming", "active"):
            role.add_metric([name], 1.0 if core.lease.role == name else 0.0)
        yield role
        term = GaugeMetricFamily("meshopt_controller_lease_term", "The current lease term.")
        term.add_metric([], float(core.lease.term))
        yield term
        version = GaugeMetricFamily(
            "meshopt_controller_route_set_version", "Newest route-set version published or seen."
        )
        version.add_metric([], float(core.version))
        yield version
        yield CounterMetricFamily(
            "meshopt_controller_recomputes", "Route recomputations.", value=core.recomputes
        )
        yield CounterMetricFamily(
            "meshopt_controller_route_changes",
            "Next-hop entries the policy changed over all recomputes.",
            value=core.route_changes,
        )
        yield CounterMetricFamily(
            "meshopt_controller_accepted_messages",
            "Bus messages taken (signed and fresh).",
            value=core.accepted,
        )
        pub = CounterMetricFamily(
            "meshopt_controller_publishes",
            "Messages published, by kind and whether the broker took them.",
            labels=["kind", "result"],
        )
        for (kind, result), count in sorted(c.publishes.items()):
            pub.add_metric([kind, result], float(count))
        yield pub
        yield counter_family(
            "meshopt_controller_dropped",
            "Messages, fields and routes refused or left out, by reason.",
            "reason",
            core.dropped(),
        )
        connected = GaugeMetricFamily(
            "meshopt_broker_connected", "1 while connected to the MQTT broker."
        )
        connected.add_metric([], 1.0 if c.bus.connected else 0.0)
        yield connected
        yield CounterMetricFamily(
            "meshopt_broker_connects", "Successful broker connections.", value=c.bus.connects
        )


def recompute_histogram(registry: CollectorRegistry) -> Histogram:
    return Histogram(
        "meshopt_controller_recompute_duration_seconds",
        "Time one recompute took (graph, all-pairs routes, policy, route sets).",
        buckets=RECOMPUTE_BUCKETS,
        registry=registry,
    )


def controller_health(
    controller: Controller, tasks: Mapping[str, asyncio.Task[Any]]
) -> tuple[bool, dict[str, Any]]:
    """Healthy while the bus and tick loops run; the body says connected and role."""
    loops = {name: "running" if not t.done() else "stopped" for name, t in tasks.items()}
    detail: dict[str, Any] = {
        "daemon": "controller",
        "mesh": controller.cfg.mesh,
        "controller": controller.cfg.id,
        "broker_connected": controller.bus.connected,
        "loops": loops,
        "role": controller.core.lease.role,
        "nodes": len(controller.core.view.nodes),
    }
    return bool(loops) and all(v == "running" for v in loops.values()), detail


def controller_registry(controller: Controller) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ControllerCollector(controller))
    return registry
