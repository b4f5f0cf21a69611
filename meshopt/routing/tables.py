"""Next-hop tables: the output of every route computation, and what agents install."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

NO_ROUTE = -1


@dataclass
class RouteTables:
    """All-pairs routes in node-index space.

    ``next_hop[s, d]`` is the neighbour s forwards to for destination d
    (``NO_ROUTE`` if unreachable, ``s`` on the diagonal); ``cost[s, d]`` is the
    metric cost of that path in ms, relay-hop costs included, inf if unreachable.
    ``backup[s, d]`` is a loop-free alternate next hop or ``NO_ROUTE``.

    ``dist`` is what the next hops actually minimise: path lengths over the
    tie-perturbed weights with one relay-hop cost per edge (not subtracted).
    The engine keeps it so that backups and incremental updates reason about
    exactly the same unique shortest paths; ``symmetric`` records the mode the
    weights were built in. Tables built elsewhere leave both at their defaults.
    """

    names: list[str]
    cost: FloatArray
    next_hop: IntArray
    backup: IntArray | None = None
    dist: FloatArray | None = None
    symmetric: bool = False

    @property
    def n(self) -> int:
        return len(self.names)

    def index(self, name: str) -> int:
        return self.names.index(name)

    def path(self, s: int, d: int) -> list[int]:
        """Node indices from s to d following next hops; [] if unreachable."""
        if s == d:
            return [s]
        out = [s]
        cur = s
        while cur != d:
            cur = int(self.next_hop[cur, d])
            if cur == NO_ROUTE or len(out) > self.n:
                return []
            out.append(cur)
        return out

    def path_names(self, a: str, b: str) -> list[str]:
        return [self.names[i] for i in self.path(self.index(a), self.index(b))]

    def relayed(self) -> npt.NDArray[np.bool_]:
        """Mask of pairs whose route goes through at least one relay."""
        d = np.arange(self.n)[None, :]
        mask: npt.NDArray[np.bool_] = (self.next_hop != d) & (self.next_hop != NO_ROUTE)
        return mask


def walk_costs(next_hop: IntArray, link: FloatArray, max_hops: int | None = None) -> FloatArray:
    """Sum ``link`` along every next-hop path (inf if a path is broken or loops).

    Vectorised: one gather over all pairs per hop, so the cost is
    O(n² · longest path), not a Python loop per pair.
    """
    n = next_hop.shape[0]
    dest = np.broadcast_to(np.arange(n)[None, :], (n, n))
    cur = np.broadcast_to(np.arange(n)[:, None], (n, n)).copy()
    acc = np.zeros((n, n))
    done = cur == dest
    for _ in range(max_hops if max_hops is not None else n):
        if done.all():
            break
        nxt = next_hop[cur, dest]
        broken = (nxt == NO_ROUTE) & ~done
        safe = np.where(nxt == NO_ROUTE, cur, nxt)
        acc = np.where(done, acc, acc + link[cur, safe])
        acc[broken] = np.inf
        done = done | broken
        cur = np.where(done, cur, safe)
        done = done | (cur == dest)
    acc[~done] = np.inf
    return acc


def relay_weights(link_cost: FloatArray, relay_hop_ms: float) -> FloatArray:
    """Each link's cost as a next-hop walk pays it, one relay hop included, and zero on
    the diagonal where the walk ends. A path of k hops then sums k relay hops where it
    pays k - 1: the caller takes the last one off (:func:`less_one_relay`)."""
    w = np.asarray(link_cost, dtype=np.float64) + relay_hop_ms
    np.fill_diagonal(w, 0.0)
    return w


def less_one_relay(
    path_cost: FloatArray, relay_hop_ms: float, cols: IntArray | None = None
) -> FloatArray:
    """Path costs summed over :func:`relay_weights` with the relay hop too many taken off
    where a path is finite (a k-hop path pays k - 1); ``cols``: ``path_cost`` holds only
    those destinations' columns."""
    dest = np.arange(path_cost.shape[1]) if cols is None else cols
    off = (np.arange(path_cost.shape[0])[:, None] != dest[None, :]) & np.isfinite(path_cost)
    out: FloatArray = np.where(off, path_cost - relay_hop_ms, path_cost)
    return out


