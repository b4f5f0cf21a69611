"""Host-style node names (fra-1, node-0, db.eu) everywhere, and link specs split against
the names a mesh has."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshopt.errors import InputError, TopologyError
from meshopt.topology import load_topology, save_topology
from meshopt.topology.importers import sanitize_name
from meshopt.topology.names import Link, check_node_name, is_node_name, split_link

NAMES = ["fra-1", "ams-2", "fra", "1-ams", "db.eu", "x_y"]


@pytest.mark.parametrize("name", ["fra-1", "node-0", "db.eu", "a", "a_", "A9", "x" * 63, "a-b.c_d"])
def test_host_names_are_node_names(name: str) -> None:
    assert is_node_name(name) and check_node_name(name) == name


@pytest.mark.parametrize("name", ["", "-a", "a-", "a.", ".a", "a b", "a/b", "ä", "x" * 64, "a>b"])
def test_other_names_are_refused_with_the_rule(name: str) -> None:
    assert not is_node_name(name)
    with pytest.raises(InputError, match=r"letters, digits, '-', '_' and '\.'"):
        check_node_name(name)


def test_sanitize_keeps_hyphens() -> None:
    assert sanitize_name("Frankfurt-am-Main") == "Frankfurt-am-Main"
    assert sanitize_name("  -x- ") == "x"


@pytest.mark.parametrize(
    ("text", "link"),
    [
        ("db.eu-x_y", Link("db.eu", "x_y", False)),
        ("fra-1->ams-2", Link("fra-1", "ams-2", True)),
        ("fra-1 -> ams-2", Link("fra-1", "ams-2", True)),
        ("fra-1 - ams-2", Link("fra-1", "ams-2", False)),
        ("fra - 1-ams", Link("fra", "1-ams", False)),
    ],
)
def test_links_split_against_known_names(text: str, link: Link) -> None:
    assert split_link(text, NAMES) == link


def test_one_split_fits_when_names_have_dashes() -> None:
    assert split_link("fra-1-ams-2", ["fra-1", "ams-2"]) == Link("fra-1", "ams-2", False)


def test_ambiguous_link_names_both_readings() -> None:
    # fra + 1-ams-2? no; fra-1 + ams-2 and fra + 1-ams... both 'fra-1-ams' splits fit:
    with pytest.raises(InputError) as err:
        split_link("fra-1-ams", ["fra-1", "ams", "fra", "1-ams"])
    msg = str(err.value)
    assert "ambiguous link 'fra-1-ams'" in msg
    assert "'fra - 1-ams' or 'fra-1 - ams'; write one of these" in msg
    assert split_link("fra-1,ams", ["fra-1", "ams", "fra", "1-ams"]) == Link("fra-1", "ams", False)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("fra-1-lon-3", "unknown node 'lon-3'"),
        ("fra-2-ams-2", "unknown node 'fra-2' (did you mean fra-1"),
        ("zzz-qqq", "no dash splits it into two known nodes"),
        ("fra1", "write 'a-b' or 'a->b'"),
        ("fra-1-fra-1", "joins a node to itself"),
        ("fra-1->", "bad link"),
    ],
)
def test_bad_links_say_why(text: str, fragment: str) -> None:
    with pytest.raises(InputError, match=None) as err:
        split_link(text, NAMES)
    assert fragment in str(err.value)


def test_two_way_only_refuses_arrow() -> None:
    with pytest.raises(InputError, match="two-way"):
        split_link("fra-1->ams-2", NAMES, directed_ok=False)


def test_yaml_with_host_names_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "hosts.yaml"
    path.write_text(
        "defaults: {delay: 5ms}\n"
        "nodes: {fra-1: , ams-2: , lon.uk: }\n"
        "underlay:\n  fra-1-ams-2: {delay: 7ms}\n  ams-2->lon.uk: {delay: 9ms}\n"
        "tunnels: [fra-1-ams-2, ams-2 - lon.uk, fra-1-lon.uk]\n"
    )
    topo = load_topology(str(path))
    assert topo.names == ["fra-1", "ams-2", "lon.uk"]
    i, j, k = (topo.index(n) for n in topo.names)
    assert topo.delay_ms[i, j] == 7.0 and topo.delay_ms[j, k] == 9.0 and topo.delay_ms[k, j] == 5
    out = tmp_path / "again.yaml"
    save_topology(topo, str(out))
    assert load_topology(str(out)).names == topo.names


def test_yaml_ambiguous_pair_is_refused_with_line(tmp_path: Path) -> None:
    path = tmp_path / "amb.yaml"
    path.write_text("defaults: {delay: 5ms}\nnodes: {a: , a-b: , b-c: , c: }\ntunnels: [a-b-c]\n")
    with pytest.raises(TopologyError) as err:
        load_topology(str(path))
    assert f"{path}:3" in str(err.value) and "ambiguous pair 'a-b-c'" in str(err.value)


def test_csv_and_gml_keep_hyphenated_names(tmp_path: Path) -> None:
    csv = tmp_path / "m.csv"
    csv.write_text("a,b,rtt_ms\nnode-0,node-1,10\nnode-1,fra-1,12\nnode-0,fra-1,30\n")
    assert load_topology(str(csv)).names == ["node-0", "node-1", "fra-1"]
    gml = tmp_path / "g.gml"
    gml.write_text(
        "graph [\n"
        '  node [ id 0 label "Frankfurt-am-Main" Latitude 50.1 Longitude 8.7 ]\n'
        '  node [ id 1 label "Saint-Denis" Latitude 48.9 Longitude 2.4 ]\n'
        "  edge [ source 0 target 1 ]\n]\n"
    )
    assert load_topology(str(gml)).names == ["Frankfurt-am-Main", "Saint-Denis"]


@pytest.mark.parametrize("layout", ["single", "per-peer"])
def test_lab_names_from_host_names_are_valid_linux_names(layout: str) -> None:
    """Namespaces and WireGuard interfaces the lab derives from host-style node names."""
    import re

    from meshopt.lab.netns import check_netns_name
    from meshopt.lab.plan import make_plan
    from meshopt.topology.model import LinkProps, Node, Topology

    names = ["fra-1", "db.eu", "x" * 63, "a_b-c.d"]
    topo = Topology.from_links("hosts", [Node(n) for n in names], LinkProps(5.0))
    plan = make_plan(topo, "l0abc", "hosts", layout=layout)  # type: ignore[arg-type]
    ifname = re.compile(r"[A-Za-z0-9_.-]{1,15}")  # Linux: <= 15 bytes, no '/', no spaces
    for node in plan.nodes:
        check_netns_name(node.netns)
        assert node.name in node.netns
    for wg in plan.wg_ifs:
        assert ifname.fullmatch(wg.ifname) and wg.ifname not in (".", ".."), wg.ifname
