"""What the agent tells the controller before its next telemetry check."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from meshopt.agent.config import load_config
from meshopt.agent.daemon import Agent

from .test_agent_config import real_copy


def test_a_peer_found_dead_or_back_is_told_at_once(tmp_path: Path) -> None:
    """A death moves the routes others relay over the peer; a return brings back the
    routes withdrawn from it, and a node's peers each telling it at their own check (up
    to a second apart) made the controller re-install them through whichever link it
    heard of first, then move them again."""
    agent = Agent(load_config(real_copy(tmp_path)))
    assert agent.cfg.telemetry.check_interval_s >= 1.0  # what "at once" saves
    agent._on_liveness("peerkey" * 6, False)
    assert agent._tell_now.is_set(), "a dead peer: the others' relays move now"
    agent._tell_now.clear()
    agent._on_liveness("peerkey" * 6, True)
    assert agent._tell_now.is_set(), "a peer back: its routes return together"


def test_a_probe_heard_releases_its_senders_peer(tmp_path: Path) -> None:
    """The responder tells the agent of every probe it answers; the sender (link-local,
    with the interface's scope) maps to its peer, each time, and a stranger to none."""
    agent = Agent(load_config(real_copy(tmp_path)))
    released: list[str] = []
    agent.prober.release = lambda name, now=None: released.append(name) or True  # type: ignore[method-assign]
    agent._by_probe_address = {ipaddress.ip_address("fe80::2"): "peer-b"}
    for _ in range(3):
        agent._heard(ipaddress.IPv6Address("fe80::2%wg0"))
    agent._heard(ipaddress.IPv6Address("fe80::9%wg0"))
    assert released == ["peer-b"] * 3
