"""scripts/bench_probe.py's pure helpers: parsing, goals, the JSON summary (no lab, no root)."""

from __future__ import annotations

import datetime as dt
import importlib.util
import itertools
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_probe.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_probe", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_probe"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bp = _load()


def test_rtt_goal_is_the_larger_of_0_2_ms_and_2_percent() -> None:
    assert bp.rtt_goal_ms(2.0) == 0.2
    assert bp.rtt_goal_ms(10.0) == 0.2
    assert bp.rtt_goal_ms(40.0) == pytest.approx(0.8)


def test_round_trip_loss_compounds_both_directions() -> None:
    assert bp.round_trip_loss(0.05, 0.05) == pytest.approx(0.0975)
    assert bp.round_trip_loss(0.05, 0.0) == pytest.approx(0.05)


def test_parse_ping_reads_counts_and_times() -> None:
    text = (
        "64 bytes from 10.98.0.2: icmp_seq=1 ttl=64 time=10.2 ms\n"
        "64 bytes from 10.98.0.2: icmp_seq=3 ttl=64 time=9.87 ms\n\n"
        "--- 10.98.0.2 ping statistics ---\n"
        "3 packets transmitted, 2 received, 33.3333% packet loss, time 2003ms\n"
    )
    assert bp.parse_ping(text) == (3, 2, [10.2, 9.87])
    with pytest.raises(ValueError):
        bp.parse_ping("ping: connect: Network is unreachable\n")


def _stamp(t: float) -> str:
    return dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]


def test_dead_line_found_after_the_cut_and_only_for_that_key() -> None:
    cut = 1_800_000_000.25
    log = "\n".join(
        [
            f"{_stamp(cut - 5)} meshopt.agent INFO peer AbCdEfGh DEAD (3 replies so far)",
            f"{_stamp(cut + 0.5)} meshopt.agent INFO peer ZZZZZZZZ DEAD (9 replies so far)",
            f"{_stamp(cut + 0.7)} meshopt.agent INFO peer AbCdEfGh DEAD (40 replies so far)",
            f"{_stamp(cut + 2.0)} meshopt.agent INFO peer AbCdEfGh alive",
            f"{_stamp(cut + 2.1)} meshopt.agent WARNING something else",
        ]
    )
    key = "AbCdEfGh1234567890abcdefghijklmnopqrstuvwx="
    dead = bp.first_event_after(log, key, False, cut)
    assert dead == pytest.approx(cut + 0.7, abs=0.001)  # not the earlier cut, not ZZZ
    assert bp.first_event_after(log, key, True, cut) == pytest.approx(cut + 2.0, abs=0.001)
    assert bp.first_event_after(log, key, True, cut + 3) is None
    assert len(bp.liveness_events(log)) == 4


def test_cpu_ticks_survive_a_process_name_with_spaces_and_parens() -> None:
    fields = ["S", "1", "2", "3", "0", "-1", "4194560", "10", "0", "0", "0"]
    text = "1234 (py (x) y) " + " ".join([*fields, "150", "50", "7", "3", "20", "0"])
    assert bp.cpu_ticks(text) == 150 + 50 + 7 + 3


def test_cpu_ticks_of_this_process_grow_with_work() -> None:
    before = bp.cpu_ticks(Path("/proc/self/stat").read_text())
    deadline = os.times().elapsed + 0.2
    while os.times().elapsed < deadline:
        sum(range(10_000))
    after = bp.cpu_ticks(Path("/proc/self/stat").read_text())
    assert after > before


def test_status_and_rss_parsing() -> None:
    text = "Name:\tpython\nVmRSS:\t  102400 kB\nRssAnon:\t 90000 kB\nThreads:\t3\n"
    assert bp.rss_mb(text) == 100.0
    assert bp.rss_mb("Name:\tx\n") is None
    assert bp.status_fields(text, ("RssAnon", "Threads", "Missing")) == {
        "RssAnon": 90000,
        "Threads": 3,
    }


def test_cpu_busy_fraction_from_two_stat_readings() -> None:
    before = "cpu  100 0 100 800 0 0 0 0 0 0\ncpu0 ...\n"
    after = "cpu  150 0 150 900 0 0 0 0 0 0\n"
    assert bp.cpu_busy_fraction(before, after) == pytest.approx(0.5)
    assert bp.cpu_busy_fraction(before, before) == 0.0


def test_emulator_pair_counters_by_name_and_delta() -> None:
    stats = {
        "nodes": [{"index": 0, "name": "n1"}, {"index": 1, "name": "n2"}],
        "pairs": [{"src": 0, "dst": 1, "packets": 10, "bytes": 1400, "drop_loss": 1}],
    }
    before = bp.pair_bytes(stats)
    assert before == {("n1", "n2"): {"packets": 10, "bytes": 1400, "drop_loss": 1}}
    after = {("n1", "n2"): {"packets": 30, "bytes": 4200, "drop_loss": 2}}
    assert bp.counter_delta(before, after, ("n1", "n2"), "bytes") == 2800
    assert bp.counter_delta(before, after, ("n2", "n1"), "bytes") == 0  # no traffic yet


