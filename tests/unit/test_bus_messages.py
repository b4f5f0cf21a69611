"""Bus topics and messages: round trips, and every kind of garbage refused with its reason."""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshopt.bus.messages import (
    MAX_PAYLOAD_BYTES,
    MAX_PEERS,
    AgentStatus,
    BusMessageError,
    ControllerStatus,
    Counters,
    Lease,
    PeerReport,
    Route,
    RouteSet,
    Signed,
    Telemetry,
    decode_controller_status,
    decode_lease,
    decode_route_set,
    decode_signed,
    decode_status,
    decode_telemetry,
    encode,
)
from meshopt.bus.topics import Topics
from meshopt.errors import InputError
from meshopt.wireguard.keys import generate_keypair

KEY_A = generate_keypair()[1]
KEY_B = generate_keypair()[1]
KEY_C = generate_keypair()[1]


def peer(**kw: Any) -> PeerReport:
    base: dict[str, Any] = dict(
        public_key=KEY_B,
        ifname="wg0",
        endpoint="192.0.2.1:51820",
        alive=True,
        rtt_ms=12.5,
        rtt_min_ms=11.0,
        rtt_median_ms=12.0,
        rtt_p95_ms=15.0,
        jitter_ms=0.4,
        noise_ms=0.2,
        loss=0.01,
        samples=100,
        probes_sent=101,
        handshake_age_s=30.0,
        rx_bytes=10_000,
        tx_bytes=20_000,
        rx_bps=100.0,
        tx_bps=200.0,
        bandwidth_mbit=95.0,
        bandwidth_confidence=0.8,
        bandwidth_age_s=5.0,
        pmtu=1420,
    )
    base.update(kw)
    return PeerReport(**base)


def telemetry(**kw: Any) -> Telemetry:
    base: dict[str, Any] = dict(
        mesh="lab",
        node="a",
        public_key=KEY_A,
        addresses=["10.99.0.1/32", "fd99::1/128"],
        seq=7,
        sent_at=1_700_000_000.5,
        full=True,
        peers=[peer()],
        counters={"bad_reply": 2},
    )
    base.update(kw)
    return Telemetry(**base)


def route_set(**kw: Any) -> RouteSet:
    base: dict[str, Any] = dict(
        mesh="lab",
        node="a",
        version=1_700_000_000_000_000_000,
        issued_at=1_700_000_000.0,
        controller="ctl-1",
        term=3,
        routes=[
            Route(dst="10.99.0.3/32", via=KEY_B, backup=KEY_C, mtu=1380, congctl="cubic"),
            Route(dst="10.99.0.3/32", via=KEY_C, table="bulk", initcwnd=20, window=1 << 20),
        ],
    )
    base.update(kw)
    return RouteSet(**base)


def reason_of(data: bytes, decoder: Any = decode_telemetry, **kw: Any) -> str:
    with pytest.raises(BusMessageError) as info:
        decoder(data, **kw)
    return info.value.reason


def patched(msg: Any, path: list[Any], value: Any) -> bytes:
    """The JSON of ``msg`` with one field (by path) replaced, bypassing encode's checks."""
    doc = json.loads(msgspec.json.encode(msg))
    target = doc
    for p in path[:-1]:
        target = target[p]
    target[path[-1]] = value
    return json.dumps(doc).encode()


# -- topics ---------------------------------------------------------------------------


