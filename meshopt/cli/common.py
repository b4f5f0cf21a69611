"""Options and helpers the commands share."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click
from rich.console import Console

from meshopt.errors import InputError
from meshopt.metric import Metric
from meshopt.topology.load import load_topology
from meshopt.topology.model import Topology
from meshopt.units import parse_time_ms

F = TypeVar("F", bound=Callable[..., Any])


def console(*, stderr: bool = False) -> Console:
    return Console(highlight=False, soft_wrap=True, stderr=stderr)


def topology_argument(f: F) -> F:
    return click.argument("topology", metavar="TOPOLOGY")(f)


def routing_options(f: F) -> F:
    f = click.option(
        "--symmetric",
        is_flag=True,
        help="One WireGuard interface per node: the way back is the way there, reversed.",
    )(f)
    f = click.option(
        "--relay-cost",
        default="2ms",
        show_default=True,
        help="What one relay hop costs; a relay must gain more than this.",
    )(f)
    return f


def json_option(f: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")(f)


def metric_from(relay_cost: str) -> Metric:
    return Metric(relay_hop_ms=parse_time_ms(relay_cost, "--relay-cost"))


def open_topology(spec: str, seed: int | None = None) -> Topology:
    return load_topology(spec, seed=seed)


def need_node(topo: Topology, name: str) -> int:
    if name not in topo.names:
        sample = ", ".join(topo.names[:8]) + (", ..." if topo.n > 8 else "")
        raise InputError(f"unknown node {name!r} in {topo.name} (nodes: {sample})")
    return topo.index(name)


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, allow_nan=False)
    sys.stdout.write("\n")
