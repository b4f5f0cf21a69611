"""Telemetry's compact wire form: the columnar peer table in MessagePack.

What agents publish must decode to the values they measured (within the quantisation),
fit the payload limit at 1000 peers with room, stay covered by the signature byte for
byte, and be refused with a BusMessageError reason, never a traceback, when hostile.
"""

from __future__ import annotations

import math
import random
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshopt.agent.core import AgentCore, RouteState
from meshopt.agent.telemetry import Plan, signed_telemetry
from meshopt.bus.messages import (
    MAX_PAYLOAD_BYTES,
    MAX_PEERS,
    BusMessageError,
    PeerReport,
    Signed,
    Telemetry,
    decode,
    decode_signed,
    decode_telemetry,
    encode,
    is_msgpack,
    peer_table,
)
from meshopt.bus.signing import generate_signing_key, public_key_b64, verify_telemetry
from meshopt.controller.view import MeshView
from meshopt.wireguard.keys import generate_keypair

KEYS = [generate_keypair()[1] for _ in range(4)]
OWN = generate_keypair()[1]


def agent_peer(key: str, i: int = 0, **kw: Any) -> PeerReport:
    """A peer report with every field a real agent fills."""
    base: dict[str, Any] = dict(
        public_key=key,
        ifname="wg0",
        endpoint=f"198.51.100.{i % 250}:51820",
        alive=True,
        rtt_ms=12.345 + i,
        rtt_min_ms=11.0,
        rtt_median_ms=12.2,
        rtt_p95_ms=15.75,
        jitter_ms=0.42,
        noise_ms=0.113,
        loss=0.0123,
        samples=64,
        probes_sent=1200 + i,
        loss_outcomes=250 + i,
        handshake_age_s=33.2,
        rx_bytes=2**40 + i,
        tx_bytes=2**33,
        rx_bps=1234.5,
        tx_bps=0.0,
        bandwidth_mbit=940.5,
        bandwidth_confidence=0.8,
        bandwidth_age_s=12.5,
        pmtu=1420,
        probe_class="idle" if i % 10 else "in_use",
        probe_interval_s=5.75 if i % 10 else 0.33,
        probe_dead_after_s=13.939 if i % 10 else 0.8,
    )
    base.update(kw)
    return PeerReport(**base)


def telemetry(rows: list[PeerReport], **kw: Any) -> Telemetry:
    base: dict[str, Any] = dict(
        mesh="lab",
        node="a",
        public_key=OWN,
        public_keys=[OWN],
        addresses=["10.99.0.1/32"],
        seq=7,
        sent_at=1_700_000_000.0,
        full=True,
        table=peer_table(rows),
        full_interval_s=41.5,
    )
    base.update(kw)
    return Telemetry(**base)


def reason_of(data: bytes) -> str:
    with pytest.raises(BusMessageError) as info:
        decode(data, Telemetry)
    return info.value.reason


def with_table(**columns: Any) -> bytes:
    """A compact telemetry message whose table has ``columns`` replaced (unchecked)."""
    t = telemetry([agent_peer(k, i) for i, k in enumerate(KEYS)])
    assert t.table is not None
    bad = msgspec.structs.replace(t, table=msgspec.structs.replace(t.table, **columns))
    return msgspec.msgpack.encode(bad)


# -- round trip --------------------------------------------------------------------------


