"""The agent's bus decisions, without I/O: which route set to install, what to sign.

The asyncio shell (meshopt.agent.daemon) hands each route-set message here and installs
what comes back; it asks here for the signed telemetry, status and will it publishes.
Tests drive it with plain calls (replay, old term, wrong key, wrong node, a term or
version the clock cannot explain).

Sequence numbers start at the wall clock in microseconds (:func:`first_seq`) and rise by
one per message, so they keep rising across restarts without any state on disk. Each
broker session takes one: the online status and the will of that session carry it, and
every telemetry message names it (``session``), so the controller can tell the will of
the current session from an old one replayed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from meshopt.agent.telemetry import telemetry
from meshopt.bus.freshness import MAX_SKEW_S, first_seq, seq_ceiling, term_ceiling
from meshopt.bus.messages import (
    AgentStatus,
    BusMessageError,
    Counters,
    PeerReport,
    RouteSet,
)
from meshopt.bus.signing import (
    KeyRing,
    PrivateKeyObject,
    PublicKeyLike,
    key_id,
    sign,
    verify_route_set,
)
from meshopt.bus.topics import Topics

log = logging.getLogger("meshopt.agent")


@dataclass
class RouteState:
    """What must survive a restart: the newest installed version and term."""

    version: int = 0
    term: int = 0


@dataclass(frozen=True)
class Accepted:
    route_set: RouteSet
    save: bool  # version or term moved: persist before installing


class AgentCore:
    def __init__(
        self,
        mesh: str,
        node: str,
        identity: PrivateKeyObject,
        controller_keys: Sequence[PublicKeyLike],
        state: RouteState,
        wall: float,
        *,
        max_skew_s: float = MAX_SKEW_S,
        counters: Counters | None = None,
    ) -> None:
        self.mesh = mesh
        self.node = node
        self.topics = Topics(mesh)
        self.identity = identity
        self.key_id = key_id(identity)
        self.trusted = KeyRing(controller_keys)
        self.state = state
        self.max_skew_s = max_skew_s
        self.counters = counters or Counters("agent dropped", log)
        self.route_set: RouteSet | None = None
        self.seq = first_seq(wall)
        self.session = 0

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    # --- what we publish ----------------------------------------------------------------

    def _status(self, online: bool, wall: float, reason: str) -> bytes:
        st = AgentStatus(
            mesh=self.mesh,
            node=self.node,
            online=online,
            since=wall,
            seq=self.session,
            reason=reason,
        )
        return sign("status", st, self.identity, self.key_id)

    def new_session(self, wall: float) -> tuple[str, bytes, bool]:
        """The will for a new broker connection (topic, payload, retain); starts a session."""
        self.session = self.next_seq()
        return self.topics.status(self.node), self._status(False, wall, "agent lost"), True

    def online(self, wall: float) -> bytes:
        return self._status(True, wall, "")

    def offline(self, wall: float, reason: str) -> bytes:
        return self._status(False, wall, reason)

    def telemetry(
        self,
        wall: float,
        *,
        public_keys: list[str],
        addresses: list[str],
        full: bool,
        peers: list[PeerReport],
        counters: dict[str, int],
    ) -> bytes:
        t = telemetry(
            mesh=self.mesh,
            node=self.node,
            public_keys=public_keys,
            addresses=addresses,
            seq=self.next_seq(),
            session=self.session,
            sent_at=wall,
            full=full,
            peers=peers,
            counters=counters,
        )
        return sign("telemetry", t, self.identity, self.key_id)

    # --- what we receive ----------------------------------------------------------------

    def on_route_set(self, payload: bytes, wall: float) -> Accepted | None:
        """The route set to install, or None (refused and counted as ``routeset_<reason>``)."""
        try:
            return self._route_set(payload, wall)
        except BusMessageError as exc:
            self.counters.count(f"routeset_{exc.reason}", str(exc))
            return None

    def _route_set(self, payload: bytes, wall: float) -> Accepted:
        if not self.trusted:
            raise BusMessageError("unknown_key", "no controller_keys configured")
        rs = verify_route_set(payload, self.trusted, mesh=self.mesh, node=self.node)
        if rs.version > seq_ceiling(wall, self.max_skew_s):
            raise BusMessageError("bad_version", f"version {rs.version} runs ahead of the clock")
        if rs.term > term_ceiling(wall, self.max_skew_s):
            raise BusMessageError("term_jump", f"term {rs.term} runs ahead of the clock")
        installed = self.state.version
        if rs.version < installed or (rs.version == installed and self.route_set is not None):
            raise BusMessageError("replay", f"version {rs.version} <= {installed}")
        if rs.term < self.state.term:
            # A deposed controller that has not noticed yet: a newer term has spoken.
            raise BusMessageError("old_term", f"{rs.controller} term {rs.term} < {self.state.term}")
        self.route_set = rs
        save = rs.version != installed or rs.term != self.state.term
        self.state.version = rs.version
        self.state.term = rs.term
        return Accepted(rs, save)
