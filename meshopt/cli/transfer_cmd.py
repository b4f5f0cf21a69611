"""``meshopt transfer``: send a file to a node's receiver, or run a receiver standalone."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import click

from meshopt.cli.common import json_option, print_json
from meshopt.cli.live_cmd import live_options
from meshopt.errors import InputError
from meshopt.transfer.limits import GIB, Limits
from meshopt.transfer.protocol import TRANSFER_PORT

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_DEFAULTS = Limits()


@click.group("transfer")
def transfer_group() -> None:
    """Bulk file transfer: chunk cache on both ends, zstd only where it pays."""


def split_destination(spec: str) -> tuple[str, str]:
    """``NODE[:DIR]`` -> (node, dir); NODE is a node name or an IP address, IPv6 in
    brackets: ``[fd00::1]:backups``."""
    if spec.startswith("["):
        end = spec.find("]")
        if end < 0:
            raise InputError(f"bad destination {spec!r}: missing ']'")
        host, rest = spec[1:end], spec[end + 1 :]
        if rest and not rest.startswith(":"):
            raise InputError(f"bad destination {spec!r}: expected ':' after ']'")
        return host, rest[1:]
    if spec.count(":") > 1:
        raise InputError(f"bad destination {spec!r}: put IPv6 addresses in brackets")
    host, _, directory = spec.partition(":")
    if not host:
        raise InputError(f"bad destination {spec!r}: no node")
    return host, directory


def resolve_node(
    host: str,
    broker: str | None,
    mesh: str | None,
    lab: str | None,
    controller_keys: tuple[str, ...],
    timeout: float,
) -> str:
    """An IP address as given; a node name -> its first overlay address, from the broker."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    from meshopt.cli.live_cmd import open_view

    view = open_view(broker, mesh, lab, controller_keys, timeout)
    t = view.telemetry.get(host)
    if t is None or not t.addresses:
        known = ", ".join(view.nodes) or "none"
        raise InputError(f"no node {host!r} with an address in mesh {view.mesh} (nodes: {known})")
    return str(ipaddress.ip_interface(t.addresses[0]).ip)


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


