"""The controller never dies of input: hostile telemetry, fed the way the daemon does it
(decode -> ``MeshView.take`` -> ``RouteEngine.compute`` -> the route sets' bus checks),
costs a refused message or a dropped field and a counter, never the process, and never
another node's routes.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshopt.bus.messages import (
    BusMessageError,
    PeerReport,
    Route,
    RouteSet,
    Telemetry,
    decode_telemetry,
    encode,
)
from meshopt.controller.engine import Computed, RouteEngine
from meshopt.controller.view import MeshView, TelemetryRefused
from meshopt.policy import PolicyConfig
from tests.unit.test_controller_view import MESH, new_key

NAMES = "abcd"
KEYS = {x: new_key() for x in NAMES}
STRANGER_KEY = new_key()
ADDRESS = {x: [f"10.99.0.{i}/32"] for i, x in enumerate(NAMES, start=1)}
ADDRESS["c"] = ["10.99.0.3/32", "fd00:99::3/128"]  # one node with IPv6 too (MTU min 1280)


def telemetry(
    node: str,
    sent_at: float,
    *,
    addresses: Sequence[str] | None = None,
    keys: Sequence[str] | None = None,
    rtt: float = 10.0,
    bandwidth: float | None = 100.0,
    names: str = NAMES,
    **per_peer: dict[str, Any],
) -> Telemetry:
    """A full snapshot of ``node``'s links to the others; ``per_peer[y]`` overrides fields
    of its report on y. Not checked here: hostile values must reach the decoder."""
    peers = [
        PeerReport(
            **{
                "public_key": KEYS[y],
                "ifname": "wg0",
                "rtt_ms": rtt,
                "samples": 64,
                "bandwidth_mbit": bandwidth,
                "pmtu": 1420,
                **per_peer.get(y, {}),
            }
        )
        for y in names
        if y != node
    ]
    own = list(keys) if keys is not None else [KEYS[node]]
    return Telemetry(
        mesh=MESH,
        node=node,
        public_key=own[0],
        public_keys=own,
        addresses=list(ADDRESS[node] if addresses is None else addresses),
        seq=int(sent_at),
        sent_at=sent_at,
        full=True,
        peers=peers,
    )


def wire(t: Telemetry) -> bytes:
    """What an attacker publishes: the JSON, without the sender-side checks of encode."""
    return msgspec.json.encode(t)


def honest_view(names: str = NAMES, sent_at: float = 1000.0) -> MeshView:
    view = MeshView(MESH)
    for x in names:
        view.take(x, decode_telemetry(wire(telemetry(x, sent_at, names=names))), 0.0)
    return view


def publishable(c: Computed) -> None:
    """Every route set passes the bus checks signing runs (no second route to a prefix)."""
    for node, routes in c.routes.items():
        encode(
            RouteSet(
                mesh=MESH,
                node=node,
                version=1,
                issued_at=1.0,
                controller="ctl",
                term=1,
                routes=routes,
            )
        )


def routes_to(c: Computed, src: str, dst: str, table: str = "fast") -> list[Route]:
    return [r for r in c.routes[src] if r.dst == dst and r.table == table]


# -- addresses: one owner per prefix ---------------------------------------------------


def test_an_address_given_twice_in_one_message_is_taken_once_and_counted() -> None:
    view = honest_view()
    before = view.dropped["duplicate_address"]
    t = telemetry("d", 2000.0, addresses=[ADDRESS["d"][0], ADDRESS["d"][0]])
    view.take("d", decode_telemetry(wire(t)), 0.0)
    assert view.nodes["d"].addresses == ADDRESS["d"]
    assert view.dropped["duplicate_address"] == before + 1
    c = RouteEngine(PolicyConfig()).compute(view, 0.0)
    publishable(c)
    assert len(routes_to(c, "a", ADDRESS["d"][0])) == 1


def test_another_nodes_address_is_refused_and_stays_with_its_owner() -> None:
    view = honest_view()
    c0 = RouteEngine(PolicyConfig()).compute(view, 0.0)
    thief = telemetry("d", 2000.0, addresses=[ADDRESS["d"][0], ADDRESS["a"][0]])
    with pytest.raises(TelemetryRefused) as info:
        view.take("d", decode_telemetry(wire(thief)), 0.0)
    assert info.value.reason == "address_conflict"
    assert view.nodes["d"].addresses == ADDRESS["d"]  # d's last good telemetry stands
    assert view.nodes["d"].sent_at == 1000.0
    c = RouteEngine(PolicyConfig()).compute(view, 0.0)
    publishable(c)
    assert c.routes == c0.routes
    # A new node claiming it is refused too, and stays out of the graph.
    with pytest.raises(TelemetryRefused, match="address_conflict"):
        stranger = [STRANGER_KEY]
        t = msgspec.structs.replace(thief, node="e", public_key=STRANGER_KEY, public_keys=stranger)
        view.take("e", t, 0.0)
    assert "e" not in view.nodes
    # Sticky until the owner lets go: once a is removed, d may have it.
    assert view.remove("a")
    view.take("d", decode_telemetry(wire(telemetry("d", 2001.0, names="bcd"))), 0.0)
    moved = telemetry("d", 2002.0, addresses=[ADDRESS["d"][0], ADDRESS["a"][0]], names="bcd")
    view.take("d", decode_telemetry(wire(moved)), 0.0)
    assert view.nodes["d"].addresses == [ADDRESS["d"][0], ADDRESS["a"][0]]


def test_an_owner_that_stops_claiming_an_address_frees_it() -> None:
    view = honest_view()
    view.take("a", decode_telemetry(wire(telemetry("a", 2000.0, addresses=["10.99.1.1/32"]))), 0)
    claim = telemetry("d", 2000.0, addresses=[ADDRESS["d"][0], ADDRESS["a"][0]])
    view.take("d", decode_telemetry(wire(claim)), 0.0)
    assert ADDRESS["a"][0] in view.nodes["d"].addresses


@pytest.mark.parametrize(
    ("owned", "claimed"),
    [
        (None, "10.99.0.0/24"),  # a wider prefix over a's /32 (and b's, c's)
        ("10.98.0.0/16", "10.98.7.1/32"),  # a narrower prefix inside a's /16
        (None, "fd00::/16"),  # over c's IPv6 address
        (None, "0.0.0.0/0"),
    ],
)
def test_an_overlapping_prefix_is_refused(owned: str | None, claimed: str) -> None:
    view = honest_view()
    if owned is not None:
        view.take("a", decode_telemetry(wire(telemetry("a", 2000.0, addresses=[owned]))), 0.0)
    before = {x: list(info.addresses) for x, info in view.nodes.items()}
    t = telemetry("d", 2000.0, addresses=[ADDRESS["d"][0], claimed])
    with pytest.raises(TelemetryRefused) as info:
        view.take("d", decode_telemetry(wire(t)), 0.0)
    assert info.value.reason == "address_conflict"
    assert {x: info.addresses for x, info in view.nodes.items()} == before
    publishable(RouteEngine(PolicyConfig()).compute(view, 0.0))


def test_nested_prefixes_of_one_node_are_its_own_business() -> None:
    view = honest_view("abc")
    t = telemetry("d", 2000.0, addresses=["10.99.4.1/32", "10.99.4.0/24"])
    view.take("d", decode_telemetry(wire(t)), 0.0)
    assert view.nodes["d"].addresses == ["10.99.4.1/32", "10.99.4.0/24"]


# -- per-peer values: the decoder refuses impossible ones, the view drops unusable ones ----


def test_a_path_mtu_below_576_is_ignored_and_the_bulk_routes_still_built() -> None:
    view = honest_view("abc")
    before = view.dropped["pmtu_unusable"]
    t = decode_telemetry(wire(telemetry("d", 2000.0, a={"pmtu": 100})))  # possible: >= 68
    view.take("d", t, 0.0)
    assert view.dropped["pmtu_unusable"] == before + 1
    m = view.matrices(0.0)
    d, a = m.names.index("d"), m.names.index("a")
    assert m.pmtu[d, a] == 0  # as if not measured
    assert m.cost[d, a] == pytest.approx(10.0)  # the rest of the report still counts
    c = RouteEngine(PolicyConfig(), bulk=True).compute(view, 0.0)
    publishable(c)
    assert not c.errors
    (bulk,) = routes_to(c, "d", ADDRESS["a"][0], "bulk")
    assert bulk.mtu == 1420  # the default for an unmeasured path


def test_an_ipv6_route_over_a_path_narrower_than_1280_takes_the_default_mtu() -> None:
    view = MeshView(MESH)
    for x in NAMES:
        t = telemetry(x, 1000.0, **{y: {"pmtu": 1000} for y in NAMES})  # usable for IPv4
        view.take(x, decode_telemetry(wire(t)), 0.0)
    c = RouteEngine(PolicyConfig(), bulk=True).compute(view, 0.0)
    publishable(c)
    assert not c.errors
    (v4,) = routes_to(c, "a", ADDRESS["c"][0], "bulk")
    (v6,) = routes_to(c, "a", ADDRESS["c"][1], "bulk")
    assert v4.mtu == 1000
    assert v6.mtu == 1420


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("bandwidth_mbit", 1e308),
        ("bandwidth_mbit", 1e10),
        ("rtt_ms", 1e308),
        ("jitter_ms", 7e5),
        ("noise_ms", 1e300),
        ("rx_bps", 1e14),
        ("handshake_age_s", 1e12),
        ("bandwidth_age_s", 1e12),
    ],
)
def test_impossible_peer_values_are_refused_by_the_decoder(field: str, value: float) -> None:
    t = telemetry("d", 2000.0, a={field: value})
    with pytest.raises(BusMessageError) as info:
        decode_telemetry(wire(t))
    assert info.value.reason == "bad_value"


def test_the_decoder_still_takes_large_but_possible_values() -> None:
    t = telemetry(
        "d",
        2000.0,
        a={"rtt_ms": 5e5, "bandwidth_mbit": 1e8, "rx_bps": 1e12, "handshake_age_s": 3e8},
    )
    assert decode_telemetry(wire(t)) == t


def test_an_absurd_bandwidth_is_dropped_by_the_view_and_the_rest_kept() -> None:
    view = honest_view("abc")
    before = view.dropped["bandwidth_mbit_unusable"]
    t = decode_telemetry(wire(telemetry("d", 2000.0, a={"bandwidth_mbit": 1e8})))
    view.take("d", t, 0.0)
    assert view.dropped["bandwidth_mbit_unusable"] == before + 1
    m = view.matrices(0.0)
    d, a, b = (m.names.index(x) for x in "dab")
    assert m.bandwidth[d, a] == 0.0  # unknown
    assert m.bandwidth[d, b] == 100.0
    assert m.cost[d, a] == pytest.approx(10.0)
    c = RouteEngine(PolicyConfig(), bulk=True).compute(view, 0.0)
    publishable(c)
    assert not c.errors


@pytest.mark.parametrize(
    ("field", "value"),
    [("rtt_ms", 3e5), ("jitter_ms", 1e5), ("noise_ms", 6.1e4), ("rx_bps", 5e12)],
)
def test_other_unusable_values_are_dropped_field_by_field(field: str, value: float) -> None:
    view = honest_view("abc")
    before = view.dropped[f"{field}_unusable"]
    view.take("d", decode_telemetry(wire(telemetry("d", 2000.0, a={field: value}))), 0.0)
    assert view.dropped[f"{field}_unusable"] == before + 1
    c = RouteEngine(PolicyConfig(), bulk=True).compute(view, 0.0)
    publishable(c)
    assert not c.errors


def test_a_zero_rtt_does_not_stop_a_bulk_route() -> None:
    view = honest_view("abc")
    view.take("d", decode_telemetry(wire(telemetry("d", 2000.0, rtt=0.0))), 0.0)
    c = RouteEngine(PolicyConfig(), bulk=True).compute(view, 0.0)
    publishable(c)
    assert not c.errors
    (bulk,) = routes_to(c, "d", ADDRESS["a"][0], "bulk")
    assert bulk.window is None  # no RTT to size it with


# -- isolation in the engine -------------------------------------------------------------


def test_a_node_whose_routes_cannot_be_built_is_skipped_and_the_others_unchanged() -> None:
    view = honest_view()
    engine = RouteEngine(PolicyConfig(), bulk=True)
    c0 = engine.compute(view, 0.0)
    errors_before = engine.counters["route_set_error"]
    b = c0.names.index("b")
    row_before = engine.installed.next_hop[b].copy() if engine.installed is not None else None
    # A value that got past the view by mistake (any future gap): b's report of its
    # tunnel to a overflows the bulk tuning of b's own routes, and only those.
    info = view.nodes["b"]
    info.peers[KEYS["a"]] = msgspec.structs.replace(info.peers[KEYS["a"]], bandwidth_mbit=1e308)
    c = engine.compute(view, 1.0)
    assert set(c.errors) == {"b"}
    assert "OverflowError" in c.errors["b"]
    assert "b" not in c.routes  # b keeps the set it has
    assert c.routes == {x: r for x, r in c0.routes.items() if x != "b"}
    assert engine.counters["route_set_error"] == errors_before + 1
    assert engine.installed is not None and row_before is not None
    assert engine.installed.next_hop[b].tolist() == row_before.tolist()
    publishable(c)


def test_two_destinations_sharing_a_prefix_give_one_route_not_an_invalid_set() -> None:
    view = honest_view()
    view.nodes["d"].addresses = list(ADDRESS["a"])  # past the view's check, by mistake
    engine = RouteEngine(PolicyConfig())
    before = engine.counters["duplicate_route"]
    c = engine.compute(view, 0.0)
    publishable(c)
    assert c.dropped["duplicate_route"] == 2  # b's and c's second route to it
    assert engine.counters["duplicate_route"] == before + 2
    assert not c.errors


# -- property: decode -> take -> compute never raises, honest routes stay -------------------


def mostly(usual: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``usual`` nine times in ten, else ``odd``: mostly valid, sometimes hostile."""
    return st.integers(0, 9).flatmap(lambda i: odd if i == 0 else usual)


