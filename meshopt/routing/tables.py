"""Next-hop tables: the output of every route computation, and what agents install."""

from __future__ import annotations

from dataclasses import dataclass

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
    """

    names: list[str]
    cost: FloatArray
    next_hop: IntArray
    backup: IntArray | None = None

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
