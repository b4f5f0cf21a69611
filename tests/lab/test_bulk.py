"""Bulk traffic on its own routes, with per-route TCP settings (issue 6, items 1-3).

A triangle in the per-peer layout: a-b direct is 5 ms one way but only 5 Mbit/s; a-c
and c-b are 10 ms and 100 Mbit/s. Interactive traffic a->b goes direct (10 ms RTT,
not 40), bulk traffic (the transfer port and iperf3's, by destination port) goes
through c, where the bandwidth is. Agents measure the capacities with packet trains;
the controller publishes both tables; the agents install both, with classifier rules.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshopt.lab.lab import Lab
from meshopt.lab.mesh import LiveMesh, ip_json, wait_until
from meshopt.lab.state import lab_dir

from .conftest import new_lab_id
from .test_agent import telemetry
from .tools import iperf3_goodput_mbit, need_tools

TOPOLOGY = """
name: bulktri
defaults: {delay: 10ms, jitter: 0.1ms, rate: 100Mbit}
nodes:
  a: {address: 10.98.0.1}
  b: {address: 10.98.0.2}
  c: {address: 10.98.0.3}
underlay:
  a-b: {delay: 5ms, rate: 5Mbit}
"""


@pytest.fixture(scope="module")
def mesh(lab_ok: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveMesh]:
    need_tools("mosquitto", "wireguard-go", "ping", "wg", "iperf3")
    spec = tmp_path_factory.mktemp("bulk") / "bulktri.yaml"
    spec.write_text(TOPOLOGY)
    lab = Lab.up(str(spec), name=new_lab_id(), layout="per-peer")
    incoming = lab_dir(lab.plan.lab_id) / "incoming"
    live = LiveMesh(
        lab,
        agent_sections={
            "bandwidth": {"enabled": True, "first_after_s": 2.0, "interval_s": 600.0},
            "bulk": {"enabled": True, "dports": ["51897/tcp", "5201/tcp"]},
            "transfer": {"enabled": True, "directory": str(incoming)},
        },
    )
    try:
        live.start()
        b = lab.overlay_ip("b")
        ready = wait_until(lambda: bulk_routes(live, "a").get(b) == "wg-c", 60, interval=0.5)
        assert ready is not None, live.logs()
        yield live
    finally:
        live.stop()
        lab.down()


def bulk_routes(mesh: LiveMesh, node: str) -> dict[str, str]:
    out = mesh.lab.run(node, ["ip", "-j", "-d", "route", "show", "table", "7702"]).stdout
    return {r["dst"]: r["dev"] for r in ip_json(out)}


def test_capacity_and_pmtu_are_measured_and_published(mesh: LiveMesh) -> None:
    def measured() -> bool:
        peers = telemetry(mesh.lab, "a")["peers"]
        return all(p.get("bandwidth_mbit") and p.get("pmtu") for p in peers)

    assert wait_until(measured, 30, interval=1.0) is not None, mesh.logs()
    owner = mesh.key_owner()
    by_node = {owner[p["public_key"]]: p for p in telemetry(mesh.lab, "a")["peers"]}
    # Packet trains at the IP level of 1200-byte probes through WireGuard (1260 B each on
    # the underlay): 5 Mbit/s direct to b, within 10 %. At 100 Mbit/s to c the estimate
    # depends on how busy this 2-core VM is (the emulator and wireguard-go are user-space
    # processes; bench_probe.py measures the accuracy on a quiet machine): here it only
    # has to be far above b's, which is what the widest path needs.
    assert by_node["b"]["bandwidth_mbit"] == pytest.approx(5 * 1200 / 1260, rel=0.10)
    assert by_node["c"]["bandwidth_mbit"] > 5 * by_node["b"]["bandwidth_mbit"]
    assert {p["pmtu"] for p in by_node.values()} == {1420}


def test_bulk_table_takes_the_wide_path_with_tuned_tcp(mesh: LiveMesh) -> None:
    lab = mesh.lab
    b = lab.overlay_ip("b")
    # Interactive: direct. Bulk: via c.
    assert mesh.next_hop("a", "b") == "b"
    assert bulk_routes(mesh, "a")[b] == "wg-c"
    shown = lab.run("a", ["ip", "route", "show", "table", "7702", b]).stdout
    for attr in ("proto 77", "mtu 1420", "advmss 1380", "window", "initcwnd", "initrwnd"):
        assert attr in shown, (attr, shown)
    # The classifier: the kernel picks the tuned bulk route for the transfer's port only.
    got = lab.run("a", ["ip", "route", "get", b, "ipproto", "tcp", "dport", "51897"]).stdout
    assert "dev wg-c" in got and "table 7702" in got, got
    got = lab.run("a", ["ip", "route", "get", b, "ipproto", "tcp", "dport", "22"]).stdout
    assert "dev wg-b" in got, got
    rtts = mesh.ping("a", "b", count=10)
    # 10 ms direct, not 40 via c; the fastest ping is the path's (load only adds).
    assert rtts and min(rtts) < 15.0, sorted(rtts)


def test_bulk_traffic_flows_through_the_relay(mesh: LiveMesh) -> None:
    lab = mesh.lab
    before = mesh.forwarded("c")
    mbit = iperf3_goodput_mbit(lab.netns("b"), lab.netns("a"), lab.overlay_ip("b"), seconds=3)
    # The direct path carries 5 Mbit/s; through c there is 100 Mbit/s.
    assert mbit > 20.0, mbit
    assert mesh.forwarded("c") - before > 1000


def test_transfer_to_the_agent_uses_the_bulk_path(mesh: LiveMesh, tmp_path: Path) -> None:
    lab = mesh.lab
    payload = tmp_path / "data.bin"
    payload.write_bytes(os.urandom(6 * 1024 * 1024))
    before = mesh.forwarded("c")
    t0 = time.monotonic()
    proc = lab.run(
        "a",
        [
            sys.executable,
            "-m",
            "meshopt.cli.main",
            "transfer",
            "send",
            str(payload),
            "b:",  # the node's name: its address is looked up on the broker
            "--lab",
            lab.plan.name,
            "--no-progress",
            "--json",
        ],
        timeout=120,
    )
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    received = lab_dir(lab.plan.lab_id) / "incoming" / "data.bin"
    assert received.read_bytes() == payload.read_bytes()
    # 6 MiB of random data at 5 Mbit/s would take 10 s direct.
    assert took < 8.0, took
    assert mesh.forwarded("c") - before > 1000


def test_bulk_traffic_survives_a_stalled_node(mesh: LiveMesh) -> None:
    """A VM stall, then bulk traffic at once: each node's processes (agent and
    wireguard-go) are stopped for 3 s in turn, and right after each stall a 3 s iperf3
    run a -> b must finish. With wireguard-go at real-time priority the same sequence,
    on this machine with much other work, froze every tunnel in the lab for tens of
    seconds (the agents and wireguard-go's control sockets starved) and the controller
    withdrew every route: session 7's CI failure. Two spinning processes alone did not
    bring it back, so this is a guard for the product's side (the agent keeps a silent
    interface's peers, a 3 s stall keeps the broker session), not a proof of the cause."""
    from meshopt.bench.cpuload import cpu_load

    lab = mesh.lab
    with cpu_load(2):  # a busy VM: the freeze needed other work on the machine
        for node in ("b", "c", "a"):
            lab.stall(node, 3.0)
            mbit = iperf3_goodput_mbit(
                lab.netns("b"), lab.netns("a"), lab.overlay_ip("b"), seconds=3
            )
            # The direct path alone carries 5 Mbit/s; the run must finish and move data.
            assert mbit > 1.0, (node, mbit)
    # Nothing was withdrawn for good: a's routes to b are back in both tables.
    b = lab.overlay_ip("b")
    back = wait_until(lambda: b in mesh.installed("a") and b in bulk_routes(mesh, "a"), 30)
    assert back is not None, mesh.logs()
