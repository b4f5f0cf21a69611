"""Ed25519 signatures on every bus message.

The broker is shared infrastructure, not a trust boundary: anyone who can publish on it
could otherwise steer a mesh's traffic. So every message is a :class:`Signed` envelope:
agents sign their telemetry and status with their own identity key (enrolled at the
controller), controllers sign route sets, leases and their status with the controller
key (configured at agents and at the other controllers). The signature covers a context
string, the message kind and the exact JSON bytes of the inner message (carried as
``Signed.payload``), never a re-encoding, so both sides agree on what was signed and a
signature made for one kind of message is worthless for another.

Key formats: a public key is base64 of its raw 32 bytes (like a WireGuard key, one TOML
line); a private key file is PKCS#8 PEM (what ``openssl genpkey -algorithm ed25519``
writes) or base64 of the raw 32-byte seed, and is written with mode 0600.

The agent signs and verifies on libsodium (PyNaCl) only: ``cryptography`` (its Rust
extension is ~6 MB of every agent's memory) is imported for writing keys and for PEM
forms other than the plain ones ``openssl genpkey`` and ``cryptography`` write.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey as _NaclSigningKey
from nacl.signing import VerifyKey

from meshopt.bus.messages import (
    MAX_PAYLOAD_BYTES,
    AgentStatus,
    BusMessageError,
    ControllerStatus,
    Lease,
    M,
    Message,
    RouteSet,
    Signed,
    SignedKind,
    Telemetry,
    decode,
    decode_signed,
    encode,
)
from meshopt.errors import InputError
from meshopt.smallfile import read_small_file

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

SIGNATURE_LEN = 64
KEY_LEN = 32

# The DER of the plain PEM forms, before the 32 key bytes: PKCS#8 v1 of an Ed25519 seed
# (RFC 8410) and SubjectPublicKeyInfo of an Ed25519 public key.
_PKCS8_PREFIX = bytes.fromhex("302e020100300506032b657004220420")
_SPKI_PREFIX = bytes.fromhex("302a300506032b6570032100")


@runtime_checkable
class PublicKeyObject(Protocol):
    """An Ed25519 public key: a :class:`PublicKey` or ``cryptography``'s."""

    def public_bytes_raw(self) -> bytes: ...


@runtime_checkable
class PrivateKeyObject(Protocol):
    """An Ed25519 private key that signs: a :class:`SigningKey` or ``cryptography``'s."""

    def sign(self, data: bytes, /) -> bytes: ...

    def public_key(self) -> PublicKeyObject: ...


PublicKeyLike = PublicKeyObject | str
CONTEXT = b"meshopt-signed-v1\n"


class PublicKey:
    """An Ed25519 public key as its 32 raw bytes (verifying is the KeyRing's, on libsodium)."""

    __slots__ = ("_raw",)

    def __init__(self, raw: bytes) -> None:
        if len(raw) != KEY_LEN:
            raise ValueError(f"an Ed25519 public key has {KEY_LEN} bytes, got {len(raw)}")
        self._raw = bytes(raw)

    def public_bytes_raw(self) -> bytes:
        return self._raw

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PublicKey) and other._raw == self._raw

    def __hash__(self) -> int:
        return hash(self._raw)


class SigningKey:
    """An Ed25519 private key on libsodium: the same deterministic signatures as
    ``cryptography``'s key of the same seed, without loading ``cryptography``."""

    __slots__ = ("_key",)

    def __init__(self, seed: bytes) -> None:
        if len(seed) != KEY_LEN:
            raise ValueError(f"an Ed25519 private key has {KEY_LEN} bytes, got {len(seed)}")
        self._key = _NaclSigningKey(bytes(seed))

    def sign(self, data: bytes, /) -> bytes:
        return self._key.sign(data).signature

    def public_key(self) -> PublicKey:
        return PublicKey(bytes(self._key.verify_key))

    def private_bytes_raw(self) -> bytes:
        return bytes(self._key)


def public_key_b64(key: PublicKeyObject | PrivateKeyObject) -> str:
    """Base64 text of the raw 32-byte public key (of a private key: its public half)."""
    if isinstance(key, PrivateKeyObject):
        key = key.public_key()
    return base64.b64encode(key.public_bytes_raw()).decode("ascii")


def generate_signing_key() -> tuple[Ed25519PrivateKey, str]:
    """A fresh controller key: ``(private key, public key as base64)``."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

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


def _plain_pem(data: bytes, label: bytes, prefix: bytes) -> bytes | None:
    """The 32 key bytes of a one-block PEM whose DER is ``prefix`` + 32 bytes, None for
    any other text (which ``cryptography`` then reads, or refuses, as before)."""
    lines = data.strip().splitlines()
    if len(lines) != 3 or lines[0] != b"-----BEGIN " + label + b"-----":
        return None
    if lines[2] != b"-----END " + label + b"-----":
        return None
    try:
        der = base64.b64decode(lines[1], validate=True)
    except (binascii.Error, ValueError):
        return None
    if len(der) != len(prefix) + KEY_LEN or not der.startswith(prefix):
        return None
    return der[len(prefix) :]


def save_private_key(path: str | Path, key: Ed25519PrivateKey) -> None:
    """Write ``key`` as PKCS#8 PEM, mode 0600 from the first byte (atomic replace)."""
    from cryptography.hazmat.primitives import serialization

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


