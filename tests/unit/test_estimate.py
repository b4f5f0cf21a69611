"""The one estimator (meshopt.estimate): spikes and stalls ignored, real steps followed,
the same figures in the prober's per-peer form and the simulator's vectorised form."""

from __future__ import annotations

import math
import random
import statistics

import numpy as np
import pytest

from meshopt.errors import InputError
from meshopt.estimate import (
    AGENT,
    DEFAULT_JITTER_HALF_LIFE_S,
    PLAIN,
    RFC3550_PER_SIGMA,
    RobustConfig,
    RttEstimator,
    alpha_for,
    path_cost_ms,
    path_jitter_ms,
    staleness_factor,
)
from meshopt.probe.stats import PeerWindow
from meshopt.sim.estimator import LinkEstimator

A = alpha_for(2.0, 0.33)
IV = 0.33


def warm(est: RttEstimator, n: int = 30, level: float = 10.0, t0: float = 0.0) -> float:
    """Feed ``n`` samples alternating level ± 0.2 ms; returns the next arrival time."""
    t = t0
    for i in range(n):
        est.add(level + (0.2 if i % 2 else -0.2), t)
        t += IV
    return t


def test_a_spike_changes_nothing() -> None:
    est = RttEstimator(A)
    t = warm(est)
    before = (est.srtt_ms, est.std(), est.rfc3550_ms())
    assert not est.add(250.0, t)
    assert (est.srtt_ms, est.std(), est.rfc3550_ms()) == before
    assert est.outliers == 1 and est.changes == 0
    assert est.mean_ms is not None and est.mean_ms > 30.0  # the plain EWMA took ~11 %


def test_a_stall_burst_is_one_group_and_changes_nothing() -> None:
    est = RttEstimator(A)
    t = warm(est)
    # A 2 s stall: six replies held, then delivered within a millisecond.
    for k, rtt in enumerate((990.0, 670.0, 340.0, 20.0 + 300.0, 200.0, 120.0)):
        assert not est.add(rtt, t + 2.0 + k * 1e-4)
    assert est.changes == 0
    assert est.add(10.1, t + 2.3)
    assert est.srtt_ms == pytest.approx(10.0, abs=0.1)


def test_a_real_step_shows_on_the_third_sample() -> None:
    est = RttEstimator(A)
    t = warm(est)
    assert not est.add(15.1, t)
    assert not est.add(14.9, t + IV)
    assert est.srtt_ms == pytest.approx(10.0, abs=0.1)  # two samples: not yet
    assert not est.add(15.0, t + 2 * IV)
    assert est.srtt_ms == 15.0 and est.changes == 1  # the median of the three
    assert est.add(15.2, t + 3 * IV)  # the new level accepts its own samples
    assert est.std() == pytest.approx(0.2, abs=0.1)  # σ kept, not the step's size


def test_a_step_interleaved_with_a_spike_still_shows() -> None:
    est = RttEstimator(A)
    t = warm(est)
    for k, x in enumerate((15.1, 212.0, 14.9, 15.0)):
        est.add(x, t + k * IV)
    assert est.srtt_ms == 15.0 and est.changes == 1


def test_spikes_that_do_not_agree_do_not_make_a_step() -> None:
    est = RttEstimator(A)
    t = warm(est)
    for k, x in enumerate((110.0, 290.0, 190.0)):
        est.add(x, t + k * IV)
    assert est.changes == 0 and est.srtt_ms == pytest.approx(10.0, abs=0.1)


def test_sigma_follows_a_link_that_became_jittery() -> None:
    rng = random.Random(5)
    est = RttEstimator(A)
    t = warm(est)
    for _ in range(600):
        est.add(10.0 + rng.gauss(0.0, 3.0), t)
        t += IV
    assert est.std() == pytest.approx(3.0, rel=0.35)
    assert est.srtt_ms == pytest.approx(10.0, abs=1.5)


def test_sigma_with_its_own_half_life_is_unbiased_from_the_second_sample() -> None:
    """The warm-up corrections hold for σ's weight apart from the srtt's: the mean of
    σ² over many links of N(10, 1) samples is 1 at every sample count."""
    rng = random.Random(11)
    av = alpha_for(DEFAULT_JITTER_HALF_LIFE_S, IV)
    checks = (2, 3, 5, 20, 100)
    sums = dict.fromkeys(checks, 0.0)
    trials = 3000
    for _ in range(trials):
        est = RttEstimator(A, PLAIN, var_alpha=av)
        for k in range(1, max(checks) + 1):
            est.add(10.0 + rng.gauss(0.0, 1.0), k * IV)
            if k in sums:
                sums[k] += (est.std() or 0.0) ** 2
    for k, total in sums.items():
        assert total / trials == pytest.approx(1.0, rel=0.08), k


