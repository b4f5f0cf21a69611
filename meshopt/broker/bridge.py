"""A mosquitto bridge from a regional broker to the central one, over TLS.

A mesh spread over regions can run one broker per region, with agents on their nearest
broker and the controller on the central one. The regional broker opens one bridge
connection to the central broker and forwards exactly what meshopt needs, per node of
its region (docs/cluster.md)::

    meshopt/<mesh>/telemetry/<node>   out   region -> central (the controller reads it)
    meshopt/<mesh>/status/<node>      out   retained status and the agent's will
    meshopt/<mesh>/routes/<node>      in    central -> region, retained signed route sets
    meshopt/<mesh>/controller/lease   in    retained; for the region's tools (agents
    meshopt/<mesh>/controller/status/+ in   only read their route set)
    meshopt/<mesh>/bridge/<name>      both  the link's state, "1"/"0" (mosquitto's
                                            notification, retained; "0" is its will)

The bridge logs in to the central broker like any client: the central broker's CA,
a client certificate of its own and a password, as an identity of role "bridge" made
by ``meshopt broker init`` on the central directory (see
:func:`meshopt.broker.mosquitto.make_identities`, ``bridges=``). Its ACL there allows
exactly the topics above, so a compromised regional broker can speak only for its own
region's nodes (and every message is signed anyway).

How: ``broker init`` the central directory with the bridge identity (``--bridge
NAME=NODE,...``: its nodes = the region's), ``broker init`` the regional directory with
the region's nodes and ``--bridge-to NAME=CENTRAL_DIR``; that runs :func:`write_bridge`
(regional, central, name), which adds the bridge section to the regional
``broker/mosquitto.conf`` (between markers that a re-run of ``broker init`` keeps) and
copies the bridge's certificate, key and the central CA next to it. The section holds
the bridge's password (mosquitto has no password file for bridges), so the conf is
written with mode 0600.

``try_private true`` makes the link a mosquitto bridge, not a plain client: the central
broker then sends it messages with the retain flag as published, so a retained route
set published while the link is up is retained on the regional broker too (a plain MQTT
3.1.1 subscription would clear the flag). ``cleansession false`` keeps the central side's
subscription and queued QoS 1 messages across a link drop.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from meshopt.broker import pki
from meshopt.broker.mosquitto import (
    BRIDGE_BEGIN,
    BRIDGE_END,
    DEFAULT_INSTALL_DIR,
    MANIFEST,
    MAX_PACKET_SIZE,
    check_identity_name,
)
from meshopt.errors import InputError

KEEPALIVE_S: Final = 10  # mosquitto's minimum is 5; 60 (its default) hides a dead link
RESTART_S: Final = (1, 10)  # reconnect backoff base and cap (mosquitto: 5, 30)


@dataclass(frozen=True)
class Bridge:
    """What one bridge section says, with paths as the regional broker sees them."""

    name: str
    mesh: str
    nodes: tuple[str, ...]
    address: str  # host:port of the central broker's TLS listener
    username: str
    password: str
    cafile: str
    certfile: str
    keyfile: str


def parse_bridge_option(text: str, option: str, form: str) -> tuple[str, str]:
    """``NAME=VALUE`` of a command-line option, with NAME checked; InputError otherwise."""
    name, sep, value = text.partition("=")
    if not sep or not value:
        raise InputError(f"{option} {text!r}: want {form}")
    return check_identity_name(name, f"{option} name"), value


def bridge_topic(mesh: str, name: str) -> str:
    """Where the link's state ("1" up, "0" down) is published, retained, on both sides."""
    return f"meshopt/{mesh}/bridge/{name}"


def bridge_conf_text(b: Bridge) -> str:
    """The ``connection`` section for the regional broker's mosquitto.conf."""
    p = f"meshopt/{b.mesh}"
    lines = [
        f"{BRIDGE_BEGIN}{b.name} (meshopt.broker.bridge; `broker init` keeps this block)",
        f"connection {b.name}",
        f"address {b.address}",
        f"remote_clientid {b.name}",
        f"local_clientid meshopt-bridge-{b.name}",
        f"remote_username {b.username}",
        f"remote_password {b.password}",
        "bridge_protocol_version mqttv311",
        "try_private true",
        "cleansession false",
        f"keepalive_interval {KEEPALIVE_S}",
        f"restart_timeout {RESTART_S[0]} {RESTART_S[1]}",
        f"bridge_max_packet_size {MAX_PACKET_SIZE}",
        "notifications true",
        "notifications_local_only false",
        f"notification_topic {bridge_topic(b.mesh, b.name)}",
        f"bridge_cafile {b.cafile}",
        f"bridge_certfile {b.certfile}",
        f"bridge_keyfile {b.keyfile}",
        "bridge_tls_version tlsv1.2",
        "bridge_insecure false",
    ]
    for node in b.nodes:
        lines += [
            f"topic {p}/telemetry/{node} out 1",
            f"topic {p}/status/{node} out 1",
            f"topic {p}/routes/{node} in 1",
        ]
    lines += [
        f"topic {p}/controller/lease in 1",
        f"topic {p}/controller/status/+ in 1",
        f"{BRIDGE_END}{b.name}",
    ]
    return "\n".join(lines) + "\n"


