#!/usr/bin/env python3
"""Benchmark ``meshopt lab``: build and tear-down times, memory, RTT fidelity; JSON out.

Needs root. Builds an n-node full mesh (``gen:geo``) ``--runs`` times and reports the
median up and down times and the RSS of the lab's processes; then, in one lab, the
median ping RTT through WireGuard and over the bare underlay against the configured
RTT at several delays. ``--baseline old.json`` adds the ratio of each timing to the
baseline's (measure both in the same session: this machine is noisy).

    .venv/bin/python scripts/bench_lab.py [--nodes 16] [--runs 3] [--baseline old.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from typing import Any

from meshopt.lab.lab import Lab


def _median_rtt(lab: Lab, src: str, addr: str, count: int = 100) -> float:
    out = lab.run(src, ["ping", "-n", "-c", str(count), "-i", "0.01", addr]).stdout
    rtts = [float(x) for x in re.findall(r"time=([\d.]+) ms", out)]
    return statistics.median(rtts) if rtts else float("nan")


def bench(nodes: int, runs: int) -> dict[str, Any]:
    ups, downs, rss = [], [], []
    spec = f"gen:geo:n={nodes},seed=1"
    for k in range(runs):
        t0 = time.monotonic()
        lab = Lab.up(spec, name=f"bench{k}")
        ups.append(time.monotonic() - t0)
        rss.append(lab.status()["rss_mb"])
        t0 = time.monotonic()
        lab.down()
        downs.append(time.monotonic() - t0)
    fidelity = []
    with Lab.up(spec, name="benchrtt") as lab:
        a, b = lab.topo.names[:2]
        for delay in (1.0, 5.0, 10.0, 20.0, 40.0):
            lab.set(f"{a}-{b} delay={delay}ms jitter=0 loss=0")
            lab.run(a, ["ping", "-c1", lab.overlay_ip(b)])  # handshake
            wg = _median_rtt(lab, a, lab.overlay_ip(b))
            bare = _median_rtt(lab, a, lab.underlay_ip(b))
            fidelity.append(
                {
                    "configured_rtt_ms": 2 * delay,
                    "wireguard_median_ms": wg,
                    "underlay_median_ms": bare,
                    "wireguard_error_ms": round(wg - 2 * delay, 3),
                    "underlay_error_ms": round(bare - 2 * delay, 3),
                    "tolerance_ms": max(0.5, 0.06 * delay),
                }
            )
    return {
        "nodes": nodes,
        "runs": runs,
        "up_s": {"median": statistics.median(ups), "all": ups},
        "down_s": {"median": statistics.median(downs), "all": downs},
        "rss_mb": {"median": statistics.median(rss), "per_node": statistics.median(rss) / nodes},
        "rtt_fidelity": fidelity,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--baseline", help="an earlier output of this script to compare with")
    args = ap.parse_args()
    try:
        result = bench(args.nodes, args.runs)
    except subprocess.SubprocessError as exc:
        print(f"bench_lab: {exc}", file=sys.stderr)
        return 1
    if args.baseline:
        with open(args.baseline) as f:
            base = json.load(f)
        result["vs_baseline"] = {
            k: result[k]["median"] / base[k]["median"] for k in ("up_s", "down_s")
        }
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