def test_a_busy_hosts_burst_on_a_long_link_lifts_sigma_half_as_much() -> None:
    """4 s of a busy host's delays (exponential, 2 ms mean: within 5 % of an 80 ms RTT,
    so accepted) lift the cost's 2σ term; σ's own 10 s half-life lifts it about half as
    far as σ on the srtt's 2 s did."""

    def lift(var_alpha: float, seed: int) -> float:
        rng = random.Random(seed)
        est = RttEstimator(A, var_alpha=var_alpha)
        t, most = 0.0, 0.0
        for i in range(300):
            x = 80.0 + rng.gauss(0.0, 0.3)
            if 150 <= i < 162:
                x += rng.expovariate(1 / 2.0)
            est.add(x, t)
            if i >= 150:
                most = max(most, 2.0 * ((est.std() or 0.0) - 0.3))
            t += IV
        return most

    av = alpha_for(DEFAULT_JITTER_HALF_LIFE_S, IV)
    ratios = [lift(av, seed) / lift(A, seed) for seed in range(1, 8)]
    assert statistics.median(ratios) < 0.6, ratios


def test_a_spike_in_the_warm_up_is_dropped_when_it_ends() -> None:
    est = RttEstimator(A)
    est.add(250.0, 0.0)  # the very first sample
    t = IV
    for i in range(7):
        est.add(10.0 + (0.2 if i % 2 else -0.2), t)
        t += IV
    assert est.srtt_ms == pytest.approx(10.0, abs=0.2)
    assert est.std() is not None and est.std() < 1.0  # type: ignore[operator]
    assert est.outliers == 1
    assert not est.add(260.0, t)  # and later spikes are outliers


def test_a_warm_up_burst_is_one_sample_at_its_least() -> None:
    """One real sample, then six replies a stalled path released together (their probes
    sent 0.14 s apart, so each waited 0.14 s less than the one before): one sample of
    their least, which the next real one shows to be far off. One by one, the six
    outvoted the real sample and the warm-up's check dropped it instead."""
    est = RttEstimator(A)
    est.add(23.0, 4.0)
    for k, rtt in enumerate((1200.0, 1060.0, 920.0, 780.0, 640.0, 500.0)):
        assert est.add(rtt, 5.5 + k * 0.002)
    assert est.srtt_ms == pytest.approx(23.0 + A * (500.0 - 23.0))  # two samples
    assert est.samples == 2
    est.add(23.2, 5.83)
    assert est.srtt_ms == pytest.approx(23.1, abs=0.2)
    assert est.std() is not None and est.std() < 1.0  # type: ignore[operator]
    assert est.outliers == 1


def test_warm_up_samples_further_apart_than_a_burst_each_count() -> None:
    """A step in the warm-up, its samples an interval apart: each counts, and the
    estimate follows it; a burst's later, larger member changes nothing."""
    est = RttEstimator(A)
    est.add(23.0, 0.0)
    t = IV
    for _ in range(3):
        est.add(650.0, t)
        t += IV
    assert est.samples == 3 and est.srtt_ms == pytest.approx(650.0)
    before = est.srtt_ms
    assert est.add(900.0, t - IV + 0.01)  # queued behind the last: no sample
    assert est.srtt_ms == before and est.samples == 3


def test_plain_is_the_ewma_of_every_sample() -> None:
    est = RttEstimator(0.5, PLAIN)
    for i, x in enumerate((10.0, 12.0, 11.0, 15.0, 300.0)):
        assert est.add(x, float(i))
    assert est.srtt_ms == pytest.approx(((11.0 + 0.0) * 0.5 + 7.5) * 0.5 + 150.0)
    assert est.srtt_ms == est.mean_ms


def test_peer_window_publishes_the_robust_estimate() -> None:
    w = PeerWindow(interval_s=IV)
    for seq in range(40):
        w.add_sent(seq, seq * IV)
        rtt = 260.0 if seq == 30 else 10.0 + (0.2 if seq % 2 else -0.2)
        w.add_reply(seq, rtt, seq * IV + 0.01)
    s = w.stats()
    assert s.srtt_ms == pytest.approx(10.0, abs=0.1)
    assert s.rtt_std_ms is not None and s.rtt_std_ms < 0.5
    assert s.jitter_ms is not None and s.jitter_ms < 0.5  # RFC 3550 skips it too
    assert s.srtt_mean_ms is not None and s.srtt_mean_ms > 15.0  # 9 samples later
    assert s.outliers == 1 and s.samples == 40  # the window still counts it


