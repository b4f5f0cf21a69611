"""Nodes whose links die one after another: no route is moved towards them meanwhile.

Why: when a node goes down while its agent's MQTT session lives on (its underlay cut,
a crashed WireGuard) or before its will fires, its peers find their tunnels to it dead
one by one, each at its own probe phase and class (0.8 s for links in use, ~5 s for
idle ones), and tell the controller one by one. Moved as each report came, a route
towards it went through the next peer whose link to it was still reported alive, then
the next: b->a went a, c, f, a in the lab (docs/twin.md), pointless detours that were
the last entries to settle after a relay failure. So once two of a node's links died
within ``window_s`` of each other, and until ``window_s`` passed without another, the
node *collapses*: entries towards it whose path still works stay, and those whose path
broke fall back to the plain tunnel (the agent's own fail-over: its backup, or the
WireGuard route). Routes *through* it move as always. The cost: a node that lost two
links at once but lives on is reached over relays ``window_s`` later.

Pure and clocked from outside; the full pass (a worker thread) and the urgent path (the
event loop) both note deaths, so a lock guards the table.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

# Longer than the spread of the reports of one death: an idle link is found dead 4.84 s
# after its last answer, a link in use 0.8 s after (docs/probe-budget.md).
WINDOW_S = 5.0

Pair = tuple[str, str]


class DeathWatch:
    """When each link (an unordered pair of node names) was first seen dead."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._dead: dict[Pair, float] = {}
        self._prev: tuple[list[str], npt.NDArray[np.bool_]] | None = None
        self._lock = threading.Lock()

    @staticmethod
    def _pair(a: str, b: str) -> Pair:
        return (a, b) if a < b else (b, a)

    def note(self, a: str, b: str, now: float) -> None:
        """The link a-b reported dead at ``now`` (the first report's time is kept)."""
        with self._lock:
            self._dead.setdefault(self._pair(a, b), now)

    def observe(self, names: Sequence[str], cost: npt.NDArray[np.float64], now: float) -> None:
        """A full picture of the links: those dead now that were not at the last one are
        noted; those alive again are forgotten. The first picture notes nothing (a link
        never measured is not a death)."""
        dead = np.isinf(np.asarray(cost, dtype=np.float64))
        np.fill_diagonal(dead, False)
        names = list(names)
        with self._lock:
            prev = self._prev
            self._prev = (names, dead)
            if prev is None:
                return
            old_names, old_dead = prev
            if old_names == names:
                was = old_dead
            else:
                index = {n: i for i, n in enumerate(old_names)}
                ix = np.array([index.get(n, -1) for n in names])
                known = ix >= 0
                was = np.ones_like(dead)  # a node new to the picture: nothing died
                sub = np.ix_(known, known)
                was[sub] = old_dead[np.ix_(ix[known], ix[known])]
            for i, j in zip(*np.nonzero(dead & ~was), strict=True):
                self._dead.setdefault(self._pair(names[i], names[j]), now)
            # Alive again both ways, or an end gone from the picture: forgotten. (Only
            # the few noted pairs are looked at: 500,000 live ones at 1000 nodes.)
            index = {n: i for i, n in enumerate(names)}
            for pair in list(self._dead):
                i, j = index.get(pair[0]), index.get(pair[1])
                if i is None or j is None or not (dead[i, j] or dead[j, i]):
                    del self._dead[pair]

    def collapsing(self, names: Sequence[str], now: float) -> npt.NDArray[np.bool_]:
        """Per node of ``names``: True while it collapses (see the module)."""
        out = np.zeros(len(names), dtype=bool)
        with self._lock:
            times: dict[str, list[float]] = {}
            for (a, b), t in self._dead.items():
                if t <= now:
                    times.setdefault(a, []).append(t)
                    times.setdefault(b, []).append(t)
        index = {n: i for i, n in enumerate(names)}
        for node, ts in times.items():
            i = index.get(node)
            if i is None or len(ts) < 2:
                continue
            ts.sort()
            if now - ts[-1] > self.window_s:
                continue
            # The deaths linked to the last one by gaps of at most window_s.
            k = len(ts) - 1
            while k > 0 and ts[k] - ts[k - 1] <= self.window_s:
                k -= 1
            out[i] = len(ts) - k >= 2
        return out

    def noted(self, names: Sequence[str]) -> npt.NDArray[np.bool_]:
        """n x n: True where the link between two of ``names`` is noted dead (a tunnel
        that exists, unlike a pair that never had one)."""
        index = {n: i for i, n in enumerate(names)}
        out = np.zeros((len(names), len(names)), dtype=bool)
        with self._lock:
            pairs = list(self._dead)
        for a, b in pairs:
            i, j = index.get(a), index.get(b)
            if i is not None and j is not None:
                out[i, j] = out[j, i] = True
        return out
