"""Ed25519 signatures on route sets, and the replay guard agents apply before installing.

Anyone who can publish on the broker could otherwise steer a mesh's traffic, so an agent
installs a route set only if it is signed by a configured controller key and newer than
the one installed. The signature covers the exact JSON bytes of the RouteSet (carried as
``SignedRouteSet.payload``), never a re-encoding, so both sides agree on what was signed.

Key formats: a public key is base64 of its raw 32 bytes (like a WireGuard key, one TOML
line); a private key file is PKCS#8 PEM (what ``openssl genpkey -algorithm ed25519``
writes) or base64 of the raw 32-byte seed, and is written with mode 0600.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from meshopt.bus.messages import (
    MAX_PAYLOAD_BYTES,
    BusMessageError,
    RouteSet,
    SignedRouteSet,
    decode_route_set,
    decode_signed_route_set,
    encode,
)
from meshopt.errors import InputError

SIGNATURE_LEN = 64
KEY_LEN = 32

PublicKeyLike = Ed25519PublicKey | str


def public_key_b64(key: Ed25519PublicKey | Ed25519PrivateKey) -> str:
    """Base64 text of the raw 32-byte public key (of a private key: its public half)."""
    if isinstance(key, Ed25519PrivateKey):
        key = key.public_key()
    return base64.b64encode(key.public_bytes_raw()).decode("ascii")


def generate_signing_key() -> tuple[Ed25519PrivateKey, str]:
    """A fresh controller key: ``(private key, public key as base64)``."""
    key = Ed25519PrivateKey.generate()
    return key, public_key_b64(key)


def _raw_b64(text: str) -> bytes | None:
    """The 32 bytes of a one-line base64 key, None if ``text`` is not one."""
    text = text.strip()
    if len(text) != 44 or "\n" in text:
        return None
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw if len(raw) == KEY_LEN else None


def save_private_key(path: str | Path, key: Ed25519PrivateKey) -> None:
    """Write ``key`` as PKCS#8 PEM, mode 0600 from the first byte (atomic replace)."""
    path = Path(path)
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_private_key(path: str | Path) -> Ed25519PrivateKey:
    """Read a PEM (PKCS#8) or base64-seed Ed25519 private key; InputError otherwise."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read signing key: {exc.strerror}", source=str(path)) from None
    if b"-----BEGIN" in data:
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError):
            raise InputError("not an unencrypted PEM private key", source=str(path)) from None
        if not isinstance(key, Ed25519PrivateKey):
            raise InputError("not an Ed25519 key", source=str(path))
        return key
    raw = _raw_b64(data.decode("ascii", errors="replace"))
    if raw is None:
        raise InputError("not an Ed25519 private key (PEM or base64 of 32 bytes)", source=str(path))
    return Ed25519PrivateKey.from_private_bytes(raw)


def load_public_key(text_or_path: str | Path) -> Ed25519PublicKey:
    """A public key from base64 text (44 characters) or from a file holding it (or PEM)."""
    if isinstance(text_or_path, str):
        raw = _raw_b64(text_or_path)
        if raw is not None:
            return Ed25519PublicKey.from_public_bytes(raw)
    path = Path(text_or_path)
    try:
        data = path.read_bytes()
    except OSError:
        raise InputError(
            "not an Ed25519 public key (base64 of 32 bytes) nor a readable file holding one",
            source=str(text_or_path)[:80],
        ) from None
    if b"-----BEGIN" in data:
        try:
            key = serialization.load_pem_public_key(data)
        except ValueError:
            raise InputError("not a PEM public key", source=str(path)) from None
        if not isinstance(key, Ed25519PublicKey):
            raise InputError("not an Ed25519 key", source=str(path))
        return key
    raw = _raw_b64(data.decode("ascii", errors="replace"))
    if raw is None:
        raise InputError("not an Ed25519 public key (base64 of 32 bytes)", source=str(path))
    return Ed25519PublicKey.from_public_bytes(raw)


def _as_public(key: PublicKeyLike) -> Ed25519PublicKey:
    return key if isinstance(key, Ed25519PublicKey) else load_public_key(key)


def key_id(public: PublicKeyLike | Ed25519PrivateKey) -> str:
    """Short fingerprint: the first 8 bytes of SHA-256 of the raw public key, in hex."""
    if isinstance(public, Ed25519PrivateKey):
        public = public.public_key()
    raw = _as_public(public).public_bytes_raw()
    return hashlib.sha256(raw).hexdigest()[:16]


def sign_route_set(rs: RouteSet, key: Ed25519PrivateKey) -> bytes:
    """The encoded SignedRouteSet of ``rs`` (validated first: nothing invalid is signed)."""
    payload = encode(rs)
    signed = SignedRouteSet(payload=payload, signature=key.sign(payload), key_id=key_id(key))
    return encode(signed)


def verify_route_set(
    data: bytes,
    trusted: Sequence[PublicKeyLike],
    *,
    mesh: str | None = None,
    node: str | None = None,
    max_bytes: int = MAX_PAYLOAD_BYTES,
) -> RouteSet:
    """The RouteSet in ``data`` if a trusted key signed it; BusMessageError otherwise.

    Reasons: the decoder's (too_large, bad_json, ...), "unknown_key" (no trusted key
    has that key id), "bad_signature", and "wrong_node" when ``mesh``/``node`` are given
    and the signed set is for another (a set replayed on another node's topic).
    """
    signed = decode_signed_route_set(data, max_bytes=max_bytes)
    keys = [k for k in map(_as_public, trusted) if key_id(k) == signed.key_id]
    if not keys:
        raise BusMessageError("unknown_key", f"key id {signed.key_id[:20]!r} is not trusted")
    if len(signed.signature) != SIGNATURE_LEN:
        raise BusMessageError("bad_signature", f"{len(signed.signature)} signature bytes")
    for k in keys:
        try:
            k.verify(signed.signature, signed.payload)
            break
        except InvalidSignature:
            continue
    else:
        raise BusMessageError("bad_signature", f"signature does not match key {signed.key_id}")
    rs = decode_route_set(signed.payload, max_bytes=max_bytes)
    if (mesh is not None and rs.mesh != mesh) or (node is not None and rs.node != node):
        raise BusMessageError("wrong_node", f"route set is for {rs.mesh}/{rs.node}")
    return rs


class ReplayGuard:
    """Newest accepted route-set version per node; refuses anything not newer.

    ``check`` raises "replay" for an older version and "duplicate" for the same version
    (a retained set seen again after a reconnect: harmless, but still not installed
    twice), and otherwise records the version. ``seed`` restores what an agent found
    installed after a restart.
    """

    def __init__(self) -> None:
        self._newest: dict[tuple[str, str], int] = {}

    def newest(self, mesh: str, node: str) -> int | None:
        return self._newest.get((mesh, node))

    def seed(self, mesh: str, node: str, version: int) -> None:
        key = (mesh, node)
        self._newest[key] = max(version, self._newest.get(key, version))

    def check(self, rs: RouteSet) -> RouteSet:
        key = (rs.mesh, rs.node)
        newest = self._newest.get(key)
        if newest is not None and rs.version < newest:
            raise BusMessageError("replay", f"version {rs.version} < installed {newest}")
        if newest is not None and rs.version == newest:
            raise BusMessageError("duplicate", f"version {rs.version} already accepted")
        self._newest[key] = rs.version
        return rs
