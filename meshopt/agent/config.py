"""The agent's configuration file (TOML), checked completely before anything starts.

Every key has a default except ``node`` and ``mesh``; see ``agents/agent.toml`` for a
commented example. Unknown keys are errors (a typo must not silently fall back to a
default), and every error names the key.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

from meshopt.bus.client import (
    BrokerSettings,
    check_broker_settings,
    fold_broker_shorthand,
    with_default_username,
)
from meshopt.configfile import (
    build,
    check_broker_files,
    check_public_key,
    printable,
    read_toml,
)
from meshopt.errors import InputError
from meshopt.metrics import AgentMetricsSettings, parse_listen
from meshopt.probe.budget import BudgetConfig

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
LAYOUTS = ("auto", "single", "per-peer")
WIREGUARD_KINDS = ("auto", "kernel", "userspace")


PEER_POLL_S: Final = 2.0  # how often the agent reads WireGuard (peers, traffic)


@dataclass(frozen=True)
class ProbeSettings:
    """Probe rate and dead-peer detection; see meshopt.probe.prober for the trade-off."""

    interval_s: float = 0.33
    dead_after_s: float = 0.8
    window: int = 64
    port: int = 51899
    # The probe budget (meshopt.probe.budget, docs/probe-budget.md): links in use at the
    # rate above, idle ones every idle_interval_s, stretched to keep max_probes_per_s.
    budget: bool = True
    idle_interval_s: float = 2.0
    idle_max_interval_s: float = 10.0
    max_probes_per_s: float = 250.0
    traffic_bytes_per_s: float = 1500.0  # WireGuard rx or tx above this: in use
    in_use_hold_s: float = 30.0  # stays in use this long after it last was


def probe_budget_config(pr: ProbeSettings) -> BudgetConfig | None:
    """The budget for these settings; None when ``probe.budget`` is off."""
    if not pr.budget:
        return None
    return BudgetConfig(
        fast_interval_s=pr.interval_s,
        fast_dead_after_s=pr.dead_after_s,
        idle_interval_s=pr.idle_interval_s,
        idle_max_interval_s=pr.idle_max_interval_s,
        max_probes_per_s=pr.max_probes_per_s,
        traffic_bytes_per_s=pr.traffic_bytes_per_s,
        in_use_hold_s=pr.in_use_hold_s,
    )


@dataclass(frozen=True)
class BandwidthSettings:
    """Active capacity estimates: a few short packet trains per peer, rarely."""

    enabled: bool = True
    interval_s: float = 300.0
    first_after_s: float = 5.0
    port: int = 51898


@dataclass(frozen=True)
class TelemetrySettings:
    """Change-driven publishing with a periodic full snapshot."""

    check_interval_s: float = 1.0
    full_interval_s: float = 5.0
    rtt_change_ms: float = 1.0
    rtt_change_rel: float = 0.10
    loss_change: float = 0.01
    # Above full_peers peers the full-snapshot interval grows with the peer count (its
    # bytes per second stay flat), up to max_full_interval_s (meshopt.agent.telemetry).
    full_peers: int = 30
    max_full_interval_s: float = 120.0


@dataclass(frozen=True)
class RouteSettings:
    fast_table: int = 7701
    bulk_table: int = 7702
    rule_priority: int = 7701
    withdraw_on_stop: bool = True
    forwarding: bool = True
    # auto: per WireGuard interface where the kernel can (6.17+), else all only for an
    # IPv6 mesh_prefixes entry; all: net.ipv6.conf.all.forwarding; off: never.
    ipv6_forwarding: str = "auto"


@dataclass(frozen=True)
class BulkSettings:
    """The bulk traffic class: which packets take the bulk table (widest paths, tuned TCP).

    ``dports``: "5000-5100/tcp" or "873/tcp"; ``fwmarks``: "0x10" or "0x10/0xff"
    (mark packets with nftables/iptables, e.g. by DSCP); ``tos``: TOS/traffic-class
    bytes (IPv4 rules only see the old TOS bits: prefer a fwmark for DSCP classes).
    """

    enabled: bool = False
    dports: tuple[str, ...] = ("51897/tcp",)  # meshopt transfer's own port
    fwmarks: tuple[str, ...] = ()
    tos: tuple[str, ...] = ()


@dataclass(frozen=True)
class TransferSettings:
    """The receiver for ``meshopt transfer send``: what mesh peers may use of this node.

    It listens on the overlay addresses only and knows senders by their WireGuard peer.
    ``quota_gib``: files received this run, partial ones included; the reserve kept free
    is the smaller of ``min_free_gib`` and ``min_free_percent`` of the disk.
    """

    enabled: bool = False
    directory: str = "/var/lib/meshopt/incoming"
    port: int = 51897
    quota_gib: float = 10.0
    min_free_gib: float = 1.0
    min_free_percent: float = 5.0
    partial_max_age_h: float = 24.0  # partial files of interrupted transfers expire
    idle_timeout_s: float = 60.0  # a sender silent for this long is dropped
    max_transfers: int = 8  # at once; more are refused as busy
    max_per_sender: int = 2
    allow_overwrite: bool = False  # replace a file when the sender asks (--overwrite)

    def check(self) -> None:
        """InputError naming the first ``transfer.*`` key that cannot work."""
        for key, value in (("quota_gib", self.quota_gib), ("min_free_gib", self.min_free_gib)):
            if value < 0:
                raise InputError(f"transfer.{key} must be >= 0")
        if not 0 <= self.min_free_percent < 100:
            raise InputError("transfer.min_free_percent must be in [0, 100)")
        for key, value in (
            ("partial_max_age_h", self.partial_max_age_h),
            ("idle_timeout_s", self.idle_timeout_s),
        ):
            if value <= 0:
                raise InputError(f"transfer.{key} must be > 0")
        for key, count in (
            ("max_transfers", self.max_transfers),
            ("max_per_sender", self.max_per_sender),
        ):
            if count < 1:
                raise InputError(f"transfer.{key} must be >= 1")
        if self.enabled:  # zstandard and pyfastcdc are the optional [transfer] extra
            import importlib.util

            for module in ("zstandard", "pyfastcdc"):
                if importlib.util.find_spec(module) is None:
                    raise InputError(
                        f"transfer.enabled needs {module}: pip install 'meshopt-wg[transfer]'"
                    )


@dataclass(frozen=True)
class AgentConfig:
    mesh: str
    node: str
    interfaces: tuple[str, ...] = ("wg0",)
    layout: str = "auto"
    wireguard: str = "auto"
    wireguard_run_dir: str = "/var/run/wireguard"
    mesh_prefixes: tuple[str, ...] = ()
    broker: BrokerSettings = field(default_factory=BrokerSettings)  # [broker], or a url
    controller_keys: tuple[str, ...] = ()
    # This node's Ed25519 identity (meshopt agent keygen): signs its telemetry and status.
    identity_key: str = "/etc/meshopt/agent.key"
    max_skew_s: float = 30.0  # how far the controller's clock may run ahead of ours
    state_dir: str = "/var/lib/meshopt"
    peer_poll_s: float = PEER_POLL_S
    log_level: str = ""  # debug|info|warning|error; empty: --log-level (a reload applies it)
    probe: ProbeSettings = field(default_factory=ProbeSettings)
    bandwidth: BandwidthSettings = field(default_factory=BandwidthSettings)
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)
    routes: RouteSettings = field(default_factory=RouteSettings)
    bulk: BulkSettings = field(default_factory=BulkSettings)
    transfer: TransferSettings = field(default_factory=TransferSettings)
    metrics: AgentMetricsSettings = field(default_factory=AgentMetricsSettings)


_SECTIONS: dict[str, type[Any]] = {
    "metrics": AgentMetricsSettings,
    "broker": BrokerSettings,
    "probe": ProbeSettings,
    "bandwidth": BandwidthSettings,
    "telemetry": TelemetrySettings,
    "routes": RouteSettings,
    "bulk": BulkSettings,
    "transfer": TransferSettings,
}


def parse_config(data: dict[str, Any], *, source: str = "config") -> AgentConfig:
    """An AgentConfig from parsed TOML, or InputError naming the bad key."""
    agent = dict(data.get("agent", {})) if isinstance(data.get("agent"), dict) else None
    if agent is None:
        raise InputError("missing [agent] table", source=source)
    rest = {k: v for k, v in data.items() if k != "agent"}
    for key in rest:
        if key not in _SECTIONS:
            raise InputError(f"unknown table [{key}]", source=source)
    for key in ("mesh", "node"):
        if key not in agent:
            raise InputError(f'[agent] needs {key} = "..."', source=source)
    try:
        fold_broker_shorthand(agent, rest, "agent")
        cfg: AgentConfig = build(AgentConfig, {**agent, **rest}, sections=_SECTIONS)
        cfg = replace(cfg, broker=with_default_username(cfg.broker, cfg.node))
        check_config(cfg)
    except InputError as exc:
        raise InputError(printable(exc.message), source=printable(source)) from None
    return cfg


def load_config(path: str | Path) -> AgentConfig:
    return parse_config(read_toml(path), source=str(path))


def check_config(cfg: AgentConfig) -> None:
    for key, value in (("mesh", cfg.mesh), ("node", cfg.node)):
        if not NAME.fullmatch(value):
            raise InputError(f"{key} {value!r}: use 1-64 of A-Z a-z 0-9 _ . -")
    if cfg.layout not in LAYOUTS:
        raise InputError(f"layout must be one of {', '.join(LAYOUTS)}, got {cfg.layout!r}")
    if cfg.wireguard not in WIREGUARD_KINDS:
        raise InputError(
            f"wireguard must be one of {', '.join(WIREGUARD_KINDS)}, got {cfg.wireguard!r}"
        )
    if not cfg.interfaces:
        raise InputError("interfaces must name at least one WireGuard interface (or glob)")
    for p in cfg.mesh_prefixes:
        try:
            ipaddress.ip_network(p, strict=False)
        except ValueError:
            raise InputError(f"mesh_prefixes: {p!r} is not a prefix") from None
    pr = cfg.probe
    if pr.interval_s < 0.01:
        raise InputError("probe.interval_s must be >= 0.01")
    if pr.dead_after_s < 2 * pr.interval_s:
        raise InputError("probe.dead_after_s must be at least two probe intervals")
    from meshopt.probe.prober import ProbeConfig

    try:  # the prober's own checks (window >= 1, ...): --check must fail where a start would
        ProbeConfig(
            interval_s=pr.interval_s, dead_after_s=pr.dead_after_s, window=pr.window, port=pr.port
        )
    except InputError as exc:
        raise InputError(exc.message.replace("probe config: ", "probe.", 1)) from None
    try:
        probe_budget_config(pr)
    except InputError as exc:
        raise InputError(exc.message.replace("probe budget: ", "probe.", 1)) from None
    for name, port in (
        ("probe.port", pr.port),
        ("bandwidth.port", cfg.bandwidth.port),
        ("transfer.port", cfg.transfer.port),
    ):
        if not 1 <= port <= 65535:
            raise InputError(f"{name} must be 1..65535")
    cfg.transfer.check()
    parse_listen(cfg.metrics.listen)
    if 0 < cfg.metrics.status_interval_s < 0.5:
        raise InputError("metrics.status_interval_s must be 0 (off) or >= 0.5")
    r = cfg.routes
    for name, table in (("fast_table", r.fast_table), ("bulk_table", r.bulk_table)):
        if not 1 <= table < 2**32 or table in (253, 254, 255):
            raise InputError(f"routes.{name} must be a table id other than local/main/default")
    if r.fast_table == r.bulk_table:
        raise InputError("routes.fast_table and routes.bulk_table must differ")
    if r.ipv6_forwarding not in ("auto", "all", "off"):
        raise InputError(
            f"routes.ipv6_forwarding must be auto, all or off, got {r.ipv6_forwarding!r}"
        )
    if cfg.log_level not in ("", "debug", "info", "warning", "error"):
        raise InputError(f"log_level must be debug, info, warning or error, got {cfg.log_level!r}")
    bulk_classifier(cfg)  # raises InputError naming the bad entry
    check_broker_files(cfg.broker)  # regular files of sane size, before they are read
    check_broker_settings(cfg.broker)  # reads the TLS and password files: --check sees them
    if cfg.telemetry.full_interval_s < cfg.telemetry.check_interval_s:
        raise InputError("telemetry.full_interval_s must be >= telemetry.check_interval_s")
    if cfg.telemetry.max_full_interval_s < cfg.telemetry.full_interval_s:
        raise InputError("telemetry.max_full_interval_s must be >= telemetry.full_interval_s")
    if cfg.telemetry.full_peers < 1:
        raise InputError("telemetry.full_peers must be at least 1")
    for name in ("identity_key", "state_dir", "wireguard_run_dir"):
        if "\0" in getattr(cfg, name):
            raise InputError(f"{name} must not contain a NUL character")
    for key in cfg.controller_keys:  # as the daemon reads them (base64 or a key file)
        check_public_key(key, "controller_keys", "the output of: meshopt controller keygen")
    from meshopt.install.model import bulk_rules, fast_rules

    try:  # the rules the daemon builds at start (priorities within 1..32765)
        fast_rules(table=r.fast_table, priority=r.rule_priority)
        if cfg.bulk.enabled:
            dports, marks, tos = bulk_classifier(cfg)
            bulk_rules(
                dports=dports,
                fwmarks=marks,
                tos=tos,
                table=r.bulk_table,
                first_priority=r.rule_priority - 100,
                last_priority=r.rule_priority - 1,
            )
    except InputError as exc:
        raise InputError(f"routes.rule_priority {r.rule_priority}: {exc.message}") from None


def _number(text: str, what: str) -> int:
    try:
        return int(text, 0)
    except ValueError:
        raise InputError(f"{what}: {text!r} is not a number") from None


def bulk_classifier(
    cfg: AgentConfig,
) -> tuple[list[tuple[int, int, str]], list[tuple[int, int | None]], list[int]]:
    """(dport ranges, fwmarks, tos values) of the [bulk] section, checked."""
    dports: list[tuple[int, int, str]] = []
    for entry in cfg.bulk.dports:
        ports, _, proto = entry.partition("/")
        lo, _, hi = ports.partition("-")
        first = _number(lo, "bulk.dports")
        last = _number(hi, "bulk.dports") if hi else first
        if not 1 <= first <= last <= 65534:
            raise InputError(f"bulk.dports: {entry!r} must be PORT[-PORT]/PROTO within 1..65534")
        if proto not in ("tcp", "udp", "sctp", "dccp"):
            raise InputError(f"bulk.dports: {entry!r} needs /tcp, /udp, /sctp or /dccp")
        dports.append((first, last, proto))
    marks: list[tuple[int, int | None]] = []
    for entry in cfg.bulk.fwmarks:
        mark, _, mask = entry.partition("/")
        m = _number(mark, "bulk.fwmarks")
        k = _number(mask, "bulk.fwmarks") if mask else None
        if not 0 < m < 2**32 or (k is not None and not 0 < k < 2**32):
            raise InputError(f"bulk.fwmarks: {entry!r} out of range")
        marks.append((m, k))
    tos = [_number(t, "bulk.tos") for t in cfg.bulk.tos]
    if any(not 0 < t < 256 for t in tos):
        raise InputError("bulk.tos: values must be 1..255")
    return dports, marks, tos
