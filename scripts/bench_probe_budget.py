#!/usr/bin/env python3
"""One agent's probing against 100 and 250 peers, probe budget off vs on (issue 15 item 3).

Per run, two processes on loopback addresses this script picks (127.77.0.0/16 for the
peers, 127.78.0.1 for the agent; nothing leaves the host):

* **agent** (measured): the agent's own probe plane as the daemon runs it: a
  :class:`~meshopt.probe.prober.Prober` probing every peer, a
  :class:`~meshopt.probe.responder.Responder` answering the peers' probes with the
  agent's guards (peer sources only, the per-source rate limit), and, with the budget
  on, a :class:`~meshopt.probe.budget.ProbeBudget` re-planned every ``peer_poll_s``
  (2 s) like the daemon does. It imports ``meshopt.agent.daemon`` first, so its RSS
  carries every module the agent loads. Its CPU is its own ``process_time`` over the
  window, its RSS ``VmRSS`` at the end.
* **peers** (load, not measured): a responder on each peer address, and each peer
  probing the agent from its own address at the rate of the agent's class for it (a
  link in use is in use from both ends).

Links in use: the first ``--in-use`` fraction of the peers (default 10 %: the next hops
and backups of a route set); budget off probes every peer at the in-use rate (today).
Probe bytes are the agent's exchanges per second (its probes and their replies) times
the wire size through WireGuard over an IPv4 underlay (280 B an exchange, see
meshopt.probe.prober), and the same for the peers' probes it answers. Figures are
medians of ``--runs`` runs, off and on interleaved so machine noise hits both alike.

WireGuard itself is not in the path (no tunnels: 250 wireguard-go peers would measure
wireguard-go); the agent's peer polling and telemetry are not in it either.

    .venv/bin/python scripts/bench_probe_budget.py [--peers 100,250] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from meshopt.probe.budget import IDLE, IN_USE, BudgetConfig, ProbeBudget
from meshopt.probe.packet import NONCE_BYTES, Kind, ProbePacket, encode, probe_bytes_per_s
from meshopt.probe.prober import ProbeConfig, Prober, Target
from meshopt.probe.responder import PeerSources, RateLimit, Responder

AGENT_ADDRESS = "127.78.0.1"
EXCHANGE_B = probe_bytes_per_s(1.0, 0)  # one probe and its reply on the wire: 280 B
GOAL_CPU_PERCENT = 5.0
GOAL_RSS_MB = 80.0
GOAL_BYTES = {250: 100_000.0, 1000: 150_000.0}  # issue 15: probe bytes per agent


def peer_address(i: int) -> str:
    return f"127.77.{i // 250}.{i % 250 + 1}"


def in_use_count(peers: int, fraction: float) -> int:
    return max(1, round(peers * fraction))


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def raise_fd_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))


def class_rates(peers: int, in_use: int, budget: bool) -> dict[str, tuple[str, float]]:
    """Each peer's (class, interval) as the agent plans it."""
    names = [f"p{i}" for i in range(peers)]
    if not budget:
        fast = ProbeConfig().interval_s
        return {n: (IN_USE, fast) for n in names}
    plan = ProbeBudget().plan(names, set(names[:in_use]), {}, 0.0)
    return {n: (r.cls, r.interval_s) for n, r in plan.rates.items()}


# --- the agent (measured) ----------------------------------------------------------------


