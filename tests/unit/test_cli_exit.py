"""What a person meets at the command line: exit codes, host-style names, offline pictures,
rounded files, fast help without the heavy imports, shell completion, missing extras."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import click
import pytest

from meshopt.cli.main import COMMANDS, EPILOG, load_command, main

TOPOLOGIES = Path(__file__).parents[2] / "topologies"
TRIANGLE = str(TOPOLOGIES / "triangle.yaml")
MESHOPT = str(Path(sys.executable).with_name("meshopt"))
HEAVY = ("numpy", "scipy", "networkx", "matplotlib", "rich", "aiomqtt", "yaml")

# Two islands: {fra-1, ams-2} and {lon.uk, par_3}: no tunnel joins them.
PARTITIONED = """\
name: islands
defaults: {delay: 5ms}
nodes: {fra-1: , ams-2: , lon.uk: , par_3: }
tunnels: [fra-1-ams-2, lon.uk-par_3]
"""
# Host names with dashes; fra-1-ams-2 relays through lon-3.
HOSTS = """\
name: hosts
defaults: {delay: 10ms}
nodes: {fra-1: , ams-2: , lon-3: }
underlay:
  fra-1-ams-2: {delay: 40ms}
"""


def meshopt(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=60, check=False, env=env, cwd="/"
    )


# --- exit codes ----------------------------------------------------------------------


def test_exit_codes_are_in_the_top_level_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = meshopt(capsys, "--help")
    assert code == 0
    flat = " ".join(out.split())
    assert "Exit codes: 0 ok; 1 a negative answer" in flat
    assert "2 bad input" in flat and "3 broker or lab unavailable" in flat
    assert "_MESHOPT_COMPLETE=bash_source meshopt" in EPILOG


def test_path_to_the_same_node_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = meshopt(capsys, "path", TRIANGLE, "a", "a")
    assert code == 2 and out == ""
    assert (
        err == "meshopt: error: A and B are the same node (a): a path joins two different nodes\n"
    )
    assert "unreachable" not in err
    # the live form refuses it the same way, before reaching for a broker
    code, _, err = meshopt(capsys, "path", "a", "a", "--broker", "mqtt://127.0.0.1:9")
    assert code == 2 and "same node" in err


def test_unreachable_pair_is_a_negative_answer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    topo = write(tmp_path, "islands.yaml", PARTITIONED)
    code, out, err = meshopt(capsys, "path", topo, "fra-1", "lon.uk")
    assert (code, err) == (1, "")
    assert "fra-1 → lon.uk: unreachable" in out
    code, out, _ = meshopt(capsys, "path", topo, "fra-1", "lon.uk", "--json")
    d = json.loads(out)
    assert code == 1 and d["reachable"] is False and d["path"] == ["fra-1"]
    assert d["problem"] == "no path from fra-1 to lon.uk" and d["rtt_ms"] is None
    code, out, _ = meshopt(capsys, "path", topo, "fra-1", "ams-2")
    assert code == 0 and "path: fra-1 → ams-2 (direct tunnel)" in out


def test_routes_with_unreachable_pairs_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    topo = write(tmp_path, "islands.yaml", PARTITIONED)
    code, out, _ = meshopt(capsys, "routes", topo, "--json")
    d = json.loads(out)
    assert code == 1
    assert ["fra-1", "lon.uk"] in d["unreachable"] and len(d["unreachable"]) == 8
    ams = {r["dst"]: r for r in d["nodes"]["fra-1"]["routes"]}
    assert ams["ams-2"]["reachable"] and not ams["par_3"]["reachable"]
    assert ams["par_3"]["next_hop"] is None and ams["par_3"]["path"] == []
    code, out, _ = meshopt(capsys, "routes", topo, "--node", "fra-1")
    assert code == 1 and "unreachable" in out
    assert meshopt(capsys, "routes", TRIANGLE)[0] == 0


def test_partitioned_mesh_fails_topology_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    topo = write(tmp_path, "islands.yaml", PARTITIONED)
    code, out, err = meshopt(capsys, "topology", "check", topo)
    assert code == 1 and "islands: 4 nodes, 2 tunnels" in out
    assert err == (
        "partitioned: 2 components that cannot reach each other: "
        "{fra-1, ams-2} (2 nodes) | {lon.uk, par_3} (2 nodes)\n"
    )
    code, out, _ = meshopt(capsys, "topology", "check", topo, "--json")
    d = json.loads(out)
    assert code == 1 and d["connected"] is False
    assert d["components"] == [["fra-1", "ams-2"], ["lon.uk", "par_3"]]
    code, out, _ = meshopt(capsys, "topology", "check", TRIANGLE, "--json")
    assert code == 0 and json.loads(out)["components"] == [["a", "b", "c"]]


def test_broker_unavailable_is_exit_3(capsys: pytest.CaptureFixture[str]) -> None:
    # port 9 (discard) on loopback: nothing listens there on this machine
    code, _, err = meshopt(capsys, "routes", "--broker", "mqtt://127.0.0.1:9", "--timeout", "2")
    assert code == 3 and err.startswith("meshopt: error: cannot read the broker")


def test_lab_not_running_is_exit_3(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = meshopt(capsys, "routes", "--lab", "no-such-lab-h1")
    assert code == 3 and "no lab named 'no-such-lab-h1'" in err


# --- host names end to end -------------------------------------------------------------


def test_hyphenated_names_in_path_routes_and_sim(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    topo = write(tmp_path, "hosts.yaml", HOSTS)
    code, out, _ = meshopt(capsys, "path", topo, "fra-1", "ams-2")
    assert code == 0 and "path: fra-1 → lon-3 → ams-2 via lon-3" in out
    csv = write(
        tmp_path, "m.csv", "a,b,rtt_ms\nnode-0,node-1,10\nnode-1,node-2,10\nnode-0,node-2,50\n"
    )
    code, out, _ = meshopt(capsys, "path", csv, "node-0", "node-2", "--json")
    assert code == 0 and json.loads(out)["path"] == ["node-0", "node-1", "node-2"]
    code, out, err = meshopt(
        capsys, "sim", topo, "--duration", "20s", "--event", "at=5s link=fra-1-lon-3 down",
        "--json",
    )  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["events"][0]["event"] == "at=5s link=fra-1-lon-3 down"
    code, _, err = meshopt(
        capsys, "sim", topo, "--duration", "20s", "--event", "at=5s link=fra-1-lon-4 down"
    )
    assert code == 2 and "unknown node 'lon-4' (did you mean lon-3?)" in err


# --- offline graph, rounded convert ------------------------------------------------------


def test_graph_offline_draws_the_relay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.svg"
    code, text, err = meshopt(capsys, "graph", TRIANGLE, "--out", str(out))
    assert code == 0, err
    assert text == f"picture written to {out}: 3 nodes, relay paths: a → c → b\n"
    ids = {e.attrib.get("id") for e in ET.parse(out).getroot().iter()}
    assert {"relay-a-c", "relay-c-b", "bypassed-a-b", "node-a"} <= ids
    code, text, _ = meshopt(capsys, "graph", TRIANGLE, "--out", str(out), "--json")
    d = json.loads(text)
    assert d["source"] == "offline" and d["relay_paths"] == [["a", "c", "b"]]
    assert {(t["a"], t["b"], t["rtt_ms"]) for t in d["tunnels"]} == {
        ("a", "b", 80.0),
        ("a", "c", 20.0),
        ("b", "c", 20.0),
    }
    code, _, err = meshopt(capsys, "graph", TRIANGLE, "--out", str(tmp_path / "x.pdf"))
    assert code == 2 and "pictures are .png or .svg, not .pdf" in err


def test_convert_writes_rounded_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "geo.yaml"
    code, _, _ = meshopt(capsys, "topology", "convert", "gen:geo:n=6,seed=3", str(out))
    assert code == 0
    text = out.read_text()
    delays = [w for w in text.replace("}", " ").replace(",", " ").split() if w.endswith("ms")]
    assert delays and all(len(d.removesuffix("ms").partition(".")[2]) <= 3 for d in delays)
    exact = tmp_path / "exact.yaml"
    assert (
        meshopt(capsys, "topology", "convert", "gen:geo:n=6,seed=3", str(exact), "--exact")[0] == 0
    )
    assert any(len(w.partition(".")[2]) > 6 for w in exact.read_text().split() if "ms" in w)
    # the rounded file still loads and differs from the exact one by < 1 microsecond
    code, a, _ = meshopt(capsys, "topology", "check", str(out), "--json")
    code, b, _ = meshopt(capsys, "topology", "check", str(exact), "--json")
    ra, rb = json.loads(a)["rtt_ms"], json.loads(b)["rtt_ms"]
    assert ra["max"] == pytest.approx(rb["max"], abs=2e-3)


# --- keys, numbers, help texts -------------------------------------------------------------


def test_controller_keygen_makes_the_missing_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = tmp_path / "etc" / "meshopt" / "controller.key"
    code, out, err = meshopt(capsys, "controller", "keygen", "--out", str(key))
    assert code == 0, err
    assert len(out.strip()) == 44 and key.is_file()
    assert stat.S_IMODE(key.parent.stat().st_mode) == 0o700
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, _, err = meshopt(capsys, "controller", "keygen", "--out", str(blocker / "k.key"))
    assert (
        code == 2
        and err == f"meshopt: error: cannot write {blocker}/k.key: {blocker} is not a directory\n"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ("sim", TRIANGLE, "--seed", "-1"),
        ("gains", TRIANGLE, "--top", "-3"),
        ("topology", "convert", TRIANGLE, "x.yaml", "--seed", "-1"),
        ("bench", "convergence", "--runs", "0"),
        ("bench", "convergence", "--stability-s", "-1"),
        ("transfer", "send", TRIANGLE, "10.0.0.1", "--port", "0"),
        ("transfer", "send", TRIANGLE, "10.0.0.1", "--link-mbit", "-1"),
        ("routes", TRIANGLE, "--max-nodes", "0"),
    ],
)
def test_numbers_out_of_range_are_usage_errors(
    argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = meshopt(capsys, *argv)
    assert code == 2 and "Invalid value for" in err and "range" in err


def test_bench_help_has_no_double_percent(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = meshopt(capsys, "bench", "convergence", "--help")
    assert code == 0 and "+/-20% jitter" in out and "%%" not in out


@pytest.mark.parametrize("sub", ["send", "serve"])
def test_every_transfer_option_has_help(sub: str) -> None:
    group = load_command("transfer")
    assert isinstance(group, click.Group)
    command = group.commands[sub]
    bare = [p.name for p in command.params if isinstance(p, click.Option) and not p.help]
    assert bare == []
    if sub == "send":
        assert [a.metavar for a in command.params if isinstance(a, click.Argument)] == [
            None,
            "NODE[:DIR]",
        ]


# --- registry, fast help, completion, extras ----------------------------------------------


def test_registry_short_help_matches_real_commands() -> None:
    for name, entry in COMMANDS.items():
        command = load_command(name)
        assert command.name == name
        assert entry.short_help and len(entry.short_help) <= 60, name


def test_top_level_help_imports_nothing_heavy() -> None:
    """--help lists every command from the registry: no subcommand module, no numpy."""
    code = (
        "import sys\nfrom meshopt.cli.main import main\nrc = main(['--help'])\n"
        f"print(rc, [m for m in {HEAVY!r} if m in sys.modules], "
        "[m for m in sys.modules if m.startswith('meshopt.cli.') and m != 'meshopt.cli.main'])"
    )
    proc = run(sys.executable, "-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "0 [] []"


def test_offline_path_does_not_import_the_broker_client_or_rich() -> None:
    code = (
        "import sys\nfrom meshopt.cli.main import main\n"
        f"rc = main(['path', {TRIANGLE!r}, 'a', 'b'])\n"
        "print(rc, [m for m in ('aiomqtt', 'rich', 'matplotlib') if m in sys.modules])"
    )
    proc = run(sys.executable, "-c", code)
    assert proc.stdout.strip().splitlines()[-1] == "0 []", proc.stderr


def test_bash_completion_script_and_answers() -> None:
    env = {**os.environ, "_MESHOPT_COMPLETE": "bash_source"}
    script = run(MESHOPT, env=env)
    assert script.returncode == 0
    assert "_meshopt_completion()" in script.stdout
    assert "complete -o nosort -F _meshopt_completion meshopt" in script.stdout
    env = {**os.environ, "_MESHOPT_COMPLETE": "bash_complete", "COMP_WORDS": "meshopt ro",
           "COMP_CWORD": "1"}  # fmt: skip
    answer = run(MESHOPT, env=env)
    assert answer.stdout.split() == ["plain,routes"]
    env["COMP_WORDS"], env["COMP_CWORD"] = "meshopt topology c", "2"
    assert run(MESHOPT, env=env).stdout.split() == ["plain,check", "plain,convert"]


@pytest.mark.parametrize(
    ("blocked", "argv", "line"),
    [
        (
            "numpy",
            ["routes", TRIANGLE],
            "meshopt: error: 'meshopt routes' needs the controller extra: "
            "pip install 'meshopt-wg[controller]'",
        ),
        (
            "scipy",  # more nodes than the numpy path takes
            ["path", "gen:geo:n=150,seed=1", "ash1", "tyo1"],
            "meshopt: error: 'meshopt path' needs the controller extra: "
            "pip install 'meshopt-wg[controller]'",
        ),
        (
            "matplotlib",
            ["graph", TRIANGLE, "--out", "/tmp/never-written-h1.svg"],
            "meshopt: error: 'meshopt graph' needs the graph extra: "
            "pip install 'meshopt-wg[graph]'",
        ),
    ],
)
def test_missing_extra_is_one_line(blocked: str, argv: list[str], line: str) -> None:
    """An install without the extra: the module cannot be imported (None in sys.modules)."""
    code = (
        f"import sys\nsys.modules[{blocked!r}] = None\n"
        f"from meshopt.cli.main import main\nsys.exit(main({argv!r}))"
    )
    proc = run(sys.executable, "-c", code)
    assert (proc.returncode, proc.stderr, proc.stdout) == (2, line + "\n", "")


TINY_GRAPHML = """<?xml version="1.0" encoding="UTF-8"?>
<graphml xmlns="http://graphml.graphdrawing.org/xmlns">
  <key id="lat" for="node" attr.name="Latitude" attr.type="double"/>
  <key id="lon" for="node" attr.name="Longitude" attr.type="double"/>
  <key id="lbl" for="node" attr.name="label" attr.type="string"/>
  <graph edgedefault="undirected">
    <node id="n0">
      <data key="lbl">fra</data><data key="lat">50.1</data><data key="lon">8.7</data>
    </node>
    <node id="n1">
      <data key="lbl">ams</data><data key="lat">52.4</data><data key="lon">4.9</data>
    </node>
    <node id="n2">
      <data key="lbl">par</data><data key="lat">48.9</data><data key="lon">2.35</data>
    </node>
    <edge source="n0" target="n1"/><edge source="n1" target="n2"/>
  </graph>
