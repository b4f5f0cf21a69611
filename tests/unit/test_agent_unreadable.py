"""An interface that stops answering keeps its peers for a while (issue 14, VM stalls).

wireguard-go starved on a busy VM lets its control socket time out. The agent used to
drop that interface's peers at once, so its telemetry listed none and the controller
withdrew every route through them, although the tunnels still carried traffic. The
two adapters (netlink's interface list, WireGuard's control socket) are replaced by
stand-ins that answer as a starved wireguard-go does; the agent's own logic runs.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from meshopt.agent.config import load_config
from meshopt.agent.daemon import UNREADABLE_GRACE_S, Agent
from meshopt.wireguard.errors import UapiError
from meshopt.wireguard.model import InterfaceState, PeerState

from .test_agent_config import real_copy

KEY = "x" * 43 + "="


class Links:
    def __init__(self) -> None:
        self.names = ["wg0"]

    async def match_interfaces(self, patterns: object) -> list[str]:
        return list(self.names)


class Socket:
    """wireguard-go's control socket: answers, or times out like a starved one."""

    def __init__(self) -> None:
        self.answers = True

    async def get(self, name: str) -> InterfaceState:
        if not self.answers:
            raise UapiError("no reply within 5 s", path=f"/var/run/wireguard/{name}.sock")
        return InterfaceState(public_key=KEY, peers=(PeerState(public_key="p" * 43 + "="),))


def test_a_silent_interface_keeps_its_peers_for_the_grace_then_loses_them(
    tmp_path: Path,
) -> None:
    agent = Agent(load_config(real_copy(tmp_path)))
    links, sock = Links(), Socket()
    agent.net = links  # type: ignore[assignment]
    agent.wg = sock  # type: ignore[assignment]
    now = [100.0]
    agent.clock = lambda: now[0]

    async def read() -> set[str]:
        got = await agent._read_interfaces()
        return {p.public_key for s in got.values() for p in s.peers}

    async def main() -> None:
        first = await read()
        assert len(first) == 1
        sock.answers = False
        now[0] += UNREADABLE_GRACE_S - 1
        assert await read() == first  # starved, not gone
        assert agent.counters["interface_unreadable"] >= 1
        now[0] += 2
        assert await read() == set()  # silent past the grace: gone
        sock.answers = True
        assert await read() == first
        links.names = []  # the interface itself went away: gone at once
        sock.answers = False
        assert await read() == set()
        links.names = ["wg0"]
        assert await read() == set()  # and no stale reading comes back with it

    asyncio.run(main())
