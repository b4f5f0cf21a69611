"""Signatures on bus messages: only a trusted key's exact bytes, for that kind and node, pass."""

from __future__ import annotations

import base64
import json
import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from meshopt.bus.messages import AgentStatus, BusMessageError, Route, RouteSet, Signed, encode
from meshopt.bus.signing import (
    CONTEXT,
    KeyRing,
    generate_signing_key,
    key_id,
    load_private_key,
    load_public_key,
    public_key_b64,
    save_private_key,
    sign,
    sign_route_set,
    verify_lease,
    verify_route_set,
    verify_status,
)
from meshopt.errors import InputError
from meshopt.wireguard.keys import generate_keypair

PEER_B = generate_keypair()[1]
PEER_C = generate_keypair()[1]


def route_set(version: int = 100, node: str = "a", **kw: Any) -> RouteSet:
    base: dict[str, Any] = dict(
        mesh="lab",
        node=node,
        version=version,
        issued_at=1_700_000_000.0,
        controller="ctl-1",
        term=1,
        routes=[Route(dst="10.99.0.3/32", via=PEER_B, backup=PEER_C)],
    )
    base.update(kw)
    return RouteSet(**base)


def reason(data: bytes, trusted: list[Any], **kw: Any) -> str:
    with pytest.raises(BusMessageError) as info:
        verify_route_set(data, trusted, **kw)
    return info.value.reason


def resigned(data: bytes, **changes: Any) -> bytes:
    """The same Signed envelope with fields swapped (bypassing the signer)."""
    doc = json.loads(data)
    for k, v in changes.items():
        doc[k] = base64.b64encode(v).decode() if isinstance(v, bytes) else v
    return json.dumps(doc).encode()


def test_valid_signature_accepted() -> None:
    key, pub = generate_signing_key()
    rs = route_set()
    data = sign_route_set(rs, key)
    assert verify_route_set(data, [pub]) == rs
    assert verify_route_set(data, [load_public_key(pub)], mesh="lab", node="a") == rs
    other = generate_signing_key()[1]
    assert verify_route_set(data, [other, pub]) == rs  # any trusted key will do


def test_tampered_payload_rejected() -> None:
    key, pub = generate_signing_key()
    data = sign_route_set(route_set(), key)
    payload = json.loads(data)["payload"]
    raw = base64.b64decode(payload)
    evil = raw.replace(PEER_B.encode(), PEER_C.encode()).replace(
        b'"backup":"' + PEER_C.encode(), b'"backup":"' + PEER_B.encode()
    )
    assert evil != raw
    assert reason(resigned(data, payload=evil), [pub]) == "bad_signature"
    # Flipping a single bit anywhere in the payload breaks the signature.
    flipped = bytes([raw[0] ^ 1]) + raw[1:]
    assert reason(resigned(data, payload=flipped), [pub]) == "bad_signature"


def test_wrong_key_rejected() -> None:
    key, _ = generate_signing_key()
    _, other_pub = generate_signing_key()
    data = sign_route_set(route_set(), key)
    assert reason(data, [other_pub]) == "unknown_key"
    assert reason(data, []) == "unknown_key"
    # A forger who copies the trusted key's id still fails the signature check.
    forger, _ = generate_signing_key()
    forged = resigned(sign_route_set(route_set(), forger), key_id=key_id(key))
    assert reason(forged, [public_key_b64(key)]) == "bad_signature"


