"""Route-set checks and packing by columns (issue 15: re-signing 1000 sets).

``validate`` checks a set's routes column by column against what it found valid before,
and falls back to the route-by-route check only when something misses; ``pack_routes``
builds its lists with comprehensions. Both must decide exactly as the route-by-route
reference does: the same sets refused with the same reason, the same packed bytes.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshopt.bus import messages
from meshopt.bus.messages import (
    BusMessageError,
    PackedRoutes,
    PackedRouteSet,
    Route,
    RouteSet,
    Tuning,
    decode_route_set,
    encode,
    pack_routes,
    unpack_routes,
    validate,
)
from meshopt.bus.signing import generate_signing_key, sign_route_set, verify_route_set
from meshopt.wireguard.keys import generate_keypair, key_to_bytes

WALL = 1_700_000_000.0
KEYS = [generate_keypair()[1] for _ in range(6)]
GOOD = Route(dst="10.1.0.1/32", via=KEYS[0], backup=KEYS[1])
BULK = Route(
    dst="10.1.0.1/32", via=KEYS[0], table="bulk", mtu=1420, advmss=1380, window=1 << 20,
    initcwnd=40, initrwnd=40, congctl="bbr",
)  # fmt: skip


def route_set(routes: list[Route]) -> RouteSet:
    return RouteSet(
        mesh="m", node="n", version=1, issued_at=WALL, controller="c", term=1, routes=routes
    )


def reference(routes: list[Route]) -> str | None:
    """The route-by-route check (what ``validate`` did before): a refusal's reason."""
    seen: set[tuple[str, str]] = set()
    try:
        for i, r in enumerate(routes):
            messages._check_route(r, i)
            if (r.dst, r.table) in seen:
                return "bad_value"
            seen.add((r.dst, r.table))
    except BusMessageError as exc:
        return exc.reason
    return None


def check(routes: list[Route]) -> str | None:
    try:
        validate(route_set(routes))
    except BusMessageError as exc:
        return exc.reason
    return None


BAD = [
    Route(dst="10.1.0.1/33", via=KEYS[0]),
    Route(dst="10.1.0.1/24", via=KEYS[0]),  # host bits
    Route(dst="10.1.0.1", via=KEYS[0]),  # no length
    Route(dst="10.1.0.1/32", via=KEYS[0][:-2] + "=="),
    Route(dst="10.1.0.1/32", via=KEYS[0], backup="x"),
    Route(dst="10.1.0.1/32", via=KEYS[0], backup=KEYS[0]),  # backup is via
    Route(dst="10.1.0.1/32", via=KEYS[0], table="slow"),  # type: ignore[arg-type]
    msgspec.structs.replace(BULK, mtu=67),
    msgspec.structs.replace(BULK, mtu=65536),
    msgspec.structs.replace(BULK, advmss=0),
    msgspec.structs.replace(BULK, initcwnd=0),
    msgspec.structs.replace(BULK, initrwnd=70000),
    msgspec.structs.replace(BULK, window=0),
    msgspec.structs.replace(BULK, window=1 << 63),
    msgspec.structs.replace(BULK, congctl="no such"),
    msgspec.structs.replace(BULK, congctl=""),
]


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_route_among_good_ones_is_refused_as_route_by_route_every_time(bad: Route) -> None:
    good = [Route(dst=f"10.2.0.{i}/32", via=KEYS[i % 3], backup=KEYS[3]) for i in range(50)] + [
        msgspec.structs.replace(BULK, dst=f"10.2.0.{i}/32") for i in range(50)
    ]
    assert check(good) is None  # now remembered: the next sets take the column path
    routes = [*good[:20], bad, *good[20:]]
    want = reference(routes)
    assert want is not None
    for _ in range(2):  # refused, not remembered
        assert check(routes) == want


def test_a_second_route_to_a_destination_in_a_table_is_refused() -> None:
    assert check([GOOD, BULK]) is None  # one fast, one bulk: fine
    assert check([GOOD, msgspec.structs.replace(GOOD, via=KEYS[2], backup=None)]) == "bad_value"
    assert check([BULK, msgspec.structs.replace(BULK, window=4096)]) == "bad_value"
    with pytest.raises(BusMessageError, match="second route"):
        validate(route_set([GOOD, BULK, GOOD]))


def test_checks_of_an_empty_set_and_of_tunings_seen_before() -> None:
    assert check([]) is None
    assert check([BULK]) is None
    # Another valid congestion control name is checked once, then remembered.
    cubic = msgspec.structs.replace(BULK, congctl="cubic")
    assert check([cubic]) is None
    assert "cubic" in messages._valid_congctl


