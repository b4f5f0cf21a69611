"""The agent's probe classes from its route set and WireGuard reading (meshopt.probe.budget
rule, docs/probe-budget.md), and the peer poll's cheap path.

The adapters (netlink, WireGuard's control socket, sysctls) are stand-ins; the agent's
own polling and planning run. Nothing here sleeps or opens a socket.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from pathlib import Path

import msgspec

from meshopt.agent.config import load_config
from meshopt.agent.daemon import Agent
from meshopt.agent.probeaddr import probe_prefix
from meshopt.bus.messages import Route, RouteSet
from meshopt.probe.budget import IDLE, IN_USE
from meshopt.wireguard.keys import generate_keypair
from meshopt.wireguard.model import InterfaceState, PeerState

from .test_agent_config import real_copy

OWN = generate_keypair()[1]
KEYS = [generate_keypair()[1] for _ in range(6)]


def overlay(i: int) -> str:
    return f"10.99.0.{i + 2}/32"


class Net:
    """Netlink: one interface, counted dumps. It is called ``lo``: the prober resolves
    its targets' scope to an index (and opens nothing here)."""

    def __init__(self) -> None:
        self.dumps = 0

    async def match_interfaces(self, patterns: object) -> list[str]:
        return ["lo"]

    async def links(self) -> dict[str, int]:
        self.dumps += 1
        return {"lo": 1}

    async def addresses(self) -> dict[int, list[str]]:
        return {1: ["10.99.0.1/32"]}

    async def ensure_link_local(self, ifindex: int, address: str) -> bool:
        return False


class WireGuard:
    """wireguard-go's control socket: the same peers, in a new order at every read (as
    Go's map iteration gives them), each with its counters."""

    def __init__(self) -> None:
        self.rx = dict.fromkeys(KEYS, 0)
        self.rng = random.Random(5)

    async def get(self, name: str) -> InterfaceState:
        peers = [
            PeerState(
                public_key=k,
                allowed_ips=tuple(reversed((overlay(i), probe_prefix(k))))
                if self.rng.random() < 0.5
                else (overlay(i), probe_prefix(k)),
                rx_bytes=self.rx[k],
            )
            for i, k in enumerate(KEYS)
        ]
        self.rng.shuffle(peers)
        return InterfaceState(public_key=OWN, peers=tuple(peers))


class Listeners:
    """The responders' sockets: binds what it is given, but ``refuse`` addresses."""

    def __init__(self) -> None:
        self.refuse = 0
        self.addresses: list[str] = []

    def listen_on(self, hosts: list[str]) -> list[tuple[str, Exception]]:
        hosts = list(hosts)
        self.addresses = hosts[self.refuse :]
        return [(h, OSError("not yet")) for h in hosts[: self.refuse]]


class Sysctls:
    def enable_interface(self, ifname: str, ipv6: object) -> None:
        pass


def agent_with_fakes(tmp_path: Path) -> tuple[Agent, Net, WireGuard, list[float]]:
    agent = Agent(load_config(real_copy(tmp_path)))
    agent.cfg = dataclasses.replace(
        agent.cfg, routes=dataclasses.replace(agent.cfg.routes, forwarding=False)
    )
    net, wg = Net(), WireGuard()
    agent.net = net  # type: ignore[assignment]
    agent.wg = wg  # type: ignore[assignment]
    agent.sysctls = Sysctls()  # type: ignore[assignment]
    for responder in (agent.responder, agent.trains):  # no socket: nothing to bind
        responder._listeners = Listeners()  # type: ignore[assignment]
    now = [100.0]
    agent.clock = lambda: now[0]
    return agent, net, wg, now


def classes(agent: Agent) -> dict[int, str]:
    plan = agent.probe_plan
    assert plan is not None
    return {i: plan.rates[k].cls for i, k in enumerate(KEYS)}