def test_topic_layout_and_parse() -> None:
    t = Topics("lab")
    assert t.telemetry("a") == "meshopt/lab/telemetry/a"
    assert t.status("a") == "meshopt/lab/status/a"
    assert t.routes("node-1.x") == "meshopt/lab/routes/node-1.x"
    assert t.lease() == "meshopt/lab/controller/lease"
    assert t.controller_status("c1") == "meshopt/lab/controller/status/c1"
    assert t.all_telemetry() == "meshopt/lab/telemetry/+"
    assert t.all_status() == "meshopt/lab/status/+"
    assert t.all_routes() == "meshopt/lab/routes/+"
    assert t.parse(t.telemetry("a")) == ("telemetry", "a")
    assert t.parse(t.status("b")) == ("status", "b")
    assert t.parse(t.routes("c")) == ("routes", "c")
    assert t.parse(t.lease()) == ("lease", "")
    assert t.parse(t.controller_status("c1")) == ("controller_status", "c1")
    for other in (
        "meshopt/other/telemetry/a",
        "meshopt/lab/telemetry/a/extra",
        "meshopt/lab/telemetry/",
        "meshopt/lab/bogus/a",
        "meshopt/lab/telemetry/a+b",
        "meshopt/lab",
        "",
        "x/lab/telemetry/a",
        "meshopt/lab/controller/status/",
    ):
        assert t.parse(other) is None, other


@pytest.mark.parametrize("bad", ["", "a/b", "+", "#", "a b", "$SYS", "x" * 65, "é"])
def test_bad_names_refused(bad: str) -> None:
    with pytest.raises(InputError):
        Topics(bad)
    t = Topics("lab")
    for method in (t.telemetry, t.status, t.routes, t.controller_status):
        with pytest.raises(InputError):
            method(bad)


# -- round trips ----------------------------------------------------------------------


def test_round_trips() -> None:
    tel = telemetry()
    assert decode_telemetry(encode(tel)) == tel
    sparse = telemetry(peers=[PeerReport(public_key=KEY_B, ifname="wg-b")], full=False)
    assert decode_telemetry(encode(sparse)) == sparse
    st_ = AgentStatus(mesh="lab", node="a", online=False, since=1.5, reason="will")
    assert decode_status(encode(st_)) == st_
    rs = route_set()
    assert decode_route_set(encode(rs)) == rs
    signed = Signed(kind="routes", payload=encode(rs), signature=b"\x01" * 64, key_id="abcd")
    assert decode_signed(encode(signed)) == signed
    lease = Lease(mesh="lab", controller="c1", term=4, expires_at=10.0, issued_at=5.0)
    assert decode_lease(encode(lease)) == lease
    cs = ControllerStatus(controller="c1", online=True, role="standby", since=3.0)
    assert decode_controller_status(encode(cs)) == cs


def test_wire_format_is_plain_json_with_version() -> None:
    doc = json.loads(encode(telemetry()))
    assert doc["v"] == 1
    assert doc["peers"][0]["rtt_ms"] == 12.5
    assert doc["addresses"] == ["10.99.0.1/32", "fd99::1/128"]


def test_unknown_fields_are_ignored() -> None:
    """Adding an optional field must not need a new schema version."""
    data = patched(telemetry(), ["future_field"], {"x": 1})
    assert decode_telemetry(data) == telemetry()


# -- garbage --------------------------------------------------------------------------


def test_too_large() -> None:
    big = b" " * (MAX_PAYLOAD_BYTES + 1)
    assert reason_of(big) == "too_large"
    assert reason_of(encode(telemetry()), max_bytes=100) == "too_large"


@pytest.mark.parametrize(
    "data", [b"", b"{", b"\xff\xfe", b"nul", b"{'v': 1}", b"[1,2", b'{"v":1,"peers":[1,}']
)
def test_bad_json(data: bytes) -> None:
    assert reason_of(data) == "bad_json"


