"""Readable tables for people; the same data goes out as JSON for scripts."""

from __future__ import annotations

import time

from rich.console import Console
from rich.table import Table

from meshopt.analysis import PathInfo, RouteEntry
from meshopt.live import LivePath, NodeRoutes, age_text
from meshopt.sim.report import GainSummary, SimReport
from meshopt.units import format_ms


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


def render_path(c: Console, info: PathInfo) -> None:
    if not info.hops:
        c.print(f"{info.src} → {info.dst}: [bold red]unreachable[/]")
        return
    t = Table(title=f"{info.src} → {info.dst}", title_justify="left")
    t.add_column("hop")
    t.add_column("RTT", justify="right")
    t.add_column("metric cost", justify="right")
    for h in info.hops:
        t.add_row(f"{h.src} → {h.dst}", format_ms(h.rtt_ms), format_ms(h.cost_ms))
    c.print(t)
    via = " via " + ", ".join(info.relays) if info.relays else " (direct tunnel)"
    c.print(f"path: {' → '.join([info.src, *[h.dst for h in info.hops]])}{via}")
    c.print(f"total RTT {format_ms(info.rtt_ms)}, metric cost {format_ms(info.cost_ms)}")
    if info.direct_rtt_ms == float("inf"):
        c.print("direct: no tunnel between these nodes")
    elif info.relays:
        pct = 100 * info.gain_ms / info.direct_rtt_ms
        c.print(
            f"direct tunnel: RTT {format_ms(info.direct_rtt_ms)}, cost "
            f"{format_ms(info.direct_cost_ms)}: relaying saves [bold green]"
            f"{format_ms(info.gain_ms)}[/] ({pct:.0f}%)"
        )
    else:
        c.print("the direct tunnel is the best path")


def render_routes(c: Console, node: str, entries: list[RouteEntry]) -> None:
    t = Table(title=f"routes of {node}", title_justify="left")
    for col in ("destination", "next hop", "backup", "RTT", "direct", "path"):
        t.add_column(col, justify="right" if col in ("RTT", "direct") else "left")
    for e in entries:
        relayed = e.next_hop is not None and e.next_hop != e.dst
        t.add_row(
            e.dst,
            f"[bold yellow]{e.next_hop}[/]" if relayed else (e.next_hop or "-"),
            e.backup or "-",
            format_ms(e.rtt_ms),
            format_ms(e.direct_rtt_ms),
            " → ".join(e.path) if e.path else "unreachable",
        )
    c.print(t)


def render_gains(c: Console, g: GainSummary, title: str) -> None:
    c.print(f"[bold]{title}[/]")
    c.print(
        f"  {g.pairs} pairs, {g.relayed} relayed, {g.improved} faster than their direct tunnel"
        + (f", {g.no_direct_tunnel} reachable only through a relay" if g.no_direct_tunnel else "")
    )
    if g.improved:
        c.print(
            f"  RTT saved: mean {format_ms(g.mean_gain_ms)} ({g.mean_gain_pct:.0f}%), "
            f"median {format_ms(g.median_gain_ms)} ({g.median_gain_pct:.0f}%), "
            f"best {format_ms(g.best_gain_ms)} ({g.best_gain_pct:.0f}%)"
        )
    if g.top:
        t = Table(title_justify="left")
        for col in ("pair", "direct", "routed", "saved", "path"):
            t.add_column(col, justify="left" if col in ("pair", "path") else "right")
        for p in g.top:
            t.add_row(
                f"{p.a} ↔ {p.b}",
                format_ms(p.direct_ms),
                format_ms(p.routed_ms),
                f"{format_ms(p.gain_ms)} ({100 * p.gain_ms / p.direct_ms:.0f}%)",
                " → ".join(p.path),
            )
        c.print(t)


