"""Backup next hops: loop-free alternates (RFC 5286) for local fail-over.

When s's primary next hop p stops answering, s can switch to its backup m at
once, before any new routes arrive, *if* m's own (old) route to d does not
lead back through s. With the engine's distances D (over the same perturbed,
relay-folded weights the primaries minimise, so shortest paths are unique):

* m is a **loop-free alternate** for (s, d) iff D(m,d) < D(m,s) + D(s,d):
  then s is not on m's path to d, so the detour never uses the failed link s→p.
* m is **node-protecting** iff also D(m,d) < D(m,p) + D(p,d): m's path avoids
  p altogether, so the detour survives p itself failing. (When p == d only
  link protection is possible.)

Among node-protecting alternates the lowest W(s,m) + D(m,d) wins, otherwise
the lowest link-protecting one. Inequalities are tested with a small margin
(``_TOL_MS``), so rounding can only ever drop a valid alternate, never accept
one whose path goes through s or p.

Cost: the test is O(n³) in total. It runs one source at a time over blocks of
destinations small enough to stay in cache (≈1.5 ms per source at n = 1,000);
the node-protection search only revisits the pairs whose cheapest alternate is
not already node-protecting. From ``compiled.COMPILED_MIN_N`` nodes a numba kernel
(``_fw_numba.backup_next_hops``) computes the same keys with the same float
operations, candidate by candidate over every destination at once, and returns
the same array ~5x faster.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from meshopt.errors import InputError
from meshopt.routing import compiled
from meshopt.routing.allpairs import compute_routes, prepare_weights
from meshopt.routing.tables import NO_ROUTE, FloatArray, IntArray, RouteTables

_TOL_MS = 1e-7
_BLOCK = 128
# A violated LFA inequality is violated by at least one ulp of a distance (>= ~1e-23
# given the positive tie perturbation), so times _HUGE it lands above _REJECT.
_HUGE = 1e300
_REJECT = 1e200


def _checked_dist(
    tables: RouteTables, link_cost: FloatArray, relay_hop_ms: float, w: FloatArray
) -> FloatArray:
    """The tables' distance matrix, after checking it belongs to these weights ``w``."""
    if tables.dist is None:
        fresh = compute_routes(link_cost, relay_hop_ms=relay_hop_ms, symmetric=tables.symmetric)
        if not np.array_equal(fresh.next_hop, tables.next_hop):
            raise ValueError("tables were not computed from this link_cost and relay_hop_ms")
        assert fresh.dist is not None
        return fresh.dist
    dist = tables.dist
    n = w.shape[0]
    nh = tables.next_hop
    if dist.shape != (n, n) or nh.shape != (n, n):
        raise ValueError("tables and link_cost differ in size")
    reach = (nh >= 0) & ~np.eye(n, dtype=bool)
    s, d = np.nonzero(reach)
    p = nh[s, d]
    via = w[s, p] + dist[p, d]
    # Primaries must be shortest over these weights, and no direct link may beat them
    # (catches a link that got cheaper since; a full optimality check would be O(n³)).
    fin = np.isfinite(dist)
    margin = np.where(fin, dist - 1e-9 * (1.0 + np.abs(np.where(fin, dist, 0.0))), np.inf)
    direct_ok = not (w < margin).any()
    if not (direct_ok and np.allclose(via, dist[s, d], rtol=1e-9, atol=1e-9)):
        raise ValueError("tables were not computed from this link_cost and relay_hop_ms")
    return dist


def backup_next_hops(
    dist: FloatArray,
    weights: FloatArray,
    next_hop: IntArray,
    sources: Sequence[int] | IntArray | None = None,
    *,
    dist_t: FloatArray | None = None,
) -> IntArray:
    """Loop-free alternate for every pair, from distances and the weights behind them.

    ``weights`` are the (perturbed, relay-folded) edge weights that ``dist``
    and ``next_hop`` are shortest paths over; inf means no link.

    ``sources`` limits the work to those rows (source nodes): each row costs
    O(n²), so a caller needing a few rows (local fail-over) skips the O(n³)
    total. Computed rows equal the full computation's exactly; the other rows
    are all ``NO_ROUTE``. None means every row. ``dist_t``: ``dist`` transposed, as a
    C-contiguous array, for a caller asking for a few rows at a time of the same
    tables (the transpose is the O(n²) part of each call).

    From ``compiled.COMPILED_MIN_N`` nodes a numba kernel gives the same array
    (~0.5 s instead of ~2.5-3 s of CPU for every row at 1000 nodes, measured with
    scripts/bench_kernels.py); numpy without numba.
    """
    n = dist.shape[0]
    if sources is None:
        srcs = np.arange(n, dtype=np.int64)
    else:
        srcs = np.unique(np.asarray(sources, dtype=np.int64).reshape(-1))
        if srcs.size and (srcs[0] < 0 or srcs[-1] >= n):
            raise InputError(f"backup sources must be row indices in [0, {n})")
    if compiled.use_compiled(n, None):
        fast = compiled.backup_table(
            dist, weights, next_hop, srcs, dist_t, (_TOL_MS, _HUGE, _REJECT)
        )
        if fast is not None:
            return fast
    with np.errstate(over="ignore"):  # the _HUGE products overflow to inf on purpose
        return _backup_next_hops(dist, weights, next_hop, srcs, dist_t)


