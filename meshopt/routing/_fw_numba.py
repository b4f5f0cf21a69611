"""The numba kernel behind ``meshopt.routing.compiled``: import that module, not this one.

Importing this module imports numba (~0.3 s of CPU) and the first call in a
fresh cache compiles the kernel (~1-2 s); ``cache=True`` keeps the machine
code on disk, so later processes only load it. ``compiled`` imports this
lazily and only for meshes large enough to repay that.

Blocked Floyd–Warshall over next hops (not predecessors): ``nh[i, j]`` is
i's next hop towards j, and when the path through k wins, ``nh[i, j]``
becomes ``nh[i, k]``, one scalar per (i, k) row instead of a row of
predecessors to load. The matrix is cut into ``block`` × ``block`` tiles; for
each block of pivots K the diagonal tile is closed first, then the tiles in
K's rows and columns, then every other tile from those (the classic
three-phase scheme, Venkataraman et al. 2003). Within a tile each (i, j)
still takes its pivots k in increasing order with a strict ``<``, as in the
textbook loop; only which rows and columns have already absorbed the other
pivots of K differs, and every value compared is the length of a real path,
so the result is the same set of shortest paths.

The inner loop first checks a whole tile row for any improvement (vector
adds and compares, no stores) and only then updates it element by element:
after the first few pivot blocks almost no row improves, and unconditional
or masked vector stores cost more than the check.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

import numba
import numpy as np

from meshopt.routing.tables import FloatArray, IntArray

F = TypeVar("F", bound=Callable[..., Any])


def _jit(**options: Any) -> Callable[[F], F]:
    """``numba.njit`` with a typed signature (numba has no type stubs)."""

    def wrap(fn: F) -> F:
        out: F = numba.njit(cache=True, boundscheck=False, nogil=True, **options)(fn)
        return out

    return wrap


@_jit(inline="always")
def _relax_row(di: FloatArray, ni: IntArray, dk: FloatArray, dik: float, hik: int) -> None:
    """di[j] = min(di[j], dik + dk[j]); where it falls, ni[j] = hik (strict <)."""
    hit = False
    for j in range(di.shape[0]):
        hit |= dik + dk[j] < di[j]
    if hit:
        for j in range(di.shape[0]):
            c = dik + dk[j]
            if c < di[j]:
                di[j] = c
                ni[j] = hik


@_jit()
def _tile_in_order(
    d: FloatArray, nh: IntArray, i0: int, i1: int, j0: int, j1: int, k0: int, k1: int
) -> None:
    """Pivots k0..k1 over tile [i0:i1, j0:j1], pivot-major (the tile may hold pivot rows)."""
    for k in range(k0, k1):
        dk = d[k, j0:j1]
        for i in range(i0, i1):
            dik = d[i, k]
            if dik < math.inf:
                _relax_row(d[i, j0:j1], nh[i, j0:j1], dk, dik, nh[i, k])


@_jit()
def _tile_from_closed(
    d: FloatArray, nh: IntArray, i0: int, i1: int, j0: int, j1: int, k0: int, k1: int
) -> None:
    """Pivots k0..k1 over a tile outside the pivot rows and columns, row-major.

    d[i, k] and d[k, j] are final for this pivot block, so rows are independent.
    """
    for i in range(i0, i1):
        di = d[i, j0:j1]
        ni = nh[i, j0:j1]
        for k in range(k0, k1):
            dik = d[i, k]
            if dik < math.inf:
                _relax_row(di, ni, d[k, j0:j1], dik, nh[i, k])


@_jit()
def floyd_warshall_next_hops(d: FloatArray, nh: IntArray, block: int) -> None:
    """In place: ``d`` edge weights → path lengths, ``nh`` direct next hops → next hops.

    On entry ``d`` has 0 on the diagonal and inf for "no edge", ``nh[i, j]``
    is j where there is an edge, i on the diagonal and -1 elsewhere.
    """
    n = d.shape[0]
    nb = (n + block - 1) // block
    for kb in range(nb):
        k0 = kb * block
        k1 = min(n, k0 + block)
        _tile_in_order(d, nh, k0, k1, k0, k1, k0, k1)
        for jb in range(nb):
            if jb != kb:
                _tile_in_order(d, nh, k0, k1, jb * block, min(n, jb * block + block), k0, k1)
        for ib in range(nb):
            if ib != kb:
                _tile_in_order(d, nh, ib * block, min(n, ib * block + block), k0, k1, k0, k1)
        for ib in range(nb):
            if ib == kb:
                continue
            i0 = ib * block
            i1 = min(n, i0 + block)
            for jb in range(nb):
                if jb != kb:
                    _tile_from_closed(d, nh, i0, i1, jb * block, min(n, jb * block + block), k0, k1)


@_jit()
def sum_paths(nh: IntArray, edge: FloatArray, rounds: int) -> FloatArray:
    """``tables.reduce_paths(nh, edge, "sum")``, one destination at a time.

    The same pointer doubling, with the same additions in the same order (each
    round adds the partial sum of the node reached, as read before the round), but
    a destination's column fits in L1 and stops once all of its paths arrived: ~3x
    faster. For ``nh`` with s on the diagonal only (then a finished path adds the
    diagonal's 0.0 per further round, which changes no value) and ``edge`` without
    NaN or -inf; ``rounds``: reduce_paths's ceil(log2 n) + 1.
    """
    n = nh.shape[0]
    out = np.empty((n, n))
    val = np.empty(n)
    val2 = np.empty(n)
    jmp = np.empty(n, np.int64)
    jmp2 = np.empty(n, np.int64)
    for d in range(n):
        for s in range(n):
            h = nh[s, d]
            if h < 0:
                jmp[s] = d
                val[s] = math.inf
            else:
                jmp[s] = h
                val[s] = edge[s, h]
        val[d] = 0.0 if nh[d, d] >= 0 else math.inf
        for _ in range(rounds):
            done = True
            for s in range(n):
                if jmp[s] != d:
                    done = False
                    break
            if done:
                break
            for s in range(n):
                j = jmp[s]
                val2[s] = val[s] + val[j]
                jmp2[s] = jmp[j]
            val, val2 = val2, val
            jmp, jmp2 = jmp2, jmp
        for s in range(n):
            out[s, d] = val[s] if jmp[s] == d else math.inf
    return out


def warm_up() -> None:
    """Compile (or load from the cache) for the array types used: a 3-node run."""
    d = np.zeros((3, 3))
    nh = np.zeros((3, 3), dtype=np.int64)
    floyd_warshall_next_hops(d, nh, 2)
    sum_paths(nh, d, 3)