def _manifest(d: Path, what: str) -> dict[str, object]:
    try:
        data = json.loads((d / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{what} {d}: no usable {MANIFEST} ({exc}); run `broker init`") from None
    if not isinstance(data, dict):
        raise InputError(f"{what} {d}: {MANIFEST} is not a JSON object")
    return data


def _split(conf: str, name: str) -> tuple[str, str]:
    """``conf`` as (everything but the bridge sections, the sections other than ``name``)."""
    body: list[str] = []
    others: list[str] = []
    current: list[str] | None = None
    for line in conf.splitlines(keepends=True):
        if line.startswith(BRIDGE_BEGIN):
            this = line[len(BRIDGE_BEGIN) :].split(" ", 1)[0].strip()
            current = [] if this == name else others
        (body if current is None else current).append(line)
        if current is not None and line.startswith(BRIDGE_END):
            current = None
    return "".join(body), "".join(others)


def write_bridge(
    regional: Path,
    central: Path,
    name: str,
    *,
    address: str = "",
    install_dir: str = DEFAULT_INSTALL_DIR,
) -> Bridge:
    """Add (or replace) bridge ``name`` in ``regional``'s broker/mosquitto.conf.

    ``regional`` and ``central`` are ``broker init`` directories of the same mesh;
    ``name`` is a bridge identity of ``central`` whose nodes must all be nodes of
    ``regional``. ``address`` is the central broker's host:port as the regional broker
    reaches it (default: the central directory's first --host and its port; the name
    must be in the central server certificate, which is verified). ``install_dir`` is
    where the regional broker/ files go on its host ("": where they are written).
    """
    check_identity_name(name, "bridge name")
    reg, cen = _manifest(regional, "regional"), _manifest(central, "central")
    mesh = cen.get("mesh")
    if reg.get("mesh") != mesh or not isinstance(mesh, str):
        raise InputError(f"{regional} is for mesh {reg.get('mesh')!r}, {central} for {mesh!r}")
    roles = cen.get("identities")
    if not isinstance(roles, dict) or roles.get(name) != "bridge":
        raise InputError(
            f"{central} has no bridge {name!r}: run `broker init` there with the bridge "
            "and its region's nodes first"
        )
    bridges = cen.get("bridges")
    nodes = bridges.get(name) if isinstance(bridges, dict) else None
    if not isinstance(nodes, list) or not nodes:
        raise InputError(f"{central}: bridge {name!r} lists no nodes")
    nodes = [check_identity_name(str(n), f"node name (bridge {name!r})") for n in nodes]
    reg_roles = reg.get("identities")
    reg_nodes = (
        {n for n, r in reg_roles.items() if r == "node"} if isinstance(reg_roles, dict) else set()
    )
    missing = [str(n) for n in nodes if n not in reg_nodes]
    if missing:
        raise InputError(
            f"bridge {name!r} forwards nodes that {regional} does not have: "
            + ", ".join(missing[:5])
            + (" ..." if len(missing) > 5 else "")
        )
    if not address:
        hosts, port = cen.get("hosts"), cen.get("port")
        if not (isinstance(hosts, list) and hosts and isinstance(port, int)):
            raise InputError(f"{central}/{MANIFEST}: no hosts/port; give the address")
        host = str(hosts[0])
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if any(c.isspace() for c in address) or not address:
        raise InputError(f"bad bridge address {address!r}: want host:port")
    src = central / "clients" / name
    try:
        password = (src / "password").read_text().splitlines()[0]
    except (OSError, IndexError):
        raise InputError(f"{src}/password: missing or empty; re-run `broker init`") from None
    if not password or any(c.isspace() for c in password):
        raise InputError(f"{src}/password: empty or with spaces; re-run `broker init`")
    bdir = regional / "broker"
    conf_path = bdir / "mosquitto.conf"
    if not conf_path.exists():
        raise InputError(f"{conf_path}: missing; run `broker init` on {regional}")
    prefix = f"bridge-{name}"
    for suffix, what in ((".ca.crt", "ca.crt"), (".crt", "client.crt"), (".key", "client.key")):
        if not (src / what).exists():
            raise InputError(f"{src}/{what}: missing; re-run `broker init` on {central}")
        if what == "client.key":
            pki.write_private(bdir / f"{prefix}{suffix}", (src / what).read_bytes())
        else:
            shutil.copyfile(src / what, bdir / f"{prefix}{suffix}")
    where = install_dir.rstrip("/") if install_dir else str(bdir.resolve())
    bridge = Bridge(
        name=name,
        mesh=mesh,
        nodes=tuple(str(n) for n in nodes),
        address=address,
        username=name,
        password=password,
        cafile=f"{where}/{prefix}.ca.crt",
        certfile=f"{where}/{prefix}.crt",
        keyfile=f"{where}/{prefix}.key",
    )
    body, others = _split(conf_path.read_text(), name)
    text = body.rstrip("\n") + "\n\n" + others + bridge_conf_text(bridge)
    pki.write_private(conf_path, text.encode())
    return bridge
