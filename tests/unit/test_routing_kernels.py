"""The numba kernels for reduce_paths and backup next hops against the numpy code.

Both must give the numpy code's exact output (the same floats, bit for bit, and the
same backup indices), so these tests call the kernel (``compiled.reduce_table``,
``compiled.backup_table``) and the numpy reference (``tables._reduce_numpy``,
``backup._backup_next_hops``) side by side on small inputs: CI runs both paths
without a 256-node mesh. The first run on a machine compiles the kernels (~2-4 s).
"""

from __future__ import annotations

import importlib.util
import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshopt.routing import backup as bk
from meshopt.routing import compiled
from meshopt.routing.allpairs import compute_routes
from meshopt.routing.backup import backup_inputs, backup_next_hops
from meshopt.routing.tables import NO_ROUTE, FloatArray, IntArray, _reduce_numpy, reduce_paths
from tests.unit.test_routing_common import INF, Mesh, meshes

# Not importorskip: that would import numba while collecting, in every run of the suite.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("numba") is None, reason="numba not installed"
)

CONSTANTS = (bk._TOL_MS, bk._HUGE, bk._REJECT)
SPECIAL = np.array([0.0, -0.0, 1.0, 1.0, 2.5, 0.1, 0.2, 0.3, 1e-300, 1e300, INF, 7.0])


def same_floats(a: FloatArray, b: FloatArray) -> bool:
    """Equal to the bit, up to NaN payloads: values, NaN positions and zero signs."""
    nan = np.isnan(a)
    return (
        a.shape == b.shape
        and np.array_equal(nan, np.isnan(b))
        and np.array_equal(a[~nan], b[~nan])
        and np.array_equal(np.signbit(a[~nan]), np.signbit(b[~nan]))
    )


def random_table(rng: np.random.Generator, n: int) -> IntArray:
    """Any next-hop table: loops, gaps, odd or NO_ROUTE diagonals, or a shortest-path one."""
    shape = rng.integers(0, 4)
    if shape == 0:  # the engine's: shortest paths on a random mesh
        c = rng.uniform(1.0, 50.0, (n, n))
        c[rng.random((n, n)) < 0.4] = INF
        np.fill_diagonal(c, 0.0)
        return compute_routes(c).next_hop
    nh = rng.integers(-1, n, (n, n)).astype(np.int64)
    if shape == 1:
        np.fill_diagonal(nh, np.arange(n))
    elif shape == 2:  # mostly toward the destination, so many walks arrive
        d = np.broadcast_to(np.arange(n)[None, :], (n, n))
        nh = np.where(rng.random((n, n)) < 0.6, d, nh)
    return nh


def random_edges(rng: np.random.Generator, n: int) -> FloatArray:
    """Edges with ties, signed zeros, tiny and huge values, inf, maybe NaN and -inf."""
    e = rng.choice(SPECIAL, (n, n)) if rng.random() < 0.5 else rng.uniform(-5.0, 50.0, (n, n))
    for bad, p in ((np.nan, 0.25), (-INF, 0.25), (INF, 0.5)):
        if rng.random() < p:
            e[rng.random((n, n)) < 0.1] = bad
    return e