# Possible but unusable (the view drops them), then impossible (the decoder refuses them).
unusable = st.sampled_from([0.0, 1e-300, 575.0, 6e4 + 1, 6e5, 1e8, 5e12])
impossible = st.sampled_from([6e5 + 1, 1e9 + 1, 1e13 + 1, 1e308, -1.0])
number = mostly(
    st.one_of(st.none(), st.floats(min_value=0.0, max_value=1e4)),
    mostly(unusable, st.one_of(impossible, st.floats(allow_nan=False))),
)
hostile_peer = st.fixed_dictionaries(
    {
        "public_key": mostly(st.sampled_from(list(KEYS.values())), st.just(STRANGER_KEY)),
        "ifname": st.sampled_from(["wg0", "wg-a"]),
        "alive": mostly(st.none(), st.booleans()),
        "rtt_ms": number,
        "jitter_ms": number,
        "noise_ms": number,
        "loss": mostly(st.none() | st.floats(min_value=0.0, max_value=1.0), number),
        "samples": mostly(st.integers(0, 1000), st.just(2**64 - 1)),
        "rx_bps": mostly(st.floats(min_value=0.0, max_value=1e9), number.filter(bool)),
        "bandwidth_mbit": number,
        "handshake_age_s": number,
        "pmtu": mostly(
            st.sampled_from([None, 1280, 1420]),
            st.sampled_from([0, 67, 68, 100, 575, 576, 1000, 65535, 70000]),
        ),
    }
)
prefix = mostly(
    st.builds(
        lambda n, p: str(ipaddress.ip_network((n, p), strict=False)),
        st.integers(0, 2**32 - 1),
        st.integers(8, 32),
    ),
    st.sampled_from(
        [a for x in NAMES for a in ADDRESS[x]]
        + ["10.99.0.0/24", "0.0.0.0/0", "fd00::/8", "10.99.0.4/31", "::/0", "10.99.0.4/32"]
    ),
)
hostile = st.sampled_from(["d", "e"]).flatmap(
    lambda node: st.fixed_dictionaries(
        {
            "node": st.just(node),
            "keys": mostly(
                st.just([KEYS["d"] if node == "d" else STRANGER_KEY]),
                st.lists(st.sampled_from([*KEYS.values(), STRANGER_KEY]), min_size=1, max_size=3),
            ),
            "addresses": st.lists(prefix, max_size=4),
            "sent_at": mostly(st.just(2000.0), st.sampled_from([999.0, 1000.0, 1e9])),
            "full": st.booleans(),
            "peers": st.lists(hostile_peer, max_size=5),
        }
    )
)


