"""Per-peer probe statistics against hand-computed values and the simulator's estimator."""

from __future__ import annotations

import random

import numpy as np
import pytest

from meshopt.probe.stats import PeerWindow, quantile
from meshopt.probe.timestamps import TimerError
from meshopt.sim.estimator import LinkEstimator

RTTS = [10.0, 12.0, 11.0, 15.0, 10.5]


def fed(rtts: list[float | None], **kwargs: float) -> PeerWindow:
    """A window fed one probe per entry (None: lost), 1 s apart."""
    w = PeerWindow(**kwargs)  # type: ignore[arg-type]
    for seq, rtt in enumerate(rtts):
        w.add_sent(seq, float(seq))
        if rtt is None:
            w.add_loss(seq, seq + 1.0)
        else:
            w.add_reply(seq, rtt, seq + 0.5)
    return w


def test_empty_window_has_no_rtt_figures() -> None:
    s = PeerWindow().stats()
    assert (s.sent, s.received, s.lost, s.loss, s.samples) == (0, 0, 0, 0.0, 0)
    assert s.rtt_min_ms is s.rtt_median_ms is s.rtt_p95_ms is None
    assert s.srtt_ms is s.jitter_ms is s.noise_ms is s.last_rtt_ms is s.rtt_std_ms is None


def test_window_figures_by_hand() -> None:
    # half-life = interval: each sample has weight 1/2
    s = fed([10.0, 12.0, None, 11.0, 15.0, 10.5], half_life_s=1.0, interval_s=1.0).stats()
    assert (s.sent, s.received, s.lost, s.samples) == (6, 5, 1, 5)
    assert s.loss == pytest.approx(1 / 6)
    assert s.rtt_min_ms == 10.0
    assert s.rtt_median_ms == 11.0  # 10 10.5 [11] 12 15
    assert s.rtt_p95_ms == pytest.approx(14.4)  # rank 0.95 * 4 = 3.8: 12 + 0.8 * (15 - 12)
    assert s.last_rtt_ms == 10.5
    # srtt: 10 -> 11 -> 11 -> 13 -> 11.75
    assert s.srtt_ms == pytest.approx(11.75)
    # RFC 3550: |D| = 2, 1, 4, 4.5; J += (|D| - J) / 16 from 0
    j = 0.0
    for d in (2.0, 1.0, 4.0, 4.5):
        j += (d - j) / 16
    assert j == pytest.approx(0.6735534668)
    assert s.jitter_ms == pytest.approx(0.6735534668)


def test_loss_and_quantiles_cover_only_the_window() -> None:
    w = fed([None, None, 50.0, 1.0, 2.0, 3.0, None, 4.0], window=5)
    s = w.stats()
    assert (s.sent, s.received, s.lost) == (8, 5, 3)  # totals since start
    assert s.samples == 4 and s.loss == pytest.approx(1 / 5)  # window: 1 2 3 lost 4
    assert (s.rtt_min_ms, s.rtt_median_ms) == (1.0, 2.5)
    assert s.rtt_p95_ms == pytest.approx(3.85)  # rank 2.85 of 1 2 3 4


def test_an_outcome_counts_once() -> None:
    w = fed([10.0])
    assert not w.add_reply(0, 99.0, 2.0)
    assert not w.add_loss(0, 2.0)
    s = w.stats()
    assert (s.received, s.lost, s.samples, s.srtt_ms) == (1, 0, 1, 10.0)


def test_constant_rtt_has_no_jitter_or_noise() -> None:
    s = fed([7.0] * 20).stats()
    assert s.srtt_ms == 7.0 and s.jitter_ms == 0.0 and s.rtt_std_ms == 0.0 and s.noise_ms == 0.0


def test_srtt_std_and_noise_match_the_simulators_estimator() -> None:
    rng = np.random.default_rng(7)
    samples = list(20.0 + rng.normal(0.0, 2.0, 300))
    lost = rng.random(300) < 0.1
    est = LinkEstimator(interval_s=0.33, rtt_half_life_s=2.0, dead_after=10**6)
    est.reset(1)
    w = PeerWindow(half_life_s=2.0, interval_s=0.33)
    for seq, (x, gone) in enumerate(zip(samples, lost, strict=True)):
        est.update(np.array([[x]]), np.array([[gone]]))
        if gone:
            w.add_loss(seq, seq * 0.33)
        else:
            w.add_reply(seq, x, seq * 0.33)
        if seq in (1, 5, 40, 299):
            s = w.stats()
            assert s.srtt_ms == pytest.approx(est.srtt[0, 0])
            assert s.rtt_std_ms == pytest.approx(est.jitter[0, 0])
            assert s.noise_ms == pytest.approx(est.noise()[0, 0])
    s = w.stats()
    assert s.rtt_std_ms == pytest.approx(2.0, rel=0.35)  # about the samples' spread
    a = w.alpha
    assert s.noise_ms == pytest.approx(s.rtt_std_ms * (a / (2 - a)) ** 0.5, rel=1e-6)


