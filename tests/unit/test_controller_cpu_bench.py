"""scripts/bench_scale.py's controller CPU trace: the start-up and the steady figures."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_scale.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_scale_cpu", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_scale_cpu"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_late_share_is_taken_past_the_startup_minute_only() -> None:
    bench = _script()
    trace = bench.CpuTrace()
    # 0.5 s of CPU per second for the first 70 s (start-up), 0.1 s per second after.
    trace.samples = [(t, 0.5 * min(t, 70.0) + 0.1 * max(0.0, t - 70.0)) for t in range(0, 101)]
    trace.marks = {"agents connected": 0.0, "steady window done": 100.0}
    assert trace.share(10.0, 30.0) == 50.0
    assert trace.late(20.0) == 10.0  # 80..100 s
    assert trace.late(30.0) == 10.0  # 70..100 s: still past the minute
    assert trace.late(45.0) is None  # would reach into the start-up minute
    trace.marks = {"agents connected": 0.0}
    assert trace.late(20.0) is None  # the run never reached its steady window's end
    assert trace.share(10.0, 10.5) is None  # too short to tell


def test_the_trace_restores_the_progress_hook_and_marks_phases() -> None:
    bench = _script()
    before = bench.synthetic.progress
    with bench.CpuTrace() as trace:
        bench.synthetic.progress("250/250 agents connected")
        bench.synthetic.progress("steady window done; degrading a link")
        bench.synthetic.progress("250/250 agents connected")  # the first one counts
    assert bench.synthetic.progress is before
    assert list(trace.marks) == ["agents connected", "steady window done"]
    assert trace.marks["agents connected"] <= trace.marks["steady window done"]
