"""``meshopt status``: this node's routes as the kernel has them, against the agent's.

It reads two things on the node itself, never the broker: the kernel (our routes,
protocol 77, and our policy rules, through rtnetlink) and the agent's local status file
(``status-<mesh>-<node>.json`` in its ``state_dir``: the routes and rules of its last
apply, the route set, the peers). So it works while the broker or the controller is
down, and shows what the kernel really does rather than what a controller published.

Exit codes: 0 in sync, 1 the kernel differs from the agent's last route set,
2 bad input, 3 no agent status to compare with.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from meshopt.cli.render import probe_text
from meshopt.errors import InputError, UnavailableError

if TYPE_CHECKING:
    from meshopt.install.model import DesiredRoute, DesiredRule
    from meshopt.metrics.statusfile import AgentStatus

DEFAULT_CONFIG = "/etc/meshopt/agent.toml"
SCHEMA = "meshopt.status/1"
TABLE_NAMES = {7701: "meshopt-fast", 7702: "meshopt-bulk"}  # packaging/iproute2


@dataclass
class RouteRow:
    state: str  # ok | missing | extra | wrong
    have: DesiredRoute | None
    want: DesiredRoute | None


@dataclass
class RuleRow:
    state: str  # ok | missing | extra
    rule: DesiredRule


@dataclass
class Comparison:
    routes: list[RouteRow] = field(default_factory=list)
    rules: list[RuleRow] = field(default_factory=list)

    def count(self, state: str) -> int:
        return sum(r.state == state for r in self.routes) + sum(
            r.state == state for r in self.rules
        )

    @property
    def in_sync(self) -> bool:
        return all(r.state == "ok" for r in self.routes) and all(
            r.state == "ok" for r in self.rules
        )


def _route_key(r: DesiredRoute) -> tuple[int, str, int, int]:
    return r.key


def compare(
    want_routes: list[DesiredRoute],
    have_routes: list[DesiredRoute],
    want_rules: list[DesiredRule],
    have_rules: list[DesiredRule],
) -> Comparison:
    """Kernel (have) against the agent's last apply (want); pure."""
    out = Comparison()
    have = {_route_key(r): r for r in have_routes}
    want = {_route_key(r): r for r in want_routes}
    for key in sorted(set(have) | set(want)):
        h, w = have.get(key), want.get(key)
        if h is None:
            out.routes.append(RouteRow("missing", None, w))
        elif w is None:
            out.routes.append(RouteRow("extra", h, None))
        else:
            out.routes.append(RouteRow("ok" if h == w else "wrong", h, w))
    have_r, want_r = set(have_rules), set(want_rules)
    for rule in sorted(have_r | want_r, key=lambda r: (r.family, r.priority, r.describe())):
        state = (
            "ok" if rule in have_r and rule in want_r else "extra" if rule in have_r else "missing"
        )
        out.rules.append(RuleRow(state, rule))
    return out


def _wanted(status: AgentStatus) -> tuple[list[DesiredRoute], list[DesiredRule]]:
    from meshopt.install.model import DesiredRoute, DesiredRule

    try:
        routes = [
            DesiredRoute(
                dst=r.dst,
                oif=r.oif,
                gateway=r.gateway,
                table=r.table,
                metric=r.metric,
                mtu=r.mtu,
                advmss=r.advmss,
                initcwnd=r.initcwnd,
                initrwnd=r.initrwnd,
                window=r.window,
                congctl=r.congctl,
            )
            for r in status.routes
        ]
        rules = [
            DesiredRule(
                priority=r.priority,
                table=r.table,
                fwmark=r.fwmark,
                fwmask=r.fwmask,
                dport=r.dport,
                ipproto=r.ipproto,
                tos=r.tos,
                family=r.family,
            )
            for r in status.rules
        ]
    except InputError as exc:
        raise InputError(f"agent status file: {exc}") from None
    return routes, rules


async def read_kernel(netns: str | None) -> tuple[list[DesiredRoute], list[DesiredRule]]:
    """Our routes (protocol 77, every table) and rules, in ``netns`` or this namespace."""
    from meshopt.install.routes import RouteInstaller

    async with RouteInstaller(netns) as inst:
        return await inst.installed_routes(), await inst.installed_rules()


def locate(config: str | None, state: str | None) -> Path:
    """The status file: given, or from the agent config's state_dir, mesh and node."""
    from meshopt.metrics.statusfile import status_path

    if state is not None:
        return Path(state)
    path = config or DEFAULT_CONFIG
    if config is None and not Path(path).exists():
        raise InputError(f"no {DEFAULT_CONFIG}: pass --config FILE (the agent's) or --state FILE")
    from meshopt.configfile import read_toml

    data = read_toml(path)
    agent = data.get("agent")
    if not isinstance(agent, dict):
        raise InputError("missing [agent] table", source=path)
    values = {}
    for key, default in (("mesh", None), ("node", None), ("state_dir", "/var/lib/meshopt")):
        value = agent.get(key, default)
        if not isinstance(value, str) or not value or "\0" in value:
            raise InputError(f"[agent] {key} must be a non-empty string", source=path)
        values[key] = value
    return status_path(values["state_dir"], values["mesh"], values["node"])


