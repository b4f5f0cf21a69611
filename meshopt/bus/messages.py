"""Typed, versioned bus messages (msgspec Structs, JSON on the wire).

Every top-level message carries ``v`` (SCHEMA_VERSION). A decoder reads ``v`` first, so a
message from a newer schema is refused as "bad_version" rather than as a confusing type
error; unknown fields are ignored, so adding an optional field does not need a new
version. Decoders then check values the type system cannot: finite non-negative RTTs,
loss in 0..1, counters that fit 64 bits, real prefixes, 32-byte base64 keys, bounded list
sizes. Each rejection is a :class:`BusMessageError` with a stable short ``reason`` that a
daemon counts (see :class:`Counters`) instead of crashing.

Messages (topic -> type)::

    telemetry/<node>             Signed("telemetry", Telemetry {v, mesh, node, public_key,
                                   addresses, seq, session, sent_at, full, peers, counters})
    status/<node>                Signed("status", AgentStatus {v, mesh, node, online, since,
                                   seq, reason})
    routes/<node>                Signed("routes", RouteSet {v, mesh, node, version,
                                   issued_at, controller, term, routes: [Route]})
    controller/lease             Signed("lease", Lease {v, mesh, controller, term,
                                   expires_at, issued_at})
    controller/status/<id>       Signed("controller_status", ControllerStatus {v,
                                   controller, online, role, since})

Every message on the bus is a :class:`Signed` envelope ``{v, kind, payload, signature,
key_id}``: ``payload`` is the exact JSON bytes of the inner message, signed with Ed25519
(agents by their identity key, controllers by the controller key; see
meshopt.bus.signing), so a receiver checks who wrote it before it decodes what it says.

PeerReport and Route leave fields at their default out of the JSON (they repeat up to
4096 times): a signed route set for a 1,000-node mesh, every route with a backup, is
~177 KB, inside the 256 KiB limit (pass ``max_bytes`` for larger meshes).

Units: times are unix seconds (float), durations ``*_s``, RTTs ``*_ms``, rates ``*_bps``
(bytes per second of WireGuard counters) and ``bandwidth_mbit`` (Mbit/s). ``None`` means
"not measured yet", never zero. Keys are base64 WireGuard keys (44 characters).

Rejection reasons: too_large, bad_json, bad_schema, bad_version, bad_value, bad_name,
bad_prefix, bad_key (and, from signing, bad_signature, unknown_key, wrong_node, replay,
duplicate). :func:`encode` runs the same checks, so a daemon never publishes what its
peers would refuse (msgspec would otherwise write a NaN as ``null``, i.e. "unknown").
"""

from __future__ import annotations

import ipaddress
import logging
import math
from collections.abc import Sized
from typing import Any, Final, Literal, TypeVar

import msgspec

from meshopt.bus.topics import is_valid_name
from meshopt.errors import MeshoptError
from meshopt.wireguard.errors import KeyFormatError
from meshopt.wireguard.keys import check_key

SCHEMA_VERSION: Final = 1
MAX_PAYLOAD_BYTES: Final = 256 * 1024
MAX_PEERS: Final = 4096
MAX_ROUTES: Final = 4096
MAX_ADDRESSES: Final = 256
MAX_COUNTERS: Final = 256
MAX_TEXT: Final = 256
_MAX_U64: Final = 2**64 - 1
_MAX_I63: Final = 2**63 - 1

REASONS: Final = (
    "too_large",
    "bad_json",
    "bad_schema",
    "bad_version",
    "bad_value",
    "bad_name",
    "bad_prefix",
    "bad_key",
)

log = logging.getLogger("meshopt.bus")


