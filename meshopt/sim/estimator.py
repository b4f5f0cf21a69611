"""What the agents would estimate from their probes, for every link at once.

The same estimator an agent runs per peer, vectorised over an n×n matrix:
an EWMA of RTT (half-life ``rtt_half_life_s``), an RFC 3550-style jitter, an
EWMA of loss, the noise (standard deviation) of the smoothed RTT, and a count
of consecutive misses that declares a link dead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


def alpha_for(half_life_s: float, interval_s: float) -> float:
    """EWMA weight per sample that halves an old value's influence in ``half_life_s``."""
    if half_life_s <= 0:
        return 1.0
    return float(1.0 - 0.5 ** (interval_s / half_life_s))


@dataclass
class LinkEstimator:
    interval_s: float
    rtt_half_life_s: float = 2.0
    loss_half_life_s: float = 10.0
    dead_after: int = 4

    def __post_init__(self) -> None:
        self.a_rtt = alpha_for(self.rtt_half_life_s, self.interval_s)
        self.a_loss = alpha_for(self.loss_half_life_s, self.interval_s)
        self.srtt: FloatArray = np.empty((0, 0))
        self.var: FloatArray = np.empty((0, 0))
        self.jitter: FloatArray = np.empty((0, 0))
        self.loss: FloatArray = np.empty((0, 0))
        self.misses: npt.NDArray[np.int32] = np.empty((0, 0), dtype=np.int32)

    def reset(self, n: int) -> None:
        self.srtt = np.full((n, n), np.nan)
        self.var = np.zeros((n, n))
        self.jitter = np.zeros((n, n))
        self.loss = np.zeros((n, n))
        self.misses = np.zeros((n, n), dtype=np.int32)

    def update(self, sample: FloatArray, lost: BoolArray) -> None:
        """One probe round: ``sample`` RTTs (ignored where ``lost``)."""
        got = ~lost
        fresh = got & (np.isnan(self.srtt) | (self.misses >= self.dead_after))
        # A link that comes back (or is new) starts from its first sample.
        self.srtt = np.where(fresh, sample, self.srtt)
        self.var = np.where(fresh, 0.0, self.var)
        upd = got & ~fresh
        dev = sample - self.srtt
        a = self.a_rtt
        self.jitter = np.where(upd, self.jitter + (np.abs(dev) - self.jitter) / 16.0, self.jitter)
        self.var = np.where(upd, (1 - a) * (self.var + a * dev * dev), self.var)
        self.srtt = np.where(upd, self.srtt + a * dev, self.srtt)
        self.loss += self.a_loss * (lost.astype(np.float64) - self.loss)
        self.misses = np.where(lost, self.misses + 1, 0).astype(np.int32)

    def dead(self) -> BoolArray:
        return np.asarray(self.misses >= self.dead_after)

    def noise(self) -> FloatArray:
        """Standard deviation of the smoothed RTT (not of single samples)."""
        a = self.a_rtt
        return np.asarray(np.sqrt(self.var * a / (2.0 - a)))