def test_bad_schema() -> None:
    assert reason_of(b"[]") == "bad_schema"
    assert reason_of(b'{"v": "1"}') == "bad_schema"
    assert reason_of(b'{"v": 1}') == "bad_schema"  # required fields missing
    assert reason_of(patched(telemetry(), ["seq"], "7")) == "bad_schema"
    assert reason_of(patched(telemetry(), ["peers"], {})) == "bad_schema"
    assert reason_of(patched(telemetry(), ["peers", 0, "rtt_ms"], "fast")) == "bad_schema"
    assert reason_of(patched(telemetry(), ["peers", 0, "samples"], 1.5)) == "bad_schema"
    rs = patched(route_set(), ["routes", 0, "table"], "slow")
    assert reason_of(rs, decode_route_set) == "bad_schema"
    cs = b'{"v":1,"controller":"c","online":true,"role":"boss","since":1}'
    assert reason_of(cs, decode_controller_status) == "bad_schema"
    sig = b'{"v":1,"kind":"routes","payload":"not base64!","signature":"","key_id":"x"}'
    assert reason_of(sig, decode_signed) == "bad_schema"


def test_bad_version() -> None:
    assert reason_of(patched(telemetry(), ["v"], 2)) == "bad_version"
    # A newer schema that also changed field types still reads as a version problem.
    assert reason_of(b'{"v": 2, "peers": "something else"}') == "bad_version"
    assert reason_of(patched(route_set(), ["v"], 0), decode_route_set) == "bad_version"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("rtt_ms", -1.0),
        ("rtt_min_ms", -0.001),
        ("jitter_ms", -3),
        ("noise_ms", -1),
        ("loss", 1.5),
        ("loss", -0.1),
        ("bandwidth_confidence", 2),
        ("rx_bytes", -1),
        ("tx_bytes", 2**64),
        ("samples", -5),
        ("rx_bps", -1.0),
        ("handshake_age_s", -2),
        ("pmtu", 20),
    ],
)
def test_impossible_peer_values(field: str, value: Any) -> None:
    assert reason_of(patched(telemetry(), ["peers", 0, field], value)) == "bad_value"


def test_number_overflowing_to_inf_is_refused() -> None:
    data = encode(telemetry()).replace(b'"rtt_p95_ms":15.0', b'"rtt_p95_ms":1e999')
    assert data != encode(telemetry())
    assert reason_of(data) == "bad_json"  # msgspec: "number out of range"


def test_nan_and_inf_refused_by_encode_and_checks() -> None:
    """JSON has no NaN, so the only way in is a buggy sender: encode refuses it."""
    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(BusMessageError) as info:
            encode(telemetry(peers=[peer(rtt_ms=bad)]))
        assert info.value.reason == "bad_value"
    with pytest.raises(BusMessageError):
        encode(telemetry(peers=[peer(loss=1.5)]))
    with pytest.raises(BusMessageError):
        encode(telemetry(sent_at=math.nan))


def test_other_bad_values() -> None:
    assert reason_of(patched(telemetry(), ["counters", "x"], -1)) == "bad_value"
    assert reason_of(patched(telemetry(), ["seq"], -1)) == "bad_value"
    assert reason_of(patched(telemetry(), ["peers", 0, "ifname"], "x" * 16)) == "bad_value"
    many = patched(telemetry(), ["peers"], [{"public_key": KEY_B, "ifname": "w"}] * (MAX_PEERS + 1))
    assert reason_of(many, max_bytes=10**7) == "bad_value"
    too_many_routes = patched(route_set(), ["routes"], [{"dst": "10.0.0.0/8", "via": KEY_B}] * 4097)
    assert reason_of(too_many_routes, decode_route_set, max_bytes=10**7) == "bad_value"
    dup = patched(route_set(), ["routes", 1, "table"], "fast")
    assert reason_of(dup, decode_route_set) == "bad_value"
    same = patched(route_set(), ["routes", 0, "backup"], KEY_B)
    assert reason_of(same, decode_route_set) == "bad_value"
    assert reason_of(patched(route_set(), ["routes", 0, "mtu"], 0), decode_route_set) == (
        "bad_value"
    )
    cc = patched(route_set(), ["routes", 0, "congctl"], "bbr; rm -rf")
    assert reason_of(cc, decode_route_set) == "bad_value"
    lease = b'{"v":1,"mesh":"lab","controller":"c","term":1,"expires_at":1,"issued_at":2}'
    assert reason_of(lease, decode_lease) == "bad_value"
    status = b'{"v":1,"mesh":"lab","node":"a","online":true,"since":-1}'
    assert reason_of(status, decode_status) == "bad_value"


