"""The shipped systemd units: systemd itself (systemd-analyze) finds no error in them and
rates their exposure OK or better, and they say what docs/daemons.md promises."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parents[2] / "packaging" / "systemd"
NAMES = ("meshopt-agent.service", "meshopt-controller.service")
INSTALLED = "/opt/meshopt/bin/meshopt"


def analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        pytest.skip("systemd-analyze is not installed (Debian: systemd)")
    return path


def settings(name: str) -> dict[str, list[str]]:
    """Key -> every value it is given in the [Service]/[Unit] sections (comments skipped)."""
    out: dict[str, list[str]] = {}
    for line in (UNITS / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key, []).append(value)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_systemd_analyze_verify_is_silent(name: str, tmp_path: Path) -> None:
    """verify needs the ExecStart binary: the copy points at this checkout's meshopt."""
    exe = Path(sys.executable).with_name("meshopt")
    if not exe.exists():
        pytest.skip(f"no meshopt console script next to {sys.executable}")
    text = (UNITS / name).read_text()
    assert INSTALLED in text
    (tmp_path / name).write_text(text.replace(INSTALLED, str(exe)))
    env = {**os.environ, "SYSTEMD_LOG_LEVEL": "notice"}
    proc = subprocess.run(
        [analyze(), "verify", "--man=no", str(tmp_path / name)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    # Unknown or misspelt keys are only warnings (exit 0): any output is a failure.
    assert proc.returncode == 0 and proc.stderr == "" and proc.stdout == "", proc.stderr


def exposure(name: str) -> tuple[float, str]:
    proc = subprocess.run(
        [analyze(), "security", "--offline=true", "--no-pager", str(UNITS / name)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+) (\w+)", proc.stdout)
    assert m is not None, proc.stdout + proc.stderr
    return float(m.group(1)), m.group(2)


@pytest.mark.parametrize("name", NAMES)
def test_exposure_rated_ok_or_better(name: str) -> None:
    value, rating = exposure(name)
    assert value < 5.0 and rating in ("OK", "SAFE"), (name, value, rating)


def test_agent_runs_unprivileged_with_two_capabilities() -> None:
    s = settings("meshopt-agent.service")
    assert s["User"] == ["meshopt"] and s["Group"] == ["meshopt"]
    assert s["AmbientCapabilities"] == ["CAP_NET_ADMIN CAP_NET_RAW"]
    assert s["CapabilityBoundingSet"] == ["CAP_NET_ADMIN CAP_NET_RAW"]
    # wireguard-go may never have made /var/run/wireguard (kernel WireGuard): "-".
    rw = " ".join(s["ReadWritePaths"]).split()
    assert "-/var/run/wireguard" in rw and "/proc/sys/net" in rw
    assert s["After"] == ["network-online.target wg-quick@wg0.service"]


def test_controller_has_no_capability_at_all() -> None:
    s = settings("meshopt-controller.service")
    assert s["User"] == ["meshopt"]
    assert s["CapabilityBoundingSet"] == [""] and s["AmbientCapabilities"] == [""]
    assert "AF_NETLINK" not in s["RestrictAddressFamilies"][0]


@pytest.mark.parametrize("name", NAMES)
def test_daemon_contract(name: str) -> None:
    """Readiness, watchdog, reload, no restart loop on a bad config, sandboxing."""
    s = settings(name)
    command = "agent" if "agent" in name else "controller"
    config = f"/etc/meshopt/{command}.toml"
    assert s["Type"] == ["notify"] and s["NotifyAccess"] == ["main"]
    assert s["WatchdogSec"] == ["10s"]
    assert s["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert s["ExecStartPre"] == [f"{INSTALLED} {command} --config {config} --check"]
    assert s["ExecStart"] == [f"{INSTALLED} {command} --config {config}"]
    assert s["Restart"] == ["on-failure"] and s["RestartPreventExitStatus"] == ["2"]
    assert s["StateDirectory"] == ["meshopt"] and s["UMask"] == ["0077"]
    for key in (
        "NoNewPrivileges",
        "ProtectHome",
        "PrivateTmp",
        "PrivateDevices",
        "ProtectKernelModules",
        "ProtectKernelLogs",
        "ProtectKernelTunables",
        "ProtectControlGroups",
        "ProtectClock",
        "ProtectHostname",
        "RestrictNamespaces",
        "RestrictRealtime",
        "RestrictSUIDSGID",
        "LockPersonality",
        "MemoryDenyWriteExecute",
    ):
        assert s.get(key) == ["yes"], key
    assert s["ProtectSystem"] == ["strict"]
    assert "@system-service" in s["SystemCallFilter"]
    assert s["SystemCallArchitectures"] == ["native"]


MDWE = (
    "import ctypes, os, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "if libc.prctl(65, 1, 0, 0, 0) != 0:\n"  # PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN
    "    sys.exit(77)\n"
    "os.execv(sys.executable, [sys.executable, '-m', 'meshopt.cli.main', *sys.argv[1:]])\n"
)


def under_mdwe(*args: str) -> subprocess.CompletedProcess[str]:
    """``meshopt ARGS`` with write+execute memory refused, as MemoryDenyWriteExecute=yes
    does (the kernel's PR_SET_MDWE, kept across execve; systemd >= 257 uses it too)."""
    proc = subprocess.run(
        [sys.executable, "-c", MDWE, *args], capture_output=True, text=True, timeout=120
    )
    if proc.returncode == 77:
        pytest.skip("this kernel has no PR_SET_MDWE (Linux < 6.3)")
    return proc


def test_memory_deny_write_execute_leaves_python_and_its_libraries_working(
    tmp_path: Path,
) -> None:
    """numpy/scipy (the controller's routes), cryptography (signing), msgspec: none needs
    memory that is writable and executable. The agent runs so in tests/lab/test_daemon_ops."""
    repo = UNITS.parents[1]
    topology = next(
        p
        for p in (repo / "topologies" / "europe.yaml", repo / "meshopt/topologies/europe.yaml")
        if p.exists()
    )
    routes = under_mdwe("routes", str(topology), "--json")
    assert routes.returncode == 0, routes.stderr
    assert routes.stdout.lstrip().startswith(("{", "["))
    key = tmp_path / "controller.key"
    keygen = under_mdwe("controller", "keygen", "--out", str(key))
    assert keygen.returncode == 0, keygen.stderr
    node = under_mdwe("agent", "keygen", "--out", str(tmp_path / "fra.key"))
    assert node.returncode == 0, node.stderr
    config = tmp_path / "controller.toml"
    config.write_text(
        f'[controller]\nmesh = "m"\nid = "c"\nsigning_key = "{key}"\n'
        f'[node_keys]\nfra = "{node.stdout.split()[-1]}"\n'
    )
    check = under_mdwe("controller", "--config", str(config), "--check")
    assert check.returncode == 0, check.stderr


def test_controller_runs_ahead_of_ordinary_work_and_the_benchmark_runs_it_so() -> None:
    from meshopt.bench.synthetic import unit_nice

    s = settings("meshopt-controller.service")
    assert s["Nice"] == ["-5"]
    assert "Nice" not in settings("meshopt-agent.service")
    assert unit_nice(UNITS / "meshopt-controller.service") == -5
    assert unit_nice(UNITS / "meshopt-agent.service") == 0
    assert unit_nice(UNITS / "no-such.service") == 0
