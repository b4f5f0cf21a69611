"""The scale benchmark's agents split over worker processes (meshopt.bench.fleet): the
fleets' answers add up, route sets are verified off the loop (all of them while a
change is timed, the newest otherwise), and a run through K workers gives the same
kind of figures as one in-process, leaving no process behind."""

from __future__ import annotations

import asyncio
import random
import shutil
import time
from pathlib import Path

import pytest

from meshopt.bench.fleet import Verifier, check_arrival, merge, not_direct
from meshopt.bench.synthetic import (
    MESH,
    Arrival,
    RunSettings,
    SyntheticAgent,
    SyntheticMesh,
    run_once,
)
from meshopt.bus.client import BrokerSettings
from meshopt.bus.messages import Route, RouteSet
from meshopt.bus.signing import generate_signing_key, key_id, public_key_b64, sign


def test_merge_adds_numbers_joins_lists_and_merges_dicts() -> None:
    got = merge(
        [
            {"n": 2, "x": 0.5, "l": [1], "d": {"a": 1}, "p": None, "flag": False},
            {"n": 3, "x": 0.25, "l": [2, 3], "d": {"a": 2, "b": 1}, "p": 4, "flag": True},
        ]
    )
    assert got == {"n": 5, "x": 0.75, "l": [1, 2, 3], "d": {"a": 3, "b": 1}, "p": 4, "flag": True}
    assert merge([]) == {}


def _agent_and_sets(versions: list[int]) -> tuple[SyntheticAgent, list[bytes]]:
    mesh = SyntheticMesh(4, seed=1)
    key, _ = generate_signing_key()
    ag = SyntheticAgent(mesh, 0, BrokerSettings(), public_key_b64(key), rng=random.Random(1))
    peer = mesh.nodes[1]
    sets = []
    for v in versions:
        routes = [Route(dst=peer.address, via=peer.wg_key)]
        if v % 2 == 0:  # even versions relay node 1's prefix through node 2
            routes = [Route(dst=peer.address, via=mesh.nodes[2].wg_key)]
        rs = RouteSet(
            mesh=MESH,
            node="n0000",
            version=v,
            issued_at=time.time(),
            controller="ctl1",
            term=1,
            routes=routes,
        )
        sets.append(sign("routes", rs, key, key_id(key)))
    return ag, sets


def _arrive(ag: SyntheticAgent, payload: bytes, at: float) -> Arrival:
    a = Arrival(at, len(payload), payload=payload)
    ag.arrivals.append(a)
    return a


def test_verifier_checks_the_newest_set_unless_a_change_is_timed() -> None:
    ag, sets = _agent_and_sets([1_000_001, 1_000_003, 1_000_004])
    v = Verifier()
    try:
        old = _arrive(ag, sets[0], 1.0)
        new = _arrive(ag, sets[1], 2.0)
        v.check(ag, old)  # not timed, overtaken by ``new``: not verified
        v.check(ag, new)
        assert old.accepted is None and new.accepted is True and v.superseded == 1
        assert ag.core.route_set is not None and ag.core.route_set.version == 1_000_003
        # A timed change: every set from ``since`` on is verified, and the watch gets
        # the arrival time of the first set passing its test, not the time of checking.
        ag.expect(2.5, not_direct(ag.mesh.nodes[1]))
        v.timing_since = 2.5
        timed = _arrive(ag, sets[2], 3.0)
        _arrive(ag, b"newer, not yet verified", 4.0)
        v.check(ag, timed)
        assert timed.accepted is True and ag.fixed_at == 3.0 and v.verified == 2
        assert timed.payload == b""  # not kept once verified
    finally:
        v.close()


def test_a_refused_set_is_marked_and_never_fixes_a_watch() -> None:
    ag, sets = _agent_and_sets([1_000_002])
    ag.expect(0.0, lambda rs: True)
    bad = _arrive(ag, sets[0][:-8] + b"AAAAAAA=", 1.0)  # a broken signature
    check_arrival(ag, bad)
    assert bad.accepted is False and ag.fixed_at is None and ag.core.route_set is None
    assert ag.accepted_after(0.0) is None


@pytest.mark.skipif(shutil.which("mosquitto") is None, reason="mosquitto is not installed")
def test_tiny_mesh_through_two_worker_processes() -> None:
    """N=6 in 2 worker processes: every agent connects with its own session, gets
    verified routes, and the changes are timed; the workers are gone afterwards."""
    res = asyncio.run(
        run_once(
            RunSettings(nodes=6, steady_s=3.0, change_window_s=10.0, quiet_s=1.5, generator_procs=2)
        )
    )
    assert res["connected"] == 6 and res["nodes_with_routes"] == 6
    assert res["agent_refused"] == {} and res["route_sets_verified"] >= 6
    assert res["agent_reconnects"] == 0
    deg = res["degrade"]
    assert deg["affected_nodes"] == 2 and deg["affected_fixed"] == 2
    assert res["death"]["nodes_updated"] == 5
    assert res["steady"]["generator_cpu_pct"] > 0
    for pid in res["pids"].values():
        assert not Path(f"/proc/{pid}").exists()
    from meshopt.bench import synthetic

    assert not synthetic._POOLS  # the pool was closed and forgotten


def test_a_node_stopped_earlier_is_not_watched_for_a_later_death() -> None:
    """With --startup-changes a node dies in start-up; it keeps its last route set but
    gets no new one, so a later death must not count it among the affected (it was
    counted, and never fixed, in the first runs of this)."""
    from meshopt.bench.fleet import Fleet

    mesh = SyntheticMesh(4, seed=1)
    key, _ = generate_signing_key()
    fleet = Fleet(mesh, {i: BrokerSettings() for i in range(4)}, public_key_b64(key))
    victim = mesh.nodes[3]

    async def body() -> None:
        never = asyncio.get_running_loop().create_future()
        for i, ag in fleet.agents.items():
            # Every node relays node 1's prefix through the victim.
            ag.core.route_set = RouteSet(
                mesh=MESH,
                node=ag.node.name,
                version=1,
                issued_at=time.time(),
                controller="ctl1",
                term=1,
                routes=[Route(dst=mesh.nodes[1].address, via=victim.wg_key)],
            )
            ag.task = never if i != 0 else None  # node 0 was stopped before
        got = fleet.expect_avoid(3, 1.0)
        assert got == {"watched": 2}  # nodes 1 and 2: not the victim, not stopped node 0
        assert fleet.agents[0].watch is None and fleet.agents[1].watch is not None
        never.cancel()
        fleet.verifier.close()

    asyncio.run(body())
