"""What each bulk route's TCP settings were computed from, for their hysteresis.

The engine keeps a bulk route's settings while its path's RTT and rate stay close to the
values they came from (``engine._sticky_tuning``), so noise sends no new route sets. At
1000 nodes that is a million routes: as a dict of ``(source, destination, prefix)``
tuples to small objects it held ~260 MB of Python objects (key tuples, value objects,
their floats). Here each source has one float array over destination indices (hops,
PMTU, RTT, rate, which settings), ~40 MB in all, and the settings themselves are listed
once per distinct value. A destination's first prefix lives in the arrays; further
prefixes of one node (rare) in a small dict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from meshopt.install.tuning import TcpTuning
from meshopt.routing.tables import FloatArray

# Rows of a source's array; NaN in HOPS: nothing remembered for that destination.
HOPS, PMTU, RTT, BW, SETTINGS = range(5)
_NO_SETTINGS = -1.0  # remembered: the path tunes nothing (TcpTuning None)


@dataclass(frozen=True, slots=True)
class Tuned:
    """A bulk route's TCP settings and the path values they were computed from."""

    hops: int
    pmtu: int
    rtt: float | None
    bw: float | None
    tuning: TcpTuning | None


def _settings_key(t: TcpTuning) -> tuple[int | None, ...]:
    return (t["mtu"], t["advmss"], t["window"], t["initcwnd"], t["initrwnd"])


class BulkMemory:
    def __init__(self) -> None:
        self.names: list[str] = []  # the destination index space of the arrays
        self.first: list[str | None] = []  # each destination's first prefix
        self.rows: dict[str, FloatArray] = {}  # source name -> (5, n)
        self.extra: dict[tuple[str, str, str], Tuned] = {}
        self.settings: list[TcpTuning] = []
        self._settings_at: dict[tuple[int | None, ...], int] = {}

    def __len__(self) -> int:
        arrays = sum(int(np.count_nonzero(~np.isnan(a[HOPS]))) for a in self.rows.values())
        return arrays + len(self.extra)

    def copy(self) -> BulkMemory:
        out = BulkMemory()
        out.names, out.first = list(self.names), list(self.first)
        out.rows = {k: a.copy() for k, a in self.rows.items()}
        out.extra = dict(self.extra)
        out.settings = list(self.settings)
        out._settings_at = dict(self._settings_at)
        return out

    def align(self, names: list[str], first: list[str | None]) -> None:
        """Index the arrays by ``names`` (each with its first prefix ``first``): what is
        remembered of nodes still there moves with them, the rest is forgotten."""
        if names == self.names and first == self.first:
            return
        old = {(nm, f): i for i, (nm, f) in enumerate(zip(self.names, self.first, strict=True))}
        src = np.array([old.get((nm, f), -1) for nm, f in zip(names, first, strict=True)])
        keep = src >= 0
        live = set(names)
        rows: dict[str, FloatArray] = {}
        for s_name, a in self.rows.items():
            if s_name not in live:
                continue
            b = np.full((5, len(names)), np.nan)
            b[:, keep] = a[:, src[keep]]
            rows[s_name] = b
        self.rows = rows
        self.extra = {k: v for k, v in self.extra.items() if k[0] in live and k[1] in live}
        self.names, self.first = list(names), list(first)
        if len(self.settings) > 65536:  # a bound, should values ever churn: start afresh
            self.clear()

    def clear(self) -> None:
        self.rows, self.extra = {}, {}
        self.settings, self._settings_at = [], {}

    def row(self, s_name: str) -> FloatArray:
        """Source ``s_name``'s array (created empty): read and written in place."""
        a = self.rows.get(s_name)
        if a is None:
            a = self.rows[s_name] = np.full((5, len(self.names)), np.nan)
        return a

    def base(self, s_name: str) -> FloatArray:
        """Hops, PMTU, RTT and rate per destination (NaN where none): a copy."""
        a = self.rows.get(s_name)
        if a is None:
            return np.full((4, len(self.names)), np.nan)
        return a[:4].copy()

    def get(self, s_name: str, d: int, addr: str) -> Tuned | None:
        if self.first[d] != addr:
            return self.extra.get((s_name, self.names[d], addr))
        a = self.rows.get(s_name)
        if a is None or math.isnan(hops := float(a[HOPS, d])):
            return None
        rtt, bw, k = float(a[RTT, d]), float(a[BW, d]), float(a[SETTINGS, d])
        return Tuned(
            int(hops),
            int(a[PMTU, d]),
            None if math.isnan(rtt) else rtt,
            None if math.isnan(bw) else bw,
            None if k == _NO_SETTINGS else self.settings[int(k)],
        )

    def put(self, s_name: str, d: int, addr: str, t: Tuned) -> None:
        if self.first[d] != addr:
            self.extra[(s_name, self.names[d], addr)] = t
            return
        self.row(s_name)[:, d] = (
            t.hops,
            t.pmtu,
            math.nan if t.rtt is None else t.rtt,
            math.nan if t.bw is None else t.bw,
            _NO_SETTINGS if t.tuning is None else self._settings_index(t.tuning),
        )

    def settings_of(self, k: float) -> TcpTuning | None:
        return None if k == _NO_SETTINGS else self.settings[int(k)]

    def _settings_index(self, t: TcpTuning) -> int:
        key = _settings_key(t)
        i = self._settings_at.get(key)
        if i is None:
            i = self._settings_at[key] = len(self.settings)
            self.settings.append(t)
        return i
