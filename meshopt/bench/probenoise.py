"""The shape of the lab's probe noise, for the simulator to draw the same.

The lab's agents share two cores with wireguard-go and the emulator, and a process
woken late delays a probe by a millisecond or so. On a long link that is within the
outlier rule's 5 % of the RTT, so the sample is kept, and σ's estimate shows it as a
tail: demo's steady spell, quiet, read σ at median 0.32 ms and 99th percentile 0.62 ms,
where normal noise with the same median gives 0.39. Which of two paths within a margin
of each other a failure picks rests on the σ terms at that moment (demo's lon<->waw
after its relay failed: the lab took the path via par in about half its runs, and a
simulator with normal noise in a few seeds of twenty).

:func:`fit` finds the normal σ added per tunnel and the late probes (each probe late
with probability ``p`` by an exponential delay of mean ``mean_ms``) whose σ readings,
through the agents' own estimator, have the lab's quantiles. It runs the estimator on
a few hundred simulated links per candidate: a few seconds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from meshopt.estimate import RobustConfig
from meshopt.sim.estimator import LinkEstimator
from meshopt.topology.model import Topology

QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9, 0.99)
# The candidates: the normal σ each tunnel adds (ms), how often a probe is late, and by
# how much on average (ms). p = 0 is the plain normal model.
SIGMAS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6)
LATE_P = (0.0, 0.01, 0.02, 0.03, 0.05, 0.08, 0.12, 0.2)
LATE_MS = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FIT_LINKS = 400  # simulated links per candidate
SPELL_S = (20.0, 40.0)  # the readings taken (s after the links' first probe)
READ_EVERY_S = 5.0  # the agents' telemetry


@dataclass(frozen=True)
class NoiseFit:
    sigma_ms: float  # normal σ each tunnel adds (root-sum-square with the topology's)
    late_p: float  # share of probes that are late
    late_ms: float  # their mean delay (exponential)
    readings: int  # σ readings the fit rests on
    lab: tuple[float, ...]  # the readings' QUANTILES
    model: tuple[float, ...]  # the fitted model's
    normal: tuple[float, ...]  # the best normal model's (late_p = 0), for comparison

    @property
    def late_mean_ms(self) -> float:
        """What late probes add to a link's mean RTT."""
        return self.late_p * self.late_ms


def simulated_readings(
    base: Sequence[tuple[float, float]],
    sigma_ms: float,
    late_p: float,
    late_ms: float,
    interval_s: float = 0.33,
    links: int = FIT_LINKS,
    seed: int = 0,
) -> np.ndarray:
    """σ readings of links whose samples are normal around the link's RTT (``base``:
    (RTT, σ) per link, cycled; ``sigma_ms`` added to σ in quadrature) plus late probes,
    through the agents' estimator (the simulator's vectorised copy of it), every
    READ_EVERY_S in SPELL_S, each link on its own phase. The RTT matters: the outlier
    rule keeps a late probe within 5 % of a long link's RTT and drops it on a short
    one (beyond 2 ms on an 8 ms link), so long links read a larger σ (demo's lab: 0.32
    ms at 8 ms, 0.43 ms at 80 ms)."""
    side = math.ceil(math.sqrt(links))
    rng = np.random.default_rng(seed)
    pairs = np.asarray(base, dtype=float).reshape(-1, 2)
    level = np.resize(pairs[:, 0], (side, side))
    sd = np.sqrt(np.resize(pairs[:, 1], (side, side)) ** 2 + sigma_ms**2)
    est = LinkEstimator(interval_s, robust=RobustConfig())
    est.reset(side)
    phase = rng.uniform(0.0, READ_EVERY_S, (side, side))
    out: list[np.ndarray] = []
    no_loss = np.zeros((side, side), dtype=bool)
    steps = int(SPELL_S[1] / interval_s) + 1
    for k in range(steps):
        t = k * interval_s
        x = level + rng.standard_normal((side, side)) * sd
        if late_p > 0.0:
            hit = rng.random((side, side)) < late_p
            x = x + np.where(hit, rng.exponential(late_ms, (side, side)), 0.0)
        est.update(x, no_loss)
        # A reading when a link's telemetry phase passes within this step.
        due = ((t - phase) % READ_EVERY_S) < interval_s
        if t >= SPELL_S[0] and due.any():
            out.append(est.jitter[due])
    return np.concatenate(out) if out else np.zeros(0)


def _loss(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sum((np.log(a) - np.log(b)) ** 2))


def fit(readings: Iterable[tuple[str, str, float]], topo: Topology) -> NoiseFit | None:
    """From (node, peer, σ reported) readings of a steady spell: the model whose
    simulated readings (each reading's link at its own RTT and σ) have QUANTILES
    nearest the lab's (in log space). None with fewer than 20 readings of known links."""
    names = set(topo.names)
    lab: list[float] = []
    base: list[tuple[float, float]] = []
    jit, rtt = topo.jitter_ms, topo.rtt_ms()
    for node, peer, sigma in readings:
        if node not in names or peer not in names or node == peer:
            continue
        if not (math.isfinite(sigma) and sigma > 0.0):
            continue
        i, j = topo.index(node), topo.index(peer)
        lab.append(sigma)
        base.append((float(rtt[i, j]), math.hypot(float(jit[i, j]), float(jit[j, i]))))
    if len(lab) < 20:
        return None
    q = np.asarray(QUANTILES)
    target = np.quantile(np.asarray(lab), q)
    best: tuple[float, float, float, float, np.ndarray] | None = None
    normal: tuple[float, np.ndarray] | None = None
    for p in LATE_P:
        for m in LATE_MS if p > 0.0 else (0.0,):
            for s in SIGMAS:
                got = np.quantile(simulated_readings(base, s, p, m), q)
                if not np.all(got > 0.0):
                    continue
                e = _loss(got, target)
                if best is None or e < best[0]:
                    best = (e, s, p, m, got)
                if p == 0.0 and (normal is None or e < normal[0]):
                    normal = (e, got)
    if best is None or normal is None:
        return None
    _, s, p, m, got = best

    def r(x: np.ndarray) -> tuple[float, ...]:
        return tuple(round(float(v), 4) for v in x)

    return NoiseFit(s, p, m, len(lab), r(target), r(got), r(normal[1]))