def test_a_reading_that_only_changed_order_takes_the_cheap_path(tmp_path: Path) -> None:
    agent, net, _, now = agent_with_fakes(tmp_path)

    async def main() -> None:
        await agent._poll_peers()
        assert net.dumps == 1  # the first poll: the full check (links, addresses, plan)
        for _ in range(5):
            now[0] += 2.0
            await agent._poll_peers()
        assert net.dumps == 1  # the same peers in another order: no full check
        now[0] += 30.0  # the periodic full check still comes
        await agent._poll_peers()
        assert net.dumps == 2
        # A probe address the responder could not bind is tried again at the next poll.
        listeners = agent.responder._listeners
        assert isinstance(listeners, Listeners)
        listeners.refuse = 1
        now[0] += 30.0
        await agent._poll_peers()
        assert net.dumps == 3
        listeners.refuse = 0
        now[0] += 2.0
        await agent._poll_peers()
        assert net.dumps == 4 and len(agent.responder.addresses) == 1
        now[0] += 2.0
        await agent._poll_peers()
        assert net.dumps == 4  # all bound: the cheap path again

    asyncio.run(main())


def test_relays_traffic_and_their_backups_are_in_use_direct_routes_idle(tmp_path: Path) -> None:
    agent, _, wg, now = agent_with_fakes(tmp_path)
    routes = [
        Route(dst=overlay(0), via=KEYS[0], backup=KEYS[1]),  # direct, no traffic
        Route(dst=overlay(1), via=KEYS[1], backup=KEYS[2]),  # direct, no traffic
        Route(dst=overlay(2), via=KEYS[3], backup=KEYS[2]),  # relayed by 3, backup 2 direct
        Route(dst=overlay(3), via=KEYS[3], backup=KEYS[4]),  # 3's own, backup 4
        Route(dst=overlay(5), via=KEYS[5], backup=KEYS[0]),  # direct; traffic comes later
    ]
    rs = RouteSet(
        mesh=agent.cfg.mesh,
        node=agent.cfg.node,
        version=1,
        issued_at=time.time(),
        controller="ctl1",
        term=1,
        routes=routes,
    )

    async def main() -> None:
        await agent._poll_peers()
        # No route set yet: every link in use (the controller needs samples of each).
        assert set(classes(agent).values()) == {IN_USE}
        agent.core.route_set = rs
        now[0] += 2.0
        await agent._poll_peers()
        # A route set that moved next hops (here: the first): every link stays in use
        # for the hold time, so the controller's candidates are measured fast.
        assert set(classes(agent).values()) == {IN_USE}
        now[0] += 31.0  # settling ends 30 s after the route set, and leaves no hold
        await agent._poll_peers()
        # 3 relays; 2 and 4 back up its routes. 0, 1 and 5 are direct without traffic.
        assert classes(agent) == {
            0: IDLE,
            1: IDLE,
            2: IN_USE,
            3: IN_USE,
            4: IN_USE,
            5: IDLE,
        }
        wg.rx[KEYS[5]] += 20_000  # 10 kB/s over the next 2 s poll: traffic on 5
        now[0] += 2.0
        await agent._poll_peers()
        got = classes(agent)
        assert got[5] == IN_USE and got[0] == IN_USE  # and 0, its route's backup
        assert got[1] == IDLE  # 0 is only a backup: its own route's backup stays idle
        # The same routes again (a new version, nothing moved): no settling.
        agent.core.route_set = msgspec.structs.replace(rs, version=2)
        now[0] += 2.0
        await agent._poll_peers()
        assert classes(agent)[1] == IDLE
        # A backup moved: everything in use again for the hold time.
        moved = [*routes[:4], Route(dst=overlay(5), via=KEYS[5], backup=KEYS[1])]
        agent.core.route_set = msgspec.structs.replace(rs, version=3, routes=moved)
        now[0] += 2.0
        await agent._poll_peers()
        assert set(classes(agent).values()) == {IN_USE}

    asyncio.run(main())