def test_truncated_or_bad_signature_rejected() -> None:
    key, pub = generate_signing_key()
    data = sign_route_set(route_set(), key)
    sig = base64.b64decode(json.loads(data)["signature"])
    assert len(sig) == 64
    assert reason(resigned(data, signature=sig[:63]), [pub]) == "bad_signature"
    assert reason(resigned(data, signature=b""), [pub]) == "bad_signature"
    assert reason(resigned(data, signature=bytes(64)), [pub]) == "bad_signature"
    assert reason(data[: len(data) // 2], [pub]) == "bad_json"


def test_signed_garbage_payload_rejected_after_signature() -> None:
    """A trusted key that signs garbage still does not get garbage installed."""
    key, pub = generate_signing_key()
    payload = b'{"v":1,"mesh":"lab"}'
    to_sign = CONTEXT + b"routes\n" + payload
    signed = Signed(kind="routes", payload=payload, signature=key.sign(to_sign), key_id=key_id(key))
    assert reason(encode(signed), [pub]) == "bad_schema"


def test_route_set_for_another_node_rejected() -> None:
    key, pub = generate_signing_key()
    data = sign_route_set(route_set(node="b"), key)
    assert reason(data, [pub], node="a") == "wrong_node"
    assert reason(data, [pub], mesh="other") == "wrong_node"
    assert verify_route_set(data, [pub], node="b").node == "b"


def test_route_set_of_a_thousand_node_mesh_fits_the_default_limit() -> None:
    key, pub = generate_signing_key()
    peers = [generate_keypair()[1] for _ in range(20)]
    routes = [
        Route(dst=f"10.{i // 250}.{i % 250}.0/24", via=peers[i % 20], backup=peers[(i + 1) % 20])
        for i in range(999)
    ]
    rs = route_set(routes=routes)
    assert verify_route_set(sign_route_set(rs, key), [pub]) == rs


def test_invalid_route_set_is_never_signed() -> None:
    key, _ = generate_signing_key()
    with pytest.raises(BusMessageError):
        sign_route_set(route_set(routes=[Route(dst="10.0.0.1/8", via=PEER_B)]), key)


def test_signature_is_bound_to_the_kind() -> None:
    """A status signed by a node's key is worthless as anything else, even relabelled."""
    key, pub = generate_signing_key()
    st = AgentStatus(mesh="lab", node="a", online=False, since=1.0, seq=5)
    data = sign("status", st, key)
    assert verify_status(data, [pub], mesh="lab", node="a") == st
    with pytest.raises(BusMessageError) as info:
        verify_route_set(data, [pub])
    assert info.value.reason == "wrong_kind"
    relabelled = resigned(data, kind="lease")
    with pytest.raises(BusMessageError) as info:
        verify_lease(relabelled, [pub], mesh="lab")
    assert info.value.reason == "bad_signature"


def test_telemetry_and_status_bound_to_their_node() -> None:
    key, pub = generate_signing_key()
    st = AgentStatus(mesh="lab", node="b", online=True, since=1.0, seq=5)
    data = sign("status", st, key)
    for mesh, node in (("lab", "a"), ("other", "b")):
        with pytest.raises(BusMessageError) as info:
            verify_status(data, [pub], mesh=mesh, node=node)
        assert info.value.reason == "wrong_node"


def test_key_ring_finds_keys_by_id() -> None:
    keys = [generate_signing_key() for _ in range(3)]
    ring = KeyRing(pub for _, pub in keys)
    ring.add(keys[0][1])  # the same key twice counts once
    assert len(ring) == 3
    data = sign_route_set(route_set(), keys[2][0])
    assert verify_route_set(data, ring) == route_set()
    assert reason(data, KeyRing()) == "unknown_key"


def test_key_files(tmp_path: Path) -> None:
    key, pub = generate_signing_key()
    path = tmp_path / "controller.key"
    save_private_key(path, key)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    loaded = load_private_key(path)
    assert public_key_b64(loaded) == pub
    # Overwriting keeps 0600 and leaves no temporary file behind.
    os.chmod(path, 0o644)
    save_private_key(path, loaded)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["controller.key"]
    # The raw base64 seed form also loads.
    raw = tmp_path / "seed.key"
    raw.write_text(base64.b64encode(key.private_bytes_raw()).decode() + "\n", encoding="ascii")
    assert public_key_b64(load_private_key(raw)) == pub
    # Public keys: base64 text, a file holding it, both give the same key id.
    pub_file = tmp_path / "controller.pub"
    pub_file.write_text(pub + "\n")
    assert key_id(load_public_key(pub_file)) == key_id(pub) == key_id(key)
    assert len(key_id(pub)) == 16


def test_openssl_key_loads(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    path = tmp_path / "k.pem"
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(path)], check=True)
    key = load_private_key(path)
    rs = route_set()
    assert verify_route_set(sign_route_set(rs, key), [public_key_b64(key)]) == rs


@pytest.mark.parametrize("text", ["", "short", "A" * 44, "x" * 200])
def test_bad_public_key_text(text: str) -> None:
    with pytest.raises(InputError):
        load_public_key(text)


def test_bad_private_key_files(tmp_path: Path) -> None:
    with pytest.raises(InputError):
        load_private_key(tmp_path / "missing")
    bad = tmp_path / "bad"
    bad.write_text("-----BEGIN PRIVATE KEY-----\nnope\n-----END PRIVATE KEY-----\n")
    with pytest.raises(InputError):
        load_private_key(bad)
    bad.write_text("not a key")
    with pytest.raises(InputError):
        load_private_key(bad)
