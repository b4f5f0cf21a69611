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
    PackedRoutes,
    PackedRouteSet,
    Route,
    RouteSet,
    Signed,
    Tuning,
    encode,
    is_msgpack,
    pack_routes,
    validate,
)
from meshopt.bus.signing import SigningKey, _to_sign, sign, sign_route_set
from meshopt.wireguard.keys import key_from_bytes, key_to_bytes

WALL = 1_700_000_000.25
# Deterministic WireGuard keys and controller key: the golden digests depend on them.
KEYS = [key_from_bytes(hashlib.sha256(b"meshopt-key-%d" % i).digest()) for i in range(2100)]
SIGNER = SigningKey(bytes(range(32)))
KID = "0123456789abcdef"


# -- the old algorithm (meshopt/bus/messages.py before the rewrite) -------------------


def old_pack_routes(rs: RouteSet) -> PackedRouteSet:
    """``pack_routes`` as it was: comprehensions over the routes, ``_tuning_of`` per route."""
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
    none_t = (None, None, None, None, None, None)
    settings_ = [(r.mtu, r.advmss, r.initcwnd, r.initrwnd, r.window, r.congctl) for r in routes]
    uniq = [t for t in dict.fromkeys(settings_) if t != none_t]
    tunings = [Tuning(*t) for t in uniq]
    t_at: dict[Any, int] = {v: i for i, v in enumerate(uniq)}
    t_at[none_t] = 0xFFFF
    tuning_idx = [t_at[t] for t in settings_]
    assert max(len(peers), len(prefixes), len(tunings)) < 0xFFFF
    cols: dict[str, Any] = {
        "keys": b"".join([key_to_bytes(k) for k in peers]),
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
_case("empty", realistic_set(1, 7), "e51f4a4e89b801ec4c844b17c3ec5103024de991d7578e29d4195137be2ee547")


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("name", sorted(CASES))
def test_signed_bytes_equal_the_old_codes(name: str) -> None:
    rs, want = CASES[name]
    data = sign("routes", rs, SIGNER, KID)
    assert data == old_sign(rs)
    assert digest(data) == want
