"""Backup next hops for the routes the policy installed, with hysteresis.

The routing layer's backups (``meshopt.routing.backup``) are the best table's loop-free
alternates. Agents forward on the installed table, which the policy keeps off the best
one where a gain is too small to move for (hysteresis; of two equal paths, the one the
policy's order names first). Where an alternate's own installed route is not its best
one, the best table's test misjudges it: it calls an alternate whose installed route
avoids the node a loop (and the backup then flips whenever noise reorders the
alternate's two near-equal routes), or the reverse. So such alternates are judged by
walking their installed routes. A backup that still delivers stays unless a new one is
better by the policy's margins: a backup flipping with noise re-sends a whole route set.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from meshopt.policy import TIE_ORDER_MAX_N, BoolArray, PolicyConfig
from meshopt.routing.tables import (
    NO_ROUTE,
    FloatArray,
    IntArray,
    RouteTables,
    reduce_paths,
    relay_weights,
)

# Added to the rank of an alternate that protects only the link, not the installed next
# hop, so that any node-protecting one comes first (as in meshopt.routing.backup).
_LINK_ONLY = 1e9


def gain_margin(cost: FloatArray, policy: PolicyConfig) -> FloatArray:
    """The gain a change must bring over ``cost``: the policy's large margins."""
    out: FloatArray = np.maximum(policy.abs_margin_ms, policy.rel_margin * cost)
    return out


def sticky_backups(
    prev: IntArray | None,
    best: RouteTables,
    hop: IntArray,
    cost: FloatArray,
    policy: PolicyConfig,
    relay_hop_ms: float = 2.0,
) -> IntArray:
    """The backup next hop of every entry whose installed next hop is ``hop``.

    The fresh choice is the best table's loop-free alternate (its best next hop when
    the policy kept another one), or, better by the policy's margins, an alternate
    whose installed route is a tie the policy keeps off its best one (in meshes of up
    to ``TIE_ORDER_MAX_N`` nodes, where the policy orders ties: at 1000 nodes the
    search cost ~0.4 s of CPU per pass, for ~50,000 such alternates). The previous
    backup stays while its installed route still reaches d without passing s over a
    live link, and the fresh one is not better by the policy's margins.
    """
    n = hop.shape[0]
    rows = np.arange(n)[:, None]
    cols = np.arange(n)[None, :]
    fresh = best.backup if best.backup is not None else np.full((n, n), NO_ROUTE)
    fresh = np.where(fresh == hop, best.next_hop, fresh)
    fresh = np.where((fresh == hop) | (fresh == rows), NO_ROUTE, fresh)
    link = relay_weights(cost, relay_hop_ms)
    moving = _detoured(hop, best.next_hop)
    if moving.any() and best.dist is not None:
        # Each node's installed route to d: inf where broken.
        reach = reduce_paths(hop, link)
        with np.errstate(invalid="ignore"):
            # Off the best route by less than the smallest gain the policy moves for: a
            # tie, which it never moves. Others it keeps by hysteresis until a gain is
            # confirmed, and a backup whose route runs over them would break then.
            tied = moving & np.isfinite(reach) & (reach - best.dist < policy.confirm_abs_ms)
        moving &= ~tied
        if tied.any() and n <= TIE_ORDER_MAX_N:  # above it, O(tied x n) costs ~0.4 s
            fresh = _with_tied(fresh, hop, tied, link, reach, policy)

    def delivers(start: IntArray, todo: BoolArray) -> BoolArray:
        """The alternate's installed route reaches d without passing s, and so does its
        best one where the policy may yet move it there."""
        ok = _walk_avoids(hop, start, todo)
        held = ok & moving[np.where(todo, start, 0), cols]
        if held.any():
            ok &= ~held | _walk_avoids(best.next_hop, start, held)
        return ok

    f = np.where(fresh >= 0, fresh, 0)
    loops = (fresh >= 0) & ~delivers(f, fresh >= 0)
    if loops.any():
        fresh = np.where(loops, _installed_alternate(hop, best.dist, link, loops, delivers), fresh)
    if prev is None or prev.shape != (n, n) or best.dist is None:
        return fresh.astype(np.int64)
    dist = best.dist
    m = np.where(prev >= 0, prev, 0)
    f = np.where(fresh >= 0, fresh, 0)
    # Still loop-free: the alternate's own installed route (what it forwards on, and
    # what the policy keeps steady) reaches d without passing s. The distances' LFA test
    # would flip whenever m has two near-equal ways to d, one of them through s.
    valid = (prev >= 0) & (prev != hop) & (prev != rows) & np.isfinite(link[rows, m])
    valid &= _walk_avoids(hop, m, valid)
    with np.errstate(invalid="ignore"):
        key_old = link[rows, m] + dist[m, cols]
        key_new = np.where(fresh >= 0, link[rows, f] + dist[f, cols], np.inf)
        better = key_new < key_old - gain_margin(key_old, policy)
    out: IntArray = np.where(valid & ~better, prev, fresh).astype(np.int64)
    return out


def _detoured(hop: IntArray, best_hop: IntArray) -> BoolArray:
    """Entries (m, d) whose installed route leaves m's best route: some node on it,
    m included, has an installed next hop to d other than its best one."""
    n = hop.shape[0]
    cols = np.arange(n)[None, :]
    has = hop >= 0
    nxt = np.where(has, hop, 0)
    out: BoolArray = has & (hop != best_hop)
    for _ in range(n):  # one round per hop of the longest installed route
        more = out | (has & out[nxt, cols])
        if np.array_equal(more, out):
            break
        out = more
    return out


