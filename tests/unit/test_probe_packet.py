"""The probe wire format, its underlay cost, and the prober's config and target checks."""

from __future__ import annotations

import socket
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshopt.errors import InputError, MeshoptError
from meshopt.probe.packet import (
    HEADER,
    HEADER_BYTES,
    MAGIC,
    MAX_PADDING,
    MAX_PROBE_BYTES,
    VERSION,
    Kind,
    ProbeFormatError,
    ProbePacket,
    decode,
    encode,
    parse,
    probe_bytes_per_s,
    reply_bytes,
    reply_to,
    request_bytes,
    wire_bytes,
)
from meshopt.probe.prober import ProbeConfig, Target

NONCE = bytes(range(1, 9))
REQUEST = ProbePacket(Kind.REQUEST, NONCE, 4_000_000_000, 1_700_000_000_123_456_789, padding=7)


def raw(kind: int = 1, length: int | None = None, magic: bytes = MAGIC, version: int = VERSION,
        padding: int = 0) -> bytes:  # fmt: skip
    size = HEADER_BYTES + padding if length is None else length
    return HEADER.pack(magic, version, kind, size, NONCE, 1, 2, 0) + bytes(padding)


def _same_probe(a: bytes, b: bytes) -> bool:
    """What decodes re-encodes to the same header and size (padding bytes are ignored)."""
    return a[:HEADER_BYTES] == b[:HEADER_BYTES] and len(a) == len(b)


def test_request_and_reply_round_trip() -> None:
    data = encode(REQUEST)
    assert len(data) == HEADER_BYTES + 7 == 37
    assert decode(data) == REQUEST
    reply = reply_to(REQUEST, turnaround_ns=12_345)
    back = decode(encode(reply))
    assert back == ProbePacket(Kind.REPLY, NONCE, REQUEST.seq, REQUEST.send_ns, 12_345, 0)
    # a reply is header only, never larger than its request
    assert len(encode(reply)) == HEADER_BYTES <= len(data)
    assert reply_to(REQUEST, -5).turnaround_ns == 0
    assert reply_to(REQUEST, 2**40).turnaround_ns == 2**32 - 1


def test_largest_request_round_trips() -> None:
    big = ProbePacket(Kind.REQUEST, NONCE, 0, 0, padding=MAX_PADDING)
    assert len(encode(big)) == MAX_PROBE_BYTES
    assert decode(encode(big)) == big


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "short"),
        (raw()[:-1], "short"),
        (raw(padding=MAX_PADDING + 1), "oversized"),
        (raw(magic=b"XX"), "bad_magic"),
        (raw(version=2), "bad_version"),
        (raw(version=0), "bad_version"),
        (raw(kind=0), "unknown_kind"),
        (raw(kind=3), "unknown_kind"),
        (raw(length=HEADER_BYTES + 1), "bad_length"),
        (raw(padding=4, length=HEADER_BYTES), "bad_length"),
        (raw(kind=2, padding=4), "bad_length"),  # a reply carries no padding
    ],
)
def test_garbage_is_rejected_with_its_reason(data: bytes, reason: str) -> None:
    with pytest.raises(ProbeFormatError) as info:
        decode(data)
    assert info.value.reason == reason
    assert isinstance(info.value, MeshoptError)
    assert reason in str(info.value) and "\n" not in str(info.value)


@given(st.binary(max_size=MAX_PROBE_BYTES + 64))
def test_decode_of_any_bytes_raises_only_probe_format_error(data: bytes) -> None:
    try:
        pkt = decode(data)
    except ProbeFormatError:
        return
    assert _same_probe(encode(pkt), data)


