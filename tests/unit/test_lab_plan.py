"""The lab's plan: names and addresses decided before anything is created."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import numpy as np
import pytest

from meshopt.errors import InputError
from meshopt.lab.plan import (
    MAX_NODES,
    MGMT_NET,
    UNDERLAY_NET,
    make_plan,
    memory_estimate_mb,
    new_lab_id,
    peer_ifname,
)
from meshopt.topology import load_topology
from meshopt.topology.model import Node, Topology

EXAMPLES = Path(__file__).resolve().parents[2] / "topologies"


def _topo(addresses: list[str | None], tunnels: list[tuple[int, int]] | None = None) -> Topology:
    n = len(addresses)
    topo = Topology.from_matrices(
        "t",
        [Node(f"n{i}", address=a) for i, a in enumerate(addresses)],
        np.array([[0.0 if i == j else 5.0 for j in range(n)] for i in range(n)]),
        source="t.yaml",
    )
    if tunnels is not None:
        topo.tunnels[:] = False
        for i, j in tunnels:
            topo.tunnels[i][j] = topo.tunnels[j][i] = True
    return topo


def test_lab4_plan_names_and_addresses() -> None:
    topo = load_topology(str(EXAMPLES / "lab4.yaml"))
    plan = make_plan(topo, "labcd", "lab4")
    assert [n.netns for n in plan.nodes] == [f"mllabcd-n{i}" for i in range(1, 5)]
    assert plan.mgmt_netns == "mllabcd--mgmt"
    assert [n.overlay_ip for n in plan.nodes] == [f"10.99.0.{i}" for i in range(1, 5)]
    assert plan.overlay_net == "10.99.0.0/29"
    assert all(ipaddress.ip_address(n.underlay_ip) in UNDERLAY_NET for n in plan.nodes)
    assert all(ipaddress.ip_address(n.mgmt_ip) in MGMT_NET for n in plan.nodes)
    assert plan.broker_ip not in [n.mgmt_ip for n in plan.nodes]
    assert all(len(n.underlay_if) <= 15 and "labcd" in n.underlay_if for n in plan.nodes)
    assert [w.ifname for w in plan.wg_ifs] == ["wg0"] * 4
    assert all(len(w.peers) == 3 for w in plan.wg_ifs)


def test_per_peer_layout_pairs_ports_both_ways() -> None:
    plan = make_plan(_topo([None] * 3, [(0, 1), (1, 2)]), "l0000", "x", layout="per-peer")
    ifs = {(w.node, w.peers[0]): w for w in plan.wg_ifs}
    assert sorted(ifs) == [(0, 1), (1, 0), (1, 2), (2, 1)]  # no tunnel 0-2, no interface
    for (i, j), w in ifs.items():
        back = ifs[(j, i)]
        assert w.peer_ports == (back.port,) and back.peer_ports == (w.port,)
        assert w.ifname == f"wg-n{j}"


def test_assigned_and_partly_given_overlay_addresses() -> None:
    plan = make_plan(_topo([None, None]), "l0000", "x")
    assert [n.overlay_ip for n in plan.nodes] == ["10.201.0.1", "10.201.0.2"]
    plan = make_plan(_topo(["10.5.0.1", None, "10.5.0.2"]), "l0000", "x")
    ips = [n.overlay_ip for n in plan.nodes]
    assert len(set(ips)) == 3 and ips[0] == "10.5.0.1" and ips[2] == "10.5.0.2"
    net = ipaddress.ip_network(plan.overlay_net)
    assert all(ipaddress.ip_address(a) in net for a in ips)


@pytest.mark.parametrize(
    "addresses",
    [["10.98.0.1", "10.98.0.2", "10.98.0.3"], ["10.5.0.0", "10.5.0.1"], ["10.7.0.4", "10.7.0.7"]],
)
def test_no_node_is_the_overlay_networks_broadcast_or_network_address(
    addresses: list[str | None],
) -> None:
    """The smallest covering network of 10.98.0.1-3 is a /30 whose .3 is its broadcast
    address: ping refused it ("Do you want to ping broadcast?") in bench_probe's lab."""
    plan = make_plan(_topo(addresses), "l0000", "x")
    net = ipaddress.ip_network(plan.overlay_net)
    for n in plan.nodes:
        ip = ipaddress.ip_address(n.overlay_ip)
        assert ip in net and ip not in (net.broadcast_address, net.network_address), net


@pytest.mark.parametrize(
    ("addresses", "layout", "match"),
    [
        (["10.0.0.1", "172.31.9.9"], "single", "overlaps the lab's underlay"),
        (["172.30.0.7", "172.30.0.8"], "single", "management network"),
        (["10.0.0.1", "fd00::1"], "single", "mix IPv4 and IPv6"),
        ([None], "single", "at least 2 nodes"),
        ([None] * (MAX_NODES + 1), "single", "too many"),
        ([None] * 30, "per-peer", "per-peer layout"),
        ([None] * 3, "star", "bad layout"),
    ],
)
def test_plans_that_cannot_be_built(addresses: list[str | None], layout: str, match: str) -> None:
    with pytest.raises(InputError, match=match):
        make_plan(_topo(addresses), "l0000", "x", layout=layout)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["", "-x", "a b", "x/y", "a" * 40])
def test_bad_lab_names(name: str) -> None:
    with pytest.raises(InputError, match="bad lab name"):
        make_plan(_topo([None, None]), "l0000", name)


def test_ids_names_and_memory() -> None:
    ids = {new_lab_id() for _ in range(200)}
    assert len(ids) > 190 and all(len(i) == 5 and i[0] == "l" for i in ids)
    assert peer_ifname("fra", 3) == "wg-fra"
    assert peer_ifname("a_very_long_name", 12) == "wgp12"
    small = make_plan(_topo([None] * 4), "l0000", "x")
    big = make_plan(_topo([None] * 4), "l0000", "x", layout="per-peer")
    assert memory_estimate_mb(big) > memory_estimate_mb(small)


@pytest.mark.parametrize("seed", [-1, 1.5, True, "1"])
def test_lab_up_refuses_a_bad_seed_before_building_anything(seed: object) -> None:
    from meshopt.lab.lab import Lab

    with pytest.raises(InputError, match="seed"):
        Lab.up(str(EXAMPLES / "triangle.yaml"), seed=seed)  # type: ignore[arg-type]
