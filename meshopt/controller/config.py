"""The controller's configuration file (TOML); see ``agents/controller.toml``."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from meshopt.bus.client import (
    BrokerSettings,
    check_broker_settings,
    fold_broker_shorthand,
    with_default_username,
)
from meshopt.configfile import (
    build,
    check_broker_files,
    check_key_file,
    check_public_key,
    placeholder,
    printable,
    read_toml,
)
from meshopt.errors import InputError
from meshopt.estimate import WARM_SAMPLES
from meshopt.metric import RELAY_HOP_MS, Metric
from meshopt.metrics import ControllerMetricsSettings, parse_listen
from meshopt.policy import PolicyConfig

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class PolicySettings(PolicyConfig):
    """The ``[policy]`` table: PolicyConfig's fields, defaults and checks."""

    def policy(self) -> PolicyConfig:
        return PolicyConfig(**asdict(self))


@dataclass(frozen=True)
class MetricSettings:
    jitter_weight: float = 2.0
    loss_penalty_ms: float = 200.0
    relay_hop_ms: float = RELAY_HOP_MS

    def metric(self) -> Metric:
        return Metric(
            jitter_weight=self.jitter_weight,
            loss_penalty_ms=self.loss_penalty_ms,
            relay_hop_ms=self.relay_hop_ms,
        )


@dataclass(frozen=True)
class Enrolment:
    """A node the controller takes telemetry from: its identity key, optionally pinned
    WireGuard keys and overlay addresses (claims outside a pin are refused)."""

    node: str
    key: str
    wireguard: tuple[str, ...] = ()
    addresses: tuple[str, ...] = ()


@dataclass(frozen=True)
class ControllerConfig:
    mesh: str
    id: str
    signing_key: str
    broker: BrokerSettings = field(default_factory=BrokerSettings)  # [broker], or a url
    nodes: tuple[str, ...] = ()  # allow-list; empty: any node that publishes telemetry
    symmetric: bool = False  # true for meshes in the single-interface layout
    debounce_s: float = 0.2
    # Links coming back (a node that returns): the recompute waits until none has come
    # back for revive_quiet_s, at most revive_max_s after the first, so the node's
    # routes return in one move once its peers have all told, not through whichever of
    # its links the controller heard of first and again a moment later.
    revive_quiet_s: float = 0.3
    revive_max_s: float = 1.0
    # First routes once every link has warmup_samples (~1 s of probes: each estimate
    # carries its noise, so the policy's margins and noise test decide what a young
    # estimate may move: a relay far better moves at once, a near tie waits), or warmup_s
    # after the first telemetry when some link never answers.
    warmup_s: float = 3.0
    warmup_samples: int = WARM_SAMPLES
    startup_s: float = 60.0  # after the first telemetry: the routes are still settling
    # Hold time meanwhile (the policy's own hold_s after), and the confirm time of small
    # gains (the policy's confirm_s after; the noise test still applies).
    startup_hold_s: float = 5.0
    stale_after_s: float = 15.0
    lease_s: float = 3.0
    settle_s: float = 0.5
    bulk: bool = True  # also publish a bulk table (widest paths)
    policy: PolicySettings = field(default_factory=PolicySettings)
    metric: MetricSettings = field(default_factory=MetricSettings)
    # Other controllers' public keys (this one's own is implied): their leases count.
    controller_keys: tuple[str, ...] = ()
    max_skew_s: float = 30.0  # how far a sender's clock may run ahead of ours
    node_keys: tuple[Enrolment, ...] = ()  # the [node_keys] table
    metrics: ControllerMetricsSettings = field(default_factory=ControllerMetricsSettings)


_SECTIONS: dict[str, type[Any]] = {
    "policy": PolicySettings,
    "metric": MetricSettings,
    "broker": BrokerSettings,
    "metrics": ControllerMetricsSettings,
}


