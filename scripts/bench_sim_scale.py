#!/usr/bin/env python3
"""The simulator at capacity-planning sizes (1000 and 5000 nodes); prints JSON.

For each size: ``gen:geo:n=N,seed=1``, ``--duration`` simulated seconds with one event
half way (the node that relays the most optimal routes goes down, so fail-over and the
backups are exercised), default configuration (the agents' probes every 330 ms and
0.8 s dead timer, 0.05 s ticks, recomputes at least 5 s apart above 300 nodes). Each
run is its own process (its peak RSS is the run's); the figures are medians over
``--repeat`` runs: wall seconds per simulated second, the wall time of each phase
(meshopt.sim.report.SimPerf), and peak RSS. CPU seconds per simulated second are
reported too: on a shared machine they move less with other people's load than wall
time does.

``--baseline`` also runs the engine as it was before backups were computed on demand
(at every recompute), side by side, with the same seeds; both must give the same
report (checked: ``same_report``).

    .venv/bin/python scripts/bench_sim_scale.py                      # 1000 and 5000, 3 runs
    .venv/bin/python scripts/bench_sim_scale.py --sizes 1000 --baseline
    .venv/bin/python scripts/bench_sim_scale.py --quick              # n = 200, 1 run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def busiest_relay(spec: str) -> str:
    import numpy as np

    from meshopt.graph import topology_costs
    from meshopt.routing import compute_routes
    from meshopt.topology.load import load_topology

    topo = load_topology(spec)
    opt = compute_routes(topology_costs(topo), topo.names)
    counts = np.bincount(opt.next_hop[opt.relayed()], minlength=topo.n)
    return topo.names[int(counts.argmax())]


def one(n: int, duration_s: float, seed: int, node: str, mode: str) -> dict[str, Any]:
    """One run in this process (called through ``--one``)."""
    from meshopt.sim import engine
    from meshopt.sim.events import parse_event
    from meshopt.topology.load import load_topology

    if mode == "eager":

        class Eager(engine._Backups):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                self.tables()

        engine._Backups = Eager  # type: ignore[misc]
    topo = load_topology(f"gen:geo:n={n},seed=1")
    events = [parse_event(f"at={duration_s / 2:g}s node={node} down")] if node else []
    started, cpu0 = time.perf_counter(), time.process_time()
    report = engine.simulate(topo, events, engine.SimConfig(duration_s=duration_s, seed=seed))
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu0
    phase = dict(report.perf.phase_s)
    if mode == "eager":  # its backups ran inside "routes", not inside the fail-over check
        phase["routes"] -= phase["backups"]
        phase["failover"] += phase["backups"]
    figures = report.to_dict()
    del figures["runtime_s"], figures["perf"]
    digest = hashlib.sha256(json.dumps(figures, sort_keys=True).encode()).hexdigest()[:16]
    return {
        "wall_s": wall,
        "wall_per_simulated_s": wall / duration_s,
        "cpu_per_simulated_s": cpu / duration_s,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rounds": report.perf.rounds,
        "recomputes": report.perf.recomputes,
        "backup_computations": report.perf.backup_computations,
        "phase_s": phase,
        "failovers": report.failovers,
        "route_changes": report.route_changes,
        "report_digest": digest,
    }


def measure(n: int, duration_s: float, seed: int, node: str, mode: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", str(n), str(duration_s), str(seed), node, mode]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(out.stdout)
    print(json.dumps({"nodes": n, "seed": seed, "mode": mode, **result}), file=sys.stderr)
    return result


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    med = statistics.median
    phases = {k: round(med(r["phase_s"][k] for r in runs), 3) for k in runs[0]["phase_s"]}
    return {
        "wall_per_simulated_s": round(med(r["wall_per_simulated_s"] for r in runs), 3),
        "wall_per_simulated_s_runs": [round(r["wall_per_simulated_s"], 3) for r in runs],
        "cpu_per_simulated_s": round(med(r["cpu_per_simulated_s"] for r in runs), 3),
        "phase_s": phases,
        "rss_mb": round(med(r["rss_mb"] for r in runs)),
        "rounds": runs[0]["rounds"],
        "recomputes": runs[0]["recomputes"],
        "backup_computations": [r["backup_computations"] for r in runs],
        "failovers": [r["failovers"] for r in runs],
        "route_changes": [r["route_changes"] for r in runs],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000])
    ap.add_argument("--duration", type=float, default=20.0, help="simulated seconds")
    ap.add_argument("--repeat", type=int, default=3, help="runs per size (median)")
    ap.add_argument("--baseline", action="store_true", help="also: backups every recompute")
    ap.add_argument("--no-event", action="store_true", help="no node failure half way")
    ap.add_argument("--quick", action="store_true", help="n = 200, 10 s, one run")
    ap.add_argument("--one", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        n, duration, seed, node, mode = args.one
        print(json.dumps(one(int(n), float(duration), int(seed), node, mode)))
        return 0
    sizes, duration, repeat = args.sizes, args.duration, args.repeat
    if args.quick:
        sizes, duration, repeat = [200], 10.0, 1
    modes = ["on_demand", "eager"] if args.baseline else ["on_demand"]
    results = []
    for n in sizes:
        spec = f"gen:geo:n={n},seed=1"
        node = "" if args.no_event else busiest_relay(spec)
        entry: dict[str, Any] = {
            "topology": spec,
            "nodes": n,
            "simulated_s": duration,
            "event": f"at={duration / 2:g}s node={node} down" if node else None,
        }
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
        for seed in range(repeat):  # modes interleaved: load from others hits both alike
            for mode in modes:
                runs[mode].append(measure(n, duration, seed, node, mode))
        digests = {json.dumps([r["report_digest"] for r in runs[mode]]) for mode in modes}
        for mode in modes:
            entry["backups_" + mode] = summary(runs[mode])
        if args.baseline:
            entry["same_report"] = len(digests) == 1
            on, eager = entry["backups_on_demand"], entry["backups_eager"]
            entry["speedup_cpu"] = round(
                eager["cpu_per_simulated_s"] / on["cpu_per_simulated_s"], 2
            )
        results.append(entry)
    out = {
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
            "platform": platform.platform(),
        },
        "repeat": repeat,
        "sizes": results,
    }
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
