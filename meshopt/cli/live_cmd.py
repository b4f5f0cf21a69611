"""The live forms of ``routes`` and ``path``, and ``graph``: what a running mesh does now.

They read the retained messages of one mesh from its broker (see meshopt/live.py):
route sets as the controller published them, telemetry as the agents measured. The
offline forms (with a TOPOLOGY) live in inspect_cmd.py.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import click

from meshopt.cli.common import F, json_option, print_json, routing_options
from meshopt.errors import InputError, UnavailableError

if TYPE_CHECKING:
    from meshopt.live import LiveView

DEFAULT_BROKER = "mqtt://127.0.0.1:1883"
# Broker credentials, kept out of the commands' signatures (five commands share
# live_options): click stores them in ctx.meta, open_view takes them from there.
TLS_PARAMS = ("ca_file", "cert_file", "key_file", "username", "password_file")
LIVE_PARAMS = ("broker", "mesh", "lab", "controller_keys", "timeout", *TLS_PARAMS)
_META = "meshopt.broker_credentials"

LIVE_HELP = """
Live form (no TOPOLOGY): read the mesh's retained route sets and telemetry from its
broker. --broker mqtt://host:port, mqtts://host:port (TLS) or unix:///path (default
$MESHOPT_BROKER, else mqtt://127.0.0.1:1883), with --ca-file, --cert-file, --key-file,
--username, --password-file for a secured broker (defaults $MESHOPT_BROKER_CA_FILE, ...);
--mesh NAME (default $MESHOPT_MESH, else the only mesh on the broker); --lab NAME takes
all of it from a running `meshopt lab` (as its reader). Route sets are shown unverified
unless --controller-key is given.
"""


def _keep_credential(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value and param.name:
        ctx.meta.setdefault(_META, {})[param.name] = value


def live_options(f: F) -> F:
    for name, metavar, what in reversed(
        (
            ("ca_file", "FILE", "the broker's CA certificate (mqtts://; default: system CAs)"),
            ("cert_file", "FILE", "client certificate (mqtts://)"),
            ("key_file", "FILE", "its private key"),
            ("username", "NAME", "user name on the broker"),
            ("password_file", "FILE", "file whose first line is the password"),
        )
    ):
        f = click.option(
            "--" + name.replace("_", "-"),
            name,
            envvar="MESHOPT_BROKER_" + name.upper(),
            metavar=metavar,
            expose_value=False,
            callback=_keep_credential,
            help=f"Live: {what}.",
        )(f)
    f = click.option(
        "--timeout",
        type=float,
        default=5.0,
        show_default=True,
        help="Live: seconds to wait for the broker.",
    )(f)
    f = click.option(
        "--controller-key",
        "controller_keys",
        multiple=True,
        metavar="KEY",
        help="Live: verify route sets against this controller public key (base64 or a "
        "file; repeatable). Sets that do not verify are left out with a warning.",
    )(f)
    f = click.option(
        "--lab", metavar="NAME", help="Live: the broker and mesh of this running lab."
    )(f)
    f = click.option(
        "--mesh", envvar="MESHOPT_MESH", metavar="NAME", help="Live: the mesh to read."
    )(f)
    f = click.option(
        "--broker",
        envvar="MESHOPT_BROKER",
        metavar="URL",
        help=f"Live: mqtt[s]://host:port or unix:///path [default: {DEFAULT_BROKER}]",
    )(f)
    return f


def refuse_live_options(ctx: click.Context, what: str) -> None:
    """The offline form takes no broker options: say so instead of ignoring them."""
    given = [
        p
        for p in LIVE_PARAMS
        if ctx.get_parameter_source(p) == click.core.ParameterSource.COMMANDLINE
    ]
    if given:
        opts = ", ".join("--" + p.replace("_", "-").removesuffix("s") for p in given)
        raise InputError(f"{opts}: only for the live form (without {what})")


def refuse_offline_options(ctx: click.Context) -> None:
    """The live form reads the routes the controller chose: routing options do not apply."""
    given = [
        p
        for p in ("symmetric", "relay_cost")
        if ctx.get_parameter_source(p) == click.core.ParameterSource.COMMANDLINE
    ]
    if given:
        opts = ", ".join("--" + p.replace("_", "-") for p in given)
        raise InputError(f"{opts}: only for the offline form (with a TOPOLOGY)")


def open_view(
    broker: str | None,
    mesh: str | None,
    lab: str | None,
    controller_keys: Sequence[str],
    timeout: float,
) -> LiveView:
    from meshopt.bus.client import BrokerSettings, check_broker_settings
    from meshopt.live import read_view

    ctx = click.get_current_context(silent=True)
    given: dict[str, str] = dict(ctx.meta.get(_META, {})) if ctx is not None else {}
    if lab is not None:
        from meshopt.lab.lab import Lab
        from meshopt.lab.state import LabError

        try:
            attached = Lab.attach(lab)
        except LabError as exc:
            raise UnavailableError(str(exc)) from None
        settings = attached.host_broker_settings("reader")
        if mesh is not None and mesh != attached.plan.name:
            raise InputError(f"lab {lab} runs mesh {attached.plan.name}, not {mesh}")
        mesh = attached.plan.name
    else:
        settings = BrokerSettings(url=broker or DEFAULT_BROKER, **given)
    if timeout <= 0:
        raise InputError("--timeout must be positive")
    check_broker_settings(settings, where="--")
    keys: list[str] = list(controller_keys)
    if keys:
        from meshopt.bus.signing import load_public_key

        for k in keys:
            load_public_key(k)  # a bad key is a clear error now, not "nothing verified"

    def warn(line: str) -> None:
        click.echo(f"meshopt: warning: {line}", err=True)

    return read_view(settings, mesh, trusted_keys=keys, timeout_s=timeout, warn=warn)


def _need_node(view: LiveView, name: str, *, routes: bool = False) -> None:
    known = sorted(view.route_sets) if routes else view.nodes
    if name not in known:
        what = "with a route set " if routes else ""
        raise InputError(f"no node {name!r} {what}in mesh {view.mesh} (nodes: {', '.join(known)})")


def live_routes(view: LiveView, nodes: Sequence[str], as_json: bool) -> bool:
    """Print the route sets; False when a route does not arrive (exit status 1)."""
    import msgspec

    from meshopt.cli.render import Out, live_routes_json, render_live_routes
    from meshopt.sim.report import json_safe

    for name in nodes:
        _need_node(view, name, routes=True)
    chosen = list(dict.fromkeys(nodes)) or sorted(view.route_sets)
    tables = {n: r for n in chosen if (r := view.routes(n)) is not None}
    lease = None if view.lease is None else msgspec.structs.asdict(view.lease)
    doc = live_routes_json(view, tables, lease)
    if as_json:
        print_json(json_safe(doc))
    else:
        out = Out()
        for r in tables.values():
            render_live_routes(out, r)
        out.flush()
    return not doc["unreachable"]


def live_path(view: LiveView, a: str, b: str, as_json: bool) -> bool:
    """Print the path the route sets give; False when it does not arrive (exit status 1)."""
    from meshopt.cli.render import Out, live_path_json, render_live_path
    from meshopt.sim.report import json_safe

    _need_node(view, a)
    _need_node(view, b)
    p = view.path(a, b)
    if as_json:
        print_json(json_safe(live_path_json(view, p)))
    else:
        out = Out()
        render_live_path(out, p)
        out.flush()
    return p.complete


@click.command(
    "graph",
    help="""Picture of a mesh: tunnels labelled with RTTs, relay routes drawn in colour.

