"""Options and helpers the commands share."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from meshopt.errors import InputError
from meshopt.topology.limits import (
    DEFAULT_MAX_INPUT_MB,
    DEFAULT_MAX_NODES,
    DEFAULT_MAX_PAIRS,
    ENV,
    Limits,
)
from meshopt.units import parse_time_ms

if TYPE_CHECKING:  # heavy (numpy, rich): imported where a command uses them
    from rich.console import Console

    from meshopt.metric import Metric
    from meshopt.topology.model import Topology

F = TypeVar("F", bound=Callable[..., Any])


def console(*, stderr: bool = False) -> Console:
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True, stderr=stderr)


_LIMITS_META = "meshopt.topology.limits"
_LIMIT_OPTIONS = (
    ("--max-nodes", "max_nodes", DEFAULT_MAX_NODES, "nodes"),
    ("--max-pairs", "max_pairs", DEFAULT_MAX_PAIRS, "pairs, underlay entries, tunnels or edges"),
    ("--max-input-mb", "max_input_mb", DEFAULT_MAX_INPUT_MB, "MiB of file (decompressed too)"),
)


def _keep_limit(ctx: click.Context, param: click.Parameter, value: int | None) -> None:
    if param.name is not None:
        ctx.meta.setdefault(_LIMITS_META, {})[param.name] = value


def limit_options(f: F) -> F:
    """--max-nodes, --max-pairs, --max-input-mb: raise (or lower) the caps on one input.

    They override the MESHOPT_MAX_* variables for this command only (kept in the click
    context, read by open_topology). Added once, whichever decorator comes first.
    """
    params = getattr(f, "__click_params__", [])
    if any(p.name == "max_nodes" for p in params):
        return f
    for flag, name, default, what in reversed(_LIMIT_OPTIONS):
        f = click.option(
            flag,
            name,
            type=click.IntRange(min=1),
            default=None,
            expose_value=False,
            callback=_keep_limit,
            help=f"Refuse a topology with more than this many {what} "
            f"(default {default:,}, or ${ENV[name]}).",
        )(f)
    return f


def topology_argument(f: F) -> F:
    return limit_options(click.argument("topology", metavar="TOPOLOGY")(f))


def routing_options(f: F) -> F:
    f = limit_options(f)
    f = click.option(
        "--symmetric",
        is_flag=True,
        help="One WireGuard interface per node: the way back is the way there, reversed.",
    )(f)
    f = click.option(
        "--relay-cost",
        default=None,
        show_default="the controller's, 0.1ms",
        help="What one relay hop costs beyond its two tunnels' RTT; a relay must gain"
        " more than this. The default is the controller's (measured in the lab).",
    )(f)
    return f


def json_option(f: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")(f)


def metric_from(relay_cost: str | None) -> Metric:
    """The controller's metric; ``relay_cost`` (--relay-cost) overrides its relay hop."""
    from meshopt.metric import Metric

    if relay_cost is None:
        return Metric()
    return Metric(relay_hop_ms=parse_time_ms(relay_cost, "--relay-cost"))


def open_topology(spec: str, seed: int | None = None) -> Topology:
    """Load with the limits of this command's --max-* flags over the MESHOPT_MAX_* variables."""
    from meshopt.topology.load import load_topology

    ctx = click.get_current_context(silent=True)
    given = ctx.meta.get(_LIMITS_META, {}) if ctx is not None else {}
    return load_topology(spec, seed=seed, limits=Limits.from_env().with_values(**given))


def need_node(topo: Topology, name: str) -> int:
    if name not in topo.names:
        sample = ", ".join(topo.names[:8]) + (", ..." if topo.n > 8 else "")
        raise InputError(f"unknown node {name!r} in {topo.name} (nodes: {sample})")
    return topo.index(name)


def print_json(data: Any) -> None:
    """One write: json.dump would write every token separately (139,000 writes for a
    52-node ``routes --json``, a third of its run time)."""
    sys.stdout.write(json.dumps(data, indent=2, allow_nan=False) + "\n")
