"""The agent runs on every node: it must load only what the base install (no extras) has.

The base install's size and the agent's RSS (issue 13: <= 60 MB each) depend on it:
numpy alone is ~15 MB of every agent's memory and scipy, networkx, matplotlib, scapy,
zstandard and pyfastcdc are extras a node does not install. ``cryptography`` is a base
dependency (keygen, broker certificates) but its Rust extension is ~7 MB of RSS, so the
agent signs, verifies and derives WireGuard public keys on libsodium (PyNaCl) instead,
with the same bytes as ``cryptography`` (checked here).
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import math
import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from meshopt.broker.pki import make_ca, make_client_cert, write_cert, write_key
from meshopt.bus.certs import key_pair_problem, load_pem_certificates
from meshopt.bus.messages import AgentStatus
from meshopt.bus.signing import (
    KeyRing,
    PublicKey,
    SigningKey,
    key_id,
    load_private_key,
    load_public_key,
    load_signing_key,
    public_key_b64,
    save_private_key,
    sign,
    verify_status,
)
from meshopt.errors import InputError
from meshopt.wireguard.keys import key_from_bytes, public_key

REPO = Path(__file__).resolve().parents[2]

# Everything the agent process loads: the command, the daemon and what it imports on
# its way (config check, PMTU helper process, metrics, reload) where those exist; then
# what it does with keys while it runs: its identity key (PEM as keygen writes it, and
# a base64 seed), the controller keys (base64, PEM), a signed status message verified,
# and a WireGuard public key derived (wireguard-go's UAPI reports only the private key).
AGENT_CODE = r"""
import importlib, importlib.util, json, sys, click
import meshopt.cli.main as m
m.cli.get_command(click.Context(m.cli), 'agent')
for mod in ('meshopt.agent.daemon', 'meshopt.agent.config', 'meshopt.probe.pmtu',
            'meshopt.probe.icmp', 'meshopt.bus.client', 'meshopt.bus.signing',
            'meshopt.metrics', 'meshopt.metrics.agent', 'meshopt.metrics.server',
            'meshopt.metrics.statusfile', 'meshopt.reload'):
    if importlib.util.find_spec(mod.rpartition('.')[0] or mod) is None:
        continue
    if importlib.util.find_spec(mod) is not None:
        importlib.import_module(mod)
if len(sys.argv) > 1:
    from meshopt.bus.messages import AgentStatus
    from meshopt.bus.signing import KeyRing, key_id, load_public_key, load_signing_key
    from meshopt.bus.signing import sign, verify_status
    from meshopt.wireguard.keys import generate_private_key, public_key
    pem_key, seed_key, pem_pub, b64_pub = sys.argv[1:5]
    for path in (pem_key, seed_key):
        key = load_signing_key(path)
        ring = KeyRing([load_public_key(pem_pub), load_public_key(b64_pub), key.public_key()])
        st = AgentStatus(mesh="m", node="n", online=True, since=1.0, seq=1)
        assert verify_status(sign("status", st, key, key_id(key)), ring, mesh="m", node="n") == st
    public_key(generate_private_key())
    from meshopt.bus.client import BrokerSettings, check_broker_settings
    ca, cert, key = sys.argv[5:8]
    tls = BrokerSettings(url="mqtts://127.0.0.1", ca_file=ca, cert_file=cert, key_file=key)
    check_broker_settings(tls)
print(json.dumps(sorted(sys.modules)))
"""

# Loaded by the running agent: none of these (the test below lists what is).
AGENT_MUST_NOT_LOAD = {
    "cryptography",  # ~7 MB RSS: the agent's keys are on libsodium (PyNaCl)
    "numpy",
    "scipy",
    "networkx",
    "numba",  # the controller's compiled routes; llvmlite under it
    "llvmlite",
    "matplotlib",
    "scapy",
    "zstandard",
    "pyfastcdc",
    "yaml",
    "rich",
    "meshopt.controller",
    "meshopt.routing",
    "meshopt.sim",
    "meshopt.lab",
    "meshopt.topology",
    "meshopt.broker",
    "meshopt.transfer",  # only when [transfer] is enabled in the agent's config
    "meshopt.graph",
    "meshopt.picture",
    "meshopt.analysis",
    "meshopt.policy",
}


def _agent_modules(*argv: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", AGENT_CODE, *argv],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    mods: list[str] = json.loads(out.stdout)
    return mods


def _agent_top_modules() -> list[str]:
    return sorted({k.partition(".")[0] for k in _agent_modules()})


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _req_name(req: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    assert m is not None, req
    return _norm(m[1])


def _base_closure() -> set[str]:
    """The base dependencies of pyproject.toml and, installed, everything they require."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    todo = [_req_name(r) for r in project["dependencies"]]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [_req_name(r) for r in reqs if "extra ==" not in r and "extra==" not in r]
    return seen