def test_rows_come_back_within_the_quantisation() -> None:
    peers = [agent_peer(k, i) for i, k in enumerate(KEYS)]
    data = encode(telemetry(peers))
    assert is_msgpack(data)
    back = decode_telemetry(data)
    assert back.table is None and len(back.peers) == len(peers)
    for got, want in zip(back.peers, peers, strict=True):
        assert got.public_key == want.public_key and got.ifname == "wg0"
        assert got.endpoint == want.endpoint and got.alive is True
        for f in ("rtt_ms", "rtt_min_ms", "rtt_median_ms", "rtt_p95_ms", "jitter_ms", "noise_ms"):
            assert getattr(got, f) == pytest.approx(getattr(want, f), abs=0.005 + 1e-9), f
        assert got.loss == pytest.approx(want.loss, abs=0.00005 + 1e-12)
        assert (got.samples, got.probes_sent) == (want.samples, want.probes_sent)
        assert got.loss_outcomes == want.loss_outcomes
        assert (got.rx_bytes, got.tx_bytes) == (want.rx_bytes, want.tx_bytes)
        assert got.handshake_age_s == pytest.approx(33.2)
        assert got.rx_bps == pytest.approx(1234.5) and got.tx_bps == 0.0
        assert got.bandwidth_mbit == pytest.approx(940.5)
        assert got.bandwidth_confidence == pytest.approx(0.8)
        assert got.bandwidth_age_s == pytest.approx(12.5)
        assert got.pmtu == 1420
        assert got.probe_class == want.probe_class
        assert got.probe_interval_s == want.probe_interval_s  # whole milliseconds
        assert got.probe_dead_after_s == want.probe_dead_after_s


def test_not_measured_stays_not_measured() -> None:
    """None is never read back as zero (an unmeasured RTT is not a 0 ms link)."""
    bare = PeerReport(public_key=KEYS[0], ifname="wg1")
    half = PeerReport(public_key=KEYS[1], ifname="wg2", alive=False, rtt_ms=0.0, loss=0.0)
    back = decode_telemetry(encode(telemetry([bare, half]))).peers
    assert back[0] == bare
    assert back[1] == half
    # A lean table (routing fields only) carries no columns for the rest.
    t = telemetry([PeerReport(public_key=k, ifname="wg0", rtt_ms=5.0) for k in KEYS])
    assert t.table is not None
    assert t.table.endpoints == [] and t.table.rx_bytes == b"" and t.table.pmtu == b""


def test_decode_keeps_the_table_for_the_controller() -> None:
    t = telemetry([agent_peer(k, i) for i, k in enumerate(KEYS)])
    back = decode(encode(t), Telemetry)
    assert back == t
    assert back.table is not None and back.table.key_list() == KEYS
    assert back.reports() == decode_telemetry(encode(t)).peers


def test_json_telemetry_with_peer_objects_still_reads() -> None:
    """Rows in ``peers`` (tools, tests, small messages) stay JSON and still decode."""
    t = Telemetry(
        mesh="lab", node="a", public_key=OWN, seq=1, sent_at=1.0, full=True,
        peers=[agent_peer(KEYS[0])],
    )  # fmt: skip
    data = encode(t)
    assert data.startswith(b"{") and decode_telemetry(data) == t


