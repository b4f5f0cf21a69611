"""``meshopt bench``: benchmarks on live labs (needs root)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from types import FrameType
from typing import Any

import click

from meshopt.cli.common import console
from meshopt.errors import InputError


@click.group("bench")
def bench_group() -> None:
    """Benchmarks on live namespace meshes; JSON on stdout."""


@bench_group.command("convergence")
@click.argument("topology", required=False, metavar="[TOPOLOGY]")
@click.option(
    "--runs",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Runs per figure (medians).",
)
@click.option(
    "--stability-s",
    type=click.FloatRange(min=0.0, max=86400.0),
    default=600.0,
    show_default=True,
    help="Seconds of +/-20% jitter for the stability figure (0: skip).",
)
@click.option(
    "--cpu-load",
    "cpu_load_n",
    type=click.IntRange(min=0, max=64),
    default=0,
    show_default=True,
    help="Busy processes (one core each) beside the lab all along.",
)
@click.option("--quick", is_flag=True, help="One run and 60 s of stability.")
@click.option(
    "--baseline",
    type=click.Path(dir_okay=False, exists=True),
    help="An earlier JSON result: print each median's ratio to it.",
)
@click.option(
    "--logs",
    type=click.Path(file_okay=False, path_type=Path),
    help="Keep each run's lab logs (agents, controllers, broker) under this directory.",
)
def convergence_cmd(
    topology: str | None,
    runs: int,
    stability_s: float,
    cpu_load_n: int,
    quick: bool,
    baseline: str | None,
    logs: Path | None,
) -> None:
    """Route quality, re-route, fail-over and stability on an 8-node live mesh."""
    base: dict[str, Any] = {}
    if baseline is not None:
        base = _read_baseline(baseline)
    if os.geteuid() != 0:
        raise InputError("meshopt bench convergence needs root (network namespaces)")
    from meshopt.bench.convergence import bench

    if quick:
        runs, stability_s = 1, min(stability_s, 60.0)

    def on_term(_sig: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt  # so every lab's `finally` tears it down

    signal.signal(signal.SIGTERM, on_term)
    err = console(stderr=True)
    result = bench(
        topology=topology,
        runs=runs,
        stability_s=stability_s,
        cpu_load_n=cpu_load_n,
        progress=err.log,
        logs=logs,
    )
    if baseline is not None:
        ratios = {}
        for key in ("degradation_s", "failure_s", "controller_failover_s"):
            a, b = result[key].get("median"), _median(base, key)
            ratios[key] = a / b if a is not None and b else None
        result["ratio_to_baseline"] = ratios
    click.echo(json.dumps(result, indent=2, default=str))


def _read_baseline(path: str) -> dict[str, Any]:
    """An earlier result of this command; anything else is one line, before the lab runs."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"--baseline {path}: not a JSON result ({exc})") from None
    if not isinstance(data, dict):
        raise InputError(f"--baseline {path}: not a JSON object")
    return data


def _median(base: dict[str, Any], key: str) -> float | None:
    entry = base.get(key)
    value = entry.get("median") if isinstance(entry, dict) else None
    return float(value) if isinstance(value, int | float) else None
