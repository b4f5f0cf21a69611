"""Everything mosquitto needs for one mesh: config, password file, ACL, and client files.

``meshopt broker init`` and the lab both go through :func:`write_broker_dir`, so the
lab runs exactly what an operator installs (DESIGN.md: "The lab runs exactly this
configuration"). Layout of the directory::

    ca.crt ca.key                    the CA (keep ca.key offline; it mints identities)
    broker/                          for the broker host
      mosquitto.conf ca.crt server.crt server.key passwd acl
    clients/<identity>/              for the node, controller or reader of that name
      ca.crt client.crt client.key password broker.toml
    meshopt-broker.json              what was asked for: mesh, hosts, identities

Identities: every node (user name = node name), controllers (their id), readers
(tools such as ``meshopt routes``), admins (read and write all of the mesh's topics:
for an operator clearing a removed node's retained messages; keep them off the nodes) and
bridges (another region's broker logged in here: it may write exactly the telemetry and
status of its region's nodes, read their route sets, the lease and the controllers'
status, and write its own link state; see
meshopt/broker/bridge.py, which also writes the bridge section into that broker's conf).
Each needs both its certificate (the TLS listener has ``require_certificate true``) and
its password (``use_identity_as_username false``: the user name, which the ACL keys on,
comes from the password check, not from the certificate, so a certificate alone gets
nobody in and a password alone neither).

The ACL gives every node an explicit ``user`` block rather than ``pattern ... %u``
lines: mosquitto applies patterns to every user, so a pattern granting
``telemetry/%u`` would let a reader or a controller publish telemetry under its own
name and appear as a node. Explicit blocks fail closed.

Password file: mosquitto 2.0's ``$7$`` format, PBKDF2-HMAC-SHA512 with a 12-byte salt
and 101 iterations (what ``mosquitto_passwd`` writes; checked against mosquitto 2.0.11
in tests/unit/test_bus_tls.py). The passwords are 32 random bytes, so the iteration
count is no defence that matters, and a higher one only costs CPU per CONNECT.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

from cryptography import x509
from cryptography.x509.oid import NameOID

from meshopt.broker import pki
from meshopt.bus.messages import MAX_PAYLOAD_BYTES
from meshopt.errors import InputError

Role = Literal["node", "controller", "reader", "admin", "bridge"]
ROLES: Final[tuple[Role, ...]] = ("node", "controller", "reader", "admin", "bridge")
NAME_RE: Final = re.compile(r"[A-Za-z0-9_.-]{1,64}")
PBKDF2_ITERATIONS: Final = 101
SALT_BYTES: Final = 12
# The largest MQTT packet the broker takes (a client sending more is disconnected;
# mosquitto 2.0.11 recommends this over message_size_limit). Twice meshopt's payload
# limit: the daemons' decoders enforce that limit themselves and count what they refuse,
# so a somewhat oversized message is seen and counted rather than vanishing at the
# broker, while the broker still bounds what one client can make it hold.
MAX_PACKET_SIZE: Final = 2 * MAX_PAYLOAD_BYTES
MANIFEST: Final = "meshopt-broker.json"
DEFAULT_INSTALL_DIR: Final = "/etc/mosquitto/meshopt"
DEFAULT_CLIENT_DIR: Final = "/etc/meshopt/broker"
RENEW_BEFORE: Final = dt.timedelta(days=30)  # re-runs replace certificates this close to expiry


@dataclass(frozen=True)
class Identity:
    name: str
    role: Role
    nodes: tuple[str, ...] = ()  # a bridge's: the nodes whose topics it forwards


def check_identity_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise InputError(f"bad {what} {name!r}: use 1-64 characters of A-Z a-z 0-9 _ . -")
    return name


def make_identities(
    nodes: Sequence[str],
    controllers: Sequence[str],
    readers: Sequence[str] = (),
    admins: Sequence[str] = (),
    bridges: Mapping[str, Sequence[str]] | None = None,
) -> list[Identity]:
    """Checked identities, nodes first; InputError for a bad or twice-used name.

    ``bridges`` maps a bridge's name to the nodes of its region (the brokers it links
    forward exactly those nodes' topics, and its ACL allows exactly those).
    """
    out: list[Identity] = []
    seen: dict[str, Role] = {}
    groups: tuple[tuple[Role, Sequence[str]], ...] = (
        ("node", nodes),
        ("controller", controllers),
        ("reader", readers),
        ("admin", admins),
        ("bridge", list(bridges or {})),
    )
    for role, names in groups:
        for name in names:
            check_identity_name(name, f"{role} name")
            if name in seen:
                first = seen[name]
                twice = "twice" if first == role else f"as a {first} and as a {role}"
                raise InputError(f"identity {name!r} given {twice}: every identity needs its own")
            seen[name] = role
            out.append(Identity(name, role, _bridge_nodes(name, (bridges or {}).get(name))))
    return out


def _bridge_nodes(name: str, nodes: Sequence[str] | None) -> tuple[str, ...]:
    if nodes is None:
        return ()
    if isinstance(nodes, str) or not nodes:
        raise InputError(f"bridge {name!r}: give the nodes of its region (at least one)")
    for node in nodes:
        check_identity_name(node, f"node name (bridge {name!r})")
    return tuple(dict.fromkeys(nodes))


# --- password file -----------------------------------------------------------------------


def hash_password(
    password: str, *, salt: bytes | None = None, iterations: int = PBKDF2_ITERATIONS
) -> str:
    """mosquitto 2.0's ``$7$iterations$salt$hash`` (PBKDF2-HMAC-SHA512, base64)."""
    salt = secrets.token_bytes(SALT_BYTES) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations, 64)
    b64 = base64.b64encode
    return f"$7${iterations}${b64(salt).decode()}${b64(digest).decode()}"


