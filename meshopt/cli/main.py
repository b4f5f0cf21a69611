"""Entry point: one click group; every user error is one line on stderr, never a traceback."""

from __future__ import annotations

import sys

import click

from meshopt import __version__
from meshopt.cli.agent_cmd import agent_cmd
from meshopt.cli.bench_cmd import bench_group
from meshopt.cli.controller_cmd import controller_group
from meshopt.cli.demo_cmd import demo_cmd
from meshopt.cli.inspect_cmd import gains_cmd, path_cmd, routes_cmd
from meshopt.cli.lab_cmd import lab_group
from meshopt.cli.live_cmd import graph_cmd
from meshopt.cli.sim_cmd import sim_cmd
from meshopt.cli.topology_cmd import topology_group
from meshopt.cli.transfer_cmd import transfer_group
from meshopt.errors import MeshoptError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="meshopt")
def cli() -> None:
    """Route and protocol optimizer for WireGuard mesh VPNs.

    TOPOLOGY arguments accept a YAML topology file, a Topology Zoo GML/GraphML
    file, an RTT matrix CSV (plain a,b,rtt_ms or RIPE Atlas form) or a generator
    such as gen:geo:n=200,seed=1 (see topologies/README.md).
    """


cli.add_command(sim_cmd)
cli.add_command(path_cmd)
cli.add_command(routes_cmd)
cli.add_command(gains_cmd)
cli.add_command(graph_cmd)
cli.add_command(topology_group)
cli.add_command(lab_group)
cli.add_command(transfer_group)
cli.add_command(agent_cmd)
cli.add_command(controller_group)
cli.add_command(demo_cmd)
cli.add_command(bench_group)


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
