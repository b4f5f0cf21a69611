"""What the agent must remember across restarts: AllowedIPs before it, and the route set.

Baseline AllowedIPs are taken the first time a peer is seen; after a restart the live
AllowedIPs carry the agent's own changes, so they could no longer be told apart from
the operator's configuration. The newest installed route-set version is kept so that
an older set (a replay, or a stale retained message) is never installed after a restart.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgspec

log = logging.getLogger("meshopt.agent")


class AgentState(msgspec.Struct):
    v: int = 1
    baseline: dict[str, list[str]] = msgspec.field(default_factory=dict)
    route_version: int = 0
    route_term: int = 0  # the newest controller term seen in an installed route set


def load_state(path: Path) -> AgentState:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return AgentState()
    try:
        return msgspec.json.decode(data, type=AgentState)
    except msgspec.DecodeError as exc:
        log.warning("ignoring unreadable agent state %s: %s", path, exc)
        return AgentState()


def save_state(path: Path, state: AgentState) -> None:
    """Write atomically (rename), so a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.encode(state))
    os.replace(tmp, path)
