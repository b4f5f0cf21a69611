"""The ``meshopt`` command on small topologies: output, JSON, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from meshopt.cli.main import main
from meshopt.metric import Metric

TOPOLOGIES = Path(__file__).parents[2] / "topologies"
TRIANGLE = str(TOPOLOGIES / "triangle.yaml")


def meshopt(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def meshopt_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    code, out, err = meshopt(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


# --- path --------------------------------------------------------------------------------


def test_path_relayed(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = meshopt(capsys, "path", TRIANGLE, "a", "b")
    assert code == 0 and err == ""
    assert "path: a → c → b via c" in out
    assert "total RTT 40.0 ms" in out
    assert "direct tunnel: RTT 80.0 ms" in out and "relaying saves 40.0 ms (50%)" in out


def test_path_direct(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = meshopt(capsys, "path", TRIANGLE, "a", "c")
    assert code == 0
    assert "path: a → c (direct tunnel)" in out
    assert "the direct tunnel is the best path" in out


def test_path_json(capsys: pytest.CaptureFixture[str]) -> None:
    d = meshopt_json(capsys, "path", TRIANGLE, "a", "b")
    assert [(h["src"], h["dst"]) for h in d["hops"]] == [("a", "c"), ("c", "b")]
    assert [h["rtt_ms"] for h in d["hops"]] == [20.0, 20.0]
    assert d["relays"] == ["c"]
    assert d["rtt_ms"] == 40.0 and d["direct_rtt_ms"] == 80.0 and d["gain_ms"] == 40.0
    # metric cost: both hops' costs (RTT + 2 x jitter) plus one relay hop, priced as the
    # controller prices it (not the fixed 2 ms these commands used before)
    hop = Metric().relay_hop_ms
    assert d["cost_ms"] == pytest.approx(sum(h["cost_ms"] for h in d["hops"]) + hop)
    assert d["direct_cost_ms"] > d["cost_ms"]


def test_path_relay_cost_can_make_direct_win(capsys: pytest.CaptureFixture[str]) -> None:
    """Relaying saves 40 ms of RTT; a relay hop priced at 50 ms makes it lose."""
    d = meshopt_json(capsys, "path", TRIANGLE, "a", "b", "--relay-cost", "50ms")
    assert d["relays"] == [] and d["rtt_ms"] == 80.0


# --- routes ------------------------------------------------------------------------------


def test_routes_json_one_node(capsys: pytest.CaptureFixture[str]) -> None:
    d = meshopt_json(capsys, "routes", TRIANGLE, "--node", "a")
    assert d["schema"] == "meshopt.routes/1" and d["source"] == "offline"
    assert d["mesh"] == "triangle" and d["unreachable"] == []
    assert list(d["nodes"]) == ["a"]
    entries = {e["dst"]: e for e in d["nodes"]["a"]["routes"]}
    assert set(entries) == {"b", "c"}
    assert entries["b"]["next_hop"] == "c" and entries["b"]["path"] == ["a", "c", "b"]
    assert entries["b"]["rtt_ms"] == 40.0 and entries["b"]["direct_rtt_ms"] == 80.0
    assert entries["b"]["backup"] == "b"  # the direct tunnel protects against c failing
    assert entries["c"]["next_hop"] == "c" and entries["c"]["path"] == ["a", "c"]


def test_routes_table_for_every_node(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = meshopt(capsys, "routes", TRIANGLE)
    assert code == 0
    for node in "abc":
        assert f"routes of {node}" in out


def test_routes_symmetric_mode_reverses_paths(capsys: pytest.CaptureFixture[str]) -> None:
    d = meshopt_json(capsys, "routes", TRIANGLE, "--symmetric")
    ab = next(e for e in d["nodes"]["a"]["routes"] if e["dst"] == "b")
    ba = next(e for e in d["nodes"]["b"]["routes"] if e["dst"] == "a")
    assert ba["path"] == list(reversed(ab["path"])) == ["b", "c", "a"]


# --- gains -------------------------------------------------------------------------------


def test_gains_json(capsys: pytest.CaptureFixture[str]) -> None:
    d = meshopt_json(capsys, "gains", TRIANGLE)
    assert (d["pairs"], d["relayed"], d["improved"]) == (3, 1, 1)
    (top,) = d["top"]
    assert (top["a"], top["b"], top["path"]) == ("a", "b", ["a", "c", "b"])
    assert (top["direct_ms"], top["routed_ms"], top["gain_ms"]) == (80.0, 40.0, 40.0)


def test_gains_text(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = meshopt(capsys, "gains", str(TOPOLOGIES / "europe.yaml"), "--top", "2")
    assert code == 0
    # One pair relays for a lower jitter, not a lower RTT: at the controller's relay-hop
    # price (0.1 ms) its gain counts; at the old fixed 2 ms it did not.
    assert "45 pairs, 5 relayed, 4 faster than their direct tunnel" in out
    assert "lon ↔ ath" in out and "mad ↔ sto" not in out  # only the top 2 rows


# --- sim ---------------------------------------------------------------------------------


def test_sim_json(capsys: pytest.CaptureFixture[str]) -> None:
    d = meshopt_json(
        capsys, "sim", TRIANGLE, "--duration", "60s", "--event", "at=30.5s node=c down"
    )
    assert (d["nodes"], d["pairs"], d["duration_s"]) == (3, 3, 60.0)
    assert d["gains"]["improved"] == 1 and d["gains"]["top"][0]["path"] == ["a", "c", "b"]
    # The agents boot at 2-3 s; first routes after their first telemetry and warm-up.
    assert 3.0 < d["initial_converge_s"] < 8.0
    (ev,) = d["events"]
    assert ev["event"] == "at=30.5s node=c down" and ev["at_s"] == 30.5
    assert ev["broken_pairs"] == 2  # a->b and b->a relayed via c
    # c is declared dead 0.8 s after its last reply (0.33 s probes); the agents fail
    # over to their backup (the direct tunnel) without waiting for the controller.
    assert 0.8 - 0.33 <= ev["outage_s"] <= 0.9
    assert d["failovers"] >= 2


def test_sim_text_report(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = meshopt(
        capsys, "sim", TRIANGLE, "--duration", "40s", "--event", "at=20s link=a-c delay=60ms"
    )
    assert code == 0 and err == ""  # no progress bar when stderr is not a terminal
    assert out.startswith("meshopt sim triangle: 3 nodes, 3 pairs, 40 s simulated")
    assert "initial convergence: " in out and "initial convergence: not" not in out
    assert "Events" in out and "at=20s" in out
    assert "route changes:" in out


def test_sim_text_says_what_is_left_when_not_converged(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = meshopt(capsys, "sim", TRIANGLE, "--duration", "0.75s")
    assert code == 0
    assert "initial convergence: not within 0.75 s (2 of 6 routes still outside" in out


def test_sim_progress_bar_on_a_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich: treat stderr as a terminal
    code, out, err = meshopt(capsys, "sim", "gen:ring:n=5", "--duration", "30s", "--json")
    assert code == 0
    assert "simulating" in err and "100%" in err
    assert json.loads(out)["nodes"] == 5  # stdout stays clean JSON


def test_sim_no_policy_flaps_more(capsys: pytest.CaptureFixture[str]) -> None:
    # Two equal paths with jitter (see test_sim): the policy is what keeps them still.
    path = str(TOPOLOGIES / "europe.yaml")
    with_policy = meshopt_json(capsys, "sim", path, "--duration", "120s")
    without = meshopt_json(capsys, "sim", path, "--duration", "120s", "--no-policy")
    assert without["route_changes"] > with_policy["route_changes"]


def test_sim_no_budget_probes_every_link_fast(capsys: pytest.CaptureFixture[str]) -> None:
    """--no-budget: the agents' probe.budget = false. A direct link without traffic found
    dead 40 s after the start: 4.84 s with the budget (idle), 0.8 s without."""
    args = ("sim", TRIANGLE, "--duration", "60s", "--probe-interval", "330ms")
    event = ("--event", "at=45.5s link=a-c down")  # c->a is c's direct link: idle
    budget = meshopt_json(capsys, *args, *event)
    plain = meshopt_json(capsys, *args, *event, "--no-budget")
    assert plain["perf"]["probes_sent"] > budget["perf"]["probes_sent"]
    assert 0.8 - 0.33 <= plain["events"][0]["outage_s"] <= 0.9
    assert 4.84 - 2.0 <= budget["events"][0]["outage_s"] <= 4.94


def test_sim_tunnel_is_paid_per_tunnel(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """a-b direct 40 ms, via c 38 ms: relayed once the small gain is confirmed; with
    1.5 ms per tunnel the relay's two tunnels cost 41.1 ms against 41.5 ms direct, a gain
    below the confirm margin, so a-b stays direct."""
    topo = tmp_path / "near.yaml"
    topo.write_text(
        "name: near\ndefaults: {delay: 9.5ms, jitter: 0.2ms}\n"
        "nodes: {a: {}, b: {}, c: {}}\nunderlay:\n  a-b: {delay: 20ms}\n"
    )
    args = ("sim", str(topo), "--duration", "60s", "--symmetric")
    plain = meshopt_json(capsys, *args)
    slow = meshopt_json(capsys, *args, "--tunnel", "1.5ms", "--tunnel-jitter", "0.1ms")
    assert plain["gains"]["relayed"] == 1 and slow["gains"]["relayed"] == 0


# --- topology check ------------------------------------------------------------------------


def test_topology_check(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = meshopt(capsys, "topology", "check", TRIANGLE)
    assert code == 0
    assert out.strip() == (
        "triangle: 3 nodes, 3 tunnels, RTT 20.0/20.0/80.0 ms (min/median/max), "
        "0 lossy and 0 rate-limited pairs"
    )


def test_topology_check_json(capsys: pytest.CaptureFixture[str]) -> None:
    d = meshopt_json(capsys, "topology", "check", str(TOPOLOGIES / "hub.yaml"))
    assert d["nodes"] == 5 and d["tunnels"] == 4
    assert d["lossy_pairs"] == 1 and d["rate_limited_pairs"] == 1
    assert d["rtt_ms"]["min"] == 16.0 and d["rtt_ms"]["max"] == 50.0


# --- bad input: one line, exit status 2, no traceback ---------------------------------------


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["path", "missing.yaml", "a", "b"], "missing.yaml: no such file"),
        (["routes", "missing.yaml"], "missing.yaml: no such file"),
        (["gains", "missing.yaml"], "missing.yaml: no such file"),
        (["sim", "missing.yaml"], "missing.yaml: no such file"),
        (["topology", "check", "missing.yaml"], "missing.yaml: no such file"),
        (["path", TRIANGLE, "a", "zz"], "unknown node 'zz'"),
        (["path", TRIANGLE, "qq", "b"], "unknown node 'qq'"),
        (["routes", TRIANGLE, "--node", "zz"], "unknown node 'zz'"),
        (["sim", TRIANGLE, "--event", "at=1s link=a-b colour=red"], "unknown key 'colour'"),
        (["sim", TRIANGLE, "--event", "link=a-b delay=5ms"], "missing at=TIME"),
        (["sim", TRIANGLE, "--event", "at=1s node=c sideways"], "expected key=value"),
        (["sim", TRIANGLE, "--event", "at=1s node=zz down"], "unknown node 'zz'"),
        (["sim", TRIANGLE, "--event", "at=5m node=c down"], "not before the end"),
        (["sim", TRIANGLE, "--duration", "soon"], "bad --duration"),
        (["sim", TRIANGLE, "--duration", "0s"], "must be > 0"),
        (["sim", TRIANGLE, "--tunnel", "-1ms"], "bad --tunnel"),
        (["sim", TRIANGLE, "--tunnel-jitter", "lots"], "bad --tunnel-jitter"),
        (["sim", TRIANGLE, "--tunnel-spread", "-2ms"], "bad --tunnel-spread"),
        (["sim", TRIANGLE, "--late-probes", "3%"], "like '3%/1.5ms'"),
        (["sim", TRIANGLE, "--late-probes", "300%/1ms"], "bad --late-probes"),
        (["sim", TRIANGLE, "--late-probes", "3%/0ms"], "mean delay must be > 0"),
        (["path", TRIANGLE, "a", "b", "--relay-cost", "cheap"], "bad --relay-cost"),
        (["gains", "gen:geo:n=1"], "n must be 2..5000"),
        (["gains", "gen:nosuch"], "gen:nosuch"),
    ],
)
def test_bad_input_is_one_line_with_status_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    code, out, err = meshopt(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("meshopt: error: ")
    assert says in err
    assert "Traceback" not in err


def test_bad_topology_file_names_file_and_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nnodes:\n  a: {}\n  b: {}\ndefaults:\n  delay: 8x0ms\n")
    for argv in (["topology", "check", str(bad)], ["sim", str(bad)], ["path", str(bad), "a", "b"]):
        code, out, err = meshopt(capsys, *argv)
        assert code == 2 and out == ""
        assert err == f"meshopt: error: {bad}:6: bad delay '8x0ms'\n"
