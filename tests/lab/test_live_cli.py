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
    """Run ``read`` between two readings of the nodes' own n1->n4 path that agree, so a
    route change in between cannot make the comparison wrong (or pass by luck)."""
    for _ in range(5):
        before = mesh.path("n1", "n4")
        got = read()
        if before == mesh.path("n1", "n4"):
            assert path_of(got) == before, (path_of(got), before)
            return got
        time.sleep(2)
    raise AssertionError(f"n1->n4 kept changing:\n{mesh.logs()}")


def underlay_rtt(mesh: LiveMesh, path: list[str]) -> float:
    rtt = mesh.lab.topo.rtt_ms()
    idx = [mesh.lab.topo.index(n) for n in path]
    return float(sum(rtt[a, b] for a, b in itertools.pairwise(idx)))


def test_routes_json_shows_the_relay_the_nodes_use(mesh: LiveMesh) -> None:
    name = mesh.lab.plan.name

    def read() -> dict[str, Any]:
        proc = meshopt("routes", "--lab", name, "--json")
        assert proc.returncode == 0, proc.stderr
        data: dict[str, Any] = json.loads(proc.stdout)
        return data

    data = agreeing(
        mesh,
        read,
        lambda d: next(r for r in d["nodes"]["n1"]["routes"] if r["dst"] == "n4")["path"],
    )
    assert data["mesh"] == name and sorted(data["nodes"]) == ["n1", "n2", "n3", "n4"]
    n1 = data["nodes"]["n1"]
    assert n1["controller"] == "ctl1" and n1["verified"] is None and n1["online"] is True
    assert time.time() - 600 < n1["since"] <= time.time()
    to_n4 = next(r for r in n1["routes"] if r["dst"] == "n4")
    assert to_n4["relayed"] and to_n4["next_hop"] == to_n4["path"][1]
    want = underlay_rtt(mesh, to_n4["path"])
    assert want * 0.85 < to_n4["rtt_ms"] < want * 1.3 + 2, (to_n4, want)
    assert 80 * 0.85 < to_n4["direct_rtt_ms"] < 80 * 1.3 + 2
    # every node's route to every other node is there, and named
    for node, table in data["nodes"].items():
        assert {r["dst"] for r in table["routes"]} == {"n1", "n2", "n3", "n4"} - {node}


def test_path_text_matches_the_kernel(mesh: LiveMesh) -> None:
    name = mesh.lab.plan.name

    def read() -> str:
        proc = meshopt("path", "--lab", name, "n1", "n4")
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    def shown(out: str) -> list[str]:
        line = next(ln for ln in out.splitlines() if ln.startswith("path: "))
        return line.removeprefix("path: ").split(" via ")[0].split(" → ")

    out = agreeing(mesh, read, shown)
    relay = shown(out)[1]
    assert f"via {relay}" in out and "relaying saves" in out and "since " in out
    proc = meshopt("path", "--lab", name, "n1", "n4", "--json")
    data = json.loads(proc.stdout)
    assert data["gain_ms"] > 20 and len(data["hops"]) == 2


def test_graph_draws_the_relay(mesh: LiveMesh, tmp_path: Path) -> None:
    out = tmp_path / "mesh.svg"
    name = mesh.lab.plan.name

    def read() -> dict[str, Any]:
        proc = meshopt("graph", "--lab", name, "--out", str(out), "--json")
        assert proc.returncode == 0, proc.stderr
        data: dict[str, Any] = json.loads(proc.stdout)
        return data

    data = agreeing(mesh, read, lambda d: next(p for p in d["relay_paths"] if p[0] == "n1"))
    path = next(p for p in data["relay_paths"] if p[0] == "n1")
    ids = {e.attrib.get("id") for e in ET.parse(out).getroot().iter()}
    assert {f"relay-{a}-{b}" for a, b in itertools.pairwise(path)} <= ids
    assert "bypassed-n1-n4" in ids or "bypassed-n4-n1" in ids
    assert len(data["tunnels"]) == 6 and data["down"] == []