def _backup_next_hops(
    dist: FloatArray,
    weights: FloatArray,
    next_hop: IntArray,
    srcs: IntArray,
    dist_t: FloatArray | None = None,
) -> IntArray:
    n = dist.shape[0]
    out = np.full((n, n), NO_ROUTE, dtype=np.int64)
    if n < 2:
        return out
    dt = np.ascontiguousarray(dist.T) if dist_t is None else dist_t  # dt[d, m] = D(m, d)
    bd = min(_BLOCK, n)
    u = np.empty((bd, n))
    t = np.empty((bd, n))
    rows = np.arange(bd)
    best = np.empty(n, dtype=np.int64)
    best_val = np.empty(n)
    todo_s: list[IntArray] = []
    todo_d: list[IntArray] = []
    # D(m,s) = inf (m cannot reach s) makes m loop-free for s whatever it does;
    # a finite stand-in larger than any distance keeps that true and avoids inf - inf.
    fin = dist[np.isfinite(dist)]
    far = 2.0 * float(fin.max(initial=0.0)) + 1.0
    for s in srcs.tolist():
        # key(d, m) = W(s,m) + D(m,d) for loop-free m, computed as
        # (D(m,d) - D(m,s)) + (W(s,m) + D(m,s)) to share the LFA test's difference.
        # Non-LFA m get max(key, (D(m,d) - D(m,s) - lim) * 1e300) >= _REJECT: a
        # multiply and a max run at full speed where a masked store (putmask) does not.
        dts = np.where(np.isfinite(dt[s]), dt[s], far)
        lift = weights[s] + dts
        lim = np.where(np.isfinite(dist[s]), dist[s] - _TOL_MS, 0.0)  # unreachable: unused
        prim = next_hop[s]
        for d0 in range(0, n, bd):
            d1 = min(n, d0 + bd)
            k = d1 - d0
            uk, tk = u[:k], t[:k]
            np.subtract(dt[d0:d1], dts, out=uk)
            np.subtract(uk, lim[d0:d1, None], out=tk)
            np.multiply(tk, _HUGE, out=tk)
            np.add(uk, lift, out=uk)
            np.maximum(uk, tk, out=uk)
            pk = prim[d0:d1]
            ok = pk >= 0
            uk[rows[:k][ok], pk[ok]] = np.inf
            arg = uk.argmin(axis=1)
            best[d0:d1] = arg
            best_val[d0:d1] = uk[rows[:k], arg]
        found = (best_val < _REJECT) & (prim >= 0)
        found[s] = False
        dd = np.flatnonzero(found)
        b = best[dd]
        out[s, dd] = b
        # Is the cheapest alternate already node-protecting? (p == d: nothing to protect.)
        p = prim[dd]
        with np.errstate(invalid="ignore"):
            protects = dt[dd, b] - dt[p, b] < dist[p, dd] - _TOL_MS
        retry = (p != dd) & ~protects
        if retry.any():
            todo_s.append(np.full(int(retry.sum()), s, dtype=np.int64))
            todo_d.append(dd[retry])
    if todo_s:
        _node_protecting(
            dist, dt, weights, next_hop, np.concatenate(todo_s), np.concatenate(todo_d), out
        )
    return out


def _node_protecting(
    dist: FloatArray,
    dt: FloatArray,
    weights: FloatArray,
    next_hop: IntArray,
    src: IntArray,
    dst: IntArray,
    out: IntArray,
) -> None:
    """For the listed pairs, replace the backup by the best node-protecting LFA, if any."""
    for i0 in range(0, src.size, _BLOCK):
        s, d = src[i0 : i0 + _BLOCK], dst[i0 : i0 + _BLOCK]
        p = next_hop[s, d]
        dtd = dt[d]
        with np.errstate(invalid="ignore"):  # inf - inf: m reaches neither, never chosen
            lfa = dtd - dt[s] < (dist[s, d] - _TOL_MS)[:, None]
            node = dtd - dt[p] < (dist[p, d] - _TOL_MS)[:, None]
        key = np.where(lfa & node, weights[s] + dtd, np.inf)
        key[np.arange(s.size), p] = np.inf
        arg = key.argmin(axis=1)
        hit = np.isfinite(key[np.arange(s.size), arg])
        out[s[hit], d[hit]] = arg[hit]


def add_backups(
    tables: RouteTables,
    link_cost: FloatArray,
    *,
    relay_hop_ms: float = 2.0,
    sources: Sequence[int] | IntArray | None = None,
) -> RouteTables:
    """A copy of ``tables`` with ``backup`` filled in (``NO_ROUTE`` where none exists).

    ``tables`` must come from ``compute_routes`` on the same ``link_cost`` and
    ``relay_hop_ms`` (its symmetric mode is taken from the tables); the
    alternates are only loop-free relative to those primaries. ``sources``
    as in ``backup_next_hops``: rows outside it are all ``NO_ROUTE``.
    """
    dist, weights = backup_inputs(tables, link_cost, relay_hop_ms=relay_hop_ms)
    backup = backup_next_hops(dist, weights, tables.next_hop, sources)
    return dataclasses.replace(tables, backup=backup, dist=dist)


def backup_inputs(
    tables: RouteTables, link_cost: FloatArray, *, relay_hop_ms: float = 2.0
) -> tuple[FloatArray, FloatArray]:
    """``(dist, weights)`` for ``backup_next_hops``, checked against ``tables``.

    Lets a caller that fills rows in several calls pay the O(n²) check once.
    """
    _, weights = prepare_weights(link_cost, relay_hop_ms, tables.symmetric)
    return _checked_dist(tables, link_cost, relay_hop_ms, weights), weights
