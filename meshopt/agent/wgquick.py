"""Living next to wg-quick: find its config for our interfaces and warn where they clash.

The agent moves relayed destinations between peers' AllowedIPs (single-interface
layout). wg-quick with ``SaveConfig = true`` writes the live AllowedIPs back into
``/etc/wireguard/<if>.conf`` when the interface goes down, so the agent's moves would
become the operator's configuration; this is detected and explained in one warning.
``wg syncconf``/``wg setconf`` revert the moves instead, which the agent repairs within
one peer poll (the drift check in meshopt.agent.daemon).
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("meshopt.agent")

WG_QUICK_DIR = Path("/etc/wireguard")
MAX_CONFIG_BYTES = 1 << 20


def save_config_enabled(text: str) -> bool:
    """True when the ``[Interface]`` section says ``SaveConfig = true`` (wg-quick(8))."""
    section = ""
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip().lower()
            continue
        key, eq, value = line.partition("=")
        if eq and section == "interface" and key.strip().lower() == "saveconfig":
            return value.strip().lower() == "true"
    return False


def read_wg_quick(ifname: str, directory: Path = WG_QUICK_DIR) -> str | None:
    """The text of ``<directory>/<ifname>.conf``; None when absent or unreadable (the
    agent's user may not read root's 0600 configs, which is fine: then it is not told)."""
    path = directory / f"{ifname}.conf"
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_CONFIG_BYTES:
        return None
    return data.decode("utf-8", errors="replace")


def config_names(patterns: Iterable[str], directory: Path = WG_QUICK_DIR) -> list[str]:
    """Interface names of the wg-quick configs matching names or globs (``wg-*``)."""
    try:
        present = sorted(p.stem for p in directory.glob("*.conf"))
    except OSError:
        return []
    return [n for n in present if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def save_config_warnings(
    interfaces: Iterable[str], layout: str, directory: Path = WG_QUICK_DIR
) -> list[str]:
    """One warning per interface whose wg-quick config has ``SaveConfig = true``."""
    out: list[str] = []
    for ifname in interfaces:
        text = read_wg_quick(ifname, directory)
        if text is None or not save_config_enabled(text):
            continue
        moves = "the AllowedIPs the agent moves for relaying" if layout != "per-peer" else ""
        what = moves or "the agent's runtime changes"
        out.append(
            f"{directory / (ifname + '.conf')} has SaveConfig = true: wg-quick will save "
            f"{what} into it when {ifname} goes down; set SaveConfig = false (or stop "
            f"meshopt-agent first: a clean stop puts the original AllowedIPs back)"
        )
    return out


def warn_save_config(interfaces: Iterable[str], layout: str, directory: Path = WG_QUICK_DIR) -> int:
    """Log the warnings; how many there were."""
    warnings = save_config_warnings(interfaces, layout, directory)
    for w in warnings:
        log.warning("%s", w)
    return len(warnings)
