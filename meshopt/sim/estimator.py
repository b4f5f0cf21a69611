"""What the agents would estimate from their probes, for every link at once.

The estimator of :mod:`meshopt.estimate` (the one an agent runs per peer), vectorised
over an n×n matrix; its tables and rules come from there, so an agent and a simulation
of it report the same figures:

* ``srtt``: the EWMA of RTT samples (half-life ``rtt_half_life_s``), started at the
  first sample of a link (or the first after it was dead). With ``robust`` (the
  agent's :class:`~meshopt.estimate.RobustConfig`) it is the agent's robust EWMA: a
  sample further than ``k`` scales from it is rejected unless it is part of a
  confirmed change (:func:`~meshopt.estimate.confirmed_change`), and the warm-up is
  checked for spikes (:func:`~meshopt.estimate.warm_up_restart`: at its end, and with
  ``early_reseed`` from that many samples on, a far-off one dropped for good, as the
  agent's :data:`~meshopt.estimate.AGENT` does). A simulated round
  has one sample per link, so each outlier is its own group, and each warm-up sample
  its own burst. The default is
  :data:`~meshopt.estimate.PLAIN` (every sample accepted) until the engine adopts it;
* ``jitter``: the standard deviation σ of the accepted RTT samples (West's incremental
  EWMA of squared deviations, half-life ``jitter_half_life_s``, with the warm-up
  corrections), the one meaning of jitter
  (topology files give σ of the one-way delay, so a round trip's is the root sum of
  squares of both directions);
* ``loss``: an EWMA of lost probes (half-life ``loss_half_life_s``), starting at 0;
* ``noise()``: the standard deviation of ``srtt`` itself, which is what the
  anti-flap policy compares gains with: ``jitter × sqrt(share[k])``, shrinking to
  ``jitter × sqrt(a / (2 - a))`` in steady state;
* ``loss_noise()``: the standard deviation of ``loss`` (an EWMA of Bernoulli
  samples), which matters as much as RTT noise on lossy links: a 2 % lossy
  link's loss estimate moves by about ±1.3 % (±3 ms of metric) at a 10 s half-life;
* a count of consecutive misses that declares a link dead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from meshopt.estimate import (
    DEFAULT_JITTER_HALF_LIFE_S,
    LOSS_CHANGE_Z,
    LOSS_MEMORY_DECAY,
    PLAIN,
    TABLE,
    RobustConfig,
    alpha_for,
    confirmed_change,
    mad_sigma,
    warm_up_restart,
    warm_up_tables,
)

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]
_T = TypeVar("_T", bound=np.generic)

__all__ = [
    "NEVER_ANSWERED",
    "LinkEstimator",
    "alpha_for",
    "loss_changed",
    "pooled_loss",
    "remember_loss",
    "remembers",
]

_TABLE = TABLE


def _warm_up_tables(a: float, av: float | None = None) -> tuple[FloatArray, FloatArray]:
    """:func:`meshopt.estimate.warm_up_tables` as arrays."""
    share, gain = warm_up_tables(a, av)
    return np.array(share, dtype=np.float64), np.array(gain, dtype=np.float64)


def _flat(a: npt.NDArray[_T]) -> npt.NDArray[_T]:
    """A flat view of a state matrix, written through (never a copy)."""
    if not a.flags.c_contiguous:
        raise ValueError("estimator state must be C-contiguous")
    return a.reshape(-1)


@dataclass
class LinkEstimator:
    interval_s: float
    rtt_half_life_s: float = 2.0
    loss_half_life_s: float = 10.0
    dead_after: int = 4
    jitter_half_life_s: float = DEFAULT_JITTER_HALF_LIFE_S
    # The agent's outlier rule (RobustConfig()) is opt-in here until the engine and its
    # tests expect a change to show on the third probe, not the first (docs/estimator.md).
    robust: RobustConfig = PLAIN

    def __post_init__(self) -> None:
        self.a_rtt = alpha_for(self.rtt_half_life_s, self.interval_s)
        self.a_loss = alpha_for(self.loss_half_life_s, self.interval_s)
        self.a_var = alpha_for(self.jitter_half_life_s, self.interval_s)
        self._share, self._var_gain = _warm_up_tables(self.a_rtt, self.a_var)
        self.srtt: FloatArray = np.empty((0, 0))
        self.var: FloatArray = np.empty((0, 0))  # EWMA of squared deviations, uncorrected
        self.loss: FloatArray = np.empty((0, 0))
        self.samples: npt.NDArray[np.int64] = np.empty((0, 0), dtype=np.int64)
        self.accepted: npt.NDArray[np.int64] = np.empty((0, 0), dtype=np.int64)
        self.misses: npt.NDArray[np.int32] = np.empty((0, 0), dtype=np.int32)
        self.pending: npt.NDArray[np.int32] = np.empty((0, 0), dtype=np.int32)
        self.pending_values: FloatArray = np.empty((0, 0, 0))
        self.outliers: npt.NDArray[np.int64] = np.empty((0, 0), dtype=np.int64)
        # Links whose outliers the last update confirmed as a change (the prober's
        # on_step: the agent then tells the controller at once).
        self.stepped: list[tuple[int, int]] = []

    @property
    def _checks_warm_up(self) -> bool:
        return 0 < self.robust.warmup <= 64

    def reset(self, n: int) -> None:
        self.srtt = np.full((n, n), np.nan)
        self.var = np.zeros((n, n))
        self.loss = np.zeros((n, n))
        self.samples = np.zeros((n, n), dtype=np.int64)  # in the current level
        self.accepted = np.zeros((n, n), dtype=np.int64)  # since the link (re)started
        self.misses = np.zeros((n, n), dtype=np.int32)
        self.pending = np.zeros((n, n), dtype=np.int32)  # consecutive outliers
        self.pending_values = np.zeros((n, n, 2 * self.robust.confirm))
        self.outliers = np.zeros((n, n), dtype=np.int64)
        # The warm-up's samples, only where they are checked (estimate.warm_up_restart).
        self.warm = np.zeros((n, n, self.robust.warmup if self._checks_warm_up else 0))
        # How many of them are kept: an early re-seed drops the far-off ones, and the
        # later checks judge the others (RttEstimator._reseed).
        self.warm_n = np.zeros((n, n), dtype=np.int64)

    def revive(self, links: BoolArray) -> None:
        """Links that came back after being dead keep their estimate (the prober's):
        their next sample continues it, its misses while dead forgotten."""
        self.misses = np.where(links, 0, self.misses).astype(np.int32)

    def update(self, sample: FloatArray, lost: BoolArray, probed: BoolArray | None = None) -> None:
        """One probe round: ``sample`` RTTs (ignored where ``lost``); ``probed``: only
        those links sent a probe (an agent not started yet sends none), the rest stay."""
        idx = np.arange(self.srtt.size) if probed is None else np.flatnonzero(probed)
        self.update_links(idx, sample.reshape(-1)[idx], lost.reshape(-1)[idx])

    def update_links(self, idx: npt.NDArray[np.intp], sample: FloatArray, lost: BoolArray) -> None:
        """The outcomes of probes on some links (flat indices ``idx``): the work is in
        proportion to them, as the simulator feeds each tick the replies that arrived
        in it (a round's replies come over its RTTs, up to a dozen ticks)."""
        cfg = self.robust
        self.stepped = []
        if idx.size == 0:
            return
        srtt_f, var_f = _flat(self.srtt), _flat(self.var)
        samples_f, accepted_f = _flat(self.samples), _flat(self.accepted)
        pending_f, outliers_f = _flat(self.pending), _flat(self.outliers)
        srtt, var, samples = srtt_f[idx], var_f[idx], samples_f[idx]
        accepted, misses = accepted_f[idx], _flat(self.misses)[idx]
        got = ~lost
        fresh = got & (np.isnan(srtt) | (misses >= self.dead_after))
        # A link that comes back (or is new) starts from its first sample.
        if fresh.any():
            srtt, var = np.where(fresh, sample, srtt), np.where(fresh, 0.0, var)
            samples, accepted = np.where(fresh, 1, samples), np.where(fresh, 1, accepted)
            fi = idx[fresh]
            srtt_f[fi], var_f[fi], samples_f[fi], accepted_f[fi] = sample[fresh], 0.0, 1, 1
            pending_f[fi] = 0
        upd = got & ~fresh
        dev = sample - srtt
        scale = np.maximum(
            np.maximum(self._jitter_of(var, samples), cfg.min_scale_ms),
            cfg.min_scale_rel * np.nan_to_num(srtt),
        )  # estimate.scale_of, vectorised
        with np.errstate(invalid="ignore"):
            out = upd & (accepted >= cfg.warmup) & (np.abs(dev) > cfg.k * scale)
        acc = upd & ~out
        # Outliers: remembered; a confirmed change restarts the link (estimate.py's rule).
        if out.any():
            oi = idx[out]
            slots = self.pending_values.reshape(self.srtt.size, -1)
            slots[oi, pending_f[oi]] = sample[out]
            pending_f[oi] += 1
            outliers_f[oi] += 1
            n = self.srtt.shape[1]
            for flat, sc in zip(oi.tolist(), scale[out].tolist(), strict=True):
                self._restart(flat // n, flat % n, sc)
        a, av = self.a_rtt, self.a_var
        ai, d = idx[acc], dev[acc]
        pending_f[ai] = 0
        var_f[ai] = (1 - av) * (var[acc] + av * d * d)
        srtt_f[ai] = srtt[acc] + a * d
        samples_f[ai] += 1
        accepted_f[ai] += 1
        if self._checks_warm_up:
            self._check_warm_up(idx, acc, fresh, sample)
        loss_f = _flat(self.loss)
        loss_f[idx] += self.a_loss * (lost.astype(np.float64) - loss_f[idx])
        _flat(self.misses)[idx] = np.where(lost, misses + 1, 0)

    def _check_warm_up(
        self, idx: npt.NDArray[np.intp], acc: BoolArray, fresh: BoolArray, sample: FloatArray
    ) -> None:
        """Keep the warm-up's samples and check them for a far-off one (the agent's
        RttEstimator._accept): at the end of the warm-up, and from ``early_reseed``
        samples on."""
        cfg = self.robust
        now_accepted = _flat(self.accepted)[idx]
        warm = self.warm.reshape(self.srtt.size, -1)
        warm_n = _flat(self.warm_n)
        warm_n[idx[fresh]] = 0  # a link that (re)starts starts its warm-up afresh
        took = (acc | fresh) & (now_accepted <= cfg.warmup)
        if not took.any():
            return
        ti = idx[took]
        warm[ti, warm_n[ti]] = sample[took]
        warm_n[ti] += 1
        final = now_accepted[took] == cfg.warmup
        early = ~final & (cfg.early_reseed > 0) & (warm_n[ti] >= cfg.early_reseed)
        check = ti[final | early]
        if check.size:
            maybe = self._maybe_far(warm[check, :], warm_n[check])
            n = self.srtt.shape[1]
            for flat in check[maybe].tolist():
                self._reseed(flat // n, flat % n)
        warm_n[ti[final]] = 0  # the warm-up is over

    def _restart(self, i: int, j: int, scale: float) -> None:
        """Link (i, j)'s outliers so far, if they are a real change (estimate.py)."""
        pending = self.pending_values[i, j, : self.pending[i, j]].tolist()
        change = confirmed_change(pending, float(self.srtt[i, j]), scale, self.robust)
        if change is None:
            return
        level, values = change
        sigma = max(float(self.jitter[i, j]), mad_sigma(values))
        k = len(values)
        self.srtt[i, j] = level
        self.samples[i, j] = k
        self.var[i, j] = sigma * sigma * self._var_gain[min(k, _TABLE - 1)]
        self.pending[i, j] = 0
        self.stepped.append((i, j))

    def _maybe_far(self, values: FloatArray, count: npt.NDArray[np.int64]) -> BoolArray:
        """Rows of warm-up samples (the first ``count`` of each) in which
        :func:`~meshopt.estimate.warm_up_restart` may find a far-off sample (its test,
        vectorised, with a hair of slack for rounding): the others certainly have none,
        so the exact rule runs only on these."""
        cfg = self.robust
        kept = np.arange(values.shape[1])[None, :] < count[:, None]
        values = np.where(kept, values, np.nan)
        level = np.nanmedian(values, axis=1)
        sigma = 1.4826 * np.nanmedian(np.abs(values - level[:, None]), axis=1)
        scale = np.maximum(np.maximum(sigma, cfg.min_scale_ms), cfg.min_scale_rel * level)
        with np.errstate(invalid="ignore"):
            far = np.abs(values - level[:, None]) > 2.0 * cfg.k * scale[:, None] * (1 - 1e-9)
        return np.asarray(far.any(axis=1))

    def _reseed(self, i: int, j: int) -> None:
        """Link (i, j)'s warm-up so far: restart if a sample was far off, and keep only
        the others for the later checks."""
        values = self.warm[i, j, : self.warm_n[i, j]].tolist()
        restart = warm_up_restart(values, self.robust)
        if restart is None:
            return
        level, kept = restart
        self.warm[i, j, : len(kept)] = kept
        self.warm_n[i, j] = len(kept)
        sigma = mad_sigma(kept)
        self.srtt[i, j] = level
        self.samples[i, j] = len(kept)
        self.var[i, j] = sigma * sigma * self._var_gain[min(len(kept), _TABLE - 1)]
        self.outliers[i, j] += len(values) - len(kept)

    @property
    def jitter(self) -> FloatArray:
        """Standard deviation of the RTT samples (0 while a link has fewer than two)."""
        return self.jitter_rows(None)

    def jitter_rows(self, rows: npt.NDArray[np.intp] | None) -> FloatArray:
        """``jitter`` of the links from ``rows`` only (None: all)."""
        if rows is None:
            return self._jitter_of(self.var, self.samples)
        return self._jitter_of(self.var[rows], self.samples[rows])

    def _jitter_of(self, var_: FloatArray, samples: npt.NDArray[np.int64]) -> FloatArray:
        gain = self._var_gain[np.minimum(samples, _TABLE - 1)]
        with np.errstate(divide="ignore", invalid="ignore"):
            var = np.where(gain > 0, var_ / gain, 0.0)
        return np.asarray(np.sqrt(var))

    def noise_rows(self, rows: npt.NDArray[np.intp] | None) -> FloatArray:
        """``noise()`` of the links from ``rows`` only (None: all)."""
        samples = self.samples if rows is None else self.samples[rows]
        share = self._share[np.minimum(samples, _TABLE - 1)]
        return np.asarray(self.jitter_rows(rows) * np.sqrt(share))

    def confirming(self) -> BoolArray:
        """Links with outliers waiting to be confirmed or dismissed
        (:attr:`meshopt.estimate.RttEstimator.confirming`): the prober probes them fast."""
        return np.asarray(self.pending > 0)

    def dead(self) -> BoolArray:
        return np.asarray(self.misses >= self.dead_after)

    def noise(self) -> FloatArray:
        """Standard deviation of the smoothed RTT (not of single samples)."""
        return self.noise_rows(None)

    def loss_noise(self) -> FloatArray:
        """Standard deviation of the loss estimate, taking the estimate as the true rate."""
        a = self.a_loss
        p = np.clip(self.loss, 0.0, 1.0)
        return np.asarray(np.sqrt(p * (1.0 - p) * a / (2.0 - a)))


# -- the prober's loss memory (meshopt.estimate.pooled_loss), every link at once ---------

NEVER_ANSWERED = np.iinfo(np.int64).max  # ``forget_until`` of a peer that never answered


def remembers(ordinal: npt.NDArray[np.int64], forget_until: npt.NDArray[np.int64]) -> BoolArray:
    """:func:`meshopt.estimate.remembers` (NEVER_ANSWERED for its None)."""
    return np.asarray(ordinal > forget_until)


def loss_changed(
    lost: FloatArray, outcomes: FloatArray, old_lost: FloatArray, old_outcomes: FloatArray
) -> BoolArray:
    """:func:`meshopt.estimate.loss_changed`."""
    z2 = LOSS_CHANGE_Z * LOSS_CHANGE_Z
    with np.errstate(divide="ignore", invalid="ignore"):
        pooled = (lost + old_lost) / (outcomes + old_outcomes)
        diff = lost / outcomes - old_lost / old_outcomes
        var = pooled * (1.0 - pooled) * (1.0 / outcomes + 1.0 / old_outcomes)
        out = (old_outcomes >= 1.0) & (outcomes > 0) & (diff * diff > z2 * var)
    return np.asarray(out)


def remember_loss(
    old_lost: FloatArray, old_outcomes: FloatArray, lost: BoolArray
) -> tuple[FloatArray, FloatArray]:
    """:func:`meshopt.estimate.remember_loss`."""
    d = LOSS_MEMORY_DECAY
    return old_lost * d + lost.astype(np.float64), old_outcomes * d + 1.0


def pooled_loss(
    lost: FloatArray, outcomes: FloatArray, old_lost: FloatArray, old_outcomes: FloatArray
) -> tuple[FloatArray, FloatArray]:
    """:func:`meshopt.estimate.pooled_loss`: (loss, the outcomes it rests on)."""
    changed = loss_changed(lost, outcomes, old_lost, old_outcomes)
    use = (old_outcomes >= 1.0) & (outcomes > 0) & ~changed
    with np.errstate(divide="ignore", invalid="ignore"):
        short = np.where(outcomes > 0, lost / outcomes, 0.0)
        pooled = (lost + old_lost) / (outcomes + old_outcomes)
    return np.where(use, pooled, short), np.where(use, outcomes + old_outcomes, outcomes)
