"""One model of a measurement: how probe samples become an RTT, a jitter and a noise.

The prober (:mod:`meshopt.probe.stats`, per peer) and the simulator
(:mod:`meshopt.sim.estimator`, every link at once) both run this estimator, so an
agent and a simulation of it report the same figures. Pure: no I/O, no clock (times
are passed in), no numpy (the agent must not load it: ~15 MB of RSS per node).

**RTT.** Delay noise on a path is one-sided and heavy-tailed: a busy host, a stalled
VM or a burst of cross traffic delays a probe by 100 ms or more, never speeds it up.
A plain EWMA (``srtt += a (x - srtt)``) takes a share ``a`` of every such spike; at the
prober's rate (0.33 s, half-life 2 s, ``a`` ≈ 0.11) one 300 ms spike lifts a 10 ms
link by ~33 ms. :class:`RttEstimator` is the same EWMA over *accepted* samples only:

* a sample further than ``k`` scales from the estimate (the scale is the samples'
  standard deviation, at least ``min_scale_ms`` and ``min_scale_rel`` of the RTT) is
  an *outlier* and changes nothing (Hampel's rule, with the EWMA's own deviation in
  place of a windowed MAD, which a vectorised simulator can run too);
* outliers that arrive within ``burst_s`` of each other are one *group*: a stall holds
  replies back and then delivers them at once, and that is one event, not several;
* ``confirm`` consecutive outlier groups that agree with each other (within
  ``agree_rel`` of their offset, or a few scales) are a real change (a new path, a
  congested link): the estimate restarts at their median. At the prober's 0.33 s that
  is the third sample after a step, ~1 s: the degradation goal. A link the probe
  budget probes slowly is probed at that rate too while outliers wait
  (:attr:`RttEstimator.confirming`). Independent spikes
  (100-300 ms) seldom agree; twice ``confirm`` outlier groups in a row restart it
  anyway (the link's spread grew, and σ must follow);
* nothing is rejected during the first ``warmup`` samples (no scale is known yet);
  if one of them was far off (more than ``2k`` MAD-scales from their median), the
  estimate then restarts from the median and MAD-σ of the others. Warm-up samples
  that arrive within ``burst_s`` of each other are one sample too, at their least
  value: replies held in a queue (a WireGuard handshake, a starved wireguard-go) come
  out together, the first held longest, and six of them once outvoted the link's one
  real sample, so the check kept them and dropped it (the 16-node lab's ash2->nyc1:
  733 ms told for a 23 ms tunnel, and a relay held for 30 s).

``scripts/bench_estimator.py`` chose this rule against a plain EWMA, a windowed
median, a windowed minimum and a Hampel-filtered EWMA on clean, spiky, stalled, busy
and stepped series (see docs/estimator.md for the figures). The plain EWMA of every
sample is still computed (``mean_ms``) for comparison and compatibility.

**Jitter** means one thing: the standard deviation σ of the RTT samples (West's
incremental EWMA of squared deviations, with exact warm-up corrections, over a longer
half-life than the RTT's: :data:`DEFAULT_JITTER_HALF_LIFE_S`). Chosen over
RFC 3550's interarrival jitter (mean |ΔRTT|) because σ is what the topology files, the
lab's shaper and netem (``distribution normal``) and the simulator are given, so a
configured link and its measurement agree; because independent delays add variances,
so a path's σ is the root-sum-square of its links' (:func:`path_jitter_ms`) where RFC
3550 figures do not combine at all; and because RFC 3550 counts every outlier twice
(once up, once down) at a weight of 1/16. For independent normal samples RFC 3550 ≈
2σ/√π ≈ 1.13σ (:data:`RFC3550_PER_SIGMA`). The prober still reports RFC 3550 jitter
(``ProbeStats.jitter_ms``, over accepted samples only) until telemetry carries σ.

**Noise** is the standard deviation of the estimate itself (what the anti-flap policy
compares gains with): σ·sqrt(share[k]) after k samples, ``σ·sqrt(a/(2-a))`` in steady
state.

**Staleness**: an estimate is as old as its last accepted sample (:meth:`age_s`);
:func:`staleness_factor` is how much an old estimate's cost is inflated.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from meshopt.errors import InputError

TABLE = 1024  # samples after which the warm-up corrections are at their steady values
DEFAULT_HALF_LIFE_S = 2.0
# σ's own half-life, longer than the RTT's: a link's spread is a slow property, and a
# few seconds of a busy host's delays (within 5 % of a long link's RTT, so accepted)
# lifted a 2 s σ three- to sevenfold, doubled in the cost, while the controller moved
# routes (docs/estimator.md, "σ's half-life").
DEFAULT_JITTER_HALF_LIFE_S = 10.0
RFC3550_PER_SIGMA = 2.0 / math.sqrt(math.pi)  # E|X1 - X2| / σ for independent normals
MAD_PER_SIGMA = 1.4826  # σ / MAD for normal samples


def alpha_for(half_life_s: float, interval_s: float) -> float:
    """EWMA weight per sample that halves an old value's influence in ``half_life_s``."""
    if half_life_s <= 0:
        return 1.0
    return float(1.0 - 0.5 ** (interval_s / half_life_s))


