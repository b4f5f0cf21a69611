"""Route sets for large meshes: packed when their JSON would not fit (issue 15).

A route set of a 2,000-node mesh (a fast and a bulk route per destination, backups and
TCP settings) is ~560 kB of JSON signed, over the 256 KiB every decoder, broker and
bridge is configured for. It goes out packed (what repeats listed once and indexed per
route, MessagePack, v2): the agent's own acceptance path takes it and gets the same
routes; an agent from before refuses it as bad_version (it keeps its routes) rather
than reading it as an empty set; hostile packed sets cost a BusMessageError, never a
traceback.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshopt.agent.core import AgentCore, RouteState
from meshopt.bus.messages import (
    MAX_PAYLOAD_BYTES,
    PACKED_ROUTES_VERSION,
    BusMessageError,
    PackedRouteSet,
    Route,
    RouteSet,
    Tuning,
    decode_route_set,
    decode_signed,
    encode,
    is_msgpack,
    pack_routes,
)
from meshopt.bus.signing import generate_signing_key, sign_route_set
from meshopt.wireguard.keys import generate_keypair

WALL = 1_700_000_000.0
KEYS = [generate_keypair()[1] for _ in range(3000)]


def big_set(n: int, *, bulk: bool = True, node: str = "n0", version: int = 7) -> RouteSet:
    """Node n0's routes in an n-node mesh: every destination fast (backup) and bulk
    (TCP settings), one in ten relayed."""
    peers = KEYS[: n - 1]
    routes = []
    for i, k in enumerate(peers):
        dst = f"10.{100 + i // 65536}.{(i // 256) % 256}.{i % 256}/32"
        via = peers[i - 1] if i % 10 == 9 else k
        routes.append(
            Route(dst=dst, via=via, backup=k if via != k else peers[(i + 1) % len(peers)])
        )
        if bulk:
            routes.append(
                Route(dst=dst, via=via, table="bulk", mtu=1420, advmss=1380,
                      window=4_194_304 if i % 3 else 1_048_576, initcwnd=40, initrwnd=40)
            )  # fmt: skip
    return RouteSet(mesh="m", node=node, version=version, issued_at=WALL, controller="ctl1",
                    term=3, routes=routes)  # fmt: skip


def test_a_2000_node_set_fits_and_the_agent_takes_it() -> None:
    rs = big_set(2001)
    assert len(rs.routes) == 4000
    assert len(msgspec.json.encode(rs)) > MAX_PAYLOAD_BYTES  # as JSON it never fit
    key, pub = generate_signing_key()
    data = sign_route_set(rs, key)  # the controller's signing
    assert len(data) <= MAX_PAYLOAD_BYTES * 3 // 4, len(data)  # 175 kB: room left
    payload = decode_signed(data).payload
    assert is_msgpack(payload)
    assert msgspec.msgpack.decode(payload)["v"] == PACKED_ROUTES_VERSION
    agent = AgentCore("m", "n0", generate_signing_key()[0], [pub], RouteState(), WALL)
    accepted = agent.on_route_set(data, WALL + 1)  # the agent's own path: all its checks
    assert accepted is not None
    assert accepted.route_set == rs


def test_small_sets_stay_json_byte_for_byte() -> None:
    """Below the limit nothing changes: agents from before read every set they could."""
    rs = big_set(300)
    data = encode(rs)
    assert data == msgspec.json.encode(rs) and data.startswith(b"{")
    assert decode_route_set(data) == rs


def test_packed_round_trip_keeps_every_field_and_the_order() -> None:
    rs = RouteSet(
        mesh="m", node="a", version=1, issued_at=WALL, controller="c", term=1,
        routes=[
            Route(dst="10.0.0.1/32", via=KEYS[0]),
            Route(dst="fd00::1/128", via=KEYS[1], backup=KEYS[0]),
            Route(dst="10.0.0.1/32", via=KEYS[1], table="bulk", mtu=1380, congctl="cubic"),
            Route(dst="10.0.0.2/32", via=KEYS[2], table="bulk", window=2**40),
        ],
    )  # fmt: skip
    packed = msgspec.msgpack.encode(pack_routes(rs))
    assert decode_route_set(packed) == rs
    p = pack_routes(rs).packed
    assert len(p.keys) == 3 * 32 and p.prefixes == ["10.0.0.1/32", "fd00::1/128", "10.0.0.2/32"]
    assert p.tunings == [Tuning(mtu=1380, congctl="cubic"), Tuning(window=2**40)]


def test_an_agent_from_before_refuses_a_packed_set_as_a_newer_version() -> None:
    """Its decoder reads v first and speaks only v1: bad_version, routes kept (never an
    empty set read from a message whose routes it cannot see)."""
    packed = encode(big_set(2001))

    class Envelope(msgspec.Struct):
        v: int

    assert msgspec.msgpack.decode(packed, type=Envelope).v != 1


def test_too_large_even_packed_is_refused_by_the_signer() -> None:
    """Past what fits (~2,900 destinations with bulk routes) the controller counts the
    set (routes_unbuildable) instead of publishing what agents would refuse."""
    with pytest.raises(BusMessageError) as info:
        sign_route_set(big_set(3001), generate_signing_key()[0])
    assert info.value.reason == "too_large"
    # Fast routes only, the same mesh fits.
    assert (
        len(sign_route_set(big_set(3001, bulk=False), generate_signing_key()[0]))
        < MAX_PAYLOAD_BYTES
    )


def hostile(**changes: Any) -> bytes:
    p = pack_routes(big_set(40))
    return msgspec.msgpack.encode(
        msgspec.structs.replace(p, packed=msgspec.structs.replace(p.packed, **changes))
    )


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"via": b"\x00\x00" * 77 + b"\xff\x00"}, "bad_value"),  # a peer past the keys
        ({"via": b"\x00"}, "bad_value"),  # not one per route
        ({"dst": b"\x00\x00" * 77 + b"\x50\x00"}, "bad_value"),  # a prefix past the list
        ({"dst": b"\x00" * 3}, "bad_value"),
        ({"backup": b"\x01\x00" * 10}, "bad_value"),
        ({"table": bytes([2] * 78)}, "bad_value"),
        ({"tuning": b"\x05\x00" * 78}, "bad_value"),
        ({"keys": b"\x01" * 33}, "bad_value"),
        ({"prefixes": ["10.0.0.0/8", "not a prefix"] * 20}, "bad_prefix"),
        ({"tunings": [Tuning(mtu=10)] * 2}, "bad_value"),  # an MTU no route may carry
        ({"via": b"\x00\x00" * 78, "backup": b"\x00\x00" * 78}, "bad_value"),  # backup = via
    ],
)
def test_hostile_packed_sets_are_refused(changes: dict[str, Any], reason: str) -> None:
    with pytest.raises(BusMessageError) as info:
        decode_route_set(hostile(**changes))
    assert info.value.reason == reason


def test_wrong_types_are_bad_schema() -> None:
    doc = msgspec.msgpack.decode(encode(big_set(2001)))
    doc["packed"]["via"] = [1, 2, 3]
    with pytest.raises(BusMessageError) as info:
        decode_route_set(msgspec.msgpack.encode(doc))
    assert info.value.reason == "bad_schema"
    doc = msgspec.msgpack.decode(encode(big_set(2001)))
    doc["v"] = 3
    with pytest.raises(BusMessageError) as info:
        decode_route_set(msgspec.msgpack.encode(doc))
    assert info.value.reason == "bad_version"


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_corrupted_packed_sets_only_raise_bus_message_error(data: st.DataObject) -> None:
    raw = bytearray(msgspec.msgpack.encode(pack_routes(big_set(30))))
    for _ in range(data.draw(st.integers(1, 8))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    try:
        rs = decode_route_set(bytes(raw))
    except BusMessageError:
        return
    assert isinstance(rs, RouteSet) and not isinstance(rs, PackedRouteSet)


def test_a_packed_set_through_the_real_agent_key_check() -> None:
    """Signed by one controller key, refused under another: packing changes nothing."""
    key, _ = generate_signing_key()
    other, other_pub = generate_signing_key()
    data = sign_route_set(big_set(2001), key)
    agent = AgentCore("m", "n0", generate_signing_key()[0], [other_pub], RouteState(), WALL)
    assert agent.on_route_set(data, WALL + 1) is None
    assert agent.counters.snapshot() == {"routeset_unknown_key": 1}
    del other
