"""What the agent tells the controller before its next telemetry check."""

from __future__ import annotations

from pathlib import Path

from meshopt.agent.config import load_config
from meshopt.agent.daemon import Agent

from .test_agent_config import real_copy


def test_a_peer_found_dead_is_told_at_once_one_alive_again_waits(tmp_path: Path) -> None:
    agent = Agent(load_config(real_copy(tmp_path)))
    assert agent.cfg.telemetry.check_interval_s >= 1.0  # what "at once" saves
    agent._on_liveness("peerkey" * 6, True)
    assert not agent._tell_now.is_set(), "a peer back is news for the next check"
    agent._on_liveness("peerkey" * 6, False)
    assert agent._tell_now.is_set(), "a dead peer: the others' relays move now"