def test_agent_command_imports_no_scipy_networkx_or_matplotlib() -> None:
    mods = set(_agent_top_modules())
    heavy = {"numpy", "scipy", "networkx", "matplotlib", "scapy", "zstandard", "pyfastcdc"}
    assert sorted(mods & heavy) == []


def test_agent_imports_only_base_distributions() -> None:
    """Every third-party module the agent loads belongs to a base dependency (or theirs)."""
    owners = metadata.packages_distributions()
    allowed = _base_closure()
    outside = {}
    for mod in _agent_top_modules():
        if mod in sys.stdlib_module_names or mod in ("meshopt", "__main__", "__mp_main__"):
            continue
        if mod.startswith(("__editable__", "_distutils_hack")):
            continue  # the dev venv's editable install and setuptools' hook
        dists = {_norm(d) for d in owners.get(mod, [])}
        if dists and not dists & allowed:
            outside[mod] = sorted(dists)
    assert outside == {}, f"the agent imports modules of non-base distributions: {outside}"


def test_warm_up_tables_agree_with_the_simulator() -> None:
    """The agent's numpy-free tables are the simulator's (to a rounding of numpy's pow)."""
    from meshopt.probe import stats
    from meshopt.sim import estimator

    assert stats._TABLE == estimator._TABLE
    for half_life, interval in ((2.0, 0.33), (0.5, 0.1), (10.0, 1.0), (0.0, 0.33)):
        a = stats.alpha_for(half_life, interval)
        assert a == estimator.alpha_for(half_life, interval)
        for av in (None, stats.alpha_for(stats.DEFAULT_JITTER_HALF_LIFE_S, interval)):
            share, gain = stats._warm_up_tables(a, av)
            np_share, np_gain = estimator._warm_up_tables(a, av)
            assert len(share) == len(np_share) == stats._TABLE
            both = zip([*share, *gain], [*np_share.tolist(), *np_gain.tolist()], strict=True)
            for x, y in both:
                assert math.isclose(x, y, rel_tol=1e-13, abs_tol=1e-300), (a, av, x, y)


@pytest.mark.parametrize("v6", [False, True])
@pytest.mark.parametrize("size", [0, 1, 7, 64, 1452])
def test_echo_requests_are_the_bytes_scapy_builds(v6: bool, size: int) -> None:
    scapy_inet = pytest.importorskip("scapy.layers.inet")
    from scapy.layers.inet6 import ICMPv6EchoRequest
    from scapy.packet import Raw

    from meshopt.probe.icmp import echo_request

    payload = os.urandom(size)
    for ident, seq in ((0, 0), (0xFFFF, 0xFFFF), (0x1234, 7)):
        if v6:
            want = bytes(ICMPv6EchoRequest(id=ident, seq=seq, cksum=0, data=payload))
        else:
            want = bytes(scapy_inet.ICMP(type=8, code=0, id=ident, seq=seq) / Raw(payload))
        assert echo_request(v6, ident, seq, payload) == want


@pytest.fixture
def agent_key_files(tmp_path: Path) -> list[str]:
    """An identity key as keygen writes it (PEM) and as a seed, controller keys as PEM and
    base64, the broker's CA and a client certificate and key: the files an agent reads."""
    identity = Ed25519PrivateKey.generate()
    pem_key = tmp_path / "agent.key"
    save_private_key(pem_key, identity)
    seed_key = tmp_path / "agent.seed"
    seed_key.write_text(base64.b64encode(identity.private_bytes_raw()).decode() + "\n")
    controller = Ed25519PrivateKey.generate().public_key()
    pem_pub = tmp_path / "controller.pub"
    spki = serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    pem_pub.write_bytes(controller.public_bytes(*spki))
    ca_key, ca_cert = make_ca("m")
    client_key, client_cert = make_client_cert(ca_key, ca_cert, "n1")
    write_cert(tmp_path / "ca.crt", ca_cert)
    write_cert(tmp_path / "client.crt", client_cert)
    write_key(tmp_path / "client.key", client_key)
    tls = [str(tmp_path / n) for n in ("ca.crt", "client.crt", "client.key")]
    return [str(pem_key), str(seed_key), str(pem_pub), public_key_b64(controller), *tls]


