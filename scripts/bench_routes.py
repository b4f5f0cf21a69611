#!/usr/bin/env python3
"""Benchmark the route engine on synthetic geographic full meshes; prints JSON.

Self-contained on purpose (numpy only for the input): nodes are uniform random
points on a sphere, link RTT = great-circle fibre delay × a path-inflation
factor (1.2–3, and 2–5 for one pair in ten) + both ends' access delay, with a
few per-cent of per-direction measurement noise. Bandwidths (for widest paths)
follow an access-capacity model: link = min(capacity of both ends) × 0.3–1.

Measured per size: all-pairs next hops with the backend (median/min of
--repeat runs), the networkx reference side by side where it is affordable
(runs alternate, so load on the machine hits both alike), symmetric mode and its
AllowedIPs check, backups and widest paths; then single-link incremental updates
at the largest size against a full recompute of the same matrix.

Every timing is CPU time of this process on one core (``time.process_time``;
numpy/scipy thread pools are pinned to one thread unless OMP_NUM_THREADS etc.
are set): "median", "min" and "runs" are CPU seconds, "wall_median" and
"wall_runs" the wall-clock seconds of the same runs. On a shared, busy machine
wall time measures the neighbours as much as the code; CPU time does not (it
still rises a little under load: caches and memory bandwidth are shared).
"meta" records the load average before and after. Targets (CPU time, one core):
n=1000 ≤ 1 s, ≥100× networkx at n=200, incremental ≤ 50 ms median at n=1000.

From ``COMPILED_MIN_N`` (256) nodes compute_routes runs the numba kernel
(meshopt/routing/compiled.py); each size says which backend ran ("backend") and,
for the numba sizes, times the scipy path alternately beside it ("routes_scipy_s",
"speedup_vs_scipy"). The kernel is warmed up (imported, compiled or loaded from
numba's cache) before anything is timed, and that one-off cost is reported apart:
"meta.warm_up_s" in this process, and "compile" from two fresh processes sharing
an empty cache directory, the first compiling ("first_call_compile_s"), the second
loading what the first cached ("first_call_cached_s"), each after "import_numba_s".

Measured 2026-11-27 on the 2-core VM shared with other work, three runs of
``scripts/bench_routes.py --out bench.json`` (numba 0.68.1) at 05:19, 05:35 and
05:49 UTC (load average 3.5-3.8, 4.9-5.2, 2.2-1.8; the last two with the compiled
path sums): n=1000 0.59 / 0.63 / 0.67 s CPU median (single runs 0.51-0.83 s), the
scipy path beside it 1.06 / 1.57 / 1.32 s; n=500 0.089 / 0.112 / 0.083 s (scipy
0.134 / 0.232 / 0.140 s); n=200 170x / 149x / 245x networkx (scipy path, below the
threshold); incremental 0.43 / 0.40 / 0.49 ms median at n=1000. One-off per
process: numba's import 0.36-0.55 s, then the first call 1.7 / 3.5 / 3.7 s compiling
(empty cache) or 0.53 / 0.54 / 0.57 s loading the cache.

    .venv/bin/python scripts/bench_routes.py --out bench.json
    .venv/bin/python scripts/bench_routes.py --quick
    .venv/bin/python scripts/bench_routes.py --baseline old.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# One core: thread pools are sized when numpy loads, so pin them before that.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import networkx as nx
import numpy as np
import numpy.typing as npt
import scipy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshopt.routing import (
    IncrementalRoutes,
    add_backups,
    allowed_ips_consistent,
    compiled,
    compute_routes,
    dense,
    reference_routes,
    widest_routes,
)

FloatArray = npt.NDArray[np.float64]
EARTH_KM = 6371.0
FIBRE_KM_PER_MS = 200.0
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def geo_mesh(n: int, rng: np.random.Generator) -> FloatArray:
    """Full-mesh link costs (ms) from random points on a sphere."""
    p = rng.normal(size=(n, 3))
    p /= np.linalg.norm(p, axis=1, keepdims=True)
    km = np.arccos(np.clip(p @ p.T, -1.0, 1.0)) * EARTH_KM
    inflation = rng.uniform(1.2, 3.0, (n, n))
    detour = rng.random((n, n)) < 0.1
    inflation[detour] = rng.uniform(2.0, 5.0, int(detour.sum()))
    inflation = np.triu(inflation, 1)
    inflation += inflation.T
    access = rng.uniform(0.5, 5.0, n)
    rtt = 2.0 * km / FIBRE_KM_PER_MS * inflation + access[:, None] + access[None, :]
    cost = rtt * rng.uniform(0.97, 1.03, (n, n))
    np.fill_diagonal(cost, 0.0)
    return cost


def access_bandwidth(n: int, rng: np.random.Generator) -> FloatArray:
    """Mbit/s: node capacities log-uniform 10 Mbit–10 Gbit, links below both ends."""
    cap = 10.0 ** rng.uniform(1.0, 4.0, n)
    bw = np.minimum(cap[:, None], cap[None, :]) * rng.uniform(0.3, 1.0, (n, n))
    return np.asarray(bw, dtype=np.float64)


def summary(cpu: list[float], wall: list[float]) -> dict[str, Any]:
    """CPU-time median/min/runs (what targets use) beside the wall-clock runs."""
    return {
        "median": statistics.median(cpu),
        "min": min(cpu),
        "runs": cpu,
        "wall_median": statistics.median(wall),
        "wall_runs": wall,
    }


def timed_many(
    fns: list[Callable[[], object]], repeat: int, budget_s: float
) -> list[dict[str, Any]]:
    """Run each of ``fns`` in turn, ``repeat`` rounds (fewer once ``budget_s`` is spent).

    Alternating the functions makes a load spike on the machine fall on all
    of them, so their ratios hold even when the absolute times move.
    """
    cpu: list[list[float]] = [[] for _ in fns]
    wall: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for k, fn in enumerate(fns):
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            cpu[k].append(time.process_time() - c0)
            wall[k].append(time.perf_counter() - w0)
        if sum(sum(w) for w in wall) > budget_s:
            break
    return [summary(c, w) for c, w in zip(cpu, wall, strict=True)]


def timed(fn: Callable[[], object], repeat: int, budget_s: float) -> dict[str, Any]:
    """Run ``fn`` up to ``repeat`` times (fewer once ``budget_s`` is spent)."""
    return timed_many([fn], repeat, budget_s)[0]


def to_graph(cost: FloatArray) -> nx.DiGraph:
    n = cost.shape[0]
    names = [str(i) for i in range(n)]
    g = nx.DiGraph(nodes=names)
    g.add_nodes_from(names)
    a, b = np.nonzero(np.isfinite(cost) & ~np.eye(n, dtype=bool))
    g.add_weighted_edges_from(
        ((names[i], names[j], float(cost[i, j])) for i, j in zip(a, b, strict=True)),
        weight="cost",
    )
    return g


def backend(n: int) -> str:
    """Which all-pairs path compute_routes takes for an n-node mesh here."""
    if compiled.use_compiled(n, None) and compiled.available():
        return "numba"
    return "numpy" if dense.small(n) else "scipy"


_FIRST_CALL = """
import json, sys, time
t0 = time.process_time()
import numba
t1 = time.process_time()
from meshopt.routing import compiled
ok = compiled.warm_up()
t2 = time.process_time()
print(json.dumps({"ok": ok, "import_numba_s": t1 - t0, "first_call_s": t2 - t1}))
"""


def compile_cost() -> dict[str, Any]:
    """CPU seconds of the kernel's one-off costs, in fresh processes and a fresh cache.

    The first process compiles (the cache directory is empty), the second loads
    what the first wrote: what a controller pays once per machine, once per start.
    """
    if not compiled.available():
        return {"skipped": "numba not installed"}
    root = str(Path(__file__).resolve().parent.parent)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-routes-numba-") as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache, "PYTHONPATH": root}
        for _ in range(2):
            proc = subprocess.run(
                [sys.executable, "-c", _FIRST_CALL],
                env=env,
                capture_output=True,
                text=True,
                check=True,
                timeout=300,
            )
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return {
        "import_numba_s": runs[0]["import_numba_s"],
        "first_call_compile_s": runs[0]["first_call_s"],
        "import_numba_cached_s": runs[1]["import_numba_s"],
        "first_call_cached_s": runs[1]["first_call_s"],
    }


def bench_size(n: int, args: argparse.Namespace, rng: np.random.Generator) -> dict[str, Any]:
    cost = geo_mesh(n, rng)
    out: dict[str, Any] = {"n": n, "links": n * (n - 1), "backend": backend(n)}
    tables = compute_routes(cost)
    out["relayed_fraction"] = float(tables.relayed().sum() / (n * (n - 1)))
    if n <= args.reference_max:
        g = to_graph(cost)
        ref = reference_routes(g, relay_hop_ms=2.0)
        out["routes_s"], out["reference_s"] = timed_many(
            [lambda: compute_routes(cost), lambda: reference_routes(g, relay_hop_ms=2.0)],
            args.repeat,
            args.budget,
        )
        out["speedup_vs_networkx"] = out["reference_s"]["median"] / out["routes_s"]["median"]
        out["speedup_vs_networkx_wall"] = (
            out["reference_s"]["wall_median"] / out["routes_s"]["wall_median"]
        )
        out["max_cost_diff_vs_networkx_ms"] = float(np.max(np.abs(ref.cost - tables.cost)))
        out["next_hops_equal_networkx"] = bool(np.array_equal(ref.next_hop, tables.next_hop))
    elif out["backend"] == "numba":
        out["routes_s"], out["routes_scipy_s"] = timed_many(
            [lambda: compute_routes(cost), lambda: compute_routes(cost, compiled=False)],
            args.repeat,
            args.budget,
        )
        out["speedup_vs_scipy"] = out["routes_scipy_s"]["median"] / out["routes_s"]["median"]
        scipy_tables = compute_routes(cost, compiled=False)
        out["next_hops_equal_scipy"] = bool(np.array_equal(scipy_tables.next_hop, tables.next_hop))
        out["reference_s"] = {"skipped": f"n > --reference-max {args.reference_max}"}
    else:
        out["routes_s"] = timed(lambda: compute_routes(cost), args.repeat, args.budget)
        out["reference_s"] = {"skipped": f"n > --reference-max {args.reference_max}"}
    sym = compute_routes(cost, symmetric=True)
    out["symmetric_routes_s"] = timed(
        lambda: compute_routes(cost, symmetric=True), args.repeat, args.budget
    )
    out["allowed_ips_check_s"] = timed(lambda: allowed_ips_consistent(sym), 1, args.budget)
    out["allowed_ips_consistent"] = {
        "symmetric": allowed_ips_consistent(sym),
        "directed": allowed_ips_consistent(tables),
    }
    if n <= args.extras_max:
        with_backups = add_backups(tables, cost)
        out["backups_s"] = timed(lambda: add_backups(tables, cost), args.repeat, args.budget)
        assert with_backups.backup is not None
        out["backup_coverage"] = float((with_backups.backup >= 0).sum() / (n * (n - 1)))
        bw = access_bandwidth(n, rng)
        wide = widest_routes(bw, cost)
        out["widest_s"] = timed(lambda: widest_routes(bw, cost), args.repeat, args.budget)
        off = ~np.eye(n, dtype=bool)
        out["widest_relayed_fraction"] = float(wide.relayed().sum() / (n * (n - 1)))
        out["widest_median_bandwidth_gain"] = float(
            np.median(wide.bandwidth[off] / np.where(off, bw, 1.0)[off])
        )
    else:
        why = f"n > --extras-max {args.extras_max}"
        out["backups_s"] = {"skipped": why}
        out["widest_s"] = {"skipped": why}
    return out


def bench_incremental(
    n: int, updates: int, repeat: int, rng: np.random.Generator
) -> dict[str, Any]:
    """Single-link changes: half on links that carry traffic, half on any link."""
    cost = geo_mesh(n, rng)
    t0 = time.process_time()
    inc = IncrementalRoutes(cost)
    init_s = time.process_time() - t0
    times: dict[str, list[float]] = {}
    wall: list[float] = []
    cols = np.arange(n)
    for k in range(updates):
        a = int(rng.integers(n))
        if k % 2 == 0:  # a link on a shortest path (the expensive case for increases)
            used = np.flatnonzero((inc.next_hop[a] == cols) & (cols != a))
            b = int(rng.choice(used))
            which = "used"
        else:
            b = int((a + 1 + rng.integers(n - 1)) % n)
            which = "any"
        old = float(cost[a, b])
        r = rng.random()
        if not np.isfinite(old):
            kind, new = "restore", float(rng.uniform(5.0, 200.0))
        elif r < 0.1:
            kind, new = "down", float("inf")
        elif r < 0.55:
            kind, new = "increase", old * float(rng.uniform(1.2, 3.0))
        else:
            kind, new = "decrease", old * float(rng.uniform(0.3, 0.9))
        w0, t0 = time.perf_counter(), time.process_time()
        inc.update_link(a, b, new)
        dt = time.process_time() - t0
        wall.append(time.perf_counter() - w0)
        cost[a, b] = new
        times.setdefault(f"{kind}/{which}", []).append(dt)
    flat = sorted(t for ts in times.values() for t in ts)
    full = timed(lambda: compute_routes(cost), repeat, 60.0)
    want = compute_routes(cost)
    got = inc.tables
    same = bool(
        np.array_equal(got.next_hop, want.next_hop)
        and np.allclose(got.cost, want.cost, rtol=0.0, atol=1e-9, equal_nan=False)
    )
    med = statistics.median(flat)
    return {
        "n": n,
        "updates": len(flat),
        "init_s": init_s,
        "median_ms": med * 1e3,
        "p95_ms": float(np.percentile(flat, 95)) * 1e3,
        "max_ms": flat[-1] * 1e3,
        "mean_ms": statistics.fmean(flat) * 1e3,
        "wall_median_ms": statistics.median(wall) * 1e3,
        "by_kind_median_ms": {k: statistics.median(v) * 1e3 for k, v in sorted(times.items())},
        "by_kind_count": {k: len(v) for k, v in sorted(times.items())},
        "engine_stats": dict(inc.stats),
        "full_recompute_s": full,
        "speedup_median_vs_full": full["median"] / med,
        "identical_to_full_recompute": same,
    }


def targets(result: dict[str, Any], clock: str = "cpu") -> dict[str, Any]:
    """The issue's three goals, on CPU time (the goal) or wall time (for information)."""
    wall = clock == "wall"
    med = "wall_median" if wall else "median"
    sizes = result["sizes"]
    out: dict[str, Any] = {}
    if "1000" in sizes:
        out["routes_n1000_le_1s"] = sizes["1000"]["routes_s"][med] <= 1.0
    speedup = "speedup_vs_networkx_wall" if wall else "speedup_vs_networkx"
    if "200" in sizes and speedup in sizes["200"]:
        out["speedup_n200_ge_100x"] = sizes["200"][speedup] >= 100.0
    inc = result.get("incremental")
    if inc and inc["n"] >= 1000:
        out["incremental_n1000_median_le_50ms"] = inc[f"{med}_ms"] <= 50.0
    return out


