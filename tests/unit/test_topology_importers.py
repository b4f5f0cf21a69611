"""Importers: small hand-made files for known answers, the real Zoo and RIPE data for realism."""

from __future__ import annotations

import csv
import gzip
import math
from pathlib import Path

import networkx as nx
import numpy as np
import pytest

from meshopt.errors import TopologyError
from meshopt.topology.geo import geo_delay_ms
from meshopt.topology.importers import (
    HOP_MS,
    import_graph,
    import_rtt_csv,
    sanitize_name,
    unique_names,
)
from meshopt.topology.load import load_topology

DATA = Path(__file__).parents[2] / ".." / "shared" / "data"
ZOO = DATA / "topology-zoo"
RIPE = DATA / "ripe-atlas-country-rtt.csv.gz"
needs_zoo = pytest.mark.skipif(not ZOO.is_dir(), reason=f"Topology Zoo data not found at {ZOO}")
needs_ripe = pytest.mark.skipif(not RIPE.is_file(), reason=f"RIPE Atlas data not found at {RIPE}")


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# --- names -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("label", "name"),
    [
        ("New York", "New_York"),
        ("Zürich", "Zurich"),
        ("São Paulo (POP)", "Sao_Paulo_POP"),
        ("  -x- ", "x"),
        ("a.b_c", "a.b_c"),
        ("???", ""),
        ("x" * 80, "x" * 56),
    ],
)
def test_sanitize_name(label: str, name: str) -> None:
    assert sanitize_name(label) == name


def test_unique_names() -> None:
    names = unique_names(
        ["Paris", "Paris", "???", "Paris_2", "Paris"], ["n0", "n1", "n2", "n3", "n4"]
    )
    assert names == ["Paris", "Paris_2", "n2", "Paris_2_2", "Paris_3"]
    assert len(set(names)) == len(names)


# --- GML / GraphML (hand-made) ---------------------------------------------------------

SMALL_GML = """graph [
  directed 1
  node [ id 0 label "Berlin" Latitude 52.52 Longitude 13.40 ]
  node [ id 1 label "Paris" Latitude 48.86 Longitude 2.35 ]
  node [ id 2 label "Paris" Latitude 48.80 Longitude 2.30 ]
  node [ id 3 label "Unknown Place" ]
  node [ id 4 label "Island" Latitude 10.0 Longitude 10.0 ]
  node [ id 5 label "Island 2" Latitude 10.5 Longitude 10.5 ]
  node [ id 6 label "Lost" ]
  edge [ source 0 target 1 ]
  edge [ source 0 target 1 ]
  edge [ source 1 target 2 ]
  edge [ source 3 target 0 ]
  edge [ source 3 target 1 ]
  edge [ source 2 target 2 ]
  edge [ source 4 target 5 ]
]
"""


def test_gml_known_answers(tmp_path: Path) -> None:
    result = import_graph(write(tmp_path, "small.gml", SMALL_GML))
    topo = result.topology
    # duplicate label made unique; "Island" part and "Lost" dropped
    assert topo.names == ["Berlin", "Paris", "Paris_2", "Unknown_Place"]
    assert topo.tunnels.sum() == 12  # full mesh of 4
    bp = geo_delay_ms(52.52, 13.40, 48.86, 2.35) + HOP_MS
    assert topo.link("Berlin", "Paris").delay_ms == pytest.approx(bp)
    # Berlin -> Paris_2 follows the backbone through Paris (directed edges read as undirected)
    p2 = geo_delay_ms(48.86, 2.35, 48.80, 2.30) + HOP_MS
    assert topo.link("Paris_2", "Berlin").delay_ms == pytest.approx(bp + p2)
    # the node without coordinates sits at the centre of Berlin and Paris
    unknown = topo.node("Unknown_Place")
    assert unknown.lat is not None and 48.86 < unknown.lat < 52.52
    assert np.allclose(topo.delay_ms, topo.delay_ms.T)
    text = " | ".join(result.warnings)
    assert "placed 1 nodes" in text
    assert "dropped 1 nodes without coordinates: Lost" in text
    assert "largest connected part: 4 of 6" in text


def test_hop_ms_option(tmp_path: Path) -> None:
    path = write(tmp_path, "small.gml", SMALL_GML)
    base = load_topology(str(path))
    slow = load_topology(f"{path}?hop_ms=1ms")
    i, j = base.index("Berlin"), base.index("Paris_2")
    assert slow.delay_ms[i, j] - base.delay_ms[i, j] == pytest.approx(2 * (1 - HOP_MS))


def test_graphml(tmp_path: Path) -> None:
    g = nx.Graph()
    g.add_node("a", label="Amsterdam", Latitude=52.37, Longitude=4.90)
    g.add_node("b", label="Frankfurt", Latitude=50.11, Longitude=8.68)
    g.add_node("c")  # no label, no coordinates
    g.add_edges_from([("a", "b"), ("b", "c")])
    path = tmp_path / "tiny.graphml"
    nx.write_graphml(g, path)
    topo = load_topology(str(path))
    assert topo.names == ["Amsterdam", "Frankfurt", "nc"]
    assert topo.link("Amsterdam", "Frankfurt").delay_ms == pytest.approx(
        geo_delay_ms(52.37, 4.90, 50.11, 8.68) + HOP_MS
    )
    assert topo.link("Frankfurt", "nc").delay_ms == pytest.approx(HOP_MS)  # placed on Frankfurt


