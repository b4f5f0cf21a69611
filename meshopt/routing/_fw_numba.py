"""The numba kernels behind ``meshopt.routing.compiled``: import that module, not this one.

Floyd–Warshall with next hops (below), the path sums and minima of
``tables.reduce_paths`` (``reduce_paths``) and the loop-free alternates of
``backup`` (``backup_next_hops``); each gives the same values as the numpy code
it replaces, not merely close ones (see their docstrings for how).

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
import numpy.typing as npt

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


@_jit(inline="always")
def _combine(a: float, b: float, is_min: bool) -> float:
    """One step of reduce_paths's fold: ``np.add`` or ``np.minimum`` (NaN and
    signed zeros as numpy's: minimum returns b unless a < b or a is NaN)."""
    if is_min:
        return a if (a < b or a != a) else b
    return a + b


@_jit(inline="always")
def _same(a: float, b: float) -> bool:
    """a and b are the same float: equal with the same sign, or both NaN."""
    if a != a:
        return b != b
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


@_jit()
def _reduce_column(
    nh: IntArray,
    edge: FloatArray,
    out: FloatArray,
    d: int,
    is_min: bool,
    masked: bool,
    rounds: int,
    exact_rounds: int,
    from_out: bool,
    val: FloatArray,
    val2: FloatArray,
    jmp: IntArray,
    jmp2: IntArray,
    bad: npt.NDArray[np.bool_],
    bad2: npt.NDArray[np.bool_],
) -> tuple[int, bool]:
    """Column d of reduce_paths: pointer doubling over this destination only.

    The same folds in the same order as the whole-matrix rounds (each round folds in
    the partial value of the node reached, as read before the round), so every value
    is the same float. Stops once every walk has arrived (``exact_rounds`` < 0) or
    after exactly ``exact_rounds`` rounds. ``from_out``: ``out[:, d]`` already holds
    the first gather (``edge[s, nh[s, d]]``). Returns (rounds run, whether a further
    round would change the column): the matrix code keeps running rounds while any
    other column still walks, and those rounds can change an arrived column when
    d's own value is not the identity (an odd diagonal).
    """
    n = nh.shape[0]
    ident = math.inf if is_min else 0.0
    fail = 0.0 if is_min else math.inf
    for s in range(n):
        h = nh[s, d]
        if h >= 0:
            jmp[s] = h
            val[s] = out[s, d] if from_out else edge[s, h]
            bad[s] = False
        else:
            jmp[s] = d
            val[s] = ident if masked else math.inf
            bad[s] = masked
    if masked:
        val[d] = ident
    else:  # _sum_paths: the diagonal is 0, or inf if it is NO_ROUTE
        val[d] = 0.0 if nh[d, d] >= 0 else math.inf
    r = 0
    while r < rounds:
        if exact_rounds < 0:
            done = True
            for s in range(n):
                if jmp[s] != d:
                    done = False
                    break
            if done:
                break
        elif r >= exact_rounds:
            break
        for s in range(n):
            j = jmp[s]
            val2[s] = _combine(val[s], val[j], is_min)
            jmp2[s] = jmp[j]
            bad2[s] = bad[s] or bad[j]
        val, val2 = val2, val
        jmp, jmp2 = jmp2, jmp
        bad, bad2 = bad2, bad
        r += 1
    arrived = True
    for s in range(n):
        if jmp[s] != d:
            arrived = False
            break
    more = False
    if arrived:  # a further round: val[s] = op(val[s], val[d]), bad[s] |= bad[d]
        vd = val[d]
        more = masked and bad[d]
        for s in range(n):
            if not _same(_combine(val[s], vd, is_min), val[s]):
                more = True
                break
    for s in range(n):
        out[s, d] = fail if (jmp[s] != d or bad[s]) else val[s]
    return r, more