def test_forget_outage_drops_the_losses_since_the_last_reply_only() -> None:
    w = PeerWindow(16)
    for seq in range(6):
        w.add_sent(seq, seq * 0.33)
    w.add_reply(0, 10.0, 0.1)
    w.add_loss(1, 1.4)  # a loss before a reply: the path's
    w.add_reply(2, 10.0, 0.7)
    for seq in (3, 4, 5):  # the outage's onset
        w.add_loss(seq, 2.0 + seq)
    assert w.stats().loss == pytest.approx(4 / 6)
    assert w.forget_outage() == 3
    s = w.stats()
    assert s.loss == pytest.approx(1 / 3) and s.samples == 2
    assert w.forget_outage() == 0 and w.stats() == s


def test_quantile_is_linear_between_ranks() -> None:
    assert quantile([1.0], 0.95) == 1.0
    assert quantile([1.0, 2.0], 0.5) == 1.5
    assert quantile(list(range(101)), 0.95) == 95.0
    assert quantile([0, 10], 0.95) == pytest.approx(np.quantile([0, 10], 0.95))
    with pytest.raises(ValueError):
        quantile([], 0.5)


def test_bad_window_arguments() -> None:
    with pytest.raises(ValueError):
        PeerWindow(window=0)
    with pytest.raises(ValueError):
        PeerWindow(interval_s=0)


def test_stats_asked_again_are_the_same_until_an_outcome_and_follow_every_send() -> None:
    import random

    rng = random.Random(3)
    cached, fresh = PeerWindow(16), PeerWindow(16)
    for seq in range(200):
        for w in (cached, fresh):
            w.add_sent(seq, seq * 0.33)
        step = rng.random()
        if step < 0.7:
            rtt = 10 + rng.random() * 5
            assert cached.add_reply(seq, rtt, seq * 0.33 + 0.01)
            fresh.add_reply(seq, rtt, seq * 0.33 + 0.01)
        elif step < 0.8:
            cached.add_loss(seq, seq * 0.33 + 1)
            fresh.add_loss(seq, seq * 0.33 + 1)
        elif step < 0.82:
            cached.forget_outage()
            fresh.forget_outage()
        # What it would compute now, asked of a window that never answered from memory.
        assert cached.stats() == fresh._compute()
        assert cached.stats() is cached.stats()


@pytest.mark.parametrize("n", [1, 2, 5, 64])
def test_window_median_is_statistics_median_exactly(n: int) -> None:
    import random
    import statistics

    rng = random.Random(n)
    w = PeerWindow(window=n)
    rtts = [rng.uniform(1.0, 30.0) for _ in range(n)]
    for seq, rtt in enumerate(rtts):
        w.add_reply(seq, rtt, float(seq))
    assert w.stats().rtt_median_ms == statistics.median(rtts)


def test_timer_error_quantiles_from_one_sort_match_each_alone() -> None:
    """The agent's full snapshots carry the receive-timer error's median and p95."""
    timer = TimerError(keep=100)
    assert timer.median_p95_us() is None
    rng = random.Random(3)
    for _ in range(250):  # more than kept: the last 100 count
        timer.add(0, rng.randrange(5_000, 900_000))
    assert timer.median_p95_us() == pytest.approx((timer.median_us(), timer.p95_us()))
    timer.add(0, 10_000)
    assert timer.median_p95_us() == pytest.approx((timer.median_us(), timer.p95_us()))


