"""``meshopt demo``, the README's main job, run as a user runs it: the real command on the
real demo topology (namespaces, wireguard-go, mosquitto, agents, a controller), its
JSON report checked against the topology, and nothing left behind, also after Ctrl-C."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from meshopt.lab.netns import list_netns
from meshopt.lab.procs import tagged_pids
from meshopt.lab.state import all_labs

from .conftest import RUN_ID
from .tools import need_tools

pytestmark = pytest.mark.lab


def demo_argv(name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "meshopt.cli.main", "demo", "--name", name, *extra]


def lab_named(name: str) -> list[Any]:
    return [s for s in all_labs() if s.name == name]


def lab_traces(lab_id: str) -> tuple[list[str], dict[int, str]]:
    """Namespaces and processes of one lab (by its id, so other labs do not count)."""
    return [n for n in list_netns() if lab_id in n], tagged_pids(lab_id)


def agents_running(lab_id: str) -> bool:
    for pid in tagged_pids(lab_id):
        try:
            if b"agent" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                return True
        except OSError:
            continue
    return False


@pytest.fixture
def demo_tools(lab_ok: None) -> None:
    need_tools("wireguard-go", "mosquitto", "ping")


def test_demo_relays_the_bad_pairs_and_routes_around_changes(demo_tools: None) -> None:
    name = f"demo{RUN_ID}"
    proc = subprocess.run(
        demo_argv(name, "--json"), capture_output=True, text=True, timeout=360, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    rep: dict[str, Any] = json.loads(proc.stdout)
    assert rep["topology"] == "demo" and len(rep["nodes"]) == 6
    good, total = rep["pairs_on_optimum"]
    assert rep["converged_s"] is not None and good == total == 30, rep["pairs_on_optimum"]
    by_pair = {(q["src"], q["dst"]): q for q in rep["quality"]}
    assert len(by_pair) == 30
    # The three detours the topology file describes (40, 35 and 45 ms one way direct):
    # relayed through the optimum's relay, as read from the nodes; and pings through the
    # mesh take it: within 5 % (+ 1 ms of VM noise) of its two hops pinged beside them
    # (how fast this machine carries the lab's tunnels while the mesh runs: CI once read
    # a direct fra->ams at 9.41 ms against 8; the lab's fidelity is test_lab's to judge),
    # and far under the direct tunnel.
    for a, b in [("lon", "waw"), ("par", "waw"), ("mad", "waw")]:
        for q in (by_pair[a, b], by_pair[b, a]):
            assert q["path"] == q["optimum_path"] and len(q["path"]) == 3, q
            src, relay, dst = q["path"]
            first, second = by_pair[src, relay], by_pair[relay, dst]
            assert first["path"] == [src, relay] and second["path"] == [relay, dst]
            hops_ms = first["achieved_ms"] + second["achieved_ms"]
            assert q["achieved_ms"] is not None, q
            assert q["achieved_ms"] <= hops_ms * 1.05 + 1.0, (q, hops_ms)
            assert q["achieved_ms"] < 0.7 * q["direct_ms"], q
    # Every pair gets through; no relay makes a pair slower than its direct tunnel. (A
    # pair on its direct tunnel is on it by the path read from the nodes, counted in
    # pairs_on_optimum above; its ping against its configured RTT is the lab's timing,
    # which a busy VM stretches: CI saw fra->ams at 9.41 ms against 8 ms, on the tunnel.)
    for q in rep["quality"]:
        assert q["achieved_ms"] is not None, q
        if len(q["path"]) > 2:
            assert q["achieved_ms"] <= q["direct_ms"] * 1.05 + 1.0, q
    # Bounded by the goals (degradation <= 3 s, failure <= 1 s). A relay's
    # failure is the agents' own: dead after 0.8 s of silence (stalls credited), then a
    # local fail-over to the backup next hop in milliseconds.
    deg = rep["degradation"]
    assert deg is not None and deg["reroute_s"] is not None, deg
    assert deg["reroute_s"] <= 3.0, deg
    assert len(deg["better_path"]) == 3 and deg["better_ms"] < deg["direct_after_ms"]
    fail = rep["failure"]
    assert fail is not None and fail["outage_s"] is not None, fail
    assert fail["outage_s"] <= 1.0, fail
    assert fail["reachable"] and all(fail["reachable"].values()), fail
    assert lab_named(name) == [], "the demo left its lab behind"


def test_ctrl_c_tears_the_demo_down(demo_tools: None) -> None:
    name = f"demoint{RUN_ID}"
    # As from a terminal: SIGINT at its default. A test run started in the background
    # by a shell without job control inherits SIGINT ignored, and the demo with it
    # (a clean-clone CI run started that way saw the demo finish and exit 0).
    proc = subprocess.Popen(
        demo_argv(name),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lab_id = ""
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until agents run: the loop is live
            states = lab_named(name)
            if states and agents_running(states[0].id):
                lab_id = states[0].id
                break
            assert proc.poll() is None, f"demo ended early: {proc.stderr}"
            time.sleep(0.2)
        assert lab_id, "the demo never started its agents"
        assert lab_traces(lab_id) != ([], {})
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert "Traceback" not in err, err[-3000:]
    assert lab_named(name) == []
    assert lab_traces(lab_id) == ([], {})