async def agent_main(args: argparse.Namespace) -> dict[str, Any]:
    import meshopt.agent.daemon  # noqa: F401  (the agent's modules, for a fair RSS)

    names = [f"p{i}" for i in range(args.peers)]
    addresses = [peer_address(i) for i in range(args.peers)]
    responder = Responder(
        limit=RateLimit.for_interval(ProbeConfig().interval_s),
        allowed=PeerSources((f"{a}/32", None) for a in addresses),
    )
    await responder.start([AGENT_ADDRESS], port=args.agent_port)
    prober = Prober(ProbeConfig(port=args.peer_port))
    prober.set_targets(Target(n, a) for n, a in zip(names, addresses, strict=True))
    budget = ProbeBudget(BudgetConfig())
    hops = set(names[: args.in_use])
    loop = asyncio.get_running_loop()

    def replan() -> None:
        if args.budget:
            prober.set_rates(budget.plan(names, hops, {}, loop.time()).rates)

    replan()
    await prober.start()
    stop = loop.time() + args.warmup + args.window

    async def poll() -> None:  # the daemon re-plans at every peer poll
        while loop.time() < stop:
            await asyncio.sleep(2.0)
            replan()

    poller = asyncio.create_task(poll())
    await asyncio.sleep(args.warmup)
    sent0, echoed0 = prober.counters["sent"], responder.counters["echoed"]
    received0 = sum(s.received for n in names if (s := prober.stats(n)) is not None)
    cpu0, t0 = time.process_time(), time.monotonic()
    await asyncio.sleep(args.window)
    cpu1, t1 = time.process_time(), time.monotonic()
    snap = prober.snapshot()
    sent, echoed = prober.counters["sent"] - sent0, responder.counters["echoed"] - echoed0
    received = sum(s.received for n in names if (s := prober.stats(n)) is not None) - received0
    poller.cancel()
    await prober.close()
    responder.close()
    span = t1 - t0
    classes = [snap["peers"][n]["class"] for n in names]
    return {
        "cpu_percent": 100.0 * (cpu1 - cpu0) / span,
        "rss_mb": rss_mb(),
        "window_s": span,
        "probes_per_s": sent / span,
        "replies_per_s": received / span,
        "answered_per_s": echoed / span,
        "planned_probes_per_s": prober.probes_per_s(),
        "alive": sum(1 for n in names if prober.alive(n)),
        "in_use": classes.count(IN_USE),
        "idle": classes.count(IDLE),
        "responder": {k: v for k, v in responder.counters.items() if v},
        "prober": {k: v for k, v in prober.counters.items() if v and k != "sent"},
    }


# --- the peers (load) ----------------------------------------------------------------------


async def peers_main(args: argparse.Namespace) -> None:
    raise_fd_limit(2 * args.peers + 64)
    addresses = [peer_address(i) for i in range(args.peers)]
    responder = Responder(limit=None)
    await responder.start(addresses, port=0)
    rates = class_rates(args.peers, args.in_use, args.budget)
    senders: list[socket.socket] = []
    for a in addresses:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((a, 0))
        s.setblocking(False)
        senders.append(s)
    print(json.dumps({"port": responder.port}), flush=True)
    loop = asyncio.get_running_loop()
    for s in senders:  # the agent's replies: read and dropped
        loop.add_reader(s.fileno(), _discard, s)
    nonce = os.urandom(NONCE_BYTES)
    target = (AGENT_ADDRESS, args.agent_port)
    start = loop.time()
    due = [start + (i % 20) * 0.05 for i in range(args.peers)]  # spread over a second
    seq = 0
    while True:
        now = loop.time()
        for i, s in enumerate(senders):
            if due[i] <= now:
                seq += 1
                data = encode(ProbePacket(Kind.REQUEST, nonce, seq, time.time_ns()))
                with contextlib.suppress(OSError):
                    s.sendto(data, target)
                interval = rates[f"p{i}"][1]
                due[i] += interval
                if due[i] <= now:  # fell behind: no burst (as the prober)
                    due[i] = now + interval
        await asyncio.sleep(0.02)


def _discard(s: socket.socket) -> None:
    try:
        while True:
            s.recv(256)
    except BlockingIOError:
        return


# --- the driver ----------------------------------------------------------------------------


def role_argv(role: str, peers: int, in_use: int, budget: bool, **extra: Any) -> list[str]:
    argv = [sys.executable, __file__, "--role", role, "--peers", str(peers)]
    argv += ["--in-use-count", str(in_use), "--budget", "on" if budget else "off"]
    for k, v in extra.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