def verify_password(password: str, hashed: str) -> bool:
    """True if ``password`` matches a ``$7$`` (or mosquitto 1.x ``$6$``) hash."""
    parts = hashed.split("$")
    try:
        if len(parts) == 5 and parts[1] == "7":
            iterations, salt, digest = int(parts[2]), parts[3], parts[4]
            raw = base64.b64decode(digest, validate=True)
            salt_b = base64.b64decode(salt, validate=True)
            if not raw or iterations < 1:
                return False
            got = hashlib.pbkdf2_hmac("sha512", password.encode(), salt_b, iterations, len(raw))
            return hmac.compare_digest(got, raw)
        if len(parts) == 4 and parts[1] == "6":
            salt_b = base64.b64decode(parts[2], validate=True)
            raw = base64.b64decode(parts[3], validate=True)
            got = hashlib.sha512(password.encode() + salt_b).digest()
            return hmac.compare_digest(got, raw)
    except (ValueError, TypeError):
        return False
    return False


def new_password() -> str:
    return secrets.token_urlsafe(32)


def passwd_text(passwords: Mapping[str, str]) -> str:
    """mosquitto's ``password_file``: ``user:$7$...`` per line."""
    return "".join(f"{user}:{hash_password(pw)}\n" for user, pw in passwords.items())