def timing_leaves(d: Any, prefix: str = "") -> dict[str, float]:
    """Flatten every {"median": ...} timing and every *_ms figure to path → value."""
    out: dict[str, float] = {}
    if isinstance(d, dict):
        if "median" in d and isinstance(d["median"], float):
            out[prefix] = d["median"]
            return out
        for k, v in d.items():
            path = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, float) and k.endswith("_ms") and "diff" not in k:
                out[path] = v
            else:
                out.update(timing_leaves(v, path))
    return out


def compare(new: dict[str, Any], old: dict[str, Any]) -> dict[str, float]:
    """new/old time ratios for every timing present in both (< 1 is faster).

    Baselines written before the CPU clock (no meta.clock) timed wall-clock
    seconds as "median": main() says so beside the ratios.
    """
    a, b = timing_leaves(new), timing_leaves(old)
    return {k: a[k] / b[k] for k in sorted(a) if k in b and b[k] > 0}


def headline(result: dict[str, Any]) -> str:
    """One line for the terminal: the figures the targets are about."""
    parts: list[str] = []
    for n, entry in result["sizes"].items():
        r = entry["routes_s"]
        part = f"n={n} {r['median']:.3f}s cpu ({r['wall_median']:.3f}s wall)"
        if "speedup_vs_networkx" in entry:
            part += f" {entry['speedup_vs_networkx']:.0f}x nx"
        if "speedup_vs_scipy" in entry:
            part += f" {entry['speedup_vs_scipy']:.1f}x scipy"
        part += f" [{entry['backend']}]"
        parts.append(part)
    inc = result["incremental"]
    parts.append(f"incremental n={inc['n']} {inc['median_ms']:.2f}ms")
    comp = result.get("compile", {})
    if "first_call_compile_s" in comp:
        parts.append(
            f"first call {comp['first_call_compile_s']:.2f}s compiling,"
            f" {comp['first_call_cached_s']:.2f}s cached"
        )
    load = result["meta"]["loadavg"]
    parts.append(f"load {load['start'][0]:.1f}->{load['end'][0]:.1f}")
    return "; ".join(parts)


