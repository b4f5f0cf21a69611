"""Typed, versioned bus messages (msgspec Structs; JSON on the wire, MessagePack for
telemetry).

Every top-level message carries ``v`` (SCHEMA_VERSION). A decoder reads ``v`` first, so a
message from a newer schema is refused as "bad_version" rather than as a confusing type
error; unknown fields are ignored, so adding an optional field does not need a new
version. Decoders then check values the type system cannot: finite non-negative RTTs,
loss in 0..1, counters that fit 64 bits, real prefixes, 32-byte base64 keys, bounded list
sizes. Each rejection is a :class:`BusMessageError` with a stable short ``reason`` that a
daemon counts (see :class:`Counters`) instead of crashing.

Messages (topic -> type)::

    telemetry/<node>             Signed("telemetry", Telemetry {v, mesh, node, public_key,
                                   addresses, seq, session, sent_at, full, peers, counters,
                                   table: PeerTable, full_interval_s})
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

Agents send telemetry's peer reports as a :class:`PeerTable` (one packed array per field,
quantised) and the message as MessagePack inside the usual JSON envelope: 152 kB signed
for 1,000 peers with every field an agent fills, where JSON objects took 475 kB. A decoder tells the
encodings apart by the first byte (:func:`is_msgpack`); ``peers`` (objects) stays
readable for tools and tests.

PeerReport and Route leave fields at their default out of the JSON (they repeat up to
4096 times): a signed route set for a 1,000-node mesh, every route with a backup, is
~177 KB. A route set whose JSON would not fit the 256 KiB limit goes out packed
(:class:`PackedRouteSet`, MessagePack, v2): 175 kB signed for 2,000 destinations with a
fast and a bulk route each. Decoders return the same RouteSet for both.

Units: times are unix seconds (float), durations ``*_s``, RTTs ``*_ms``, rates ``*_bps``
(bytes per second of WireGuard counters) and ``bandwidth_mbit`` (Mbit/s). ``None`` means
"not measured yet", never zero. Keys are base64 WireGuard keys (44 characters).

Rejection reasons (bad_json: the bytes do not decode, JSON or MessagePack): too_large,
bad_json, bad_schema, bad_version, bad_value, bad_name,
bad_prefix, bad_key (and, from signing, bad_signature, unknown_key, wrong_node, replay,
duplicate). :func:`encode` runs the same checks, so a daemon never publishes what its
peers would refuse (msgspec would otherwise write a NaN as ``null``, i.e. "unknown").
"""

from __future__ import annotations

import base64
import ipaddress
import logging
import math
import operator
import sys
from array import array
from collections.abc import Iterable, Sequence, Sized
from itertools import compress, repeat
from typing import Any, Final, Literal, TypeVar

import msgspec

from meshopt.bus.topics import is_valid_name
from meshopt.errors import MeshoptError
from meshopt.wireguard.errors import KeyFormatError
from meshopt.wireguard.keys import check_key, key_to_bytes

SCHEMA_VERSION: Final = 1
MAX_PAYLOAD_BYTES: Final = 256 * 1024
MAX_PEERS: Final = 4096
MAX_ROUTES: Final = 8192  # a fast and a bulk route to each of MAX_PEERS destinations
# Route sets whose JSON would not fit go out packed (see PackedRouteSet), as v2.
PACKED_ROUTES_VERSION: Final = 2
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
    jitter_ms: float | None = None  # sigma of the RTT samples (meshopt.estimate)
    noise_ms: float | None = None
    loss: float | None = None
    samples: int = 0
    probes_sent: int = 0
    # How many probe outcomes ``loss`` rests on: the window's, or more with the prober's
    # loss memory (meshopt.estimate.pooled_loss). 0: not told (the controller takes the
    # window's, ``samples`` / (1 - loss)).
    loss_outcomes: int = 0
    handshake_age_s: float | None = None
    rx_bytes: int = 0
    tx_bytes: int = 0
    rx_bps: float = 0.0
    tx_bps: float = 0.0
    bandwidth_mbit: float | None = None
    bandwidth_confidence: float | None = None
    bandwidth_age_s: float | None = None
    pmtu: int | None = None
    # How the agent probes this peer now (meshopt.probe.budget): "in_use" (a relay,
    # traffic, or the backup of a next hop that is either: probed fast) or "idle",
    # the time between probes and the failure-detection time that class gets.
    probe_class: Literal["in_use", "idle"] | None = None
    probe_interval_s: float | None = None
    probe_dead_after_s: float | None = None


# -- the compact, columnar peer table (telemetry's wire form) --------------------------
#
# A full snapshot of 1,000 peers as JSON objects was 475 kB (over MAX_PAYLOAD_BYTES) and
# cost the controller per-peer Python to check. The table holds one packed little-endian
# array per field instead, peer i at index i of each, so a decoder checks a column with
# a few C-level passes and the controller maps it into numpy without a loop (this module
# uses the stdlib ``array``: agents do not load numpy). Values are quantised where finer
# precision means nothing: delays to 10 us, loss and confidence to 1e-4, handshake age to
# 0.1 s. An empty column means "not measured" for every peer (the lean case costs
# nothing); within a column a sentinel (the type's maximum, NaN for floats, 0 for pmtu)
# means "not measured" for that peer.

DELAY_UNIT_MS: Final = 0.01  # delays travel as uint32 counts of 10 us
RATIO_UNIT: Final = 1e-4  # loss and bandwidth confidence as uint16 counts of 1e-4
AGE_UNIT_S: Final = 0.1  # handshake age as uint32 counts of 0.1 s
KEY_BYTES: Final = 32
NONE_U32: Final = 0xFFFFFFFF
NONE_U16: Final = 0xFFFF
ALIVE_UNKNOWN: Final = 2
PROBE_NONE: Final = 0xFF  # probe column: this peer's probing not reported
MAX_PROBE_RATES: Final = 16  # distinct (class, interval, dead time) in one table
MAX_IFNAMES: Final = 255  # ifname indexes are one byte

