"""The numba Floyd–Warshall (meshopt.routing.compiled) against scipy and networkx.

Small meshes force the kernel through ``compiled=True`` and small tiles through
``block``, so every tile phase runs without a large (slow) mesh. The first run on a
machine compiles the kernel (~2 s, then numba's on-disk cache serves it).
"""

from __future__ import annotations

import importlib.util
import logging
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshopt.routing import compiled
from meshopt.routing.allpairs import compute_routes, prepare_weights, reference_routes
from meshopt.routing.tables import NO_ROUTE, reduce_paths
from tests.unit.test_routing_common import INF, Mesh, meshes, random_costs, to_graph

# Not importorskip: that would import numba while collecting, in every run of the suite.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("numba") is None, reason="numba not installed"
)


def scipy_fw(perturbed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dist, next_hop) the scipy path gives, in the same orientation."""
    from scipy.sparse.csgraph import floyd_warshall

    d_t, p_t = floyd_warshall(perturbed.T.copy(), directed=True, return_predecessors=True)
    nh = np.maximum(np.asarray(p_t).T.astype(np.int64), NO_ROUTE)
    np.fill_diagonal(nh, np.arange(perturbed.shape[0]))
    return np.asarray(d_t).T, nh


def same_routes(m: Mesh, symmetric: bool) -> None:
    want = compute_routes(m.cost, relay_hop_ms=m.relay_hop_ms, symmetric=symmetric, compiled=False)
    got = compute_routes(m.cost, relay_hop_ms=m.relay_hop_ms, symmetric=symmetric, compiled=True)
    assert np.array_equal(got.next_hop, want.next_hop)
    assert np.array_equal(np.isinf(got.cost), np.isinf(want.cost))
    assert np.array_equal(got.cost, want.cost)  # same paths, same exact sums
    assert got.dist is not None and want.dist is not None
    fin = np.isfinite(want.dist)
    assert np.array_equal(np.isfinite(got.dist), fin)
    assert np.allclose(got.dist[fin], want.dist[fin], rtol=1e-12, atol=1e-9)


@settings(max_examples=200, deadline=None)
@given(meshes(max_n=40))
def test_compiled_matches_the_scipy_path(m: Mesh) -> None:
    same_routes(m, symmetric=False)


@settings(max_examples=60, deadline=None)
@given(meshes(max_n=40))
def test_compiled_matches_the_scipy_path_symmetric(m: Mesh) -> None:
    same_routes(m, symmetric=True)


@settings(max_examples=150, deadline=None)
@given(meshes(max_n=45), st.sampled_from([1, 2, 3, 7, 16, 128]))
def test_every_tile_size_gives_scipys_next_hops(m: Mesh, block: int) -> None:
    _, w = prepare_weights(m.cost, m.relay_hop_ms, False)
    out = compiled.floyd_warshall(w, block=block)
    assert out is not None
    dist, nh = out
    want_d, want_nh = scipy_fw(w)
    assert np.array_equal(nh, want_nh)
    fin = np.isfinite(want_d)
    assert np.array_equal(np.isfinite(dist), fin)
    assert np.allclose(dist[fin], want_d[fin], rtol=1e-12, atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(meshes(max_n=14))
def test_compiled_matches_networkx(m: Mesh) -> None:
    t = compute_routes(m.cost, relay_hop_ms=m.relay_hop_ms, compiled=True)
    r = reference_routes(to_graph(m.cost), relay_hop_ms=m.relay_hop_ms)
    assert np.array_equal(np.isinf(t.cost), np.isinf(r.cost))
    fin = np.isfinite(r.cost)
    assert np.allclose(t.cost[fin], r.cost[fin], rtol=0.0, atol=1e-3)
    if m.kind != "int":  # exact ties: networkx picks either, the perturbation one of them
        assert np.array_equal(t.next_hop, r.next_hop)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 40), st.integers(0, 2**32 - 1), st.booleans())
def test_path_sums_are_reduce_paths_to_the_bit(n: int, seed: int, with_inf: bool) -> None:
    """Any table, not only shortest-path ones: loops, broken routes, odd diagonals."""
    assert compiled.available()
    rng = np.random.default_rng(seed)
    nh = rng.integers(-1, n, (n, n)).astype(np.int64)
    if rng.random() < 0.5:  # mostly the engine's shape: i on the diagonal
        np.fill_diagonal(nh, np.arange(n))
    edge = rng.uniform(0.0, 50.0, (n, n))
    if with_inf:
        edge[rng.random((n, n)) < 0.2] = INF
    want = reduce_paths(nh, edge, "sum")
    got = compiled.path_sums(nh, edge)
    assert np.array_equal(got, want)
    edge[0, 0] = np.nan  # not for the kernel: reduce_paths's masked way
    assert np.array_equal(compiled.path_sums(nh, edge), reduce_paths(nh, edge, "sum"), True)


def test_exact_ties_disconnected_parts_and_one_way_links() -> None:
    # Two 4-cycles of equal links (two equal ways round each), no link between them,
    # and one one-way link 0→4: 4..7 are reachable from 0..3, not the other way.
    c = np.full((8, 8), INF)
    np.fill_diagonal(c, 0.0)
    for base in (0, 4):
        for a, b in [(0, 1), (1, 2), (2, 3), (3, 0)]:
            c[base + a, base + b] = c[base + b, base + a] = 10.0
    c[0, 4] = 50.0
    for block in (1, 3, 8):
        _, w = prepare_weights(c, 2.0, False)
        out = compiled.floyd_warshall(w, block=block)
        assert out is not None
        assert np.array_equal(out[1], scipy_fw(w)[1])
    t = compute_routes(c, compiled=True)
    assert np.array_equal(t.next_hop, compute_routes(c, compiled=False).next_hop)
    assert (t.next_hop[4:, :4] == NO_ROUTE).all() and np.isinf(t.cost[4:, :4]).all()
    assert t.path(1, 4) == [1, 0, 4] and t.cost[1, 4] == pytest.approx(62.0)
    assert list(np.diag(t.next_hop)) == list(range(8))


def test_threshold_boundary() -> None:
    n = compiled.COMPILED_MIN_N
    assert not compiled.use_compiled(n - 1, None) and compiled.use_compiled(n, None)
    assert compiled.use_compiled(3, True) and not compiled.use_compiled(n, False)
    rng = np.random.default_rng(7)
    for size in (n - 1, n):
        c = random_costs(size, rng, "geo", 0.6)
        default = compute_routes(c)
        for forced in (False, True):
            t = compute_routes(c, compiled=forced)
            assert np.array_equal(t.next_hop, default.next_hop)
            assert np.array_equal(t.cost, default.cost)


def test_the_default_path_calls_the_kernel_from_the_threshold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    real = compiled.floyd_warshall

    def spy(w: np.ndarray, *, block: int = compiled.BLOCK) -> object:
        calls.append(w.shape[0])
        return real(w, block=block)

    monkeypatch.setattr(compiled, "floyd_warshall", spy)
    monkeypatch.setattr(compiled, "COMPILED_MIN_N", 6)
    rng = np.random.default_rng(3)
    for size in (5, 6):
        compute_routes(random_costs(size, rng, "float", 1.0))
    assert calls == [6]


def test_without_numba_scipy_is_used_after_one_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delitem(compiled._state, "kernel", raising=False)
    monkeypatch.delitem(sys.modules, "meshopt.routing._fw_numba", raising=False)
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba -> ImportError
    c = random_costs(12, np.random.default_rng(5), "geo", 0.6)
    with caplog.at_level(logging.WARNING, logger="meshopt.routing.compiled"):
        t = compute_routes(c, compiled=True)
        compute_routes(c, compiled=True)
    assert [r.getMessage().startswith("numba unavailable") for r in caplog.records] == [True]
    assert not compiled.available()
    assert np.array_equal(t.next_hop, compute_routes(c, compiled=False).next_hop)
    monkeypatch.delitem(compiled._state, "kernel")  # undo: the next test imports it again


def test_a_failing_kernel_falls_back_to_scipy(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken:
        @staticmethod
        def floyd_warshall_next_hops(d: object, nh: object, block: int) -> None:
            raise RuntimeError("boom")

        @staticmethod
        def sum_paths(nh: object, edge: object, rounds: int) -> None:
            raise RuntimeError("boom")

    monkeypatch.setitem(compiled._state, "kernel", Broken)  # type: ignore[arg-type]
    c = random_costs(10, np.random.default_rng(6), "float", 0.8)
    with caplog.at_level(logging.ERROR, logger="meshopt.routing.compiled"):
        t = compute_routes(c, compiled=True)
    assert "compiled Floyd-Warshall failed" in caplog.text
    assert compiled._state["kernel"] is None
    assert np.array_equal(t.next_hop, compute_routes(c, compiled=False).next_hop)
    monkeypatch.setitem(compiled._state, "kernel", Broken)  # type: ignore[arg-type]
    nh, edge = t.next_hop, np.where(np.isfinite(c), c, INF)
    with caplog.at_level(logging.ERROR, logger="meshopt.routing.compiled"):
        assert np.array_equal(compiled.path_sums(nh, edge), reduce_paths(nh, edge, "sum"))
    assert "compiled path sums failed" in caplog.text
    assert compiled._state["kernel"] is None


MDWE_ROUTES = (
    "import ctypes, logging, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "if libc.prctl(65, 1, 0, 0, 0) != 0:\n"  # PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN
    "    sys.exit(77)\n"
    "logging.basicConfig(level=logging.WARNING)\n"
    "import numpy as np\n"
    "from meshopt.routing import compute_routes\n"
    "c = np.random.default_rng(1).uniform(1.0, 50.0, (30, 30))\n"
    "a = compute_routes(c, compiled=True)\n"
    "b = compute_routes(c, compiled=False)\n"
    "print(bool(np.array_equal(a.next_hop, b.next_hop)))\n"
)


def test_write_execute_memory_refused_means_scipy_and_one_warning() -> None:
    """As under MemoryDenyWriteExecute=yes (the shipped controller unit): numba's import
    raises, the routes come from scipy, and the log says why."""
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-c", MDWE_ROUTES], capture_output=True, text=True, timeout=120
    )
    if proc.returncode == 77:
        pytest.skip("this kernel has no PR_SET_MDWE (Linux < 6.3)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"
    assert proc.stderr.count("numba unavailable (PermissionError") == 1, proc.stderr