def _numba_version() -> str | None:
    """numba's version without importing it (None if not installed)."""
    from importlib import metadata

    try:
        return metadata.version("numba")
    except metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="100,200,500,1000", help="comma-separated mesh sizes")
    ap.add_argument("--repeat", type=int, default=5, help="runs per measurement (median, min)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    ap.add_argument("--baseline", type=Path, help="previous JSON to compare against")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--updates", type=int, default=60, help="incremental single-link changes")
    ap.add_argument("--incremental-n", type=int, help="mesh size for updates (default: largest)")
    ap.add_argument("--reference-max", type=int, default=200, help="largest n for networkx")
    ap.add_argument("--extras-max", type=int, default=1000, help="largest n for backups/widest")
    ap.add_argument("--budget", type=float, default=30.0, help="seconds per measurement")
    ap.add_argument(
        "--compile-cost",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time the numba kernel's compile and cache load in fresh processes\n"
        "(default: yes, except with --quick)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.updates, args.repeat = "20,40", 10, max(1, min(args.repeat, 2))
    if args.compile_cost is None:
        args.compile_cost = not args.quick
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.repeat < 1 or not sizes or min(sizes) < 2:
        ap.error("need --repeat >= 1 and sizes >= 2")
    rng = np.random.default_rng(args.seed)
    result: dict[str, Any] = {
        "meta": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "scipy": scipy.__version__,
            "networkx": nx.__version__,
            "numba": _numba_version(),
            "compiled_min_n": compiled.COMPILED_MIN_N,
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "seed": args.seed,
            "repeat": args.repeat,
            "quick": args.quick,
            "argv": sys.argv[1:] if argv is None else argv,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "clock": "cpu: time.process_time of this process; wall_*: time.perf_counter",
            "threads": {v: os.environ.get(v) for v in THREAD_VARS},
            "loadavg": {"start": list(os.getloadavg())},
        },
        "sizes": {},
    }
    if args.compile_cost:
        print("# numba compile and cache-load cost", file=sys.stderr, flush=True)
        result["compile"] = compile_cost()
    if any(backend(n) == "numba" for n in sizes):  # warm up: nothing timed below compiles
        t0 = time.process_time()
        compiled.warm_up()
        result["meta"]["warm_up_s"] = time.process_time() - t0
    for n in sizes:
        print(f"# n={n}", file=sys.stderr, flush=True)
        result["sizes"][str(n)] = bench_size(n, args, rng)
    inc_n = args.incremental_n or max(sizes)
    print(f"# incremental n={inc_n}", file=sys.stderr, flush=True)
    result["incremental"] = bench_incremental(inc_n, args.updates, args.repeat, rng)
    result["meta"]["loadavg"]["end"] = list(os.getloadavg())
    result["targets"] = targets(result)
    result["targets_wall_clock"] = targets(result, "wall")
    if args.baseline:
        old = json.loads(args.baseline.read_text())
        ratios = compare(result, old)
        result["vs_baseline"] = ratios
        if "clock" not in old.get("meta", {}):
            result["vs_baseline_note"] = "baseline timed wall-clock seconds; this run CPU seconds"
        for k, v in ratios.items():
            print(f"{k:60s} {v:6.2f}x", file=sys.stderr)
    print(f"# {headline(result)}", file=sys.stderr)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
