"""Smoke test: the simulator benchmark runs and reports a node failure it really simulated."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_sim.py"


def test_quick_bench_sim_json() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    (run,) = json.loads(proc.stdout)["runs"]
    # 20 s: the agents boot at 2-3 s and route from ~6 s, so the failure at 10 s hits
    # routes the controller installed.
    assert run["nodes"] == 50 and run["routes"] == 50 * 49 and run["simulated_s"] == 20.0
    assert run["wall_s"] > 0  # rounded to 0.01 s, so the ratio matches within rounding
    assert abs(run["wall_per_simulated_s"] - run["wall_s"] / 20.0) <= 0.001
    assert run["event"].startswith("at=10s node=") and run["event"].endswith(" down")
    assert run["event_broken_routes"] > 0  # the busiest relay carried routes when it failed
    assert run["event_outage_s"] is not None and run["event_outage_s"] <= 1.0
    assert run["improved_pairs"] > 0
