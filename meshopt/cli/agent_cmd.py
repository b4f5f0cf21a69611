"""``meshopt agent``: run the per-node daemon until SIGTERM or Ctrl-C."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import TYPE_CHECKING

import click

from meshopt.agent.config import load_config

if TYPE_CHECKING:
    from meshopt.agent.daemon import Agent


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
    logging.basicConfig(
        level=getattr(logging, log_level.upper()),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    from meshopt.agent.daemon import Agent

    asyncio.run(_run(Agent(cfg)))


async def _run(agent: Agent) -> None:
    """Run until a signal; the agent's own teardown (withdraw, offline status) then runs."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await agent.run()
