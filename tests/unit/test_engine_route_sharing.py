"""Full passes share the Route objects of destinations whose routes did not change
(issue 15: controller RSS at 1000 nodes). A pass after a snapshot of noise from every
node rebuilds many destinations' routes; those rebuilt equal keep the old objects, so
the row cache, what is intended and what agents hold do not each hold a copy."""

from __future__ import annotations

import random
import time

from meshopt.agent.core import AgentCore, RouteState
from meshopt.agent.telemetry import Plan, signed_telemetry
from meshopt.bench.synthetic import CONTROLLER_ID, MESH, RUNNING_SENT, SyntheticMesh
from meshopt.bus.messages import Route
from meshopt.bus.signing import generate_signing_key, public_key_b64
from meshopt.bus.topics import Topics
from meshopt.controller.config import ControllerConfig, Enrolment
from meshopt.controller.core import ControllerCore
from meshopt.controller.engine import route_sets


def _controller(mesh: SyntheticMesh) -> tuple[ControllerCore, Topics]:
    """A controller core that every node of ``mesh`` is enrolled with, and the topics."""
    cfg = ControllerConfig(
        mesh=MESH,
        id=CONTROLLER_ID,
        signing_key="/unused",
        node_keys=tuple(Enrolment(x.name, public_key_b64(x.identity)) for x in mesh.nodes),
    )
    return ControllerCore(cfg, generate_signing_key()[0]), Topics(MESH)


def _fed(mesh: SyntheticMesh, seed: int) -> tuple[ControllerCore, Topics]:
    """A controller core (see ``_controller``) that took one full snapshot from every node."""
    core, topics = _controller(mesh)
    rng = random.Random(seed)
    for x in mesh.nodes:
        ag = AgentCore(MESH, x.name, x.identity, [], RouteState(), time.time())
        peers = mesh.reports(x.index, rng, profile="agent", sent=RUNNING_SENT)
        msg = signed_telemetry(ag, time.time(), public_keys=[x.wg_key], addresses=[x.address],
                               plan=Plan(True, peers, 10.0), counters={})  # fmt: skip
        core.on_message(topics.telemetry(x.name), msg, False, time.monotonic(), time.time())
    return core, topics


def test_routes_rebuilt_equal_are_the_old_objects_and_changed_ones_are_new() -> None:
    n = 40
    mesh = SyntheticMesh(n, 3)
    core, topics = _controller(mesh)
    agents = [
        AgentCore(MESH, x.name, x.identity, [], RouteState(), time.time()) for x in mesh.nodes
    ]
    rng = random.Random(5)

    def feed(factor: float = 1.0) -> None:
        for x, ag in zip(mesh.nodes, agents, strict=True):
            f = {j: factor for j in range(n) if j != x.index and (j + x.index) % 3 == 0}
            peers = mesh.reports(x.index, rng, profile="agent", sent=RUNNING_SENT, factor=f)
            msg = signed_telemetry(ag, time.time(), public_keys=[x.wg_key],
                                   addresses=[x.address], plan=Plan(True, peers, 10.0),
                                   counters={})  # fmt: skip
            core.on_message(topics.telemetry(x.name), msg, False, time.monotonic(), time.time())

    feed()
    core.plan(time.monotonic(), time.time())
    before = {node: list(rs) for node, rs in core.intended.items()}
    feed(3.0)  # a third of every node's links 3 x slower: many destinations rebuilt
    core.plan(time.monotonic(), time.time())
    shared = new = 0
    for node, routes in core.intended.items():
        old: dict[tuple[str, str], Route] = {(r.dst, r.table): r for r in before[node]}
        by_dst: dict[str, list[Route]] = {}
        for r in routes:
            by_dst.setdefault(r.dst, []).append(r)
        for dst, rs in by_dst.items():
            olds = [old.get((r.dst, r.table)) for r in rs]
            if rs == olds and len(rs) == sum(1 for k in old if k[0] == dst):
                assert all(a is b for a, b in zip(rs, olds, strict=True)), (node, dst)
                shared += len(rs)
            else:
                new += 1
        if routes == before[node]:
            assert core.engine._rows.rows[node].routes is routes
    assert shared > 0 and new > 0  # both cases happened
    # Rows patched from the last pass (only the destinations to rebuild visited, the
    # rest copied a run at a time) equal rows built from scratch with the same settings.
    c = core.last
    assert c is not None
    assert route_sets(core.view, c, core.engine._tuning.copy(), None) == c.routes


def test_a_row_rebuilt_to_the_same_routes_keeps_its_list_and_objects() -> None:
    core, _ = _fed(SyntheticMesh(30, 4), 2)
    core.plan(time.monotonic(), time.time())
    c, eng = core.last, core.engine
    assert c is not None
    rows = eng._rows.rows
    old = {node: (row.routes, row.chunks) for node, row in rows.items()}
    for row in rows.values():
        row.inputs = row.inputs + 1  # every destination differs: every one rebuilt
    out = route_sets(core.view, c, eng._tuning, eng._rows)
    assert out and set(out) == set(old)
    for node, routes in out.items():
        was, chunks = old[node]
        assert routes is was  # equal: the same list
        assert rows[node].routes is was
        assert rows[node].chunks.flat is chunks.flat
        for d in range(len(chunks.off) - 1):
            assert all(a is b for a, b in zip(rows[node].chunks.of(d), chunks.of(d), strict=True))
