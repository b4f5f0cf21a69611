#!/usr/bin/env python3
"""Scale benchmark: N synthetic agents through a real broker and the real controller.

Each run starts a mosquitto with the production setup (``meshopt broker init`` files:
TLS listener with client certificates, password file, ACL; the synthetic agents use its
plain unix socket, same users and ACL, unless ``--transport tls``), the real controller
process (``meshopt controller --config``, every node enrolled), and N synthetic agents
in this process (meshopt.bench.synthetic: one MQTT session each, telemetry and status
signed by the agent's own code and sent at the agent's own cadence: full snapshots at the
interval that stretches with the peer count, change reports of the peers that moved,
heartbeats; values from a generated geographic mesh plus noise; route sets verified as
an agent does). It measures:

* ``first_routes_s``: from the first connect until every node holds a verified route set;
* a steady window: controller, broker and generator CPU (% of one core, from
  /proc/<pid>/stat), controller RSS, bytes per second per agent up (telemetry and
  status, payload + topic) and down (route sets);
* ``degrade``: the busiest direct link's RTT x10 + 100 ms, reported by both ends;
  ``death``: a node stops (offline status, the will). For each, the time from the
  change's publish to each updated node's subscriber holding the new signed route set
  (median, p95), and how many nodes were updated;
* the route-set, snapshot and heartbeat sizes in bytes.

``--ingest`` also times the controller core's ingest in-process (per full snapshot,
change report and heartbeat, rows and matrices); ``--ingest-only`` does only that.

Medians over ``--runs`` (every run's values kept), the goals of issue 15, and how each
figure grows with N (the exponent k of N^k from the smallest N to each larger one).

    .venv/bin/python scripts/bench_scale.py --quick
    .venv/bin/python scripts/bench_scale.py --nodes 50,250 --runs 3 --out scale.json
    .venv/bin/python scripts/bench_scale.py --nodes 1000 --runs 1 --baseline scale.json
    .venv/bin/python scripts/bench_scale.py --nodes 250,1000 --ingest-only
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshopt.bench import synthetic
from meshopt.bench.synthetic import (
    BenchError,
    RunSettings,
    SyntheticMesh,
    generator_check_cost,
    ingest_cost,
    run_once,
)
from meshopt.errors import MeshoptError

# figure -> (where in a run's JSON, goal at 250, goal at 1000); None: no goal.
FIGURES: dict[str, tuple[tuple[str, ...], float | None, float | None]] = {
    "degrade_latency_median_s": (("degrade", "latency_median_s"), 1.0, 3.0),
    "degrade_latency_p95_s": (("degrade", "latency_p95_s"), 1.0, 3.0),
    "death_latency_median_s": (("death", "latency_median_s"), 1.0, 3.0),
    "death_latency_p95_s": (("death", "latency_p95_s"), 1.0, 3.0),
    "degrade_affected_latency_median_s": (("degrade", "affected_latency_median_s"), 1.0, 3.0),
    "death_affected_latency_median_s": (("death", "affected_latency_median_s"), 1.0, 3.0),
    "death_affected_latency_p95_s": (("death", "affected_latency_p95_s"), 1.0, 3.0),
    "startup_degrade_affected_latency_median_s": (
        ("startup_degrade", "affected_latency_median_s"),
        1.0,
        3.0,
    ),
    "startup_death_affected_latency_median_s": (
        ("startup_death", "affected_latency_median_s"),
        1.0,
        3.0,
    ),
    "startup_death_affected_latency_p95_s": (
        ("startup_death", "affected_latency_p95_s"),
        1.0,
        3.0,
    ),
    "controller_cpu_pct": (("steady", "controller_cpu_pct"), 15.0, 60.0),
    "controller_cpu_pct_late": (("steady", "controller_cpu_pct_late"), 15.0, 60.0),
    "controller_rss_mb": (("steady", "controller_rss_mb"), 500.0, 2000.0),
    "broker_cpu_pct": (("steady", "broker_cpu_pct"), None, None),
    "generator_cpu_pct": (("steady", "generator_cpu_pct"), None, None),
    "generator_loop_lag_p95_s": (("generator_loop_lag_p95_s",), None, None),
    "agent_reconnects": (("agent_reconnects",), None, None),
    "agent_keepalive_timeouts": (("broker_keepalive_timeouts", "agents"), None, None),
    "controller_keepalive_timeouts": (("broker_keepalive_timeouts", "controller"), None, None),
    "controller_broker_dropping": (
        ("broker_keepalive_timeouts", "controller_dropping"),
        None,
        None,
    ),
    "verify_ms_per_set": (("verify_ms_per_set",), None, None),
    "agent_up_bytes_per_s": (("steady", "agent_up_bytes_per_s"), 2000.0, 5000.0),
    "agent_down_bytes_per_s": (("steady", "agent_down_bytes_per_s"), None, None),
    "route_sets_per_s_steady": (("steady", "route_sets_per_s"), None, None),
    "nodes_with_routes": (("nodes_with_routes",), None, None),
    "route_set_bytes_median": (("route_set_bytes_median",), None, None),
    "telemetry_snapshot_bytes": (("telemetry_snapshot_bytes",), None, None),
    "telemetry_heartbeat_bytes": (("telemetry_heartbeat_bytes",), None, None),
    "telemetry_msgs_per_s": (("steady", "telemetry_msgs_per_s"), None, None),
    "agent_full_interval_s": (("steady", "agent_full_interval_s"), None, None),
    "first_routes_s": (("first_routes_s",), None, None),
    "degrade_nodes_updated": (("degrade", "nodes_updated"), None, None),
    "death_nodes_updated": (("death", "nodes_updated"), None, None),
}


def _get(run: dict[str, Any], path: tuple[str, ...]) -> float | None:
    v: Any = run
    for k in path:
        if not isinstance(v, dict) or k not in v:
            return None
        v = v[k]
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def summarise(runs: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Median of each figure over the runs, with the goal for this N where there is one."""
    out: dict[str, Any] = {}
    for name, (path, g250, g1000) in FIGURES.items():
        values = [v for v in (_get(r, path) for r in runs) if v is not None]
        goal = g250 if n == 250 else g1000 if n == 1000 else None
        entry: dict[str, Any] = {
            "median": round(statistics.median(values), 3) if values else None,
            "runs": values,
        }
        if goal is not None:
            entry["goal"] = goal
            entry["pass"] = bool(values) and statistics.median(values) <= goal
        out[name] = entry
    return out


