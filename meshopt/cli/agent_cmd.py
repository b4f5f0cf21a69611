"""``meshopt agent``: run the per-node daemon until SIGTERM or Ctrl-C."""

from __future__ import annotations

import click

from meshopt.agent.config import load_config
from meshopt.cli.daemon_runner import run_daemon


@click.command("agent")
@click.option(
    "--config",
    "config_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="Agent configuration (TOML; see agents/agent.toml).",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
)
@click.option("--check", is_flag=True, help="Check the configuration and exit.")
def agent_cmd(config_path: str, log_level: str, check: bool) -> None:
    """Probe this node's WireGuard peers, publish telemetry, install the controller's routes."""
    cfg = load_config(config_path)
    if check:
        click.echo(f"{config_path}: ok (mesh {cfg.mesh}, node {cfg.node})")
        return
    from meshopt.agent.daemon import Agent

    run_daemon(log_level, Agent(cfg).run)