@_jit()
def reduce_paths(
    nh: IntArray, edge: FloatArray, is_min: bool, masked: bool, rounds: int
) -> FloatArray:
    """``tables.reduce_paths``, the same floats, one destination column at a time.

    ``masked``: the general way (``_reduce_masked``), else ``_sum_paths``'s (sum over
    edges without NaN or -inf). ``rounds``: reduce_paths's ceil(log2 n) + 1. The
    matrix code runs its rounds until every column has arrived; a column that arrived
    earlier and whose value a further round would change (see ``_reduce_column``) is
    computed again with exactly that many rounds.
    """
    n = nh.shape[0]
    out = np.empty((n, n))
    for s in range(n):  # the first gather row by row: edge's row s stays in cache
        for d in range(n):
            h = nh[s, d]
            out[s, d] = edge[s, h] if h >= 0 else 0.0
    val = np.empty(n)
    val2 = np.empty(n)
    jmp = np.empty(n, np.int64)
    jmp2 = np.empty(n, np.int64)
    bad = np.empty(n, np.bool_)
    bad2 = np.empty(n, np.bool_)
    ran = np.empty(n, np.int64)
    more = np.empty(n, np.bool_)
    for d in range(n):
        ran[d], more[d] = _reduce_column(
            nh, edge, out, d, is_min, masked, rounds, -1, True, val, val2, jmp, jmp2, bad, bad2
        )
    total = 0
    for d in range(n):
        total = max(total, ran[d])
    for d in range(n):
        if more[d] and ran[d] < total:
            _reduce_column(
                nh,
                edge,
                out,
                d,
                is_min,
                masked,
                rounds,
                total,
                False,
                val,
                val2,
                jmp,
                jmp2,
                bad,
                bad2,
            )
    return out


@_jit()
def _lfa_update(
    row: FloatArray,
    dms: float,
    lift: float,
    m: int,
    lim: FloatArray,
    prim: npt.NDArray[np.int32],
    huge: float,
    best: FloatArray,
    arg: npt.NDArray[np.int32],
) -> None:
    """Fold candidate m into every destination's running argmin, for one source s.

    ``row`` is D(m, ·); the key is backup.py's max(u + lift, (u - lim) * huge) with
    u = D(m, d) - D(m, s), the same operations, so the same floats (no NaN can
    arise: the caller checks for NaN and -inf inputs). m ascends and only a strictly
    lower key replaces the incumbent: numpy's argmin, which takes the first minimum.
    m == p (the primary, numpy's inf) never enters. Selects, no branches: vectorised.
    """
    for d in range(row.shape[0]):
        u = row[d] - dms
        t = (u - lim[d]) * huge
        v = u + lift
        k = v if v > t else t
        b = best[d]
        take = (k < b) & (prim[d] != m)
        best[d] = k if take else b
        arg[d] = np.int32(m) if take else arg[d]


@_jit()
def _node_protecting_one(
    dist: FloatArray, dt: FloatArray, ws: FloatArray, s: int, d: int, p: int, tol: float
) -> int:
    """backup._node_protecting for one pair: the first cheapest m that is loop-free
    and avoids p (the same comparisons; NaN from inf - inf fails them, as there);
    -1 if none has a finite key."""
    lim_s = dist[s, d] - tol
    lim_p = dist[p, d] - tol
    rd = dt[d]
    rs = dt[s]
    rp = dt[p]
    best = math.inf
    arg = -1
    for m in range(rd.shape[0]):
        if m == p:
            continue
        x = rd[m]
        if x - rs[m] < lim_s and x - rp[m] < lim_p:
            k = ws[m] + x
            if k < best:
                best = k
                arg = m
    return arg