\b
meshopt graph TOPOLOGY --out x.svg   offline: the configured RTTs and the relay
                                     routes meshopt would choose
meshopt graph --out x.svg            live: measured RTTs and the installed routes
"""
    + LIVE_HELP,
)
@click.argument("topology", metavar="[TOPOLOGY]", required=False)
@click.option(
    "--out",
    required=True,
    metavar="FILE",
    help="Picture to write: mesh.svg or mesh.png (by the suffix).",
)
@routing_options
@live_options
@json_option
@click.pass_context
def graph_cmd(
    ctx: click.Context,
    topology: str | None,
    out: str,
    symmetric: bool,
    relay_cost: str | None,
    broker: str | None,
    mesh: str | None,
    lab: str | None,
    controller_keys: tuple[str, ...],
    timeout: float,
    as_json: bool,
) -> None:
    from meshopt.picture import check_picture_path

    check_picture_path(out)
    if topology is not None:
        refuse_live_options(ctx, "TOPOLOGY")
        _offline_graph(topology, out, symmetric, relay_cost, as_json)
        return
    refuse_offline_options(ctx)
    from meshopt.picture import draw_mesh
    from meshopt.sim.report import json_safe

    view = open_view(broker, mesh, lab, controller_keys, timeout)
    topo, labels = view.picture_inputs()
    relays = view.relay_paths()
    down = sorted(n for n, s in view.status.items() if not s.online and n in view.telemetry)
    newest = max(rs.issued_at for rs in view.route_sets.values())
    controllers = sorted({rs.controller for rs in view.route_sets.values()})
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(newest))
    title = (
        f"mesh {view.mesh}: measured RTT, relay routes in colour "
        f"(route sets from {', '.join(controllers)}, newest {stamp})"
    )
    draw_mesh(topo, out, edge_label_ms=labels, relay_paths=relays, down_nodes=down, title=title)
    if as_json:
        edges = [
            {
                "a": a,
                "b": b,
                "rtt_ms": view.measured_rtt(a, b),
                "rtt_back_ms": view.measured_rtt(b, a),
            }
            for a, b in topo.tunnel_pairs()
        ]
        print_json(
            json_safe(
                {
                    "source": "live",
                    "mesh": view.mesh,
                    "out": out,
                    "nodes": topo.names,
                    "down": down,
                    "relay_paths": relays,
                    "tunnels": edges,
                    "warnings": view.warnings,
                }
            )
        )
        return
    shown = "; ".join(" → ".join(p) for p in relays) or "none"
    click.echo(f"picture written to {out}: {topo.n} nodes, relay paths: {shown}")


def _offline_graph(
    topology: str, out: str, symmetric: bool, relay_cost: str | None, as_json: bool
) -> None:
    """Draw a topology file with the relay routes the offline ``routes`` would give."""
    from meshopt.analysis import plan, relay_paths
    from meshopt.cli.common import metric_from, open_topology
    from meshopt.picture import draw_mesh
    from meshopt.sim.report import json_safe

    topo = open_topology(topology)
    p = plan(topo, metric_from(relay_cost), symmetric=symmetric)
    relays = relay_paths(p)
    draw_mesh(
        topo,
        out,
        relay_paths=relays,
        title=f"{topo.name}: configured RTT, relay routes in colour",
    )
    if as_json:
        rtt = topo.rtt_ms()
        edges = [
            {"a": a, "b": b, "rtt_ms": float(rtt[topo.index(a), topo.index(b)])}
            for a, b in topo.tunnel_pairs()
        ]
        print_json(
            json_safe(
                {
                    "source": "offline",
                    "mesh": topo.name,
                    "topology": topology,
                    "out": out,
                    "nodes": topo.names,
                    "down": [],
                    "relay_paths": relays,
                    "tunnels": edges,
                    "warnings": [],
                }
            )
        )
        return
    shown = "; ".join(" → ".join(r) for r in relays) or "none"
    click.echo(f"picture written to {out}: {topo.n} nodes, relay paths: {shown}")