def test_worst_abs_and_median_treat_missing_values_honestly() -> None:
    assert bp.worst_abs([0.1, -0.3, 0.2]) == 0.3
    assert bp.worst_abs([0.1, None]) is None  # a failed point never looks perfect
    assert bp.worst_abs([]) is None
    assert bp.median([3.0, None, 1.0, 2.0]) == 2.0
    assert bp.median([None]) is None


def test_figure_and_failure_summaries() -> None:
    ok = bp.figure(0.7, "<= 1 s", True, unit="s", all_s=[0.7])
    assert ok == {"value": 0.7, "goal": "<= 1 s", "pass": True, "unit": "s", "all_s": [0.7]}
    assert bp.figure(None, "g", None)["pass"] is False
    bad = bp.failed("g", RuntimeError("agents never saw each other alive"))
    assert bad["pass"] is False and bad["value"] is None
    assert bad["error"] == "RuntimeError: agents never saw each other alive"


def test_compare_baseline_gives_ratios_of_shared_numbers_only() -> None:
    new = {
        "figures": {
            "dead_peer": {"value": 0.8, "pass": True, "max_s": 0.9, "note": "x"},
            "probe_bytes": {"value": 850.0, "pass": True},
            "loss": {"value": 0.5},
        }
    }
    old = {
        "figures": {
            "dead_peer": {"value": 0.4, "pass": False, "max_s": 0.0},
            "probe_bytes": {"value": 850.0, "pass": True},
        }
    }
    assert bp.compare_baseline(new, old) == {
        "dead_peer": {"value": 2.0},  # max_s: a zero baseline has no ratio; bools skipped
        "probe_bytes": {"value": 1.0},
    }


def test_arguments_and_quick_settings() -> None:
    args = bp.build_parser().parse_args(["--quick", "--only", "rtt", "--only", "cpu"])
    assert args.quick and args.only == ["rtt", "cpu"] and args.runs == 3
    quick = bp.settings(args.runs, args.quick)
    full = bp.settings(5, False)
    assert quick.runs == 1 and full.runs == 5
    assert full.loss_probes >= 1000 and quick.loss_probes >= 1000  # the figure needs them
    assert full.cpu_nodes == 16 and full.cpu_window_s == 60.0
    assert set(full.rtts_ms) == {2.0, 10.0, 40.0, 80.0}
    with pytest.raises(SystemExit):
        bp.build_parser().parse_args(["--only", "everything"])


def test_mesh_yaml_is_a_topology_the_loader_accepts(tmp_path: Path) -> None:
    from meshopt.topology import load_topology

    path = tmp_path / "m.yaml"
    path.write_text(bp.mesh_yaml("m", 4, 1.5))
    topo = load_topology(str(path))
    assert topo.names == ["n1", "n2", "n3", "n4"]
    assert topo.delay_ms[0][3] == 1.5 and topo.loss[1][2] == 0.0


def test_main_refuses_bad_runs_before_touching_anything(capsys: pytest.CaptureFixture[str]) -> None:
    assert bp.main(["--runs", "0"]) == 2
    assert "--runs must be >= 1" in capsys.readouterr().err


def test_pings_start_at_phases_of_their_own() -> None:
    """Started together, the reference pings kept wireguard-go awake for each other and
    read low (issue 14 item 7): each pair's ping starts at its own phase."""
    phases = bp.ping_phases(3, 0.33)
    assert phases[0] == 0.0 and len(set(phases)) == 3
    assert all(0.1 <= b - a <= 0.12 for a, b in itertools.pairwise(phases))
    assert phases[-1] < 0.33


def test_agent_rtt_alone_is_a_phase() -> None:
    args = bp.build_parser().parse_args(["--only", "agent_rtt", "--quick"])
    assert args.only == ["agent_rtt"]


def test_the_agents_bias_is_judged_against_ping_on_the_same_tunnel() -> None:
    # The lab's path read 0.4 ms over its configuration, ping as much as the agent.
    row = {"error_ms": 0.44, "pass": False, "agent_minus_ping_ms": 0.04, "pass_vs_ping": True}
    fig = bp.agent_rtt_figure([row, {**row, "agent_minus_ping_ms": -0.14}])
    assert fig["pass"] is True and fig["value"] == pytest.approx(0.14)
    biased = {**row, "agent_minus_ping_ms": 0.3, "pass_vs_ping": False}
    assert bp.agent_rtt_figure([row, biased])["pass"] is False
    failed = bp.agent_rtt_figure([{"error": "agents never saw each other alive"}])
    assert failed["pass"] is False and failed["value"] is None
    assert bp.agent_rtt_figure([])["pass"] is False
