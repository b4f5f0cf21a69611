#!/usr/bin/env python3
"""CPU time of the numba kernels for backups and reduce_paths against the numpy code.

On a geographic full mesh (``gen:geo:n=N``, the controller's shape): every row of
backup next hops (``backup_next_hops``, the O(n^3) part of ``add_backups``; and
``add_backups`` whole, with its input checks), and ``reduce_paths`` "sum" and "min"
over the route table. These are the public functions; the numpy runs set
``compiled.COMPILED_MIN_N`` above n. Old (numpy) and new (kernel) run alternately in
the same process, so load on the shared machine hits both alike; the first call of
each is left out (numba compiling or loading its cache). Each figure is the median
of ``--repeat`` CPU times (``time.process_time``, one core: thread pools pinned to
one thread). "identical": both gave the same array (np.array_equal).

    PYTHONPATH=. .venv/bin/python scripts/bench_kernels.py --n 1000 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshopt.routing import compiled
from meshopt.routing.allpairs import compute_routes
from meshopt.routing.backup import add_backups, backup_inputs, backup_next_hops
from meshopt.routing.tables import reduce_paths
from meshopt.topology.generators import generate


def cpu(fn: Callable[[], object]) -> tuple[float, object]:
    """(CPU seconds, result) of one call."""
    t0 = time.process_time()
    out = fn()
    return time.process_time() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not compiled.warm_up():
        sys.exit("numba unavailable: nothing to compare")
    cost = generate(f"gen:geo:n={args.n},seed={args.seed}").rtt_ms()
    relay = 2.0
    tables = compute_routes(cost, relay_hop_ms=relay)
    dist, weights = backup_inputs(tables, cost, relay_hop_ms=relay)
    nh = tables.next_hop
    n = nh.shape[0]
    edge = np.where(np.isfinite(cost), cost + relay, np.inf)
    np.fill_diagonal(edge, 0.0)
    bw = np.where(np.eye(n, dtype=bool), np.inf, np.maximum(1000.0 - cost, 1.0))
    numpy_only = 10**9  # COMPILED_MIN_N above any mesh: the public functions use numpy

    def public(fn: Callable[[], object], kernel: bool) -> Callable[[], object]:
        """``fn`` (a public routing function) with the kernels on or off."""

        def run() -> object:
            saved = compiled.COMPILED_MIN_N
            compiled.COMPILED_MIN_N = saved if kernel else numpy_only
            try:
                return fn()
            finally:
                compiled.COMPILED_MIN_N = saved

        return run

    def both(fn: Callable[[], object]) -> tuple[Callable[[], object], Callable[[], object]]:
        return public(fn, False), public(fn, True)

    cases: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "backup_next_hops": both(lambda: backup_next_hops(dist, weights, nh)),
        "add_backups": both(lambda: add_backups(tables, cost, relay_hop_ms=relay).backup),
        "reduce_paths_sum": both(lambda: reduce_paths(nh, edge, "sum")),
        "reduce_paths_min": both(lambda: reduce_paths(nh, bw, "min")),
    }
    report: dict[str, object] = {"n": n, "repeat": args.repeat, "load_before": os.getloadavg()}
    for name, (old, new) in cases.items():
        a, b = old(), new()  # first calls: not timed
        same = isinstance(b, np.ndarray) and np.array_equal(a, b)  # type: ignore[arg-type]
        t_old: list[float] = []
        t_new: list[float] = []
        for _ in range(args.repeat):
            t_old.append(cpu(old)[0])
            t_new.append(cpu(new)[0])
        mo, mn = statistics.median(t_old), statistics.median(t_new)
        report[name] = {
            "numpy_s": round(mo, 4),
            "kernel_s": round(mn, 4),
            "speedup": round(mo / mn, 2),
            "identical": bool(same),
            "numpy_runs": [round(x, 4) for x in t_old],
            "kernel_runs": [round(x, 4) for x in t_new],
        }
    report["load_after"] = os.getloadavg()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
