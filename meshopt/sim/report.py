"""Simulation results: plain data, a JSON form and nothing else (the CLI renders them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from meshopt.metric import FloatArray


@dataclass
class PairGain:
    a: str
    b: str
    direct_ms: float  # RTT of the direct tunnel (inf if there is none)
    routed_ms: float  # RTT over the installed routes
    optimum_ms: float  # RTT over the optimal routes for the ground truth
    path: list[str]

    @property
    def gain_ms(self) -> float:
        return self.direct_ms - self.routed_ms


@dataclass
class GainSummary:
    """Pairs whose installed route relays through other nodes, and what it buys them."""

    pairs: int = 0
    relayed: int = 0
    improved: int = 0
    mean_gain_ms: float = 0.0
    median_gain_ms: float = 0.0
    best_gain_ms: float = 0.0
    mean_gain_pct: float = 0.0
    median_gain_pct: float = 0.0
    best_gain_pct: float = 0.0
    no_direct_tunnel: int = 0  # pairs reachable only by relaying
    mean_shortfall_ms: float = 0.0  # installed routes' RTT above the optimum, mean over pairs
    top: list[PairGain] = field(default_factory=list)


@dataclass
class EventResult:
    event: str
    at_s: float
    outage_s: float | None = 0.0  # time until every reachable pair had a working route again
    broken_pairs: int = 0  # most pairs without a working route at any moment
    converge_s: float | None = None  # time until every pair was within the policy margin
    suboptimal_pairs: int = 0  # pairs outside the margin at the end of the interval
    route_changes: int = 0  # installed entries changed until the next event
    # Next-hop entries in use that changed until the next event: the controller's
    # changes and the agents' fail-overs, as a reading of the nodes' tables sees them.
    hop_changes: int = 0
    # The next hops in use when the interval ended, src -> dst -> hop (SimConfig.keep_routes).
    routes: dict[str, dict[str, str]] | None = None


@dataclass
class SimPerf:
    """What the run cost, for capacity planning (wall times vary from run to run).

    ``phase_s`` splits the wall time: "truth" (the ground truth's optimum at the start
    and after each event), "routes" (the controller's all-pairs routes), "backups"
    (computed only in rounds where an installed next hop is dead), "policy", "failover",
    "score" (routes in use against the truth) and "probes" (drawing probes and the
    agents' estimators).
    """

    rounds: int = 0  # time steps simulated (SimConfig.tick_s each)
    recomputes: int = 0  # controller decisions
    backup_computations: int = 0  # recomputes whose backups fail-over needed
    probes_sent: int = 0  # by every agent, at the probe budget's rates
    wall_per_simulated_s: float = 0.0
    phase_s: dict[str, float] = field(default_factory=dict)


@dataclass
class SimReport:
    topology: str
    nodes: int
    pairs: int
    duration_s: float
    seed: int
    symmetric: bool
    gains: GainSummary
    events: list[EventResult]
    route_changes: int
    changes_per_route_hour: float
    max_changes_pair: list[tuple[str, str, int]]
    failovers: int
    runtime_s: float
    initial_converge_s: float | None = None
    initial_suboptimal_pairs: int = 0  # routes outside the margin when the start interval ended
    perf: SimPerf = field(default_factory=SimPerf)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["gains"]["top"] = [
            {**asdict(g), "gain_ms": g.gain_ms} for g in self.gains.top
        ]  # asdict drops properties
        out: dict[str, Any] = json_safe(d)
        return out


def json_safe(obj: Any) -> Any:
    """JSON has no infinity: write null for it."""
    if isinstance(obj, float):
        return None if not np.isfinite(obj) else round(obj, 4)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def summarize_gains(
    names: list[str],
    direct: FloatArray,
    routed: FloatArray,
    optimum: FloatArray,
    relayed: npt.NDArray[np.bool_],
    path_of: Callable[[int, int], list[int]],
    top: int = 10,
) -> GainSummary:
    """Summary over unordered pairs; paths are listed for the ``top`` gains only
    (every path of a 1,000-node mesh would cost more than the simulation)."""
    n = len(names)
    iu, ju = np.triu_indices(n, 1)
    d, r, o = direct[iu, ju], routed[iu, ju], optimum[iu, ju]
    rel = relayed[iu, ju] & np.isfinite(r)
    s = GainSummary(pairs=int(iu.size), relayed=int(rel.sum()))
    s.no_direct_tunnel = int((rel & ~np.isfinite(d)).sum())
    both = np.isfinite(r) & np.isfinite(o)
    if both.any():
        s.mean_shortfall_ms = float((r - o)[both].mean())
    imp = rel & np.isfinite(d) & (r < d)
    s.improved = int(imp.sum())
    if s.improved:
        g = (d - r)[imp]
        pct = 100.0 * g / d[imp]
        s.mean_gain_ms, s.median_gain_ms, s.best_gain_ms = (
            float(g.mean()), float(np.median(g)), float(g.max()))  # fmt: skip
        s.mean_gain_pct, s.median_gain_pct, s.best_gain_pct = (
            float(pct.mean()), float(np.median(pct)), float(pct.max()))  # fmt: skip
    order = np.argsort(-np.where(imp, d - r, -np.inf), kind="stable")[: min(top, s.improved)]
    for k in order.tolist():
        i, j = int(iu[k]), int(ju[k])
        s.top.append(
            PairGain(names[i], names[j], float(direct[i, j]), float(routed[i, j]),
                     float(optimum[i, j]), [names[x] for x in path_of(i, j)])
        )  # fmt: skip
    return s