@pytest.mark.parametrize(
    ("name", "text", "fragment"),
    [
        (
            "none.gml",
            'graph [ node [ id 0 label "a" ] node [ id 1 ] edge [ source 0 target 1 ] ]',
            "no node has coordinates",
        ),
        ("one.gml", "graph [ node [ id 0 Latitude 1 Longitude 1 ] ]", "fewer than 2"),
        ("broken.gml", "graph [ node [ id 0 ", "cannot parse GML"),
        ("junk.gml", "\x00\x01 this is not gml", "cannot parse GML"),
        ("broken.graphml", "<graphml><graph>", "cannot parse GraphML"),
    ],
)
def test_graph_errors(tmp_path: Path, name: str, text: str, fragment: str) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(TopologyError, match=fragment) as info:
        load_topology(str(path))
    assert str(path) in str(info.value)


# --- Topology Zoo (real data) ----------------------------------------------------------


@needs_zoo
def test_abilene() -> None:
    topo = load_topology(str(ZOO / "Abilene.gml"))
    assert topo.n == 11
    assert "New_York" in topo.names and "Los_Angeles" in topo.names
    # ~3,940 km great circle -> ~39 ms RTT; the backbone path is a little longer
    rtt = topo.rtt_ms()[topo.index("New_York"), topo.index("Los_Angeles")]
    assert rtt == pytest.approx(40.0, rel=0.25)
    assert rtt > 39.0  # never shorter than the great circle
    assert topo.tunnels.sum() == 11 * 10


@needs_zoo
def test_every_zoo_file_loads_or_says_why() -> None:
    files = sorted(ZOO.glob("*.gml"))
    assert len(files) == 261
    loaded, refused = 0, []
    for path in files:
        try:
            topo = load_topology(str(path))
        except TopologyError as e:
            assert str(path) in str(e) and "fewer than 2 usable nodes" in str(e), str(e)
            refused.append(path.name)
            continue
        loaded += 1
        assert topo.n >= 2 and len(set(topo.names)) == topo.n
        off = ~np.eye(topo.n, dtype=bool)
        assert np.all(np.isfinite(topo.delay_ms)) and np.all(topo.delay_ms[off] > 0), path
        assert np.allclose(topo.delay_ms, topo.delay_ms.T)
    assert loaded >= 250, refused  # 8 files have no coordinates at all


# --- plain CSV ---------------------------------------------------------------------------


def test_plain_csv_full_matrix(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "m.csv",
        "# measured last week\n"
        "a,b,rtt_ms,jitter_ms,loss\nx,y,20,2,0\ny,z,10ms,0,1%\n\nz,x,50,0.5,0\n",
    )
    result = import_rtt_csv(path)
    topo = result.topology
    assert result.warnings == []
    assert topo.name == "m" and topo.names == ["x", "y", "z"]
    assert topo.link("x", "y").delay_ms == topo.link("y", "x").delay_ms == 10.0
    assert topo.rtt_ms()[topo.index("x"), topo.index("z")] == 50.0
    jit = topo.jitter_ms[0, 1]
    assert math.hypot(jit, jit) == pytest.approx(2.0)  # both directions combine back to 2 ms
    one_way = topo.loss[1, 2]
    assert 1 - (1 - one_way) ** 2 == pytest.approx(0.01)
    assert topo.tunnels.sum() == 6


def test_plain_csv_missing_pairs_have_no_tunnel(tmp_path: Path) -> None:
    path = write(tmp_path, "m.csv", "a,b,rtt_ms\np,q,10\nq,r,20\ns,t,5\n")
    result = import_rtt_csv(path)
    topo = result.topology
    assert topo.names == ["p", "q", "r"]  # s-t is a separate part: dropped
    assert "largest connected part: 3 of 5" in result.warnings[0]
    assert sorted(topo.tunnel_pairs()) == [("p", "q"), ("q", "r")]
    assert topo.link("p", "r").delay_ms == 15.0  # placeholder: best path over measured pairs


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        ("a,b,rtt\nx,y,1\n", 1, "unknown CSV header"),
        ("a,b,rtt_ms,colour\nx,y,1,red\n", 1, "bad CSV header"),
        ("a,b,rtt_ms\nx,y,1\nx,y\n", 3, "expected 3 fields"),
        ("a,b,rtt_ms\nx,y,fast\n", 2, "bad rtt_ms"),
        ("a,b,rtt_ms\nx,y,-1\n", 2, "bad rtt_ms"),
        ("a,b,rtt_ms,loss\nx,y,1,200%\n", 2, "loss"),
        ("a,b,rtt_ms\nx,x,1\n", 2, "itself"),
        ("a,b,rtt_ms\nx,y,1\ny,x,2\n", 3, "duplicate pair"),
        ("a,b,rtt_ms\nx/1,y,1\n", 2, "bad node name"),
        ("# c\n\na,b,rtt_ms\nx,y,1\nx,z,1\nz,y,ms\n", 6, "bad rtt_ms"),
    ],
)
def test_plain_csv_errors(tmp_path: Path, text: str, line: int, fragment: str) -> None:
    path = write(tmp_path, "bad.csv", text)
    with pytest.raises(TopologyError, match=fragment) as info:
        load_topology(str(path))
    assert str(info.value).startswith(f"{path}:{line}: ")