def one_run(peers: int, in_use: int, budget: bool, args: argparse.Namespace) -> dict[str, Any]:
    agent_port = free_port(AGENT_ADDRESS)
    load = subprocess.Popen(
        role_argv("peers", peers, in_use, budget, agent_port=agent_port),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert load.stdout is not None
        ready = json.loads(load.stdout.readline() or "{}")
        if "port" not in ready:
            raise RuntimeError("the peers' process did not start")
        out = subprocess.run(
            role_argv(
                "agent",
                peers,
                in_use,
                budget,
                agent_port=agent_port,
                peer_port=ready["port"],
                warmup=args.warmup,
                window=args.window,
            ),
            capture_output=True,
            text=True,
            timeout=args.warmup + args.window + 60,
        )
        if out.returncode != 0:
            raise RuntimeError(f"agent process failed: {out.stderr.strip()[-400:]}")
        result: dict[str, Any] = json.loads(out.stdout)
        return result
    finally:
        load.terminate()  # the process this run started, by its own handle
        try:
            load.wait(10)
        except subprocess.TimeoutExpired:
            load.kill()
            load.wait()


def med(runs: Sequence[dict[str, Any]], key: str) -> float:
    return round(statistics.median(float(r[key]) for r in runs), 3)


def summary(peers: int, runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    own = med(runs, "probes_per_s") * EXCHANGE_B
    answered = med(runs, "answered_per_s") * EXCHANGE_B
    return {
        "cpu_percent_of_one_core": med(runs, "cpu_percent"),
        "cpu_percent_runs": [round(r["cpu_percent"], 3) for r in runs],
        "rss_mb": med(runs, "rss_mb"),
        "probes_per_s": med(runs, "probes_per_s"),
        "answered_per_s": med(runs, "answered_per_s"),
        "probe_bytes_per_s": round(own),
        "probe_bytes_per_s_per_peer": round(own / peers, 1),
        "answering_bytes_per_s": round(answered),
        "all_probe_bytes_on_its_links_per_s": round(own + answered),
        "peers_alive": min(r["alive"] for r in runs),
        "in_use": runs[0]["in_use"],
        "idle": runs[0]["idle"],
        "drops": [{**r["responder"], **r["prober"]} for r in runs],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    load0 = [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    rows: dict[str, Any] = {}
    for peers in args.peer_counts:
        in_use = in_use_count(peers, args.in_use)
        runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
        for _ in range(args.runs):
            for budget in (False, True):
                runs[budget].append(one_run(peers, in_use, budget, args))
        off, on = summary(peers, runs[False]), summary(peers, runs[True])
        goal_b = GOAL_BYTES.get(peers)
        rows[str(peers)] = {
            "budget_off": off,
            "budget_on": on,
            "cpu_ratio_on_off": round(
                on["cpu_percent_of_one_core"] / max(off["cpu_percent_of_one_core"], 1e-9), 3
            ),
            "goals": {
                "cpu_percent": GOAL_CPU_PERCENT,
                "rss_mb": GOAL_RSS_MB,
                "probe_bytes_per_s": goal_b,
                "on_cpu_ok": on["cpu_percent_of_one_core"] <= GOAL_CPU_PERCENT,
                "on_rss_ok": on["rss_mb"] <= GOAL_RSS_MB,
                "on_bytes_ok": None if goal_b is None else on["probe_bytes_per_s"] <= goal_b,
            },
        }
    return {
        "benchmark": "probe_budget",
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "settings": {
            "runs": args.runs,
            "warmup_s": args.warmup,
            "window_s": args.window,
            "in_use_fraction": args.in_use,
            "budget": BudgetConfig().__dict__,
            "exchange_bytes": EXCHANGE_B,
        },
        "machine": {
            "cores": os.cpu_count(),
            "loadavg_before": load0,
            "loadavg_after": [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]],
        },
        "peers": rows,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--peers", default="100,250", help="peer counts, comma-separated")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=float, default=6.0)
    p.add_argument("--window", type=float, default=20.0)
    p.add_argument("--in-use", type=float, default=0.10, help="fraction of peers in use")
    # Internal: the two roles of a run.
    p.add_argument("--role", choices=("driver", "agent", "peers"), default="driver")
    p.add_argument("--in-use-count", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--budget", choices=("on", "off"), default="on", help=argparse.SUPPRESS)
    p.add_argument("--agent-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--peer-port", type=int, default=0, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.role == "agent":
        args.budget = args.budget == "on"
        args.in_use, args.peers = args.in_use_count, int(args.peers)
        print(json.dumps(asyncio.run(agent_main(args))))
        return 0
    if args.role == "peers":
        args.budget = args.budget == "on"
        args.in_use, args.peers = args.in_use_count, int(args.peers)
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(peers_main(args))
        return 0
    try:
        args.peer_counts = [int(x) for x in args.peers.split(",") if x]
    except ValueError:
        print(f"error: --peers {args.peers!r}: give counts like 100,250", file=sys.stderr)
        return 2
    if not args.peer_counts or min(args.peer_counts) < 1 or max(args.peer_counts) > 60_000:
        print("error: --peers: counts from 1 to 60000", file=sys.stderr)
        return 2
    if args.runs < 1 or args.window <= 0 or args.warmup < 0 or not 0 < args.in_use <= 1:
        print("error: --runs >= 1, --window > 0, --warmup >= 0, 0 < --in-use <= 1", file=sys.stderr)
        return 2
    try:
        print(json.dumps(run(args), indent=2))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
