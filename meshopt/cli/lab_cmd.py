"""``meshopt lab``: build, inspect, change and remove namespace labs."""

from __future__ import annotations

import os
import sys
from typing import Any

import click
from rich.table import Table

from meshopt.cli.common import console, json_option, print_json
from meshopt.errors import InputError


@click.group("lab")
def lab_group() -> None:
    """A real WireGuard mesh in network namespaces, built from a topology (needs root)."""


def _progress(msg: str) -> None:
    click.echo(f"  {msg}", err=True)


@lab_group.command("up")
@click.argument("topology", metavar="TOPOLOGY")
@click.option("--name", help="Lab name (default: the topology's name).")
@click.option(
    "--layout",
    type=click.Choice(["single", "per-peer"]),
    default="single",
    show_default=True,
    help="One WireGuard interface per node (AllowedIPs per peer) or one per peer.",
)
@click.option(
    "--underlay",
    type=click.Choice(["auto", "emulator", "netem"]),
    default="auto",
    show_default=True,
    help="How delay, jitter, loss and rate are emulated.",
)
@click.option(
    "--wireguard",
    type=click.Choice(["auto", "userspace", "kernel"]),
    default="auto",
    show_default=True,
    help="wireguard-go, or the kernel module (auto: kernel when it is loaded).",
)
@click.option("--no-broker", is_flag=True, help="Do not start mosquitto.")
@click.option(
    "--insecure-broker",
    is_flag=True,
    help="Anonymous plain MQTT instead of TLS + passwords + ACL (for debugging).",
)
@click.option(
    "--seed",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="The emulator's random draws (jitter, loss, spikes): the same seed repeats them.",
)
@json_option
def up_cmd(
    topology: str,
    name: str | None,
    layout: str,
    underlay: str,
    wireguard: str,
    no_broker: bool,
    insecure_broker: bool,
    seed: int,
    as_json: bool,
) -> None:
    """Build a lab from TOPOLOGY and leave it running (remove it with `lab down`)."""
    from meshopt.lab.lab import Lab

    click.echo(f"meshopt: building lab from {topology}", err=True)
    lab = Lab.up(
        topology,
        name=name,
        layout=layout,  # type: ignore[arg-type]
        underlay=underlay,
        wireguard=wireguard,
        broker=not no_broker,
        insecure_broker=insecure_broker,
        seed=seed,
        progress=_progress,
    )
    status = lab.status()
    if as_json:
        print_json(status)
        return
    _render_status(status)
    click.echo(f"\nrun a command in a node:  meshopt lab exec {lab.plan.name} NODE -- CMD ...")
    click.echo(f"remove it:                meshopt lab down {lab.plan.name}")


@lab_group.command("status")
@click.argument("name", required=False)
@click.option("--stats", is_flag=True, help="Include the underlay's per-pair counters.")
@click.option(
    "--graph",
    "graph_out",
    metavar="FILE.png|svg",
    help="Draw the lab's topology with its configured underlay delays.",
)
@json_option
def status_cmd(name: str | None, stats: bool, graph_out: str | None, as_json: bool) -> None:
    """List running labs, or show one lab's nodes, addresses, modes and processes."""
    from meshopt.lab.lab import Lab
    from meshopt.lab.state import all_labs

    if name is None:
        if graph_out:
            raise InputError("--graph needs a lab NAME")
        states = all_labs()
        rows = [
            {
                "name": s.name,
                "id": s.id,
                "phase": s.phase,
                "nodes": Lab.from_state(s).topo.n if s.phase == "up" else None,
                "underlay": s.underlay,
                "wireguard": s.wireguard,
                "layout": s.layout,
                "topology": s.source,
            }
            for s in states
        ]
        if as_json:
            print_json(rows)
            return
        if not rows:
            click.echo("no labs are running")
            return
        t = Table(title="labs", title_justify="left")
        for col in ("name", "id", "phase", "nodes", "underlay", "wireguard", "layout", "topology"):
            t.add_column(col)
        for r in rows:
            t.add_row(*(str(r[c]) for c in r))
        console().print(t)
        return
    lab = Lab.attach(name)
    status = lab.status(stats=stats)
    if graph_out:
        _draw(lab, graph_out)
        status["graph"] = graph_out
    if as_json:
        print_json(status)
    else:
        _render_status(status)
        if graph_out:
            click.echo(f"picture written to {graph_out}")


def _draw(lab: Any, out: str) -> None:
    from meshopt.picture import draw_mesh

    draw_mesh(lab.topo, out, title=f"lab {lab.plan.name}: configured underlay RTT")


