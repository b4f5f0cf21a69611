"""Agents (and their configs) in a lab: one ``meshopt agent`` per node.

The configs are what an operator would write, filled in from the lab plan: the
node's WireGuard interfaces, the mesh prefix, the broker on the management network and
a state directory inside the lab's directory (so ``lab down`` removes it). Agents are
ordinary processes in the node's namespace: tagged, ended by ``lab down`` if still up.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

from meshopt.lab.lab import Lab
from meshopt.lab.state import lab_dir
from meshopt.metrics import AGENT_PORT as AGENT_METRICS_PORT


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
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
        "controller_keys": list(controller_keys),
        "identity_key": str(identity_key(lab, node)[0]),
        "state_dir": str(lab_dir(lab.plan.lab_id) / "agents" / node),
    }
    out: dict[str, dict[str, Any]] = {
        "agent": agent,
        "broker": broker_table(lab, node),
        # /metrics and /healthz on the management network, where a Prometheus next to
        # the broker and the controller reaches every node (docs/observability.md).
        "metrics": {"listen": f"{lab.mgmt_ip(node)}:{AGENT_METRICS_PORT}"},
    }
    for table, values in (sections or {}).items():
        out.setdefault(table, {}).update(values)
    return out


def broker_table(lab: Lab, identity: str) -> dict[str, str]:
    """The [broker] table of ``identity``'s config: the lab's broker, its credentials."""
    settings = asdict(lab.broker_settings(identity))
    return {k: v for k, v in settings.items() if v}


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


def agent_log_path(lab: Lab, node: str) -> Path:
    return lab_dir(lab.plan.lab_id) / "agents" / f"{node}.log"


def agent_log(lab: Lab, node: str) -> str:
    path = agent_log_path(lab, node)
    return path.read_text(errors="replace") if path.exists() else ""


def controller_key(lab: Lab) -> tuple[Path, str]:
    """The lab's controller signing key (made once per lab) and its public key."""
    return _key_file(lab_dir(lab.plan.lab_id) / "controller.key")


def start_controller(
    lab: Lab,
    controller_id: str = "ctl1",
    *,
    settings: Mapping[str, Any] | None = None,
    sections: Mapping[str, Mapping[str, Any]] | None = None,
    log_level: str = "info",
) -> subprocess.Popen[bytes]:
    """Start ``meshopt controller`` in the lab's management namespace (next to the broker).

    It is tagged like every lab process, so ``lab down`` ends it if it is still running.
    """
    from meshopt.lab import procs
    from meshopt.lab.netns import netns_argv

    key, _ = controller_key(lab)
    top: dict[str, Any] = {
        "mesh": lab.plan.name,
        "id": controller_id,
        "signing_key": str(key),
        "symmetric": lab.plan.layout == "single",
        **(settings or {}),
    }
    cfg: dict[str, dict[str, Any]] = {
        "controller": top,
        "broker": broker_table(lab, controller_id),
        "node_keys": enrolment(lab),
    }
    for table, values in (sections or {}).items():
        cfg.setdefault(table, {}).update(values)
    path = lab_dir(lab.plan.lab_id) / "controllers" / f"{controller_id}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_toml(cfg))
    log = path.with_suffix(".log").open("ab")
    argv = [sys.executable, "-m", "meshopt.cli.main", "controller", "--config", str(path)]
    argv += ["--log-level", log_level]
    import os

    env = {**os.environ, procs.TAG: lab.plan.lab_id}
    try:
        return subprocess.Popen(
            netns_argv(lab.plan.mgmt_netns, argv),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            process_group=0,  # not a session of its own: see procs.spawn
        )
    finally:
        log.close()