def test_running_agent_loads_none_of_the_modules_it_does_not_need(
    agent_key_files: list[str],
) -> None:
    """The diet must not regress: a module here costs every node memory (issue 13)."""
    loaded = set(_agent_modules(*agent_key_files))
    assert "meshopt.agent.daemon" in loaded and "nacl.signing" in loaded
    # A submodule loads its package first: the names themselves are enough to look for.
    assert sorted(AGENT_MUST_NOT_LOAD & loaded) == []


@pytest.mark.parametrize("form", ["pem", "seed"])
def test_signing_key_signs_what_cryptography_signs(tmp_path: Path, form: str) -> None:
    """Ed25519 is deterministic: libsodium's signature of a message is cryptography's."""
    ref = Ed25519PrivateKey.generate()
    path = tmp_path / "k"
    if form == "pem":
        save_private_key(path, ref)
    else:
        path.write_text(base64.b64encode(ref.private_bytes_raw()).decode())
    light = load_signing_key(path)
    assert isinstance(light, SigningKey)
    assert light.private_bytes_raw() == ref.private_bytes_raw()
    assert light.public_key().public_bytes_raw() == ref.public_key().public_bytes_raw()
    assert key_id(light) == key_id(ref) == key_id(public_key_b64(ref))
    assert public_key_b64(light) == public_key_b64(ref)
    for message in (b"", b"x", os.urandom(8000)):
        assert light.sign(message) == ref.sign(message)
    st = AgentStatus(mesh="m", node="n", online=True, since=2.0, seq=7)
    data = sign("status", st, light)
    assert data == sign("status", st, ref)
    assert verify_status(data, KeyRing([ref.public_key()]), mesh="m", node="n") == st
    assert verify_status(data, [public_key_b64(ref)], mesh="m", node="n") == st
    # load_private_key (the controller's) reads the same files to the same key.
    assert load_private_key(path).private_bytes_raw() == ref.private_bytes_raw()


def test_other_pem_forms_still_load_through_cryptography(tmp_path: Path) -> None:
    """Only the plain PEM takes the light path; any other text gets cryptography's
    answer, the same for the agent's loader and the controller's."""
    ref = Ed25519PrivateKey.generate()
    pem = ref.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    crlf = tmp_path / "crlf.key"
    crlf.write_bytes(pem.replace(b"\n", b"\r\n"))
    noted = tmp_path / "noted.key"
    noted.write_bytes(b"the node's key\n" + pem)
    for path in (crlf, noted):
        assert load_signing_key(path).private_bytes_raw() == ref.private_bytes_raw()
        assert load_private_key(path).private_bytes_raw() == ref.private_bytes_raw()
    ec_key = tmp_path / "ec.key"
    ec_key.write_bytes(
        ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    locked = tmp_path / "locked.key"
    locked.write_bytes(
        ref.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    truncated = tmp_path / "truncated.key"
    truncated.write_bytes(pem.replace(pem.splitlines()[1], pem.splitlines()[1][:-4]))
    for path, why in (
        (ec_key, "not an Ed25519 key"),
        (locked, "not an unencrypted PEM private key"),
        (truncated, "not an unencrypted PEM private key"),
    ):
        for loader in (load_signing_key, load_private_key):
            with pytest.raises(InputError, match=why):
                loader(path)
    spki = serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    pub = tmp_path / "k.pub"
    pub.write_bytes(ref.public_key().public_bytes(*spki).replace(b"\n", b"\r\n"))
    assert load_public_key(str(pub)) == PublicKey(ref.public_key().public_bytes_raw())
    pub.write_bytes(ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(*spki))
    with pytest.raises(InputError, match="not an Ed25519 key"):
        load_public_key(str(pub))


def test_wireguard_public_keys_are_cryptographys(tmp_path: Path) -> None:
    """X25519 on libsodium: the public key of any 32 bytes (clamped or not) is the one
    cryptography computes."""
    raws = [bytes(32), b"\xff" * 32, *(os.urandom(32) for _ in range(200))]
    for raw in raws:
        want = X25519PrivateKey.from_private_bytes(raw).public_key().public_bytes_raw()
        assert public_key(key_from_bytes(raw)) == key_from_bytes(want)


def _cert(key: Any, start: dt.datetime, end: dt.datetime, name: str = "n") -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, name)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
    )
    return builder.sign(key, None if isinstance(key, Ed25519PrivateKey) else hashes.SHA256())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _same_answer(data: bytes) -> None:
    """Our reading of PEM certificates is cryptography's: the same validity, or both refuse."""
    try:
        want = [
            (c.not_valid_before_utc, c.not_valid_after_utc)
            for c in x509.load_pem_x509_certificates(data)
        ]
    except ValueError:
        with pytest.raises(ValueError):
            load_pem_certificates(data)
        return
    got = [(c.not_valid_before_utc, c.not_valid_after_utc) for c in load_pem_certificates(data)]
    assert got == want


