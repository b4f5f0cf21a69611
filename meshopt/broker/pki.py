"""A small certificate authority for one mesh's broker: EC P-256 keys, X.509 certificates.

The broker's TLS is a wall of its own (see DESIGN.md, "Trust nothing that arrives"):
clients must show a certificate from this CA (mosquitto ``require_certificate``) on top
of their user name and password, so a leaked password alone does not get anyone onto
the broker, and the broker proves its name to every client.

Why P-256: every OpenSSL that mosquitto and Python link against takes it, signing is
fast, and keys are small. Certificates carry the extensions a strict verifier wants
(key identifiers, critical basic constraints, key usage), so they pass Python 3.13's
``VERIFY_X509_STRICT`` as well as mosquitto's OpenSSL. Private keys are written with
mode 0600 from the start (never briefly readable by others).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from meshopt.errors import InputError

CA_DAYS: Final = 3650
LEAF_DAYS: Final = 825  # the longest a TLS leaf certificate is commonly accepted for
_BACKDATE: Final = dt.timedelta(minutes=5)  # clocks a little behind still accept it

Key = ec.EllipticCurvePrivateKey


def new_key() -> Key:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str, org: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, org),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _validity(days: int) -> tuple[dt.datetime, dt.datetime]:
    now = dt.datetime.now(dt.UTC)
    return now - _BACKDATE, now + dt.timedelta(days=days)


def make_ca(mesh: str, *, days: int = CA_DAYS) -> tuple[Key, x509.Certificate]:
    """A self-signed CA that signs only leaf certificates (path length 0)."""
    key = new_key()
    name = _name(f"meshopt {mesh} broker CA", f"meshopt {mesh}")
    start, end = _validity(days)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _leaf(
    ca_key: Key,
    ca_cert: x509.Certificate,
    common_name: str,
    usage: x509.ObjectIdentifier,
    sans: Sequence[x509.GeneralName],
    days: int,
) -> tuple[Key, x509.Certificate]:
    key = new_key()
    start, end = _validity(days)
    org = ca_cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name, str(org[0].value) if org else "meshopt"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(min(end, ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def host_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    """SAN entries: IP addresses as IPAddress, everything else as a DNS name."""
    out: list[x509.GeneralName] = []
    for h in hosts:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            out.append(x509.DNSName(h))
    return out


def make_server_cert(
    ca_key: Key, ca_cert: x509.Certificate, hosts: Sequence[str], *, days: int = LEAF_DAYS
) -> tuple[Key, x509.Certificate]:
    """The broker's certificate, valid for every name and address clients connect to."""
    if not hosts:
        raise InputError("the broker certificate needs at least one --host")
    return _leaf(
        ca_key, ca_cert, hosts[0], ExtendedKeyUsageOID.SERVER_AUTH, host_names(hosts), days
    )


def make_client_cert(
    ca_key: Key, ca_cert: x509.Certificate, identity: str, *, days: int = LEAF_DAYS
) -> tuple[Key, x509.Certificate]:
    """A client certificate with CN = the identity (node name, controller id or reader)."""
    return _leaf(ca_key, ca_cert, identity, ExtendedKeyUsageOID.CLIENT_AUTH, [], days)


# --- files ------------------------------------------------------------------------------


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` with mode 0600 from the first byte (atomically replacing ``path``)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_key(path: Path, key: Key) -> None:
    write_private(
        path,
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )


def write_cert(path: Path, cert: x509.Certificate) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    tmp.chmod(0o644)
    os.replace(tmp, path)


def load_key(path: Path) -> Key:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise InputError(f"{path}: not a usable private key ({exc})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise InputError(f"{path}: not an EC key (made by another tool?)")
    return key


def load_cert(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: not a PEM certificate ({exc})") from None


def same_public_key(key: Key, cert: x509.Certificate) -> bool:
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    return key.public_key().public_bytes(*spki) == cert.public_key().public_bytes(*spki)


def issued_by(cert: x509.Certificate, ca_cert: x509.Certificate) -> bool:
    """True if ``ca_cert``'s key signed ``cert`` (and the names chain)."""
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True
