"""``meshopt topology``: check, show and convert topology files and generators."""

from __future__ import annotations

import click
import numpy as np

from meshopt.cli.common import (
    json_option,
    open_topology,
    print_json,
    topology_argument,
)
from meshopt.topology.load import save_topology
from meshopt.topology.model import Topology


@click.group("topology")
def topology_group() -> None:
    """Check, show and convert topologies (files, importers, generators)."""


def _summary(topo: Topology) -> dict[str, object]:
    rtt = topo.rtt_ms()[np.triu(topo.tunnels, 1)]
    return {
        "name": topo.name,
        "source": topo.source,
        "nodes": topo.n,
        "tunnels": int(np.triu(topo.tunnels, 1).sum()),
        "rtt_ms": {
            "min": float(rtt.min()) if rtt.size else None,
            "median": float(np.median(rtt)) if rtt.size else None,
            "max": float(rtt.max()) if rtt.size else None,
        },
        "lossy_pairs": int(np.triu(np.maximum(topo.loss, topo.loss.T) > 0, 1).sum()),
        "rate_limited_pairs": int(np.triu(np.isfinite(topo.rate_mbit), 1).sum()),
    }


def _components_text(parts: list[list[str]], limit: int = 6) -> str:
    def one(part: list[str]) -> str:
        shown = ", ".join(part[:limit]) + (", ..." if len(part) > limit else "")
        return f"{{{shown}}} ({len(part)} nodes)"

    return " | ".join(one(p) for p in parts)


@topology_group.command("check")
@topology_argument
@json_option
@click.pass_context
def check_cmd(ctx: click.Context, topology: str, as_json: bool) -> None:
    """Load TOPOLOGY and summarise it; a bad file gets one line naming where it is wrong.

    Exit status 1 when the tunnels leave the mesh partitioned (some pair cannot reach
    each other even through relays); the line names the components.
    """
    topo = open_topology(topology)
    s = _summary(topo)
    parts = topo.components()
    s["connected"] = len(parts) == 1
    s["components"] = parts
    if as_json:
        print_json(s)
    else:
        r = s["rtt_ms"]
        assert isinstance(r, dict)
        click.echo(
            f"{s['name']}: {s['nodes']} nodes, {s['tunnels']} tunnels, RTT "
            f"{r['min']:.1f}/{r['median']:.1f}/{r['max']:.1f} ms (min/median/max), "
            f"{s['lossy_pairs']} lossy and {s['rate_limited_pairs']} rate-limited pairs"
            if r["min"] is not None
            else f"{s['name']}: {s['nodes']} nodes, no tunnels"
        )
        if len(parts) > 1:
            click.echo(
                f"partitioned: {len(parts)} components that cannot reach each other: "
                f"{_components_text(parts)}",
                err=True,
            )
    if len(parts) > 1:
        ctx.exit(1)


@topology_group.command("convert")
@topology_argument
@click.argument("out", type=click.Path(dir_okay=False, writable=True))
@click.option("--seed", type=click.IntRange(min=0), default=None, help="Seed for generators.")
@click.option(
    "--exact",
    is_flag=True,
    help="Keep every digit of computed delays (default: rounded to the microsecond).",
)
def convert_cmd(topology: str, out: str, seed: int | None, exact: bool) -> None:
    """Write TOPOLOGY (any supported form, or a generator) as a YAML topology file."""
    topo = open_topology(topology, seed=seed)
    save_topology(topo if exact else topo.rounded(), out)
    click.echo(f"wrote {out}: {topo.n} nodes")
