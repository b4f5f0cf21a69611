"""``meshopt sim``: the offline simulator from the command line."""

from __future__ import annotations

import sys

import click

from meshopt.cli.common import (
    json_option,
    metric_from,
    open_topology,
    print_json,
    routing_options,
    topology_argument,
)
from meshopt.errors import InputError
from meshopt.units import parse_duration_s, parse_late, parse_time_ms


@click.command("sim")
@topology_argument
@click.option("--duration", default="120s", show_default=True, help="Simulated time.")
@click.option(
    "--seed",
    default=0,
    show_default=True,
    type=click.IntRange(min=0, max=2**32 - 1),
    help="Random seed.",
)
@click.option(
    "--event",
    "events",
    multiple=True,
    metavar="EVENT",
    help='A change, e.g. "at=30s link=a-b delay=200ms" or "at=60s node=c down" (repeatable).',
)
@click.option("--probe-interval", default="250ms", show_default=True, help="Probe period.")
@click.option(
    "--recompute",
    default=None,
    help="Controller recompute period [default: 1s, 5s above 300 nodes].",
)
@click.option("--no-backups", is_flag=True, help="No backup next hops (no local fail-over).")
@click.option("--no-policy", is_flag=True, help="Install every new optimum (no anti-flap).")
@click.option(
    "--no-budget",
    is_flag=True,
    help="Probe every link at the probe period (the agents' probe.budget = false).",
)
@click.option(
    "--tunnel",
    default="0ms",
    show_default=True,
    help="What each tunnel adds to a probe's RTT (WireGuard's work; the lab's"
    " wireguard-go: ~0.3-0.5 ms): paid once direct, once per tunnel relayed.",
)
@click.option(
    "--tunnel-jitter",
    default="0ms",
    show_default=True,
    help="The spread (σ) each tunnel adds to a probe's RTT.",
)
@click.option(
    "--tunnel-spread",
    default="0ms",
    show_default=True,
    help="How far tunnels differ (σ): each draws its --tunnel share from it.",
)
@click.option(
    "--late-probes",
    default="off",
    show_default=True,
    metavar="SHARE/DELAY",
    help="A busy host's late probes, e.g. 3%/1.5ms: that share of probes late by an"
    " exponential delay of that mean (the twin fits it to the lab's σ readings).",
)
@routing_options
@json_option
def sim_cmd(
    topology: str,
    duration: str,
    seed: int,
    events: tuple[str, ...],
    probe_interval: str,
    recompute: str | None,
    no_backups: bool,
    no_policy: bool,
    no_budget: bool,
    tunnel: str,
    tunnel_jitter: str,
    tunnel_spread: str,
    late_probes: str,
    symmetric: bool,
    relay_cost: str | None,
    as_json: bool,
) -> None:
    """Simulate probing, the metric, the anti-flap policy and routing over time."""
    from dataclasses import replace

    from meshopt.policy import PolicyConfig
    from meshopt.sim.engine import SimConfig, simulate
    from meshopt.sim.events import parse_event
    from meshopt.topology.names import resolve_event_links

    parsed = [parse_event(e) for e in events]
    topo = open_topology(topology, seed=seed)
    parsed = resolve_event_links(parsed, topo.names)
    policy = PolicyConfig(0.0, 0.0, 0.0, 0.0) if no_policy else PolicyConfig()
    late_p, late_ms = parse_late(late_probes, "--late-probes")
    cfg = SimConfig(
        duration_s=parse_duration_s(duration, "--duration"),
        seed=seed,
        probe_interval_s=parse_duration_s(probe_interval, "--probe-interval"),
        recompute_s=None if recompute is None else parse_duration_s(recompute, "--recompute"),
        symmetric=symmetric,
        backups=not no_backups,
        metric=metric_from(relay_cost),
        policy=policy,
        tunnel_ms=parse_time_ms(tunnel, "--tunnel"),
        tunnel_sigma_ms=parse_time_ms(tunnel_jitter, "--tunnel-jitter"),
        tunnel_spread_ms=parse_time_ms(tunnel_spread, "--tunnel-spread"),
        late_p=late_p,
        late_ms=late_ms,
    )
    if no_budget:
        cfg = replace(cfg, budget=None)
    if cfg.duration_s <= 0 or cfg.probe_interval_s <= 0:
        raise InputError("--duration and --probe-interval must be > 0")
    if cfg.recompute_s is not None and cfg.recompute_s <= 0:
        raise InputError("--recompute must be > 0")
    if cfg.probe_interval_s >= cfg.dead_after_s:
        raise InputError(
            f"--probe-interval must be below the agents' dead time ({cfg.dead_after_s:g} s):"
            " a peer would be declared dead between two probes"
        )
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    err = Console(stderr=True)
    if err.is_terminal:
        with Progress(
            TextColumn("simulating"),
            BarColumn(),
            TextColumn("{task.percentage:>3.0f}%"),
            TimeRemainingColumn(),
            console=err,
            transient=True,
        ) as bar:
            task = bar.add_task("sim", total=1.0)
            report = simulate(topo, parsed, cfg, lambda f: bar.update(task, completed=f))
    else:
        report = simulate(topo, parsed, cfg)
    if as_json:
        print_json(report.to_dict())
    else:
        from meshopt.cli.render import Out, render_sim

        out = Out()
        render_sim(out, report)
        out.flush()
    sys.stdout.flush()
