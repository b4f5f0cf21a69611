"""The busy processes of ``meshopt bench convergence --cpu-load`` and the lab's
fidelity figure."""

from __future__ import annotations

import os
import time

import pytest

from meshopt.bench.cpuload import cpu_load, lag_window
from meshopt.errors import InputError


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_cpu_load_spins_and_ends_exactly_its_processes() -> None:
    with cpu_load(2) as pids:
        assert len(pids) == 2 and os.getpid() not in pids
        time.sleep(0.3)
        ticks = []
        for pid in pids:
            assert _state(pid) in ("R", "S")  # alive (R when it has a core)
            with open(f"/proc/{pid}/stat") as f:
                ticks.append(int(f.read().rsplit(")", 1)[1].split()[11]))  # utime
        assert all(t > 0 for t in ticks)  # they burn CPU
    assert [_state(pid) for pid in pids] == [None, None]  # reaped, not zombies


def test_cpu_load_ends_its_processes_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError), cpu_load(1) as pids:
        raise RuntimeError("benchmark failed")
    assert _state(pids[0]) is None


def test_cpu_load_refuses_nonsense() -> None:
    with pytest.raises(InputError, match="--cpu-load -1"), cpu_load(-1):
        pass
    with cpu_load(0) as pids:
        assert pids == []


def test_lag_window_is_the_difference_of_two_stats() -> None:
    before = {"lag_us": {"count": 1000, "over_1ms": 5}}
    after = {"lag_us": {"count": 11000, "over_1ms": 55}}
    w = lag_window(before, after)
    assert w["packets"] == 10000 and w["late_over_1ms"] == 50
    assert w["late_share"] == pytest.approx(0.005) and w["ok"] is True
    worse = lag_window(before, {"lag_us": {"count": 2000, "over_1ms": 105}})
    assert worse["late_share"] == pytest.approx(0.1) and worse["ok"] is False
    assert lag_window(before, {"lag_us": {"count": 1000, "over_1ms": 5}})["ok"] is False
    assert lag_window({}, {"ok": True})["measured"] is False  # netem: no timer lag
