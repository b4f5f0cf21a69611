"""Agents (and their configs) in a lab: one ``meshopt agent`` per node.

The configs are what an operator would write, filled in from the lab plan: the
node's WireGuard interfaces, the mesh prefix, the broker on the management network and
a state directory inside the lab's directory (so ``lab down`` removes it). Agents are
ordinary processes in the node's namespace: tagged, ended by ``lab down`` if still up.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from meshopt.lab.lab import Lab
from meshopt.lab.state import lab_dir


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML for {v!r}")


def dump_toml(data: Mapping[str, Mapping[str, Any]]) -> str:
    """Tables of scalars and lists: all an agent config needs."""
    lines: list[str] = []
    for table, values in data.items():
        lines.append(f"[{table}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in values.items())
        lines.append("")
    return "\n".join(lines)


def agent_config(
    lab: Lab,
    node: str,
    *,
    controller_keys: Sequence[str] = (),
    sections: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, dict[str, Any]]:
    """The config of ``node``'s agent; ``sections`` override or add keys per table."""
    single = lab.plan.layout == "single"
    agent: dict[str, Any] = {
        "mesh": lab.plan.name,
        "node": node,
        "interfaces": ["wg0"] if single else ["wg-*"],
        "layout": lab.plan.layout,
        "mesh_prefixes": [lab.plan.overlay_net],
        "broker": f"mqtt://{lab.plan.broker_ip}:1883",
        "controller_keys": list(controller_keys),
        "state_dir": str(lab_dir(lab.plan.lab_id) / "agents" / node),
    }
    out: dict[str, dict[str, Any]] = {"agent": agent}
    for table, values in (sections or {}).items():
        out.setdefault(table, {}).update(values)
    return out


def write_agent_config(lab: Lab, node: str, config: Mapping[str, Mapping[str, Any]]) -> Path:
    path = lab_dir(lab.plan.lab_id) / "agents" / f"{node}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_toml(config))
    return path


def start_agent(
    lab: Lab,
    node: str,
    *,
    controller_keys: Sequence[str] = (),
    sections: Mapping[str, Mapping[str, Any]] | None = None,
    log_level: str = "info",
) -> subprocess.Popen[bytes]:
    """Start ``meshopt agent`` in ``node``; its log is ``<lab dir>/agents/<node>.log``."""
    cfg = agent_config(lab, node, controller_keys=controller_keys, sections=sections)
    path = write_agent_config(lab, node, cfg)
    log = path.with_suffix(".log").open("ab")
    argv = [
        sys.executable,
        "-m",
        "meshopt.cli.main",
        "agent",
        "--config",
        str(path),
        "--log-level",
        log_level,
    ]
    try:
        return lab.popen(node, argv, stdout=log, stderr=subprocess.STDOUT)
    finally:
        log.close()


def agent_log(lab: Lab, node: str) -> str:
    path = lab_dir(lab.plan.lab_id) / "agents" / f"{node}.log"
    return path.read_text(errors="replace") if path.exists() else ""
