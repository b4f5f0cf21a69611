#!/usr/bin/env python3
"""Benchmark the offline simulator on generated geographic meshes; prints JSON.

For each size: ``gen:geo:n=N,seed=1`` (the same mesh ``meshopt sim`` builds),
``--duration`` of simulated time with one event half way through (the node
that relays the most optimal routes goes down), default configuration (probe
every 250 ms, recompute every 1 s, or 5 s above 300 nodes). Reported: wall
time of the whole run (topology generation excluded), wall seconds per
simulated second, and the figures of the report a user would look at.

    .venv/bin/python scripts/bench_sim.py                 # n = 100, 300, 1000; 60 s each
    .venv/bin/python scripts/bench_sim.py --sizes 1000 --duration 120
    .venv/bin/python scripts/bench_sim.py --quick         # n = 50, 20 s (a smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshopt.graph import topology_costs
from meshopt.routing import compute_routes
from meshopt.sim.engine import SimConfig, simulate
from meshopt.sim.events import parse_event
from meshopt.topology.load import load_topology


def busiest_relay(spec: str) -> str:
    topo = load_topology(spec)
    opt = compute_routes(topology_costs(topo), topo.names)
    counts = np.bincount(opt.next_hop[opt.relayed()], minlength=topo.n)
    return topo.names[int(counts.argmax())]


def run(n: int, duration_s: float, seed: int) -> dict[str, Any]:
    spec = f"gen:geo:n={n},seed=1"
    topo = load_topology(spec)
    at = duration_s / 2
    hub = busiest_relay(spec)
    event = parse_event(f"at={at:g}s node={hub} down")
    started = time.perf_counter()
    report = simulate(topo, [event], SimConfig(duration_s=duration_s, seed=seed))
    wall = time.perf_counter() - started
    (ev,) = report.events
    return {
        "topology": spec,
        "nodes": n,
        "routes": n * (n - 1),
        "simulated_s": duration_s,
        "wall_s": round(wall, 2),
        "wall_per_simulated_s": round(wall / duration_s, 3),
        "recompute_s": SimConfig().recompute_gap(n),
        "initial_converge_s": report.initial_converge_s,
        "initial_suboptimal_routes": report.initial_suboptimal_pairs,
        "relayed_pairs": report.gains.relayed,
        "improved_pairs": report.gains.improved,
        "event": ev.event,
        "event_broken_routes": ev.broken_pairs,
        "event_outage_s": ev.outage_s,
        "event_converge_s": ev.converge_s,
        "route_changes": report.route_changes,
        "failovers": report.failovers,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 300, 1000])
    ap.add_argument("--duration", type=float, default=60.0, help="simulated seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="n = 50 for 20 s")
    args = ap.parse_args()
    sizes, duration = ([50], 20.0) if args.quick else (args.sizes, args.duration)
    out = {
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "runs": [run(n, duration, args.seed) for n in sizes],
    }
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