ROUTES = st.lists(
    st.builds(
        Route,
        dst=st.sampled_from(["10.3.0.1/32", "10.3.0.2/32", "10.3.0.0/16", "10.3.0.1/16"]),
        via=st.sampled_from([*KEYS[:3], "bad"]),
        backup=st.sampled_from([None, *KEYS[:3], "x"]),
        table=st.sampled_from(["fast", "bulk", "slow"]),
        mtu=st.sampled_from([None, 67, 1420, 65536]),
        window=st.sampled_from([None, 0, 1 << 20]),
        congctl=st.sampled_from([None, "bbr", "b b"]),
    ),
    max_size=6,
)


@settings(max_examples=300, deadline=None)
@given(ROUTES)
def test_the_column_check_decides_as_route_by_route(routes: list[Route]) -> None:
    want = reference(routes)
    assert check(routes) == want
    assert check(routes) == want  # again, with whatever it remembered


def reference_pack(rs: RouteSet) -> PackedRouteSet:
    """The loop-per-route packing the controller used before (same lists, same order)."""

    def interned(values: list[Any], seen: dict[Any, int], out: list[Any]) -> list[int]:
        idx = []
        for v in values:
            if v not in seen:
                seen[v] = len(out)
                out.append(v)
            idx.append(seen[v])
        return idx

    routes = rs.routes
    peers: list[str] = []
    seen: dict[Any, int] = {}
    via = interned([r.via for r in routes], seen, peers)
    backup = [0xFFFF if r.backup is None else interned([r.backup], seen, peers)[0] for r in routes]
    prefixes: list[str] = []
    dst = interned([r.dst for r in routes], {}, prefixes)
    tunings: list[Tuning] = []
    tuning = interned(
        [Tuning(r.mtu, r.advmss, r.initcwnd, r.initrwnd, r.window, r.congctl) for r in routes],
        {Tuning(): 0xFFFF},
        tunings,
    )
    cols: dict[str, Any] = {
        "keys": b"".join(key_to_bytes(k) for k in peers),
        "prefixes": prefixes,
        "dst": messages._pack("H", dst),
        "via": messages._pack("H", via),
        "backup": b"" if all(b == 0xFFFF for b in backup) else messages._pack("H", backup),
        "table": messages._pack_int([("fast", "bulk").index(r.table) for r in routes], "B"),
        "tunings": tunings,
        "tuning": messages._pack("H", tuning) if tunings else b"",
    }
    return PackedRouteSet(
        mesh=rs.mesh, node=rs.node, version=rs.version, issued_at=rs.issued_at,
        controller=rs.controller, term=rs.term, packed=PackedRoutes(**cols),
    )  # fmt: skip


def mixed_set(n: int) -> RouteSet:
    keys = [generate_keypair()[1] for _ in range(n)]
    routes = []
    for i, k in enumerate(keys):
        dst = f"10.{100 + i // 65536}.{(i // 256) % 256}.{i % 256}/32"
        via = keys[i - 1] if i % 10 == 9 else k
        backup = None if i % 7 == 0 else keys[(i + 3) % n]
        routes.append(Route(dst=dst, via=via, backup=backup if backup != via else None))
        if i % 4:
            routes.append(
                Route(dst=dst, via=via, table="bulk", mtu=1420, advmss=1380,
                      window=4_194_304 if i % 3 else 1_048_576, initcwnd=40, initrwnd=40,
                      congctl="bbr" if i % 5 else None)
            )  # fmt: skip
    return route_set(routes)


@pytest.mark.parametrize("n", [1, 2, 50, 1200])
def test_packing_gives_the_bytes_of_the_route_by_route_packing_and_reads_back(n: int) -> None:
    rs = mixed_set(n)
    packed = pack_routes(rs)
    assert msgspec.msgpack.encode(packed) == msgspec.msgpack.encode(reference_pack(rs))
    assert unpack_routes(packed) == rs
    assert pack_routes(route_set([])).packed.dst == b""


def test_a_large_set_signed_and_verified_keeps_every_route() -> None:
    key, pub = generate_signing_key()
    rs = mixed_set(1200)
    data = sign_route_set(rs, key)
    assert verify_route_set(data, [pub], mesh="m", node="n").routes == rs.routes
    assert decode_route_set(encode(rs)) == rs
    bad = route_set([*rs.routes[:-1], msgspec.structs.replace(rs.routes[-1], via="bad")])
    with pytest.raises(BusMessageError, match="bad_key"):
        sign_route_set(bad, key)