@given(
    st.tuples(
        st.sampled_from([MAGIC, b"MP", b"\x00\x00"]),
        st.integers(0, 3),
        st.integers(0, 4),
        st.integers(0, 2000),
        st.binary(min_size=8, max_size=8),
        st.integers(0, 2**32 - 1),
        st.integers(0, 2**64 - 1),
        st.integers(0, 2**32 - 1),
    ),
    st.binary(max_size=64),
)
def test_decode_of_header_like_bytes_raises_only_probe_format_error(
    fields: tuple[bytes, int, int, int, bytes, int, int, int], tail: bytes
) -> None:
    data = HEADER.pack(*fields) + tail
    try:
        pkt = decode(data)
    except ProbeFormatError:
        return
    assert _same_probe(encode(pkt), data)


@given(st.integers(0, HEADER_BYTES + 6), st.integers(0, 255), st.integers(0, 3))
def test_decode_of_mutated_probes_raises_only_probe_format_error(
    pos: int, value: int, kind: int
) -> None:
    packets = [encode(REQUEST), encode(reply_to(REQUEST, 1))]
    data = bytearray(packets[kind % 2])
    if pos < len(data):
        data[pos] = value
    try:
        pkt = decode(bytes(data))
    except ProbeFormatError:
        return
    assert _same_probe(encode(pkt), bytes(data))


@pytest.mark.parametrize(
    "packet",
    [
        ProbePacket(Kind.REQUEST, b"short", 0, 0),
        ProbePacket(Kind.REQUEST, NONCE, -1, 0),
        ProbePacket(Kind.REQUEST, NONCE, 2**32, 0),
        ProbePacket(Kind.REQUEST, NONCE, 0, 2**64),
        ProbePacket(Kind.REQUEST, NONCE, 0, 0, padding=MAX_PADDING + 1),
        ProbePacket(Kind.REPLY, NONCE, 0, 0, padding=1),
    ],
)
def test_encode_refuses_what_the_format_cannot_carry(packet: ProbePacket) -> None:
    with pytest.raises(ValueError):
        encode(packet)


def test_layout_is_network_byte_order() -> None:
    data = encode(ProbePacket(Kind.REPLY, NONCE, 0x01020304, 0x05, turnaround_ns=0x0A0B0C0D))
    assert data[:6] == b"MO\x01\x02\x00\x1e"
    assert data[6:14] == NONCE
    assert data[14:18] == b"\x01\x02\x03\x04"
    assert struct.unpack("!Q", data[18:26]) == (5,)
    assert data[26:30] == b"\x0a\x0b\x0c\x0d"


# --- what a probe costs on the underlay ------------------------------------------------


def test_wire_bytes_follow_wireguard_padding_and_headers() -> None:
    # IPv6 inner: 40 + 8 + 30 = 78 -> 80, + 60 (outer IPv4, UDP, WireGuard) = 140
    assert wire_bytes(HEADER_BYTES) == 140
    assert wire_bytes(HEADER_BYTES, outer_ipv6=True) == 160
    assert wire_bytes(HEADER_BYTES, inner_ipv6=False) == 64 + 60  # 20 + 8 + 30 = 58 -> 64
    assert wire_bytes(32) == 140 and wire_bytes(33) == 156  # the next 16-byte step


def test_default_probing_fits_one_kilobyte_per_second_per_peer() -> None:
    cfg = ProbeConfig()
    assert cfg.bytes_per_s() == pytest.approx(280 / 0.33)
    for inner6 in (True, False):
        for outer6 in (True, False):
            assert cfg.bytes_per_s(inner_ipv6=inner6, outer_ipv6=outer6) <= 1000
    assert probe_bytes_per_s(0.25) == 1120  # why the default is not 0.25 s
    # and a dead peer is declared within 1 s of its last reply
    assert cfg.dead_after_s < 1.0