def test_signature_covers_the_packed_bytes() -> None:
    key, pub = generate_signing_key()
    core = AgentCore("lab", "a", key, [], RouteState(), 1_700_000_000.0)
    peers = [agent_peer(k, i) for i, k in enumerate(KEYS)]
    data = signed_telemetry(
        core,
        1_700_000_000.0,
        public_keys=[OWN],
        addresses=["10.99.0.1/32"],
        plan=Plan(True, peers, 41.5),
        counters={"x": 1},
    )
    assert data.startswith(b"{")  # the envelope stays JSON (text on the bus) ...
    assert is_msgpack(decode_signed(data).payload)  # ... around a MessagePack payload
    t = verify_telemetry(data, [public_key_b64(key)], mesh="lab", node="a")
    assert t.full_interval_s == 41.5 and t.table is not None and len(t.table) == 4
    signed = decode_signed(data)
    for pos in (0, len(signed.payload) // 2, len(signed.payload) - 1):
        flipped = bytearray(signed.payload)
        flipped[pos] ^= 1
        evil = encode(msgspec.structs.replace(signed, payload=bytes(flipped)))
        with pytest.raises(BusMessageError) as info:
            verify_telemetry(evil, [pub], mesh="lab", node="a")
        assert info.value.reason in ("bad_signature", "bad_json", "bad_schema", "bad_value")


def test_a_1000_peer_snapshot_fits_with_room() -> None:
    """Limit 2 of docs/scale.md: 475 kB of JSON at 1000 peers, refused by the controller."""
    rng = random.Random(1)
    keys = [generate_keypair()[1] for _ in range(999)]
    peers = [
        agent_peer(
            k,
            i,
            rtt_ms=rng.uniform(1, 300),
            rx_bytes=rng.getrandbits(40),
            tx_bytes=rng.getrandbits(40),
            rx_bps=rng.uniform(100, 400),
        )
        for i, k in enumerate(keys)
    ]
    key, _ = generate_signing_key()
    core = AgentCore("lab", "a", key, [], RouteState(), 1_700_000_000.0)
    data = signed_telemetry(
        core, 1_700_000_000.0, public_keys=[OWN], addresses=["10.99.0.1/32"],
        plan=Plan(True, peers, 120.0), counters={},
    )  # fmt: skip
    # Every field filled, 40-bit counters: about 124 bytes a peer, a third more for the
    # envelope's base64 (the envelope stays JSON): 167 kB with the probe class (one byte a
    # peer), where JSON objects took 475 kB.
    assert len(data) < MAX_PAYLOAD_BYTES * 2 // 3, len(data)
    assert len(decode_telemetry(decode_signed(data).payload).peers) == 999


# -- hostile tables ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "columns",
    [
        {"keys": b"\x01" * 33},  # not whole keys
        {"rtt": b"\x00" * 3},  # a column of the wrong length
        {"alive": b"\x00" * 5},
        {"rx_bytes": b"\x00" * 8},
        {"alive": bytes([3, 1, 1, 1])},
        {"rtt": np.array([0, 1, 60_000_001, 5], dtype="<u4").tobytes()},  # over 10 minutes
        {"loss": np.array([0, 10_001, 0, 0], dtype="<u2").tobytes()},  # loss over 1
        {"bandwidth_confidence": np.array([0, 0, 0, 20_000], dtype="<u2").tobytes()},
        {"pmtu": np.array([1420, 67, 0, 0], dtype="<u2").tobytes()},
        {"rx_bps": np.array([1, math.nan, 1, 1], dtype="<f4").tobytes()},
        {"tx_bps": np.array([1, -1, 1, 1], dtype="<f4").tobytes()},
        {"bandwidth": np.array([1, math.inf, 1, 1], dtype="<f4").tobytes()},
        {"bandwidth_age": np.array([1, -5, 1, 1], dtype="<f4").tobytes()},
        {"handshake_age": np.array([0, 2**32 - 2, 0, 0], dtype="<u4").tobytes()},
        {"ifname": bytes([0, 1, 0, 0])},  # only one interface name
        {"ifnames": []},
        {"ifnames": ["x" * 16]},
        {"ifnames": ["wg"] * 256},
        {"endpoints": ["a", "b"]},  # not one per peer
        {"endpoints": ["x" * 65] * 4},
    ],
)
def test_impossible_tables_are_bad_value(columns: dict[str, Any]) -> None:
    assert reason_of(with_table(**columns)) == "bad_value"


def test_too_many_peers() -> None:
    assert reason_of(with_table(keys=b"\x01" * 32 * (MAX_PEERS + 1))) == "bad_value"


def test_announced_interval_must_be_possible() -> None:
    t = telemetry([agent_peer(KEYS[0])])
    for bad in (-1.0, math.inf, 1e9):
        data = msgspec.msgpack.encode(msgspec.structs.replace(t, full_interval_s=bad))
        assert reason_of(data) == "bad_value"