@_jit()
def backup_next_hops(
    dist: FloatArray,
    dt: FloatArray,
    weights: FloatArray,
    next_hop: IntArray,
    srcs: IntArray,
    far: float,
    tol: float,
    huge: float,
    reject: float,
    out: IntArray,
) -> None:
    """``backup._backup_next_hops`` into ``out`` (all NO_ROUTE on entry).

    Candidate-major: for each m, one pass over all destinations updates their running
    argmin (``_lfa_update``), a vector loop, where the numpy code builds a block of
    keys and reduces each row. Sources go in blocks of ``sb`` so that each row of
    ``dist`` is read once per block. Then per (s, d) the alternate found below
    ``reject`` and, if it does not protect p (p != d), the node-protecting search
    at once (numpy defers it; each pair reads only the inputs, so the order does not
    matter). ``dt`` must be ``dist`` transposed (as numpy's dist_t). For inputs
    without NaN or -inf (the caller checks). The running argmins and a copy of the
    primaries are int32 (n < 2**31): the vector loop is bound by memory traffic, and
    this cut its time by ~15 %. Only pairs with a primary (>= 0, read as int64 here)
    use that copy, so a next hop below -2**31 cannot wrap into a real index.
    """
    n = dist.shape[0]
    nsrc = srcs.shape[0]
    sb = 16
    best = np.empty((sb, n))
    arg = np.empty((sb, n), np.int32)
    prim = np.empty((sb, n), np.int32)
    lim = np.empty((sb, n))
    for b0 in range(0, nsrc, sb):
        k = min(nsrc, b0 + sb) - b0
        for i in range(k):
            s = srcs[b0 + i]
            for d in range(n):
                best[i, d] = math.inf
                arg[i, d] = 0
                prim[i, d] = next_hop[s, d]
                x = dist[s, d]
                lim[i, d] = x - tol if x < math.inf else 0.0
        for m in range(n):
            row = dist[m]
            for i in range(k):
                s = srcs[b0 + i]
                dms = row[s] if row[s] < math.inf else far
                _lfa_update(
                    row, dms, weights[s, m] + dms, m, lim[i], prim[i], huge, best[i], arg[i]
                )
        for i in range(k):
            s = srcs[b0 + i]
            for d in range(n):
                p = next_hop[s, d]
                if p < 0 or d == s or not best[i, d] < reject:
                    continue
                b = arg[i, d]
                out[s, d] = b
                if p != d and not (dt[d, b] - dt[p, b] < dist[p, d] - tol):
                    alt = _node_protecting_one(dist, dt, weights[s], s, d, p, tol)
                    if alt >= 0:
                        out[s, d] = alt


@_jit()
def min_plus(
    pert: FloatArray,
    cols_t: FloatArray,
    src: IntArray,
    col: IntArray,
    val: FloatArray,
    arg: IntArray,
) -> None:
    """For each entry e: ``val[e] = min_k pert[src[e], k] + cols_t[col[e], k]`` and its
    argument, as numpy's ``argmin`` over the row of sums picks it: the first minimum,
    or the first NaN where there is one (the urgent path's re-step of moved entries).
    ``cols_t``: the distance columns transposed, so both operands are read along rows."""
    n = pert.shape[1]
    for e in range(src.shape[0]):
        p = pert[src[e]]
        c = cols_t[col[e]]
        best = p[0] + c[0]
        at = 0
        if best == best:  # not NaN
            for k in range(1, n):
                v = p[k] + c[k]
                if v != v:
                    best = v
                    at = k
                    break
                if v < best:
                    best = v
                    at = k
        val[e] = best
        arg[e] = at


def warm_up() -> None:
    """Compile (or load from the cache) for the array types used: a 3-node run."""
    d = np.zeros((3, 3))
    nh = np.zeros((3, 3), dtype=np.int64)
    floyd_warshall_next_hops(d, nh, 2)
    sum_paths(nh, d, 3)
    reduce_paths(nh, d, False, False, 3)
    backup_next_hops(d, d, d, nh, np.arange(3), 1.0, 1e-7, 1e300, 1e200, nh.copy())
    min_plus(d, d, np.arange(3), np.arange(3), np.zeros(3), np.zeros(3, dtype=np.int64))
