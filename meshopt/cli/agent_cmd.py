"""``meshopt agent``: run the per-node daemon, make its identity key, reset its term."""

from __future__ import annotations

import click

from meshopt.cli.daemon_runner import run_daemon
from meshopt.cli.keys import write_new_key
from meshopt.errors import InputError


@click.group("agent", invoke_without_command=True)
@click.option(
    "--config",
    "config_path",
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
@click.pass_context
def agent_cmd(ctx: click.Context, config_path: str | None, log_level: str, check: bool) -> None:
    """Probe this node's WireGuard peers, publish telemetry, install the controller's routes."""
    if ctx.invoked_subcommand is not None:
        return
    if config_path is None:
        raise InputError("meshopt agent needs --config FILE (or: agent keygen, agent reset-term)")
    from meshopt.agent.config import load_config
    from meshopt.bus.signing import load_signing_key

    cfg = load_config(config_path)
    # What Agent() reads at start must fail here, for --check and start alike, in one
    # line: a missing key or unreadable state file must not become a restart loop.
    from pathlib import Path

    from meshopt.agent.state import load_state
    from meshopt.configfile import check_key_file, printable

    state = Path(cfg.state_dir) / f"agent-{cfg.mesh}-{cfg.node}.json"
    try:
        check_key_file(cfg.identity_key, "identity_key", "signing key")
        load_signing_key(cfg.identity_key)
        load_state(state)
    except OSError as exc:
        why = f"cannot read agent state {state}: {exc.strerror or exc}"
        raise InputError(printable(why)) from None
    except InputError as exc:
        raise InputError(printable(str(exc))) from None
    if check:
        # Run as root, --check can read wg-quick's root-only configs (the unit's user cannot).
        from meshopt.agent import wgquick

        where = wgquick.WG_QUICK_DIR
        names = wgquick.config_names(cfg.interfaces, where)
        for warning in wgquick.save_config_warnings(names, cfg.layout, where):
            click.echo(f"meshopt: warning: {warning}", err=True)
        click.echo(f"{config_path}: ok (mesh {cfg.mesh}, node {cfg.node})")
        return
    from meshopt.agent.daemon import Agent

    agent = Agent(cfg)
    run_daemon(cfg.log_level or log_level, agent.run, reload=lambda: agent.reload(config_path))


@agent_cmd.command("keygen")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Private key file.")
@click.option("--force", is_flag=True, help="Overwrite an existing key file.")
def keygen_cmd(out: str, force: bool) -> None:
    """Make this node's Ed25519 identity key; print the public key to enrol at the controller
    (its [node_keys] table)."""
    click.echo(write_new_key(out, force, "the controller's [node_keys] entry must then change"))


@agent_cmd.command("reset-term")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False))
def reset_term_cmd(config_path: str) -> None:
    """Forget the newest controller term and route-set version this agent accepted.

    For recovery after a controller key was compromised: stop the agent, rotate the
    controller key (controller_keys), run this, start the agent. Without it the agent
    refuses every set older than what the compromised controller sent (at most an hour
    ahead of the clock, so the honest controllers catch up within that hour anyway).
    """
    from pathlib import Path

    from meshopt.agent.config import load_config
    from meshopt.agent.state import load_state, save_state

    cfg = load_config(config_path)
    path = Path(cfg.state_dir) / f"agent-{cfg.mesh}-{cfg.node}.json"
    state = load_state(path)
    click.echo(f"{path}: term {state.route_term} and version {state.route_version} forgotten")
    state.route_term = 0
    state.route_version = 0
    save_state(path, state)
