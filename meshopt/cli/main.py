"""Entry point: one click group; every user error is one line on stderr, never a traceback.

Exit codes (docs/cli.md): 0 ok, 1 a negative answer (unreachable pair, a topology that
fails its check), 2 bad input, 3 the broker or lab cannot be reached.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, NamedTuple

import click

from meshopt import __version__
from meshopt.errors import MeshoptError, UnavailableError

EXIT_OK = 0
EXIT_NEGATIVE = 1
EXIT_BAD_INPUT = 2
EXIT_UNAVAILABLE = 3


class Entry(NamedTuple):
    """Where a subcommand lives and its one-line help, so ``--help`` imports nothing."""

    target: str  # "module:attribute"
    short_help: str


# Subcommands load on use: the agent daemon must not carry scipy, networkx and
# matplotlib (the offline commands' weight) in every node's memory, and `meshopt
# --help` must not import them either. Add a command here with its one-line help.
COMMANDS: dict[str, Entry] = {
    "sim": Entry(
        "meshopt.cli.sim_cmd:sim_cmd",
        "Simulate probing, metric, anti-flap and routing over time.",
    ),
    "path": Entry("meshopt.cli.inspect_cmd:path_cmd", "Best path from A to B, offline or live."),
    "routes": Entry(
        "meshopt.cli.inspect_cmd:routes_cmd", "Next-hop table of each node, offline or live."
    ),
    "gains": Entry(
        "meshopt.cli.inspect_cmd:gains_cmd", "Which pairs gain from relaying, and by how much."
    ),
    "graph": Entry("meshopt.cli.live_cmd:graph_cmd", "Draw a topology or a live mesh as SVG/PNG."),
    "topology": Entry(
        "meshopt.cli.topology_cmd:topology_group", "Check, show and convert topologies."
    ),
    "lab": Entry(
        "meshopt.cli.lab_cmd:lab_group", "A real WireGuard mesh in network namespaces (root)."
    ),
    "transfer": Entry(
        "meshopt.cli.transfer_cmd:transfer_group", "Bulk file transfer over the mesh."
    ),
    "agent": Entry(
        "meshopt.cli.agent_cmd:agent_cmd", "Run this node's agent: probe, publish, install."
    ),
    "controller": Entry(
        "meshopt.cli.controller_cmd:controller_group",
        "Run the controller: compute and publish route sets.",
    ),
    "status": Entry(
        "meshopt.cli.status_cmd:status_cmd",
        "This node: kernel routes, agent state, drift.",
    ),
    "demo": Entry(
        "meshopt.cli.demo_cmd:demo_cmd", "Build a live mesh, let meshopt route it, measure."
    ),
    "bench": Entry("meshopt.cli.bench_cmd:bench_group", "Benchmarks on live namespace meshes."),
    "broker": Entry(
        "meshopt.cli.broker_cmd:broker_group", "Files for a mesh's mosquitto: TLS, users, ACL."
    ),
}

# Optional modules and the extra (of the meshopt-wg distribution) that installs them.
EXTRAS: dict[str, str] = {
    "numpy": "controller",
    "scipy": "controller",
    "networkx": "controller",
    "matplotlib": "graph",
    "zstandard": "transfer",
    "pyfastcdc": "transfer",
}
DISTRIBUTION = "meshopt-wg"

EPILOG = """\b
Exit codes: 0 ok; 1 a negative answer (unreachable pair, failed topology check);
2 bad input (usage, files, values); 3 broker or lab unavailable.
Shell completion: eval "$(_MESHOPT_COMPLETE=bash_source meshopt)" (see docs/cli.md).
"""


def load_command(name: str) -> click.Command:
    module, _, attr = COMMANDS[name].target.partition(":")
    command = getattr(importlib.import_module(module), attr)
    assert isinstance(command, click.Command)
    return command


class LazyGroup(click.Group):
    """Imports a subcommand's module only when that subcommand runs (or shows its help)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        return load_command(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name].short_help) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def shell_complete(self, ctx: click.Context, incomplete: str) -> list[Any]:
        from click.shell_completion import CompletionItem

        items = [
            CompletionItem(name, help=COMMANDS[name].short_help)
            for name in self.list_commands(ctx)
            if name.startswith(incomplete)
        ]
        return items + [
            item
            for item in click.Command.shell_complete(self, ctx, incomplete)
            if item.value not in COMMANDS
        ]


@click.group(
    cls=LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog=EPILOG,
)
@click.version_option(__version__, prog_name="meshopt")
def cli() -> None:
    """Route and protocol optimizer for WireGuard mesh VPNs.

    TOPOLOGY arguments accept a YAML topology file, a Topology Zoo GML/GraphML
    file, an RTT matrix CSV (plain a,b,rtt_ms or RIPE Atlas form) or a generator
    such as gen:geo:n=200,seed=1 (see topologies/README.md).
    """


def _command_words(argv: list[str]) -> str:
    """'meshopt routes': the command the user ran, for a message."""
    name = next((a for a in argv if not a.startswith("-")), "")
    return f"meshopt {name}" if name in COMMANDS else "meshopt"


def missing_extra(exc: ModuleNotFoundError, argv: list[str]) -> str | None:
    """The one line for a module an extra would have installed; None for any other."""
    root = (exc.name or "").partition(".")[0]
    extra = EXTRAS.get(root)
    if extra is None:
        return None
    return (
        f"{_command_words(argv)!r} needs the {extra} extra: pip install '{DISTRIBUTION}[{extra}]'"
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        # Without standalone mode click returns ctx.exit()'s status (1: a negative answer)
        # instead of raising it; commands themselves return None.
        status = cli.main(args=args, prog_name="meshopt", standalone_mode=False)
    except UnavailableError as exc:
        click.echo(f"meshopt: error: {exc}", err=True)
        return EXIT_UNAVAILABLE
    except MeshoptError as exc:
        click.echo(f"meshopt: error: {exc}", err=True)
        return EXIT_BAD_INPUT
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except (click.exceptions.Abort, KeyboardInterrupt):
        click.echo("meshopt: interrupted", err=True)
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except ModuleNotFoundError as exc:
        line = missing_extra(exc, args)
        if line is None:
            raise
        click.echo(f"meshopt: error: {line}", err=True)
        return EXIT_BAD_INPUT
    return status if isinstance(status, int) else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
