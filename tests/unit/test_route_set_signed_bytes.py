"""Signing a route set gives the same bytes as before the column-sharing rewrite.

``encode`` of a RouteSet computes each route column once for the check and the packing,
skips the JSON attempt when the route count alone proves the JSON too large, and writes
the packed indexes from precomputed 2-byte codes (issue 15: a dead relay at 1000 nodes
makes ~600 sets the controller signs one after another). None of that may change a byte:
the old algorithm is kept here (``old_encode``, ``old_pack_routes``: the code as it was)
and both must give the same signed bytes for random and realistic sets, across the
JSON/packed threshold; golden digests pin sets signed by the old code itself.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshopt.bus import messages
from meshopt.bus.messages import (
    MAX_PAYLOAD_BYTES,
    BusMessageError,
    PackedRoutes,
    PackedRouteSet,
    Route,
    RouteSet,
    Signed,
    Tuning,
    decode_route_set,
    decode_signed,
    encode,
    is_msgpack,
    pack_routes,
    validate,
)
from meshopt.bus.signing import SigningKey, _to_sign, sign
from meshopt.wireguard.errors import KeyFormatError
from meshopt.wireguard.keys import key_from_bytes, key_to_bytes
from tests.unit.test_route_set_checks import BAD, reference

WALL = 1_700_000_000.25
# Deterministic WireGuard keys and controller key: the golden digests depend on them.
KEYS = [key_from_bytes(hashlib.sha256(b"meshopt-key-%d" % i).digest()) for i in range(2100)]
SIGNER = SigningKey(bytes(range(32)))
KID = "0123456789abcdef"
NO_TUNING = (None, None, None, None, None, None)


# -- the old algorithm (meshopt/bus/messages.py before the rewrite) -------------------


def old_pack_routes(rs: RouteSet) -> PackedRouteSet:
    """``pack_routes`` as it was (comprehensions over the routes, ``_tuning_of`` per
    route), word for word but for the module prefix."""
    routes = rs.routes
    dsts = [r.dst for r in routes]
    vias = [r.via for r in routes]
    backups = [r.backup for r in routes]
    peers: list[str] = list(dict.fromkeys([*vias, *(b for b in backups if b is not None)]))
    at = {v: i for i, v in enumerate(peers)}
    via = [at[v] for v in vias]
    backup = [0xFFFF if b is None else at[b] for b in backups]
    prefixes: list[str] = list(dict.fromkeys(dsts))
    at = {v: i for i, v in enumerate(prefixes)}
    dst = [at[d] for d in dsts]
    settings_ = [(r.mtu, r.advmss, r.initcwnd, r.initrwnd, r.window, r.congctl) for r in routes]
    uniq = [t for t in dict.fromkeys(settings_) if t != NO_TUNING]
    tunings = [Tuning(*t) for t in uniq]
    t_at: dict[Any, int] = {v: i for i, v in enumerate(uniq)}
    t_at[NO_TUNING] = 0xFFFF
    tuning_idx = [t_at[t] for t in settings_]
    if max(len(peers), len(prefixes), len(tunings)) >= 0xFFFF:
        raise BusMessageError("bad_value", "a route set too large to pack")
    try:
        keys = b"".join([key_to_bytes(k) for k in peers])
    except KeyFormatError:
        raise BusMessageError("bad_key", "a route's peer is not a base64 WireGuard key") from None
    cols: dict[str, Any] = {
        "keys": keys,
        "prefixes": prefixes,
        "dst": messages._pack("H", dst),
        "via": messages._pack("H", via),
        "backup": b"" if all(b is None for b in backups) else messages._pack("H", backup),
        "table": messages._pack_int([0 if r.table == "fast" else 1 for r in routes], "B"),
        "tunings": tunings,
        "tuning": messages._pack("H", tuning_idx) if tunings else b"",
    }
    return PackedRouteSet(
        mesh=rs.mesh, node=rs.node, version=rs.version, issued_at=rs.issued_at,
        controller=rs.controller, term=rs.term, packed=PackedRoutes(**cols),
    )  # fmt: skip


def old_encode(rs: RouteSet) -> bytes:
    """``encode`` of a RouteSet as it was: validate, JSON, packed if the JSON is too large."""
    validate(rs)
    data = msgspec.json.encode(rs)
    if 4 * ((len(data) + 2) // 3) + 512 > MAX_PAYLOAD_BYTES:
        return msgspec.msgpack.encode(old_pack_routes(rs))
    return data


def old_sign(rs: RouteSet) -> bytes:
    payload = old_encode(rs)
    signed = Signed(
        kind="routes", payload=payload, signature=SIGNER.sign(_to_sign("routes", payload)),
        key_id=KID,
    )  # fmt: skip
    return msgspec.json.encode(signed)


# -- route sets ------------------------------------------------------------------------


def prefix(i: int, v6: bool = False) -> str:
    if v6:
        return f"fd00:{i // 65536:x}:{i % 65536:x}::/48"
    return f"10.{64 + i // 65536}.{(i // 256) % 256}.{i % 256}/32"


def realistic_set(
    n: int,
    seed: int,
    *,
    relays: int = 70,
    no_backup: float = 0.02,
    bulk: float = 1.0,
    v6: float = 0.0,
    tunings: tuple[tuple[Any, ...], ...] = ((1420, 1380, None, None, None, None),),
    node: str = "n0001",
) -> RouteSet:
    """One node's routes as the controller builds them in an n-node mesh: per
    destination a fast route (direct or via one of ``relays`` relays, a backup but for
    a share ``no_backup``) and, for a share ``bulk``, a bulk route on the same next hop
    with one of ``tunings`` (mtu, advmss, initcwnd, initrwnd, window, congctl)."""
    rng = random.Random(seed)
    peers = KEYS[: n - 1]
    hubs = peers[:relays] if relays else peers
    routes = []
    for i, k in enumerate(peers):
        dst = prefix(i, rng.random() < v6)
        via = k if rng.random() < 0.3 or not relays else rng.choice(hubs)
        backup = None
        if rng.random() >= no_backup:
            backup = rng.choice(hubs)
            if backup == via:
                backup = k if k != via else None
        routes.append(Route(dst=dst, via=via, backup=backup))
        if rng.random() < bulk:
            mtu, advmss, cwnd, rwnd, window, cc = rng.choice(tunings)
            routes.append(
                Route(dst=dst, via=via, table="bulk", mtu=mtu, advmss=advmss, initcwnd=cwnd,
                      initrwnd=rwnd, window=window, congctl=cc)
            )  # fmt: skip
    if seed % 5 == 4:
        rng.shuffle(routes)  # not grouped by destination
    return RouteSet(mesh="mesh1", node=node, version=1_700_000_000_123 + seed,
                    issued_at=WALL + seed, controller="ctl-a", term=7, routes=routes)  # fmt: skip


RICH_TUNINGS = (
    (1420, 1380, None, None, None, None),
    (1420, 1380, 40, 40, 4_194_304, "bbr"),
    (1280, None, 10, None, 1 << 20, None),
    (None, None, None, None, None, "cubic"),
    (9000, 8960, 64, 64, (1 << 62) + 1, "bbr2"),
)

# name -> (set, sha256 of its signed bytes made by the old code: git 6d69e47)
CASES: dict[str, tuple[RouteSet, str]] = {}


def _case(name: str, rs: RouteSet, digest: str) -> None:
    CASES[name] = (rs, digest)


_case("1000_nodes_controller_like", realistic_set(1000, 1),
      "3ae23e99ff7d0521e628fcd4f8234b6c012d29e7721e17ae7c55f699c5f9499e")  # fmt: skip
_case("1000_nodes_1000_peers", realistic_set(1000, 2, relays=0),
      "034f99701298fbc8720ce204e5adab39c298ad58ad4c3a673182983edfc03e12")  # fmt: skip
_case("1000_nodes_rich_tunings_v6", realistic_set(1000, 3, tunings=RICH_TUNINGS, v6=0.5),
      "1c187a94e321e021feff810d6bd01c2b4ee37230eb18f5b1ef1b5b97be1c22dd")  # fmt: skip
_case("1000_nodes_no_backups", realistic_set(1000, 4, no_backup=1.0),
      "b77ed3b9bccd33aa9e10c2d24482b4d62fd47152fa887efd03e34ec06be77ac9")  # fmt: skip
_case("1200_nodes_no_bulk", realistic_set(1200, 5, bulk=0.0),
      "23c644b5b847ff5502bd04cdf2ae1a62608d18c65f655cd048e4ef4ae9458116")  # fmt: skip
_case("600_nodes_json", realistic_set(600, 6, tunings=RICH_TUNINGS),
      "6f477a791906b0aa44084b4dde796459bd67789ad1d413c93c0edb50a4e9a732")  # fmt: skip
_case("2000_nodes_no_bulk", realistic_set(2000, 8, bulk=0.0, no_backup=0.1),
      "8fc081ec97ada995f7492100c2f6044bfc8cc16ad5f940372758dedfc61a8d4b")  # fmt: skip
_case("empty", realistic_set(1, 7),
      "e51f4a4e89b801ec4c844b17c3ec5103024de991d7578e29d4195137be2ee547")  # fmt: skip


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("name", sorted(CASES))
def test_signed_bytes_equal_the_old_codes(name: str) -> None:
    rs, want = CASES[name]
    data = sign("routes", rs, SIGNER, KID)
    assert data == old_sign(rs)
    assert digest(data) == want


def outcome(fn: Any, arg: Any) -> bytes | str:
    """What ``fn(arg)`` gives: its bytes (msgpack of a PackedRouteSet), or the reason."""
    try:
        out = fn(arg)
    except BusMessageError as exc:
        return exc.reason
    return out if isinstance(out, bytes) else msgspec.msgpack.encode(out)


class JsonSpy:
    """Counts the JSON encodings of route sets ``encode`` makes."""

    def __init__(self) -> None:
        self.real = messages._encoder
        self.route_sets = 0

    def encode(self, msg: Any) -> bytes:
        self.route_sets += isinstance(msg, RouteSet)
        return self.real.encode(msg)


@pytest.mark.parametrize("seed", range(24))
def test_random_realistic_sets_sign_as_before(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.choice([2, 3, 40, 300, 700, 900, 1000, 1100, 1300, 1600, 2000])
    rs = realistic_set(
        n,
        seed,
        relays=rng.choice([0, 1, 5, 70, 300]),
        no_backup=rng.choice([0.0, 0.02, 0.5, 1.0]),
        bulk=rng.choice([0.0, 0.3, 1.0]),
        v6=rng.choice([0.0, 0.1, 1.0]),
        tunings=tuple(rng.sample(RICH_TUNINGS, rng.randint(1, len(RICH_TUNINGS)))),
    )
    assert sign("routes", rs, SIGNER, KID) == old_sign(rs)
    assert msgspec.msgpack.encode(pack_routes(rs)) == msgspec.msgpack.encode(old_pack_routes(rs))


def test_sets_around_the_json_limit_choose_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """Routes cut from a large set one at a time, around where its JSON stops fitting:
    the same encoding chosen for each, by the bound alone or by the JSON made."""
    spy = JsonSpy()
    monkeypatch.setattr(messages, "_encoder", spy)
    seen: set[tuple[bool, bool]] = set()  # (packed, its JSON made)
    for full in (
        realistic_set(1000, 11),
        realistic_set(1000, 12, no_backup=1.0, tunings=RICH_TUNINGS),
        realistic_set(1500, 13, bulk=0.0),
    ):

        def cut(k: int, full: RouteSet = full) -> RouteSet:
            return msgspec.structs.replace(full, routes=full.routes[:k])

        def packed(k: int) -> bool:
            return is_msgpack(old_encode(cut(k)))

        lo, hi = 0, len(full.routes)  # packed(hi), not packed(lo)
        assert packed(hi) and not packed(lo)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if packed(mid) else (mid, hi)
        for k in [*range(max(lo - 3, 0), hi + 4), *range(hi + 4, len(full.routes) + 1, 37)]:
            rs = cut(k)
            before = spy.route_sets
            data = encode(rs)
            assert data == old_encode(rs), k
            seen.add((is_msgpack(data), spy.route_sets > before))
            assert sign("routes", rs, SIGNER, KID) == old_sign(rs), k
    assert seen == {(False, True), (True, True), (True, False)}
    before = spy.route_sets
    encode(CASES["1000_nodes_controller_like"][0])
    assert spy.route_sets == before  # the controller's 1000-node sets: the bound decides


PREFIXES = ["10.3.0.1/32", "10.3.0.0/16", "fd00:1::/48", "::/0", "::/1", "0.0.0.0/0",
            "10.3.0.1/16", "fd00::1/48", "x"]  # fmt: skip
ANY_ROUTE = st.builds(
    Route,
    dst=st.sampled_from(PREFIXES),
    via=st.sampled_from([*KEYS[:4], "bad"]),
    backup=st.sampled_from([None, *KEYS[:4], "x"]),
    table=st.sampled_from(["fast", "bulk", "slow"]),
    mtu=st.sampled_from([None, 67, 68, 1420, 65535, 65536]),
    advmss=st.sampled_from([None, 0, 1, 1380]),
    initcwnd=st.sampled_from([None, 0, 10, 40]),
    initrwnd=st.sampled_from([None, 10, 70000]),
    window=st.sampled_from([None, 0, 1, 1 << 20, (1 << 63) - 1, 1 << 63]),
    congctl=st.sampled_from([None, "bbr", "cubic", "b b", "", "x" * 16]),
)


def route_set(routes: list[Route]) -> RouteSet:
    return RouteSet(
        mesh="m", node="n", version=1, issued_at=WALL, controller="c", term=1, routes=routes
    )


@settings(max_examples=400, deadline=None)
@given(st.lists(ANY_ROUTE, max_size=8))
def test_encode_refuses_and_packs_as_before(routes: list[Route]) -> None:
    """Any set, valid or not: encode's check on the columns refuses with the reason of
    the route-by-route check, and the bytes (JSON, packed) are the old ones."""
    rs = route_set(routes)
    want = reference(routes)
    for _ in range(2):  # again, with whatever the first call remembered
        got = outcome(encode, rs)
        assert got == (want if want is not None else old_encode(rs))
        assert outcome(pack_routes, rs) == outcome(old_pack_routes, rs)


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_route_among_good_ones_is_refused_by_encode_as_route_by_route(bad: Route) -> None:
    good = realistic_set(60, 21, tunings=RICH_TUNINGS).routes
    assert outcome(encode, route_set(good)) == old_encode(route_set(good))
    routes = [*good[:20], bad, *good[20:]]
    want = reference(routes)
    assert want is not None
    for _ in range(2):
        assert outcome(encode, route_set(routes)) == want


VALID_ROUTE = st.builds(
    Route,
    dst=st.sampled_from(["::/0", "::/1", "::/2", "0.0.0.0/0", "fd00:1::/48", "10.3.0.1/32"]),
    via=st.sampled_from(KEYS[:3]),
    backup=st.sampled_from([None, KEYS[3]]),
    table=st.sampled_from(["fast", "bulk"]),
    mtu=st.sampled_from([None, 68, 1420, 65535]),
    advmss=st.sampled_from([None, 1, 1380]),
    initcwnd=st.sampled_from([None, 1, 40]),
    initrwnd=st.sampled_from([None, 9, 40]),
    window=st.sampled_from([None, 1, 1 << 20, (1 << 63) - 1]),
    congctl=st.sampled_from([None, "b", "bbr", "cubic"]),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(VALID_ROUTE, max_size=12, unique_by=lambda r: (r.dst, r.table)),
    st.sampled_from(["m", "a-much-longer-mesh-name"]),
    st.sampled_from([0.0, 5e-324, 1.5, WALL]),
)
def test_the_json_bound_is_never_above_the_json(
    routes: list[Route], mesh: str, issued_at: float
) -> None:
    rs = RouteSet(mesh=mesh, node="n", version=0, issued_at=issued_at, controller="c",
                  term=0, routes=routes)  # fmt: skip
    c = messages._validate(rs, columns=True)
    assert c is not None
    assert messages._json_size_at_least(c) <= len(msgspec.json.encode(rs))


def test_the_json_bound_is_tight_for_the_shortest_routes() -> None:
    """Each constant is what the shortest valid field takes: a route with the shortest
    values adds exactly its bound to the JSON."""
    k = KEYS[0]
    shortest = [
        Route(dst="::/0", via=k),
        Route(dst="::/0", via=k, backup=KEYS[1], table="bulk", mtu=68, advmss=1, initcwnd=1,
              initrwnd=1, window=1, congctl="b"),
    ]  # fmt: skip
    validate(route_set([Route(dst="::/0", via=k, congctl="b")]))  # "b" remembered valid
    base = route_set(shortest[:1])

    def grow(rs: RouteSet) -> tuple[int, int]:
        c = messages._validate(rs, columns=True)
        assert c is not None
        return messages._json_size_at_least(c), len(msgspec.json.encode(rs))

    b0, j0 = grow(base)
    b1, j1 = grow(route_set(shortest))
    assert b1 - b0 == j1 - j0
    b2, j2 = grow(route_set([]))
    assert b0 - b2 == j0 - j2


def test_no_prefix_shorter_than_four_characters_is_valid() -> None:
    """The bound takes a destination as at least 4 characters ("::/0")."""
    alphabet = "0123456789abcdefABCDEF:./x "
    short = ["", *alphabet]
    short += [a + b for a in alphabet for b in alphabet]
    short += [a + b + c for a in alphabet for b in alphabet for c in alphabet]
    for text in short:
        with pytest.raises(BusMessageError):
            messages._prefix(text, "dst")


def test_packed_sets_read_back() -> None:
    for name in ("1000_nodes_1000_peers", "1000_nodes_rich_tunings_v6", "2000_nodes_no_bulk"):
        rs = CASES[name][0]
        assert decode_route_set(decode_signed(sign("routes", rs, SIGNER, KID)).payload) == rs
