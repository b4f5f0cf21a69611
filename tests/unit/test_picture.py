"""draw_mesh: valid PNG/SVG files that show names, RTTs and relay paths, and clear errors."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from meshopt.errors import MeshoptError, TopologyError
from meshopt.picture import PictureError, draw_mesh, edge_text, format_ms, mesh_layout
from meshopt.topology import Node, Topology, load_topology

EXAMPLES = Path(__file__).parents[2] / "topologies"
SVG = "{http://www.w3.org/2000/svg}"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def example(name: str) -> Topology:
    return load_topology(str(EXAMPLES / f"{name}.yaml"))


def svg_of(tmp_path: Path, topo: Topology, **kwargs: object) -> tuple[ET.Element, str]:
    out = tmp_path / "mesh.svg"
    draw_mesh(topo, out, **kwargs)  # type: ignore[arg-type]
    text = out.read_text()
    return ET.fromstring(text), text


def texts(root: ET.Element) -> list[str]:
    return [t.text or "" for t in root.iter(f"{SVG}text")]


def ids(root: ET.Element) -> set[str]:
    return {e.attrib["id"] for e in root.iter() if "id" in e.attrib}


def test_png_is_a_png(tmp_path: Path) -> None:
    out = tmp_path / "europe.png"
    draw_mesh(example("europe"), out, relay_paths=[["ams", "fra", "ath"]])
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 20_000  # a drawing, not an empty canvas


def test_suffix_decides_the_format_case_insensitively(tmp_path: Path) -> None:
    draw_mesh(example("triangle"), tmp_path / "t.PNG")
    assert (tmp_path / "t.PNG").read_bytes()[:8] == PNG_MAGIC
    draw_mesh(example("triangle"), str(tmp_path / "t.Svg"))
    ET.parse(tmp_path / "t.Svg")


def test_svg_shows_names_addresses_and_rtts(tmp_path: Path) -> None:
    root, _ = svg_of(tmp_path, example("triangle"))
    shown = texts(root)
    assert {"a", "b", "c"} <= set(shown)
    assert "10.99.0.1" in shown
    assert shown.count("80 ms") == 1  # a-b: 40 ms each way
    assert shown.count("20 ms") == 2  # a-c and b-c
    assert {"rtt-a-b", "rtt-a-c", "rtt-b-c", "node-a", "tunnels"} <= ids(root)


def test_relay_path_is_highlighted(tmp_path: Path) -> None:
    root, text = svg_of(tmp_path, example("triangle"), relay_paths=[["a", "c", "b"]])
    found = ids(root)
    assert {"relay-a-c", "relay-c-b", "bypassed-a-b"} <= found
    relay = next(e for e in root.iter() if e.attrib.get("id") == "relay-a-c")
    styles = " ".join(p.attrib.get("style", "") for p in relay.iter(f"{SVG}path"))
    assert "stroke: #d62728" in styles  # the first relay colour, not the tunnel grey
    bypassed = next(e for e in root.iter() if e.attrib.get("id") == "bypassed-a-b")
    assert "stroke-dasharray" in ET.tostring(bypassed).decode()
    shown = texts(root)
    assert "a → c → b: 40 ms" in shown
    assert "direct a – b: 80 ms" in shown
    assert text.count("#d62728") >= 5  # two hops, the bypassed line, their labels, legend


def test_relay_hop_shared_by_two_paths_gets_two_arrows(tmp_path: Path) -> None:
    root, _ = svg_of(
        tmp_path,
        example("two-regions"),
        relay_paths=[["chi", "nyc", "lon", "fra"], ["sea", "nyc", "lon"]],
    )
    assert {"relay-nyc-lon", "relay-nyc-lon-1", "relay-sea-nyc", "bypassed-sea-lon"} <= ids(root)


def test_relay_without_direct_tunnel_draws_no_bypass(tmp_path: Path) -> None:
    root, _ = svg_of(tmp_path, example("hub"), relay_paths=[["br1", "hq", "br2"]])
    found = ids(root)
    assert {"relay-br1-hq", "relay-hq-br2"} <= found
    assert not any(i.startswith("bypassed") for i in found)
    assert "no direct tunnel br1 – br2" in texts(root)


def test_only_tunnels_are_drawn(tmp_path: Path) -> None:
    root, _ = svg_of(tmp_path, example("hub"))
    rtts = {i for i in ids(root) if i.startswith("rtt-")}
    assert rtts == {"rtt-hq-br1", "rtt-hq-br2", "rtt-hq-br3", "rtt-hq-br4"}


def test_down_nodes_are_marked(tmp_path: Path) -> None:
    root, _ = svg_of(tmp_path, example("lab4"), down_nodes=["n3"])
    assert "n3 (down)" in texts(root)
    assert "node down" in texts(root)
    assert {"nodes-down", "tunnels-down"} <= ids(root)


def test_nodes_without_coordinates_render(tmp_path: Path) -> None:
    topo = example("lab4")
    assert all(node.lat is None for node in topo.nodes)
    root, _ = svg_of(tmp_path, topo, relay_paths=[["n1", "n2", "n4"]])
    assert {"n1", "n2", "n3", "n4"} <= set(texts(root))
    _, geographic = mesh_layout(topo)
    assert not geographic


def test_larger_mesh_without_coordinates_uses_rtt_layout(tmp_path: Path) -> None:
    geo = load_topology("gen:geo:n=12,seed=4")
    nodes = [Node(node.name, address=node.address) for node in geo.nodes]
    topo = Topology.from_matrices("flat", nodes, geo.delay_ms, source="test")
    pos, geographic = mesh_layout(topo)
    assert not geographic and pos.shape == (12, 2) and np.isfinite(pos).all()
    assert len({(round(x, 6), round(y, 6)) for x, y in pos.tolist()}) == 12
    np.testing.assert_array_equal(pos, mesh_layout(topo)[0])
    draw_mesh(topo, tmp_path / "flat.png")


def test_geographic_layout_uses_lat_lon() -> None:
    pos, geographic = mesh_layout(example("europe"))
    assert geographic
    names = example("europe").names
    ath, sto = pos[names.index("ath")], pos[names.index("sto")]
    assert ath[1] < sto[1]  # south is down
    assert pos[names.index("mad"), 0] < pos[names.index("waw"), 0]  # west is left


def test_antimeridian_mesh_stays_together() -> None:
    nodes = [Node("tyo", lat=35.7, lon=139.7), Node("sfo", lat=37.8, lon=-122.4)]
    topo = Topology.from_matrices("pacific", nodes, np.full((2, 2), 50.0), source="test")
    pos, _ = mesh_layout(topo)
    assert abs(pos[0, 0] - pos[1, 0]) < 120  # across the Pacific, not around the world


def test_output_is_deterministic(tmp_path: Path) -> None:
    topo = example("europe")
    for suffix in (".svg", ".png"):
        one, two = tmp_path / f"one{suffix}", tmp_path / f"two{suffix}"
        draw_mesh(topo, one, relay_paths=[["ams", "fra", "ath"]])
        draw_mesh(topo, two, relay_paths=[["ams", "fra", "ath"]])
        assert one.read_bytes() == two.read_bytes()


def test_asymmetric_labels_show_both_ends(tmp_path: Path) -> None:
    topo = example("triangle")
    labels = topo.rtt_ms()
    labels[0, 1], labels[1, 0] = 75.0, 88.0  # a measures 75 ms to b, b measures 88 ms to a
    root, _ = svg_of(tmp_path, topo, edge_label_ms=labels)
    shown = texts(root)
    assert "75/88 ms" in shown  # a is drawn left of b: its figure comes first
    assert "x/y ms: RTT measured from the left / right end" in shown


def test_edge_text_and_format() -> None:
    m = np.array([[0.0, 20.0, 9.6], [28.0, 0.0, np.nan], [9.4, np.nan, 0.0]])
    assert edge_text(m, 0, 1) == "20/28 ms"
    assert edge_text(m, 1, 0) == "28/20 ms"
    assert edge_text(m, 0, 2) == "9.5 ms"  # within 10%: one figure, the mean
    assert edge_text(m, 1, 2) is None
    m[1, 2] = 12.0
    assert edge_text(m, 1, 2) == "12 ms"  # one end measured
    assert format_ms(24.4) == "24" and format_ms(8.0) == "8" and format_ms(0.64) == "0.6"
    assert format_ms(float("nan")) == "?"


def test_large_mesh_drops_edge_labels_but_keeps_relay_ones(tmp_path: Path) -> None:
    topo = load_topology("gen:geo:n=40,seed=2")
    a, b, c = topo.names[:3]
    root, _ = svg_of(tmp_path, topo, relay_paths=[[a, b, c]], down_nodes=[topo.names[5]])
    rtts = {i for i in ids(root) if i.startswith("rtt-")}
    assert rtts == {f"rtt-{a}-{b}", f"rtt-{b}-{c}", f"rtt-{a}-{c}"}
    assert "tunnel RTT (ms)" in texts(root)  # the colour bar replaces the labels


def test_300_node_geo_mesh_renders(tmp_path: Path) -> None:
    topo = load_topology("gen:geo:n=300,seed=1")
    out = tmp_path / "big.png"
    draw_mesh(topo, out, relay_paths=[topo.names[:3]], down_nodes=[topo.names[7]])
    assert out.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("name", ["mesh.jpg", "mesh", "mesh.svg.gz", "mesh.pdf"])
def test_bad_suffix_is_a_one_line_error(tmp_path: Path, name: str) -> None:
    with pytest.raises(PictureError, match=r"\.png or \.svg") as info:
        draw_mesh(example("triangle"), tmp_path / name)
    assert isinstance(info.value, MeshoptError)
    assert name in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / name).exists()


def test_bad_inputs(tmp_path: Path) -> None:
    topo = example("triangle")
    out = tmp_path / "t.svg"
    with pytest.raises(PictureError, match="at least 3 nodes"):
        draw_mesh(topo, out, relay_paths=[["a", "b"]])
    with pytest.raises(PictureError, match="twice"):
        draw_mesh(topo, out, relay_paths=[["a", "c", "a"]])
    with pytest.raises(TopologyError, match="unknown node 'x'"):
        draw_mesh(topo, out, relay_paths=[["a", "x", "b"]])
    with pytest.raises(TopologyError, match="unknown node 'x'"):
        draw_mesh(topo, out, down_nodes=["x"])
    with pytest.raises(PictureError, match="edge labels"):
        draw_mesh(topo, out, edge_label_ms=np.zeros((2, 2)))
    with pytest.raises(PictureError, match="cannot write"):
        draw_mesh(topo, tmp_path / "no" / "such" / "dir.png")


def test_single_node_renders(tmp_path: Path) -> None:
    topo = Topology.from_matrices("one", [Node("solo")], np.zeros((1, 1)), source="test")
    root, _ = svg_of(tmp_path, topo, title="just one")
    assert {"solo", "just one"} <= set(texts(root))


def test_import_does_not_load_matplotlib() -> None:
    code = "import sys, meshopt.picture; print('matplotlib' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"