# Column name -> numpy dtype of its packed little-endian values (the wire format).
COLUMNS: Final[dict[str, str]] = {
    "ifname": "u1",
    "alive": "u1",
    "rtt": "<u4",
    "rtt_min": "<u4",
    "rtt_median": "<u4",
    "rtt_p95": "<u4",
    "jitter": "<u4",
    "noise": "<u4",
    "loss": "<u2",
    "samples": "<u4",
    "probes_sent": "<u4",
    "loss_outcomes": "<u4",
    "handshake_age": "<u4",
    "rx_bytes": "<u8",
    "tx_bytes": "<u8",
    "rx_bps": "<f4",
    "tx_bps": "<f4",
    "bandwidth": "<f4",
    "bandwidth_confidence": "<u2",
    "bandwidth_age": "<f4",
    "pmtu": "<u2",
    "probe": "u1",
}
# The same as stdlib array type codes (sizes checked at import).
_CODES: Final[dict[str, str]] = {"u1": "B", "<u2": "H", "<u4": "I", "<u8": "Q", "<f4": "f"}
assert all(array(c).itemsize == int(d[-1]) for d, c in _CODES.items())
_SWAP: Final = sys.byteorder == "big"
# Delay column -> PeerReport field.
DELAY_COLUMNS: Final[dict[str, str]] = {
    "rtt": "rtt_ms",
    "rtt_min": "rtt_min_ms",
    "rtt_median": "rtt_median_ms",
    "rtt_p95": "rtt_p95_ms",
    "jitter": "jitter_ms",
    "noise": "noise_ms",
}


def _unpack(name: str, raw: bytes) -> array[Any]:
    a: array[Any] = array(_CODES[COLUMNS[name]])
    a.frombytes(raw)
    if _SWAP:
        a.byteswap()
    return a


def _pack(code: str, values: Sequence[Any]) -> bytes:
    a = array(code, values)
    if _SWAP:
        a.byteswap()
    return a.tobytes()


class ProbeRate(msgspec.Struct, array_like=True, frozen=True):
    """One way of probing peers: class, time between probes, dead time (None: not
    reported). A table lists the few distinct ones once; ``probe`` indexes them."""

    cls: Literal["in_use", "idle"] | None = None
    interval_s: float | None = None
    dead_after_s: float | None = None


_NO_RATE: Final = ProbeRate()


