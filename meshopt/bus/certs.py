"""What the broker-settings check needs of X.509 files, without ``cryptography``.

Every agent checks its TLS files at start and on reload (bus.client); ``cryptography``'s
Rust extension, loaded for that one look, would stay in its memory (~7 MB RSS of a
~50 MB agent). OpenSSL through the ``ssl`` module (loaded anyway for TLS) parses the
certificates and matches the key to the certificate; the validity dates are read from
the certificate's DER here (a few fixed fields of RFC 5280's TBSCertificate).
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import re
import ssl
from dataclasses import dataclass
from typing import Literal

# One PEM block: its label, the text between, the closing label (pem-rfc7468).
_PEM_BLOCK = re.compile(rb"-----BEGIN ([^\r\n]*?)-----(.*?)-----END ([^\r\n]*?)-----", re.S)
_CERT_LABELS = (b"CERTIFICATE", b"X509 CERTIFICATE")
_SEQUENCE, _INTEGER, _VERSION, _UTC_TIME, _GENERALIZED_TIME = 0x30, 0x02, 0xA0, 0x17, 0x18


@dataclass(frozen=True)
class Certificate:
    """One certificate of a PEM file: its DER and validity (the two fields we check)."""

    der: bytes
    not_valid_before_utc: dt.datetime
    not_valid_after_utc: dt.datetime


def _item(der: bytes, pos: int, end: int) -> tuple[int, int, int]:
    """``(tag, content start, content end)`` of the DER item at ``pos``; ValueError when
    it does not fit before ``end``."""
    if pos + 2 > end:
        raise ValueError("truncated DER")
    tag, length = der[pos], der[pos + 1]
    pos += 2
    if length & 0x80:
        n = length & 0x7F
        if not 0 < n <= 4 or pos + n > end:
            raise ValueError("bad DER length")
        length = int.from_bytes(der[pos : pos + n], "big")
        pos += n
    if pos + length > end:
        raise ValueError("truncated DER")
    return tag, pos, pos + length


def _time(tag: int, raw: bytes) -> dt.datetime:
    """A UTCTime (YYMMDDHHMMSSZ, 1950-2049) or GeneralizedTime (YYYYMMDDHHMMSSZ) in UTC."""
    text = raw.decode("ascii")
    if tag == _UTC_TIME and len(text) == 13:
        year = int(text[:2])
        text = ("19" if year >= 50 else "20") + text
    elif tag != _GENERALIZED_TIME or len(text) != 15:
        raise ValueError("not a DER time")
    if not text[:14].isdigit() or text[14] != "Z":
        raise ValueError("not a DER time")
    mo, d, h, mi, s = (int(text[i : i + 2]) for i in range(4, 14, 2))
    return dt.datetime(int(text[:4]), mo, d, h, mi, s, tzinfo=dt.UTC)


def _validity(der: bytes) -> tuple[dt.datetime, dt.datetime]:
    """notBefore and notAfter of a DER certificate (RFC 5280 4.1); ValueError if malformed."""
    tag, start, end = _item(der, 0, len(der))
    if tag != _SEQUENCE or end != len(der):
        raise ValueError("not a DER certificate")
    tag, pos, tbs_end = _item(der, start, end)
    if tag != _SEQUENCE:
        raise ValueError("not a DER certificate")
    fields = [_SEQUENCE, _SEQUENCE, _SEQUENCE]  # signature algorithm, issuer, validity
    tag, _, after = _item(der, pos, tbs_end)
    if tag == _VERSION:
        pos = after
        tag, _, after = _item(der, pos, tbs_end)
    if tag != _INTEGER:  # serial number
        raise ValueError("not a DER certificate")
    pos = after
    for want in fields:
        tag, inner, after = _item(der, pos, tbs_end)
        if tag != want:
            raise ValueError("not a DER certificate")
        pos = after
    times = []
    at = inner  # inside Validity
    for _ in range(2):
        tag, s, e = _item(der, at, after)
        times.append(_time(tag, der[s:e]))
        at = e
    if at != after:
        raise ValueError("not a DER certificate")
    return times[0], times[1]


def load_pem_certificates(data: bytes) -> list[Certificate]:
    """Every certificate in PEM ``data`` (other blocks skipped); ValueError when a block is
    not base64, a certificate does not parse (OpenSSL's reading and ours), or there is none."""
    certs = []
    for m in _PEM_BLOCK.finditer(data):
        if m[1] != m[3]:
            raise ValueError("PEM labels do not match")
        if m[1] not in _CERT_LABELS:
            continue
        try:
            der = base64.b64decode(b"".join(m[2].split()), validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("PEM block is not base64") from None
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=der)
        except ssl.SSLError:
            raise ValueError("OpenSSL cannot read the certificate") from None
        try:
            before, after = _validity(der)
        except (UnicodeDecodeError, ValueError):
            raise ValueError("not a certificate") from None
        certs.append(Certificate(der, before, after))
    if not certs:
        raise ValueError("no certificate")
    return certs


class _Encrypted(Exception):
    """Raised by the password callback: OpenSSL asks for one only for an encrypted key."""


KeyPairProblem = Literal["encrypted", "not a key", "mismatch"]


def key_pair_problem(cert_file: str, key_file: str) -> KeyPairProblem | None:
    """None when ``key_file`` is the unencrypted PEM private key of ``cert_file``'s first
    certificate (OpenSSL's own check, as the TLS connection will make it); else why not.
    The files must be readable (the caller has read them); OSError otherwise."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)

    def refuse() -> str:
        raise _Encrypted

    try:
        ctx.load_cert_chain(cert_file, key_file, password=refuse)
    except _Encrypted:
        return "encrypted"
    except ssl.SSLError as exc:
        # A key of another type goes to another slot than the certificate's: "no
        # certificate assigned" to it.
        if exc.reason in ("KEY_VALUES_MISMATCH", "KEY_TYPE_MISMATCH", "NO_CERTIFICATE_ASSIGNED"):
            return "mismatch"
        return "not a key"
    return None
