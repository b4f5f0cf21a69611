"""The agent's TOML config: the shipped example loads, every mistake names its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshopt.agent.config import AgentConfig, load_config, parse_config
from meshopt.errors import InputError

EXAMPLE = Path(__file__).resolve().parents[2] / "agents" / "agent.toml"


def test_example_config_loads() -> None:
    cfg = load_config(EXAMPLE)
    assert cfg.node == "fra" and cfg.mesh == "prod"
    assert cfg.interfaces == ("wg0",)
    assert cfg.probe.interval_s == pytest.approx(0.33)
    assert cfg.routes.withdraw_on_stop is True


def test_minimal_config_gets_defaults() -> None:
    cfg = parse_config({"agent": {"mesh": "m", "node": "a"}})
    assert cfg == AgentConfig(mesh="m", node="a")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({}, "missing [agent]"),
        ({"agent": {"mesh": "m"}}, "needs node"),
        ({"agent": {"mesh": "m", "node": "a/b"}}, "node 'a/b'"),
        ({"agent": {"mesh": "m", "node": "a", "colour": 1}}, "unknown key colour"),
        ({"agent": {"mesh": "m", "node": "a"}, "probes": {}}, "unknown table [probes]"),
        (
            {"agent": {"mesh": "m", "node": "a"}, "probe": {"interval_s": "fast"}},
            "probe.interval_s",
        ),
        ({"agent": {"mesh": "m", "node": "a"}, "probe": {"interval_s": -1}}, "probe.interval_s"),
        ({"agent": {"mesh": "m", "node": "a"}, "probe": {"dead_after_s": 0.4}}, "dead_after_s"),
        ({"agent": {"mesh": "m", "node": "a", "layout": "mesh"}}, "layout"),
        ({"agent": {"mesh": "m", "node": "a", "mesh_prefixes": ["10.0.0.300/8"]}}, "not a prefix"),
        ({"agent": {"mesh": "m", "node": "a"}, "routes": {"fast_table": 254}}, "fast_table"),
        ({"agent": {"mesh": "m", "node": "a"}, "routes": {"withdraw_on_stop": 1}}, "true or false"),
        ({"agent": {"mesh": "m", "node": "a"}, "probe": {"port": 70000}}, "probe.port"),
    ],
)
def test_bad_config_is_one_clear_error(data: dict[str, object], message: str) -> None:
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_config(data, source="agent.toml")


def test_unreadable_and_invalid_toml(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[agent\nmesh = ")
    with pytest.raises(InputError, match="not valid TOML"):
        load_config(bad)
