"""Smoke test: the route benchmark runs and its JSON has the promised shape (no timing checks)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

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
    assert set(res) >= {"meta", "sizes", "incremental", "targets", "targets_wall_clock"}
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
        routes = entry["routes_s"]
        assert {"median", "min", "runs", "wall_median", "wall_runs"} <= set(routes)
        assert len(routes["runs"]) == len(routes["wall_runs"]) >= 1
        # CPU seconds of real work, one per run.
        assert min(routes["runs"]) > 0 and routes["min"] == min(routes["runs"])
        # networkx ran side by side, as often as the backend, on the same matrix.
        assert len(entry["reference_s"]["runs"]) == len(routes["runs"])
        assert entry["max_cost_diff_vs_networkx_ms"] < 1e-3
        assert entry["next_hops_equal_networkx"] is True
        assert entry["allowed_ips_consistent"]["symmetric"] is True
    meta = res["meta"]
    assert meta["clock"].startswith("cpu")
    # Thread pools pinned to one core unless the caller set them.
    assert meta["threads"]["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS", "1")
    assert len(meta["loadavg"]["start"]) == 3 and len(meta["loadavg"]["end"]) == 3
    inc = res["incremental"]
    assert isinstance(inc, dict)
    for key in (
        "median_ms",
        "wall_median_ms",
        "p95_ms",
        "full_recompute_s",
        "speedup_median_vs_full",
    ):
        assert key in inc, key
    assert inc["identical_to_full_recompute"] is True
    again = run("--baseline", str(first), "--reference-max", "0", "--extras-max", "0")
    ratios = again["vs_baseline"]
    assert isinstance(ratios, dict) and "sizes.20.routes_s" in ratios
    assert again["sizes"]["40"]["backups_s"] == {"skipped": "n > --extras-max 0"}
    assert "vs_baseline_note" not in again  # both runs timed CPU seconds
    assert "routes_s" in again["sizes"]["40"] and again["targets"] == {}


def test_old_wall_clock_baseline_is_flagged(tmp_path: Path) -> None:
    first = run("--reference-max", "0", "--extras-max", "0")
    del first["meta"]["clock"]  # as written before the CPU clock
    old = tmp_path / "old.json"
    old.write_text(json.dumps(first))
    again = run("--baseline", str(old), "--reference-max", "0", "--extras-max", "0")
    assert again["vs_baseline_note"].startswith("baseline timed wall-clock")


def bench_module(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The script as a module; its thread-pinning defaults stay out of this process's env."""
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(var, os.environ.get(var, "1"))
    spec = importlib.util.spec_from_file_location("bench_routes", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_targets_are_judged_on_cpu_time_and_reported_on_wall_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A busy machine: 0.7 s of CPU took 1.6 s of wall time; networkx ran beside it.
    routes = {"median": 0.7, "wall_median": 1.6}
    result = {
        "sizes": {
            "200": {"speedup_vs_networkx": 130.0, "speedup_vs_networkx_wall": 90.0},
            "1000": {"routes_s": routes},
        },
        "incremental": {"n": 1000, "median_ms": 0.2, "wall_median_ms": 60.0},
    }
    b = bench_module(monkeypatch)
    assert b.targets(result) == {
        "routes_n1000_le_1s": True,
        "speedup_n200_ge_100x": True,
        "incremental_n1000_median_le_50ms": True,
    }
    assert b.targets(result, "wall") == {
        "routes_n1000_le_1s": False,
        "speedup_n200_ge_100x": False,
        "incremental_n1000_median_le_50ms": False,
    }
    # Smaller meshes only: no target applies.
    assert b.targets({"sizes": {"40": {}}, "incremental": {"n": 40}}) == {}


def test_compile_cost_is_reported_apart() -> None:
    if importlib.util.find_spec("numba") is None:
        pytest.skip("numba not installed")
    res = run("--compile-cost", "--reference-max", "0", "--extras-max", "0")
    comp = res["compile"]
    assert set(comp) == {
        "import_numba_s",
        "first_call_compile_s",
        "import_numba_cached_s",
        "first_call_cached_s",
    }
    assert all(v > 0 for v in comp.values())
    assert res["meta"]["compiled_min_n"] == 256 and res["meta"]["numba"]
    assert {e["backend"] for e in res["sizes"].values()} == {"numpy"}  # --quick: 20, 40
