"""wireguard-go process handling that needs neither root nor wireguard-go."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from meshopt.wireguard.errors import WireGuardGoError
from meshopt.wireguard.userspace import (
    check_ifname,
    start_wireguard_go,
    wireguard_go_argv,
    wireguard_go_env,
)


def test_argv_plain_and_in_netns() -> None:
    assert wireguard_go_argv("wg0") == ["wireguard-go", "-f", "wg0"]
    assert wireguard_go_argv("wg0", netns="ns1") == [
        "ip", "netns", "exec", "ns1", "wireguard-go", "-f", "wg0",
    ]  # fmt: skip


def test_argv_private_run_dir_bind_mounts_it(tmp_path: Path) -> None:
    argv = wireguard_go_argv("wg0", netns="ns1", run_dir=str(tmp_path))
    assert argv[:6] == ["ip", "netns", "exec", "ns1", "sh", "-c"]
    assert "mount --bind" in argv[6] and 'exec "$@"' in argv[6]
    assert argv[7:] == [str(tmp_path), "wireguard-go", "-f", "wg0"]
    # without a namespace, unshare supplies the private mount namespace
    assert wireguard_go_argv("wg0", run_dir=str(tmp_path))[:4] == [
        "unshare", "--mount", "--propagation", "slave",
    ]  # fmt: skip
    # the default directory (through the /var/run symlink) needs no mount
    assert wireguard_go_argv("wg0", run_dir="/var/run/wireguard/") == ["wireguard-go", "-f", "wg0"]


@pytest.mark.parametrize("bad", ["", "a" * 16, "a/b", "a b", "a:b"])
def test_bad_ifnames(bad: str) -> None:
    with pytest.raises(WireGuardGoError):
        check_ifname(bad)


def test_env_tags_and_strips_inherited_fds() -> None:
    env = wireguard_go_env(
        {"MESHOPT_LAB": "t1"}, base={"PATH": "/bin", "WG_TUN_FD": "3", "WG_UAPI_FD": "4"}
    )
    assert env == {
        "PATH": "/bin",
        "WG_PROCESS_FOREGROUND": "1",
        "LOG_LEVEL": "error",
        "MESHOPT_LAB": "t1",
    }


def _fake_binary(tmp_path: Path, body: str) -> str:
    path = tmp_path / "fake-wireguard-go"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_daemon_that_dies_is_reported_with_its_output(tmp_path: Path) -> None:
    binary = _fake_binary(tmp_path, 'echo "boom: cannot create TUN $2" >&2; exit 3')
    with pytest.raises(WireGuardGoError, match=r"exited with status 3: boom: cannot create TUN"):
        start_wireguard_go(f"mowgu{os.getpid() % 10000}", binary=binary, timeout=5)


def test_a_daemon_that_never_answers_is_stopped(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    binary = _fake_binary(tmp_path, f"echo $$ > {pidfile}; echo waiting >&2; exec sleep 30")
    t0 = time.monotonic()
    with pytest.raises(WireGuardGoError, match=r"did not answer .* in time: waiting"):
        start_wireguard_go(f"mowgu{os.getpid() % 10000}", binary=binary, timeout=0.3)
    assert time.monotonic() - t0 < 5
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # ended (and reaped) by start_wireguard_go


def test_missing_binary() -> None:
    with pytest.raises(WireGuardGoError, match="not found"):
        start_wireguard_go("wg0", binary="/nonexistent/wireguard-go")