def warm_up_tables(a: float, av: float | None = None) -> tuple[list[float], list[float]]:
    """How the EWMAs behave after k samples, for k = 0 .. TABLE - 1 (``a``: the
    srtt's weight; ``av``: the variance's, ``a`` if None).

    ``share[k]``: variance of srtt (started at the first sample, then
    ``srtt += a (x - srtt)``) as a fraction of the samples' variance:
    ``(1-a)^(2(k-1)) + a^2 (1 - (1-a)^(2(k-1))) / (1 - (1-a)^2)``, 1 at k = 1 and
    ``a / (2 - a)`` in steady state.

    ``gain[k]``: expected value of the variance EWMA (``var = (1-av) (var + av dev^2)``,
    0 at the first sample) as a fraction of the samples' variance. Each deviation is
    measured from the srtt before it, so its expected square is ``1 + share[k-1]``:
    early deviations are larger, which an estimate that only undid the EWMA's start
    at zero would count as jitter.
    """
    share: list[float] = []
    for k in range(TABLE):
        decay = (1.0 - a) ** (2 * max(k - 1, 0))
        share.append(decay + a * a * (1.0 - decay) / (1.0 - (1.0 - a) ** 2))
    v = a if av is None else av
    gain = [0.0] * TABLE
    for i in range(2, TABLE):
        gain[i] = (1.0 - v) * (gain[i - 1] + v * (1.0 + share[i - 1]))
    return share, gain


@functools.lru_cache(maxsize=16)
def tables(a: float, av: float | None = None) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """:func:`warm_up_tables` as tuples, cached per pair of weights."""
    share, gain = warm_up_tables(a, av)
    return tuple(share), tuple(gain)


def quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted values, linear between closest ranks (numpy's default)."""
    if not ordered:
        raise ValueError("quantile of no values")
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))


def median(values: Iterable[float]) -> float:
    return quantile(sorted(values), 0.5)


def mad_sigma(values: Sequence[float]) -> float:
    """σ of normal samples from their median absolute deviation (robust to outliers)."""
    m = median(values)
    return MAD_PER_SIGMA * median(abs(x - m) for x in values)


# Samples of a link before its estimate is routed on: the controller's warm-up
# (``warmup_samples``) waits for them on every link, and an agent tells its peers'
# estimates the moment they reach it (meshopt.agent.telemetry).
WARM_SAMPLES = 3


