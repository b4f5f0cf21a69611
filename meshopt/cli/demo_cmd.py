"""``meshopt demo``: the closed loop on a live namespace mesh (needs root)."""

from __future__ import annotations

import os
import signal
from types import FrameType
from typing import Literal

import click
from rich.table import Table

from meshopt.cli.common import console, json_option, print_json
from meshopt.errors import InputError
from meshopt.policy import PolicyConfig
from meshopt.topologies import packaged, resolve

DEFAULT_TOPOLOGY = str(packaged("demo.yaml"))  # shipped in the package: found when installed


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


@click.command("demo")
@click.argument("topology", required=False, metavar="[TOPOLOGY]")
@click.option(
    "--layout",
    type=click.Choice(["single", "per-peer"]),
    default="single",
    show_default=True,
    help="One WireGuard interface per node, or one per tunnel.",
)
@click.option("--name", default="demo", show_default=True, help="Lab name.")
@click.option(
    "--insecure-broker",
    is_flag=True,
    help="Anonymous plain MQTT instead of TLS + passwords + ACL (for debugging).",
)
@json_option
def demo_cmd(
    topology: str | None,
    layout: Literal["single", "per-peer"],
    name: str,
    insecure_broker: bool,
    as_json: bool,
) -> None:
    """Build a live mesh, let meshopt route it, and measure the result with pings.

    Agents probe, publish and install; the controller computes and signs. The report
    compares, per pair, the direct tunnel, what pings achieve through the installed
    routes, and the optimum; then a link is made five times slower and the busiest
    relay is stopped, and the time each took to route around is reported.
    """
    if os.geteuid() != 0:
        raise InputError("meshopt demo needs root (network namespaces, TUN devices)")
    from meshopt.demo import run_demo

    spec = resolve(topology) if topology else DEFAULT_TOPOLOGY
    out = console()
    err = console(stderr=True)

    # An interrupt is remembered as well as raised: one that lands in a library's import
    # can be swallowed (Cython's module init ignores errors while it registers its ABCs;
    # a Ctrl-C during numpy.random's first import went unseen and the demo ran on), so
    # every progress step raises it again until the demo tears down.
    interrupted: list[int] = []

    def on_signal(sig: int, _frame: FrameType | None) -> None:
        interrupted.append(sig)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, on_signal)
    with err.status("starting") as status:

        def progress(msg: str) -> None:
            if interrupted and msg != "tearing down":
                raise KeyboardInterrupt
            status.update(msg)
            if not msg.startswith("converging"):
                err.log(msg)

        report = run_demo(
            spec, name=name, layout=layout, progress=progress, insecure_broker=insecure_broker
        )
    if interrupted:
        raise KeyboardInterrupt
    if as_json:
        print_json(report.to_json())
        return
    conv = report.converged_s
    good, total = report.on_optimum
    out.print(
        f"[bold]{report.topology}[/]: {len(report.nodes)} nodes, {report.layout} layout; "
        + (
            f"all {total} routes on a path the anti-flap policy keeps (within 5 % of the "
            f"optimum's cost, or less than its {PolicyConfig().abs_margin_ms:g} ms margin) "
            f"{conv:.1f} s after the agents started"
            if conv is not None
            else f"{good}/{total} routes on their optimum (not converged)"
        )
    )
    table = Table(title="RTT per pair (ms): direct tunnel, achieved through meshopt's routes")
    for col in ("pair", "direct", "achieved", "optimum", "path now"):
        table.add_column(col, justify="left" if col in ("pair", "path now") else "right")
    for p in report.quality:
        if p.src > p.dst:
            continue
        relayed = len(p.path) > 2
        style = "bold green" if relayed else ""
        table.add_row(
            f"{p.src}-{p.dst}",
            _ms(p.direct_ms),
            _ms(p.achieved_ms),
            _ms(p.optimum_ms),
            " → ".join(p.path),
            style=style,
        )
    out.print(table)
    d = report.degradation
    if d is not None:
        a, b = d.link
        took = f"{d.reroute_s:.2f} s" if d.reroute_s is not None else "never (within 15 s)"
        out.print(
            f"{a}-{b} made 5x slower ({d.before_ms:.0f} → {d.direct_after_ms:.0f} ms RTT): "
            f"pings took {' → '.join(d.better_path)} ({d.better_ms:.0f} ms) after [bold]{took}[/]"
        )
    f = report.failure
    if f is not None and f.pair is not None:
        a, b = f.pair
        took = f"{f.outage_s:.2f} s" if f.outage_s is not None else "never (within 15 s)"
        ok = sum(f.reachable.values())
        out.print(
            f"relay {f.node} stopped: {a}->{b} got through again after [bold]{took}[/]; "
            f"{ok}/{len(f.reachable)} other affected pairs reachable"
        )
    out.print(f"demo finished in {report.wall_s:.0f} s; everything torn down")
