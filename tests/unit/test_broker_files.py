"""``meshopt broker init`` and what it writes: the CA and certificates, mosquitto's
password file, ACL and config, the clients' files; and the [broker] config table.

No broker here: tests/unit/test_bus_tls.py runs the same files in a real mosquitto.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import shutil
import stat
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from meshopt.agent.config import parse_config
from meshopt.broker import pki
from meshopt.broker.mosquitto import (
    MAX_PACKET_SIZE,
    BrokerRequest,
    Identity,
    acl_text,
    hash_password,
    make_identities,
    parse_passwd,
    verify_password,
    write_broker_dir,
)
from meshopt.bus.client import BrokerSettings, check_broker_settings, client_kwargs
from meshopt.bus.messages import MAX_PAYLOAD_BYTES
from meshopt.cli.main import main
from meshopt.errors import InputError

REPO = Path(__file__).resolve().parents[2]
LAB4 = REPO / "topologies" / "lab4.yaml"


def request(**kw: Any) -> BrokerRequest:
    base: dict[str, Any] = {
        "mesh": "m",
        "identities": tuple(make_identities(["a", "b"], ["ctl1"], ["viewer"])),
        "hosts": ("broker.example", "10.0.0.1"),
    }
    return BrokerRequest(**{**base, **kw})


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("broker") / "out"
    write_broker_dir(request(), out)
    return out


def cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def meshopt(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --- the PKI -----------------------------------------------------------------------------


def test_layout(made: Path) -> None:
    files = sorted(str(p.relative_to(made)) for p in made.rglob("*") if p.is_file())
    assert "ca.crt" in files and "ca.key" in files
    for f in ("mosquitto.conf", "ca.crt", "server.crt", "server.key", "passwd", "acl"):
        assert f"broker/{f}" in files
    for who in ("a", "b", "ctl1", "viewer"):
        for f in ("ca.crt", "client.crt", "client.key", "password", "broker.toml"):
            assert f"clients/{who}/{f}" in files
    assert not [f for f in files if f.endswith(".tmp")]


def test_private_files_are_0600_and_directories_0700(made: Path) -> None:
    private = [made / "ca.key", made / "broker/server.key", made / "broker/passwd"]
    private += [made / "broker/acl"]
    for who in ("a", "ctl1", "viewer"):
        private += [made / "clients" / who / "client.key", made / "clients" / who / "password"]
    for p in private:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    for d in (made, made / "broker", made / "clients", made / "clients" / "a"):
        assert stat.S_IMODE(d.stat().st_mode) & 0o077 == 0, d
    assert stat.S_IMODE((made / "ca.crt").stat().st_mode) == 0o644


def test_certificates_chain_to_the_ca(made: Path) -> None:
    ca = cert(made / "ca.crt")
    bc = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca and bc.value.path_length == 0
    ca.verify_directly_issued_by(ca)  # self-signed
    leaves = [made / "broker/server.crt"] + [made / f"clients/{w}/client.crt" for w in "ab"]
    for path in leaves:
        c = cert(path)
        c.verify_directly_issued_by(ca)
        assert not c.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        aki = c.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
        ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        assert aki.key_identifier == ski.digest
    for who in ("a", "ctl1"):
        assert (made / "clients" / who / "ca.crt").read_bytes() == (made / "ca.crt").read_bytes()
    # Another CA does not vouch for them.
    _, other = pki.make_ca("other")
    assert not pki.issued_by(cert(made / "clients/a/client.crt"), other)


def test_server_certificate_names_every_host(made: Path) -> None:
    c = cert(made / "broker/server.crt")
    san = c.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["broker.example"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.1")]
    eku = c.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]


def test_client_certificates_carry_their_identity(made: Path) -> None:
    for who in ("a", "ctl1", "viewer"):
        c = cert(made / "clients" / who / "client.crt")
        assert c.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == who
        eku = c.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
        key = pki.load_key(made / "clients" / who / "client.key")
        assert pki.same_public_key(key, c)


def test_client_files_pass_our_own_check(made: Path) -> None:
    toml = tomllib.loads((made / "clients/a/broker.toml").read_text())["broker"]
    assert toml["url"] == "mqtts://broker.example:8883" and toml["username"] == "a"
    d = made / "clients" / "a"
    settings = BrokerSettings(
        url="mqtts://broker.example:8883",
        ca_file=str(d / "ca.crt"),
        cert_file=str(d / "client.crt"),
        key_file=str(d / "client.key"),
        username="a",
        password_file=str(d / "password"),
    )
    address = check_broker_settings(settings)
    assert (address.username, address.password) == ("a", (d / "password").read_text().strip())
    kwargs = client_kwargs(settings)
    assert kwargs["hostname"] == "broker.example" and kwargs["port"] == 8883
    assert kwargs["tls_context"] is not None and kwargs["tls_context"].check_hostname


# --- passwords -----------------------------------------------------------------------------


def test_passwd_verifies_every_identity(made: Path) -> None:
    hashes = parse_passwd((made / "broker/passwd").read_text())
    assert set(hashes) == {"a", "b", "ctl1", "viewer"}
    for who, hashed in hashes.items():
        password = (made / "clients" / who / "password").read_text().splitlines()[0]
        assert len(password) >= 40
        assert hashed.startswith("$7$101$")
        assert verify_password(password, hashed)
        assert not verify_password(password + "x", hashed)
    passwords = {(made / "clients" / w / "password").read_text() for w in hashes}
    assert len(passwords) == len(hashes)


def test_hash_format_is_mosquittos() -> None:
    """PBKDF2-SHA512, base64 salt and digest: what mosquitto_passwd writes."""
    salt = bytes(range(12))
    h = hash_password("s3cret", salt=salt, iterations=101)
    _, seven, it, s, d = h.split("$")
    assert (seven, it, base64.b64decode(s)) == ("7", "101", salt)
    assert base64.b64decode(d) == hashlib.pbkdf2_hmac("sha512", b"s3cret", salt, 101, 64)
    for bad in ("", "$7$", "$7$x$y$z", "$7$101$!!$!!", "plain"):
        assert not verify_password("s3cret", bad)


def test_mosquitto_passwd_hashes_verify(tmp_path: Path) -> None:
    """Both ways: our verify takes a hash made by the real mosquitto_passwd."""
    tool = shutil.which("mosquitto_passwd")
    if tool is None:
        pytest.skip("mosquitto_passwd is not installed")
    f = tmp_path / "pw"
    subprocess.run([tool, "-b", "-c", str(f), "alice", "s3cret"], check=True, timeout=10)
    hashed = parse_passwd(f.read_text())["alice"]
    assert verify_password("s3cret", hashed) and not verify_password("s3cre", hashed)


# --- ACL and conf --------------------------------------------------------------------------


def test_acl_binds_each_identity_to_its_topics(made: Path) -> None:
    acl = (made / "broker/acl").read_text()
    assert acl == acl_text("m", make_identities(["a", "b"], ["ctl1"], ["viewer"]))
    rules = [ln for ln in acl.splitlines() if ln and not ln.startswith("#")]
    blocks: dict[str, list[str]] = {}
    current = None
    for line in rules:
        if line.startswith("user "):
            current = line.split()[1]
            blocks[current] = []
        else:
            assert current is not None, f"a rule for anonymous clients: {line}"
            blocks[current].append(line)
    assert not any(ln.startswith("pattern") for ln in rules)
    assert blocks["a"] == [
        "topic write meshopt/m/telemetry/a",
        "topic write meshopt/m/status/a",
        "topic read meshopt/m/routes/a",
    ]
    assert blocks["ctl1"] == [
        "topic read meshopt/m/telemetry/+",
        "topic read meshopt/m/status/+",
        "topic readwrite meshopt/m/routes/+",
        "topic read meshopt/m/controller/#",
        "topic write meshopt/m/controller/lease",
        "topic write meshopt/m/controller/status/ctl1",
    ]
    assert blocks["viewer"] == ["topic read meshopt/m/#"]
    admin = acl_text("m", [Identity("ops", "admin")])
    assert "user ops\ntopic readwrite meshopt/m/#" in admin


def test_mosquitto_conf(made: Path) -> None:
    conf = (made / "broker/mosquitto.conf").read_text()
    lines = conf.splitlines()
    for want in (
        "per_listener_settings true",
        "listener 8883",
        "cafile /etc/mosquitto/meshopt/ca.crt",
        "certfile /etc/mosquitto/meshopt/server.crt",
        "keyfile /etc/mosquitto/meshopt/server.key",
        "require_certificate true",
        "use_identity_as_username false",
        "tls_version tlsv1.2",
        "allow_anonymous false",
        "password_file /etc/mosquitto/meshopt/passwd",
        "acl_file /etc/mosquitto/meshopt/acl",
        "persistence true",
        "persistence_location /var/lib/mosquitto/",
        f"max_packet_size {MAX_PACKET_SIZE}",
    ):
        assert want in lines, want
    assert MAX_PACKET_SIZE > MAX_PAYLOAD_BYTES
    assert "allow_anonymous true" not in conf
    # per_listener_settings: the listener's auth settings come after its listener line.
    assert lines.index("listener 8883") < lines.index("allow_anonymous false")


def test_lab_style_conf_names_files_where_written(tmp_path: Path) -> None:
    out = tmp_path / "pki"
    sock = tmp_path / "mq.sock"
    write_broker_dir(
        request(install_dir="", client_dir="", unix_socket=str(sock), persistence_dir=""),
        out,
    )
    conf = (out / "broker/mosquitto.conf").read_text().splitlines()
    assert f"cafile {(out / 'broker/ca.crt').resolve()}" in conf
    assert f"listener 0 {sock}" in conf and "persistence false" in conf
    after = conf[conf.index(f"listener 0 {sock}") :]
    assert after[1:] == [
        "allow_anonymous false",
        f"password_file {(out / 'broker/passwd').resolve()}",
        f"acl_file {(out / 'broker/acl').resolve()}",
    ]
    toml = tomllib.loads((out / "clients/b/broker.toml").read_text())["broker"]
    assert toml["key_file"] == str((out / "clients/b/client.key").resolve())


# --- re-runs -------------------------------------------------------------------------------


def test_rerun_keeps_the_ca_and_identities_and_adds(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_broker_dir(request(), out)
    ca_before = (out / "ca.crt").read_bytes()
    a_before = (out / "clients/a/client.crt").read_bytes(), (out / "clients/a/password").read_text()
    with pytest.raises(InputError, match="not empty: use --force"):
        write_broker_dir(request(identities=(Identity("c", "node"),)), out)
    files = write_broker_dir(request(identities=(Identity("c", "node"),)), out, force=True)
    assert (
        files.ca_reused and files.new == ["c"] and set(files.kept) == {"a", "b", "ctl1", "viewer"}
    )
    assert (out / "ca.crt").read_bytes() == ca_before
    a_after = (out / "clients/a/client.crt").read_bytes(), (out / "clients/a/password").read_text()
    assert a_after == a_before
    assert set(parse_passwd((out / "broker/passwd").read_text())) == {
        "a",
        "b",
        "c",
        "ctl1",
        "viewer",
    }
    assert "user c\n" in (out / "broker/acl").read_text()
    assert json.loads((out / "meshopt-broker.json").read_text())["identities"]["c"] == "node"
    with pytest.raises(InputError, match=r"is a node in .* already, not a controller"):
        write_broker_dir(request(identities=(Identity("c", "controller"),)), out, force=True)
    with pytest.raises(InputError, match="is for mesh 'm', not 'n'"):
        write_broker_dir(request(mesh="n"), out, force=True)


def test_rerun_replaces_an_identity_whose_files_are_broken(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_broker_dir(request(), out)
    (out / "clients/b/client.key").write_text("garbage")
    files = write_broker_dir(request(identities=(Identity("b", "node"),)), out, force=True)
    assert files.new == ["b"]
    key = pki.load_key(out / "clients/b/client.key")
    assert pki.same_public_key(key, cert(out / "clients/b/client.crt"))


# --- names and the CLI ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nodes", "controllers", "message"),
    [
        (["a", "a"], [], "'a' given twice"),
        (["a"], ["a"], "'a' given as a node and as a controller"),
        (["a b"], [], "bad node name 'a b'"),
        (["x" * 65], [], "bad node name"),
        ([], ["ctl/1"], "bad controller name 'ctl/1'"),
        (["a+"], [], "bad node name"),
    ],
)
def test_bad_identities_are_refused(nodes: list[str], controllers: list[str], message: str) -> None:
    with pytest.raises(InputError, match=message):
        make_identities(nodes, controllers, [])


def test_cli_init_writes_and_summarises(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, stdout, err = meshopt(
        capsys, "broker", "init", "--mesh", "prod", "--topology", str(LAB4), "--node", "extra",
        "--controller", "ctl1", "--controller", "ctl2", "--reader", "viewer",
        "--host", "broker.example", "--host", "10.0.0.1", "--port", "8884", "--out", str(out),
    )  # fmt: skip
    assert (code, err) == (0, "")
    assert f"wrote {out}" in stdout and "mqtts://broker.example:8884" in stdout
    assert "ca.key" in stdout and "/etc/mosquitto/meshopt" in stdout
    users = set(parse_passwd((out / "broker/passwd").read_text()))
    assert users == {"n1", "n2", "n3", "n4", "extra", "ctl1", "ctl2", "viewer"}
    assert "listener 8884" in (out / "broker/mosquitto.conf").read_text().splitlines()


def test_cli_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "o"
    argv = ["broker", "init", "--mesh", "m", "--node", "a", "--host", "h", "--out", str(out)]
    code, stdout, _ = meshopt(capsys, *argv, "--json")
    assert code == 0
    d = json.loads(stdout)
    assert d["url"] == "mqtts://h:8883" and d["new"] == ["a"] and not d["ca_reused"]
    code, stdout, _ = meshopt(capsys, *argv[:-4], "--node", "b", *argv[-4:], "--force", "--json")
    d = json.loads(stdout)
    assert code == 0 and d["ca_reused"] and d["new"] == ["b"] and d["kept"] == ["a"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--node", "n1", "--controller", "n1"],
            "identity 'n1' given as a node and as a controller",
        ),
        (["--node", "bad name"], "bad node name 'bad name'"),
        (["--node", "a", "--node", "a"], "given twice"),
        (["--node", "ümlaut"], "bad node name"),
        (["--node", "a", "--mesh", "m/x"], "bad mesh name"),
        (["--node", "a", "--host", "bad/host"], "bad --host 'bad/host'"),
        (["--node", "a", "--port", "0"], "--port 0"),
        ([], "no identities"),
        (["--topology", "/nonexistent.yaml"], "nonexistent"),
    ],
)
def test_cli_refuses_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, extra: list[str], message: str
) -> None:
    argv = ["broker", "init", "--mesh", "m", "--host", "h", "--out", str(tmp_path / "o")]
    code, stdout, err = meshopt(capsys, *argv, *extra)
    assert code == 2 and stdout == ""
    assert err.startswith("meshopt: error: ") and err.count("\n") == 1, err
    assert message in err
    assert "Traceback" not in err


def test_cli_refuses_a_non_empty_directory(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "something").write_text("x")
    argv = ["broker", "init", "--mesh", "m", "--node", "a", "--host", "h", "--out", str(out)]
    code, _, err = meshopt(capsys, *argv)
    assert code == 2 and "is not empty: use --force" in err and err.count("\n") == 1
    assert meshopt(capsys, *argv, "--force")[0] == 0


# --- the [broker] config table ---------------------------------------------------------------


def agent(**broker: Any) -> dict[str, Any]:
    return {"agent": {"mesh": "m", "node": "a"}, "broker": broker}


def test_agent_broker_table_and_default_user_name(made: Path) -> None:
    d = made / "clients" / "a"
    cfg = parse_config(
        agent(
            url="mqtts://broker.example",
            ca_file=str(d / "ca.crt"),
            cert_file=str(d / "client.crt"),
            key_file=str(d / "client.key"),
            password_file=str(d / "password"),
        )
    )
    assert cfg.broker.username == "a"  # the node name, as broker init made the user
    assert cfg.broker.url == "mqtts://broker.example"
    short = parse_config({"agent": {"mesh": "m", "node": "a", "broker": "mqtt://h:1884"}})
    assert short.broker == BrokerSettings(url="mqtt://h:1884")
    # No password file: no user name invented.
    assert parse_config(agent(url="mqtt://h")).broker.username == ""


def test_controller_broker_table_and_default_user_name(made: Path) -> None:
    from meshopt.bus.signing import generate_signing_key
    from meshopt.controller.config import parse_controller_config

    d = made / "clients" / "ctl1"
    top = {"mesh": "m", "id": "ctl1", "signing_key": "/k"}
    data: dict[str, Any] = {
        "controller": top,
        "node_keys": {"a": generate_signing_key()[1]},
        "broker": {"url": "mqtt://h", "password_file": str(d / "password")},
    }
    cfg = parse_controller_config(data)
    assert cfg.broker.username == "ctl1"
    with pytest.raises(InputError, match="not both"):
        parse_controller_config({**data, "controller": {**top, "broker": "mqtt://h"}})


@pytest.mark.parametrize(
    ("broker", "message"),
    [
        ({"url": "mqtt://h", "ca_file": "/x/ca.crt"}, "broker.ca_file is set but broker.url"),
        ({"url": "mqtts://h", "ca_file": "/nonexistent/ca.crt"}, "no such file"),
        ({"url": "mqtts://h", "cert_file": "CERT"}, "broker.cert_file needs broker.key_file"),
        ({"url": "mqtts://h", "ca_file": "KEY"}, "not a PEM certificate"),
        ({"url": "mqtts://h", "cert_file": "CERT", "key_file": "CERT"}, "not a PEM private key"),
        ({"url": "mqtts://h", "cert_file": "CERT", "key_file": "OTHERKEY"}, "not the key of"),
        ({"url": "mqtt://h", "password_file": "EMPTY"}, "empty"),
        ({"url": "mqtt://h", "password_file": "/nonexistent"}, "no such file"),
        ({"url": "ftp://h"}, "broker.url"),
        ({"url": "mqtt://h", "colour": "x"}, "unknown key broker.colour"),
        ({"url": 1883}, "broker.url must be a string"),
    ],
)
def test_bad_broker_settings_are_one_line(
    made: Path, tmp_path: Path, broker: dict[str, Any], message: str
) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    names = {
        "CERT": str(made / "clients/a/client.crt"),
        "KEY": str(made / "clients/a/client.key"),
        "OTHERKEY": str(made / "clients/b/client.key"),
        "EMPTY": str(empty),
    }
    broker = {k: names.get(v, v) if isinstance(v, str) else v for k, v in broker.items()}
    with pytest.raises(InputError, match=message) as info:
        parse_config(agent(**broker), source="agent.toml")
    assert "\n" not in str(info.value) and str(info.value).startswith("agent.toml: ")


def test_both_broker_forms_are_refused() -> None:
    data = {"agent": {"mesh": "m", "node": "a", "broker": "mqtt://h"}, "broker": {"url": "x"}}
    with pytest.raises(InputError, match=r"\[agent\] broker or as a \[broker\] table, not both"):
        parse_config(data)


def test_group_readable_password_file_is_only_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pw = tmp_path / "pw"
    pw.write_text("secret\n")
    pw.chmod(0o644)
    with caplog.at_level("WARNING", logger="meshopt.bus"):
        address = check_broker_settings(
            BrokerSettings(url="mqtt://h", username="u", password_file=str(pw))
        )
    assert address.password == "secret"
    assert "readable by group or others" in caplog.text


def test_live_cli_checks_credentials_before_connecting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = meshopt(
        capsys, "routes", "--broker", "mqtts://127.0.0.1:1", "--ca-file", "/nonexistent/ca.crt"
    )
    assert code == 2 and err.count("\n") == 1
    assert "--ca-file /nonexistent/ca.crt: no such file" in err
    code, _, err = meshopt(capsys, "routes", "--broker", "mqtt://h:1", "--cert-file", "/x")
    assert code == 2 and "--cert-file is set but --broker mqtt://h:1 is not mqtts://" in err


def test_committed_example_is_what_the_command_writes(tmp_path: Path) -> None:
    """agents/broker/ holds the public part of one run (no keys, no passwords)."""
    example = REPO / "agents" / "broker"
    out = tmp_path / "o"
    argv = ["broker", "init", "--mesh", "prod", "--node", "fra", "--node", "ams",
            "--node", "nyc", "--controller", "ctl1", "--controller", "ctl2",
            "--reader", "viewer", "--host", "broker.example", "--host", "10.0.0.1",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    for name, made in (
        ("mosquitto.conf", out / "broker/mosquitto.conf"),
        ("acl", out / "broker/acl"),
        ("fra.broker.toml", out / "clients/fra/broker.toml"),
    ):
        assert (example / name).read_text() == made.read_text(), name
    assert sorted(p.name for p in example.iterdir()) == [
        "README.md",
        "acl",
        "fra.broker.toml",
        "mosquitto.conf",
    ]
