"""All-pairs next hops with a numba-compiled Floyd–Warshall, for large meshes; and
the same values as ``tables.reduce_paths`` and ``backup.backup_next_hops`` by numba
kernels (``reduce_table``, ``backup_table``), which those use from the same size.

scipy's Floyd–Warshall with predecessors takes ~1.1-1.4 s of CPU on the 1,000-node
mesh of ``scripts/bench_routes.py``; the blocked kernel in ``_fw_numba`` takes
~0.45 s for the same next hops (all of compute_routes 0.59-0.67 s, load 2-5).
numba is imported lazily and only for meshes of at least ``COMPILED_MIN_N`` nodes
(importing numba costs 0.35-0.55 s of CPU, compiling the kernels 1.7-3.7 s once per
machine, loading them from numba's on-disk cache ~0.55 s once per process): agents,
the lab (up to 250 nodes), offline commands on smaller topologies and collecting the
test suite never load it; of the tests, only the compiled path's and the kernels' own
and those on meshes of 256+ nodes do (one 1000-node simulation,
``test_a_thousand_node_mesh_runs``: 21 s of CPU instead of 27 s with scipy, numba's
loading included). Without numba (it comes with the ``controller`` extra), or if a
kernel fails, ``floyd_warshall`` (``reduce_table``, ``backup_table``) returns None
after one log line and the caller uses scipy (numpy).
That includes a process that may not map executable memory (systemd's
``MemoryDenyWriteExecute=yes``, PR_SET_MDWE: numba's import raises PermissionError)
and one where numba finds no writable cache directory (RuntimeError at import;
``NUMBA_CACHE_DIR`` names one).

Same routes as the scipy path: both find, for every pair, the least sum of the
tie-perturbed weights, and those paths are unique (``allpairs``). The two add the
same weights in different orders, so a distance may differ in the last bits
(~1e-13 ms); the next hops could only differ where two paths' perturbed lengths are
closer than that, against a perturbation of up to 1e-4 ms per edge: a chance of
roughly 1e-9 per close pair, never seen in the tests. The costs are the same sums
along the same next hops, so they are equal. ``tests/unit/test_routing_compiled.py``
holds both against scipy and networkx.
"""

from __future__ import annotations

import importlib
import logging
import math
from types import ModuleType
from typing import Literal

import numpy as np

from meshopt.routing.tables import NO_ROUTE, FloatArray, IntArray, reduce_paths

log = logging.getLogger(__name__)

# From this many nodes up compute_routes uses the compiled kernel. Measured on the
# 2-core VM (CPU s per compute_routes, kernel vs scipy, load 4-5): 0.005/0.010 at 150
# nodes, 0.009/0.016 at 200, 0.019/0.030 at 256, 0.038/0.062 at 300, 0.085/0.136 at
# 400, 0.63-0.84/1.47-1.84 at 1000. The kernel wins at every size, but loading it
# costs ~1 s once per process (numba's import 0.35-0.55 s, the cached kernel ~0.55 s;
# compiling on a fresh cache 1.7-3.7 s): at 256 nodes that is repaid after ~100
# recomputes, at 1000 in the first one. 256 keeps the lab (up to 250 nodes), the
# offline commands and the tests on scipy/numpy.
COMPILED_MIN_N = 256
# Tile edge: 128 × 128 float64 + int64 tiles (256 KiB a pair) stay in L2.
BLOCK = 128

_state: dict[str, ModuleType | None] = {}


def _kernel() -> ModuleType | None:
    """The kernel module, imported on first use; None (logged once) without numba."""
    if "kernel" not in _state:
        try:
            kernel = importlib.import_module("meshopt.routing._fw_numba")
        except Exception as e:  # not installed, or refused (see the module docstring)
            log.warning(
                "numba unavailable (%s: %s): all-pairs routes use scipy's Floyd-Warshall, "
                "~2x slower on large meshes (docs/daemons.md, 'Compiled routes')",
                type(e).__name__,
                e,
            )
            _state["kernel"] = None
        else:
            _state["kernel"] = kernel
    return _state["kernel"]


