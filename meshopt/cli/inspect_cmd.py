"""``meshopt path``, ``routes`` and ``gains``: on a topology (offline), or live from a
broker when no TOPOLOGY is given (see live_cmd.py)."""

from __future__ import annotations

import os
import sys
from dataclasses import asdict

import click

from meshopt.cli.common import (
    json_option,
    metric_from,
    need_node,
    open_topology,
    print_json,
    routing_options,
    topology_argument,
)
from meshopt.cli.live_cmd import (
    LIVE_HELP,
    live_options,
    live_path,
    live_routes,
    open_view,
    refuse_live_options,
    refuse_offline_options,
)
from meshopt.errors import InputError

EXIT_NEGATIVE = 1  # an answer that is "no": an unreachable pair (see meshopt.cli.main)

if "numpy" not in sys.modules:
    # meshopt does no BLAS work, yet OpenBLAS starts a thread per core at numpy's import
    # and spins it: ~0.04 s of CPU in a 0.2 s command. A count the user set is kept.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def need_two_nodes(a: str, b: str) -> None:
    """``path T a a`` asks nothing: say so (bad input) rather than 'unreachable'."""
    if a == b:
        raise InputError(f"A and B are the same node ({a}): a path joins two different nodes")


@click.command(
    "path",
    help="""Best path from A to B: hops, per-hop and total RTT, versus the direct tunnel.

\b
meshopt path TOPOLOGY A B    offline: the best path the topology allows
meshopt path A B             live: the path the mesh uses now, hop by hop through
                             the installed route sets, with measured RTTs
"""
    + LIVE_HELP,
)
@click.argument("args", nargs=-1, metavar="[TOPOLOGY] A B")
@routing_options
@live_options
@json_option
@click.pass_context
def path_cmd(
    ctx: click.Context,
    args: tuple[str, ...],
    symmetric: bool,
    relay_cost: str | None,
    broker: str | None,
    mesh: str | None,
    lab: str | None,
    controller_keys: tuple[str, ...],
    timeout: float,
    as_json: bool,
) -> None:
    if len(args) == 2:
        refuse_offline_options(ctx)
        need_two_nodes(args[0], args[1])
        view = open_view(broker, mesh, lab, controller_keys, timeout)
        if not live_path(view, args[0], args[1], as_json):
            ctx.exit(EXIT_NEGATIVE)
        return
    if len(args) != 3:
        raise click.UsageError(f"want TOPOLOGY A B or A B, got {len(args)} arguments")
    refuse_live_options(ctx, "TOPOLOGY")
    topology, a, b = args
    from meshopt.analysis import path_info, plan
    from meshopt.cli.render import Out, offline_path_json, render_path
    from meshopt.sim.report import json_safe

    topo = open_topology(topology)
    need_node(topo, a)
    need_node(topo, b)
    need_two_nodes(a, b)
    info = path_info(plan(topo, metric_from(relay_cost), symmetric=symmetric), a, b)
    if as_json:
        print_json(json_safe(offline_path_json(topo.name, topology, info)))
    else:
        out = Out()
        render_path(out, info)
        out.flush()
    if not info.hops:
        ctx.exit(EXIT_NEGATIVE)


@click.command(
    "routes",
    help="""The next-hop table of each node, with backup next hops.

\b
meshopt routes TOPOLOGY      offline: the routes each node would install
meshopt routes               live: the routes each node has from the controller now,
                             with the measured RTT of each path and since when
"""
    + LIVE_HELP,
)
@click.argument("topology", metavar="[TOPOLOGY]", required=False)
@click.option("--node", "nodes", multiple=True, help="Only this node (repeatable).")
@routing_options
@live_options
@json_option
@click.pass_context
def routes_cmd(
    ctx: click.Context,
    topology: str | None,
    nodes: tuple[str, ...],
    symmetric: bool,
    relay_cost: str | None,
    broker: str | None,
    mesh: str | None,
    lab: str | None,
    controller_keys: tuple[str, ...],
    timeout: float,
    as_json: bool,
) -> None:
    if topology is None:
        refuse_offline_options(ctx)
        view = open_view(broker, mesh, lab, controller_keys, timeout)
        if not live_routes(view, nodes, as_json):
            ctx.exit(EXIT_NEGATIVE)
        return
    refuse_live_options(ctx, "TOPOLOGY")
    from meshopt.analysis import node_routes, plan
    from meshopt.cli.render import Out, offline_routes_json, render_routes
    from meshopt.sim.report import json_safe

    topo = open_topology(topology)
    for name in nodes:
        need_node(topo, name)
    p = plan(topo, metric_from(relay_cost), symmetric=symmetric)
    chosen = list(dict.fromkeys(nodes)) or topo.names
    tables = {name: node_routes(p, name) for name in chosen}
    doc = offline_routes_json(topo.name, topology, tables)
    if as_json:
        print_json(json_safe(doc))
    else:
        out = Out()
        for name, entries in tables.items():
            render_routes(out, name, entries)
        out.flush()
    if doc["unreachable"]:
        ctx.exit(EXIT_NEGATIVE)


@click.command("gains")
@topology_argument
@click.option(
    "--top",
    type=click.IntRange(min=0),
    default=10,
    show_default=True,
    help="How many pairs to list.",
)
@routing_options
@json_option
def gains_cmd(
    topology: str, top: int, symmetric: bool, relay_cost: str | None, as_json: bool
) -> None:
    """Which pairs gain from relaying through other nodes, and by how much."""
    from meshopt.analysis import plan, relay_gains
    from meshopt.cli.render import Out, render_gains
    from meshopt.sim.report import json_safe

    topo = open_topology(topology)
    g = relay_gains(plan(topo, metric_from(relay_cost), symmetric=symmetric), top=top)
    if as_json:
        d = asdict(g)
        d["top"] = [{**asdict(p), "gain_ms": p.gain_ms} for p in g.top]
        print_json(json_safe(d))
    else:
        out = Out()
        render_gains(out, g, f"{topo.name}: {topo.n} nodes")
        out.flush()
