"""``meshopt routes/path/graph --lab`` on a real mesh: wireguard-go, agents, a controller
and the lab's mosquitto (issue 5 item 3).

One lab for the module: topologies/lab4.yaml, where n1-n4 direct is 80 ms RTT and the
controller relays n1 <-> n4 (through n2, or n3 while early estimates settle). What the
commands print must be the path the nodes' kernels and WireGuard actually use, read back
from the nodes by LiveMesh, and RTTs close to the emulated underlay.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from meshopt.lab.lab import Lab
from meshopt.lab.mesh import LiveMesh, wait_until

from .conftest import EXAMPLES, new_lab_id
from .tools import need_tools


@pytest.fixture(scope="module")
def mesh(lab_ok: None) -> Iterator[LiveMesh]:
    need_tools("mosquitto", "wireguard-go", "wg")
    lab = Lab.up(str(EXAMPLES / "lab4.yaml"), name=new_lab_id(), layout="single")
    live = LiveMesh(lab)
    try:
        live.start()
        relayed = wait_until(lambda: len(live.path("n1", "n4")) == 3, 60, interval=0.5)
        assert relayed is not None, f"n1->n4 never relayed:\n{live.logs()}"
        time.sleep(3.0)  # let the first route sets (taken on young estimates) settle
        yield live
    finally:
        live.stop()
        lab.down()


def meshopt(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshopt.cli.main", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )


def agreeing(mesh: LiveMesh, read: Callable[[], Any], path_of: Callable[[Any], list[str]]) -> Any:
    """What ``read`` returned once its n1->n4 path equalled the nodes' own path, read from
    the nodes just before and just after. A route set is published a moment before the
    agents install it, so a disagreement is retried a few times before it fails."""
    seen = []
    for _ in range(6):
        before = mesh.path("n1", "n4")
        got = read()
        after = mesh.path("n1", "n4")
        shown = path_of(got)
        if before == after == shown:
            return got
        seen.append((before, shown, after))
        time.sleep(2)
    raise AssertionError(f"CLI vs nodes (before, shown, after): {seen}\n{mesh.logs()}")


def relay_path(data: dict[str, Any]) -> list[str]:
    """n1 -> n4 among the graph's relay paths (listed once per direction pair), or direct."""
    for p in data["relay_paths"]:
        if p[0] == "n1" and p[-1] == "n4":
            return list(p)
        if p[0] == "n4" and p[-1] == "n1":
            return list(reversed(p))
    return ["n1", "n4"]


def underlay_rtt(mesh: LiveMesh, path: list[str]) -> float:
    rtt = mesh.lab.topo.rtt_ms()
    idx = [mesh.lab.topo.index(n) for n in path]
    return float(sum(rtt[a, b] for a, b in itertools.pairwise(idx)))


def test_routes_json_shows_the_relay_the_nodes_use(mesh: LiveMesh) -> None:
    name = mesh.lab.plan.name

    def read() -> dict[str, Any]:
        proc = meshopt("routes", "--lab", name, "--json")
        # 1: a route that does not arrive (a moment between route sets); read again
        assert proc.returncode in (0, 1), proc.stderr
        data: dict[str, Any] = json.loads(proc.stdout)
        return data

    def to_n4_of(d: dict[str, Any]) -> dict[str, Any]:
        route: dict[str, Any] = next(r for r in d["nodes"]["n1"]["routes"] if r["dst"] == "n4")
        return route

    data = agreeing(mesh, read, lambda d: to_n4_of(d)["path"])
    assert data["mesh"] == name and sorted(data["nodes"]) == ["n1", "n2", "n3", "n4"]
    n1 = data["nodes"]["n1"]
    assert n1["controller"] == "ctl1" and n1["verified"] is None and n1["online"] is True
    assert time.time() - 600 < n1["since"] <= time.time()
    to_n4 = to_n4_of(data)
    assert to_n4["relayed"] and to_n4["next_hop"] == to_n4["path"][1]
    # Read once, no retries: the estimates are robust to spikes and stalls (a stalled
    # agent credits its own silence, a late burst of replies is rejected as a group).
    # Measured RTTs cannot beat the emulated underlay; above it they carry wireguard-go's
    # user-space hops and a shared machine's scheduling, which is sustained, not a spike
    # (at load 20 on these 2 cores the 80 ms tunnel read 102.8 ms). Still far from the
    # other link's figure: 34-40 ms relayed against 80 ms direct.
    want = underlay_rtt(mesh, to_n4["path"])
    hops = json.loads(meshopt("path", "--lab", name, "n1", "n4", "--json").stdout)["hops"]
    assert to_n4["rtt_ms"] is not None and to_n4["direct_rtt_ms"] is not None, (to_n4, hops)
    assert want - 1.0 < to_n4["rtt_ms"] < want * 1.25 + 3.0, (to_n4, want, hops)
    assert 80 - 1.0 < to_n4["direct_rtt_ms"] < 80 * 1.25 + 3.0, to_n4
    # every node's route to every other node is there, and named
    for node, table in data["nodes"].items():
        assert {r["dst"] for r in table["routes"]} == {"n1", "n2", "n3", "n4"} - {node}


def test_path_text_matches_the_kernel(mesh: LiveMesh) -> None:
    name = mesh.lab.plan.name

    def read() -> str:
        proc = meshopt("path", "--lab", name, "n1", "n4")
        assert proc.returncode in (0, 1), proc.stderr  # 1: broken for a moment; read again
        return proc.stdout

    def shown(out: str) -> list[str]:
        line = next(ln for ln in out.splitlines() if ln.startswith("path: "))
        return line.removeprefix("path: ").split(" via ")[0].split(" → ")

    out = agreeing(mesh, read, shown)
    relay = shown(out)[1]
    assert f"via {relay}" in out and "direct tunnel: RTT" in out and "since " in out, out
    data: dict[str, Any] = json.loads(meshopt("path", "--lab", name, "n1", "n4", "--json").stdout)
    assert data["direct_rtt_ms"] is not None and all(h["rtt_ms"] for h in data["hops"]), data
    # What the nodes measure now: the gain may even be negative for a while (the controller
    # holds a route against noise), so only its arithmetic is checked here.
    assert len(data["hops"]) == 2 and all(h["rtt_ms"] > 0 for h in data["hops"]), data
    total = sum(h["rtt_ms"] for h in data["hops"])
    assert data["rtt_ms"] == pytest.approx(total, abs=1e-3), data
    assert data["gain_ms"] == pytest.approx(data["direct_rtt_ms"] - total, abs=1e-3), data


def test_graph_draws_the_relay(mesh: LiveMesh, tmp_path: Path) -> None:
    out = tmp_path / "mesh.svg"
    name = mesh.lab.plan.name

    def read() -> dict[str, Any]:
        proc = meshopt("graph", "--lab", name, "--out", str(out), "--json")
        assert proc.returncode == 0, proc.stderr
        data: dict[str, Any] = json.loads(proc.stdout)
        return data

    data = agreeing(mesh, read, relay_path)
    assert len(relay_path(data)) == 3, data
    drawn = next(p for p in data["relay_paths"] if {p[0], p[-1]} == {"n1", "n4"})
    ids = {e.attrib.get("id") for e in ET.parse(out).getroot().iter()}
    assert {f"relay-{a}-{b}" for a, b in itertools.pairwise(drawn)} <= ids
    assert "bypassed-n1-n4" in ids or "bypassed-n4-n1" in ids
    assert len(data["tunnels"]) == 6 and data["down"] == []
