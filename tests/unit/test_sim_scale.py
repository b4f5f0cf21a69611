"""The simulator's cost at scale: backups computed only when fail-over needs them, and
the figures ``--json`` reports for capacity planning (scripts/bench_sim_scale.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from meshopt.graph import topology_costs
from meshopt.routing import compute_routes
from meshopt.sim import engine
from meshopt.sim.engine import SimConfig, simulate
from meshopt.sim.events import parse_event
from meshopt.sim.report import SimReport
from meshopt.topology.load import load_topology

from .test_sim import DEGRADE, mesh


class EagerBackups(engine._Backups):
    """What the engine did before: backups computed at every recompute."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tables()


def figures(r: SimReport) -> dict[str, object]:
    d = r.to_dict()
    del d["runtime_s"], d["perf"]
    return d


def busiest_relay(spec: str) -> str:
    topo = load_topology(spec)
    opt = compute_routes(topology_costs(topo), topo.names)
    counts = np.bincount(opt.next_hop[opt.relayed()], minlength=topo.n)
    return topo.names[int(counts.argmax())]


@pytest.mark.parametrize("symmetric", [False, True])
def test_backups_on_demand_give_exactly_the_report_of_backups_every_recompute(
    monkeypatch: pytest.MonkeyPatch, symmetric: bool
) -> None:
    spec = "gen:geo:n=60,seed=2"
    topo = load_topology(spec)
    hub = busiest_relay(spec)
    events = [parse_event(f"at=10s node={hub} down"), parse_event(f"at=18s node={hub} up")]
    cfg = SimConfig(duration_s=26.0, seed=3, symmetric=symmetric, recompute_s=5.0)
    lazy = simulate(topo, events, cfg)
    monkeypatch.setattr(engine, "_Backups", EagerBackups)
    eager = simulate(topo, events, cfg)
    assert lazy.failovers > 0  # the backups were used, not just skipped
    assert figures(lazy) == figures(eager)
    if symmetric:
        # Symmetric route sets carry the direct tunnel as every route's backup (one
        # AllowedIPs set per destination): no loop-free alternates to compute.
        assert lazy.perf.backup_computations == 0
    else:
        assert 0 < lazy.perf.backup_computations < eager.perf.backup_computations
        assert eager.perf.backup_computations == eager.perf.recomputes


def test_a_steady_mesh_never_computes_backups() -> None:
    cfg = SimConfig(duration_s=20.0)
    r = simulate(mesh("xyz", DEGRADE, default_ms=8.0), [], cfg)
    assert r.perf.rounds == round(20.0 / cfg.tick_s)
    assert r.perf.recomputes > 0 and r.perf.backup_computations == 0
    assert r.perf.phase_s["backups"] == 0.0


def test_json_reports_time_per_simulated_second_and_its_phases() -> None:
    cfg = SimConfig(duration_s=5.0)
    r = simulate(mesh("xyz", DEGRADE, default_ms=8.0), [], cfg)
    perf = r.to_dict()["perf"]
    assert perf["wall_per_simulated_s"] > 0 and perf["rounds"] == round(5.0 / cfg.tick_s)
    phases = {"truth", "routes", "backups", "policy", "failover", "score", "probes"}
    assert set(perf["phase_s"]) == phases
    assert all(v is not None and v >= 0 for v in perf["phase_s"].values())
    assert sum(r.perf.phase_s.values()) <= r.runtime_s


def test_scoring_only_the_changed_destinations_gives_the_full_walks_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fail-overs on lossy links change a few columns of the next hops; the tracker
    walks only those. The report is the one full walks give."""
    spec = "gen:geo:n=60,seed=2"
    topo = load_topology(spec)
    events = [parse_event(f"at=10s node={busiest_relay(spec)} down")]
    cfg = SimConfig(duration_s=16.0, seed=5)
    part = simulate(topo, events, cfg)
    full_walk = engine._Tracker.score

    def always_full(self: engine._Tracker, *args: Any, **kwargs: Any) -> None:
        self._paths = None
        full_walk(self, *args, **kwargs)

    monkeypatch.setattr(engine._Tracker, "score", always_full)
    full = simulate(topo, events, cfg)
    assert part.failovers > 0
    assert figures(part) == figures(full)


def test_path_sums_of_some_destinations_match_the_full_table() -> None:
    topo = load_topology("gen:geo:n=80,seed=4")
    cost = topology_costs(topo)
    nh = compute_routes(cost, topo.names).next_hop.copy()
    rng = np.random.default_rng(1)
    nh[rng.integers(0, 80, 100), rng.integers(0, 80, 100)] = -1  # some broken entries
    cols = np.array([0, 5, 17, 79, 42])
    full = engine.reduce_paths(nh, cost)
    assert np.array_equal(full[:, cols], engine._sum_paths_cols(nh, cost, cols))
