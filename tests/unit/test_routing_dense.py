"""The numpy shortest paths for small meshes against scipy's, to the last bit.

Offline ``routes``/``path`` skip scipy's import on small meshes only because these
give exactly scipy's distances, predecessors, components and Dijkstra distances.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components, floyd_warshall, shortest_path

from meshopt.routing import dense
from meshopt.routing.allpairs import compute_routes
from meshopt.routing.backup import add_backups
from meshopt.routing.tables import NO_ROUTE, FloatArray
from meshopt.topology.generators import generate
from meshopt.topology.importers import import_rtt_csv
from tests.unit.test_routing_common import Mesh, meshes

ROOT = Path(__file__).resolve().parents[2]


@st.composite
def weight_matrices(draw: st.DrawFn, max_n: int = 60) -> FloatArray:
    """Square weights with many exact ties, missing links (inf) and zeros (scipy's
    dense "no edge"); sometimes small integers, sometimes arbitrary floats."""
    n = draw(st.integers(1, max_n))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if draw(st.booleans()):
        w = rng.integers(0, 4, (n, n)).astype(np.float64)  # ties everywhere, some zeros
    else:
        w = rng.uniform(0.0, 50.0, (n, n))
        w[rng.random((n, n)) < 0.05] = 0.0
    w[rng.random((n, n)) > draw(st.sampled_from([0.1, 0.3, 0.7, 1.0]))] = np.inf
    return w


def scipy_fw(w: FloatArray) -> tuple[FloatArray, np.ndarray]:
    dist, pred = floyd_warshall(w, directed=True, return_predecessors=True)
    return dist, np.maximum(np.asarray(pred, dtype=np.int64), NO_ROUTE)


@settings(max_examples=300, deadline=None)
@given(weight_matrices())
def test_floyd_warshall_is_scipys_to_the_bit(w: FloatArray) -> None:
    before = w.copy()
    dist, pred = dense.floyd_warshall(w)
    want_dist, want_pred = scipy_fw(w)
    assert dist.tobytes() == want_dist.tobytes()
    assert np.array_equal(pred, want_pred)
    assert w.tobytes() == before.tobytes()  # the input is left alone


def test_floyd_warshall_keeps_the_first_of_tied_relays() -> None:
    """0→3 costs 2 via 1 and via 2: the strict '<' keeps the relay found first (k=1)."""
    w = np.array(
        [[0, 1, 1, 9], [9, 0, 9, 1], [9, 9, 0, 1], [9, 9, 9, 0]],
        dtype=np.float64,
    )
    dist, pred = dense.floyd_warshall(w)
    assert dist[0, 3] == 2.0
    assert pred[0, 3] == 1
    assert np.array_equal(pred, scipy_fw(w)[1])


@st.composite
def undirected_graphs(draw: st.DrawFn) -> tuple[int, np.ndarray, np.ndarray, FloatArray]:
    """An undirected graph as one (i, j, weight > 0) per pair, often disconnected."""
    n = draw(st.integers(1, 60))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    density = draw(st.sampled_from([0.0, 0.03, 0.1, 0.3, 1.0]))
    ii, jj = np.nonzero(np.triu(rng.random((n, n)) < density, 1))
    if draw(st.booleans()):
        w = rng.integers(1, 4, ii.size).astype(np.float64)  # ties
    else:
        w = np.maximum(rng.uniform(0.0, 80.0, ii.size), 1e-9)
    flip = rng.random(ii.size) < 0.5  # either orientation of a pair
    rows, cols = np.where(flip, jj, ii), np.where(flip, ii, jj)
    return n, rows.astype(np.int64), cols.astype(np.int64), w


@settings(max_examples=300, deadline=None)
@given(undirected_graphs())
def test_pair_distances_are_scipys_dijkstra_and_components(
    g: tuple[int, np.ndarray, np.ndarray, FloatArray],
) -> None:
    n, rows, cols, w = g
    adj = coo_matrix((w, (rows, cols)), shape=(n, n)).tocsr()
    want_count, want_labels = connected_components(adj, directed=False)
    want_dist = shortest_path(adj, method="D", directed=False)
    assert dense.small(n)
    count, labels, dist = dense.pair_distances(n, rows, cols, w)
    assert dist.tobytes() == np.asarray(want_dist, dtype=np.float64).tobytes()
    assert count == want_count
    assert np.array_equal(labels, want_labels)


def test_small_meshes_use_numpy_and_large_ones_scipy() -> None:
    assert dense.small(1)
    assert dense.small(dense.SMALL_N)
    assert not dense.small(dense.SMALL_N + 1)


@settings(max_examples=60, deadline=None)
@given(meshes(min_n=1, max_n=40), st.booleans())
def test_routes_with_backups_are_the_same_from_numpy_and_scipy(mesh: Mesh, symmetric: bool) -> None:
    """Whole route tables (next hops, distances, costs, backups) agree bit for bit."""
    small = add_backups(
        compute_routes(mesh.cost, relay_hop_ms=mesh.relay_hop_ms, symmetric=symmetric),
        mesh.cost,
        relay_hop_ms=mesh.relay_hop_ms,
    )
    saved = dense.SMALL_N
    dense.SMALL_N = 0  # every size to scipy, for this comparison only
    try:
        big = add_backups(
            compute_routes(mesh.cost, relay_hop_ms=mesh.relay_hop_ms, symmetric=symmetric),
            mesh.cost,
            relay_hop_ms=mesh.relay_hop_ms,
        )
    finally:
        dense.SMALL_N = saved
    assert np.array_equal(small.next_hop, big.next_hop)
    assert small.cost.tobytes() == big.cost.tobytes()
    assert small.dist is not None and big.dist is not None
    assert small.dist.tobytes() == big.dist.tobytes()
    assert small.backup is not None and big.backup is not None
    assert np.array_equal(small.backup, big.backup)


def test_a_mesh_just_over_the_limit_routes_the_same() -> None:
    """The first size that goes to scipy gives what numpy would have given."""
    n = dense.SMALL_N + 1
    cost = generate(f"gen:geo:n={n},seed=3").rtt_ms()
    np.fill_diagonal(cost, 0.0)
    big = compute_routes(cost)
    saved = dense.SMALL_N
    dense.SMALL_N = n
    try:
        small = compute_routes(cost)
    finally:
        dense.SMALL_N = saved
    assert np.array_equal(small.next_hop, big.next_hop)
    assert small.cost.tobytes() == big.cost.tobytes()


def write_sparse_csv(path: Path, n: int, seed: int) -> None:
    """A partly measured RTT matrix with two islands: relayed delays and the
    largest-part rule both come into play."""
    rng = np.random.default_rng(seed)
    lines = ["a,b,rtt_ms"]
    for i in range(n):
        for j in range(i + 1, n):
            same_island = (i < n - 3) == (j < n - 3)
            if same_island and rng.random() < 0.3:
                lines.append(f"n{i},n{j},{rng.uniform(0.5, 90.0):.3f}")
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_rtt_csv_import_is_the_same_without_scipy(tmp_path: Path, seed: int) -> None:
    csv = tmp_path / "m.csv"
    write_sparse_csv(csv, 40, seed)
    small = import_rtt_csv(csv)
    saved = dense.SMALL_N
    dense.SMALL_N = 0
    try:
        big = import_rtt_csv(csv)
    finally:
        dense.SMALL_N = saved
    assert small.warnings == big.warnings
    assert small.topology.names == big.topology.names
    for attr in ("delay_ms", "jitter_ms", "loss", "tunnels"):
        a, b = getattr(small.topology, attr), getattr(big.topology, attr)
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), attr


def test_offline_routes_and_path_import_neither_scipy_nor_networkx(tmp_path: Path) -> None:
    """The real CLI on a 52-node RTT CSV, in a fresh interpreter: no scipy, no networkx
    and no OpenBLAS worker threads."""
    csv = tmp_path / "geo52.csv"
    topo = generate("gen:geo:n=52,seed=7")
    rtt = topo.rtt_ms()
    rows = [f"s{i},s{j},{rtt[i, j]:.3f}" for i in range(52) for j in range(i + 1, 52)]
    csv.write_text("a,b,rtt_ms\n" + "\n".join(rows) + "\n")
    code = (
        "import contextlib, io, json, os, sys\n"
        "from meshopt.cli.main import main\n"
        "codes, outs = [], []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    outs.append(io.StringIO())\n"
        "    with contextlib.redirect_stdout(outs[-1]):\n"
        "        codes.append(main(argv))\n"
        "hops = [h['dst'] for h in json.loads(outs[1].getvalue())['hops']]\n"
        "threads = len(os.listdir('/proc/self/task'))\n"
        "print(json.dumps([codes, hops, threads] +\n"
        "    [m in sys.modules for m in ('scipy', 'networkx')]))\n"
    )
    argvs = [["routes", str(csv)], ["path", str(csv), "s0", "s51", "--json"]]
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(argvs)],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    codes, hops, threads, scipy_loaded, networkx_loaded = json.loads(proc.stdout.splitlines()[-1])
    assert codes == [0, 0]
    assert hops[-1] == "s51"
    assert threads == 1  # no idle OpenBLAS threads: meshopt does no BLAS work
    assert (scipy_loaded, networkx_loaded) == (False, False)
