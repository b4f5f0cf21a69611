"""What the agents would estimate from their probes, for every link at once.

The same estimator an agent runs per peer, vectorised over an n×n matrix:

* ``srtt``: an EWMA of RTT samples (half-life ``rtt_half_life_s``), started at
  the first sample of a link (or the first after it was dead);
* ``jitter``: the standard deviation of the RTT samples, from an EWMA of the
  squared deviations with the same weight (West's incremental form). That is
  the quantity the metric and the topology files call jitter (a topology's
  per-direction jitter is the standard deviation of the one-way delay, so a
  round trip's is the root sum of squares of both directions). The EWMA starts
  at 0 and early deviations are taken from a young srtt; both are corrected
  (exactly, for independent samples) so that a link's jitter is about right
  from its second sample on instead of creeping up over tens of samples;
* ``loss``: an EWMA of lost probes (half-life ``loss_half_life_s``), starting at 0;
* ``noise()``: the standard deviation of ``srtt`` itself, which is what the
  anti-flap policy compares gains with. It is larger while a link has few
  samples and shrinks to
  ``jitter × sqrt(a / (2 - a))`` in steady state;
* ``loss_noise()``: the standard deviation of ``loss`` (an EWMA of Bernoulli
  samples), which matters as much as RTT noise on lossy links: a 2 % lossy
  link's loss estimate moves by about ±1.3 % (±3 ms of metric) at a 10 s half-life;
* a count of consecutive misses that declares a link dead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


_TABLE = 1024  # samples after which the warm-up corrections are at their steady values


def _warm_up_tables(a: float) -> tuple[FloatArray, FloatArray]:
    """How the EWMAs behave after k samples of a link, for k = 0 .. _TABLE - 1.

    ``share[k]``: variance of srtt (started at the first sample, then
    ``srtt += a (x - srtt)``) as a fraction of the samples' variance:
    ``(1-a)^(2(k-1)) + a^2 (1 - (1-a)^(2(k-1))) / (1 - (1-a)^2)``, 1 at k = 1 and
    ``a / (2 - a)`` in steady state.

    ``var_gain[k]``: expected value of the variance EWMA
    (``var = (1-a) (var + a dev^2)``, 0 at the first sample) as a fraction of the
    samples' variance. Each deviation is measured from the srtt before it, so its
    expected square is ``1 + share[k-1]``: early deviations are larger, which an
    estimate that only undid the EWMA's start at zero would count as jitter.
    """
    k = np.arange(_TABLE)
    decay = (1.0 - a) ** (2 * np.maximum(k - 1, 0))
    share = decay + a * a * (1.0 - decay) / (1.0 - (1.0 - a) ** 2)
    gain = np.zeros(_TABLE)
    for i in range(2, _TABLE):
        gain[i] = (1.0 - a) * (gain[i - 1] + a * (1.0 + share[i - 1]))
    return share, gain


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
        self._share, self._var_gain = _warm_up_tables(self.a_rtt)
        self.srtt: FloatArray = np.empty((0, 0))
        self.var: FloatArray = np.empty((0, 0))  # EWMA of squared deviations, uncorrected
        self.loss: FloatArray = np.empty((0, 0))
        self.samples: npt.NDArray[np.int64] = np.empty((0, 0), dtype=np.int64)
        self.misses: npt.NDArray[np.int32] = np.empty((0, 0), dtype=np.int32)

    def reset(self, n: int) -> None:
        self.srtt = np.full((n, n), np.nan)
        self.var = np.zeros((n, n))
        self.loss = np.zeros((n, n))
        self.samples = np.zeros((n, n), dtype=np.int64)  # since the link was (re)started
        self.misses = np.zeros((n, n), dtype=np.int32)

    def update(self, sample: FloatArray, lost: BoolArray) -> None:
        """One probe round: ``sample`` RTTs (ignored where ``lost``)."""
        got = ~lost
        fresh = got & (np.isnan(self.srtt) | (self.misses >= self.dead_after))
        # A link that comes back (or is new) starts from its first sample.
        self.srtt = np.where(fresh, sample, self.srtt)
        self.var = np.where(fresh, 0.0, self.var)
        self.samples = np.where(fresh, 0, self.samples) + got
        upd = got & ~fresh
        dev = sample - self.srtt
        a = self.a_rtt
        self.var = np.where(upd, (1 - a) * (self.var + a * dev * dev), self.var)
        self.srtt = np.where(upd, self.srtt + a * dev, self.srtt)
        self.loss += self.a_loss * (lost.astype(np.float64) - self.loss)
        self.misses = np.where(lost, self.misses + 1, 0).astype(np.int32)

    @property
    def jitter(self) -> FloatArray:
        """Standard deviation of the RTT samples (0 while a link has fewer than two)."""
        k = np.minimum(self.samples, _TABLE - 1)
        gain = self._var_gain[k]
        with np.errstate(divide="ignore", invalid="ignore"):
            var = np.where(gain > 0, self.var / gain, 0.0)
        return np.asarray(np.sqrt(var))

    def dead(self) -> BoolArray:
        return np.asarray(self.misses >= self.dead_after)

    def noise(self) -> FloatArray:
        """Standard deviation of the smoothed RTT (not of single samples)."""
        return np.asarray(self.jitter * np.sqrt(self._share[np.minimum(self.samples, _TABLE - 1)]))

    def loss_noise(self) -> FloatArray:
        """Standard deviation of the loss estimate, taking the estimate as the true rate."""
        a = self.a_loss
        p = np.clip(self.loss, 0.0, 1.0)
        return np.asarray(np.sqrt(p * (1.0 - p) * a / (2.0 - a)))
