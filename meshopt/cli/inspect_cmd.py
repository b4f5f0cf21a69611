"""``meshopt path``, ``routes`` and ``gains`` on a topology (offline)."""

from __future__ import annotations

from dataclasses import asdict

import click

from meshopt.analysis import node_routes, path_info, plan, relay_gains
from meshopt.cli.common import (
    console,
    json_option,
    metric_from,
    need_node,
    open_topology,
    print_json,
    routing_options,
    topology_argument,
)
from meshopt.cli.render import render_gains, render_path, render_routes
from meshopt.sim.report import json_safe


@click.command("path")
@topology_argument
@click.argument("a")
@click.argument("b")
@routing_options
@json_option
def path_cmd(
    topology: str, a: str, b: str, symmetric: bool, relay_cost: str, as_json: bool
) -> None:
    """Best path from A to B: hops, per-hop and total RTT, versus the direct tunnel."""
    topo = open_topology(topology)
    need_node(topo, a)
    need_node(topo, b)
    info = path_info(plan(topo, metric_from(relay_cost), symmetric=symmetric), a, b)
    if as_json:
        print_json(json_safe({**asdict(info), "relays": info.relays, "gain_ms": info.gain_ms}))
    else:
        render_path(console(), info)


@click.command("routes")
@topology_argument
@click.option("--node", "nodes", multiple=True, help="Only this node (repeatable).")
@routing_options
@json_option
def routes_cmd(
    topology: str, nodes: tuple[str, ...], symmetric: bool, relay_cost: str, as_json: bool
) -> None:
    """The next-hop table each node would install, with backup next hops."""
    topo = open_topology(topology)
    for name in nodes:
        need_node(topo, name)
    p = plan(topo, metric_from(relay_cost), symmetric=symmetric)
    chosen = list(nodes) or topo.names
    tables = {name: node_routes(p, name) for name in chosen}
    if as_json:
        print_json(json_safe({k: [asdict(e) for e in v] for k, v in tables.items()}))
        return
    c = console()
    for name, entries in tables.items():
        render_routes(c, name, entries)


@click.command("gains")
@topology_argument
@click.option("--top", default=10, show_default=True, help="How many pairs to list.")
@routing_options
@json_option
def gains_cmd(topology: str, top: int, symmetric: bool, relay_cost: str, as_json: bool) -> None:
    """Which pairs gain from relaying through other nodes, and by how much."""
    topo = open_topology(topology)
    g = relay_gains(plan(topo, metric_from(relay_cost), symmetric=symmetric), top=top)
    if as_json:
        d = asdict(g)
        d["top"] = [{**asdict(p), "gain_ms": p.gain_ms} for p in g.top]
        print_json(json_safe(d))
    else:
        render_gains(console(), g, f"{topo.name}: {topo.n} nodes")
