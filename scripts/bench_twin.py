#!/usr/bin/env python3
"""The twin benchmark (issue 14 item 5): the same topologies and events in ``meshopt
sim`` and in the lab, side by side; prints JSON. See meshopt/bench/twin.py.

    .venv/bin/python scripts/bench_twin.py --sim-only          # seconds, no root
    .venv/bin/python scripts/bench_twin.py                     # + the lab (root, minutes)
    .venv/bin/python scripts/bench_twin.py --lab-runs 3 --topologies topologies/bench8.yaml
    .venv/bin/python scripts/bench_twin.py --cpu-load 2       # the lab on a busy machine
    .venv/bin/python scripts/bench_twin.py --lab-runs 3 --save-lab lab.json
    .venv/bin/python scripts/bench_twin.py --lab-from lab.json  # a new simulator, same lab
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshopt.bench.cpuload import MAX_LOAD
from meshopt.bench.twin import TOPOLOGIES, Timeline, bench, table
from meshopt.errors import MeshoptError
from meshopt.sim.report import json_safe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sim-only", action="store_true", help="the simulator's side only")
    ap.add_argument(
        "--topologies",
        nargs="+",
        help="default: bench8, demo and the 16-node mesh; with --lab-from, those it holds",
    )
    ap.add_argument(
        "--seeds",
        type=int,
        default=10,
        help="simulated runs per topology (the median is its prediction)",
    )
    ap.add_argument("--lab-runs", type=int, default=1, help="lab runs per topology")
    ap.add_argument("--jitter-s", type=float, default=60.0, help="length of the jitter period")
    ap.add_argument("--logs", type=Path, help="keep each lab run's logs and readings here")
    ap.add_argument(
        "--save-lab",
        type=Path,
        metavar="FILE",
        help="write the lab runs here (after each topology), for --lab-from",
    )
    ap.add_argument(
        "--lab-from",
        type=Path,
        metavar="FILE",
        help="judge the simulator against lab runs saved by --save-lab; runs no lab",
    )
    ap.add_argument(
        "--cpu-load",
        type=int,
        default=0,
        metavar="N",
        help="N busy processes (a core each) beside every lab run, as a shared VM has",
    )
    args = ap.parse_args()
    if not 0 <= args.cpu_load <= MAX_LOAD:
        ap.error(f"--cpu-load {args.cpu_load}: give 0..{MAX_LOAD} busy processes")
    tl = Timeline(jitter_s=args.jitter_s)
    recorded = None
    if args.lab_from is not None:
        if args.sim_only:
            ap.error("--lab-from and --sim-only: give one")
        try:
            saved = json.loads(args.lab_from.read_text())
            recorded, args.cpu_load = saved["runs"], int(saved["cpu_load"])
            args.lab_runs = max(len(v) for v in recorded.values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            ap.error(f"--lab-from {args.lab_from}: not a file --save-lab wrote ({e})")
    if args.topologies is None:
        args.topologies = list(recorded) if recorded is not None else list(TOPOLOGIES)

    def record(runs: dict[str, list[dict[str, Any]]]) -> None:
        if args.save_lab is not None:
            text = json.dumps(json_safe({"cpu_load": args.cpu_load, "runs": runs}))
            args.save_lab.write_text(text)

    try:
        out = bench(
            tuple(args.topologies),
            sim_only=args.sim_only,
            seeds=args.seeds,
            lab_runs=args.lab_runs,
            timeline=tl,
            progress=lambda m: print(m, file=sys.stderr, flush=True),
            logs=args.logs,
            cpu_load_n=args.cpu_load,
            recorded=recorded,
            record=record,
        )
    except MeshoptError as e:
        print(f"bench_twin: {e}", file=sys.stderr)
        return 2
    print(json.dumps(json_safe(out), indent=1))
    if not args.sim_only:
        print(table(out), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
