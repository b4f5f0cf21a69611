"""Readable tables for people; the same data goes out as JSON for scripts.

Tables are plain formatted columns written in one go: a 52-node ``routes`` is 2,652 rows,
and a per-cell layout engine (rich) spent seconds on them. Colour only on a terminal
(and never with NO_COLOR set).

The JSON documents of ``routes`` and ``path`` are built here, one schema for the offline
and the live form (docs/cli.md): ``source`` says which, fields one form cannot know are
null.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, TextIO

from meshopt.units import format_ms

if TYPE_CHECKING:
    from meshopt.analysis import PathInfo, RouteEntry
    from meshopt.live import LivePath, LiveView, NodeRoutes
    from meshopt.sim.report import GainSummary, SimReport

ROUTES_SCHEMA = "meshopt.routes/1"
PATH_SCHEMA = "meshopt.path/1"

_STYLES = {"relay": "\x1b[1;33m", "bad": "\x1b[1;31m", "good": "\x1b[1;32m", "bold": "\x1b[1m"}
_RESET = "\x1b[0m"

Cell = str | tuple[str, str]  # text, or (text, style name)


def _seconds(x: float) -> str:
    return f"{x:.3g} s"


def probe_text(cls: str | None, interval_s: float | None, dead_after_s: float | None) -> str:
    """How a peer is probed, for people: "in use: every 0.33 s, dead after 0.8 s"."""
    if cls is None and interval_s is None:
        return "-"
    word = {"in_use": "in use", "idle": "idle"}.get(cls or "", cls or "?")
    parts = [word]
    if interval_s is not None:
        parts.append(f"every {_seconds(interval_s)}")
    if dead_after_s is not None:
        parts.append(f"dead after {_seconds(dead_after_s)}")
    return parts[0] + (": " + ", ".join(parts[1:]) if len(parts) > 1 else "")


class Out:
    """Lines for stdout, gathered and written once; styles only where a terminal shows them."""

    def __init__(self, stream: TextIO | None = None, color: bool | None = None) -> None:
        self.stream = stream or sys.stdout
        if color is None:
            color = self.stream.isatty() and "NO_COLOR" not in os.environ
        self.color = color
        self.lines: list[str] = []

    def style(self, text: str, kind: str) -> str:
        return f"{_STYLES[kind]}{text}{_RESET}" if self.color else text

    def line(self, text: str = "") -> None:
        self.lines.append(text)

    def table(
        self,
        headers: Sequence[str],
        rows: Sequence[Sequence[Cell]],
        *,
        title: str | None = None,
        right: Sequence[str] = (),
    ) -> None:
        """Columns padded to their widest cell; ``right`` names right-aligned columns."""
        texts = [[c if isinstance(c, str) else c[0] for c in row] for row in rows]
        widths = [len(h) for h in headers]
        for text_row in texts:
            for k, text in enumerate(text_row):
                if len(text) > widths[k]:
                    widths[k] = len(text)
        flush = [h in right for h in headers]
        last = len(headers) - 1

        def pad(k: int, text: str) -> str:
            if flush[k]:
                return text.rjust(widths[k])
            return text if k == last else text.ljust(widths[k])

        if title is not None:
            self.line(self.style(title, "bold"))
        self.line("  " + "  ".join(pad(k, h) for k, h in enumerate(headers)).rstrip())
        self.line("  " + "  ".join("─" * w for w in widths))
        for cell_row, text_row in zip(rows, texts, strict=True):
            cells = []
            for k, (cell, text) in enumerate(zip(cell_row, text_row, strict=True)):
                padded = pad(k, text)
                if isinstance(cell, tuple) and self.color:
                    padded = padded.replace(text, self.style(text, cell[1]), 1)
                cells.append(padded)
            self.line("  " + "  ".join(cells).rstrip())

    def flush(self) -> None:
        if self.lines:
            self.stream.write("\n".join(self.lines) + "\n")
            self.stream.flush()
        self.lines = []


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


def _ms(value: float | None) -> str:
    return "-" if value is None else format_ms(value)


# --- offline answers (a topology) --------------------------------------------------------


def render_path(o: Out, info: PathInfo) -> None:
    if not info.hops:
        o.line(f"{info.src} → {info.dst}: {o.style('unreachable', 'bad')} (no path in the mesh)")
        return
    o.table(
        ["hop", "RTT", "metric cost"],
        [(f"{h.src} → {h.dst}", format_ms(h.rtt_ms), format_ms(h.cost_ms)) for h in info.hops],
        title=f"{info.src} → {info.dst}",
        right=("RTT", "metric cost"),
    )
    via = " via " + ", ".join(info.relays) if info.relays else " (direct tunnel)"
    o.line(f"path: {' → '.join([info.src, *[h.dst for h in info.hops]])}{via}")
    o.line(f"total RTT {format_ms(info.rtt_ms)}, metric cost {format_ms(info.cost_ms)}")
    if info.direct_rtt_ms == float("inf"):
        o.line("direct: no tunnel between these nodes")
    elif info.relays:
        pct = 100 * info.gain_ms / info.direct_rtt_ms
        saved = o.style(format_ms(info.gain_ms), "good")
        o.line(
            f"direct tunnel: RTT {format_ms(info.direct_rtt_ms)}, cost "
            f"{format_ms(info.direct_cost_ms)}: relaying saves {saved} ({pct:.0f}%)"
        )
    else:
        o.line("the direct tunnel is the best path")


def render_routes(o: Out, node: str, entries: list[RouteEntry]) -> None:
    rows: list[list[Cell]] = []
    for e in entries:
        relayed = e.next_hop is not None and e.next_hop != e.dst
        rows.append(
            [
                e.dst,
                (e.next_hop, "relay") if relayed and e.next_hop else (e.next_hop or "-"),
                e.backup or "-",
                format_ms(e.rtt_ms),
                format_ms(e.direct_rtt_ms),
                " → ".join(e.path) if e.next_hop is not None else ("unreachable", "bad"),
            ]
        )
    o.table(
        ["destination", "next hop", "backup", "RTT", "direct", "path"],
        rows,
        title=f"routes of {node}",
        right=("RTT", "direct"),
    )
    o.line()


def render_gains(o: Out, g: GainSummary, title: str) -> None:
    o.line(o.style(title, "bold"))
    o.line(
        f"  {g.pairs} pairs, {g.relayed} relayed, {g.improved} faster than their direct tunnel"
        + (f", {g.no_direct_tunnel} reachable only through a relay" if g.no_direct_tunnel else "")
    )
    if g.improved:
        o.line(
            f"  RTT saved: mean {format_ms(g.mean_gain_ms)} ({g.mean_gain_pct:.0f}%), "
            f"median {format_ms(g.median_gain_ms)} ({g.median_gain_pct:.0f}%), "
            f"best {format_ms(g.best_gain_ms)} ({g.best_gain_pct:.0f}%)"
        )
    if g.top:
        o.table(
            ["pair", "direct", "routed", "saved", "path"],
            [
                (
                    f"{p.a} ↔ {p.b}",
                    format_ms(p.direct_ms),
                    format_ms(p.routed_ms),
                    f"{format_ms(p.gain_ms)} ({100 * p.gain_ms / p.direct_ms:.0f}%)",
                    " → ".join(p.path),
                )
                for p in g.top
            ],
            right=("direct", "routed", "saved"),
        )


def render_sim(o: Out, r: SimReport) -> None:
    mode = "symmetric" if r.symmetric else "directed"
    o.line(
        f"{o.style('meshopt sim', 'bold')} {r.topology}: {r.nodes} nodes, {r.pairs} pairs, "
        f"{r.duration_s:.0f} s simulated ({mode} routes, seed {r.seed}) in {r.runtime_s:.1f} s"
    )
    if r.initial_converge_s is None:
        until = r.events[0].at_s if r.events else r.duration_s
        o.line(
            f"initial convergence: not within {until:g} s ({r.initial_suboptimal_pairs} of "
            f"{r.nodes * (r.nodes - 1)} routes still outside the policy margin)"
        )
    else:
        o.line(f"initial convergence: {_s(r.initial_converge_s)}")
    render_gains(o, r.gains, "Relaying (installed routes before the first event)")
    if r.gains.pairs:
        o.line(f"  installed routes vs optimum: {r.gains.mean_shortfall_ms:+.2f} ms RTT, mean")
    if r.events:
        o.table(
            ["at", "event", "outage", "converged", "pairs cut", "changes", "left off"],
            [
                (
                    f"{e.at_s:.1f} s",
                    e.event,
                    _s(e.outage_s) if e.broken_pairs else "none",
                    _s(e.converge_s),
                    str(e.broken_pairs),
                    str(e.route_changes),
                    str(e.suboptimal_pairs),
                )
                for e in r.events
            ],
            title="Events",
            right=("at", "outage", "converged", "pairs cut", "changes", "left off"),
        )
        o.line(
            "  outage: until every pair that can be reached has a working route again; "
            "converged: until every pair the event moved is within the policy's margin of "
            "the optimum; left off: pairs outside it when the interval ended"
        )
    o.line(
        f"route changes: {r.route_changes} in all, {r.changes_per_route_hour:.2f} per route "
        f"per hour; local fail-overs: {r.failovers}"
    )
    if r.max_changes_pair:
        top = ", ".join(f"{a}↔{b} {n}" for a, b, n in r.max_changes_pair[:5])
        o.line(f"  most changed pairs: {top}")


# --- a live mesh (read from the broker) ------------------------------------------------


def when_text(t: float | None, now: float | None = None) -> str:
    """'2024-05-01 12:00:03 (14 s ago)'; '-' when unknown."""
    from meshopt.live import age_text

    if t is None:
        return "-"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    return f"{stamp} ({age_text(t, time.time() if now is None else now)})"


def _checked(verified: bool | None) -> str:
    return "unverified" if verified is None else ("signature verified" if verified else "BAD")


def render_live_routes(o: Out, r: NodeRoutes) -> None:
    online = {None: "no status", True: "agent online", False: o.style("agent offline", "bad")}
    rows: list[list[Cell]] = [
        [
            e.dst,
            e.table,
            (e.next_hop, "relay") if e.relayed else e.next_hop,
            e.backup or "-",
            _ms(e.rtt_ms),
            _ms(e.direct_rtt_ms),
            " → ".join(e.path) if e.path else "-",
        ]
        for e in r.routes
    ]
    if not rows:
        rows.append(["(no routes)", "", "", "", "", "", ""])
    o.table(
        ["destination", "table", "next hop", "backup", "RTT", "direct", "path"],
        rows,
        title=(
            f"routes of {r.node}: version {r.version} from {r.controller} (term {r.term}), "
            f"since {when_text(r.issued_at)}, {_checked(r.verified)}, {online[r.online]}"
        ),
        right=("RTT", "direct"),
    )
    o.line()


def render_live_path(o: Out, p: LivePath) -> None:
    o.table(
        ["hop", "measured RTT", "probed"],
        [
            (
                f"{h.src} → {h.dst}",
                _ms(h.rtt_ms),
                probe_text(h.probe_class, h.probe_interval_s, h.probe_dead_after_s),
            )
            for h in p.hops
        ],
        title=f"{p.src} → {p.dst} (as the route sets forward now)",
        right=("measured RTT",),
    )
    if not p.complete:
        o.line(f"path: {' → '.join(p.nodes)} {o.style('broken', 'bad')}: {p.problem}")
    else:
        via = " via " + ", ".join(p.relays) if p.relays else " (direct tunnel)"
        o.line(f"path: {' → '.join(p.nodes)}{via}")
        o.line(f"total RTT {_ms(p.rtt_ms)} (sum of the measured hops)")
    gain = p.gain_ms
    if p.direct_rtt_ms is None:
        o.line("direct tunnel: no measurement")
    elif p.relays and gain is not None:
        pct = 100 * abs(gain) / p.direct_rtt_ms if p.direct_rtt_ms else 0.0
        if gain >= 0:
            verdict = f"relaying saves {o.style(format_ms(gain), 'good')} ({pct:.0f}%)"
        else:  # the controller holds routes against noise (anti-flap), or load skews RTTs
            verdict = f"relaying costs {o.style(format_ms(-gain), 'bad')} ({pct:.0f}%) more now"
        o.line(f"direct tunnel: RTT {format_ms(p.direct_rtt_ms)}: {verdict}")
    else:
        o.line(f"direct tunnel: RTT {format_ms(p.direct_rtt_ms)}")
    o.line(f"since {when_text(p.since)} (newest route set along the path)")


# --- JSON: one schema for the offline and the live form -----------------------------------


def _when(t: float | None) -> dict[str, Any]:
    iso = None if t is None else time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))
    return {"since": t, "since_iso": iso}


def _route_set_fields(r: NodeRoutes | None) -> dict[str, Any]:
    """What the route set a node installed says about itself; null offline."""
    return {
        "online": None if r is None else r.online,
        "version": None if r is None else r.version,
        "issued_at": None if r is None else r.issued_at,
        "controller": None if r is None else r.controller,
        "term": None if r is None else r.term,
        "verified": None if r is None else r.verified,
        **_when(None if r is None else r.issued_at),
    }


def offline_routes_json(
    mesh: str, topology: str, tables: dict[str, list[RouteEntry]]
) -> dict[str, Any]:
    nodes = {}
    for name, entries in tables.items():
        routes = [
            {
                "dst": e.dst,
                "prefix": None,
                "table": "fast",
                "next_hop": e.next_hop,
                "backup": e.backup,
                "relayed": e.next_hop is not None and e.next_hop != e.dst,
                "reachable": e.next_hop is not None,
                "path": e.path if e.next_hop is not None else [],
                "rtt_ms": e.rtt_ms,
                "cost_ms": e.cost_ms,
                "direct_rtt_ms": e.direct_rtt_ms,
            }
            for e in entries
        ]
        nodes[name] = {"node": name, **_route_set_fields(None), "routes": routes}
    return {
        "schema": ROUTES_SCHEMA,
        "source": "offline",
        "mesh": mesh,
        "topology": topology,
        "broker": None,
        "lease": None,
        "warnings": [],
        "unreachable": _unreachable(nodes),
        "nodes": nodes,
    }


def live_routes_json(
    view: LiveView, tables: dict[str, NodeRoutes], lease: dict[str, Any] | None
) -> dict[str, Any]:
    nodes = {}
    for name, r in tables.items():
        routes = [
            {
                "dst": e.dst,
                "prefix": e.prefix,
                "table": e.table,
                "next_hop": e.next_hop,
                "backup": e.backup,
                "relayed": e.relayed,
                # None: a prefix no node announces (its path cannot be followed)
                "reachable": (e.path[-1] == e.dst) if e.path else None,
                "path": e.path,
                "rtt_ms": e.rtt_ms,
                "cost_ms": None,
                "direct_rtt_ms": e.direct_rtt_ms,
            }
            for e in r.routes
        ]
        nodes[name] = {"node": name, **_route_set_fields(r), "routes": routes}
    return {
        "schema": ROUTES_SCHEMA,
        "source": "live",
        "mesh": view.mesh,
        "topology": None,
        "broker": view.broker,
        "lease": lease,
        "warnings": view.warnings,
        "unreachable": _unreachable(nodes),
        "nodes": nodes,
    }


def _unreachable(nodes: dict[str, Any]) -> list[list[str]]:
    """[src, dst] of every route that does not arrive (exit status 1 when any)."""
    return [
        [name, r["dst"]]
        for name, d in nodes.items()
        for r in d["routes"]
        if r["reachable"] is False and r["table"] == "fast"
    ]


_NO_PROBE: dict[str, Any] = {
    "probe_class": None,
    "probe_interval_s": None,
    "probe_dead_after_s": None,
}


def offline_path_json(mesh: str, topology: str, info: PathInfo) -> dict[str, Any]:
    reachable = bool(info.hops)
    return {
        "schema": PATH_SCHEMA,
        "source": "offline",
        "mesh": mesh,
        "topology": topology,
        "src": info.src,
        "dst": info.dst,
        "table": "fast",
        "reachable": reachable,
        "problem": None if reachable else f"no path from {info.src} to {info.dst}",
        "path": [info.src, *[h.dst for h in info.hops]],
        "relays": info.relays,
        # How each tunnel is probed is known live only (the agents' telemetry).
        "hops": [{**asdict(h), **_NO_PROBE} for h in info.hops],
        "rtt_ms": info.rtt_ms,
        "cost_ms": info.cost_ms,
        "direct_rtt_ms": info.direct_rtt_ms,
        "direct_cost_ms": info.direct_cost_ms,
        "gain_ms": info.gain_ms if reachable else None,
        **_when(None),
    }


def live_path_json(view: LiveView, p: LivePath) -> dict[str, Any]:
    return {
        "schema": PATH_SCHEMA,
        "source": "live",
        "mesh": view.mesh,
        "topology": None,
        "src": p.src,
        "dst": p.dst,
        "table": p.table,
        "reachable": p.complete,
        "problem": p.problem or None,
        "path": p.nodes,
        "relays": p.relays,
        "hops": [{**asdict(h), "cost_ms": None} for h in p.hops],
        "rtt_ms": p.rtt_ms,
        "cost_ms": None,
        "direct_rtt_ms": p.direct_rtt_ms,
        "direct_cost_ms": None,
        "gain_ms": p.gain_ms,
        **_when(p.since),
    }