def exponents(sizes: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """k in figure ~ N^k, from the smallest N to each larger one."""
    ns = sorted(int(n) for n in sizes)
    if len(ns) < 2:
        return {}
    lo = ns[0]
    out: dict[str, dict[str, float | None]] = {}
    for name in FIGURES:
        a = sizes[str(lo)]["figures"][name]["median"]
        per: dict[str, float | None] = {}
        for hi in ns[1:]:
            b = sizes[str(hi)]["figures"][name]["median"]
            ok = a is not None and b is not None and a > 0 and b > 0
            per[f"{lo}->{hi}"] = round(math.log(b / a) / math.log(hi / lo), 2) if ok else None
        out[name] = per
    return out


def _ingest_medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each numeric ingest figure over the runs."""
    out: dict[str, Any] = {}
    for k, v in runs[0].items():
        if isinstance(v, int | float) and not isinstance(v, bool):
            out[k] = statistics.median(r[k] for r in runs)
        else:
            out[k] = v
    return out


def compare(new: dict[str, Any], old: dict[str, Any]) -> dict[str, float]:
    """new / old of every figure median both have (same N)."""
    out: dict[str, float] = {}
    for n, entry in new["sizes"].items():
        before = old.get("sizes", {}).get(n)
        if not isinstance(before, dict):
            continue
        for name, fig in entry["figures"].items():
            b = before.get("figures", {}).get(name, {}).get("median")
            a = fig["median"]
            if isinstance(a, int | float) and isinstance(b, int | float) and b > 0:
                out[f"n={n} {name}"] = round(a / b, 3)
    return out


def headline(result: dict[str, Any]) -> str:
    parts = []
    for n, entry in result["sizes"].items():
        if "figures" not in entry:
            ing = entry.get("ingest", {})
            parts.append(f"n={n}: ingest {ing.get('ingest_ms_per_snapshot')} ms/snapshot")
            continue
        f = entry["figures"]
        parts.append(
            f"n={n}: degrade {f['degrade_latency_median_s']['median']}s"
            f" death {f['death_latency_median_s']['median']}s"
            f" ctl {f['controller_cpu_pct']['median']}% {f['controller_rss_mb']['median']}MB"
            f" up {f['agent_up_bytes_per_s']['median']}B/s"
        )
    return "; ".join(parts)


# The controller's start-up phase (ControllerConfig.startup_s): a short hold lets the
# policy take gains on young estimates, one route set each. Steady state is after it.
STARTUP_S = 60.0


class CpuTrace:
    """The controller's CPU over a whole run, sampled from /proc every 0.25 s, and when
    each phase began (the run's progress lines): the steady window starts 2 s after the
    first routes, inside the controller's start-up minute at these sizes, so its CPU is
    the start-up figure; ``late`` gives the CPU over the window's last seconds, once
    they lie past the start-up minute (``--steady 80`` and more at N = 250)."""

    def __init__(self, late_s: float | None = None) -> None:
        self.late_s = late_s
        self.samples: list[tuple[float, float]] = []
        self.marks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._progress = synthetic.progress

    def __enter__(self) -> CpuTrace:
        def mark(text: str) -> None:
            for phase in ("agents connected", "steady window done"):
                if phase in text:
                    self.marks.setdefault(phase, time.monotonic())
            self._progress(text)
            if "steady window done" in text and self.late_s is not None:
                # On stderr at once too: a run that fails later still leaves its figure.
                self._progress(f"controller CPU, steady (late): {self.late(self.late_s)} %")

        synthetic.progress = mark
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        synthetic.progress = self._progress
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(0.25):
            for stack in list(synthetic._LIVE):
                p = stack.controller
                if p is not None and p.poll() is None:
                    with contextlib.suppress(OSError, ValueError, IndexError):
                        self.samples.append((time.monotonic(), synthetic.proc_cpu_s(p.pid)))

    def share(self, t0: float, t1: float) -> float | None:
        """% of one core between the samples nearest inside [t0, t1]."""
        inside = [x for x in self.samples if t0 <= x[0] <= t1]
        if len(inside) < 2 or inside[-1][0] - inside[0][0] < 1.0:
            return None
        (a, ca), (b, cb) = inside[0], inside[-1]
        return round(100 * (cb - ca) / (b - a), 2)

    def late(self, window_s: float) -> float | None:
        """CPU over the steady window's last ``window_s``, if they start past start-up."""
        start = self.marks.get("agents connected")
        end = self.marks.get("steady window done")
        if start is None or end is None or end - window_s < start + STARTUP_S:
            return None
        return self.share(end - window_s, end)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nodes", default="50,250,1000", help="comma-separated mesh sizes")
    ap.add_argument("--runs", type=int, default=3, help="runs per size (medians reported)")
    ap.add_argument("--quick", action="store_true", help="one short run of 20 nodes")
    ap.add_argument("--steady", type=float, default=20.0, help="steady window, seconds")
    ap.add_argument(
        "--profile",
        choices=("agent", "lean"),
        default="agent",
        help="agent: peer reports as full as a real agent's; lean: routing fields",
    )
    ap.add_argument(
        "--transport",
        choices=("unix", "tls"),
        default="unix",
        help="how the synthetic agents reach the broker",
    )
    ap.add_argument(
        "--lease-s",
        type=float,
        default=None,
        help="the controller's lease_s (default: its own, 3 s; see docs/scale.md)",
    )
    ap.add_argument(
        "--routes-timeout",
        type=float,
        default=None,
        help="longest wait for every node's first route set (default 60 s, 180 s above 250)",
    )
    ap.add_argument(
        "--change-window",
        type=float,
        default=None,
        help="longest wait for route sets after an injected change (default 20 s, 60 s above 250)",
    )
    ap.add_argument(
        "--full-interval",
        type=float,
        default=5.0,
        help="agents' base telemetry interval, telemetry.full_interval_s (default 5 s: "
        "heartbeats, and snapshots up to 30 peers, stretching above); otherwise the "
        "controller's stale_after_s becomes 3x it",
    )
    ap.add_argument(
        "--ingest",
        action="store_true",
        help="also time the controller core's ingest per message in-process, per size",
    )
    ap.add_argument(
        "--ingest-only",
        action="store_true",
        help="only time the ingest in-process (no broker, no controller process)",
    )
    ap.add_argument(
        "--late",
        type=float,
        default=20.0,
        help="controller_cpu_pct_late: CPU over the steady window's last LATE s, reported "
        f"when they start {STARTUP_S:g} s (the controller's start-up) after the agents "
        "connected; use --steady 80 or more at N = 250",
    )
    ap.add_argument(
        "--generator-procs",
        type=int,
        default=0,
        help="worker processes for the synthetic agents, each with its own event loop and "
        "a share of the agents (0: all in this process; use 4 at N = 1000)",
    )
    ap.add_argument(
        "--generator-nice",
        type=int,
        default=10,
        help="niceness of the worker processes (they stand for the agents' own machines, "
        "so their CPU must not be taken from the controller and the broker; 0: none)",
    )
    ap.add_argument(
        "--controller-nice",
        type=int,
        default=None,
        help="the controller's niceness (default: the Nice= of "
        "packaging/systemd/meshopt-controller.service, as deployed)",
    )
    ap.add_argument(
        "--startup-changes",
        action="store_true",
        help="also degrade a link and kill a node right after the first routes (inside "
        "the controller's start-up minute), before the steady window",
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--baseline", type=Path, help="an earlier JSON output to compare with")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # a killed run still stops what it started
    try:
        sizes = [int(x) for x in args.nodes.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--nodes {args.nodes!r}: want comma-separated integers")
    if args.quick:
        sizes, args.runs, args.steady = ([20] if args.nodes == "50,250,1000" else sizes), 1, 8.0
    if args.runs < 1 or not sizes or min(sizes) < 2 or max(sizes) > 5000 or args.steady <= 0:
        ap.error("need --runs >= 1, sizes 2..5000 and --steady > 0")
    if not 0 <= args.generator_procs <= 64:
        ap.error("--generator-procs: want 0..64")
    if not 0 <= args.generator_nice <= 19:
        ap.error("--generator-nice: want 0..19")
    if args.controller_nice is not None and not -20 <= args.controller_nice <= 19:
        ap.error("--controller-nice: want -20..19")
    if not 1.0 <= args.full_interval <= 300.0:
        ap.error("--full-interval: want 1..300 s")
    old = None
    if args.baseline is not None:
        try:
            old = json.loads(args.baseline.read_text())
        except (OSError, ValueError) as exc:
            ap.error(f"--baseline {args.baseline}: {exc}")
    result: dict[str, Any] = {
        "meta": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "argv": sys.argv[1:] if argv is None else argv,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "profile": args.profile,
            "agent_transport": args.transport,
            "controller_lease_s": args.lease_s,
            "full_interval_s": args.full_interval,
            "steady_s": args.steady,
            "generator_procs": args.generator_procs,
            "generator_nice": args.generator_nice,
            "controller_nice": args.controller_nice,
            "startup_changes": args.startup_changes,
            "runs": args.runs,
            "loadavg": {"start": list(os.getloadavg())},
            "cpu": "% of one core over the steady window, from /proc/<pid>/stat",
            "bytes": "MQTT payload + topic per agent (not TCP/TLS framing)",
        },
        "sizes": {},
    }
    try:
        for n in sizes:
            runs: list[dict[str, Any]] = []
            if args.ingest_only:
                mesh = SyntheticMesh(n, args.seed)
                cost = [ingest_cost(mesh, args.profile) for _ in range(args.runs)]
                result["sizes"][str(n)] = {
                    "ingest": _ingest_medians(cost),
                    "ingest_runs": cost,
                    "generator_heartbeat_check": generator_check_cost(mesh),
                }
                continue
            for i in range(args.runs):
                print(f"# n={n} run {i + 1}/{args.runs}", file=sys.stderr, flush=True)
                settings = RunSettings(
                    nodes=n,
                    seed=args.seed,
                    profile=args.profile,
                    transport=args.transport,
                    lease_s=args.lease_s,
                    full_interval_s=args.full_interval,
                    steady_s=args.steady,
                    routes_timeout_s=args.routes_timeout or (60.0 if n <= 250 else 180.0),
                    change_window_s=args.change_window or (20.0 if n <= 250 else 60.0),
                    generator_procs=args.generator_procs,
                    generator_nice=args.generator_nice,
                    controller_nice=args.controller_nice,
                    startup_changes=args.startup_changes,
                )
                load0 = list(os.getloadavg())
                with CpuTrace(args.late) as trace:
                    run = asyncio.run(run_once(settings))
                run["loadavg"] = {"start": load0, "end": list(os.getloadavg())}
                if isinstance(run.get("steady"), dict):
                    run["steady"]["controller_cpu_pct_late"] = trace.late(args.late)
                runs.append(run)
            result["sizes"][str(n)] = {"figures": summarise(runs, n), "runs": runs}
            if args.ingest:
                mesh = SyntheticMesh(n, args.seed)
                result["sizes"][str(n)]["ingest"] = ingest_cost(mesh, args.profile)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except MeshoptError as exc:
        print(f"bench_scale: {exc}", file=sys.stderr)
        return 1
    if not args.ingest_only:
        result["exponents"] = exponents(result["sizes"])
    result["meta"]["loadavg"]["end"] = list(os.getloadavg())
    if old is not None:
        result["vs_baseline"] = compare(result, old)
    print(f"# {headline(result)}", file=sys.stderr)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except BenchError as exc:
        print(f"bench_scale: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
