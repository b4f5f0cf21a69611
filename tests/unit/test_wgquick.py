"""wg-quick coexistence: SaveConfig = true in an interface's config is found and
explained in one warning; other configs, unreadable or absent files say nothing."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from meshopt.agent.wgquick import (
    config_names,
    read_wg_quick,
    save_config_enabled,
    save_config_warnings,
    warn_save_config,
)

WG0 = """\
[Interface]
Address = 10.99.0.1/24
ListenPort = 51820
PrivateKey = aGVsbG8=
{extra}
[Peer]
PublicKey = cGVlcg==
AllowedIPs = 10.99.0.2/32
Endpoint = 192.0.2.2:51820
"""


@pytest.mark.parametrize(
    ("extra", "saved"),
    [
        ("SaveConfig = true", True),
        ("SaveConfig=true", True),
        ("saveconfig = True  # persist", True),
        ("SaveConfig = false", False),
        ("# SaveConfig = true", False),
        ("", False),
    ],
)
def test_save_config_detected(extra: str, saved: bool) -> None:
    assert save_config_enabled(WG0.format(extra=extra)) is saved


def test_save_config_in_a_peer_section_does_not_count() -> None:
    assert not save_config_enabled("[Interface]\nListenPort = 1\n[Peer]\nSaveConfig = true\n")


def test_warning_names_the_file_and_the_fix(tmp_path: Path) -> None:
    (tmp_path / "wg0.conf").write_text(WG0.format(extra="SaveConfig = true"))
    (tmp_path / "wg1.conf").write_text(WG0.format(extra=""))
    warnings = save_config_warnings(["wg0", "wg1", "wg2"], "single", tmp_path)
    assert len(warnings) == 1
    w = warnings[0]
    assert str(tmp_path / "wg0.conf") in w and "SaveConfig = false" in w
    assert "AllowedIPs the agent moves" in w


def test_warn_logs_one_line_per_interface(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "wg0.conf").write_text(WG0.format(extra="SaveConfig = true"))
    with caplog.at_level(logging.WARNING, logger="meshopt.agent"):
        assert warn_save_config(["wg0"], "auto", tmp_path) == 1
    assert len(caplog.records) == 1 and "SaveConfig = true" in caplog.records[0].getMessage()


def test_absent_unreadable_or_huge_configs_are_skipped(tmp_path: Path) -> None:
    assert read_wg_quick("wg0", tmp_path) is None
    (tmp_path / "wg1.conf").mkdir()  # not a file
    assert read_wg_quick("wg1", tmp_path) is None
    (tmp_path / "wg2.conf").write_bytes(b"#" * (2 << 20))
    assert read_wg_quick("wg2", tmp_path) is None
    assert save_config_warnings(["wg0", "wg1", "wg2"], "single", tmp_path) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_a_root_only_config_is_silently_skipped(tmp_path: Path) -> None:
    path = tmp_path / "wg0.conf"
    path.write_text(WG0.format(extra="SaveConfig = true"))
    path.chmod(0)
    assert read_wg_quick("wg0", tmp_path) is None


def test_config_names_expand_globs(tmp_path: Path) -> None:
    for name in ("wg0", "wg-ams", "wg-fra", "other"):
        (tmp_path / f"{name}.conf").write_text("")
    assert config_names(["wg-*"], tmp_path) == ["wg-ams", "wg-fra"]
    assert config_names(["wg0", "wg9"], tmp_path) == ["wg0"]
    assert config_names(["wg0"], tmp_path / "missing") == []


def test_check_reports_save_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`meshopt agent --check`, run as root after installing, reads what the unit's user
    cannot: wg-quick's 0600 configs."""
    from meshopt.agent import wgquick
    from meshopt.bus.signing import generate_signing_key, save_private_key
    from meshopt.cli.main import main

    etc = tmp_path / "wireguard"
    etc.mkdir()
    (etc / "wg0.conf").write_text(WG0.format(extra="SaveConfig = true"))
    monkeypatch.setattr(wgquick, "WG_QUICK_DIR", etc)
    key = tmp_path / "agent.key"
    save_private_key(key, generate_signing_key()[0])
    config = tmp_path / "agent.toml"
    config.write_text(
        f'[agent]\nmesh = "m"\nnode = "fra"\nidentity_key = "{key}"\n'
        f'state_dir = "{tmp_path / "state"}"\nbroker = "mqtt://127.0.0.1:1"\n'
    )
    assert main(["agent", "--config", str(config), "--check"]) == 0
    out, err = capsys.readouterr()
    assert out.endswith(": ok (mesh m, node fra)\n")
    assert err.startswith("meshopt: warning: ") and "SaveConfig = true" in err
    assert err.count("\n") == 1