def feed(view: MeshView, node: str, data: bytes) -> bool:
    """What the daemon does with one message: True if taken, False if refused."""
    try:
        view.take(node, decode_telemetry(data), 0.0)
    except (BusMessageError, TelemetryRefused):
        return False
    return True


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    garbage=hostile,
    rtts=st.lists(st.floats(min_value=1.0, max_value=200.0), min_size=4, max_size=4),
    mode=st.sampled_from([(False, False), (False, True), (True, False), (True, True)]),
)
def test_hostile_telemetry_never_raises_and_leaves_honest_routes_alone(
    garbage: dict[str, Any], rtts: list[float], mode: tuple[bool, bool]
) -> None:
    symmetric, bulk = mode
    views = [MeshView(MESH), MeshView(MESH)]
    engines = [RouteEngine(PolicyConfig(), symmetric=symmetric, bulk=bulk) for _ in views]
    for view in views:
        for x, rtt in zip(NAMES, rtts, strict=True):
            assert feed(view, x, wire(telemetry(x, 1000.0, rtt=rtt)))
    for view, engine in zip(views, engines, strict=True):
        engine.compute(view, 0.0)
    t = Telemetry(
        mesh=MESH,
        node=garbage["node"],
        public_key=garbage["keys"][0],
        public_keys=garbage["keys"],
        addresses=garbage["addresses"],
        seq=7,
        sent_at=garbage["sent_at"],
        full=garbage["full"],
        peers=[PeerReport(**p) for p in garbage["peers"]],
    )
    taken = feed(views[1], garbage["node"], wire(t))
    plain, attacked = (e.compute(v, 1.0) for v, e in zip(views, engines, strict=True))
    publishable(attacked)
    assert not attacked.errors
    honest = "abc"
    if not taken:
        assert {x: attacked.routes[x] for x in honest} == {x: plain.routes[x] for x in honest}