def _private_seed(path: Path) -> bytes:
    """The 32-byte seed in a PEM (PKCS#8) or base64-seed Ed25519 key file; InputError else."""
    data = read_small_file(path, "signing key")
    if b"-----BEGIN" in data:
        seed = _plain_pem(data, b"PRIVATE KEY", _PKCS8_PREFIX)
        if seed is not None:
            return seed
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError):
            raise InputError("not an unencrypted PEM private key", source=str(path)) from None
        if not isinstance(key, Ed25519PrivateKey):
            raise InputError("not an Ed25519 key", source=str(path))
        return key.private_bytes_raw()
    raw = _raw_b64(data.decode("ascii", errors="replace"))
    if raw is None:
        raise InputError("not an Ed25519 private key (PEM or base64 of 32 bytes)", source=str(path))
    return raw


def load_private_key(path: str | Path) -> Ed25519PrivateKey:
    """Read a PEM (PKCS#8) or base64-seed Ed25519 private key; InputError otherwise."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.from_private_bytes(_private_seed(Path(path)))


def load_signing_key(path: str | Path) -> SigningKey:
    """The key of :func:`load_private_key` (same files, same errors) on libsodium, for
    the agent: it signs with it and never loads ``cryptography`` for plain key files."""
    return SigningKey(_private_seed(Path(path)))


def load_public_key(text_or_path: str | Path) -> PublicKey:
    """A public key from base64 text (44 characters) or from a file holding it (or PEM)."""
    if isinstance(text_or_path, str):
        raw = _raw_b64(text_or_path)
        if raw is not None:
            return PublicKey(raw)
    path = Path(text_or_path)
    try:
        data = read_small_file(path, "public key")
    except InputError:
        raise InputError(
            "not an Ed25519 public key (base64 of 32 bytes) nor a readable file holding one",
            source=str(text_or_path)[:80],
        ) from None
    if b"-----BEGIN" in data:
        raw = _plain_pem(data, b"PUBLIC KEY", _SPKI_PREFIX)
        if raw is not None:
            return PublicKey(raw)
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        try:
            key = serialization.load_pem_public_key(data)
        except ValueError:
            raise InputError("not a PEM public key", source=str(path)) from None
        if not isinstance(key, Ed25519PublicKey):
            raise InputError("not an Ed25519 key", source=str(path))
        return PublicKey(key.public_bytes_raw())
    raw = _raw_b64(data.decode("ascii", errors="replace"))
    if raw is None:
        raise InputError("not an Ed25519 public key (base64 of 32 bytes)", source=str(path))
    return PublicKey(raw)


def _as_public(key: PublicKeyLike) -> PublicKeyObject:
    return load_public_key(key) if isinstance(key, str) else key


def key_id(public: PublicKeyLike | PrivateKeyObject) -> str:
    """Short fingerprint: the first 8 bytes of SHA-256 of the raw public key, in hex."""
    if isinstance(public, PrivateKeyObject):
        public = public.public_key()
    raw = _as_public(public).public_bytes_raw()
    return hashlib.sha256(raw).hexdigest()[:16]


def _to_sign(kind: str, payload: bytes) -> bytes:
    return CONTEXT + kind.encode("ascii") + b"\n" + payload


def sign(kind: SignedKind, msg: Message, key: PrivateKeyObject, kid: str | None = None) -> bytes:
    """The encoded Signed envelope of ``msg`` (validated first: nothing invalid is signed)."""
    payload = encode(msg)
    signed = Signed(
        kind=kind,
        payload=payload,
        signature=key.sign(_to_sign(kind, payload)),
        key_id=kid or key_id(key),
    )
    data = encode(signed)
    if kind == "routes" and len(data) > MAX_PAYLOAD_BYTES:
        # Agents would refuse it (too_large): the controller counts it instead of sending.
        raise BusMessageError("too_large", f"signed route set of {len(data)} bytes")
    return data


def sign_route_set(rs: RouteSet, key: PrivateKeyObject) -> bytes:
    return sign("routes", rs, key)


class KeyRing:
    """Trusted public keys by key id, so a verifier hashes each key once, not per message.

    Verification runs on libsodium (PyNaCl): 78 us per 8 KB message here against 128 us
    for OpenSSL through ``cryptography``, and it refuses non-canonical signatures and
    small-order keys.
    """

    def __init__(self, keys: Iterable[PublicKeyLike] = ()) -> None:
        self._by_id: dict[str, list[VerifyKey]] = {}
        for k in keys:
            self.add(k)

    def add(self, key: PublicKeyLike) -> str:
        raw = _as_public(key).public_bytes_raw()
        kid = key_id(key)
        same = self._by_id.setdefault(kid, [])
        if all(bytes(p) != raw for p in same):
            same.append(VerifyKey(raw))
        return kid

    def __len__(self) -> int:
        return sum(map(len, self._by_id.values()))

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def get(self, kid: str) -> list[VerifyKey]:
        return self._by_id.get(kid, [])


def _ring(trusted: KeyRing | Sequence[PublicKeyLike]) -> KeyRing:
    return trusted if isinstance(trusted, KeyRing) else KeyRing(trusted)


def open_signed(
    data: bytes,
    kind: SignedKind,
    trusted: KeyRing | Sequence[PublicKeyLike],
    *,
    max_bytes: int = MAX_PAYLOAD_BYTES,
) -> bytes:
    """The payload of a Signed envelope of ``kind`` if a trusted key signed it.

    Reasons: the decoder's (too_large, bad_json, ...), "wrong_kind", "unknown_key" (no
    trusted key has that key id) and "bad_signature".
    """
    signed = decode_signed(data, max_bytes=max_bytes)
    if signed.kind != kind:
        raise BusMessageError("wrong_kind", f"a signed {signed.kind} where {kind} belongs")
    keys = _ring(trusted).get(signed.key_id)
    if not keys:
        raise BusMessageError("unknown_key", f"key id {signed.key_id[:20]!r} is not trusted")
    if len(signed.signature) != SIGNATURE_LEN:
        raise BusMessageError("bad_signature", f"{len(signed.signature)} signature bytes")
    message = _to_sign(kind, signed.payload)
    for k in keys:
        try:
            k.verify(message, signed.signature)
            return signed.payload
        except BadSignatureError:
            continue
    raise BusMessageError("bad_signature", f"signature does not match key {signed.key_id}")


def unsigned_payload(data: bytes, kind: SignedKind, *, max_bytes: int = MAX_PAYLOAD_BYTES) -> bytes:
    """The payload of a Signed envelope without checking who signed it (for display only)."""
    signed = decode_signed(data, max_bytes=max_bytes)
    if signed.kind != kind:
        raise BusMessageError("wrong_kind", f"a signed {signed.kind} where {kind} belongs")
    return signed.payload


def verify(
    data: bytes,
    kind: SignedKind,
    type_: type[M],
    trusted: KeyRing | Sequence[PublicKeyLike],
    *,
    max_bytes: int = MAX_PAYLOAD_BYTES,
) -> M:
    """The inner message of ``kind`` and type ``type_``, signed by a trusted key."""
    return decode(open_signed(data, kind, trusted, max_bytes=max_bytes), type_, max_bytes=max_bytes)


def _check_for(mesh: str | None, node: str | None, msg_mesh: str, msg_node: str, what: str) -> None:
    if (mesh is not None and msg_mesh != mesh) or (node is not None and msg_node != node):
        raise BusMessageError("wrong_node", f"{what} is for {msg_mesh}/{msg_node}")


def verify_route_set(
    data: bytes,
    trusted: KeyRing | Sequence[PublicKeyLike],
    *,
    mesh: str | None = None,
    node: str | None = None,
    max_bytes: int = MAX_PAYLOAD_BYTES,
) -> RouteSet:
    """The RouteSet in ``data`` if a trusted key signed it; BusMessageError otherwise.

    Also "wrong_node" when ``mesh``/``node`` are given and the signed set is for another
    (a set replayed on another node's topic).
    """
    rs = verify(data, "routes", RouteSet, trusted, max_bytes=max_bytes)
    _check_for(mesh, node, rs.mesh, rs.node, "route set")
    return rs


def verify_telemetry(
    data: bytes, trusted: KeyRing | Sequence[PublicKeyLike], *, mesh: str, node: str
) -> Telemetry:
    """Telemetry signed by ``node``'s enrolled key, for ``mesh``/``node`` (the topic's)."""
    t = verify(data, "telemetry", Telemetry, trusted)
    _check_for(mesh, node, t.mesh, t.node, "telemetry")
    return t


def verify_status(
    data: bytes, trusted: KeyRing | Sequence[PublicKeyLike], *, mesh: str, node: str
) -> AgentStatus:
    st = verify(data, "status", AgentStatus, trusted)
    _check_for(mesh, node, st.mesh, st.node, "status")
    return st


def verify_lease(data: bytes, trusted: KeyRing | Sequence[PublicKeyLike], *, mesh: str) -> Lease:
    lease = verify(data, "lease", Lease, trusted)
    _check_for(mesh, None, lease.mesh, "", "lease")
    return lease


def verify_controller_status(
    data: bytes, trusted: KeyRing | Sequence[PublicKeyLike], *, controller: str
) -> ControllerStatus:
    cs = verify(data, "controller_status", ControllerStatus, trusted)
    if cs.controller != controller:
        raise BusMessageError("wrong_node", f"status of controller {cs.controller!r}")
    return cs
