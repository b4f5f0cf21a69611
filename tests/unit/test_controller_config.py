"""The controller's TOML config: the shipped example is complete and loads; every mistake
is one InputError naming its key."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from meshopt.bus.signing import generate_signing_key, save_private_key
from meshopt.cli.main import main
from meshopt.controller.config import (
    ControllerConfig,
    Enrolment,
    MetricSettings,
    PolicySettings,
    load_controller_config,
    parse_controller_config,
)
from meshopt.errors import InputError
from meshopt.metric import Metric
from meshopt.metrics import ControllerMetricsSettings
from meshopt.policy import PolicyConfig
from meshopt.wireguard.keys import generate_keypair

EXAMPLE = Path(__file__).resolve().parents[2] / "agents" / "controller.toml"
REQUIRED: dict[str, Any] = {"mesh": "m", "id": "ctl1", "signing_key": "/k"}
FRA = generate_signing_key()[1]
WG = generate_keypair()[1]
NODE_KEYS: dict[str, Any] = {"fra": FRA}


def names(cls: type[Any]) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_example_config_names_every_key() -> None:
    data = tomllib.loads(EXAMPLE.read_text())
    assert set(data) == {"controller", "policy", "metric", "node_keys", "metrics"}
    assert set(data["controller"]) == names(ControllerConfig) - {
        "policy",
        "metric",
        "node_keys",
        "metrics",
    }
    assert set(data["policy"]) == names(PolicySettings)
    assert set(data["metric"]) == names(MetricSettings)
    assert set(data["metrics"]) == names(ControllerMetricsSettings)


PLACEHOLDERS = {
    "fra": "ZXhhbXBsZS1mcmEtaWRlbnRpdHktcmVwbGFjZS1tZSE=",
    "ams": "ZXhhbXBsZS1hbXMtaWRlbnRpdHktcmVwbGFjZS1tZSE=",
    "nyc": "ZXhhbXBsZS1ueWMtaWRlbnRpdHktcmVwbGFjZS1tZSE=",
}


def real_copy(tmp_path: Path, text: str | None = None) -> Path:
    """The example as an operator completes it: real node keys, a real signing key file."""
    text = EXAMPLE.read_text() if text is None else text
    for placeholder in PLACEHOLDERS.values():
        assert placeholder in text
        text = text.replace(placeholder, generate_signing_key()[1])
    key = tmp_path / "controller.key"
    save_private_key(key, generate_signing_key()[0])
    text = text.replace('signing_key = "/etc/meshopt/controller.key"', f'signing_key = "{key}"')
    out = tmp_path / "controller.toml"
    out.write_text(text)
    return out


def test_example_config_loads_and_shows_the_defaults(tmp_path: Path) -> None:
    cfg = load_controller_config(real_copy(tmp_path))
    assert (cfg.mesh, cfg.id) == ("prod", "ctl1")
    assert cfg.nodes == ("fra", "ams", "nyc")
    assert cfg.broker.url == "mqtt://10.0.0.1:1883"
    # Apart from what names this mesh, the example is the defaults: no surprise either way.
    site = ("mesh", "id", "signing_key", "broker", "nodes", "node_keys")
    assert [e.node for e in cfg.node_keys] == list(PLACEHOLDERS)
    defaults = ControllerConfig(**{k: getattr(cfg, k) for k in site})
    assert cfg == defaults
    assert cfg.policy.policy() == PolicyConfig()
    metric = cfg.metric.metric()
    assert (metric.jitter_weight, metric.loss_penalty_ms, metric.relay_hop_ms) == (
        Metric().jitter_weight,
        Metric().loss_penalty_ms,
        Metric().relay_hop_ms,
    )


def check(capsys: pytest.CaptureFixture[str], path: Path) -> tuple[int, str, str]:
    code = main(["controller", "--config", str(path), "--check"])
    out = capsys.readouterr()
    return code, out.out, out.err.strip()


def test_check_command_refuses_the_example_for_its_placeholders_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = check(capsys, EXAMPLE)
    assert code == 2 and "\n" not in err
    assert err.startswith(f"meshopt: error: {EXAMPLE}: node_keys: fra, ams, nyc: placeholder")
    assert "real key" in err and "meshopt agent keygen" in err
    # With real node keys, only the signing key file the example names is missing.
    text = EXAMPLE.read_text()
    for placeholder in PLACEHOLDERS.values():
        text = text.replace(placeholder, generate_signing_key()[1])
    keys_only = tmp_path / "keys-only.toml"
    keys_only.write_text(text)
    code, _, err = check(capsys, keys_only)
    assert code == 2 and "signing_key" in err and "/etc/meshopt/controller.key" in err
    # A copy with real keys and a real key file passes.
    code, out, err = check(capsys, real_copy(tmp_path))
    assert code == 0, err
    assert "ok (mesh prod, controller ctl1)" in out


@pytest.mark.parametrize(
    ("key_file", "fragment"),
    [
        (b"", "not an Ed25519 private key"),
        (b"-----BEGIN PRIVATE KEY-----\nnope\n-----END PRIVATE KEY-----\n", "PEM"),
        (b"\xff" * 100, "not an Ed25519 private key"),
        (b"x" * 100_000, "larger than"),
    ],
)
def test_check_refuses_a_bad_signing_key_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key_file: bytes, fragment: str
) -> None:
    cfg = real_copy(tmp_path)
    (tmp_path / "controller.key").write_bytes(key_file)
    code, _, err = check(capsys, cfg)
    assert code == 2 and "\n" not in err and fragment in err, err


def test_check_refuses_a_signing_key_that_is_not_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = real_copy(tmp_path).read_text()
    for target in ("/dev/zero", str(tmp_path), "a\\u0000b"):
        cfg = tmp_path / "odd.toml"
        line = f'signing_key = "{target}"'
        cfg.write_text(re.sub(r'signing_key = "[^"]*"', lambda _, line=line: line, text))
        code, _, err = check(capsys, cfg)
        assert code == 2 and "\n" not in err and "signing_key" in err, err


def test_placeholder_controller_keys_are_refused() -> None:
    with pytest.raises(InputError, match=r"controller_keys: .*placeholder.*real key"):
        parse_controller_config(ctl(controller_keys=[PLACEHOLDERS["fra"]]))
    with pytest.raises(InputError, match="placeholder"):
        parse_controller_config(ctl(controller_keys=["<paste the key here>"]))


def test_check_command_refuses_a_bad_file_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = real_copy(tmp_path, EXAMPLE.read_text().replace("hold_s = 30.0", "hold_s = -30.0"))
    assert main(["controller", "--config", str(bad), "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.startswith(f"meshopt: error: {bad}: ") and "policy.hold_s" in err


def test_minimal_config_gets_defaults() -> None:
    cfg = parse_controller_config({"controller": dict(REQUIRED), "node_keys": NODE_KEYS})
    assert cfg == ControllerConfig(**REQUIRED, node_keys=(Enrolment("fra", FRA),))
    assert cfg.nodes == () and cfg.policy == PolicySettings()


def test_lists_and_numbers_are_coerced() -> None:
    cfg = parse_controller_config(
        {
            "controller": {**REQUIRED, "nodes": "fra", "lease_s": 5},
            "policy": {"hold_s": 0},
            "node_keys": NODE_KEYS,
        }
    )
    assert cfg.nodes == ("fra",)
    assert cfg.lease_s == 5.0 and isinstance(cfg.lease_s, float)
    assert cfg.policy.hold_s == 0.0


def ctl(**kw: Any) -> dict[str, Any]:
    return {"controller": {**REQUIRED, **kw}, "node_keys": NODE_KEYS}


@pytest.mark.parametrize(
    ("data", "names_key"),
    [
        ({}, "[controller]"),
        ({"controller": "x"}, "[controller]"),
        ({"controller": {"id": "c", "signing_key": "/k"}}, "mesh"),
        ({"controller": {"mesh": "m", "signing_key": "/k"}}, "id"),
        ({"controller": {"mesh": "m", "id": "c"}}, "signing_key"),
        (ctl(colour=1), "colour"),
        ({**ctl(), "polciy": {}}, "[polciy]"),
        ({**ctl(), "policy": {"hold": 3}}, "policy.hold"),
        ({**ctl(), "policy": 3}, "[policy]"),
        ({**ctl(), "policy": {"hold_s": -1}}, "policy.hold_s"),
        ({**ctl(), "policy": {"rel_margin": "10%"}}, "policy.rel_margin"),
        ({**ctl(), "policy": {"noise_sigmas": float("nan")}}, "policy.noise_sigmas"),
        ({**ctl(), "metric": {"relay_hop_ms": float("inf")}}, "metric.relay_hop_ms"),
        ({**ctl(), "metric": {"loss_penalty_ms": True}}, "metric.loss_penalty_ms"),
        (ctl(mesh="a/b"), "mesh"),
        (ctl(id=""), "id"),
        (ctl(nodes=["fra", "a b"]), "nodes"),
        (ctl(nodes=[1, 2]), "nodes"),
        (ctl(symmetric="yes"), "symmetric"),
        (ctl(bulk=1), "bulk"),
        (ctl(warmup_samples=1.5), "warmup_samples"),
        (ctl(warmup_samples=-1), "warmup_samples"),
        (ctl(debounce_s=-0.1), "debounce_s"),
        (ctl(stale_after_s="15s"), "stale_after_s"),
        (ctl(broker=1883), "broker"),
        (ctl(lease_s=0.5), "lease_s"),
        (ctl(lease_s=3.0, settle_s=3.0), "settle_s"),
        ({"controller": REQUIRED}, "[node_keys]"),
        ({**ctl(), "node_keys": {}}, "[node_keys]"),
        ({**ctl(), "node_keys": {"fra": "not-a-key"}}, "node_keys.fra"),
        ({**ctl(), "node_keys": {"a b": FRA}}, "node_keys.a b"),
        ({**ctl(), "node_keys": {"fra": 7}}, "node_keys.fra"),
        ({**ctl(), "node_keys": {"fra": {"key": FRA, "colour": 1}}}, "node_keys.fra.colour"),
        ({**ctl(), "node_keys": {"fra": {"key": FRA, "wireguard": ["x"]}}}, "node_keys.fra"),
        ({**ctl(), "node_keys": {"fra": {"key": FRA, "addresses": ["10.0.0.1"]}}}, "node_keys.fra"),
        (ctl(nodes=["fra", "ams"]), "ams"),
        (ctl(controller_keys=["nope"]), "controller_keys"),
    ],
)
def test_bad_config_is_one_error_naming_the_key(data: dict[str, Any], names_key: str) -> None:
    with pytest.raises(InputError) as info:
        parse_controller_config(data, source="controller.toml")
    msg = str(info.value)
    assert msg.startswith("controller.toml: ")
    assert "\n" not in msg
    assert re.search(rf"(^|[\s'(.]){re.escape(names_key)}(?!\w)", msg.split(": ", 1)[1]), msg


def test_node_keys_pin_wireguard_keys_and_addresses() -> None:
    cfg = parse_controller_config(
        {
            **ctl(),
            "node_keys": {
                "fra": {"key": FRA, "wireguard": [WG], "addresses": ["10.99.0.1/32"]},
                "ams": FRA,
            },
        }
    )
    assert cfg.node_keys == (
        Enrolment("fra", FRA, (WG,), ("10.99.0.1/32",)),
        Enrolment("ams", FRA),
    )


def test_bad_broker_address_is_refused_when_loading() -> None:
    with pytest.raises(InputError, match="broker"):
        parse_controller_config(ctl(broker="ftp://broker.example:21"))


def test_unreadable_and_invalid_toml(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot read"):
        load_controller_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[controller\nmesh = ")
    with pytest.raises(InputError, match="not valid TOML"):
        load_controller_config(bad)