@settings(max_examples=400, deadline=None)
@given(st.integers(1, 40), st.integers(0, 2**32 - 1))
def test_reduce_kernel_gives_numpys_floats(n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    nh = random_table(rng, n)
    edge = random_edges(rng, n)
    for how in ("sum", "min"):
        got = compiled.reduce_table(nh, edge, how)
        assert got is not None
        with np.errstate(invalid="ignore"):  # inf + -inf in numpy's masked sums
            want = _reduce_numpy(nh, edge, how)
        assert same_floats(got, want), how


@settings(max_examples=100, deadline=None)
@given(meshes(max_n=40), st.sampled_from(["sum", "min"]))
def test_reduce_kernel_on_route_tables(m: Mesh, how: str) -> None:
    t = compute_routes(m.cost, relay_hop_ms=m.relay_hop_ms)
    w = np.where(np.isfinite(m.cost), m.cost + m.relay_hop_ms, INF)
    np.fill_diagonal(w, 0.0 if how == "sum" else INF)
    got = compiled.reduce_table(t.next_hop, w, how)  # type: ignore[arg-type]
    assert got is not None
    assert same_floats(got, _reduce_numpy(t.next_hop, w, how))  # type: ignore[arg-type]


def test_reduce_kernel_long_chains_need_every_round() -> None:
    # A 300-hop chain toward node 0 and a 2-hop path elsewhere: columns finish after
    # very different numbers of rounds, and one odd diagonal (d's next hop toward d is
    # another node, whose next hop is d) gives d a nonzero value that the extra rounds
    # of the whole-matrix code add to the walks already arrived.
    n = 300
    rng = np.random.default_rng(1)
    nh = np.tile(np.arange(n, dtype=np.int64), (n, 1))
    nh[1:, 0] = np.arange(n - 1)  # i -> i - 1 toward 0
    nh[5, 5], nh[6, 5] = 6, 5
    nh[7, 7] = NO_ROUTE
    for edge in (rng.uniform(0.0, 10.0, (n, n)), rng.choice(SPECIAL[:-1], (n, n))):
        for how in ("sum", "min"):
            got = compiled.reduce_table(nh, edge, how)  # type: ignore[arg-type]
            assert got is not None
            assert same_floats(got, _reduce_numpy(nh, edge, how))  # type: ignore[arg-type]


def test_reduce_kernel_declines_what_it_does_not_take() -> None:
    nh = np.tile(np.arange(4, dtype=np.int64), (4, 1))
    e32 = np.ones((4, 4), dtype=np.float32)
    assert compiled.reduce_table(nh, e32, "min") is None  # numpy folds in float32
    got = compiled.reduce_table(nh, e32, "sum")  # the fast sum converts to float64
    assert got is not None and same_floats(got, _reduce_numpy(nh, e32, "sum"))
    bad = nh.copy()
    bad[0, 1] = 4  # out of range: numpy raises
    assert compiled.reduce_table(bad, np.ones((4, 4)), "sum") is None
    assert compiled.reduce_table(nh, np.ones((4, 5)), "sum") is None
    ints = compiled.reduce_table(nh.astype(np.int32), np.ones((4, 4), dtype=np.int64), "sum")
    assert ints is not None and same_floats(ints, _reduce_numpy(nh, np.ones((4, 4)), "sum"))


def lfa_inputs(m: Mesh, symmetric: bool) -> tuple[FloatArray, FloatArray, IntArray]:
    t = compute_routes(m.cost, relay_hop_ms=m.relay_hop_ms, symmetric=symmetric)
    dist, w = backup_inputs(t, m.cost, relay_hop_ms=m.relay_hop_ms)
    return dist, w, t.next_hop


def numpy_backups(
    dist: FloatArray, w: FloatArray, nh: IntArray, srcs: IntArray, dist_t: FloatArray | None = None
) -> IntArray:
    with np.errstate(over="ignore", invalid="ignore"):
        return bk._backup_next_hops(dist, w, nh, srcs, dist_t)


@settings(max_examples=300, deadline=None)
@given(meshes(max_n=30), st.booleans(), st.integers(0, 2**32 - 1))
def test_backup_kernel_gives_numpys_alternates(m: Mesh, symmetric: bool, seed: int) -> None:
    dist, w, nh = lfa_inputs(m, symmetric)
    n = m.n
    rng = np.random.default_rng(seed)
    every = np.arange(n, dtype=np.int64)
    some = np.unique(rng.integers(0, n, 3)).astype(np.int64)
    for srcs, dist_t in ((every, None), (some, np.ascontiguousarray(dist.T))):
        got = compiled.backup_table(dist, w, nh, srcs, dist_t, CONSTANTS)
        assert got is not None
        assert np.array_equal(got, numpy_backups(dist, w, nh, srcs, dist_t))


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 30), st.integers(0, 2**32 - 1))
def test_backup_kernel_on_arbitrary_inputs(n: int, seed: int) -> None:
    """Not shortest paths at all: ties everywhere (small integers), zeros, inf
    distances and weights, NO_ROUTE next hops, huge distances (D - tol rounds to D)."""
    rng = np.random.default_rng(seed)
    scale = rng.choice([1.0, 1e-9, 1e12])
    dist = rng.integers(0, 4, (n, n)).astype(np.float64) * scale
    w = rng.integers(0, 4, (n, n)).astype(np.float64) * scale
    dist[rng.random((n, n)) < rng.choice([0.0, 0.2, 0.6])] = INF
    w[rng.random((n, n)) < rng.choice([0.0, 0.2, 0.6])] = INF
    if rng.random() < 0.5:
        np.fill_diagonal(dist, 0.0)
    nh = rng.integers(-1, n, (n, n)).astype(np.int64)
    srcs = np.arange(n, dtype=np.int64)
    got = compiled.backup_table(dist, w, nh, srcs, None, CONSTANTS)
    assert got is not None
    assert np.array_equal(got, numpy_backups(dist, w, nh, srcs))