def parse_passwd(text: str) -> dict[str, str]:
    """user -> hash, from a password file (for checks and tests)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            user, _, hashed = line.partition(":")
            out[user] = hashed
    return out


# --- ACL -----------------------------------------------------------------------------------


def acl_text(mesh: str, identities: Sequence[Identity]) -> str:
    """The ``acl_file``: each identity gets exactly its topics (see the module docstring)."""
    check_identity_name(mesh, "mesh name")
    p = f"meshopt/{mesh}"
    lines = [
        f"# mosquitto ACL for meshopt mesh {mesh!r}, written by `meshopt broker init`.",
        "# No topic lines before the first user: anonymous clients get nothing.",
        "# Nodes: explicit user blocks, not `pattern ... %u` (mosquitto applies patterns",
        "# to every user, so a reader would gain a node's rights under its own name).",
        "",
    ]
    for ident in identities:
        name = ident.name
        lines.append(f"user {name}")
        if ident.role == "node":
            lines += [
                f"topic write {p}/telemetry/{name}",
                f"topic write {p}/status/{name}",  # also its will
                f"topic read {p}/routes/{name}",
            ]
        elif ident.role == "controller":
            lines += [
                f"topic read {p}/telemetry/+",
                f"topic read {p}/status/+",
                f"topic readwrite {p}/routes/+",
                f"topic read {p}/controller/#",
                f"topic write {p}/controller/lease",
                f"topic write {p}/controller/status/{name}",
            ]
        elif ident.role == "reader":
            lines.append(f"topic read {p}/#")
        elif ident.role == "bridge":  # exactly what the bridge section forwards
            for node in ident.nodes:
                lines += [
                    f"topic write {p}/telemetry/{node}",
                    f"topic write {p}/status/{node}",
                    f"topic read {p}/routes/{node}",
                ]
            lines += [
                f"topic read {p}/controller/lease",  # for the region's tools (and standbys)
                f"topic read {p}/controller/status/+",
                f"topic write {p}/bridge/{name}",  # its link state (and will)
            ]
        else:  # admin: clears a removed node's retained messages, for instance
            lines.append(f"topic readwrite {p}/#")
        lines.append("")
    return "\n".join(lines)


# --- mosquitto.conf ------------------------------------------------------------------------


@dataclass(frozen=True)
class ListenerFiles:
    """Paths as the broker sees them."""

    cafile: str
    certfile: str
    keyfile: str
    password_file: str
    acl_file: str


def conf_text(
    files: ListenerFiles,
    *,
    mesh: str,
    port: int = 8883,
    bind_address: str = "",
    unix_socket: str = "",
    persistence_dir: str = "/var/lib/mosquitto/",
    run_as: str = "",
    log_dest: str = "syslog",
) -> str:
    """A complete mosquitto.conf: one TLS listener (and a plain unix socket, if given).

    ``per_listener_settings true`` so each listener states its own authentication: a
    listener added later by hand does not silently inherit (or lose) it.
    """
    lines = [
        f"# mosquitto.conf for meshopt mesh {mesh!r}, written by `meshopt broker init`.",
        "# Needs mosquitto >= 2.0 (it reads the files below as the user it runs as).",
        "per_listener_settings true",
    ]
    if run_as:
        lines.append(f"user {run_as}")
    if persistence_dir:
        lines += ["persistence true", f"persistence_location {persistence_dir}"]
    else:
        lines.append("persistence false")
    lines += [f"log_dest {log_dest}", "log_type error", "log_type warning", "log_type notice"]
    lines += [
        "# meshopt refuses (and counts) payloads above 256 KiB itself; twice that here lets",
        "# it see and count what it refuses, while bounding what a client can make us hold.",
        f"max_packet_size {MAX_PACKET_SIZE}",
        "",
        "# TLS: clients need a certificate from ca.crt AND their user name and password.",
        f"listener {port}{' ' + bind_address if bind_address else ''}",
        f"cafile {files.cafile}",
        f"certfile {files.certfile}",
        f"keyfile {files.keyfile}",
        "require_certificate true",
        "use_identity_as_username false",
        "tls_version tlsv1.2",
        "allow_anonymous false",
        f"password_file {files.password_file}",
        f"acl_file {files.acl_file}",
    ]
    if unix_socket:
        lines += [
            "",
            "# Local unix socket (no TLS: only who can open the socket file reaches it),",
            "# same users and ACL.",
            f"listener 0 {unix_socket}",
            "allow_anonymous false",
            f"password_file {files.password_file}",
            f"acl_file {files.acl_file}",
        ]
    return "\n".join(lines) + "\n"


BRIDGE_BEGIN: Final = "# >>> meshopt bridge "
BRIDGE_END: Final = "# <<< meshopt bridge "


def bridge_sections(conf: str) -> str:
    """The bridge sections of a mosquitto.conf (between meshopt's markers), so that a
    re-run of ``broker init`` keeps what meshopt.broker.bridge added to it."""
    out: list[str] = []
    inside = False
    for line in conf.splitlines(keepends=True):
        if line.startswith(BRIDGE_BEGIN):
            inside = True
        if inside:
            out.append(line)
        if line.startswith(BRIDGE_END):
            inside = False
    return "".join(out)


# --- the directory -------------------------------------------------------------------------


@dataclass(frozen=True)
class BrokerRequest:
    """What ``broker init`` is asked to write (the lab asks with its own paths)."""

    mesh: str
    identities: tuple[Identity, ...]
    hosts: tuple[str, ...]
    port: int = 8883
    install_dir: str = DEFAULT_INSTALL_DIR  # "": the conf names the files where written
    client_dir: str = DEFAULT_CLIENT_DIR  # where broker.toml expects them; "": where written
    bind_address: str = ""
    unix_socket: str = ""
    persistence_dir: str = "/var/lib/mosquitto/"
    run_as: str = ""
    log_dest: str = "syslog"
    days: int = pki.LEAF_DAYS


@dataclass
class BrokerFiles:
    """What was written: for the summary and for the lab."""

    out: Path
    mesh: str
    url: str
    identities: list[Identity]
    ca_reused: bool = False
    new: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)

    @property
    def broker_dir(self) -> Path:
        return self.out / "broker"

    def client_dir(self, identity: str) -> Path:
        return self.out / "clients" / identity

    def password(self, identity: str) -> str:
        return (self.client_dir(identity) / "password").read_text().splitlines()[0]


def _manifest(out: Path) -> dict[str, object] | None:
    path = out / MANIFEST
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: unreadable ({exc})") from None
    return data if isinstance(data, dict) else None


def _merge(out: Path, req: BrokerRequest) -> list[Identity]:
    """The identities of an earlier run in ``out`` plus the new ones (a re-run adds)."""
    old = _manifest(out)
    if old is None:
        return list(req.identities)
    if old.get("mesh") != req.mesh:
        raise InputError(f"{out} is for mesh {old.get('mesh')!r}, not {req.mesh!r}")
    merged: dict[str, Identity] = {}
    earlier = old.get("identities")
    bridges = old.get("bridges")
    bridges = bridges if isinstance(bridges, dict) else {}
    for name, role in (earlier if isinstance(earlier, dict) else {}).items():
        for r in ROLES:
            if role == r and NAME_RE.fullmatch(str(name)):
                nodes = bridges.get(name) if r == "bridge" else None
                listed = nodes if isinstance(nodes, list) else []
                kept = tuple(str(x) for x in listed if NAME_RE.fullmatch(str(x)))
                merged[str(name)] = Identity(str(name), r, kept)
    for ident in req.identities:
        was = merged.get(ident.name)
        if was is not None and was.role != ident.role:
            raise InputError(
                f"identity {ident.name!r} is a {was.role} in {out} already, not a {ident.role}"
            )
        merged[ident.name] = ident
    return list(merged.values())


def _load_ca(out: Path) -> tuple[pki.Key, x509.Certificate] | None:
    key_path, cert_path = out / "ca.key", out / "ca.crt"
    if not (key_path.exists() and cert_path.exists()):
        return None
    key, cert = pki.load_key(key_path), pki.load_cert(cert_path)
    if not pki.same_public_key(key, cert):
        raise InputError(f"{key_path} is not the key of {cert_path}")
    if cert.not_valid_after_utc < dt.datetime.now(dt.UTC) + RENEW_BEFORE:
        raise InputError(
            f"{cert_path} expires on {cert.not_valid_after_utc:%Y-%m-%d}: make a new CA"
        )
    return key, cert


def _usable_client(
    d: Path, name: str, ca_cert: x509.Certificate
) -> tuple[x509.Certificate, str] | None:
    """An earlier identity's certificate and password, if still good for this CA."""
    try:
        cert = pki.load_cert(d / "client.crt")
        key = pki.load_key(d / "client.key")
        password = (d / "password").read_text().splitlines()[0]
    except (InputError, OSError, IndexError):
        return None
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    fresh = cert.not_valid_after_utc > dt.datetime.now(dt.UTC) + RENEW_BEFORE
    if not (cn and cn[0].value == name and fresh and password):
        return None
    if not (pki.same_public_key(key, cert) and pki.issued_by(cert, ca_cert)):
        return None
    return cert, password


def broker_url(hosts: Sequence[str], port: int) -> str:
    host = hosts[0]
    shown = f"[{host}]" if ":" in host else host
    return f"mqtts://{shown}:{port}"


def _client_toml(req: BrokerRequest, ident: Identity, url: str, written: Path) -> str:
    d = req.client_dir.rstrip("/") if req.client_dir else str(written.resolve())
    use = {
        "node": "paste it into the node's agent.toml",
        "controller": "paste it into the controller's controller.toml",
        "reader": "or give `meshopt routes` --ca-file/--cert-file/... (MESHOPT_BROKER_*)",
        "admin": "use its files with mosquitto_pub/mosquitto_sub",
        "bridge": "meshopt.broker.bridge puts its files into the other broker's conf",
    }[ident.role]
    return (
        f"# [broker] table for {ident.role} {ident.name!r} of mesh {req.mesh!r}:\n"
        f"# {use};\n# copy this directory to {d}/ on its host (mode 0700).\n"
        "[broker]\n"
        f'url = "{url}"\n'
        f'ca_file = "{d}/ca.crt"\n'
        f'cert_file = "{d}/client.crt"\n'
        f'key_file = "{d}/client.key"\n'
        f'username = "{ident.name}"\n'
        f'password_file = "{d}/password"\n'
    )


def write_broker_dir(req: BrokerRequest, out: Path, *, force: bool = False) -> BrokerFiles:
    """Write (or, with ``force``, extend) the directory described in the module docstring.

    An existing CA in ``out`` is kept, and so is every identity whose certificate and
    password are still good; new identities are added; the server certificate, passwd,
    ACL and conf are written afresh. Without ``force`` a non-empty ``out`` is refused.
    """
    check_identity_name(req.mesh, "mesh name")
    if not req.hosts:
        raise InputError("give the broker's name or address with --host (repeatable)")
    if not 1 <= req.port <= 65535:
        raise InputError(f"--port {req.port}: want 1..65535")
    if not req.identities:
        raise InputError("no identities: give --node, --controller or --reader")
    if out.exists() and not out.is_dir():
        raise InputError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise InputError(f"{out} is not empty: use --force to add to it (its CA is kept)")
    identities = _merge(out, req) if out.is_dir() else list(req.identities)
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    url = broker_url(req.hosts, req.port)
    files = BrokerFiles(out=out, mesh=req.mesh, url=url, identities=identities)

    loaded = _load_ca(out)
    if loaded is None:
        ca_key, ca_cert = pki.make_ca(req.mesh)
        pki.write_key(out / "ca.key", ca_key)
        pki.write_cert(out / "ca.crt", ca_cert)
    else:
        ca_key, ca_cert = loaded
        files.ca_reused = True

    bdir = files.broker_dir
    bdir.mkdir(exist_ok=True, mode=0o700)
    server_key, server_cert = pki.make_server_cert(ca_key, ca_cert, req.hosts, days=req.days)
    pki.write_key(bdir / "server.key", server_key)
    pki.write_cert(bdir / "server.crt", server_cert)
    pki.write_cert(bdir / "ca.crt", ca_cert)

    passwords: dict[str, str] = {}
    (out / "clients").mkdir(exist_ok=True, mode=0o700)
    for ident in identities:
        d = files.client_dir(ident.name)
        d.mkdir(exist_ok=True, mode=0o700)
        usable = _usable_client(d, ident.name, ca_cert) if files.ca_reused else None
        if usable is not None:
            passwords[ident.name] = usable[1]
            files.kept.append(ident.name)
        else:
            key, cert = pki.make_client_cert(ca_key, ca_cert, ident.name, days=req.days)
            pki.write_key(d / "client.key", key)
            pki.write_cert(d / "client.crt", cert)
            password = new_password()
            pki.write_private(d / "password", (password + "\n").encode())
            passwords[ident.name] = password
            files.new.append(ident.name)
        pki.write_cert(d / "ca.crt", ca_cert)
        (d / "broker.toml").write_text(_client_toml(req, ident, url, d))

    pki.write_private(bdir / "passwd", passwd_text(passwords).encode())
    pki.write_private(bdir / "acl", acl_text(req.mesh, identities).encode())
    where = req.install_dir.rstrip("/") if req.install_dir else str(bdir.resolve())
    conf = conf_text(
        ListenerFiles(
            cafile=f"{where}/ca.crt",
            certfile=f"{where}/server.crt",
            keyfile=f"{where}/server.key",
            password_file=f"{where}/passwd",
            acl_file=f"{where}/acl",
        ),
        mesh=req.mesh,
        port=req.port,
        bind_address=req.bind_address,
        unix_socket=req.unix_socket,
        persistence_dir=req.persistence_dir,
        run_as=req.run_as,
        log_dest=req.log_dest,
    )
    conf_path = bdir / "mosquitto.conf"
    bridged = bridge_sections(conf_path.read_text()) if conf_path.exists() else ""
    if bridged:  # written by meshopt.broker.bridge; they hold a password: keep them, 0600
        pki.write_private(conf_path, (conf + bridged).encode())
    else:
        conf_path.write_text(conf)
    manifest: dict[str, object] = {
        "mesh": req.mesh,
        "hosts": list(req.hosts),
        "port": req.port,
        "identities": {i.name: i.role for i in identities},
    }
    bridges = {i.name: list(i.nodes) for i in identities if i.role == "bridge"}
    if bridges:
        manifest["bridges"] = bridges
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return files
