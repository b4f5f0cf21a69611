"""``meshopt lab`` as a user runs it: separate processes, a crash, ``down --all``, scale."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from meshopt.lab.netns import list_netns
from meshopt.lab.procs import tagged_pids
from meshopt.lab.state import LABS_ROOT, all_labs

from .conftest import EXAMPLES, RUN_ID, LabMaker
from .tools import ping_from

pytestmark = pytest.mark.lab


def meshopt(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshopt.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _one_line_error(proc: subprocess.CompletedProcess[str], *words: str, code: int = 2) -> None:
    """One error line; exit 2 for bad input, 3 for a lab that is not running."""
    assert proc.returncode == code, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()  # progress lines may come first
    errors = [line for line in lines if line.startswith("meshopt: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    for w in words:
        assert w in errors[0], errors[0]


def test_cli_up_status_exec_set_graph_down(lab_ok: None, tmp_path: Path) -> None:
    name = f"cli{RUN_ID}"
    up = meshopt("lab", "up", str(EXAMPLES / "lab4.yaml"), "--name", name, "--json")
    ours = ""
    try:
        assert up.returncode == 0, up.stderr
        status: dict[str, Any] = json.loads(up.stdout)
        ours = f"ml{status['id']}-"  # every namespace of this lab (other labs may come and go)
        assert sum(ns.startswith(ours) for ns in list_netns()) == len(status["nodes"]) + 1
        assert status["healthy"] and status["underlay"] == "emulator"
        assert status["wireguard"] in ("userspace", "kernel")
        assert [n["overlay"] for n in status["nodes"]] == [f"10.99.0.{i}" for i in range(1, 5)]

        listing = json.loads(meshopt("lab", "status", "--json").stdout)
        assert name in [lab["name"] for lab in listing]

        ping = meshopt(
            "lab", "exec", name, "n1", "--", "ping", "-c", "2", "-i", "0.05", "10.99.0.4"
        )
        assert ping.returncode == 0 and "2 received" in ping.stdout, ping.stdout + ping.stderr
        failing = meshopt("lab", "exec", name, "n1", "--", "sh", "-c", "exit 3")
        assert failing.returncode == 3  # the command's own exit status

        changed = meshopt("lab", "set", name, "n1-n4", "delay=60ms")
        assert changed.returncode == 0, changed.stderr
        status_now = json.loads(meshopt("lab", "status", name, "--json").stdout)
        r = ping_from(status_now["nodes"][0]["netns"], "172.31.0.4", 3, 0.05)
        assert min(r.rtts) >= 119, r.rtts

        calibrated = meshopt("lab", "calibrate", name)
        assert calibrated.returncode == 0, calibrated.stderr
        allowance = json.loads(meshopt("lab", "status", name, "--json").stdout)
        assert f"{allowance['tunnel_latency_us']:.0f} µs a tunnel hop" in calibrated.stdout
        _one_line_error(meshopt("lab", "calibrate", "no-such-lab"), "no lab named", code=3)

        _one_line_error(meshopt("lab", "set", name, "n1-zz", "delay=1ms"), "unknown node 'zz'")
        _one_line_error(meshopt("lab", "set", name, "n1-n4", "delay=fast"), "bad delay")
        _one_line_error(meshopt("lab", "exec", name, "zz", "--", "true"), "unknown node 'zz'")
        _one_line_error(meshopt("lab", "status", "no-such-lab"), "no lab named", code=3)
        _one_line_error(
            meshopt("lab", "up", str(EXAMPLES / "lab4.yaml"), "--name", name), "already up"
        )
        _one_line_error(meshopt("lab", "up", "gen:geo:n=400"), "too many")
        _one_line_error(meshopt("lab", "up", str(tmp_path / "missing.yaml")), "missing.yaml")

        svg = tmp_path / "lab.svg"
        drawn = meshopt("lab", "status", name, "--graph", str(svg))
        assert drawn.returncode == 0, drawn.stderr
        text = svg.read_text()
        assert "n1" in text and "80 ms" in text  # n1-n4: 40 ms each way in the file
    finally:
        down = meshopt("lab", "down", name)
    assert down.returncode == 0, down.stderr
    assert ours and not [ns for ns in list_netns() if ns.startswith(ours)]
    _one_line_error(meshopt("lab", "down", name), "no lab named", code=3)


def test_down_all_cleans_up_after_a_crashed_up(lab_ok: None) -> None:
    """``lab up`` killed mid-build: ``lab down --all`` removes everything it had made."""
    if all_labs():
        pytest.skip("other labs are running here; --all would remove them too")
    before = list_netns()
    procs_before = tagged_pids()
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshopt.cli.main", "lab", "up", "gen:geo:n=12,seed=2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # wait until WireGuard is starting
            states = all_labs()
            if states and any(p.role.startswith("wg:") for p in states[0].procs):
                break
            assert proc.poll() is None, "lab up finished before it could be killed"
            time.sleep(0.005)
        else:
            pytest.fail("lab up never reached the WireGuard step")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert len(list_netns()) > len(before) and len(tagged_pids()) > len(procs_before)
    done = meshopt("lab", "down", "--all")
    assert done.returncode == 0, done.stderr
    assert list_netns() == before
    assert tagged_pids() == procs_before
    assert not list(LABS_ROOT.glob("l*"))


def test_sixteen_node_full_mesh_up_and_down(make_lab: LabMaker) -> None:
    """The issue's scale check: a 16-node full mesh up in <= 30 s, down in <= 10 s."""
    t0 = time.monotonic()
    lab = make_lab("gen:geo:n=16,seed=3")
    up_s = time.monotonic() - t0
    status = lab.status()
    assert status["healthy"] and len(status["nodes"]) == 16
    names = lab.topo.names
    # A ring of pings through WireGuard: every node sends and answers at least once.
    for k, a in enumerate(names):
        b = names[(k + 5) % len(names)]
        assert ping_from(lab.netns(a), lab.overlay_ip(b), 2, 0.05).received >= 1, (a, b)
    print(f"16-node lab: up {up_s:.1f} s, processes {status['rss_mb']} MB RSS")
    t0 = time.monotonic()
    lab.down()
    down_s = time.monotonic() - t0
    assert up_s <= 30 and down_s <= 10, (up_s, down_s)
