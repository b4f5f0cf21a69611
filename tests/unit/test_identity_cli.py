"""``agent keygen``, ``controller keygen`` and ``agent reset-term``: the operator's side of
identities and of recovering from a compromised controller key."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from meshopt.agent.state import AgentState, load_state, save_state
from meshopt.bus.signing import load_private_key, public_key_b64
from meshopt.cli.main import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("who", ["agent", "controller"])
def test_keygen_makes_the_directory_and_prints_the_public_key(
    who: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "etc" / "meshopt" / "id.key"  # the directory does not exist yet
    code, out, err = run(capsys, who, "keygen", "--out", str(path))
    assert code == 0, err
    assert out.strip() == public_key_b64(load_private_key(path))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    code, _, err = run(capsys, who, "keygen", "--out", str(path))
    assert code == 2 and "exists; use --force" in err and "\n" not in err.strip()
    code, out2, _ = run(capsys, who, "keygen", "--out", str(path), "--force")
    assert code == 0 and out2 != out
    code, _, err = run(capsys, who, "keygen", "--out", str(tmp_path))
    assert code == 2 and "is a directory" in err


def test_agent_check_needs_its_identity_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "agent.toml"
    key = tmp_path / "agent.key"
    cfg.write_text(
        f'[agent]\nmesh = "m"\nnode = "a"\nidentity_key = "{key}"\nstate_dir = "{tmp_path}"\n'
    )
    code, _, err = run(capsys, "agent", "--config", str(cfg), "--check")
    assert code == 2 and "signing key" in err and str(key) in err
    assert run(capsys, "agent", "keygen", "--out", str(key))[0] == 0
    code, _, err = run(capsys, "agent", "--config", str(cfg), "--check")
    assert code == 0, err


def test_reset_term_forgets_what_a_compromised_controller_sent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'[agent]\nmesh = "m"\nnode = "a"\nstate_dir = "{tmp_path}"\n')
    state_path = tmp_path / "agent-m-a.json"
    save_state(
        state_path, AgentState(baseline={"k": ["10.0.0.1/32"]}, route_version=99, route_term=7)
    )
    code, out, err = run(capsys, "agent", "reset-term", "--config", str(cfg))
    assert code == 0, err
    assert "term 7 and version 99 forgotten" in out
    state = load_state(state_path)
    assert (state.route_term, state.route_version) == (0, 0)
    assert state.baseline == {"k": ["10.0.0.1/32"]}  # the operator's AllowedIPs are kept