# --- config and targets ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"interval_s": 0}, "interval_s"),
        ({"interval_s": float("nan")}, "interval_s"),
        ({"timeout_s": -1}, "timeout_s"),
        ({"dead_after_s": 0.3}, "must exceed interval_s"),
        ({"window": 0}, "window"),
        ({"port": 0}, "port"),
        ({"port": 70000}, "port"),
        ({"padding": -1}, "padding"),
        ({"padding": MAX_PADDING + 1}, "padding"),
    ],
)
def test_bad_config_is_one_clear_input_error(kwargs: dict[str, float], needle: str) -> None:
    with pytest.raises(InputError, match=needle) as info:
        ProbeConfig(**kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


def test_targets_map_to_dual_stack_socket_addresses() -> None:
    assert Target("a", "10.0.0.2").sockaddr(9) == ("::ffff:10.0.0.2", 9, 0, 0)
    assert Target("b", "fd00::2").sockaddr(9) == ("fd00::2", 9, 0, 0)
    lo = socket.if_nametoindex("lo")
    assert Target("c", "fe80::2", scope="lo").sockaddr(9) == ("fe80::2", 9, 0, lo)
    assert Target("d", "fe80::2", scope="7").sockaddr(9)[3] == 7


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("a", "not-an-ip"), "not an IP address"),
        (("a", "fe80::1"), "needs a scope"),
        (("a", "10.0.0.1", "lo"), "IPv6 only"),
        (("", "10.0.0.1"), "empty name"),
    ],
)
def test_bad_targets_are_input_errors(args: tuple[str, ...], needle: str) -> None:
    with pytest.raises(InputError, match=needle):
        Target(*args)


def test_unknown_scope_interface_is_an_input_error() -> None:
    with pytest.raises(InputError, match="no interface 'nosuchif0'"):
        Target("a", "fe80::1", scope="nosuchif0").sockaddr(1)


def test_stamp_writes_the_send_time_into_an_encoded_request() -> None:
    from meshopt.probe.packet import Kind, ProbePacket, decode, encode, stamp

    buf = bytearray(encode(ProbePacket(Kind.REQUEST, b"12345678", 7, 0, padding=3)))
    stamp(buf, 1_700_000_000_123_456_789)
    got = decode(bytes(buf))
    assert (got.seq, got.send_ns, got.padding) == (7, 1_700_000_000_123_456_789, 3)


@given(
    nonce=st.binary(min_size=8, max_size=8),
    seq=st.integers(0, 2**32 - 1),
    send_ns=st.integers(0, 2**64 - 1),
    padding=st.integers(0, MAX_PADDING),
    turnaround=st.integers(-(2**40), 2**40),
)
def test_the_per_probe_fast_paths_give_the_same_bytes_and_fields(
    nonce: bytes, seq: int, send_ns: int, padding: int, turnaround: int
) -> None:
    packet = ProbePacket(Kind.REQUEST, nonce, seq, send_ns, padding=padding)
    data = encode(packet)
    fields = parse(data)
    assert fields == (1, nonce, seq, send_ns, 0, padding)
    assert decode(data) == packet
    assert reply_bytes(fields, turnaround) == encode(reply_to(packet, turnaround))
    sent = request_bytes(nonce, seq, padding)
    assert isinstance(sent, bytearray)
    assert sent == bytearray(encode(ProbePacket(Kind.REQUEST, nonce, seq, 0, padding=padding)))


@given(data=st.binary(max_size=80))
def test_parse_refuses_what_decode_refuses_for_the_same_reason(data: bytes) -> None:
    try:
        want: object = decode(data)
    except ProbeFormatError as exc:
        want = exc.reason
    try:
        kind, nonce, seq, send_ns, turnaround, padding = parse(data)
        got: object = ProbePacket(Kind(kind), nonce, seq, send_ns, turnaround, padding)
    except ProbeFormatError as exc:
        got = exc.reason
    assert got == want


def test_request_bytes_refuses_what_encode_refuses() -> None:
    for args in ((b"short", 1, 0), (NONCE, 2**32, 0), (NONCE, 1, MAX_PADDING + 1)):
        with pytest.raises(ValueError):
            request_bytes(*args)