def loss_run(
    rates: list[float], seed: int, births: int = 0
) -> tuple[list[tuple[float, float]], list[float]]:
    """A PeerWindow fed one probe per rate (lost with that probability) after ``births``
    probes lost before the peer first answered: each probe's (loss, loss_outcomes) and
    the loss of the window alone."""
    rng = random.Random(seed)
    w = PeerWindow(interval_s=0.33)
    told: list[tuple[float, float]] = []
    alone: list[float] = []
    recent: list[bool] = []
    for seq in range(births):
        w.add_sent(seq, seq * 0.33)
        w.add_loss(seq, seq * 0.33 + 0.8)
        recent.append(True)
    for k, p in enumerate(rates):
        seq = births + k
        w.add_sent(seq, seq * 0.33)
        lost = rng.random() < p
        if lost:
            w.add_loss(seq, seq * 0.33 + 0.8)
        else:
            w.add_reply(seq, 20.0, seq * 0.33 + 0.02)
        recent = [*recent, lost][-w.window :]
        s = w.stats()
        told.append((s.loss, s.loss_outcomes))
        alone.append(sum(recent) / len(recent))
    return told, alone


@pytest.mark.parametrize("p", [0.015, 0.03, 0.1])
def test_a_steady_loss_rests_on_the_memory_and_varies_half_as_much_as_the_window(
    p: float,
) -> None:
    told_sd, alone_sd, means = [], [], []
    for seed in range(8):
        told, alone = loss_run([p] * 2000, seed)
        tail = [loss for loss, _ in told[500:]]
        assert min(n for _, n in told[500:]) >= 64
        assert sum(n > 200 for _, n in told[500:]) > 0.75 * len(tail)
        told_sd.append(np.std(tail))
        alone_sd.append(np.std(alone[500:]))
        means.append(np.mean(tail))
    assert np.mean(told_sd) < 0.55 * np.mean(alone_sd)
    assert np.mean(means) == pytest.approx(p, rel=0.2)


def test_a_loss_step_and_its_end_are_told_as_soon_as_the_window_tells_them() -> None:
    for seed in range(5):
        told, alone = loss_run([0.0] * 600 + [0.2] * 600 + [0.0] * 600, seed)

        def first(values: list[float], start: int, hit: float, above: bool) -> int:
            return next(
                k - start
                for k in range(start, len(values))
                if (values[k] >= hit if above else values[k] < hit)
            )

        loss = [x for x, _ in told]
        assert first(loss, 600, 0.05, True) <= first(alone, 600, 0.05, True)
        assert first(loss, 1200, 0.02, False) <= first(alone, 1200, 0.02, False)
        # Healed is healed: the memory of the lossy minutes does not pull it back up.
        assert max(loss[1200 + 64 :]) == 0.0
        assert told[-1][1] > 200


def test_the_losses_before_the_peer_first_answered_never_enter_the_memory() -> None:
    told, _ = loss_run([0.0] * 400, seed=1, births=3)
    assert told[0][0] == pytest.approx(3 / 4)  # the window shows them (the controller
    # forgives them while the link is young)
    assert all(loss == 0.0 for loss, _ in told[64:])
    assert told[-1][1] > 200


def test_the_simulators_loss_memory_matches_the_probers() -> None:
    from meshopt.agent.config import TelemetrySettings
    from meshopt.sim.engine import _Agents, _popcount
    from meshopt.sim.estimator import pooled_loss

    rng = random.Random(5)
    rates = [0.0] * 3 + [0.03] * 700 + [0.25] * 300 + [0.01] * 500
    agents = _Agents.start(2, 64, np.zeros(2), TelemetrySettings())
    w = PeerWindow(interval_s=0.33)
    for seq, p in enumerate(rates):
        lost = seq < 3 or rng.random() < p  # three birth losses, then the rates
        w.add_sent(seq, seq * 0.33)
        if lost:
            w.add_loss(seq, seq * 0.33 + 0.8)
        else:
            w.add_reply(seq, 20.0, seq * 0.33 + 0.02)
        got = np.array([[False, not lost], [False, False]])
        agents.probe(np.array([[False, True], [False, False]]), got, np.full((2, 2), seq * 0.33))
        if seq % 7 == 0 or seq == len(rates) - 1:
            s = w.stats()
            g = _popcount(agents.got_bits[:1, 1:]).astype(np.float64)
            lo = _popcount(agents.lost_bits[:1, 1:]).astype(np.float64)
            loss, n = pooled_loss(lo, g + lo, agents.old_lost[:1, 1:], agents.old_outcomes[:1, 1:])
            assert (float(loss[0, 0]), float(n[0, 0])) == pytest.approx((s.loss, s.loss_outcomes))
