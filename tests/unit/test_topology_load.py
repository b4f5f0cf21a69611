"""load_topology: dispatch on what the user typed, and clear errors for everything else."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from meshopt.errors import TopologyError
from meshopt.topology import load_topology, save_topology
from meshopt.topology.load import file_kind, split_options

EXAMPLES = Path(__file__).parents[2] / "topologies"


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("a.yaml", "yaml"),
        ("a.YML", "yaml"),
        ("a.gml", "graph"),
        ("a.graphml", "graph"),
        ("a.csv", "csv"),
        ("a.csv.gz", "csv"),
        ("dir.v2/a.CSV.GZ", "csv"),
    ],
)
def test_file_kind(name: str, kind: str) -> None:
    assert file_kind(Path(name)) == kind


@pytest.mark.parametrize("name", ["a.json", "a.gz", "a", "a.yaml.bak", "a.txt.gz"])
def test_unknown_extensions(name: str) -> None:
    with pytest.raises(TopologyError, match="unknown topology") as info:
        file_kind(Path(name))
    assert name in str(info.value)
    assert ".yaml" in str(info.value) and "gen:" in str(info.value)


def test_split_options(tmp_path: Path) -> None:
    assert split_options("x.csv") == (Path("x.csv"), {})
    assert split_options("x.csv.gz?min_count=5&countries=DE,FR") == (
        Path("x.csv.gz"),
        {"min_count": "5", "countries": "DE,FR"},
    )
    odd = tmp_path / "what?.yaml"
    odd.write_text("x")
    assert split_options(str(odd)) == (odd, {})  # a real file wins over the option syntax
    with pytest.raises(TopologyError, match="key=value"):
        split_options("x.csv?min_count")
    with pytest.raises(TopologyError, match="twice"):
        split_options("x.csv?min_count=1&min_count=2")


def test_examples_load() -> None:
    names = {p.stem: load_topology(str(p)) for p in EXAMPLES.glob("*.yaml")}
    assert set(names) >= {"triangle", "europe", "two-regions", "hub", "lab4"}
    assert names["europe"].n == 10 and names["lab4"].n == 4 and names["hub"].n == 5
    assert names["two-regions"].n == 8


def test_a_path_loads_as_its_text_does(tmp_path: Path) -> None:
    path = EXAMPLES / "triangle.yaml"
    assert load_topology(path).names == load_topology(str(path)).names
    with pytest.raises(TopologyError, match="no such file"):
        load_topology(tmp_path / "missing.yaml")


def test_triangle_example_relays_through_c() -> None:
    topo = load_topology(str(EXAMPLES / "triangle.yaml"))
    rtt = topo.rtt_ms()
    a, b, c = (topo.index(x) for x in "abc")
    assert rtt[a, b] == 80.0
    assert rtt[a, c] + rtt[c, b] == 40.0


def test_europe_example() -> None:
    topo = load_topology(str(EXAMPLES / "europe.yaml"))
    assert topo.names == ["fra", "ams", "lon", "par", "mad", "mil", "waw", "sto", "vie", "ath"]
    assert [node.address for node in topo.nodes] == [f"10.99.0.{k}" for k in range(1, 11)]
    assert all(node.lat is not None for node in topo.nodes)
    rtt = topo.rtt_ms()
    best = np.min(rtt[:, :, None] + rtt[None, :, :], axis=1)
    wins = {
        (topo.names[i], topo.names[j])
        for i, j in zip(*np.nonzero(best < 0.7 * rtt), strict=True)
        if i < j
    }
    assert wins == {("ams", "ath"), ("lon", "ath"), ("mad", "waw"), ("mad", "sto")}


def test_hub_and_lab4_examples() -> None:
    hub = load_topology(str(EXAMPLES / "hub.yaml"))
    assert sorted(hub.tunnel_pairs()) == [("hq", f"br{k}") for k in range(1, 5)]
    lab = load_topology(str(EXAMPLES / "lab4.yaml"))
    off = ~np.eye(4, dtype=bool)
    assert np.all(lab.rate_mbit[off] <= 100)
    assert lab.delay_ms[off].min() >= 5 and lab.delay_ms[off].max() <= 40


def test_missing_and_odd_files(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match="no such file") as info:
        load_topology(str(tmp_path / "nope.yaml"))
    assert "nope.yaml" in str(info.value)
    folder = tmp_path / "dir.yaml"
    folder.mkdir()
    with pytest.raises(TopologyError, match="not a regular file"):
        load_topology(str(folder))
    with pytest.raises(TopologyError, match=r"unknown topology file type '\.txt'"):
        load_topology(str(tmp_path / "nope.txt"))


def test_options_are_checked(tmp_path: Path) -> None:
    yaml_file = EXAMPLES / "triangle.yaml"
    with pytest.raises(TopologyError, match="no \\?options"):
        load_topology(f"{yaml_file}?x=1")
    csv_file = tmp_path / "m.csv"
    csv_file.write_text("a,b,rtt_ms\nx,y,1\n")
    with pytest.raises(TopologyError, match="unknown option 'hop_ms'"):
        load_topology(f"{csv_file}?hop_ms=1")
    gml = tmp_path / "g.gml"
    gml.write_text("graph [ node [ id 0 ] ]")
    with pytest.raises(TopologyError, match="unknown option 'min_count'"):
        load_topology(f"{gml}?min_count=1")
    with pytest.raises(TopologyError, match="option hop_ms"):
        load_topology(f"{gml}?hop_ms=slow")


def test_warnings_are_returned_and_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "m.csv"
    path.write_text("a,b,rtt_ms\np,q,10\ns,t,5\n")
    warnings: list[str] = []
    with caplog.at_level(logging.WARNING, logger="meshopt.topology.load"):
        topo = load_topology(str(path), warnings=warnings)
    assert topo.names == ["p", "q"]
    assert len(warnings) == 1 and "largest connected part" in warnings[0]
    assert "largest connected part" in caplog.text


def test_save_and_load_generated(tmp_path: Path) -> None:
    topo = load_topology("gen:two-regions:n=6")
    out = tmp_path / "saved.yaml"
    save_topology(topo, out)
    again = load_topology(str(out))
    assert again.names == topo.names
    assert np.array_equal(again.delay_ms, topo.delay_ms)
    assert np.array_equal(again.tunnels, topo.tunnels)


# --- compressed files and the limits on one input --------------------------------------

COMPRESS = {".gz": "gzip", ".bz2": "bz2", ".xz": "lzma"}
ZOO = Path(__file__).parents[2].parent / "shared" / "data" / "topology-zoo" / "Abilene.gml"


@pytest.mark.parametrize("suffix", sorted(COMPRESS))
@pytest.mark.parametrize("source", ["europe.yaml", "plain.csv", "abilene.gml"])
def test_every_form_loads_compressed(tmp_path: Path, source: str, suffix: str) -> None:
    import importlib

    if source == "abilene.gml":
        if not ZOO.exists():
            pytest.skip("no Topology Zoo data in ../shared/data")
        plain = tmp_path / source
        plain.write_bytes(ZOO.read_bytes())
    elif source == "plain.csv":
        plain = tmp_path / source
        plain.write_text("a,b,rtt_ms\nx,y,8\ny,z,9\nx,z,30\n")
    else:
        plain = EXAMPLES / source
    packed = tmp_path / (source + suffix)
    packed.write_bytes(importlib.import_module(COMPRESS[suffix]).compress(plain.read_bytes()))
    a, b = load_topology(str(plain)), load_topology(str(packed))
    assert a.names == b.names and a.name == b.name
    assert np.array_equal(a.delay_ms, b.delay_ms) and np.array_equal(a.tunnels, b.tunnels)


def _yaml_nodes(n: int) -> str:
    return "defaults: {delay: 1ms}\nnodes:\n" + "".join(f"  n{i}:\n" for i in range(n))


def test_node_cap_names_the_line_and_how_to_raise_it(tmp_path: Path) -> None:
    from meshopt.topology.limits import Limits

    path = tmp_path / "many.yaml"
    path.write_text(_yaml_nodes(30))
    with pytest.raises(TopologyError) as info:
        load_topology(str(path), limits=Limits(max_nodes=20))
    assert info.value.line == 23  # the 21st node
    assert "more than 20 nodes" in str(info.value) and "--max-nodes" in str(info.value)
    assert load_topology(str(path), limits=Limits(max_nodes=30)).n == 30


def test_pair_cap_counts_underlay_and_tunnels(tmp_path: Path) -> None:
    from meshopt.topology.limits import Limits

    path = tmp_path / "pairs.yaml"
    path.write_text(
        "defaults: {delay: 1ms}\nnodes: {a: , b: , c: }\n"
        "underlay: {a-b: {delay: 2ms}, b-c: {delay: 3ms}}\ntunnels: [a-b, b-c]\n"
    )
    assert load_topology(str(path), limits=Limits(max_pairs=4)).n == 3
    with pytest.raises(TopologyError, match="more than 3 pairs"):
        load_topology(str(path), limits=Limits(max_pairs=3))


def test_limits_from_the_environment_and_flags_over_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshopt.cli.main import main

    path = tmp_path / "many.yaml"
    path.write_text(_yaml_nodes(30))
    monkeypatch.setenv("MESHOPT_MAX_NODES", "10")
    assert main(["topology", "check", str(path)]) == 2
    assert "more than 10 nodes" in capsys.readouterr().err
    assert main(["topology", "check", str(path), "--max-nodes", "30"]) == 0
    monkeypatch.setenv("MESHOPT_MAX_NODES", "ten")
    assert main(["topology", "check", str(path)]) == 2
    assert "MESHOPT_MAX_NODES must be a whole number" in capsys.readouterr().err


def test_nesting_stops_before_parsing(tmp_path: Path) -> None:
    for name, text in [
        ("deep.yaml", "nodes: " + "[" * 100 + "]" * 100),
        ("deep.gml", "graph [ x " + "[ " * 100 + "]" * 100 + " ]"),
        ("deep.graphml", "<graphml>" + "<g>" * 100 + "</g>" * 100 + "</graphml>"),
    ]:
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(TopologyError, match="more than 64 levels of nesting"):
            load_topology(str(path))


def test_graphml_with_a_dtd_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "laughs.graphml"
    path.write_text(
        '<?xml version="1.0"?><!DOCTYPE g [<!ENTITY a "lol">]>'
        '<graphml><graph><node id="&a;"/></graph></graphml>'
    )
    with pytest.raises(TopologyError, match="DTD"):
        load_topology(str(path))


def test_decompressed_cap(tmp_path: Path) -> None:
    import gzip

    from meshopt.topology.limits import Limits

    path = tmp_path / "bomb.csv.gz"
    path.write_bytes(gzip.compress(b"a,b,rtt_ms\n" + b"#" * 1000 + b"\n" * (3 << 20)))
    assert path.stat().st_size < 20_000
    with pytest.raises(TopologyError, match="more than 1 MiB of decompressed data"):
        load_topology(str(path), limits=Limits(max_input_mb=1))


def test_file_names_with_line_breaks_stay_one_line(tmp_path: Path) -> None:
    path = tmp_path / "two\nlines.yaml"
    path.write_text("nodes: [")
    with pytest.raises(TopologyError) as info:
        load_topology(str(path))
    assert "\n" not in str(info.value) and "two\\nlines.yaml" in str(info.value)