class PeerTable(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """Every peer report of one telemetry message, one packed array per field.

    ``keys`` is the peers' raw 32-byte WireGuard keys back to back; ``ifnames`` the
    distinct interface names and ``ifname`` each peer's index into it (empty: all on
    ``ifnames[0]``); ``endpoints`` one text per peer ("" = unknown) or empty.
    """

    keys: bytes
    ifnames: list[str]
    ifname: bytes = b""
    endpoints: list[str] = msgspec.field(default_factory=list)
    alive: bytes = b""
    rtt: bytes = b""
    rtt_min: bytes = b""
    rtt_median: bytes = b""
    rtt_p95: bytes = b""
    jitter: bytes = b""
    noise: bytes = b""
    loss: bytes = b""
    samples: bytes = b""
    probes_sent: bytes = b""
    loss_outcomes: bytes = b""
    handshake_age: bytes = b""
    rx_bytes: bytes = b""
    tx_bytes: bytes = b""
    rx_bps: bytes = b""
    tx_bps: bytes = b""
    bandwidth: bytes = b""
    bandwidth_confidence: bytes = b""
    bandwidth_age: bytes = b""
    pmtu: bytes = b""
    probe_rates: list[ProbeRate] = msgspec.field(default_factory=list)
    probe: bytes = b""

    def __len__(self) -> int:
        return len(self.keys) // KEY_BYTES

    def values(self, name: str) -> array[Any] | None:
        """Column ``name`` as raw wire values (quantised), or None when it is absent."""
        raw: bytes = getattr(self, name)
        return _unpack(name, raw) if raw else None

    def _probe_rates(self) -> list[ProbeRate]:
        """Each peer's ProbeRate (``_NO_RATE`` where not reported)."""
        n = len(self)
        rates = self.probe_rates
        if not rates:
            return [_NO_RATE] * n
        idx = self.values("probe")
        if idx is None:
            return [rates[0]] * n
        return [_NO_RATE if i == PROBE_NONE else rates[i] for i in idx]

    def key_list(self) -> list[str]:
        """The peers' keys in base64, the form every other part of meshopt uses."""
        k = self.keys
        return [
            base64.b64encode(k[i : i + KEY_BYTES]).decode("ascii")
            for i in range(0, len(k), KEY_BYTES)
        ]

    def rows(self) -> list[PeerReport]:
        """The table as one PeerReport per peer (display tools, tests, the controller's
        rows once per snapshot; not the ingest path). Column by column, then one
        constructor call per peer."""
        n = len(self)
        none_n: list[Any] = [None] * n

        def scaled(name: str, unit: float, none: int, nd: int) -> list[Any]:
            c = self.values(name)
            if c is None:
                return none_n
            return [None if v == none else round(v * unit, nd) for v in c]

        def plain(name: str, default: Any) -> list[Any]:
            c = self.values(name)
            return [default] * n if c is None else c.tolist()

        def opt(name: str) -> list[Any]:
            c = self.values(name)
            return none_n if c is None else [None if v != v else v for v in c]

        ifn = self.values("ifname")
        names = self.ifnames
        alive = self.values("alive")
        pmtu = self.values("pmtu")
        probe_of = self._probe_rates()
        fields: dict[str, list[Any]] = {
            "public_key": self.key_list(),
            "ifname": [names[0]] * n if ifn is None else [names[i] for i in ifn],
            "endpoint": [e or None for e in self.endpoints] if self.endpoints else none_n,
            "alive": (
                none_n if alive is None else [None if a == ALIVE_UNKNOWN else a == 1 for a in alive]
            ),
            **{f: scaled(c, DELAY_UNIT_MS, NONE_U32, 2) for c, f in DELAY_COLUMNS.items()},
            "loss": scaled("loss", RATIO_UNIT, NONE_U16, 4),
            "samples": plain("samples", 0),
            "probes_sent": plain("probes_sent", 0),
            "loss_outcomes": plain("loss_outcomes", 0),
            "handshake_age_s": scaled("handshake_age", AGE_UNIT_S, NONE_U32, 1),
            "rx_bytes": plain("rx_bytes", 0),
            "tx_bytes": plain("tx_bytes", 0),
            "rx_bps": plain("rx_bps", 0.0),
            "tx_bps": plain("tx_bps", 0.0),
            "bandwidth_mbit": opt("bandwidth"),
            "bandwidth_confidence": scaled("bandwidth_confidence", RATIO_UNIT, NONE_U16, 4),
            "bandwidth_age_s": opt("bandwidth_age"),
            "pmtu": none_n if pmtu is None else [v or None for v in pmtu],
            "probe_class": [r.cls for r in probe_of],
            "probe_interval_s": [r.interval_s for r in probe_of],
            "probe_dead_after_s": [r.dead_after_s for r in probe_of],
        }
        names_ = list(fields)
        return [
            PeerReport(**dict(zip(names_, vals, strict=True)))
            for vals in zip(*fields.values(), strict=True)
        ]


def _pack_opt(values: Sequence[float | None], unit: float, none: int, code: str) -> bytes:
    if all(v is None for v in values):
        return b""
    return _pack(code, [none if v is None else min(round(v / unit), none - 1) for v in values])


def _pack_float(values: Sequence[float | None], default: float | None = None) -> bytes:
    if all(v is None or v == default for v in values):
        return b""
    return _pack("f", [math.nan if v is None else v for v in values])


def _pack_int(values: Sequence[int], code: str) -> bytes:
    return _pack(code, values) if any(values) else b""


def _probe_columns(peers: Sequence[PeerReport]) -> dict[str, Any]:
    """``probe_rates`` (the distinct ways peers are probed: two or three with the budget)
    and ``probe``, each peer's index into it: one byte a peer."""
    rates: list[ProbeRate] = []
    index: dict[ProbeRate, int] = {}
    col: list[int] = []
    for p in peers:
        r = ProbeRate(p.probe_class, p.probe_interval_s, p.probe_dead_after_s)
        if r == _NO_RATE:
            col.append(PROBE_NONE)
            continue
        i = index.get(r)
        if i is None:
            if len(rates) >= MAX_PROBE_RATES:
                raise _bad("bad_value", f"peers probed in more than {MAX_PROBE_RATES} ways")
            i = index[r] = len(rates)
            rates.append(r)
        col.append(i)
    if not rates:
        return {}
    if all(i == 0 for i in col):
        return {"probe_rates": rates}
    return {"probe_rates": rates, "probe": _pack("B", col)}


def peer_table(peers: Sequence[PeerReport]) -> PeerTable:
    """The columnar form of ``peers`` (the agent's side: it runs once per message).

    BusMessageError for a value the table cannot carry (a key that is not a WireGuard
    key, a counter beyond 64 bits): :func:`validate` would refuse it anyway.
    """
    names: list[str] = []
    index: dict[str, int] = {}
    for p in peers:
        if p.ifname not in index:
            index[p.ifname] = len(names)
            names.append(p.ifname)
    if len(names) > MAX_IFNAMES:
        raise _bad("bad_value", f"peers on {len(names)} interfaces (at most {MAX_IFNAMES})")
    try:
        keys = b"".join(key_to_bytes(p.public_key) for p in peers)
    except KeyFormatError:
        raise _bad("bad_key", "a peer's public_key is not a base64 WireGuard key") from None
    try:
        cols: dict[str, Any] = {
            "keys": keys,
            "ifnames": names or ["-"],
            "ifname": _pack("B", [index[p.ifname] for p in peers]) if len(names) > 1 else b"",
            "endpoints": (
                [p.endpoint or "" for p in peers] if any(p.endpoint for p in peers) else []
            ),
            "alive": (
                b""
                if all(p.alive is None for p in peers)
                else bytes(ALIVE_UNKNOWN if p.alive is None else int(p.alive) for p in peers)
            ),
            "loss": _pack_opt([p.loss for p in peers], RATIO_UNIT, NONE_U16, "H"),
            "samples": _pack_int([p.samples for p in peers], "I"),
            "probes_sent": _pack_int([p.probes_sent for p in peers], "I"),
            "loss_outcomes": _pack_int([p.loss_outcomes for p in peers], "I"),
            "handshake_age": _pack_opt(
                [p.handshake_age_s for p in peers], AGE_UNIT_S, NONE_U32, "I"
            ),
            "rx_bytes": _pack_int([p.rx_bytes for p in peers], "Q"),
            "tx_bytes": _pack_int([p.tx_bytes for p in peers], "Q"),
            "rx_bps": _pack_float([p.rx_bps for p in peers], 0.0),
            "tx_bps": _pack_float([p.tx_bps for p in peers], 0.0),
            "bandwidth": _pack_float([p.bandwidth_mbit for p in peers]),
            "bandwidth_confidence": _pack_opt(
                [p.bandwidth_confidence for p in peers], RATIO_UNIT, NONE_U16, "H"
            ),
            "bandwidth_age": _pack_float([p.bandwidth_age_s for p in peers]),
            "pmtu": _pack_int([p.pmtu or 0 for p in peers], "H"),
            **_probe_columns(peers),
        }
        for col, fld in DELAY_COLUMNS.items():
            cols[col] = _pack_opt([getattr(p, fld) for p in peers], DELAY_UNIT_MS, NONE_U32, "I")
    except (OverflowError, ValueError, TypeError) as exc:
        raise _bad("bad_value", f"a peer value does not fit the table: {exc}") from None
    return PeerTable(**cols)


def _check_table(t: PeerTable) -> None:
    """Every column the right length and every value possible (C-level passes per column,
    no per-peer Python)."""
    if len(t.keys) % KEY_BYTES:
        raise _bad("bad_value", f"table.keys: {len(t.keys)} bytes, not whole 32-byte keys")
    n = len(t)
    if n > MAX_PEERS:
        raise _bad("bad_value", f"table: {n} peers (at most {MAX_PEERS})")
    if not 1 <= len(t.ifnames) <= MAX_IFNAMES:
        raise _bad("bad_value", f"table.ifnames: {len(t.ifnames)} names (want 1..{MAX_IFNAMES})")
    if n and (max(map(len, t.ifnames)) > 15 or min(map(len, t.ifnames)) < 1):
        raise _bad("bad_value", "table.ifnames: a name without 1-15 characters")
    if t.endpoints:
        if len(t.endpoints) != n:
            raise _bad("bad_value", f"table.endpoints: {len(t.endpoints)} entries for {n} peers")
        if max(map(len, t.endpoints)) > 64:
            raise _bad("bad_value", "table.endpoints: an entry longer than 64 characters")
    cols: dict[str, array[Any]] = {}
    for name, dtype in COLUMNS.items():
        raw: bytes = getattr(t, name)
        if raw:
            if len(raw) != n * int(dtype[-1]):
                raise _bad("bad_value", f"table.{name}: {len(raw)} bytes for {n} peers")
            cols[name] = _unpack(name, raw)

    def over(name: str, hi: float, none: int | None = None) -> None:
        c = cols.get(name)
        if c is None or not c:
            return
        top = max(c)
        if none is not None and top == none:
            top = max(filter(none.__ne__, c), default=0)
        if top > hi:
            raise _bad("bad_value", f"table.{name}: {top} (at most {hi:g})")

    over("ifname", len(t.ifnames) - 1)
    over("alive", ALIVE_UNKNOWN)
    for col in DELAY_COLUMNS:
        over(col, MAX_PEER_DELAY_MS / DELAY_UNIT_MS, NONE_U32)
    over("loss", 1.0 / RATIO_UNIT, NONE_U16)
    over("bandwidth_confidence", 1.0 / RATIO_UNIT, NONE_U16)
    over("handshake_age", MAX_PEER_AGE_S / AGE_UNIT_S, NONE_U32)
    pm = cols.get("pmtu")
    if pm is not None and pm and min(filter(None, pm), default=68) < 68:
        raise _bad("bad_value", "table.pmtu: a path MTU below 68")
    _count(t.probe_rates, "table.probe_rates", MAX_PROBE_RATES)
    for i, r in enumerate(t.probe_rates):
        _probe_class(r.cls, f"table.probe_rates[{i}].cls")
        _num(r.interval_s, f"table.probe_rates[{i}].interval_s", MIN_PROBE_S, MAX_PROBE_S)
        _num(r.dead_after_s, f"table.probe_rates[{i}].dead_after_s", MIN_PROBE_S, MAX_PROBE_S)
    pr = cols.get("probe")
    if pr is not None and pr:
        top = max(filter(PROBE_NONE.__ne__, pr), default=0)
        if top >= max(len(t.probe_rates), 1):
            raise _bad("bad_value", f"table.probe: {top} ({len(t.probe_rates)} probe_rates)")
    for name, hi, nan_ok in (
        ("rx_bps", MAX_PEER_RATE_BPS, False),
        ("tx_bps", MAX_PEER_RATE_BPS, False),
        ("bandwidth", MAX_PEER_BANDWIDTH_MBIT, True),
        ("bandwidth_age", MAX_PEER_AGE_S, True),
    ):
        c = cols.get(name)
        if c is None or not c:
            continue
        if not nan_ok and math.isnan(sum(c)):
            raise _bad("bad_value", f"table.{name}: NaN")
        finite = [x for x in c if x == x] if nan_ok else c
        if finite and not (min(finite) >= 0.0 and max(finite) <= hi):
            raise _bad("bad_value", f"table.{name}: a value outside 0..{hi:g}")


# What counts as a significant move of one peer between two snapshots: the agent's own
# change-report thresholds (meshopt.agent.telemetry.peer_changed, defaults).
MOVED_RTT_MS: Final = 1.0
MOVED_RTT_REL: Final = 0.1
MOVED_LOSS: Final = 0.01
MOVED_YOUNG_SAMPLES: Final = 16  # a young estimate moves each time its samples double


def tables_moved(old: PeerTable | None, new: PeerTable) -> bool:
    """True when ``new`` differs from ``old`` as much as a change report would: other
    peers, a peer alive/dead, an RTT appearing or gone, an RTT step of >= 1 ms and
    >= 10 %, a loss step of >= 0.01, a young estimate's samples doubled. A controller
    acts on such a snapshot at once and batches the rest (noise its policy would not
    act on). Columns only, no rows."""
    if old is None or old.keys != new.keys or old.alive != new.alive:
        return True
    o_rtt, n_rtt = old.values("rtt"), new.values("rtt")
    if (o_rtt is None) != (n_rtt is None):
        return True
    if o_rtt is not None and n_rtt is not None:
        abs_units = MOVED_RTT_MS / DELAY_UNIT_MS
        for a, b in zip(o_rtt, n_rtt, strict=True):
            if a != b and (a == NONE_U32 or b == NONE_U32):
                return True
            step = abs(b - a)
            if step >= abs_units and step >= MOVED_RTT_REL * a:
                return True
    o_n, n_n = old.values("samples"), new.values("samples")
    if n_n is not None:
        for a, b in zip(o_n or array("I", bytes(4 * len(new))), n_n, strict=True):
            if a < MOVED_YOUNG_SAMPLES and b >= 2 * max(a, 1):
                return True
    o_loss, n_loss = old.values("loss"), new.values("loss")
    if o_loss == n_loss:
        return False
    zeros = array("H", bytes(2 * len(new)))
    units = MOVED_LOSS / RATIO_UNIT
    for a, b in zip(o_loss or zeros, n_loss or zeros, strict=True):
        a, b = (0 if a == NONE_U16 else a), (0 if b == NONE_U16 else b)
        if abs(b - a) >= units - 1e-9:
            return True
    return False


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
    # The compact form of the peer reports (what agents send; ``peers`` stays for small
    # messages and tools). A message may carry both; a peer in both is taken from the table.
    table: PeerTable | None = None
    # The agent's full-snapshot interval now (it stretches with the number of peers): a
    # controller holds a node's picture stale only after missing several of them.
    full_interval_s: float = 0.0

    def reports(self) -> list[PeerReport]:
        """Every peer report, from ``peers`` and the table (display tools; not a hot path)."""
        if self.table is None:
            return list(self.peers)
        return list(self.peers) + self.table.rows()


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


class Tuning(msgspec.Struct, array_like=True, frozen=True):
    """A bulk route's TCP settings (None: unset), listed once per distinct set."""

    mtu: int | None = None
    advmss: int | None = None
    initcwnd: int | None = None
    initrwnd: int | None = None
    window: int | None = None
    congctl: str | None = None


class PackedRoutes(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """A route set's routes, one column per field (the wire form of large sets).

    What repeats is listed once and indexed per route (little-endian u16): ``keys``
    (the peers the routes name, raw 32-byte WireGuard keys back to back) by ``via`` and
    ``backup`` (0xFFFF: none; no column: no backups), ``prefixes`` by ``dst`` (a
    destination has a fast and a bulk route), ``tunings`` (the bulk TCP settings) by
    ``tuning`` (0xFFFF: none; no column: none anywhere). ``table``: u8 per route, 0
    fast, 1 bulk (no column: all fast). About 9 bytes a route plus 32 a peer.
    """

    keys: bytes
    prefixes: list[str]
    dst: bytes
    via: bytes
    backup: bytes = b""
    table: bytes = b""
    tunings: list[Tuning] = msgspec.field(default_factory=list)
    tuning: bytes = b""


class PackedRouteSet(msgspec.Struct, kw_only=True, frozen=True):
    """A RouteSet in its packed wire form: MessagePack, ``v`` = PACKED_ROUTES_VERSION, so
    an agent from before it refuses the set (bad_version: it keeps its routes) instead
    of reading an empty route list. :func:`encode` picks it only when the JSON form
    would not fit MAX_PAYLOAD_BYTES signed (about 1,400 destinations with bulk routes,
    fewer with their TCP settings); :func:`decode` gives the same RouteSet either way."""

    v: int = PACKED_ROUTES_VERSION
    mesh: str
    node: str
    version: int
    issued_at: float
    controller: str
    term: int
    packed: PackedRoutes


_NONE_U16: Final = 0xFFFF
_NONE_LE: Final = _NONE_U16.to_bytes(2, "little")
_TABLES: Final[tuple[Literal["fast", "bulk"], ...]] = ("fast", "bulk")
_TABLE_NAMES: Final = frozenset(_TABLES)


# Raw bytes of base64 WireGuard keys found valid, remembered (bounded as _valid_keys):
# packing a set of a 1000-node mesh decoded its ~1000 keys every time.
_key_bytes: dict[str, bytes] = {}


def _raw_key(k: str) -> bytes:
    raw = _key_bytes.get(k)
    if raw is None:
        raw = key_to_bytes(k)  # KeyFormatError for a bad one, not remembered
        if len(_key_bytes) >= _VALID_MAX:
            _key_bytes.clear()
        _key_bytes[k] = raw
    return raw


# i -> i as 2 little-endian bytes (the packed index columns), as many as the largest
# list packed so far needed (at most 0xFFFF): a column is one dict lookup and one join
# per route, no list of ints to convert. Replaced, never extended, when it grows.
_u16_le: list[bytes] = []


def _u16_codes(uniq: Sequence[Any]) -> dict[Any, bytes]:
    """``uniq``'s values (fewer than 0xFFFF, distinct) -> their index as 2 LE bytes."""
    global _u16_le
    codes = _u16_le
    if len(codes) < len(uniq):
        codes = [i.to_bytes(2, "little") for i in range(len(uniq))]
        _u16_le = codes
    return dict(zip(uniq, codes, strict=False))


# Route.table -> its byte in the packed ``table`` column.
_TABLE_BYTE: Final[dict[str, int]] = {"fast": 0, "bulk": 1}
_FLIP: Final = bytes.maketrans(b"\x00\x01", b"\x01\x00")


class _RouteColumns:
    """A route set's routes column by column, each computed once for both the check
    (:func:`_check_columns`) and the packing (:func:`pack_routes`), with comprehensions
    and C-level maps: at 1000 nodes the controller signs ~600 sets of ~2000 routes one
    after another when a relay dies (issue 15).

    ``table``: a byte per route (0 fast, 1 bulk), None if a route's table is neither
    (the check then goes route by route). ``tunings``: each distinct TCP setting (mtu,
    advmss, initcwnd, initrwnd, window, congctl) in first-use order -> the index of the
    first route with it; ``tuning``: that index per route (a tuple is hashed once).
    ``peers``: every via, then the backups, each once (``via_none``: a via is None).
    """

    __slots__ = (
        "backup",
        "dst",
        "peers",
        "prefixes",
        "table",
        "tuning",
        "tunings",
        "via",
        "via_none",
    )

    def __init__(self, routes: Sequence[Route]) -> None:
        self.dst = [r.dst for r in routes]
        self.via = [r.via for r in routes]
        self.backup = [r.backup for r in routes]
        self.table: bytes | None
        try:
            self.table = bytes([_TABLE_BYTE[r.table] for r in routes])
        except KeyError:
            self.table = None
        self.tunings: dict[_Tuning, int] = {}
        first = self.tunings.setdefault
        self.tuning = [
            first((r.mtu, r.advmss, r.initcwnd, r.initrwnd, r.window, r.congctl), i)
            for i, r in enumerate(routes)
        ]
        peers: dict[str | None, None] = dict.fromkeys(self.via)
        self.via_none = None in peers
        peers.update(dict.fromkeys(self.backup))
        if not self.via_none:
            peers.pop(None, None)
        # None stays only when it is a via: then the check goes route by route (None is
        # not a valid key) and packing refuses it as before (bad_key).
        self.peers: dict[str, None] = peers  # type: ignore[assignment]
        self.prefixes: dict[str, None] = dict.fromkeys(self.dst)

    def has_backups(self) -> bool:
        return self.backup.count(None) != len(self.backup)


def pack_routes(rs: RouteSet) -> PackedRouteSet:
    """The packed form of ``rs`` (routes in the same order).

    Lists in first-use order (peers: every ``via``, then the backups), indexes by dict
    lookups over the routes' columns: no Python call per route (issue 15: packing was
    the other half of signing a 1000-node set)."""
    return _pack_routes(rs, _RouteColumns(rs.routes))


def _pack_routes(rs: RouteSet, c: _RouteColumns) -> PackedRouteSet:
    peers = list(c.peers)
    prefixes = list(c.prefixes)
    uniq = [t for t in c.tunings if t != _NO_TUNING_T]
    if max(len(peers), len(prefixes), len(uniq)) >= _NONE_U16:
        raise _bad("bad_value", "a route set too large to pack")
    raws = list(map(_key_bytes.get, peers))  # bytes of the keys seen before, else None
    try:
        keys = b"".join(map(_raw_key, peers) if None in raws else raws)  # type: ignore[arg-type]
    except KeyFormatError:
        raise _bad("bad_key", "a route's peer is not a base64 WireGuard key") from None
    # Every peer is a key now, so None is not one: it stands for "no backup".
    at = _u16_codes(peers)
    at[None] = _NONE_LE
    # A route's tuning is the index of the first route with the same settings.
    codes = _u16_codes(uniq)
    t_at = {i: codes.get(t, _NONE_LE) for t, i in c.tunings.items()}
    table = c.table
    if table is None:  # tables the check took route by route: 0 fast, 1 any other
        names = [r.table for r in rs.routes]
        table = bytes(map(operator.not_, map(operator.eq, names, repeat("fast"))))
    cols: dict[str, Any] = {
        "keys": keys,
        "prefixes": prefixes,
        "dst": b"".join(map(_u16_codes(prefixes).__getitem__, c.dst)),
        "via": b"".join(map(at.__getitem__, c.via)),
        "backup": b"".join(map(at.__getitem__, c.backup)) if c.has_backups() else b"",
        "table": table if b"\x01" in table else b"",
        "tunings": [Tuning(*t) for t in uniq],
        "tuning": b"".join(map(t_at.__getitem__, c.tuning)) if uniq else b"",
    }
    return PackedRouteSet(
        mesh=rs.mesh, node=rs.node, version=rs.version, issued_at=rs.issued_at,
        controller=rs.controller, term=rs.term, packed=PackedRoutes(**cols),
    )  # fmt: skip


def unpack_routes(p: PackedRouteSet) -> RouteSet:
    """The RouteSet a packed one carries; BusMessageError unless its columns fit together
    (the routes are then checked like any set's, by :func:`validate`)."""
    t = p.packed
    n = len(t.dst) // 2
    if n > MAX_ROUTES:
        raise _bad("bad_value", f"routes: {n} entries (at most {MAX_ROUTES})")
    if len(t.keys) % KEY_BYTES:
        raise _bad("bad_value", f"packed.keys: {len(t.keys)} bytes, not whole keys")
    _count(t.prefixes, "packed.prefixes", MAX_ROUTES)
    _count(t.tunings, "packed.tunings", MAX_ROUTES)
    keys = [
        base64.b64encode(t.keys[i : i + KEY_BYTES]).decode("ascii")
        for i in range(0, len(t.keys), KEY_BYTES)
    ]
    _count(keys, "packed.keys", MAX_ROUTES)

    def column(name: str, code: str, size: int, hi: int, none: int | None) -> list[int] | None:
        raw: bytes = getattr(t, name)
        if not raw and name not in ("dst", "via"):
            return None
        if len(raw) != n * size:
            raise _bad("bad_value", f"packed.{name}: {len(raw)} bytes for {n} routes")
        a: array[Any] = array(code)
        a.frombytes(raw)
        if _SWAP:
            a.byteswap()
        top = max(filter(none.__ne__, a), default=0) if none is not None else max(a, default=0)
        if n and top > hi:
            raise _bad("bad_value", f"packed.{name}: index {top} (at most {hi})")
        return a.tolist()

    dst = column("dst", "H", 2, len(t.prefixes) - 1, None)
    via = column("via", "H", 2, len(keys) - 1, None)
    backup = column("backup", "H", 2, len(keys) - 1, _NONE_U16)
    table = column("table", "B", 1, len(_TABLES) - 1, None)
    tuning = column("tuning", "H", 2, len(t.tunings) - 1, _NONE_U16)
    assert dst is not None and via is not None
    tunings = [msgspec.structs.asdict(x) for x in t.tunings]
    routes = [
        Route(
            dst=t.prefixes[dst[i]],
            via=keys[via[i]],
            backup=None if backup is None or backup[i] == _NONE_U16 else keys[backup[i]],
            table=_TABLES[table[i]] if table is not None else "fast",
            **({} if tuning is None or tuning[i] == _NONE_U16 else tunings[tuning[i]]),
        )
        for i in range(n)
    ]
    return RouteSet(
        mesh=p.mesh, node=p.node, version=p.version, issued_at=p.issued_at,
        controller=p.controller, term=p.term, routes=routes,
    )  # fmt: skip


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


# Keys and prefixes found valid, remembered: a route set repeats the same few hundred
# (every destination's prefix, every peer's key) in each of its ~500 routes, and the
# controller validates each set it signs, the agent each it receives. ``ipaddress``
# parsing was most of the 10 ms of signing an 84 kB set (issue 15). Only valid strings
# are kept (a refusal is re-checked each time), at most _VALID_MAX of each (cleared
# when full: hostile input can cost a re-parse, never memory).
_VALID_MAX: Final = 65536
_valid_keys: set[str] = set()
_valid_prefixes: set[str] = set()
# Congestion control names found valid (a route's other TCP settings are numbers,
# checked against their ranges).
_valid_congctl: set[str] = set()
# A route's TCP settings (mtu, advmss, initcwnd, initrwnd, window, congctl).
_Tuning = tuple[int | None, int | None, int | None, int | None, int | None, str | None]
_NO_TUNING_T: Final[_Tuning] = (None, None, None, None, None, None)


def _remember(seen: set[Any], value: Any) -> None:
    if len(seen) >= _VALID_MAX:
        seen.clear()
    seen.add(value)


def _key(value: str, field: str) -> None:
    if value in _valid_keys:
        return
    try:
        check_key(value)
    except KeyFormatError:
        raise _bad("bad_key", f"{field} is not a base64 WireGuard key") from None
    _remember(_valid_keys, value)


def _prefix(value: str, field: str) -> None:
    if value in _valid_prefixes:
        return
    try:
        if "/" not in value:
            raise ValueError(value)
        ipaddress.ip_network(value, strict=True)
    except ValueError:
        raise _bad("bad_prefix", f"{field} {value[:60]!r} is not a prefix") from None
    _remember(_valid_prefixes, value)


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
MAX_FULL_INTERVAL_S: Final = 86400.0
MAX_PROBE_S: Final = 3600.0  # a probe interval or dead time (the budget's are <= 25 s)
MIN_PROBE_S: Final = 0.001


def _probe_class(value: str | None, field: str) -> None:
    # msgspec checks the Literal on decode; this catches what Python code built.
    if value not in (None, "in_use", "idle"):
        raise _bad("bad_value", f"{field} is not a probe class")


def _check_peer(p: PeerReport, i: int) -> None:
    f = f"peers[{i}]"
    _key(p.public_key, f + ".public_key")
    if not 1 <= len(p.ifname) <= 15:
        raise _bad("bad_value", f"{f}.ifname must have 1-15 characters")
    _text(p.endpoint, f + ".endpoint", 64)
    for name in ("rtt_ms", "rtt_min_ms", "rtt_median_ms", "rtt_p95_ms", "jitter_ms", "noise_ms"):
        _num(getattr(p, name), f"{f}.{name}", hi=MAX_PEER_DELAY_MS)
    _num(p.loss, f + ".loss", 0.0, 1.0)
    for name in ("samples", "probes_sent", "loss_outcomes", "rx_bytes", "tx_bytes"):
        _int(getattr(p, name), f"{f}.{name}")
    for name in ("handshake_age_s", "bandwidth_age_s"):
        _num(getattr(p, name), f"{f}.{name}", hi=MAX_PEER_AGE_S)
    for name in ("rx_bps", "tx_bps"):
        _num(getattr(p, name), f"{f}.{name}", hi=MAX_PEER_RATE_BPS)
    _num(p.bandwidth_mbit, f + ".bandwidth_mbit", hi=MAX_PEER_BANDWIDTH_MBIT)
    _num(p.bandwidth_confidence, f + ".bandwidth_confidence", 0.0, 1.0)
    _int(p.pmtu, f + ".pmtu", 68, 65535)
    _probe_class(p.probe_class, f + ".probe_class")
    for name in ("probe_interval_s", "probe_dead_after_s"):
        value = getattr(p, name)
        _num(value, f"{f}.{name}", MIN_PROBE_S, MAX_PROBE_S)


def _check_route(r: Route, i: int) -> None:
    f = f"routes[{i}]"
    _prefix(r.dst, f + ".dst")
    if r.table not in _TABLES:
        raise _bad("bad_value", f"{f}.table is not fast or bulk")
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


def _tunings_ok(routes: Sequence[Route]) -> bool:
    """Every route's TCP settings in range, field by field over the few distinct values
    (each field's range does not depend on the others; the bounds of
    :func:`_check_route`)."""
    for lo, vals in (
        (68, {r.mtu for r in routes}),
        (1, {r.advmss for r in routes}),
        (1, {r.initcwnd for r in routes}),
        (1, {r.initrwnd for r in routes}),
    ):
        vals.discard(None)
        if not all(lo <= v <= 65535 for v in vals):  # type: ignore[operator]
            return False
    windows = {r.window for r in routes if r.window is not None}
    if not all(1 <= v <= _MAX_I63 for v in windows):
        return False
    names = {r.congctl for r in routes}
    names.discard(None)
    return names <= _valid_congctl


def _distinct_tunings_ok(tunings: Iterable[_Tuning]) -> bool:
    """:func:`_tunings_ok` over the routes' distinct TCP settings (``tunings``): the same
    values field by field, in the same order."""
    mtu, advmss, initcwnd, initrwnd, window, congctl = list(zip(*tunings, strict=True)) or [()] * 6
    for lo, vals in (
        (68, set(mtu)),
        (1, set(advmss)),
        (1, set(initcwnd)),
        (1, set(initrwnd)),
    ):
        vals.discard(None)
        if not all(lo <= v <= 65535 for v in vals):
            return False
    windows = set(window)
    windows.discard(None)
    if not all(1 <= v <= _MAX_I63 for v in windows):
        return False
    names = set(congctl)
    names.discard(None)
    return names <= _valid_congctl


def _check_routes(routes: Sequence[Route]) -> None:
    """Every route possible, and at most one per destination and table.

    First column by column, against the keys and prefixes already found valid (set
    operations over list comprehensions; a set of a 1000-node mesh repeats the same
    ~1000 of each in its 2000 routes) and over the few distinct TCP settings. Only a
    set that misses there is checked route by route (:func:`_check_each_route`), with
    the same reasons in the same order. Route by route was half of the ~12 ms of CPU the
    controller spent signing a set at 1000 nodes, and agents run this on every set they
    take (issue 15). :func:`encode` checks the same with :func:`_check_columns`.
    """
    dst = [r.dst for r in routes]
    via = [r.via for r in routes]
    backup = [r.backup for r in routes]
    backups = set(backup)
    backups.discard(None)
    fast = [r.dst for r in routes if r.table == "fast"]
    bulk = [r.dst for r in routes if r.table == "bulk"]
    if (
        _valid_prefixes.issuperset(dst)
        and _valid_keys.issuperset(via)
        and _valid_keys.issuperset(backups)
        and not any(map(operator.eq, backup, via))
        and len(fast) + len(bulk) == len(routes)
        and len(set(fast)) == len(fast)
        and len(set(bulk)) == len(bulk)
        and _tunings_ok(routes)
    ):
        return
    _check_each_route(routes)


def _check_columns(routes: Sequence[Route], c: _RouteColumns) -> None:
    """:func:`_check_routes` on the columns :func:`encode` packs with (``c``: those of
    ``routes``): the distinct prefixes, peers and TCP settings are at hand there, and
    the table bytes say which routes are fast or bulk. The same sets pass; any other
    goes route by route, as there."""
    fast: list[str] = []
    bulk: list[str] = []
    if c.table is not None:  # every table fast or bulk: then each destination once a table
        fast = list(compress(c.dst, c.table.translate(_FLIP)))
        bulk = list(compress(c.dst, c.table))
    if (
        c.table is not None
        and _valid_prefixes.issuperset(c.prefixes)
        and _valid_keys.issuperset(c.peers)
        and not any(map(operator.eq, c.backup, c.via))
        and len(set(fast)) == len(fast)
        and len(set(bulk)) == len(bulk)
        and _distinct_tunings_ok(c.tunings)
    ):
        return
    _check_each_route(routes)


def _check_each_route(routes: Sequence[Route]) -> None:
    """Route by route: :func:`_check_route` raises, or remembers what it found valid."""
    seen: set[tuple[str, str]] = set()
    for i, r in enumerate(routes):
        _check_route(r, i)
        if r.congctl is not None:
            _remember(_valid_congctl, r.congctl)
        if (r.dst, r.table) in seen:
            raise _bad("bad_value", f"routes[{i}]: second route to {r.dst} ({r.table})")
        seen.add((r.dst, r.table))


def validate(msg: Message) -> None:
    """Raise BusMessageError unless every value of ``msg`` is possible."""
    _validate(msg)


def _validate(msg: Message, columns: bool = False) -> _RouteColumns | None:
    """:func:`validate`; with ``columns``, a RouteSet's routes are checked on their
    columns, which it returns (:func:`encode` packs with them)."""
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
        if msg.table is not None:
            _check_table(msg.table)
        _num(msg.full_interval_s, "full_interval_s", hi=MAX_FULL_INTERVAL_S)
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
        if columns:
            c = _RouteColumns(msg.routes)
            _check_columns(msg.routes, c)
            return c
        _check_routes(msg.routes)
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
    return None


# -- wire format -----------------------------------------------------------------------


class _Envelope(msgspec.Struct):
    """Just the version, read before the rest so a newer schema reads as bad_version."""

    v: int


_encoder = msgspec.json.Encoder()
_envelope = msgspec.json.Decoder(_Envelope)
_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {}
_mp_encoder = msgspec.msgpack.Encoder()
_mp_envelope = msgspec.msgpack.Decoder(_Envelope)
_mp_decoders: dict[type[Any], msgspec.msgpack.Decoder[Any]] = {}
_packed_route_set = msgspec.msgpack.Decoder(PackedRouteSet)


def is_msgpack(data: bytes | bytearray | memoryview) -> bool:
    """True when ``data`` opens a MessagePack map: no JSON document starts with those bytes,
    so the first byte tells the two encodings apart (anything else is read as JSON)."""
    return len(data) > 0 and (0x80 <= data[0] <= 0x8F or data[0] in (0xDE, 0xDF))


def _schema_or_json(data: bytes | bytearray | memoryview, exc: Exception) -> BusMessageError:
    """msgspec stops at the first wrong type, before it has seen all the JSON: tell a
    well-formed document of the wrong shape (bad_schema) from broken JSON (bad_json)."""
    try:
        if is_msgpack(data):
            msgspec.msgpack.decode(data)
        else:
            msgspec.json.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as broken:
        return _bad("bad_json", str(broken)[:200])
    return _bad("bad_schema", str(exc)[:200])


def encode(msg: Message) -> bytes:
    """Wire bytes of ``msg``; BusMessageError if a decoder would refuse it.

    JSON, except telemetry that carries a peer table: MessagePack (the packed columns
    travel as raw bytes, where JSON would spend a third more on base64). The Signed
    envelope stays JSON (text on the bus, for every reader and tool), with the payload
    in base64 as for every kind.
    """
    cols = _validate(msg, columns=True)
    if isinstance(msg, Telemetry) and msg.table is not None:
        return _mp_encoder.encode(msg)
    if cols is not None:
        assert isinstance(msg, RouteSet)
        # Too large as JSON (about 1,400 destinations with bulk routes): packed. A set
        # whose JSON is longer than a bound already too large is too large itself
        # (_signed_size never falls as the payload grows): packed without making it.
        if _signed_size(_json_size_at_least(cols)) > MAX_PAYLOAD_BYTES:
            return _mp_encoder.encode(_pack_routes(msg, cols))
        data = _encoder.encode(msg)
        if _signed_size(len(data)) > MAX_PAYLOAD_BYTES:
            return _mp_encoder.encode(_pack_routes(msg, cols))
        return data
    return _encoder.encode(msg)


# The fewest bytes of a valid RouteSet's JSON (msgspec writes every RouteSet field;
# a Route's only when it is not its default): every scalar value taken as 0 bytes.
_JSON_SET_MIN: Final = len(
    b'{"v":,"mesh":"","node":"","version":,"issued_at":,"controller":"","term":,"routes":[]}'
)
# ... and of each valid route: dst a prefix (at least 4 characters: "::/0"), via a key
# (44), then a comma between routes; a backup (a key); a table that is not "fast" (so
# "bulk"); each TCP setting that is not None (a number: a digit at least, two for an
# mtu of 68 or more; congctl a name of 1-15 characters). A JSON string is at least its
# characters and 2 quotes (tests/unit/test_route_set_signed_bytes.py: never above the
# JSON, and exact for the shortest valid routes).
_JSON_ROUTE_MIN: Final = len(b'{"dst":"::/0","via":""},') + 44
_JSON_BACKUP_MIN: Final = len(b',"backup":""') + 44
_JSON_BULK_MIN: Final = len(b',"table":"bulk"')
_JSON_TUNING_MIN: Final = (
    len(b',"mtu":68'),
    len(b',"advmss":0'),
    len(b',"initcwnd":0'),
    len(b',"initrwnd":0'),
    len(b',"window":0'),
    len(b',"congctl":"x"'),
)


def _json_size_at_least(c: _RouteColumns) -> int:
    """A lower bound of the JSON length of a valid RouteSet whose routes' columns are
    ``c``, from counts only; the TCP settings are counted (a pass per distinct one) only
    when the rest does not already put it over the limit."""
    n = len(c.dst)
    bulk = 0 if c.table is None else c.table.count(1)  # None: tables taken as all fast
    size = (
        _JSON_SET_MIN
        + n * _JSON_ROUTE_MIN
        - (1 if n else 0)  # no comma after the last route
        + (n - c.backup.count(None)) * _JSON_BACKUP_MIN
        + bulk * _JSON_BULK_MIN
    )
    for t, first in c.tunings.items():
        if _signed_size(size) > MAX_PAYLOAD_BYTES:
            break
        weight = sum(w for w, v in zip(_JSON_TUNING_MIN, t, strict=True) if v is not None)
        if weight:
            size += weight * c.tuning.count(first)
    return size


def _signed_size(payload: int) -> int:
    """About how large a Signed envelope around ``payload`` bytes is (base64, fields)."""
    return 4 * ((payload + 2) // 3) + 512


def decode(data: bytes, kind: type[M], *, max_bytes: int = MAX_PAYLOAD_BYTES) -> M:
    """Decode and validate one message of type ``kind``; BusMessageError otherwise.

    Either encoding is read (see :func:`is_msgpack`); a malformed document of either is
    ``bad_json``, a well-formed one of the wrong shape ``bad_schema``.
    """
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
    packed = is_msgpack(data)
    try:
        env = (_mp_envelope if packed else _envelope).decode(data)
    except msgspec.ValidationError as exc:
        raise _schema_or_json(data, exc) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        # msgspec's MessagePack reader raises UnicodeDecodeError for a broken string.
        raise _bad("bad_json", str(exc)[:200]) from None
    if env.v == PACKED_ROUTES_VERSION and kind is RouteSet and packed:
        try:
            p = _packed_route_set.decode(data)
        except msgspec.ValidationError as exc:
            raise _schema_or_json(data, exc) from None
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise _bad("bad_json", str(exc)[:200]) from None
        rs: M = unpack_routes(p)  # type: ignore[assignment]
        validate(rs)
        return rs
    if env.v != SCHEMA_VERSION:
        raise _bad("bad_version", f"v={env.v}, this side speaks {SCHEMA_VERSION}")
    decoder: msgspec.json.Decoder[Any] | msgspec.msgpack.Decoder[Any]
    if packed:
        decoder = _mp_decoders.get(kind) or _mp_decoders.setdefault(
            kind, msgspec.msgpack.Decoder(kind)
        )
    else:
        decoder = _decoders.get(kind) or _decoders.setdefault(kind, msgspec.json.Decoder(kind))
    try:
        msg: M = decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise _schema_or_json(data, exc) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        # msgspec's MessagePack reader raises UnicodeDecodeError for a broken string.
        raise _bad("bad_json", str(exc)[:200]) from None
    validate(msg)
    return msg


def decode_telemetry(data: bytes, *, max_bytes: int = MAX_PAYLOAD_BYTES) -> Telemetry:
    """Telemetry with its table expanded into ``peers`` (for tools that read rows; the
    controller decodes with :func:`decode` and ingests the table's columns as they are)."""
    t = decode(data, Telemetry, max_bytes=max_bytes)
    if t.table is None:
        return t
    return msgspec.structs.replace(t, peers=t.reports(), table=None)


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
