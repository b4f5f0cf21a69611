#!/usr/bin/env python3
"""Benchmark the lab's underlay emulator; prints one JSON document.

Needs root, ``ip netns``, /dev/net/tun, iperf3 and ping. It builds a 4-node lab in
namespaces named ``mo<lab>n<i>`` (lab id ``b`` + random hex), runs:

- TCP throughput on one pair without a rate limit (iperf3, median of ``--runs``);
- every ordered pair of the 4 nodes sending at once (12 iperf3 flows): aggregate and
  per pair;
- ping RTT error (measured - configured) at several one-way delays: median and p95;

and reports the emulator's CPU use (``/proc/<pid>/stat``) during the throughput runs
and its timer lag. Everything it creates is removed at the end, also on errors.

    sudo .venv/bin/python scripts/bench_emulator.py [--seconds 5] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from meshopt.lab.emulator import (
    EmulatorClient,
    EmulatorSpec,
    NodeSpec,
    start_emulator,
    stop_emulator,
    tun_name,
    write_spec,
)
from meshopt.lab.netns import create_netns, delete_netns, netns_exec, netns_run

N = 4
BASE_PORT = 5201


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Bench:
    def __init__(self, seconds: int, runs: int) -> None:
        self.seconds = seconds
        self.runs = runs
        self.lab = f"b{uuid.uuid4().hex[:5]}"
        self.netns = [f"mo{self.lab}n{i}" for i in range(N)]
        self.addresses = [f"172.31.0.{i + 1}" for i in range(N)]
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"meshopt-{self.lab}-"))
        self.children: list[subprocess.Popen[Any]] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self.client: EmulatorClient | None = None
        self.created: list[str] = []

    # -- set-up ------------------------------------------------------------------
    def start(self) -> None:
        for ns in self.netns:
            create_netns(ns)
            self.created.append(ns)
        zero = [[0.0] * N for _ in range(N)]
        spec = EmulatorSpec(
            lab=self.lab,
            control=str(self.run_dir / "emu.sock"),
            nodes=[
                NodeSpec(
                    name=f"n{i}",
                    netns=self.netns[i],
                    ifname=tun_name(self.lab, i),
                    address=f"{self.addresses[i]}/16",
                )
                for i in range(N)
            ],
            delay_ms=zero,
        )
        spec_path = self.run_dir / "emu.json"
        write_spec(spec, spec_path)
        self.proc = start_emulator(spec_path)
        self.client = EmulatorClient(spec.control)

    def close(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.kill()
                child.wait()
        if self.client is not None:
            self.client.close()
        if self.proc is not None:
            stop_emulator(self.proc)
        for ns in reversed(self.created):
            delete_netns(ns, missing_ok=True)
        shutil.rmtree(self.run_dir, ignore_errors=True)

    @property
    def emu(self) -> EmulatorClient:
        assert self.client is not None
        return self.client

    def set_all(self, delay_ms: float) -> None:
        pairs = [(i, j) for i in range(N) for j in range(N) if i != j]
        self.emu.set(pairs, delay_ms=delay_ms, jitter_ms=0.0, loss=0.0, rate_mbit=None)

    # -- measurements --------------------------------------------------------------
    def _servers(self, flows: list[tuple[int, int]]) -> None:
        for src, dst in flows:
            server = netns_exec(
                self.netns[dst],
                ["iperf3", "-s", "-1", "-B", self.addresses[dst], "-p", str(BASE_PORT + src)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            self.children.append(server)
        deadline = time.monotonic() + 10
        for src, dst in flows:
            while f":{BASE_PORT + src} " not in netns_run(self.netns[dst], ["ss", "-Hltn"]).stdout:
                if time.monotonic() > deadline:
                    raise RuntimeError("iperf3 servers did not start")
                time.sleep(0.05)

    def iperf(self, flows: list[tuple[int, int]]) -> tuple[dict[str, float], float]:
        """Run the flows at once; Mbit/s per flow (receiver side) and emulator CPU share."""
        assert self.proc is not None
        self._servers(flows)
        cpu0, t0 = cpu_seconds(self.proc.pid), time.monotonic()
        clients = [
            netns_exec(
                self.netns[src],
                [
                    "iperf3",
                    "-c",
                    self.addresses[dst],
                    "-p",
                    str(BASE_PORT + src),
                    "-t",
                    str(self.seconds),
                    "-J",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for src, dst in flows
        ]
        self.children.extend(clients)
        outputs = [c.communicate(timeout=self.seconds + 60)[0] for c in clients]
        cpu = (cpu_seconds(self.proc.pid) - cpu0) / (time.monotonic() - t0)
        result = {}
        for (src, dst), out in zip(flows, outputs, strict=True):
            doc = json.loads(out)
            if "error" in doc:
                raise RuntimeError(f"iperf3 {src}->{dst}: {doc['error']}")
            result[f"{src}->{dst}"] = doc["end"]["sum_received"]["bits_per_second"] / 1e6
        for child in self.children:
            child.wait(10)
        self.children.clear()
        return result, cpu

    def rtt_errors(self, delay_ms: float, count: int = 200) -> dict[str, float]:
        self.set_all(delay_ms)
        proc = netns_run(
            self.netns[0],
            ["ping", "-n", "-c", str(count), "-i", "0.01", "-W", "2", self.addresses[1]],
            timeout=count * 0.01 + 30,
            check=False,
        )
        rtts = [float(x) for x in re.findall(r"time=([\d.]+) ms", proc.stdout)]
        errors = sorted(r - 2 * delay_ms for r in rtts)
        return {
            "configured_rtt_ms": 2 * delay_ms,
            "replies": len(rtts),
            "median_error_ms": round(statistics.median(errors), 3),
            "p95_error_ms": round(errors[int(0.95 * (len(errors) - 1))], 3),
        }

    def run(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "lab_nodes": N,
            "cpus": os.cpu_count(),
            "iperf3_seconds": self.seconds,
        }
        single = []
        for delay in (0.0, 1.0):
            self.set_all(delay)
            rates, cpus = [], []
            for _ in range(self.runs):
                r, cpu = self.iperf([(0, 1)])
                rates.append(r["0->1"])
                cpus.append(cpu)
            single.append(
                {
                    "one_way_delay_ms": delay,
                    "runs_mbit": [round(x, 1) for x in rates],
                    "median_mbit": round(statistics.median(rates), 1),
                    "emulator_cpu_pct": round(100 * statistics.median(cpus), 1),
                }
            )
        out["single_pair_unlimited"] = single
        self.set_all(1.0)
        flows = [(i, j) for i in range(N) for j in range(N) if i != j]
        per_pair, cpu = self.iperf(flows)
        out["all_pairs_busy"] = {
            "one_way_delay_ms": 1.0,
            "flows": len(flows),
            "aggregate_mbit": round(sum(per_pair.values()), 1),
            "per_pair_mbit": {k: round(v, 1) for k, v in per_pair.items()},
            "min_pair_mbit": round(min(per_pair.values()), 1),
            "max_pair_mbit": round(max(per_pair.values()), 1),
            "emulator_cpu_pct": round(100 * cpu, 1),
        }
        lag_after_throughput = self.emu.stats()["lag_us"]
        out["rtt_error"] = [self.rtt_errors(d) for d in (0.0, 1.0, 5.0, 10.0, 40.0)]
        out["timer_lag_us_after_throughput"] = lag_after_throughput
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=5, help="iperf3 duration per run")
    parser.add_argument("--runs", type=int, default=3, help="single-pair runs (median)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench_emulator: needs root", file=sys.stderr)
        return 2
    for tool in ("ip", "iperf3", "ping", "ss"):
        if shutil.which(tool) is None:
            print(f"bench_emulator: needs {tool}", file=sys.stderr)
            return 2
    bench = Bench(args.seconds, args.runs)
    try:
        bench.start()
        result = bench.run()
    finally:
        bench.close()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
