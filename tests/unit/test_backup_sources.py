"""Backups for a few rows (``sources``): the same values as the full computation.

The simulator computes only the rows whose fail-over needs a backup, so those rows
must be bit-identical to the rows of the full O(n³) computation, and its reports
must not change.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from meshopt.errors import InputError, MeshoptError
from meshopt.routing.allpairs import compute_routes, prepare_weights
from meshopt.routing.backup import add_backups, backup_next_hops
from meshopt.routing.tables import NO_ROUTE, FloatArray, IntArray
from meshopt.sim import engine
from meshopt.sim.engine import SimConfig, simulate
from meshopt.sim.report import SimReport
from meshopt.topology.load import load_topology
from tests.unit.test_routing_common import random_costs

CASES = [
    # (n, kind, density, relay_hop_ms, symmetric); n > 128 spans several blocks.
    (2, "float", 1.0, 2.0, False),
    (9, "int", 0.6, 0.0, False),
    (17, "int", 0.6, 2.0, True),
    (25, "float", 0.3, 7.5, False),
    (40, "geo", 0.6, 2.0, True),
    (60, "geo", 0.15, 2.0, False),
    (150, "float", 0.1, 2.0, False),
    (200, "geo", 0.1, 2.0, True),
]


def inputs(
    n: int, kind: str, density: float, relay: float, sym: bool, seed: int
) -> tuple[FloatArray, FloatArray, IntArray]:
    """dist, weights and next hops of a random mesh, as ``add_backups`` derives them."""
    cost = random_costs(n, np.random.default_rng(seed), kind, density)
    t = compute_routes(cost, relay_hop_ms=relay, symmetric=sym)
    _, w = prepare_weights(cost, relay, sym)
    assert t.dist is not None
    return t.dist, w, t.next_hop


def subsets(n: int, rng: np.random.Generator) -> list[Any]:
    """Row selections a caller might pass: empty, one, a few unsorted with repeats, all."""
    few = rng.integers(0, n, size=min(n, 5))
    return [
        [],
        [0],
        [n - 1],
        few.tolist(),
        np.concatenate([few, few[:2]]),  # repeats
        rng.permutation(n)[: max(1, n // 3)],
        np.arange(n),
    ]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("n", "kind", "density", "relay", "sym"), CASES)
def test_rows_computed_with_sources_equal_those_of_the_full_computation(
    n: int, kind: str, density: float, relay: float, sym: bool, seed: int
) -> None:
    dist, w, nh = inputs(n, kind, density, relay, sym, seed)
    full = backup_next_hops(dist, w, nh)
    assert np.array_equal(backup_next_hops(dist, w, nh, None), full)
    if n > 2:
        assert (full != NO_ROUTE).any()  # there are backups to get right
    for rows in subsets(n, np.random.default_rng(seed + 100)):
        part = backup_next_hops(dist, w, nh, rows)
        picked = np.zeros(n, dtype=bool)
        picked[np.asarray(rows, dtype=np.int64)] = True
        assert part.dtype == full.dtype and part.shape == full.shape
        assert np.array_equal(part[picked], full[picked])
        assert (part[~picked] == NO_ROUTE).all()


def test_add_backups_passes_sources_through() -> None:
    cost = random_costs(30, np.random.default_rng(5), "geo", 0.3)
    t = compute_routes(cost)
    full = add_backups(t, cost)
    part = add_backups(t, cost, sources=[3, 7])
    assert full.backup is not None and part.backup is not None
    assert np.array_equal(part.backup[[3, 7]], full.backup[[3, 7]])
    assert (np.delete(part.backup, [3, 7], axis=0) == NO_ROUTE).all()


@pytest.mark.parametrize("rows", [[-1], [4], [0, 9]])
def test_sources_outside_the_mesh_are_a_one_line_error(rows: list[int]) -> None:
    dist, w, nh = inputs(4, "float", 1.0, 2.0, False, 0)
    with pytest.raises(InputError, match=r"backup sources must be row indices in \[0, 4\)"):
        backup_next_hops(dist, w, nh, rows)
    assert issubclass(InputError, MeshoptError)


def test_sim_backups_fill_rows_on_demand_and_keep_earlier_ones() -> None:
    cost = random_costs(50, np.random.default_rng(9), "geo", 0.3)
    t = compute_routes(cost)
    full = add_backups(t, cost)
    assert full.backup is not None
    b = engine._Backups(t, cost, 2.0, True)
    done: set[int] = set()
    for rows in ([4, 11], [11, 30], [0, 4, 49]):
        got = b.tables(np.array(rows, dtype=np.int64))
        done |= set(rows)
        assert got is not None and got.backup is not None
        assert np.array_equal(got.backup[sorted(done)], full.backup[sorted(done)])
    assert b.computed
    every = b.tables()
    assert every is not None and every.backup is not None
    assert np.array_equal(every.backup, full.backup)
    assert engine._Backups(t, cost, 2.0, False).tables(np.array([1])) is None


class EagerBackups(engine._Backups):
    """Every row at every recompute, as the engine did before per-row backups."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tables()


def figures(r: SimReport) -> dict[str, object]:
    d = r.to_dict()
    del d["runtime_s"], d["perf"]
    return d


@pytest.mark.parametrize("symmetric", [False, True])
def test_lossy_mesh_report_is_the_same_with_per_row_backups(
    monkeypatch: pytest.MonkeyPatch, symmetric: bool
) -> None:
    """Lossy links give false "dead" verdicts in many rounds and rows: rows accumulate."""
    topo = load_topology("gen:geo:n=60,seed=4")
    topo = dataclasses.replace(topo, loss=np.where(topo.tunnels, 0.3, 0.0))
    cfg = SimConfig(duration_s=20.0, seed=1, symmetric=symmetric, recompute_s=5.0)
    lazy = simulate(topo, [], cfg)
    monkeypatch.setattr(engine, "_Backups", EagerBackups)
    eager = simulate(topo, [], cfg)
    assert lazy.failovers > 0  # backups were used
    assert figures(lazy) == figures(eager)