class BusMessageError(MeshoptError):
    """A bus message was refused; ``reason`` is a stable short key for counters."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


# -- message types (keyword-only, immutable) -----------------------------------------


class PeerReport(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """What one agent measured towards one WireGuard peer."""

    public_key: str
    ifname: str
    endpoint: str | None = None
    alive: bool | None = None
    rtt_ms: float | None = None  # smoothed
    rtt_min_ms: float | None = None
    rtt_median_ms: float | None = None
    rtt_p95_ms: float | None = None
    jitter_ms: float | None = None
    noise_ms: float | None = None
    loss: float | None = None
    samples: int = 0
    probes_sent: int = 0
    handshake_age_s: float | None = None
    rx_bytes: int = 0
    tx_bytes: int = 0
    rx_bps: float = 0.0
    tx_bps: float = 0.0
    bandwidth_mbit: float | None = None
    bandwidth_confidence: float | None = None
    bandwidth_age_s: float | None = None
    pmtu: int | None = None


class Telemetry(msgspec.Struct, kw_only=True, frozen=True):
    """An agent's report: a full snapshot (``full``) or only the peers that changed."""

    v: int = SCHEMA_VERSION
    mesh: str
    node: str
    public_key: str
    # Every interface's key (the per-peer layout has one per tunnel); peers report us by these.
    public_keys: list[str] = msgspec.field(default_factory=list)
    addresses: list[str] = msgspec.field(default_factory=list)
    seq: int
    # The seq of the status this agent published when its broker session began; an
    # offline status (the will) older than the session of the latest telemetry is a replay.
    session: int = 0
    sent_at: float
    full: bool
    peers: list[PeerReport] = msgspec.field(default_factory=list)
    counters: dict[str, int] = msgspec.field(default_factory=dict)


class AgentStatus(msgspec.Struct, kw_only=True, frozen=True):
    """Retained liveness of an agent; its will publishes ``online=False``."""

    v: int = SCHEMA_VERSION
    mesh: str
    node: str
    online: bool
    since: float
    # Rises per broker session (the will carries the seq of the session it ends).
    seq: int = 0
    reason: str = ""


