"""A live mesh in a lab: agents in every node, controllers next to the broker.

This is what ``meshopt demo``, the convergence benchmark and the closed-loop lab tests
run on. Everything it reports is read from the nodes themselves (routes with
``ip route``, AllowedIPs with ``wg``, pings), never from the controller's own idea of
what it installed, so a route that did not take effect shows as such.
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshopt.lab.agents import (
    agent_log,
    controller_key,
    controller_log,
    start_agent,
    start_controller,
)
from meshopt.lab.lab import Lab
from meshopt.lab.state import LabError
from meshopt.wireguard.errors import WireGuardError
from meshopt.wireguard.userspace import UserspaceBackend

FAST_TABLE = 7701

# Agents in a lab: bandwidth trains off unless asked for (they would load the shared
# emulator while the demo measures latency), everything else at its defaults.
QUIET_AGENT: dict[str, dict[str, Any]] = {"bandwidth": {"enabled": False}}


def ip_json(text: str) -> list[dict[str, Any]]:
    """``ip -j`` output; an empty table prints "[" alone (and an error on stderr)."""
    try:
        out = json.loads(text or "[]")
    except json.JSONDecodeError:
        return []
    return out if isinstance(out, list) else []


@dataclass
class LiveMesh:
    lab: Lab
    agent_sections: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: QUIET_AGENT)
    controller_settings: Mapping[str, Any] = field(default_factory=dict)
    controller_sections: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    agents: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    controllers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    # --- processes ---------------------------------------------------------------------

    @property
    def nodes(self) -> list[str]:
        return [n.name for n in self.lab.plan.nodes]

    def start(self, *, controllers: Sequence[str] = ("ctl1",)) -> None:
        for cid in controllers:
            self.start_controller(cid)
        self.start_agents()

    def start_controllers(
        self, controllers: Sequence[str] = ("ctl1",), *, ready_s: float = 30.0
    ) -> float:
        """Start the controllers and wait until each is on the broker and one is active:
        a benchmark that times the agents' start-up starts them into a running control
        plane, as on a real mesh, not beside ten Python start-ups at once. Returns the
        seconds it took."""
        began = time.monotonic()
        for cid in controllers:
            self.start_controller(cid)
        while True:
            logs = [controller_log(self.lab, cid) for cid in controllers]
            if all("connected to" in t for t in logs) and any("active (term" in t for t in logs):
                return time.monotonic() - began
            dead = [cid for cid in controllers if self.controllers[cid].poll() is not None]
            if dead or time.monotonic() - began > ready_s:
                why = f"exited: {', '.join(dead)}" if dead else f"not active after {ready_s:g} s"
                tails = "\n".join(
                    f"--- {c}\n{t[-1500:]}" for c, t in zip(controllers, logs, strict=True)
                )
                raise LabError(f"lab controllers {why}\n{tails}")
            time.sleep(0.05)

    def start_agents(self) -> None:
        for node in self.nodes:
            self.start_agent(node)

    def start_controller(self, cid: str = "ctl1") -> None:
        self.controllers[cid] = start_controller(
            self.lab,
            cid,
            settings=self.controller_settings,
            sections=self.controller_sections,
        )

    def start_agent(self, node: str) -> None:
        _, public = controller_key(self.lab)
        self.agents[node] = start_agent(
            self.lab, node, controller_keys=[public], sections=self.agent_sections
        )

    def stop_agent(self, node: str, *, kill: bool = False) -> None:
        """SIGTERM (clean stop: routes withdrawn if configured) or SIGKILL (a crash)."""
        proc = self.agents.pop(node)
        proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def stop_controller(self, cid: str = "ctl1", *, kill: bool = False) -> None:
        proc = self.controllers.pop(cid)
        proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        proc.wait(10)

    def stop(self) -> None:
        for node in list(self.agents):
            self.stop_agent(node)
        for cid in list(self.controllers):
            self.stop_controller(cid)

    def logs(self) -> str:
        parts = [
            f"--- controller {c}\n{controller_log(self.lab, c)[-3000:]}" for c in self.controllers
        ]
        parts += [f"--- agent {n}\n{agent_log(self.lab, n)[-2000:]}" for n in self.nodes]
        return "\n".join(parts)

    def diagnose(self) -> str:
        """What a failed lab test needs to be explained after the fact (CI keeps only its
        output): every node's policy rules, meshopt routes, tunnels and forwarding
        counters, the underlay's drops and lag, and the logs' tails."""
        parts: list[str] = []
        commands = (
            ["ip", "rule", "show"],
            ["ip", "route", "show", "table", "all", "proto", "77"],
            ["wg", "show", "all", "dump"],
            ["sh", "-c", "grep -h . /proc/sys/net/ipv4/ip_forward; grep '^Ip:' /proc/net/snmp"],
        )
        for node in self.nodes:
            for argv in commands:
                try:
                    out = self.lab.run(node, argv, timeout=10)
                    text = (out.stdout + out.stderr).strip()
                except (OSError, subprocess.SubprocessError) as exc:
                    text = f"({exc})"
                parts.append(f"--- {node}: {' '.join(argv)}\n{text}")
        try:
            stats = self.lab.emulator.stats()
            parts.append("--- underlay stats\n" + json.dumps(stats, sort_keys=True)[:6000])
        except Exception as exc:  # a diagnosis never hides the failure
            parts.append(f"--- underlay stats unavailable: {exc}")
        for proc in self.lab.state.procs:
            if proc.role.startswith("wg:") and proc.log:
                try:
                    tail = Path(proc.log).read_text(errors="replace")[-1500:]
                except OSError as exc:
                    tail = f"({exc})"
                parts.append(f"--- wireguard-go {proc.role[3:]}\n{tail}")
        parts.append(self.logs())
        return "\n".join(parts)

    # --- reading the nodes -------------------------------------------------------------

    def key_owner(self) -> dict[str, str]:
        """WireGuard public key -> node name (every interface of every node)."""
        return {w.public_key: w.node for w in self.lab.state.wg}

    def installed(self, node: str) -> dict[str, str]:
        """Our routes in ``node``'s fast table: destination -> outgoing interface."""
        out = self.lab.run(node, ["ip", "-j", "route", "show", "table", str(FAST_TABLE)])
        routes = ip_json(out.stdout)
        return {r["dst"]: r["dev"] for r in routes if r.get("protocol") in ("77", 77)}

    def allowed_ips(self, node: str) -> dict[str, list[str]]:
        """Peer public key -> AllowedIPs, over all of ``node``'s interfaces.

        From wireguard-go's UAPI sockets where the node has them (a few ms for a whole
        mesh, so a benchmark can read every node often without loading the machine it
        measures), else ``wg show`` in the node."""
        result: dict[str, list[str]] = {}
        run_dir = self.lab.wg_run_dir(node)
        if self.lab.state.wireguard == "userspace" and run_dir.is_dir():
            backend = UserspaceBackend(str(run_dir))
            for w in self.lab.state.wg:
                if w.node != node:
                    continue
                try:
                    peers = backend.get(w.ifname).peers
                except WireGuardError:  # not there (as ``wg show`` lists nothing for it)
                    continue
                for peer in peers:
                    result[peer.public_key] = list(peer.allowed_ips)
            return result
        out = self.lab.run(node, ["wg", "show", "all", "allowed-ips"]).stdout
        for line in out.splitlines():
            parts = line.split()
            if len(parts) >= 2:
                result[parts[1]] = [p for p in parts[2:] if p != "(none)"]
        return result

    def _node_hops(self, src: str) -> dict[str, str]:
        """dst node -> the node ``src`` hands its packets to, as its kernel and WireGuard do."""
        owner = self.key_owner()
        host = {n: self.lab.overlay_ip(n) for n in self.nodes}
        out: dict[str, str] = {}
        if self.lab.plan.layout == "single":
            prefixes = self.allowed_ips(src)
            for key, allowed in prefixes.items():
                for dst, addr in host.items():
                    if f"{addr}/32" in allowed or f"{addr}/128" in allowed:
                        out[dst] = owner[key]
            return out
        # Per-peer: our table first (the rule sends everything there), then main.
        dev_peer = {w.ifname: w.peers[0] for w in self.lab.state.wg if w.node == src}
        for table in ("main", str(FAST_TABLE)):
            text = self.lab.run(src, ["ip", "-j", "route", "show", "table", table]).stdout
            for r in ip_json(text):
                dst = r.get("dst", "").split("/")[0]
                for node, addr in host.items():
                    if dst == addr and r.get("dev") in dev_peer:
                        out[node] = dev_peer[r["dev"]]
        return out

    def next_hops(self) -> dict[str, dict[str, str]]:
        """A snapshot of every node's next hops: ``hops[src][dst]``."""
        return {n: self._node_hops(n) for n in self.nodes}

    def next_hop(self, src: str, dst: str) -> str | None:
        return self._node_hops(src).get(dst)

    @staticmethod
    def path_from(hops: Mapping[str, Mapping[str, str]], src: str, dst: str) -> list[str]:
        """Hop by hop through a snapshot; ends in "?" at a loop or a dead end."""
        path = [src]
        while path[-1] != dst and len(path) <= len(hops):
            nxt = hops.get(path[-1], {}).get(dst)
            if nxt is None or nxt in path:
                path.append("?")
                break
            path.append(nxt)
        return path

    @classmethod
    def direct_but(
        cls, hops: Mapping[str, Mapping[str, str]], relayed: Mapping[tuple[str, str], list[str]]
    ) -> bool:
        """Every pair of the snapshot on its own tunnel, but the ``relayed`` pairs, each on
        its given path: what a test's small mesh looks like on its optimum."""
        nodes = sorted(hops)
        return all(
            cls.path_from(hops, s, d) == relayed.get((s, d), [s, d])
            for s in nodes
            for d in nodes
            if s != d
        )

    def path(self, src: str, dst: str) -> list[str]:
        """As the nodes forward now, following each hop's own next hop."""
        return self.path_from(self.next_hops(), src, dst)

    def forwarded(self, node: str) -> int:
        """Packets ``node`` forwarded for others so far (its namespace's ForwDatagrams)."""
        text = self.lab.run(node, ["cat", "/proc/net/snmp"]).stdout
        lines = [ln.split() for ln in text.splitlines() if ln.startswith("Ip:")]
        return int(lines[1][lines[0].index("ForwDatagrams")])

    def ping(
        self, src: str, dst: str, *, count: int = 10, interval: float = 0.05, timeout: float = 2.0
    ) -> list[float]:
        """RTTs (ms) of the replies that came back; lost pings are simply missing."""
        return self.lab.ping(src, dst, count=count, interval=interval, timeout=timeout)

    def median_rtt(self, src: str, dst: str, count: int = 10) -> float | None:
        rtts = self.ping(src, dst, count=count)
        return statistics.median(rtts) if rtts else None


def wait_until(
    check: Callable[[], bool], timeout: float, *, interval: float = 0.05
) -> float | None:
    """Seconds until ``check()`` first held, or None if it never did within ``timeout``."""
    start = time.monotonic()
    while True:
        if check():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            return None
        time.sleep(interval)