def test_wrong_types_are_bad_schema_and_broken_msgpack_bad_json() -> None:
    good = encode(telemetry([agent_peer(KEYS[0])]))
    doc = msgspec.msgpack.decode(good)
    doc["table"]["rtt"] = [1, 2, 3]  # a list where packed bytes belong
    assert reason_of(msgspec.msgpack.encode(doc)) == "bad_schema"
    assert reason_of(good[: len(good) // 2]) == "bad_json"
    assert reason_of(good + b"\x00") == "bad_json"
    assert reason_of(b"\x81\x00\xa1\x80") in ("bad_json", "bad_schema")  # invalid UTF-8
    doc = msgspec.msgpack.decode(good)
    doc["v"] = 2
    assert reason_of(msgspec.msgpack.encode(doc)) == "bad_version"


def test_the_agent_cannot_encode_what_peers_would_refuse() -> None:
    with pytest.raises(BusMessageError) as info:
        peer_table([agent_peer(KEYS[0], rx_bytes=2**64)])
    assert info.value.reason == "bad_value"
    with pytest.raises(BusMessageError) as info:
        peer_table([agent_peer("not a key")])
    assert info.value.reason == "bad_key"


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_corrupted_compact_telemetry_only_raises_bus_message_error(data: st.DataObject) -> None:
    good = bytearray(encode(telemetry([agent_peer(k, i) for i, k in enumerate(KEYS)])))
    for _ in range(data.draw(st.integers(1, 8))):
        pos = data.draw(st.integers(0, len(good) - 1))
        good[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(1, len(good)))
    for payload in (bytes(good), bytes(good[:cut])):
        try:
            t = decode(payload, Telemetry)
        except BusMessageError as exc:
            assert exc.reason in {"bad_json", "bad_schema", "bad_version", "bad_value", "bad_key",
                                  "bad_name", "bad_prefix"}  # fmt: skip
        else:
            t.reports()  # whatever decodes also expands without error


@settings(max_examples=300, deadline=None)
@given(st.integers(0x80, 0x8F), st.binary(max_size=300))
def test_random_msgpack_maps_only_raise_bus_message_error(first: int, rest: bytes) -> None:
    for kind in (Telemetry, Signed):
        try:
            decode(bytes([first]) + rest, kind)
        except BusMessageError as exc:
            assert exc.reason in {"bad_json", "bad_schema", "bad_version", "bad_value"}


# -- the controller's side ---------------------------------------------------------------


def test_view_clears_unusable_table_values_and_counts_them() -> None:
    """A 2-minute RTT passes the decoder (possible) but is no link to route on."""
    view = MeshView("lab")
    peers = [
        agent_peer(KEYS[0], rtt_ms=120_000.0, pmtu=300),
        agent_peer(KEYS[1], bandwidth_mbit=5e7),
        agent_peer(KEYS[2]),
    ]
    t = telemetry(peers)
    t = decode(encode(t), Telemetry)
    assert view.take("a", t, 0.0)
    assert view.dropped["rtt_ms_unusable"] == 1
    assert view.dropped["pmtu_unusable"] == 1
    assert view.dropped["bandwidth_mbit_unusable"] == 1
    rows = view.nodes["a"].peers
    assert rows[KEYS[0]].rtt_ms is None and rows[KEYS[0]].pmtu is None
    assert rows[KEYS[0]].jitter_ms == pytest.approx(0.42)  # the rest of the report counts
    assert rows[KEYS[1]].bandwidth_mbit is None
    assert rows[KEYS[2]].rtt_ms == pytest.approx(12.345, abs=0.005 + 1e-9)


def test_table_and_peer_objects_in_one_message() -> None:
    """Both forms may arrive together; a peer in both is taken from the table."""
    view = MeshView("lab")
    t = telemetry(
        [agent_peer(KEYS[0], rtt_ms=5.0)],
        peers=[agent_peer(KEYS[0], rtt_ms=99.0), agent_peer(KEYS[1], rtt_ms=7.0)],
    )
    view.take("a", decode(encode(t), Telemetry), 0.0)
    rows = view.nodes["a"].peers
    assert rows[KEYS[0]].rtt_ms == 5.0 and rows[KEYS[1]].rtt_ms == 7.0
