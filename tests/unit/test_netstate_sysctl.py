"""The sysctls the agent sets and puts back, on a temporary "/proc/sys" tree: only what
relaying needs, per interface where Linux allows, the host's values restored after a
clean stop and after a crash and restart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshopt.agent.netstate import Sysctls, read_sysctl, sysctl_path

HOST = {
    "net/ipv4/ip_forward": "0",
    "net/ipv4/conf/all/rp_filter": "1",
    "net/ipv4/conf/default/rp_filter": "1",
    "net/ipv4/conf/eth0/rp_filter": "1",
    "net/ipv4/conf/wg0/rp_filter": "1",
    "net/ipv6/conf/all/forwarding": "0",
    "net/ipv6/conf/eth0/forwarding": "0",
    "net/ipv6/conf/wg0/forwarding": "0",
}


def fake_proc(root: Path, per_interface_ipv6: bool, values: dict[str, str] = HOST) -> Path:
    files = dict(values)
    if per_interface_ipv6:  # Linux 6.17+: force_forwarding
        files.update({f"net/ipv6/conf/{i}/force_forwarding": "0" for i in ("all", "eth0", "wg0")})
    for rel, value in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(value + "\n")
    return root


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text().strip() for p in root.rglob("*") if p.is_file()}


def test_sysctl_path_keeps_dotted_interface_names(tmp_path: Path) -> None:
    assert sysctl_path("net.ipv4.ip_forward", tmp_path) == tmp_path / "net/ipv4/ip_forward"
    assert (
        sysctl_path("net.ipv6.conf.wg0.100.forwarding", tmp_path)
        == tmp_path / "net/ipv6/conf/wg0.100/forwarding"
    )


@pytest.mark.parametrize("per_interface", [True, False])
def test_forwarding_sets_only_what_relaying_needs_and_restores(
    tmp_path: Path, per_interface: bool
) -> None:
    root = fake_proc(tmp_path / "proc", per_interface)
    before = snapshot(root)
    s = Sysctls(tmp_path / "state" / "sysctl.json", root)
    s.enable_forwarding("auto", ipv6_mesh=False)
    s.enable_interface("wg0", "auto")
    now = snapshot(root)
    changed = {k: (before[k], v) for k, v in now.items() if before[k] != v}
    want = {
        "net/ipv4/ip_forward": ("0", "1"),
        # strict (1) would still win over the tunnel's 0: loose, never off
        "net/ipv4/conf/all/rp_filter": ("1", "2"),
        "net/ipv4/conf/wg0/rp_filter": ("1", "0"),
    }
    if per_interface:
        want["net/ipv6/conf/wg0/forwarding"] = ("0", "1")
        want["net/ipv6/conf/wg0/force_forwarding"] = ("0", "1")
    assert changed == want
    # Never the global IPv6 switch (it drops RA-learned default routes), never eth0.
    assert now["net/ipv6/conf/all/forwarding"] == "0"
    assert s.restore()
    assert snapshot(root) == before
    assert not (tmp_path / "state" / "sysctl.json").exists()


def test_rp_filter_loose_or_off_is_left_alone(tmp_path: Path) -> None:
    for value in ("0", "2"):
        root = fake_proc(tmp_path / value, True, {**HOST, "net/ipv4/conf/all/rp_filter": value})
        s = Sysctls(tmp_path / value / "rec.json", root)
        s.enable_forwarding("auto", ipv6_mesh=False)
        assert read_sysctl("net.ipv4.conf.all.rp_filter", root) == value


def test_ipv6_mesh_on_an_old_kernel_needs_the_global_switch(tmp_path: Path) -> None:
    root = fake_proc(tmp_path / "proc", per_interface_ipv6=False)
    s = Sysctls(tmp_path / "rec.json", root)
    s.enable_forwarding("auto", ipv6_mesh=True)
    assert read_sysctl("net.ipv6.conf.all.forwarding", root) == "1"
    s.restore()
    assert read_sysctl("net.ipv6.conf.all.forwarding", root) == "0"


def test_ipv6_modes_all_and_off(tmp_path: Path) -> None:
    root = fake_proc(tmp_path / "a", per_interface_ipv6=True)
    s = Sysctls(tmp_path / "a.json", root)
    s.enable_forwarding("all", ipv6_mesh=False)
    assert read_sysctl("net.ipv6.conf.all.forwarding", root) == "1"
    root = fake_proc(tmp_path / "o", per_interface_ipv6=True)
    s = Sysctls(tmp_path / "o.json", root)
    s.enable_forwarding("off", ipv6_mesh=True)
    s.enable_interface("wg0", "off")
    assert read_sysctl("net.ipv6.conf.all.forwarding", root) == "0"
    assert read_sysctl("net.ipv6.conf.wg0.forwarding", root) == "0"
    assert read_sysctl("net.ipv4.conf.wg0.rp_filter", root) == "0"


def test_a_crash_and_restart_still_restores_the_hosts_values(tmp_path: Path) -> None:
    root = fake_proc(tmp_path / "proc", True)
    before = snapshot(root)
    record = tmp_path / "state" / "sysctl.json"
    first = Sysctls(record, root)
    first.enable_forwarding("auto", ipv6_mesh=False)
    first.enable_interface("wg0", "auto")
    # The agent dies here (no restore); the originals are on disk already.
    assert json.loads(record.read_text())["net.ipv4.ip_forward"] == "0"
    second = Sysctls(record, root)
    second.enable_forwarding("auto", ipv6_mesh=False)  # sees 1s now: must not record them
    second.enable_interface("wg0", "auto")
    second.restore()
    assert snapshot(root) == before


def test_restore_skips_interfaces_that_are_gone(tmp_path: Path) -> None:
    root = fake_proc(tmp_path / "proc", True)
    s = Sysctls(tmp_path / "rec.json", root)
    s.enable_forwarding("auto", ipv6_mesh=False)
    s.enable_interface("wg0", "auto")
    for p in sorted((root / "net/ipv4/conf/wg0").iterdir()):
        p.unlink()
    (root / "net/ipv4/conf/wg0").rmdir()
    done = s.restore()
    assert "net.ipv4.ip_forward" in done and "net.ipv4.conf.wg0.rp_filter" not in done
    assert read_sysctl("net.ipv4.ip_forward", root) == "0"


def test_unreadable_record_is_ignored(tmp_path: Path) -> None:
    root = fake_proc(tmp_path / "proc", True)
    record = tmp_path / "rec.json"
    record.write_text("{broken")
    s = Sysctls(record, root)
    assert s.original == {}
    s.enable_forwarding("auto", ipv6_mesh=False)
    s.restore()
    assert read_sysctl("net.ipv4.ip_forward", root) == "0"


def test_a_missing_sysctl_is_a_warning_not_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s = Sysctls(tmp_path / "rec.json", tmp_path / "empty")
    assert s.set("net.ipv4.ip_forward", "1") is False
    assert "no such sysctl" in caplog.text
    assert not (tmp_path / "rec.json").exists()
