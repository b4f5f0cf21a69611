"""The tunnel calibration's arithmetic (the lab test drives it through real tunnels)."""

from __future__ import annotations

from typing import Any

import pytest

from meshopt.lab.calibrate import MAX_LATENCY_US, ROUNDS, SETTLED_MS, fit, next_latency_us


def test_a_path_reading_high_gets_more_taken_off() -> None:
    # 10.6 ms at 5 ms one way: 0.3 ms a direction more than the 250 µs allowance
    assert next_latency_us(0.6, 250.0) == pytest.approx(550.0)


def test_a_path_reading_low_gets_less_taken_off() -> None:
    assert next_latency_us(-0.2, 250.0) == pytest.approx(150.0)
    assert next_latency_us(0.0, 250.0) == pytest.approx(250.0)


def test_the_allowance_stays_within_its_bounds() -> None:
    assert next_latency_us(-1.0, 250.0) == 0.0
    assert next_latency_us(20.0, 250.0) == MAX_LATENCY_US


def _machine(true_us: float, *, stall_round: int | None, noise_ms: float) -> Any:
    """A tunnel that adds ``true_us`` a hop, rounds reading ±``noise_ms`` alternately (a
    median of 30 pings moves that much here), and one round (1-based) 0.75 ms high, as
    a round did in CI when wireguard-go hiccuped during its 150 ms."""
    seen: list[float] = []

    def measure(allowance_us: float) -> float | None:
        seen.append(allowance_us)
        residual = (true_us - allowance_us) * 2.0 / 1000.0
        residual += noise_ms if len(seen) % 2 else -noise_ms
        return residual + (0.75 if len(seen) == stall_round else 0.0)

    return measure, seen


@pytest.mark.parametrize("stall_round", [None, 1, 2, 3, 4, 5, 6])
def test_one_stalled_round_does_not_set_the_allowance(stall_round: int | None) -> None:
    measure, seen = _machine(180.0, stall_round=stall_round, noise_ms=0.0)
    got = fit(measure, 250.0)
    assert got is not None
    # A quiet machine: what is left in force read true in the last round.
    assert got.latency_us == pytest.approx(180.0, abs=1.0)
    assert seen[-1] == got.latency_us and abs(got.residual_ms) <= SETTLED_MS
    assert [us for us, _ in got.history] == pytest.approx(seen, abs=0.05)


@pytest.mark.parametrize("stall_round", [None, 1, 2, 3, 4, 5, 6])
def test_a_noisy_machine_with_a_stalled_round_ends_near_the_truth(
    stall_round: int | None,
) -> None:
    """Rounds that never settle end on the median estimate: never the stalled round's
    375 µs alone, even when it is the last. One more round checks it, so the residual
    reported is what the allowance left in force reads."""
    measure, seen = _machine(180.0, stall_round=stall_round, noise_ms=0.1)
    got = fit(measure, 400.0)
    assert got is not None
    assert got.latency_us == pytest.approx(180.0, abs=60.0)  # noise: 50 µs a hop
    assert got.rounds == len(seen) == len(got.history)
    assert seen[-1] == got.latency_us == got.history[-1][0]
    assert got.residual_ms == got.history[-1][1]


def test_a_fit_that_never_settles_checks_the_allowance_it_leaves() -> None:
    """Every round reads 0.3 ms high (a machine getting slower as it goes): after ROUNDS
    estimates, one more round runs under the allowance left in force and its residual is
    the one reported, not a residual measured under an allowance since replaced."""
    seen: list[float] = []

    def measure(allowance_us: float) -> float:
        seen.append(allowance_us)
        return 0.3

    got = fit(measure, 250.0)
    assert got is not None
    assert got.rounds == ROUNDS + 1 == len(seen) == len(got.history)
    assert seen[-1] == got.latency_us == got.history[-1][0] != seen[-2]
    assert got.residual_ms == 0.3


def test_lost_pings_end_the_fit() -> None:
    assert fit(lambda us: None, 250.0) is None