def _with_tied(
    fresh: IntArray,
    hop: IntArray,
    tied: BoolArray,
    link: FloatArray,
    reach: FloatArray,
    policy: PolicyConfig,
) -> IntArray:
    """``fresh``, with each entry's alternate replaced by the best ``tied`` one (an
    alternate on a tie the policy keeps off its best route) where that ranks first by
    the policy's margins: node-protecting before link-protecting, then the cost of
    reaching d over it (the link, then the alternate's installed route ``reach``).

    The best table's test misjudges such an alternate: it calls it a loop when its best
    route runs through s and its installed one does not, and flips as noise reorders
    the two. Near-equal alternates keep the best table's choice."""
    n = hop.shape[0]
    cols = np.arange(n)[None, :]
    rows = np.arange(n)[:, None]
    ok = (fresh >= 0) & ~tied[np.where(fresh >= 0, fresh, 0), cols]  # else a candidate
    f = np.where(ok, fresh, 0)
    node = ok & ((hop == cols) | _walk_avoids(hop, f, ok, avoid=hop))
    with np.errstate(invalid="ignore"):
        rank = np.where(ok, link[rows, f] + reach[f, cols], np.inf)
    rank = rank + np.where(node, 0.0, _LINK_ONLY)
    finite = np.isfinite(rank)
    bar = np.where(finite, rank - gain_margin(np.where(finite, rank, 0.0), policy), np.inf)
    out = fresh.copy()
    for d in np.nonzero(tied.any(axis=0))[0]:
        m = np.nonzero(tied[:, d])[0]
        on = _on_walks(hop[:, d], m, int(d))  # (len(m), n): the nodes on m's route
        p = hop[:, d]
        with np.errstate(invalid="ignore"):
            r = link[:, m] + reach[m, d][None, :]  # (s, candidate)
        unprotected = on[:, np.where(p >= 0, p, 0)].T & (p != d)[:, None]
        r = r + np.where(unprotected, _LINK_ONLY, 0.0)
        r[on.T | (p[:, None] == m[None, :])] = np.inf  # through s itself, or its own hop
        pick = np.argmin(r, axis=1)
        take = r[np.arange(n), pick] < bar[:, d]
        out[take, d] = m[pick[take]]
    return out


def _on_walks(col: IntArray, starts: IntArray, d: int) -> BoolArray:
    """For each start m: the nodes on m's walk along ``col`` (next hops to d), m and d
    included. The walks must reach d (loop-free, no gaps)."""
    n = col.shape[0]
    k = np.arange(starts.size)
    on = np.zeros((starts.size, n), dtype=bool)
    cur = starts.copy()
    live = np.ones(starts.size, dtype=bool)
    for _ in range(n):
        on[k[live], cur[live]] = True
        live &= cur != d
        if not live.any():
            break
        cur = np.where(live, col[cur], cur)
    return on


def _installed_alternate(
    hop: IntArray,
    dist: FloatArray | None,
    link: FloatArray,
    todo: BoolArray,
    delivers: Callable[[IntArray, BoolArray], BoolArray],
    tries: int = 3,
) -> IntArray:
    """For the entries in ``todo``, the cheapest next hop (link, then its best distance)
    other than the installed one that ``delivers`` (start, entries) accepts; NO_ROUTE
    where none of the ``tries`` cheapest does (or without distances)."""
    n = hop.shape[0]
    out = np.full((n, n), NO_ROUTE, dtype=np.int64)
    if dist is None:
        return out
    s_idx, d_idx = np.nonzero(todo)
    with np.errstate(invalid="ignore"):
        key = link[s_idx] + dist[:, d_idx].T
    key[np.arange(s_idx.size), s_idx] = np.inf
    key[np.arange(s_idx.size), hop[s_idx, d_idx]] = np.inf
    left = np.ones(s_idx.size, dtype=bool)
    for _ in range(tries):
        pick = np.argmin(key, axis=1)
        live = left & np.isfinite(key[np.arange(s_idx.size), pick])
        if not live.any():
            break
        start = np.zeros((n, n), dtype=np.int64)
        start[s_idx, d_idx] = pick
        mask = np.zeros((n, n), dtype=bool)
        mask[s_idx[live], d_idx[live]] = True
        ok = delivers(start, mask)[s_idx, d_idx] & live
        out[s_idx[ok], d_idx[ok]] = pick[ok]
        left &= ~ok
        key[np.arange(s_idx.size), pick] = np.inf
    return out


def _walk_avoids(
    next_hop: IntArray, start: IntArray, todo: BoolArray, avoid: IntArray | None = None
) -> BoolArray:
    """For every entry (s, d) in ``todo``: the walk from ``start[s, d]`` along
    ``next_hop[:, d]`` arrives at d without visiting s (``avoid[s, d]`` if given; one
    gather per hop, all at once)."""
    n = next_hop.shape[0]
    s_idx, d_idx = np.nonzero(todo)
    bad = s_idx if avoid is None else avoid[s_idx, d_idx]
    cur = start[s_idx, d_idx]
    ok = np.zeros(s_idx.shape, dtype=bool)
    live = np.ones(s_idx.shape, dtype=bool)
    for _ in range(n):
        arrived = live & (cur == d_idx)
        ok |= arrived
        live &= ~arrived & (cur != bad) & (cur != NO_ROUTE)
        if not live.any():
            break
        cur = np.where(live, next_hop[np.where(live, cur, 0), d_idx], cur)
    out = np.zeros(todo.shape, dtype=bool)
    out[s_idx, d_idx] = ok
    return out
