"""The controller's configuration file (TOML); see ``agents/controller.toml``."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from meshopt.bus.client import parse_broker
from meshopt.configfile import build, read_toml
from meshopt.errors import InputError
from meshopt.metric import Metric
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
    relay_hop_ms: float = 2.0

    def metric(self) -> Metric:
        return Metric(
            jitter_weight=self.jitter_weight,
            loss_penalty_ms=self.loss_penalty_ms,
            relay_hop_ms=self.relay_hop_ms,
        )


@dataclass(frozen=True)
class ControllerConfig:
    mesh: str
    id: str
    signing_key: str
    broker: str = "mqtt://127.0.0.1:1883"
    nodes: tuple[str, ...] = ()  # allow-list; empty: any node that publishes telemetry
    symmetric: bool = False  # true for meshes in the single-interface layout
    debounce_s: float = 0.2
    warmup_s: float = 10.0  # first routes once every link has warmup_samples, or after this
    warmup_samples: int = 8
    startup_s: float = 60.0  # after the first telemetry: the routes are still settling
    startup_hold_s: float = 5.0  # hold time meanwhile (the policy's own hold_s after)
    stale_after_s: float = 15.0
    lease_s: float = 3.0
    settle_s: float = 0.5
    bulk: bool = True  # also publish a bulk table (widest paths)
    policy: PolicySettings = field(default_factory=PolicySettings)
    metric: MetricSettings = field(default_factory=MetricSettings)


_SECTIONS: dict[str, type[Any]] = {"policy": PolicySettings, "metric": MetricSettings}


def parse_controller_config(data: dict[str, Any], *, source: str = "config") -> ControllerConfig:
    top = data.get("controller")
    if not isinstance(top, dict):
        raise InputError("missing [controller] table", source=source)
    for key in data:
        if key != "controller" and key not in _SECTIONS:
            raise InputError(f"unknown table [{key}]", source=source)
    for key in ("mesh", "id", "signing_key"):
        if key not in top:
            raise InputError(f'[controller] needs {key} = "..."', source=source)
    rest = {k: v for k, v in data.items() if k != "controller"}
    try:
        cfg: ControllerConfig = build(ControllerConfig, {**top, **rest}, sections=_SECTIONS)
        for key, value in (("mesh", cfg.mesh), ("id", cfg.id), *(("nodes", n) for n in cfg.nodes)):
            if not NAME.fullmatch(value):
                raise InputError(f"{key} {value!r}: use 1-64 of A-Z a-z 0-9 _ . -")
        parse_broker(cfg.broker)
        if cfg.lease_s < 1.0:
            raise InputError("lease_s must be >= 1 s")
        if cfg.settle_s >= cfg.lease_s:
            raise InputError("settle_s must be shorter than lease_s")
        cfg.policy.policy()
        cfg.metric.metric()
    except InputError as exc:
        raise InputError(exc.message, source=source) from None
    return cfg


def load_controller_config(path: str | Path) -> ControllerConfig:
    return parse_controller_config(read_toml(path), source=str(path))
