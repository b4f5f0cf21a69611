"""scripts/bench_agent_peers.py's pure parts: the route sets it installs and the classes
they give (the run itself needs root, a namespace and wireguard-go)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from meshopt.bus.messages import decode_route_set, encode
from meshopt.probe.budget import IDLE, IN_USE, ProbeBudget, route_use
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


def classes(bench: ModuleType, rs_routes: list[object], keys: list[str]) -> dict[str, str]:
    """The agent's classes for this route set: owners as its baselines give them."""
    owners = {bench.overlay(i): k for i, k in enumerate(keys)}
    use = route_use(rs_routes, owners.get)  # type: ignore[arg-type]
    return ProbeBudget().classify(keys, use.relays, {}, 0.0, use.backups)


def test_a_full_mesh_route_set_keeps_relays_and_their_backups_in_use(bench: ModuleType) -> None:
    rs = bench.route_set(KEYS, "full", 1)
    assert decode_route_set(encode(rs)) == rs  # a set every agent takes
    assert (
        len(rs.routes) == 100
        and sum(r.via != k for r, k in zip(rs.routes, KEYS, strict=True)) == 10
    )
    got = classes(bench, rs.routes, KEYS)
    # Peer 10j+8 relays to 10j+9, whose direct tunnel is that route's backup; the 80
    # direct routes without traffic leave their peers idle.
    in_use = {KEYS[i] for i in range(100) if i % 10 in (8, 9)}
    assert {k for k, c in got.items() if c == IN_USE} == in_use
    assert sum(1 for c in got.values() if c == IDLE) == 80
    intervals = bench.peer_intervals(100, "full")
    assert [i for i, x in enumerate(intervals) if x == 0.33] == [
        i for i in range(100) if i % 10 in (8, 9)
    ]
    assert {x for x in intervals if x != 0.33} == {2.0}


def test_a_partial_route_set_of_direct_routes_leaves_every_link_idle(bench: ModuleType) -> None:
    rs = bench.route_set(KEYS, "partial", 1)
    assert len(rs.routes) == 10
    assert set(classes(bench, rs.routes, KEYS).values()) == {IDLE}
    assert set(bench.peer_intervals(100, "partial")) == {2.0}


def test_overlay_addresses_are_distinct_host_prefixes(bench: ModuleType) -> None:
    addrs = [bench.overlay(i) for i in range(1000)]
    assert len(set(addrs)) == 1000 and all(a.endswith("/32") for a in addrs)
    assert "10.99.0.1/32" not in addrs  # the agent's own
