"""Path capacity from packet trains: a few short bursts instead of a saturating test.

A sender puts a train of equal-sized UDP packets on the wire back to back; the narrowest
link on the path spaces them out to its serialisation time, and the receiver's kernel
receive timestamps (``SO_TIMESTAMPNS``) measure that dispersion. Capacity of one train is
``(packets received - 1) * packet_bytes / (last_rx - first_rx)``; several trains are
combined with the median. An estimate costs a few tens of kilobytes, where iperf3 sends
at full rate for 10 s.

Rates are at the **IP level of the probe packets**: ``packet_bytes`` is the whole IP
packet (IPv4 20 or IPv6 40 bytes of header, UDP 8, then the payload). A tunnel adds its
own bytes per packet on the underlay; :meth:`BandwidthEstimate.underlay_mbit` and
:func:`probe_level_mbit` convert (WireGuard over IPv4: inner padded to 16, plus 60).

Wire format (network byte order), every packet starts with ``MOTR``, a version and a kind:

- train packet: ``magic version kind=1 train_id:u32 nonce:8s index:u16 count:u16`` (22
  bytes) then zero padding up to the packet size, which is at least
  :func:`report_bytes` ``(count) = 34 + 6 * count`` (shorter ones are refused,
  ``drop_short``);
- report: ``magic version kind=2 train_id:u32 nonce:8s received:u16 count:u16 bytes:u32
  first_rx_ns:u64`` (34 bytes) then ``received`` entries ``index:u16 offset_ns:u32``
  (receive time after the first packet), in arrival order.

No amplification: a report has at most ``count`` entries, so it is never larger than
any one packet of its train (amplification <= 1 per datagram, and <= 1/received over a
train). The smallest train packet is 40 bytes (a train of one, answered by a 40-byte
report); a train of ``n`` needs a UDP payload of ``34 + 6n``, so a packet size caps the
train length (:func:`max_train_packets`; at the default 1,200-byte IPv6 packets, 186).
The default estimate's wire cost is unchanged by this rule below about 178 Mbit/s (its
1,200-byte packets always dwarfed their reports); above it, trains stop at 186 packets
instead of 200, a little cheaper. The header stays version 1: an older sender still
interoperates as long as its packets are long enough for its trains.

The responder (:class:`TrainResponder`) listens on chosen addresses only (the agent's
probe addresses), answers current peers only and grants each source a budget of new
trains (:data:`DEFAULT_TRAIN_LIMIT`), like the echo responder (see
:mod:`meshopt.probe.responder`: ``drop_unknown_source``, ``drop_rate_limited``). It keeps a
bounded number of trains in flight, each bounded in length; it answers after a train's
last packet, or when a train has been idle for ``REPORT_IDLE_S`` (its tail was lost).
Garbage, oversized and short packets, packets of a train whose nonce does not match and
late packets of an answered train are dropped, counted, and logged once per reason.
Every packet read is counted in ``packets`` and lands in ``accepted`` or one ``drop_*``.

Command line (for lab nodes)::

    python -m meshopt.probe.train --serve [--host ADDR]... [--interface GLOB]... [--port 51898]
    python -m meshopt.probe.train --estimate ADDRESS [--scope IF] [--json]

``--serve`` chooses its addresses, sources and budget like ``python -m
meshopt.probe.responder`` (default: the addresses of ``wg*``, any source, no budget).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import ipaddress
import itertools
import json
import logging
import math
import os
import socket
import statistics
import struct
import sys
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from meshopt.errors import MeshoptError
from meshopt.probe.responder import (
    LOOPBACK,
    AllowedSources,
    Listeners,
    RateLimit,
    SourceAddress,
    SourceBuckets,
    add_listen_arguments,
    allowed_arg,
    any_source,
    hosts_arg,
    limit_arg,
    listen_hosts,
    source_of,
)
from meshopt.probe.timestamps import Address, open_udp_socket, recv_timestamped

log = logging.getLogger(__name__)

TRAIN_PORT = 51898
MAGIC = b"MOTR"
VERSION = 1
KIND_TRAIN = 1
KIND_REPORT = 2

_HEAD = struct.Struct("!4sBBI8s")  # magic, version, kind, train id, nonce
_TRAIN = struct.Struct("!4sBBI8sHH")  # + index, count
_REPORT = struct.Struct("!4sBBI8sHHIQ")  # + received, count, bytes, first rx ns
_ENTRY = struct.Struct("!HI")  # index, receive time after the first packet (ns)

IPV4_UDP_HEADERS = 28
IPV6_UDP_HEADERS = 48
MAX_TRAIN_PACKETS = 200  # its report (1,234 bytes) fits a 1280-byte IPv6 MTU
MAX_PACKET_BYTES = 9000  # UDP payload; a bigger datagram is refused as oversized
MAX_TRAINS_IN_FLIGHT = 32
REPORT_IDLE_S = 0.15  # a train silent this long is answered as it stands
FINISHED_MEMORY = 256  # answered trains remembered, so their late packets are not new trains

# WireGuard on the underlay: outer IPv4 20 + UDP 8 + header 16 + tag 16; IPv6 outer: 80.
WG_IPV4_OVERHEAD = 60
WG_IPV6_OVERHEAD = 80
WG_PADDING = 16

# Defaults chosen by measurement through wireguard-go in the lab (emulated underlay at
# 10-100 Mbit/s). The first train has 48 packets of 1,200 bytes: 60 KB on the underlay,
# under a 64 KB queue. Later trains are sized from the estimate so far to last about
# TARGET_DISPERSION_S: through wireguard-go a train needs ~5 ms of dispersion before its
# slope is within a few % (16 packets at 100 Mbit/s scattered by +-50 %), while at
# 10 Mbit/s 24 packets (24 ms) are plenty. A train that loses its tail (a queue
# overflowed) halves the next one.
DEFAULT_PACKET_BYTES = 1200
FIRST_TRAIN_PACKETS = 48
MIN_TRAIN_PACKETS = 24
TARGET_DISPERSION_S = 0.010
DEFAULT_TRAINS = 5
DEFAULT_GAP_S = 0.01

# New trains per source: an estimate sends DEFAULT_TRAINS back to back, every
# bandwidth.interval_s (300 s) or every 5 s while a peer is unmeasured; two estimates'
# worth of burst and one train a second is ample for that and bounds a flood.
DEFAULT_TRAIN_LIMIT = RateLimit(rate=1.0, burst=2 * DEFAULT_TRAINS)


class TrainError(MeshoptError):
    """A train packet or report that cannot be decoded (garbage, truncated, wrong kind)."""


class TrainTooShortError(TrainError):
    """A train packet smaller than its train's report could be (it would amplify)."""


