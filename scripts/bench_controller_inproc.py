#!/usr/bin/env python3
"""The controller core in-process at N nodes (issue 15): CPU of full passes, of the
urgent plan for a dead relay and a degraded link, and of signing the sets they make.

N agent-profile snapshots (meshopt.bench.synthetic, signed by the agents' own code) go
into ``ControllerCore``; then the first full pass (every set built), a pass after a
snapshot of noise from every node, the busiest relay's death (its will): the urgent plan
and the signing of every set it made, the full pass after it; the busiest direct link
10 x worse (both ends' change reports): the urgent plan, the full pass after it. Each
figure is the CPU time of the call (``time.process_time``: robust on a shared machine);
RSS after each pass, after glibc's ``malloc_trim`` as the daemon does, and the daemon's
GC thresholds (``--default-gc``: Python's). JSON on stdout;
``--passes K`` adds K more noise passes to watch RSS.

    PYTHONPATH=. .venv/bin/python scripts/bench_controller_inproc.py --nodes 1000
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshopt import memtrim
from meshopt.agent.config import TelemetrySettings
from meshopt.agent.core import AgentCore, RouteState
from meshopt.agent.telemetry import Plan, full_interval, signed_telemetry
from meshopt.bench.synthetic import CONTROLLER_ID, MESH, RUNNING_SENT, SyntheticMesh
from meshopt.bus.messages import AgentStatus
from meshopt.bus.signing import generate_signing_key, public_key_b64, sign
from meshopt.bus.topics import Topics
from meshopt.controller.config import ControllerConfig, Enrolment
from meshopt.controller.core import ControllerCore, Publish

try:
    from meshopt.controller.daemon import GC_THRESHOLDS
except ImportError:  # a tree from before them (to compare)
    GC_THRESHOLDS = (700, 10, 10)


def rss_mb() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) // 1024
    return out


class Bench:
    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.mesh = SyntheticMesh(n, seed)
        key, _ = generate_signing_key()
        nodes = self.mesh.nodes
        cfg = ControllerConfig(
            mesh=MESH,
            id=CONTROLLER_ID,
            signing_key="/unused",
            node_keys=tuple(Enrolment(x.name, public_key_b64(x.identity)) for x in nodes),
        )
        self.core = ControllerCore(cfg, key)
        self.topics = Topics(MESH)
        now = time.time()
        self.agents = [AgentCore(MESH, x.name, x.identity, [], RouteState(), now) for x in nodes]
        self.interval = full_interval(n - 1, TelemetrySettings())
        self.rng = random.Random(seed)
        self.out: dict[str, Any] = {"nodes": n, "rss_mb": {}}

    def feed(
        self,
        factor: dict[int, dict[int, float]] | None = None,
        only: set[int] | None = None,
        full: bool = True,
    ) -> None:
        for x, ag in zip(self.mesh.nodes, self.agents, strict=True):
            if only is not None and x.index not in only:
                continue
            f = (factor or {}).get(x.index)
            peers = self.mesh.reports(
                x.index, self.rng, profile="agent", sent=RUNNING_SENT, factor=f
            )
            if not full and f is not None:
                keys = {self.mesh.nodes[j].wg_key for j in f}
                peers = [p for p in peers if p.public_key in keys]
            msg = signed_telemetry(
                ag,
                time.time(),
                public_keys=[x.wg_key],
                addresses=[x.address],
                plan=Plan(full, peers, self.interval),
                counters={},
            )
            topic = self.topics.telemetry(x.name)
            self.core.on_message(topic, msg, False, time.monotonic(), time.time())

    def full_pass(self, tag: str) -> None:
        t = time.process_time()
        acts = self.core.plan(time.monotonic(), time.time())
        cpu = time.process_time() - t
        memtrim.trim()
        self.out[f"{tag}_full_pass_cpu_s"] = round(cpu, 3)
        self.out[f"{tag}_full_pass_sets"] = len(acts)
        self.out["rss_mb"][tag] = rss_mb()["VmRSS"]
        print(tag, self.out[f"{tag}_full_pass_cpu_s"], "s", len(acts), rss_mb(), file=sys.stderr)

    def urgent(self, tag: str) -> list[Publish]:
        t = time.process_time()
        w = time.perf_counter()
        acts = self.core.urgent_plan(time.monotonic(), time.time())
        self.out[f"{tag}_urgent_cpu_s"] = round(time.process_time() - t, 3)
        self.out[f"{tag}_urgent_wall_s"] = round(time.perf_counter() - w, 3)
        self.out[f"{tag}_urgent_sets"] = len(acts)
        t = time.process_time()
        for a in acts:
            self.core.sign_routes(a, time.time())
        cpu = time.process_time() - t
        self.out[f"{tag}_sign_cpu_s"] = round(cpu, 3)
        self.out[f"{tag}_sign_ms_per_set"] = round(1000 * cpu / max(1, len(acts)), 2)
        print(tag, {k: v for k, v in self.out.items() if k.startswith(tag)}, file=sys.stderr)
        return acts

    def run(self, passes: int) -> dict[str, Any]:
        core, n = self.core, self.n
        t = time.process_time()
        self.feed()
        self.out["feed_cpu_s"] = round(time.process_time() - t, 3)
        self.full_pass("first")
        self.feed()
        self.full_pass("noise")
        assert core.engine.installed is not None
        nh = core.engine.installed.next_hop
        idx = np.arange(n)
        rel = nh[(nh != idx[None, :]) & (nh != idx[:, None]) & (nh >= 0)]
        x = int(np.bincount(rel, minlength=n).argmax())
        self.out["relay_entries"] = int((rel == x).sum())
        name = self.mesh.nodes[x].name
        st = AgentStatus(mesh=MESH, node=name, online=False, since=time.time(), seq=0)
        payload = sign("status", st, self.mesh.nodes[x].identity)
        core.on_message(self.topics.status(name), payload, False, time.monotonic(), time.time())
        self.urgent("death")
        self.out["death_entries_moved"] = core.urgent_moves
        self.full_pass("after_death")
        # The busiest direct link (not the dead node's): both ends report it 10 x worse.
        nh = core.engine.installed.next_hop
        uses = np.zeros((n, n), dtype=np.int64)
        for d in range(n):
            col = nh[:, d]
            ok = (col >= 0) & (idx != d)
            np.add.at(uses, (idx[ok], col[ok]), 1)
        uses[x, :] = 0
        uses[:, x] = 0
        a, b = (int(v) for v in np.unravel_index(int(uses.argmax()), uses.shape))
        self.feed(factor={a: {b: 10.0}, b: {a: 10.0}}, only={a, b}, full=False)
        self.urgent("degrade")
        self.full_pass("after_degrade")
        for i in range(passes):
            self.feed()
            self.full_pass(f"extra_{i + 1}")
        self.out["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        return self.out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--passes", type=int, default=0, help="noise passes after the rest")
    ap.add_argument(
        "--default-gc", action="store_true", help="Python's GC thresholds, not the daemon's"
    )
    args = ap.parse_args(argv)
    if not args.default_gc:
        gc.set_threshold(*GC_THRESHOLDS)  # as the controller daemon runs
    out = Bench(args.nodes, args.seed).run(args.passes)
    out["when"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