@transfer_group.command("send")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("destination", metavar="NODE[:DIR]")
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=TRANSFER_PORT,
    show_default=True,
    help="The receiver's TCP port.",
)
@live_options
@click.option(
    "--link-mbit",
    type=click.FloatRange(min=0, min_open=True),
    help="Link rate for the compression decision (default: measured during the transfer).",
)
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Chunk cache of what was sent (default: ~/.cache/meshopt/transfer).",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="Replace a file of the same name (the receiver must allow it too).",
)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@json_option
def send_cmd(
    file: Path,
    destination: str,
    port: int,
    link_mbit: float | None,
    cache_dir: Path | None,
    overwrite: bool,
    no_progress: bool,
    as_json: bool,
    broker: str | None,
    mesh: str | None,
    lab: str | None,
    controller_keys: tuple[str, ...],
    timeout: float,
) -> None:
    """Send FILE to the receiver on NODE, into DIR below its directory.

    NODE is a mesh node's name, looked up on the broker (its overlay address from its
    telemetry; --broker/--mesh/--lab as for `meshopt routes`), or an IP address.
    """
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    from meshopt.transfer.sender import send_file

    host, directory = split_destination(destination)
    host = resolve_node(host, broker, mesh, lab, controller_keys, timeout)
    bar = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=no_progress or as_json or not sys.stderr.isatty(),
    )
    with bar:
        task = bar.add_task(file.name, total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        summary = asyncio.run(
            send_file(
                file,
                host,
                port,
                dest=directory,
                link_mbit=link_mbit,
                progress=progress,
                cache_dir=cache_dir,
                overwrite=overwrite,
            )
        )
    if as_json:
        print_json(summary.as_dict())
        return
    levels = ", ".join(f"{k} x{v}" for k, v in summary.levels.items()) or "none"
    click.echo(
        f"{summary.path} -> {host}:{summary.remote_path}: {_mb(summary.file_bytes)} in "
        f"{summary.seconds:.2f} s, {_mb(summary.bytes_on_wire)} on the wire "
        f"(ratio {summary.ratio:.2f}), goodput {summary.goodput_bps * 8 / 1e6:.1f} Mbit/s; "
        f"chunks sent {summary.chunks_sent}/{summary.chunks_total} (compression: {levels})"
    )


@transfer_group.command("serve")
@click.option(
    "--dir",
    "directory",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Receive into this directory (nothing is written outside it).",
)
@click.option(
    "--allow",
    multiple=True,
    required=True,
    metavar="PREFIX",
    help="Accept peers in this prefix (the mesh's; repeat for more).",
)
@click.option(
    "--bind",
    "--host",
    "bind",
    multiple=True,
    metavar="ADDRESS",
    help="Listen on this address (repeat for more). Default: this host's addresses inside "
    "the --allow prefixes (its overlay addresses), never every interface.",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=TRANSFER_PORT,
    show_default=True,
    help="TCP port to listen on (0: any free port).",
)
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Chunk cache of what was received (default: inside --dir).",
)
@click.option(
    "--cache-max-mb",
    type=click.FloatRange(min=0),
    default=4096,
    show_default=True,
    help="Chunk cache size cap.",
)
@click.option(
    "--quota-gib",
    type=click.FloatRange(min=0),
    default=_DEFAULTS.quota_bytes / GIB,
    show_default=True,
    help="Bytes of files (partial ones included) this run may receive.",
)
@click.option(
    "--min-free-gib",
    type=click.FloatRange(min=0),
    default=_DEFAULTS.min_free_bytes / GIB,
    show_default=True,
    help="Keep this much free on the disk (or --min-free-percent, whichever is smaller).",
)
@click.option(
    "--min-free-percent",
    type=click.FloatRange(min=0, max=100, max_open=True),
    default=_DEFAULTS.min_free_fraction * 100,
    show_default=True,
    help="Keep this share of the disk free (or --min-free-gib, whichever is smaller).",
)
@click.option(
    "--partial-max-age-h",
    type=click.FloatRange(min=0, min_open=True),
    default=_DEFAULTS.partial_max_age_s / 3600,
    show_default=True,
    help="Remove partial files of interrupted transfers untouched for this long.",
)
@click.option(
    "--idle-timeout-s",
    type=click.FloatRange(min=0, min_open=True),
    default=_DEFAULTS.idle_timeout_s,
    show_default=True,
    help="Drop a sender that sends nothing for this long.",
)
@click.option(
    "--max-transfers",
    type=click.IntRange(min=1),
    default=_DEFAULTS.max_transfers,
    show_default=True,
    help="Transfers received at once, from all senders.",
)
@click.option(
    "--max-per-sender",
    type=click.IntRange(min=1),
    default=_DEFAULTS.max_per_sender,
    show_default=True,
    help="Transfers received at once from one sender.",
)
@click.option(
    "--allow-overwrite",
    is_flag=True,
    help="Let a sender that asks (send --overwrite) replace an existing file.",
)
def serve_cmd(
    directory: Path,
    allow: tuple[str, ...],
    bind: tuple[str, ...],
    port: int,
    cache_dir: Path | None,
    cache_max_mb: float,
    quota_gib: float,
    min_free_gib: float,
    min_free_percent: float,
    partial_max_age_h: float,
    idle_timeout_s: float,
    max_transfers: int,
    max_per_sender: int,
    allow_overwrite: bool,
) -> None:
    """Run a receiver until interrupted (the agent hosts the same service)."""
    from meshopt.transfer.receiver import TransferServer, parse_allow

    logging.basicConfig(level=logging.INFO, format="meshopt transfer: %(message)s")
    limits = Limits(
        quota_bytes=int(quota_gib * GIB),
        min_free_bytes=int(min_free_gib * GIB),
        min_free_fraction=min_free_percent / 100,
        partial_max_age_s=partial_max_age_h * 3600,
        idle_timeout_s=idle_timeout_s,
        max_transfers=max_transfers,
        max_per_sender=max_per_sender,
        allow_overwrite=allow_overwrite,
    )
    nets = parse_allow(allow)

    async def run() -> None:
        hosts = list(bind) or await addresses_inside(nets)
        server = TransferServer(
            directory,
            host=hosts,
            port=port,
            allow=list(allow),
            cache_dir=cache_dir,
            cache_max_bytes=int(cache_max_mb * 1e6),
            limits=limits,
        )
        try:
            await server.start()
        except OSError as exc:
            shown = ", ".join(hosts)
            raise InputError(
                f"cannot listen on {shown} port {port}: {exc.strerror or exc}"
            ) from None
        where = ", ".join(f"[{h}]:{server.port}" for h in hosts)
        click.echo(f"listening on {where}, receiving into {directory}", err=True)
        try:
            await server.serve_forever()
        finally:
            await server.close()

    asyncio.run(run())


async def addresses_inside(nets: Sequence[IPNetwork]) -> list[str]:
    """This host's addresses inside ``nets``: the overlay addresses for the mesh prefixes."""
    from meshopt.agent.netstate import NetState

    state = NetState()
    await state.open()
    try:
        found = await state.addresses()
    finally:
        await state.close()
    out = []
    for addrs in found.values():
        for a in addrs:
            ip = ipaddress.ip_interface(a).ip
            if not ip.is_link_local and any(ip in n for n in nets) and str(ip) not in out:
                out.append(str(ip))
    if not out:
        prefixes = ", ".join(str(n) for n in nets)
        raise InputError(
            f"no local address inside --allow {prefixes} to listen on: give --bind ADDRESS "
            "(this host's overlay address)"
        )
    return sorted(out)