class TrainUnansweredError(MeshoptError):
    """The peer answered none of the trains: no responder, or the path is down."""


def report_bytes(count: int) -> int:
    """The largest report of a train of ``count``: the smallest packet such a train may
    use (a reply is never larger than a request)."""
    return _REPORT.size + count * _ENTRY.size


def max_train_packets(payload: int) -> int:
    """The longest train whose packets may carry ``payload`` bytes (0: none may)."""
    return max(0, min(MAX_TRAIN_PACKETS, (payload - _REPORT.size) // _ENTRY.size))


# --- wire format ------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainPacket:
    train_id: int
    nonce: bytes
    index: int
    count: int


@dataclass(frozen=True)
class TrainReport:
    """What the responder saw of one train: arrivals as (index, ns after the first)."""

    train_id: int
    nonce: bytes
    count: int
    bytes: int  # UDP payload bytes received
    first_rx_ns: int
    arrivals: tuple[tuple[int, int], ...]

    @property
    def received(self) -> int:
        return len(self.arrivals)


def encode_train_packet(p: TrainPacket, size: int) -> bytes:
    """One train packet of ``size`` bytes of UDP payload (at least its report's size)."""
    head = _TRAIN.pack(MAGIC, VERSION, KIND_TRAIN, p.train_id, p.nonce, p.index, p.count)
    if size < max(len(head), report_bytes(p.count)):
        raise TrainError(
            f"packets of a train of {p.count} need at least "
            f"{max(len(head), report_bytes(p.count))} bytes of payload, not {size}"
        )
    return head + bytes(size - len(head))


def _check_head(data: bytes, kind: int, what: str) -> None:
    if len(data) < _HEAD.size:
        raise TrainError(f"{what}: {len(data)} bytes is too short")
    magic, version, got_kind, _, _ = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise TrainError(f"{what}: bad magic {magic!r}")
    if version != VERSION:
        raise TrainError(f"{what}: version {version}, expected {VERSION}")
    if got_kind != kind:
        raise TrainError(f"{what}: kind {got_kind}, expected {kind}")


def decode_train_packet(data: bytes) -> TrainPacket:
    _check_head(data, KIND_TRAIN, "train packet")
    if len(data) < _TRAIN.size:
        raise TrainError(f"train packet: {len(data)} bytes is too short")
    _, _, _, train_id, nonce, index, count = _TRAIN.unpack_from(data)
    if not 0 < count <= MAX_TRAIN_PACKETS:
        raise TrainError(f"train packet: train of {count} packets (limit {MAX_TRAIN_PACKETS})")
    if index >= count:
        raise TrainError(f"train packet: index {index} of a train of {count}")
    if len(data) < report_bytes(count):
        raise TrainTooShortError(
            f"train packet: {len(data)} bytes, a train of {count} needs "
            f"{report_bytes(count)} (its report's size)"
        )
    return TrainPacket(train_id, nonce, index, count)


def encode_report(r: TrainReport) -> bytes:
    head = _REPORT.pack(
        MAGIC,
        VERSION,
        KIND_REPORT,
        r.train_id,
        r.nonce,
        r.received,
        r.count,
        r.bytes,
        r.first_rx_ns,
    )
    return head + b"".join(_ENTRY.pack(i, off) for i, off in r.arrivals)


def decode_report(data: bytes) -> TrainReport:
    _check_head(data, KIND_REPORT, "train report")
    if len(data) < _REPORT.size:
        raise TrainError(f"train report: {len(data)} bytes is too short")
    _, _, _, train_id, nonce, received, count, nbytes, first = _REPORT.unpack_from(data)
    if not 0 < count <= MAX_TRAIN_PACKETS or received > count:
        raise TrainError(f"train report: {received} of {count} packets")
    if len(data) != _REPORT.size + received * _ENTRY.size:
        raise TrainError(f"train report: {len(data)} bytes for {received} entries")
    arrivals = tuple(
        _ENTRY.unpack_from(data, _REPORT.size + k * _ENTRY.size) for k in range(received)
    )
    if any(i >= count for i, _ in arrivals):
        raise TrainError("train report: an index beyond the train")
    if any(b[1] < a[1] for a, b in itertools.pairwise(arrivals)):
        raise TrainError("train report: arrival times go backwards")
    return TrainReport(train_id, nonce, count, nbytes, first, arrivals)


# --- the math ---------------------------------------------------------------------------


def dispersion_mbit(report: TrainReport, packet_bytes: int) -> float | None:
    """Classic dispersion of one train: bytes after the first arrival over first-to-last.

    Fewer than two arrivals or no measurable spread give None. Kept as the reference;
    :func:`train_capacity_mbit` is what the estimate uses.
    """
    if report.received < 2:
        return None
    span_ns = report.arrivals[-1][1] - report.arrivals[0][1]
    if span_ns <= 0:
        return None
    return (report.received - 1) * packet_bytes * 8 * 1000.0 / span_ns


def train_capacity_mbit(report: TrainReport, packet_bytes: int) -> float | None:
    """Capacity seen by one train (Mbit/s at the level of ``packet_bytes``), or None.

    The Theil-Sen slope of arrival time against packet index (the median of the
    slopes between every two arrivals) times the packet size. Through wireguard-go the
    first and last arrivals of a train are often displaced by a wake-up or a batch
    (tens to hundreds of µs); measured in the lab at 100 Mbit/s, first-to-last
    dispersion of 48-packet trains scattered by +-10 % per train and -6 % in the median,
    the slope by +-1 % with a few outlier trains. The slope counts a lost packet's slot
    as used (loss after the bottleneck, the common case) and needs no first packet.
    """
    arr = report.arrivals
    if len(arr) < 2:
        return None
    slopes = [
        (b[1] - a[1]) / (b[0] - a[0])
        for k, a in enumerate(arr)
        for b in arr[k + 1 :]
        if b[0] != a[0]
    ]
    if not slopes:
        return None
    ns_per_packet = statistics.median(slopes)
    if ns_per_packet <= 0:
        return None
    return packet_bytes * 8 * 1000.0 / ns_per_packet


def next_train_length(
    length: int, report: TrainReport, capacity_mbit: float, packet_bytes: int
) -> int:
    """Length of the next train: TARGET_DISPERSION_S at the capacity seen so far,
    bounded by MIN_TRAIN_PACKETS, MAX_TRAIN_PACKETS and twice this one (a first train
    squeezed by a batch must not blow up the next); half this one after a lost tail.
    """
    if report.received and max(i for i, _ in report.arrivals) < report.count - 1:
        return max(2, length // 2)  # the tail did not arrive: a queue overflowed
    if capacity_mbit <= 0:
        return length
    want = math.ceil(TARGET_DISPERSION_S * capacity_mbit * 1e6 / 8 / packet_bytes)
    return max(MIN_TRAIN_PACKETS, min(MAX_TRAIN_PACKETS, 2 * length, want))


def combine(capacities: Sequence[float], loss_fraction: float) -> tuple[float, float]:
    """Median of the trains' capacities and a confidence in 0..1.

    Confidence = spread term x loss term x count term, where the spread term is
    ``1 - 5 * MAD / median`` (1 when the trains agree, 0 when they scatter by 20 %),
    the loss term ``1 - 2 * loss`` (packets lost inside trains blur the dispersion;
    50 % loss gives 0) and the count term ``min(1, trains / 3)`` (one train is a guess).
    """
    if not capacities:
        raise ValueError("no train capacities to combine")
    med = statistics.median(capacities)
    mad = statistics.median(abs(c - med) for c in capacities)
    spread = max(0.0, 1.0 - 5.0 * mad / med) if med > 0 else 0.0
    loss = max(0.0, 1.0 - 2.0 * loss_fraction)
    count = min(1.0, len(capacities) / 3.0)
    return med, round(spread * loss * count, 3)


def tunnel_packet_bytes(
    packet_bytes: int, overhead: int = WG_IPV4_OVERHEAD, pad: int = WG_PADDING
) -> int:
    """Size on the underlay of a ``packet_bytes`` packet carried by a tunnel."""
    return math.ceil(packet_bytes / pad) * pad + overhead


def probe_level_mbit(
    underlay_mbit: float,
    packet_bytes: int,
    overhead: int = WG_IPV4_OVERHEAD,
    pad: int = WG_PADDING,
) -> float:
    """What a train of ``packet_bytes`` packets should measure over an underlay rate."""
    return underlay_mbit * packet_bytes / tunnel_packet_bytes(packet_bytes, overhead, pad)


@dataclass(frozen=True)
class BandwidthEstimate:
    """Path capacity from packet trains.

    ``capacity_mbit`` counts whole IP packets of ``packet_bytes`` (IP and UDP headers
    included); ``bytes_spent`` is every byte this estimate put on the path or got back
    (train packets and reports, IP level).
    """

    capacity_mbit: float
    confidence: float  # 0..1, see combine()
    trains_used: int
    bytes_spent: int
    duration_s: float
    packet_bytes: int
    trains_sent: int = 0
    packets_lost: int = 0
    per_train_mbit: tuple[float, ...] = field(default=())

    def underlay_mbit(self, overhead: int = WG_IPV4_OVERHEAD, pad: int = WG_PADDING) -> float:
        """The rate on the underlay when each probe packet is padded to ``pad`` and gets
        ``overhead`` bytes (WireGuard over IPv4: 16 and 60; over IPv6: 16 and 80)."""
        return (
            self.capacity_mbit
            * tunnel_packet_bytes(self.packet_bytes, overhead, pad)
            / self.packet_bytes
        )

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)


# --- responder --------------------------------------------------------------------------


@dataclass
class _Train:
    nonce: bytes
    count: int
    peer: Address  # where the report goes (the last packet's source)
    sock: socket.socket  # and from which of our addresses (the one the packet came to)
    first_rx_ns: int
    last_seen: float  # monotonic
    bytes: int = 0
    smallest: int = MAX_PACKET_BYTES  # the smallest packet received: the report's cap
    arrivals: list[tuple[int, int]] = field(default_factory=list)
    seen: set[int] = field(default_factory=set)


def _scope_id(scope: str | None) -> int:
    if scope is None or scope == "":
        return 0
    if scope.isdigit():
        return int(scope)
    try:
        return socket.if_nametoindex(scope)
    except OSError as exc:
        raise MeshoptError(f"unknown interface {scope!r} for the address scope") from exc


def _sockaddr(address: str, port: int, scope: str | None) -> tuple[int, tuple[object, ...]]:
    """Socket family and address tuple; ``fe80::1%wg0`` and ``scope=`` both work."""
    host, _, inline_scope = address.partition("%")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError as exc:
        raise MeshoptError(f"not an IP address: {address!r}") from exc
    if ip.version == 4:
        return socket.AF_INET, (host, port)
    return socket.AF_INET6, (host, port, 0, _scope_id(scope or inline_scope or None))


def _open_train_socket(host: str, port: int) -> socket.socket:
    """A bound UDP socket with rx timestamps and room for a whole train in its buffer."""
    sock = open_udp_socket(host, port)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    except OSError:
        sock.close()
        raise
    return sock


class TrainResponder:
    """Receives trains on its bound addresses and answers each with a report.

    ``limit``: new trains per source (None: no limit); ``allowed``: which sources are
    answered (default all; the agent passes its peers, see
    :class:`meshopt.probe.responder.PeerSources`, and may replace :attr:`allowed`).
    """

    def __init__(
        self,
        *,
        limit: RateLimit | None = DEFAULT_TRAIN_LIMIT,
        allowed: AllowedSources = any_source,
    ) -> None:
        self.allowed = allowed
        self.buckets = SourceBuckets(limit) if limit is not None else None
        self._listeners = Listeners("train responder", self._readable, _open_train_socket)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._trains: dict[tuple[SourceAddress, int], _Train] = {}
        self._finished: OrderedDict[tuple[SourceAddress, int, bytes], None] = OrderedDict()
        self._timer: asyncio.TimerHandle | None = None
        self._logged: set[str] = set()
        self.counters: dict[str, int] = {
            "packets": 0,
            "accepted": 0,
            "trains": 0,
            "reports": 0,
            "drop_garbage": 0,
            "drop_short": 0,
            "drop_oversized": 0,
            "drop_unknown_source": 0,
            "drop_rate_limited": 0,
            "drop_nonce": 0,
            "drop_late": 0,
            "drop_busy": 0,
            "drop_duplicate": 0,
            "drop_would_amplify": 0,
            "send_error": 0,
            "recv_error": 0,
            "bind_error": 0,
        }

    @property
    def port(self) -> int:
        try:
            return self._listeners.port
        except RuntimeError as exc:
            raise MeshoptError("train responder is not started") from exc

    @property
    def addresses(self) -> list[str]:
        """The addresses listened on."""
        return self._listeners.addresses

    async def start(self, host: str | Iterable[str] = LOOPBACK, port: int = TRAIN_PORT) -> None:
        """Bind every address in ``host`` on ``port`` (0: a free one) and answer;
        MeshoptError, with nothing left bound, if one cannot be bound. The agent starts
        with no address and calls :meth:`listen_on`."""
        self._loop = asyncio.get_running_loop()
        self._listeners.start(self._loop, port)
        failed = self._listeners.listen_on(hosts_arg(host))
        if failed:
            self.close()
            where, exc = failed[0]
            raise MeshoptError(f"train responder cannot listen on [{where}]:{port}: {exc}")

    def listen_on(self, hosts: Iterable[str]) -> None:
        """Listen on exactly ``hosts`` from now on (the agent: its probe addresses); one
        that cannot be bound is counted (``bind_error``), logged once, tried next call."""
        for host, exc in self._listeners.listen_on(hosts):
            self.counters["bind_error"] += 1
            if f"bind {host}" not in self._logged:
                self._logged.add(f"bind {host}")
                log.warning("train responder: cannot listen on %s: %s", host, exc)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._listeners.close()
        self._loop = None
        self._trains.clear()

    async def __aenter__(self) -> TrainResponder:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def _drop(self, reason: str, detail: str, peer: object) -> None:
        self.counters[f"drop_{reason}"] += 1
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("train responder: dropped a packet from %s (%s): %s", peer, reason, detail)

    def _readable(self, sock: socket.socket) -> None:
        for _ in range(256):  # bounded: let the loop breathe under a flood
            try:
                data, peer, rx = recv_timestamped(sock, MAX_PACKET_BYTES + 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.counters["recv_error"] += 1
                log.debug("train responder: recvmsg failed: %s", exc)
                return
            self._on_packet(sock, data, peer, rx or time.time_ns())

    def _on_packet(self, sock: socket.socket, data: bytes, peer: Address, rx_ns: int) -> None:
        self.counters["packets"] += 1
        if len(data) > MAX_PACKET_BYTES:
            self._drop("oversized", f"{len(data)} bytes", peer)
            return
        source = source_of(peer)
        if source is None or not self.allowed(source):
            self._drop("unknown_source", "not a current peer", peer)
            return
        try:
            p = decode_train_packet(data)
        except TrainTooShortError as exc:
            self._drop("short", str(exc), peer)
            return
        except TrainError as exc:
            self._drop("garbage", str(exc), peer)
            return
        key = (source, p.train_id)
        train = self._trains.get(key)
        now = time.monotonic()
        if train is None:
            if (source, p.train_id, p.nonce) in self._finished:
                self._drop("late", f"train {p.train_id} was already answered", peer)
                return
            if len(self._trains) >= MAX_TRAINS_IN_FLIGHT:
                self._drop("busy", f"{len(self._trains)} trains in flight", peer)
                return
            if self.buckets is not None and not self.buckets.take(source):
                self._drop("rate_limited", "over its budget of new trains", peer)
                return
            train = _Train(p.nonce, p.count, peer, sock, rx_ns, now)
            self._trains[key] = train
            self.counters["trains"] += 1
            self._arm()
        elif train.nonce != p.nonce or train.count != p.count:
            self._drop("nonce", f"train {p.train_id} with another nonce or length", peer)
            return
        if p.index in train.seen:
            self._drop("duplicate", f"index {p.index} of train {p.train_id} twice", peer)
            return
        self.counters["accepted"] += 1
        train.seen.add(p.index)
        train.peer, train.sock = peer, sock
        train.last_seen = now
        train.bytes += len(data)
        train.smallest = min(train.smallest, len(data))
        offset = max(0, rx_ns - train.first_rx_ns)
        train.arrivals.append((p.index, min(offset, 0xFFFFFFFF)))
        if p.index == p.count - 1 or len(train.seen) == p.count:
            self._answer(key)

    def _answer(self, key: tuple[SourceAddress, int]) -> None:
        train = self._trains.pop(key)
        self._finished[(key[0], key[1], train.nonce)] = None
        while len(self._finished) > FINISHED_MEMORY:
            self._finished.popitem(last=False)
        arrivals = sorted(train.arrivals, key=lambda a: a[1])
        report = TrainReport(
            key[1], train.nonce, train.count, train.bytes, train.first_rx_ns, tuple(arrivals)
        )
        data = encode_report(report)
        if len(data) > train.smallest:  # cannot happen (decode refuses short packets)
            self._drop("would_amplify", f"a {len(data)}-byte report", train.peer)
            return
        if train.sock.fileno() < 0:  # the address went away (listen_on) or we closed
            return
        try:
            train.sock.sendto(data, train.peer)
            self.counters["reports"] += 1
        except OSError as exc:
            self.counters["send_error"] += 1
            log.debug("train responder: report to %s failed: %s", train.peer, exc)

    def _arm(self) -> None:
        if self._timer is None and self._loop is not None:
            self._timer = self._loop.call_later(REPORT_IDLE_S, self._expire)

    def _expire(self) -> None:
        """Answer trains whose tail never came (lost), as they stand."""
        self._timer = None
        now = time.monotonic()
        for key, train in list(self._trains.items()):
            if now - train.last_seen >= REPORT_IDLE_S:
                self._answer(key)
        if self._trains:
            self._arm()


# --- sender -----------------------------------------------------------------------------


def _send_train(sock: socket.socket, packets: Sequence[bytes]) -> int:
    """Send back to back from a blocking socket (never a paced or scapy loop)."""
    sent = 0
    sock.setblocking(True)
    try:
        for pkt in packets:
            sock.send(pkt)
            sent += 1
    finally:
        sock.setblocking(False)
    return sent


async def _await_report(
    sock: socket.socket, train_id: int, nonce: bytes, timeout_s: float, counts: dict[str, int]
) -> TrainReport | None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (left := deadline - loop.time()) > 0:
        try:
            data = await asyncio.wait_for(loop.sock_recv(sock, 65535), left)
        except TimeoutError:
            return None
        counts["bytes_in"] += len(data)
        try:
            report = decode_report(data)
        except TrainError:
            counts["garbage"] += 1
            continue
        if report.train_id == train_id and report.nonce == nonce:
            counts["reports"] += 1
            return report
        counts["stale"] += 1
    return None


async def estimate_capacity(
    address: str,
    *,
    scope: str | None = None,
    port: int = TRAIN_PORT,
    packet_bytes: int = DEFAULT_PACKET_BYTES,
    train_packets: int | None = None,
    trains: int = DEFAULT_TRAINS,
    timeout_s: float = 1.0,
    gap_s: float = DEFAULT_GAP_S,
) -> BandwidthEstimate:
    """Capacity of the path to a :class:`TrainResponder` at ``address`` (see module doc).

    ``packet_bytes`` is the IP packet size of each probe (headers included); it caps
    the train length (:func:`max_train_packets`: no packet is smaller than its report).
    ``train_packets`` fixes every train's length; None (default) sizes trains from
    the estimate so far (see TARGET_DISPERSION_S). Raises :class:`TrainUnansweredError` when
    no train gets a report.
    """
    if train_packets is not None and not 2 <= train_packets <= MAX_TRAIN_PACKETS:
        raise MeshoptError(f"train_packets must be 2..{MAX_TRAIN_PACKETS}, not {train_packets}")
    if trains < 1:
        raise MeshoptError(f"trains must be >= 1, not {trains}")
    family, dest = _sockaddr(address, port, scope)
    headers = IPV4_UDP_HEADERS if family == socket.AF_INET else IPV6_UDP_HEADERS
    payload = packet_bytes - headers
    smallest = report_bytes(2)  # a train of two: the shortest that measures anything
    if not smallest <= payload <= MAX_PACKET_BYTES:
        raise MeshoptError(
            f"packet_bytes must be {smallest + headers}..{MAX_PACKET_BYTES + headers}, "
            f"not {packet_bytes}"
        )
    longest = max_train_packets(payload)
    if train_packets is not None and train_packets > longest:
        raise MeshoptError(
            f"train_packets: {packet_bytes}-byte packets carry trains of at most {longest} "
            f"(a report may not exceed a packet), not {train_packets}"
        )
    counts = {"bytes_in": 0, "reports": 0, "garbage": 0, "stale": 0}
    capacities: list[float] = []
    sent_packets = 0
    lost = 0
    length = train_packets or min(FIRST_TRAIN_PACKETS, longest)
    started = time.monotonic()
    where = f"[{address}]:{port}" if family == socket.AF_INET6 else f"{address}:{port}"
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        sock.setblocking(False)
        try:
            sock.connect(dest)  # replies from anywhere else never reach us
        except OSError as exc:
            raise TrainUnansweredError(
                f"no route to the train responder at {where}: {exc}"
            ) from exc
        for n in range(trains):
            if n:
                await asyncio.sleep(gap_s)
            nonce = os.urandom(8)
            train_id = int.from_bytes(os.urandom(4), "big")
            packets = [
                encode_train_packet(TrainPacket(train_id, nonce, i, length), payload)
                for i in range(length)
            ]
            try:
                sent_packets += _send_train(sock, packets)
                report = await _await_report(sock, train_id, nonce, timeout_s, counts)
            except ConnectionRefusedError as exc:
                raise TrainUnansweredError(
                    f"no train responder at {where} (port unreachable)"
                ) from exc
            except OSError as exc:
                raise TrainUnansweredError(f"train to {where} failed: {exc}") from exc
            if report is None:
                lost += length
                continue
            lost += length - report.received
            cap = train_capacity_mbit(report, packet_bytes)
            if cap is not None:
                capacities.append(cap)
            if train_packets is None:
                length = min(
                    longest,
                    next_train_length(
                        length, report, statistics.median(capacities or [0.0]), packet_bytes
                    ),
                )
    duration = time.monotonic() - started
    if not counts["reports"]:
        raise TrainUnansweredError(
            f"the train responder at {where} answered none of {trains} trains"
        )
    if not capacities:
        raise TrainUnansweredError(f"{where}: no train arrived with two packets or more")
    capacity, confidence = combine(capacities, lost / max(1, sent_packets))
    bytes_in = counts["bytes_in"] + counts["reports"] * headers
    return BandwidthEstimate(
        capacity_mbit=round(capacity, 3),
        confidence=confidence,
        trains_used=len(capacities),
        bytes_spent=sent_packets * packet_bytes + bytes_in,
        duration_s=round(duration, 4),
        packet_bytes=packet_bytes,
        trains_sent=trains,
        packets_lost=lost,
        per_train_mbit=tuple(round(c, 3) for c in capacities),
    )


# --- command line -----------------------------------------------------------------------


async def _serve(args: argparse.Namespace) -> None:
    responder = TrainResponder(limit=limit_arg(args), allowed=allowed_arg(args))
    await responder.start(await listen_hosts(args), args.port)
    print(f"READY {responder.port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        responder.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m meshopt.probe.train", description="Packet-train capacity estimate."
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--serve", action="store_true", help="run a train responder")
    mode.add_argument("--estimate", metavar="ADDRESS", help="estimate the path to ADDRESS")
    add_listen_arguments(parser)  # --host, --interface, --allow, --rate, --burst (--serve)
    parser.add_argument("--port", type=int, default=TRAIN_PORT)
    parser.add_argument("--scope", help="interface of a link-local ADDRESS")
    parser.add_argument("--packet-bytes", type=int, default=DEFAULT_PACKET_BYTES)
    parser.add_argument("--train-packets", type=int, help="fixed train length (default: adaptive)")
    parser.add_argument("--trains", type=int, default=DEFAULT_TRAINS)
    parser.add_argument("--timeout", type=float, default=1.0)
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        if args.serve:
            with contextlib.suppress(KeyboardInterrupt):
                asyncio.run(_serve(args))
            return 0
        est = asyncio.run(
            estimate_capacity(
                args.estimate,
                scope=args.scope,
                port=args.port,
                packet_bytes=args.packet_bytes,
                train_packets=args.train_packets,
                trains=args.trains,
                timeout_s=args.timeout,
            )
        )
    except MeshoptError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(est.to_json()))
    else:
        print(
            f"{est.capacity_mbit:.2f} Mbit/s (IP level, {est.packet_bytes}-byte packets), "
            f"confidence {est.confidence:.2f}, {est.trains_used} trains, "
            f"{est.bytes_spent} bytes, {est.duration_s * 1000:.0f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
