"""The underlay emulator's per-pair schedule, without any network."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from meshopt.lab.shaper import PairParams, PairShaper


def shaper(seed: int = 1, **params: float) -> PairShaper:
    return PairShaper(PairParams(**params), random.Random(seed))


def test_delay_only_is_exact() -> None:
    s = shaper(delay_ms=10.0)
    for k in range(100):
        now = k * 0.001
        assert s.schedule(now, 1000) == pytest.approx(now + 0.010, abs=1e-12)


def test_jitter_statistics_and_floor() -> None:
    s = shaper(delay_ms=20.0, jitter_ms=2.0)
    # Packets far apart: the FIFO clamp never binds, so the samples are the raw delays.
    delays = []
    for k in range(20_000):
        now = k * 1.0
        release = s.schedule(now, 100)
        assert release is not None
        delays.append((release - now) * 1000.0)
    assert statistics.fmean(delays) == pytest.approx(20.0, abs=0.05)
    assert statistics.stdev(delays) == pytest.approx(2.0, rel=0.03)
    # A jitter larger than the delay is clipped at zero delay, never negative.
    s = shaper(delay_ms=1.0, jitter_ms=5.0)
    raw = [s.schedule(k * 1.0, 100) for k in range(2000)]
    clipped = [r - k * 1.0 for k, r in enumerate(raw) if r is not None]
    assert min(clipped) == 0.0
    assert sum(1 for d in clipped if d == 0.0) > 500  # P(N(1,5) < 0) ~ 42%


def test_jitter_never_reorders() -> None:
    s = shaper(delay_ms=5.0, jitter_ms=3.0)
    last = -math.inf
    clamped = 0
    for k in range(10_000):
        now = k * 0.0002  # 0.2 ms apart, much less than the jitter
        release = s.schedule(now, 1500)
        assert release is not None
        assert release >= last
        assert release >= now
        clamped += release == last
        last = release
    assert clamped > 100  # the clamp did bind: the test exercised it


def test_loss_fraction() -> None:
    s = shaper(loss=0.05)
    n = 100_000
    delivered = sum(1 for k in range(n) if s.schedule(k * 1e-4, 100) is not None)
    assert s.drop_loss == n - delivered
    assert s.drop_loss / n == pytest.approx(0.05, abs=0.004)
    assert shaper(loss=1.0).schedule(0.0, 100) is None
    assert all(shaper(seed=k, loss=0.0).schedule(0.0, 100) == 0.0 for k in range(100))


def test_same_seed_same_drops() -> None:
    a, b = shaper(seed=7, loss=0.3, jitter_ms=1.0), shaper(seed=7, loss=0.3, jitter_ms=1.0)
    assert [a.schedule(k, 100) for k in range(500)] == [b.schedule(k, 100) for k in range(500)]


@pytest.mark.parametrize("rate_mbit", [1.0, 20.0, 100.0, 1000.0])
def test_rate_release_times_imply_the_rate(rate_mbit: float) -> None:
    s = shaper(delay_ms=3.0, rate_mbit=rate_mbit)
    size = 1500
    # Offer twice the rate, spread out so that the queue never overflows.
    gap = size * 8 / (rate_mbit * 1e6) / 2
    releases = []
    for k in range(20):
        release = s.schedule(k * gap, size)
        assert release is not None
        releases.append(release)
    spacing = [b - a for a, b in itertools.pairwise(releases)]
    assert spacing == pytest.approx([size * 8 / (rate_mbit * 1e6)] * len(spacing), rel=1e-9)
    # The first packet pays its own serialisation plus the delay.
    assert releases[0] == pytest.approx(size * 8 / (rate_mbit * 1e6) + 0.003, rel=1e-9)


def test_rate_below_capacity_adds_only_serialisation() -> None:
    s = shaper(rate_mbit=100.0)
    for k in range(100):
        now = k * 0.001  # 12 Mbit/s offered
        assert s.schedule(now, 1500) == pytest.approx(now + 1500 * 8 / 100e6)
    assert s.drop_queue == 0


def test_queue_limit_tail_drops() -> None:
    s = shaper(rate_mbit=20.0)
    limit = s.queue_limit_bytes
    assert limit == pytest.approx(20e6 / 8 * 0.050)  # 50 ms of 20 Mbit/s > 64 KB
    assert shaper(rate_mbit=1.0).queue_limit_bytes == 64 * 1024  # the floor
    assert shaper().queue_limit_bytes == math.inf
    # A burst at one instant: exactly floor(limit / size) packets fit.
    results = [s.schedule(0.0, 1000) for _ in range(1000)]
    accepted = sum(r is not None for r in results)
    assert accepted == int(limit // 1000)
    assert s.drop_queue == 1000 - accepted
    assert all(r is None for r in results[accepted:])
    # Once the queue has drained, packets are accepted again.
    later = limit * 8 / 20e6 + 0.001
    assert s.schedule(later, 1000) is not None


def test_long_run_throughput_matches_rate_under_overload() -> None:
    s = shaper(rate_mbit=50.0)
    size, delivered_bytes, last = 1200, 0, 0.0
    for k in range(200_000):
        now = k * 1e-5  # 960 Mbit/s offered: mostly dropped
        release = s.schedule(now, size)
        if release is not None:
            delivered_bytes += size
            last = release
    assert delivered_bytes * 8 / last / 1e6 == pytest.approx(50.0, rel=0.01)


def test_parameter_changes_apply_to_the_next_packet() -> None:
    s = shaper(delay_ms=40.0)
    assert s.schedule(0.0, 100) == pytest.approx(0.040)
    s.set_params(PairParams(delay_ms=5.0))
    # The new, shorter delay applies at once (the FIFO clamp is cleared by a new delay).
    assert s.schedule(0.001, 100) == pytest.approx(0.006)
    s.set_params(PairParams(delay_ms=5.0, loss=1.0))
    assert s.schedule(0.002, 100) is None
    s.set_params(PairParams(delay_ms=5.0, rate_mbit=8.0))
    assert s.schedule(0.003, 1000) == pytest.approx(0.003 + 0.001 + 0.005)
    s.set_params(PairParams(delay_ms=5.0))
    assert s.schedule(0.004, 1000) == pytest.approx(0.009)


def test_rate_change_keeps_queued_backlog() -> None:
    s = shaper(rate_mbit=8.0)  # 1 ms per 1000 bytes
    for _ in range(10):
        assert s.schedule(0.0, 1000) is not None
    assert s.last_departure == pytest.approx(0.010)
    s.set_params(PairParams(rate_mbit=80.0))
    # The new packet waits for the ten queued ones, then takes 0.1 ms.
    assert s.schedule(0.0, 1000) == pytest.approx(0.0101)


@pytest.mark.parametrize(
    "bad",
    [
        {"delay_ms": -1.0},
        {"delay_ms": math.nan},
        {"jitter_ms": math.inf},
        {"loss": 1.5},
        {"loss": -0.1},
        {"rate_mbit": 0.0},
        {"rate_mbit": math.nan},
    ],
)
def test_bad_params_are_rejected(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        PairParams(**bad)


def test_counters() -> None:
    s = shaper(loss=1.0)
    s.schedule(0.0, 10)
    assert s.counters() == {
        "packets": 0,
        "bytes": 0,
        "drop_loss": 1,
        "drop_queue": 0,
        "drop_down": 0,
        "drop_error": 0,
    }
