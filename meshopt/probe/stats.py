"""Per-peer probe statistics: a pure function of the outcomes fed in (no I/O, no clock).

Two kinds of figure:

* over the last ``window`` probes with an outcome: loss, min / median / p95 RTT;
* smoothed over time, the same estimator the simulator runs for every link
  (:mod:`meshopt.sim.estimator`): ``srtt`` is an EWMA with a half-life of
  ``half_life_s`` (one weight per sample, from the probe interval), ``rtt_std_ms`` the
  standard deviation of the samples from West's incremental EWMA of squared
  deviations, and ``noise_ms`` the standard deviation of ``srtt`` itself — what the
  anti-flap policy compares gains with. The warm-up corrections are the simulator's own
  tables, so an agent and a simulation of it report the same noise.

``jitter_ms`` is RFC 3550's interarrival jitter over consecutive RTT samples:
``J += (|D| - J) / 16`` with ``D`` the difference of two consecutive RTTs.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass

DEFAULT_HALF_LIFE_S = 2.0  # the simulator's rtt_half_life_s
# The simulator's warm-up tables (meshopt.sim.estimator), computed here in plain Python
# with the same formulas: the agent must not load numpy (~15 MB of RSS per node).
# tests/unit/test_agent_imports.py checks both agree (to a rounding of numpy's pow).
_TABLE = 1024


def alpha_for(half_life_s: float, interval_s: float) -> float:
    """EWMA weight per sample that halves an old value's influence in ``half_life_s``."""
    if half_life_s <= 0:
        return 1.0
    return float(1.0 - 0.5 ** (interval_s / half_life_s))


def _warm_up_tables(a: float) -> tuple[list[float], list[float]]:
    """``share[k]`` and ``var_gain[k]`` of meshopt.sim.estimator._warm_up_tables."""
    share: list[float] = []
    for k in range(_TABLE):
        decay = (1.0 - a) ** (2 * max(k - 1, 0))
        share.append(decay + a * a * (1.0 - decay) / (1.0 - (1.0 - a) ** 2))
    gain = [0.0] * _TABLE
    for i in range(2, _TABLE):
        gain[i] = (1.0 - a) * (gain[i - 1] + a * (1.0 + share[i - 1]))
    return share, gain


def quantile(ordered: list[int] | list[float], q: float) -> float:
    """The ``q`` quantile of sorted values, linear between closest ranks (numpy's default)."""
    if not ordered:
        raise ValueError("quantile of no values")
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))


@functools.lru_cache(maxsize=16)
def _tables(a: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    share, gain = _warm_up_tables(a)
    return tuple(float(x) for x in share), tuple(float(x) for x in gain)


@dataclass(frozen=True, slots=True)
class ProbeStats:
    sent: int  # since the window was created
    received: int
    lost: int
    loss: float  # lost / outcomes over the window, 0..1
    samples: int  # RTT samples in the window
    rtt_min_ms: float | None
    rtt_median_ms: float | None
    rtt_p95_ms: float | None
    srtt_ms: float | None
    jitter_ms: float | None  # RFC 3550
    noise_ms: float | None  # standard deviation of srtt_ms
    last_rtt_ms: float | None
    rtt_std_ms: float | None = None  # standard deviation of the samples (the metric's jitter)


class PeerWindow:
    """Outcomes of one peer's probes, fed by the prober with injected times."""

    def __init__(
        self,
        window: int = 64,
        half_life_s: float = DEFAULT_HALF_LIFE_S,
        *,
        interval_s: float = 0.33,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.window = window
        self.alpha = alpha_for(half_life_s, interval_s)
        self._share, self._gain = _tables(self.alpha)
        self._outcomes: dict[int, float | None] = {}  # seq -> RTT ms, None if lost
        self.sent = 0
        self.received = 0
        self.lost = 0
        self.last_reply_at: float | None = None
        self.last_loss_at: float | None = None
        self.reset_smoothing()

    def reset_smoothing(self) -> None:
        """Start the smoothed figures afresh (a peer that comes back after being dead)."""
        self._srtt: float | None = None
        self._var = 0.0  # EWMA of squared deviations, before the warm-up correction
        self._k = 0  # samples since the smoothing (re)started
        self._jitter = 0.0
        self._last_rtt: float | None = None

    def add_sent(self, seq: int, now: float) -> None:
        self.sent += 1

    def add_reply(self, seq: int, rtt_ms: float, now: float) -> bool:
        """Record a reply; False (and nothing changes) if ``seq`` already has an outcome."""
        if not self._record(seq, rtt_ms):
            return False
        self.received += 1
        self.last_reply_at = now
        if self._srtt is None:
            self._srtt, self._var, self._k = rtt_ms, 0.0, 1
        else:
            a = self.alpha
            dev = rtt_ms - self._srtt
            self._var = (1.0 - a) * (self._var + a * dev * dev)
            self._srtt += a * dev
            self._k += 1
        if self._last_rtt is not None:
            self._jitter += (abs(rtt_ms - self._last_rtt) - self._jitter) / 16.0
        self._last_rtt = rtt_ms
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
        self._outcomes[seq] = rtt_ms
        if len(self._outcomes) > self.window:
            del self._outcomes[next(iter(self._outcomes))]
        return True

    def stats(self) -> ProbeStats:
        rtts = sorted(r for r in self._outcomes.values() if r is not None)
        outcomes = len(self._outcomes)
        lost = outcomes - len(rtts)
        k = min(self._k, _TABLE - 1)
        std: float | None = None
        noise: float | None = None
        if self._srtt is not None:
            gain = self._gain[k]
            std = math.sqrt(self._var / gain) if gain > 0 else 0.0
            noise = std * math.sqrt(self._share[k])
        return ProbeStats(
            sent=self.sent,
            received=self.received,
            lost=self.lost,
            loss=lost / outcomes if outcomes else 0.0,
            samples=len(rtts),
            rtt_min_ms=rtts[0] if rtts else None,
            rtt_median_ms=statistics.median(rtts) if rtts else None,
            rtt_p95_ms=quantile(rtts, 0.95) if rtts else None,
            srtt_ms=self._srtt,
            jitter_ms=self._jitter if self._srtt is not None else None,
            noise_ms=noise,
            last_rtt_ms=self._last_rtt,
            rtt_std_ms=std,
        )