class Route(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """One route an agent installs: ``dst`` via the peer ``via`` (backup: ``backup``)."""

    dst: str
    via: str
    backup: str | None = None
    table: Literal["fast", "bulk"] = "fast"
    mtu: int | None = None
    advmss: int | None = None
    initcwnd: int | None = None
    initrwnd: int | None = None
    window: int | None = None
    congctl: str | None = None


class RouteSet(msgspec.Struct, kw_only=True, frozen=True):
    """All routes of one node; ``version`` rises strictly per node across controllers."""

    v: int = SCHEMA_VERSION
    mesh: str
    node: str
    version: int
    issued_at: float
    controller: str
    term: int
    routes: list[Route] = msgspec.field(default_factory=list)


SignedKind = Literal["telemetry", "status", "routes", "lease", "controller_status"]
SIGNED_KINDS: Final[tuple[str, ...]] = (
    "telemetry",
    "status",
    "routes",
    "lease",
    "controller_status",
)


class Signed(msgspec.Struct, kw_only=True, frozen=True):
    """An inner message's exact JSON bytes, what kind it is, and their Ed25519 signature.

    The signature covers the kind as well (see meshopt.bus.signing), so a signed status
    can never be passed off as a lease.
    """

    v: int = SCHEMA_VERSION
    kind: SignedKind
    payload: bytes
    signature: bytes
    key_id: str


class Lease(msgspec.Struct, kw_only=True, frozen=True):
    """The active controller's lease (retained); a standby takes over once it expires."""

    v: int = SCHEMA_VERSION
    mesh: str
    controller: str
    term: int
    expires_at: float
    issued_at: float


class ControllerStatus(msgspec.Struct, kw_only=True, frozen=True):
    """Retained liveness and role of a controller; its will publishes ``online=False``."""

    v: int = SCHEMA_VERSION
    controller: str
    online: bool
    role: Literal["active", "standby"]
    since: float


Message = Telemetry | AgentStatus | RouteSet | Signed | Lease | ControllerStatus
M = TypeVar("M", Telemetry, AgentStatus, RouteSet, Signed, Lease, ControllerStatus)


# -- value checks ----------------------------------------------------------------------


def _bad(reason: str, detail: str) -> BusMessageError:
    return BusMessageError(reason, detail)


def _num(value: float | None, field: str, lo: float = 0.0, hi: float = math.inf) -> None:
    """None, or a finite number in lo..hi."""
    if value is None:
        return
    if not math.isfinite(value) or not lo <= value <= hi:
        raise _bad("bad_value", f"{field}={value!r} (want {lo:g}..{hi:g})")


def _int(value: int | None, field: str, lo: int = 0, hi: int = _MAX_U64) -> None:
    if value is None:
        return
    if not lo <= value <= hi:
        raise _bad("bad_value", f"{field}={value} (want {lo}..{hi})")


def _name(value: str, field: str) -> None:
    if not is_valid_name(value):
        raise _bad("bad_name", f"{field} is not a valid name")


def _text(value: str | None, field: str, limit: int = MAX_TEXT) -> None:
    if value is not None and len(value) > limit:
        raise _bad("bad_value", f"{field} longer than {limit} characters")


def _key(value: str, field: str) -> None:
    try:
        check_key(value)
    except KeyFormatError:
        raise _bad("bad_key", f"{field} is not a base64 WireGuard key") from None


def _prefix(value: str, field: str) -> None:
    try:
        if "/" not in value:
            raise ValueError(value)
        ipaddress.ip_network(value, strict=True)
    except ValueError:
        raise _bad("bad_prefix", f"{field} {value[:60]!r} is not a prefix") from None


def _count(items: Sized, field: str, limit: int) -> None:
    n = len(items)
    if n > limit:
        raise _bad("bad_value", f"{field}: {n} entries (at most {limit})")


# Upper bounds of what a peer report can possibly hold (a finite float is not enough:
# 1e308 Mbit/s overflows the arithmetic downstream). Possible but unusable values
# (a 2-minute RTT, a 100-byte PMTU) pass here and are dropped by the controller's view.
MAX_PEER_DELAY_MS: Final = 600_000.0  # 10 minutes
MAX_PEER_BANDWIDTH_MBIT: Final = 1e9  # 1 Pbit/s
MAX_PEER_RATE_BPS: Final = 1e13  # 10 Tbit/s
MAX_PEER_AGE_S: Final = 10 * 366 * 86400.0  # ten years


def _check_peer(p: PeerReport, i: int) -> None:
    f = f"peers[{i}]"
    _key(p.public_key, f + ".public_key")
    if not 1 <= len(p.ifname) <= 15:
        raise _bad("bad_value", f"{f}.ifname must have 1-15 characters")
    _text(p.endpoint, f + ".endpoint", 64)
    for name in ("rtt_ms", "rtt_min_ms", "rtt_median_ms", "rtt_p95_ms", "jitter_ms", "noise_ms"):
        _num(getattr(p, name), f"{f}.{name}", hi=MAX_PEER_DELAY_MS)
    _num(p.loss, f + ".loss", 0.0, 1.0)
    for name in ("samples", "probes_sent", "rx_bytes", "tx_bytes"):
        _int(getattr(p, name), f"{f}.{name}")
    for name in ("handshake_age_s", "bandwidth_age_s"):
        _num(getattr(p, name), f"{f}.{name}", hi=MAX_PEER_AGE_S)
    for name in ("rx_bps", "tx_bps"):
        _num(getattr(p, name), f"{f}.{name}", hi=MAX_PEER_RATE_BPS)
    _num(p.bandwidth_mbit, f + ".bandwidth_mbit", hi=MAX_PEER_BANDWIDTH_MBIT)
    _num(p.bandwidth_confidence, f + ".bandwidth_confidence", 0.0, 1.0)
    _int(p.pmtu, f + ".pmtu", 68, 65535)


def _check_route(r: Route, i: int) -> None:
    f = f"routes[{i}]"
    _prefix(r.dst, f + ".dst")
    _key(r.via, f + ".via")
    if r.backup is not None:
        _key(r.backup, f + ".backup")
        if r.backup == r.via:
            raise _bad("bad_value", f"{f}.backup is the same peer as via")
    _int(r.mtu, f + ".mtu", 68, 65535)
    _int(r.advmss, f + ".advmss", 1, 65535)
    _int(r.initcwnd, f + ".initcwnd", 1, 65535)
    _int(r.initrwnd, f + ".initrwnd", 1, 65535)
    _int(r.window, f + ".window", 1, _MAX_I63)
    if r.congctl is not None and not (
        1 <= len(r.congctl) <= 15 and r.congctl.replace("_", "").isalnum() and r.congctl.isascii()
    ):
        raise _bad("bad_value", f"{f}.congctl is not a congestion control name")


def validate(msg: Message) -> None:
    """Raise BusMessageError unless every value of ``msg`` is possible."""
    if msg.v != SCHEMA_VERSION:
        raise _bad("bad_version", f"v={msg.v}, this side speaks {SCHEMA_VERSION}")
    if isinstance(msg, Telemetry):
        _name(msg.mesh, "mesh")
        _name(msg.node, "node")
        _key(msg.public_key, "public_key")
        _count(msg.public_keys, "public_keys", MAX_ADDRESSES)
        for i, k in enumerate(msg.public_keys):
            _key(k, f"public_keys[{i}]")
        _count(msg.addresses, "addresses", MAX_ADDRESSES)
        for i, a in enumerate(msg.addresses):
            _prefix(a, f"addresses[{i}]")
        _int(msg.seq, "seq")
        _int(msg.session, "session")
        _num(msg.sent_at, "sent_at")
        _count(msg.peers, "peers", MAX_PEERS)
        for i, p in enumerate(msg.peers):
            _check_peer(p, i)
        _count(msg.counters, "counters", MAX_COUNTERS)
        for k, n in msg.counters.items():
            _text(k, "counters key", 64)
            _int(n, f"counters[{k[:64]!r}]")
    elif isinstance(msg, AgentStatus):
        _name(msg.mesh, "mesh")
        _name(msg.node, "node")
        _num(msg.since, "since")
        _int(msg.seq, "seq")
        _text(msg.reason, "reason")
    elif isinstance(msg, RouteSet):
        _name(msg.mesh, "mesh")
        _name(msg.node, "node")
        _name(msg.controller, "controller")
        _int(msg.version, "version", 0, _MAX_I63)
        _int(msg.term, "term", 0, _MAX_I63)
        _num(msg.issued_at, "issued_at")
        _count(msg.routes, "routes", MAX_ROUTES)
        seen: set[tuple[str, str]] = set()
        for i, r in enumerate(msg.routes):
            _check_route(r, i)
            if (r.dst, r.table) in seen:
                raise _bad("bad_value", f"routes[{i}]: second route to {r.dst} ({r.table})")
            seen.add((r.dst, r.table))
    elif isinstance(msg, Signed):
        _text(msg.key_id, "key_id", 64)
        _count(msg.signature, "signature", 64)
    elif isinstance(msg, Lease):
        _name(msg.mesh, "mesh")
        _name(msg.controller, "controller")
        _int(msg.term, "term", 0, _MAX_I63)
        _num(msg.issued_at, "issued_at")
        _num(msg.expires_at, "expires_at")
        if msg.expires_at < msg.issued_at:
            raise _bad("bad_value", "lease expires before it was issued")
    elif isinstance(msg, ControllerStatus):
        _name(msg.controller, "controller")
        _num(msg.since, "since")
    else:  # pragma: no cover - the union above is closed
        raise TypeError(f"not a bus message: {type(msg).__name__}")


# -- wire format -----------------------------------------------------------------------


class _Envelope(msgspec.Struct):
    """Just the version, read before the rest so a newer schema reads as bad_version."""

    v: int


_encoder = msgspec.json.Encoder()
_envelope = msgspec.json.Decoder(_Envelope)
_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {}


def _schema_or_json(data: bytes | bytearray | memoryview, exc: Exception) -> BusMessageError:
    """msgspec stops at the first wrong type, before it has seen all the JSON: tell a
    well-formed document of the wrong shape (bad_schema) from broken JSON (bad_json)."""
    try:
        msgspec.json.decode(data)
    except msgspec.DecodeError as broken:
        return _bad("bad_json", str(broken)[:200])
    return _bad("bad_schema", str(exc)[:200])


def encode(msg: Message) -> bytes:
    """JSON bytes of ``msg``; BusMessageError if a decoder would refuse it."""
    validate(msg)
    return _encoder.encode(msg)


def decode(data: bytes, kind: type[M], *, max_bytes: int = MAX_PAYLOAD_BYTES) -> M:
    """Decode and validate one message of type ``kind``; BusMessageError otherwise."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise _bad("bad_json", f"payload is a {type(data).__name__}, not bytes")
    if len(data) > max_bytes:
        raise _bad("too_large", f"{len(data)} bytes (at most {max_bytes})")
    try:
        return _decode(data, kind)
    except RecursionError:
        # msgspec recurses per nesting level: '[' * 100000 must not escape as a crash.
        raise _bad("bad_json", "nested too deeply") from None


def _decode(data: bytes | bytearray | memoryview, kind: type[M]) -> M:
    try:
        env = _envelope.decode(data)
    except msgspec.ValidationError as exc:
        raise _schema_or_json(data, exc) from None
    except msgspec.DecodeError as exc:
        raise _bad("bad_json", str(exc)[:200]) from None
    if env.v != SCHEMA_VERSION:
        raise _bad("bad_version", f"v={env.v}, this side speaks {SCHEMA_VERSION}")
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    try:
        msg: M = decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise _schema_or_json(data, exc) from None
    except msgspec.DecodeError as exc:
        raise _bad("bad_json", str(exc)[:200]) from None
    validate(msg)
    return msg


def decode_telemetry(data: bytes, *, max_bytes: int = MAX_PAYLOAD_BYTES) -> Telemetry:
    return decode(data, Telemetry, max_bytes=max_bytes)


def decode_status(data: bytes, *, max_bytes: int = MAX_PAYLOAD_BYTES) -> AgentStatus:
    return decode(data, AgentStatus, max_bytes=max_bytes)


def decode_route_set(data: bytes, *, max_bytes: int = MAX_PAYLOAD_BYTES) -> RouteSet:
    return decode(data, RouteSet, max_bytes=max_bytes)


def decode_signed(data: bytes, *, max_bytes: int = MAX_PAYLOAD_BYTES) -> Signed:
    return decode(data, Signed, max_bytes=max_bytes)


def decode_lease(data: bytes, *, max_bytes: int = MAX_PAYLOAD_BYTES) -> Lease:
    return decode(data, Lease, max_bytes=max_bytes)


def decode_controller_status(
    data: bytes, *, max_bytes: int = MAX_PAYLOAD_BYTES
) -> ControllerStatus:
    return decode(data, ControllerStatus, max_bytes=max_bytes)


# -- counting what was dropped -------------------------------------------------------


class Counters:
    """Counts per reason; logs a reason the first time only, so garbage cannot flood logs.

    A daemon calls ``count(exc.reason, detail)`` when it drops input and publishes
    ``snapshot()`` (e.g. in ``Telemetry.counters``).
    """

    def __init__(
        self,
        what: str = "dropped",
        logger: logging.Logger | None = None,
        level: int = logging.WARNING,
    ) -> None:
        self.what = what
        self.logger = logger or log
        self.level = level
        self._counts: dict[str, int] = {}

    def count(
        self, reason: str, detail: str = "", n: int = 1, *, exc_info: BaseException | None = None
    ) -> int:
        """Add ``n`` to ``reason``; log the first one (with ``exc_info``'s traceback)."""
        new = self._counts.get(reason, 0) + n
        self._counts[reason] = new
        if new == n:
            more = f": {detail}" if detail else ""
            self.logger.log(
                self.level,
                "%s (%s)%s; further ones are only counted",
                self.what,
                reason,
                more,
                exc_info=exc_info,
            )
        return new

    def __getitem__(self, reason: str) -> int:
        return self._counts.get(reason, 0)

    def __contains__(self, reason: object) -> bool:
        return reason in self._counts

    def total(self) -> int:
        return sum(self._counts.values())

    def snapshot(self) -> dict[str, int]:
        return dict(self._counts)

    def __repr__(self) -> str:
        return f"Counters({self.what!r}, {self._counts!r})"