def test_certificate_validity_is_what_cryptography_reads() -> None:
    """The broker check's dates (expired, not yet valid) without cryptography in the agent:
    UTCTime and GeneralizedTime, every key type, chains, other blocks between."""
    utc = dt.UTC
    ec_key = ec.generate_private_key(ec.SECP256R1())
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ed_key = Ed25519PrivateKey.generate()
    spans = [
        (
            dt.datetime(2020, 1, 2, 3, 4, 5, tzinfo=utc),
            dt.datetime(2021, 6, 7, 8, 9, 10, tzinfo=utc),
        ),
        (dt.datetime(1950, 1, 1, tzinfo=utc), dt.datetime(1999, 12, 31, 23, 59, 59, tzinfo=utc)),
        (dt.datetime(2049, 12, 31, 23, 59, 59, tzinfo=utc), dt.datetime(2050, 1, 1, tzinfo=utc)),
        (
            dt.datetime(2024, 2, 29, 12, tzinfo=utc),
            dt.datetime(9999, 12, 31, 23, 59, 59, tzinfo=utc),
        ),
    ]
    pems = [_pem(_cert(k, a, b)) for k in (ec_key, rsa_key, ed_key) for a, b in spans]
    for pem in pems:
        _same_answer(pem)
    key_pem = ec_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    _same_answer(b"".join(pems))
    _same_answer(b"a chain\n" + pems[0] + key_pem + pems[5] + b"\r\n" + pems[9])
    _same_answer(pems[0].replace(b"\n", b"\r\n"))
    _same_answer(pems[0].replace(b"CERTIFICATE", b"X509 CERTIFICATE"))


@pytest.mark.parametrize(
    "damage",
    ["none", "no-block", "key-only", "not-base64", "random", "truncated", "trailing", "labels"],
)
def test_broken_certificates_are_refused_like_cryptography_does(damage: str) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    pem = _pem(_cert(key, now, now + dt.timedelta(days=1)))
    body = pem.splitlines()[1:-1]
    der = base64.b64decode(b"".join(body))

    def wrap(raw: bytes, label: bytes = b"CERTIFICATE", end: bytes = b"CERTIFICATE") -> bytes:
        text = base64.encodebytes(raw)
        return b"-----BEGIN " + label + b"-----\n" + text + b"-----END " + end + b"-----\n"

    data = {
        "none": pem,
        "no-block": b"hello\n",
        "key-only": key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
        "not-base64": b"-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n",
        "random": wrap(os.urandom(len(der))),
        "truncated": wrap(der[:-10]),
        "trailing": wrap(der + b"\0"),
        "labels": wrap(der, end=b"X509 CERTIFICATE"),
    }[damage]
    _same_answer(data)


def test_key_pair_problems_are_the_ones_cryptography_finds(tmp_path: Path) -> None:
    """Key matches certificate, another key, another type, encrypted, or no key at all."""
    now = dt.datetime.now(dt.UTC)
    ec_key = ec.generate_private_key(ec.SECP256R1())
    cert = tmp_path / "c.crt"
    cert.write_bytes(_pem(_cert(ec_key, now, now + dt.timedelta(days=1))))
    pkcs8 = serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8
    keys = {
        "own": ec_key.private_bytes(*pkcs8, serialization.NoEncryption()),
        "other": ec.generate_private_key(ec.SECP256R1()).private_bytes(
            *pkcs8, serialization.NoEncryption()
        ),
        "rsa": rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
            *pkcs8, serialization.NoEncryption()
        ),
        "locked": ec_key.private_bytes(*pkcs8, serialization.BestAvailableEncryption(b"pw")),
        "traditional-locked": ec_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.BestAvailableEncryption(b"pw"),
        ),
        "cert": cert.read_bytes(),
        "garbage": b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
    }
    want = {
        "own": None,
        "other": "mismatch",
        "rsa": "mismatch",
        "locked": "encrypted",
        "traditional-locked": "encrypted",
        "cert": "not a key",
        "garbage": "not a key",
    }
    for name, data in keys.items():
        path = tmp_path / f"{name}.key"
        path.write_bytes(data)
        assert key_pair_problem(str(cert), str(path)) == want[name], name