@dataclass(frozen=True)
class RobustConfig:
    """The outlier rule (module doc); the defaults are the benchmark's choice."""

    k: float = 4.0  # an outlier is further than k scales from the estimate
    min_scale_ms: float = 0.5  # floor of the scale: quiet links have tiny σ
    min_scale_rel: float = 0.05  # ... and of the RTT: 5 % is never an outlier
    confirm: int = 3  # consecutive outlier groups that make a real change
    burst_s: float = 0.05  # outliers arriving this close together are one group
    warmup: int = 8  # accepted samples before anything is rejected
    agree_rel: float = 0.1  # confirming groups agree within this share of their offset
    # From this many warm-up samples on, check for a far-off one at every sample (0: only
    # at the end of the warm-up; see AGENT).
    early_reseed: int = 0
    warm_bursts: bool = True  # a warm-up burst counts once (module doc); off: PLAIN

    def __post_init__(self) -> None:
        for name in ("k", "min_scale_ms", "min_scale_rel", "burst_s", "agree_rel"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise InputError(f"estimator {name} must be a finite number >= 0, not {v!r}")
        if self.k <= 0:
            raise InputError(f"estimator k must be > 0, not {self.k!r}")
        if self.confirm < 1 or self.warmup < 0 or self.early_reseed < 0:
            raise InputError("estimator confirm must be >= 1, warmup and early_reseed >= 0")


# A plain EWMA: every sample accepted (k = inf cannot be expressed, so no warm-up end).
PLAIN = RobustConfig(warmup=2**62, warm_bursts=False)
# The agent's rule (RttEstimator's default): a far-off warm-up sample is dropped from
# the third sample on. The first probe over a fresh tunnel waits for WireGuard's
# handshake; left in until the eighth sample it lifts the estimate and its noise by
# tens of ms (a quarter of bench8's links at their first report), and the controller
# routes on three samples. The simulator runs the same rule (SimConfig.robust).
AGENT = RobustConfig(early_reseed=3)


def scale_of(sigma: float, level: float, config: RobustConfig) -> float:
    """One scale (ms) of a link at ``level`` with spread ``sigma``, with the floors."""
    return max(sigma, config.min_scale_ms, config.min_scale_rel * level)


def confirmed_change(
    pending: Sequence[float], srtt: float, scale: float, config: RobustConfig
) -> tuple[float, list[float]] | None:
    """(new level, the groups it rests on) if consecutive outlier groups ``pending``
    are a real change, else None.

    ``confirm`` of them that agree with each other (within a few scales, or
    ``agree_rel`` of their offset from ``srtt``; others may be interleaved: a spike
    during a step) are a step; ``2 confirm`` in a row that do not agree mean the link's
    spread grew. Independent spikes (100-300 ms) seldom agree, and seldom run long.
    """
    c = config.confirm
    if len(pending) >= 2 * c:
        values = list(pending)
        return median(values), values
    if len(pending) < c:
        return None
    ordered = sorted(pending)
    best: list[float] | None = None
    for i in range(len(ordered) - c + 1):
        window = ordered[i : i + c]
        offset = abs(median(window) - srtt)
        agree = max(2.0 * config.k * scale, config.agree_rel * offset)
        spread = window[-1] - window[0]
        if spread <= agree and (best is None or spread < best[-1] - best[0]):
            best = window
    if best is None:
        return None
    chosen = [x for x in pending if best[0] <= x <= best[-1]]  # arrival order
    return median(best), chosen


def warm_up_restart(
    values: Sequence[float], config: RobustConfig
) -> tuple[float, list[float]] | None:
    """(level, samples kept) if a warm-up sample was far off (more than ``2k``
    MAD-scales from their median: a spike before any scale was known), else None."""
    if not values:
        return None
    level = median(values)
    scale = scale_of(mad_sigma(values), level, config)
    if all(abs(x - level) <= 2.0 * config.k * scale for x in values):
        return None
    kept = [x for x in values if abs(x - level) <= config.k * scale]
    return median(kept), kept


# What a warm-up burst's later, smaller member undoes (RttEstimator._add_warm).
_BURST_STATE = frozenset(
    {"_srtt", "_var", "_k", "_accepted", "_jitter", "_last_accepted", "last_at", "_warm"}
    | {"outliers", "changes"}
)


def _burst_state(state: dict[str, object]) -> dict[str, object]:
    """A copy of an estimator's :data:`_BURST_STATE` (its lists too: a snapshot serves
    a whole burst)."""
    return {k: list(v) if isinstance(v, list) else v for k, v in state.items() if k in _BURST_STATE}


class RttEstimator:
    """One link's RTT estimate, σ and noise, fed samples with their arrival times."""

    def __init__(
        self, alpha: float, config: RobustConfig | None = None, *, var_alpha: float | None = None
    ) -> None:
        """``alpha``: the srtt's EWMA weight; ``var_alpha``: σ's (``alpha`` if None)."""
        self.alpha = alpha
        self.var_alpha = alpha if var_alpha is None else var_alpha
        for w in (self.alpha, self.var_alpha):
            if not 0 < w <= 1:
                raise InputError(f"EWMA weight must be in (0, 1], not {w!r}")
        self.config = config or AGENT
        self._share, self._gain = tables(alpha, self.var_alpha)
        self.outliers = 0  # samples rejected since creation
        self.changes = 0  # confirmed changes (restarts at a new level)
        self.reset()

    def reset(self) -> None:
        """Start afresh (a peer that comes back after being dead)."""
        self._srtt: float | None = None
        self._mean: float | None = None
        self._var = 0.0  # EWMA of squared deviations, before the warm-up correction
        self._k = 0  # samples in the current level (for the warm-up corrections)
        self._accepted = 0  # accepted samples since the reset (for ``warmup``)
        self._jitter = 0.0  # RFC 3550 over accepted samples
        self._last_accepted: float | None = None
        self.last_at: float | None = None  # arrival time of the last accepted sample
        self._pending: list[float] = []  # one value per outlier group
        self._pending_at = -math.inf
        self._warm: list[float] = []  # the warm-up's samples, to check for spikes
        # The warm-up's last burst: when its last sample came, its value, and the state
        # before it (a later, smaller member of the burst replaces it).
        self._burst_at = -math.inf
        self._burst_value = math.inf
        self._before_burst: dict[str, object] | None = None

    # -- feeding ---------------------------------------------------------------------
    def add(self, x: float, now: float) -> bool:
        """One RTT sample (ms) that arrived at ``now`` (s); False if it was an outlier."""
        a = self.alpha
        self._mean = x if self._mean is None else self._mean + a * (x - self._mean)
        cfg = self.config
        if self._srtt is None or (self._accepted < cfg.warmup and cfg.warm_bursts):
            return self._add_warm(x, now)
        dev = x - self._srtt
        if self._accepted >= cfg.warmup and abs(dev) > cfg.k * self.scale():
            self.outliers += 1
            if self._pending and now - self._pending_at <= cfg.burst_s:
                self._pending[-1] = min(self._pending[-1], x)
            else:
                self._pending.append(x)
            self._pending_at = now
            self._restart(now)
            return False
        self._take(x, dev, now)
        return True

    def _take(self, x: float, dev: float, now: float) -> None:
        """Accept sample ``x``, ``dev`` from the estimate."""
        a, av = self.alpha, self.var_alpha
        self._pending.clear()
        self._var = (1.0 - av) * (self._var + av * dev * dev)
        self._srtt = (self._srtt or 0.0) + a * dev
        self._k += 1
        self._accept(x, now)

    def _add_warm(self, x: float, now: float) -> bool:
        """A warm-up sample: a burst (samples each within ``burst_s`` of the one
        before) counts once, at its least value."""
        before = self._before_burst
        if before is not None and now - self._burst_at <= self.config.burst_s:
            self._burst_at = now
            if x >= self._burst_value:
                return True
            self.__dict__.update(_burst_state(before))  # undo the burst's value
        else:
            self._burst_at = now
            self._before_burst = _burst_state(vars(self))
        self._burst_value = x
        if self._srtt is None:
            self._start(x, now)
        else:
            self._take(x, x - self._srtt, now)
        return True

    def _start(self, x: float, now: float) -> None:
        self._srtt, self._var, self._k = x, 0.0, 1
        self._accept(x, now)

    def _accept(self, x: float, now: float) -> None:
        if self._last_accepted is not None:
            self._jitter += (abs(x - self._last_accepted) - self._jitter) / 16.0
        self._last_accepted = x
        self._accepted += 1
        self.last_at = now
        warmup = self.config.warmup
        if self._accepted <= warmup:
            self._warm.append(x)
            if self._accepted == warmup:
                self._reseed()
            elif 0 < self.config.early_reseed <= len(self._warm):
                self._reseed(final=False)

    def _reseed(self, *, final: bool = True) -> None:
        """:func:`warm_up_restart`, if a warm-up sample was far off: at the end of the
        warm-up, and from the third sample on (the first probe over a fresh tunnel waits
        for WireGuard's handshake: left in, it lifts the first routes' estimates and
        their noise by tens of ms until the eighth sample). A spike found early leaves
        the warm-up's samples, so the later checks judge the others."""
        values = self._warm
        if final:
            self._warm = []
        restart = warm_up_restart(values, self.config)
        if restart is None:
            return
        level, kept = restart
        if not final:
            self._warm = list(kept)
        self._srtt = level
        self._k = len(kept)
        sigma = mad_sigma(kept)
        self._var = sigma * sigma * self._gain[min(self._k, TABLE - 1)]
        self.outliers += len(values) - len(kept)

    def _restart(self, now: float) -> None:
        """A confirmed change (:func:`confirmed_change`): restart at its level."""
        if self._srtt is None:
            return
        change = confirmed_change(self._pending, self._srtt, self.scale(), self.config)
        if change is None:
            return
        level, values = change
        sigma = max(self.std() or 0.0, mad_sigma(values))
        k = len(values)
        self._srtt = level
        self._k = k
        self._var = sigma * sigma * self._gain[min(k, TABLE - 1)]
        self._last_accepted = values[-1]
        self.last_at = now
        self._pending = []
        self.changes += 1

    # -- reading ---------------------------------------------------------------------
    @property
    def srtt_ms(self) -> float | None:
        """The robust estimate: the EWMA of accepted samples."""
        return self._srtt

    @property
    def confirming(self) -> bool:
        """Outlier groups wait for more to confirm them as a change (or for a normal
        sample to dismiss them): the prober then probes a slow link fast, so a step on
        an idle link is confirmed in ~1 s, not in ``confirm`` idle intervals."""
        return bool(self._pending)

    @property
    def mean_ms(self) -> float | None:
        """The plain EWMA of every sample (what srtt was before outliers were rejected)."""
        return self._mean

    @property
    def samples(self) -> int:
        return self._k

    def std(self) -> float | None:
        """σ of the samples (the one jitter), corrected for the EWMA's warm-up."""
        if self._srtt is None:
            return None
        gain = self._gain[min(self._k, TABLE - 1)]
        return math.sqrt(self._var / gain) if gain > 0 else 0.0

    def noise(self) -> float | None:
        """Standard deviation of ``srtt_ms`` itself."""
        std = self.std()
        if std is None:
            return None
        return std * math.sqrt(self._share[min(self._k, TABLE - 1)])

    def rfc3550_ms(self) -> float | None:
        """RFC 3550 interarrival jitter over consecutive accepted samples."""
        return self._jitter if self._srtt is not None else None

    def last_ms(self) -> float | None:
        return self._last_accepted

    def scale(self) -> float:
        """How far from the estimate one scale is (ms): σ, with its floors."""
        return scale_of(self.std() or 0.0, self._srtt or 0.0, self.config)

    def age_s(self, now: float) -> float | None:
        """Seconds since the last accepted sample (None: never one)."""
        return None if self.last_at is None else max(now - self.last_at, 0.0)


# --- loss ------------------------------------------------------------------------------

# Outcomes the loss estimate remembers beyond the prober's window, with weight decaying by
# 1/LOSS_MEMORY per outcome (~64 s at the prober's 0.33 s): a 1.5 % lossy link shows one
# loss in a window of 64 probes or none, so its loss read from the window alone is as
# uncertain as it is large, and a relay that its loss makes worth taking waited for that
# noise to dip (issue 14: the 16-node twin's par2<->sao1). Pooled with what came before,
# the same link's loss rests on ~256 outcomes and its noise halves.
LOSS_MEMORY = 192.0
LOSS_MEMORY_DECAY = 1.0 - 1.0 / LOSS_MEMORY
# The window's loss differs from the memory's by more than this many standard deviations
# (a two-proportion test): the loss changed, the window alone says what it is now, and
# the memory is forgotten as the next outcome leaves the window, with the outcomes then
# in the window (else a healed link's memory, once the test no longer flags it, would
# pull its loss back up; or learn the lossy outcomes still leaving). A link going
# from 0 to 20 % loss is told as soon as the window alone tells it (~15 probes, ~5 s).
# With 1.5-10 % steady loss the reported loss varies 0.40 times as much as the window's
# and is pooled 99 % of the time (20 seeded runs of 3000 probes each; a step to 20 % and
# back is told on the same probes as by the window alone).
LOSS_CHANGE_Z = 3.0
# Outcomes of the probes sent before a peer first answered (its tunnel's birth) never
# enter the memory (the controller forgives them while they are in the window,
# meshopt.controller.view.handshake_loss_discounted); the slack covers the replies to
# later probes counted before those probes' timeouts.
BIRTH_SLACK = 3


def remembers(ordinal: int, forget_until: int | None) -> bool:
    """Whether the outcome numbered ``ordinal`` (1 = the first counted), leaving the
    window, may enter the loss memory: it is newer than ``forget_until`` (the birth's
    probes and slack, or the outcomes counted when the memory was last forgotten; None:
    the peer never answered)."""
    return forget_until is not None and ordinal > forget_until


def loss_changed(lost: int, outcomes: int, old_lost: float, old_outcomes: float) -> bool:
    """The window's ``lost`` of ``outcomes`` differs from the memory's rate by more than
    LOSS_CHANGE_Z standard deviations (False while either is empty)."""
    if old_outcomes < 1.0 or outcomes <= 0:
        return False
    pooled = (lost + old_lost) / (outcomes + old_outcomes)
    diff = lost / outcomes - old_lost / old_outcomes
    var = pooled * (1.0 - pooled) * (1.0 / outcomes + 1.0 / old_outcomes)
    return diff * diff > LOSS_CHANGE_Z * LOSS_CHANGE_Z * var


def remember_loss(old_lost: float, old_outcomes: float, lost: bool) -> tuple[float, float]:
    """The loss memory after one more outcome (one that left the window; the caller
    forgets the memory instead when :func:`loss_changed` says the window differs)."""
    d = LOSS_MEMORY_DECAY
    return old_lost * d + (1.0 if lost else 0.0), old_outcomes * d + 1.0


def pooled_loss(
    lost: int, outcomes: int, old_lost: float, old_outcomes: float
) -> tuple[float, float]:
    """(loss, the outcomes it rests on): the window's ``lost`` of ``outcomes`` pooled
    with the memory's, unless the two differ by more than LOSS_CHANGE_Z standard
    deviations (then the window's alone: the loss changed)."""
    if old_outcomes < 1.0 or outcomes <= 0 or loss_changed(lost, outcomes, old_lost, old_outcomes):
        return (lost / outcomes if outcomes > 0 else 0.0), float(outcomes)
    n = outcomes + old_outcomes
    return (lost + old_lost) / n, n


# --- staleness and paths ---------------------------------------------------------------


def staleness_factor(age_s: float, fresh_s: float, stale_s: float, penalty: float) -> float:
    """How much an estimate of ``age_s`` is inflated: 1 while fresh, rising linearly to
    ``1 + penalty`` at ``stale_s``, inf beyond (unknown: the caller prices it)."""
    if age_s > stale_s:
        return math.inf
    span = max(stale_s - fresh_s, 1e-9)
    return 1.0 + penalty * min(max((age_s - fresh_s) / span, 0.0), 1.0)


def path_jitter_ms(link_jitters_ms: Iterable[float]) -> float:
    """σ of a path's delay from its links' σ: independent delays add variances, so the
    root-sum-square, not the sum (two 3 ms links make 4.24 ms, not 6)."""
    return math.sqrt(sum(j * j for j in link_jitters_ms))


def path_cost_ms(
    rtt_ms: Sequence[float],
    jitter_ms: Sequence[float],
    *,
    jitter_weight: float = 2.0,
    relay_hop_ms: float = 0.0,
) -> float:
    """A path's RTT plus ``jitter_weight`` times its combined σ, plus a per-relay cost:
    the additive link metric with the jitter term combined correctly."""
    if len(rtt_ms) != len(jitter_ms) or not rtt_ms:
        raise InputError("a path needs one RTT and one jitter per link, at least one link")
    relays = len(rtt_ms) - 1
    return sum(rtt_ms) + jitter_weight * path_jitter_ms(jitter_ms) + relay_hop_ms * relays
