"""Smoke test: the route benchmark runs and its JSON has the promised shape (no timing checks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_routes.py"


def run(*args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


def test_quick_bench_json(tmp_path: Path) -> None:
    first = tmp_path / "first.json"
    res = run("--out", str(first))
    assert json.loads(first.read_text()) == res
    assert set(res) >= {"meta", "sizes", "incremental", "targets"}
    sizes = res["sizes"]
    assert isinstance(sizes, dict) and set(sizes) == {"20", "40"}
    for entry in sizes.values():
        for key in (
            "routes_s",
            "reference_s",
            "speedup_vs_networkx",
            "symmetric_routes_s",
            "allowed_ips_check_s",
            "backups_s",
            "backup_coverage",
            "widest_s",
        ):
            assert key in entry, key
        assert {"median", "min", "runs"} <= set(entry["routes_s"])
        assert entry["allowed_ips_consistent"]["symmetric"] is True
    inc = res["incremental"]
    assert isinstance(inc, dict)
    for key in ("median_ms", "p95_ms", "full_recompute_s", "speedup_median_vs_full"):
        assert key in inc, key
    assert inc["identical_to_full_recompute"] is True
    again = run("--baseline", str(first), "--reference-max", "0", "--extras-max", "0")
    ratios = again["vs_baseline"]
    assert isinstance(ratios, dict) and "sizes.20.routes_s" in ratios
    assert again["sizes"]["40"]["backups_s"] == {"skipped": "n > --extras-max 0"}
