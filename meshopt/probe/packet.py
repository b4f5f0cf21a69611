"""The probe's wire format: one small fixed header, network byte order.

::

    offset size field
         0    2 magic          b"MO"
         2    1 version        1
         3    1 kind           1 = REQUEST, 2 = REPLY
         4    2 length         the whole datagram, header and padding
         6    8 nonce          random per prober instance; a reply must echo it
        14    4 seq            per prober, echoed
        18    8 send_ns        sender's CLOCK_REALTIME just before sendto, echoed
        26    4 turnaround_ns  REPLY: responder's time from its kernel rx stamp to its
                               sendto (0 in a REQUEST)
        30      padding        REQUEST only (sent as zeros, content ignored); a REPLY
                               is exactly 30 bytes

Why this size: WireGuard pads its plaintext to a multiple of 16 bytes, so every UDP
payload up to 32 bytes costs the same on the underlay (an IPv6 inner packet 40 + 8 + 30
= 78 -> 80 bytes; IPv4 20 + 8 + 30 = 58 -> 64). The ``turnaround_ns`` field is therefore
free, and it lets the prober take the responder's user-space scheduling delay out of
the RTT (both of its ends are read from the responder's own clock, so clock offsets
between the nodes cancel).

Replies never carry padding: a reply is never larger than the request that caused it
(no amplification), and a padded request's echo would double its cost for nothing.

:func:`decode` rejects everything else with :class:`ProbeFormatError` and a short
``reason`` key that daemons count (``short``, ``oversized``, ``bad_magic``,
``bad_version``, ``unknown_kind``, ``bad_length``).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from meshopt.errors import MeshoptError

PROBE_PORT = 51899
MAGIC = b"MO"
VERSION = 1
NONCE_BYTES = 8
HEADER = struct.Struct("!2sBBH8sIQI")
HEADER_BYTES = HEADER.size  # 30
SEND_NS = struct.Struct("!Q")
SEND_NS_OFFSET = 18  # magic 2, version 1, kind 1, size 2, nonce 8, seq 4


def stamp(datagram: bytearray, send_ns: int) -> None:
    """Write the send time into an encoded request, as late as possible before sending."""
    SEND_NS.pack_into(datagram, SEND_NS_OFFSET, send_ns)


# The largest UDP payload of an IPv6 packet in WireGuard's default 1420-byte MTU:
# a probe never needs IP fragmentation through the tunnel.
MAX_PROBE_BYTES = 1420 - 40 - 8
MAX_PADDING = MAX_PROBE_BYTES - HEADER_BYTES
_U32 = 2**32
_U64 = 2**64

# Underlay cost of one datagram through WireGuard (see wire_bytes).
WG_OUTER_IPV4 = 20 + 8 + 32  # outer IPv4 + UDP + WireGuard header (16) and tag (16)
WG_OUTER_IPV6 = 40 + 8 + 32
WG_PAD = 16


class Kind(enum.IntEnum):
    REQUEST = 1
    REPLY = 2


class ProbeFormatError(MeshoptError):
    """A datagram that is not a probe of this version; ``reason`` is a short counter key."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        super().__init__(f"bad probe packet ({reason}): {detail}")


@dataclass(frozen=True, slots=True)
class ProbePacket:
    kind: Kind
    nonce: bytes
    seq: int
    send_ns: int
    turnaround_ns: int = 0
    padding: int = 0  # bytes of zeros after the header (REQUEST only)

    @property
    def size(self) -> int:
        return HEADER_BYTES + self.padding


def encode(packet: ProbePacket) -> bytes:
    """The datagram for ``packet``; ValueError for values the format cannot carry."""
    if len(packet.nonce) != NONCE_BYTES:
        raise ValueError(f"nonce must be {NONCE_BYTES} bytes, got {len(packet.nonce)}")
    if not 0 <= packet.seq < _U32:
        raise ValueError(f"seq out of range: {packet.seq}")
    if not 0 <= packet.send_ns < _U64:
        raise ValueError(f"send_ns out of range: {packet.send_ns}")
    if not 0 <= packet.turnaround_ns < _U32:
        raise ValueError(f"turnaround_ns out of range: {packet.turnaround_ns}")
    if not 0 <= packet.padding <= MAX_PADDING:
        raise ValueError(f"padding must be 0..{MAX_PADDING}, got {packet.padding}")
    if packet.kind is Kind.REPLY and packet.padding:
        raise ValueError("a reply carries no padding")
    head = HEADER.pack(
        MAGIC,
        VERSION,
        int(packet.kind),
        packet.size,
        packet.nonce,
        packet.seq,
        packet.send_ns,
        packet.turnaround_ns,
    )
    return head + bytes(packet.padding) if packet.padding else head


