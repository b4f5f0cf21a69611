"""What the agent tells the controller before its next telemetry check."""

from __future__ import annotations

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
