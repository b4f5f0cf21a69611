#!/usr/bin/env python3
"""Wall time of the ``meshopt`` command as people type it; prints JSON.

Each case runs as a fresh subprocess (the interpreter start and the imports are what a
user waits for), --runs times; the median is judged against the goal of issue 13:
``meshopt --help`` <= 0.3 s, offline ``routes`` and ``path`` on a 52-node RTT CSV
<= 0.6 s. The CSV (hostname-style names, fra-1 style, a,b,rtt_ms) is generated in a
temporary directory from the geo generator; nothing is written into the repository.

    .venv/bin/python scripts/bench_cli.py
    .venv/bin/python scripts/bench_cli.py --runs 5 --out cli.json
    .venv/bin/python scripts/bench_cli.py --plain-names   # names without '-' (old CLIs)
    git archive HEAD | tar -x -C /tmp/base && \
        .venv/bin/python scripts/bench_cli.py --tree /tmp/base --plain-names  # the old code
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HELP_GOAL_S = 0.3
OFFLINE_GOAL_S = 0.6


def meshopt_command(tree: str | None) -> list[str]:
    """The installed console script next to this interpreter, else ``python -m``; with
    ``tree``, the CLI of that source tree."""
    if tree is not None:
        # the editable install's finder would win over PYTHONPATH: drop it first
        shim = (
            "import sys; sys.meta_path[:] = [f for f in sys.meta_path "
            "if 'editable' not in repr(f)]; sys.path.insert(0, sys.argv.pop(1)); "
            "from meshopt.cli.main import main; sys.exit(main())"
        )
        return [sys.executable, "-c", shim, tree]
    script = Path(sys.executable).with_name("meshopt")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "meshopt.cli.main"]


def write_csv(path: Path, n: int, plain_names: bool) -> list[str]:
    """A full-mesh a,b,rtt_ms file from gen:geo (fixed seed), with host-style names."""
    sys.path.insert(0, str(ROOT))
    from meshopt.topology.generators import generate

    topo = generate(f"gen:geo:n={n},seed=7")
    rtt = topo.rtt_ms()
    sep = "" if plain_names else "-"
    names = [f"site{sep}{i}" for i in range(n)]
    lines = ["a,b,rtt_ms"]
    for i in range(n):
        for j in range(i + 1, n):
            if topo.tunnels[i, j]:
                lines.append(f"{names[i]},{names[j]},{rtt[i, j]:.3f}")
    path.write_text("\n".join(lines) + "\n")
    return names


def time_run(cmd: list[str]) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of one run; CPU barely moves with load."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    wall = time.perf_counter() - start
    if done.returncode not in (0, 1):
        err = done.stderr.decode(errors="replace").strip().splitlines()
        raise SystemExit(f"{' '.join(cmd)}: exit {done.returncode}: {err[-1:] or ''}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs per case (median reported)")
    ap.add_argument("--nodes", type=int, default=52, help="nodes in the generated CSV")
    ap.add_argument("--plain-names", action="store_true", help="names without '-'")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--tree", help="time this source tree instead (e.g. a git archive)")
    args = ap.parse_args()
    if args.runs < 1 or args.nodes < 3:
        ap.error("--runs >= 1 and --nodes >= 3")

    base = meshopt_command(args.tree)
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as tmp:
        csv = Path(tmp) / f"geo{args.nodes}.csv"
        names = write_csv(csv, args.nodes, args.plain_names)
        a, b = names[0], names[-1]
        cases: dict[str, tuple[list[str], float]] = {
            "help": (["--help"], HELP_GOAL_S),
            "routes": (["routes", str(csv)], OFFLINE_GOAL_S),
            "routes_json": (["routes", str(csv), "--json"], OFFLINE_GOAL_S),
            "path": (["path", str(csv), a, b], OFFLINE_GOAL_S),
            "path_json": (["path", str(csv), a, b, "--json"], OFFLINE_GOAL_S),
        }
        results: dict[str, Any] = {}
        for name, (argv, goal) in cases.items():
            walls, cpus = [], []
            for _ in range(args.runs):
                wall, cpu = time_run([*base, *argv])
                walls.append(wall)
                cpus.append(cpu)
            median = statistics.median(walls)
            results[name] = {
                "argv": ["meshopt", *[Path(x).name if x == str(csv) else x for x in argv]],
                "median_s": round(median, 3),
                "min_s": round(min(walls), 3),
                "max_s": round(max(walls), 3),
                "cpu_median_s": round(statistics.median(cpus), 3),
                "goal_s": goal,
                "pass": median <= goal,
            }
    report = {
        "bench": "cli",
        "runs": args.runs,
        "nodes": args.nodes,
        "command": " ".join(base[:1] + base[-1:] if args.tree else base),
        "tree": args.tree or str(ROOT),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_1m": round(os.getloadavg()[0], 2),
        "cases": results,
        "pass": all(r["pass"] for r in results.values()),
    }
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
