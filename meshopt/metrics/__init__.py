"""Observability: Prometheus metrics and a health endpoint for the agent and controller.

This module stays import-light (the agent's config imports it); the exporter itself
(prometheus-client, the HTTP listener) lives in :mod:`meshopt.metrics.server`, the
per-daemon collectors in :mod:`meshopt.metrics.agent` and
:mod:`meshopt.metrics.controller`.

Both daemons listen on loopback by default (agent 9477, controller 9478): an operator
gets ``curl localhost:9477/metrics`` and ``/healthz`` without opening anything to the
network. ``listen = ""`` turns the listener off.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from meshopt.errors import InputError

AGENT_PORT = 9477
CONTROLLER_PORT = 9478


@dataclass(frozen=True)
class AgentMetricsSettings:
    """The agent's ``[metrics]`` table: where /metrics and /healthz listen ("" = off),
    and how often the local status file for ``meshopt status`` is written (0 = never)."""

    listen: str = f"127.0.0.1:{AGENT_PORT}"
    status_interval_s: float = 5.0


@dataclass(frozen=True)
class ControllerMetricsSettings:
    """The controller's ``[metrics]`` table: where /metrics and /healthz listen ("" = off)."""

    listen: str = f"127.0.0.1:{CONTROLLER_PORT}"


def parse_listen(text: str, where: str = "metrics.listen") -> tuple[str, int] | None:
    """``"HOST:PORT"`` or ``"[V6]:PORT"`` -> (host, port); ``""`` -> None (off).

    The host must be an IP address: a name would resolve at start, and a daemon that
    exposes its metrics should say exactly where.
    """
    text = text.strip()
    if not text:
        return None
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise InputError(f'{where}: {text!r} must be "ADDRESS:PORT" (e.g. "127.0.0.1:9477")')
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise InputError(f'{where}: {text!r}: write an IPv6 address as "[ADDRESS]:PORT"')
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise InputError(f"{where}: {host!r} is not an IP address") from None
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise InputError(f"{where}: port {port_text!r} must be 1..65535")
    return str(address), int(port_text)
