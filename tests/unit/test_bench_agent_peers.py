"""scripts/bench_agent_peers.py's pure parts: the route sets it installs and the classes
they give (the run itself needs root, a namespace and wireguard-go)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from meshopt.bus.messages import decode_route_set, encode
from meshopt.probe.budget import IDLE, IN_USE, ProbeBudget, route_hops
from meshopt.wireguard.keys import generate_keypair

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_agent_peers.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_agent_peers", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_agent_peers"] = module
    spec.loader.exec_module(module)
    return module


KEYS = [generate_keypair()[1] for _ in range(100)]


def classes(rs_routes: list[object], keys: list[str]) -> dict[str, int]:
    plan = ProbeBudget().plan(keys, route_hops(rs_routes), {}, 0.0)  # type: ignore[arg-type]
    return {c: plan.count(c) for c in (IN_USE, IDLE)}


def test_a_full_mesh_route_set_puts_every_peer_in_use(bench: ModuleType) -> None:
    rs = bench.route_set(KEYS, "full", 1)
    assert decode_route_set(encode(rs)) == rs  # a set every agent takes
    assert (
        len(rs.routes) == 100
        and sum(r.via != k for r, k in zip(rs.routes, KEYS, strict=True)) == 10
    )
    assert classes(rs.routes, KEYS) == {IN_USE: 100, IDLE: 0}
    assert bench.peer_intervals(100, "full") == [0.33] * 100


def test_a_partial_route_set_leaves_nine_tenths_idle(bench: ModuleType) -> None:
    rs = bench.route_set(KEYS, "partial", 1)
    assert len(rs.routes) == 10
    assert classes(rs.routes, KEYS) == {IN_USE: 10, IDLE: 90}
    intervals = bench.peer_intervals(100, "partial")
    assert intervals[:10] == [0.33] * 10 and set(intervals[10:]) == {2.0}


def test_overlay_addresses_are_distinct_host_prefixes(bench: ModuleType) -> None:
    addrs = [bench.overlay(i) for i in range(1000)]
    assert len(set(addrs)) == 1000 and all(a.endswith("/32") for a in addrs)
    assert "10.99.0.1/32" not in addrs  # the agent's own
