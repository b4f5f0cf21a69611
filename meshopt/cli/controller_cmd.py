"""``meshopt controller``: run the controller, or make its signing key."""

from __future__ import annotations

import click

from meshopt.cli.daemon_runner import run_daemon
from meshopt.cli.keys import write_new_key
from meshopt.errors import InputError


@click.group("controller", invoke_without_command=True)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="Controller configuration (TOML; see agents/controller.toml).",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
)
@click.option("--check", is_flag=True, help="Check the configuration and exit.")
@click.pass_context
def controller_group(
    ctx: click.Context, config_path: str | None, log_level: str, check: bool
) -> None:
    """Compute routes from the agents' telemetry and publish signed route sets.

    Run several with the same mesh and key for a standby: one holds the lease on the
    broker and publishes, the others take over within seconds when it dies.
    """
    if ctx.invoked_subcommand is not None:
        return
    if config_path is None:
        raise InputError("meshopt controller needs --config FILE (or: controller keygen)")
    from meshopt.controller.config import load_controller_config

    cfg = load_controller_config(config_path)
    if check:
        click.echo(f"{config_path}: ok (mesh {cfg.mesh}, controller {cfg.id})")
        return
    from meshopt.controller.daemon import Controller

    controller = Controller(cfg)
    run_daemon(log_level, controller.run, reload=lambda: controller.reload(config_path))


@controller_group.command("keygen")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Private key file.")
@click.option("--force", is_flag=True, help="Overwrite an existing key file.")
def keygen_cmd(out: str, force: bool) -> None:
    """Make an Ed25519 signing key; print the public key agents put in controller_keys."""
    click.echo(write_new_key(out, force, "agents must then be updated"))
