"""Incremental all-pairs routes: one link's cost changes, only what it touches is redone.

A full run is O(n³) (~0.8 s at n = 1,000); a probe round usually moves a
handful of links. The state kept is the perturbed distance matrix D (the
unique shortest paths, see ``allpairs``), the exact relay-folded path costs C
and the next hops NH. After an update the tables are identical to what
``compute_routes`` gives for the new matrix: the same unique paths, so the
same next hops, and costs equal up to float rounding.

* **Decrease** of w(i,j) (incl. a link coming back): a pair improves only by
  using the edge once, D'(s,d) = D(s,i) + w + D(j,d). Such s improve their
  route to j and such d are reached better from i, so only the block
  {s : D(s,i)+w < D(s,j)} × {d : w+D(j,d) < D(i,d)} is scanned; the new
  next hop is s's next hop towards i (or j when s == i).
* **Increase** (incl. to inf, link down): if i's route to j is not the edge
  itself, no shortest path uses it and nothing changes. Otherwise the
  affected pairs are those whose path runs over the edge: destinations d
  with NH(i,d) == j, sources with i on their path to d (a subtree test on
  d's in-tree). Only those entries are recomputed, by a min-plus step over
  the unaffected entries, D'(a,d) = min_k W(a,k) + D(k,d), then Bellman–Ford
  among the affected ones; the new next hop is the argmin k. Work is about
  r·m·(n + r) for r affected sources and m affected destinations; past
  ``max_affected`` × n³ a full run is cheaper and is done instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from meshopt.routing.allpairs import (
    prepare_weights,
    shortest_paths,
    tie_noise,
    without_relay_offset,
)
from meshopt.routing.tables import NO_ROUTE, FloatArray, IntArray, RouteTables

BoolArray = npt.NDArray[np.bool_]

# Elements per temporary in the min-plus steps (keeps them in cache, bounds memory).
_CHUNK_ELEMS = 1 << 18


def _through(parent: IntArray, dests: IntArray, i: int) -> BoolArray:
    """hit[s, c]: is i on the path from s to dests[c], given parent[s, c] = next hop.

    Pointer doubling up each destination's in-tree: ⌈log2 n⌉ rounds of O(n·m).
    """
    n, m = parent.shape
    colidx = np.broadcast_to(np.arange(m, dtype=np.int64)[None, :], (n, m))
    dst = np.broadcast_to(dests[None, :], (n, m))
    anc = np.where(parent >= 0, parent, dst)
    hit = anc == i
    hit[i, :] = True
    for _ in range(max(1, math.ceil(math.log2(max(n, 2)))) + 1):
        if (anc == dst).all():
            break
        hit = hit | hit[anc, colidx]
        anc = anc[anc, colidx]
    out: BoolArray = hit
    return out


class IncrementalRoutes:
    """All-pairs routes kept up to date under single-link cost changes.

    ``tables`` equals ``compute_routes(link_cost, names, relay_hop_ms=...,
    symmetric=...)`` for the current matrix at all times. In symmetric mode
    ``update_link(a, b, c)`` sets both directions to c.
    """

    def __init__(
        self,
        link_cost: FloatArray,
        names: Sequence[str] | None = None,
        *,
        relay_hop_ms: float = 2.0,
        symmetric: bool = False,
        max_affected: float = 0.25,
    ) -> None:
        self._link = np.array(link_cost, dtype=np.float64, copy=True)
        self._relay = float(relay_hop_ms)
        self._symmetric = symmetric
        self._max_affected = max_affected
        n = self._link.shape[0] if self._link.ndim == 2 else 0
        if names is not None and len(names) != n:
            raise ValueError(f"{len(names)} names for a {n}-node cost matrix")
        self._names = list(names) if names is not None else [str(i) for i in range(n)]
        self.stats: dict[str, int] = {"noop": 0, "decrease": 0, "increase": 0, "full": 0}
        self._cached: RouteTables | None = None
        self.recompute()

    @property
    def n(self) -> int:
        return len(self._names)

    @property
    def next_hop(self) -> IntArray:
        """The live next-hop matrix as a read-only view (no copy; changes with updates)."""
        v = self._nh.view()
        v.setflags(write=False)
        return v

    @property
    def link_cost(self) -> FloatArray:
        """The current link-cost matrix (a copy)."""
        return self._link.copy()

    def recompute(self) -> None:
        """Full run from the current link costs."""
        exact, pert = prepare_weights(self._link, self._relay, self._symmetric)
        self._wx, self._w = exact, pert
        self._d, self._nh, self._c = shortest_paths(exact, pert)
        self._noise = tie_noise(exact.shape[0], self._symmetric)
        self._cached = None
        self.stats["full"] += 1

    @property
    def tables(self) -> RouteTables:
        """A snapshot of the current routes (not changed by later updates)."""
        if self._cached is None:
            self._cached = RouteTables(
                names=list(self._names),
                cost=without_relay_offset(self._c, self._relay),
                next_hop=self._nh.copy(),
                dist=self._d.copy(),
                symmetric=self._symmetric,
            )
        return self._cached

    def update_link(self, a: int, b: int, cost: float) -> None:
        """Set the cost of link a→b (and b→a in symmetric mode); inf takes it down."""
        n = self.n
        if not (0 <= a < n and 0 <= b < n) or a == b:
            raise ValueError(f"no link {a}→{b} in a {n}-node mesh")
        cost = float(cost)
        if math.isnan(cost) or cost < 0:
            raise ValueError(f"link cost must be >= 0 (inf for no link), got {cost!r}")
        self._link[a, b] = cost
        if self._symmetric:
            self._link[b, a] = cost
            self._apply(a, b)
            self._apply(b, a)
        else:
            self._apply(a, b)

    def _apply(self, i: int, j: int) -> None:
        # The same float operations as prepare_weights, so the weights match bit for bit.
        raw = (self._link[i, j] + self._link[j, i]) / 2.0 if self._symmetric else self._link[i, j]
        wx = raw + self._relay
        w = wx + self._noise[i, j]
        old = self._w[i, j]
        self._wx[i, j], self._w[i, j] = wx, w
        if w == old:
            self.stats["noop"] += 1
            return
        self._cached = None
        if w < old:
            self._decrease(i, j, w, wx)
        else:
            self._increase(i, j)

    def _decrease(self, i: int, j: int, w: float, wx: float) -> None:
        self.stats["decrease"] += 1
        d_, c_, nh = self._d, self._c, self._nh
        src = np.flatnonzero(d_[:, i] + w < d_[:, j])
        if src.size == 0:
            return
        dst = np.flatnonzero(w + d_[j] < d_[i])
        cand = (d_[src, i] + w)[:, None] + d_[j, dst][None, :]
        rs, cs = np.nonzero(cand < d_[np.ix_(src, dst)])
        s, d = src[rs], dst[cs]
        d_[s, d] = cand[rs, cs]
        c_[s, d] = (c_[s, i] + wx) + c_[j, d]
        nh[s, d] = np.where(s == i, j, nh[s, i])

    def _increase(self, i: int, j: int) -> None:
        nh = self._nh
        if nh[i, j] != j:  # the edge is on no shortest path
            self.stats["noop"] += 1
            return
        n = self.n
        dests = np.flatnonzero(nh[i] == j)
        hit = _through(nh[:, dests], dests, i)
        rows = np.flatnonzero(hit.any(axis=1))
        # Min-plus over all n first hops plus (usually one or two) Bellman–Ford sweeps
        # among the r affected rows: ~ r·m·(n + r) against a full run's n³.
        r, m = rows.size, dests.size
        if r * m * (n + r) > self._max_affected * n**3:
            self.recompute()
            return
        self.stats["increase"] += 1
        self._repair(rows, dests, hit[rows])

    def _repair(self, rows: IntArray, cols: IntArray, todo: BoolArray) -> None:
        """Recompute entries rows×cols where ``todo``; all other entries are still exact."""
        d_, nh, w = self._d, self._nh, self._w
        n, r, m = self.n, rows.size, cols.size
        # Min-plus over the entries that stay valid.
        dcol = d_[:, cols]
        dsub = dcol[rows]
        dsub[todo] = np.inf
        dcol[rows] = dsub
        new_d = d_[np.ix_(rows, cols)]
        new_nh = nh[np.ix_(rows, cols)]
        step = max(1, _CHUNK_ELEMS // max(1, n * m))
        for a0 in range(0, r, step):
            a1 = min(r, a0 + step)
            t = w[rows[a0:a1]][:, :, None] + dcol[None, :, :]
            k = t.argmin(axis=1)
            val = np.take_along_axis(t, k[:, None, :], axis=1)[:, 0, :]
            sel = todo[a0:a1]
            new_d[a0:a1][sel] = val[sel]
            new_nh[a0:a1][sel] = k[sel]
        # Bellman–Ford among the recomputed entries.
        w_rr = w[np.ix_(rows, rows)]
        step = max(1, _CHUNK_ELEMS // max(1, r * m))
        for _ in range(r + 1):
            changed = False
            for a0 in range(0, r, step):
                a1 = min(r, a0 + step)
                t = w_rr[a0:a1][:, :, None] + new_d[None, :, :]
                k = t.argmin(axis=1)
                val = np.take_along_axis(t, k[:, None, :], axis=1)[:, 0, :]
                better = (val < new_d[a0:a1]) & todo[a0:a1]
                if better.any():
                    changed = True
                    new_d[a0:a1][better] = val[better]
                    new_nh[a0:a1][better] = rows[k[better]]
            if not changed:
                break
        new_nh[todo & np.isinf(new_d)] = NO_ROUTE
        d_[np.ix_(rows, cols)] = new_d
        nh[np.ix_(rows, cols)] = new_nh
        self._fill_costs(rows[np.nonzero(todo)[0]], cols[np.nonzero(todo)[1]])

    def _fill_costs(self, s: IntArray, d: IntArray) -> None:
        """Exact costs of the listed pairs from their (new) next hops, nearest first."""
        c_, nh, wx = self._c, self._nh, self._wx
        hop = nh[s, d]
        dead = hop == NO_ROUTE
        c_[s[dead], d[dead]] = np.inf
        s, d, hop = s[~dead], d[~dead], hop[~dead]
        c_[s, d] = np.nan
        while s.size:
            val = wx[s, hop] + c_[hop, d]
            ok = ~np.isnan(val)
            if not ok.any():
                raise RuntimeError("next hops loop: incremental state is corrupt")
            c_[s[ok], d[ok]] = val[ok]
            s, d, hop = s[~ok], d[~ok], hop[~ok]
