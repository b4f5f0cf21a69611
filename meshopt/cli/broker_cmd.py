"""``meshopt broker init``: the CA, certificates, passwords, ACL and mosquitto.conf of a mesh.

What an operator needs to run mosquitto as the mesh's second wall (TLS, a password and
a certificate per identity, an ACL binding each node to its own topics); the files are
described in meshopt/broker/mosquitto.py.
"""

from __future__ import annotations

from pathlib import Path

import click

from meshopt.cli.common import json_option, print_json
from meshopt.errors import InputError


def _check_host(host: str) -> None:
    import ipaddress

    from meshopt.bus.client import parse_broker

    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    try:
        parse_broker(f"mqtts://{host}:1")
    except InputError:
        raise InputError(f"bad --host {host!r}: want a host name or an IP address") from None


@click.group("broker")
def broker_group() -> None:
    """Files for a mesh's mosquitto: TLS, per-identity credentials, an ACL."""


@broker_group.command("init")
@click.option("--mesh", required=True, metavar="NAME", help="The mesh's name (topic prefix).")
@click.option("--node", "nodes", multiple=True, metavar="NAME", help="A node (repeatable).")
@click.option(
    "--topology",
    metavar="TOPOLOGY",
    help="Take the node names from a topology (file or generator).",
)
@click.option(
    "--controller",
    "controllers",
    multiple=True,
    metavar="ID",
    help="A controller id (repeatable).",
)
@click.option(
    "--reader",
    "readers",
    multiple=True,
    metavar="NAME",
    help="A read-only identity for tools such as `meshopt routes` (repeatable).",
)
@click.option(
    "--admin",
    "admins",
    multiple=True,
    metavar="NAME",
    help="An identity that may read and write all the mesh's topics, e.g. to clear a "
    "removed node's retained messages (repeatable; keep it off the nodes).",
)
@click.option(
    "--host",
    "hosts",
    multiple=True,
    required=True,
    metavar="NAME|IP",
    help="A name or address clients use for the broker (repeatable; the first is the url's).",
)
@click.option("--port", type=int, default=8883, show_default=True, help="TLS listener port.")
@click.option(
    "--install-dir",
    default="/etc/mosquitto/meshopt",
    show_default=True,
    help="Where broker/ is copied on the broker host (mosquitto.conf names its files there).",
)
@click.option(
    "--client-dir",
    default="/etc/meshopt/broker",
    show_default=True,
    help="Where clients/<identity>/ is copied on each host (its broker.toml names it).",
)
@click.option(
    "--bridge",
    "bridges",
    multiple=True,
    metavar="NAME=NODE,...",
    help="An identity for another region's broker bridged to this one, allowed exactly "
    "the topics of those nodes (repeatable; docs/cluster.md).",
)
@click.option(
    "--bridge-to",
    "bridge_to",
    multiple=True,
    metavar="NAME=DIR",
    help="Bridge this broker to the central one whose `broker init` DIR has bridge NAME "
    "(repeatable; docs/cluster.md).",
)
@click.option("--out", required=True, metavar="DIR", help="Directory to write.")
@click.option(
    "--force",
    is_flag=True,
    help="Write into a non-empty DIR: keep its CA and identities, add the new ones.",
)
@json_option
def init_cmd(
    mesh: str,
    nodes: tuple[str, ...],
    topology: str | None,
    controllers: tuple[str, ...],
    readers: tuple[str, ...],
    admins: tuple[str, ...],
    hosts: tuple[str, ...],
    port: int,
    install_dir: str,
    client_dir: str,
    bridges: tuple[str, ...],
    bridge_to: tuple[str, ...],
    out: str,
    force: bool,
    as_json: bool,
) -> None:
    """Write a CA, the broker's certificate and config, and every identity's credentials.

    Identities: nodes (user name = node name), controllers (their id), readers. Each gets
    a client certificate (CN = its name) and a password; the ACL lets a node publish only
    its own telemetry and status and read only its own route set.
    """
    from meshopt.broker.mosquitto import BrokerRequest, make_identities, write_broker_dir

    names = list(nodes)
    if topology is not None:
        from meshopt.topology import load_topology

        names += [n for n in load_topology(topology).names if n not in names]
    from meshopt.broker.bridge import parse_bridge_option, write_bridge

    pairs = [parse_bridge_option(b, "--bridge", "NAME=NODE,...") for b in bridges]
    bridged = {name: nodes.split(",") for name, nodes in pairs}
    links = [parse_bridge_option(b, "--bridge-to", "NAME=DIR") for b in bridge_to]
    if not (names or controllers or readers or admins or bridged):
        raise InputError("no identities: give --node NAME (or --topology), --controller, --reader")
    for h in hosts:
        _check_host(h)
    req = BrokerRequest(
        mesh=mesh,
        identities=tuple(make_identities(names, controllers, readers, admins, bridged)),
        hosts=hosts,
        port=port,
        install_dir=install_dir,
        client_dir=client_dir,
    )
    files = write_broker_dir(req, Path(out), force=force)
    for name, central in links:
        write_bridge(Path(out), Path(central), name, install_dir=install_dir)
    if as_json:
        print_json(
            {
                "out": str(files.out),
                "mesh": files.mesh,
                "url": files.url,
                "ca_reused": files.ca_reused,
                "new": files.new,
                "kept": files.kept,
                "identities": {i.name: i.role for i in files.identities},
            }
        )
        return
    d = files.out
    inst = install_dir.rstrip("/")
    made = f"{len(files.new)} new" + (f", {len(files.kept)} kept" if files.kept else "")
    ca = "existing CA kept" if files.ca_reused else "new CA"
    click.echo(f"wrote {d}: mesh {mesh}, {ca}, identities {made}; clients use {files.url}")
    click.echo(
        f"""
broker host:   copy {d}/broker/* to {inst}/, then
               chown mosquitto: {inst}/{{server.key,passwd,acl}}
               cp {inst}/mosquitto.conf /etc/mosquitto/mosquitto.conf; systemctl restart mosquitto
each identity: copy {d}/clients/<name>/ to {client_dir.rstrip("/")}/ on its host (mode 0700)
               (its broker.toml is the [broker] table for its agent.toml / controller.toml)
keep offline:  {d}/ca.key (it mints identities; re-run with --force to add some)"""
    )
