"""A seeded generator of hostile bus messages for one lab mesh.

Each message comes with the reason it must be refused. Messages signed with the lab's
real keys (a node's identity, the controller key: what a compromised host would hold)
are built so that each breaks exactly one rule (future date, replayed sequence, another
node's address or WireGuard key, a term or version no clock explains, a lease for 30
years, ...), so none of them may change a route. The rest is garbage of every shape:
random bytes, broken and deeply nested JSON, unsigned or foreign-key messages,
NaN/inf/negative/huge values, oversized payloads, and honest messages replayed.
"""

from __future__ import annotations

import base64
import json
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshopt.bus.messages import (
    MAX_PAYLOAD_BYTES,
    Signed,
    SignedKind,
    decode_telemetry,
    encode,
    is_msgpack,
)
from meshopt.bus.signing import CONTEXT, key_id
from meshopt.bus.topics import Topics


@dataclass(frozen=True)
class Hostile:
    topic: str
    payload: bytes
    retain: bool
    what: str  # the kind of attack, for the tally


@dataclass(frozen=True)
class Honest:
    """What the attacker has seen (retained messages) and holds (stolen keys)."""

    mesh: str
    nodes: Mapping[str, Ed25519PrivateKey]  # node -> its identity key
    controller: Ed25519PrivateKey
    addresses: Mapping[str, str]  # node -> overlay address /32
    wireguard: Mapping[str, str]  # node -> WireGuard public key
    telemetry: Mapping[str, bytes]  # node -> a captured signed telemetry message
    status: Mapping[str, bytes]
    routes: Mapping[str, bytes]
    lease: bytes | None
    now: float


def sign_raw(kind: SignedKind, payload: bytes, key: Ed25519PrivateKey) -> bytes:
    """A Signed envelope around any bytes, validated or not (the attacker's signer)."""
    sig = key.sign(CONTEXT + kind.encode() + b"\n" + payload)
    return encode(Signed(kind=kind, payload=payload, signature=sig, key_id=key_id(key)))


def _inner(data: bytes) -> dict[str, Any]:
    """The message inside an honest envelope, as a document to mutate (telemetry's
    MessagePack table expanded into rows; the mutants go out as JSON, which the
    decoder also reads)."""
    doc = json.loads(data)
    raw = base64.b64decode(doc["payload"])
    if is_msgpack(raw):
        inner: dict[str, Any] = msgspec.to_builtins(decode_telemetry(raw))
        return inner
    inner = json.loads(raw)
    return inner


def _dump(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, allow_nan=True).encode()


def generate(h: Honest, seed: int, n: int) -> Iterator[Hostile]:
    """At least ``n`` hostile messages for the mesh in ``h`` (deterministic per seed)."""
    rng = random.Random(seed)
    t = Topics(h.mesh)
    names = sorted(h.nodes)
    forger = Ed25519PrivateKey.generate()
    day = 86400.0
    makers = [
        lambda: _garbage(rng, t, names),
        lambda: _telemetry(rng, t, h, names, forger, day),
        lambda: _status(rng, t, h, names, forger, day),
        lambda: _lease(rng, t, h, forger, day),
        lambda: _route_set(rng, t, h, names, forger, day),
        lambda: _replay(rng, t, h, names),
    ]
    count = 0
    while count < n:
        for m in makers:
            msg = m()
            if msg is not None:
                count += 1
                yield msg


def _garbage(rng: random.Random, t: Topics, names: list[str]) -> Hostile:
    node = rng.choice(names)
    topics = [t.telemetry(node), t.status(node), t.routes(node), t.lease()]
    topic = rng.choice([*topics, t.controller_status(rng.choice(["ctl1", "ctl2"]))])
    shape = rng.randrange(7)
    if shape == 0:
        payload = rng.randbytes(rng.randrange(1, 2000))
    elif shape == 1:
        payload = b"[" * rng.choice([1000, 50_000, 200_000])
    elif shape == 2:
        payload = b'{"v":1,"kind":"telemetry","payload":"' + b"A" * (MAX_PAYLOAD_BYTES + 10) + b'"}'
    elif shape == 3:
        payload = _dump({"v": rng.choice([0, 2, -1, 2**70]), "kind": "routes"})
    elif shape == 4:
        payload = _dump({"v": 1, "kind": "status", "payload": "!!", "signature": "", "key_id": 5})
    elif shape == 5:
        payload = json.dumps([rng.random() for _ in range(50)]).encode()
    else:
        payload = b""  # clears a retained message: must be harmless too
    return Hostile(topic, payload, rng.random() < 0.3, "garbage")


