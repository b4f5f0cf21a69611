#!/usr/bin/env python3
"""One real agent daemon with 100+ WireGuard peers: its CPU, RSS and probe bytes (issue 15).

Root. Per run, in a network namespace this script creates (``mab<pid>r<run>``; nothing
leaves it, the broker is a unix socket):

* **wireguard-go** serving ``wg0`` with the agent's key and ``--peers`` peers (random
  keys; AllowedIPs: an overlay /32 each and its probe address, as the agent wants them).
* **the agent** (measured): ``meshopt agent --config ...``, the daemon an operator runs,
  single-interface layout, reading ``wg0`` over wireguard-go's UAPI every
  ``peer_poll_s``, probing every peer, answering their probes, publishing telemetry and
  status to the broker, holding a signed route set, installing its routes (netlink)
  and AllowedIPs (UAPI), writing its status file, serving ``/metrics``. Bandwidth
  trains are off (``[bandwidth] enabled = false``): they run every 300 s, not in a
  steady window; say so when quoting the figures.
* **the peers** (load, not measured): their probe addresses are also put on ``wg0``,
  so the kernel delivers the agent's probes to them locally instead of through the
  tunnel (one wireguard-go per peer would measure wireguard-go). A responder answers on
  each, and each peer probes the agent from its own address at the rate of the class
  the agent gives it (a link in use is in use at both ends). So WireGuard's crypto is
  not in the probe path; the agent's own work (sockets, timers, stats, budget, UAPI
  reads of 100+ peers, telemetry encoding and signing) all is.
* **mosquitto** on a unix socket, where the script publishes the route set (signed
  with a controller key the agent trusts) and counts the agent's telemetry.

Route sets (``--mode``):

* ``full``: what the controller sends in a full mesh: a route to every peer's address,
  via the peer itself (one in ten relayed through another peer, the direct tunnel as
  backup), every route with a backup. The probe budget keeps the ten relays and the
  backups of their routes in use (20 peers, 3 probes/s each) and the rest idle: a
  direct route without traffic does not make a link in use (docs/probe-budget.md).
  Before that rule every peer here was in use.
* ``partial``: routes to a tenth of the peers only, all direct: no link in use (no
  traffic). Before the rule those ten were in use (the case ``bench_probe_budget.py``
  models).

The agent's CPU is utime + stime from ``/proc/<pid>/stat`` over the window (all its
threads), as a share of one core; RSS is ``VmRSS`` at the end (``VmHWM`` the peak).
Probe bytes: the agent's own probe exchanges per second (its probes the peers
answered) times 280 B, the wire size of one probe and its reply through WireGuard over
an IPv4 underlay (meshopt.probe.prober); the peers' probes it answered likewise.
Telemetry: bytes of every message on its telemetry topic in the window (payload and
topic). The probe classes are read from the agent's last full snapshot in telemetry.

    sudo .venv/bin/python scripts/bench_agent_peers.py [--peers 100] [--runs 3]
        [--mode full,partial] [--busy 2]

``--busy N`` starts N spinning processes for the whole benchmark (ended by PID).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import ipaddress
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from meshopt.agent.probeaddr import probe_address, probe_prefix
from meshopt.bus.messages import (
    BusMessageError,
    Route,
    RouteSet,
    decode_signed,
    decode_telemetry,
)
from meshopt.bus.signing import generate_signing_key, save_private_key, sign_route_set
from meshopt.bus.topics import Topics
from meshopt.lab.agents import dump_toml
from meshopt.probe.budget import BudgetConfig, ProbeBudget, route_use
from meshopt.probe.packet import NONCE_BYTES, Kind, ProbePacket, encode, probe_bytes_per_s
from meshopt.probe.prober import ProbeConfig
from meshopt.probe.responder import Responder
from meshopt.wireguard.keys import generate_keypair
from meshopt.wireguard.model import InterfaceConfig, PeerConfig
from meshopt.wireguard.userspace import start_wireguard_go

MESH = "bench"
NODE = "a0"
IFNAME = "wg0"
PROBE_PORT = ProbeConfig().port
EXCHANGE_B = probe_bytes_per_s(1.0, 0)  # one probe and its reply on the wire: 280 B
GOAL_CPU_PERCENT = 5.0
GOAL_RSS_MB = 80.0
TAG = "MESHOPT_BENCH_AGENT_PEERS"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def overlay(i: int) -> str:
    """Peer i's overlay address (the agent is 10.99.0.1)."""
    return f"10.99.{1 + i // 250}.{i % 250 + 1}/32"