def controller_log(lab: Lab, controller_id: str = "ctl1") -> str:
    path = lab_dir(lab.plan.lab_id) / "controllers" / f"{controller_id}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def _key_file(path: Path) -> tuple[Path, str]:
    """An Ed25519 key at ``path`` (made the first time) and its public key."""
    from meshopt.bus.signing import (
        generate_signing_key,
        load_private_key,
        public_key_b64,
        save_private_key,
    )

    if path.exists():
        return path, public_key_b64(load_private_key(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    key, public = generate_signing_key()
    save_private_key(path, key)
    return path, public


def identity_key(lab: Lab, node: str) -> tuple[Path, str]:
    """``node``'s agent identity key (made once per lab) and its public key."""
    return _key_file(lab_dir(lab.plan.lab_id) / "identities" / f"{node}.key")


def enrolment(lab: Lab) -> dict[str, dict[str, Any]]:
    """The controller's [node_keys]: every node's identity, pinned to the WireGuard keys
    and the overlay address the lab gave it (what an operator knows from wg configs)."""
    out: dict[str, dict[str, Any]] = {}
    for n in lab.plan.nodes:
        out[n.name] = {
            "key": identity_key(lab, n.name)[1],
            "wireguard": sorted(w.public_key for w in lab.state.wg if w.node == n.name),
            "addresses": [
                f"{n.overlay_ip}/32" if ":" not in n.overlay_ip else f"{n.overlay_ip}/128"
            ],
        }
    return out


class BootWatch(threading.Thread):
    """When each agent logged that it is up (reading its lab log every 0.1 s), in
    seconds from ``t0``: the agents' start-up, an input of the simulated twin."""

    def __init__(self, logs: Mapping[str, Path], t0: float, timeout_s: float = 60.0) -> None:
        super().__init__(daemon=True)
        self.logs, self.t0, self.timeout_s = logs, t0, timeout_s
        self.up: dict[str, float] = {}

    def run(self) -> None:
        while len(self.up) < len(self.logs) and time.monotonic() - self.t0 < self.timeout_s:
            for node, path in self.logs.items():
                if node in self.up:
                    continue
                try:
                    text = path.read_text(errors="replace")
                except OSError:
                    continue
                if " up: interfaces " in text:
                    self.up[node] = time.monotonic() - self.t0
            time.sleep(0.1)


_STALL = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \S+ \S+ prober: woke ([\d.]+) s late"
)


_INSTALLED = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \S+ \S+ route set v\d+ installed (\d+) ms "
    r"after it arrived"
)


def _log_lines(
    logs: Mapping[str, Path], pattern: re.Pattern[str]
) -> list[tuple[str, float, re.Match[str]]]:
    """(node, wall-clock time, match) of every line of the agents' logs ``pattern`` matches."""
    out = []
    for node, path in logs.items():
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            m = pattern.match(line)
            if m is None:
                continue
            stamp = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")  # local time
            out.append((node, stamp.timestamp() + int(m.group(2)) / 1000, m))
    return sorted(out, key=lambda x: x[1])


def agent_installs(logs: Mapping[str, Path]) -> list[tuple[str, float, float]]:
    """(node, wall-clock time a route set arrived, seconds until it was in the kernel)
    for every route set the agents logged installing."""
    out = []
    for node, at, m in _log_lines(logs, _INSTALLED):
        took = int(m.group(3)) / 1000
        out.append((node, at - took, took))
    return sorted(out, key=lambda x: x[1])


def agent_stalls(logs: Mapping[str, Path]) -> list[tuple[str, float, float]]:
    """(node, wall-clock time it woke, seconds it was late) for every stall an agent's
    prober logged (at least 0.5 s: its whole process did not run, a busy or paused
    machine). A benchmark reads them as the lab failing to keep time, not as routing."""
    return [(node, at, float(m.group(3))) for node, at, m in _log_lines(logs, _STALL)]


def agent_logs(lab: Lab, nodes: Sequence[str]) -> dict[str, Path]:
    """Each agent's lab log, removed first: a log left from an earlier start would read as up."""
    logs = {n: agent_log_path(lab, n) for n in nodes}
    for path in logs.values():
        path.unlink(missing_ok=True)
    return logs


def keep_logs(lab: Lab, dest: Path) -> list[Path]:
    """Copy the lab's logs (agents, controllers, broker, wireguard-go, emulator) under
    ``dest`` before the lab goes down with them: what a benchmark run looked like from inside."""
    root = lab_dir(lab.plan.lab_id)
    kept: list[Path] = []
    for path in sorted(root.rglob("*.log")):
        if not path.is_file():
            continue
        target = dest / path.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        kept.append(target)
    return kept