</graphml>
"""


def test_graphml_without_networkx_is_one_line(tmp_path: Path) -> None:
    """Small meshes route without networkx; reading GraphML still needs it."""
    f = tmp_path / "tiny.graphml"
    f.write_text(TINY_GRAPHML)
    code = (
        "import sys\nsys.modules['networkx'] = None\nfrom meshopt.cli.main import main\n"
        f"sys.exit(main(['path', {str(f)!r}, 'fra', 'par']))"
    )
    proc = run(sys.executable, "-c", code)
    line = (
        "meshopt: error: 'meshopt path' needs the controller extra: "
        "pip install 'meshopt-wg[controller]'\n"
    )
    assert (proc.returncode, proc.stderr, proc.stdout) == (2, line, "")


def test_help_still_works_without_the_extras() -> None:
    code = (
        "import sys\nfor m in ('numpy', 'scipy', 'networkx', 'matplotlib'):\n"
        "    sys.modules[m] = None\n"
        "from meshopt.cli.main import main\n"
        "for argv in (['--help'], ['routes', '--help'], ['path', '--help'], ['graph', '--help']):\n"
        "    assert main(argv) == 0, argv\n"
    )
    proc = run(sys.executable, "-c", code)
    assert proc.returncode == 0, proc.stderr


def _keys(d: Any) -> Any:
    return sorted(d) if isinstance(d, dict) else None


def test_ambiguous_sim_link_is_refused_with_both_readings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    topo = write(
        tmp_path, "amb.yaml", "defaults: {delay: 5ms}\nnodes: {fra: , fra-1: , ams: , 1-ams: }\n"
    )
    code, _, err = meshopt(
        capsys, "sim", topo, "--duration", "10s", "--event", "at=5s link=fra-1-ams down"
    )
    assert code == 2
    assert "ambiguous link 'fra-1-ams': it splits into known nodes as 'fra - 1-ams' or " in err
    code, out, err = meshopt(
        capsys, "sim", topo, "--duration", "10s", "--event", "at=5s link='fra-1 - ams' down",
        "--json",
    )  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["events"][0]["broken_pairs"] >= 1


def test_colour_only_styles_and_never_shifts_columns() -> None:
    """On a terminal a relayed next hop is bold yellow; without ANSI codes the text is
    exactly the plain table (pipes and files get the plain one)."""
    import io
    import re

    from meshopt.analysis import node_routes, plan
    from meshopt.cli.render import Out, render_routes
    from meshopt.topology import load_topology

    entries = node_routes(plan(load_topology(TRIANGLE)), "a")
    plain, coloured = io.StringIO(), io.StringIO()
    for stream, colour in ((plain, False), (coloured, True)):
        out = Out(stream, color=colour)
        render_routes(out, "a", entries)
        out.flush()
    assert "\x1b[1;33mc\x1b[0m" in coloured.getvalue() and "\x1b" not in plain.getvalue()
    assert re.sub(r"\x1b\[[0-9;]*m", "", coloured.getvalue()) == plain.getvalue()
    rows = plain.getvalue().splitlines()
    assert rows[1].split() == ["destination", "next", "hop", "backup", "RTT", "direct", "path"]
    assert rows[3].split() == ["b", "c", "b", "40.0", "ms", "80.0", "ms", "a", "→", "c", "→", "b"]


def test_bench_cli_script_reports_goals() -> None:
    script = Path(__file__).parents[2] / "scripts" / "bench_cli.py"
    proc = run(sys.executable, str(script), "--runs", "1", "--nodes", "6")
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert set(d["cases"]) == {"help", "routes", "routes_json", "path", "path_json"}
    assert d["cases"]["help"]["goal_s"] == 0.3 and d["cases"]["routes"]["goal_s"] == 0.6
    assert all(c["median_s"] > 0 and isinstance(c["pass"], bool) for c in d["cases"].values())