@pytest.mark.parametrize("cfg", [RobustConfig(), AGENT], ids=["end-check", "agent"])
def test_the_simulator_runs_the_same_estimator(cfg: RobustConfig) -> None:
    """Spikes, warm-up spikes, losses and a step: the vectorised form gives the same
    srtt, σ and noise as one RttEstimator per link, to the last bit that matters, with
    the warm-up checked at its end only or, as the agent does, from its third sample."""
    rng = random.Random(3)
    n = 3
    sim = LinkEstimator(IV, robust=cfg, dead_after=10**6)
    sim.reset(n)
    av = alpha_for(DEFAULT_JITTER_HALF_LIFE_S, IV)
    a = alpha_for(2.0, IV)
    ref = [[RttEstimator(a, cfg, var_alpha=av) for _ in range(n)] for _ in range(n)]
    for r in range(900):
        x = np.array(
            [
                [
                    (10.0 + 5 * (i + j)) * (1.5 if r > 450 and i == 0 else 1.0)
                    + rng.gauss(0.0, 0.5)
                    + (rng.uniform(100.0, 300.0) if rng.random() < 0.1 else 0.0)
                    for j in range(n)
                ]
                for i in range(n)
            ]
        )
        if r < 2:
            x[0, 1] += 200.0
        if r in (3, 5):  # late in the warm-up: found early by the agent's rule
            x[1, 2] += 150.0 * (r - 2)
        lost = np.array([[rng.random() < 0.05 for _ in range(n)] for _ in range(n)])
        sim.update(x, lost)
        for i in range(n):
            for j in range(n):
                if not lost[i, j]:
                    ref[i][j].add(float(x[i, j]), r * IV)
        if r % 50 == 49:
            for i in range(n):
                for j in range(n):
                    e = ref[i][j]
                    assert e.srtt_ms == pytest.approx(sim.srtt[i, j], abs=1e-9)
                    assert e.std() == pytest.approx(sim.jitter[i, j], abs=1e-9)
                    assert e.noise() == pytest.approx(sim.noise()[i, j], abs=1e-9)
    assert int(sim.outliers.sum()) == sum(ref[i][j].outliers for i in range(n) for j in range(n))
    assert sim.srtt[0, 1] == pytest.approx(22.5, abs=1.0)  # followed the step


def test_path_jitter_is_a_root_sum_square() -> None:
    assert path_jitter_ms([3.0, 4.0]) == 5.0
    assert path_jitter_ms([3.0, 3.0]) == pytest.approx(4.2426, abs=1e-4)
    assert path_jitter_ms([]) == 0.0
    assert path_cost_ms([10.0, 20.0], [3.0, 4.0], jitter_weight=2.0, relay_hop_ms=1.5) == 41.5
    with pytest.raises(InputError):
        path_cost_ms([10.0], [1.0, 2.0])


def test_rfc3550_of_normal_samples_is_about_1_13_sigma() -> None:
    rng = random.Random(9)
    est = RttEstimator(A)
    for i in range(20000):
        est.add(50.0 + rng.gauss(0.0, 2.0), i * IV)
    j, s = est.rfc3550_ms(), est.std()
    assert j is not None and s is not None
    assert j / s == pytest.approx(RFC3550_PER_SIGMA, rel=0.1)


def test_staleness_and_age() -> None:
    assert staleness_factor(5.0, 10.0, 30.0, 0.5) == 1.0
    assert staleness_factor(20.0, 10.0, 30.0, 0.5) == 1.25
    assert math.isinf(staleness_factor(31.0, 10.0, 30.0, 0.5))
    est = RttEstimator(A)
    assert est.age_s(5.0) is None
    est.add(10.0, 2.0)
    assert est.age_s(5.0) == 3.0


@pytest.mark.parametrize(
    "kwargs",
    [{"k": 0.0}, {"k": math.nan}, {"min_scale_ms": -1.0}, {"confirm": 0}, {"agree_rel": math.inf}],
)
def test_bad_configs_are_one_line_errors(kwargs: dict[str, float]) -> None:
    with pytest.raises(InputError):
        RobustConfig(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(InputError):
        RttEstimator(1.5)