def available() -> bool:
    """Whether the compiled kernel can be used (imports numba on first call)."""
    return _kernel() is not None


def use_compiled(n: int, compiled: bool | None) -> bool:
    """Whether an n-node run should try the kernel: ``compiled`` forces it either way."""
    return n >= COMPILED_MIN_N if compiled is None else compiled


def warm_up() -> bool:
    """Import numba and compile or load the kernel now; False without it."""
    k = _kernel()
    if k is None:
        return False
    k.warm_up()
    return True


def path_sums(next_hop: IntArray, edge: FloatArray) -> FloatArray:
    """``reduce_paths(next_hop, edge, "sum")``, the same values; compiled once the
    kernel is loaded (~25 ms instead of ~75 ms at 1000 nodes), else reduce_paths itself.

    The kernel takes the engine's tables only: s on the diagonal (there a path that has
    arrived adds 0.0 per further round, so each destination may stop on its own) and
    edges without NaN or -inf.
    """
    k = _state.get("kernel")
    n = next_hop.shape[0]
    if (
        k is None
        or n == 0
        or not np.min(edge) > -math.inf  # NaN, -inf: the masked way
        or not np.array_equal(np.diagonal(next_hop), np.arange(n))
    ):
        return reduce_paths(next_hop, edge, "sum")
    rounds = max(1, math.ceil(math.log2(n))) + 1  # as reduce_paths
    try:
        out: FloatArray = k.sum_paths(
            np.ascontiguousarray(next_hop, dtype=np.int64),
            np.ascontiguousarray(edge, dtype=np.float64),
            rounds,
        )
    except Exception:
        log.exception("compiled path sums failed: using scipy and numpy from now on")
        _state["kernel"] = None
        return reduce_paths(next_hop, edge, "sum")
    return out


def min_plus(
    pert: FloatArray, dcols: FloatArray, src: IntArray, col: IntArray
) -> tuple[FloatArray, IntArray] | None:
    """For each entry e, min over k of ``pert[src[e], k] + dcols[k, col[e]]`` and the
    argmin (numpy's: first minimum, first NaN), by the kernel without the n-wide
    temporaries numpy needs per entry; None (use numpy) without numba or if it fails."""
    k = _kernel()
    if k is None or pert.ndim != 2 or dcols.ndim != 2 or dcols.shape[0] != pert.shape[1]:
        return None
    if pert.shape[1] == 0:
        return None
    val = np.empty(src.size)
    arg = np.empty(src.size, dtype=np.int64)
    try:
        k.min_plus(
            np.ascontiguousarray(pert, dtype=np.float64),
            np.ascontiguousarray(dcols.T, dtype=np.float64),
            np.ascontiguousarray(src, dtype=np.int64),
            np.ascontiguousarray(col, dtype=np.int64),
            val,
            arg,
        )
    except Exception:
        _failed("min-plus step")
        return None
    return val, arg


def _failed(what: str) -> None:
    """Log a kernel failure once and stop using numba in this process."""
    log.exception("compiled %s failed: using scipy and numpy from now on", what)
    _state["kernel"] = None


def _index_table(next_hop: IntArray, n: int) -> IntArray | None:
    """``next_hop`` as C-contiguous int64 if it is an n × n table of indices below n,
    else None: the numpy code raises (IndexError) or broadcasts on the others, and the
    kernels do not check bounds."""
    nh = np.asarray(next_hop)
    if nh.shape != (n, n) or not np.issubdtype(nh.dtype, np.integer):
        return None
    if n and int(nh.max()) >= n:
        return None
    return np.ascontiguousarray(nh, dtype=np.int64)