def route_set(keys: Sequence[str], mode: str, version: int) -> RouteSet:
    n = len(keys)
    routes: list[Route] = []
    if mode == "full":
        for i, k in enumerate(keys):
            if i % 10 == 9:  # relayed through the peer before it, the direct tunnel as backup
                routes.append(Route(dst=overlay(i), via=keys[i - 1], backup=k))
            else:
                routes.append(Route(dst=overlay(i), via=k, backup=keys[(i + 1) % n]))
    else:
        m = max(2, n // 10)
        for i in range(m):
            routes.append(Route(dst=overlay(i), via=keys[i], backup=keys[(i + 1) % m]))
    return RouteSet(
        mesh=MESH, node=NODE, version=version, issued_at=time.time(), controller="ctl1",
        term=1, routes=routes,
    )  # fmt: skip


def peer_intervals(n: int, mode: str) -> list[float]:
    """The interval the agent probes each peer at (its class), which the peer mirrors:
    the budget's rule on the same route set, no traffic (the tunnels carry none)."""
    names = [str(i) for i in range(n)]
    owners = {overlay(i): name for i, name in enumerate(names)}
    use = route_use(route_set(names, mode, 1).routes, owners.get)
    plan = ProbeBudget(BudgetConfig()).plan(names, use.relays, {}, 0.0, use.backups)
    return [plan.rates[x].interval_s for x in names]


# --- the peers (load, in the namespace) -----------------------------------------------


async def peers_main(args: argparse.Namespace) -> None:
    keys = json.loads(Path(args.keys_file).read_text())
    addresses = [probe_address(k) for k in keys]
    scope = socket.if_nametoindex(IFNAME)
    responder = Responder(limit=None)
    await responder.start([f"{a}%{IFNAME}" for a in addresses], port=PROBE_PORT)
    intervals = peer_intervals(len(keys), args.mode)
    loop = asyncio.get_running_loop()
    senders: list[socket.socket] = []
    replies = [0]

    def drain(s: socket.socket) -> None:
        try:
            while True:
                s.recv(256)
                replies[0] += 1
        except BlockingIOError:
            return

    for a in addresses:
        s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        s.bind((a, 0, 0, scope))
        s.setblocking(False)
        loop.add_reader(s.fileno(), drain, s)
        senders.append(s)
    target = (args.agent_address, PROBE_PORT, 0, scope)
    nonce = os.urandom(NONCE_BYTES)
    start = loop.time()
    due = [start + (i % 20) * 0.05 for i in range(len(keys))]
    sent = seq = 0
    out = Path(args.counters_file)
    last_write = 0.0
    while True:
        now = loop.time()
        for i, s in enumerate(senders):
            if due[i] <= now:
                seq += 1
                with contextlib.suppress(OSError):
                    s.sendto(encode(ProbePacket(Kind.REQUEST, nonce, seq, time.time_ns())), target)
                    sent += 1
                due[i] += intervals[i]
                if due[i] <= now:
                    due[i] = now + intervals[i]
        if now - last_write >= 0.5:
            last_write = now
            doc = {
                "t": time.monotonic(),
                "echoed": responder.counters["echoed"],  # the agent's probes answered
                "sent": sent,  # the peers' probes to the agent
                "replies": replies[0],  # ... that it answered
            }
            tmp = out.with_suffix(".tmp")
            tmp.write_text(json.dumps(doc))
            tmp.replace(out)
        await asyncio.sleep(0.02)


# --- the driver -------------------------------------------------------------------------


def sh(*argv: str, input: str | None = None) -> None:
    subprocess.run(argv, check=True, input=input, text=True, capture_output=True)


def cpu_s(pid: int) -> float:
    user, system = cpu_split_s(pid)
    return user + system


def cpu_split_s(pid: int) -> tuple[float, float]:
    """(utime, stime) of all of ``pid``'s threads, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def status_kb(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return float(line.split()[1])
    return float("nan")


def wait_for(what: str, check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)


class TelemetryTap:
    """Every message on the agent's telemetry topic, timed (a mosquitto_sub we start)."""

    def __init__(self, sock: str, topic: str) -> None:
        self.proc = subprocess.Popen(
            ["mosquitto_sub", "--unix", sock, "-t", topic, "-v", "-q", "1"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self.messages: list[tuple[float, int, bytes]] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            topic, _, payload = line.rstrip(b"\n").partition(b" ")
            self.messages.append((time.monotonic(), len(topic) + len(payload), payload))

    def bytes_between(self, t0: float, t1: float) -> int:
        return sum(n for t, n, _ in list(self.messages) if t0 <= t < t1)

    def count_between(self, t0: float, t1: float) -> int:
        return sum(1 for t, _, _ in list(self.messages) if t0 <= t < t1)

    def last_full(self) -> dict[str, Any] | None:
        for _, _, payload in reversed(list(self.messages)):
            try:
                t = decode_telemetry(decode_signed(payload).payload)
            except BusMessageError:  # a tap, not a judge: skip what does not read
                continue
            if t.full:
                classes = [p.probe_class for p in t.peers]
                return {
                    "peers": len(t.peers),
                    "in_use": classes.count("in_use"),
                    "idle": classes.count("idle"),
                    "unreported": classes.count(None),
                    "alive": sum(1 for p in t.peers if p.alive),
                    "intervals_s": sorted({p.probe_interval_s or 0.0 for p in t.peers}),
                    "dead_after_s": sorted({p.probe_dead_after_s or 0.0 for p in t.peers}),
                    "signed_bytes": len(payload),
                    "full_interval_s": t.full_interval_s,
                }
        return None

    def close(self) -> None:
        self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def stop(proc: subprocess.Popen[Any] | None, sig: int = signal.SIGTERM, wait: float = 10) -> None:
    """End a process this script started, by its own handle (its PID)."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(wait)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def one_run(args: argparse.Namespace, mode: str, index: int) -> dict[str, Any]:
    ns = f"mab{os.getpid()}r{index}"
    tmp = Path(tempfile.mkdtemp(prefix=f"meshopt-{ns}-"))
    env = {**os.environ, TAG: ns}
    procs: list[subprocess.Popen[Any]] = []
    wg = None
    tap = None
    ns_made = False
    try:
        sh("ip", "netns", "add", ns)
        ns_made = True
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        run_dir = tmp / "wg"
        run_dir.mkdir()
        wg = start_wireguard_go(IFNAME, netns=ns, run_dir=str(run_dir), env={TAG: ns})
        own_private, own_public = generate_keypair()
        keys = [generate_keypair()[1] for _ in range(args.peers)]
        wg.backend().configure(
            IFNAME,
            InterfaceConfig(
                private_key=own_private,
                listen_port=51820,
                peers=tuple(
                    PeerConfig(public_key=k, allowed_ips=(overlay(i), probe_prefix(k)))
                    for i, k in enumerate(keys)
                ),
            ),
        )
        batch = [f"addr add 10.99.0.1/32 dev {IFNAME}", f"link set {IFNAME} up"]
        batch += [f"addr add {probe_prefix(k)} dev {IFNAME} nodad" for k in keys]
        sh("ip", "-n", ns, "-batch", "-", input="\n".join(batch) + "\n")

        sock = str(tmp / "mqtt.sock")
        (tmp / "mosquitto.conf").write_text(
            f"user root\nlistener 0 {sock}\nallow_anonymous true\npersistence false\n"
            f"log_dest file {tmp / 'mosquitto.log'}\nmax_packet_size 1048576\n"
        )
        broker = subprocess.Popen(
            ["mosquitto", "-c", str(tmp / "mosquitto.conf")],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        procs.append(broker)
        wait_for("mosquitto", lambda: os.path.exists(sock), 10)

        ctl_key, ctl_pub = generate_signing_key()
        ident, _ = generate_signing_key()
        save_private_key(tmp / "agent.key", ident)
        topics = Topics(MESH)
        data = sign_route_set(route_set(keys, mode, 1), ctl_key)
        sh("mosquitto_pub", "--unix", sock, "-t", topics.routes(NODE), "-r", "-q", "1", "-s",
           input=data.decode())  # fmt: skip
        tap = TelemetryTap(sock, topics.telemetry(NODE))

        config = {
            "agent": {
                "mesh": MESH,
                "node": NODE,
                "interfaces": [IFNAME],
                "layout": "single",
                "wireguard": "userspace",
                "wireguard_run_dir": str(run_dir),
                "mesh_prefixes": ["10.99.0.0/16"],
                "controller_keys": [ctl_pub],
                "identity_key": str(tmp / "agent.key"),
                "state_dir": str(tmp / "state"),
                "broker": f"unix://{sock}",
            },
            "bandwidth": {"enabled": False},
        }
        (tmp / "agent.toml").write_text(dump_toml(config))
        (tmp / "keys.json").write_text(json.dumps(keys))
        counters = tmp / "counters.json"
        log = (tmp / "agent.log").open("ab")
        agent = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "meshopt.cli.main", "agent",
             "--config", str(tmp / "agent.toml"), "--log-level", "info"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        log.close()
        procs.append(agent)
        load = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, __file__, "--role", "peers",
             "--keys-file", str(tmp / "keys.json"), "--mode", mode,
             "--agent-address", probe_address(own_public),
             "--counters-file", str(counters)],
            env=env, stdout=subprocess.DEVNULL, stderr=(tmp / "peers.log").open("ab"),
        )  # fmt: skip
        procs.append(load)
        try:
            wait_for("the peers' counters", counters.exists, 60)
        except RuntimeError:
            raise RuntimeError(
                f"the peers' process did not start: {(tmp / 'peers.log').read_text()[-800:]}"
            ) from None
        time.sleep(args.warmup)
        if agent.poll() is not None:
            raise RuntimeError(f"agent exited: {(tmp / 'agent.log').read_text()[-800:]}")
        c0 = json.loads(counters.read_text())
        (u0, k0), wg0, t0 = cpu_split_s(agent.pid), cpu_s(wg.pid), time.monotonic()
        cpu0 = u0 + k0
        # The event loop's thread: each voluntary switch is one sleep (a wake-up after it).
        sw0 = status_kb(agent.pid, "voluntary_ctxt_switches")
        spy = None
        if args.py_spy:  # where the agent's CPU goes (py-spy samples from outside)
            out = f"{args.py_spy_out}.{mode}.{index}.txt"
            spy = subprocess.Popen(
                [args.py_spy, "record", "-p", str(agent.pid), "-d", str(int(args.window)),
                 "-r", str(args.py_spy_rate), "-f", "raw", "-o", out],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            procs.append(spy)
        time.sleep(args.window)
        (u1, k1), wg1, t1 = cpu_split_s(agent.pid), cpu_s(wg.pid), time.monotonic()
        cpu1 = u1 + k1
        sw1 = status_kb(agent.pid, "voluntary_ctxt_switches")
        if spy is not None:  # let it write its profile (stopped early, it writes none)
            with contextlib.suppress(subprocess.TimeoutExpired):
                spy.wait(20)
        c1 = json.loads(counters.read_text())
        rss, hwm = status_kb(agent.pid, "VmRSS") / 1024, status_kb(agent.pid, "VmHWM") / 1024
        span = t1 - t0
        cspan = c1["t"] - c0["t"]
        own = (c1["echoed"] - c0["echoed"]) / cspan
        answered = (c1["replies"] - c0["replies"]) / cspan
        peer_sent = (c1["sent"] - c0["sent"]) / cspan
        classes = tap.last_full()
        return {
            "mode": mode,
            "peers": args.peers,
            "routes": len(route_set(keys, mode, 1).routes),
            "cpu_percent": 100.0 * (cpu1 - cpu0) / span,
            "cpu_user_percent": 100.0 * (u1 - u0) / span,
            "cpu_system_percent": 100.0 * (k1 - k0) / span,
            "wakeups_per_s": (sw1 - sw0) / span,
            "rss_mb": rss,
            "rss_peak_mb": hwm,
            "window_s": span,
            "probes_per_s": own,  # the agent's probes that were answered
            "answered_per_s": answered,
            "answered_share": answered / peer_sent if peer_sent else None,
            "probe_bytes_per_s": own * EXCHANGE_B,
            "probe_bytes_per_s_per_peer": own * EXCHANGE_B / args.peers,
            "telemetry_bytes_per_s": tap.bytes_between(t0, t1) / span,
            "telemetry_messages": tap.count_between(t0, t1),
            "telemetry_snapshot": classes,
            "wireguard_go_cpu_percent": 100.0 * (wg1 - wg0) / span,  # UAPI reads, no traffic
            "loadavg": [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]],
        }
    finally:
        for p in reversed(procs):
            stop(p)
        if tap is not None:
            tap.close()
        if wg is not None:
            wg.stop()
        if ns_made:
            subprocess.run(["ip", "netns", "del", ns], check=False)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


def med(runs: Sequence[dict[str, Any]], key: str) -> float:
    return round(statistics.median(float(r[key]) for r in runs), 3)


def summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        k: med(runs, k)
        for k in (
            "cpu_percent",
            "cpu_user_percent",
            "cpu_system_percent",
            "wakeups_per_s",
            "rss_mb",
            "rss_peak_mb",
            "probes_per_s",
            "answered_per_s",
            "probe_bytes_per_s",
            "probe_bytes_per_s_per_peer",
            "telemetry_bytes_per_s",
        )
    }
    out["cpu_percent_runs"] = [round(r["cpu_percent"], 2) for r in runs]
    out["rss_mb_runs"] = [round(r["rss_mb"], 1) for r in runs]
    out["goals"] = {
        "cpu_percent": GOAL_CPU_PERCENT,
        "rss_mb": GOAL_RSS_MB,
        "cpu_ok": out["cpu_percent"] <= GOAL_CPU_PERCENT,
        "rss_ok": out["rss_mb"] <= GOAL_RSS_MB,
    }
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    spinners: list[subprocess.Popen[Any]] = []
    load0 = [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    try:
        for _ in range(args.busy):
            spinners.append(
                subprocess.Popen([sys.executable, "-c", "while True: pass"], env={TAG: "spin"})
            )
        results: dict[str, Any] = {}
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in args.modes}
        n = 0
        for _ in range(args.runs):
            for mode in args.modes:  # interleaved: machine noise hits both alike
                runs[mode].append(one_run(args, mode, n))
                n += 1
        for mode in args.modes:
            results[mode] = {"median": summary(runs[mode]), "runs": runs[mode]}
    finally:
        for p in spinners:
            stop(p, signal.SIGKILL)
    return {
        "benchmark": "agent_peers",
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "settings": {
            "peers": args.peers,
            "runs": args.runs,
            "warmup_s": args.warmup,
            "window_s": args.window,
            "busy_processes": args.busy,
            "exchange_bytes": EXCHANGE_B,
            "bandwidth_trains": False,
            "wireguard": "wireguard-go (UAPI read by the agent); probes delivered locally",
        },
        "machine": {
            "cores": os.cpu_count(),
            "loadavg_before": load0,
            "loadavg_after": [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]],
        },
        "modes": results,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--peers", type=int, default=100)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--mode", default="full,partial", help="full, partial or both")
    p.add_argument(
        "--warmup", type=float, default=45.0, help="after the agent starts (> the 30 s in-use hold)"
    )
    p.add_argument("--window", type=float, default=30.0)
    p.add_argument("--busy", type=int, default=0, help="spinning processes beside it")
    p.add_argument("--keep", action="store_true", help="keep each run's directory (logs)")
    p.add_argument("--py-spy", metavar="BINARY", help="profile the agent over the window")
    p.add_argument("--py-spy-out", default="agent-profile", help="profile file prefix")
    p.add_argument("--py-spy-rate", type=int, default=50, help="py-spy samples per second")
    p.add_argument("--role", choices=("driver", "peers"), default="driver")
    p.add_argument("--keys-file", help=argparse.SUPPRESS)
    p.add_argument("--agent-address", help=argparse.SUPPRESS)
    p.add_argument("--counters-file", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.role == "peers":
        args.mode = args.mode.split(",")[0]
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(peers_main(args))
        return 0
    args.modes = [m for m in args.mode.split(",") if m]
    if not args.modes or any(m not in ("full", "partial") for m in args.modes):
        print("error: --mode: full, partial or full,partial", file=sys.stderr)
        return 2
    if not 2 <= args.peers <= 4000 or args.runs < 1 or args.window <= 0 or args.busy < 0:
        print("error: --peers 2..4000, --runs >= 1, --window > 0, --busy >= 0", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("error: needs root (a network namespace and wireguard-go)", file=sys.stderr)
        return 2
    ipaddress.ip_network(overlay(args.peers - 1))
    try:
        print(json.dumps(run(args), indent=2))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