def test_backup_kernel_declines_nan_and_minus_inf() -> None:
    n = 4
    dist = np.ones((n, n))
    np.fill_diagonal(dist, 0.0)
    nh = np.tile(np.arange(n, dtype=np.int64), (n, 1))
    srcs = np.arange(n, dtype=np.int64)
    for bad in (np.nan, -INF):
        d = dist.copy()
        d[1, 2] = bad
        assert compiled.backup_table(d, dist, nh, srcs, None, CONSTANTS) is None
        assert compiled.backup_table(dist, d, nh, srcs, None, CONSTANTS) is None
    assert (
        compiled.backup_table(dist[:1, :1], dist[:1, :1], nh[:1, :1], srcs[:1], None, CONSTANTS)
        is None
    )
    assert compiled.backup_table(dist.astype(np.float32), dist, nh, srcs, None, CONSTANTS) is None


def test_public_functions_use_the_kernels_from_the_threshold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    real_reduce, real_backup = compiled.reduce_table, compiled.backup_table

    def spy_reduce(*a: object) -> object:
        calls.append("reduce")
        return real_reduce(*a)  # type: ignore[arg-type]

    def spy_backup(*a: object) -> object:
        calls.append("backup")
        return real_backup(*a)  # type: ignore[arg-type]

    monkeypatch.setattr(compiled, "reduce_table", spy_reduce)
    monkeypatch.setattr(compiled, "backup_table", spy_backup)
    monkeypatch.setattr(compiled, "COMPILED_MIN_N", 8)
    rng = np.random.default_rng(4)
    for n in (7, 8, 20):
        c = rng.uniform(1.0, 50.0, (n, n))
        np.fill_diagonal(c, 0.0)
        t = compute_routes(c, compiled=False)
        calls.clear()
        dist, w = backup_inputs(t, c)
        got = backup_next_hops(dist, w, t.next_hop)
        cost = reduce_paths(t.next_hop, c)
        assert calls.count("backup") == (n >= 8) and ("reduce" in calls) == (n >= 8)
        assert np.array_equal(got, numpy_backups(dist, w, t.next_hop, np.arange(n)))
        assert same_floats(cost, _reduce_numpy(t.next_hop, c))


def test_a_failing_kernel_falls_back_to_numpy(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken:
        @staticmethod
        def reduce_paths(*a: object) -> None:
            raise RuntimeError("boom")

        @staticmethod
        def backup_next_hops(*a: object) -> None:
            raise RuntimeError("boom")

    monkeypatch.setattr(compiled, "COMPILED_MIN_N", 2)
    rng = np.random.default_rng(8)
    c = rng.uniform(1.0, 50.0, (9, 9))
    np.fill_diagonal(c, 0.0)
    t = compute_routes(c, compiled=False)
    dist, w = backup_inputs(t, c)
    for what, run, want in (
        ("path reduction", lambda: reduce_paths(t.next_hop, c), _reduce_numpy(t.next_hop, c)),
        (
            "backup next hops",
            lambda: backup_next_hops(dist, w, t.next_hop),
            numpy_backups(dist, w, t.next_hop, np.arange(9)),
        ),
    ):
        monkeypatch.setitem(compiled._state, "kernel", Broken)  # type: ignore[arg-type]
        with caplog.at_level(logging.ERROR, logger="meshopt.routing.compiled"):
            got = run()
        assert f"compiled {what} failed" in caplog.text
        assert compiled._state["kernel"] is None
        assert np.array_equal(got, want)
    monkeypatch.delitem(compiled._state, "kernel")  # the next test imports it again


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 12),
    m=st.integers(1, 6),
    k=st.integers(0, 30),
    seed=st.integers(0, 2**32 - 1),
    specials=st.sampled_from([(), (np.inf,), (np.nan,), (np.inf, np.nan, -np.inf)]),
)
def test_min_plus_kernel_matches_numpy(
    n: int, m: int, k: int, seed: int, specials: tuple[float, ...]
) -> None:
    """The urgent path's min-plus step: the same minimum and argmin as numpy's argmin
    (ties: the first; NaN: the first NaN), on coarse values that tie often."""
    from meshopt.controller import urgent

    rng = np.random.default_rng(seed)
    pert = rng.integers(0, 4, (n, n)).astype(np.float64)
    dcols = rng.integers(0, 4, (n, m)).astype(np.float64)
    for v in specials:
        pert[rng.random((n, n)) < 0.2] = v
        dcols[rng.random((n, m)) < 0.2] = v
    src = rng.integers(0, n, k)
    col = rng.integers(0, m, k)
    old = compiled.COMPILED_MIN_N
    try:
        compiled.COMPILED_MIN_N = 10**9
        with np.errstate(invalid="ignore"):  # inf + -inf: NaN, on purpose
            want = urgent._min_plus(pert, dcols, src, col)
    finally:
        compiled.COMPILED_MIN_N = old
    got = compiled.min_plus(pert, dcols, src, col)
    assert got is not None
    assert np.array_equal(got[1], want[1])
    assert np.array_equal(got[0], want[0], equal_nan=True)
