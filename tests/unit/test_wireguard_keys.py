"""Curve25519 keys: RFC 7748 vectors, base64/hex conversions, rejection of bad keys."""

from __future__ import annotations

import base64
import shutil
import subprocess

import pytest

from meshopt.errors import MeshoptError
from meshopt.wireguard.keys import (
    check_key,
    generate_keypair,
    generate_preshared_key,
    generate_private_key,
    key_from_hex,
    key_to_bytes,
    key_to_hex,
    public_key,
)

# RFC 7748 section 6.1 (X25519 Diffie-Hellman): Alice's and Bob's key pairs.
RFC7748 = [
    (
        "77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a",
        "8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a",
    ),
    (
        "5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb",
        "de9edb7d7b7dc1b4d35b61c2ece435373f8343c85b78674dadfc7e146f882b4f",
    ),
]


@pytest.mark.parametrize(("private_hex", "public_hex"), RFC7748)
def test_rfc7748_public_keys(private_hex: str, public_hex: str) -> None:
    assert public_key(key_from_hex(private_hex)) == key_from_hex(public_hex)


def test_hex_base64_round_trip() -> None:
    raw = bytes(range(32))
    b64 = base64.b64encode(raw).decode()
    assert key_to_hex(b64) == raw.hex()
    assert key_from_hex(raw.hex()) == b64
    assert key_from_hex(raw.hex().upper()) == b64  # hex case does not matter on input
    assert key_to_bytes(b64) == raw


def test_generated_private_keys_are_clamped_like_wg_genkey() -> None:
    for _ in range(20):
        raw = key_to_bytes(generate_private_key())
        assert raw[0] & 7 == 0
        assert raw[31] & 0x80 == 0
        assert raw[31] & 0x40


def test_keypairs_and_psks_are_fresh_and_valid() -> None:
    a, b = generate_keypair(), generate_keypair()
    assert a != b
    assert public_key(a[0]) == a[1]
    assert check_key(generate_preshared_key())


@pytest.mark.skipif(shutil.which("wg") is None, reason="wireguard-tools (wg) not installed")
def test_public_key_matches_wg_pubkey() -> None:
    private = generate_private_key()
    out = subprocess.run(
        ["wg", "pubkey"], input=private + "\n", capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == public_key(private)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "abc",
        "A" * 44,  # no padding
        "A" * 42 + "==",  # 31 bytes
        "!" * 43 + "=",
        base64.b64encode(bytes(33)).decode(),
    ],
)
def test_bad_base64_keys_rejected(bad: str) -> None:
    with pytest.raises(MeshoptError, match="not a WireGuard key"):
        check_key(bad)


@pytest.mark.parametrize("bad", ["", "00" * 31, "zz" * 32, "00" * 33])
def test_bad_hex_keys_rejected(bad: str) -> None:
    with pytest.raises(MeshoptError, match="hex"):
        key_from_hex(bad)


def test_errors_never_echo_the_key() -> None:
    secret = generate_private_key()[:-1] + "!"
    with pytest.raises(ValueError) as info:
        check_key(secret)
    assert secret[:10] not in str(info.value)