def _pid_running(pid: int) -> bool | None:
    """Whether the agent's process exists here (None: cannot tell)."""
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return None
    return True


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.0f} days"


def _table(n: int) -> str:
    name = TABLE_NAMES.get(n)
    return f"{name} ({n})" if name else str(n)


def _route_json(r: DesiredRoute | None) -> dict[str, Any] | None:
    if r is None:
        return None
    out: dict[str, Any] = {"dst": r.dst, "dev": r.oif, "gateway": r.gateway, "table": r.table}
    out["metric"] = r.metric
    for name in ("mtu", "advmss", "initcwnd", "initrwnd", "window", "congctl"):
        if getattr(r, name) is not None:
            out[name] = getattr(r, name)
    return out


def _rule_json(r: DesiredRule) -> dict[str, Any]:
    import socket

    return {
        "priority": r.priority,
        "table": r.table,
        "family": "inet6" if r.family == socket.AF_INET6 else "inet",
        "fwmark": r.fwmark,
        "fwmask": r.fwmask,
        "ipproto": r.ipproto,
        "dport": list(r.dport) if r.dport else None,
        "tos": r.tos,
    }


def report(status: AgentStatus, cmp: Comparison | None, now: float, path: Path) -> dict[str, Any]:
    """The JSON document (schema meshopt.status/1); the text output is drawn from it."""
    age = max(0.0, now - status.written_at)
    stale_after = max(3 * status.interval_s, status.interval_s + 10.0)
    rs = status.route_set
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "mesh": status.mesh,
        "node": status.node,
        "status_file": str(path),
        "agent": {
            "pid": status.pid,
            "running": _pid_running(status.pid) if status.running else False,
            "stopped_cleanly": not status.running,
            "started_at": status.started_at,
            "written_at": status.written_at,
            "age_s": round(age, 1),
            "stale": status.running and age > stale_after,
            "broker_connected": status.broker_connected,
        },
        "route_set": None
        if rs is None
        else {
            "version": rs.version,
            "term": rs.term,
            "controller": rs.controller,
            "issued_at": rs.issued_at,
            "age_s": round(max(0.0, now - rs.issued_at), 1),
            "routes": [
                {"dst": r.dst, "via": r.via, "backup": r.backup, "table": r.table}
                for r in rs.routes
            ],
        },
        "failed_over": status.failed_over,
        "apply_errors": status.apply_errors,
        "peers": [
            {
                "key": p.key,
                "interface": p.interface,
                "endpoint": p.endpoint,
                "alive": p.alive,
                "rtt_ms": p.rtt_ms,
                "loss": p.loss,
                "probe_class": p.probe_class,
                "probe_interval_s": p.probe_interval_s,
                "probe_dead_after_s": p.probe_dead_after_s,
            }
            for p in status.peers
        ],
        "compared": cmp is not None,
        "in_sync": True if cmp is None else cmp.in_sync,
        "kernel": None
        if cmp is None
        else {
            "routes": [
                {"state": r.state, "have": _route_json(r.have), "want": _route_json(r.want)}
                for r in cmp.routes
            ],
            "rules": [{"state": r.state, **_rule_json(r.rule)} for r in cmp.rules],
            "missing": cmp.count("missing"),
            "extra": cmp.count("extra"),
            "wrong": cmp.count("wrong"),
        },
    }
    return doc


def _style(text: str, code: str, color: bool) -> str:
    return f"\x1b[{code}m{text}\x1b[0m" if color and code else text


