"""The YAML topology format: known answers, every error with its line, round trips, fuzzing."""

from __future__ import annotations

import math
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshopt.errors import TopologyError
from meshopt.topology import generators
from meshopt.topology.geo import geo_delay_ms
from meshopt.topology.load import load_topology, save_topology
from meshopt.topology.model import Node, Topology
from meshopt.topology.yamlfile import dump_yaml, parse_yaml

EXAMPLES = Path(__file__).parents[2] / "topologies"

BRIEF_EXAMPLE = """\
name: triangle
defaults:
  delay: 10ms
  jitter: 0.5ms
  loss: 0%
  rate: 100Mbit
nodes:
  a: {address: 10.99.0.1, site: eu-west, lat: 52.52, lon: 13.40}
  b: {}
  c:
underlay:
  a-b: {delay: 80ms}
  a-c: {delay: 20ms, loss: 1%}
  b->c: {delay: 25ms}
tunnels: full
"""


def write(tmp_path: Path, text: str, name: str = "topo.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def delay(topo: Topology, a: str, b: str) -> float:
    return float(topo.delay_ms[topo.index(a), topo.index(b)])


# --- known answers ---------------------------------------------------------------------


def test_brief_example(tmp_path: Path) -> None:
    topo = load_topology(str(write(tmp_path, BRIEF_EXAMPLE)))
    assert topo.name == "triangle"
    assert topo.names == ["a", "b", "c"]
    assert topo.nodes[0] == Node("a", "10.99.0.1", "eu-west", 52.52, 13.40)
    assert topo.nodes[2] == Node("c")
    assert delay(topo, "a", "b") == delay(topo, "b", "a") == 80.0
    assert delay(topo, "a", "c") == delay(topo, "c", "a") == 20.0
    assert delay(topo, "b", "c") == 25.0  # one-way override
    assert delay(topo, "c", "b") == 10.0  # the other direction keeps the default
    ac = topo.link("a", "c")
    assert ac.loss == topo.link("c", "a").loss == pytest.approx(0.01)
    assert ac.jitter_ms == 0.5 and ac.rate_mbit == 100.0
    assert topo.link("b", "c").loss == 0.0
    assert topo.tunnels.sum() == 6
    assert np.all(np.diag(topo.delay_ms) == 0)


def test_one_way_entry_overrides_only_its_keys(tmp_path: Path) -> None:
    topo = load_topology(
        str(
            write(
                tmp_path,
                """
                defaults: {delay: 10ms}
                nodes: {a: , b: }
                underlay:
                  a->b: {loss: 2%}
                  a-b: {delay: 30ms, jitter: 1ms}
                """,
            )
        )
    )
    ab, ba = topo.link("a", "b"), topo.link("b", "a")
    assert (ab.delay_ms, ab.jitter_ms) == (ba.delay_ms, ba.jitter_ms) == (30.0, 1.0)
    assert ab.loss == pytest.approx(0.02) and ba.loss == 0.0


def test_defaults_rate_unlimited_and_name_from_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        defaults: {delay: 5}
        nodes: {x: , y: , z: }
        underlay:
          x-y: {rate: 10Mbit}
          y-z: {rate: unlimited}
        """,
        name="small.yml",
    )
    topo = load_topology(str(path))
    assert topo.name == "small"
    assert topo.link("x", "y").rate_mbit == 10.0
    assert math.isinf(topo.link("y", "z").rate_mbit)
    assert math.isinf(topo.link("x", "z").rate_mbit)
    assert topo.link("x", "z").delay_ms == 5.0


def test_tunnel_list(tmp_path: Path) -> None:
    topo = load_topology(
        str(
            write(
                tmp_path,
                """
                defaults: {delay: 5ms}
                nodes: {h: , s1: , s2: }
                tunnels: [h-s1, s2-h]
                """,
            )
        )
    )
    assert sorted(topo.tunnel_pairs()) == [("h", "s1"), ("h", "s2")]
    assert not topo.tunnels[topo.index("s1"), topo.index("s2")]


def test_geo_delay(tmp_path: Path) -> None:
    topo = load_topology(
        str(
            write(
                tmp_path,
                """
                defaults: {delay: 7ms}
                geo_delay: true
                nodes:
                  ber: {lat: 52.52, lon: 13.40}
                  par: {lat: 48.86, lon: 2.35}
                  lon: {lat: 51.51, lon: -0.13}
                  nowhere: {}
                underlay:
                  par-lon: {delay: 9ms}
                """,
            )
        )
    )
    expected = geo_delay_ms(52.52, 13.40, 48.86, 2.35)
    assert delay(topo, "ber", "par") == pytest.approx(expected)
    assert delay(topo, "par", "ber") == pytest.approx(expected)
    assert 4.0 < expected < 5.0  # ~880 km
    assert delay(topo, "par", "lon") == 9.0  # explicit wins over geography
    assert delay(topo, "ber", "nowhere") == 7.0  # no coordinates: defaults


def test_geo_delay_alone_is_enough(tmp_path: Path) -> None:
    topo = load_topology(
        str(
            write(
                tmp_path,
                """
                geo_delay: true
                nodes: {a: {lat: 0, lon: 0}, b: {lat: 0, lon: 1}}
                """,
            )
        )
    )
    assert delay(topo, "a", "b") == pytest.approx(geo_delay_ms(0, 0, 0, 1))


def test_names_are_taken_as_written(tmp_path: Path) -> None:
    topo = load_topology(
        str(
            write(
                tmp_path,
                """
                defaults: {delay: 1}
                nodes: {no: , yes: , 1.10: , "null": }
                underlay: {no-1.10: {delay: 3}}
                """,
            )
        )
    )
    assert topo.names == ["no", "yes", "1.10", "null"]
    assert delay(topo, "no", "1.10") == 3.0


def test_ipv6_address_is_normalised(tmp_path: Path) -> None:
    topo = load_topology(
        str(
            write(
                tmp_path,
                """
                defaults: {delay: 1}
                nodes: {a: {address: "fd00:0:0::1"}, b: {address: 10.99.0.2}}
                """,
            )
        )
    )
    assert topo.nodes[0].address == "fd00::1"


# --- errors ----------------------------------------------------------------------------

ERRORS = [
    ("nodes: {a: , b: }\ndefaults: {delay: 1}\ncolour: blue\n", 3, "unknown key 'colour'"),
    ("defaults: {delay: 1}\nnodes:\n  a: {}\n  b: {addr: 10.0.0.1}\n", 4, "unknown key 'addr'"),
    ("defaults: {delay: 1, latency: 2}\nnodes: {a: , b: }\n", 1, "unknown key 'latency'"),
    ("defaults: {delay: 1}\nnodes: {a: , b: }\nunderlay:\n  a-b: {dealy: 5}\n", 4, "dealy"),
    ("defaults: {delay: 1}\nnodes: {a: , b: }\nunderlay:\n  a-x: {delay: 5}\n", 4, "unknown node"),
    ("defaults: {delay: 1}\nnodes: {a: , b: }\nunderlay:\n  a-a: {}\n", 4, "itself"),
    (
        "defaults: {delay: 1}\nnodes: {a: , b: }\nunderlay:\n  a-b: {}\n  b-a: {}\n",
        5,
        "duplicate pair",
    ),
    (
        "defaults: {delay: 1}\nnodes: {a: , b: }\nunderlay:\n  a->b: {}\n  a->b: {}\n",
        5,
        "duplicate key",
    ),
    ("defaults: {delay: 1}\nnodes: {a: , b: }\nunderlay:\n  a+b: {}\n", 4, "bad pair"),
    ("defaults:\n  delay: 10 parsecs\nnodes: {a: , b: }\n", 2, "bad delay"),
    ("defaults: {delay: 1}\nnodes: {a: , b: }\nunderlay:\n  a-b: {loss: 150%}\n", 4, "loss"),
    ("defaults: {delay: 1}\nnodes: {a: , b: }\nunderlay:\n  a-b: {rate: 0}\n", 4, "rate"),
    ("defaults: {delay: -3ms}\nnodes: {a: , b: }\n", 1, "bad delay"),
    ("defaults: {delay: 1}\nnodes:\n  a: {address: 10.0.0.300}\n  b:\n", 3, "bad address"),
    (
        "defaults: {delay: 1}\nnodes:\n  a: {address: 10.0.0.1}\n  b: {address: 10.0.0.1}\n",
        4,
        "duplicate address",
    ),
    ("defaults: {delay: 1}\nnodes:\n  a: {lat: 91, lon: 0}\n  b:\n", 3, "out of range"),
    ("defaults: {delay: 1}\nnodes:\n  a: {lat: 1, lon: 200}\n  b:\n", 3, "out of range"),
    ("defaults: {delay: 1}\nnodes:\n  a: {lat: north}\n  b:\n", 3, "must be a number"),
    ("defaults: {delay: 1}\nnodes: {}\n", 2, "at least 2 nodes"),
    ("defaults: {delay: 1}\nnodes:\n", 2, "no nodes"),
    ("defaults: {delay: 1}\nnodes:\n  a:\n", 3, "at least 2 nodes"),
    ("defaults: {delay: 1}\n", 1, "missing 'nodes'"),
    ("defaults: {delay: 1}\nnodes:\n  a-: {}\n", 3, "bad node name"),
    ("defaults: {delay: 1}\nnodes:\n  _a: {}\n", 3, "bad node name"),
    ("defaults: {delay: 1}\nnodes:\n  a: fast\n  b:\n", 3, "must be a mapping"),
    ("defaults: {delay: 1}\nnodes: [a, b]\n", 2, "must be a mapping"),
    ("- a\n- b\n", 1, "must be a mapping"),
    ("nodes: {a: , b: }\n", 1, "no delay for a->b"),
    ("defaults: {delay: 1}\nnodes: {a: , b: }\ntunnels: [a->b]\n", 3, "two-way"),
    ("defaults: {delay: 1}\nnodes: {a: , b: }\ntunnels: [a-b, b-a]\n", 3, "duplicate tunnel"),
    ("defaults: {delay: 1}\nnodes: {a: , b: }\ntunnels:\n  - a-c\n", 4, "unknown node"),
    ("defaults: {delay: 1}\nnodes: {a: , b: }\ntunnels: some\n", 3, "tunnels must be"),
    ("defaults: {delay: 1}\nnodes: {a: , b: }\ngeo_delay: yes please\n", 3, "true or false"),
    ("defaults: 10ms\nnodes: {a: , b: }\n", 1, "must be a mapping"),
    ("defaults: {delay: 1}\nnodes: {a: , b: }\nnodes: {c: }\n", 3, "duplicate key"),
    ("defaults: {delay: [1, 2]}\nnodes: {a: , b: }\n", 1, "single value"),
    ("defaults: {delay: 1}\nnodes: [a, b\n", 3, "YAML"),
    ("defaults: {delay: 1}\nnodes:\n\t a: {}\n", 3, "YAML"),
    ("defaults: {delay: 1}\n  nodes: {a: , b: }\n", 2, "YAML"),
    ("defaults: {delay: !!python/name:os.system }\nnodes: {a: , b: }\n", 1, "bad delay"),
    ("---\nnodes: {}\n---\nnodes: {}\n", 3, "YAML"),
    ("name: [x]\nnodes: {a: , b: }\n", 1, "name must be text"),
]


@pytest.mark.parametrize(("text", "line", "fragment"), ERRORS)
def test_errors_name_file_and_line(tmp_path: Path, text: str, line: int, fragment: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(TopologyError) as info:
        load_topology(str(path))
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: "), message
    assert fragment in message
    assert "\n" not in message
    assert info.value.source == str(path) and info.value.line == line


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"", "empty file"),
        (b"# only a comment\n", "empty file"),
        (b"nodes:\n  \xff: {}\n", "UTF-8"),
    ],
)
def test_file_level_errors(tmp_path: Path, data: bytes, fragment: str) -> None:
    path = tmp_path / "odd.yaml"
    path.write_bytes(data)
    with pytest.raises(TopologyError, match=fragment) as info:
        load_topology(str(path))
    assert str(path) in str(info.value)


def test_lone_surrogate_in_text() -> None:
    with pytest.raises(TopologyError, match="Unicode"):
        parse_yaml("nodes: {a: , \ud800: }")


def test_not_utf8_reports_the_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("defaults: {delay: 1}\nnodes:\n  z\xfcrich: {}\n".encode("latin-1"))
    with pytest.raises(TopologyError) as info:
        load_topology(str(path))
    assert info.value.line == 3


# --- round trips -----------------------------------------------------------------------


def assert_same(a: Topology, b: Topology) -> None:
    assert a.name == b.name
    assert a.nodes == b.nodes
    for m in ("delay_ms", "jitter_ms", "loss", "rate_mbit", "tunnels"):
        assert np.array_equal(getattr(a, m), getattr(b, m)), m


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_round_trip(tmp_path: Path, path: Path) -> None:
    topo = load_topology(str(path))
    out = tmp_path / "again.yaml"
    save_topology(topo, out)
    assert_same(topo, load_topology(str(out)))


@pytest.mark.parametrize(
    "topo",
    [
        generators.geo_mesh(25, seed=4),
        generators.ring(6, 3.3, tunnels="ring"),
        generators.hub_and_spoke(5, spread=0.3, seed=1),
        generators.two_regions(7, gateways=2),
    ],
    ids=["geo", "ring", "hub", "two-regions"],
)
def test_generated_round_trip(tmp_path: Path, topo: Topology) -> None:
    out = tmp_path / "gen.yaml"
    save_topology(topo, out)
    assert_same(topo, load_topology(str(out)))


def test_random_matrices_round_trip() -> None:
    rng = np.random.default_rng(7)
    n = 6
    topo = generators.ring(n)
    topo.delay_ms = rng.uniform(0, 100, (n, n))
    topo.jitter_ms = np.round(rng.uniform(0, 3, (n, n)), 1)
    topo.loss = rng.choice([0.0, 0.001, 1 / 3, 0.07, 1.0], (n, n))
    topo.rate_mbit = rng.choice([math.inf, 10.0, 1e-3, 123.456], (n, n))
    topo.tunnels = rng.random((n, n)) < 0.5
    topo.tunnels |= topo.tunnels.T
    for m in (topo.delay_ms, topo.jitter_ms, topo.loss):
        np.fill_diagonal(m, 0.0)
    np.fill_diagonal(topo.rate_mbit, math.inf)
    np.fill_diagonal(topo.tunnels, False)
    assert_same(topo, parse_yaml(dump_yaml(topo)))


def test_saved_file_is_readable() -> None:
    text = dump_yaml(load_topology(str(EXAMPLES / "triangle.yaml")))
    assert "a-b: {delay: 40ms}" in text
    assert "tunnels: full" in text


def test_save_rejects_other_extensions(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match="YAML"):
        save_topology(generators.ring(3), tmp_path / "x.json")


def test_save_rejects_unsaveable_names(tmp_path: Path) -> None:
    topo = generators.ring(3)
    topo.nodes[0] = Node("bad name")
    with pytest.raises(TopologyError, match="bad name"):
        save_topology(topo, tmp_path / "x.yaml")


# --- fuzzing ---------------------------------------------------------------------------

VALID = (EXAMPLES / "europe.yaml").read_text(encoding="utf-8")
NOISE = st.sampled_from([*":-{}[],>#&*!|'\"\n\t %.0123456789abcxyz", "ms", "- ", "->"])


def parse_or_reject(data: str | bytes) -> None:
    try:
        topo = parse_yaml(data, source="fuzz.yaml")
    except TopologyError as e:
        assert str(e).startswith("fuzz.yaml")
        assert "\n" not in str(e)
        return
    assert topo.n >= 2
    assert np.all(np.isfinite(topo.delay_ms)) and np.all(topo.delay_ms >= 0)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_random_bytes(data: bytes) -> None:
    parse_or_reject(data)


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=200))
def test_fuzz_random_text(text: str) -> None:
    parse_or_reject(text)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(VALID)), st.integers(0, 3), NOISE), max_size=4))
def test_fuzz_mutations_of_a_valid_file(edits: list[tuple[int, int, str]]) -> None:
    text = VALID
    for pos, cut, insert in edits:
        pos = min(pos, len(text))
        text = text[:pos] + insert + text[pos + cut :]
    parse_or_reject(text)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_fuzz_through_load_topology(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.yaml"
        path.write_bytes(data)
        try:
            load_topology(str(path))
        except TopologyError as e:
            assert str(path) in str(e)
