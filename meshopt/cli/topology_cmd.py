"""``meshopt topology``: check, show and convert topology files and generators."""

from __future__ import annotations

import click
import numpy as np

from meshopt.cli.common import (
    console,
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


@topology_group.command("check")
@topology_argument
@json_option
def check_cmd(topology: str, as_json: bool) -> None:
    """Load TOPOLOGY and summarise it; a bad file gets one line naming where it is wrong."""
    s = _summary(open_topology(topology))
    if as_json:
        print_json(s)
        return
    r = s["rtt_ms"]
    assert isinstance(r, dict)
    console().print(
        f"{s['name']}: {s['nodes']} nodes, {s['tunnels']} tunnels, RTT "
        f"{r['min']:.1f}/{r['median']:.1f}/{r['max']:.1f} ms (min/median/max), "
        f"{s['lossy_pairs']} lossy and {s['rate_limited_pairs']} rate-limited pairs"
        if r["min"] is not None
        else f"{s['name']}: {s['nodes']} nodes, no tunnels"
    )


@topology_group.command("convert")
@topology_argument
@click.argument("out", type=click.Path(dir_okay=False, writable=True))
@click.option("--seed", type=int, default=None, help="Seed for generators.")
def convert_cmd(topology: str, out: str, seed: int | None) -> None:
    """Write TOPOLOGY (any supported form, or a generator) as a YAML topology file."""
    topo = open_topology(topology, seed=seed)
    save_topology(topo, out)
    console().print(f"wrote {out}: {topo.n} nodes")
