"""``meshopt transfer``: send a file to a node's receiver, or run a receiver standalone."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import sys
from pathlib import Path

import click

from meshopt.cli.common import json_option, print_json
from meshopt.cli.live_cmd import live_options
from meshopt.errors import InputError
from meshopt.transfer.protocol import TRANSFER_PORT


@click.group("transfer")
def transfer_group() -> None:
    """Bulk file transfer: chunk cache on both ends, zstd only where it pays."""


def split_destination(spec: str) -> tuple[str, str]:
    """``HOST[:DIR]`` -> (host, dir); IPv6 hosts go in brackets: ``[fd00::1]:backups``."""
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
        raise InputError(f"bad destination {spec!r}: no host")
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
@click.option("--port", type=int, default=TRANSFER_PORT, show_default=True)
@live_options
@click.option(
    "--link-mbit",
    type=float,
    help="Link rate for the compression decision (default: measured during the transfer).",
)
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@json_option
def send_cmd(
    file: Path,
    destination: str,
    port: int,
    link_mbit: float | None,
    cache_dir: Path | None,
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
@click.option("--host", default="::", show_default=True)
@click.option("--port", type=int, default=TRANSFER_PORT, show_default=True)
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--cache-max-mb", type=float, default=4096, show_default=True, help="Chunk cache size cap."
)
def serve_cmd(
    directory: Path,
    allow: tuple[str, ...],
    host: str,
    port: int,
    cache_dir: Path | None,
    cache_max_mb: float,
) -> None:
    """Run a receiver until interrupted (the agent hosts the same service)."""
    from meshopt.transfer.receiver import TransferServer

    logging.basicConfig(level=logging.INFO, format="meshopt transfer: %(message)s")

    async def run() -> None:
        server = TransferServer(
            directory,
            host=host,
            port=port,
            allow=list(allow),
            cache_dir=cache_dir,
            cache_max_bytes=int(cache_max_mb * 1e6),
        )
        await server.start()
        click.echo(f"listening on [{host}]:{server.port}, receiving into {directory}", err=True)
        try:
            await server.serve_forever()
        finally:
            await server.close()

    asyncio.run(run())