def render_sim(c: Console, r: SimReport) -> None:
    mode = "symmetric" if r.symmetric else "directed"
    c.print(
        f"[bold]meshopt sim[/] {r.topology}: {r.nodes} nodes, {r.pairs} pairs, "
        f"{r.duration_s:.0f} s simulated ({mode} routes, seed {r.seed}) in {r.runtime_s:.1f} s"
    )
    if r.initial_converge_s is None:
        until = r.events[0].at_s if r.events else r.duration_s
        c.print(
            f"initial convergence: not within {until:g} s ({r.initial_suboptimal_pairs} of "
            f"{r.nodes * (r.nodes - 1)} routes still outside the policy margin)"
        )
    else:
        c.print(f"initial convergence: {_s(r.initial_converge_s)}")
    render_gains(c, r.gains, "Relaying (installed routes before the first event)")
    if r.gains.pairs:
        c.print(f"  installed routes vs optimum: {r.gains.mean_shortfall_ms:+.2f} ms RTT, mean")
    if r.events:
        t = Table(title="Events", title_justify="left")
        for col in ("at", "event", "outage", "converged", "pairs cut", "changes", "left off"):
            t.add_column(col, justify="left" if col == "event" else "right")
        for e in r.events:
            t.add_row(
                f"{e.at_s:.1f} s",
                e.event,
                _s(e.outage_s) if e.broken_pairs else "none",
                _s(e.converge_s),
                str(e.broken_pairs),
                str(e.route_changes),
                str(e.suboptimal_pairs),
            )
        c.print(t)
        c.print(
            "  outage: until every pair that can be reached has a working route again; "
            "converged: until every pair the event moved is within the policy's margin of "
            "the optimum; left off: pairs outside it when the interval ended"
        )
    c.print(
        f"route changes: {r.route_changes} in all, {r.changes_per_route_hour:.2f} per route "
        f"per hour; local fail-overs: {r.failovers}"
    )
    if r.max_changes_pair:
        top = ", ".join(f"{a}↔{b} {n}" for a, b, n in r.max_changes_pair[:5])
        c.print(f"  most changed pairs: {top}")


# --- a live mesh (read from the broker) ------------------------------------------------


def when_text(t: float | None, now: float | None = None) -> str:
    """'2024-05-01 12:00:03 (14 s ago)'; '-' when unknown."""
    if t is None:
        return "-"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    return f"{stamp} ({age_text(t, time.time() if now is None else now)})"


def _ms(value: float | None) -> str:
    return "-" if value is None else format_ms(value)


def _checked(verified: bool | None) -> str:
    return "unverified" if verified is None else ("signature verified" if verified else "BAD")


def render_live_routes(c: Console, r: NodeRoutes) -> None:
    online = {None: "no status", True: "agent online", False: "[bold red]agent offline[/]"}
    t = Table(
        title=(
            f"routes of {r.node}: version {r.version} from {r.controller} (term {r.term}), "
            f"since {when_text(r.issued_at)}, {_checked(r.verified)}, {online[r.online]}"
        ),
        title_justify="left",
    )
    for col in ("destination", "table", "next hop", "backup", "RTT", "direct", "path"):
        t.add_column(col, justify="right" if col in ("RTT", "direct") else "left")
    for e in r.routes:
        t.add_row(
            e.dst,
            e.table,
            f"[bold yellow]{e.next_hop}[/]" if e.relayed else e.next_hop,
            e.backup or "-",
            _ms(e.rtt_ms),
            _ms(e.direct_rtt_ms),
            " → ".join(e.path) if e.path else "-",
        )
    if not r.routes:
        t.add_row("(no routes)", "", "", "", "", "", "")
    c.print(t)


def render_live_path(c: Console, p: LivePath) -> None:
    t = Table(title=f"{p.src} → {p.dst} (as the route sets forward now)", title_justify="left")
    t.add_column("hop")
    t.add_column("measured RTT", justify="right")
    for h in p.hops:
        t.add_row(f"{h.src} → {h.dst}", _ms(h.rtt_ms))
    c.print(t)
    if not p.complete:
        c.print(f"path: {' → '.join(p.nodes)} [bold red]broken[/]: {p.problem}")
    else:
        via = " via " + ", ".join(p.relays) if p.relays else " (direct tunnel)"
        c.print(f"path: {' → '.join(p.nodes)}{via}")
        c.print(f"total RTT {_ms(p.rtt_ms)} (sum of the measured hops)")
    gain = p.gain_ms
    if p.direct_rtt_ms is None:
        c.print("direct tunnel: no measurement")
    elif p.relays and gain is not None:
        pct = 100 * abs(gain) / p.direct_rtt_ms if p.direct_rtt_ms else 0.0
        if gain >= 0:
            verdict = f"relaying saves [bold green]{format_ms(gain)}[/] ({pct:.0f}%)"
        else:  # the controller holds routes against noise (anti-flap), or load skews RTTs
            verdict = f"relaying costs [bold red]{format_ms(-gain)}[/] ({pct:.0f}%) more now"
        c.print(f"direct tunnel: RTT {format_ms(p.direct_rtt_ms)}: {verdict}")
    else:
        c.print(f"direct tunnel: RTT {format_ms(p.direct_rtt_ms)}")
    c.print(f"since {when_text(p.since)} (newest route set along the path)")