def _peer_doc(rng: random.Random, h: Honest, peer: str) -> dict[str, Any]:
    """A peer report with one value no decoder may take. (A possible but unusable value,
    such as a 100-byte PMTU, is taken with the field dropped: signed by the node's real
    key and newer than its last report, such a message would be the node's word, which
    only the node's own key can give; that is what rotating a stolen key is for.)"""
    bad = rng.choice(
        [
            {"rtt_ms": float("nan")},
            {"rtt_ms": float("inf")},
            {"rtt_ms": -5.0},
            {"loss": 1.5},
            {"bandwidth_mbit": 1e308},
            {"pmtu": 67},
            {"samples": -1},
            {"rtt_ms": 1e12},
            {"samples": 2**70},
        ]
    )
    return {"public_key": h.wireguard[peer], "ifname": "wg0", "alive": True, **bad}


def _telemetry(
    rng: random.Random,
    t: Topics,
    h: Honest,
    names: list[str],
    forger: Ed25519PrivateKey,
    day: float,
) -> Hostile:
    victim = rng.choice(names)
    other = rng.choice([n for n in names if n != victim])
    doc = _inner(h.telemetry[victim])
    doc["seq"] = doc["seq"] + rng.randrange(1, 10**6)
    doc["sent_at"] = h.now
    # a->c 1 ms, a->b dead: what the routes would follow if it were believed.
    doc["peers"] = [
        {"public_key": h.wireguard[other], "ifname": "wg0", "alive": True, "rtt_ms": 0.5},
        *(
            {"public_key": h.wireguard[p], "ifname": "wg0", "alive": False}
            for p in names
            if p not in (victim, other)
        ),
    ]
    attack = rng.randrange(10)
    key = h.nodes[victim]
    if attack == 0:
        return Hostile(t.telemetry(victim), _dump(doc), False, "telemetry_unsigned")
    if attack == 1:
        return Hostile(
            t.telemetry(victim),
            sign_raw("telemetry", _dump(doc), forger),
            False,
            "telemetry_foreign_key",
        )
    if attack == 2:
        # Another node's own (stolen) key speaking for the victim.
        thief = h.nodes[other]
        return Hostile(
            t.telemetry(victim),
            sign_raw("telemetry", _dump(doc), thief),
            False,
            "telemetry_other_nodes_key",
        )
    if attack == 3:
        doc["sent_at"] = h.now + rng.choice([3600.0, 365 * day, 10 * 365 * day])
        return Hostile(
            t.telemetry(victim),
            sign_raw("telemetry", _dump(doc), key),
            rng.random() < 0.5,
            "telemetry_future",
        )
    if attack == 4:
        doc["seq"] = _inner(h.telemetry[victim])["seq"] - rng.randrange(1, 1000)
        return Hostile(
            t.telemetry(victim), sign_raw("telemetry", _dump(doc), key), False, "telemetry_old_seq"
        )
    if attack == 5:
        doc["addresses"] = [h.addresses[victim], h.addresses[other]]
        return Hostile(
            t.telemetry(victim),
            sign_raw("telemetry", _dump(doc), key),
            False,
            "telemetry_duplicate_address",
        )
    if attack == 6:
        doc["public_keys"] = [h.wireguard[victim], h.wireguard[other]]
        return Hostile(
            t.telemetry(victim),
            sign_raw("telemetry", _dump(doc), key),
            False,
            "telemetry_stolen_wg_key",
        )
    if attack == 7:
        doc["node"] = other
        return Hostile(
            t.telemetry(victim),
            sign_raw("telemetry", _dump(doc), key),
            False,
            "telemetry_wrong_node",
        )
    if attack == 8:
        doc["peers"] = [_peer_doc(rng, h, other)]
        return Hostile(
            t.telemetry(victim),
            sign_raw("telemetry", _dump(doc), key),
            False,
            "telemetry_bad_values",
        )
    doc["seq"] = 2**64 - 1
    return Hostile(
        t.telemetry(victim), sign_raw("telemetry", _dump(doc), key), False, "telemetry_seq_overflow"
    )


