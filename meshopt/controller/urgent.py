"""The urgent path: move only the entries a failed or far worse link or node broke.

Why: at 1000 nodes a full recompute (loop-free alternates O(n³), widest and shortest
paths, a fast and a bulk route per destination) costs 5-30 s of CPU, and a dead relay
waited behind it for a minute or more (issue 15). What a failure forces is much less:
the entries whose installed path runs over the failed link or node need a new next hop,
and nothing else does.

:func:`urgent_fix` takes the installed next hops (what agents have), the link costs
with the failure in them and the links that got worse, and returns the entries to move:

* **Affected** entries are those whose installed walk to d takes one of the links that
  got worse (a dead node: every link to or from it). Entries of a dead node (as source
  or destination) are left to the full pass: a dead node needs no routes, and routes to
  it carry nothing.
* Every other entry keeps its next hop, and its walk never visits an affected node for
  that destination (if it did, it would follow that node's path over the bad link and
  be affected itself). So an affected source's new value is a min-plus step over its
  neighbours, ``min_k w(s,k) + D(k,d)``, with ``D`` the unaffected nodes' installed path
  costs, iterated among the affected entries until nothing improves (Bellman-Ford on
  the perturbed weights the route engine uses, so ties fall as they fall there). With
  positive weights the new next hops descend strictly in value: no loop. When the
  installed routes are the shortest paths (a settled mesh) this is exactly the next hop
  the full recompute's best table gives the entry.
* **Which move** follows the policy: an entry whose path is broken (a dead link or
  relay) moves at once, as ``decide`` moves failed entries; one whose path is only worse
  moves when the gain is the engine's "far worse" (``DEGRADED_*``, which skips the hold)
  and clears the policy's large margins and noise test. Entries the moves leave without
  a clean walk (a loop through an entry that stayed) take the new next hop too, as the
  policy's repair does.
* Bulk entries whose (widest-path) walk is broken take the new fast next hop (walks
  repaired the same way); their TCP settings are left to the full pass.
* A moved entry keeps its backup while that is still a loop-free alternate over a live
  link (its walk reaches d without the source); otherwise it has none until the full
  pass computes one.

All of it is numpy over the affected destinations' columns only: O(n·m·hops) for m
affected destinations, plus O(|E|·n) per Bellman-Ford round over the |E| affected
entries. Pure: arrays in, arrays out; no clock, no view.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from meshopt.policy import PolicyConfig
from meshopt.routing import compiled
from meshopt.routing.allpairs import prepare_weights
from meshopt.routing.tables import NO_ROUTE, FloatArray, IntArray

BoolArray = npt.NDArray[np.bool_]

# The engine's "far worse" (meshopt.controller.engine.DEGRADED_*), repeated here to keep
# this module free of the engine's imports; a test holds them equal.
DEGRADED_REL = 0.6
DEGRADED_ABS_MS = 10.0
# Elements per temporary in the min-plus steps.
_CHUNK_ELEMS = 1 << 20


@dataclass
class UrgentFix:
    """What to move. Fast entries: ``s``, ``d`` (node indices), their new next hop
    ``hop`` (NO_ROUTE: none left), ``failed`` (the path was broken, not only worse) and
    the backup each keeps (``backup``, NO_ROUTE: none). Bulk entries: ``bulk_s``,
    ``bulk_d``, ``bulk_hop``. ``affected``: entries whose path took a bad link (moved or
    not), for the record."""

    s: IntArray
    d: IntArray
    hop: IntArray
    failed: BoolArray
    backup: IntArray
    bulk_s: IntArray
    bulk_d: IntArray
    bulk_hop: IntArray
    affected: int = 0
    # The best table's entries after the failure (for the next urgent plan's picture).
    best_s: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    best_d: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    best_hop: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    best_dist: FloatArray = field(default_factory=lambda: np.zeros(0))

    @property
    def rows(self) -> set[int]:
        """Sources whose routes change."""
        return set(self.s.tolist()) | set(self.bulk_s.tolist())


def _empty() -> UrgentFix:
    z = np.zeros(0, dtype=np.int64)
    return UrgentFix(z, z, z, np.zeros(0, dtype=bool), z, z, z, z)


def _walk(
    table: IntArray,
    dest: IntArray,
    src: IntArray,
    j: IntArray,
    edges: Sequence[FloatArray],
    bad: BoolArray | None = None,
    avoid: IntArray | None = None,
) -> tuple[BoolArray, list[FloatArray], BoolArray, BoolArray]:
    """Walk ``table`` (n x m, column j routes to node ``dest[j]``) from ``src[e]`` in
    column ``j[e]``, for every entry e at once (one gather per hop).

    Returns: arrived (no gap, no loop), the sum of each of ``edges`` (n x n) along the
    walk (inf unless arrived), whether it took a link marked in ``bad`` (n x n), and
    whether it visited node ``avoid[e]`` after its start."""
    n = table.shape[0]
    k = src.size
    cur = src.astype(np.int64, copy=True)
    target = dest[j]
    sums = [np.zeros(k) for _ in edges]
    hit = np.zeros(k, dtype=bool)
    visited = np.zeros(k, dtype=bool)
    arrived = cur == target
    live = np.flatnonzero(~arrived)
    for _ in range(n):
        if live.size == 0:
            break
        c = cur[live]
        nxt = table[c, j[live]]
        ok = nxt >= 0
        live, c, nxt = live[ok], c[ok], nxt[ok]
        for acc, e in zip(sums, edges, strict=True):
            acc[live] += e[c, nxt]
        if bad is not None:
            hit[live] |= bad[c, nxt]
        if avoid is not None:
            visited[live] |= nxt == avoid[live]
        cur[live] = nxt
        done = nxt == target[live]
        arrived[live[done]] = True
        live = live[~done]
    for acc in sums:
        acc[~arrived] = np.inf
    return arrived, sums, hit, visited


def _min_plus(
    pert: FloatArray, dcols: FloatArray, s: IntArray, j: IntArray
) -> tuple[FloatArray, IntArray]:
    """For each entry e: min over k of pert[s[e], k] + dcols[k, j[e]], and the argmin
    (compiled from COMPILED_MIN_N nodes: ~10x less CPU at 1000 nodes, the same values)."""
    n = pert.shape[0]
    if n >= compiled.COMPILED_MIN_N and s.size:
        got = compiled.min_plus(pert, dcols, s, j)
        if got is not None:
            return got
    val = np.empty(s.size)
    arg = np.empty(s.size, dtype=np.int64)
    step = max(1, _CHUNK_ELEMS // max(1, n))
    for a in range(0, s.size, step):
        b = min(s.size, a + step)
        t = pert[s[a:b]] + dcols[:, j[a:b]].T
        k = t.argmin(axis=1)
        arg[a:b] = k
        val[a:b] = t[np.arange(b - a), k]
    return val, arg


def urgent_fix(
    next_hop: IntArray,
    cost: FloatArray,
    noise: FloatArray,
    bad: BoolArray,
    dead: BoolArray,
    policy: PolicyConfig,
    *,
    relay_hop_ms: float = 2.0,
    backup: IntArray | None = None,
    bulk: IntArray | None = None,
    best: IntArray | None = None,
    dist: FloatArray | None = None,
    held: BoolArray | None = None,
) -> UrgentFix:
    """The entries of ``next_hop`` (installed, n x n) to move now; see the module.

    ``cost``: link costs with the failure in them (inf: down; 0 on the diagonal), as
    ``Matrices.cost``; ``noise``: their standard deviations; ``bad``: links whose cost
    rose (a dead node's links included); ``dead``: nodes gone (no routes from or to
    them are moved). ``backup``/``bulk``: the backup and bulk next hops handed out.
    ``best``/``dist``: the engine's best table before the failure and its (perturbed)
    distances: given, a moved entry takes the best table's next hop after the failure
    (repaired the same way), as the full pass's policy moves a failed entry; without,
    the installed table stands in for it. ``held``: collapsing nodes
    (:mod:`meshopt.controller.deaths`), no entry towards them is moved."""
    n = next_hop.shape[0]
    if n == 0 or not bad.any():
        return _empty()
    alive = ~np.asarray(dead, dtype=bool)
    exact, pert = prepare_weights(np.where(np.isnan(cost), np.inf, cost), relay_hop_ms, False)
    var = np.asarray(noise, dtype=np.float64) ** 2
    rows = np.arange(n)[:, None]

    def bad_hops(table: IntArray) -> BoolArray:
        out: BoolArray = (table >= 0) & bad[rows, np.where(table >= 0, table, 0)]
        return out

    # Destinations some live node reaches over a bad link (a dead node's own rows, all
    # bad, would make every column hot).
    hot = bad_hops(next_hop)[alive].any(axis=0)
    if bulk is not None:
        hot |= bad_hops(bulk)[alive].any(axis=0)
    if best is not None:
        hot |= bad_hops(best)[alive].any(axis=0)
    if held is not None:
        hot &= ~np.asarray(held, dtype=bool)
    cols = np.flatnonzero(hot & alive)
    if cols.size == 0:
        return _empty()
    m = cols.size
    # Every live source's walk to every hot destination, on the installed table.
    src = np.repeat(np.flatnonzero(alive), m)
    jj = np.tile(np.arange(m), int(alive.sum()))
    keep = src != cols[jj]
    src, jj = src[keep], jj[keep]
    table = np.ascontiguousarray(next_hop[:, cols])
    if best is None or dist is None:
        _, (cur_x, cur_p, cur_v), aff, _ = _walk(table, cols, src, jj, (exact, pert, var), bad)
        es, ej = src[aff], jj[aff]
        cur_x, cur_v = cur_x[aff], cur_v[aff]
    else:  # only the affected entries' path values are needed: walked again, alone
        _, _, aff, _ = _walk(table, cols, src, jj, (), bad)
        es, ej = src[aff], jj[aff]
        _, (cur_x, cur_v), _, _ = _walk(table, cols, es, ej, (exact, var))
    # The best table after the failure, on the hot columns: entries whose best path took
    # a bad link get a min-plus step over the others' distances (still shortest: costs
    # only rose, and their paths do not take a raised link), then Bellman-Ford among them.
    dcols = np.full((n, m), np.inf)
    if best is None or dist is None:
        btab = table.copy()
        dcols[src, jj] = cur_p
        bs, bj = es, ej
    else:
        btab = np.ascontiguousarray(best[:, cols])
        _, _, bhit, _ = _walk(btab, cols, src, jj, (), bad)
        dcols[src, jj] = dist[src, cols[jj]]
        bs, bj = src[bhit], jj[bhit]
    dcols[cols, np.arange(m)] = 0.0
    dcols[bs, bj] = np.inf
    bhop = np.full(bs.size, NO_ROUTE, dtype=np.int64)
    # An entry's step reads only its own column of dcols: after the first round, only
    # entries in a column that changed in the last round can improve (the same result,
    # fewer min-plus rows).
    live = np.arange(bs.size)
    for _ in range(n + 1):
        if live.size == 0:
            break
        ls, lj = bs[live], bj[live]
        val, arg = _min_plus(pert, dcols, ls, lj)
        better = val < dcols[ls, lj]
        if not better.any():
            break
        won = live[better]
        dcols[bs[won], bj[won]] = val[better]
        bhop[won] = arg[better]
        moved = np.zeros(m, dtype=bool)
        moved[bj[won]] = True
        live = np.flatnonzero(moved[bj])
    bhop[~np.isfinite(dcols[bs, bj])] = NO_ROUTE
    btab[bs, bj] = bhop
    best_moves = (bs, bj, bhop, dcols[bs, bj])
    if es.size == 0:
        fix = _empty()
        fix.best_s, fix.best_d, fix.best_hop, fix.best_dist = (
            best_moves[0],
            cols[best_moves[1]],
            best_moves[2],
            best_moves[3],
        )
        if bulk is not None:
            fix.bulk_s, fix.bulk_d, fix.bulk_hop = _bulk_moves(bulk, table, cols, exact, src, jj)
        return fix
    hop = btab[es, ej]
    cand = table.copy()
    cand[es, ej] = hop
    # The policy's test on every affected entry: the installed path's cost and the best's.
    _, (new_x, new_v), _, _ = _walk(btab, cols, es, ej, (exact, var))
    old_x, old_v = cur_x, cur_v
    broken = ~np.isfinite(old_x)
    moves = hop != table[es, ej]
    # Path costs as the policy prices them: k hops pay k - 1 relay hops.
    cur = old_x - relay_hop_ms
    new = new_x - relay_hop_ms
    with np.errstate(invalid="ignore"):
        gain = cur - new
        far_worse = (
            np.isfinite(cur)
            & np.isfinite(new)
            & (gain >= DEGRADED_ABS_MS)
            & (gain >= DEGRADED_REL * cur)
            & (gain >= policy.abs_margin_ms)
            & (gain >= policy.rel_margin * cur)
            & (gain > policy.noise_sigmas * np.sqrt(old_v + new_v))
        )
    switch = moves & (broken | far_worse)
    out = table.copy()
    out[es[switch], ej[switch]] = hop[switch]
    # Repair: an affected entry whose walk no longer arrives cleanly takes its new hop.
    for _ in range(es.size + 1):
        ok, (x,), _, _ = _walk(out, cols, es, ej, (exact,))
        need = ~(ok & np.isfinite(x)) & (out[es, ej] != hop)
        if not need.any():
            break
        out[es[need], ej[need]] = hop[need]
    changed = out[es, ej] != table[es, ej]
    cs, cj = es[changed], ej[changed]
    new_hop = out[cs, cj]
    failed = broken[changed]
    kept = np.full(cs.size, NO_ROUTE, dtype=np.int64)
    if backup is not None and cs.size:
        b = backup[cs, cols[cj]]
        cand_b = (b >= 0) & (b != new_hop) & (b != cs)
        bb = np.where(cand_b, b, 0)
        cand_b &= np.isfinite(exact[cs, bb]) & alive[bb]
        ok, (x,), _, seen = _walk(out, cols, bb, cj, (exact,), avoid=cs)
        cand_b &= ok & np.isfinite(x) & ~seen
        kept = np.where(cand_b, b, NO_ROUTE).astype(np.int64)
    fix = UrgentFix(
        s=cs.astype(np.int64),
        d=cols[cj].astype(np.int64),
        hop=new_hop.astype(np.int64),
        failed=failed,
        backup=kept,
        bulk_s=np.zeros(0, dtype=np.int64),
        bulk_d=np.zeros(0, dtype=np.int64),
        bulk_hop=np.zeros(0, dtype=np.int64),
        affected=int(es.size),
        best_s=best_moves[0].astype(np.int64),
        best_d=cols[best_moves[1]].astype(np.int64),
        best_hop=best_moves[2].astype(np.int64),
        best_dist=best_moves[3],
    )
    if bulk is not None:
        fix.bulk_s, fix.bulk_d, fix.bulk_hop = _bulk_moves(bulk, out, cols, exact, src, jj)
    return fix


def _bulk_moves(
    bulk: IntArray,
    fast: IntArray,
    cols: IntArray,
    exact: FloatArray,
    src: IntArray,
    jj: IntArray,
) -> tuple[IntArray, IntArray, IntArray]:
    """Bulk entries (of the hot columns) whose walk is broken now (a dead link or node on
    it; one only slower stays for the full pass): moved to the fast table's next hop,
    then repaired until every moved walk arrives."""
    btab = np.ascontiguousarray(bulk[:, cols])
    ok, (x,), _, _ = _walk(btab, cols, src, jj, (exact,))
    broken = ~(ok & np.isfinite(x))
    need = broken & (btab[src, jj] != fast[src, jj])
    if not need.any():
        z = np.zeros(0, dtype=np.int64)
        return z, z, z
    # A walk that was not broken visits no node whose walk was (it would share its
    # end): only the broken entries can need repair.
    src, jj, need = src[broken], jj[broken], need[broken]
    out = btab.copy()
    out[src[need], jj[need]] = fast[src[need], jj[need]]
    for _ in range(src.size + 1):
        ok, (x,), _, _ = _walk(out, cols, src, jj, (exact,))
        more = ~(ok & np.isfinite(x)) & (out[src, jj] != fast[src, jj])
        if not more.any():
            break
        out[src[more], jj[more]] = fast[src[more], jj[more]]
    changed = out[src, jj] != btab[src, jj]
    return (
        src[changed].astype(np.int64),
        cols[jj[changed]].astype(np.int64),
        out[src[changed], jj[changed]].astype(np.int64),
    )