def reduce_paths(
    next_hop: IntArray, edge: FloatArray, how: Literal["sum", "min"] = "sum"
) -> FloatArray:
    """Sum (or minimum) of ``edge`` along every next-hop path, by pointer doubling.

    Each round joins every pair's partial path with the partial path of the
    node it has reached, so ⌈log2 n⌉ rounds of O(n²) gathers cover any
    loop-free table, however long its paths (``walk_costs`` needs one round
    per hop). Unreachable, broken or looping pairs get inf for "sum" and 0
    for "min"; the diagonal gets 0 for "sum" and inf for "min".

    From ``compiled.COMPILED_MIN_N`` nodes a numba kernel computes the same
    floats, one destination at a time (~3x faster at 1000 nodes: the controller
    calls this some 20 times per recompute); numpy without numba.
    """
    n = next_hop.shape[0]
    if n == 0:
        return np.zeros((0, 0))
    from meshopt.routing import compiled  # here: compiled imports this module

    if compiled.use_compiled(n, None):
        fast = compiled.reduce_table(next_hop, edge, how)
        if fast is not None:
            return fast
    return _reduce_numpy(next_hop, edge, how)


def _reduce_numpy(
    next_hop: IntArray, edge: FloatArray, how: Literal["sum", "min"] = "sum"
) -> FloatArray:
    """``reduce_paths`` in numpy: the reference the kernel matches, and its fallback."""
    n = next_hop.shape[0]
    if n == 0:
        return np.zeros((0, 0))
    if how == "sum" and np.min(edge) > -math.inf:  # False for NaN too
        return _sum_paths(next_hop, np.asarray(edge, dtype=np.float64))
    return _reduce_masked(next_hop, edge, how)


def _reduce_masked(next_hop: IntArray, edge: FloatArray, how: Literal["sum", "min"]) -> FloatArray:
    """The general case of ``reduce_paths``: failures tracked in a mask of their own."""
    n = next_hop.shape[0]
    ident = 0.0 if how == "sum" else math.inf
    fail = math.inf if how == "sum" else 0.0
    op = np.add if how == "sum" else np.minimum
    col = np.broadcast_to(np.arange(n, dtype=np.int64)[None, :], (n, n))
    row = np.arange(n, dtype=np.int64)[:, None]
    reach = next_hop >= 0
    jump = np.where(reach, next_hop, col).astype(np.int64)
    val = np.where(reach, edge[row, jump], ident)
    np.fill_diagonal(val, ident)
    bad = ~reach
    for _ in range(max(1, math.ceil(math.log2(n))) + 1):
        if (jump == col).all():
            break
        idx = jump * n + col
        val = op(val, val.reshape(-1)[idx])
        bad = bad | bad.reshape(-1)[idx]
        jump = jump.reshape(-1)[idx]
    bad |= jump != col
    val[bad] = fail
    return val


def _sum_paths(next_hop: IntArray, edge: FloatArray) -> FloatArray:
    """``reduce_paths(..., "sum")`` for edges without NaN or -inf: failures ride along as inf.

    An unreachable pair starts at inf and inf + anything stays inf, so no
    separate failure mask is gathered each round (a third fewer gathers).
    """
    n = next_hop.shape[0]
    col = np.arange(n, dtype=np.int64)
    reach = next_hop >= 0
    jump = np.where(reach, next_hop, col[None, :])
    val = edge[col[:, None], jump]
    np.fill_diagonal(val, 0.0)
    val[~reach] = math.inf  # after the diagonal: a NO_ROUTE diagonal stays inf (as masked)
    idx = np.empty((n, n), dtype=np.int64)
    for _ in range(max(1, math.ceil(math.log2(n))) + 1):
        if (jump == col).all():
            break
        np.multiply(jump, n, out=idx)
        idx += col
        val += np.take(val.reshape(-1), idx)
        jump = np.take(jump.reshape(-1), idx)
    val[jump != col] = math.inf
    return val
