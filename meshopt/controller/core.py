"""The controller's decisions, without I/O (Faucet's ``valve`` style): data in, actions out.

:class:`ControllerCore` takes each bus message with the clocks (``now`` monotonic,
``wall`` unix time) and returns the messages to publish; the asyncio shell
(meshopt.controller.daemon) only moves bytes between the broker and here. Tests drive
it with plain calls.

What it trusts, in order (each refusal is one dropped message and one counter, named
``<kind>_<reason>``; nothing a message contains can raise out of here):

* telemetry and status of node N: signed by N's enrolled identity key, for this mesh and
  N (the topic's), not from the future (``max_skew_s``), newer than the last accepted
  (per-node sequence), claiming only pinned WireGuard keys and addresses when the
  enrolment pins them, and no key or address another node already owns (the view);
* an offline status (the will): only for the agent's current broker session, so an old
  will replayed cannot take a live node out of routing;
* leases, controller status and retained route sets: signed by a controller key, with
  terms and versions the clock can explain and a lease lifetime of at most
  ``MAX_LEASE_FACTOR`` x ``lease_s``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshopt.bus.freshness import (
    MAX_AGE_S,
    SequenceGuard,
    check_time,
    first_seq,
    seq_ceiling,
    term_ceiling,
)
from meshopt.bus.messages import (
    BusMessageError,
    ControllerStatus,
    Counters,
    Lease,
    PeerTable,
    Route,
    RouteSet,
    Telemetry,
    decode,
    tables_moved,
)
from meshopt.bus.signing import (
    KeyRing,
    key_id,
    sign,
    unsigned_payload,
    verify_controller_status,
    verify_lease,
    verify_route_set,
    verify_status,
    verify_telemetry,
)
from meshopt.bus.topics import Topics
from meshopt.controller.config import ControllerConfig, Enrolment
from meshopt.controller.engine import DEGRADED_ABS_MS, Computed, RouteEngine, startup_policy
from meshopt.controller.explain import pending
from meshopt.controller.lease import LeaseKeeper, check_lease
from meshopt.controller.urgent import UrgentFix, urgent_fix
from meshopt.controller.view import (
    MeshView,
    TelemetryRefused,
    _PeerArrays,
    link_matrices,
    usable_peer,
    warmed_up,
)
from meshopt.routing.tables import NO_ROUTE, FloatArray, IntArray

log = logging.getLogger("meshopt.controller")


@dataclass(frozen=True)
class Publish:
    """One message to publish; ``node``/``routes`` mark a route set (reported back).

    ``priority`` orders route sets when many wait (lower first): ``URGENT`` when a
    next hop of the node's failed or its path got far worse (the engine's
    ``DEGRADED_*``), ``CHANGED`` when a fast next hop moved, ``REFRESH``
    for backups, bulk routes and settings only."""

    topic: str
    payload: bytes
    retain: bool = False
    qos: int = 1
    node: str | None = None
    routes: tuple[Route, ...] = ()
    priority: int = 2


URGENT, CHANGED, REFRESH = 0, 1, 2
OWN_KEPT = 4  # our own publishes remembered per topic, to know their echoes
# Recomputes for routine snapshots only (noise) take at most this share of a core: the
# next waits for the last one's CPU time / ROUTINE_SHARE after it began. Change reports,
# statuses and snapshots that moved something still wait only ``debounce_s``.
ROUTINE_SHARE = 0.05
# The urgent path (see ``urgent_plan``): a link whose cost rose at least this factor and
# DEGRADED_ABS_MS (or died) is a candidate; the entries over it move if the engine's
# "far worse" holds for them. During a recompute, held telemetry is read ahead for such
# links only up to this size (change reports; a full snapshot of 1000 peers is ~150 kB,
# and reading every one twice would cost more than it finds).
LINK_JUMP = 1.5
PEEK_MAX_BYTES = 16384
# A mass failure is the full pass's: many nodes or links gone at once (a controller that
# lagged and found a fifth of the mesh stale, a partition) moved tens of thousands of
# entries in one urgent plan at 1000 nodes, 16 s on the loop, and the broker dropped the
# controller for its missed keepalive. Past these counts (failures not yet covered by a
# full pass) the urgent path stands aside until the next full pass has finished.
URGENT_MAX_NODES = 8
URGENT_MAX_LINKS = 64


@dataclass
class _Event:
    """A failure the urgent path acts on: a node gone (``link`` None) or a link whose
    cost rose to ``cost``. ``in_view``: the message that told it was taken by the view
    (a recompute started after that covers it)."""

    id: int
    node: str
    link: str | None
    cost: float
    noise: float
    in_view: bool
    noted_at_pass: int = 0  # full passes finished when it was told


@dataclass
class _Base:
    """What the urgent path works on: the last full pass's decision (copies) with the
    urgent moves since then applied, and what building routes needs of the view then."""

    names: list[str]
    index: dict[str, int]
    next_hop: IntArray
    cost: FloatArray
    noise: FloatArray
    dead: np.ndarray
    backup: IntArray | None
    bulk: IntArray | None
    # The engine's best table and distances: shared with it (never written) until an
    # urgent plan moves them, copied then.
    best: IntArray | None
    dist: FloatArray | None
    peers: dict[str, tuple[list[str], np.ndarray]]
    addresses: dict[str, list[str]]
    # The pass's route lists laid out by destination (Computed.layouts).
    layouts: dict[str, tuple[list[Route], np.ndarray]] = field(default_factory=dict)
    _keys: dict[int, dict[int, str]] = field(default_factory=dict)
    _own_best: bool = False
    _own_costs: bool = False

    def key_for(self, s: int) -> dict[int, str]:
        """Node index -> the key node ``s`` knows it by (the last, as the engine does)."""
        out = self._keys.get(s)
        if out is None:
            keys, dst = self.peers.get(self.names[s], ([], np.zeros(0, dtype=np.intp)))
            # dict(zip()) keeps the last key per index, in C (a dict comprehension over
            # ~1000 peers per row was a tenth of a dead relay's urgent plan at N = 1000).
            out = dict(zip(dst.tolist(), keys, strict=False))
            if out and min(out) < 0:
                out = {i: k for i, k in out.items() if i >= 0}
            self._keys[s] = out
        return out


def _normal(prefix: str) -> str:
    return str(ipaddress.ip_network(prefix, strict=False))


class ControllerCore:
    def __init__(self, cfg: ControllerConfig, key: Ed25519PrivateKey) -> None:
        self.cfg = cfg
        self.key = key
        self.key_id = key_id(key)
        self.topics = Topics(cfg.mesh)
        self.counters = Counters("controller dropped", log)
        self.controllers = KeyRing([key.public_key(), *cfg.controller_keys])
        self.enrolled: dict[str, Enrolment] = {e.node: e for e in cfg.node_keys}
        self.node_rings = {e.node: KeyRing([e.key]) for e in cfg.node_keys}
        self.pinned_keys = {e.node: set(e.wireguard) for e in cfg.node_keys if e.wireguard}
        self.pinned_addrs = {
            e.node: {_normal(a) for a in e.addresses} for e in cfg.node_keys if e.addresses
        }
        self.view = MeshView(
            cfg.mesh,
            metric=cfg.metric.metric(),
            stale_after_s=cfg.stale_after_s,
            allowed=sorted(self.enrolled),
        )
        self.engine = RouteEngine(
            cfg.policy.policy(),
            relay_hop_ms=cfg.metric.relay_hop_ms,
            symmetric=cfg.symmetric,
            bulk=cfg.bulk,
        )
        self.lease = LeaseKeeper(cfg.mesh, cfg.id, lease_s=cfg.lease_s, settle_s=cfg.settle_s)
        self.telemetry_seq = SequenceGuard(cfg.max_skew_s)
        self.status_seq: dict[str, int] = {}
        self.session: dict[str, int] = {}  # per node: the broker session of its telemetry
        self.controller_since: dict[str, float] = {}
        self.retained_sets: dict[str, RouteSet] = {}
        self.published: dict[str, list[Route]] = {}  # the broker took these
        # Signed and handed to the shell, possibly still on the way: what the next
        # recompute compares with, so a set on its way is not signed twice.
        self.intended: dict[str, list[Route]] = {}
        self.version = 0
        self.dirty_since: float | None = None
        self.urgent = False
        # Links reported back since the last recompute: the first such report's time,
        # and until when the recompute waits for the rest (ControllerConfig.revive_*).
        self.revived_at: float | None = None
        self.revive_until = -math.inf
        # Directed links told back since then, and those whose other end, dead in the
        # last recompute and online, has still to tell: the hold lasts until it has.
        self._told_back: set[tuple[int, int]] = set()
        self.awaiting: set[tuple[int, int]] = set()
        # Dirty by more than routine snapshots (see recompute_due); the last recompute's
        # start and CPU time; each node's last snapshot table, to tell noise from moves.
        self.prompt = False
        self.recomputed_at: float | None = None
        self.recompute_cpu_s = 0.0
        self._tables: dict[str, PeerTable] = {}
        self.last: Computed | None = None
        self.recomputes = 0
        self.route_changes = 0  # next-hop entries changed, over all recomputes (metrics)
        self.accepted = 0
        self.session_since = 0.0
        # What we published last per topic: the broker echoes it back to us, and our own
        # bytes need no signature check (a fifth of the core's CPU at 50 nodes).
        self._own: dict[str, list[tuple[bytes, RouteSet | Lease]]] = {}
        # The urgent path: failures not yet covered by a full pass, those no urgent plan
        # has acted on yet, what it works on, and whether a full pass is under way (the
        # engine is the worker thread's then: the urgent path leaves it alone).
        self._events: dict[tuple[str, str | None], _Event] = {}
        self._event_seq = 0
        self._hot: list[tuple[str, str | None]] = []
        self._base: _Base | None = None
        self._last_index: tuple[Computed, dict[str, int]] | None = None
        self._busy = False
        self._covering: set[int] = set()
        self.urgent_plans = 0
        self.urgent_moves = 0  # fast entries moved by the urgent path (metrics)

    def reconfigure(self, cfg: ControllerConfig, now: float) -> None:
        """A reload: enrolments, other controllers' keys, policy and timing take effect
        now (the caller kept the settings that need a restart). A node no longer enrolled
        has its telemetry refused from now on and leaves the routes when it goes stale."""
        self.cfg = cfg
        self.controllers = KeyRing([self.key.public_key(), *cfg.controller_keys])
        self.enrolled = {e.node: e for e in cfg.node_keys}
        self.node_rings = {e.node: KeyRing([e.key]) for e in cfg.node_keys}
        self.pinned_keys = {e.node: set(e.wireguard) for e in cfg.node_keys if e.wireguard}
        self.pinned_addrs = {
            e.node: {_normal(a) for a in e.addresses} for e in cfg.node_keys if e.addresses
        }
        self.view.allowed = set(self.enrolled)
        self.engine.policy = cfg.policy.policy()
        self.mark_dirty(now)

    # --- our own status -----------------------------------------------------------------

    def status(self, online: bool) -> bytes:
        """Our status for the current broker session: the online status and the will of
        one session carry the same ``since``, so the will is not taken for a replay."""
        role: Literal["active", "standby"] = "active" if self.lease.role == "active" else "standby"
        cs = ControllerStatus(
            controller=self.cfg.id, online=online, role=role, since=self.session_since
        )
        return sign("controller_status", cs, self.key, self.key_id)

    def new_session(self, wall: float) -> tuple[str, bytes, bool]:
        """The will for a new broker connection (topic, payload, retain)."""
        self.session_since = wall
        return self.topics.controller_status(self.cfg.id), self.status(False), True

    def on_connect(self, wall: float) -> list[Publish]:
        return [Publish(self.topics.controller_status(self.cfg.id), self.status(True), True)]

    # --- input --------------------------------------------------------------------------

    def mark_dirty(self, now: float, urgent: bool = False, routine: bool = False) -> None:
        """``routine``: only snapshots that moved nothing significantly (batched)."""
        if self.dirty_since is None:
            self.dirty_since = now
        self.urgent = self.urgent or urgent
        self.prompt = self.prompt or not routine

    def on_message(
        self, topic: str, payload: bytes, retained: bool, now: float, wall: float
    ) -> list[Publish]:
        """Take one bus message; it never raises (a refusal is counted)."""
        parsed = self.topics.parse(topic)
        if parsed is None:
            return []
        kind, name = parsed
        if not payload:  # a cleared retained message: nothing to take
            self.counters.count(f"{kind}_cleared", topic)
            return []
        try:
            own = self._own_echo(topic, payload)
            if own is not None:
                self._take_own(name, own)
            elif kind == "telemetry":
                self.on_telemetry(name, payload, retained, now, wall)
            elif kind == "status":
                self.on_status(name, payload, now, wall)
            elif kind == "routes":
                self.on_route_set(name, payload, wall)
            elif kind == "lease":
                self.on_lease(payload, wall)
            elif kind == "controller_status":
                self.on_controller_status(name, payload, wall)
            self.accepted += 1
        except (BusMessageError, TelemetryRefused) as exc:
            self.counters.count(f"{kind}_{exc.reason}", str(exc))
        except Exception as exc:  # a bug here must cost one message, not the controller
            self.counters.count(f"{kind}_internal_error", repr(exc), exc_info=exc)
        return []

    def _take_own(self, name: str, msg: RouteSet | Lease) -> None:
        if isinstance(msg, Lease):
            self.lease.on_lease(msg)
        else:
            old = self.retained_sets.get(name)
            if old is None or msg.version > old.version:
                self.retained_sets[name] = msg
            self.version = max(self.version, msg.version)

    def _remember_own(self, topic: str, payload: bytes, msg: RouteSet | Lease) -> None:
        """What we publish comes back from the broker: its digest is enough to know it
        (the payloads themselves were 60 MB at 1000 nodes), and the last few per topic
        are kept, since at 1000 nodes a node's next set is often signed before the echo
        of the one before arrives: each such echo was verified in full, ~5 ms of the
        loop (3.4 s of 25 s around a dead relay)."""
        mine = self._own.setdefault(topic, [])
        mine.append((_digest(payload), msg))
        # A lease: only the newest is ours to count (an older one's echo is checked).
        del mine[: -1 if isinstance(msg, Lease) else -OWN_KEPT]

    def _own_echo(self, topic: str, payload: bytes) -> RouteSet | Lease | None:
        mine = self._own.get(topic)
        if not mine:
            return None
        d = _digest(payload)
        for digest, msg in reversed(mine):
            if digest == d:
                return msg
        return None

    def _ring(self, node: str) -> KeyRing:
        ring = self.node_rings.get(node)
        if ring is None:
            raise BusMessageError("unknown_node", f"{node} is not enrolled")
        return ring

    def _check_pins(self, t: Telemetry) -> None:
        keys = self.pinned_keys.get(t.node)
        if keys is not None:
            for k in t.public_keys or [t.public_key]:
                if k not in keys:
                    raise TelemetryRefused("unpinned_key", f"{t.node} claims {k[:8]}…")
        addrs = self.pinned_addrs.get(t.node)
        if addrs is not None:
            for a in t.addresses:
                if _normal(a) not in addrs:
                    raise TelemetryRefused("unpinned_address", f"{t.node} claims {a}")

    def on_telemetry(
        self, name: str, payload: bytes, retained: bool, now: float, wall: float
    ) -> None:
        t = verify_telemetry(payload, self._ring(name), mesh=self.cfg.mesh, node=name)
        # A retained snapshot may be old (the view ages it); a live one is recent.
        check_time(
            t.sent_at,
            wall,
            max_skew_s=self.cfg.max_skew_s,
            max_age_s=None if retained else MAX_AGE_S,
        )
        self.telemetry_seq.check(name, t.seq, wall)
        self._check_pins(t)
        # A retained snapshot may be old: its age counts (fresh ones are timed by
        # arrival, which needs no clock agreement between hosts).
        before = self.view.nodes.get(name)
        known = before is not None and before.online
        claims = (list(before.public_keys), list(before.addresses)) if before else None
        changed = self.view.take(name, t, now, wall if retained else None)
        self.telemetry_seq.accept(name, t.seq)
        last = self.session.get(name)
        if last is not None and t.session > last and self.intended.pop(name, None) is not None:
            # A new broker session of the agent (a restart, a reconnect): its route set
            # goes out again at the next recompute, even unchanged. A clean stop withdrew
            # the routes, and the retained set may be one the agent refuses (a replay of
            # a version it is past), which left it routeless until its routes changed.
            self.mark_dirty(now)
        self.session[name] = max(t.session, self.session.get(name, 0))
        routine = False
        if t.full and t.table is not None:
            # A snapshot that moved nothing as much as a change report would (noise)
            # is routine: batched (recompute_due), not a recompute of its own.
            info = self.view.nodes[name]
            routine = (
                known
                and claims == (info.public_keys, info.addresses)
                and not tables_moved(self._tables.get(name), t.table)
            )
            self._tables[name] = t.table
        # A full snapshot tells a link back as a change report does (the agent sends one
        # when it is due, revivals in it or not). It set no hold, and compared with the
        # last full snapshot (from before the link died) it could pass for noise: the
        # likely way the 16-node lab's returning relay was recomputed before its links
        # had all told, and came back through one of them (46 and 55 changes).
        revived = self._revives(name, t) if changed else []
        if revived:
            routine = False
            cfg = self.cfg
            if self.revived_at is None:
                self.revived_at = now
            self._await_other_ends(revived)
            # Until the other ends have told too (a link priced by its two ends is down
            # while one of them says so): one 16-node run of three recomputed the
            # returning relay 0.22 s after its last link came back, reports still on
            # their way, and moved every route to it twice (42 changes).
            quiet = cfg.revive_max_s if self.awaiting else cfg.revive_quiet_s
            self.revive_until = min(self.revived_at + cfg.revive_max_s, now + quiet)
            if log.isEnabledFor(logging.DEBUG):
                names = self.last.names if self.last is not None else []
                log.debug(
                    "%s tells %s back; awaiting %s; recompute held %.2f s",
                    name,
                    ", ".join(f"{names[a]}-{names[b]}" for a, b in revived),
                    ", ".join(f"{names[a]}-{names[b]}" for a, b in sorted(self.awaiting)),
                    self.revive_until - now,
                )
        if not routine and log.isEnabledFor(logging.DEBUG):
            # When a report that moves routes left its agent and got here: where a slow
            # reroute's seconds went (the agent, the broker, or this loop).
            log.debug(
                "telemetry from %s: %s, %d peers, %.0f ms after it was sent",
                name,
                "snapshot" if t.full else "change report",
                len(t.table.keys) // 32 if t.table is not None else 0,
                (wall - t.sent_at) * 1000.0,
            )
        if changed:  # a heartbeat only keeps the node fresh: nothing to recompute
            self.mark_dirty(now, routine=routine)
            if not routine:
                self._link_events(name, t, in_view=True)

    def on_status(self, name: str, payload: bytes, now: float, wall: float) -> None:
        st = verify_status(payload, self._ring(name), mesh=self.cfg.mesh, node=name)
        check_time(st.since, wall, max_skew_s=self.cfg.max_skew_s, max_age_s=None)
        if st.seq > seq_ceiling(wall, self.cfg.max_skew_s):
            raise BusMessageError("bad_seq", f"{name}: seq {st.seq} runs ahead of the clock")
        last = self.status_seq.get(name)
        if st.online:
            if last is not None and st.seq <= last:
                raise BusMessageError("replay", f"{name}: online status seq {st.seq} <= {last}")
            self.status_seq[name] = st.seq
            return
        # Offline: the will (or a clean stop) of the session the node is in now, not of
        # one before it.
        current = max(last or 0, self.session.get(name, 0))
        if st.seq < current:
            raise BusMessageError("replay", f"{name}: offline for session {st.seq} < {current}")
        self.status_seq[name] = st.seq
        if self.view.set_offline(name, st.reason or "offline"):
            log.warning("node %s offline (%s): routing around it", name, st.reason)
            self.mark_dirty(now, urgent=True)
            self._note(name, None, math.inf, 0.0, in_view=True)

    def _check_route_set(self, rs: RouteSet, wall: float) -> None:
        if rs.version > seq_ceiling(wall, self.cfg.max_skew_s):
            raise BusMessageError("bad_version", f"version {rs.version} runs ahead of the clock")
        if rs.term > term_ceiling(wall, self.cfg.max_skew_s):
            raise BusMessageError("term_jump", f"term {rs.term} runs ahead of the clock")

    def on_route_set(self, name: str, payload: bytes, wall: float) -> None:
        """A retained route set (ours or another controller's): what agents have."""
        rs = verify_route_set(payload, self.controllers, mesh=self.cfg.mesh, node=name)
        self._check_route_set(rs, wall)
        old = self.retained_sets.get(name)
        if old is not None and rs.version <= old.version:
            if rs.version < old.version:  # an old set played back: agents refuse it too
                raise BusMessageError("replay", f"{name}: version {rs.version} < {old.version}")
            return
        self.retained_sets[name] = rs
        self.version = max(self.version, rs.version)

    def on_lease(self, payload: bytes, wall: float) -> None:
        lease = verify_lease(payload, self.controllers, mesh=self.cfg.mesh)
        check_lease(lease, wall, lease_s=self.cfg.lease_s, max_skew_s=self.cfg.max_skew_s)
        self.lease.on_lease(lease)

    def on_controller_status(self, name: str, payload: bytes, wall: float) -> None:
        cs = verify_controller_status(payload, self.controllers, controller=name)
        check_time(cs.since, wall, max_skew_s=self.cfg.max_skew_s, max_age_s=None)
        since = self.controller_since.get(name)
        if cs.online:
            self.controller_since[name] = max(cs.since, since if since is not None else cs.since)
            return
        # A will carries the time its session began: one from an older session is a replay.
        if since is not None and cs.since < since:
            raise BusMessageError("replay", f"offline status of {name} from an older session")
        self.lease.on_controller_offline(cs.controller)

    # --- the loop -----------------------------------------------------------------------

    def dropped(self) -> dict[str, int]:
        """Everything refused or left out so far, by reason (messages, fields, routes)."""
        out = self.counters.snapshot()
        for k, n in self.view.dropped.snapshot().items():
            out[f"field_{k}"] = n
        for k, n in self.engine.counters.snapshot().items():
            out[f"engine_{k}"] = n
        return out

    def may_publish(self, wall: float) -> bool:
        return self.lease.may_publish(wall)

    def tick(self, now: float, wall: float) -> list[Publish]:
        """Advance the lease, expire stale nodes, recompute when due; what to publish."""
        out = self.housekeeping(now, wall)
        if self.recompute_due(now, wall):
            out += self.recompute_now(now, wall)
        return out

    def housekeeping(self, now: float, wall: float, *, expire: bool = True) -> list[Publish]:
        """Advance the lease and (``expire``) age stale nodes out; cheap, so the shell
        runs it on every tick, also while a recompute runs elsewhere (``expire=False``:
        the view must not change under it)."""
        out: list[Publish] = []
        was_active = self.lease.role == "active"
        lease = self.lease.tick(wall)
        if lease is not None:
            payload = sign("lease", lease, self.key, self.key_id)
            self._remember_own(self.topics.lease(), payload, lease)
            out.append(Publish(self.topics.lease(), payload, True))
        active = self.lease.role == "active"
        if active and not was_active:
            log.info("controller %s active (term %d)", self.cfg.id, self.lease.term)
            self.engine.adopt(self.view, self.retained_sets, now)
            self._base = None  # the next full pass gives the urgent path its picture
            self.published = {n: list(rs.routes) for n, rs in self.retained_sets.items()}
            self.intended = dict(self.published)
            out += self.on_connect(wall)
            self.mark_dirty(now, urgent=True)
        elif was_active and not active:
            log.warning("controller %s is standby now (another holds a newer lease)", self.cfg.id)
            out += self.on_connect(wall)
        if expire:
            for name in self.view.expire(now):
                log.warning("node %s: telemetry stale, routing around it", name)
                self.mark_dirty(now, urgent=True)
                self._note(name, None, math.inf, 0.0, in_view=True)
        return out

    def recompute_due(self, now: float, wall: float) -> bool:
        """Whether to recompute now: something changed, we hold the lease, the view is
        warm and the debounce has passed (at once when urgent)."""
        if self.dirty_since is None or not self.lease.may_publish(wall):
            return False
        # Only routine snapshots: recompute at most ROUTINE_SHARE of a core (a recompute
        # costs ~0.2 s at 250 nodes, and snapshots arrive 6 times a second).
        spaced = (
            self.prompt
            or self.recomputed_at is None
            or now - self.recomputed_at >= self.recompute_cpu_s / ROUTINE_SHARE
        )
        if not self.urgent and not (spaced and now - self.dirty_since >= self.cfg.debounce_s):
            return False
        if not self.urgent and now < self.revive_until:
            return False  # links are coming back: wait for the rest of them
        # The clock first: ``ready`` checks every link's samples (62,000 at 250 nodes),
        # a third of the controller's CPU when asked on every tick.
        return warmed_up(
            self.view.first_seen,
            now,
            self.cfg.warmup_s,
            lambda: self.view.measured(self.cfg.warmup_samples),
        )

    def recompute_now(self, now: float, wall: float, *, signed: bool = True) -> list[Publish]:
        """A due recompute; never raises (a failure is counted and the routes agents
        have stay). ``signed=False``: planned sets, for :meth:`sign_routes` (see
        :meth:`plan`)."""
        started = time.thread_time()
        try:
            return self.recompute(now, wall) if signed else self.plan(now, wall)
        except Exception as exc:  # keep the routes agents have; try again on the next change
            self.counters.count("recompute_failed", repr(exc), exc_info=exc)
            return []
        finally:
            self.recomputed_at = now
            self.recompute_cpu_s = time.thread_time() - started

    def recompute(self, now: float, wall: float) -> list[Publish]:
        """Recompute and sign every set that changed (most urgent first)."""
        out = []
        for a in self.plan(now, wall):
            signed = self.sign_routes(a, wall)
            if signed is not None:
                out.append(signed)
        return out

    def plan(self, now: float, wall: float) -> list[Publish]:
        """Recompute; the route sets that changed, not yet signed (empty payloads; the
        shell signs each with :meth:`sign_routes` just before sending it, so the most
        urgent set does not wait for 249 others to be signed, and a set replaced before
        it went out is never signed), most urgent first.

        In three steps, which the shell runs apart (the middle one in a worker thread,
        the others on its loop): :meth:`begin_recompute`, :meth:`compute`,
        :meth:`finish_recompute`."""
        self.begin_recompute()
        try:
            c = self.compute(now)
        except BaseException:
            self.abort_recompute()
            raise
        return self.finish_recompute(c, now)

    def begin_recompute(self) -> None:
        """A full pass starts on the view as it is: every change told so far is in it
        (the dirty mark and a revival's hold end here; the shell runs this too, and a
        revival it left set made every later return's hold end a second after the
        first revival ever told, so a returning node was routed on its first links and
        moved again), and the failures the view holds now are covered by it; from here
        until it is finished the engine is its own."""
        self.dirty_since = None
        self.urgent = False
        self.prompt = False
        self.revived_at = None
        self.revive_until = -math.inf
        self._told_back.clear()
        self.awaiting.clear()
        self._busy = True
        self._covering = {e.id for e in self._events.values() if e.in_view}

    def abort_recompute(self) -> None:
        self._busy = False
        self._covering = set()

    def compute(self, now: float) -> Computed | None:
        """The full pass itself (engine and view only, no other core state: the shell
        runs it in a worker thread while the loop may run urgent plans)."""
        if not self.view.nodes:
            return None
        policy = startup_policy(
            self.engine.policy,
            self.view.first_seen,
            now,
            self.cfg.startup_s,
            self.cfg.startup_hold_s,
        )
        return self.engine.compute(self.view, now, policy)

    def finish_recompute(self, c: Computed | None, now: float) -> list[Publish]:
        """The route sets a full pass changed, with the failures it does not cover (told
        while it ran) moved again on top of it: a pass that began before a node died
        must not undo the urgent plan that routed around it."""
        covered, self._covering = self._covering, set()
        self._busy = False
        if c is None:
            return []
        self.recomputes += 1
        # Covered: in the view when this pass began. One read ahead whose message never
        # reached the view (refused when taken) is let go two passes on.
        for key in [
            k
            for k, e in self._events.items()
            if e.id in covered or (not e.in_view and self.recomputes - e.noted_at_pass > 2)
        ]:
            del self._events[key]
        self.last = c
        for node, reason in c.errors.items():
            self.counters.count("routes_unbuildable", f"{node}: {reason}")
        changed = int(c.decision.changed.sum())
        self.route_changes += changed
        if changed:
            log.info(
                "routes: %d entries changed (%d failed, %d improved)",
                changed,
                int(c.decision.failed.sum()),
                int(c.decision.improved.sum()),
            )
        if log.isEnabledFor(logging.DEBUG) and c.policy is not None:
            for line in pending(
                c.names, c.best, c.decision, c.policy, now, symmetric=self.engine.symmetric
            ):
                log.debug("routes: %s", line)
        index = {n: i for i, n in enumerate(c.names)}
        urgent = c.decision.failed if c.degraded is None else c.decision.failed | c.degraded
        failed_rows = np.asarray(urgent.any(axis=1))
        changed_rows = np.asarray(c.decision.changed.any(axis=1))
        self._base = self._capture(c)
        self._hot = []
        moved: set[int] = set()
        if self._mass_failure():
            self._events.clear()  # those told meanwhile are in the view for the next pass
        if self._events and self._base is not None:
            base = self._base
            bad = np.zeros(base.next_hop.shape, dtype=bool)
            for e in self._events.values():
                self._apply_event(base, e, bad)
            fix = self._fix(base, bad, self.engine.deaths.collapsing(base.names, now))
            if fix is not None:
                moved = self._apply_fix(base, fix, now, c.routes, engine=True)
                log.info(
                    "routes: %d entries moved again for %d failures told during the recompute",
                    fix.s.size,
                    len(self._events),
                )
        out: list[Publish] = []
        for node, routes in c.routes.items():
            if self.intended.get(node) == routes:
                continue
            i = index[node]
            prio = (
                URGENT if failed_rows[i] or i in moved else CHANGED if changed_rows[i] else REFRESH
            )
            out.append(self._intend(node, routes, int(prio)))
        out.sort(key=lambda p: p.priority)  # stable: node order within a class
        return out

    # --- the urgent path ----------------------------------------------------------------

    def _note(
        self, node: str, link: str | None, cost: float, noise: float, *, in_view: bool
    ) -> bool:
        """A failure told (a node gone, or its link to ``link`` far worse); True if it is
        news for the urgent path."""
        key = (node, link)
        e = self._events.get(key)
        if e is not None:
            e.in_view = e.in_view or in_view
            if cost <= e.cost:
                return False
            e.cost, e.noise = cost, noise
        else:
            self._event_seq += 1
            self._events[key] = _Event(
                self._event_seq, node, link, cost, noise, in_view, self.recomputes
            )
        if key not in self._hot:
            self._hot.append(key)
        return True

    def _await_other_ends(self, revived: list[tuple[int, int]]) -> None:
        """Note links told back; a link's other end is awaited while the last recompute
        had it down from that end too and its node online (it will tell)."""
        c = self.last
        assert c is not None
        told = self._told_back
        told.update(revived)
        self.awaiting.difference_update(revived)
        cost, up = c.matrices.cost, c.matrices.up
        for a, b in revived:
            if (b, a) not in told and up[b] and not math.isfinite(cost[b, a]):
                self.awaiting.add((b, a))

    def _revives(self, name: str, t: Telemetry) -> list[tuple[int, int]]:
        """The links (indices of the last recompute) this report (a change report or a
        full snapshot) has alive that the last recompute had down from this end (a
        node's return, or a tunnel's)."""
        c = self.last
        if c is None or not c.names:
            return []
        if self._last_index is None or self._last_index[0] is not c:
            self._last_index = (c, {n: i for i, n in enumerate(c.names)})
        index = self._last_index[1]
        a = index.get(name)
        if a is None:
            return []
        keys = [p.public_key for p in t.peers if p.alive]
        if t.table is not None and len(t.table):
            arr = _PeerArrays.of_table(t.table)
            keys += [k for k, alive in zip(arr.keys, arr.alive, strict=True) if alive == 1]
        owner = self.view._key_owner
        cost = c.matrices.cost
        out = []
        for key in keys:
            b = index.get(owner.get(key, ""))
            if b is not None and b != a and not math.isfinite(cost[a, b]):
                out.append((a, b))
        return out

    def _link_events(self, name: str, t: Telemetry, *, in_view: bool) -> bool:
        """Links of ``name`` this telemetry reports dead, or far costlier than the last
        full pass (and urgent moves since) priced them: noted for the urgent path."""
        base = self._base
        if base is None or self.cfg.symmetric:
            return False
        a = base.index.get(name)
        if a is None:
            return False
        metric = self.view.metric
        keys: list[str] = []
        costs: list[float] = []
        sds: list[float] = []
        told = [] if t.table is None or not len(t.table) else [_PeerArrays.of_table(t.table)]
        if t.peers:
            reps = [usable_peer(p)[0] for p in t.peers]
            told.append(_PeerArrays.of_reports([p.public_key for p in t.peers], reps))
        for arr in told:
            cs, ss, _ = link_matrices(
                metric, arr.rtt, arr.jitter, arr.loss, arr.noise, arr.samples, arr.sent,
                arr.loss_n, arr.alive == 0, np.zeros(len(arr.keys)),
            )  # fmt: skip
            keys += arr.keys
            costs += cs.tolist()
            sds += ss.tolist()
        owner = self.view._key_owner
        news = False
        for key, cost, sd in zip(keys, costs, sds, strict=True):
            peer = owner.get(key)
            b = base.index.get(peer) if peer is not None else None
            if peer is None or b is None or b == a:
                continue
            if (name, peer) in self._events:  # told before (read ahead): now in the view
                news = self._note(name, peer, cost, sd, in_view=in_view) or news
                continue
            old = float(base.cost[a, b])
            if not math.isfinite(old) or cost <= old:
                continue
            if math.isinf(cost) or (cost >= old + DEGRADED_ABS_MS and cost >= old * LINK_JUMP):
                news = self._note(name, peer, cost, sd, in_view=in_view) or news
        return news

    def peek(self, topic: str, payload: bytes, now: float, wall: float) -> bool:
        """Read a message held during a recompute for failures only (the view and every
        sequence stay as they are: the message is taken in turn later). True if it told
        the urgent path something new. Never raises."""
        if self._base is None or not payload:
            return False
        parsed = self.topics.parse(topic)
        if parsed is None:
            return False
        kind, name = parsed
        try:
            if self._own_echo(topic, payload) is not None:
                return False
            if kind == "status":
                st = verify_status(payload, self._ring(name), mesh=self.cfg.mesh, node=name)
                check_time(st.since, wall, max_skew_s=self.cfg.max_skew_s, max_age_s=None)
                if st.online or st.seq > seq_ceiling(wall, self.cfg.max_skew_s):
                    return False
                current = max(self.status_seq.get(name) or 0, self.session.get(name, 0))
                info = self.view.nodes.get(name)
                if st.seq < current or info is None or not info.online:
                    return False
                return self._note(name, None, math.inf, 0.0, in_view=False)
            if kind == "telemetry" and len(payload) <= PEEK_MAX_BYTES:
                # A heartbeat (no peers) tells nothing: seen unverified, not verified (at
                # 1000 nodes 200 a second, on the loop a recompute starves).
                pre = decode(unsigned_payload(payload, "telemetry"), Telemetry)
                if not pre.peers and (pre.table is None or not len(pre.table)):
                    return False
                t = verify_telemetry(payload, self._ring(name), mesh=self.cfg.mesh, node=name)
                check_time(t.sent_at, wall, max_skew_s=self.cfg.max_skew_s, max_age_s=MAX_AGE_S)
                self.telemetry_seq.check(name, t.seq, wall)
                self._check_pins(t)
                info = self.view.nodes.get(name)
                if info is None or not info.online or t.sent_at <= info.sent_at:
                    return False
                return self._link_events(name, t, in_view=False)
        except (BusMessageError, TelemetryRefused):
            return False  # counted when it is taken
        except Exception as exc:  # a bug here must cost one look-ahead, not the controller
            self.counters.count("peek_internal_error", repr(exc), exc_info=exc)
        return False

    def _mass_failure(self) -> bool:
        nodes = sum(1 for e in self._events.values() if e.link is None)
        return nodes > URGENT_MAX_NODES or len(self._events) - nodes > URGENT_MAX_LINKS

    def urgent_due(self, wall: float) -> bool:
        """Failures told that no urgent plan has acted on, and routes to act on."""
        return bool(self._hot) and self._base is not None and self.lease.may_publish(wall)

    def urgent_plan(self, now: float, wall: float) -> list[Publish]:
        """The route sets of the nodes whose installed paths the new failures broke (or
        made far worse), moved now on the last full pass's picture; everything else
        (backups, bulk paths and settings, improvements) waits for the full pass. Runs
        beside a full pass in progress (it leaves the engine alone then; the pass's end
        moves the same entries again). Never raises."""
        hot, self._hot = self._hot, []
        base = self._base
        if base is None or not hot:
            return []
        if self._mass_failure():
            log.warning("urgent: %d failures at once: left to the full pass", len(self._events))
            self._base = None  # its picture misses them: no urgent plan until that pass
            return []
        try:
            bad = np.zeros(base.next_hop.shape, dtype=bool)
            deaths = self.engine.deaths
            for key in hot:
                e = self._events.get(key)
                if e is not None:
                    self._apply_event(base, e, bad)
                    if e.link is not None and math.isinf(e.cost):
                        deaths.note(e.node, e.link, now)
            fix = self._fix(base, bad, deaths.collapsing(base.names, now))
            if fix is None:
                return []
            routes = {n: self.intended[n] for n in (base.names[s] for s in fix.rows)
                      if n in self.intended}  # fmt: skip
            moved = self._apply_fix(base, fix, now, routes, engine=not self._busy)
        except Exception as exc:  # the full pass still comes
            self.counters.count("urgent_failed", repr(exc), exc_info=exc)
            return []
        self.urgent_plans += 1
        self.urgent_moves += int(fix.s.size)
        out: list[Publish] = []
        # Nodes with a broken fast path first (they lose traffic until their set
        # arrives); then those whose paths only got far worse or whose bulk routes
        # moved. The daemon signs and sends URGENT sets in this order: at 1000 nodes a
        # dead relay gave ~650 sets, of ~4 ms each to sign, ~300 of them broken.
        broken = set(fix.s[fix.failed].tolist())
        for s in sorted(moved, key=lambda s: (s not in broken, s)):
            node = base.names[s]
            new = routes.get(node)
            if new is None or self.intended.get(node) == new:
                continue
            out.append(self._intend(node, new, URGENT))
        log.info(
            "urgent: %d entries of %d nodes moved off %d failures (%d affected)",
            fix.s.size,
            len(out),
            len(hot),
            fix.affected,
        )
        return out

    def _capture(self, c: Computed) -> _Base | None:
        """The urgent path's picture after a full pass (copies: the engine's arrays are
        its own); None in symmetric mode, where the full pass does everything."""
        if self.cfg.symmetric or not c.names:
            return None
        m = c.matrices
        peers: dict[str, tuple[list[str], np.ndarray]] = {}
        addresses: dict[str, list[str]] = {}
        for name in c.names:
            info = self.view.nodes.get(name)
            if info is None:
                continue
            addresses[name] = info.addresses
            if info.online:
                a = info.arrays()
                if a.dst is not None:
                    peers[name] = (a.keys, a.dst)
        return _Base(
            names=list(c.names),
            index={n: i for i, n in enumerate(c.names)},
            next_hop=c.decision.installed.next_hop.copy(),
            cost=m.cost,  # copied when a failure is written in (_apply_event)
            noise=m.noise,
            dead=~np.asarray(m.up, dtype=bool),
            backup=None if c.backup is None else c.backup.copy(),
            bulk=None if c.bulk_next_hop is None else c.bulk_next_hop.copy(),
            best=c.best.next_hop,
            dist=c.best.dist,
            peers=peers,
            addresses=addresses,
            layouts=c.layouts,
        )

    @staticmethod
    def _apply_event(base: _Base, e: _Event, bad: np.ndarray) -> None:
        a = base.index.get(e.node)
        if a is None:
            return
        if not base._own_costs:  # the last pass's matrices are its own: copy once
            base.cost, base.noise = base.cost.copy(), base.noise.copy()
            base._own_costs = True
        if e.link is None:
            base.cost[a, :] = np.inf
            base.cost[:, a] = np.inf
            base.cost[a, a] = 0.0
            base.dead[a] = True
            bad[a, :] = True
            bad[:, a] = True
            return
        b = base.index.get(e.link)
        if b is None or a == b:
            return
        base.cost[a, b] = max(float(base.cost[a, b]), e.cost)
        base.noise[a, b] = e.noise
        bad[a, b] = True

    def _fix(self, base: _Base, bad: np.ndarray, held: np.ndarray) -> UrgentFix | None:
        if not bad.any():
            return None
        fix = urgent_fix(
            base.next_hop,
            base.cost,
            base.noise,
            bad,
            base.dead,
            self.engine.policy,
            relay_hop_ms=self.engine.relay_hop_ms,
            backup=base.backup,
            bulk=base.bulk,
            best=base.best,
            dist=base.dist,
            held=held if held.any() else None,
        )
        if fix.best_s.size and base.best is not None and base.dist is not None:
            if not base._own_best:
                base.best, base.dist = base.best.copy(), base.dist.copy()
                base._own_best = True
            base.best[fix.best_s, fix.best_d] = fix.best_hop
            base.dist[fix.best_s, fix.best_d] = fix.best_dist
        return fix if fix.s.size or fix.bulk_s.size else None

    def _apply_fix(
        self,
        base: _Base,
        fix: UrgentFix,
        now: float,
        routes: dict[str, list[Route]],
        *,
        engine: bool,
    ) -> set[int]:
        """Move ``fix``'s entries in ``base`` (and, ``engine``, in the engine's state, so
        the next full pass starts from what agents have), and in ``routes`` (node ->
        its route list, replaced by the moved one). The rows whose routes changed."""
        base.next_hop[fix.s, fix.d] = fix.hop
        if base.backup is not None:
            base.backup[fix.s, fix.d] = fix.backup
        if base.bulk is not None:
            base.bulk[fix.bulk_s, fix.bulk_d] = fix.bulk_hop
        eng = self.engine
        if engine and eng.installed is not None and eng.names == base.names:
            inst = eng.installed
            inst.next_hop[fix.s, fix.d] = fix.hop
            # A forced move is not held (as the engine does with failed entries); a move
            # off a far worse path is a choice the hold protects.
            inst.since[fix.s, fix.d] = np.where(fix.failed, -np.inf, now)
            if inst.better_since is not None:
                inst.better_since[fix.s, fix.d] = np.nan
            if eng._backup is not None and eng._backup.shape == base.next_hop.shape:
                eng._backup[fix.s, fix.d] = fix.backup
            if eng._bulk is not None and eng._bulk.shape == base.next_hop.shape:
                eng._bulk[fix.bulk_s, fix.bulk_d] = fix.bulk_hop
        fast: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
        for s, d, h, b in zip(
            fix.s.tolist(), fix.d.tolist(), fix.hop.tolist(), fix.backup.tolist(), strict=True
        ):
            fast[s].append((d, h, b))
        bulk: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for s, d, h in zip(fix.bulk_s.tolist(), fix.bulk_d.tolist(), fix.bulk_hop.tolist(),
                           strict=True):  # fmt: skip
            bulk[s].append((d, h))
        out: set[int] = set()
        for s in fix.rows:
            node = base.names[s]
            old = routes.get(node)
            if old is None:
                continue
            keys = base.key_for(s)
            pf: dict[str, Route | None] = {}
            for d, h, b in fast.get(s, []):
                via = keys.get(h) if h != NO_ROUTE else None
                bk = keys.get(b) if b != NO_ROUTE else None
                for addr in base.addresses.get(base.names[d], []):
                    pf[addr] = None if via is None else Route(dst=addr, via=via, backup=bk)
            pb: dict[str, Route | None] = {}
            for d, h in bulk.get(s, []):
                via = keys.get(h) if h != NO_ROUTE else None
                for addr in base.addresses.get(base.names[d], []):
                    pb[addr] = None if via is None else Route(dst=addr, via=via, table="bulk")
            lay = base.layouts.get(node)
            new = None
            if lay is not None and lay[0] is old:
                dests = {d for d, _, _ in fast.get(s, [])} | {d for d, _ in bulk.get(s, [])}
                new = _patched_at(old, lay[1], dests, pf, pb)
            if new is None:
                new = _patched(old, pf, pb)
            if new != old:
                routes[node] = new
                out.add(s)
        return out

    def _intend(self, node: str, routes: list[Route], priority: int) -> Publish:
        """Record ``routes`` as what ``node`` should hold; its unsigned route-set publish."""
        self.intended[node] = routes
        return Publish(
            self.topics.routes(node),
            b"",
            True,
            node=node,
            routes=tuple(routes),
            priority=priority,
        )

    def sign_routes(self, a: Publish, wall: float) -> Publish | None:
        """A planned route set, versioned and signed now; None (counted) if it cannot be
        (one node's set is unusable; the rest go out)."""
        if a.node is None:
            return a
        self.version = max(self.version + 1, first_seq(wall))
        rs = RouteSet(
            mesh=self.cfg.mesh,
            node=a.node,
            version=self.version,
            issued_at=wall,
            controller=self.cfg.id,
            term=self.lease.term,
            routes=list(a.routes),
        )
        try:
            payload = sign("routes", rs, self.key, self.key_id)
        except BusMessageError as exc:
            self.counters.count("routes_unbuildable", f"{a.node}: {exc}")
            if self.intended.get(a.node) == rs.routes:
                self.intended.pop(a.node, None)
            return None
        self._remember_own(a.topic, payload, rs)
        return dataclasses.replace(a, payload=payload)

    def published_ok(self, action: Publish, ok: bool, now: float) -> None:
        """The shell's report on a publish: a route set taken, or to retry once the bus is
        back (or never sent: lease lost); our lease renewal, taken by the broker, counts
        as held without waiting for the broker's echo (a busy loop reads that late)."""
        if action.node is None:
            own = self._own_echo(action.topic, action.payload) if ok else None
            if action.topic == self.topics.lease() and isinstance(own, Lease):
                self.lease.own_published(own)
            return
        if ok:
            self.published[action.node] = list(action.routes)
            # Retained now: what the broker's echo told, where no echo comes (No Local).
            own = self._own_echo(action.topic, action.payload)
            if isinstance(own, RouteSet):
                self._take_own(action.node, own)
        else:
            if self.intended.get(action.node) == list(action.routes):
                self.intended.pop(action.node, None)
            self.mark_dirty(now)


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def _patched_at(
    old: list[Route],
    off: np.ndarray,
    dests: set[int],
    fast: dict[str, Route | None],
    bulk: dict[str, Route | None],
) -> list[Route] | None:
    """:func:`_patched` for a list laid out by destination (``old[off[d]:off[d + 1]]``
    are destination d's routes, no prefix in two destinations), reading only the moved
    destinations' routes (``dests``): a dead relay's plan at 1000 nodes patched ~650
    lists of 2000 routes to change ~25 in each. None where a patched prefix is not in
    its destination's routes (it would be appended, or the layout does not hold): then
    :func:`_patched`, which looks everywhere."""
    want = len(fast) + len(bulk)
    at: dict[int, Route | None] = {}
    for d in dests:
        for i in range(int(off[d]), int(off[d + 1])):
            route = old[i]
            patch = fast if route.table == "fast" else bulk
            if route.dst in patch:
                at[i] = patch[route.dst]
    if len(at) != want:
        return None
    out: list[Route | None] = list(old)
    for i, new in at.items():
        out[i] = new
    return [r for r in out if r is not None]


def _patched(
    old: list[Route], fast: dict[str, Route | None], bulk: dict[str, Route | None]
) -> list[Route]:
    """``old`` with the fast and bulk routes to the given prefixes replaced (None: left
    out), in place; routes to prefixes it had none for at the end.

    One dict lookup per route in a comprehension (a loop with a branch per route was a
    third of a dead relay's urgent plan at N = 1000: ~650 sets of 2000 routes)."""
    fget, bget = fast.get, bulk.get
    new = [(fget if r.table == "fast" else bget)(r.dst, r) for r in old]
    out = [r for r in new if r is not None]
    for table, patch in (("fast", fast), ("bulk", bulk)):
        if not patch:
            continue
        have = {r.dst for r in old if r.table == table}
        out.extend(r for dst, r in patch.items() if r is not None and dst not in have)
    return out