def render_text(doc: dict[str, Any], color: bool) -> str:
    lines: list[str] = []
    a = doc["agent"]
    if a["stopped_cleanly"]:
        state = _style("stopped", "1;33", color) + " (clean stop"
        state += f", {_age(a['age_s'])} ago)"
    elif a["running"] is False:
        state = _style(f"not running (pid {a['pid']} gone)", "1;31", color)
    elif a["stale"]:
        state = _style(f"status is {_age(a['age_s'])} old (agent hung?)", "1;31", color)
    else:
        state = f"running (pid {a['pid']}), status {_age(a['age_s'])} old"
    broker = (
        _style("broker connected", "32", color)
        if a["broker_connected"]
        else _style("broker NOT connected", "1;33", color)
    )
    lines.append(f"agent {doc['node']} (mesh {doc['mesh']}): {state}; {broker}")
    rs = doc["route_set"]
    if rs is None:
        lines.append("route set: none received yet")
    else:
        lines.append(
            f"route set: v{rs['version']} term {rs['term']} from {rs['controller']}, "
            f"issued {_age(rs['age_s'])} ago, {len(rs['routes'])} routes"
        )
    if doc["failed_over"]:
        lines.append("failed over (primary dead): " + ", ".join(doc["failed_over"]))
    for err in doc["apply_errors"]:
        lines.append(_style("refused by the kernel: ", "1;31", color) + err)
    if doc["peers"]:
        lines.append("")
        lines.append(
            f"  {'peer':<10} {'interface':<15} {'state':<6} {'rtt':>10} {'loss':>7}  probed"
        )
        for p in doc["peers"]:
            word = {True: "alive", False: "DEAD", None: "?"}[p["alive"]]
            alive = _style(f"{word:<6}", "1;31" if p["alive"] is False else "", color)
            rtt = f"{p['rtt_ms']:.2f} ms" if p["rtt_ms"] is not None else "-"
            loss = f"{100 * p['loss']:.1f} %" if p["loss"] is not None else "-"
            lines.append(
                f"  {p['key'][:8]:<10} {p['interface']:<15} {alive} {rtt:>10} {loss:>7}  "
                + probe_text(p["probe_class"], p["probe_interval_s"], p["probe_dead_after_s"])
            )
    lines.append("")
    k = doc["kernel"]
    if k is None:
        lines.append("kernel: not compared (the agent has installed no route set yet)")
        return "\n".join(lines)
    marks = {
        "ok": "  ok     ",
        "missing": _style("  MISSING", "1;31", color) + "",
        "extra": _style("  EXTRA  ", "1;31", color),
        "wrong": _style("  WRONG  ", "1;31", color),
    }
    lines.append("kernel routes (protocol 77):")
    if not k["routes"]:
        lines.append("  (none, and none wanted)")
    for r in k["routes"]:
        shown = r["have"] or r["want"]
        via = f" via {shown['gateway']}" if shown["gateway"] else ""
        text = f"{shown['dst']}{via} dev {shown['dev']} table {_table(shown['table'])}"
        if r["state"] == "wrong":
            w = r["want"]
            wvia = f" via {w['gateway']}" if w["gateway"] else ""
            if (w["dev"], w["gateway"]) != (shown["dev"], shown["gateway"]):
                text += f"  (agent wants{wvia} dev {w['dev']})"
            else:
                text += "  (attributes differ: mtu/advmss/window/congctl)"
        lines.append(f"{marks[r['state']]} {text}")
    lines.append("policy rules:")
    for r in k["rules"]:
        sel = []
        if r["fwmark"] is not None:
            sel.append(f"fwmark {r['fwmark']:#x}/{r['fwmask'] or 0:#x}")
        if r["ipproto"] is not None:
            sel.append(f"ipproto {r['ipproto']}")
        if r["dport"]:
            sel.append(f"dport {r['dport'][0]}-{r['dport'][1]}")
        if r["tos"] is not None:
            sel.append(f"tos {r['tos']:#04x}")
        what = " ".join(sel) or "all"
        text = f"{r['priority']}: from {what} lookup {_table(r['table'])} ({r['family']})"
        lines.append(f"{marks[r['state']]} {text}")
    lines.append("")
    if doc["in_sync"]:
        n = sum(1 for r in k["routes"] if r["state"] == "ok")
        lines.append(
            _style(f"in sync: the kernel has the agent's {n} routes and its rules", "32", color)
        )
    else:
        lines.append(
            _style(
                f"kernel differs from the last route set: {k['missing']} missing, "
                f"{k['extra']} extra, {k['wrong']} wrong",
                "1;31",
                color,
            )
        )
    return "\n".join(lines)


@click.command("status")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help=f"The agent's configuration, for its state_dir, mesh and node (default {DEFAULT_CONFIG}).",
)
@click.option(
    "--state",
    "state_path",
    type=click.Path(dir_okay=False),
    help="The agent's status file itself (status-MESH-NODE.json in its state_dir).",
)
@click.option("--netns", metavar="NAME", help="Read the kernel of this network namespace (labs).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def status_cmd(
    ctx: click.Context,
    config_path: str | None,
    state_path: str | None,
    netns: str | None,
    as_json: bool,
) -> None:
    """This node's routes in the kernel against the agent's last route set.

    Works without the broker. Exit 0 in sync, 1 the kernel differs, 2 bad input,
    3 no agent status found.
    """
    import importlib

    from meshopt.metrics.statusfile import read_status, reading

    path = locate(config_path, state_path)
    if netns is not None and ("/" in netns or netns in (".", "..") or not netns):
        raise InputError(f"--netns {netns!r} is not a namespace name")
    importlib.import_module("pyroute2")  # ~0.4 s: not while holding the agent's lock
    # The file and the kernel from one apply: the agent changes neither while we read.
    with reading(path):
        try:
            status = read_status(path)
        except FileNotFoundError:
            raise UnavailableError(
                f"no agent status at {path}: is the agent running (with this state_dir)?"
            ) from None
        except IsADirectoryError:
            raise InputError(f"{path} is a directory, not a status file") from None
        except PermissionError:
            raise InputError(
                f"{path}: permission denied (run as root or the agent's user)"
            ) from None
        cmp = None
        if status.applied:
            want_routes, want_rules = _wanted(status)
            have_routes, have_rules = asyncio.run(read_kernel(netns))
            cmp = compare(want_routes, have_routes, want_rules, have_rules)
    doc = report(status, cmp, time.time(), path)
    if as_json:
        json.dump(doc, sys.stdout, indent=2, allow_nan=False)
        sys.stdout.write("\n")
    else:
        color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
        click.echo(render_text(doc, color))
    if not doc["in_sync"]:
        ctx.exit(1)