def _render_status(s: dict[str, Any]) -> None:
    c = console()
    health = "[green]healthy[/]" if s["healthy"] else "[bold red]degraded[/]"
    c.print(
        f"lab [bold]{s['name']}[/] (id {s['id']}, {s['phase']}, {health}): "
        f"{len(s['nodes'])} nodes from {s['topology']}"
    )
    seed = f" (seed {s['seed']})" if s["underlay"] == "emulator" else ""
    c.print(
        f"underlay: {s['underlay']}{seed}   wireguard: {s['wireguard']} ({s['layout']} layout)   "
        f"overlay: {s['overlay_net']}"
    )
    b = s["broker"]
    mode = {"secure": "TLS + passwords + ACL", "insecure": "anonymous, plain"}.get(
        b.get("mode", ""), b.get("mode", "")
    )
    c.print(f"broker ({mode}): {b['address']} (nodes), {b['socket']} (this host)")
    if s.get("build_s") is not None:
        c.print(f"built in {s['build_s']:.1f} s; processes use {s['rss_mb']} MB RSS")
    if s.get("tunnel_latency_us") is not None:
        c.print(f"tunnels: {s['tunnel_latency_us']:.0f} µs a hop taken off (calibrated at up)")
    t = Table(title_justify="left")
    for col in ("node", "netns", "underlay", "overlay", "mgmt", "wireguard"):
        t.add_column(col)
    for n in s["nodes"]:
        t.add_row(
            n["name"] if n["exists"] else f"[red]{n['name']} (netns missing)[/]",
            n["netns"],
            n["underlay"],
            n["overlay"],
            n["mgmt"],
            ", ".join(n["wireguard"]),
        )
    c.print(t)
    dead = [p for p in s["processes"] if not p["alive"]]
    for p in dead:
        c.print(f"[bold red]process {p['role']} (pid {p['pid']}) is not running[/]")
    if "underlay_stats" in s:
        print_json(s["underlay_stats"])


@lab_group.command(
    "exec", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False}
)
@click.argument("name")
@click.argument("node")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def exec_cmd(name: str, node: str, command: tuple[str, ...]) -> None:
    """Run COMMAND inside NODE's namespace: meshopt lab exec NAME NODE -- CMD ..."""
    from meshopt.lab.lab import Lab

    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise InputError("nothing to run: meshopt lab exec NAME NODE -- CMD ...")
    lab = Lab.attach(name)
    argv = lab.argv(node, list(command))
    env = {**os.environ, **lab.env(node)}
    sys.stdout.flush()
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        raise InputError(f"cannot run {command[0]!r}: {exc.strerror}") from None


@lab_group.command("set")
@click.argument("name")
@click.argument("change", nargs=-1, required=True)
def set_cmd(name: str, change: tuple[str, ...]) -> None:
    """Change the underlay of a running lab, at once.

    \b
    meshopt lab set NAME a-b delay=150ms loss=2%     both directions
    meshopt lab set NAME a->b rate=5Mbit             one direction
    meshopt lab set NAME a-b down | up               cut or restore a link
    meshopt lab set NAME node=c down | up            cut or restore a node
    meshopt lab set NAME a-b spike=20 | spike=off    1 packet in 20 held 100-300 ms
    meshopt lab set NAME node=c stall=2s             stop c's processes for 2 s
    """
    from meshopt.lab.lab import Lab

    lab = Lab.attach(name)
    event = lab.set(" ".join(change))
    click.echo(f"lab {lab.plan.name}: {event.text.removeprefix('at=0 ')}")


@lab_group.command("calibrate")
@click.argument("name")
def calibrate_cmd(name: str) -> None:
    """Fit the lab's tunnel allowance to the machine as it is now.

    What wireguard-go adds to each tunnel hop moves with the machine's load. `lab up`
    fits it once; after starting or stopping other work, calibrate again so overlay
    pings read the configured RTT.
    """
    from meshopt.lab.lab import Lab

    lab = Lab.attach(name)
    cal = lab.calibrate_tunnels()
    if cal is None:
        raise InputError(
            f"lab {lab.plan.name}: nothing calibrated (netem underlay, one node, or no "
            "reply through the tunnel: see the warning above)"
        )
    click.echo(
        f"lab {lab.plan.name}: {cal.latency_us:.0f} µs a tunnel hop taken off "
        f"(measured on {cal.pair[0]}-{cal.pair[1]}, {cal.rounds} rounds, last "
        f"{cal.residual_ms:+.2f} ms)"
    )


@lab_group.command("down")
@click.argument("name", required=False)
@click.option("--all", "everything", is_flag=True, help="Every lab, and leftovers of crashes.")
def down_cmd(name: str | None, everything: bool) -> None:
    """Remove a lab: its processes, namespaces, interfaces and files, nothing else."""
    from meshopt.lab.lab import Lab, down_all

    if everything == (name is not None):
        raise InputError("give a lab NAME or --all")
    if everything:
        removed = down_all()
        click.echo("removed: " + (", ".join(removed) if removed else "nothing was running"))
        return
    assert name is not None
    lab = Lab.attach(name)
    lab.down()
    click.echo(f"lab {lab.plan.name} removed")
