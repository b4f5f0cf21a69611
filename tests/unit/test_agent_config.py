"""The agent's TOML config: the shipped example loads, every mistake names its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshopt.agent.config import AgentConfig, load_config, parse_config
from meshopt.bus.signing import generate_signing_key, save_private_key
from meshopt.cli.main import main
from meshopt.errors import InputError

EXAMPLE = Path(__file__).resolve().parents[2] / "agents" / "agent.toml"
PLACEHOLDER = '"<output of: meshopt controller keygen --out controller.key>"'
CONTROLLER = generate_signing_key()[1]


def real_copy(tmp_path: Path, text: str | None = None) -> Path:
    """The example as an operator completes it: a real controller key and identity key."""
    text = EXAMPLE.read_text() if text is None else text
    assert PLACEHOLDER in text
    key = tmp_path / "agent.key"
    save_private_key(key, generate_signing_key()[0])
    text = text.replace(PLACEHOLDER, f'"{CONTROLLER}"')
    text = text.replace('identity_key = "/etc/meshopt/agent.key"', f'identity_key = "{key}"')
    text = text.replace('state_dir = "/var/lib/meshopt"', f'state_dir = "{tmp_path}"')
    out = tmp_path / "agent.toml"
    out.write_text(text)
    return out


def check(capsys: pytest.CaptureFixture[str], path: Path) -> tuple[int, str, str]:
    code = main(["agent", "--config", str(path), "--check"])
    out = capsys.readouterr()
    return code, out.out, out.err.strip()


def test_example_config_refuses_its_placeholder_key() -> None:
    with pytest.raises(InputError, match=r"controller_keys: .*placeholder: put the real key"):
        load_config(EXAMPLE)


def test_example_check_fails_on_the_placeholder_and_a_real_copy_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = check(capsys, EXAMPLE)
    assert code == 2 and "\n" not in err
    assert "controller_keys" in err and "meshopt controller keygen" in err
    code, out, err = check(capsys, real_copy(tmp_path))
    assert code == 0, err
    assert "ok (mesh prod, node fra)" in out


def test_example_config_loads(tmp_path: Path) -> None:
    cfg = load_config(real_copy(tmp_path))
    assert cfg.controller_keys == (CONTROLLER,)
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
        # What failed only at start before (a systemd restart loop), now refused by --check:
        ({"agent": {"mesh": "m", "node": "a"}, "probe": {"window": 0}}, "probe.window"),
        ({"agent": {"mesh": "m", "node": "a", "controller_keys": ["not-a-key"]}}, "not-a-key"),
        ({"agent": {"mesh": "m", "node": "a", "controller_keys": [PLACEHOLDER[1:-1]]}}, "real key"),
        (
            {
                "agent": {
                    "mesh": "m",
                    "node": "a",
                    "controller_keys": ["ZXhhbXBsZS1mcmEtaWRlbnRpdHktcmVwbGFjZS1tZSE="],
                }
            },
            "placeholder",
        ),
        (
            {"agent": {"mesh": "m", "node": "a", "controller_keys": ["/dev/zero"]}},
            "controller_keys",
        ),
        (
            {"agent": {"mesh": "m", "node": "a", "controller_keys": [CONTROLLER[:-2]]}},
            "controller_keys",
        ),
        ({"agent": {"mesh": "m", "node": "a"}, "routes": {"rule_priority": 0}}, "rule_priority"),
        (
            {"agent": {"mesh": "m", "node": "a"}, "routes": {"rule_priority": 40000}},
            "rule_priority",
        ),
        (
            {
                "agent": {"mesh": "m", "node": "a"},
                "routes": {"rule_priority": 50},
                "bulk": {"enabled": True},
            },
            "rule_priority",
        ),
        ({"agent": {"mesh": "m", "node": "a", "state_dir": "a\0b"}}, "state_dir"),
        ({"agent": {"mesh": "m", "node": "a", "identity_key": "a\0b"}}, "identity_key"),
    ],
)
def test_bad_config_is_one_clear_error(data: dict[str, object], message: str) -> None:
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_config(data, source="agent.toml")


def test_controller_key_in_a_file_is_accepted(tmp_path: Path) -> None:
    key = tmp_path / "controller.pub"
    key.write_text(CONTROLLER + "\n")
    cfg = parse_config({"agent": {"mesh": "m", "node": "a", "controller_keys": [str(key)]}})
    assert cfg.controller_keys == (str(key),)


@pytest.mark.parametrize(
    ("key_file", "fragment"),
    [
        (None, "cannot read signing key"),
        (b"", "not an Ed25519 private key"),
        (b"\x00" * 70_000, "larger than"),
    ],
)
def test_check_refuses_a_bad_identity_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key_file: bytes | None, fragment: str
) -> None:
    cfg = real_copy(tmp_path)
    key = tmp_path / "agent.key"
    if key_file is None:
        key.unlink()
    else:
        key.write_bytes(key_file)
    code, _, err = check(capsys, cfg)
    assert code == 2 and "\n" not in err and fragment in err, err


def test_check_refuses_an_unreadable_state_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = real_copy(tmp_path)
    (tmp_path / "agent-prod-fra.json").mkdir()  # a directory where the state file belongs
    code, _, err = check(capsys, cfg)
    assert code == 2 and "\n" not in err and "agent state" in err, err


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"\xff\xfe[agent]\n", "not UTF-8"),
        (b'[agent]\nmesh = "m"\nnode = "\xe9"\n', "not UTF-8"),
        (b"a = " + b"[" * 5000 + b"]" * 5000 + b"\n", "TOML"),
        (b"a = " + b"{b = " * 3000 + b"1" + b"}" * 3000 + b"\n", "TOML"),
        (b"[agent]\n" + b"#" * (5 << 20), "larger than"),
    ],
)
def test_hostile_toml_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], data: bytes, fragment: str
) -> None:
    path = tmp_path / "agent.toml"
    path.write_bytes(data)
    code, _, err = check(capsys, path)
    assert code == 2 and "\n" not in err and fragment in err, err


def test_unreadable_and_invalid_toml(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[agent\nmesh = ")
    with pytest.raises(InputError, match="not valid TOML"):
        load_config(bad)
