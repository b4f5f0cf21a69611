"""Per-peer probe statistics: a pure function of the outcomes fed in (no I/O, no clock).

Two kinds of figure:

* over the last ``window`` probes with an outcome: min / median / p95 RTT, and the
  loss, pooled with a decaying memory of the outcomes before (``loss_outcomes``: how
  many it rests on) unless the window says the loss changed
  (:func:`meshopt.estimate.pooled_loss`);
* smoothed over time by the one estimator of :mod:`meshopt.estimate` (the simulator
  runs the same one for every link): ``srtt_ms`` is the robust EWMA of RTT samples
  (half-life ``half_life_s``; samples far outside the link's spread, such as a stall's
  or a spike's, are rejected unless they persist), ``rtt_std_ms`` the standard
  deviation of the samples (the one meaning of jitter), ``noise_ms`` the standard
  deviation of ``srtt_ms`` itself (what the anti-flap policy compares gains with),
  ``srtt_mean_ms`` the plain EWMA of every sample, for comparison.

``jitter_ms`` is RFC 3550's interarrival jitter over consecutive accepted samples
(``J += (|D| - J) / 16``), kept while telemetry carries it; σ is ``rtt_std_ms``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshopt.estimate import (
    BIRTH_SLACK,
    DEFAULT_HALF_LIFE_S,
    DEFAULT_JITTER_HALF_LIFE_S,
    TABLE,
    RobustConfig,
    RttEstimator,
    alpha_for,
    loss_changed,
    pooled_loss,
    quantile,
    remember_loss,
    remembers,
    tables,
    warm_up_tables,
)

__all__ = [
    "DEFAULT_HALF_LIFE_S",
    "DEFAULT_JITTER_HALF_LIFE_S",
    "PeerWindow",
    "ProbeStats",
    "RobustConfig",
    "alpha_for",
    "quantile",
]

# The names tests/unit/test_agent_imports.py compares with the simulator's.
_TABLE = TABLE
_warm_up_tables = warm_up_tables
_tables = tables


@dataclass(frozen=True, slots=True)
class ProbeStats:
    sent: int  # since the window was created
    received: int
    lost: int
    loss: float  # 0..1: lost / outcomes over the window, pooled with the memory
    samples: int  # RTT samples in the window
    rtt_min_ms: float | None
    rtt_median_ms: float | None
    rtt_p95_ms: float | None
    srtt_ms: float | None  # robust: stalls and spikes rejected (meshopt.estimate)
    jitter_ms: float | None  # RFC 3550, over accepted samples
    noise_ms: float | None  # standard deviation of srtt_ms
    last_rtt_ms: float | None
    rtt_std_ms: float | None = None  # standard deviation of the samples (the one jitter)
    srtt_mean_ms: float | None = None  # plain EWMA of every sample
    outliers: int = 0  # samples the estimator rejected since the window was created
    loss_outcomes: float = 0.0  # outcomes ``loss`` rests on (the window's, or with memory)


class PeerWindow:
    """Outcomes of one peer's probes, fed by the prober with injected times."""

    def __init__(
        self,
        window: int = 64,
        half_life_s: float = DEFAULT_HALF_LIFE_S,
        *,
        interval_s: float = 0.33,
        jitter_half_life_s: float = DEFAULT_JITTER_HALF_LIFE_S,
        robust: RobustConfig | None = None,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.window = window
        self.alpha = alpha_for(half_life_s, interval_s)
        var_alpha = alpha_for(jitter_half_life_s, interval_s)
        self.estimator = RttEstimator(self.alpha, robust, var_alpha=var_alpha)
        self._outcomes: dict[int, float | None] = {}  # seq -> RTT ms, None if lost
        self.sent = 0
        self.received = 0
        self.lost = 0
        self.last_reply_at: float | None = None
        self.last_loss_at: float | None = None
        # The loss memory (meshopt.estimate.pooled_loss): outcomes counted so far and
        # lost in the window, the last outcome that may not enter the memory (None: the
        # peer never answered), and the decayed lost and outcome counts it holds.
        self._counted = 0
        self._window_lost = 0
        self._forget_until: int | None = None
        self._old_lost = 0.0
        self._old_outcomes = 0.0
        # The last stats(), until an outcome changes them (the agent asks for every
        # peer's each second; a slowly probed peer has a new outcome every few).
        self._stats: ProbeStats | None = None

    def forget_outage(self) -> int:
        """Drop the losses recorded since the last reply (a peer back from being dead:
        they were the outage, told as its death, not the path's loss); how many."""
        outcomes = self._outcomes
        dropped = 0
        while outcomes:
            last = next(reversed(outcomes))
            if outcomes[last] is not None:
                break
            del outcomes[last]
            dropped += 1
        self._counted -= dropped
        self._window_lost -= dropped
        if dropped:
            self._stats = None
        return dropped

    def add_sent(self, seq: int, now: float) -> None:
        self.sent += 1

    def add_reply(self, seq: int, rtt_ms: float, now: float) -> bool:
        """Record a reply; False (and nothing changes) if ``seq`` already has an outcome."""
        if not self._record(seq, rtt_ms):
            return False
        self.received += 1
        self.last_reply_at = now
        if self._forget_until is None:
            self._forget_until = self.sent + BIRTH_SLACK
        self.estimator.add(rtt_ms, now)
        return True

    def add_loss(self, seq: int, now: float) -> bool:
        """Record a probe that got no reply in time; False if ``seq`` already has an outcome."""
        if not self._record(seq, None):
            return False
        self.lost += 1
        self.last_loss_at = now
        return True

    def _record(self, seq: int, rtt_ms: float | None) -> bool:
        if seq in self._outcomes:
            return False
        self._stats = None
        outcomes = self._outcomes
        outcomes[seq] = rtt_ms
        self._counted += 1
        self._window_lost += rtt_ms is None
        if len(outcomes) > self.window:
            gone = next(iter(outcomes))
            was_lost = outcomes.pop(gone) is None
            self._window_lost -= was_lost
            if remembers(self._counted - self.window, self._forget_until):
                self._age_out(was_lost)
        return True

    def _age_out(self, was_lost: bool) -> None:
        """An outcome leaves the window: into the loss memory, unless the window's
        loss has moved away from the memory's (then the memory is forgotten)."""
        if loss_changed(self._window_lost, self.window, self._old_lost, self._old_outcomes):
            self._old_lost = self._old_outcomes = 0.0
            self._forget_until = self._counted
        else:
            self._old_lost, self._old_outcomes = remember_loss(
                self._old_lost, self._old_outcomes, was_lost
            )

    def stats(self) -> ProbeStats:
        cached = self._stats
        if cached is not None:
            if cached.sent != self.sent:  # only probes sent since: the rest still holds
                cached = self._stats = dataclasses.replace(cached, sent=self.sent)
            return cached
        self._stats = self._compute()
        return self._stats

    def _compute(self) -> ProbeStats:
        rtts = sorted(r for r in self._outcomes.values() if r is not None)
        outcomes = len(self._outcomes)
        lost = outcomes - len(rtts)
        loss, loss_outcomes = pooled_loss(lost, outcomes, self._old_lost, self._old_outcomes)
        est = self.estimator
        return ProbeStats(
            sent=self.sent,
            received=self.received,
            lost=self.lost,
            loss=loss,
            samples=len(rtts),
            rtt_min_ms=rtts[0] if rtts else None,
            rtt_median_ms=_median_of_sorted(rtts) if rtts else None,
            rtt_p95_ms=quantile(rtts, 0.95) if rtts else None,
            srtt_ms=est.srtt_ms,
            jitter_ms=est.rfc3550_ms(),
            noise_ms=est.noise(),
            last_rtt_ms=est.last_ms(),
            rtt_std_ms=est.std(),
            srtt_mean_ms=est.mean_ms,
            outliers=est.outliers,
            loss_outcomes=loss_outcomes,
        )


def _median_of_sorted(ordered: list[float]) -> float:
    """``statistics.median`` of values already sorted (it would sort them again)."""
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2
