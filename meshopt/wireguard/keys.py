"""Curve25519 keys as WireGuard uses them.

WireGuard's tools (``wg``, config files, pyroute2) write keys as base64; wireguard-go's
UAPI socket wants lowercase hex. The model keeps base64 (what operators read and paste)
and converts at the UAPI boundary. The X25519 arithmetic comes from libsodium (PyNaCl,
which the agent loads anyway to sign), never from hand-written field code; it clamps the
scalar as RFC 7748 says, so any 32 bytes give the public key ``wg pubkey`` prints.
"""

from __future__ import annotations

import base64
import binascii
import os

from nacl.bindings import crypto_scalarmult_base

from meshopt.wireguard.errors import KeyFormatError

KEY_LEN = 32
_B64_LEN = 44  # 32 bytes -> 43 characters and one '=' of padding


def _clamp(raw: bytes) -> bytes:
    """Clamp a scalar the way ``wg genkey`` does (RFC 7748 decodeScalar25519)."""
    b = bytearray(raw)
    b[0] &= 248
    b[31] = (b[31] & 127) | 64
    return bytes(b)


def key_to_bytes(key: str) -> bytes:
    """The 32 raw bytes of a base64 key; KeyFormatError if it is not one."""
    if not isinstance(key, str) or len(key) != _B64_LEN or not key.endswith("="):
        raise KeyFormatError(f"not a WireGuard key (44 base64 characters): {_show(key)}")
    try:
        raw = base64.b64decode(key, validate=True)
    except (binascii.Error, ValueError):
        raise KeyFormatError(f"not a WireGuard key (bad base64): {_show(key)}") from None
    if len(raw) != KEY_LEN:  # pragma: no cover - length checked above
        raise KeyFormatError(f"not a WireGuard key (not 32 bytes): {_show(key)}")
    return raw


def key_from_bytes(raw: bytes) -> str:
    """Base64 text of 32 raw key bytes."""
    if len(raw) != KEY_LEN:
        raise KeyFormatError(f"a WireGuard key has 32 bytes, got {len(raw)}")
    return base64.b64encode(raw).decode("ascii")


def check_key(key: str) -> str:
    """Return ``key`` unchanged if it is a valid base64 WireGuard key, else raise."""
    key_to_bytes(key)
    return key


def key_to_hex(key: str) -> str:
    """Base64 key -> the lowercase hex form the UAPI socket speaks."""
    return key_to_bytes(key).hex()


def key_from_hex(text: str) -> str:
    """UAPI hex key -> base64; KeyFormatError unless it is exactly 64 hex digits."""
    if len(text) != 2 * KEY_LEN:
        raise KeyFormatError(f"not a hex WireGuard key (64 hex digits): {_show(text)}")
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise KeyFormatError(f"not a hex WireGuard key: {_show(text)}") from None
    return key_from_bytes(raw)


def generate_private_key() -> str:
    """A fresh private key (clamped, like ``wg genkey``), base64."""
    return key_from_bytes(_clamp(os.urandom(KEY_LEN)))


def generate_preshared_key() -> str:
    """A fresh 32-byte symmetric preshared key (``wg genpsk``), base64."""
    return key_from_bytes(os.urandom(KEY_LEN))


def public_key(private_key: str) -> str:
    """The public key of a base64 private key (``wg pubkey``)."""
    raw = key_to_bytes(private_key)
    return key_from_bytes(crypto_scalarmult_base(raw))


def generate_keypair() -> tuple[str, str]:
    """``(private, public)``, both base64."""
    private = generate_private_key()
    return private, public_key(private)


def _show(value: object) -> str:
    """Describe bad input without echoing it: it may be a private key."""
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    return f"a {type(value).__name__}"