def test_bad_names_in_messages() -> None:
    assert reason_of(patched(telemetry(), ["node"], "a/b")) == "bad_name"
    assert reason_of(patched(telemetry(), ["mesh"], "#")) == "bad_name"
    assert reason_of(patched(route_set(), ["controller"], ""), decode_route_set) == "bad_name"


@pytest.mark.parametrize("prefix", ["10.0.0.1/24", "10.0.0.0", "10.0.0.0/33", "nope", "::1/200"])
def test_bad_prefix(prefix: str) -> None:
    assert reason_of(patched(telemetry(), ["addresses", 0], prefix)) == "bad_prefix"
    rs = patched(route_set(), ["routes", 0, "dst"], prefix)
    assert reason_of(rs, decode_route_set) == "bad_prefix"


@pytest.mark.parametrize(
    "key",
    ["", "abc", "A" * 44, KEY_A[:-1] + "!", KEY_A + "A"],
    ids=["empty", "short", "44-chars", "bad-char", "45-chars"],  # KEY_A is random
)
def test_bad_key(key: str) -> None:
    assert reason_of(patched(telemetry(), ["public_key"], key)) == "bad_key"
    assert reason_of(patched(telemetry(), ["peers", 0, "public_key"], key)) == "bad_key"
    rs = patched(route_set(), ["routes", 0, "via"], key)
    assert reason_of(rs, decode_route_set) == "bad_key"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes_only_raise_bus_message_error(data: bytes) -> None:
    for decoder in (
        decode_telemetry,
        decode_status,
        decode_route_set,
        decode_signed,
        decode_lease,
        decode_controller_status,
    ):
        try:
            decoder(data)
        except BusMessageError as exc:
            assert exc.reason in {"too_large", "bad_json", "bad_schema", "bad_version"}


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=50),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["peers", "addresses", "counters", "seq", "public_key", "v"]), json_values)
def test_random_json_fields_only_raise_bus_message_error(field: str, value: Any) -> None:
    """Well-formed JSON with one field replaced by anything: refused with a reason, or
    accepted as a message that encode takes back unchanged (no crash either way)."""
    data = patched(telemetry(), [field], value)
    try:
        msg = decode_telemetry(data)
    except BusMessageError as exc:
        assert exc.reason in {"bad_schema", "bad_version", "bad_value", "bad_prefix", "bad_key"}
        return
    assert decode_telemetry(encode(msg)) == msg


# -- counters -------------------------------------------------------------------------


def test_counters_log_once_per_reason(caplog: pytest.LogCaptureFixture) -> None:
    c = Counters("dropped telemetry")
    with caplog.at_level(logging.DEBUG, logger="meshopt.bus"):
        for _ in range(5):
            c.count("bad_json", "from a")
        c.count("too_large")
        c.count("too_large")
    assert c["bad_json"] == 5
    assert c["too_large"] == 2
    assert c["never"] == 0
    assert c.total() == 7
    assert c.snapshot() == {"bad_json": 5, "too_large": 2}
    lines = [r.getMessage() for r in caplog.records if r.name == "meshopt.bus"]
    assert len(lines) == 2
    assert "bad_json" in lines[0] and "from a" in lines[0]
    assert "too_large" in lines[1]


@pytest.mark.parametrize("depth", [1000, 100_000])
def test_deeply_nested_json_is_bad_json_not_a_crash(depth: int) -> None:
    for data in (b"[" * depth, b'{"v":1,"kind":"routes","payload":' + b"[" * depth + b"}"):
        with pytest.raises(BusMessageError) as info:
            decode_signed(data)
        assert info.value.reason in ("bad_json", "bad_schema")
