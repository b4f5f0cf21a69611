"""Entry point: one click group; every user error is one line on stderr, never a traceback."""

from __future__ import annotations

import importlib
import sys

import click

from meshopt import __version__
from meshopt.errors import MeshoptError

# Subcommands load on use: the agent daemon must not carry scipy, networkx and
# matplotlib (the offline commands' weight) in every node's memory.
COMMANDS: dict[str, str] = {
    "sim": "meshopt.cli.sim_cmd:sim_cmd",
    "path": "meshopt.cli.inspect_cmd:path_cmd",
    "routes": "meshopt.cli.inspect_cmd:routes_cmd",
    "gains": "meshopt.cli.inspect_cmd:gains_cmd",
    "graph": "meshopt.cli.live_cmd:graph_cmd",
    "topology": "meshopt.cli.topology_cmd:topology_group",
    "lab": "meshopt.cli.lab_cmd:lab_group",
    "transfer": "meshopt.cli.transfer_cmd:transfer_group",
    "agent": "meshopt.cli.agent_cmd:agent_cmd",
    "controller": "meshopt.cli.controller_cmd:controller_group",
    "demo": "meshopt.cli.demo_cmd:demo_cmd",
    "bench": "meshopt.cli.bench_cmd:bench_group",
    "broker": "meshopt.cli.broker_cmd:broker_group",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module, _, attr = target.partition(":")
        command = getattr(importlib.import_module(module), attr)
        assert isinstance(command, click.Command)
        return command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="meshopt")
def cli() -> None:
    """Route and protocol optimizer for WireGuard mesh VPNs.

    TOPOLOGY arguments accept a YAML topology file, a Topology Zoo GML/GraphML
    file, an RTT matrix CSV (plain a,b,rtt_ms or RIPE Atlas form) or a generator
    such as gen:geo:n=200,seed=1 (see topologies/README.md).
    """


def main(argv: list[str] | None = None) -> int:
    try:
        cli.main(args=argv, prog_name="meshopt", standalone_mode=False)
    except MeshoptError as exc:
        click.echo(f"meshopt: error: {exc}", err=True)
        return 2
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except (click.exceptions.Abort, KeyboardInterrupt):
        click.echo("meshopt: interrupted", err=True)
        return 130
    except BrokenPipeError:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