@pytest.mark.parametrize(
    ("text", "fragment"), [("", "empty CSV"), ("a,b,rtt_ms\n", "no usable pairs")]
)
def test_plain_csv_empty(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(TopologyError, match=fragment):
        load_topology(str(write(tmp_path, "e.csv", text)))


def test_plain_csv_rejects_ripe_options(tmp_path: Path) -> None:
    path = write(tmp_path, "m.csv", "a,b,rtt_ms\nx,y,1\n")
    with pytest.raises(TopologyError, match="RIPE Atlas files only"):
        load_topology(f"{path}?min_count=3")


def test_gzip_csv_and_bad_gzip(tmp_path: Path) -> None:
    good = tmp_path / "m.csv.gz"
    with gzip.open(good, "wt", encoding="utf-8") as f:
        f.write("a,b,rtt_ms\nx,y,8\n")
    assert load_topology(str(good)).rtt_ms()[0, 1] == 8.0
    bad = tmp_path / "bad.csv.gz"
    bad.write_bytes(b"a,b,rtt_ms\nx,y,8\n")  # not gzip
    with pytest.raises(TopologyError, match="cannot read"):
        load_topology(str(bad))


# --- RIPE Atlas ------------------------------------------------------------------------


def ripe_row(a: str, b: str) -> dict[str, str]:
    with gzip.open(RIPE, "rt", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            if {row["cty1"], row["cty2"]} == {a, b}:
                return row
    raise AssertionError(f"{a}-{b} not in the data")


@needs_ripe
def test_ripe_atlas_full_file() -> None:
    warnings: list[str] = []
    topo = load_topology(str(RIPE), warnings=warnings)
    assert 120 <= topo.n <= 173
    assert all(len(name) == 2 and name.isupper() for name in topo.names)
    assert "EU" not in topo.names
    row = ripe_row("DE", "FR")
    i, j = topo.index("DE"), topo.index("FR")
    assert topo.rtt_ms()[i, j] == pytest.approx(float(row["rtt_avg"]))
    jitter = min(float(row["rtt_std"]), float(row["rtt_avg"]) / 2)
    assert math.hypot(topo.jitter_ms[i, j], topo.jitter_ms[j, i]) == pytest.approx(jitter)
    present = topo.tunnels.sum() / (topo.n * (topo.n - 1))
    assert 0.3 < present < 0.8  # only measured pairs are tunnels
    assert any("rtt_cnt < 100" in w for w in warnings)


@needs_ripe
def test_ripe_atlas_options() -> None:
    topo = load_topology(f"{RIPE}?min_count=1000&countries=DE,fr,PL,NL")
    assert sorted(topo.names) == ["DE", "FR", "NL", "PL"]
    assert topo.tunnels.sum() == 12
    with pytest.raises(TopologyError, match="bad country codes"):
        load_topology(f"{RIPE}?countries=DE,France")
    with pytest.raises(TopologyError, match="min_count"):
        load_topology(f"{RIPE}?min_count=-1")


def test_ripe_form_is_detected_and_filtered(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "atlas.csv",
        "cty1,cty2,rtt_cnt,rtt_avg,rtt_std,rtt_min,rtt_max\n"
        "AA,BB,500,40,100,0.1,9000\n"
        "AA,CC,50,10,1,9,11\n"
        "BB,CC,500,30,2,28,40\n"
        "AA,AA,900,3,1,1,5\n"
        "AA,None,900,3,1,1,5\n",
    )
    result = import_rtt_csv(path)
    topo = result.topology
    assert topo.names == ["AA", "BB", "CC"]
    assert topo.rtt_ms()[0, 1] == 40.0
    assert math.hypot(topo.jitter_ms[0, 1], topo.jitter_ms[1, 0]) == pytest.approx(20.0)  # capped
    assert not topo.tunnels[0, 2]  # rtt_cnt 50 < 100
    assert topo.link("AA", "CC").delay_ms == 35.0  # placeholder via BB
    assert len(result.warnings) == 3
    assert import_rtt_csv(path, min_count=10).topology.tunnels.sum() == 6


def test_ripe_bad_row(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "atlas.csv",
        "cty1,cty2,rtt_cnt,rtt_avg,rtt_std,rtt_min,rtt_max\nAA,BB,many,40,1,1,1\n",
    )
    with pytest.raises(TopologyError, match="bad number") as info:
        load_topology(str(path))
    assert info.value.line == 2