# (kind, nonce, seq, send_ns, turnaround_ns, padding): a decoded datagram as a tuple.
Fields = tuple[int, bytes, int, int, int, int]
KINDS = {int(k): k for k in Kind}


def request_bytes(nonce: bytes, seq: int, padding: int = 0) -> bytearray:
    """A REQUEST ready to :func:`stamp` and send: ``encode`` of the same packet with
    ``send_ns`` 0, without building a :class:`ProbePacket` (the prober's per-probe path)."""
    if len(nonce) != NONCE_BYTES or not 0 <= seq < _U32 or not 0 <= padding <= MAX_PADDING:
        return bytearray(encode(ProbePacket(Kind.REQUEST, nonce, seq, 0, padding=padding)))
    head = HEADER.pack(MAGIC, VERSION, 1, HEADER_BYTES + padding, nonce, seq, 0, 0)
    return bytearray(head + bytes(padding) if padding else head)


def reply_bytes(request: Fields, turnaround_ns: int) -> bytes:
    """``encode(reply_to(request, turnaround_ns))`` for a request :func:`parse` accepted,
    without the objects (the responder's per-probe path)."""
    _, nonce, seq, send_ns, _, _ = request
    turnaround = min(max(turnaround_ns, 0), _U32 - 1)
    return HEADER.pack(MAGIC, VERSION, 2, HEADER_BYTES, nonce, seq, send_ns, turnaround)


def decode(data: bytes) -> ProbePacket:
    """Parse one datagram; :class:`ProbeFormatError` (and nothing else) for anything bad."""
    kind, nonce, seq, send_ns, turnaround, padding = parse(data)
    return ProbePacket(
        kind=KINDS[kind],
        nonce=nonce,
        seq=seq,
        send_ns=send_ns,
        turnaround_ns=turnaround,
        padding=padding,
    )


def parse(data: bytes) -> Fields:
    """:func:`decode` as a plain tuple (the per-probe paths): the same checks and errors;
    ``kind`` is 1 (REQUEST) or 2 (REPLY)."""
    n = len(data)
    if n < HEADER_BYTES:
        raise ProbeFormatError("short", f"{n} bytes, a probe has at least {HEADER_BYTES}")
    if n > MAX_PROBE_BYTES:
        raise ProbeFormatError("oversized", f"{n} bytes, at most {MAX_PROBE_BYTES}")
    magic, version, kind, length, nonce, seq, send_ns, turnaround = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ProbeFormatError("bad_magic", f"magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ProbeFormatError("bad_version", f"version {version}, this is {VERSION}")
    if kind not in (1, 2):
        raise ProbeFormatError("unknown_kind", f"kind {kind}")
    if length != n:
        raise ProbeFormatError("bad_length", f"header says {length} bytes, datagram has {n}")
    if kind == 2 and n != HEADER_BYTES:
        raise ProbeFormatError("bad_length", f"a reply is {HEADER_BYTES} bytes, got {n}")
    return kind, nonce, seq, send_ns, turnaround, n - HEADER_BYTES


def reply_to(request: ProbePacket, turnaround_ns: int) -> ProbePacket:
    """The REPLY a responder sends for ``request`` (clamped turnaround, no padding)."""
    return ProbePacket(
        kind=Kind.REPLY,
        nonce=request.nonce,
        seq=request.seq,
        send_ns=request.send_ns,
        turnaround_ns=min(max(turnaround_ns, 0), _U32 - 1),
    )


def wire_bytes(payload: int, *, inner_ipv6: bool = True, outer_ipv6: bool = False) -> int:
    """Underlay bytes of one UDP datagram of ``payload`` bytes sent through WireGuard.

    The inner IP packet (header + UDP 8 + payload) is padded to a multiple of 16 and
    WireGuard adds its 32 bytes plus the outer IP and UDP headers (60 over IPv4, 80 over
    IPv6). Link-layer framing is not counted.
    """
    inner = (40 if inner_ipv6 else 20) + 8 + payload
    padded = -(-inner // WG_PAD) * WG_PAD
    return padded + (WG_OUTER_IPV6 if outer_ipv6 else WG_OUTER_IPV4)


def probe_bytes_per_s(
    interval_s: float, padding: int = 0, *, inner_ipv6: bool = True, outer_ipv6: bool = False
) -> float:
    """Underlay bytes per second one peer's probing costs: request and reply."""
    request = wire_bytes(HEADER_BYTES + padding, inner_ipv6=inner_ipv6, outer_ipv6=outer_ipv6)
    reply = wire_bytes(HEADER_BYTES, inner_ipv6=inner_ipv6, outer_ipv6=outer_ipv6)
    return (request + reply) / interval_s