def parse_controller_config(data: dict[str, Any], *, source: str = "config") -> ControllerConfig:
    top = data.get("controller")
    if not isinstance(top, dict):
        raise InputError("missing [controller] table", source=source)
    for key in data:
        if key not in ("controller", "node_keys") and key not in _SECTIONS:
            raise InputError(f"unknown table [{key}]", source=source)
    for key in ("mesh", "id", "signing_key"):
        if key not in top:
            raise InputError(f'[controller] needs {key} = "..."', source=source)
    rest = {k: v for k, v in data.items() if k not in ("controller", "node_keys")}
    try:
        enrolled = parse_node_keys(data.get("node_keys"))
        top = dict(top)
        fold_broker_shorthand(top, rest, "controller")
        cfg: ControllerConfig = build(ControllerConfig, {**top, **rest}, sections=_SECTIONS)
        cfg = replace(cfg, broker=with_default_username(cfg.broker, cfg.id))
        cfg = replace(cfg, node_keys=enrolled)
        for key, value in (("mesh", cfg.mesh), ("id", cfg.id), *(("nodes", n) for n in cfg.nodes)):
            if not NAME.fullmatch(value):
                raise InputError(f"{key} {value!r}: use 1-64 of A-Z a-z 0-9 _ . -")
        check_broker_files(cfg.broker)  # regular files of sane size, before they are read
        check_broker_settings(cfg.broker)  # reads the TLS and password files
        if cfg.lease_s < 1.0:
            raise InputError("lease_s must be >= 1 s")
        if cfg.settle_s >= cfg.lease_s:
            raise InputError("settle_s must be shorter than lease_s")
        if not cfg.warmup_samples >= 1:
            raise InputError("warmup_samples must be >= 1")
        for key in ("warmup_s", "startup_s", "startup_hold_s", "revive_quiet_s", "revive_max_s"):
            v = getattr(cfg, key)
            if not v >= 0.0:
                raise InputError(f"{key} must be >= 0, got {v!r}")
        cfg.policy.policy()
        cfg.metric.metric()
        parse_listen(cfg.metrics.listen)
        for k in cfg.controller_keys:
            _public_key(k, "controller_keys")
        if cfg.nodes and set(cfg.nodes) - {e.node for e in enrolled}:
            missing = sorted(set(cfg.nodes) - {e.node for e in enrolled})
            raise InputError(f"nodes: {missing[0]} has no key in [node_keys]")
    except InputError as exc:
        raise InputError(printable(exc.message), source=printable(source)) from None
    return cfg


def _public_key(text: object, where: str) -> str:
    """A key as the controller reads it at start; the example's placeholders are refused."""
    if not isinstance(text, str):
        raise InputError(f"{where} must be a base64 Ed25519 public key")
    how = (
        "the output of: meshopt controller keygen"
        if where == "controller_keys"
        else "the node's meshopt agent keygen prints it"
    )
    check_public_key(text, where, how)
    return text


def parse_node_keys(table: object) -> tuple[Enrolment, ...]:
    """``[node_keys]``: ``node = "KEY"`` or ``node = {key = "KEY", wireguard = [...],
    addresses = [...]}``. Without it the controller would take no telemetry at all."""
    if table is None or table == {}:
        raise InputError(
            "no [node_keys]: enrol each node's identity key (meshopt agent keygen prints it),"
            ' e.g. [node_keys] a = "BASE64KEY"'
        )
    if not isinstance(table, dict):
        raise InputError("[node_keys] must be a table of node = key")
    from meshopt.bus.messages import BusMessageError, _key, _prefix

    examples = [
        str(node)
        for node, value in table.items()
        if placeholder(str(value.get("key", "") if isinstance(value, dict) else value))
    ]
    if examples:  # name them all: a copied example has one per node
        raise InputError(
            f"node_keys: {', '.join(examples)[:300]}: placeholder keys from the example "
            "(they decode to 'example-...'): put each node's real key there "
            "(meshopt agent keygen prints it on the node)"
        )
    out: list[Enrolment] = []
    for node, value in table.items():
        where = f"node_keys.{node}"
        if not NAME.fullmatch(node):
            raise InputError(f"{where}: bad node name (use 1-64 of A-Z a-z 0-9 _ . -)")
        if isinstance(value, str):
            value = {"key": value}
        if not isinstance(value, dict):
            raise InputError(f"{where} must be a key or a table {{key, wireguard, addresses}}")
        e: Enrolment = build(Enrolment, {"node": node, "key": "", **value}, where + ".")
        _public_key(e.key, where + ".key")
        try:
            for k in e.wireguard:
                _key(k, where + ".wireguard")
            for a in e.addresses:
                _prefix(a, where + ".addresses")
        except BusMessageError as exc:
            raise InputError(exc.detail) from None
        out.append(e)
    return tuple(out)


def load_controller_config(path: str | Path) -> ControllerConfig:
    """The file, and what the daemon reads and builds from it at start (its signing key,
    the controller core), so ``--check`` fails exactly where a start would."""
    from meshopt.bus.signing import load_private_key
    from meshopt.controller.core import ControllerCore

    cfg = parse_controller_config(read_toml(path), source=str(path))
    try:
        check_key_file(cfg.signing_key, "signing_key", "signing key")
        ControllerCore(cfg, load_private_key(cfg.signing_key))
    except InputError as exc:
        raise InputError(printable(str(exc)), source=printable(str(path))) from None
    return cfg