def _status(
    rng: random.Random,
    t: Topics,
    h: Honest,
    names: list[str],
    forger: Ed25519PrivateKey,
    day: float,
) -> Hostile:
    victim = rng.choice(names)
    doc = _inner(h.status[victim])
    doc.update(online=False, reason="forged")
    attack = rng.randrange(4)
    if attack == 0:
        return Hostile(t.status(victim), _dump(doc), True, "status_unsigned")
    if attack == 1:
        return Hostile(
            t.status(victim), sign_raw("status", _dump(doc), forger), True, "status_foreign_key"
        )
    if attack == 2:
        doc["seq"] = doc["seq"] - rng.randrange(1, 10**6)  # an older session's will
        return Hostile(
            t.status(victim),
            sign_raw("status", _dump(doc), h.nodes[victim]),
            True,
            "status_old_session",
        )
    doc["since"] = h.now + 365 * day
    doc["seq"] = doc["seq"] + 1
    return Hostile(
        t.status(victim), sign_raw("status", _dump(doc), h.nodes[victim]), False, "status_future"
    )


def _lease(
    rng: random.Random, t: Topics, h: Honest, forger: Ed25519PrivateKey, day: float
) -> Hostile:
    base = {
        "v": 1,
        "mesh": h.mesh,
        "controller": rng.choice(["evil", "ctl1", "ctl2"]),
        "term": int(h.now) + 10,
        "issued_at": h.now,
        "expires_at": h.now + 3.0,
    }
    attack = rng.randrange(6)
    if attack == 0:
        return Hostile(t.lease(), _dump(base), True, "lease_unsigned")
    if attack == 1:
        return Hostile(t.lease(), sign_raw("lease", _dump(base), forger), True, "lease_foreign_key")
    if attack == 2:
        base["expires_at"] = h.now + 30 * 365 * day
        return Hostile(
            t.lease(),
            sign_raw("lease", _dump(base), h.controller),
            rng.random() < 0.3,
            "lease_30_years",
        )
    if attack == 3:
        base.update(term=rng.choice([2**62, 2**63 - 1]), issued_at=h.now - 10, expires_at=h.now - 7)
        return Hostile(
            t.lease(),
            sign_raw("lease", _dump(base), h.controller),
            rng.random() < 0.3,
            "lease_huge_term",
        )
    if attack == 4:
        base.update(issued_at=h.now + 3600, expires_at=h.now + 3603)
        return Hostile(
            t.lease(), sign_raw("lease", _dump(base), h.controller), False, "lease_future"
        )
    base.update(term=rng.randrange(1, 1000), issued_at=h.now - 5, expires_at=h.now + 1)
    return Hostile(t.lease(), sign_raw("lease", _dump(base), h.controller), False, "lease_old_term")


def _route_set(
    rng: random.Random,
    t: Topics,
    h: Honest,
    names: list[str],
    forger: Ed25519PrivateKey,
    day: float,
) -> Hostile:
    victim = rng.choice(names)
    other = rng.choice([n for n in names if n != victim])
    doc = _inner(h.routes[victim])
    # Everything via `other`: would black-hole or detour the victim's traffic.
    doc["routes"] = [
        {"dst": h.addresses[d], "via": h.wireguard[other]}
        for d in names
        if d not in (victim, other)
    ]
    doc["version"] = doc["version"] + rng.randrange(1, 10**6)
    attack = rng.randrange(6)
    if attack == 0:
        return Hostile(t.routes(victim), _dump(doc), False, "routes_unsigned")
    if attack == 1:
        return Hostile(
            t.routes(victim), sign_raw("routes", _dump(doc), forger), False, "routes_foreign_key"
        )
    if attack == 2:
        doc["term"] = 2**62
        return Hostile(
            t.routes(victim),
            sign_raw("routes", _dump(doc), h.controller),
            False,
            "routes_huge_term",
        )
    if attack == 3:
        doc["version"] = 2**63 - 1
        return Hostile(
            t.routes(victim),
            sign_raw("routes", _dump(doc), h.controller),
            False,
            "routes_huge_version",
        )
    if attack == 4:
        doc["version"] = _inner(h.routes[victim])["version"] - rng.randrange(1, 10**6)
        return Hostile(
            t.routes(victim),
            sign_raw("routes", _dump(doc), h.controller),
            False,
            "routes_old_version",
        )
    doc["node"] = other  # a valid set for another node, on the victim's topic
    return Hostile(
        t.routes(victim), sign_raw("routes", _dump(doc), h.controller), False, "routes_wrong_node"
    )


def _replay(rng: random.Random, t: Topics, h: Honest, names: list[str]) -> Hostile | None:
    victim = rng.choice(names)
    which = rng.randrange(3)
    if which == 0:
        return Hostile(t.telemetry(victim), h.telemetry[victim], False, "replay_telemetry")
    if which == 1:
        return Hostile(t.routes(victim), h.routes[victim], False, "replay_routes")
    if h.lease is None:
        return None
    return Hostile(t.lease(), h.lease, False, "replay_lease")