def reduce_table(
    next_hop: IntArray, edge: FloatArray, how: Literal["sum", "min"]
) -> FloatArray | None:
    """``tables.reduce_paths`` by the kernel: the same floats, to the bit (~3x faster at
    1000 nodes), or None (use numpy) without numba, for inputs it does not take
    (float32 edges in the masked way, out-of-range next hops, odd shapes) or if it fails.

    Same floats because each destination column folds in the same values in the same
    order as the whole-matrix pointer doubling (not a sequential walk, whose sums would
    be associated differently): see ``_fw_numba.reduce_paths``.
    """
    k = _kernel()
    n = next_hop.shape[0] if next_hop.ndim == 2 else -1
    if k is None or n <= 0 or how not in ("sum", "min"):
        return None
    nh = _index_table(next_hop, n)
    e = np.asarray(edge)
    if nh is None or e.shape != (n, n):
        return None
    masked = not (how == "sum" and np.min(e) > -math.inf)  # as reduce_paths chooses
    if masked and e.dtype != np.float64:  # numpy would fold in e's own dtype
        return None
    rounds = max(1, math.ceil(math.log2(n))) + 1
    try:
        out: FloatArray = k.reduce_paths(
            nh, np.ascontiguousarray(e, dtype=np.float64), how == "min", masked, rounds
        )
    except Exception:
        _failed("path reduction")
        return None
    return out


def backup_table(
    dist: FloatArray,
    weights: FloatArray,
    next_hop: IntArray,
    srcs: IntArray,
    dist_t: FloatArray | None,
    constants: tuple[float, float, float],
) -> IntArray | None:
    """``backup._backup_next_hops`` by the kernel (the same array, ~5x faster at 1000
    nodes), or None (use numpy) without numba, for inputs it does not take or if it fails.

    ``constants``: backup.py's (_TOL_MS, _HUGE, _REJECT). The kernel computes the numpy
    code's keys with the same float operations; it takes float64 inputs without NaN or
    -inf (where a NaN key could appear and numpy's argmin would pick it).
    """
    k = _kernel()
    n = dist.shape[0] if dist.ndim == 2 else -1
    if k is None or n < 2:
        return None
    nh = _index_table(next_hop, n)
    arrays = [dist, weights] if dist_t is None else [dist, weights, dist_t]
    if nh is None or any(a.shape != (n, n) or a.dtype != np.float64 for a in arrays):
        return None
    if not (np.min(dist) > -math.inf and np.min(weights) > -math.inf):  # NaN fails too
        return None
    dt = np.ascontiguousarray(dist.T) if dist_t is None else np.ascontiguousarray(dist_t)
    fin = dist[np.isfinite(dist)]
    far = 2.0 * float(fin.max(initial=0.0)) + 1.0  # as _backup_next_hops
    out = np.full((n, n), NO_ROUTE, dtype=np.int64)
    tol, huge, reject = constants
    try:
        k.backup_next_hops(
            np.ascontiguousarray(dist),
            dt,
            np.ascontiguousarray(weights),
            nh,
            np.ascontiguousarray(srcs, dtype=np.int64),
            far,
            tol,
            huge,
            reject,
            out,
        )
    except Exception:
        _failed("backup next hops")
        return None
    return out


def floyd_warshall(
    weights: FloatArray, *, block: int = BLOCK
) -> tuple[FloatArray, IntArray] | None:
    """(dist, next_hop) over dense ``weights`` (inf = no edge, all >= 0), or None.

    ``next_hop[s, d]`` is s's neighbour on the shortest path to d, s on the
    diagonal, ``NO_ROUTE`` if d is unreachable; ``dist[s, d]`` its length.
    None if numba is missing or the kernel failed (logged): use scipy then.
    ``block``: the tile edge (tests use small ones to cover every tile phase).
    """
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    k = _kernel()
    if k is None:
        return None
    d = np.array(weights, dtype=np.float64, order="C", copy=True)
    n = d.shape[0]
    np.fill_diagonal(d, 0.0)
    cols = np.arange(n, dtype=np.int64)
    nh = np.where(np.isfinite(d), cols[None, :], np.int64(NO_ROUTE))
    np.fill_diagonal(nh, cols)
    try:
        k.floyd_warshall_next_hops(d, nh, block)
    except Exception:
        log.exception("compiled Floyd-Warshall failed: using scipy from now on")
        _state["kernel"] = None
        return None
    return d, nh
